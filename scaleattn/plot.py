"""Plots of a fit (matplotlib): certificate spectrum, head spectrum, loss against heads, predictions.

Every ``*_figure`` function returns a :class:`matplotlib.figure.Figure` built without pyplot (no global state,
no GUI backend; Jupyter displays it inline, :meth:`Figure.savefig` writes PNG through Agg). Marked elements
carry a ``gid`` (``"lambda_min"``, ``"lambda_max"``, ``"cutoff"``, ``"dropped"``, ``"clipped"`` (values below a
log axis' floor, drawn at it), ``"lambda_min_clipped"``, ``"n_heads"``, ``"minimal_heads"``, ``"identity"``) so
they can be found programmatically. Legends lie outside the axes (figure legends below them), never on the data.

:func:`save_run_plots` writes ``spectrum.png`` (when the whole spectrum is known), ``heads.png``,
``loss_vs_heads.png`` (when the report's ``loss_vs_heads`` has two or more points) and ``predictions.png`` (when
the dataset is reachable) next to ``report.json``.
The eigenvalues of ``Lambda_D`` come from the run's ``spectrum.zarr`` (:func:`scaleattn.run.read_run`), or are
recomputed from ``stats.zarr`` for runs without one (psi > 2,000) up to psi = 4,000 (at any psi with
``full_spectrum``); past it a :class:`~scaleattn.errors.Note` says why there is no ``spectrum.png``. Layer L4.
"""
from __future__ import annotations

import contextlib
import io
import math
import re
import textwrap
import warnings

import numpy as np

from ._version import __version__
from .data._dataset import Dataset, open_dataset
from .display._figures import integer_ticks, legend_outside, mark_clipped, new_figure, positive_floor
from .display._text import minimal_heads
from .errors import DatasetError, Note, ParameterError, ScaleattnError
from .run import MODEL, SPECTRUM, SPECTRUM_RECOMPUTE_PSI, STATS, read_run, spectrum_not_kept, write_files
from .run import read_run as load_run  # noqa: F401 (its old, documented name)
from .store import _formats
from .store._location import Location, check_path, check_storage_options, is_url, options_for, resolve
from .store._outputs import check_disjoint, check_output_location, hold, reading, relation

__all__ = ["spectrum_figure", "head_spectrum_figure", "loss_vs_heads_figure", "predictions_figure",
           "sample_predictions", "samples_drawn", "dataset_rows", "run_figures", "figure_pngs", "save_run_plots"]
#: rows (samples or prefixes) drawn in the predictions-against-targets scatter
PREDICTION_POINTS = 2000
#: a loss curve whose values (and mean y^2) span less than this factor is drawn on a linear axis, else log
LINEAR_SPAN = 10.0
#: outputs drawn on panels of their own in the predictions figure (pooled on one panel beyond)
PREDICTION_PANELS = 16


