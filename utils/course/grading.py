"""Grade student submissions per exercise, with nbval, so that editing a check gains nothing.

``python -m utils grade SUBMISSIONS... --out DIR`` calls :func:`grade`. For each
submitted notebook it

1. **finds its instructor notebook**: the one ``release`` named in the
   notebook's metadata, else the course notebook with the same file name;
2. **builds the graded copy from the instructor notebook**, putting in only
   the student's *exercise cells* (matched by the ids ``release`` wrote into
   their metadata, see :mod:`utils.course.student`); check cells, setup and
   everything else come from the instructor's copy, so a student who edits,
   deletes or disables a check gains nothing;
3. **executes it with nbval in lax mode** (``pytest --nbval-lax``, the tool the
   course promises instructors), at smoke size, in a fresh kernel, in a
   subprocess with a per-cell timeout *and* a wall-clock limit; on that limit
   the subprocess and the kernel (its own process group) are killed;
4. **scores each exercise**: it passes when its exercise cell and its check
   cell both ran without an error. An exercise that did not pass after one of
   the instructor's own cells failed (setup that cannot import a package: a
   broken grading environment) is *not graded*, unless an exercise before that
   cell failed (the student's code may have broken it) or it is the released
   stub or empty: it counts neither for nor against the student, its
   ``passed`` and ``points`` are empty in ``gradebook.csv``, its reason names
   the instructor's cell and its error, and ``python -m utils grade`` warns
   and exits 3.

Hidden checks (``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` in a check
cell) are not in the student version (:mod:`utils.course.student`) but are in the
instructor's check cell the grader runs. A failed one is reported as "a hidden
check failed", with its assertion message only where the instructor wrote one
(the plugin records the line of the cell each exception was raised from), and
every reason is scrubbed of the hidden blocks' lines and of the grader's paths,
so ``reports/<student>.md`` can be sent as it is.

Limits, each graded as a failure of the exercise that ran into it, with a reason:
memory (``RLIMIT_DATA`` on each kernel, ``memory_limit_gib``), output (each
cell's output capped as it arrives; a flood fails its cell), processes (the
pytest process is a child subreaper and ends what the kernel left running;
each run's processes carry a marker in their environment, by which the grader
finds what escaped). On a GPU node each kernel gets one GPU of its own and
notebooks wait for a free one, unless ``hide_gpus`` hides the GPUs.

What the graded kernel can see. It runs in a scratch folder outside the
course repository that holds a copy of the ``utils`` package, each module's
helper files (scripts, helper modules) and the *student* version of every
course notebook, and nothing else: its working folder, ``utils.__file__``,
``sys.path`` (``PYTHONPATH`` is the scratch folder) and its environment lead
to no solution, except that an editable install (``pip install -e .``) records
the checkout's path in the package's metadata (``direct_url.json``, the
``__editable__`` finder), which any code can read. The per-cell results come
back through a small pytest plugin (:mod:`utils.course.grading_plugin`) whose
records are signed with a key the kernel never sees, so code in the kernel
cannot forge them. None of this is a
sandbox: the kernel runs with the grader's rights, and code that opens the
instructor's files by their absolute path, or subverts the interpreter the
checks run in, is stopped only by the operating system. Run grading in a
container or as an unprivileged user without network (see README).

Every failure ends up in the gradebook with a reason, and never stops the
batch: a file that is not a notebook or is not valid JSON (named like a course
notebook, it fails each of that notebook's exercises), a notebook that
belongs to no course notebook, an empty or missing exercise cell, an error at
import, a cell that loops (stopped at the per-cell timeout, or at the
wall-clock limit when it ignores the interrupt), a kernel that dies
(``os._exit``, a segfault).

Student names: a folder argument is one student, named after the folder
(every file inside it, recursively, is one of their submissions); a file
argument named ``NAME__anything.ipynb`` belongs to ``NAME``; a file named like
a course notebook (``01_measuring_performance.ipynb``) belongs to the folder it
sits in; any other file to its own stem (``alice.ipynb`` -> ``alice``).
"""

from __future__ import annotations

import concurrent.futures
import copy
import csv
import hmac
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import nbformat

from ..sizes import COMPILE_THREADS_ENV_VAR, compile_threads_per_job, usable_cpu_count
from .student import (
    METADATA_KEY,
    Exercise,
    copy_module_files,
    course_notebooks,
    find_exercises,
    hidden_blocks,
    notebook_name,
    release_notebook,
    strip_hidden,
)

__all__ = [
    "GRADEBOOK_COLUMNS",
    "DEFAULT_CELL_TIMEOUT_S",
    "DEFAULT_NOTEBOOK_TIMEOUT_S",
    "default_memory_limit_gib",
    "GradeRow",
    "NotebookGrade",
    "Submission",
    "collect_submissions",
    "build_graded",
    "grade",
    "default_jobs",
]

GRADEBOOK_COLUMNS = ("student", "notebook", "exercise", "passed", "points", "reason")
#: The longest ``reason`` in gradebook.csv (the per-student report keeps the whole text).
CSV_REASON_CHARS = 300
#: Per-cell limit. The slowest smoke-size cells of the course (a cold torch.compile on a
#: loaded 2-core machine) take well under a minute; the test suite allows the same 300 s.
DEFAULT_CELL_TIMEOUT_S = 300
#: Wall-clock limit for one notebook, for a kernel that ignores the per-cell timeout.
DEFAULT_NOTEBOOK_TIMEOUT_S = 1200
#: Bounds of the default per-notebook memory limit (see :func:`default_memory_limit_gib`).
MIN_DEFAULT_MEMORY_GIB, MAX_DEFAULT_MEMORY_GIB = 4.0, 16.0
#: How long processes a notebook started may outlive its kernel (a DataLoader worker notices
#: that its parent is gone within 5 s) before they are killed and the cell that started them fails.
LINGER_GRACE_S = 10.0
#: How much of what nbval prints the log of one notebook keeps (its first and last half).
LOG_KEEP_BYTES = 1_000_000
#: The environment variable that marks every process a notebook's run started.
RUN_MARKER = "COURSE_GRADING_RUN"
PLUGIN_MODULE = "course_grading_plugin"
_NOTEBOOK_NAME = re.compile(r"^\d\d_\w+$")
_SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints", ".git"}
# Constructs an honest exercise rarely needs and a subversion of the checks usually does:
# a passed exercise that uses one gets a note asking a person to read it.
_REVIEW = [
    (re.compile(r"\bget_ipython\b|\bInteractiveShell\b"), "the IPython shell (get_ipython)"),
    (re.compile(r"\bsys\.(settrace|setprofile|modules)\b|\bbuiltins\b|__builtins__"),
     "interpreter internals (sys.settrace/modules, builtins)"),
    (re.compile(r"\bos\._exit\b|\bos\.kill\b|\bsignal\.|\bctypes\b"), "process control (os._exit, signals, ctypes)"),
    (re.compile(r"\.ipynb\b|/proc/|COURSE_GRADING"), "notebook files or the grader's files"),
    (re.compile(r"\bsubprocess\b|\bos\.system\b|\bsocket\b"), "subprocesses or sockets"),
    # how an editable install leads back to the instructor's tree (a direct_url.json, the
    # __editable__ finder, a .pth file in site-packages)
    (re.compile(r"\bimportlib[._]metadata\b|\bpkg_resources\b|direct_url|__editable__|"
                r"\bsite-packages\b|\bdist-packages\b|\bgetsitepackages\b|\bgetusersitepackages\b|"
                r"\bmeta_path\b|\bpath_hooks\b"),
     "the installed packages' metadata or files (importlib.metadata, site-packages)"),
    (re.compile(r"(?<![\w.])(exec|eval)\s*\("), "code run from a string (exec, eval)"),
]


