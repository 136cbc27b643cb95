"""The main job: dataset -> statistics (Dask) -> solve + certificate -> heads -> model and report.

Data flow one way (DESIGN §6)::

    Zarr dataset --row groups--> workers: features -> partial statistics --tree reduction--> statistics
        --> solver (client side): Jacobi-scaled eigh, certificate, c = G^+ B --> heads --> model + report
    only when the Gram cannot certify (``certificate="auto"``, :func:`scaleattn.linalg._qr.needs_qr`):
    Zarr dataset --row groups--> workers: R of [phi | y] --TSQR tree--> R --> certificate, c = R^+ z

:func:`fit` and :func:`certify_dataset` are the public entries: they validate every parameter and resolve every
store once, check the memory, and only then start work.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings

from ._backend import check_device
from ._params import choice, heads_spec, real, seconds
from ._version import __version__
from .data._dataset import Dataset, check_dataset_argument
from .display import _html as _html
from .display import _text as _text
from .display._progress import as_reporter
from .distributed.build import build_statistics, check_unchanged
from .distributed.evaluate import evaluate
from .distributed.journal import PassJournal
from .distributed.memory import (
    available_memory,
    check_fit_memory,
    chunk_bytes,
    fit_route,
    release_large_buffers,
    trim_heap,
)
from .distributed.operator import remote_build
from .distributed.partition import row_groups
from .distributed.reduction import check_client, check_reachable
from .distributed.stream import stream_operator
from .distributed.tsqr import check_qr_memory, compute_r
from .errors import CheckpointError, DatasetError, IntegrityError, ParameterError, ScaleattnError, with_hint
from .features import coef_distance, n_features
from .heads._algebra import Heads, coef_from_heads
from .heads._search import DEFAULT_BUDGET
from .linalg._certificate import Certificate, ambiguity_witness, check_cutoff
from .linalg._qr import CERTIFICATE_METHODS, certificate_from_r, needs_qr, residual_floor, solve_from_r
from .linalg._solver import (
    Solution,
    certify_validated,
    check_no_worse_than_zero,
    check_ridge,
    shared_gram,
    solve_validated,
)
from .linalg._stream import (
    BLOCK_ROWS,
    FIT_SOLVERS,
    StreamOperator,
    check_path_memory,
    count_rows,
    dual_solve,
    rows_from_dataset,
    stream_solve,
)
from .model import MHLAModel, heads_are_exact, model_from_heads, model_from_statistics, recover_heads
from .plot import figure_pngs, run_figures
from .preflight import (
    after_failed_build,
    holding,
    open_input,
    preflight,
    rerun_command,
    run_locations,
    solve_hint,
)
from .run import write_run
from .statistics._container import Statistics
from .store import _formats
from .store._location import Location, check_path, check_storage_options
from .store._outputs import reading

__all__ = ["fit", "certify_dataset", "FitResult", "SAY_KEPT_PSI", "validation_split"]


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
    out : str or None
        The run directory as given to :func:`fit` (None without one).
    files : list of str
        The names written into ``out`` (``report.json``, ``model.zarr``, ..., the PNG plots).

    See Also
    --------
    fit : makes one.
    scaleattn.run.read_run : the same numbers from a run directory.

    Examples
    --------
    >>> import scaleattn
    >>> from scaleattn.generate import generate_mhla
    >>> ds = generate_mhla("_doc_fit.zarr", d=2, heads=1, length=20, samples=64, causal=True, overwrite=True)
    >>> res = scaleattn.fit(ds, heads="minimal")
    >>> res.certificate.identifiable, res.model.n_heads
    (True, 1)
    >>> print(res.summary().splitlines()[3])  # doctest: +ELLIPSIS
    certificate: IDENTIFIABLE: every least-squares fit computes the same function [the float64 Gram, margin ...x]
    """

    model: MHLAModel
    statistics: Statistics
    solution: Solution
    heads: Heads
    report: dict
    out: str | None = None
    files: list = dataclasses.field(default_factory=list)

    @property
    def certificate(self) -> Certificate:
        return self.solution.certificate

    def summary(self) -> str:
        """The same summary ``scaleattn fit`` prints (:func:`scaleattn.display._text.fit_summary`)."""
        return _text.fit_summary(self.report)

    def _repr_html_(self) -> str:
        """The fit at a glance in Jupyter: verdict, spectrum, errors, heads, files (:func:`~.report_html.fit_html`)."""
        return _html.safe_html(lambda: _html.fit_html(self.report, self.certificate.spectrum_scaled, self.out,
                                                      self.files), self.summary, self.__repr__)

    def __repr__(self) -> str:
        r = self.report
        verdict = _text.verdict(r) if "identifiable" in r and "ambiguous_dim" in r else "no certificate in the report"
        mse, val = r.get("relative_train_mse"), r.get("relative_validation_mse")
        return (f"FitResult({r.get('dataset', '')!r}: {verdict}; {self.model.n_heads} heads; relative train MSE"
                f" {'n/a' if mse is None else format(mse, '.3g')}"
                + ("" if "validation_mse" not in r else f", validation {'n/a' if val is None else format(val, '.3g')}")
                + ")")


