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
from .dataset import Dataset, open_dataset
from .heads import Heads, coef_distance, coef_from_heads, minimal_heads, rank_r_heads, svd_heads
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


def recover_heads(coef, d: int, heads="svd") -> Heads:
    """Heads for coefficients: ``"svd"`` ([Y25] Alg. 1), ``"minimal"`` or an integer H (best H-head model)."""
    heads = parse_heads(heads)
    if heads == "svd":
        return svd_heads(coef, d)
    if heads == "minimal":
        return minimal_heads(coef, d)[0]
    return rank_r_heads(coef, d, heads)


def model_from_statistics(stats: Statistics, causal: bool = False, heads="svd", rtol=None):
    """Solve, certify and recover heads from statistics alone: ``(MHLAModel, Solution, Heads)``."""
    sol = solve(stats, rtol)
    h = recover_heads(sol.coef, stats.d, heads)
    model = MHLAModel(sol.coef, h.V, h.Q, stats.d, causal)
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


def fit(dataset, out: str | None = None, *, client=None, heads="svd", rtol: float | None = None,
        exact_mse: bool = True, overwrite: bool = False, progress: bool = False,
        storage_options: dict | None = None, device: str = "auto") -> FitResult:
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
    exact_mse : bool
        Measure the training MSE by a second pass over the data (exact to round-off even at 1e-30), in
        addition to the statistics formula (whose floor is about eps * mean(y^2)).

    Raises
    ------
    DatasetError
        Malformed input (names the array and sample). ``ValueError`` for a dataset without targets.
    """
    t0 = time.perf_counter()
    heads = parse_heads(heads)
    ds = dataset if isinstance(dataset, Dataset) else open_dataset(dataset, storage_options)
    if not ds.has_targets:
        raise ValueError(f"{ds.url}: has no 'targets' array; use certify for the certificate alone")
    if out is not None and _storage.exists(out, storage_options) and not overwrite:
        raise FileExistsError(f"output {out!r} already exists (pass --overwrite to replace it)")
    times = {}
    t = time.perf_counter()
    stats = compute_statistics(ds, client, progress=progress, device=device)
    times["statistics"] = time.perf_counter() - t
    t = time.perf_counter()
    model, sol, h = model_from_statistics(stats, ds.causal, heads, rtol)
    times["solve_and_heads"] = time.perf_counter() - t
    model.attrs.update({"dataset": ds.url, "scaleattn_version": __version__, "heads_method": h.method})
    cert = sol.certificate
    n_out = stats.n_rows * stats.d_out
    report = {
        "n_rows": stats.n_rows, "n_samples": ds.n_samples, "length": ds.length, "d": ds.d, "d_out": ds.d_out,
        "causal": ds.causal, "psi": stats.psi, **cert.summary(),
        "train_mse_stats": max(sol.sse, 0.0) / n_out, "target_mean_square": stats.target_mean_square,
        "n_heads": model.n_heads, "heads_method": h.method, "heads_residual": h.residual,
        "head_singular_values": h.spectrum.tolist(),
    }
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
        report["teacher_coef_distance"] = coef_distance(sol.coef, coef_from_heads(*teacher))
    report["timings"] = times
    report["scaleattn_version"] = __version__
    report["dataset"] = ds.url
    report["seconds"] = time.perf_counter() - t0
    result = FitResult(model, stats, sol, h, report)
    if out is not None:
        write_run(result, out, overwrite=overwrite, storage_options=storage_options)
    return result


def write_run(result: FitResult, out: str, overwrite: bool = False, storage_options=None) -> None:
    """Write ``report.json``, ``model.zarr`` and ``stats.zarr`` under ``out`` (all or nothing)."""
    with _storage.atomic_output(out, overwrite, storage_options) as tmp:
        if not _storage.is_url(tmp):
            os.makedirs(tmp, exist_ok=True)
        result.model.save(_storage.join(tmp, "model.zarr"), storage_options=storage_options)
        result.statistics.save(_storage.join(tmp, "stats.zarr"), storage_options=storage_options,
                               attrs={"dataset": result.report.get("dataset", "")})
        fs, path = _storage.fs_for(_storage.join(tmp, "report.json"), storage_options)
        with fs.open(path, "w") as f:
            json.dump(result.report, f, indent=2, default=_json_default)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def certify_dataset(dataset, *, client=None, rtol=None, progress=False, storage_options=None) -> Certificate:
    """Identifiability certificate of a dataset (only the Gram is built; targets are not read)."""
    ds = dataset if isinstance(dataset, Dataset) else open_dataset(dataset, storage_options)
    stats = compute_statistics(ds, client, targets=False, progress=progress)
    return certify(stats, rtol)


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
        f"heads {r['n_heads']} ({r['heads_method']})" + (
            f"  teacher heads {r['teacher_heads']}, ||c - c_teacher|| = {r['teacher_coef_distance']:.3g}" if "teacher_heads" in r else ""),
        f"wall time {r['seconds']:.2f} s",
    ]
    return "\n".join(lines)
