"""pytest plugin for ``python -m utils grade``: what happened to each cell of an nbval run.

The grader runs ``pytest --nbval-lax`` on one graded notebook in a subprocess
with ``-p`` naming this module (it is copied beside the sandbox as a
standalone file: it imports nothing from :mod:`utils`, so loading it does not
import torch). It does four things:

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
"""

from __future__ import annotations

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

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_state: dict[str, Any] = {"key": b"", "path": "", "cells": {}}


class KernelDiedError(RuntimeError):
    """The kernel process ended while a cell was running."""


def sign(key: bytes, record: dict[str, Any]) -> str:
    """HMAC-SHA256 of a cell record (its ``cell``, ``status`` and ``message``)."""
    body = json.dumps([record.get("cell"), record.get("status"), record.get("message")],
                      sort_keys=True, ensure_ascii=True)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


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


def pytest_configure(config: Any) -> None:
    from nbval import kernel as nbval_kernel

    nbval_kernel.RunningKernel.await_reply = _await_reply
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
    else:
        return
    record = {"cell": n, "status": status, "message": message[:2000]}
    record["hmac"] = sign(_state["key"], record)
    record["outputs"] = outputs
    _state["cells"][n] = record
    _write()
