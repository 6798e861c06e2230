"""Turn ledgers (results JSON) into a markdown results page and plots.

``python -m utils report DIR...`` reads every ledger under the folders it is given (and, in a
recorded run's folder, the capstone's ``train.log``) and writes one page: where each notebook
was last measured (GPU, torch, commit, date), then per notebook each claim with its threshold,
the value and the verdict, for every device it was measured on. A recorded run's folder may
hold a ``provenance.json`` (GPU, driver, torch, commit, date, how it was run) that fills in what
an older ledger did not record itself.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

from .claims import claims_section
from ..ledger import MET, NOT_APPLICABLE, NOT_MET, Ledger, Record

__all__ = ["load_ledgers", "scan_results", "markdown_report", "write_report", "parse_train_log",
           "PROVENANCE_FILE"]

# A ledger is a few kB; anything this large (a profiler trace, say) is not one.
MAX_LEDGER_BYTES = 20 * 2**20
# Written by the runner beside the ledgers; not a ledger, and not worth a note.
RUNNER_FILES = {"run.json"}
#: A recorded run's facts (GPU, driver, torch, commit, date, how), beside its ledgers.
PROVENANCE_FILE = "provenance.json"
#: Folders skipped when a folder is scanned: ``results/local/`` (git ignores it) holds the
#: runs of whoever works in this checkout; pass it by name to report on it.
LOCAL_DIR = "local"


def _provenance(path: Path) -> dict[str, Any]:
    """The nearest ``provenance.json`` in the file's folder or a folder above it."""
    for folder in [path.parent, *path.parent.parents]:
        f = folder / PROVENANCE_FILE
        if f.is_file():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return {}
            return data if isinstance(data, dict) else {}
    return {}


_TRAIN_PATTERNS = {
    "device": re.compile(r"^device (\S+) x (\d+) process\(es\), torch (\S+); preset (\w+)"),
    "rung": re.compile(r"^settings \('(.+?)' \+ flags\): (.*)$"),
    "flags": re.compile(r"^\s+the same settings as flags: (.*)$"),
    "flops": re.compile(r"^FLOPs per step per process: ([\d.]+) GFLOP"),
    "batch": re.compile(r"^batch: (\d+) x (\d+) tokens per step"),
    "vocab": re.compile(r"vocabulary (\d+) \(padded to (\d+)\)"),
    "first": re.compile(r"^first step \(.*\): ([\d.]+) s"),
    "done": re.compile(r"^done: final loss ([\d.]+), ([\d,]+) tokens/s"),
    "mfu": re.compile(r"^MFU per process, last window: ([\d.]+) TFLOP/s = ([\d.]+)% of the "
                      r"(\w+) matmul ceiling measured here \(([\d.]+) TFLOP/s\)"
                      r"(?:, ([\d.]+)% of the datasheet peak \(([\d.]+) TFLOP/s dense, (.+)\))?"),
}


