"""Run notebooks headless with papermill: one notebook, a module, or several.

Used by ``python -m utils run`` on cluster nodes and by the test-suite. Each
notebook runs in a fresh kernel in its own folder; the executed copy is
written even when a cell fails (papermill saves as it goes), the ledgers go
to ``OUT/results/``, and ``OUT/run.json`` says what ran, how long, and what
failed. A failure in one notebook does not stop the others.

Two things make a headless run differ from stock papermill, both so that a run
never waits on something that is not coming and never reports a stuck cell as
done:

* **No widget is mimicked.** nbclient (under papermill) imitates the
  front end of an ipywidgets ``Output`` widget (the one inside
  ``widgets.interactive``): it sends a ``comm_msg`` back to the kernel on the
  shell socket for every output the widget captures, while another coroutine
  is waiting on that same socket for the cell's ``execute_reply``.
  jupyter_client sends through a plain (non-asyncio) shadow of the socket, so
  pyzmq's asyncio layer never re-checks the socket after that send; when the
  reply's arrival is consumed by the send, the wait is not woken until its
  timeout, or never when there is none (upstream: jupyter/nbclient#312).
  Our client registers no widget mimic: nothing is written to the kernel while
  a cell runs, and what a widget's callback prints lands in the cell's output,
  where a log or an executed copy shows it.
* **Every cell has a time limit, and reaching it fails the notebook.** A cell
  whose execution lasts the whole limit fails with a message naming the cell,
  even when the kernel's reply turns up at the deadline.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import functools
import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from ..ledger import REPO_ROOT, RESULTS_ENV_VAR, SHARED_ENV_VAR, SMOKE_ENV_VAR, ledger_file_name
from ..sizes import COMPILE_THREADS_ENV_VAR, compile_threads_per_job, usable_cpu_count

__all__ = [
    "DEFAULT_CELL_TIMEOUT_S",
    "NotebookRun",
    "find_notebooks",
    "run_notebooks",
    "default_out_dir",
    "summarize_failure",
    "stop_on_sigterm",
]

NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"
#: Per-cell limit of ``python -m utils run`` when ``--timeout`` is not given: a
#: batch job must never hang forever. The longest full-size cell of the course
#: (a capstone ladder rung sweep) is meant to finish in about 10 minutes on one GPU.
DEFAULT_CELL_TIMEOUT_S = 1800
ENGINE_NAME = "course"
TIMEOUT_ENAME = "CellTimeoutError"
DEAD_KERNEL_ENAME = "DeadKernelError"
#: Set when the run is being stopped (Ctrl-C, or SIGTERM through :func:`stop_on_sigterm`): a
#: kernel that dies then died of the stop, not of a crash or a lack of memory.
_STOPPING = threading.Event()


@dataclass(frozen=True)
class NotebookRun:
    """What happened to one notebook.

    ``status`` is ``"ok"``, ``"failed"`` (a cell raised, timed out or killed
    the kernel; ``executed`` holds the copy with the error), ``"malformed"``
    (the file is not a notebook; nothing ran and ``executed`` is empty),
    ``"interrupted"`` (the run was stopped, by Ctrl-C or SIGTERM, while it ran; ``executed``
    holds the copy as far as it got) or ``"not run"`` (the run was stopped before it).
    ``summary`` is one line naming the failing cell and the exception's first
    line; ``error`` keeps the longer text. ``device`` and ``tier`` are what the notebook's
    ledger says it ran on (``"cpu"``, ``"cuda:0"``) and which column of its size table it read
    (``"smoke"``, ``"cpu"``, ``"gpu"``, ``"gpu-smoke"``); empty where it wrote no ledger.
    """

    notebook: str
    executed: str
    status: str
    seconds: float
    error: str = ""
    summary: str = ""
    cell: int | None = None
    device: str = ""
    tier: str = ""


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
    """``results/local/run-<date>-<time>-<process id>``: two runs started in the same second
    (the tasks of a job array, say) do not share a folder."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return REPO_ROOT / "results" / "local" / f"run-{stamp}-{os.getpid()}"


