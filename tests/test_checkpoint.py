"""utils.checkpoint: atomic saves, safe loads and clear errors for bad files."""

import os
import stat
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
    with pytest.raises(CheckpointError, match="Save a state_dict") as info:
        safe_load(path)
    assert "torch.nn.modules.linear.Linear" in str(info.value)  # names what it refused
    assert "\x1b[" not in str(info.value)  # no terminal colour codes


def test_a_text_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("not a checkpoint\n")
    with pytest.raises(CheckpointError, match="is not a torch checkpoint: it starts with"):
        safe_load(path)


def test_a_legacy_pickle_checkpoint_still_loads(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.arange(3.0)}, path, _use_new_zipfile_serialization=False)
    torch.testing.assert_close(safe_load(path)["w"], torch.arange(3.0))
    with pytest.raises(CheckpointError, match="legacy"):
        safe_load(path, mmap=True)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        safe_load(tmp_path / "nope.pt")


# -- training state: everything a resumed run needs, in one atomic file ---------------------

from utils.checkpoint import (  # noqa: E402
    TrainingState,
    load_training_state,
    remove_stale_temporaries,
    save_training_state,
    stale_temporaries,
)


def _run(steps, model=None, opt=None, scaler=None, start=0):
    torch.manual_seed(1000 + start)
    model = model or nn.Linear(8, 4)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(start, steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean() + 0.01 * torch.randn(()).abs()  # uses the global RNG
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model, opt


def test_resume_equals_an_uninterrupted_run(tmp_path):
    torch.manual_seed(0)
    ref, _ = _run(6, model=nn.Linear(8, 4))
    torch.manual_seed(0)
    model, opt = _run(3, model=nn.Linear(8, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    save_training_state(tmp_path / "s.pt", model=model, optimizer=opt, scaler=scaler, step=3,
                        extra={"epoch": 1, "note": "half way"})
    torch.manual_seed(123)  # the resumed process starts with other weights and another RNG state
    model2 = nn.Linear(8, 4)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    scaler2 = torch.amp.GradScaler("cpu")
    st = load_training_state(tmp_path / "s.pt", model=model2, optimizer=opt2, scaler=scaler2)
    assert isinstance(st, TrainingState) and st.step == 3 and st.extra["epoch"] == 1
    assert st.restored == ("model", "optimizer", "scaler", "rng")
    assert scaler2.get_scale() == 1024.0
    resumed, _ = _run(6, model=model2, opt=opt2, start=st.step)
    for a, b in zip(resumed.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_resume_without_optimizer_state_differs(tmp_path):
    """The negative control: the model alone is not enough to resume AdamW."""
    torch.manual_seed(0)
    ref, _ = _run(6, model=nn.Linear(8, 4))
    torch.manual_seed(0)
    model, opt = _run(3, model=nn.Linear(8, 4))
    save_training_state(tmp_path / "s.pt", model=model, step=3)
    model2 = nn.Linear(8, 4)
    st = load_training_state(tmp_path / "s.pt", model=model2)
    resumed, _ = _run(6, model=model2, start=st.step)
    assert not all(torch.equal(a, b) for a, b in zip(resumed.parameters(), ref.parameters()))


def test_a_missing_part_is_an_error_not_a_fresh_start(tmp_path):
    model = nn.Linear(2, 2)
    save_training_state(tmp_path / "s.pt", model=model, step=0)
    with pytest.raises(CheckpointError, match="no optimizer or scaler state"):
        load_training_state(tmp_path / "s.pt", model=model,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            scaler=torch.amp.GradScaler("cpu"))


def test_foreign_and_mismatched_files_are_clear_errors(tmp_path):
    atomic_save({"weight": torch.zeros(2)}, tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="not a training state"):
        load_training_state(tmp_path / "bare.pt", model=nn.Linear(2, 2))
    save_training_state(tmp_path / "s.pt", model=nn.Linear(2, 2), step=1)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_training_state(tmp_path / "s.pt", model=nn.Linear(3, 2))


def test_training_state_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="step must be"):
        save_training_state(tmp_path / "s.pt", model=nn.Linear(2, 2), step=-1)
    with pytest.raises(TypeError, match="model must be"):
        save_training_state(tmp_path / "s.pt", model={"w": torch.zeros(1)}, step=0)
    with pytest.raises(TypeError, match="extra must be a dict"):
        save_training_state(tmp_path / "s.pt", model=nn.Linear(2, 2), step=0, extra=[1])


def test_meta_model_filled_with_assign_and_mmap(tmp_path):
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    save_training_state(tmp_path / "s.pt", model=src, step=5, rng=False)
    with torch.device("meta"):
        dst = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    st = load_training_state(tmp_path / "s.pt", model=dst, assign=True, mmap=True)
    assert st.step == 5 and "rng" not in st.restored
    assert not any(p.is_meta for p in dst.parameters())
    x = torch.randn(3, 4)
    torch.testing.assert_close(dst(x), src(x))


def test_stale_temporaries_of_a_killed_save(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_save({"step": 1}, path)
    assert stale_temporaries(path) == []
    (tmp_path / ".ckpt.pt.abc123.tmp").write_bytes(b"PK half")
    (tmp_path / ".other.pt.x.tmp").write_bytes(b"not ours")
    assert [p.name for p in stale_temporaries(path)] == [".ckpt.pt.abc123.tmp"]
    assert remove_stale_temporaries(path) == len(b"PK half")
    assert stale_temporaries(path) == [] and (tmp_path / ".other.pt.x.tmp").exists()
    assert safe_load(path)["step"] == 1
    assert stale_temporaries(tmp_path / "missing" / "x.pt") == []


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
def test_atomic_save_gives_the_permissions_of_a_plain_save(tmp_path):
    """mkstemp creates 0600 files; a checkpoint must be readable as torch.save's would be."""
    old = os.umask(0o022)
    try:
        torch.save({"w": torch.zeros(2)}, tmp_path / "plain.pt")
        atomic_save({"w": torch.zeros(2)}, tmp_path / "atomic.pt")
        os.umask(0o077)  # a stricter umask is respected too
        atomic_save({"w": torch.zeros(2)}, tmp_path / "private.pt")
    finally:
        os.umask(old)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert mode["atomic.pt"] == mode["plain.pt"] == 0o644
    assert mode["private.pt"] == 0o600
    os.chmod(tmp_path / "atomic.pt", 0o640)  # an existing file keeps its permissions
    atomic_save({"w": torch.ones(2)}, tmp_path / "atomic.pt")
    assert stat.S_IMODE((tmp_path / "atomic.pt").stat().st_mode) == 0o640


def test_a_disabled_scaler_state_into_an_enabled_scaler_is_a_clear_error(tmp_path):
    model = nn.Linear(2, 2)
    save_training_state(tmp_path / "s.pt", model=model, step=1,
                        scaler=torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(CheckpointError, match="GradScaler state does not fit"):
        load_training_state(tmp_path / "s.pt", model=model,
                            scaler=torch.amp.GradScaler("cpu", enabled=True))


# -- record_loads ------------------------------------------------------------------------------

def _tied_gpt_and_file(tmp_path):
    import utils

    cfg = utils.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    path = atomic_save(utils.TinyGPT(cfg).state_dict(), tmp_path / "gpt.pt")
    return utils.TinyGPT, cfg, path


def test_record_loads_tells_one_copy_from_two(tmp_path):
    from utils.checkpoint import record_loads

    gpt, cfg, path = _tied_gpt_and_file(tmp_path)
    with record_loads() as one:  # the meta device, mmap=True, assign=True
        with torch.device("meta"):
            model = gpt(cfg)
        model.load_state_dict(torch.load(path, mmap=True, weights_only=True), assign=True)
    assert one.mmap and one.assign_into_meta
    assert one.torch_load == [{"mmap": True, "weights_only": True}]
    assert one.load_state_dict == [{"strict": True, "assign": True, "into_meta": True}]
    assert not any(p.is_meta for p in model.parameters()), "the calls still ran"

    with record_loads() as two:  # the plain recipe: an initialised model, a copy into it
        gpt(cfg).load_state_dict(torch.load(path))
    assert not two.mmap and not two.assign_into_meta
    with record_loads() as copied:  # mmap=True, but copied into an allocated model
        gpt(cfg).load_state_dict(torch.load(path, mmap=True), False, True)  # positional assign
    assert copied.mmap and not copied.assign_into_meta
    assert copied.load_state_dict[0]["assign"] and not copied.load_state_dict[0]["into_meta"]
    with record_loads() as nothing:
        pass
    assert not nothing.mmap and not nothing.assign_into_meta, "no call is no evidence"


def test_record_loads_sees_torch_load_under_its_other_name_and_through_safe_load(tmp_path):
    from utils.checkpoint import record_loads

    _, _, path = _tied_gpt_and_file(tmp_path)
    with record_loads() as calls:
        torch.serialization.load(path, mmap=True)
        safe_load(path, mmap=True)
    assert len(calls.torch_load) == 2 and calls.mmap
    assert torch.load is torch.serialization.load, "both names are put back"
    assert torch.nn.Module.load_state_dict.__qualname__ == "Module.load_state_dict"
