"""Plots of a fit (matplotlib): certificate spectrum, head spectrum, loss against heads, predictions.

Every ``*_figure`` function returns a :class:`matplotlib.figure.Figure` built without pyplot (no global state,
no GUI backend; Jupyter displays it inline, :meth:`Figure.savefig` writes PNG through Agg). Marked elements
carry a ``gid`` (``"lambda_min"``, ``"lambda_max"``, ``"cutoff"``, ``"n_heads"``, ``"minimal_heads"``,
``"identity"``) so they can be found programmatically.

:func:`save_run_plots` writes ``spectrum.png``, ``heads.png``, ``loss_vs_heads.png`` (when the report's
``loss_vs_heads`` has two or more points) and ``predictions.png`` (when the dataset is reachable) next to
``report.json``.
The eigenvalues of ``Lambda_D`` come from the run's ``spectrum.zarr`` (:func:`scaleattn.run.read_run`), or are
recomputed from ``stats.zarr`` for runs without one. Layer L4.
"""
from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np

from . import _formats
from ._outputs import check_disjoint, check_output_location, hold, reading, relation
from ._storage import resolve
from ._version import __version__
from .dataset import Dataset, open_dataset
from .errors import ParameterError, ScaleattnError
from .report import minimal_heads
from .run import MODEL, SPECTRUM, STATS, read_run, write_files
from .run import read_run as load_run  # noqa: F401 (its old, documented name)

__all__ = ["spectrum_figure", "head_spectrum_figure", "loss_vs_heads_figure", "predictions_figure",
           "sample_predictions", "run_figures", "figure_pngs", "save_run_plots"]
#: rows (samples or prefixes) drawn in the predictions-against-targets scatter
PREDICTION_POINTS = 2000


def _figure(ncols: int = 1, width: float = 5.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, 3.8), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _positive_floor(values, top, rel: float = 1e-18):
    """Values for a log axis: entries <= floor = ``rel * top`` (zero or round-off negatives) are drawn at it."""
    floor = max(abs(float(top)), 1e-300) * rel
    return np.maximum(np.asarray(values, np.float64), floor), floor


