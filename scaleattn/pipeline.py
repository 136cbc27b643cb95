"""The main job (layer L4): dataset -> statistics (Dask) -> solve + certificate -> heads -> model and report.

Data flow one way (DESIGN §6)::

    Zarr dataset --row groups--> workers: features -> partial statistics --tree reduction--> statistics
        --> solver (client side): Jacobi-scaled eigh, certificate, c = G^+ B --> heads --> model + report

:func:`fit` and :func:`certify_dataset` are the public entries: they validate every parameter and resolve every
store once, check the memory, and only then start work.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings

from . import report as _text
from ._backend import check_device
from ._outputs import (
    check_companions,
    check_disjoint,
    check_outside_stores,
    check_replaceable,
    clean_leftovers,
    hold,
)
from ._params import choice, heads_spec, no_other_kwargs, real, renamed
from ._storage import Location, resolve
from ._version import __version__
from .certificate import Certificate, ambiguity_witness, certify, check_cutoff
from .dataset import Dataset, open_dataset
from .distributed.build import compute_statistics
from .distributed.evaluate import evaluate
from .distributed.memory import check_fit_memory, chunk_bytes, release_large_buffers
from .errors import CheckpointError, DatasetError, OutputExistsError, ScaleattnError, with_hint
from .features import coef_distance
from .heads import Heads, coef_from_heads
from .model import MHLAModel, heads_are_exact, model_from_statistics
from .plot import figure_pngs, run_figures
from .progress import as_reporter
from .run import write_run
from .solver import Solution
from .spectrum import SOLVERS
from .statistics import Statistics

__all__ = ["fit", "certify_dataset", "preflight", "holding", "FitResult"]


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns: the model, the statistics, the solution (with certificate), heads, report.

    Attributes
    ----------
    model : MHLAModel
    statistics : Statistics
    solution : Solution
    heads : Heads
    report : dict
        Every number of the fit (the keys of report.json, docs/report.md).
    """

    model: MHLAModel
    statistics: Statistics
    solution: Solution
    heads: Heads
    report: dict

    @property
    def certificate(self) -> Certificate:
        return self.solution.certificate

    def summary(self) -> str:
        """The same summary ``scaleattn fit`` prints (:func:`scaleattn.report.fit_summary`)."""
        return _text.fit_summary(self.report)


def _open(dataset, storage_options, fill_absent_chunks: bool = False) -> Dataset:
    if isinstance(dataset, Dataset):
        return dataset
    return open_dataset(dataset, storage_options, fill_absent_chunks=fill_absent_chunks)


def _locations(ds: Dataset, out, checkpoint, storage_options) -> tuple[Location | None, Location | None]:
    """The run directory and the checkpoint store of a fit, resolved with the fit's options."""
    opts = ds.storage_options if storage_options is None else storage_options
    out = None if out is None else resolve(out, None if isinstance(out, Location) else opts)
    return out, _checkpoint_location(out, checkpoint, opts)