#: from this many features on (the Cholesky and krylov paths: a solve of minutes and gigabytes) a fit says, before
#: its solve, where the finished build is kept and how to solve again from it; a smaller solve is over before the
#: line could help
SAY_KEPT_PSI = 2_000


def fit(dataset, out=None, *, client=None, heads="svd", cutoff_rtol: float | None = None, ridge: float = 0.0,
        exact_mse: bool = True, overwrite: bool = False, progress=False, storage_options=None,
        device: str = "auto", plots: bool = True, resume: bool = False, checkpoint=None,
        keep_checkpoint: bool = False, solver: str = "auto", certificate: str = "auto",
        heads_budget: float | None = DEFAULT_BUDGET, fill_absent_chunks: bool = False,
        validation: float = 0.0) -> FitResult:
    """Fit MHLA to a dataset by least squares, certify it and recover heads ([Y25] Algorithm 1).

    Parameters
    ----------
    dataset : str, path-like, Location or Dataset
        A dataset group (:mod:`scaleattn.data._dataset`); local paths are made absolute.
    out : str, path-like or Location, optional
        Run directory to write ``report.json``, ``model.zarr``, ``stats.zarr`` (atomically: nothing is left
        behind on failure; an existing ``out`` is refused unless ``overwrite``).
    client : distributed.Client, optional
        Cluster to run on (:func:`scaleattn.distributed.cluster.connect`); None computes in this process.
    heads : "svd" | "minimal" | int
        Head recovery (:func:`scaleattn.heads._search.search_heads`).
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff in (0, 1) (default ``16 psi eps``).
    ridge : float
        Scaled ridge strength >= 0 (:func:`scaleattn.solve`); the report gives the effective dof.
    exact_mse : bool
        Measure the training MSE by a pass over the data (exact to round-off even at 1e-30), besides the statistics
        formula (round-off ``train_mse_stats_floor``); False skips it where that is below 1e-6 of mean y^2.
    overwrite : bool
        Replace an existing ``out`` (and start over instead of resuming a checkpoint).
    progress : bool or Reporter
        Bars in rows (rate, row groups done, time left) and the phases statistics, solve, heads, evaluate,
        write: on stderr, or live in the cell in a notebook (:mod:`scaleattn.display._progress`).
    storage_options : dict or list of "KEY=VALUE", optional
        fsspec options for the dataset, ``out`` and the checkpoint.
    device : "auto" | "cpu" | "gpu"
        Array device of the statistics tasks.
    plots : bool
        With ``out``, also write the PNG plots of :mod:`scaleattn.plot` next to the report.
    resume : bool
        Continue from the checkpoint: finished row groups are not recomputed (bit-identical statistics); a
        ``"stream"`` fit reads back its first sweep and every finished data pass and computes the rest, its
        answer bit-identical to a fit never interrupted (:mod:`scaleattn.distributed.journal`).
    checkpoint : str, path-like or Location, optional
        Checkpoint store of the statistics build (DESIGN §6), or of a ``"stream"`` fit its pass journal
        (DESIGN §4b; psi k floats per pass, about 6 MB at d = 64, d_out = 1; the dual keeps none); default
        ``out + ".checkpoint.zarr"`` when ``out`` is given. Written while running, removed after success unless
        ``keep_checkpoint``. An existing one is refused unless ``resume`` or ``overwrite`` (start over); one of
        the other kind, or made from another dataset, d or grouping, is refused
        (:class:`~scaleattn.errors.CheckpointError`).
    keep_checkpoint : bool
        Keep the checkpoint after a successful fit.
    solver : "auto" | "eigh" | "cholesky" | "krylov" | "stream"
        Solver path (:func:`scaleattn.linalg._spectrum.solver_path`): ``"eigh"`` keeps the whole spectrum of
        ``Lambda_D`` (for the spectrum plot) at any psi; ``"auto"`` switches to Cholesky + Lanczos past
        ``LARGE_PSI`` and to the matrix-free krylov path past ``KRYLOV_PSI`` or when the dense path does not fit
        in memory (:func:`scaleattn.distributed.memory.check_fit_memory`). ``"stream"``: no statistics; CG and the
        certificate from passes over the tokens in this process (:mod:`scaleattn.linalg._stream`, K-FAC
        preconditioned), or the dual for fewer rows than features; svd heads only, no ``stats.zarr``, no plots.
        ``"auto"`` takes the dual for fewer rows than features past psi = 2,000, and the stream path when the
        Gram route does not fit in memory or the cost model predicts it 1.5x faster
        (:func:`scaleattn.linalg._stream.fit_path`). The report's ``solver_path`` says which path ran and why.
    certificate : "auto" | "gram" | "qr"
        What decides the rank and solves ([Y25] Lemma 2.3, :mod:`scaleattn.linalg._qr`): ``"gram"`` the float64 Gram
        only; ``"qr"`` a tall-skinny QR of the features ``[Phi | Y]`` (a second pass over the data, any psi):
        rank from the singular values of R, ``c = R^+ z``, the residual from R; ``"auto"`` the QR only when the
        Gram does not certify identifiability and psi <= ``QR_MAX_PSI`` (well-conditioned data: one pass,
        unchanged results). The report's ``certificate_method`` says which decided.
    heads_budget : float or None
        Seconds for the head search of ``"minimal"`` / H, at most 30 days (None: no limit); the report's
        ``heads_budget_exhausted`` says when it ran out.
    fill_absent_chunks : bool
        For a dataset written by another tool: absent chunks mean the fill value (by default they are refused,
        naming the array and the samples).
    validation : float
        Fraction in ``[0, 1)`` of the samples held out for validation: the last ``ceil(validation * N)`` whole
        samples (deterministic, as Keras' ``validation_split``; the order of a time series is kept: the model is
        judged on what comes after its training data). They are left out of the statistics, the solve and
        ``train_mse``; one more pass measures their MSE: the report's ``validation_mse``,
        ``relative_validation_mse`` and ``validation_samples`` (:func:`validation_split`). 0 (default): every
        sample is fitted.

    Returns
    -------
    FitResult

    Raises
    ------
    ParameterError
        A parameter out of range or not one of its choices (before any work), or a ``validation`` that leaves
        no sample to fit or none to validate on.
    DatasetError
        Malformed input (names the array and sample), or a dataset without targets.
    OutputExistsError
        ``out``, or a checkpoint of an unfinished fit, exists without ``overwrite``/``resume``.
    UnsafeOutputError
        ``out`` or the checkpoint is, contains or lies inside the dataset, or ``overwrite`` would replace
        something scaleattn did not write.
    OutputInUseError
        Another run holds ``out`` or the checkpoint, replaces the dataset, or reads what ``overwrite`` replaces.
    UnsupportedError
        A ``memory://`` dataset (this process's memory) with workers in other processes.
    IntegrityError
        Absent, changed or damaged chunks (naming the array and the samples), or a store a worker sees differently.
    CheckpointError
        The checkpoint was made from another dataset, chunking or version, or is of the other kind (a statistics
        build's where a ``"stream"`` fit resumes, or a pass journal where the Gram route does).
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
    check_dataset_argument(dataset, "fit")
    check_client(client)
    if out is not None:
        check_path(out, "fit", "as `out` a run directory's path or URL")
    heads = heads_spec(heads)
    cutoff_rtol = check_cutoff(cutoff_rtol)
    ridge = check_ridge(ridge)
    heads_budget = seconds("heads_budget", heads_budget)
    choice("solver", solver, FIT_SOLVERS)
    choice("certificate", certificate, CERTIFICATE_METHODS)
    validation = real("validation", validation, 0.0, 1.0, high_open=True)
    check_device(device, need_gpu_here=client is None)
    reporter = as_reporter(progress)
    ds = preflight(dataset, out, overwrite, storage_options, checkpoint=checkpoint, resume=resume,
                   fill_absent_chunks=fill_absent_chunks)
    n_train = ds.n_samples - validation_split(ds.n_samples, validation)
    train = ds.first(n_train) if n_train < ds.n_samples else ds  # the statistics, solve and train MSE: these only
    check_reachable(client, [("dataset", ds.store)])
    out_label = out.url if isinstance(out, Location) else None if out is None else str(out)  # as the user gave it
    path, why = _stream_path(train, solver, heads, ridge, certificate)
    if path is not None:
        out, ckpt = run_locations(ds, out, checkpoint, storage_options)
        return _fit_streaming(ds, train, out, out_label, path, why, cutoff_rtol, overwrite, reporter, t0, client,
                              _Resume(ckpt, resume, keep_checkpoint))
    out, ckpt = run_locations(ds, out, checkpoint, storage_options)
    # refused before the build (InsufficientMemoryError); "auto" becomes the path that fits
    solver = check_fit_memory(ds.d, ds.d_out, client=client, solver=solver, chunk_bytes=chunk_bytes(ds),
                              dense=ridge > 0, heads=heads, n_rows=_rows_of(ds))["path"]
    if client is not None and solver == "krylov" and heads != "svd":  # Tc stays on the workers: products only
        raise ParameterError(f"`heads={heads!r}` needs the dense Gram (loss-weighted head fits); a krylov fit on a"
                             " cluster keeps Tc on the workers: use `heads='svd'` (or `solver='cholesky'` where G"
                             " fits)")
    if certificate == "qr":
        check_qr_memory(ds.d, ds.d_out, client)
    release_large_buffers()  # peak memory must not creep up with the number of row groups
    with holding(ds, out, ckpt):
        preflight(ds, out, overwrite, checkpoint=ckpt, resume=resume)  # again, now that no other run can interfere
        if ckpt is not None and not resume and ckpt.exists():
            ckpt.remove()  # --overwrite: start over (preflight checked that it is a scaleattn checkpoint)
        new_ckpt = ckpt is not None and not ckpt.exists()
        t = time.perf_counter()
        try:
            # krylov on a cluster: the tiles of Tc stay on the workers (no node holds Tc or G)
            build_on = remote_build if client is not None and solver == "krylov" else build_statistics
            build = build_on(train, client, progress=reporter, device=device, checkpoint=ckpt)
            stats = build.statistics
        except BaseException as e:
            after_failed_build(e, ckpt, new_ckpt)
            raise
        times = {"statistics": time.perf_counter() - t}
        trim_heap()  # the build's freed buffers, before the solve's peak
        rerun = None if ckpt is None else rerun_command(ds.url, out_label, ckpt, checkpoint is not None)
        if ckpt is not None and n_features(ds.d) >= SAY_KEPT_PSI:  # before the solve: all a native crash there leaves
            groups = build.groups
            reporter.line(f"statistics of all {groups} row group{'s' if groups != 1 else ''} are kept in {ckpt.url}"
                          f" until the fit is written; should the solve fail, `{rerun}` (with this run's other"
                          " options) solves again from them")
        try:
            opts = _SolveOptions(heads, cutoff_rtol, ridge, solver, certificate, heads_budget)
            result = _finish(train, stats, client, reporter, times, build, opts, exact_mse,
                             ckpt if keep_checkpoint else None)
            if train is not ds:  # the held-out samples: one more pass, the model as it will be saved
                _validate(result, ds, train.n_samples, client, reporter, times)
            result.report["seconds"] = time.perf_counter() - t0
            if out is not None:
                with reporter.phase("write", out_label + (" with plots" if plots else "")):
                    t = time.perf_counter()
                    files = _plots(result, train) if plots else None
                    if plots:
                        times["plots"] = time.perf_counter() - t
                    result.files = write_run(result, out, overwrite=overwrite, files=files)
                    result.out = out_label
        except BaseException as e:
            if ckpt is not None:
                with_hint(e, solve_hint(ckpt, rerun, e))
            raise
        finally:  # Tc held on the workers (a cluster krylov fit) is freed as the fit ends, failed or not
            stats.release()
        if ckpt is not None and not keep_checkpoint:
            try:
                ckpt.remove()
            except BaseException as e:  # (Ctrl-C here) the run is complete: say so, not "nothing was written"
                with_hint(e, f"{out_label or 'the fit'} was written in full; the checkpoint {ckpt.url} may be"
                             " left behind (remove it)")
                raise
    return result


def validation_split(n_samples: int, fraction: float) -> int:
    """The number of samples a fit holds out for validation: the last ``ceil(fraction * n_samples)`` (0 for a
    fraction of 0; at least one sample for any fraction above 0), refused where that leaves no sample to fit.

    Raises
    ------
    ParameterError
        ``fraction`` > 0 holds out every sample (named with the counts).

    Examples
    --------
    >>> validation_split(100, 0.2), validation_split(64, 0.2), validation_split(10, 0.0), validation_split(100, 1e-12)
    (20, 13, 0, 1)
    """
    if fraction <= 0:
        return 0
    # (0.7 * 10 is 7.000000000000001: not 8 held out; the rounding must not take a tiny fraction to none)
    held = max(1, math.ceil(round(fraction * n_samples, 9)))
    if held >= n_samples:
        raise ParameterError(f"`validation={fraction:g}` of {n_samples} sample{'s' * (n_samples != 1)} holds out"
                             " every one: nothing is left to fit (a smaller fraction, or more samples)")
    return held


def _validate(result: FitResult, ds: Dataset, n_train: int, client, reporter, times: dict) -> None:
    """The validation MSE of a fit's model on the held-out samples ``[n_train, N)`` of ``ds`` (the report's
    ``validation_*`` keys, docs/report.md)."""
    t = time.perf_counter()
    v = evaluate(result.model, ds, client, progress=reporter, samples=(n_train, ds.n_samples))
    times["validation"] = time.perf_counter() - t
    result.report.update({"n_samples": ds.n_samples, "train_samples": n_train,
                          "validation_samples": ds.n_samples - n_train, "validation_mse": v["mse"],
                          "relative_validation_mse": v["relative_mse"]})


@dataclasses.dataclass(frozen=True)
class _SolveOptions:
    """The validated options of the solve, certificate and head steps of :func:`fit`."""

    heads: str | int
    cutoff_rtol: float | None
    ridge: float
    solver: str
    certificate: str
    heads_budget: float | None


def _rows_of(ds) -> int:
    """The dataset's rows (its lengths read for causal data with lengths)."""
    return count_rows(ds.n_samples, ds.length, ds.causal,
                      ds.read_lengths(0, ds.n_samples) if ds.causal and ds.has_lengths else None)


