"""Axis helpers of the plots (:mod:`scaleattn.plot`): figures without pyplot, log floors, clipped values, integer
ticks, legends outside the axes. Layer L4 (matplotlib only, no other scaleattn module)."""
from __future__ import annotations

import numpy as np

__all__ = ["new_figure", "positive_floor", "legend_outside", "mark_clipped", "integer_ticks", "runs"]


def new_figure(ncols: int = 1, width: float = 5.0, nrows: int = 1, height: float = 3.8):
    """A constrained-layout Figure (no pyplot) of ``nrows x ncols`` panels of ``width x height`` inches each, and
    its axes, flattened."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    return fig, axes


def positive_floor(values, top, rel: float = 1e-18):
    """Values for a log axis: entries <= floor = ``rel * top`` (zero or round-off negatives) are drawn at it."""
    floor = max(abs(float(top)), 1e-300) * rel
    return np.maximum(np.asarray(values, np.float64), floor), floor


def legend_outside(fig, ax, side: str = "center", ncols: int = 1):
    """The legend of ``ax`` below the axes, outside them (constrained layout makes room): it never covers a
    point or a line of the plot (a legend inside the axes did, e.g. the cutoff running through its text)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc=f"outside lower {side}", fontsize="small", ncols=ncols, markerscale=1.5)


def mark_clipped(ax, x, values, floor, color, what: str):
    """Values at or below the log axis' ``floor`` drawn at it, with a legend entry saying how many and where they
    were clipped; returns the mask of the clipped values.

    Each run of consecutive clipped values is one artist, not a marker per value (70 markers at one height
    merged into a solid band): a segment along the floor from its first to its last x with open down-triangles
    at both ends (``gid="clipped"``; one Line2D for all runs, NaN between them) and, for a run of two or more,
    its count written below its middle (``gid="clipped_count"``), in a margin made below the floor."""
    low = np.asarray(values, np.float64) <= floor
    if not low.any():
        return low
    x = np.asarray(x, np.float64)
    xs, counts = [], []
    for first, last in runs(low):
        xs += ([x[first]] if first == last else [x[first], x[last]]) + [np.nan]
        counts.append(((x[first] + x[last]) / 2, last - first + 1))
    xs = np.array(xs[:-1])
    k = int(low.sum())
    ax.semilogy(xs, np.full(xs.size, floor), "-", marker="v", color=color, mfc="none", ms=5, lw=2.5, alpha=0.8,
                solid_capstyle="butt", gid="clipped",
                label=f"{k} of the {what} below {floor:.0e} (or ≤ 0): clipped, drawn at the floor")
    for mid, n in counts:  # below the floor, where nothing else is drawn (above it, a cutoff line crossed it)
        if n > 1:
            ax.annotate(f"{n} clipped", (mid, floor), xytext=(0, -6), textcoords="offset points", ha="center",
                        va="top", fontsize="x-small", color=color, gid="clipped_count")
    if any(n > 1 for _, n in counts):  # room for that text: about a tenth of the decades drawn below the floor
        top = float(np.nanmax(np.asarray(values, np.float64)))
        decades = np.log10(top / floor) if top > floor else 1.0
        ax.update_datalim([(x[0], floor / 10 ** max(0.12 * decades, 0.5))], updatex=False)  # (autoscaled still)
    return low


def integer_ticks(axis) -> None:
    """Integer ticks, thinned to at most about 10 (a tick per head count ran 22 labels together: "10111213")."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(nbins=10, steps=[1, 2, 5, 10], integer=True, min_n_ticks=1))


def runs(mask) -> list[tuple[int, int]]:
    """``(first, last)`` index of each run of True in ``mask``.

    Examples
    --------
    >>> runs(np.array([False, True, True, False, True]))
    [(1, 2), (4, 4)]
    """
    m = np.concatenate([[False], np.asarray(mask, bool), [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2])]
