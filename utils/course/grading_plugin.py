"""pytest plugin for ``python -m utils grade``: what happened to each cell of an nbval run.

The grader runs ``pytest --nbval-lax`` on one graded notebook in a subprocess
with ``-p`` naming this module (it is copied beside the sandbox as a
standalone file: it imports nothing from :mod:`utils`, so loading it does not
import torch). It does these things:

* **Records every cell's outcome** (passed, failed, skipped, error; the
  exception's name and message, or why the cell timed out or was not run) and
  its outputs, in a JSON file rewritten after each cell, so that a run stopped
  from outside still says how far it got.
* **Signs each record** with an HMAC whose key the grader hands over in a file
  that this plugin reads and deletes before the kernel starts (and whose name
  it removes from the environment the kernel inherits): student code in the
  kernel can overwrite the results file, but cannot write a record the grader
  accepts.
* **Notices a dead kernel at once.** nbval waits for a cell's reply until the
  per-cell timeout even when the kernel has died (``os._exit``, a segfault, out
  of memory); here the wait polls the kernel process every second and fails
  the cell with the kernel's exit code or signal.
* **Ignores nbval markers in exercise cells** (``# NBVAL_SKIP``,
  ``# NBVAL_RAISES_EXCEPTION``...): an exercise cell is the student's code and
  is run and judged like any other cell.
* **Limits memory** (``--course-memory-limit``): ``RLIMIT_DATA`` on this process,
  inherited by the kernel it starts, so an allocation past the limit fails
  with ``MemoryError`` in the cell that made it instead of taking the machine.
* **Caps each cell's output as it arrives**: a cell keeps the first
  :data:`TEXT_HEAD_CHARS` and the last :data:`TEXT_TAIL_CHARS` characters of
  each stream, with a note saying how much was cut, and at most
  :data:`RICH_KEEP_CHARS` of rich outputs (images, HTML); a cell that prints
  more than :data:`FLOOD_CHARS` fails. Neither this process's memory nor the
  results file, the log or the executed copy grows with a flood.
* **Ends every process the kernel started.** This process is a child
  subreaper (Linux), so a process that leaves the kernel's tree (a daemon,
  ``start_new_session``, a double fork) is re-parented here instead of to
  init. After each cell the processes below this one are noted with the cell
  that started them; when the notebook is done and the kernel has been shut
  down, what still runs after a grace period (``--course-linger-s``) is
  killed, and the cell that started it fails ("left a process running").
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import re
import signal
import time
from collections import defaultdict
from queue import Empty
from typing import Any

import pytest

RESULTS_ENV_VAR = "COURSE_GRADING_RESULTS"
KEY_ENV_VAR = "COURSE_GRADING_KEY_FILE"
METADATA_KEY = "course"
#: How often a wait for a cell's reply checks that the kernel is still alive.
POLL_S = 1.0
#: Of a stream (stdout, stderr) longer than the two together, a cell keeps the first
#: TEXT_HEAD_CHARS and the last TEXT_TAIL_CHARS characters, with a note between them.
TEXT_HEAD_CHARS = 80_000
TEXT_TAIL_CHARS = 20_000
#: Rich outputs (images, HTML, tables) a cell keeps, in characters of their data.
RICH_KEEP_CHARS = 5_000_000
#: A cell that prints more than this (all streams together), or whose rich outputs went past
#: RICH_KEEP_CHARS, fails: far beyond what any exercise or course cell prints.
FLOOD_CHARS = 1_000_000
#: An error's message and each entry of its traceback are cut to this many characters.
ERROR_KEEP_CHARS = 10_000
#: Which record says what happened outside every cell (a process nothing can be blamed on).
NOTEBOOK_RECORD = -1

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_state: dict[str, Any] = {"key": b"", "path": "", "cells": {}, "out": None, "linger_s": 10.0,
                          "wall_s": 0.0, "t0": 0.0, "baseline": None, "first_seen": {}}


class KernelDiedError(RuntimeError):
    """The kernel process ended while a cell was running."""


def sign(key: bytes, record: dict[str, Any]) -> str:
    """HMAC-SHA256 of a cell record (its ``cell``, ``status``, ``message``, ``ename``, ``lines``)."""
    body = json.dumps([record.get("cell"), record.get("status"), record.get("message"),
                       record.get("ename"), record.get("lines")],
                      sort_keys=True, ensure_ascii=True)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


# --- processes (Linux /proc; elsewhere these find nothing) ----------------------------------

def process_table() -> dict[int, tuple[int, str, int]]:
    """Every process this user can see: ``pid -> (parent pid, state letter, start time)``."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces
        try:
            table[int(name)] = (int(fields[1]), fields[0], int(fields[19]))
        except (IndexError, ValueError):
            continue
    return table