def preflight(dataset, out=None, overwrite: bool = False, storage_options=None, *, checkpoint=None,
              resume: bool = False, fill_absent_chunks: bool = False) -> Dataset:
    """The checks :func:`fit` makes before any work (callers run them before starting a cluster too): the
    dataset opens, is complete and has targets; ``out`` and the checkpoint are neither, nor contain, nor lie
    inside the dataset (or each other); ``out`` does not exist unless ``overwrite``, and what ``overwrite``
    would replace was written by scaleattn. Returns the dataset.

    Raises
    ------
    DatasetError
        The dataset is malformed, has absent chunks (:class:`~scaleattn.errors.IntegrityError`) or no targets.
    UnsafeOutputError
        An output overlaps the input, or ``overwrite`` would replace something scaleattn did not write.
    OutputExistsError
        ``out`` exists and not ``overwrite``, or a checkpoint exists without ``resume`` or ``overwrite``.
    """
    ds = _open(dataset, storage_options, fill_absent_chunks)
    if not ds.has_targets:
        raise DatasetError(f"{ds.url}: has no 'targets' array; use certify for the certificate alone")
    out, ckpt = _locations(ds, out, checkpoint, storage_options)
    check_disjoint([("--out", out), ("--checkpoint", ckpt)], [("dataset", ds.store)])
    check_disjoint([("--checkpoint", ckpt)], [("--out", out)], kind="output")
    check_companions([("--out", out), ("--checkpoint", ckpt)], [("dataset", ds.store)])
    for role, loc in (("--out", out), ("--checkpoint", ckpt)):
        if loc is not None:
            check_outside_stores(loc, role)
    if out is not None and out.exists():
        if not overwrite:
            raise OutputExistsError(f"output {out.url!r} already exists (pass --overwrite to replace it)")
        check_replaceable(out, "--out")
    if ckpt is not None and ckpt.exists() and not resume:
        if not overwrite:
            raise OutputExistsError(f"checkpoint {ckpt.url!r} of an unfinished fit exists: pass --resume to continue"
                                    " it, or --overwrite to start over")
        check_replaceable(ckpt, "--checkpoint")
    return ds


@contextlib.contextmanager
def holding(dataset, out=None, checkpoint=None, storage_options=None):
    """Hold the locks of a fit's run directory and checkpoint for the block (:func:`scaleattn._outputs.hold`):
    a second run to the same output is refused naming the first. Temporaries a killed run left are removed."""
    ds = _open(dataset, storage_options)
    out, ckpt = _locations(ds, out, checkpoint, storage_options)
    with contextlib.ExitStack() as stack:
        for role, loc in (("--out", out), ("--checkpoint", ckpt)):
            if loc is not None:
                stack.enter_context(hold(loc, role))
                clean_leftovers(loc, protect=[ds.store])
        yield


