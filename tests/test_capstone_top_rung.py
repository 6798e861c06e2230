"""06-capstone/02_the_top_rung_up_close took notebook 01's exercises (the CNN ladder and
channels_last) with their ledger keys: the claims registry must read those keys from 02's
ledger, where the notebook records them, and 01 must no longer record them. The CNN exercise's
check holds at the CPU-full sizes too."""

from __future__ import annotations

import json
import re

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
    its check; the eager rungs at the table's CPU-full sizes, as the exercise runs them, must
    stay inside the band. (The GPU-full sizes, 64 images per micro-batch, gave 0.1-0.6% on a
    CPU; they take a minute here.)"""
    import copy

    import torch

    import utils
    from test_shared_sizes import read, size_rows
    from utils import ladder as L

    rows = size_rows(read("06-capstone/02_the_top_rung_up_close.ipynb"))
    width, batch, steps = (rows[k][1] for k in ("cnn_width", "cnn_batch", "cnn_steps"))
    torch.manual_seed(0)
    template = utils.SmallCNN(width=width)
    rungs = [r for r in L.default_ladder("bf16") if not r.language_model_only
             and "compile" not in r.changes and "fused_adamw" not in r.changes]
    assert [r.key for r in rungs] == ["fp32", "tf32", "amp", "micro-batch"]

    def batch_fn(step):
        return utils.image_batch(batch, seed=step % 4, device="cpu")  # CNN_POOL = 4

    results = L.run_ladder(lambda cfg: copy.deepcopy(template), batch_fn, steps=steps,
                           flops_per_step=1.0, ceilings={"fp32": 1.0, "tf32": 1.0, "bf16": 1.0},
                           base=L.TrainConfig(accum_steps=4), rungs=rungs, device="cpu",
                           num_classes=10, lr=1e-3, warmup_steps=3,
                           loss_window=max(3, steps // 4), min_run_time_s=0.01,
                           item_name="image", progress=False)
    base = results[0]
    worst = max(abs(r.final_loss - base.final_loss) / base.final_loss for r in results if r.ran)
    assert base.final_loss < base.first_loss
    assert worst <= 0.05, f"a CNN rung ended {worst:.2%} from fp32 eager at the CPU-full sizes"