def stop_on_sigterm() -> None:
    """Make SIGTERM (what Slurm sends at a job's time limit, or on ``scancel``) stop a run the
    way Ctrl-C does: the notebook that was running is recorded as interrupted in ``run.json``
    and its copy is kept as far as it got. For the command line, in the main thread."""
    def handler(signum: int, frame: Any) -> None:
        _STOPPING.set()
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _ledger_facts(results: Path, name: str, since: float) -> tuple[str, str]:
    """The device and the size-table column that a notebook's ledger, written since ``since``
    (a ``time.time()``), records; empty strings where there is none."""
    stem = name[:-len(".ipynb")] if name.endswith(".ipynb") else name
    f = results / ledger_file_name(stem)
    try:
        if f.stat().st_mtime < since:
            return "", ""
        data = json.loads(f.read_text(encoding="utf-8"))
        return (str(data.get("env", {}).get("device", "")),
                str((data.get("sizes") or {}).get("tier", "")))
    except (OSError, ValueError, AttributeError):
        return "", ""


def _relative_name(nb: Path) -> Path:
    try:
        return nb.relative_to(REPO_ROOT)
    except ValueError:
        return Path(nb.parent.name) / nb.name


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


# Cells papermill adds to an executed copy: an error banner and anchor, and the
# injected parameters. Cell positions are counted without them, as in the source.
_ADDED_TAGS = {"papermill-error-cell-tag", "injected-parameters"}


def _source_cells(cells: Sequence[Any]) -> list[tuple[int, Any]]:
    """(index in the executed copy, cell) for the cells that come from the source notebook."""
    return [(i, c) for i, c in enumerate(cells)
            if not _ADDED_TAGS & set(c.get("metadata", {}).get("tags", []))]


def _describe_cell(cell: Any, position: int, n_cells: int) -> str:
    """``cell 33 of 47 (In [17]: `explorer = ...`)``: how a person finds the cell.

    ``position`` is 0-based among the source notebook's cells.
    """
    count = cell.get("execution_count")
    first = _first_line(cell.get("source", ""))
    if len(first) > 60:
        first = first[:57] + "..."
    where = f"In [{count}]: " if count else ""
    return f"cell {position + 1} of {n_cells} ({where}`{first}`)"


def summarize_failure(nb: Any) -> tuple[str, int | None]:
    """One line for the first failing cell of an executed notebook, and its index.

    The line names the cell (position, execution count, first source line) and
    the exception's first line: ``cell 33 of 47 (In [17]: `x = f()`): ValueError:
    bad size``; the index is the cell's 0-based position in the source notebook
    (papermill's added cells not counted). Returns ``("", None)`` when no cell failed.
    """
    cells = _source_cells(nb.cells)
    for i, (_, cell) in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        errors = [out for out in cell.get("outputs", []) if out.get("output_type") == "error"
                  and not (out.get("ename") == "SystemExit"
                           and str(out.get("evalue", "")) in ("", "0"))]
        if errors:
            # The last one: after a timeout the cell holds the interrupt's
            # KeyboardInterrupt, then the runner's own CellTimeoutError.
            out = errors[-1]
            evalue = _first_line(out.get("evalue", ""))
            exc = f"{out.get('ename', 'Error')}: {evalue}" if evalue else out.get("ename", "Error")
            return f"{_describe_cell(cell, i, len(cells))}: {exc}", i
        if cell.get("metadata", {}).get("papermill", {}).get("exception"):
            return f"{_describe_cell(cell, i, len(cells))}: failed without an error output", i
    return "", None