def fit(dataset, out=None, *, client=None, heads="svd", cutoff_rtol: float | None = None, ridge: float = 0.0,
        exact_mse: bool = True, overwrite: bool = False, progress=False, storage_options=None,
        device: str = "auto", plots: bool = True, resume: bool = False, checkpoint=None,
        keep_checkpoint: bool = False, solver: str = "auto", fill_absent_chunks: bool = False,
        **deprecated) -> FitResult:
    """Fit MHLA to a dataset by least squares, certify it and recover heads ([Y25] Algorithm 1).

    Parameters
    ----------
    dataset : str, path-like, Location or Dataset
        A dataset group (:mod:`scaleattn.dataset`); local paths are made absolute.
    out : str, path-like or Location, optional
        Run directory to write ``report.json``, ``model.zarr``, ``stats.zarr`` (atomically: nothing is left
        behind on failure; an existing ``out`` is refused unless ``overwrite``).
    client : distributed.Client, optional
        Cluster to run on (:func:`scaleattn.cluster.connect`); None computes in this process.
    heads : "svd" | "minimal" | int
        Head recovery (:func:`scaleattn.heads.search_heads`).
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff in (0, 1) (default ``16 psi eps``).
    ridge : float
        Scaled ridge strength >= 0 (:func:`scaleattn.solve`); the report gives the effective dof.
    exact_mse : bool
        Measure the training MSE by a second pass over the data (exact to round-off even at 1e-30), in
        addition to the statistics formula (whose floor is about eps * mean(y^2)).
    overwrite : bool
        Replace an existing ``out`` (and start over instead of resuming a checkpoint).
    progress : bool or Reporter
        Bars and phases on stderr (:mod:`scaleattn.progress`).
    storage_options : dict or list of "KEY=VALUE", optional
        fsspec options for the dataset, ``out`` and the checkpoint.
    device : "auto" | "cpu" | "gpu"
        Array device of the statistics tasks.
    plots : bool
        With ``out``, also write the PNG plots of :mod:`scaleattn.plot` next to the report.
    resume : bool
        Continue from the checkpoint: finished row groups are not recomputed (bit-identical statistics).
    checkpoint : str, path-like or Location, optional
        Checkpoint store of the statistics build (DESIGN §6); default ``out + ".checkpoint.zarr"`` when
        ``out`` is given. Written while running, removed after success unless ``keep_checkpoint``. An existing
        one is refused unless ``resume`` or ``overwrite`` (start over).
    keep_checkpoint : bool
        Keep the checkpoint after a successful fit.
    solver : "auto" | "eigh" | "cholesky"
        Solver path (:func:`scaleattn.spectrum.solver_path`): ``"eigh"`` keeps the whole spectrum of
        ``Lambda_D`` (for the spectrum plot) at any psi; ``"auto"`` switches to Cholesky + Lanczos past
        ``LARGE_PSI``.
    fill_absent_chunks : bool
        For a dataset written by another tool: absent chunks mean the fill value (by default they are refused,
        naming the array and the samples).
    rtol
        Deprecated name of ``cutoff_rtol``.

    Returns
    -------
    FitResult

    Raises
    ------
    ParameterError
        A parameter out of range or not one of its choices (before any work).
    DatasetError
        Malformed input (names the array and sample), or a dataset without targets.
    OutputExistsError
        ``out``, or a checkpoint of an unfinished fit, exists without ``overwrite``/``resume``.
    UnsafeOutputError
        ``out`` or the checkpoint is, contains or lies inside the dataset, or ``overwrite`` would replace
        something scaleattn did not write.
    OutputInUseError
        Another run holds ``out`` or the checkpoint.
    IntegrityError
        Absent, changed or damaged chunks (naming the array and the samples), or a store a worker sees differently.
    CheckpointError
        The checkpoint was made from another dataset, chunking or version.
    InsufficientMemoryError
        The solve cannot fit in the memory of this process (or of the workers).

    See Also
    --------
    certify_dataset : the certificate alone, without targets.
    scaleattn.compute_statistics, scaleattn.solve, scaleattn.search_heads : the steps one by one.

    Examples
    --------
    >>> from scaleattn.generate import generate_mhla
    >>> ds = generate_mhla("data.zarr", d=2, heads=1, length=20, samples=64, overwrite=True)  # doctest: +SKIP
    >>> res = fit(ds, "run1", overwrite=True)  # doctest: +SKIP
    >>> res.certificate.identifiable  # doctest: +SKIP
    True
    """
    t0 = time.perf_counter()
    cutoff_rtol = renamed(deprecated, "rtol", "cutoff_rtol", cutoff_rtol)
    no_other_kwargs(deprecated, "fit")
    heads = heads_spec(heads)
    cutoff_rtol = check_cutoff(cutoff_rtol)
    ridge = real("ridge", ridge, 0.0)
    choice("solver", solver, SOLVERS)
    check_device(device, need_gpu_here=client is None)
    reporter = as_reporter(progress)
    ds = preflight(dataset, out, overwrite, storage_options, checkpoint=checkpoint, resume=resume,
                   fill_absent_chunks=fill_absent_chunks)
    out, ckpt = _locations(ds, out, checkpoint, storage_options)
    check_fit_memory(ds.d, ds.d_out, client=client, solver=solver, chunk_bytes=chunk_bytes(ds))  # before the build
    release_large_buffers()  # peak memory must not creep up with the number of row groups
    with holding(ds, out, ckpt):
        preflight(ds, out, overwrite, checkpoint=ckpt, resume=resume)  # again, now that no other run can interfere
        if ckpt is not None and not resume and ckpt.exists():
            ckpt.remove()  # --overwrite: start over (preflight checked that it is a scaleattn checkpoint)
        build = {}
        new_ckpt = ckpt is not None and not ckpt.exists()
        t = time.perf_counter()
        try:
            stats = compute_statistics(ds, client, progress=reporter, device=device, checkpoint=ckpt, info=build)
        except BaseException as e:
            _after_failed_build(e, ckpt, new_ckpt)
            raise
        times = {"statistics": time.perf_counter() - t}
        try:
            result = _finish(ds, stats, client, reporter, times, build, heads, cutoff_rtol, ridge, solver, exact_mse,
                             ckpt if keep_checkpoint else None)
            result.report["seconds"] = time.perf_counter() - t0
            if out is not None:
                with reporter.phase(f"write {out.url}"):
                    write_run(result, out, overwrite=overwrite, files=_plots(result, ds) if plots else None)
        except BaseException as e:
            if ckpt is not None:
                with_hint(e, _kept(ckpt, "all row groups"))
            raise
        if ckpt is not None and not keep_checkpoint:
            ckpt.remove()
    return result


