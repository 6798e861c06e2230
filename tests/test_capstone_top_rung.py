"""06-capstone/02_the_top_rung_up_close took notebook 01's exercises (the CNN ladder and
channels_last) with their ledger keys: the claims registry must read those keys from 02's
ledger, where the notebook records them, and 01 must no longer record them. The CNN exercise's
check holds at the CPU-full sizes too."""

from __future__ import annotations

import json
import re

import torch

from conftest import REPO
from utils.course import claims


def _code(notebook: str) -> str:
    nb = json.loads((REPO / f"{notebook}.ipynb").read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


def _asked_of(notebook: str) -> list[str]:
    return [ev.key for c in claims.CLAIMS for t in c.tests for ev in t.evidence
            if ev.notebook == notebook]


def test_the_claims_read_the_cnn_keys_where_the_top_rung_notebook_records_them():
    asked = _asked_of(claims._NB_TOP_RUNG)
    assert asked == ["cnn_channels_last_speedup"], asked
    top, ladder = _code(claims._NB_TOP_RUNG), _code(claims._NB_LADDER)
    for key in asked:
        assert re.search(r'ledger\.record\(\s*"' + re.escape(key) + '"', top), key
        assert f'"{key}"' not in ladder, f"{key} is recorded by 02 now, not by 01"
    assert not [k for k in _asked_of(claims._NB_LADDER) if k.startswith("cnn_")]


def test_the_cnn_exercise_stays_in_its_loss_band_at_cpu_full_size():
    """02's Exercise 1 check allows 5% between a CNN rung's final loss and fp32 eager's: batch
    norm's statistics change with the micro-batch. At the CPU-full sizes (CI runs only smoke)
    16-image micro-batches over 20 steps parted the losses by 5.2%, so a correct solution failed
    its check. Here the eager rungs' settings train at the table's CPU-full sizes, as the
    ladder trains them (L.Trainer, the same weights and batches, the final loss the mean of the
    exercise's loss window), and must stay inside the band. (TF32 changes nothing on a CPU and
    is left out; the GPU-full sizes, 64 images per micro-batch, gave 0.1-0.6% on a CPU.)"""
    import copy
    import dataclasses

    import utils
    from test_shared_sizes import read, size_rows
    from utils import ladder as L

    rows = size_rows(read("06-capstone/02_the_top_rung_up_close.ipynb"))
    width, batch, steps = (rows[k][1] for k in ("cnn_width", "cnn_batch", "cnn_steps"))
    window = max(3, steps // 4)
    torch.manual_seed(0)
    template = utils.SmallCNN(width=width)

    def losses(cfg):
        trainer = L.Trainer(copy.deepcopy(template), cfg, device="cpu", num_classes=10, lr=1e-3,
                            warmup_steps=3)
        return [trainer.step(*utils.image_batch(batch, seed=i % 4, device="cpu")).item()
                for i in range(steps)]  # CNN_POOL = 4

    base = L.TrainConfig(accum_steps=4)
    amp = dataclasses.replace(base, amp="bf16")
    configs = {"fp32 eager": base, "bf16 autocast": amp,
               "bigger micro-batch": dataclasses.replace(amp, accum_steps=1)}
    with utils.torch_threads(1):  # CI runs two test workers on two cores
        final = {name: sum(losses(cfg)[-window:]) / window for name, cfg in configs.items()}
    ref = final["fp32 eager"]
    worst = {name: abs(v - ref) / ref for name, v in final.items()}
    assert max(worst.values()) <= 0.05, f"at the CPU-full sizes: {worst}"
