"""Popular performance claims, each tied to the course's measurements that test it.

The track's performance guidelines quote speedups that people repeat ("torch.compile: 1.3-2x",
"AMP: 2-3x faster training, 50% less memory", ...). Here every such claim is data: its words,
its source, the range it promises, and the ledger measurements (a notebook's or a command-line
script's) that test it. :func:`claims_table` renders one table from whatever ledgers exist, and
``python -m utils report`` puts it on the results page: per claim, what the course measured
(device, torch, date, size, which notebook or script) and the verdict: *holds*, *holds only
for* some of the measurements, or *does not hold*, with the measured values.

Only what can stand for the claim counts: a full-size run (not smoke) on a CUDA GPU that had
the machine to itself (not ``python -m utils run --jobs N``), the latest per notebook and GPU.
A claim with no such measurement says "not yet measured on a GPU" (or on the GPUs it names).
Nothing is filled in by hand: a notebook or script that records a measurement under a name
listed here feeds the table the next time the report is rendered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..ledger import Ledger

__all__ = ["SOURCE", "Evidence", "Test", "Claim", "CLAIMS", "Finding", "find_evidence",
           "claim_verdict", "claims_table", "claims_section", "ledgers_for_claims"]

#: Where the claims come from (issue 24 quotes them).
SOURCE = "the track's performance guidelines"

_NB_AMP = "02-mixed-precision/04_amp_end_to_end"
#: channels_last and torch.compile on top of autocast moved here from 04 (its ledgers before
#: 2026-11-27 hold them under _NB_AMP, so both are read).
_NB_AMP_LAYOUT = "02-mixed-precision/08_amp_with_channels_last_and_compile"
_NB_AUTOCAST = "02-mixed-precision/02_autocast"
_NB_COMPILE = "01-torch-compile/01_compile_basics"
_NB_LADDER = "06-capstone/01_speedup_ladder"
#: The capstone's exercises (the CNN ladder, channels_last) moved here from _NB_LADDER; no
#: recorded ledger holds them under _NB_LADDER (it has not run on a GPU), so only this is read.
_NB_TOP_RUNG = "06-capstone/02_the_top_rung_up_close"
_NB_FUSED = "03-fused-operations/01_fewer_bigger_kernels"
_NB_ATTN = "03-fused-operations/02_attention_kernels"
_NB_INFER = "03-fused-operations/05_inference_fusions"
_NB_CKPT = "04-memory-efficiency/02_activation_checkpointing"
#: The ledgers of the two command-line benchmarks.
COMPILE_SCRIPT = "01-torch-compile/compile_benchmark"
AMP_SCRIPT = "02-mixed-precision/amp_training"


@dataclass(frozen=True)
class Evidence:
    """Measurement(s) in one notebook's (or script's) ledger that test a claim.

    Attributes:
        notebook: the ledger's notebook name, e.g. ``"02-mixed-precision/04_amp_end_to_end"``.
        key: the measurement's name; ``*`` stands for any run of characters (one item per
            measurement that matches).
        what: what the value is, in words (default: the ledger's description of that
            expectation, else the measurement's note, else its name).
        ratio_of: the value is ``key``'s divided by this measurement's (two rungs of a ladder:
            the rung before over the rung that adds the technique).
        invert: the value is ``1 / key``'s (a time ratio read as a speed).
        context: shown beside the others, but not used for the verdict.
    """

    notebook: str
    key: str
    what: str = ""
    ratio_of: str | None = None
    invert: bool = False
    context: bool = False


@dataclass(frozen=True)
class Test:
    """One number a claim promises, and how a measurement is judged against it.

    A value holds when it is at least ``at_least`` (if given) and at most ``at_most`` (if
    given). ``quoted_up_to`` is the top of a quoted range ("1.3-2x"): a value above it still
    holds, and the verdict says it is above the quoted range.
    """

    evidence: tuple[Evidence, ...]
    at_least: float | None = None
    at_most: float | None = None
    quoted_up_to: float | None = None
    label: str = ""
    unit: str = "x"

    def __post_init__(self) -> None:
        if self.at_least is None and self.at_most is None:
            raise ValueError("a Test needs at_least=, at_most= or both")

    def holds(self, value: float) -> bool:
        return ((self.at_least is None or value >= self.at_least)
                and (self.at_most is None or value <= self.at_most))

    def promise(self) -> str:
        if self.at_least is not None and self.quoted_up_to == self.at_least:
            return f"{self.at_least:g}{self.unit}"
        if self.at_least is not None and self.quoted_up_to is not None:
            return f"{self.at_least:g}-{self.quoted_up_to:g}{self.unit}"
        if self.at_least is not None and self.at_most is not None:
            return f"{self.at_least:g}-{self.at_most:g}{self.unit}"
        if self.at_least is not None:
            return f">= {self.at_least:g}{self.unit}"
        return f"<= {self.at_most:g}{self.unit}"


@dataclass(frozen=True)
class Claim:
    """A popular claim: its words, its source, and the tests that decide it.

    Attributes:
        key: a short name.
        text: the claim as it is quoted.
        tests: one per number the claim promises (speed, memory, fp16 and bf16, ...).
        source: where it is quoted.
        devices: words of the GPU names it is about (``("A100", "H100")``); empty: any
            CUDA GPU.
        device_words: those GPUs in words, for "not yet measured on ...".
    """

    key: str
    text: str
    tests: tuple[Test, ...]
    source: str = SOURCE
    devices: tuple[str, ...] = ()
    device_words: str = "a GPU"

    def about(self, device_name: str) -> bool:
        return not self.devices or any(d.lower() in device_name.lower() for d in self.devices)


def _compile_evidence(model_glob: str, notebook_keys: Sequence[tuple[str, str]] = (),
                      ladder: bool = False) -> tuple[Evidence, ...]:
    items = [Evidence(COMPILE_SCRIPT, f"speedup[{model_glob}]")]
    items += [Evidence(nb, key, what) for nb, key, what in notebook_keys]
    if ladder:
        items.append(Evidence(_NB_LADDER, "bigger_micro_batch_ms_per_step",
                              "GPT-2-shaped training step: the capstone ladder's torch.compile "
                              "rung over the rung before it",
                              ratio_of="torch_compile_ms_per_step"))
    return tuple(items)


_GPT_COMPILE = (
    (_NB_COMPILE, "gpt_train_step_compile_speedup_tf32", ""),
    (_NB_COMPILE, "gpt_train_step_compile_speedup_bf16", ""),
    (_NB_COMPILE, "tinygpt_infer_compile_speedup",
     "TinyGPT inference forward: eager / compiled (mode default)"),
    (_NB_COMPILE, "mode_*_infer_speedup", "TinyGPT inference forward: eager / compiled"),
    (_NB_AMP, "compiled_amp_step_speedup_vs_eager_amp",
     "TinyGPT autocast training step: eager / compiled"),
    (_NB_AMP_LAYOUT, "compiled_amp_step_speedup_vs_eager_amp",
     "TinyGPT autocast training step: eager / compiled"),
)
_CNN_COMPILE = (
    (_NB_COMPILE, "cnn_train_step_compile_speedup", ""),
    (_NB_COMPILE, "smallcnn_infer_compile_speedup",
     "SmallCNN inference forward: eager / compiled (mode default)"),
)


def _amp_speed(dtype: str) -> tuple[Evidence, ...]:
    word = {"fp16": "fp16 autocast + GradScaler", "bf16": "bf16 autocast"}[dtype]
    items = [Evidence(AMP_SCRIPT, f"step_speedup[*, {dtype}]"),
             Evidence(_NB_AMP, f"*_step_speedup_{dtype}",
                      f"training step: fp32 (TF32 off) / {word}"),
             # 02/02 records each variant under its label's key: "autocast fp16 + GradScaler"
             Evidence(_NB_AUTOCAST, f"step_speedup_autocast_{dtype}"
                                    + ("_gradscaler" if dtype == "fp16" else ""),
                      f"TinyGPT training step: fp32 (TF32 off) / {word}")]
    # the capstone ladder's autocast rung (bf16, or fp16 + GradScaler on a GPU without bf16)
    rung = {"bf16": "bf16_autocast", "fp16": "fp16_autocast_gradscaler"}[dtype]
    items.append(Evidence(_NB_LADDER, f"{rung}_speedup_vs_fp32",
                          f"GPT-2-shaped training step: fp32 eager / the capstone ladder's "
                          f"{word} rung (TF32 on below it)"))
    return tuple(items)


_AMP_MEMORY = (
    Evidence(AMP_SCRIPT, "peak_ratio[*, bf16]"),
    Evidence(AMP_SCRIPT, "peak_ratio[*, fp16]"),
    Evidence(_NB_AMP, "*_step_peak_ratio_*", "a training step's peak memory: autocast / fp32"),
)

#: The claims, in the order the issue quotes them.
CLAIMS: tuple[Claim, ...] = (
    Claim("compile", "torch.compile: 1.3-2x faster (\"always\")",
          (Test(_compile_evidence("*", _GPT_COMPILE + _CNN_COMPILE, ladder=True),
                at_least=1.3, quoted_up_to=2.0),)),
    Claim("compile-transformers", "torch.compile: 1.5-2.5x on transformers",
          (Test(_compile_evidence("tinygpt *", _GPT_COMPILE, ladder=True),
                at_least=1.5, quoted_up_to=2.5),)),
    Claim("compile-cnns", "torch.compile: 1.3-2x on CNNs",
          (Test(_compile_evidence("smallcnn *", _CNN_COMPILE), at_least=1.3,
                quoted_up_to=2.0),)),
    Claim("compile-rnns", "torch.compile: 1.2-1.5x on RNN/LSTM",
          (Test(_compile_evidence("lstm *"), at_least=1.2, quoted_up_to=1.5),)),
    Claim("amp-fp16", "AMP (fp16): 1.5-3x faster",
          (Test(_amp_speed("fp16"), at_least=1.5, quoted_up_to=3.0),)),
    Claim("amp-a100-h100", "fp16 and bf16: 2-3x faster on A100 and H100",
          (Test(_amp_speed("fp16"), at_least=2.0, quoted_up_to=3.0, label="fp16"),
           Test(_amp_speed("bf16"), at_least=2.0, quoted_up_to=3.0, label="bf16")),
          devices=("A100", "H100"), device_words="an A100 or H100"),
    Claim("amp-3090", "fp16 2x and bf16 1.5-2x on an RTX 3090",
          (Test(_amp_speed("fp16"), at_least=2.0, quoted_up_to=2.0, label="fp16"),
           Test(_amp_speed("bf16"), at_least=1.5, quoted_up_to=2.0, label="bf16")),
          devices=("3090",), device_words="an RTX 3090"),
    Claim("amp", "AMP: \"2-3x faster training, 50% less memory usage\"",
          (Test(_amp_speed("bf16") + _amp_speed("fp16"), at_least=2.0, quoted_up_to=3.0,
                label="speed"),
           Test(_AMP_MEMORY, at_most=0.5, label="memory")),),
    Claim("fused-optimizers", "fused optimizers: 1.1-1.3x on large models",
          (Test((Evidence(_NB_FUSED, "fused_vs_foreach_training_step_speedup",
                          "TinyGPT training step: AdamW foreach / fused"),
                 Evidence(_NB_LADDER, "torch_compile_ms_per_step",
                          "GPT-2-shaped training step: the capstone ladder's fused-AdamW rung "
                          "over the rung before it", ratio_of="fused_adamw_ms_per_step"),
                 Evidence(_NB_FUSED, "fused_vs_foreach_adamw_step_speedup", context=True)),
                at_least=1.1, quoted_up_to=1.3),)),
    Claim("flash-attention", "flash attention: 2-4x on transformers",
          (Test((Evidence(_NB_ATTN, "flash_vs_naive_speedup"),
                 Evidence(_NB_LADDER, "bf16_autocast_ms_per_step",
                          "GPT-2-shaped training step: the capstone ladder's SDPA rung "
                          "over the rung before it", ratio_of="sdpa_ms_per_step")),
                at_least=2.0, quoted_up_to=4.0),)),
    Claim("checkpointing", "gradient checkpointing: 0.8x the speed for 3x less memory",
          (Test((Evidence(_NB_CKPT, "full_checkpoint_step_time_ratio",
                          "TinyGPT forward + backward, every block checkpointed: speed / "
                          "no checkpointing's", invert=True),),
                at_least=0.8, quoted_up_to=0.8, label="speed"),
           Test((Evidence(_NB_CKPT, "full_checkpoint_memory_cut"),), at_least=3.0,
                label="memory"))),
    Claim("channels-last", "channels_last: up to 20% faster on tensor cores",
          (Test((Evidence(_NB_AMP, "channels_last_cnn_amp_speedup"),
                 Evidence(_NB_AMP_LAYOUT, "channels_last_cnn_amp_speedup"),
                 Evidence(_NB_TOP_RUNG, "cnn_channels_last_speedup",
                          "SmallCNN training step on the capstone ladder: NCHW / "
                          "channels_last")),
                at_least=1.0, quoted_up_to=1.2),)),
    Claim("torchscript", "TorchScript: \"10-30% faster inference\"",
          (Test((Evidence(_NB_INFER, "speedup_vs_eager[TorchScript, freeze + "
                                     "optimize_for_inference]",
                          "SmallCNN inference: eager / TorchScript (trace, freeze, "
                          "optimize_for_inference)"),
                 Evidence(_NB_INFER, "speedup_vs_eager[TorchScript, trace]",
                          "SmallCNN inference: eager / TorchScript (trace)")),
                at_least=1.1, quoted_up_to=1.3),)),
)


@dataclass(frozen=True)
class Finding:
    """One measured value that tests a claim."""

    evidence: Evidence
    name: str          # the measurement's name (the one a glob matched)
    value: float
    what: str
    ledger: Ledger = field(compare=False, repr=False)


def ledgers_for_claims(ledgers: Sequence[Ledger]) -> list[Ledger]:
    """The ledgers that can stand for a claim: full size, on a CUDA GPU, not sharing the
    machine with other notebooks; the latest per notebook and GPU."""
    latest: dict[tuple[str, str], Ledger] = {}
    for led in ledgers:
        if led.smoke or led.shared or not str(led.env.get("device", "")).startswith("cuda"):
            continue
        key = (led.notebook, str(led.env.get("device_name", "?")))
        if key not in latest or (led.created or "") >= (latest[key].created or ""):
            latest[key] = led
    return list(latest.values())


def _pattern(glob: str) -> re.Pattern[str]:
    return re.compile("^" + ".*".join(re.escape(p) for p in glob.split("*")) + "$")


def _describe(led: Ledger, name: str) -> str:
    exp = led.expectations.get(name)
    if exp is not None and exp.description and exp.description != name:
        return exp.description
    m = led.measurements.get(name)
    return (m.note if m is not None and m.note else "") or name


def find_evidence(ev: Evidence, ledgers: Sequence[Ledger]) -> list[Finding]:
    """Every value ``ev`` names in ``ledgers`` (already filtered to one GPU)."""
    out = []
    pat = _pattern(ev.key)
    for led in ledgers:
        if led.notebook != ev.notebook:
            continue
        for name, m in led.measurements.items():
            if not pat.match(name):
                continue
            value = m.value
            if ev.ratio_of is not None:
                den = led.measurements.get(ev.ratio_of)
                if den is None or den.value == 0:
                    continue
                value = value / den.value
            if ev.invert:
                if value == 0:
                    continue
                value = 1 / value
            what = ev.what or _describe(led, name)
            if ev.what and "*" in ev.key:
                what += f" [{name}]"
            out.append(Finding(ev, name, value, what, led))
    return out


def _fmt(value: float, unit: str) -> str:
    return f"{value:.2f}{unit}" if unit == "x" else f"{value:.3g} {unit}"


def claim_verdict(claim: Claim, ledgers: Sequence[Ledger],
                  version_note: Callable[[Ledger], str] | None = None
                  ) -> tuple[list[str], list[str]]:
    """What was measured and the verdict, per GPU, for one claim.

    ``version_note(ledger)`` may add words to a ledger's source line (the report says
    whether the notebook changed since the commit it was measured at).

    Returns:
        ``(measured lines, verdict lines)``: one paragraph per GPU; both empty when no
        ledger measured the claim.
    """
    by_device: dict[str, list[Ledger]] = {}
    for led in ledgers:
        name = str(led.env.get("device_name", "?"))
        if claim.about(name):
            by_device.setdefault(name, []).append(led)
    measured, verdicts = [], []
    for device, leds in sorted(by_device.items()):
        per_test = [(t, [f for ev in t.evidence for f in find_evidence(ev, leds)])
                    for t in claim.tests]
        if not any(f for _, fs in per_test for f in fs):
            continue
        items: dict[int, list[str]] = {}   # id(ledger) -> its items, in order
        sources: dict[int, Ledger] = {}
        parts, n = [], 0
        for test, findings in per_test:
            numbers: dict[int, Finding] = {}
            for f in findings:
                n += 1
                numbers[n] = f
                tag = " (context, not judged)" if f.evidence.context else ""
                label = f"{test.label}: " if test.label else ""
                sources.setdefault(id(f.ledger), f.ledger)
                items.setdefault(id(f.ledger), []).append(
                    f"[{n}] {label}{f.what} = **{_fmt(f.value, test.unit)}**{tag}")
            parts.append(_test_verdict(test, numbers))
        lines = [f"**{device}**:"]
        for key, led_items in items.items():
            led = sources[key]
            note = version_note(led) if version_note is not None else ""
            lines.append(f"_{_where(led)}" + (f", {note}" if note else "") + "_: "
                         + "; ".join(led_items))
        measured.append("<br>".join(lines))
        verdicts.append(f"**{device}**: " + "; ".join(parts))
    return measured, verdicts


def _where(led: Ledger) -> str:
    """The notebook or script and the run: torch, date, size, commit."""
    return (f"{led.notebook} (torch {led.env.get('torch_version', '?')}, "
            f"{(led.created or '?')[:10]}, {'smoke' if led.smoke else 'full'} size"
            + (f", commit {led.commit}" if led.commit else "") + ")")


def _test_verdict(test: Test, numbers: dict[int, Finding]) -> str:
    label = f"{test.label} ({test.promise()}): " if test.label else ""
    judged = {i: f for i, f in numbers.items() if not f.evidence.context}
    if not judged:
        return label + "not yet measured on this GPU"
    ok = {i: f for i, f in judged.items() if test.holds(f.value)}
    bad = {i: f for i, f in judged.items() if i not in ok}

    def refs(group: dict[int, Finding]) -> str:
        return ", ".join(f"[{i}] {_fmt(f.value, test.unit)}" for i, f in group.items())

    if not bad:
        above = {i: f for i, f in ok.items()
                 if test.quoted_up_to is not None and f.value > test.quoted_up_to}
        text = "holds"
        if above and len(above) == len(ok):
            text += f", above the quoted range ({refs(above)})"
        elif above:
            text += f" ({refs(ok)}; above the quoted range: {', '.join(f'[{i}]' for i in above)})"
        else:
            text += f" ({refs(ok)})"
        return label + text
    if not ok:
        return label + f"does not hold ({refs(bad)})"
    return label + f"holds only for {refs(ok)}; not for {refs(bad)}"


def claims_table(ledgers: Sequence[Ledger], claims: Sequence[Claim] = CLAIMS,
                 version_note: Callable[[Ledger], str] | None = None) -> list[str]:
    """The claims table as markdown lines, from every ledger given (filtered with
    :func:`ledgers_for_claims`)."""
    usable = ledgers_for_claims(ledgers)
    rows = ["| claim | source | what the course measured | verdict |", "|---|---|---|---|"]
    for claim in claims:
        measured, verdicts = (_cell(t) for t in claim_verdict(claim, usable, version_note))
        if not measured:
            why = f"not yet measured on {claim.device_words}"
            rows.append(f"| {claim.text} | {claim.source} | - | {why} |")
            continue
        rows.append(f"| {claim.text} | {claim.source} | {'<br>'.join(measured)} | "
                    f"{'<br>'.join(verdicts)} |")
    return rows


def _cell(lines: list[str]) -> list[str]:
    """Lines for a markdown table cell: a ``|`` in a description would end the cell."""
    return [ln.replace("|", "\\|") for ln in lines]


def claims_section(ledgers: Sequence[Ledger],
                   version_note: Callable[[Ledger], str] | None = None) -> list[str]:
    """The results page's section: a heading, what counts, and the table."""
    return ["## Popular claims, tested", "",
            "Each claim as the track's performance guidelines quote it, what the course "
            "measured that tests it (full-size runs on a GPU that had the machine to itself, "
            "the latest per notebook or script and GPU), and the verdict: *holds* (the measured "
            "value is in or above the quoted range), *holds only for* some measurements, or "
            "*does not hold*. `01-torch-compile/compile_benchmark.py` and "
            "`02-mixed-precision/amp_training.py` measure most of them in one command; the "
            "registry is `utils/course/claims.py`.", "",
            *claims_table(ledgers, version_note=version_note), ""]