def _stream_path(ds, solver: str, heads, ridge: float, certificate: str) -> tuple[str | None, str]:
    """:func:`scaleattn.linalg._stream.fit_path` for a dataset (its rows counted from its lengths), refused with
    ``certificate="qr"`` (the streaming paths certify from passes or by dimension count)."""
    if solver not in ("auto", "stream"):
        return None, f"asked for (solver={solver!r})"
    n_rows = _rows_of(ds)
    path, why = fit_route(solver, n_rows, ds.d, ds.d_out, heads=heads, ridge=ridge, chunk_bytes=chunk_bytes(ds))
    if path is not None and certificate == "qr":
        if solver == "stream":
            raise ParameterError("the QR certificate needs the statistics build, which the stream solver does not"
                                 " make (it certifies from passes over the tokens): choose the certificate auto or"
                                 " gram, or another solver")
        return None, "certificate='qr' asked for"
    if path is not None:
        check_path_memory(path, n_rows, ds.d, ds.d_out, available_memory(), chunk_bytes(ds))
    return path, why


def _streamed(ds, path: str, client, cutoff_rtol, certify_only: bool = False, note=None, journal=None):
    """The streaming or dual solve of ``ds`` (DESIGN §4b): ``(solution or certificate, cluster summary or None,
    where it ran, for the report's reason, or "")``. The streaming CG's passes run on the cluster of ``client``
    (:mod:`scaleattn.distributed.stream`; in this process without one: the same row groups and tree, the same
    bits); the dual needs all rows at once (one N x N kernel) and runs in this process. ``note``: the progress
    phase's note (the sweep's rows, each pass). ``journal``: the fit's pass journal
    (:class:`scaleattn.distributed.journal.PassJournal`; the dual keeps its sweep only)."""
    if path == "dual":
        where = "" if client is None else ("; in this process, not on the cluster: the dual holds all rows at once"
                                           " (one N x N kernel)")
        src = rows_from_dataset(ds, targets=not certify_only)
        op = StreamOperator(src, note, journal)
        return dual_solve(src, cutoff_rtol=cutoff_rtol, certify_only=certify_only, op=op), None, where
    op = stream_operator(ds, client, targets=not certify_only, note=note, journal=journal)
    try:
        sol = stream_solve(op.source, cutoff_rtol=cutoff_rtol, op=op, certify_only=certify_only)
    finally:  # the token features kept on the workers are freed as the solve ends, failed or not
        if client is not None:
            op.release()
    if client is None:
        return sol, None, ""
    return sol, op.summary(), f"; its passes on the Dask cluster ({op.workers} workers, {len(op.groups)} row groups)"


