"""Turn ledgers (results JSON) into a markdown report and plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from .ledger import NOT_MET, Ledger

__all__ = ["load_ledgers", "scan_results", "markdown_report", "write_report"]

# A ledger is a few kB; anything this large (a profiler trace, say) is not one.
MAX_LEDGER_BYTES = 20 * 2**20
# Written by the runner beside the ledgers; not a ledger, and not worth a note.
RUNNER_FILES = {"run.json"}


def scan_results(paths: Sequence[str | os.PathLike]) -> tuple[list[Ledger], list[tuple[Path, str]]]:
    """Ledgers found in files and folders (searched recursively), and what was skipped.

    Every ``*.json`` that is not a ledger (a Chrome trace, another tool's
    JSON, a file that is not JSON at all) is skipped with the reason, never
    an abort: a run folder holds more than ledgers.

    Returns:
        ``(ledgers sorted by notebook, [(skipped file, why), ...])``.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"no such results file or folder: {raw}")
        files += sorted(p.rglob("*.json")) if p.is_dir() else [p]
    ledgers, skipped = [], []
    for f in files:
        if f.name in RUNNER_FILES:
            continue
        size = f.stat().st_size
        if size > MAX_LEDGER_BYTES:
            skipped.append((f, f"{size / 2**20:.0f} MiB, too large to be a ledger"))
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            skipped.append((f, f"not JSON ({exc})"))
            continue
        if not (isinstance(data, dict) and "measurements" in data and "notebook" in data):
            what = "a Chrome/profiler trace" if isinstance(data, dict) and "traceEvents" in data \
                else "JSON without a ledger's notebook and measurements"
            skipped.append((f, f"not a ledger: {what}"))
            continue
        try:
            ledgers.append(Ledger.from_dict(data))
        except (KeyError, TypeError, ValueError) as exc:
            skipped.append((f, f"a damaged ledger ({type(exc).__name__}: {exc})"))
    return sorted(ledgers, key=lambda led: led.notebook), skipped


def load_ledgers(paths: Sequence[str | os.PathLike]) -> list[Ledger]:
    """The ledgers in files and folders (see :func:`scan_results`; skipped files are dropped).

    Raises:
        FileNotFoundError: a path does not exist, or no ledger was found.
    """
    return _found_ledgers(paths)[0]


def _found_ledgers(paths: Sequence[str | os.PathLike]) -> tuple[list[Ledger], list[tuple[Path, str]]]:
    ledgers, skipped = scan_results(paths)
    if not ledgers:
        why = f" ({len(skipped)} other JSON file(s) skipped)" if skipped else ""
        raise FileNotFoundError(f"no ledgers (results JSON) found in "
                                f"{', '.join(map(str, paths))}{why}")
    return ledgers, skipped


def _env_line(led: Ledger) -> str:
    e = led.env
    cc = e.get("compute_capability")
    cc_s = f" sm{cc[0]}{cc[1]}" if cc else ""
    size = "smoke" if led.smoke else "full"
    return (f"{e.get('device_name', '?')}{cc_s}, torch {e.get('torch_version', '?')}, "
            f"CUDA {e.get('cuda_version') or 'n/a'}, {size} size, {led.created}")


def markdown_report(ledgers: Sequence[Ledger]) -> str:
    parts = ["# Results", ""]
    missed = [(led, e) for led in ledgers for e in led.expectations.values() if e.status == NOT_MET]
    if missed:
        parts += [f"**{len(missed)} expectation(s) not met:**", ""]
        parts += [f"- {led.notebook}: {e.line()}" for led, e in missed]
        parts.append("")
    for led in ledgers:
        parts += [f"## {led.notebook}", "", f"_{_env_line(led)}_", "", led.to_markdown(), ""]
    return "\n".join(parts)


def write_report(paths: Sequence[str | os.PathLike], out: str | os.PathLike | None = None,
                 plots: bool = True) -> Path:
    """Write ``report.md`` (and one bar plot per notebook of its ratios, unit ``x``).

    Files that are not ledgers are listed at the end of the report, with why.

    Returns the path of the markdown file.
    """
    ledgers, skipped = _found_ledgers(paths)
    first = Path(paths[0])
    out_path = Path(out) if out else (first if first.is_dir() else first.parent) / "report.md"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    text = markdown_report(ledgers)
    if plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from .plots import speedup_bars

        images = []
        for led in ledgers:
            ratios = {m.name: m.value for m in led.measurements.values() if m.unit == "x"}
            if not ratios:
                continue
            ax = speedup_bars(ratios, title=f"{led.notebook}\n{_env_line(led)}", baseline="",
                              xlabel="measured ratio (x); the dashed line marks 1x")
            png = out_path.parent / (led.notebook.replace("/", "__") + ".png")
            ax.figure.savefig(png, bbox_inches="tight")
            plt.close(ax.figure)
            images.append(png)
        if images:
            text += "\n## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in images) + "\n"
    if skipped:
        text += "\n## Files skipped\n\n" + "\n".join(f"- `{f}`: {why}" for f, why in skipped) + "\n"
    out_path.write_text(text, encoding="utf-8")
    return out_path
