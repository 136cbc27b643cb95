"""The main job: dataset -> statistics (Dask) -> solve + certificate -> heads -> model and report.

Data flow one way (DESIGN §6)::

    Zarr dataset --row groups--> workers: features -> partial statistics --tree reduction--> statistics
        --> solver (client side): Jacobi-scaled eigh, certificate, c = G^+ B --> heads --> model + report
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from . import __version__, _storage
from .dataset import Dataset, DatasetError, open_dataset
from .head_search import DEFAULT_BUDGET, search_heads
from .heads import Heads, ambiguity_witness, coef_distance, coef_from_heads, svd_heads
from .model import MHLAModel, evaluate
from .solver import Certificate, Solution, certify, solve
from .statistics import Statistics, compute_statistics


def parse_heads(heads) -> str | int:
    """``"svd"``, ``"minimal"`` or a positive head count (``"3"`` or 3)."""
    if isinstance(heads, str) and heads in ("svd", "minimal"):
        return heads
    try:
        h = int(heads)
    except (TypeError, ValueError):
        raise ValueError(f"heads must be 'svd', 'minimal' or a positive integer, got {heads!r}") from None
    if h < 1:
        raise ValueError(f"heads must be >= 1, got {h}")
    return h


def recover_heads(coef, d: int, heads="svd", stats: Statistics | None = None,
                  budget: float | None = DEFAULT_BUDGET) -> Heads:
    """Heads for coefficients: ``"svd"`` ([Y25] Alg. 1), ``"minimal"`` or an integer H (best H-head model).

    With ``stats`` the heads carry their training loss, the loss-versus-heads curve and a lower bound on the
    head count (:func:`scaleattn.head_search.search_heads`, ``budget`` seconds); without, only ``"svd"``.
    """
    heads = parse_heads(heads)
    if stats is None:
        if heads != "svd":
            raise ValueError(f"heads={heads!r} needs the statistics (the training loss decides)")
        return svd_heads(coef, d)
    return search_heads(stats, coef, heads, budget=budget)


#: heads reproducing the fitted coefficients to this relative residual define the same model
EXACT_HEADS_RTOL = 1e-10


def model_from_statistics(stats: Statistics, causal: bool = False, heads="svd", rtol=None, ridge: float = 0.0,
                          solver: str = "auto", heads_budget: float | None = DEFAULT_BUDGET):
    """Solve, certify and recover heads from statistics alone: ``(MHLAModel, Solution, Heads)``.

    When the heads cannot reproduce the fit (``heads=H`` below the minimal head count) the model's
    coefficients are the heads' own ``c(Theta)``: the model is the H-head model. ``heads_budget``: seconds
    for the head search (:func:`scaleattn.head_search.search_heads`).
    """
    sol = solve(stats, rtol, ridge=ridge, method=solver)
    h = recover_heads(sol.coef, stats.d, heads, stats, heads_budget)
    coef = sol.coef if h.residual <= EXACT_HEADS_RTOL else coef_from_heads(h.V, h.Q)
    model = MHLAModel(coef, h.V, h.Q, stats.d, causal)
    return model, sol, h


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns: the model, the statistics, the solution (with certificate), heads, report."""

    model: MHLAModel
    statistics: Statistics
    solution: Solution
    heads: Heads
    report: dict

    @property
    def certificate(self) -> Certificate:
        return self.solution.certificate

    def summary(self) -> str:
        return format_report(self.report)


def preflight(dataset, out=None, overwrite: bool = False, storage_options=None) -> Dataset:
    """The checks :func:`fit` makes before any work (callers run them before starting a cluster too): the
    dataset opens and has targets, and ``out`` does not exist unless ``overwrite``. Returns the dataset.

    Raises ``DatasetError``/``ValueError`` (no targets) or ``FileExistsError``.
    """
    ds = dataset if isinstance(dataset, Dataset) else open_dataset(dataset, storage_options)
    if not ds.has_targets:
        raise ValueError(f"{ds.url}: has no 'targets' array; use certify for the certificate alone")
    if out is not None and _storage.exists(out, storage_options) and not overwrite:
        raise FileExistsError(f"output {out!r} already exists (pass --overwrite to replace it)")
    return ds


