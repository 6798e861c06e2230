"""utils.checkpoint: atomic saves, safe loads and clear errors for bad files."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from utils.checkpoint import CheckpointError, atomic_save, safe_load


def _state():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7}


def test_round_trip_and_no_temporary_left(tmp_path):
    state = _state()
    path = atomic_save(state, tmp_path / "sub" / "ckpt.pt")
    back = safe_load(path)
    assert back["step"] == 7
    torch.testing.assert_close(back["model"]["weight"], state["model"]["weight"])
    assert back["optimizer"]["state"][0]["step"] == state["optimizer"]["state"][0]["step"]
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]


def test_mmap_load(tmp_path):
    path = atomic_save({"w": torch.arange(10.0)}, tmp_path / "w.pt")
    torch.testing.assert_close(safe_load(path, mmap=True)["w"], torch.arange(10.0))


def test_a_killed_save_leaves_the_old_checkpoint(tmp_path):
    """A process killed in the middle of atomic_save: the previous file is intact."""
    path = tmp_path / "ckpt.pt"
    atomic_save({"step": 1, "w": torch.zeros(4)}, path)
    script = f"""
import os, torch
import utils.checkpoint as c
real_save = torch.save
def dying_save(obj, f, *a, **k):
    f.write(b"PK\\x03\\x04 half a zip")  # some bytes, then the process dies
    f.flush()
    os._exit(9)
c.torch.save = dying_save
c.atomic_save({{"step": 2, "w": torch.ones(4)}}, {str(path)!r})
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    back = safe_load(path)
    assert back["step"] == 1 and back["w"].sum() == 0
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert leftovers and all(n.startswith(".ckpt.pt.") for n in leftovers)  # only the temporary


def test_truncated_file_is_a_clear_error(tmp_path):
    path = atomic_save(_state(), tmp_path / "ckpt.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a complete torch checkpoint"):
        safe_load(path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="is empty"):
        safe_load(path)


def test_foreign_file_is_a_clear_error(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("these are not tensors\n")
    with pytest.raises(CheckpointError, match=str(path)):
        safe_load(path)


def test_a_pickled_module_is_refused_with_advice(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(nn.Linear(2, 2), path)  # the whole module, pickled
    with pytest.raises(CheckpointError, match="Save a state_dict"):
        safe_load(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        safe_load(tmp_path / "nope.pt")
