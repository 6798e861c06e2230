"""06-capstone: the corpus and tokenizer, and train.py at smoke size on a CPU (one process and
two under torchrun with gloo)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import utils
from conftest import REPO
from utils.checkpoint import safe_load

CAPSTONE = REPO / "06-capstone"
TRAIN = CAPSTONE / "train.py"
sys.path.insert(0, str(CAPSTONE))  # train.py imports corpus.py from its own folder, as a script
import corpus  # noqa: E402
import train  # noqa: E402

# A fast run: the tiny preset, less text, eager (a fresh process would spend most of the test
# compiling; the notebook's smoke run covers the compiled rungs through utils.ladder).
SMALL = ["--preset", "tiny", "--max-chars", "300000", "--n-words", "200", "--batch-size", "8",
         "--compile", "none", "--threads", "1"]


def _train(*args: str, timeout: float = 300, env: dict | None = None):
    return subprocess.run([sys.executable, str(TRAIN), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


# ----------------------------------------------------------------------------- corpus

def test_pieces_cover_every_character():
    text = "def f(x):\n\treturn x  +  1  # é\r\n\x0b"
    assert "".join(corpus.PIECE.findall(text)) == text


def test_tokenizer_round_trips_and_has_an_ugly_size():
    text = corpus.read_torch_sources(200_000, seed=3)
    assert len(text) == 200_000 and corpus.EOF_MARK in text
    assert text == corpus.read_torch_sources(200_000, seed=3), "same install, same seed, same text"
    tok = corpus.Tokenizer.train(text, 300)
    assert tok.vocab_size == 557 and tok.eof_id == 556 and tok.vocab_size % 128
    ids = tok.encode(text)
    assert max(ids) < tok.vocab_size and ids.count(tok.eof_id) == text.count(corpus.EOF_MARK)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(tok.encode("x = torch.zeros(3)"))) == "x = torch.zeros(3)"
    assert len(ids) < len(text.encode("utf-8")), "frequent pieces make it shorter than bytes"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="fewer than n_words"):
        corpus.Tokenizer.train("a b c", 10)
    with pytest.raises(ValueError, match="unique"):
        corpus.Tokenizer(("ab", "ab"))
    with pytest.raises(ValueError, match="two or more bytes"):
        corpus.Tokenizer(("a",))


def test_corpus_batches_are_a_function_of_the_step():
    c = corpus.build_corpus(100_000, 100)
    assert c.tokens.dtype == torch.int32 and c.tokens.numel() > 10_000
    x, y = c.batch(5, 4, 32, seed=1)
    x2, y2 = c.batch(5, 4, 32, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, c.batch(6, 4, 32, seed=1)[0])
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64 and x.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="batch_size"):
        c.batch(0, 0, 32)
    with pytest.raises(ValueError, match="more than"):
        c.batch(0, 1, c.tokens.numel())
    with pytest.raises(ValueError, match="step"):
        c.batch(-1, 1, 8)


# ----------------------------------------------------------------------------- train.py

def test_help_lists_the_ladder_flags():
    r = _train("--help", timeout=120)
    assert r.returncode == 0, r.stderr
    for flag in ("--rung", "--ledger", "--amp", "--attention", "--compile", "--fused-adamw",
                 "--vocab-multiple", "--accum-steps", "--out", "torchrun", "--loss", "--fp8",
                 "--budget-s", "--profile-steps", "max-autotune-gemm", "bundle-wheels.sh torchao"):
        assert flag in " ".join(r.stdout.split()), flag  # as one line, however argparse wraps
    # max-autotune's cost is said, and why --benchmark leaves it out
    assert "max-autotune is not among the runs" in " ".join(r.stdout.split())
    assert "fp32 eager" in r.stdout and "CUDA graphs" in r.stdout
    # short keys, no shell quoting needed, each listed with its rung
    assert "sdpa = SDPA;" in r.stdout and "cuda-graphs = CUDA graphs" in r.stdout
    assert "best" in r.stdout and "top" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--accum-steps", "3", "--batch-size", "8"], "must split into 1 process(es) x --accum-steps 3"),
    (["--compile", "reduce-overhead"], "CUDA graphs"),
    (["--compile", "reduce-overhead", "--accum-steps", "2"], "169545"),
    (["--n-embd", "100", "--n-head", "3"], "divisible by --n-head"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--rung", "warp drive"], "invalid choice"),
    (["--rung", "SDPA (flash)"], "invalid choice"),
    (["--amp", "fp64"], "invalid choice"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--loss", "fused"], "invalid choice"),
    (["--compile", "max-autotune-gemm"], "CUDA graphs"),
    (["--compile", "reduce-overhead-tuned"], "CUDA graphs"),
    (["--profile-steps", "-1"], "--profile-steps must be >= 0"),
])
def test_bad_flags_get_a_clear_error(args, message, capsys):
    if {"reduce-overhead", "max-autotune-gemm", "reduce-overhead-tuned"} & set(args) and \
            torch.cuda.is_available():
        pytest.skip("CUDA graphs are allowed on a GPU")
    with pytest.raises(SystemExit) as exc:
        train.main(["--preset", "tiny", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_flag_in_a_real_process_exits_2_without_a_traceback():
    r = _train("--preset", "tiny", "--accum-steps", "0", timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "accum_steps must be a positive int" in r.stderr and "Traceback" not in r.stderr


def test_fp8_on_a_cpu_exits_2_with_one_clear_line(capsys):
    """Before any data or model is built: the usage, then one line saying why."""
    with pytest.raises(SystemExit) as exc:
        train.main(["--preset", "tiny", "--device", "cpu", "--fp8"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    errors = [ln for ln in captured.err.splitlines() if "error" in ln.lower()]
    assert errors == ["train.py: error: --fp8: FP8 training needs a CUDA GPU of compute "
                      "capability 8.9 or newer (Ada, Hopper or later); this run is on the CPU"]
    assert "Traceback" not in captured.err and not captured.out


def test_smoke_run_prints_progress_and_writes_an_atomic_checkpoint(tmp_path):
    out = tmp_path / "ck" / "gpt.pt"
    figures = tmp_path / "figures" / "train.json"
    r = _train(*SMALL, "--steps", "6", "--log-every", "3", "--out", str(out),
               "--results", str(figures))
    assert r.returncode == 0, r.stderr[-3000:]
    # the figures it printed, as a ledger: nothing about a run is copied by hand
    led = utils.Ledger.load(figures)
    assert led.notebook == "06-capstone/train" and led["world_size"] == 1
    assert led["tokens_per_s"] > 0 and led["flops_per_step"] > 0 and led["vocab_size"] == 457
    assert f"{led['tokens_per_s']:,.0f} tokens/s" in r.stdout
    assert "vocab padded to 128" in led.measurements["tokens_per_s"].note
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2 and all("tokens/s" in ln and "MFU" in ln for ln in lines), r.stdout
    assert "measured on this machine" in r.stdout and "checkpoint:" in r.stdout
    assert "train:" in r.stderr and "6/6" in r.stderr, "a tqdm progress bar on stderr"
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpt.pt"], "no temp file left"
    state = safe_load(out)
    assert state["step"] == 6 and state["result"]["world_size"] == 1
    assert state["vocab_size"] == 257 + 200 == len(state["tokenizer_words"]) + 257
    assert state["train_config"]["compile"] is None and state["train_config"]["amp"] == "bf16"
    assert state["rung"] == "vocab padded to 128"  # the top rung that runs on a CPU
    cfg = utils.GPTConfig(**state["gpt_config"])
    model = utils.TinyGPT(utils.GPTConfig(**{**state["gpt_config"], "vocab_size": 512}))
    model.load_state_dict(state["model"])  # padded to 512 = a multiple of 128 above 457
    assert cfg.vocab_size == 457 and torch.isfinite(torch.tensor(state["result"]["final_loss"]))
    # the extra rows of the padded vocabulary never trained
    assert not state["model"]["tok_emb.weight"][cfg.vocab_size:].any()


def test_an_earlier_rung_by_name_and_flags_on_top_the_chunked_loss_among_them(tmp_path):
    out = tmp_path / "gpt.pt"
    r = _train(*SMALL, "--rung", "sdpa", "--amp", "fp32", "--loss", "chunked", "--steps", "2",
               "--log-every", "1", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train:" not in r.stderr, "--no-progress: lines only"
    assert "chunked linear + cross-entropy" in r.stdout and "--loss chunked --no-fp8" in r.stdout
    state = safe_load(out)
    assert state["rung"] == "SDPA"
    assert state["train_config"] == {"tf32": True, "amp": None, "sdpa": True, "compile": None,
                                     "fused_adamw": False, "vocab_multiple": 1,
                                     "accum_steps": 4, "loss": "chunked", "fp8": False,
                                     "bf16_residual": False}
    assert torch.isfinite(torch.tensor(state["result"]["final_loss"]))


def test_ddp_under_torchrun_with_two_gloo_processes(tmp_path):
    out = tmp_path / "gpt.pt"
    res = utils.distributed.launch(TRAIN, nproc=2, args=[*SMALL, "--steps", "3", "--log-every",
                                                        "3", "--no-progress", "--out", str(out)],
                                   timeout_s=240, echo=False)
    assert "x 2 process(es)" in res.output and "4 per process" in res.output, res.output[-2000:]
    assert res.output.count("checkpoint:") == 1, "rank 0 alone writes the checkpoint"
    state = safe_load(out)
    assert state["result"]["world_size"] == 2 and state["step"] == 3
    assert not any(k.startswith("module.") for k in state["model"]), "the unwrapped model's keys"


# ----------------------------------------------------------------------------- --rung best

def _ledger(path, device_name: str, index: int, name: str) -> None:
    path.write_text(json.dumps({
        "schema": 1, "notebook": train.NOTEBOOK_LEDGER, "smoke": True, "strict": False,
        "created": "2026-11-24T00:00:00+00:00", "env": {"device_name": device_name},
        "measurements": [{"name": "best_rung_index", "value": float(index), "unit": "",
                          "note": name}],
        "expectations": []}), encoding="utf-8")


def test_best_rung_comes_from_the_notebooks_results_on_this_device(tmp_path, capsys):
    here = utils.get_env("cpu").device_name
    path = tmp_path / "06-capstone__01_speedup_ladder.json"
    _ledger(path, here, 4, "bigger micro-batch")
    assert train.best_rung_key(path, here)[0] == "micro-batch"
    parser = train.build_parser()
    args = parser.parse_args(["--preset", "tiny", "--rung", "best", "--ledger", str(path)])
    *_, cfg, name, notes = train.resolve(args, parser, world=1)
    assert name == "bigger micro-batch" and cfg.accum_steps == 1 and cfg.compile is None
    assert "--rung best" in notes[0] and here in notes[0]
    # measured on another device, no results file, no best rung in it: a clear error
    _ledger(path, "NVIDIA H100 80GB HBM3", 7, "vocab padded to 128")
    for bad, message in [(path, "measured on NVIDIA H100"),
                         (tmp_path / "missing.json", "does not exist")]:
        with pytest.raises(SystemExit):
            train.main(["--preset", "tiny", "--rung", "best", "--ledger", str(bad)])
        assert message in capsys.readouterr().err
    path.write_text(json.dumps({"env": {"device_name": here}, "measurements": []}))
    with pytest.raises(ValueError, match="no best rung"):
        train.best_rung_key(path, here)


def test_cuda_graphs_give_way_to_default_compile_under_ddp(monkeypatch):
    """On a GPU under torchrun the top rung's CUDA graphs become compile mode default (with a
    note), unless --compile asks for them; alone, the top rung keeps them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train, "native_bf16", lambda device: True)
    parser = train.build_parser()
    common = ["--preset", "tiny", "--device", "cuda", "--batch-size", "16"]
    *_, cfg, name, notes = train.resolve(parser.parse_args(common), parser, world=2)
    assert name == "CUDA graphs" and cfg.compile == "default" and "untested" in notes[0]
    *_, cfg, _, notes = train.resolve(parser.parse_args([*common, "--compile", "reduce-overhead"]),
                                      parser, world=2)
    assert cfg.compile == "reduce-overhead" and not notes
    *_, cfg, _, notes = train.resolve(parser.parse_args(common), parser, world=1)
    assert cfg.compile == "reduce-overhead" and not notes