def parse_train_log(path: str | os.PathLike, provenance: dict[str, Any] | None = None) -> Ledger:
    """A ledger of the figures ``06-capstone/train.py`` printed in a log (one run per block).

    For logs of runs made before train.py wrote its own ledger (``--results``): every value
    is read from the printed lines, none typed in. Each rung's figures are named after it,
    e.g. ``tokens_per_s [fp32 eager]``.

    Raises:
        ValueError: the log holds no complete train.py run.
    """
    p = Path(path)
    prov = provenance if provenance is not None else _provenance(p)
    runs: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        for key, pat in _TRAIN_PATTERNS.items():
            m = pat.search(line)
            if not m:
                continue
            if key == "device":
                cur = {"device": m.group(1), "world": int(m.group(2)), "torch": m.group(3),
                       "preset": m.group(4)}
                runs.append(cur)
            elif cur:
                cur[key] = m.groups()
    runs = [r for r in runs if "done" in r and "rung" in r]
    if not runs:
        raise ValueError(f"{p} holds no complete train.py run (no 'settings' and 'done' lines)")
    device_name = next((r["mfu"][6] for r in runs if r.get("mfu") and r["mfu"][6]), "?")
    env = {"device": runs[0]["device"], "device_name": device_name,
           "torch_version": runs[0]["torch"], "gpu_count": None, "compute_capability": None}
    led = Ledger("06-capstone/train", smoke=runs[0]["preset"] == "tiny", env=env, strict=False)
    led.created = str(prov.get("date", ""))
    led.commit = str(prov.get("commit", ""))
    led.source_note = f"parsed from {p.name}"  # type: ignore[attr-defined]

    def rec(name: str, value: float, unit: str, note: str = "") -> None:
        led.measurements[name] = Record(name, float(value), unit, note)

    for r in runs:
        rung = r["rung"][0]
        flags = r["flags"][0] if "flags" in r else r["rung"][1]
        rec(f"tokens_per_s [{rung}]", float(r["done"][1].replace(",", "")), "tokens/s",
            note=f"{flags}; the last logging window")
        rec(f"final_loss [{rung}]", float(r["done"][0]), "")
        if "first" in r:
            rec(f"first_step_s [{rung}]", float(r["first"][0]), "s")
        if "flops" in r:
            rec(f"flops_per_step [{rung}]", float(r["flops"][0]) * 1e9, "FLOP")
        if "vocab" in r:
            rec(f"vocab_size [{rung}]", float(r["vocab"][0]), "tokens",
                note=f"padded to {r['vocab'][1]}")
        if r.get("mfu"):
            tflops, pct, kind, ceiling, ds_pct, ds_peak, _ = r["mfu"]
            rec(f"model_tflops [{rung}]", float(tflops), "TFLOP/s", note="per process")
            rec(f"mfu_vs_measured_ceiling [{rung}]", float(pct) / 100, "fraction",
                note=f"of the {kind} matmul ceiling measured there, {ceiling} TFLOP/s")
            if ds_pct:
                rec(f"mfu_vs_datasheet [{rung}]", float(ds_pct) / 100, "fraction",
                    note=f"of the datasheet's {ds_peak} TFLOP/s dense {kind}")
    if len(runs) > 1:
        first, last = runs[0], runs[-1]
        ratio = float(last["done"][1].replace(",", "")) / float(first["done"][1].replace(",", ""))
        rec(f"speedup [{last['rung'][0]} over {first['rung'][0]}]", ratio, "x",
            note="tokens/s of the two runs of this log")
    return led


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
        if p.is_dir():
            found = sorted(p.rglob("*.json")) + sorted(p.rglob("train*.log"))
            # results/local/ holds this machine's own runs, not the course's records
            files += [f for f in found if LOCAL_DIR not in f.relative_to(p).parts[:-1]]
        else:
            files.append(p)
    ledgers, skipped = [], []
    for f in files:
        if f.name in RUNNER_FILES or f.name.endswith(".run.json") or f.name == PROVENANCE_FILE:
            continue
        if f.suffix == ".log":
            try:
                led = parse_train_log(f)
            except (ValueError, UnicodeDecodeError) as exc:
                skipped.append((f, f"a log, but not train.py's ({exc})"))
                continue
            led.source = f  # type: ignore[attr-defined]
            led.provenance = _provenance(f)  # type: ignore[attr-defined]
            ledgers.append(led)
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
            led = Ledger.from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            skipped.append((f, f"a damaged ledger ({type(exc).__name__}: {exc})"))
            continue
        led.source = f  # type: ignore[attr-defined]
        led.provenance = _provenance(f)  # type: ignore[attr-defined]
        if not led.commit and led.provenance.get("commit"):  # type: ignore[attr-defined]
            led.commit = str(led.provenance["commit"])  # type: ignore[attr-defined]
        ledgers.append(led)
    return sorted(ledgers, key=lambda led: (led.notebook, led.created)), skipped


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
    commit = f", commit {led.commit}" if getattr(led, "commit", "") else ""
    cuda = f", CUDA {e.get('cuda_version')}" if e.get("cuda_version") else ""
    return (f"{e.get('device_name', '?')}{cc_s}, torch {e.get('torch_version', '?')}{cuda}, "
            f"{size} size, {led.created or 'date unknown'}{commit}")


def _date(led: Ledger) -> str:
    return (led.created or "")[:10] or "?"


def _counts(led: Ledger) -> str:
    n = {s: sum(e.status == s for e in led.expectations.values())
         for s in (MET, NOT_MET, NOT_APPLICABLE)}
    return f"{n[MET]} / {n[NOT_MET]} / {n[NOT_APPLICABLE]}"