# ---- the certificate's spectrum ---------------------------------------------------------------------------
def spectrum_figure(eigenvalues, eigenvalues_scaled=None, *, rtol: float | None = None, lambda_min=None,
                    title: str | None = None, identifiable: bool | None = None):
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

    Returns a Figure with one axis (two with ``eigenvalues_scaled``), log y, eigenvalues in descending order.
    """
    ev = np.sort(np.asarray(eigenvalues, np.float64))[::-1]
    if ev.size == 0:
        raise ParameterError("eigenvalues: empty spectrum")
    fig, axes = _figure(1 if eigenvalues_scaled is None else 2)
    lam_max = float(ev[0])
    lam_min = float(max(ev[-1], 0.0)) if lambda_min is None else float(lambda_min)
    rel = 1e-18 if rtol is None else min(1e-18, 1e-2 * float(rtol))  # below the cutoff, whatever the method
    shown, floor = _positive_floor(ev, lam_max, rel)
    not_identifiable = lam_min <= floor if identifiable is None else not identifiable
    ax = axes[0]
    idx = np.arange(1, ev.size + 1)
    ax.semilogy(idx, shown, ".-", color="C0", ms=3, lw=0.8, label=r"eigenvalues of $\Lambda_D$")
    ax.axhline(lam_max, color="C2", ls=":", lw=1, gid="lambda_max", label=rf"$\lambda_{{\max}}$ = {lam_max:.3g}")
    ax.axhline(max(lam_min, floor), color="C3", ls="--", lw=1.2, gid="lambda_min",
               label=rf"$\lambda_{{\min}}$ = {lam_min:.3g}" + (" (not identifiable)" if not_identifiable else ""))
    ax.set_xlabel("eigenvalue index (descending)")
    ax.set_ylabel(r"eigenvalue of $\Lambda_D = G/N$")
    ax.set_title(title or r"Certificate: spectrum of $\Lambda_D$")
    ax.legend(fontsize="small", loc="lower left")
    if eigenvalues_scaled is not None:
        ws = np.sort(np.asarray(eigenvalues_scaled, np.float64))[::-1]
        top = max(float(ws[0]), 0.0)
        shown_s, _ = _positive_floor(ws, top, rel)
        ax2 = axes[1]
        cut = None if rtol is None else float(rtol) * top
        kept = np.ones(ws.size, bool) if cut is None else ws > cut
        j = np.arange(1, ws.size + 1)
        ax2.semilogy(j[kept], shown_s[kept], ".", color="C0", ms=4, label=f"kept ({int(kept.sum())})")
        if (~kept).any():
            ax2.semilogy(j[~kept], shown_s[~kept], "x", color="C3", ms=5, gid="dropped",
                         label=f"below cutoff ({int((~kept).sum())}: ambiguous)")
        if cut is not None:
            ax2.axhline(max(cut, _positive_floor([cut], top, rel)[1]), color="k", ls="--", lw=1, gid="cutoff",
                        label=f"cutoff {float(rtol):.1e} x max")
        ax2.set_xlabel("eigenvalue index (descending)")
        ax2.set_ylabel(r"eigenvalue of $D^{-1/2} G D^{-1/2}$")
        ax2.set_title("Jacobi-scaled Gram: rank decision")
        ax2.legend(fontsize="small", loc="lower left")
    return fig


def head_spectrum_figure(singular_values, n_heads: int | None = None, title: str | None = None, *,
                         minimal: dict | None = None, method: str | None = None):
    """Singular values ``sigma_r`` of ``W`` (d_out*d, d*d), the head spectrum of [Y25] Alg. 1 (DESIGN §5), with
    the number of heads kept marked (``gid="n_heads"``). Log y; zeros are drawn at a floor.

    ``minimal`` (:func:`scaleattn.report.minimal_heads` of the report: ``{"count", "exact", "source"}``) marks
    the fewest heads known to compute the function (``gid="minimal_heads"``) when it is below ``n_heads``,
    labelled "fewer heads suffice"; ``method`` (the report's ``heads_method``) names the heads kept."""
    s = np.sort(np.asarray(singular_values, np.float64))[::-1]
    if s.size == 0:
        raise ParameterError("singular_values: empty")
    from matplotlib.ticker import MaxNLocator

    fig, (ax,) = _figure(1)
    shown, _ = _positive_floor(s, s[0])
    r = np.arange(1, s.size + 1)
    ax.semilogy(r, shown, "o-", color="C1", ms=4, lw=0.8, label=r"$\sigma_r(W)$")
    if n_heads is not None:
        ax.axvline(n_heads + 0.5, color="k", ls="--", lw=1, gid="n_heads",
                   label=f"heads kept: {n_heads}" + (f" ({method})" if method else ""))
    if minimal is not None and (n_heads is None or minimal["count"] < n_heads):
        who = "head search" if minimal["source"] == "head search" else "the teacher's"
        ax.axvline(minimal["count"] + 0.5, color="C2", ls="-.", lw=1.4, gid="minimal_heads",
                   label=f"fewer heads suffice: {minimal['count']} ({who})")
    ax.set_xlabel("index r")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("singular value of W")
    ax.set_title(title or "Head spectrum (SVD of W)")
    ax.legend(fontsize="small")
    return fig


def loss_vs_heads_figure(loss_vs_heads, target_mean_square: float | None = None, title: str | None = None):
    """Training loss against the number of heads H from ``report["loss_vs_heads"]``
    (a list of ``{"heads": H, "train_mse_stats": mse}``, or ``"train_objective_stats"`` after a ridge fit:
    :func:`scaleattn._formats.loss_curve`); None when it has fewer than two points (the ``svd`` heads give one
    point: no curve).
    With ``target_mean_square`` the zero-model MSE (mean y^2) is drawn for reference."""
    if not loss_vs_heads or len(loss_vs_heads) < 2:
        return None
    what, rows = _formats.loss_curve(loss_vs_heads)
    rows = sorted(rows)
    H = np.array([h for h, _ in rows])
    mse = np.array([m for _, m in rows])
    top = max(float(np.max(np.abs(mse))), float(target_mean_square or 0.0), 1e-300)
    shown, _ = _positive_floor(mse, top)
    fig, (ax,) = _figure(1)
    ax.semilogy(H, shown, "o-", color="C0", label=f"{what} (from statistics)")
    if target_mean_square:
        ax.axhline(target_mean_square, color="0.5", ls=":", gid="mean_square", label="mean $y^2$ (zero model)")
    ax.set_xlabel("number of heads H")
    ax.set_ylabel(what)
    ax.set_xticks(H)
    ax.set_title(title or "Loss against number of heads")
    ax.legend(fontsize="small")
    return fig


def sample_predictions(model, dataset, max_points: int = PREDICTION_POINTS, storage_options=None):
    """Targets and predictions ``(y, y_hat)``, each (rows, d_out) float64, for the first samples of a dataset
    (a :class:`~scaleattn.dataset.Dataset`, or a path/URL opened with ``storage_options``; at most about
    ``max_points`` rows; causal data give one row per valid prefix)."""
    ds = dataset if isinstance(dataset, Dataset) else open_dataset(dataset, storage_options)
    if not ds.has_targets:
        raise ParameterError(f"{ds.url}: no targets to plot predictions against")
    per = ds.length if ds.causal else 1
    n = int(min(ds.n_samples, max(1, max_points // per)))
    tok, lens, y = ds.read(0, n)
    yhat = np.asarray(model.predict(tok, lens, causal=ds.causal))
    if ds.causal:
        valid = np.ones(tok.shape[:2], bool) if lens is None else np.arange(ds.length)[None, :] < lens[:, None]
        return y[valid], yhat[valid]
    return y, yhat


def predictions_figure(y, y_hat, title: str | None = None):
    """Predictions against targets (all outputs pooled, one colour per output up to 10) with the identity
    line (``gid="identity"``); the title gives the MSE of the points shown."""
    y, y_hat = np.asarray(y, np.float64), np.asarray(y_hat, np.float64)
    if y.shape != y_hat.shape or y.size == 0:
        raise ParameterError(f"y and y_hat: expected equal non-empty shapes, got {y.shape} and {y_hat.shape}")
    y2, p2 = y.reshape(y.shape[0], -1), y_hat.reshape(y.shape[0], -1)
    fig, (ax,) = _figure(1, width=4.6)
    d_out = y2.shape[1]
    for a in range(d_out):
        kw = {"color": f"C{a % 10}", "label": f"output {a}"} if d_out <= 10 else {"color": "C0"}
        ax.scatter(y2[:, a], p2[:, a], s=4, alpha=0.5, lw=0, **kw)
    lo, hi = float(min(y2.min(), p2.min())), float(max(y2.max(), p2.max()))
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, gid="identity", label="y = ŷ")
    mse = float(np.mean((y2 - p2) ** 2))
    ax.set_xlabel("target y")
    ax.set_ylabel("prediction ŷ")
    ax.set_title(title or f"Predictions against targets\n{y2.shape[0]:,} rows, MSE {mse:.3g}")
    if d_out <= 10:
        ax.legend(fontsize="small", markerscale=3)
    return fig


# ---- runs -------------------------------------------------------------------------------------------------
def run_figures(run, dataset=None, storage_options=None) -> dict:
    """All figures of a run: ``{"spectrum", "heads", "loss_vs_heads", "predictions"}`` -> Figure.

    ``run`` is a :class:`~scaleattn.pipeline.FitResult` or a run directory (read with ``storage_options``).
    ``dataset`` (a Dataset or URL; default the report's ``dataset``) gives the predictions panel; the report's,
    when it cannot be read, is skipped with a warning (one given here raises); ``loss_vs_heads`` is skipped when
    the report has no such entry.
    """
    if hasattr(run, "certificate"):
        view = {"report": run.report, "eigenvalues": run.certificate.eigenvalues,
                "eigenvalues_scaled": run.certificate.spectrum_scaled, "model": run.model}
    else:
        view = read_run(run, storage_options)
    r = view["report"]
    figs = {}
    if view["eigenvalues"] is not None:
        figs["spectrum"] = spectrum_figure(view["eigenvalues"], view["eigenvalues_scaled"],
                                           rtol=r.get("cutoff_rtol"), lambda_min=r.get("lambda_min"),
                                           identifiable=r.get("identifiable"))
    if r.get("head_singular_values"):
        figs["heads"] = head_spectrum_figure(r["head_singular_values"], r.get("n_heads"), minimal=minimal_heads(r),
                                             method=r.get("heads_method"))
    lvh = loss_vs_heads_figure(r.get("loss_vs_heads"), r.get("target_mean_square"))
    if lvh is not None:
        figs["loss_vs_heads"] = lvh
    given = dataset is not None
    dataset = dataset if given else r.get("dataset")
    if view["model"] is not None and dataset:
        try:
            figs["predictions"] = predictions_figure(*sample_predictions(view["model"], dataset,
                                                                         storage_options=storage_options))
        except (ScaleattnError, OSError) as e:  # the report's dataset gone or moved: the other plots still go
            if given:  # (one the caller named is an error of its own: never skipped)
                raise
            warnings.warn(f"predictions plot skipped: {e}", stacklevel=2)
    return figs


def figure_pngs(figs: dict, dpi: int = 120) -> dict:
    """``{name: Figure}`` -> ``{"name.png": PNG bytes}`` (Agg, no pyplot)."""
    out = {}
    for name, fig in figs.items():
        buf = io.BytesIO()
        # the Software text marks the file as scaleattn's: only such a file is ever replaced by a later plot or
        # removed with a run (scaleattn._outputs.is_scaleattn_plot)
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": f"{_formats.PLOT_SOFTWARE} {__version__}"})
        out[f"{name}.png"] = buf.getvalue()
    return out


def save_run_plots(run, out=None, *, dataset=None, storage_options=None, dpi: int = 120) -> list[str]:
    """Write the run's figures as PNG files (``spectrum.png``, ``heads.png``, ``loss_vs_heads.png``,
    ``predictions.png``) into ``out`` (default: the run directory itself) and return their paths.

    ``run`` is a run directory or a :class:`~scaleattn.pipeline.FitResult` (then ``out`` is required).
    Raises :class:`~scaleattn.errors.ParameterError` for a FitResult without ``out``, and
    :class:`~scaleattn.errors.OutputInUseError` while a fit writes the run or ``out`` (their locks are held).
    """
    if out is None:
        if hasattr(run, "certificate"):
            raise ParameterError("save_run_plots: give `out` when plotting a FitResult")
        out = run
    out = resolve(out, storage_options)
    _check_plot_output(run, out, dataset, storage_options)  # before any work
    with contextlib.ExitStack() as stack:  # the run read and the plots written while no fit replaces either
        if not hasattr(run, "certificate"):  # read, not written (unless it is --out): marked as read
            stack.enter_context(reading(resolve(run, storage_options), "run"))
        stack.enter_context(hold(out, "--out"))
        return write_files(out, figure_pngs(run_figures(run, dataset, storage_options), dpi))


def _check_plot_output(run, out, dataset, storage_options) -> None:
    """Plots only add files, but never into an input store: refuse an ``out`` that is or lies inside the
    dataset or one of the run's stores (:func:`scaleattn._outputs.check_disjoint`), or where they would not last
    (:func:`scaleattn._outputs.check_output_location`)."""
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
    check_disjoint([("--out", out)], inputs, contains_ok=True)
    # into a directory, but never another run's (the plots would pass for that run's); the run's own is its place
    own = not hasattr(run, "certificate") and relation(out, resolve(run, storage_options)) == "is"
    check_output_location(out, "--out", into=not own)