def test_train_py_measures_its_ceiling_with_the_notebooks_routine(tmp_path, monkeypatch, capsys):
    calls = []

    def fake(kinds, device, **kwargs):
        calls.append((list(kinds), kwargs))
        return {k: 1.0 for k in kinds}

    monkeypatch.setattr(train.ladder, "measure_ceilings_tflops", fake)
    threads = torch.get_num_threads()
    try:
        train.main([*SMALL, "--steps", "2", "--log-every", "1", "--no-progress",
                    "--out", str(tmp_path / "gpt.pt")])
    finally:
        torch.set_num_threads(threads)  # --threads 1 must not leak into the other tests
    assert calls == [(["bf16"], {"quick": True})], "the notebook's smoke setting for the tiny preset"
    out = capsys.readouterr().out
    assert "MFU per process" in out and "of the bf16 matmul ceiling measured here" in out


def test_batches_on_the_device_match_the_host_batches_with_no_copy_per_step():
    from torch.overrides import TorchFunctionMode

    data = corpus.build_corpus(200_000, 100, seed=0)
    dev_batches = data.on_device("cpu", steps=4, batch_size=3, seq_len=16, seed=2)

    class Copies(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            if name in ("to", "cuda", "copy_", "pin_memory"):
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    for step in range(4):
        with Copies() as copies:
            x, y = dev_batches(step)
        assert not copies.seen, f"step {step} copied: {copies.seen}"
        hx, hy = data.batch(step, 3, 16, seed=2)
        assert torch.equal(x, hx) and torch.equal(y, hy)
        assert x.is_contiguous() and y.is_contiguous()
    with pytest.raises(IndexError, match="outside the 4 steps"):
        dev_batches(4)


def _fake_train(seen, fail_on=None, profile=None, final_loss=lambda args, n: 4.0 + 0.01 * n):
    """train() stood in for: a result shaped like train()'s, faster with every run."""
    def fake(args, parser):
        if fail_on is not None and fail_on(args):
            raise RuntimeError("compiled kernel crashed\nsecond line")
        seen.append(args)
        n = len(seen)
        report = utils.flops.MFUReport(300.0 + n, 700.0, 989.4, "bf16", "NVIDIA H100")
        random = args.data == "random"
        out = {"tokens_per_s": 50_000.0 * n, "rung": f"rung {n}",
               "vocab_size": 50257 if random else 8257, "padded_vocab": 50304 if random else 8320,
               "report": report, "batch_size": args.batch_size or 16, "settings": "s",
               "flops_per_step": 2e12, "ceiling_tflops": 700.0, "ceiling_kind": "bf16",
               "peak_gib": 10.0 * n, "peak_reserved_gib": 10.0 * n + 1.5,
               "final_loss": final_loss(args, n)}
        if args.rung == "fp32":  # a CPU run has no GPU memory to report
            out["peak_gib"] = out["peak_reserved_gib"] = math.nan
        if profile is not None:
            out["profile"] = profile
        return out
    return fake


def test_benchmark_runs_every_run_says_why_one_is_skipped_and_prints_one_table(
        tmp_path, monkeypatch, capsys):
    """--benchmark's plumbing on a CPU, with train() stood in for (the real runs are the smoke
    run's code): the runs, the FP8 row skipped with its reason, one table with both MFUs, the
    convention and the gains, one ledger."""
    seen = []
    monkeypatch.setattr(train, "train", _fake_train(seen))
    monkeypatch.setattr(train, "_STARTED", time.perf_counter())  # the budget counts from here
    args = train.build_parser().parse_args(["--benchmark", "--device", "cpu", "--results",
                                            str(tmp_path / "bench.json")])
    rows = train.benchmark(args, train.build_parser())
    assert [(s.rung, s.data, s.loss, s.fp8, s.bf16_residual, s.batch_size) for s in seen] == [
        ("fp32", "corpus", None, None, None, None), ("top", "corpus", None, None, None, None),
        ("top", "random", None, None, None, None), ("top", "random", "chunked", None, None, None),
        ("top", "corpus", None, None, True, None), ("top", "random", "chunked", None, True, None),
        ("top", "random", "chunked", None, True, 32), ("top", "corpus", None, None, True, 32)], \
        "the FP8 run is not run on a CPU; 2 x 16"
    assert all(s.out == "none" and s.results == "none" for s in seen), "no checkpoint, no ledger"
    assert all(s.ceiling_cache is seen[0].ceiling_cache for s in seen), "one ceiling per kind"
    assert all(s.profile_steps == 0 for s in seen), "no profile on a CPU"
    out = capsys.readouterr().out
    assert "6N + 12 L d T" in out and "MFU measured" in out and "MFU datasheet" in out
    assert "50257 (50304)" in out and "150,000" in out
    assert "FP8 linears: skipped: FP8 training needs a CUDA GPU of compute capability 8.9" in out
    assert re.search(r"^FP8 linears +skipped: FP8 training needs a CUDA GPU", out, re.M), "its row"
    assert "1.33x over top rung, GPT-2 vocabulary" in out  # 200,000 / 150,000 tokens/s
    assert "1.50x over chunked loss, GPT-2 vocabulary" in out  # bf16 residual: 300k / 200k
    # 2x batch, on the bf16 residual rows: 350k / 300k and 400k / 250k
    assert "1.17x over bf16 residual stream, chunked loss, GPT-2 vocabulary" in out
    assert "1.60x over bf16 residual stream" in out
    assert "2.50x over top rung" in out  # bf16 residual: 250k / 100k
    assert "Time by kernel kind: skipped (profiled on CUDA only" in out
    # the peak memory column: the allocator's reserve, '-' where there is none to report
    assert re.search(r"^top rung +8257 \( 8320\) +16 +100,000 .* 21\.5  2\.00x over fp32", out,
                     re.M), "top rung's row ends with its peak GiB before the gain"
    assert re.search(r"^fp32 eager .* +-  -$", out, re.M), "no peak for the fp32 row"
    led = utils.Ledger.load(tmp_path / "bench.json")
    assert led["peak_reserved_gib_top_rung"] == 21.5 and led["peak_allocated_gib_top_rung"] == 20
    assert "peak_reserved_gib_fp32_eager" not in led.measurements
    assert led["speedup_top_over_fp32"] == pytest.approx(2.0)
    assert led["mfu_vs_datasheet_top_rung_GPT2_vocabulary"] == pytest.approx(303 / 989.4)
    assert led["gain_chunked_loss_GPT2_vocabulary"] == pytest.approx(4 / 3)
    assert "tokens_per_s_FP8_linears" not in led.measurements
    assert led["gain_bf16_residual_stream"] == pytest.approx(2.5)
    assert led["final_loss_top_rung"] == pytest.approx(4.02)
    (claim,) = led.expectations.values()  # smoke size (the tiny preset): recorded, not checked
    assert claim.name == "bf16_residual_final_loss_rel_diff" and claim.status == "not applicable"
    assert claim.value == pytest.approx(0.03 / 4.02)
    assert len(rows) == len(train.BENCHMARK_RUNS) == 9 and "skipped" in rows[4]


def test_benchmark_keeps_to_its_budget_and_survives_a_failing_run(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(train, "train", _fake_train(seen, fail_on=lambda a: a.loss == "chunked"))
    monkeypatch.setattr(train, "_STARTED", time.perf_counter())
    parser = train.build_parser()
    rows = train.benchmark(parser.parse_args(["--benchmark", "--device", "cpu", "--results",
                                              "none"]), parser)
    out = capsys.readouterr().out
    assert "chunked loss, GPT-2 vocabulary: failed: RuntimeError: compiled kernel crashed" in out
    assert [r.get("skipped", "ran")[:6] for r in rows] == ["ran", "ran", "ran", "failed", "FP8 tr",
                                                         "ran", "failed", "failed", "ran"]
    seen.clear()
    rows = train.benchmark(parser.parse_args(["--benchmark", "--device", "cpu", "--results",
                                              "none", "--budget-s", "1e-9"]), parser)
    assert len(seen) == 2, "the first two always run; the rest would pass the budget"
    assert "left out for time" in rows[2]["skipped"] and "--budget-s 1e-09" in rows[2]["skipped"]
    with pytest.raises(SystemExit):
        train.benchmark(parser.parse_args(["--benchmark", "--budget-s", "0"]), parser)
    # --amp fp16 for every run: the bf16 residual rows say why they cannot run; the rest run
    seen.clear()
    rows = train.benchmark(parser.parse_args(["--benchmark", "--device", "cpu", "--results",
                                              "none", "--amp", "fp16"]), parser)
    assert [r["label"] for r in rows if "--amp fp16 was given" in r.get("skipped", "")] == [
        "bf16 residual stream", "bf16 residual stream, chunked loss, GPT-2 vocabulary",
        "2x batch, bf16 residual stream, chunked loss, GPT-2 vocabulary",
        "2x batch, bf16 residual stream"]
    assert not any(s.bf16_residual for s in seen) and len(rows) == len(train.BENCHMARK_RUNS)
    with pytest.raises(SystemExit):  # the benchmark sets it run by run
        train.benchmark(parser.parse_args(["--benchmark", "--bf16-residual"]), parser)
    assert "sets --bf16-residual itself" in capsys.readouterr().err
    # an optional run whose settings train() refuses (parser.error) becomes a row; the rest run
    seen.clear()
    fake = _fake_train(seen)

    def refuses_the_larger_chunked(args, parser):
        if args.loss == "chunked" and args.batch_size:
            parser.error("made-up refusal")
        return fake(args, parser)

    monkeypatch.setattr(train, "train", refuses_the_larger_chunked)
    rows = train.benchmark(parser.parse_args(["--benchmark", "--device", "cpu", "--results",
                                              "none"]), parser)
    (refused,) = [r for r in rows if "refused" in r.get("skipped", "")]
    # the bf16 residual stream's claim, at full size: its final loss against the top rung's
    capsys.readouterr()
    for higher, status in ((1.01, "met"), (1.05, "not met")):
        monkeypatch.setattr(train, "train", _fake_train(
            [], final_loss=lambda args, n: 4.0 * (higher if args.bf16_residual else 1.0)))
        train.benchmark(parser.parse_args(["--benchmark", "--device", "cpu", "--preset", "gpt2",
                                           "--results", "none"]), parser)
        out = capsys.readouterr().out
        line = [ln for ln in out.splitlines() if "bf16 residual stream / the top rung" in ln]
        verdict = "[  MET  ]" if status == "met" else "[NOT MET]"
        assert len(line) == 1 and line[0].startswith(verdict), line
    assert refused["label"] == "2x batch, bf16 residual stream, chunked loss, GPT-2 vocabulary"
    assert rows[-1]["label"] == "2x batch, bf16 residual stream" and "skipped" not in rows[-1]


def test_benchmark_killed_at_a_time_limit_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    # run-course.sh's train phase ends with `timeout`: the rows measured before the kill must
    # be in the log's last lines and in the ledger, not only in a table printed at the end
    seen = []
    fake = _fake_train(seen)

    def killed_at_the_fourth(args, parser):
        if len(seen) == 3:
            raise KeyboardInterrupt("the time limit")
        return fake(args, parser)

    monkeypatch.setattr(train, "train", killed_at_the_fourth)
    monkeypatch.setattr(train, "_STARTED", time.perf_counter())
    parser = train.build_parser()
    with pytest.raises(KeyboardInterrupt):
        train.benchmark(parser.parse_args(["--benchmark", "--device", "cpu", "--results",
                                           str(tmp_path / "bench.json")]), parser)
    out = capsys.readouterr().out
    assert "--- the table so far" in out and "150,000" in out
    led = utils.Ledger.load(tmp_path / "bench.json")
    assert led["tokens_per_s_top_rung_GPT2_vocabulary"] == 150_000
    assert led.smoke, "--preset auto on a CPU runs the tiny preset: a smoke-size ledger"
    # the budget counts from the process's start: a process that already spent it runs only
    # the first two
    seen.clear()
    monkeypatch.setattr(train, "train", fake)
    monkeypatch.setattr(train, "_STARTED", time.perf_counter() - 1000)
    train.benchmark(parser.parse_args(["--benchmark", "--device", "cpu", "--results", "none"]),
                    parser)
    assert len(seen) == 2


def test_benchmark_on_a_gpu_explains_the_best_runs_time_by_kernel_kind(monkeypatch, capsys):
    """What a GPU run prints after the table, from a made-up profile: the parts add up to the
    gap between the FLOP bound and the profiled step."""
    from utils.compiletools import StepProfile

    prof = StepProfile(label="CUDA graphs", unit="GPU kernels", steps=3, kernels_per_step=900,
                       kernels_by_category={"matmul": 300, "attention": 24, "optimizer": 4,
                                            "copy": 2, "other": 570},
                       busy_ms_per_step=54.0,
                       kernel_ms_by_category={"matmul": 38.0, "attention": 6.0, "optimizer": 2.0,
                                              "copy": 0.5, "other": 7.5},
                       wall_ms_per_step=60.0, median_gap_us=2.0,
                       top_kernels=(("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 9.0),
                                    ("triton_red_fused_native_layer_norm_backward_3", 2.5),
                                    ("triton_poi_fused_gelu_backward_7", 1.5)))
    lines = train.kernel_breakdown(prof, flops=28e12, ceiling_tflops=700.0, kind="bf16")
    text = "\n".join(lines)
    assert "take 40.00 ms" in text and "the 20.00 ms between" in text
    assert "beyond the bound      4.00 ms" in text  # 38 + 6 - 40
    assert "copies)     10.00 ms" in text and "synchronisation)      6.00 ms" in text  # 4+6+10=20
    assert "[matmul] nvjet_tst" in text
    # the gap's largest part named kernel by kernel: the other kernels, longest first
    assert re.search(r"longest of the other kernels \(7\.50 ms per step in all\):\n +2\.50 ms  "
                     r"triton_red_fused_native_layer_norm_backward_3\n +1\.50 ms  triton_poi",
                     text), text
    seen = []
    monkeypatch.setattr(train, "train", _fake_train(seen, profile=prof))
    monkeypatch.setattr(train, "_STARTED", time.perf_counter())
    monkeypatch.setattr(train, "_device_type", lambda args: "cuda")
    monkeypatch.setattr(train, "_release_compiled", lambda device_type: None)  # no GPU to free
    monkeypatch.setattr(train.ladder, "fp8_unavailable_reason", lambda device=None: "")
    monkeypatch.setattr(train, "native_bf16", lambda device: True)
    parser = train.build_parser()
    train.benchmark(parser.parse_args(["--benchmark", "--preset", "gpt2", "--results", "none"]),
                    parser)
    assert [s.profile_steps for s in seen] == [0] + [3] * 8, "every compiled run, 3 steps"
    assert [s.fp8 for s in seen][4] is True and seen[7].batch_size == 64, "2 x gpt2's 32"
    assert seen[8].batch_size == 64 and seen[8].data == "corpus", "and at the course's vocabulary"
    assert all(s.bf16_residual for s in seen[5:]) and seen[6].loss == seen[7].loss == "chunked"
    out = capsys.readouterr().out
    assert "The best run by model TFLOP/s, 2x batch, bf16 residual stream:" in out  # the last
    assert "time by kernel kind, CUDA graphs: 3 profiled step(s)" in out
    # --profile-steps 0 turns the profiler off in --benchmark too (a profiler fault on CUDA
    # graphs can end the process, and with it the later runs)
    seen.clear()
    train.benchmark(parser.parse_args(["--benchmark", "--preset", "gpt2", "--results", "none",
                                       "--profile-steps", "0"]), parser)
    assert [s.profile_steps for s in seen] == [0] * len(train.BENCHMARK_RUNS)
    # a GPU without native bf16 (before sm80): the four bf16 residual rows say why, the rest run
    monkeypatch.setattr(train, "native_bf16", lambda device: False)
    seen.clear()
    capsys.readouterr()
    rows = train.benchmark(parser.parse_args(["--benchmark", "--preset", "gpt2", "--results",
                                              "none", "--profile-steps", "0"]), parser)
    assert len(seen) == len(train.BENCHMARK_RUNS) - 4
    assert [r["label"] for r in rows if "no native bfloat16" in r.get("skipped", "")] == [
        "bf16 residual stream", "bf16 residual stream, chunked loss, GPT-2 vocabulary",
        "2x batch, bf16 residual stream, chunked loss, GPT-2 vocabulary",
        "2x batch, bf16 residual stream"]
    # a profile with no kernels in it says so instead of a breakdown that is all idle time
    empty = dataclasses.replace(prof, kernels_per_step=0.0, busy_ms_per_step=0.0,
                                kernels_by_category={}, kernel_ms_by_category={}, top_kernels=())
    (line,) = train.kernel_breakdown(empty, flops=28e12, ceiling_tflops=700.0, kind="bf16")
    assert "recorded no GPU kernels in 3 profiled step(s)" in line


def test_fp8_needs_micro_batches_of_a_multiple_of_16_tokens(monkeypatch, capsys):
    """torch._scaled_mm wants inner dimensions that are multiples of 16; in the weight
    gradient's matmul one of them is the micro-batch's token count."""
    monkeypatch.setattr(train.ladder, "fp8_unavailable_reason", lambda device=None: "")
    parser = train.build_parser()
    args = ["--preset", "tiny", "--device", "cpu", "--fp8", "--batch-size", "3"]
    with pytest.raises(SystemExit) as exc:
        train.resolve(parser.parse_args([*args, "--block-size", "31"]), parser, world=1)
    assert exc.value.code == 2
    assert "--fp8: a micro-batch of 93 tokens" in capsys.readouterr().err
    *_, cfg, _, _ = train.resolve(parser.parse_args([*args, "--block-size", "32"]), parser,
                                  world=1)
    assert cfg.fp8


def test_random_tokens_at_gpt2_vocabulary(tmp_path):
    r = _train("--preset", "tiny", "--rung", "fp32", "--data", "random", "--steps", "2",
               "--log-every", "1", "--no-progress", "--out", "none",
               "--results", str(tmp_path / "r.json"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "uniform random tokens, vocabulary 50257 (padded to 50257)" in r.stdout
    led = utils.Ledger.load(tmp_path / "r.json")
    assert led["vocab_size"] == 50257 and not list(tmp_path.glob("*.pt"))
    batches = corpus.RandomTokens(100, seed=1).on_device("cpu", 3, 2, 8)
    x, y = batches(1)
    assert torch.equal(x, corpus.RandomTokens(100, seed=1).on_device("cpu", 3, 2, 8)(1)[0])
    assert x.shape == (2, 8) and int(x.max()) < 100 and torch.equal(x[:, 1:], y[:, :-1])


def test_fp8_sweep_times_both_kinds_per_width_and_says_where_fp8_pays(tmp_path, monkeypatch,
                                                                      capsys):
    """On a CPU torch emulates the FP8 matmuls (slowly, eager): enough to run the plumbing."""
    parser = train.build_parser()
    with pytest.raises(SystemExit) as exc:  # a CPU: refused with the reason, before any work
        train.main(["--fp8-sweep", "--device", "cpu"])
    assert exc.value.code == 2 and "--fp8-sweep: FP8 training needs a CUDA GPU" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.fp8_sweep(parser.parse_args(["--fp8-sweep", "768,100"]), parser)
    assert "positive multiples of 16" in capsys.readouterr().err
    monkeypatch.setattr(train.ladder, "fp8_unavailable_reason", lambda device=None: "")
    out = tmp_path / "sweep.json"
    points = train.fp8_sweep(parser.parse_args(
        ["--fp8-sweep", "16", "--device", "cpu", "--batch-size", "2", "--block-size", "16",
         "--results", str(out)]), parser)
    (p,) = points
    assert (p.width, p.tokens, p.flops) == (16, 32, 48 * 32 * 16**2)
    assert p.bf16_ms > 0 and p.fp8_ms > 0
    text = capsys.readouterr().out
    # the verdict follows the measured speedup (emulated FP8 on a CPU: either way)
    verdict = ("FP8 is at least 1.1x bf16 at every width from 16 on" if p.speedup >= 1.1 else
               "FP8 is not 1.1x bf16 at the largest width measured (16)")
    assert "FP8 speedup" in text and verdict in text, text
    assert text.count("bf16 time / FP8 time") == 1, "the claim, printed once at the end"
    led = json.loads(out.read_text())
    keys = {m["name"] for m in led["measurements"]}
    assert {"fp8_mlp_d16_speedup", "fp8_mlp_d16_fp8_tflops", "fp8_pays_from_width"} <= keys
    (claim,) = [e for e in led["expectations"] if e["name"] == "fp8_mlp_speedup_at_largest_width"]
    assert claim["status"] == "not applicable", "width 16 is far below where FP8 must pay"
    # at 4096, a sweep where FP8 barely moves (a conversion that did not take) misses the claim
    fake = [dataclasses.replace(p, width=w, bf16_ms=10.0, fp8_ms=9.5) for w in (768, 4096)]
    monkeypatch.setattr(train.ladder, "fp8_mlp_sweep", lambda widths, **kw: fake)
    train.fp8_sweep(parser.parse_args(["--fp8-sweep", "768,4096", "--device", "cpu",
                                       "--preset", "gpt2", "--results", str(out)]), parser)
    (claim,) = [e for e in json.loads(out.read_text())["expectations"]
                if e["name"] == "fp8_mlp_speedup_at_largest_width"]
    assert claim["status"] == "not met" and claim["value"] == pytest.approx(10 / 9.5)
    # a sweep at fewer tokens than the preset's is not what the claim is about
    train.fp8_sweep(parser.parse_args(["--fp8-sweep", "768,4096", "--device", "cpu",
                                       "--preset", "gpt2", "--batch-size", "4",
                                       "--results", str(out)]), parser)
    (claim,) = [e for e in json.loads(out.read_text())["expectations"]
                if e["name"] == "fp8_mlp_speedup_at_largest_width"]
    assert claim["status"] == "not applicable" and "4096 tokens" in claim["reason"]


def test_fp8_sweep_saves_each_width_as_it_ends(tmp_path, monkeypatch, capsys):
    """A sweep stopped at a time limit (the H100 run of 2026-11-27 was, at its last width) keeps
    the widths it measured: the ledger is written after each one, claim included."""
    parser = train.build_parser()
    out = tmp_path / "sweep.json"
    pt = train.ladder.Fp8SweepPoint(768, 32 * 1024, 1.0, bf16_ms=2.0, fp8_ms=2.2)
    seen = []

    def stopped_sweep(widths, *, on_point=None, **kw):
        on_point(pt)
        seen.append(json.loads(out.read_text()))  # what a kill here would leave behind
        on_point(dataclasses.replace(pt, width=3072, bf16_ms=23.0, fp8_ms=17.0))
        seen.append(json.loads(out.read_text()))
        raise KeyboardInterrupt  # the time limit, before the last width

    monkeypatch.setattr(train.ladder, "fp8_unavailable_reason", lambda device=None: "")
    monkeypatch.setattr(train.ladder, "fp8_mlp_sweep", stopped_sweep)
    with pytest.raises(KeyboardInterrupt):
        train.fp8_sweep(parser.parse_args(["--fp8-sweep", "768,3072,4096", "--device", "cpu",
                                           "--preset", "gpt2", "--results", str(out)]), parser)
    first, second = ({m["name"]: m for m in led["measurements"]} for led in seen)
    assert "fp8_mlp_d768_speedup" in first and "fp8_mlp_d3072_speedup" not in first
    assert first["fp8_sweep_widths_unmeasured"]["value"] == 2
    assert "[3072, 4096]" in first["fp8_sweep_widths_unmeasured"]["note"]
    assert second["fp8_sweep_widths_unmeasured"]["value"] == 1
    (claim,) = [e for e in seen[1]["expectations"]
                if e["name"] == "fp8_mlp_speedup_at_largest_width"]
    assert claim["status"] == "met" and claim["value"] == pytest.approx(23 / 17)
    assert "width 3072 (the largest measured)" in claim["description"]
    assert "bf16 time / FP8 time" not in capsys.readouterr().out, "saved quietly as it goes"


def test_fp8_pays_from_the_smallest_width_after_which_it_always_pays():
    def pt(width, speedup):
        return train.ladder.Fp8SweepPoint(width, 32, 1.0, bf16_ms=speedup, fp8_ms=1.0)

    assert train.ladder.fp8_pays_from([pt(768, 0.9), pt(2048, 1.3), pt(1024, 1.2)]) == 1024
    assert train.ladder.fp8_pays_from([pt(768, 1.2), pt(1024, 1.0), pt(2048, 1.3)]) == 2048
    assert train.ladder.fp8_pays_from([pt(768, 1.2), pt(1024, 1.05)]) is None