@functools.cache
def _make_engine():
    """The papermill engine that runs notebooks with :class:`CourseNotebookClient`.

    Built on first use so that importing :mod:`utils` does not import papermill.
    """
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from nbclient.util import run_sync
    from nbformat.v4 import new_output
    from papermill.clientwrap import PapermillNotebookClient
    from papermill.engines import NBClientEngine, papermill_engines

    class CourseNotebookClient(PapermillNotebookClient):
        """papermill's client without widget mimics, failing any cell that reaches its limit."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # No front-end mimic for any widget (see the module docstring): the
            # stock client registers one for Output widgets, whose messages to the
            # kernel can hide a cell's reply from the wait that expects it.
            self.widget_registry = {}
            self._stop_early = False

        def _fail_cell(self, cell: Any, ename: str, message: str) -> None:
            cell.outputs.append(new_output("error", ename=ename, evalue=message,
                                           traceback=[f"{ename}: {message}"]))
            self._stop_early = True
            raise CellExecutionError(message, ename, message)

        async def _interrupt_and_settle(self, wait_s: float = 10.0) -> None:
            """Interrupt the stuck cell and give the kernel a moment to answer.

            A cell that honours the interrupt replies with a KeyboardInterrupt (its
            traceback, which shows where it was stuck, lands in the cell); shutting
            the kernel down before that makes it print an error of its own.
            """
            if self.km is None or self.kc is None:
                return
            await _maybe_await(self.km.interrupt_kernel())
            deadline = time.monotonic() + wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msg = await _maybe_await(self.kc.shell_channel.get_msg(timeout=left))
                except Exception:  # noqa: BLE001 - queue.Empty: no reply in time
                    return
                if msg.get("msg_type") == "execute_reply":
                    await asyncio.sleep(0.5)  # let the traceback reach the cell on IOPub
                    return

        async def async_execute_cell(self, cell: Any, cell_index: int, *args: Any,
                                     **kwargs: Any) -> Any:
            limit = self._get_timeout(cell)
            t0 = time.monotonic()
            source = _source_cells(self.nb.cells)
            position = next((k for k, (i, _) in enumerate(source) if i == cell_index), cell_index)
            where = _describe_cell(cell, position, len(source))
            try:
                result = await super().async_execute_cell(cell, cell_index, *args, **kwargs)
            except CellTimeoutError:
                await self._interrupt_and_settle()
                self._fail_cell(cell, TIMEOUT_ENAME,
                                f"this cell ran into the per-cell timeout of {limit} s; give it "
                                "more time with --timeout SECONDS if it needs it")
            except DeadKernelError:
                self._fail_cell(cell, DEAD_KERNEL_ENAME,
                                "the run was stopped (Ctrl-C or SIGTERM) while this cell ran"
                                if _STOPPING.is_set() else
                                "the kernel died while running this cell (out of memory, a crash "
                                "in native code, or os._exit)")
            elapsed = time.monotonic() - t0
            if limit is not None and cell.get("cell_type") == "code" and elapsed >= limit:
                # The reply came only when the wait for it ran out: the cell took
                # the whole limit, whatever the kernel says now.
                self._fail_cell(cell, TIMEOUT_ENAME,
                                f"this cell took {elapsed:.0f} s, reaching the per-cell timeout of "
                                f"{limit} s; give it more time with --timeout SECONDS if it needs it")
            return result

        # nbclient binds its synchronous wrapper to the base class's coroutine.
        execute_cell = run_sync(async_execute_cell)

        def execute(self, **kwargs: Any) -> Any:
            self.reset_execution_trackers()
            with self.setup_kernel(**kwargs):
                self.log.info(f"Executing notebook with kernel: {self.kernel_name}")
                self.papermill_execute_cells()
                if not self._stop_early:  # a stuck or dead kernel would not answer
                    info = self.wait_for_reply(self.kc.kernel_info())
                    if info:
                        self.nb.metadata["language_info"] = info["content"]["language_info"]
                self.set_widgets_metadata()
            return self.nb

    class CourseEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, log_output=False,
                                     stdout_file=None, stderr_file=None, start_timeout=60,
                                     execution_timeout=None, **kwargs):
            kwargs.pop("input_path", None)
            kwargs.pop("timeout", None)
            kwargs.pop("startup_timeout", None)
            return CourseNotebookClient(
                nb_man, timeout=execution_timeout, startup_timeout=start_timeout,
                kernel_name=kernel_name, log=logging.getLogger("papermill"),
                log_output=log_output, stdout_file=stdout_file, stderr_file=stderr_file,
                **kwargs,
            ).execute()

    papermill_engines.register(ENGINE_NAME, CourseEngine)
    return CourseEngine


async def _maybe_await(x: Any) -> Any:
    if hasattr(x, "__await__"):
        return await x
    return x


def _check_notebook(path: Path) -> str:
    """An empty string if ``path`` reads as a notebook, else why it does not."""
    import nbformat

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - JSON errors, NotJSONError, unknown nbformat, ...
        return f"{type(exc).__name__}: {_first_line(str(exc)) or 'unreadable'}"
    if not isinstance(nb.get("cells"), list):
        return "it has no list of cells"
    return ""


def _run_one(nb: Path, out: Path, params: dict[str, Any], kernel: str, timeout_s: int | None,
             start_timeout_s: int, progress: bool, log_output: bool) -> NotebookRun:
    """Execute one notebook into ``out`` (in this process); never raises for the notebook's
    own failure, which the returned :class:`NotebookRun` describes."""
    import nbformat
    import papermill as pm

    name = str(_relative_name(nb))
    problem = _check_notebook(nb)
    if problem:
        return NotebookRun(name, "", "malformed", 0.0, problem,
                           f"not a valid notebook ({problem}); nothing was executed")
    _make_engine()
    if log_output:
        _stream_papermill_log()
    target = out / _relative_name(nb)
    target.parent.mkdir(parents=True, exist_ok=True)
    t0, started = time.perf_counter(), time.time()
    error = ""
    try:
        pm.execute_notebook(
            str(nb), str(target), parameters=params, kernel_name=kernel,
            cwd=str(nb.parent), execution_timeout=timeout_s,
            start_timeout=start_timeout_s, engine_name=ENGINE_NAME,
            progress_bar=progress, log_output=log_output,
        )
    except Exception as exc:  # noqa: BLE001 - any failure is reported, the rest run on
        error = f"{type(exc).__name__}: {exc}".strip() or type(exc).__name__
    seconds = time.perf_counter() - t0
    summary, cell = "", None
    if error:
        if target.exists():
            summary, cell = summarize_failure(nbformat.read(target, as_version=4))
        summary = summary or _first_line(error)
    device, tier = _ledger_facts(out / "results", name, started)
    return NotebookRun(name, str(target) if target.exists() else "",
                       "failed" if error else "ok", round(seconds, 2),
                       error[-4000:], summary, cell, device, tier)


def _stopped(nb: Path, out: Path, started: float | None) -> NotebookRun:
    """The record of a notebook the run was stopped in (``started``: its ``time.time()`` at
    start) or before (``None``)."""
    name = str(_relative_name(nb))
    if started is None:
        return NotebookRun(name, "", "not run", 0.0, "", "the run was stopped before it started")
    target = out / _relative_name(nb)
    device, tier = _ledger_facts(out / "results", name, started)
    return NotebookRun(name, str(target) if target.exists() else "", "interrupted",
                       round(time.time() - started, 2), "",
                       "the run was stopped (Ctrl-C or SIGTERM) while it ran; the copy holds "
                       "what it did so far", None, device, tier)


def _usable_out_dir(out: Path) -> None:
    """Make ``out`` and check that files can be written in it, or raise a ValueError that
    names it (the command line turns that into one line and exit code 2)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("", encoding="utf-8")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"cannot use {out} as the output folder: "
                         f"{exc.strerror or type(exc).__name__}"
                         + (f" ({exc.filename})" if exc.filename and str(exc.filename) != str(out)
                            else "")) from None


