"""``python -m utils``: the course's command line.

    python -m utils env                         what this machine is
    python -m utils run PATH... [--smoke|--full] [--out DIR] [--jobs N]
    python -m utils report RESULTS... [--out FILE]
    python -m utils release [PATH...] [--out DIR]   student versions (alias: student)
    python -m utils grade SUBMISSION... [--out DIR] [--timeout S] [--jobs N]
                          [--memory-limit GIB] [--hide-gpus]

``grade`` exits 0 when every file was graded (whatever the grades), 2 on a bad argument
and 3 when some exercises could not be graded because an instructor's cell before them
failed (see :data:`GRADE_NOT_GRADED_EXIT`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .course.runner import DEFAULT_CELL_TIMEOUT_S

#: ``grade``'s exit code when an instructor's cell failed and kept exercises from being graded.
GRADE_NOT_GRADED_EXIT = 3


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import print_env

    print_env(args.device)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .course.runner import default_out_dir, run_notebooks, stop_on_sigterm

    smoke = True if args.smoke else (False if args.full else None)
    out = Path(args.out) if args.out else default_out_dir()
    stop_on_sigterm()  # Slurm's time limit and scancel stop the run the way Ctrl-C does
    try:
        runs = run_notebooks(args.paths, out_dir=out, smoke=smoke, timeout_s=args.timeout,
                             kernel=args.kernel, log_output=args.log_output,
                             # a bar only on a terminal: in a batch log it is noise
                             progress=not args.no_progress and sys.stderr.isatty(),
                             jobs=args.jobs)
    except KeyboardInterrupt as exc:
        signum = 15 if "signal 15" in str(exc) else 2
        print(f"\nstopped by {'SIGTERM' if signum == 15 else 'Ctrl-C'}: {out / 'run.json'} lists "
              "the notebooks that finished, the one that was running (its copy holds what it "
              "did so far) and those not started", file=sys.stderr, flush=True)
        return 128 + signum
    failed = [r for r in runs if r.status != "ok"]
    print(f"\n{len(runs) - len(failed)} of {len(runs)} notebooks ran cleanly.")
    for r in failed:
        print(f"{r.status.upper()} {r.notebook}: {r.summary}")
        if r.executed:
            print(f"    executed copy, with the error in place: {r.executed}" if r.cell is not None
                  else f"    executed copy: {r.executed}")
    print(f"Executed notebooks, results JSON and run.json are in {out}")
    print(f"Summarise with: python -m utils report {out}")
    return 1 if failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .course.report import write_report

    path = write_report(args.paths, out=args.out, plots=not args.no_plots, figures=args.figures)
    print(path.read_text(encoding="utf-8"))
    print(f"written to {path}")
    return 0


def _cmd_release(args: argparse.Namespace) -> int:
    from .course.student import release

    written = release(args.paths, args.out, course_root=args.course)
    for p in written:
        print(f"wrote {p}")
    print(f"{len(written)} student notebook(s) in {args.out}")
    return 0


def _cmd_grade(args: argparse.Namespace) -> int:
    from .course.grading import grade

    out = Path(args.out)
    grades = grade(args.paths, out, course_root=args.course, timeout_s=args.timeout,
                   notebook_timeout_s=args.notebook_timeout, jobs=args.jobs,
                   memory_limit_gib=args.memory_limit, hide_gpus=args.hide_gpus)
    graded = [r for g in grades for r in g.rows if r.exercise and r.graded]
    not_graded = [g for g in grades if g.not_graded]
    skipped = sum(len(g.not_graded) for g in not_graded)
    print(f"\n{len(grades)} file(s) of {len({g.student for g in grades})} student(s): "
          f"{sum(r.passed for r in graded)} of {len(graded)} exercises passed"
          + (f"; {skipped} not graded." if skipped else "."))
    print(f"gradebook: {out / 'gradebook.csv'}; per-student reports: {out / 'reports'}; "
          f"summary: {out / 'summary.md'}")
    if skipped:
        print(f"WARNING: {skipped} exercise(s) in {len(not_graded)} file(s) could not be graded: an "
              "instructor's cell before them failed (a package missing from the grading "
              "environment?). They count neither for nor against the students; the gradebook's "
              "reasons name the cell and its error. Fix it and grade those files again.",
              file=sys.stderr)
        return GRADE_NOT_GRADED_EXIT
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m utils", allow_abbrev=False,
                                     description="PyTorch Optimization Track tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    # No abbreviated options (allow_abbrev=False on every parser): in a batch script a
    # mistyped flag (`--smok`) must fail, not be taken for another one.

    p = sub.add_parser("env", allow_abbrev=False, help="print the device and software this machine offers")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: best available)")
    p.set_defaults(func=_cmd_env, parser=p)

    p = sub.add_parser("run", allow_abbrev=False, help="execute notebooks or whole modules headless (papermill)")
    p.add_argument("paths", nargs="+", help="notebooks (.ipynb) and/or module folders")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="force smoke size (about a minute on a CPU)")
    size.add_argument("--full", action="store_true",
                      help="force full size (meant for a GPU; without one, the notebooks run "
                           "their CPU full sizes, and the runner says so)")
    p.add_argument("--out", default=None,
                   help="output folder (default: results/local/run-<date>-<time>-<pid> in this "
                        "checkout)")
    p.add_argument("--timeout", type=int, default=DEFAULT_CELL_TIMEOUT_S, metavar="SECONDS",
                   help="per-cell limit; a cell that reaches it fails its notebook "
                        f"(default {DEFAULT_CELL_TIMEOUT_S})")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    p.add_argument("--log-output", action="store_true",
                   help="stream cell output to this log (useful in sbatch jobs)")
    p.add_argument("--no-progress", action="store_true",
                   help="no per-cell progress bar (there is none when the output is not a "
                        "terminal, as in a batch job's log)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="notebooks run at once, each in its own kernel (default 1). With N > 1 "
                        "they share the machine: a quick pass over the code paths, not a "
                        "measurement (the ledgers say so)")
    p.set_defaults(func=_cmd_run, parser=p)

    p = sub.add_parser("report", allow_abbrev=False, help="results JSON -> markdown table and plots")
    p.add_argument("paths", nargs="+", help="ledger JSON files or folders holding them")
    p.add_argument("--out", default=None, help="markdown file to write (default: beside the results)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument("--figures", default=None, metavar="DIR",
                   help="folder for the plots (default: beside the markdown file); the plots are "
                        "then named by notebook, device and date")
    p.set_defaults(func=_cmd_report, parser=p)

    # `student` is the old name of `release`: a parser of its own (argparse's alias would show
    # `release` in its usage line), with no line in the list of commands.
    for name, kwargs in (("release", {"help": "write student versions (solutions replaced by "
                                              "stubs, cells given ids); old name: student"}),
                         ("student", {"description": "The old name of `release`."})):
        p = sub.add_parser(name, allow_abbrev=False, **kwargs)
        p.add_argument("paths", nargs="*",
                       help="notebooks and/or module folders (default: every course notebook)")
        p.add_argument("--out", default="student",
                       help="folder for the student notebooks (default: student)")
        p.add_argument("--course", default=None, metavar="DIR",
                       help="folder holding the instructor modules (default: this repository)")
        p.set_defaults(func=_cmd_release, parser=p)

    from .course.grading import DEFAULT_CELL_TIMEOUT_S as GRADE_CELL_S, DEFAULT_NOTEBOOK_TIMEOUT_S

    p = sub.add_parser("grade", allow_abbrev=False, help="grade submissions per exercise with nbval (runs students' code!)",
                       epilog=f"exit codes: 0: every file was graded, whatever the grades; 2: a bad "
                              f"argument or path; {GRADE_NOT_GRADED_EXIT}: some exercises could not "
                              "be graded because an instructor's cell before them failed (a "
                              "broken grading environment, most often): a warning says so, and "
                              "the gradebook leaves their passed and points empty")
    p.add_argument("paths", nargs="+", metavar="SUBMISSION",
                   help="submitted notebooks and/or one folder per student")
    p.add_argument("--out", default="grades",
                   help="folder for gradebook.csv, summary.md, reports/, executed/ and logs/ "
                        "(default: grades)")
    p.add_argument("--timeout", type=float, default=GRADE_CELL_S, metavar="SECONDS",
                   help=f"per-cell limit (default {GRADE_CELL_S})")
    p.add_argument("--notebook-timeout", type=float, default=DEFAULT_NOTEBOOK_TIMEOUT_S,
                   metavar="SECONDS", help="wall-clock limit for one notebook "
                                           f"(default {DEFAULT_NOTEBOOK_TIMEOUT_S})")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="notebooks graded at once (default: one per CPU core, at most 16; "
                        "with GPUs in view, one per GPU)")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="memory limit of each notebook's kernel, in GiB; 0 for none (default: "
                        "the machine's memory shared by the notebooks graded at once, 4 to 16 "
                        "GiB, on kernels given no GPU)")
    p.add_argument("--hide-gpus", action="store_true",
                   help="give the kernels no GPU: grade as on a CPU, --jobs at a time, under "
                        "the memory limit (default with GPUs: one notebook per GPU at a time)")
    p.add_argument("--course", default=None, metavar="DIR",
                   help="folder holding the instructor modules (default: this repository)")
    p.set_defaults(func=_cmd_grade, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's own usage line, not the list of commands
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