@dataclass(frozen=True)
class Submission:
    """One submitted file and whose it is."""

    student: str
    path: Path
    label: str  # the path as given on the command line, shown in the gradebook
    shown: str = ""  # the file as the student knows it, shown in their report

    @property
    def file(self) -> str:
        return self.shown or self.path.name


@dataclass(frozen=True)
class GradeRow:
    """One line of the gradebook.

    ``graded`` false: the grader could not grade it, and it counts neither for nor against
    the student (an exercise after an instructor's cell that failed, the row of that cell,
    a second copy of a notebook that was set aside). Its ``passed`` and ``points`` are empty
    in gradebook.csv, and its reason starts with what happened.
    """

    student: str
    notebook: str
    exercise: str
    passed: bool
    points: float
    reason: str
    graded: bool = True

    def as_csv(self) -> list[str]:
        """The row of gradebook.csv: its reason on one line (see :func:`_csv_reason`)."""
        passed = ("true" if self.passed else "false") if self.graded else ""
        points = f"{self.points:g}" if self.graded else ""
        return [self.student, self.notebook, self.exercise, passed, points, _csv_reason(self.reason)]


# The notes the grader adds after a reason (see _prepare and build_graded): a cut keeps them.
_TRAILING_NOTES = re.compile(r"(?:; (?:review by hand: |the exercise cell is missing|\d+ cells carry|"
                             r"matched by its )[^;]*)+$")


def _csv_reason(reason: str, limit: int = CSV_REASON_CHARS) -> str:
    """A reason on one line (its lines joined by `` / ``), at most ``limit`` characters.

    A longer one is cut inside its message, with ``...``; the grader's notes at its end
    (``review by hand: ...``) are kept whole.
    """
    text = " / ".join(ln.strip() for ln in str(reason).splitlines() if ln.strip())
    if len(text) <= limit:
        return text
    notes = _TRAILING_NOTES.search(text)
    tail = notes.group(0) if notes and len(notes.group(0)) <= limit // 2 else ""
    head = text[:len(text) - len(tail)]
    return head[:limit - len(tail) - 3].rstrip() + "..." + tail


@dataclass(frozen=True)
class NotebookGrade:
    """What grading one submitted file gave.

    ``rows`` holds one row per exercise of the matched instructor notebook
    (titles in ``titles``), plus a row with an empty ``exercise`` for a problem
    with the file or the run as a whole. ``points``/``max_points`` sum them up;
    an exercise that was not graded (:attr:`not_graded`) is left out of both.
    """

    student: str
    submission: str
    notebook: str
    rows: tuple[GradeRow, ...]
    titles: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    executed: str = ""
    log: str = ""
    notes: tuple[str, ...] = ()
    file: str = ""  # the submitted file as the student knows it (no instructor's path)

    @property
    def points(self) -> float:
        return sum(r.points for r in self.rows)

    @property
    def max_points(self) -> float:
        return float(len(self.titles) - len(self.not_graded))

    @property
    def not_graded(self) -> tuple[GradeRow, ...]:
        """The exercise rows the grader could not grade (an instructor's cell failed before them)."""
        return tuple(r for r in self.rows if r.exercise and not r.graded)

    @property
    def set_aside(self) -> bool:
        """A file left ungraded as a whole (another copy of the same notebook was graded)."""
        return bool(self.rows) and not self.titles and not any(r.graded for r in self.rows)


@dataclass
class _Prepared:
    """A submission matched to its instructor notebook, ready to run."""

    submission: Submission
    name: str
    exercises: list[Exercise]
    graded: Any
    notes: dict[str, list[str]] = field(default_factory=dict)
    empty: set[str] = field(default_factory=set)
    file_notes: list[str] = field(default_factory=list)
    hidden: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # cell -> line ranges
    secrets: list[str] = field(default_factory=list)  # hidden source lines, never shown