# ---- the certificate's spectrum ---------------------------------------------------------------------------
def spectrum_figure(eigenvalues, eigenvalues_scaled=None, *, rtol: float | None = None, lambda_min=None,
                    title: str | None = None, identifiable: bool | None = None, method: str | None = None):
    """Eigenvalue spectrum of ``Lambda_D = G / N`` with ``lambda_min`` / ``lambda_max`` marked ([Y25] Lemma 2.3;
    DESIGN §4), and, when ``eigenvalues_scaled`` is given, the Jacobi-scaled spectrum with the relative cutoff
    ``rtol * max`` that decides the rank (eigenvalues below it are the ambiguous directions, drawn in red).

    Parameters
    ----------
    eigenvalues : (psi,) float
        Eigenvalues of ``Lambda_D`` (any order; :attr:`Certificate.eigenvalues`).
    eigenvalues_scaled : (psi,) float, optional
        :attr:`Certificate.spectrum_scaled`.
    rtol : float, optional
        Relative cutoff (``report["cutoff_rtol"]``); needed to draw the cutoff.
    lambda_min : float, optional
        The certificate's ``lambda_min`` (default: the smallest eigenvalue clipped at 0).
    identifiable : bool, optional
        The certificate's verdict (``report["identifiable"]``) for the ``lambda_min`` label; default: lambda_min
        at the plot's floor means not identifiable. The floor is ``1e-18`` of the largest value, lower when the
        cutoff is (a QR certificate's spectrum resolves ``(psi eps)^2``).
    method : {"gram", "qr"}, optional
        The report's ``certificate_method``: with ``"qr"`` the spectra are squared singular values of R (the
        scaled R on the right), and the cutoff is labelled as the CLI states it, ``sqrt(rtol) x sigma_max of R``.

    Values at or below the floor are drawn at it, one segment per run of them with its count
    (``gid="clipped"``, ``"clipped_count"``), and said to be clipped in the legend, as is ``lambda_min`` when it
    lies below the floor (its line then sits at the floor up to the clipped run, with a downward arrow at its
    index, ``gid="lambda_min_clipped"``); on the right, values below the cutoff (``gid="dropped"``, x) are those
    above the floor. The legends lie below the axes.

    Returns a Figure with one axis (two with ``eigenvalues_scaled``), log y, eigenvalues in descending order.
    """
    ev = np.sort(np.asarray(eigenvalues, np.float64))[::-1]
    if ev.size == 0:
        raise ParameterError("eigenvalues: empty spectrum")
    qr = method == "qr"
    fig, axes = new_figure(1 if eigenvalues_scaled is None else 2)
    lam_max = float(ev[0])
    lam_min = float(max(ev[-1], 0.0)) if lambda_min is None else float(lambda_min)
    rel = 1e-18 if rtol is None else min(1e-18, 1e-2 * float(rtol))  # below the cutoff, whatever the method
    shown, floor = positive_floor(ev, lam_max, rel)
    not_identifiable = lam_min <= floor if identifiable is None else not identifiable
    ax = axes[0]
    idx = np.arange(1, ev.size + 1)
    low = ev <= floor
    ax.semilogy(idx[~low], shown[~low], ".-", color="C0", ms=3, lw=0.8,
                label=r"eigenvalues of $\Lambda_D$" + (r" ($\sigma^2$ of R / N)" if qr else ""))
    mark_clipped(ax, idx, ev, floor, "C0", "eigenvalues")
    ax.axhline(lam_max, color="C2", ls=":", lw=1, gid="lambda_max", label=rf"$\lambda_{{\max}}$ = {lam_max:.3g}")
    verdict = " not identifiable" if not_identifiable else ""
    if lam_min < floor:  # the line sits at the floor: say so, and point down
        label = rf"$\lambda_{{\min}}$ = {lam_min:.3g} (below {floor:.0e}: clipped, drawn at the floor;{verdict})"
        # at the clipped run's last index (lambda_min's own), else the right edge
        at, coords = ((float(idx[-1]), "data") if low.any() else (0.97, "axes fraction"))
        ax.annotate("", xy=(at, floor), xycoords=(coords, "data"), xytext=(at, floor * 1e3),
                    textcoords=(coords, "data"), gid="lambda_min_clipped",
                    arrowprops={"arrowstyle": "->", "color": "C3", "lw": 1.2})
    else:
        label = rf"$\lambda_{{\min}}$ = {lam_min:.3g}" + (f" ({verdict.strip()})" if verdict else "")
    if lam_min < floor and low.any():  # ends where the clipped run begins: a line through its marks hid both
        ax.plot([1.0, idx[low][0] - 0.5], [floor, floor], color="C3", ls="--", lw=1.2, gid="lambda_min", label=label)
    else:
        ax.axhline(max(lam_min, floor), color="C3", ls="--", lw=1.2, gid="lambda_min", label=label)
    ax.set_xlabel("eigenvalue index (descending)")
    ax.set_ylabel(r"eigenvalue of $\Lambda_D = G/N$")
    ax.set_title(title or r"Certificate: spectrum of $\Lambda_D$")
    if eigenvalues_scaled is not None:
        ws = np.sort(np.asarray(eigenvalues_scaled, np.float64))[::-1]
        top = max(float(ws[0]), 0.0)
        shown_s, floor_s = positive_floor(ws, top, rel)
        ax2 = axes[1]
        cut = None if rtol is None else float(rtol) * top
        kept = np.ones(ws.size, bool) if cut is None else ws > cut
        j = np.arange(1, ws.size + 1)
        ax2.semilogy(j[kept], shown_s[kept], ".", color="C0", ms=4, label=f"kept ({int(kept.sum())})")
        low_s = ws <= floor_s
        if (~kept).any():  # the clipped ones only once, by _mark_clipped (an x on each of its marks hid both)
            ax2.semilogy(j[~kept & ~low_s], shown_s[~kept & ~low_s], "x", color="C3", ms=5, gid="dropped",
                         label=f"below cutoff ({int((~kept).sum())}: ambiguous"
                         + (f"; {int(low_s.sum())} of them clipped, at the floor)" if low_s.any() else ")"))
        mark_clipped(ax2, j, ws, floor_s, "C3", "values")
        if cut is not None:
            label = (f"cutoff ({math.sqrt(float(rtol)):.1e} x $\\sigma_{{\\max}}$ of R)$^2$ = {float(rtol):.1e} x max"
                     if qr else f"cutoff {float(rtol):.1e} x max")
            ax2.axhline(max(cut, floor_s), color="k", ls="--", lw=1, gid="cutoff", label=label)
        ax2.set_xlabel("eigenvalue index (descending)")
        if qr:
            ax2.set_ylabel(r"$\sigma^2$ of the Jacobi-scaled R")
            ax2.set_title("QR of the features: rank decision")
        else:
            ax2.set_ylabel(r"eigenvalue of $D^{-1/2} G D^{-1/2}$")
            ax2.set_title("Jacobi-scaled Gram: rank decision")
        legend_outside(fig, ax, "left")
        legend_outside(fig, ax2, "right")
    else:
        legend_outside(fig, ax)
    return fig