def descendants(pid: int, table: dict[int, tuple[int, str, int]] | None = None) -> list[int]:
    """The live (not zombie) processes below ``pid``, parents before children."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(p)
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        if table[p][1] != "Z":
            found.append(p)
        todo += children.get(p, [])
    return found


def command_line(pid: int) -> str:
    """A process's command line, short (or its name when it has none)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
        if not words:
            with open(f"/proc/{pid}/comm", "rb") as f:
                words = [f.read().decode(errors="replace").strip()]
    except OSError:
        return f"pid {pid}"
    words[0] = os.path.basename(words[0])
    text = " ".join(words)
    return text if len(text) <= 60 else text[:57] + "..."


def carries(pid: int, marker: bytes) -> bool:
    """Whether a process was started with ``marker`` (``NAME=value``) in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def kill_quietly(pids: Any) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux ``PR_SET_CHILD_SUBREAPER``)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_memory_limit(limit_bytes: int) -> None:
    """``RLIMIT_DATA`` (heap and private writable mappings) of this process and its children."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = limit_bytes if hard == resource.RLIM_INFINITY else min(limit_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _exit_description(kernel: Any) -> str:
    km = getattr(kernel, "km", None)
    proc = getattr(getattr(km, "provisioner", None), "process", None) or getattr(km, "kernel", None)
    code = getattr(proc, "returncode", None) if proc is not None else None
    if code is None and proc is not None and hasattr(proc, "poll"):
        try:
            code = proc.poll()
        except Exception:  # noqa: BLE001 - a description only
            code = None
    if code is None:
        return "the kernel died"
    if code < 0:
        try:
            return f"the kernel died (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"the kernel died (killed by signal {-code})"
    return f"the kernel died (exit code {code})"


