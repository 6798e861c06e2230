"""The command-line benchmarks (01-torch-compile/compile_benchmark.py and
02-mixed-precision/amp_training.py) at smoke size on a CPU: their tables, ledgers and exit
codes, a correctness check that must fail, bad options, and the claims table the report
renders from ledgers.

Each script runs in a real process (as on a cluster node): a smoke run, and a run of a model
that is broken on purpose (tests/fixtures/bench_models.py). Bad options are checked in-process
(no torch work happens before they are refused) and once per script in a process, for the
exit status and the absence of a traceback.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from utils import cli, ladder
from utils.course import claims
from utils.ledger import MET, NOT_MET, Ledger
from utils.course.report import markdown_report, scan_results

COMPILE = REPO / "01-torch-compile" / "compile_benchmark.py"
AMP = REPO / "02-mixed-precision" / "amp_training.py"
FIXTURES = "tests/fixtures/bench_models.py"


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


compile_benchmark = _load(COMPILE)
amp_training = _load(AMP)


def _run(script, *args, tmp_path, timeout=240):
    env = {**os.environ, "COURSE_RESULTS_DIR": str(tmp_path / "results")}
    env.pop("COURSE_SMOKE", None)
    return subprocess.run([sys.executable, str(script), *args, "--no-progress"],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _table(stdout: str, header: str) -> list[str]:
    """The final table's lines: from its header line to the first line that is not a row."""
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.strip() or ln.startswith(("compile s:", "check:")):
            break
        rows.append(ln)
    return rows


def _matches(ledger: Ledger, glob: str) -> list[str]:
    pat = claims._pattern(glob)
    return [name for name in ledger.measurements if pat.match(name)]


# ----------------------------------------------------------------------------- compile_benchmark