#: singular values of W above this fraction of the largest count towards its rank (as
# :func:`scaleattn.heads._algebra.svd_heads`
#: keeps them)
SVD_RANK_RTOL = 1e-12


def head_spectrum_figure(singular_values, n_heads: int | None = None, title: str | None = None, *,
                         minimal: dict | None = None, method: str | None = None, exact: bool | None = None,
                         train_mse: float | None = None, residual: float | None = None):
    """Singular values ``sigma_r`` of ``W`` (d_out*d, d*d), the head spectrum of [Y25] Alg. 1 (DESIGN §5), with
    the number of heads kept marked (``gid="n_heads"``). Log y; zeros are drawn at a floor.

    ``minimal`` (:func:`scaleattn.display._text.minimal_heads` of the report: ``{"count", "exact", "source"}``) marks
    the fewest heads known to compute the function (``gid="minimal_heads"``) when it is below ``n_heads``,
    labelled "fewer heads suffice"; ``method`` (the report's ``heads_method``) names the heads kept.

    ``exact`` (``heads_exact``), ``train_mse`` and ``residual`` (``heads_residual``) say in the ``n_heads`` label
    what the heads kept compute when they are fewer than the rank of W (``--heads minimal`` or ``H``: heads found
    by a search, not the leading terms of the SVD): exact heads are then not a cut of the spectrum drawn; heads
    that are not exact compute another function than the fit (at a higher train MSE, or, on data that do not
    determine the function, at the same). Singular values at or below the floor are marked ``gid="clipped"``."""
    s = np.sort(np.asarray(singular_values, np.float64))[::-1]
    if s.size == 0:
        raise ParameterError("singular_values: empty")
    fig, (ax,) = new_figure(1)
    shown, floor = positive_floor(s, s[0])
    r = np.arange(1, s.size + 1)
    ax.semilogy(r, shown, "o-", color="C1", ms=4, lw=0.8, label=r"$\sigma_r(W)$")
    mark_clipped(ax, r, s, floor, "C1", "singular values")
    if n_heads is not None:
        rank = int((s > SVD_RANK_RTOL * s[0]).sum()) if s[0] > 0 else 0
        label = f"heads kept: {n_heads}" + (f" ({method})" if method else "")
        facts = ", ".join(([f"heads residual {residual:.1e}"] if residual is not None else [])
                          + ([f"train MSE {train_mse:.3g}"] if train_mse is not None else []))
        facts = f"\n({facts})" if facts else ""
        if n_heads < rank and exact:
            label += (f": exact, {'they compute' if n_heads > 1 else 'it computes'} the fitted function{facts}"
                      f"\nthe SVD of W has rank {rank}: fewer heads were found,\nnot a cut of the SVD")
        elif n_heads < rank and exact is False:  # (on a singular Gram at no loss: another function, as good a fit)
            label += (f": not exact, {'they compute' if n_heads > 1 else 'it computes'} another function than the"
                      f" fit{facts}\nfewer heads than the rank {rank} of W")
        ax.axvline(n_heads + 0.5, color="k", ls="--", lw=1, gid="n_heads", label=label)
    if minimal is not None and (n_heads is None or minimal["count"] < n_heads):
        who = "head search" if minimal["source"] == "head search" else "the teacher's"
        ax.axvline(minimal["count"] + 0.5, color="C2", ls="-.", lw=1.4, gid="minimal_heads",
                   label=f"fewer heads suffice: {minimal['count']} ({who})")
    ax.set_xlabel("index r")
    integer_ticks(ax.xaxis)
    ax.set_ylabel("singular value of W")
    ax.set_title(title or "Head spectrum (SVD of W)")
    legend_outside(fig, ax)
    return fig