def fit(dataset, out: str | None = None, *, client=None, heads="svd", rtol: float | None = None,
        ridge: float = 0.0, exact_mse: bool = True, overwrite: bool = False, progress: bool = False,
        storage_options: dict | None = None, device: str = "auto", plots: bool = True, resume: bool = False,
        checkpoint: str | None = None, keep_checkpoint: bool = False, solver: str = "auto",
        heads_budget: float | None = DEFAULT_BUDGET) -> FitResult:
    """Fit MHLA to a dataset by least squares, certify it and recover heads ([Y25] Algorithm 1).

    Parameters
    ----------
    dataset : str or Dataset
        Path / URL of a dataset group (:mod:`scaleattn.dataset`).
    out : str, optional
        Run directory to write ``report.json``, ``model.zarr``, ``stats.zarr`` (atomically: nothing is left
        behind on failure; an existing ``out`` is refused unless ``overwrite``).
    client : distributed.Client, optional
        Cluster to run on (:func:`scaleattn.cluster.connect`); None computes in this process.
    heads : "svd" | "minimal" | int
    heads_budget : float or None
        Seconds for the head search of ``"minimal"`` / H (:func:`scaleattn.head_search.search_heads`; None:
        no limit); the report's ``heads_budget_exhausted`` says when it ran out.
    ridge : float
        Scaled ridge strength (:func:`scaleattn.solver.solve`); the report gives the effective dof.
    solver : "auto" | "eigh" | "cholesky"
        Solver path (:func:`scaleattn.solver.solve`): ``"eigh"`` keeps the whole spectrum of ``Lambda_D`` (for
        the spectrum plot) at any psi; ``"auto"`` switches to Cholesky + Lanczos past ``LARGE_PSI``.
    exact_mse : bool
        Measure the training MSE by a second pass over the data (exact to round-off even at 1e-30), in
        addition to the statistics formula (whose floor is about eps * mean(y^2)).
    plots : bool
        With ``out``, also write the PNG plots of :func:`scaleattn.plot.save_run_plots` next to the report.
    checkpoint : str, optional
        Checkpoint store of the statistics build (DESIGN §6; :mod:`scaleattn.checkpoint`); default
        ``out + ".checkpoint.zarr"`` when ``out`` is given. Written while running, removed after success
        unless ``keep_checkpoint``. An existing one is refused unless ``resume`` (skip the finished row
        groups; the statistics are bit-identical to an uninterrupted run) or ``overwrite`` (start over).

    Raises
    ------
    DatasetError
        Malformed input (names the array and sample). ``ValueError`` for a dataset without targets, or a
        checkpoint made from another dataset, chunking or version. ``FileExistsError`` for an existing
        checkpoint without ``resume`` or ``overwrite``.
    """
    t0 = time.perf_counter()
    heads = parse_heads(heads)
    ds = preflight(dataset, out, overwrite, storage_options)
    from .memory import check_fit_memory, release_large_buffers

    check_fit_memory(ds.d, ds.d_out, client=client)  # refuse before the build: InsufficientMemoryError
    release_large_buffers()  # peak memory must not creep up with the number of row groups
    times = {}
    t = time.perf_counter()
    ckpt = checkpoint or (str(out).rstrip("/") + ".checkpoint.zarr" if out is not None else None)
    if ckpt is not None and not resume and _storage.exists(ckpt, storage_options):
        if not overwrite:
            raise FileExistsError(f"checkpoint {ckpt!r} of an unfinished fit exists: pass --resume to continue it,"
                                  " or --overwrite to start over")
        _storage.remove(ckpt, storage_options)
    build = {}
    new_ckpt = ckpt is not None and not _storage.exists(ckpt, storage_options)
    try:
        stats = compute_statistics(ds, client, progress=progress, device=device, checkpoint=ckpt,
                                   storage_options=storage_options, info=build)
    except DatasetError:  # bad data: nothing worth resuming; a crash, interrupt or StorageError keeps it
        if new_ckpt:
            _storage.remove(ckpt, storage_options)
        raise
    times["statistics"] = time.perf_counter() - t
    t = time.perf_counter()
    from .cluster import status

    with status(f"solve (psi {stats.psi:,}) and heads ({heads})", progress):
        model, sol, h = model_from_statistics(stats, ds.causal, heads, rtol, ridge, solver, heads_budget)
    times["solve_and_heads"] = time.perf_counter() - t
    model.attrs.update({"dataset": ds.url, "scaleattn_version": __version__, "heads_method": h.method})
    cert = sol.certificate
    n_out = stats.n_rows * stats.d_out
    report = {
        "n_rows": stats.n_rows, "n_samples": ds.n_samples, "length": ds.length, "d": ds.d, "d_out": ds.d_out,
        "causal": ds.causal, "psi": stats.psi, **cert.summary(),
        # the saved model's loss: the least-squares fit's, unless heads=H could not reproduce it
        "train_mse_stats": max(sol.sse if model.coef is sol.coef else h.sse, 0.0) / n_out,
        "lstsq_train_mse_stats": max(sol.sse, 0.0) / n_out, "target_mean_square": stats.target_mean_square,
        "n_heads": model.n_heads, "heads_method": h.method, "heads_residual": h.residual,
        "head_singular_values": h.spectrum.tolist(),
        "loss_vs_heads": [{"heads": int(k), "train_mse_stats": max(v, 0.0) / n_out} for k, v in h.curve],
        "ridge": sol.ridge, "effective_dof": sol.effective_dof,
    }
    if h.sse is not None:
        report["heads_train_mse_stats"] = max(h.sse, 0.0) / n_out
    report.update(_heads_search_report(h, n_out))
    wit = ambiguity_witness(sol, stats)
    if wit is not None:
        report["witness"] = wit.summary()
    if exact_mse:
        t = time.perf_counter()
        ev = evaluate(model, ds, client, progress=progress)
        times["evaluate"] = time.perf_counter() - t
        report["train_mse"] = ev["mse"]
    else:
        report["train_mse"] = report["train_mse_stats"]
    ms = report["target_mean_square"]
    report["relative_train_mse"] = report["train_mse"] / ms if ms > 0 else float("nan")
    teacher = ds.teacher()
    if teacher is not None:
        report["teacher_heads"] = int(teacher[0].shape[0])
        report["teacher_coef_distance"] = coef_distance(model.coef, coef_from_heads(*teacher))
    report.update({k: build[k] for k in ("groups", "tiles", "groups_computed", "groups_resumed")})
    report["checkpoint"] = ckpt if keep_checkpoint else None
    report["timings"] = times
    report["scaleattn_version"] = __version__
    report["dataset"] = ds.url
    report["seconds"] = time.perf_counter() - t0
    result = FitResult(model, stats, sol, h, report)
    if out is not None:
        write_run(result, out, overwrite=overwrite, storage_options=storage_options)
        if plots:
            _write_plots(result, out, ds, storage_options)
    if ckpt is not None and not keep_checkpoint:
        _storage.remove(ckpt, storage_options)
    return result