def _await_reply(self: Any, msg_id: str, timeout: float | None = None) -> None:
    """nbval's ``RunningKernel.await_reply``, checking every second that the kernel lives."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if left <= 0:
            raise Empty
        try:
            msg = self.get_message(stream="shell", timeout=left)
        except Empty:
            if not self.is_alive():
                raise KernelDiedError(
                    f"{_exit_description(self)} while running this cell (os._exit, a crash in "
                    "native code such as a segfault, or out of memory)") from None
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            if msg["content"]["status"] == "aborted":
                raise RuntimeError("Kernel aborted execution request")
            return


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("course grading")
    group.addoption("--course-memory-limit", type=int, default=0, metavar="BYTES",
                    help="RLIMIT_DATA of the kernel (0: none)")
    group.addoption("--course-linger-s", type=float, default=10.0, metavar="SECONDS",
                    help="how long processes may outlive the kernel before they are killed")
    group.addoption("--course-wall-s", type=float, default=0.0, metavar="SECONDS",
                    help="the grader's wall-clock limit for this run: the wait for processes "
                         "to end stops short of it (0: no limit)")


def pytest_configure(config: Any) -> None:
    from nbval import kernel as nbval_kernel
    from nbval import plugin as nbval_plugin

    nbval_kernel.RunningKernel.await_reply = _await_reply
    if not getattr(nbval_plugin.IPyNbFile.get_kernel_message, "_course_capped", False):
        nbval_plugin.IPyNbFile.get_kernel_message = _capped(nbval_plugin.IPyNbFile.get_kernel_message)
    _state["t0"] = time.monotonic()
    _state["linger_s"] = max(0.0, float(config.getoption("course_linger_s", 10.0) or 0.0))
    _state["wall_s"] = float(config.getoption("course_wall_s", 0.0) or 0.0)
    limit = int(config.getoption("course_memory_limit", 0) or 0)
    if limit > 0:
        set_memory_limit(limit)
    become_subreaper()
    _state["path"] = os.environ.pop(RESULTS_ENV_VAR, "")
    key_file = os.environ.pop(KEY_ENV_VAR, "")
    if key_file:
        try:
            with open(key_file, "rb") as f:
                _state["key"] = f.read().strip()
        finally:
            os.unlink(key_file)  # gone before any kernel starts


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    for item in items:
        cell = getattr(item, "cell", None)
        meta = cell.get("metadata", {}).get(METADATA_KEY, {}) if cell is not None else {}
        if isinstance(meta, dict) and meta.get("role") == "exercise":
            item.options = defaultdict(bool, {"check": False})


# --- output caps ----------------------------------------------------------------------------

class _Output:
    """What one cell printed and what of it was kept."""

    def __init__(self) -> None:
        self.text_total = 0
        self.head: dict[str, int] = {}   # characters kept per stream
        self.tail: dict[str, str] = {}   # the last characters cut, per stream
        self.cut: dict[str, int] = {}    # characters cut per stream
        self.cut_lines: dict[str, int] = {}
        self.rich_kept = 0
        self.rich_dropped = 0
        self.rich_dropped_chars = 0

    @property
    def flooded(self) -> bool:
        return self.text_total > FLOOD_CHARS or self.rich_dropped > 0

    def stream(self, name: str, text: str) -> str:
        """The part of ``text`` to keep; the rest goes to the tail."""
        self.text_total += len(text)
        room = TEXT_HEAD_CHARS - self.head.get(name, 0)
        keep, rest = (text, "") if len(text) <= room else (text[:max(room, 0)], text[max(room, 0):])
        self.head[name] = self.head.get(name, 0) + len(keep)
        if rest:
            tail = self.tail.get(name, "") + rest
            dropped = tail[:-TEXT_TAIL_CHARS] if len(tail) > TEXT_TAIL_CHARS else ""
            self.tail[name] = tail[len(dropped):]
            self.cut[name] = self.cut.get(name, 0) + len(dropped)
            self.cut_lines[name] = self.cut_lines.get(name, 0) + dropped.count("\n")
        return keep

    def rich(self, data: dict[str, Any]) -> bool:
        """Whether a rich output of this data is kept."""
        size = sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in data.values())
        if self.rich_kept + size <= RICH_KEEP_CHARS:
            self.rich_kept += size
            return True
        self.rich_dropped += 1
        self.rich_dropped_chars += size
        return False


def _short(text: Any, limit: int = ERROR_KEEP_CHARS) -> Any:
    if isinstance(text, str) and len(text) > limit:
        return text[:limit] + f"... [{len(text) - limit:,} characters cut by the grader]"
    return text


def _cap_message(msg: dict[str, Any], out: _Output) -> dict[str, Any]:
    """A kernel message as nbval may keep it: output past the caps is cut, or the message dropped."""
    kind = msg.get("msg_type")
    content = msg.get("content", {})
    if kind == "stream":
        content["text"] = out.stream(content.get("name", "stdout"), content.get("text", ""))
        if not content["text"]:
            msg["msg_type"] = "comm_cut_by_grader"  # nbval skips comm messages
    elif kind in ("display_data", "execute_result"):
        if not out.rich(content.get("data", {})):
            msg["msg_type"] = "comm_cut_by_grader"
    elif kind == "error":
        content["evalue"] = _short(content.get("evalue", ""))
        tb = [_short(t) for t in content.get("traceback", [])]
        if len(tb) > 60:
            tb = tb[:30] + ["[... traceback cut by the grader ...]"] + tb[-30:]
        content["traceback"] = tb
    return msg


def _capped(get_kernel_message: Any) -> Any:
    """nbval's ``get_kernel_message``, with each cell's output capped as it arrives."""
    def capped(self: Any, timeout: float | None = None, stream: str = "iopub") -> Any:
        msg = get_kernel_message(self, timeout=timeout, stream=stream)
        out = _state.get("out")
        if stream == "iopub" and out is not None and isinstance(msg, dict):
            msg = _cap_message(msg, out)
        return msg

    capped._course_capped = True  # type: ignore[attr-defined]
    return capped


def _finish_outputs(outputs: list[dict[str, Any]], out: _Output) -> None:
    """Put the kept tail of each cut stream back, after a note saying how much was cut."""
    for name, tail in out.tail.items():
        cut, lines = out.cut.get(name, 0), out.cut_lines.get(name, 0)
        note = (f"\n[... the grader cut {cut:,} characters ({lines:,} lines) of {name} here: "
                f"a cell keeps its first {TEXT_HEAD_CHARS:,} and last {TEXT_TAIL_CHARS:,} "
                f"characters ...]\n" if cut else "")
        target = next((o for o in reversed(outputs) if o.get("output_type") == "stream"
                       and o.get("name") == name), None)
        if target is None:
            outputs.append({"output_type": "stream", "name": name, "text": note + tail})
        else:
            target["text"] = str(target.get("text", "")) + note + tail
    if out.rich_dropped:
        outputs.append({"output_type": "stream", "name": "stderr", "text": (
            f"[... the grader dropped {out.rich_dropped} rich output(s) of this cell "
            f"({out.rich_dropped_chars:,} characters): a cell keeps {RICH_KEEP_CHARS:,} ...]\n")})


def _flood_message(out: _Output) -> str:
    if out.text_total > FLOOD_CHARS:
        return (f"printed {out.text_total:,} characters of output, more than the {FLOOD_CHARS:,} "
                "a cell may print (the executed copy keeps its first and last lines)")
    return (f"displayed {out.rich_dropped_chars + out.rich_kept:,} characters of rich output "
            f"(images, HTML), more than the {RICH_KEEP_CHARS:,} a cell may keep")


# --- processes left behind -------------------------------------------------------------------

def _snapshot() -> dict[tuple[int, int], int]:
    table = process_table()
    return {(p, table[p][2]): p for p in descendants(os.getpid(), table)}


def _note_processes(cell: int | None) -> None:
    """Remember which cell each process below this one was first seen after."""
    seen = _state["first_seen"]
    for key in _snapshot():
        if key not in seen:
            seen[key] = cell


def _end_processes(grace_s: float) -> dict[int | None, list[str]]:
    """Kill what outlived the kernel (after ``grace_s``); their command lines, by cell."""
    t0 = time.monotonic()
    waiting = len(_snapshot())
    while _snapshot() and time.monotonic() < t0 + grace_s:
        time.sleep(0.1)
    if waiting:  # for the log: how long honest workers take to follow their kernel
        print(f"\n[course grading] {waiting} process(es) outlived the kernel; after "
              f"{time.monotonic() - t0:.1f} s, {len(_snapshot())} still ran", flush=True)
    found: dict[tuple[int, int], tuple[Any, str]] = {}
    for _ in range(100):  # a process may fork while its parent is being killed
        now = _snapshot()
        if not now:
            break
        for key, pid in now.items():
            if key not in found:
                found[key] = (_state["first_seen"].get(key, "unseen"), command_line(pid))
        kill_quietly(now.values())
        time.sleep(0.05)
        _reap()
    _reap()
    left: dict[int | None, list[str]] = {}
    for cell, command in found.values():
        if cell != "baseline":  # the kernel itself, should nbval have failed to stop it
            left.setdefault(None if cell == "unseen" else cell, []).append(command)
    return left


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _lingering_message(commands: list[str]) -> str:
    first = commands[0]
    more = f" and {len(commands) - 1} more" if len(commands) > 1 else ""
    return (f"left a process running after the notebook ended (`{first}`{more}); the grader "
            "killed it")


def _failing_line(traceback: list[str]) -> str:
    """The source line an IPython traceback points at last (``---> 12 assert x``)."""
    lines = _ANSI.sub("", "\n".join(traceback)).splitlines()
    marked = [ln for ln in lines if re.match(r"\s*-+>\s*\d+", ln)]
    return re.sub(r"^\s*-+>\s*\d+\s*", "", marked[-1]).strip() if marked else ""


def _message(item: Any, call: Any) -> str:
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, KernelDiedError):
        return str(exc)
    if isinstance(exc, RuntimeError) and "Kernel dead" in str(exc):
        return "not run: the kernel had stopped in an earlier cell"
    errors = [o for o in (getattr(item, "test_outputs", None) or [])
              if o.get("output_type") == "error"]
    timeout = item.config.getoption("nbval_cell_timeout", None)
    if errors:
        err = errors[-1]
        ename, evalue = err.get("ename", "Error"), str(err.get("evalue", "")).strip()
        if ename == "KeyboardInterrupt" and getattr(item.parent, "timed_out", False):
            return f"timed out: the cell ran past the per-cell limit of {timeout:g} s"
        if not evalue and ename == "AssertionError":
            line = _failing_line(err.get("traceback", []))
            return f"AssertionError at `{line}`" if line else "AssertionError"
        return f"{ename}: {evalue}" if evalue else ename
    text = str(exc) if exc is not None else "failed"
    if "waiting for output" in text:
        return ("the kernel sent no output for a few seconds after the cell's reply (nbval's "
                "limit; a heavily loaded machine?), so nbval shut the kernel down")
    if "Timeout" in text:
        return (f"timed out: the cell ran past the per-cell limit of {timeout:g} s and did not "
                "stop when interrupted, so its kernel was shut down")
    return text if exc is None else f"{type(exc).__name__}: {text}"


def _top_lines(traceback: list[str]) -> list[int]:
    """The line of the cell itself that each exception (chained ones too) was raised from.

    An IPython traceback names the cell's own frame first after each ``Traceback`` header
    (``----> 4 f(a)``, then the frames of what that line called).
    """
    lines, expect = [], False
    for entry in traceback:
        text = _ANSI.sub("", str(entry))
        if "Traceback (most recent call last)" in text:
            expect = True
            continue
        marked = re.search(r"^\s*-+>\s*(\d+)", text, re.M)
        if expect and marked:
            lines.append(int(marked.group(1)))
            expect = False
    return lines


def _error_of(item: Any) -> dict[str, Any]:
    errors = [o for o in (getattr(item, "test_outputs", None) or []) if o.get("output_type") == "error"]
    return errors[-1] if errors else {}


def _outputs(item: Any) -> list[dict[str, Any]]:
    outs = []
    for o in getattr(item, "test_outputs", None) or []:
        out = dict(o)
        if out.get("output_type") == "execute_result":
            out.setdefault("execution_count", None)
            out.setdefault("metadata", {})
        elif out.get("output_type") == "display_data":
            out.setdefault("metadata", {})
        outs.append(out)
    return outs


def _write() -> None:
    path = _state["path"]
    if not path:
        return
    data = {"cells": [_state["cells"][k] for k in sorted(_state["cells"])]}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    if getattr(item, "cell_num", None) is not None:
        if _state["baseline"] is None:  # the kernel and what it started before any cell ran
            _state["baseline"] = True
            _note_processes("baseline")  # type: ignore[arg-type]
        _state["out"] = _Output()
    yield


def pytest_sessionfinish(session: Any) -> None:
    """After the kernel's shutdown: end what it left running, and fail the cell that started it."""
    if _state["baseline"] is None:
        return
    grace = _state["linger_s"]
    if _state.get("wall_s"):  # end before the grader's wall-clock limit kills this process
        grace = min(grace, max(0.0, _state["wall_s"] - (time.monotonic() - _state["t0"]) - 3))
    for cell, commands in _end_processes(grace).items():
        n = NOTEBOOK_RECORD if cell is None else cell
        rec = dict(_state["cells"].get(n) or {"cell": n, "status": "passed", "message": "",
                                              "outputs": []})
        text = _lingering_message(commands)
        passed = rec.get("status") == "passed"
        rec["message"] = text if passed else f"{rec.get('message', '')}; it also {text}"
        rec["status"] = "failed"
        _store(rec)


