"""The results ledger: named measurements and expectations, with their environment.

A notebook makes one :class:`Ledger`, records what it measured and states what
it expects ("bf16 speedup >= 1.8x on CUDA sm80+"). Each expectation is *met*,
*not met* or *not applicable here* (smoke size, or hardware it is not about),
and says so plainly. Smoke runs never fail on an expectation; full-size runs
where it applies do, at :meth:`Ledger.finish`, after the results are saved.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the ledger itself needs no torch: report and grade read ledgers without it
    from .env import EnvInfo

__all__ = [
    "Record",
    "Expectation",
    "Ledger",
    "ExpectationNotMet",
    "results_dir",
    "ledger_file_name",
    "ledger_key",
    "shared_jobs",
    "course_commit",
    "MET",
    "NOT_MET",
    "NOT_APPLICABLE",
]

MET, NOT_MET, NOT_APPLICABLE = "met", "not met", "not applicable"
#: COURSE_SMOKE=1/0 asks every notebook for smoke or full size (utils.resolve_smoke reads it).
SMOKE_ENV_VAR = "COURSE_SMOKE"
RESULTS_ENV_VAR = "COURSE_RESULTS_DIR"
STRICT_ENV_VAR = "COURSE_STRICT"
#: Set by ``python -m utils run --jobs N`` (N > 1) for the notebooks it runs side by side:
#: they share the machine, so their times are not measurements. The ledger records it.
SHARED_ENV_VAR = "COURSE_SHARED_JOBS"
#: The course's commit, for a ledger written outside a git checkout (else read from git).
COMMIT_ENV_VAR = "COURSE_COMMIT"
REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1


class ExpectationNotMet(AssertionError):
    """A full-size run missed an expectation that applies to its hardware."""


def ledger_key(text: str) -> str:
    """A ledger key made from a name or a label: lower case, each run of other characters one
    ``_`` (``"bf16 autocast"`` -> ``"bf16_autocast"``, ``"3. Correctness"`` ->
    ``"3_correctness"``).

    Raises:
        ValueError: ``text`` has no letter or digit to make a key of.
    """
    key = re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")
    if not key:
        raise ValueError(f"a key needs a letter or a digit, got {text!r}")
    return key


def results_dir() -> Path:
    """Where ledgers are written: ``$COURSE_RESULTS_DIR``, else ``results/local/`` in the repo."""
    env = os.environ.get(RESULTS_ENV_VAR)
    return Path(env).expanduser() if env else REPO_ROOT / "results" / "local"


def ledger_file_name(notebook: str) -> str:
    """The file a notebook's ledger is saved as, in :func:`results_dir`: its name with ``/`` as
    ``__`` (``"00-foundations/01_x"`` -> ``00-foundations__01_x.json``)."""
    return notebook.replace("/", "__") + ".json"


@dataclass(frozen=True)
class Record:
    """One number a notebook recorded: its name, value, unit and a note. (Not to be confused
    with ``torch.utils.benchmark.Measurement``, a timer's result, which ``utils.Timing``
    keeps.)"""

    name: str
    value: float
    unit: str
    note: str = ""


@dataclass(frozen=True)
class Expectation:
    """``value`` compared with ``threshold`` by ``op`` (``>=`` or ``<=``)."""

    name: str
    description: str
    value: float | None  # None: not measured here (then the status is "not applicable")
    op: str
    threshold: float
    status: str
    reason: str = ""

    def line(self) -> str:
        mark = {MET: "MET", NOT_MET: "NOT MET", NOT_APPLICABLE: "n/a"}[self.status]
        got = "not measured" if self.value is None else f"measured {self.value:.3g}"
        text = f"[{mark:^7}] {self.description}: {got} (expected {self.op} {self.threshold:g})"
        return text + (f" - {self.reason}" if self.reason else "")


def _number(value: float) -> str:
    """A value for a table: thousands separated when large, four significant digits else."""
    if 1e4 <= abs(value) < 1e15:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def shared_jobs() -> int:
    """How many notebooks share this machine with this one (1: it has the machine to itself),
    from ``COURSE_SHARED_JOBS``, which ``python -m utils run --jobs N`` sets."""
    raw = os.environ.get(SHARED_ENV_VAR, "").strip()
    try:
        return max(1, int(raw)) if raw else 1
    except ValueError:
        return 1


def course_commit() -> str:
    """The course's git commit (12 hex digits, ``+dirty`` when tracked files changed), or
    ``$COURSE_COMMIT``, or ``""`` outside a git checkout."""
    if os.environ.get(COMMIT_ENV_VAR):
        return os.environ[COMMIT_ENV_VAR].strip()
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "diff", "--quiet", "HEAD", "--"],
                               capture_output=True, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _strict_default(smoke: bool) -> bool:
    word = os.environ.get(STRICT_ENV_VAR, "").strip().lower()
    if word in {"1", "true", "yes", "on"}:
        return True
    if word in {"0", "false", "no", "off"}:
        return False
    # Side by side with other notebooks a timing claim can miss for want of the machine:
    # report it, do not fail on it (COURSE_STRICT=1 still asks for failing).
    return not smoke and shared_jobs() == 1


class Ledger:
    """Measurements and expectations of one notebook run.

    Args:
        notebook: the notebook's path relative to the repo, e.g.
            ``"00-foundations/01_measuring_performance"``.
        smoke: whether this run is at smoke size.
        env: the environment (default: :func:`utils.get_env`).
        strict: fail :meth:`finish` on an applicable missed expectation
            (default: full-size runs; ``COURSE_STRICT=0/1`` overrides).
        autosave: write the JSON after every record, so a cell that fails
            later loses nothing measured before it.
    """

    def __init__(self, notebook: str, smoke: bool, env: EnvInfo | dict | None = None,
                 strict: bool | None = None, autosave: bool = False) -> None:
        if not notebook or not isinstance(notebook, str):
            raise ValueError("notebook must be a non-empty name such as '00-foundations/01_x'")
        self.notebook = notebook
        self.smoke = bool(smoke)
        if env is None:
            from .env import get_env

            env = get_env()
        self.env: dict[str, Any] = env.fingerprint() if hasattr(env, "fingerprint") else dict(env)
        self.strict = _strict_default(self.smoke) if strict is None else strict
        self.autosave = autosave
        self.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.shared_jobs = shared_jobs()   # > 1: other notebooks ran at the same time
        self.commit = course_commit()
        self.measurements: dict[str, Record] = {}
        self.expectations: dict[str, Expectation] = {}
        # the size table's column this run read, and the sizes (utils.size_table)
        self.sizes: dict[str, Any] = {}

    # -- recording -------------------------------------------------------------
    def record(self, name: str, value: Any, unit: str = "", note: str = "") -> Record:
        """Record a measured number under ``name`` (a later record replaces it).

        ``value`` may also be one of the course's result objects (``utils.Timing``,
        ``SpeedupTable``, ``MemoryResult``, ``RungResult`` ...: anything with a
        ``ledger_fields()`` method): its standard fields are recorded with their units under
        ``name_<field>`` (a timing's median as ``name_ms``, its IQR as ``name_iqr_ms``), and
        the first of them is returned.
        """
        fields = getattr(value, "ledger_fields", None)
        if callable(fields) and not isinstance(value, (int, float)):
            if unit:
                raise ValueError(f"{name!r}: a result object brings its own units; drop unit=")
            made = [self._measurement(f"{name}_{suffix}" if suffix else name, v, u, note)
                    for suffix, (v, u) in fields().items() if v is not None]
            if not made:
                raise ValueError(f"{name!r}: {type(value).__name__} has nothing to record "
                                 "(did it run?)")
            m = made[0]
        else:
            m = self._measurement(name, value, unit, note)
        if self.autosave:
            self.save()
        return m

    def set_sizes(self, tier: str, sizes: dict[str, Any]) -> None:
        """Record which column of the size table this run read, and the sizes it chose."""
        self.sizes = {"tier": str(tier), "values": {k: str(v) for k, v in sizes.items()}}
        if self.autosave:
            self.save()

    def _measurement(self, name: str, value: float, unit: str, note: str) -> Record:
        if not name:
            raise ValueError("a measurement needs a name")
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"measurement {name!r} must be a number, got {value!r}") from None
        if math.isnan(value):
            raise ValueError(f"measurement {name!r} is NaN: the measurement failed")
        m = Record(name, value, unit, note)
        self.measurements[name] = m
        return m

    def expect(self, name: str, value: float | None, *, at_least: float | None = None,
               at_most: float | None = None, applies: bool = True, reason: str = "",
               description: str | None = None, in_smoke: bool = False,
               unit: str = "") -> Expectation:
        """State and check an expectation; prints its status and returns it.

        Args:
            name: a key, e.g. ``"bf16_speedup"``.
            value: the measured value (also recorded as a measurement), or
                ``None`` where it cannot be measured on this machine; then
                ``applies`` must be ``False`` and ``reason`` says why.
            at_least / at_most: the threshold (exactly one of them).
            applies: ``False`` when this hardware is not what the expectation
                is about; give the ``reason`` (e.g. "needs CUDA sm80+").
            description: words for the report (default: the name).
            in_smoke: check it at smoke size too (for hardware-independent
                facts, such as memory savings that show at any size).
            unit: the value's unit (``"x"`` for a speedup ratio).
        """
        if (at_least is None) == (at_most is None):
            raise ValueError("give exactly one of at_least= or at_most=")
        op, threshold = (">=", at_least) if at_least is not None else ("<=", at_most)
        if value is None:
            if applies or not reason:
                raise ValueError(f"expectation {name!r} has no value: that is only allowed with "
                                 "applies=False and a reason saying why it was not measured")
        else:
            value = self._measurement(name, value, unit, "").value
        if not applies:
            status = NOT_APPLICABLE
        elif self.smoke and not in_smoke:
            status, reason = NOT_APPLICABLE, "smoke size: checked at full size only"
        elif (value >= threshold) if op == ">=" else (value <= threshold):
            status = MET
        else:
            status = NOT_MET
        exp = Expectation(name, description or name, value, op, float(threshold), status, reason)
        self.expectations[name] = exp
        if self.autosave:
            self.save()
        print(exp.line())
        return exp

    # -- reading ---------------------------------------------------------------
    def __getitem__(self, name: str) -> float:
        return self.measurements[name].value

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "notebook": self.notebook,
            "smoke": self.smoke,
            "strict": self.strict,
            "created": self.created,
            "commit": self.commit,
            "shared_jobs": self.shared_jobs,
            "env": self.env,
            "sizes": self.sizes,
            "measurements": [asdict(m) for m in self.measurements.values()],
            "expectations": [asdict(e) for e in self.expectations.values()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Ledger":
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"unknown ledger schema {data.get('schema')!r}")
        led = cls(data["notebook"], data["smoke"], env=data["env"], strict=data["strict"])
        led.created = data["created"]
        # Fields added later: a ledger written before them ran alone, at an unrecorded commit.
        led.commit = data.get("commit", "")
        led.shared_jobs = int(data.get("shared_jobs", 1))
        led.sizes = dict(data.get("sizes") or {})
        for m in data["measurements"]:
            led.measurements[m["name"]] = Record(**m)
        for e in data["expectations"]:
            led.expectations[e["name"]] = Expectation(**e)
        return led

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Ledger":
        """Read a ledger written by :meth:`save`."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no ledger at {p}")
        return cls.from_dict(json.loads(p.read_text(encoding="utf-8")))

    def default_path(self) -> Path:
        return results_dir() / ledger_file_name(self.notebook)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the ledger as JSON (default: :func:`results_dir`) and return the path."""
        p = Path(path) if path is not None else self.default_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2), encoding="utf-8")
        tmp.replace(p)
        return p

    @property
    def shared(self) -> bool:
        """Whether other notebooks ran beside this one (its times are then not measurements)."""
        return self.shared_jobs > 1

    def to_markdown(self) -> str:
        """The claims (threshold, value, verdict), then every measurement, as markdown tables."""
        lines = []
        if self.shared:
            lines += [f"_{self.shared_jobs} notebooks ran at once on this machine: the times and "
                      "speedups below are not measurements._", ""]
        if self.expectations:
            lines += ["| claim | measured | expected | verdict |", "|---|---:|---|---|"]
            lines += [
                f"| {e.description} | {'-' if e.value is None else format(e.value, '.3g')} "
                f"| {e.op} {e.threshold:g} | {e.status}"
                + (f" ({e.reason})" if e.reason else "") + " |"
                for e in self.expectations.values()
            ]
            lines.append("")
        lines += ["| measurement | value | unit |", "|---|---:|---|"]
        lines += [f"| {m.name} | {_number(m.value)} | {m.unit} |"
                  for m in self.measurements.values()]
        return "\n".join(lines)

    def finish(self) -> Path:
        """Save, print a summary, and in strict mode fail on a missed expectation.

        The results are written before anything can fail, so nothing is lost.
        """
        path = self.save()
        counts = {s: sum(e.status == s for e in self.expectations.values())
                  for s in (MET, NOT_MET, NOT_APPLICABLE)}
        size = "smoke" if self.smoke else "full"
        print(f"{len(self.measurements)} measurements saved to {path} ({size} size, "
              f"{self.env.get('device_name', '?')}).")
        print(f"expectations: {counts[MET]} met, {counts[NOT_MET]} not met, "
              f"{counts[NOT_APPLICABLE]} not applicable here")
        if self.shared:
            print(f"({self.shared_jobs} notebooks ran at once on this machine: times and speedups "
                  "are not measurements, and a missed timing claim says nothing)")
        for e in self.expectations.values():
            print("  " + e.line())
        missed = [e for e in self.expectations.values() if e.status == NOT_MET]
        if missed and self.strict:
            raise ExpectationNotMet(
                "full-size run missed: " + "; ".join(e.line() for e in missed)
                + ". Results are saved; a threshold changes only with a measured reason"
                " written in the notebook."
            )
        return path