@dataclasses.dataclass(frozen=True)
class _Resume:
    """A streaming fit's checkpoint options: the journal's location (None: none kept), ``resume``,
    ``keep_checkpoint``."""

    store: Location | None
    resume: bool = False
    keep: bool = False


def _open_journal(ds, path: str, r: _Resume):
    """The pass journal of a streaming fit (:mod:`scaleattn.distributed.journal`), after the locks are held:
    ``(journal or None, created now?)``. Without ``resume`` an existing one (``overwrite``: preflight checked it
    is scaleattn's) is removed first: the fit starts over."""
    if r.store is None:
        return None, False
    if not r.resume and r.store.exists():
        r.store.remove()
    if path == "dual":  # (the dual reads the rows in one sweep and one more read: no passes to keep)
        return None, False
    new = not r.store.exists()
    return PassJournal.open(r.store, ds, row_groups(ds), targets=True, block_rows=BLOCK_ROWS), new


def _after_failed_stream(e: BaseException, journal, r: _Resume, new: bool) -> None:
    """After a streaming fit failed or was interrupted: remove a journal this fit created that holds nothing
    worth resuming (bad data, or no finished first sweep), else attach the resume hint to ``e``."""
    if journal is None or isinstance(e, CheckpointError):  # (someone else's store: never touched)
        return
    try:
        worth = journal.has_sweep() and not isinstance(e, DatasetError)
        if new and not worth and r.store.exists():
            r.store.remove()
            with_hint(e, "no checkpoint was kept")
        elif isinstance(e, IntegrityError) and r.store.exists():  # (a resume would be refused: the rows changed)
            with_hint(e, f"the checkpoint {r.store.url} holds passes over the data as it was before: once nothing"
                         " writes to the input, run again with `overwrite=True` instead of `resume=True`")
        elif r.store.exists():
            with_hint(e, f"the checkpoint {r.store.url} keeps {journal.held()}: repeat the fit with `resume=True`"
                         " to continue")
    except Exception:  # (the store unreachable now: the error that stopped the fit is what matters)
        return


