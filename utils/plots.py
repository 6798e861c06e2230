"""Plots in one consistent style: speedup bars, memory bars, sweeps."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .memory import format_bytes
from .timing import SpeedupTable

__all__ = ["use_style", "speedup_bars", "memory_bars", "sweep_plot", "plain_log_ticks",
           "curves_plot", "fit_slope"]

_STYLE = {
    "figure.dpi": 110,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "font.size": 9,
}
BASELINE_COLOR = "#8c8c8c"
CANDIDATE_COLOR = "#1f77b4"
SLOWER_COLOR = "#d62728"
_LINESTYLES = ("-", "--", ":", "-.")  # for lines drawn over a reference


def use_style() -> None:
    """Apply the course's matplotlib style (idempotent)."""
    import matplotlib as mpl

    mpl.rcParams.update(_STYLE)


def _axes(ax: Any, figsize: tuple[float, float]) -> Any:
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def speedup_bars(table: SpeedupTable | Mapping[str, float], title: str = "", ax: Any = None,
                 baseline: str | None = None, xlabel: str | None = None) -> Any:
    """Horizontal bars of speedup over the baseline; a dashed line marks 1x.

    Bars slower than the baseline are red: a slowdown is a result, not an error.

    Args:
        table: a :class:`SpeedupTable`, or a mapping label -> ratio.
        baseline: the baseline's label, drawn grey (default: the table's
            baseline, or a mapping's first key; ``""`` for none).
        xlabel: the axis label (default: "speedup vs <baseline> (higher is better)").
    """
    if isinstance(table, SpeedupTable):
        items = [(r.label, r.speedup) for r in table.rows]
        base = table.baseline if baseline is None else baseline
    else:
        items = list(table.items())
        base = (items[0][0] if items else "") if baseline is None else baseline
    if not items:
        raise ValueError("speedup_bars needs at least one value")
    ax = _axes(ax, (6.5, 0.45 * len(items) + 1.2))
    labels = [k for k, _ in items][::-1]
    values = [v for _, v in items][::-1]
    # Red marks a slowdown against a baseline; plain ratios (no baseline) get one colour.
    colors = [BASELINE_COLOR if k == base else
              (SLOWER_COLOR if v < 1 and base else CANDIDATE_COLOR)
              for k, v in zip(labels, values)]
    ax.barh(labels, values, color=colors)
    ax.axvline(1.0, color="black", ls="--", lw=1)
    for y, v in enumerate(values):
        ax.annotate(f"{v:.2f}x", (v, y), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_xlabel(xlabel or f"speedup vs {base} (higher is better)")
    ax.set_title(title)
    ax.margins(x=0.15)
    return ax


def memory_bars(values: Mapping[str, float], title: str = "", ax: Any = None,
                stacked: Mapping[str, Mapping[str, float]] | None = None) -> Any:
    """Bars of memory in bytes, labelled in MiB/GiB.

    With ``stacked`` (variant -> {part: bytes}) each bar is split into parts,
    e.g. parameters / gradients / optimizer state / activations.
    """
    import numpy as np

    if stacked is not None:
        variants = list(stacked)
        parts = list(dict.fromkeys(p for v in stacked.values() for p in v))
        ax = _axes(ax, (6.5, 0.5 * len(variants) + 1.5))
        left = np.zeros(len(variants))
        for part in parts:
            widths = np.array([stacked[v].get(part, 0) for v in variants], dtype=float) / 2**20
            ax.barh(variants, widths, left=left, label=part)
            left += widths
        for y, total in enumerate(left):
            ax.annotate(format_bytes(total * 2**20), (total, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.invert_yaxis()  # first variant on top, in reading order
        ax.legend(loc="best")
    else:
        if not values:
            raise ValueError("memory_bars needs at least one value")
        ax = _axes(ax, (6.5, 0.45 * len(values) + 1.2))
        labels = list(values)
        mib = [values[k] / 2**20 for k in labels]
        ax.barh(labels, mib, color=CANDIDATE_COLOR)
        for y, (k, v) in enumerate(zip(labels, mib)):
            ax.annotate(format_bytes(values[k]), (v, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.invert_yaxis()
    ax.set_xlabel("memory (MiB)")
    ax.set_title(title)
    ax.margins(x=0.2)
    return ax


def plain_log_ticks(ax: Any) -> Any:
    """Label an Axes' log axes 0.5, 2, 1000 rather than 5x10^-1, 2x10^0, 10^3.

    Minor ticks get labels only when an axis spans less than 20x, where there
    would otherwise be one label or none. Linear axes are left alone.
    """
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() != "log":
            continue
        lo, hi = sorted(axis.get_view_interval())
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain if lo > 0 and hi / lo < 20 else NullFormatter())
    return ax


def sweep_plot(x: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str,
               ylabel: str, title: str = "", ax: Any = None, logx: bool = False,
               logy: bool = False, reference: str | None = None,
               ticks_at_x: bool = False) -> Any:
    """Lines with markers for a parameter sweep: one line per series.

    With ``reference`` (a series name), series that lie on top of each other stay visible:
    the reference is drawn as a wide pale band without markers, the others as thin lines of
    different styles over it (as :func:`curves_plot` draws them). With ``ticks_at_x`` the
    x axis has one labelled tick per measured x value and no others (a log axis otherwise
    labels powers of ten that were never measured).
    """
    if not series:
        raise ValueError("sweep_plot needs at least one series")
    if reference is not None and reference not in series:
        raise ValueError(f"reference {reference!r} is not one of {list(series)}")
    ax = _axes(ax, (6.5, 4))
    others = 0
    for name, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {name!r} has {len(ys)} values for {len(x)} x values")
        if reference is None:
            style: dict[str, Any] = {"marker": "o"}
        elif name == reference:
            style = {"lw": 5.0, "alpha": 0.35}
        else:
            style = {"lw": 1.5, "ls": _LINESTYLES[others % len(_LINESTYLES)]}
            others += 1
        ax.plot(list(x), list(ys), label=name, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    plain_log_ticks(ax)
    if ticks_at_x:
        from matplotlib.ticker import NullFormatter, NullLocator

        ax.set_xticks(list(x), [f"{v:g}" for v in x])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
    if len(series) > 1:
        ax.legend()
    return ax



def curves_plot(curves: Mapping[str, Sequence[float]], reference: str | None = None,
                xlabel: str = "step", ylabel: str = "training loss", title: str = "",
                ax: Any = None, logy: bool = False, colors: Mapping[str, str] | None = None) -> Any:
    """Training curves (one value per step, from step 1) that may lie on top of each other.

    The ``reference`` curve (fp32, say) is drawn as a wide pale band and the others as thin
    lines of different styles over it, so a curve that follows the reference stays visible
    instead of hiding it.

    Args:
        curves: ``{label: values}``.
        reference: the label drawn wide and pale (``None``: none).
        colors: optional ``{label: colour}``.

    Raises:
        ValueError: no curves, or a ``reference`` that is not one of them.
    """
    if not curves:
        raise ValueError("curves_plot needs at least one curve")
    if reference is not None and reference not in curves:
        raise ValueError(f"reference {reference!r} is not one of {list(curves)}")
    ax = _axes(ax, (8, 3.2))
    others = 0
    for label, ys in curves.items():
        ys = [float(v) for v in ys]
        kw: dict[str, Any] = {"label": label}
        if colors and label in colors:
            kw["color"] = colors[label]
        if label == reference:
            kw.update(lw=4.0, alpha=0.35)
        else:
            kw.update(lw=1.4, alpha=0.95, ls=_LINESTYLES[others % len(_LINESTYLES)])
            others += 1
        ax.plot(range(1, len(ys) + 1), ys, **kw)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
        plain_log_ticks(ax)
    ax.legend()
    return ax


def fit_slope(xs: Sequence[float], ys: Sequence[float], log: bool = False) -> float:
    """The least-squares slope of ``ys`` against ``xs`` (through two points: the line's).

    With ``log=True`` the slope on a log-log plot: how ``ys`` grows with ``xs`` as a power
    (2 for quadratic, 1 for linear).

    Raises:
        ValueError: fewer than two points, lengths that differ, all ``xs`` equal, or a
            non-positive value with ``log=True``.
    """
    import math

    xs, ys = [float(v) for v in xs], [float(v) for v in ys]
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs against {len(ys)} ys")
    if len(xs) < 2:
        raise ValueError("a slope needs at least two points")
    if log:
        if min(xs + ys) <= 0:
            raise ValueError("log=True needs positive values")
        xs, ys = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((a - mx) ** 2 for a in xs)
    if sxx == 0:
        raise ValueError("all xs are equal: no slope")
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sxx