def loss_vs_heads_figure(loss_vs_heads, target_mean_square: float | None = None, title: str | None = None):
    """Training loss against the number of heads H from ``report["loss_vs_heads"]``
    (a list of ``{"heads": H, "train_mse_stats": mse}``, or ``"train_objective_stats"`` after a ridge fit:
    :func:`scaleattn.store._formats.loss_curve`); None when it has fewer than two points (the ``svd`` heads give one
    point: no curve).
    With ``target_mean_square`` the zero-model MSE (mean y^2) is drawn for reference. The y axis is log unless
    everything drawn spans less than :data:`LINEAR_SPAN` (then linear, plain numbers); the x ticks are integers,
    at most about 10 of them."""
    if not loss_vs_heads or len(loss_vs_heads) < 2:
        return None
    what, rows = _formats.loss_curve(loss_vs_heads)
    rows = sorted(rows)
    H = np.array([h for h, _ in rows])
    mse = np.array([m for _, m in rows])
    top = max(float(np.max(np.abs(mse))), float(target_mean_square or 0.0), 1e-300)
    shown, floor = positive_floor(mse, top)
    fig, (ax,) = new_figure(1)
    drawn = np.append(mse, target_mean_square) if target_mean_square else mse
    if float(drawn.min()) > floor and float(drawn.max()) < LINEAR_SPAN * float(drawn.min()):
        # less than a decade: a log axis labelled its minor ticks 8.08x10^0, 8.1x10^0, ...; plain numbers, no
        # offset (a "+8.08" above the axis hid the values)
        from matplotlib.ticker import ScalarFormatter

        ax.plot(H, mse, "o-", color="C0", label=f"{what} (from statistics)")
        ax.yaxis.set_major_formatter(ScalarFormatter(useOffset=False, useMathText=True))
    else:
        ax.semilogy(H, shown, "o-", color="C0", label=f"{what} (from statistics)")
        mark_clipped(ax, H, mse, floor, "C0", "MSE values" if what == "train MSE" else "values")
    if target_mean_square:
        ax.axhline(target_mean_square, color="0.5", ls=":", gid="mean_square", label="mean $y^2$ (zero model)")
    ax.set_xlabel("number of heads H")
    ax.set_ylabel(what)
    integer_ticks(ax.xaxis)
    ax.set_title(title or "Loss against number of heads")
    legend_outside(fig, ax)
    return fig