def test_compile_benchmark_smoke_table_ledger_and_report(tmp_path):
    out = tmp_path / "compile.json"
    r = _run(COMPILE, "--smoke", "--results", str(out), tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    # the environment printout comes first, the table last
    assert r.stdout.lstrip().startswith("device"), r.stdout[:300]
    rows = _table(r.stdout, "model")
    assert [row.split()[:3] for row in rows] == [["tinygpt", "train", "default"],
                                                 ["tinygpt", "infer", "default"]], rows
    assert all(row.rstrip().endswith("ok") for row in rows), rows
    led = Ledger.load(out)
    assert led.notebook == compile_benchmark.NOTEBOOK and led.smoke
    for task in ("train", "infer"):
        key = f"tinygpt {task}, default"
        assert led.measurements[f"speedup[{key}]"].unit == "x"
        assert led.measurements[f"speedup[{key}]"].value > 0
        assert led.measurements[f"compile_s[{key}]"].value > 0
        assert led.measurements[f"graphs[{key}]"].value == 1   # model and loss in one graph
        assert led.expectations[f"check_excess[{key}]"].status == MET
    # the claims registry's patterns find this script's measurements
    assert _matches(led, "speedup[tinygpt *]") and _matches(led, "speedup[*]")
    # the report reads it; a smoke run on a CPU tests no claim
    ledgers, skipped = scan_results([out])
    text = markdown_report(ledgers)
    assert "## 01-torch-compile/compile_benchmark" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| torch.compile: 1.5-2.5x"))
    assert row.endswith("| not yet measured on a GPU |"), row


def test_compile_benchmark_fails_a_model_that_breaks_when_compiled(tmp_path):
    out = tmp_path / "broken.json"
    r = _run(COMPILE, "--model", f"{FIXTURES}:breaks_when_compiled", "--tasks", "infer",
             "--results", str(out), tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    rows = _table(r.stdout, "model")
    assert len(rows) == 1 and "FAILED CHECK" in rows[0] and "breaks_when_compiled" in rows[0]
    assert "FAILED its correctness check" in r.stdout
    led = Ledger.load(out)
    exp = led.expectations["check_excess[breaks_when_compiled infer, default]"]
    assert exp.status == NOT_MET and exp.value > 10   # a 10% error, far outside fp32's tolerance
    assert not _matches(led, "speedup[*]")             # a failed version is never timed


# ----------------------------------------------------------------------------- amp_training

def test_amp_training_smoke_table_ledger_and_report(tmp_path):
    out = tmp_path / "amp.json"
    r = _run(AMP, "--smoke", "--results", str(out), tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert r.stdout.lstrip().startswith("device"), r.stdout[:300]
    rows = _table(r.stdout, "model")
    trained = [row for row in rows if row.startswith("tinygpt")]
    assert len(trained) == 2 and "fp32" in trained[0] and "bf16 autocast" in trained[1], rows
    assert "trains like fp32" in trained[1], rows
    # what a CPU does not run is listed, with the reason
    assert any("fp16 autocast + GradScaler" in row and "not run here" in row for row in rows)
    led = Ledger.load(out)
    assert led.notebook == amp_training.NOTEBOOK and led.smoke
    assert led.measurements["step_speedup[tinygpt, bf16]"].unit == "x"
    assert 0 < led.measurements["peak_ratio[tinygpt, bf16]"].value < 1  # bf16 activations
    assert led.expectations["check_excess[tinygpt, bf16]"].status == MET
    gap = led.expectations["loss_gap[tinygpt, bf16]"]
    assert gap.status == MET, gap   # applies: fp32 learned enough at smoke size
    assert led.measurements["fp32_drop_share[tinygpt]"].value >= amp_training.MIN_LEARNED
    assert _matches(led, "step_speedup[*, bf16]") and _matches(led, "peak_ratio[*, bf16]")
    assert not _matches(led, "step_speedup[*, fp16]")
    text = markdown_report(scan_results([out])[0])
    assert "## 02-mixed-precision/amp_training" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| AMP: "))
    assert row.endswith("| not yet measured on a GPU |"), row


def test_amp_training_fails_a_model_that_breaks_under_autocast(tmp_path):
    out = tmp_path / "broken.json"
    r = _run(AMP, "--model", f"{FIXTURES}:breaks_under_autocast", "--steps", "10",
             "--results", str(out), tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    rows = _table(r.stdout, "model")
    bad = [row for row in rows if "bf16 autocast" in row]
    assert len(bad) == 1 and "FAILED CHECK" in bad[0], rows
    led = Ledger.load(out)
    assert led.expectations["check_excess[breaks_under_autocast, bf16]"].status == NOT_MET
    assert "step_speedup[breaks_under_autocast, bf16]" not in led.measurements  # not timed


# ----------------------------------------------------------------------------- bad options

@pytest.mark.parametrize("script, args, message", [
    ("compile", ["--modes", "reduce-overhead"], "need a CUDA GPU"),
    ("compile", ["--modes", "default,nope"], "unknown 'nope'"),
    ("compile", ["--models", "resnet"], "unknown 'resnet'"),
    ("compile", ["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "tpu"],
     "--device"),
    ("compile", ["--amp", "fp16", "--device", "cpu"], "CUDA GPUs only"),
    ("compile", ["--model", "no_such_module_here:build"], "importing 'no_such_module_here'"),
    ("compile", ["--model", f"{FIXTURES}:not_a_triple"], "(model, inputs, targets)"),
    ("compile", ["--min-run-time", "0"], "positive"),
    ("amp", ["--modes", "fp16", "--device", "cpu"], "CUDA GPUs only"),
    ("amp", ["--modes", "tf32", "--device", "cpu"], "TF32 exists on NVIDIA GPUs"),
    ("amp", ["--modes", "bf16,bf16"], "names one twice"),
    ("amp", ["--steps", "3"], "at least 6"),
    ("amp", ["--model", f"{FIXTURES}:inference_only"], "gave no targets"),
])
def test_a_bad_option_is_one_line_and_exit_2(script, args, message, capsys):
    module = compile_benchmark if script == "compile" else amp_training
    cwd = os.getcwd()
    os.chdir(REPO)   # --model paths are relative to where the script runs
    try:
        assert module.main(args + ["--results", "none"]) == 2
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert err.count("\n") == 1, err   # one line


@pytest.mark.parametrize("script", [COMPILE, AMP])
def test_a_bad_option_in_a_real_process(script, tmp_path):
    r = _run(script, "--modes", "no-such-mode", tmp_path=tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no-such-mode" in r.stderr
    assert r.stdout == ""   # refused before the environment printout and any work


@pytest.mark.parametrize("module", ["compile", "amp"])
def test_argparse_refuses_contradictory_sizes(module, capsys):
    module = compile_benchmark if module == "compile" else amp_training
    with pytest.raises(SystemExit) as exc:
        module.main(["--smoke", "--full"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_help_explains_the_choices():
    for module, words in ((compile_benchmark, ["reduce-overhead", "--models", "--model",
                                               "Exit status", "--smoke"]),
                          (amp_training, ["pure-bf16", "GradScaler", "unscale", "--steps",
                                          "Exit status"])):
        text = module.build_parser().format_help()
        for w in words:
            assert w in text, (module.__name__, w)


# ----------------------------------------------------------------------------- the trainer's clip

def test_trainer_clips_the_unscaled_gradients_with_a_grad_scaler():
    """fp16 + GradScaler: the clip must see the true gradients, not scale x them (scale 2^16
    at the start): the norm AdamW receives is min(true norm, max_norm)."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(4, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))

    def norm_seen(cfg, max_norm):
        t = ladder.Trainer(__import__("copy").deepcopy(model), cfg, device="cpu", lr=1e-3,
                           max_grad_norm=max_norm)
        seen = []
        t.optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(
            torch.cat([p.grad.flatten() for p in t.model.parameters()]).norm().item()))
        t.step(x, y)
        return seen[0]

    true = norm_seen(ladder.TrainConfig(), None)
    limit = true / 2
    assert norm_seen(ladder.TrainConfig(), limit) == pytest.approx(limit, rel=1e-4)
    # fp16 autocast on a CPU: a few rounding errors in the gradient, never a factor of 2^16
    clipped = norm_seen(ladder.TrainConfig(amp="fp16"), limit)
    assert clipped == pytest.approx(limit, rel=1e-3)
    unclipped = norm_seen(ladder.TrainConfig(amp="fp16"), None)
    assert unclipped == pytest.approx(true, rel=2e-2)
    with pytest.raises(ValueError, match="max_grad_norm"):
        ladder.Trainer(model, ladder.TrainConfig(), device="cpu", max_grad_norm=0)


# ----------------------------------------------------------------------------- the claims table

def _gpu_ledger(notebook, values, *, device="NVIDIA H100 80GB HBM3", smoke=False, shared=1,
                created="2026-12-01T10:00:00+00:00"):
    env = {"device": "cuda:0", "device_name": device, "torch_version": "2.11.0+cu130",
           "compute_capability": [9, 0]}
    led = Ledger(notebook, smoke=smoke, env=env, strict=False)
    led.created, led.commit, led.shared_jobs = created, "abc123", shared
    for name, v in values.items():
        led.record(name, v, "x", note=f"note of {name}")
    return led


def _row(ledgers, start):
    return next(r for r in claims.claims_table(ledgers) if r.startswith(f"| {start}"))


def test_claims_table_judges_gpu_measurements_and_says_what_is_missing():
    cb = _gpu_ledger(claims.COMPILE_SCRIPT, {"speedup[tinygpt train, default]": 1.6,
                                             "speedup[tinygpt infer, default]": 1.1,
                                             "speedup[lstm train, default]": 0.9})
    amp = _gpu_ledger(claims.AMP_SCRIPT, {"step_speedup[tinygpt, bf16]": 2.4,
                                          "peak_ratio[tinygpt, bf16]": 0.7})
    ledgers = [cb, amp]
    row = _row(ledgers, "torch.compile: 1.5-2.5x on transformers")
    assert "holds only for [1] 1.60x; not for [2] 1.10x" in row, row
    assert "compile_benchmark (torch 2.11.0+cu130, 2026-12-01, full size, commit abc123)" in row
    assert "does not hold ([1] 0.90x)" in _row(ledgers, "torch.compile: 1.2-1.5x on RNN")
    assert "not yet measured on a GPU" in _row(ledgers, "torch.compile: 1.3-2x on CNNs")
    amp_row = _row(ledgers, "AMP: ")
    assert "speed (2-3x): holds ([1] 2.40x)" in amp_row, amp_row
    assert "memory (<= 0.5x): does not hold ([2] 0.70x)" in amp_row, amp_row
    assert "bf16 (2-3x): holds" in _row(ledgers, "fp16 and bf16: 2-3x faster on A100 and H100")
    assert _row(ledgers, "fp16 2x and bf16").endswith("| not yet measured on an RTX 3090 |")
    # smoke runs, CPU runs and runs that shared the machine stand for nothing
    cpu = _gpu_ledger(claims.COMPILE_SCRIPT, {"speedup[lstm train, default]": 3.0})
    cpu.env = {**cpu.env, "device": "cpu", "device_name": "AMD EPYC"}
    smoke = _gpu_ledger(claims.COMPILE_SCRIPT, {"speedup[lstm train, default]": 3.0}, smoke=True)
    shared = _gpu_ledger(claims.COMPILE_SCRIPT, {"speedup[lstm train, default]": 3.0}, shared=8)
    for led in (cpu, smoke, shared):
        assert "not yet measured on a GPU" in _row([led], "torch.compile: 1.2-1.5x on RNN")
    # the latest run per notebook and GPU counts
    newer = _gpu_ledger(claims.COMPILE_SCRIPT, {"speedup[lstm train, default]": 1.3},
                        created="2026-12-02T10:00:00+00:00")
    assert "holds ([1] 1.30x)" in _row([cb, newer], "torch.compile: 1.2-1.5x on RNN")
    # a ladder's rungs: the technique's own gain is the rung before over its rung
    lad = _gpu_ledger("06-capstone/01_speedup_ladder", {"bigger_micro_batch_ms_per_step": 30.0,
                                                        "torch_compile_ms_per_step": 20.0})
    assert "holds ([1] 1.50x)" in _row([lad], "torch.compile: 1.5-2.5x on transformers")


def test_every_claim_of_the_issue_has_a_row_and_every_source_exists():
    rows = claims.claims_table([])
    assert len(rows) == 2 + len(claims.CLAIMS) == 2 + 13
    assert all(r.endswith("| not yet measured on a GPU |") or "not yet measured on an" in r
               for r in rows[2:])
    for claim in claims.CLAIMS:
        assert claim.source == "the track's performance guidelines"
        for test in claim.tests:
            for ev in test.evidence:
                assert ((REPO / f"{ev.notebook}.ipynb").is_file()
                        or (REPO / f"{ev.notebook}.py").is_file()), ev.notebook


def test_the_ladder_keys_in_the_registry_are_rungs_the_capstone_records():
    """06-capstone/01_speedup_ladder records f"{rung_key(rung.name)}_ms_per_step" (and
    _speedup_vs_fp32) for every rung of utils.ladder.default_ladder(amp), through
    utils.ladder.record_rungs."""
    recorded = {f"{ladder.rung_key(r.name)}_{what}" for amp in ("bf16", "fp16")
                for r in ladder.default_ladder(amp) for what in ("ms_per_step", "speedup_vs_fp32")}
    used = {k for c in claims.CLAIMS for t in c.tests for ev in t.evidence
            if ev.notebook == "06-capstone/01_speedup_ladder"
            for k in (ev.key, ev.ratio_of) if k and not k.startswith("cnn_")}
    assert used and used <= recorded, used - recorded


def test_the_recorded_h100_run_feeds_the_claims():
    """results/2026-11-26-h100 holds 02/04's and 03/02's full-size ledgers: the AMP, flash
    attention and channels_last rows read them (by the names those notebooks record)."""
    ledgers, _ = scan_results([REPO / "results" / "2026-11-26-h100"])
    assert "2.29x" in _row(ledgers, "AMP (fp16): 1.5-3x")   # SmallCNN's fp16 step speedup
    assert "NVIDIA H100 80GB HBM3" in _row(ledgers, "flash attention")
    assert "NVIDIA H100 80GB HBM3" in _row(ledgers, "channels_last")


# ----------------------------------------------------------------------------- utils.cli

def test_workloads_are_deterministic_and_learnable_data():
    sizes = dict(vocab=64, seq=8, layers=1, width=16, hidden=16, batch=2, lr=1e-3)
    a = cli.build_workload("lstm", sizes, n_batches=3, seed=1)
    b = cli.build_workload("lstm", sizes, n_batches=3, seed=1)
    assert len(a.batches) == 3 and a.family == "rnn" and a.num_classes == 64
    for (xa, ya), (xb, yb) in zip(a.batches, b.batches):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])       # next-token targets
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    x, _ = a.batch(4, torch.device("cpu"))
    assert torch.equal(x, a.batches[1][0])               # batches cycle
    img = cli.build_workload("smallcnn", dict(width=4, image=8, batch=2, lr=1e-3))
    x, y = img.batch(0, torch.device("cpu"), torch.bfloat16)
    assert x.dtype == torch.bfloat16 and y.dtype == torch.long
    with pytest.raises(cli.UsageError, match="built-in models"):
        cli.build_workload("resnet50", {})
    assert math.isclose(a.extra["uniform_nats"], math.log(64))


def test_size_and_list_choices():
    cpu = torch.device("cpu")
    assert cli.resolve_size(False, False, cpu) is True
    assert cli.resolve_size(False, True, cpu) is False
    assert cli.size_tier(False, cpu) == "cpu" and cli.size_tier(True, cpu) == "smoke"
    assert cli.split_list("a, b", ["a", "b", "c"], "x") == ["a", "b"]
    assert cli.split_list("all", ["a", "b"], "x") == ["a", "b"]
    assert cli.split_list(None, ["a"], "x") is None
    with pytest.raises(cli.UsageError, match="empty"):
        cli.split_list(",", ["a"], "x")
    assert cli.unique_name("m", {"m": 1, "m#2": 2}) == "m#3"
    table = cli.text_table(["a", "bb"], [["x", 1.5], ["yyy", 10]], right=[1])
    assert table.splitlines()[2] == "x    1.5" and table.splitlines()[3] == "yyy   10"


def test_the_results_page_carries_the_claims_table_as_rendered():
    """results/RESULTS.md is rendered by `python -m utils report results --out
    results/RESULTS.md --figures results/figures`: every claim has its row there, with the
    verdict the registry gives the recorded ledgers today (render the page again after
    changing utils/course/claims.py or recording a run)."""
    page = (REPO / "results" / "RESULTS.md").read_text().splitlines()
    ledgers, _ = scan_results([REPO / "results"])
    for row in claims.claims_table(ledgers)[2:]:
        claim_cell = row.split(" | ")[0] + " |"
        verdict_cell = row.rsplit(" | ", 1)[1]
        on_page = [ln for ln in page if ln.startswith(claim_cell)]
        assert len(on_page) == 1, claim_cell
        assert on_page[0].endswith(" | " + verdict_cell), (on_page[0], verdict_cell)


def test_the_autocast_speed_claims_read_the_keys_02_autocast_records():
    """02/02 records its step speedups as `step_speedup_<variant label as a key>` (a
    SpeedupTable through Ledger.record); the registry must ask for those very keys, or the
    notebook's evidence never reaches the results page (the fp16 variant is labelled with its
    GradScaler)."""
    import json
    import re

    from utils.timing import _key

    nb = json.loads((REPO / f"{claims._NB_AUTOCAST}.ipynb").read_text(encoding="utf-8"))
    src = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    labels = re.findall(r'step_variants\["([^"]+)"\]', src)
    assert len(labels) >= 2, labels
    recorded = {f"step_speedup_{_key(label)}" for label in labels}
    for dtype in ("bf16", "fp16"):
        asked = [e.key for e in claims._amp_speed(dtype) if e.notebook == claims._NB_AUTOCAST]
        assert asked and set(asked) <= recorded, (dtype, asked, sorted(recorded))