def _finish(ds, stats, client, reporter, times, build, heads, cutoff_rtol, ridge, solver, exact_mse,
            kept_ckpt) -> FitResult:
    """Solve, certify, recover heads and assemble the report of a fit from its statistics."""
    t = time.perf_counter()
    with reporter.phase(f"solve (psi {stats.psi:,}) and heads ({heads})"):
        model, sol, h = model_from_statistics(stats, ds.causal, heads, cutoff_rtol, ridge, solver)
    times["solve_and_heads"] = time.perf_counter() - t
    model.attrs.update({"dataset": ds.url, "scaleattn_version": __version__, "heads_method": h.method})
    report = _report(ds, stats, sol, h, model)
    if exact_mse:
        t = time.perf_counter()
        report["train_mse"] = evaluate(model, ds, client, progress=reporter)["mse"]
        times["evaluate"] = time.perf_counter() - t
    else:
        report["train_mse"] = report["train_mse_stats"]
    ms = report["target_mean_square"]
    report["relative_train_mse"] = report["train_mse"] / ms if ms > 0 else float("nan")
    report.update({k: build[k] for k in ("groups", "tiles", "groups_computed", "groups_resumed")})
    report["checkpoint"] = None if kept_ckpt is None else kept_ckpt.url
    report["timings"] = times
    report["scaleattn_version"] = __version__
    report["dataset"] = ds.url
    return FitResult(model, stats, sol, h, report)


def _done_groups(ckpt: Location) -> tuple[int, int] | None:
    """(finished row groups, row groups) of the checkpoint at ``ckpt``, None when there is none readable."""
    try:
        done = ckpt.open_group("r")["done"][...]
    except Exception:  # absent, or never got its arrays
        return None
    return int(done.all(axis=1).sum()), int(done.shape[0])


def _kept(ckpt: Location, what: str | None = None) -> str:
    """The resume hint for a kept checkpoint."""
    n = _done_groups(ckpt)
    held = what or ("nothing" if n is None else f"{n[0]} of {n[1]} row groups")
    return f"the checkpoint {ckpt.url} keeps {held}: run the same command with --resume to continue"


def _after_failed_build(e: BaseException, ckpt: Location | None, new_ckpt: bool) -> None:
    """After a build failed or was interrupted: remove a checkpoint this fit created when it holds nothing
    worth resuming (bad data, or not one finished group), otherwise attach the resume hint to ``e``."""
    if ckpt is None:
        return
    if isinstance(e, CheckpointError):  # someone else's store: never touched
        return
    n = _done_groups(ckpt)
    if new_ckpt and (isinstance(e, DatasetError) or not n or n[0] == 0) and ckpt.exists():
        ckpt.remove()  # nothing worth resuming
        with_hint(e, "no checkpoint was kept")
        return
    if ckpt.exists():
        with_hint(e, _kept(ckpt))


def _checkpoint_location(out: Location | None, checkpoint, storage_options) -> Location | None:
    """The checkpoint store: ``checkpoint`` resolved with the fit's options, else ``OUT.checkpoint.zarr``."""
    if checkpoint is not None:
        return resolve(checkpoint, None if isinstance(checkpoint, Location) else storage_options)
    return None if out is None else Location(out.url + ".checkpoint.zarr", out.storage_options)