def sample_predictions(model, dataset, max_points: int = PREDICTION_POINTS, storage_options=None):
    """Targets and predictions ``(y, y_hat)``, each (rows, d_out) float64, for the first samples of a dataset
    (a :class:`~scaleattn.data._dataset.Dataset`, or a path/URL opened with ``storage_options``; at most about
    ``max_points`` rows; causal data give one row per valid prefix)."""
    ds = dataset if isinstance(dataset, Dataset) else open_dataset(dataset, storage_options)
    model.check_dataset(ds)  # (a dataset of another d or d_out: one line naming both)
    tok, lens, y = ds.read(0, samples_drawn(ds, max_points))
    yhat = np.asarray(model.predict(tok, lens, causal=ds.causal))
    if ds.causal:
        valid = np.ones(tok.shape[:2], bool) if lens is None else np.arange(ds.length)[None, :] < lens[:, None]
        return y[valid], yhat[valid]
    return y, yhat


def samples_drawn(ds: Dataset, max_points: int = PREDICTION_POINTS) -> int:
    """How many of the first samples :func:`sample_predictions` draws: about ``max_points`` rows (a causal
    sample gives up to T rows), at least one."""
    per = ds.length if ds.causal else 1
    return int(min(ds.n_samples, max(1, max_points // per)))


def dataset_rows(ds: Dataset) -> int:
    """The rows of a dataset (what a fit's ``n_rows`` counts): its samples, or with causal data their valid
    prefixes (the sum of the lengths)."""
    if not ds.causal:
        return int(ds.n_samples)
    return int(ds.read_lengths(0, ds.n_samples).sum()) if ds.has_lengths else int(ds.n_samples) * int(ds.length)


def predictions_figure(y, y_hat, title: str | None = None, *, dataset: str | None = None,
                       training: bool | None = None, total_rows: int | None = None,
                       samples: tuple[int, int] | None = None):
    """Predictions against targets with the identity line (``gid="identity"``): one panel per output up to
    :data:`PREDICTION_PANELS` outputs (each titled with its MSE; outputs pooled on one panel beyond, one colour
    per output, translucent), so that no output hides another.

    The title names the rows drawn: ``"first n of N rows"`` (``total_rows`` = N, the dataset's rows; ``"all N
    rows"`` when they are all drawn), or with ``samples = (s, S)`` (the first s of the dataset's S samples
    drawn) ``"first s of S samples"``, followed by ``"(n of N rows)"`` where rows are not samples (causal data:
    a row per prefix); and their MSE, which is that of these rows, not the report's ``train_mse`` unless they
    are all the rows; and the dataset they come from, ``dataset`` (its name), with ``training``: True "the
    training data", False "not the training data" (a held-out plot is never taken for the fit's)."""
    y, y_hat = np.asarray(y, np.float64), np.asarray(y_hat, np.float64)
    if y.shape != y_hat.shape or y.size == 0:
        raise ParameterError(f"y and y_hat: expected equal non-empty shapes, got {y.shape} and {y_hat.shape}")
    y2, p2 = y.reshape(y.shape[0], -1), y_hat.reshape(y.shape[0], -1)
    n, d_out = y2.shape
    pooled = d_out > PREDICTION_PANELS
    ncols = 1 if pooled else min(d_out, 4)
    nrows = 1 if pooled else -(-d_out // 4)
    width, height = (4.6, 3.8) if ncols == 1 else (2.7, 2.6)
    fig, axes = new_figure(ncols, width, nrows, height)
    for a in range(d_out):
        ax = axes[0 if pooled else a]
        if pooled:
            ax.scatter(y2[:, a], p2[:, a], s=5, alpha=0.35, lw=0, color=f"C{a % 10}",
                       marker="os^Dv<>ph*"[(a // 10) % 10], zorder=2)
        else:
            ax.scatter(y2[:, a], p2[:, a], s=5, alpha=0.6, lw=0, color=f"C{a % 10}", zorder=2)
        if not pooled and d_out > 1:
            ax.set_title(f"output {a}: MSE {float(np.mean((y2[:, a] - p2[:, a]) ** 2)):.3g}", fontsize="medium")
    panels = axes[:1] if pooled else axes[:d_out]
    for i, ax in enumerate(panels):
        cols = slice(None) if pooled else slice(i, i + 1)
        lo = float(min(y2[:, cols].min(), p2[:, cols].min()))
        hi = float(max(y2[:, cols].max(), p2[:, cols].max()))
        # under the points (an exact fit's points lie on it)
        ax.plot([lo, hi], [lo, hi], "--", color="0.4", lw=0.8, zorder=1, gid="identity", label="y = ŷ")
        if i + ncols >= len(panels):  # the bottom panel of its column
            ax.set_xlabel("target y")
        if i % ncols == 0:
            ax.set_ylabel("prediction ŷ")
        if ncols > 1:
            ax.tick_params(labelsize="small")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    mse = float(np.mean((y2 - p2) ** 2))
    rows = _rows_drawn(n, total_rows, samples)
    where = ("the training data" if training else "not the training data") if training is not None else ""
    if dataset:
        where = f"{dataset} ({where})" if where else dataset
    head = f"Predictions against targets on {where}" if where else "Predictions against targets"
    of = "of these rows, all outputs" if d_out > 1 else "of these rows"
    text = title or (f"{head}\n{rows}, MSE {mse:.3g} ({of}); dashed:\u00a0y\u00a0=\u00a0ŷ"  # (kept on one line)
                     + (f"\n{d_out} outputs pooled (colour and marker by output)" if pooled else ""))
    # wrapped to the figure's width (a long dataset name or the rows line ran off both edges): about 13
    # characters per inch at 10 pt, 11 at 12 pt
    per_inch = 13 if ncols > 1 else 11
    text = "\n".join(_wrap(line, int(fig.get_figwidth() * per_inch)) for line in text.split("\n"))
    fig.suptitle(text, fontsize="medium" if ncols > 1 else "large")
    return fig


def _wrap(line: str, width: int) -> str:
    """``line`` wrapped to ``width`` characters, never inside parentheses (``(of these rows, all outputs)``
    and ``(the training data)`` broke in two across lines).

    Examples
    --------
    >>> _wrap("Predictions against targets on x.zarr (the training data)", 50)
    'Predictions against targets on x.zarr\n(the training data)'
    """
    kept = re.sub(r"\([^()]*\)", lambda m: m.group(0).replace(" ", "\u00a0"), line)  # (no break at a no-break space)
    return textwrap.fill(kept, width, break_long_words=False).replace("\u00a0", " ")


def _rows_drawn(n: int, total_rows: int | None, samples: tuple[int, int] | None) -> str:
    """``first 166 of 300 samples (1,992 of 3,600 rows)``, ``all 300 samples``, ``first 50 of 5,000 rows``: the
    part of the dataset drawn, in samples when known (``first 1,992 of 3,600 rows`` of causal data, a row per
    prefix, read as if most samples were left out), with the rows where they are not the samples."""
    if samples is None:
        if total_rows is None:
            return f"{n:,} rows"
        return f"all {n:,} rows" if total_rows <= n else f"first {n:,} of {total_rows:,} rows"
    s, total = samples
    part = f"all {total:,} samples" if s >= total else f"first {s:,} of {total:,} samples"
    if n == s and (total_rows is None or total_rows == total):  # a row per sample
        return part
    if s >= total:
        return f"{part} ({n:,} rows)"
    return f"{part} ({n:,} of {total_rows:,} rows)" if total_rows is not None else f"{part} ({n:,} rows)"


# ---- runs -------------------------------------------------------------------------------------------------
def run_figures(run, dataset=None, storage_options=None, *, full_spectrum: bool = False) -> dict:
    """All figures of a run: ``{"spectrum", "heads", "loss_vs_heads", "predictions"}`` -> Figure.

    ``run`` is a :class:`~scaleattn.pipeline.FitResult` or a run directory (read with ``storage_options``;
    ``full_spectrum``: recompute a missing spectrum at any psi, :func:`scaleattn.run.read_run`).
    ``dataset`` (a Dataset or URL; default the report's ``dataset``) gives the predictions panel; the report's,
    when it cannot be read, is skipped with a warning (one given here raises); ``loss_vs_heads`` is skipped when
    the report has no such entry. A run without the whole spectrum (the Cholesky and krylov paths, psi > 2,000)
    has no ``spectrum`` figure: a :class:`~scaleattn.errors.Note` says why and what draws it.
    """
    if hasattr(run, "certificate"):
        r = run.report
        view = {"report": r, "eigenvalues": run.certificate.eigenvalues,
                "eigenvalues_scaled": run.certificate.spectrum_scaled, "model": run.model,
                "spectrum_method": r.get("certificate_method"),
                "spectrum_note": None if run.certificate.eigenvalues is not None else
                spectrum_not_kept(r.get("psi"), recompute=(r.get("psi") or 0) <= SPECTRUM_RECOMPUTE_PSI,
                                  stats_kept=getattr(run.statistics, "operator", None) is None)}
    else:
        view = read_run(run, options_for(run, storage_options), full_spectrum=full_spectrum)
    r = view["report"]
    figs = {}
    if view["eigenvalues"] is not None:
        figs["spectrum"] = spectrum_figure(view["eigenvalues"], view["eigenvalues_scaled"],
                                           rtol=r.get("cutoff_rtol"), lambda_min=r.get("lambda_min"),
                                           identifiable=r.get("identifiable"), method=view["spectrum_method"])
    else:
        warnings.warn(f"no spectrum.png: {view['spectrum_note']}", Note, stacklevel=2)
    if r.get("head_singular_values"):
        figs["heads"] = head_spectrum_figure(r["head_singular_values"], r.get("n_heads"), minimal=minimal_heads(r),
                                             method=r.get("heads_method"), exact=r.get("heads_exact"),
                                             train_mse=r.get("train_mse"), residual=r.get("heads_residual"))
    lvh = loss_vs_heads_figure(r.get("loss_vs_heads"), r.get("target_mean_square"))
    if lvh is not None:
        figs["loss_vs_heads"] = lvh
    given = dataset is not None
    dataset = dataset if given else r.get("dataset")
    check_storage_options(storage_options, *([] if hasattr(run, "certificate") else [run]),
                          *([dataset] if dataset and not isinstance(dataset, Dataset) else []))
    if view["model"] is not None and dataset:
        try:
            opts = None if isinstance(dataset, Dataset) else options_for(dataset, storage_options)
            ds = dataset if isinstance(dataset, Dataset) else open_dataset(dataset, opts)
            if not given and _is_training(ds, r, storage_options) is False:  # (the report's numbers are another's)
                raise DatasetError(f"{ds.url} changed since the fit (another dataset is stored there now); pass"
                                   " `dataset` to draw the predictions on it as it is now")
            if r.get("train_samples") and ds.n_samples > r["train_samples"] and _is_training(ds, r, storage_options):
                ds = ds.first(int(r["train_samples"]))  # (a fit with validation: its training samples, as its MSE)
            figs["predictions"] = predictions_figure(*sample_predictions(view["model"], ds),
                                                     dataset=_dataset_name(ds.url), total_rows=dataset_rows(ds),
                                                     samples=(samples_drawn(ds), int(ds.n_samples)),
                                                     training=_is_training(ds, r, storage_options))
        except (ScaleattnError, OSError) as e:  # the report's dataset gone or moved: the other plots still go
            if given:  # (one the caller named is an error of its own: never skipped)
                raise
            warnings.warn(f"predictions plot skipped: {e}", stacklevel=2)
    return figs


def _dataset_name(url: str) -> str:
    """The last part of a dataset's path or URL (``fresh.zarr``)."""
    return url.rstrip("/").rsplit("/", 1)[-1] or url


def _is_training(ds: Dataset, report: dict, storage_options=None) -> bool | None:
    """Whether ``ds`` is the dataset the run was fitted on: at its path (``report["dataset"]``, resolved as
    ``fit`` resolved it) and, where the report records it, with its fingerprint (a dataset regenerated or edited
    at that path since is not the one fitted); None when the report does not say."""
    fitted = report.get("dataset")
    if not fitted:
        return None
    try:
        same = resolve(fitted, storage_options).url.rstrip("/") == ds.url.rstrip("/")
    except (ScaleattnError, OSError):  # a report's path that no longer resolves: not this dataset
        return False
    return same and report.get("dataset_fingerprint", ds.fingerprint) == ds.fingerprint


def figure_pngs(figs: dict, dpi: int = 120) -> dict:
    """``{name: Figure}`` -> ``{"name.png": PNG bytes}`` (Agg, no pyplot)."""
    out = {}
    for name, fig in figs.items():
        buf = io.BytesIO()
        # the Software text marks the file as scaleattn's: only such a file is ever replaced by a later plot or
        # removed with a run (scaleattn.store._outputs.is_scaleattn_plot)
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": f"{_formats.PLOT_SOFTWARE} {__version__}"})
        out[f"{name}.png"] = buf.getvalue()
    return out


def save_run_plots(run, out=None, *, dataset=None, storage_options=None, dpi: int = 120,
                   full_spectrum: bool = False) -> list[str]:
    """Write the run's figures as PNG files (``spectrum.png``, ``heads.png``, ``loss_vs_heads.png``,
    ``predictions.png``) into ``out`` (default: the run directory itself) and return their paths.

    ``run`` is a run directory or a :class:`~scaleattn.pipeline.FitResult` (then ``out`` is required);
    ``full_spectrum``: see :func:`run_figures`. Raises :class:`~scaleattn.errors.ParameterError` for a FitResult without
    ``out`` or ``storage_options`` where no path (the run, ``out``, the dataset) is a URL, and
    :class:`~scaleattn.errors.OutputInUseError` while a fit writes the run or ``out`` (their locks are held).
    """
    if not hasattr(run, "certificate"):
        check_path(run, "save_run_plots", "a run directory's path or URL, or a FitResult")
    if out is None:
        if hasattr(run, "certificate"):
            raise ParameterError("save_run_plots: give `out` when plotting a FitResult")
        out = run
    out = resolve(out, storage_options)
    data = _check_plot_output(run, out, dataset, storage_options)  # before any work
    with contextlib.ExitStack() as stack:  # the run read and the plots written while no fit replaces either
        read = [] if hasattr(run, "certificate") else [resolve(run, storage_options)]
        if read:  # read, not written (unless it is --out): marked as read
            stack.enter_context(reading(read[0], "run"))
        if data is not None:  # (the predictions' dataset: read as fit and evaluate read theirs)
            stack.enter_context(reading(data, "dataset"))
            read.append(data)
        stack.enter_context(hold(out, "`out`"))
        opts = storage_options if any(is_url(loc.url) for loc in read) else None  # (they may be out's alone)
        return write_files(out, figure_pngs(run_figures(run, dataset, opts, full_spectrum=full_spectrum), dpi))


def _check_plot_output(run, out, dataset, storage_options) -> Location | None:
    """Plots only add files, but never into an input store: refuse an ``out`` that is or lies inside the
    dataset or one of the run's stores (:func:`scaleattn.store._outputs.check_disjoint`), or where they would not last
    (:func:`scaleattn.store._outputs.check_output_location`). Returns the dataset's location (None without one)."""
    inputs = []
    if not hasattr(run, "certificate"):
        run_loc = resolve(run, storage_options)
        inputs += [(name, run_loc.join(name)) for name in (MODEL, STATS, SPECTRUM)]
        if dataset is None:
            dataset = read_run(run_loc)["report"].get("dataset")
    elif dataset is None:
        dataset = run.report.get("dataset")
    if dataset:
        inputs.append(("dataset", dataset.store if isinstance(dataset, Dataset) else resolve(dataset, storage_options)))
    # (the report's dataset is known only now: options where neither it, the run nor out is a URL are refused)
    check_storage_options(storage_options, out, *(loc for _, loc in inputs))
    check_disjoint([("`out`", out)], inputs, contains_ok=True)
    # into a directory, but never another run's (the plots would pass for that run's); the run's own is its place
    own = not hasattr(run, "certificate") and relation(out, resolve(run, storage_options)) == "is"
    check_output_location(out, "`out`", into=not own)
    return inputs[-1][1] if dataset else None