def default_jobs() -> int:
    """Notebooks graded at once: one per CPU core this process may use, at most 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, 16))


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_memory_limit_gib(jobs: int) -> float:
    """The default per-notebook memory limit: the machine's memory shared by ``jobs`` notebooks.

    Between :data:`MIN_DEFAULT_MEMORY_GIB` and :data:`MAX_DEFAULT_MEMORY_GIB`, rounded down
    to a whole GiB. Measured by the same rule (``RLIMIT_DATA`` counts the heap and private
    writable mappings), a kernel that imports torch starts near 0.8 GiB, and the compile and
    capstone notebooks peak near 1.3 GiB at smoke size; the memory and distributed notebooks
    grade in full under the 4 GiB floor.
    """
    total = _total_memory_bytes() / 2**30
    if total <= 0:
        return MIN_DEFAULT_MEMORY_GIB
    return float(int(max(MIN_DEFAULT_MEMORY_GIB, min(MAX_DEFAULT_MEMORY_GIB, total / max(jobs, 1)))))


def _visible_gpus() -> list[str]:
    """The GPUs the grader sees, each as CUDA_VISIBLE_DEVICES names it to a kernel.

    The NVIDIA driver lists its GPUs under ``/proc/driver/nvidia/gpus``; without that
    folder (another vendor's GPUs, another OS) torch is asked, which takes an import.
    """
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None and named.strip() in ("", "-1"):
        return []
    listed = Path("/proc/driver/nvidia/gpus")
    try:
        if listed.is_dir():
            count = len(list(listed.iterdir()))
        else:
            import torch

            count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch, or no driver: no GPU
        return []
    if count <= 0:
        return []
    named = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if named:
        return [d.strip() for d in named.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


# --- submissions ---------------------------------------------------------------------------

def _student_of_file(path: Path) -> str:
    stem = path.name[:-len(".ipynb")] if path.name.endswith(".ipynb") else path.stem
    if "__" in stem and stem.split("__", 1)[0]:
        return stem.split("__", 1)[0]
    if _NOTEBOOK_NAME.match(stem):
        return path.resolve().parent.name
    return stem or path.name


_MODULE_FOLDER = re.compile(r"^\d\d-")


def _refuse_a_class_folder(p: Path) -> None:
    """A single folder is one student; refuse one that holds a class instead.

    ``grade submissions/`` (the parent folder, where ``submissions/*`` was meant) would grade
    one "student" called ``submissions`` and skip everyone else's files: a gradebook silently
    incomplete. A folder whose subfolders (two or more, not named like course modules, which
    a student may keep their notebooks in) each hold course notebooks is a class.
    """
    if not p.is_dir():
        return
    students = []
    for sub in sorted(q for q in p.iterdir() if q.is_dir() and not q.name.startswith(".")):
        if sub.name in _SKIP_PARTS or _MODULE_FOLDER.match(sub.name):
            continue
        if any(_NOTEBOOK_NAME.match(f.stem) for f in sub.rglob("*.ipynb")
               if not any(part.startswith(".") for part in f.relative_to(sub).parts)):
            students.append(sub.name)
    if len(students) >= 2:
        shown = ", ".join(students[:4]) + (", ..." if len(students) > 4 else "")
        raise ValueError(
            f"{p} holds {len(students)} folders of course notebooks ({shown}): it looks like a "
            f"class, not one student. A folder argument is one student; to grade each of them, "
            f"name the students' folders: python -m utils grade {p}/* --out grades/")


def collect_submissions(paths: Sequence[str | os.PathLike]) -> list[Submission]:
    """Expand the command line into submitted files, each with its student's name.

    A folder is one student (named after it) and every file in it, recursively,
    is theirs; hidden files, caches and checkpoints are skipped. A file is named
    by :func:`_student_of_file` (see the module docstring).

    Raises:
        ValueError: no paths.
        FileNotFoundError: a path that does not exist.
    """
    if not paths:
        raise ValueError("name at least one submission (a notebook or a student's folder)")
    if len(paths) == 1:
        _refuse_a_class_folder(Path(paths[0]).expanduser())
    found: list[Submission] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"no such submission file or folder: {raw}")
        if p.is_dir():
            student = p.resolve().name
            files = [f for f in sorted(p.rglob("*")) if f.is_file() and not any(
                part in _SKIP_PARTS or part.startswith(".") for part in f.relative_to(p).parts)]
            if not files:
                found.append(Submission(student, p, str(raw), f"{student}/"))  # reported as empty
            found += [Submission(student, f, str(Path(raw) / f.relative_to(p)),
                                 f.relative_to(p).as_posix()) for f in files]
        else:
            found.append(Submission(_student_of_file(p), p, str(raw), p.name))
    return found


# --- instructor notebooks and graded copies -------------------------------------------------

class _Course:
    """The instructor notebooks under a course root, by name and by file name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.notebooks: dict[str, Path] = {}
        for p in course_notebooks(root):
            self.notebooks[notebook_name(p, root)] = p
        if not self.notebooks:
            raise FileNotFoundError(f"{root} holds no course notebooks (NN-module/NN_name.ipynb)")
        self._cache: dict[str, tuple[Any, list[Exercise]]] = {}

    def load(self, name: str) -> tuple[Any, list[Exercise]]:
        if name not in self._cache:
            nb = nbformat.read(self.notebooks[name], as_version=4)
            self._cache[name] = (nb, find_exercises(nb))
        nb, exercises = self._cache[name]
        return copy.deepcopy(nb), exercises

    def match(self, nb: Any, path: Path) -> tuple[str | None, str]:
        """(instructor notebook name or None, how it was matched or why not)."""
        meta = nb.get("metadata", {}).get(METADATA_KEY, {})
        named = meta.get("notebook") if isinstance(meta, dict) else None
        if isinstance(named, str) and named in self.notebooks:
            return named, ""
        file_name = path.name.split("__", 1)[1] if "__" in path.name else path.name
        by_file = [n for n, p in self.notebooks.items() if p.name == file_name]
        if len(by_file) == 1:
            return by_file[0], f"matched by its file name ({file_name})"
        said = f"its metadata names {named!r}, which is not a course notebook" if named else \
            "it carries no course metadata (was it made with `python -m utils release`?)"
        return None, f"belongs to no course notebook: {said}, and no course notebook is named {file_name}"


def _cell_meta(cell: Any) -> dict[str, Any]:
    meta = cell.get("metadata", {}).get(METADATA_KEY, {})
    return meta if isinstance(meta, dict) else {}


def _is_empty(source: str) -> bool:
    return all(not ln.strip() or ln.strip().startswith("#") for ln in source.splitlines())


def build_graded(instructor_nb: Any, exercises: Sequence[Exercise],
                 submission_nb: Any) -> tuple[Any, dict[str, list[str]], set[str]]:
    """The notebook to execute: the instructor's, with the student's exercise cells in it.

    Only the *source* of each exercise cell is taken from the submission (its
    metadata, tags and every other cell are the instructor's). A submission
    cell is matched by its ``course.id`` metadata; a notebook with no ids at
    all (not made by ``release``) is matched by the ``# Exercise N`` comments.
    A missing exercise cell is graded as the released stub.

    Returns:
        ``(graded notebook, notes per exercise id, ids of empty exercise cells)``.
    """
    from .student import _TITLE, _NUMBER, strip_solutions

    graded = copy.deepcopy(instructor_nb)
    cells = [c for c in submission_nb.get("cells", []) if isinstance(c, dict)]
    code = [c for c in cells if c.get("cell_type") == "code" and isinstance(c.get("source"), str)]
    by_id: dict[str, list[Any]] = {}
    for c in code:
        meta = _cell_meta(c)
        if meta.get("role") == "exercise" and isinstance(meta.get("id"), str):
            by_id.setdefault(meta["id"], []).append(c)
    by_title = not by_id
    if by_title:
        for c in code:
            title = _TITLE.search(c["source"])
            number = _NUMBER.match(title.group(1)) if title else None
            if number:
                by_id.setdefault(f"exercise-{number.group(1)}", []).append(c)
    notes: dict[str, list[str]] = {}
    empty: set[str] = set()
    for k, cell in enumerate(graded.cells):
        cell.metadata.pop(METADATA_KEY, None)
        if cell.get("cell_type") == "code":
            cell.outputs, cell.execution_count = [], None
        if not cell.get("id"):
            cell["id"] = f"cell-{k}"
    for ex in exercises:
        note = notes.setdefault(ex.id, [])
        target = graded.cells[ex.cell_index]
        target.metadata[METADATA_KEY] = {"id": ex.id, "role": "exercise"}
        if ex.check_index is not None:
            graded.cells[ex.check_index].metadata[METADATA_KEY] = {
                "id": ex.check_id, "role": "check", "exercise": ex.id}
        mine = by_id.get(ex.id, [])
        if not mine:
            target.source = strip_solutions(target.source, ex.title)
            note.append("the exercise cell is missing from the submission (graded as the released stub)")
            continue
        if len(mine) > 1:
            note.append(f"{len(mine)} cells carry this exercise's id; the first was graded")
        if by_title:
            note.append("matched by its `# Exercise N` comment (the notebook carries no grading ids)")
        target.source = mine[0]["source"]
        if _is_empty(target.source):
            empty.add(ex.id)
    return graded, notes, empty


def _review_notes(source: str) -> list[str]:
    return [f"review by hand: the exercise cell uses {what}" for pattern, what in _REVIEW
            if pattern.search(source)]


# --- the sandbox and the nbval run ----------------------------------------------------------

def _build_template(course: _Course, into: Path) -> Path:
    """A course tree without solutions: utils, module helper files, student notebooks."""
    from . import grading_plugin

    root = into / "course"
    utils_src = Path(__file__).resolve().parent.parent
    shutil.copytree(utils_src, root / "utils",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "course"))  # not the grader
    shutil.copyfile(Path(grading_plugin.__file__), root / f"{PLUGIN_MODULE}.py")
    modules = {p.parent for p in course.notebooks.values()}
    for module in sorted(modules):
        copy_module_files(module, root / module.relative_to(course.root))
    for name in course.notebooks:
        nb, _ = course.load(name)
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(release_notebook(nb, name), target)
    return root


def _kernel_env(sandbox: Path, work: Path, hidden: Sequence[Path],
                gpu: str | None = None, compile_threads: int | None = None) -> dict[str, str]:
    """The kernel's environment; ``gpu``: the one GPU it may see (``""``: none, ``None``: as is);
    ``compile_threads``: Inductor's compile workers, unless the grader's environment names them
    (``None``: Inductor decides)."""
    hide = [str(h.resolve()) for h in hidden]
    env = {}
    for k, v in os.environ.items():
        if k.startswith(("PYTEST_", "COURSE_")) or k in ("OLDPWD", "PYTHONPATH"):
            continue
        if k != "PATH" and any(h in v for h in hide):
            continue  # nothing in the kernel's environment points at the instructor's files
        env[k] = v
    env.update({
        "COURSE_SMOKE": "1",
        "COURSE_STRICT": "0",
        "COURSE_RESULTS_DIR": str(work / "results"),
        "PYTHONPATH": str(sandbox),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    })
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if compile_threads is not None and COMPILE_THREADS_ENV_VAR not in env:
        env[COMPILE_THREADS_ENV_VAR] = str(compile_threads)
    return env


def _kill_marked(marker: bytes) -> int:
    """SIGKILL every process started with ``marker`` in its environment; how many there were.

    The backstop for a run whose pytest process died (killed at the wall-clock limit, or by
    the code it ran) before it could end what the kernel started: those processes were
    re-parented to init, out of reach of any process tree, but they still carry the marker.
    """
    from .grading_plugin import carries, kill_quietly, process_table

    me, killed = os.getpid(), set()
    for _ in range(100):
        found = [p for p in process_table() if p != me and carries(p, marker)]
        if not found:
            break
        kill_quietly(found)
        killed.update(found)
        time.sleep(0.05)
    return len(killed)


class _CappedLog(threading.Thread):
    """Copies a pipe into a log file, keeping the first and the last ``keep // 2`` bytes."""

    def __init__(self, fd: int, path: Path, keep: int = LOG_KEEP_BYTES) -> None:
        super().__init__(daemon=True)
        self.fd, self.path, self.half = fd, path, max(keep // 2, 1)

    def run(self) -> None:
        written, tail, cut = 0, b"", 0
        with open(self.path, "wb") as log:
            while True:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                if written < self.half:
                    head, chunk = chunk[:self.half - written], chunk[self.half - written:]
                    log.write(head)
                    written += len(head)
                tail += chunk
                if len(tail) > self.half:
                    cut += len(tail) - self.half
                    tail = tail[-self.half:]
            if cut:
                log.write(f"\n[... the grader cut {cut:,} bytes of this log here ...]\n".encode())
            log.write(tail)
        try:
            os.close(self.fd)
        except OSError:
            pass


class _Watch:
    """The processes under the pytest subprocess, remembered while it runs.

    The kernel starts in a session of its own, so killing the subprocess's
    process group would leave it running; and a kernel that kills its parent
    is re-parented, so it cannot be found from the parent afterwards. Polling
    the tree while the run lasts finds it in both cases.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, Any] = {}
        try:
            import psutil

            self._root = psutil.Process(pid)
        except Exception:  # noqa: BLE001 - no psutil, or the process is already gone
            self._root = None

    def poll(self) -> None:
        if self._root is None:
            return
        try:
            for child in self._root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except Exception:  # noqa: BLE001 - the subprocess ended meanwhile
            pass

    def kill_all(self, group: bool) -> None:
        """SIGKILL every remembered process that still runs, and the subprocess's group.

        ``group`` only while the subprocess has not been reaped (its pid is still its own).
        """
        if group and hasattr(os, "killpg"):
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
        for proc in self.seen.values():
            try:
                if proc.is_running():  # psutil checks that the pid was not reused
                    proc.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass


@dataclass
class _RunResult:
    cells: dict[int, dict[str, Any]]
    seconds: float
    killed: bool
    returncode: int | None
    log_tail: str
    tampered: bool
    work: str = ""  # the scratch folder it ran in (removed; named so reports can leave it out)
    memory_limit_gib: float = 0.0
    gpu: str | None = None


def _read_results(path: Path, key: bytes) -> tuple[dict[int, dict[str, Any]], bool]:
    """The records signed with ``key``, and whether anything else was in the file."""
    from . import grading_plugin

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}, path.exists()
    if not isinstance(data, dict):
        return {}, True
    cells, tampered = {}, False
    for rec in data.get("cells", []) if isinstance(data.get("cells"), list) else []:
        if not isinstance(rec, dict) or not isinstance(rec.get("cell"), int):
            tampered = True
            continue
        if hmac.compare_digest(str(rec.get("hmac", "")), grading_plugin.sign(key, rec)):
            cells[rec["cell"]] = rec
        else:
            tampered = True
    return cells, tampered


def _run_nbval(graded: Any, name: str, template: Path, hidden: Sequence[Path], timeout_s: float,
               wall_s: float, log_path: Path, memory_limit_gib: float = 0.0,
               gpu: str | None = None, compile_threads: int | None = None) -> _RunResult:
    """Run one graded notebook; ``gpu`` is the GPU its kernel sees (``""`` none, ``None`` as is),
    ``compile_threads`` its Inductor compile workers (``None``: Inductor decides)."""
    from . import grading_plugin

    work = Path(tempfile.mkdtemp(prefix="course-grade-"))
    try:
        sandbox = work / "course"
        shutil.copytree(template, sandbox)
        nb_path = sandbox / name
        nbformat.write(graded, nb_path)
        key = secrets.token_hex(32).encode()
        key_file = work / "key"
        key_file.write_bytes(key)
        key_file.chmod(0o600)
        results = work / "cells.json"
        ini = work / "pytest.ini"
        ini.write_text("[pytest]\n", encoding="utf-8")
        env = _kernel_env(sandbox, work, hidden, gpu, compile_threads)
        env[grading_plugin.RESULTS_ENV_VAR] = str(results)
        env[grading_plugin.KEY_ENV_VAR] = str(key_file)
        marker = f"{RUN_MARKER}={secrets.token_hex(16)}"
        env[RUN_MARKER] = marker.split("=", 1)[1]
        cmd = [sys.executable, "-m", "pytest", str(nb_path), "--nbval-lax", "--nbval-current-env",
               f"--nbval-cell-timeout={timeout_s:g}", "-c", str(ini), "--rootdir", str(sandbox),
               "-o", "addopts=", "-p", "nbval.plugin", "-p", PLUGIN_MODULE,
               "-p", "no:cacheprovider", "-q", "--color=no",
               f"--course-memory-limit={int(memory_limit_gib * 2**30)}",
               f"--course-linger-s={LINGER_GRACE_S:g}", f"--course-wall-s={wall_s:g}"]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        killed = False
        read_end, write_end = os.pipe()
        log = _CappedLog(read_end, log_path)
        log.start()
        try:
            proc = subprocess.Popen(cmd, cwd=nb_path.parent, env=env, stdin=subprocess.DEVNULL,
                                    stdout=write_end, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            os.close(write_end)
        watch = _Watch(proc.pid)
        while True:
            watch.poll()
            try:
                proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 > wall_s:
                    killed = True
                    break
        watch.kill_all(group=killed)  # after a clean run, only what outlived it
        proc.wait()
        _kill_marked(marker.encode())
        log.join(timeout=10)  # every writer is gone, so the pipe is at its end
        seconds = time.monotonic() - t0
        cells, tampered = _read_results(results, key)
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        return _RunResult(cells, seconds, killed, None if killed else proc.returncode, tail,
                          tampered, str(work), memory_limit_gib, gpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- scoring --------------------------------------------------------------------------------

def _first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def _describe(graded: Any, cell_index: int) -> str:
    """``cell 6 of 11 (`first line`)``: the first line a student can read (hidden checks left out)."""
    cells = graded.cells
    try:
        source = strip_hidden(cells[cell_index].get("source", ""))
    except ValueError:
        source = ""
    first = _first_line(source)
    first = first if len(first) <= 60 else first[:57] + "..."
    return f"cell {cell_index + 1} of {len(cells)} (`{first}`)"


STUB_MESSAGE = "NotImplementedError: Student exercise"


_MEMORY = re.compile(r"\bMemoryError\b|can't allocate memory|Cannot allocate memory|std::bad_alloc|"
                     r"failed to map segment")
_GPU_MEMORY = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
# Messages the grader writes itself: they hold no source, hidden or not.
_GRADER_SAYS = ("not run", "not done", "no result", "timed out", "the kernel died",
                "the kernel sent no output", "the kernel did not start", "printed ", "displayed ",
                "left a process")


def _in_hidden(rec: dict[str, Any], blocks: Sequence[tuple[int, int]]) -> bool:
    """Whether a failed cell with hidden checks failed in one (or cannot be shown not to have)."""
    lines = rec.get("lines") or []
    if not lines:
        return True  # no traceback to place it: say nothing of the source
    return any(first <= n <= last for n in lines for first, last in blocks)


def _hidden_safe(rec: dict[str, Any], msg: str, blocks: Sequence[tuple[int, int]]) -> str:
    """A failed cell's message, saying no more of a hidden check than that it failed.

    The assertion message stays when the instructor wrote one (``assert x, "..."``); any
    other exception is named by its type only (its message may quote hidden code).
    """
    if not blocks or msg.startswith(_GRADER_SAYS) or not _in_hidden(rec, blocks):
        return msg
    head, sep, also = msg.partition("; it also ")
    ename = rec.get("ename") or ""
    if ename == "AssertionError":
        said = head[len("AssertionError: "):] if head.startswith("AssertionError: ") else ""
        safe = "a hidden check failed" + (f": {said}" if said.strip() else "")
    elif ename:
        safe = f"a hidden check failed (it raised {ename})"
    else:
        safe = "a hidden check failed"
    return safe + sep + also


def _with_limits(msg: str, run: _RunResult) -> str:
    """Say which limit an out-of-memory failure ran into."""
    short = msg if len(msg) <= 160 else msg[:157] + "..."
    if _GPU_MEMORY.search(msg):
        return f"used more than the GPU's memory ({short})"
    if _MEMORY.search(msg):
        if run.memory_limit_gib > 0:
            return f"used more than the {run.memory_limit_gib:g} GiB memory limit ({short})"
        return f"ran out of memory ({short})"
    return msg


def _scrubber(secret: Sequence[str], work_dir: str,
              places: Sequence[tuple[str | os.PathLike, str]]) -> Any:
    """Text as a student may read it: no line of a hidden check, no path of the grader's machine."""
    pairs: list[tuple[str, str]] = []
    work = Path(work_dir) if work_dir else None
    named = ([(work / "course", "<course>"), (work, "<grader>")] if work else []) + list(places)
    for path, shown in named:
        for variant in {str(path), str(Path(path).resolve())}:
            if len(variant) > 1:
                pairs.append((variant, shown))
    pairs.sort(key=lambda p: len(p[0]), reverse=True)

    def scrub(text: str) -> str:
        for line in secret:
            text = text.replace(line, "[hidden]")
        for path, shown in pairs:
            text = text.replace(path, shown)
        return text

    return scrub


def _uncut(message: str, secret: Sequence[str]) -> str:
    """A message the plugin cut (at 2,000 characters) inside a hidden line loses that line's start."""
    for line in secret:
        for k in range(len(line) - 1, 5, -1):
            if message.endswith(line[:k]):
                return message[:-k] + "[hidden]"
    return message


def _where(cell: str, message: str) -> str:
    """``check: AssertionError: ...``; messages that already say it all stay as they are."""
    if message.startswith(("not run", "not done", "no result")):
        return message
    return f"{cell}: {message}"


def _score(prep: _Prepared, run: _RunResult, wall_s: float,
           scrub: Any = None) -> tuple[list[GradeRow], list[str]]:
    """One row per exercise (and one per problem with the run), in words a student may read."""
    from .grading_plugin import NOTEBOOK_RECORD

    scrub = scrub or _scrubber(prep.secrets, run.work, [])
    graded, student, name = prep.graded, prep.submission.student, prep.name
    code = [i for i, c in enumerate(graded.cells) if c.get("cell_type") == "code"]
    records = {code[n]: rec for n, rec in run.cells.items() if 0 <= n < len(code)}
    stopped = next((i for i in code if records.get(i, {}).get("message", "").startswith(
        ("the kernel died", "timed out", "the kernel sent no output"))), None)
    if run.killed:
        not_run = (f"not run: grading of this notebook was stopped at its wall-clock limit of "
                   f"{wall_s:g} s")
    elif run.tampered:
        not_run = ("no result the grader can trust: code in the kernel overwrote the grader's "
                   "results file")
    elif stopped is not None:
        not_run = f"not run: the kernel stopped earlier, in {_describe(graded, stopped)}"
    elif not run.cells:
        not_run = f"not run: nbval did not execute this notebook (exit code {run.returncode})"
    else:
        not_run = "not run"

    def outcome(i: int) -> tuple[str, str]:
        rec = records.get(i)
        if rec is None:
            return "not run", not_run
        msg = rec.get("message", "")
        if len(msg) >= 2000:
            msg = _uncut(msg, prep.secrets)
        if msg.startswith("not run: the kernel had stopped") and stopped is not None:
            msg = f"not run: the kernel stopped earlier, in {_describe(graded, stopped)}"
        if STUB_MESSAGE in msg:
            msg = "not done: the exercise still raises the released stub's NotImplementedError"
        status = rec.get("status", "failed")
        if status in ("failed", "error"):
            msg = _with_limits(_hidden_safe(rec, msg, prep.hidden.get(i, [])), run)
        return status, msg

    roles = {i for ex in prep.exercises for i in (ex.cell_index, ex.check_index)}
    # The first of the instructor's own cells that failed (setup, a demo between exercises).
    first_bad = next((i for i in code if i not in roles and records.get(i, {}).get("status")
                      in ("failed", "error")
                      and not records[i].get("message", "").startswith("not run")), None)
    rows, notes = [], []
    for ex in prep.exercises:
        status, msg = outcome(ex.cell_index)
        check = outcome(ex.check_index) if ex.check_index is not None else ("passed", "")
        extra = prep.notes.get(ex.id, [])
        if ex.id in prep.empty:
            passed, reason = False, "the exercise cell is empty"
        elif status != "passed":
            passed, reason = False, _where("exercise cell", msg)
        elif check[0] not in ("passed", "skipped"):
            passed, reason = False, _where("check", check[1])
        else:
            passed, reason = True, ""
        reason = scrub("; ".join([r for r in [reason] if r] + extra))
        rows.append(GradeRow(student, name, ex.id, passed, 1.0 if passed else 0.0, reason))
    # An exercise after a failed instructor's cell could not be graded: its names, imports
    # and data are missing (a broken grading environment, most often). Unless an exercise
    # before that cell failed (the student's code may have broken it), such an exercise is
    # "not graded" rather than failed; a pass stays a pass, and the released stub or an empty
    # cell is the student's whatever came before.
    broken = ""
    if first_bad is not None:
        broken = f"the instructor's {_describe(graded, first_bad)} failed"
        said = outcome(first_bad)[1]
        before = [r for ex, r in zip(prep.exercises, rows) if ex.cell_index < first_bad]
        if not run.tampered and all(r.passed for r in before):
            for k, ex in enumerate(prep.exercises):
                row = rows[k]
                if ex.cell_index < first_bad or row.passed or ex.id in prep.empty \
                        or row.reason.startswith("not done"):
                    continue
                reason = "; ".join([f"not graded: {broken} before this exercise: {said}"]
                                   + prep.notes.get(ex.id, []))
                rows[k] = GradeRow(student, name, ex.id, False, 0.0, scrub(reason), graded=False)
    problems: list[tuple[str, bool]] = []  # (what happened, whether it is graded)
    if first_bad is not None:
        if any(not r.graded for r in rows):
            problems.append((f"{broken}: {said}; the exercises after it that did not pass "
                             "were not graded", False))
        else:
            problems.append((f"{broken}: {said}; exercises after it may have failed because "
                             "of it", True))
    outside = run.cells.get(NOTEBOOK_RECORD)
    if outside and outside.get("status") == "failed":
        problems.append((f"the notebook {outside.get('message', '')} (started after the last "
                         "cell the grader saw end)", True))
    if run.killed:
        problems.append((f"stopped at the wall-clock limit of {wall_s:g} s (--notebook-timeout)",
                         True))
    if run.tampered:
        problems.append(("the grader's results file held records the grader did not sign "
                         "(ignored): code in the kernel wrote to it", True))
    elif not run.cells and not run.killed:
        problems.append((f"nbval did not run (exit code {run.returncode}): "
                         f"{_first_line(run.log_tail[-600:]) or 'no output'}", True))
    for p, counted in problems:
        rows.append(GradeRow(student, name, "", False, 0.0, scrub(p), graded=counted))
    if not run.cells:
        notes.append("last lines of the nbval run:\n" + run.log_tail[-1500:])
    return rows, notes


def _executed_copy(graded: Any, run: _RunResult) -> Any:
    nb = copy.deepcopy(graded)
    code = [c for c in nb.cells if c.get("cell_type") == "code"]
    count = 0
    for n, cell in enumerate(code):
        rec = run.cells.get(n)
        if rec is None:
            continue
        count += 1
        cell.execution_count = count
        outs = []
        for o in rec.get("outputs", []):
            try:
                out = nbformat.from_dict(o)
                if out.get("output_type") == "execute_result":
                    out["execution_count"] = count
                outs.append(out)
            except Exception:  # noqa: BLE001 - a malformed output is dropped, not fatal
                continue
        cell.outputs = outs
    return nb


# --- the batch ------------------------------------------------------------------------------

def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "student"


def _file_row(sub: Submission, reason: str, notebook: str = "", graded: bool = True) -> NotebookGrade:
    return NotebookGrade(sub.student, sub.label, notebook,
                         (GradeRow(sub.student, notebook or sub.label, "", False, 0.0, reason,
                                   graded),),
                         file=sub.file)


def _prepare(sub: Submission, course: _Course) -> _Prepared | NotebookGrade:
    if sub.path.is_dir():
        return _file_row(sub, "the folder holds no files: nothing was submitted")
    if not sub.path.name.endswith(".ipynb"):
        return _file_row(sub, "not a notebook (.ipynb): skipped")
    try:
        nb = nbformat.read(sub.path, as_version=4)
        if not isinstance(nb.get("cells"), list):
            raise ValueError("it has no list of cells")
    except Exception as exc:  # noqa: BLE001 - JSON errors, NotJSONError, unknown nbformat...
        why = (f"not a valid notebook ({type(exc).__name__}: "
               f"{_first_line(str(exc)) or 'unreadable'}): nothing was executed")
        name, _ = course.match({}, sub.path)  # by its file name, as a valid one would be
        if name is None:
            return _file_row(sub, why)
        _, exercises = course.load(name)
        return NotebookGrade(sub.student, sub.label, name,
                             tuple(GradeRow(sub.student, name, ex.id, False, 0.0, why)
                                   for ex in exercises),
                             tuple((ex.id, ex.title) for ex in exercises), file=sub.file)
    name, how = course.match(nb, sub.path)
    if name is None:
        return _file_row(sub, how + ": nothing was executed")
    instructor, exercises = course.load(name)
    graded, notes, empty = build_graded(instructor, exercises, nb)
    for ex in exercises:
        notes[ex.id] = notes.get(ex.id, []) + (
            [] if ex.id in empty else _review_notes(graded.cells[ex.cell_index].source))
    hidden, secret = _hidden_parts(graded, {ex.cell_index for ex in exercises})
    return _Prepared(sub, name, exercises, graded, notes, empty, [how] if how else [],
                     hidden, secret)


def _hidden_parts(graded: Any,
                  exercise_cells: set[int]) -> tuple[dict[int, list[tuple[int, int]]], list[str]]:
    """The hidden checks of a graded notebook: line ranges per cell, and their lines of source.

    A line counts as secret when it is long enough to say something (6 characters) and
    appears nowhere in what students can read.
    """
    hidden: dict[int, list[tuple[int, int]]] = {}
    lines: set[str] = set()
    public: set[str] = set()
    for k, cell in enumerate(graded.cells):
        if cell.get("cell_type") != "code" or k in exercise_cells:
            continue
        blocks = hidden_blocks(cell.source, f"cell {k + 1}")
        if not blocks:
            public.update(ln.strip() for ln in cell.source.splitlines())
            continue
        hidden[k] = blocks
        src = cell.source.splitlines()
        inside = {n for first, last in blocks for n in range(first, last + 1)}
        for n, ln in enumerate(src, start=1):
            (lines if n in inside else public).add(ln.strip())
    secret = sorted((ln for ln in lines - public if len(ln) >= 6 and not ln.startswith(
        ("### BEGIN HIDDEN", "### END HIDDEN"))), key=len, reverse=True)
    return hidden, secret


class _Slots:
    """Which GPU each running notebook has: one notebook per GPU at a time.

    ``gpus`` empty: the kernels get no GPU of their own (``hide``: none at all, else as the
    grader sees them) and nothing waits.
    """

    def __init__(self, gpus: Sequence[str], hide: bool) -> None:
        self.gpus, self.hide = list(gpus), hide
        self._free: queue.Queue[str] = queue.Queue()
        for g in self.gpus:
            self._free.put(g)

    def take(self) -> str | None:
        if self.gpus:
            return self._free.get()
        return "" if self.hide else None

    def give(self, gpu: str | None) -> None:
        if self.gpus and gpu is not None:
            self._free.put(gpu)


def _grade_one(prep: _Prepared, template: Path, hidden: Sequence[Path], out: Path,
               timeout_s: float, wall_s: float, file_name: str = "",
               memory_limit_gib: float = 0.0, gpu_memory_limit: bool = False,
               slots: _Slots | None = None, compile_threads: int | None = None) -> NotebookGrade:
    sub = prep.submission
    stem = f"{file_name or _safe(sub.student)}/{prep.name}"
    log = out / "logs" / (stem[:-len(".ipynb")] + ".log")
    slots = slots or _Slots([], hide=False)
    gpu = slots.take()
    try:
        # A kernel given a GPU gets no RLIMIT_DATA unless asked for (see the README): the GPU
        # is its own, and CUDA's address-space reservations are not checked here.
        limit = memory_limit_gib if (not gpu or gpu_memory_limit) else 0.0
        run = _run_nbval(prep.graded, prep.name, template, hidden, timeout_s, wall_s, log,
                         limit, gpu, compile_threads)
    finally:
        slots.give(gpu)
    places: list[tuple[str | os.PathLike, str]] = [(out, "<grades>"), (Path.home(), "~")]
    places += [(h, "<course>") for h in hidden]
    places += [(sub.path.parent, "<submissions>")] if sub.path.parent != Path(".") else []
    rows, notes = _score(prep, run, wall_s, _scrubber(prep.secrets, run.work, places))
    executed = out / "executed" / stem
    executed.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(_executed_copy(prep.graded, run), executed)
    if gpu:
        notes.append(f"graded on GPU {gpu} (CUDA_VISIBLE_DEVICES={gpu})")
    return NotebookGrade(sub.student, sub.label, prep.name, tuple(rows),
                         tuple((ex.id, ex.title) for ex in prep.exercises), round(run.seconds, 1),
                         str(executed), str(log), tuple(prep.file_notes + notes), sub.file)


def _dedupe(found: Sequence[tuple[Submission, _Prepared | NotebookGrade]]
            ) -> tuple[list[_Prepared], list[NotebookGrade]]:
    """One graded file per (student, notebook), the others set aside (a "not graded" file row).

    The one kept: a valid notebook before an invalid one (graded 0 without a run), then the
    one named like the course notebook, then the first by path.
    """
    groups: dict[tuple[str, str], list[tuple[Submission, _Prepared | NotebookGrade]]] = {}
    done: list[NotebookGrade] = []
    for sub, p in found:
        if isinstance(p, _Prepared):
            groups.setdefault((sub.student, p.name), []).append((sub, p))
        elif p.titles:  # an invalid file, matched to a course notebook by its name
            groups.setdefault((sub.student, p.notebook), []).append((sub, p))
        else:
            done.append(p)
    keep = []
    for (_, name), group in groups.items():
        group.sort(key=lambda item: (not isinstance(item[1], _Prepared),
                                     item[0].path.name != Path(name).name, item[0].label))
        first, chosen = group[0]
        (keep if isinstance(chosen, _Prepared) else done).append(chosen)
        for sub, _ in group[1:]:
            done.append(_file_row(sub, f"not graded: another file of this student for {name} was "
                                       f"graded ({first.file}); this one was not", name,
                                  graded=False))
    return keep, done


def _write_gradebook(grades: Sequence[NotebookGrade], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(GRADEBOOK_COLUMNS)
        for g in grades:
            for r in g.rows:
                w.writerow(r.as_csv())


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _not_graded_line(g: NotebookGrade) -> str:
    """``2 exercise(s) not graded: the instructor's cell 2 of 11 (...) failed: ...``, on one line."""
    why = next((r.reason for r in g.rows if not r.exercise and not r.graded
                and r.reason.startswith("the instructor's")), "")
    why = why.split("; the exercises after it", 1)[0]
    return _csv_reason(f"{len(g.not_graded)} exercise(s) not graded" + (f": {why}" if why else ""))


def student_report(student: str, grades: Sequence[NotebookGrade]) -> str:
    """Markdown report for one student: points per notebook, each exercise passed or not and why.

    It can be sent to the student as it is: it names their files as they know them (not
    where the instructor keeps them), holds nothing of another student's, and its reasons
    come from the gradebook, which never quotes a hidden check or a path of the grader.
    """
    total = sum(g.points for g in grades)
    most = sum(g.max_points for g in grades)
    skipped = sum(len(g.not_graded) for g in grades)
    lines = [f"# Grading report: {student}", "",
             f"**{total:g} of {most:g} points** over {len(grades)} submitted file(s)." + (
                 f" {skipped} exercise(s) could not be graded, through no fault of yours (see "
                 "below): they count neither for nor against you."
                 if skipped else ""), ""]
    for g in grades:
        titles = dict(g.titles)
        head = g.notebook or g.file or Path(g.submission).name
        lines += [f"## {head}", "", f"Submitted file: `{g.file or Path(g.submission).name}`" + (
            f"; {g.points:g} of {g.max_points:g} points" + (
                f", {len(g.not_graded)} exercise(s) not graded." if g.not_graded else ".")
            if g.titles else "."), ""]
        exercise_rows = [r for r in g.rows if r.exercise]
        if exercise_rows:
            lines += ["| exercise | passed | points | reason |", "|---|---|---|---|"]
            lines += [f"| {_md(titles.get(r.exercise, r.exercise))} | "
                      f"{('yes' if r.passed else 'no') if r.graded else 'not graded'} "
                      f"| {f'{r.points:g}' if r.graded else '-'} | {_md(r.reason)} |"
                      for r in exercise_rows]
            lines.append("")
        for heading, listed in (("Failed:", [r for r in exercise_rows if r.graded and not r.passed]),
                                ("Not graded:", [r for r in exercise_rows if not r.graded])):
            if listed:
                lines += [heading, ""]
                lines += [f"- **{titles.get(r.exercise, r.exercise)}** (`{r.exercise}`): {r.reason}"
                          for r in listed]
                lines.append("")
        problems = [r for r in g.rows if not r.exercise]
        if problems:
            lines += ["Problems with this file:", ""] + [f"- {r.reason}" for r in problems] + [""]
    return "\n".join(lines).rstrip() + "\n"


def _file_names(students: Sequence[str]) -> dict[str, str]:
    """A file name per student, distinct even where two names make the same safe name.

    ``a b`` and ``a_b`` (or ``Alice`` and ``alice`` on a case-insensitive disk) would
    otherwise share a report, and one student would be sent the other's grades.
    """
    names: dict[str, str] = {}
    taken: set[str] = set()
    for student in sorted(set(students)):
        base = _safe(student)
        name, k = base, 1
        while name.casefold() in taken:
            k += 1
            name = f"{base}-{k}"
        taken.add(name.casefold())
        names[student] = name
    return names


def _write_reports(grades: Sequence[NotebookGrade], out: Path,
                   names: dict[str, str] | None = None) -> dict[str, Path]:
    by_student: dict[str, list[NotebookGrade]] = {}
    for g in grades:
        by_student.setdefault(g.student, []).append(g)
    names = names or _file_names(list(by_student))
    folder = out / "reports"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for student, gs in sorted(by_student.items()):
        path = folder / f"{names.get(student) or _safe(student)}.md"
        path.write_text(student_report(student, gs), encoding="utf-8")
        written[student] = path
    summary = ["# Gradebook summary", "",
               "| student | notebook | points | of | failed | not graded |", "|---|---|---|---|---|---|"]
    for g in grades:
        if g.set_aside:
            continue  # a second copy: the copy graded has the line (gradebook.csv has both)
        failed = ", ".join(r.exercise or "(file)" for r in g.rows if r.graded and not r.passed)
        skipped = ", ".join(r.exercise for r in g.not_graded)
        summary.append(f"| {_md(g.student)} | {_md(g.notebook or g.submission)} | {g.points:g} | "
                       f"{g.max_points:g} | {_md(failed)} | {_md(skipped)} |")
    (out / "summary.md").write_text("\n".join(summary) + "\n", encoding="utf-8")
    return written


def grade(
    paths: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike = "grades",
    course_root: str | os.PathLike | None = None,
    timeout_s: float = DEFAULT_CELL_TIMEOUT_S,
    notebook_timeout_s: float = DEFAULT_NOTEBOOK_TIMEOUT_S,
    jobs: int | None = None,
    progress: bool = True,
    memory_limit_gib: float | None = None,
    hide_gpus: bool = False,
) -> list[NotebookGrade]:
    """Grade submissions; writes ``gradebook.csv``, ``summary.md``, ``reports/``, ``executed/``, ``logs/``.

    Args:
        paths: submitted notebooks and/or students' folders (see the module docstring).
        out_dir: where the gradebook and reports go.
        course_root: the folder holding the instructor notebooks (default: this repository).
        timeout_s: per-cell limit (nbval's ``--nbval-cell-timeout``).
        notebook_timeout_s: wall-clock limit for one notebook's whole run.
        jobs: notebooks graded at once (default :func:`default_jobs`; with GPUs in view and
            ``hide_gpus`` off, at most one per GPU).
        progress: print one line per graded file.
        memory_limit_gib: each kernel's memory limit (``RLIMIT_DATA``) in GiB; ``0``: none;
            ``None``: :func:`default_memory_limit_gib`, on kernels that are given no GPU.
            Given explicitly, it applies to every kernel.
        hide_gpus: give the kernels no GPU (``CUDA_VISIBLE_DEVICES=""``), so they grade as
            on a CPU, ``jobs`` at a time, under the memory limit. Otherwise, where the grader
            sees GPUs, each kernel sees one GPU of its own and no other kernel uses it
            meanwhile.

    Returns:
        One :class:`NotebookGrade` per submitted file, sorted by student and file.

    Raises:
        ValueError: no submissions, or a non-positive limit or job count, or a negative
            memory limit.
        FileNotFoundError: a submission path that does not exist, or no course notebooks.
    """
    from ..ledger import REPO_ROOT

    for what, value in (("timeout", timeout_s), ("notebook timeout", notebook_timeout_s)):
        if not value > 0:
            raise ValueError(f"{what} must be a positive number of seconds, got {value}")
    if memory_limit_gib is not None and not memory_limit_gib >= 0:
        raise ValueError(f"memory limit must be a number of GiB, 0 for none, got {memory_limit_gib}")
    if memory_limit_gib is not None and 0 < memory_limit_gib < 0.5:
        raise ValueError(f"a memory limit of {memory_limit_gib:g} GiB leaves a Python kernel no room "
                         "to start (one that imports torch needs about 1 GiB); 0 means none")
    asked_jobs = jobs
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    root = Path(course_root).resolve() if course_root is not None else REPO_ROOT
    course = _Course(root)
    submissions = collect_submissions(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    prepared, grades = _dedupe([(sub, _prepare(sub, course)) for sub in submissions])
    gpus = [] if hide_gpus or not prepared else _visible_gpus()
    if gpus:
        jobs = min(jobs, len(gpus))
    explicit_limit = memory_limit_gib is not None
    limit = default_memory_limit_gib(jobs) if memory_limit_gib is None else float(memory_limit_gib)
    # Each kernel that compiles would start min(32, cores) compile workers: share the cores.
    compile_threads = compile_threads_per_job(usable_cpu_count(), jobs) if jobs > 1 else None
    if progress:
        print(f"grading {len(prepared)} notebook(s) of {len({s.student for s in submissions})} "
              f"student(s), {jobs} at a time; {len(grades)} file(s) need no run", flush=True)
        if gpus:
            capped = f" (not the {asked_jobs} asked for)" if asked_jobs and asked_jobs > jobs else ""
            print(f"    {len(gpus)} GPU(s) in view: one notebook per GPU at a time{capped}; "
                  f"--hide-gpus grades on the CPU instead, more at a time", flush=True)
        print(f"    memory limit per notebook: " + (f"{limit:g} GiB" if limit else "none") + (
            " (kernels given a GPU: none)" if gpus and not explicit_limit and limit else ""),
            flush=True)
        for g in grades:
            print(f"    {g.student}: {g.submission}: {g.rows[0].reason}", flush=True)
    hidden = sorted({root, REPO_ROOT})
    names = _file_names([s.student for s in submissions])
    slots = _Slots(gpus, hide_gpus)
    scratch = Path(tempfile.mkdtemp(prefix="course-grade-template-"))
    try:
        template = _build_template(course, scratch) if prepared else scratch
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_grade_one, p, template, hidden, out, timeout_s,
                                   notebook_timeout_s, names[p.submission.student], limit,
                                   gpu_memory_limit=explicit_limit,  # --memory-limit given
                                   slots=slots, compile_threads=compile_threads): p
                       for p in prepared}
            for fut in concurrent.futures.as_completed(futures):
                p = futures[fut]
                try:
                    g = fut.result()
                except Exception as exc:  # noqa: BLE001 - a grader bug must not stop the class
                    scrub = _scrubber(p.secrets, "", [(out, "<grades>"), (Path.home(), "~")]
                                      + [(h, "<course>") for h in hidden])
                    g = _file_row(p.submission, scrub(f"the grader failed on this file: "
                                                      f"{type(exc).__name__}: {exc}"), p.name)
                grades.append(g)
                if progress:
                    print(f"    {g.student}: {g.notebook}: {g.points:g} of {g.max_points:g} "
                          f"points ({g.seconds:.0f} s)", flush=True)
                    if g.not_graded:
                        print(f"    WARNING {g.student}: {g.notebook}: {_not_graded_line(g)}",
                              flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    grades.sort(key=lambda g: (g.student, g.submission))
    _write_gradebook(grades, out / "gradebook.csv")
    _write_reports(grades, out, names)
    return grades