def _fit_streaming(ds, train, out, out_label, path, why, cutoff_rtol, overwrite, reporter, t0,
                   client=None, r: _Resume = _Resume(None)) -> FitResult:
    """A fit by :mod:`scaleattn.linalg._stream` (DESIGN §4b), its passes on the cluster of ``client`` or in this
    process: the ``train`` samples of ``ds`` read chunk by chunk in every pass (or kept as token features when they
    fit), no statistics (no ``stats.zarr``), svd heads, the training MSE from the path's own pass; the held-out
    samples (``validation``) measured by :func:`_validate`. The first sweep and every pass are kept in the pass
    journal at ``r.store`` (:mod:`scaleattn.distributed.journal`) and, with ``r.resume``, read back from it:
    removed once the run is written, unless ``r.keep``."""
    full, ds = ds, train
    with holding(full, out, r.store):
        preflight(full, out, overwrite, checkpoint=r.store, resume=r.resume)
        journal, new = _open_journal(ds, path, r)
        times = {}
        t = time.perf_counter()
        try:
            with reporter.phase("solve", f"{path}, psi {n_features(ds.d):,}") as note:
                sol, cluster, where = _streamed(ds, path, client, cutoff_rtol, note=note, journal=journal)
        except BaseException as e:
            _after_failed_stream(e, journal, r, new)
            raise
        times["solve"] = time.perf_counter() - t
        h = recover_heads(sol.coef, ds.d, "svd")
        model = model_from_heads(sol, h, ds.d, ds.causal)
        n_out = max(sol.n_rows * ds.d_out, 1)
        ms = sol.yy / n_out
        check_no_worse_than_zero(sol.sse / n_out, ms, 1e-9 * ms)
        cert = sol.certificate
        report = {"n_rows": sol.n_rows, "n_samples": ds.n_samples, "length": ds.length, "d": ds.d,
                  "d_out": ds.d_out, "causal": ds.causal, "psi": n_features(ds.d), **cert.summary(),
                  "train_mse": sol.sse / n_out, "relative_train_mse": sol.sse / sol.yy if sol.yy > 0 else float("nan"),
                  "target_mean_square": ms, "n_heads": model.n_heads, "heads_method": h.method,
                  "heads_residual": h.residual, "head_singular_values": h.spectrum.tolist(), "loss_vs_heads": [],
                  "ridge": 0.0, "effective_dof": sol.effective_dof,
                  "solver_path": {"path": path, "reason": why + where, "statistics_written": False,
                                  **({} if cluster is None else {"cluster": cluster}),
                                  **({} if journal is None else {"sweep_resumed": journal.sweep_resumed,
                                                                 "passes_resumed": journal.resumed,
                                                                 "passes_computed": journal.computed})}}
        teacher = full.teacher()
        if teacher is not None:
            report["teacher_heads"] = int(teacher[0].shape[0])
            report["teacher_coef_distance"] = coef_distance(model.coef, coef_from_heads(*teacher))
        model.attrs.update({"dataset": full.url, "scaleattn_version": __version__, "heads_method": h.method})
        kept = journal is not None and r.keep
        report.update(timings=times, scaleattn_version=__version__, dataset=full.url,
                      dataset_fingerprint=full.fingerprint, checkpoint=r.store.url if kept else None,
                      seconds=time.perf_counter() - t0)
        result = FitResult(model, None, sol, h, report)
        try:
            if train.n_samples < full.n_samples:
                _validate(result, full, train.n_samples, client, reporter, times)
            if out is not None:
                with reporter.phase("write", out_label):
                    result.files = write_run(result, out, overwrite=overwrite)
                    result.out = out_label
        except BaseException as e:
            _after_failed_stream(e, journal, r, False)
            raise
        if journal is not None and not r.keep:
            try:
                r.store.remove()
            except BaseException as e:  # (Ctrl-C here) the run is complete: say so, not "nothing was written"
                with_hint(e, f"{out_label or 'the fit'} was written in full; the checkpoint {r.store.url} may be"
                             " left behind (remove it)")
                raise
    return result