def _worker_env(env: dict[str, str]) -> None:
    """A pool worker's environment: the kernels it starts inherit it."""
    os.environ.update(env)


def _where(run: NotebookRun) -> str:
    """`` on cpu, smoke column``: what the notebook's ledger says it ran on."""
    if not run.device:
        return ""
    return f" on {run.device}" + (f", {run.tier} column" if run.tier else "")


def _report_end(run: NotebookRun, jobs: int) -> None:
    who = f"{run.notebook}: " if jobs > 1 else "    "
    if run.status == "ok":
        print(f"{who}ok in {run.seconds:.1f} s{_where(run)} -> {run.executed}", flush=True)
    else:
        print(f"{who}{run.status.upper()}: {run.summary}", flush=True)


def run_notebooks(
    paths: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    smoke: bool | None = None,
    timeout_s: int | None = DEFAULT_CELL_TIMEOUT_S,
    kernel: str = "python3",
    log_output: bool = False,
    progress: bool = True,
    start_timeout_s: int = 120,
    jobs: int = 1,
) -> list[NotebookRun]:
    """Execute notebooks with papermill; returns one :class:`NotebookRun` each.

    Args:
        paths: notebooks and/or module folders.
        out_dir: where executed notebooks, ledgers and ``run.json`` go.
        smoke: ``True``/``False`` force the size; ``None`` lets each notebook
            decide (smoke on CPU, full on GPU, or ``$COURSE_SMOKE``).
        timeout_s: per-cell time limit in seconds; a cell that reaches it fails
            its notebook. ``None`` means no limit (for interactive use only: a
            batch job should always have one).
        kernel: the Jupyter kernel name.
        log_output: stream cell output to this process's log (for batch jobs).
        progress: show papermill's per-cell progress bar (off when ``jobs > 1``).
        start_timeout_s: how long a kernel may take to start.
        jobs: notebooks run at once, each in its own kernel (and its own worker process).
            With more than one, the notebooks share the machine: the runner says so to each
            (``COURSE_SHARED_JOBS``), their ledgers record it, and their timings are not
            measurements (see :mod:`utils.ledger`). Each kernel then gets its share of the
            cores for Inductor's compile workers (``TORCHINDUCTOR_COMPILE_THREADS``, from
            :func:`utils.sizes.compile_threads_per_job`) unless that variable is set already.

    A run that is stopped (Ctrl-C, or SIGTERM after :func:`stop_on_sigterm`) still writes
    ``run.json``: the notebook it was in is ``"interrupted"``, those it had not started
    ``"not run"``; then the ``KeyboardInterrupt`` goes on to the caller.

    Raises:
        ValueError: a non-positive timeout or job count, or an output folder that cannot be
            made or written to.
        FileNotFoundError: a path that does not exist.
    """
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int (notebooks run at once), got {jobs!r}")
    notebooks = find_notebooks(paths)
    jobs = min(jobs, len(notebooks))
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    _usable_out_dir(out)
    if (out / "run.json").exists():
        print(f"note: {out} holds an earlier run: the notebooks run now replace their copies and "
              "ledgers there, the others stay, and run.json will list this run only (a new "
              "--out keeps runs apart)", flush=True)
    results = (out / "results").resolve()
    params = {} if smoke is None else {"SMOKE": bool(smoke)}
    env = {RESULTS_ENV_VAR: str(results.resolve())}
    if smoke is not None:
        env[SMOKE_ENV_VAR] = "1" if smoke else "0"
    if jobs > 1:
        env[SHARED_ENV_VAR] = str(jobs)
        if COMPILE_THREADS_ENV_VAR not in os.environ:  # a value the user set is kept
            env[COMPILE_THREADS_ENV_VAR] = str(compile_threads_per_job(usable_cpu_count(), jobs))
    saved_env = {k: os.environ.get(k)
                 for k in (RESULTS_ENV_VAR, SMOKE_ENV_VAR, SHARED_ENV_VAR, COMPILE_THREADS_ENV_VAR)}
    os.environ.update(env)
    if jobs == 1:
        os.environ.pop(SHARED_ENV_VAR, None)  # one at a time: the machine is this run's
    done: dict[int, NotebookRun] = {}
    started: dict[int, float] = {}  # time.time() at each notebook's start
    warned_cpu_full = False

    def write_summary() -> None:
        (out / "run.json").write_text(json.dumps({
            "smoke": smoke, "timeout_s": timeout_s, "results_dir": str(results), "jobs": jobs,
            "runs": [asdict(done[i]) for i in sorted(done)],
        }, indent=2), encoding="utf-8")

    def finished(i: int) -> None:
        nonlocal warned_cpu_full
        _report_end(done[i], jobs)
        if smoke is False and done[i].tier == "cpu" and not warned_cpu_full:
            warned_cpu_full = True
            print("note: --full, but the kernel found no CUDA GPU: the notebooks run their CPU "
                  "full column (a GPU job that sees no GPU: check --gres and "
                  "CUDA_VISIBLE_DEVICES)", flush=True)
        write_summary()

    _STOPPING.clear()
    try:
        if jobs == 1:
            for i, nb in enumerate(notebooks):
                print(f"==> {_relative_name(nb)}", flush=True)
                started[i] = time.time()
                done[i] = _run_one(nb, out, params, kernel, timeout_s, start_timeout_s,
                                   progress, log_output)
                finished(i)
        else:
            import concurrent.futures as cf
            import multiprocessing

            print(f"running {len(notebooks)} notebooks, {jobs} at a time (timings from this run "
                  "are not measurements: the notebooks share the machine)", flush=True)
            ctx = multiprocessing.get_context("spawn")
            pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                          initializer=_worker_env, initargs=(env,))
            try:
                futures = {pool.submit(_run_one, nb, out, params, kernel, timeout_s,
                                       start_timeout_s, False, log_output): i
                           for i, nb in enumerate(notebooks)}
                t_submit = time.time()  # the first `jobs` start now, the rest as others end
                started.update({i: t_submit for i in range(jobs)})
                for fut in cf.as_completed(futures):
                    i = futures[fut]
                    try:
                        done[i] = fut.result()
                    except Exception as exc:  # noqa: BLE001 - a worker that died
                        done[i] = NotebookRun(str(_relative_name(notebooks[i])), "", "failed",
                                              0.0, f"{type(exc).__name__}: {exc}",
                                              f"the runner's worker failed: {type(exc).__name__}")
                    nxt = len(started)  # a slot came free: the next notebook in order starts
                    if nxt < len(notebooks):
                        started[nxt] = time.time()
                    finished(i)
            except KeyboardInterrupt:
                # Stop now: a pool left by `with` would wait for the running notebooks to end.
                for proc in list((getattr(pool, "_processes", None) or {}).values()):
                    proc.terminate()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            pool.shutdown()
    except KeyboardInterrupt:
        _STOPPING.set()
        for i, nb in enumerate(notebooks):
            if i not in done:
                done[i] = _stopped(nb, out, started.get(i))
        write_summary()
        raise
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [done[i] for i in sorted(done)]
