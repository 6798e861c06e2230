"""The fresh-process scripts of 04-memory-efficiency: alloc_probe.py and ckpt_probe.py."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from utils.checkpoint import CheckpointError, safe_load, stale_temporaries

MODULE = REPO / "04-memory-efficiency"
SMALL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--vocab-size", "512",
         "--block-size", "32"]


def _run(script, *args, env=None, timeout=300):
    r = subprocess.run([sys.executable, str(MODULE / script), *args], capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA answer")
def test_alloc_probe_without_cuda_says_so(tmp_path):
    import os

    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    out = tmp_path / "r.json"
    reply = json.loads(_run("alloc_probe.py", "--experiment", "holes", "--out", str(out),
                            env=env).strip().splitlines()[-1])
    assert reply["cuda"] is False and "CUDA" in reply["reason"]
    assert reply["env"] == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert json.loads(out.read_text()) == reply


def test_alloc_probe_rejects_bad_arguments():
    r = subprocess.run([sys.executable, str(MODULE / "alloc_probe.py"), "--experiment", "holes",
                        "--blocks", "0"], capture_output=True, text=True)
    assert r.returncode != 0 and "--blocks must be >= 1" in r.stderr


def test_ckpt_probe_plain_meta_and_mmap_load_the_same_model(tmp_path):
    import utils
    from utils.checkpoint import atomic_save

    path = tmp_path / "m.pt"
    cfg = utils.GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)
    atomic_save(utils.TinyGPT(cfg).state_dict(), path)  # what `ckpt_probe.py make` writes
    res = {mode: json.loads(_run("ckpt_probe.py", "load", "--path", str(path), "--mode", mode,
                                 *SMALL).strip().splitlines()[-1])
           for mode in ("plain", "meta", "mmap")}
    assert len({r["checksum"] for r in res.values()}) == 1
    assert all(r["tied"] for r in res.values())
    assert len({r["n_parameters"] for r in res.values()}) == 1
    assert all(r["peak_above_start_bytes"] >= 0 and r["file_bytes"] > 0 for r in res.values())
    assert all(min(r["load_s"], r["first_output_s"], r["checksum_s"]) >= 0 for r in res.values())
    assert not list(tmp_path.glob("*.warmup.pt"))
    for r in res.values():  # RssAnon/RssFile at four moments on Linux, None elsewhere
        if sys.platform.startswith("linux"):
            assert set(r["rss"]) == {"before", "loaded", "first_output", "end"}
            assert all(set(v) == {"anon", "file", "shmem"} and min(v.values()) >= 0
                       for v in r["rss"].values())
        else:
            assert r["rss"] is None


def test_ckpt_probe_rejects_an_unknown_load_mode(tmp_path):
    r = subprocess.run([sys.executable, str(MODULE / "ckpt_probe.py"), "load", "--path",
                        str(tmp_path / "m.pt"), "--mode", "lazy"], capture_output=True, text=True)
    assert r.returncode != 0 and "invalid choice: 'lazy'" in r.stderr


def test_ckpt_probe_killed_mid_write(tmp_path):
    """The notebook's demonstration, small: a plain save killed mid-write leaves a broken file,
    an atomic one leaves the previous checkpoint."""
    import time

    from utils.checkpoint import atomic_save

    for atomic in (False, True):
        path = tmp_path / f"{'atomic' if atomic else 'plain'}.pt"
        atomic_save({"step": 1, "model": {"w": torch.zeros(4)}}, path)  # the previous save
        cmd = [sys.executable, str(MODULE / "ckpt_probe.py"), "write", "--path", str(path),
               "--mib", "2", "--step", "2", "--throttle-mib-s", "1"] + (["--atomic"] * atomic)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().startswith("saving step 2")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                tmp = stale_temporaries(path)
                target = tmp[0] if atomic and tmp else (None if atomic else path)
                if target is not None and target.exists() and target.stat().st_size > 256 * 1024:
                    break
                time.sleep(0.02)
        finally:
            proc.kill()
            proc.wait()
        if atomic:
            assert safe_load(path)["step"] == 1 and stale_temporaries(path)
        else:
            with pytest.raises(CheckpointError, match="not a complete torch checkpoint"):
                safe_load(path)