def _report(ds: Dataset, stats: Statistics, sol: Solution, h: Heads, model: MHLAModel) -> dict:
    """The report of a fit from its pieces (the keys of docs/report.md, but the timings and the exact MSE)."""
    cert = sol.certificate
    n_out = stats.n_rows * stats.d_out
    exact = heads_are_exact(h)
    report = {
        "n_rows": stats.n_rows, "n_samples": ds.n_samples, "length": ds.length, "d": ds.d, "d_out": ds.d_out,
        "causal": ds.causal, "psi": stats.psi, **cert.summary(),
        # the saved model's loss: the least-squares fit's, unless heads=H could not reproduce it
        "train_mse_stats": max(sol.sse if exact else h.sse, 0.0) / n_out,
        "lstsq_train_mse_stats": max(sol.sse, 0.0) / n_out, "target_mean_square": stats.target_mean_square,
        "n_heads": model.n_heads, "heads_method": h.method, "heads_residual": h.residual,
        "head_singular_values": h.spectrum.tolist(),
        "loss_vs_heads": [{"heads": int(k), "train_mse_stats": max(v, 0.0) / n_out} for k, v in h.curve],
        "ridge": sol.ridge, "effective_dof": sol.effective_dof,
    }
    if h.sse is not None:
        report["heads_train_mse_stats"] = max(h.sse, 0.0) / n_out
    wit = ambiguity_witness(sol, stats)
    if wit is not None:
        report["witness"] = wit.summary()
    teacher = ds.teacher()
    if teacher is not None:
        report["teacher_heads"] = int(teacher[0].shape[0])
        report["teacher_coef_distance"] = coef_distance(model.coef, coef_from_heads(*teacher))
    return report


def _plots(result: FitResult, ds: Dataset) -> dict:
    """The run's PNG plots (name -> bytes); a plotting failure warns but never fails a finished fit."""
    try:
        return figure_pngs(run_figures(result, ds))
    except (ScaleattnError, OSError, RuntimeError) as e:  # the fit itself is done; plots are a convenience
        warnings.warn(f"plots not written: {type(e).__name__}: {e}", stacklevel=3)
        return {}


def certify_dataset(dataset, *, client=None, cutoff_rtol=None, progress=False, storage_options=None,
                    solver: str = "auto", device: str = "auto", fill_absent_chunks: bool = False,
                    **deprecated) -> Certificate:
    """Identifiability certificate of a dataset ([Y25] Lemma 2.3): only the Gram is built, targets are not read.

    Parameters
    ----------
    dataset : str, path-like, Location or Dataset
    client : distributed.Client, optional
        Cluster to run on; None computes in this process.
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff in (0, 1).
    progress : bool or Reporter
    storage_options : dict or list of "KEY=VALUE", optional
    solver : "auto" | "eigh" | "cholesky"
        As :func:`scaleattn.certify`: ``"eigh"`` gives the whole spectrum, ``"cholesky"`` the extreme
        eigenvalues only.
    device : "auto" | "cpu" | "gpu"
    fill_absent_chunks : bool
        As :func:`fit`.
    rtol
        Deprecated name of ``cutoff_rtol``.

    Returns
    -------
    Certificate

    Raises
    ------
    ParameterError, DatasetError, InsufficientMemoryError
        As :func:`fit`, before any work.

    Examples
    --------
    >>> certify_dataset("data.zarr").identifiable  # doctest: +SKIP
    True
    """
    cutoff_rtol = renamed(deprecated, "rtol", "cutoff_rtol", cutoff_rtol)
    no_other_kwargs(deprecated, "certify_dataset")
    cutoff_rtol = check_cutoff(cutoff_rtol)
    choice("solver", solver, SOLVERS)
    check_device(device, need_gpu_here=client is None)
    reporter = as_reporter(progress)
    ds = _open(dataset, storage_options, fill_absent_chunks)
    check_fit_memory(ds.d, 0, client=client, solver=solver, what="certificate", chunk_bytes=chunk_bytes(ds, False))
    stats = compute_statistics(ds, client, targets=False, progress=reporter, device=device)
    with reporter.phase(f"certificate (psi {stats.psi:,})"):
        return certify(stats, cutoff_rtol, solver=solver)