def _version_note(led: Ledger) -> str:
    """``current`` when the notebook (or script) is unchanged since the ledger's commit,
    ``changed since`` when it changed, ``""`` when git cannot tell."""
    import subprocess

    from ..ledger import REPO_ROOT

    commit = (led.commit or "").replace("+dirty", "")
    if not commit:
        return ""
    name = led.notebook
    script = re.fullmatch(r"(.+/train)(?:_[a-z0-9_]+)?", name)  # train.py's ledgers, any kind
    path = f"{script.group(1)}.py" if script else f"{name}.ipynb"
    if not (REPO_ROOT / path).exists() and (REPO_ROOT / f"{name}.py").exists():
        path = f"{name}.py"   # a command-line script's ledger (compile_benchmark, amp_training)
    if not (REPO_ROOT / path).exists():
        return ""
    try:
        r = subprocess.run(["git", "-C", str(REPO_ROOT), "diff", "--quiet", commit, "HEAD", "--",
                            path], capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    if r.returncode == 0:
        return "current" + (" (uncommitted changes then)" if led.commit.endswith("+dirty") else "")
    return "changed since" if r.returncode == 1 else ""


def _where_table(ledgers: Sequence[Ledger]) -> list[str]:
    """One row per notebook and device: the latest ledger."""
    latest: dict[tuple[str, str], Ledger] = {}
    for led in ledgers:
        key = (led.notebook, str(led.env.get("device_name", "?")))
        if key not in latest or led.created >= latest[key].created:
            latest[key] = led
    rows = ["| notebook | device | torch | size | date | commit | notebook since | claims met / "
            "not met / n/a | note |", "|---|---|---|---|---|---|---|---|---|"]
    for (nb, device), led in sorted(latest.items()):
        prov = getattr(led, "provenance", {}) or {}
        notes = []
        if led.shared:
            notes.append(f"{led.shared_jobs} notebooks at once: times are not measurements")
        if nb in (prov.get("incomplete") or {}):
            notes.append("incomplete: " + prov["incomplete"][nb])
        if getattr(led, "source_note", ""):
            notes.append(led.source_note)  # type: ignore[attr-defined]
        rows.append(f"| {nb} | {device} | {led.env.get('torch_version', '?')} | "
                    f"{'smoke' if led.smoke else 'full'} | {_date(led)} | {led.commit or '?'} | "
                    f"{_version_note(led) or '?'} | {_counts(led)} | {'; '.join(notes)} |")
    return rows


def markdown_report(ledgers: Sequence[Ledger]) -> str:
    """The results page: where each notebook was measured, then each notebook's claims and
    measurements per device, run by run."""
    parts = ["# Results", ""]
    missed = [(led, e) for led in ledgers for e in led.expectations.values() if e.status == NOT_MET]
    if missed:
        parts += [f"**{len(missed)} expectation(s) not met:**", ""]
        parts += [f"- {led.notebook} ({led.env.get('device_name', '?')}, {_date(led)}): {e.line()}"
                  for led, e in missed]
        parts.append("")
    # the popular claims, judged by what was measured (and whether the notebook changed since)
    parts += claims_section(ledgers, version_note=lambda led: {
        "changed since": "changed since that commit"}.get(_version_note(led), ""))
    parts += ["## Where each notebook was last measured", "",
              "\"notebook since\": whether the notebook (for a command-line script, such as the "
              "capstone's train.py, the script) "
              "is unchanged since the commit it was measured at (\"current\") or has changed "
              "since, so that its figures come from an earlier version.", ""]
    parts += _where_table(ledgers) + [""]
    for led in ledgers:
        prov = getattr(led, "provenance", {}) or {}
        parts += [f"## {led.notebook}", "", f"_{_env_line(led)}_", ""]
        if prov:
            bits = [f"{k} {prov[k]}" for k in ("driver", "cpu_cores", "how") if prov.get(k)]
            if bits:
                parts += ["_" + "; ".join(bits) + "_", ""]
        parts += [led.to_markdown(), ""]
    return "\n".join(parts)


def unfinished_runs(paths: Sequence[str | os.PathLike]) -> list[tuple[Path, dict[str, Any]]]:
    """The notebooks that a runner's ``run.json`` (in the given folders, ``local/`` skipped as
    for ledgers) records as not having run cleanly: failed, malformed, interrupted or not run.
    A failed notebook may have written a ledger with few or no numbers, so the report lists
    them apart."""
    found: list[tuple[Path, dict[str, Any]]] = []
    for raw in paths:
        p = Path(raw)
        if not p.is_dir():
            continue
        for f in sorted(p.rglob("run.json")):
            if LOCAL_DIR in f.relative_to(p).parts[:-1]:
                continue
            try:
                runs = json.loads(f.read_text(encoding="utf-8")).get("runs", [])
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                continue
            found += [(f, r) for r in runs if isinstance(r, dict) and r.get("status") != "ok"]
    return found


def _unfinished_section(unfinished: Sequence[tuple[Path, dict[str, Any]]]) -> str:
    lines = [f"**{len(unfinished)} notebook(s) did not run cleanly** (from the runner's "
             "run.json; their ledgers, where they wrote one, hold only what they measured "
             "before):", ""]
    for f, r in unfinished:
        lines.append(f"- {r.get('notebook', '?')}: {str(r.get('status', '?')).upper()}: "
                     f"{r.get('summary', '')} (`{f}`)")
    return "\n".join(lines) + "\n\n"


def write_report(paths: Sequence[str | os.PathLike], out: str | os.PathLike | None = None,
                 plots: bool = True, figures: str | os.PathLike | None = None) -> Path:
    """Write ``report.md`` (and one bar plot per notebook of its ratios, unit ``x``).

    Files that are not ledgers are listed at the end of the report, with why; notebooks that a
    runner's ``run.json`` records as failed, interrupted or not run, at the top
    (:func:`unfinished_runs`).

    Args:
        paths: ledger files and folders (searched recursively; ``local/`` folders skipped).
        out: the markdown file (default: ``report.md`` in the first folder).
        plots: draw the plots.
        figures: the folder for the plots (default: beside the markdown file).

    Returns the path of the markdown file.

    Raises:
        FileNotFoundError: a path does not exist, or the paths hold neither a ledger nor a
            ``run.json`` that records a notebook that did not run cleanly.
    """
    unfinished = unfinished_runs(paths)
    first = Path(paths[0])
    out_path = Path(out) if out else (first if first.is_dir() else first.parent) / "report.md"
    try:
        ledgers, skipped = _found_ledgers(paths)
    except FileNotFoundError as exc:
        if not unfinished:  # nothing to report
            raise
        # every notebook stopped before it wrote a ledger (a broken environment, say): say so
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(f"# Results\n\n{_unfinished_section(unfinished)}{exc}.\n",
                            encoding="utf-8")
        return out_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig_dir = Path(figures) if figures else out_path.parent
    fig_dir.mkdir(parents=True, exist_ok=True)
    text = markdown_report(ledgers)
    if unfinished:
        head, _, rest = text.partition("\n\n")  # after the title
        text = f"{head}\n\n{_unfinished_section(unfinished)}{rest}"
    if plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from ..plots import speedup_bars

        images = []
        for led in ledgers:
            ratios = {m.name: m.value for m in led.measurements.values() if m.unit == "x"}
            if not ratios:
                continue
            ax = speedup_bars(ratios, title=f"{led.notebook}\n{_env_line(led)}", baseline="",
                              xlabel="measured ratio (x); the dashed line marks 1x")
            stem = led.notebook.replace("/", "__")
            device = str(led.env.get("device_name", "")).replace(" ", "-")
            png = fig_dir / (f"{stem}__{device}__{_date(led)}.png" if figures else f"{stem}.png")
            ax.figure.savefig(png, bbox_inches="tight")
            plt.close(ax.figure)
            images.append(png)
        if images:
            text += "\n## Plots\n\n" + "\n".join(
                f"![{p.stem}]({os.path.relpath(p, out_path.parent)})" for p in images) + "\n"
    if skipped:
        text += "\n## Files skipped\n\n" + "\n".join(f"- `{f}`: {why}" for f, why in skipped) + "\n"
    out_path.write_text(text, encoding="utf-8")
    return out_path