def _store(rec: dict[str, Any]) -> None:
    rec["message"] = str(rec.get("message", ""))[:2000]
    rec["hmac"] = sign(_state["key"], rec)
    _state["cells"][rec["cell"]] = rec
    _write()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    outcome = yield
    rep = outcome.get_result()
    n = getattr(item, "cell_num", None)
    if n is None:
        return
    if call.when == "setup":
        if rep.failed:
            status, message = "error", "the kernel did not start: " + _message(item, call)
        elif rep.skipped:
            status, message = "skipped", ""
        else:
            return
        outputs: list[dict[str, Any]] = []
    elif call.when == "call":
        xfail = hasattr(rep, "wasxfail")
        if rep.passed:
            status, message = "passed", ""
        elif rep.skipped and not xfail:
            status, message = "skipped", ""
        else:  # failed, or failed after an earlier timeout (xfailed)
            status, message = "failed", _message(item, call)
        outputs = _outputs(item)
        out = _state.get("out")
        if out is not None:
            _finish_outputs(outputs, out)
            if out.flooded and status != "skipped":
                flood = _flood_message(out)
                message = flood if status == "passed" else f"{message}; it also {flood}"
                status = "failed"
        _state["out"] = None
        _note_processes(n)
    else:
        return
    record: dict[str, Any] = {"cell": n, "status": status, "message": message}
    if status == "failed":
        err = _error_of(item) if call.when == "call" else {}
        record["ename"] = str(err.get("ename", "")) or None
        record["lines"] = _top_lines(err.get("traceback", [])) if err else []
    record["outputs"] = outputs
    _store(record)