def _write_plots(result: FitResult, out: str, ds, storage_options=None) -> None:
    """PNG plots next to the report; a plotting failure warns but never fails a finished fit."""
    import warnings

    from .plot import save_run_plots

    try:
        save_run_plots(result, out, dataset=ds, storage_options=storage_options)
    except Exception as e:  # the run is already written; plots are a convenience
        warnings.warn(f"plots not written to {out}: {type(e).__name__}: {e}", stacklevel=3)


def write_run(result: FitResult, out: str, overwrite: bool = False, storage_options=None) -> None:
    """Write ``report.json``, ``model.zarr``, ``stats.zarr`` and ``spectrum.zarr`` (eigenvalues of the
    certificate, :func:`scaleattn.plot.save_spectrum`) under ``out`` (all or nothing)."""
    with _storage.atomic_output(out, overwrite, storage_options) as tmp:
        if not _storage.is_url(tmp):
            os.makedirs(tmp, exist_ok=True)
        result.model.save(_storage.join(tmp, "model.zarr"), storage_options=storage_options)
        result.statistics.save(_storage.join(tmp, "stats.zarr"), storage_options=storage_options,
                               attrs={"dataset": result.report.get("dataset", "")})
        if result.certificate.eigenvalues is not None:
            from .plot import save_spectrum

            save_spectrum(result.certificate, _storage.join(tmp, "spectrum.zarr"), storage_options)
        fs, path = _storage.fs_for(_storage.join(tmp, "report.json"), storage_options)
        with fs.open(path, "w") as f:
            json.dump(result.report, f, indent=2, default=_json_default)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def certify_dataset(dataset, *, client=None, rtol=None, progress=False, storage_options=None,
                    solver: str = "auto") -> Certificate:
    """Identifiability certificate of a dataset (only the Gram is built; targets are not read).

    ``solver``: ``"auto"``, ``"eigh"`` (whole spectrum) or ``"cholesky"`` (extreme eigenvalues only), as
    :func:`scaleattn.solver.certify`.
    """
    ds = dataset if isinstance(dataset, Dataset) else open_dataset(dataset, storage_options)
    stats = compute_statistics(ds, client, targets=False, progress=progress)
    return certify(stats, rtol, method=solver)