def _finish(ds, stats, client, reporter, times, build, o: _SolveOptions, exact_mse, kept_ckpt) -> FitResult:
    """Solve, certify, recover heads and assemble the report of a fit from its statistics."""
    heads, cutoff_rtol, ridge, solver = o.heads, o.cutoff_rtol, o.ridge, o.solver
    t = time.perf_counter()
    stats = stats.to_numpy()
    with reporter.phase("solve", f"psi {stats.psi:,}"):
        G = shared_gram(stats, solver)  # expanded once (the krylov path: the operator): solve, heads, witness
        sol = solve_validated(stats, cutoff_rtol, ridge=ridge, solver=solver, gram=G)
    times["solve"] = time.perf_counter() - t
    if needs_qr(o.certificate, sol.certificate, stats.psi):  # the Gram cannot settle it: a QR, a second pass
        t = time.perf_counter()
        check_qr_memory(ds.d, ds.d_out, client)
        factor = compute_r(ds, client, progress=reporter)
        check_unchanged(ds, *build.bindings, during="the QR pass read it")
        times["qr"] = time.perf_counter() - t
        t = time.perf_counter()
        with reporter.phase("solve from R", f"psi {stats.psi:,}"):
            sol = solve_from_r(factor, cutoff_rtol, ridge, gram=sol.certificate)
        times["solve"] += time.perf_counter() - t
    t = time.perf_counter()
    with reporter.phase("heads", str(heads)) as note:  # the search says the head count it tries, as it goes
        model, sol, h = model_from_statistics(stats, ds.causal, heads, cutoff_rtol, ridge, solver, gram=G,
                                              solution=sol, heads_budget=o.heads_budget, progress=note)
        report = _report(ds, stats, sol, h, model, G)
    times["heads"] = time.perf_counter() - t
    times["solve_and_heads"] = times["solve"] + times["heads"]
    del G
    model.attrs.update({"dataset": ds.url, "scaleattn_version": __version__, "heads_method": h.method})
    ms = report["target_mean_square"]
    if exact_mse or not report["train_mse_stats_floor"] <= 1e-6 * ms:  # (the statistics cannot tell: measure)
        t = time.perf_counter()
        report["train_mse"] = evaluate(model, ds, client, progress=reporter)["mse"]
        check_unchanged(ds, *build.bindings, during="the evaluation pass read it")
        check_no_worse_than_zero(report["train_mse"], ms, 1e-9 * ms, None if heads_are_exact(h) else model.n_heads)
        times["evaluate"] = time.perf_counter() - t
    else:
        report["train_mse"] = report["train_mse_stats"]
    report["relative_train_mse"] = report["train_mse"] / ms if ms > 0 else float("nan")
    report.update(groups=build.groups, tiles=build.tiles, groups_computed=build.groups_computed,
                  groups_resumed=build.groups_resumed)
    report["checkpoint"] = None if kept_ckpt is None else kept_ckpt.url
    report["timings"] = times
    report["scaleattn_version"] = __version__
    report.update(dataset=ds.url, dataset_fingerprint=ds.fingerprint)  # (plot: is it still the data fitted?)
    return FitResult(model, stats, sol, h, report)


