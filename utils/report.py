"""Turn ledgers (results JSON) into a markdown report and plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from .ledger import NOT_MET, Ledger

__all__ = ["load_ledgers", "markdown_report", "write_report"]


def load_ledgers(paths: Sequence[str | os.PathLike]) -> list[Ledger]:
    """Load ledger JSON files, searching folders recursively (``run.json`` is skipped).

    Raises:
        FileNotFoundError: a path does not exist, or nothing was found.
    """
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"no such results file or folder: {raw}")
        files += sorted(p.rglob("*.json")) if p.is_dir() else [p]
    ledgers = []
    for f in files:
        if f.name == "run.json":
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f} is not valid JSON: {exc}") from None
        if isinstance(data, dict) and "measurements" in data and "notebook" in data:
            ledgers.append(Ledger.from_dict(data))
    if not ledgers:
        raise FileNotFoundError(f"no ledgers (results JSON) found in {', '.join(map(str, paths))}")
    return sorted(ledgers, key=lambda led: led.notebook)


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

    Returns the path of the markdown file.
    """
    ledgers = load_ledgers(paths)
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
    out_path.write_text(text, encoding="utf-8")
    return out_path