def _heads_search_report(h: Heads, n_out: int) -> dict:
    """The head search's report keys (docs/report.md §4): exactness, loss gap, lower bound and its kind."""
    if h.lower_bound is None:
        return {}
    return {"heads_exact": bool(h.exact), "heads_loss_gap": (h.loss_gap or 0.0) / max(n_out, 1),
            "heads_lower_bound": int(h.lower_bound), "heads_lower_bound_kind": h.lower_bound_kind,
            "heads_bound_every_c": int(h.bound_every_c), "heads_bound_generic": int(h.bound_generic),
            "heads_meets_bound": bool(h.meets_bound), "heads_budget_exhausted": bool(h.budget_exhausted),
            "heads_search_seconds": float(h.seconds or 0.0)}


def _heads_line(r: dict) -> str:
    """``heads 4 (minimal)  minimal: yes, meets the bound 4 (dimension count (generic data))`` and kin."""
    line = f"heads {r['n_heads']} ({r['heads_method']})"
    if "heads_lower_bound" in r:
        k, kind = r["heads_lower_bound"], r["heads_lower_bound_kind"]
        if r["heads_method"] == "svd":
            line += f"  bound {k} ({kind}; --heads minimal for the fewest)"
        elif not r["heads_exact"]:
            line += (f"  lossy: no exact {r['n_heads']}-head model found (exact needs >= {k}: {kind});"
                     f" ||c_H - c||/||c|| = {r['heads_residual']:.3g}, train MSE +{r['heads_loss_gap']:.3g}")
        elif r["heads_meets_bound"]:
            line += f"  minimal: yes, meets the bound {k} ({kind})"
        else:
            line += f"  fewest found; bound {k} ({kind})"
        if r["heads_budget_exhausted"]:
            line += f"  [search budget ran out after {r['heads_search_seconds']:.1f} s]"
    if "teacher_heads" in r:
        line += f"  teacher heads {r['teacher_heads']}, ||c - c_teacher|| = {r['teacher_coef_distance']:.3g}"
    return line


def format_report(r: dict) -> str:
    """A short human summary of a fit report."""
    verdict = "IDENTIFIABLE: every least-squares fit computes the same function" if r["identifiable"] else (
        f"NOT identifiable: {r['ambiguous_dim']} feature direction(s) are not determined by the data")
    lines = [
        f"rows {r['n_rows']:,}  (samples {r['n_samples']:,}, T {r['length']}, {'causal prefixes' if r['causal'] else 'last token'})",
        f"d {r['d']}  d_out {r['d_out']}  psi {r['psi']:,}  rank {r['rank']:,}  (cutoff {r['cutoff_rtol']:.1e} x lambda_max, Jacobi-scaled)",
        f"lambda_min {r['lambda_min']:.4g}  lambda_max {r['lambda_max']:.4g}  (Lambda_D = G/N)",
        f"certificate: {verdict}",
        f"train MSE {r['train_mse']:.4g}  (relative {r['relative_train_mse']:.3g}; mean y^2 {r['target_mean_square']:.4g})",
        _heads_line(r),
        *([("loss vs heads: " + "  ".join(f"{e['heads']}:{e['train_mse_stats']:.3g}" for e in r["loss_vs_heads"]))]
          if len(r.get("loss_vs_heads", [])) > 1 else []),
        *([f"ridge {r['ridge']:.3g}  effective dof {r['effective_dof']:.4g} of {r['psi']} per output"]
          if r.get("ridge") else []),
        *([f"witness: two fits with train MSE {r['witness']['loss_a']:.6g} and {r['witness']['loss_b']:.6g} differ by"
           f" {r['witness']['prediction_difference']:.3g} (norm) in their predictions on a {len(r['witness']['tokens'])}-token"
           " input (report.json: witness)"] if "witness" in r else []),
        f"wall time {r['seconds']:.2f} s",
    ]
    return "\n".join(lines)

