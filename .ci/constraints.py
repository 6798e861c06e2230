"""Write and compare constraints.txt, the course's known-good set of packages.

    python .ci/constraints.py write FREEZE [FREEZE ...] --python X.Y [X.Y ...] --out FILE
    python .ci/constraints.py compare constraints.txt FREEZE

``write`` turns ``pip freeze`` outputs, one per Python version the suite passed
on, into a constraints file: a package with one tested version gets one line, a
package whose tested versions differ by Python gets a line per version with a
``python_version`` marker. PyTorch and the packages a PyTorch build brings with
it are left out on purpose: cluster users install the build their site needs.
``compare`` lists the pins a newer environment moved.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# Left free: torch, its builds' own dependencies, and packaging tools.
FREE = {"torch", "torchvision", "torchaudio", "triton", "sympy", "mpmath", "networkx",
        "filelock", "fsspec", "typing-extensions", "setuptools", "pip", "wheel",
        "pytorch-optimization-track"}
FREE_PREFIXES = ("nvidia-", "cuda-")

HEADER = """\
# The course's known-good set: the Jupyter, plotting and test stack at versions the
# whole test suite passed with. The README's install uses it:
#     pip install -e ".[dev]" -c constraints.txt
# PyTorch is left free (install the build your cluster needs first, then the command
# above); so are the packages a PyTorch build brings with it.
# Written by .ci/constraints.py from {sources}. To move the pins: run .ci/latest (the
# suite against the newest releases), review its constraints-latest.txt, and write this
# file again from environments the suite passed in (README: "Keeping a known-good set").
"""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(path: str | Path) -> dict[str, str]:
    """``{normalized name: version}`` of the ``name==version`` lines of a freeze or
    constraints file; a line with a marker counts only if it holds for this Python."""
    pins = {}
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        line, _, marker = raw.split("#")[0].partition(";")
        if marker.strip():
            from packaging.markers import Marker

            if not Marker(marker.strip()).evaluate():
                continue
        line = line.strip()
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s]+)", line)
        if m:
            pins[normalize(m.group(1))] = m.group(2)
    return pins


def is_free(name: str) -> bool:
    return name in FREE or name.startswith(FREE_PREFIXES)


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def constraint_lines(freezes: dict[str, dict[str, str]]) -> list[str]:
    """Lines for ``{python "X.Y": {name: version}}``; markers only where versions differ."""
    pythons = sorted(freezes, key=_key)
    names = sorted({n for f in freezes.values() for n in f if not is_free(n)})
    lines = []
    for name in names:
        tested = {py: freezes[py].get(name) for py in pythons}
        versions = {v for v in tested.values() if v is not None}
        if len(versions) == 1 and None not in tested.values():
            lines.append(f"{name}=={versions.pop()}")
            continue
        for i, py in enumerate(pythons):
            if tested[py] is None:
                continue
            marker = []
            if i > 0:
                marker.append(f'python_version >= "{py}"')
            if i < len(pythons) - 1:
                marker.append(f'python_version < "{pythons[i + 1]}"')
            lines.append(f"{name}=={tested[py]}" + (f"; {' and '.join(marker)}" if marker else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write a constraints file from freeze outputs")
    w.add_argument("freezes", nargs="+", help="pip freeze outputs, one per Python version")
    w.add_argument("--python", nargs="+", required=True,
                   help="the Python version (X.Y) each freeze was made with, in the same order")
    w.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="list the pins that a freeze output moved")
    c.add_argument("constraints")
    c.add_argument("freeze")
    args = parser.parse_args(argv)

    if args.command == "write":
        if len(args.freezes) != len(args.python):
            parser.error("give one --python version per freeze file")
        freezes = {py: read_freeze(f) for f, py in zip(args.freezes, args.python)}
        sources = ", ".join(f"Python {py}" for py in sorted(freezes, key=_key))
        text = HEADER.format(sources=sources) + "\n".join(constraint_lines(freezes)) + "\n"
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}: {len(text.splitlines())} lines from {sources}")
        return 0

    pinned, fresh = read_freeze(args.constraints), read_freeze(args.freeze)
    moved = [(n, pinned[n], fresh[n]) for n in sorted(pinned) if n in fresh and fresh[n] != pinned[n]]
    new = sorted(n for n in fresh if n not in pinned and not is_free(n))
    for name, old, now in moved:
        print(f"moved: {name} {old} -> {now}")
    for name in new:
        print(f"new dependency: {name}=={fresh[name]}")
    if not moved and not new:
        print("the newest releases are the pinned ones")
    return 1 if moved or new else 0


if __name__ == "__main__":
    sys.exit(main())