def _report(ds: Dataset, stats: Statistics, sol: Solution, h: Heads, model: MHLAModel, gram) -> dict:
    """The report of a fit from its pieces (the keys of docs/report.md, but the timings and the exact MSE)."""
    cert = sol.certificate
    n_out = stats.n_rows * stats.d_out
    exact = heads_are_exact(h)
    factor = getattr(sol, "factor", None)
    lstsq_floor = (stats.sse_floor(sol.coef, gram) if factor is None else residual_floor(factor, sol.coef)) / n_out
    report = {
        "n_rows": stats.n_rows, "n_samples": ds.n_samples, "length": ds.length, "d": ds.d, "d_out": ds.d_out,
        "causal": ds.causal, "psi": stats.psi, **cert.summary(),
        # the saved model's loss: the least-squares fit's, unless heads=H could not reproduce it
        "train_mse_stats": max(sol.sse if exact else h.sse, 0.0) / n_out,
        "train_mse_stats_floor": lstsq_floor if exact else stats.sse_floor(model.coef, gram) / n_out,
        "lstsq_train_mse_stats": max(sol.sse, 0.0) / n_out, "lstsq_train_mse_stats_floor": lstsq_floor,
        # every loss_vs_heads entry comes from the statistics formula: its round-off at the fitted coefficients
        "loss_vs_heads_floor": stats.sse_floor(sol.coef, gram) / n_out,
        "target_mean_square": stats.target_mean_square,
        "n_heads": model.n_heads, "heads_method": h.method, "heads_residual": h.residual,
        "head_singular_values": h.spectrum.tolist(),
        "loss_vs_heads": [{"heads": int(k), _formats.loss_key(h.ridge): max(v, 0.0) / n_out} for k, v in h.curve],
        "ridge": sol.ridge, "effective_dof": sol.effective_dof,
    }
    if sol.ridge > 0:  # what the ridge fit minimised (the curve's loss): its MSE plus the penalty
        report["train_objective_stats"] = max(sol.objective(gram), 0.0) / n_out
    if h.sse is not None:
        report["heads_train_mse_stats"] = max(h.sse, 0.0) / n_out
    report.update(_heads_search_report(h, n_out, report["loss_vs_heads_floor"]))
    wit = ambiguity_witness(sol, stats, gram)
    if wit is not None:
        report["witness"] = wit.summary()
    teacher = ds.teacher()
    if teacher is not None:
        report["teacher_heads"] = int(teacher[0].shape[0])
        report["teacher_coef_distance"] = coef_distance(model.coef, coef_from_heads(*teacher))
    return report


