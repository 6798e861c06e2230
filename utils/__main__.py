"""``python -m utils``: the course's command line.

    python -m utils env                         what this machine is
    python -m utils run PATH... [--smoke|--full] [--out DIR]
    python -m utils report RESULTS... [--out FILE]
    python -m utils student PATH... --out DIR   student versions for a class
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .runner import DEFAULT_CELL_TIMEOUT_S


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import print_env

    print_env(args.device)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .runner import default_out_dir, run_notebooks

    smoke = True if args.smoke else (False if args.full else None)
    out = Path(args.out) if args.out else default_out_dir()
    runs = run_notebooks(args.paths, out_dir=out, smoke=smoke, timeout_s=args.timeout,
                         kernel=args.kernel, log_output=args.log_output,
                         progress=not args.no_progress)
    failed = [r for r in runs if r.status != "ok"]
    print(f"\n{len(runs) - len(failed)} of {len(runs)} notebooks ran cleanly.")
    for r in failed:
        print(f"{r.status.upper()} {r.notebook}: {r.summary}")
        if r.executed:
            print(f"    executed copy, with the error in place: {r.executed}")
    print(f"Executed notebooks, results JSON and run.json are in {out}")
    print(f"Summarise with: python -m utils report {out}")
    return 1 if failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    path = write_report(args.paths, out=args.out, plots=not args.no_plots)
    print(path.read_text(encoding="utf-8"))
    print(f"written to {path}")
    return 0


def _cmd_student(args: argparse.Namespace) -> int:
    from .student import make_student_versions

    for p in make_student_versions(args.paths, args.out):
        print(f"wrote {p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m utils",
                                     description="PyTorch Optimization Track tools.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("env", help="print the device and software this machine offers")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: best available)")
    p.set_defaults(func=_cmd_env)

    p = sub.add_parser("run", help="execute notebooks or whole modules headless (papermill)")
    p.add_argument("paths", nargs="+", help="notebooks (.ipynb) and/or module folders")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="force smoke size (about a minute on a CPU)")
    size.add_argument("--full", action="store_true", help="force full size (meant for a GPU)")
    p.add_argument("--out", default=None,
                   help="output folder (default: results/local/run-<timestamp>)")
    p.add_argument("--timeout", type=int, default=DEFAULT_CELL_TIMEOUT_S, metavar="SECONDS",
                   help="per-cell limit; a cell that reaches it fails its notebook "
                        f"(default {DEFAULT_CELL_TIMEOUT_S})")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    p.add_argument("--log-output", action="store_true",
                   help="stream cell output to this log (useful in sbatch jobs)")
    p.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("report", help="results JSON -> markdown table and plots")
    p.add_argument("paths", nargs="+", help="ledger JSON files or folders holding them")
    p.add_argument("--out", default=None, help="markdown file to write (default: beside the results)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("student", help="write student versions (solutions replaced by stubs)")
    p.add_argument("paths", nargs="+", help="notebooks and/or module folders")
    p.add_argument("--out", required=True, help="folder for the student notebooks")
    p.set_defaults(func=_cmd_student)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
