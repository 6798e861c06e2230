"""Run notebooks headless with papermill: one notebook, a module, or several.

Used by ``python -m utils run`` on cluster nodes and by the test-suite. Each
notebook runs in a fresh kernel in its own folder; the executed copy is
written even when a cell fails (papermill saves as it goes), the ledgers go
to ``OUT/results/``, and ``OUT/run.json`` says what ran, how long, and what
failed. A failure in one notebook does not stop the others.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .env import SMOKE_ENV_VAR
from .ledger import REPO_ROOT, RESULTS_ENV_VAR

__all__ = ["NotebookRun", "find_notebooks", "run_notebooks", "default_out_dir"]

NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"


@dataclass(frozen=True)
class NotebookRun:
    notebook: str
    executed: str
    status: str  # "ok" or "failed"
    seconds: float
    error: str = ""


def find_notebooks(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand notebook files and module folders (``NN_*.ipynb`` inside) in order.

    Raises:
        FileNotFoundError: a path does not exist, or a folder holds no notebooks.
        ValueError: a file is not a ``.ipynb`` notebook.
    """
    if not paths:
        raise ValueError("name at least one notebook or module folder")
    found: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"no such notebook or module folder: {raw}")
        if p.is_dir():
            nbs = sorted(p.glob(NOTEBOOK_GLOB))
            if not nbs:
                raise FileNotFoundError(f"{raw} holds no notebooks named like {NOTEBOOK_GLOB}")
            found += nbs
        elif p.suffix != ".ipynb":
            raise ValueError(f"{raw} is not a Jupyter notebook (.ipynb)")
        else:
            found.append(p)
    return [f.resolve() for f in dict.fromkeys(found)]


def _stream_papermill_log() -> None:
    """Print papermill's log (where it puts cell output with ``log_output``) to stderr.

    papermill's own CLI configures logging; called as a library it stays
    silent unless we do.
    """
    log = logging.getLogger("papermill")
    if not any(getattr(h, "_course_stream", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._course_stream = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def default_out_dir() -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return REPO_ROOT / "results" / "local" / f"run-{stamp}"


def _relative_name(nb: Path) -> Path:
    try:
        return nb.relative_to(REPO_ROOT)
    except ValueError:
        return Path(nb.parent.name) / nb.name


def run_notebooks(
    paths: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    smoke: bool | None = None,
    timeout_s: int | None = None,
    kernel: str = "python3",
    log_output: bool = False,
    progress: bool = True,
) -> list[NotebookRun]:
    """Execute notebooks with papermill; returns one :class:`NotebookRun` each.

    Args:
        paths: notebooks and/or module folders.
        out_dir: where executed notebooks, ledgers and ``run.json`` go.
        smoke: ``True``/``False`` force the size; ``None`` lets each notebook
            decide (smoke on CPU, full on GPU, or ``$COURSE_SMOKE``).
        timeout_s: per-cell time limit in seconds (``None``: no limit).
        kernel: the Jupyter kernel name.
        log_output: stream cell output to this process's log (for batch jobs).
    """
    import papermill as pm

    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
    notebooks = find_notebooks(paths)
    if log_output:
        _stream_papermill_log()
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results"
    params = {} if smoke is None else {"SMOKE": bool(smoke)}
    saved_env = {k: os.environ.get(k) for k in (RESULTS_ENV_VAR, SMOKE_ENV_VAR)}
    os.environ[RESULTS_ENV_VAR] = str(results.resolve())
    if smoke is not None:
        os.environ[SMOKE_ENV_VAR] = "1" if smoke else "0"
    runs: list[NotebookRun] = []
    try:
        for nb in notebooks:
            target = out / _relative_name(nb)
            target.parent.mkdir(parents=True, exist_ok=True)
            print(f"==> {_relative_name(nb)}", flush=True)
            t0 = time.perf_counter()
            error = ""
            try:
                pm.execute_notebook(
                    str(nb), str(target), parameters=params, kernel_name=kernel,
                    cwd=str(nb.parent), execution_timeout=timeout_s,
                    progress_bar=progress, log_output=log_output,
                )
            except Exception as exc:  # noqa: BLE001 - any failure is reported, the rest run on
                error = f"{type(exc).__name__}: {exc}".strip()
            seconds = time.perf_counter() - t0
            run = NotebookRun(str(_relative_name(nb)), str(target), "failed" if error else "ok",
                              round(seconds, 2), error[-4000:])
            runs.append(run)
            print(f"    {run.status} in {seconds:.1f} s -> {target}", flush=True)
            if error:
                print("    " + error.splitlines()[-1][:500] if error.splitlines() else "", flush=True)
            (out / "run.json").write_text(json.dumps({
                "smoke": smoke, "results_dir": str(results), "runs": [asdict(r) for r in runs],
            }, indent=2), encoding="utf-8")
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return runs