def _heads_search_report(h: Heads, n_out: int, floor: float = 0.0) -> dict:
    """The head search's report keys (docs/report.md §4); ``floor``: the loss curve's round-off per row and output."""
    if h.lower_bound is None:
        return {}
    return {"heads_exact": bool(h.exact), "heads_loss_gap": (h.loss_gap or 0.0) / max(n_out, 1),
            "heads_lower_bound": int(h.lower_bound), "heads_lower_bound_kind": h.lower_bound_kind,
            "heads_bound_every_c": int(h.bound_every_c), "heads_bound_generic": int(h.bound_generic),
            "heads_meets_bound": bool(h.meets_bound), "heads_budget_exhausted": bool(h.budget_exhausted),
            "heads_search_seconds": float(h.seconds or 0.0), "heads_fewer_within": h.fewer_within(floor * n_out)}


def _plots(result: FitResult, ds: Dataset) -> dict:
    """The run's PNG plots (name -> bytes); a plotting failure warns but never fails a finished fit."""
    try:
        return figure_pngs(run_figures(result, ds))
    except (ScaleattnError, OSError, RuntimeError) as e:  # the fit itself is done; plots are a convenience
        warnings.warn(f"plots not written: {type(e).__name__}: {e}", stacklevel=3)
        return {}


def certify_dataset(dataset, *, client=None, cutoff_rtol=None, progress=False, storage_options=None,
                    solver: str = "auto", device: str = "auto", certificate: str = "auto",
                    fill_absent_chunks: bool = False) -> Certificate:
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
    solver : "auto" | "eigh" | "cholesky" | "krylov" | "stream"
        As :func:`scaleattn.certify`: ``"eigh"`` gives the whole spectrum, ``"cholesky"`` and ``"krylov"`` the
        extreme eigenvalues only (krylov with their intervals, ``G`` never formed); ``"stream"`` the same from
        passes over the tokens (no statistics; for fewer rows than features the dual's kernel rank);
        ``"auto"`` as :func:`fit`.
    device : "auto" | "cpu" | "gpu"
    certificate : "auto" | "gram" | "qr"
        As :func:`fit`: ``"auto"`` takes a second pass (a QR of the features, no targets) only when the Gram
        does not certify identifiability and psi <= ``QR_MAX_PSI``; ``"qr"`` always, ``"gram"`` never.
    fill_absent_chunks : bool
        As :func:`fit`.

    Returns
    -------
    Certificate
        ``method`` says what decided (``"gram"`` or ``"qr"``); ``verdict`` is ``"identifiable"``, ``"not
        identifiable"`` or ``"not settled"``.

    Raises
    ------
    ParameterError, DatasetError, InsufficientMemoryError, UnsupportedError, OutputInUseError
        As :func:`fit`, before any work.

    See Also
    --------
    scaleattn.certify : the certificate of statistics you already have.
    fit : with targets: coefficients, heads and the report too.

    Examples
    --------
    >>> certify_dataset("data.zarr").identifiable  # doctest: +SKIP
    True
    """
    check_dataset_argument(dataset, "certify_dataset")
    check_client(client)
    cutoff_rtol = check_cutoff(cutoff_rtol)
    choice("solver", solver, FIT_SOLVERS)
    choice("certificate", certificate, CERTIFICATE_METHODS)
    check_device(device, need_gpu_here=client is None)
    reporter = as_reporter(progress)
    check_storage_options(storage_options, dataset)  # (fsspec's options of a local path: ignored, so refused)
    ds = open_input(dataset, storage_options, fill_absent_chunks)
    check_reachable(client, [("dataset", ds.store)])
    path, _ = _stream_path(ds, solver, "svd", 0.0, certificate)
    if path is not None:  # no statistics: passes over the tokens (or the dual's kernel), targets not read
        with reading(ds.store, "dataset"), reporter.phase(f"certificate ({path}, psi {n_features(ds.d):,})") as note:
            return _streamed(ds, path, client, cutoff_rtol, certify_only=True, note=note)[0]
    solver = check_fit_memory(ds.d, 0, client=client, solver=solver, what="certificate",
                              chunk_bytes=chunk_bytes(ds, False), n_rows=_rows_of(ds))["path"]
    if certificate == "qr":
        check_qr_memory(ds.d, 0, client)
    with reading(ds.store, "dataset"):  # no other run replaces the dataset while it is read
        build_on = remote_build if client is not None and solver == "krylov" else build_statistics
        build = build_on(ds, client, targets=False, progress=reporter, device=device)
        stats = build.statistics
        try:
            with reporter.phase(f"certificate (psi {stats.psi:,})"):
                cert = certify_validated(stats, cutoff_rtol, solver=solver)
        finally:  # Tc held on the workers is freed once the certificate is made (or failed)
            stats.release()
        if not needs_qr(certificate, cert, stats.psi):
            return cert
        check_qr_memory(ds.d, 0, client)
        factor = compute_r(ds, client, targets=False, progress=reporter)
        check_unchanged(ds, *build.bindings, during="the QR pass read it")
        with reporter.phase(f"certificate from R (psi {stats.psi:,})"):
            return certificate_from_r(factor, cutoff_rtol, gram=cert)
