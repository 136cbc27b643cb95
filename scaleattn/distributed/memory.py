"""Memory a fit or certificate needs, estimated before it starts, and a clear refusal when it cannot fit
(DESIGN §3, §4, §6).

The solver node holds the statistics (compact Gram ``Tc``: m(m+1)/2 x d(d+1)/2 floats) and, on the dense
paths, expands them to the psi x psi Gram ``G``; the eigh path then needs about five psi x psi float64 arrays
at its peak (``G``, the Jacobi-scaled copy, LAPACK's copy that becomes the eigenvectors, ``syevd``'s 2 n^2
workspace), the Cholesky path one past ``DENSE_GRAM_MAX_PSI`` features (``G``, factored in place; the products
after the factor use ``Tc``) and two up to it (the dense ``G`` the fit shares and the factor's copy). The krylov path
(:mod:`scaleattn.linalg._krylov`) none: beyond ``Tc`` it holds the token-diagonal columns of ``Tc`` (m(m+1)/2 x d),
the block-Jacobi inverses (d x m x m), one segment expansion per operator thread and a few hundred psi-vectors
(Lanczos bases, LOBPCG and CG blocks), :func:`krylov_bytes`. Each worker holds one partial ``Tc`` tile per task,
and up to ``split_every + 2`` of them while it combines partials (:func:`scaleattn.distributed.reduction.tree_reduce`).

The available memory is ``psutil.virtual_memory().available`` unless ``memory_limit`` (bytes, or a string
such as ``"16GiB"``) or the environment variable ``SCALEATTN_MEMORY_LIMIT`` says otherwise.
"""
from __future__ import annotations

import functools
import os

from ..data._dataset import CUT_CHUNKS
from ..errors import InsufficientMemoryError, ParameterError
from ..features import n_features, n_pairs
from ..linalg._gram import DENSE_GRAM_MAX_PSI
from ..linalg._krylov import BLOCK, LANCZOS_MAX
from ..linalg._spectrum import solver_path
from ..linalg._stream import fit_path
from ..statistics._container import BLOCK_BYTES, block_bytes_per_sample
from ..statistics._kernel import PANEL_COLS, PANEL_ROWS
from .partition import MAX_TILE_BYTES, tile_bounds
from .reduction import NO_WORKER_S

__all__ = ["fit_memory", "check_fit_memory", "fit_route", "krylov_null_bytes", "available_memory", "parse_bytes",
           "release_large_buffers",
           "trim_heap", "worker_config", "chunk_bytes", "krylov_bytes", "InsufficientMemoryError", "SOLVER_ARRAYS",
           "MMAP_THRESHOLD", "TRIM_THRESHOLD", "PROFILE_INTERVAL", "TICK_INTERVAL", "MONITOR_INTERVAL"]

GIB = 2.0**30
#: psi x psi float64 arrays alive at the solver's peak, per path (see the module docstring)
SOLVER_ARRAYS = {"eigh": 5, "cholesky": 1, "krylov": 0}


#: buffers from this size on are mmapped and given back to the OS when freed (glibc otherwise raises the
#: threshold to 32 MB after the first free, and freed 10-30 MB partials then fragment the heap: a fit's peak
#: RSS grew 18% from N to 4N rows at d = 16; with the fixed threshold 1%). 8 MiB, not 1 MiB: a block's feature
#: arrays (about 5 MB each, BLOCK_BYTES in all) then come from the heap instead of fresh page-faulted mappings
#: every block (1 MiB cost an in-process build 8-10% at d = 16, and made a Dask worker's build slower than the
#: in-process one: docs/performance.md), while the partials (10 MB and up at d >= 16) are still given back
MMAP_THRESHOLD = 1 << 23


#: the heap's free top is given back to the OS only above this (glibc's own ratio to the mmap threshold when it
#: adjusts both itself): Dask's nanny sets MALLOC_TRIM_THRESHOLD_ = 64 KiB in its workers, and a fixed mmap
#: threshold leaves glibc's default of 128 KiB, so each block's feature arrays, freed at the top of the heap, were
#: returned and page-faulted again on the next block (docs/performance.md, "The Dask path")
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


def release_large_buffers() -> None:
    """Make this process return large freed buffers to the OS, and keep a block's worth of heap (glibc
    ``mallopt``: ``M_MMAP_THRESHOLD`` = :data:`MMAP_THRESHOLD`, ``M_TRIM_THRESHOLD`` = :data:`TRIM_THRESHOLD`).
    A no-op where glibc is absent. Called by a fit in process and by every statistics task on a worker (any
    cluster, whatever its environment); the embedded cluster's workers also start with it
    (:func:`worker_config`)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, TRIM_THRESHOLD)  # M_TRIM_THRESHOLD


def trim_heap() -> None:
    """Give every freed page of the C heap back to the OS now (glibc ``malloc_trim(0)``, what Dask's docs advise
    for worker memory that is "not released back to the OS"). Called once between a fit's build and its solve: the
    build's block buffers, freed below :data:`TRIM_THRESHOLD` or in the middle of the heap, otherwise stay resident
    under the solve's psi x psi arrays, and there are more of them the more row groups were read (peak RSS
    +10.8% from N to 4N rows at d = 16 without it). A no-op where glibc is absent."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc():
    """This process's C library when it is glibc (``mallopt`` and ``malloc_trim``), else None; looked up once
    (``find_library`` runs ``ldconfig``: not once per statistics task)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (musl and others lack them)
    except (OSError, AttributeError):
        return None
    return libc


#: sampling interval of the embedded cluster's worker profiler (the dashboard's profile page): Dask's 10 ms
#: sampling walks the stacks on the worker's event loop, holding the GIL, 100 times a second: 1.8 s of a one-worker
#: build's 20 s (that thread's CPU time; 0.8 s with the profiler off, docs/performance.md)
PROFILE_INTERVAL = "100ms"


#: event-loop health check of every Dask server of the embedded cluster (scheduler, nannies, workers, client;
#: ``distributed.admin.tick.interval``): Dask's 20 ms wakes each loop 50 times a second only to time itself (a
#: warning past ``tick.limit``, 3 s, still fires at 500 ms; Dask's own test clusters run at 500 ms). Measured on 2
#: vCPUs, 2 workers idle: 1.43 s of CPU per 10 s with 20 ms, 0.75 s with 500 ms; during a 2-worker build the
#: compute threads waited for a core 0.57-0.97 s of their 4.3 s, 0.30-0.43 s with this and MONITOR_INTERVAL
#: (docs/performance.md, "The Dask path: the cluster's own CPU")
TICK_INTERVAL = "500ms"

#: the nanny's and the worker's memory checks (spill, pause, terminate; ``distributed.worker.memory.
#: monitor-interval``, Dask's 100 ms): a psutil read of the worker's RSS each time; 0.75 -> 0.47 s of idle CPU per
#: 10 s with 1 s (2 workers, TICK_INTERVAL as above); 500 ms still stops a worker within half a second of its limit
MONITOR_INTERVAL = "500ms"


def worker_config() -> dict:
    """Dask config for the embedded cluster (``dask.config.set(worker_config())`` around its start, so that the
    scheduler, the nannies and the client in this process and the worker processes they spawn all read it): the
    glibc thresholds of :func:`release_large_buffers` as environment variables of the workers, set before they
    spawn (they replace the nanny's ``MALLOC_TRIM_THRESHOLD_ = 65536``); the workers' statistical profiler at
    :data:`PROFILE_INTERVAL` instead of Dask's 10 ms; every server's event-loop check at :data:`TICK_INTERVAL`
    and the memory checks at :data:`MONITOR_INTERVAL` instead of Dask's 20 ms and 100 ms (on a machine whose
    every core runs a worker, this background work takes its time from the statistics tasks). A cluster of your
    own gets the thresholds from the statistics tasks themselves, or the same keys in its Dask config
    (docs/performance.md)."""
    import dask

    env = "distributed.nanny.pre-spawn-environ."
    config = {env + "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), env + "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
              "distributed.worker.profile.interval": PROFILE_INTERVAL,
              "distributed.admin.tick.interval": TICK_INTERVAL,
              "distributed.worker.memory.monitor-interval": MONITOR_INTERVAL}
    if dask.config.get("distributed.scheduler.no-workers-timeout", None) is None:
        # a task no live worker can run fails after this (distributed's NoWorkerError), never waits for ever: the
        # nanny of a worker killed again and again (its memory) may give up restarting it
        config["distributed.scheduler.no-workers-timeout"] = f"{NO_WORKER_S:g}s"
    return config


def parse_bytes(value) -> float:
    """``123``, ``"8e9"``, ``"16GiB"``, ``"500 MB"`` -> bytes. Raises ``ValueError`` on anything else."""
    if isinstance(value, (int, float)):
        return float(value)
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = str(value).strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    try:
        return float(num) * units[s[len(num):]]
    except (KeyError, ValueError):
        raise ParameterError(f"memory limit: cannot read {value!r} as a size (e.g. 16GiB, 8e9)") from None


def krylov_bytes(d: int, d_out: int, threads: int | None = None, lanczos_steps: int = LANCZOS_MAX,
                 block: int = BLOCK, remote: bool = False) -> float:
    """Bytes the krylov path holds beyond ``Tc`` and ``B`` (module docstring): token columns, block-Jacobi
    inverses (and one block's temporaries while they are made), ``threads`` segment expansions and psi x k
    buffers, four Lanczos bases of ``lanczos_steps`` vectors (``lambda_max`` of ``Gs`` and of ``G``, and the two
    of the preconditioned lower bound), two LOBPCG runs of ``block`` columns (about 20
    psi-vectors per column), the CG vectors (6 per output), the coefficients and the heads step's vectors.
    A numerical null space grows the LOBPCG block (20 psi-vectors per null direction) and adds its basis: not
    counted here (it is not known before the solve). ``remote``: ``Tc`` on the workers, whose tasks expand the
    segments; the client holds one psi x k product buffer."""
    m, psi = n_pairs(d), n_features(d)
    mm = m * (m + 1) // 2
    threads = max(1, os.cpu_count() or 1) if threads is None else int(threads)
    k = max(d_out, 1) + 2 + 2 * block  # columns of one lockstep pass: CG, two Lanczos, two LOBPCG blocks
    vectors = 4 * lanczos_steps + 2 * 20 * block + 6 * max(d_out, 1) + 4 * max(d_out, 1)
    per_thread = psi * k if remote else threads * (2 * m * d * d + psi * k)
    return 8.0 * (mm * d + (d + 3) * m * m + per_thread + psi * vectors)


def fit_memory(d: int, d_out: int, *, solver: str = "auto", large_psi: int | None = None,
               split_every: int = 2, max_tile_bytes: float | None = None, block_rows: int | None = None,
               threads: int = 1, available: float | None = None, remote: bool = False, dense: bool = False,
               heads="svd", n_rows: int | None = None) -> dict:
    """Estimated peak bytes of a fit with token dimension ``d`` and ``d_out`` outputs (``d_out = 0``: a
    certificate, no moments) on the given ``solver`` path.

    Returns a dict: ``psi``, ``path`` ("eigh", "cholesky" or "krylov", :func:`scaleattn.linalg._spectrum.solver_path`;
    with ``available`` bytes, ``solver="auto"`` takes krylov when the dense path it would pick does not fit),
    ``gram_bytes`` (one psi x psi float64 array), ``gram_arrays`` (how many the dense path holds at its peak,
    :data:`SOLVER_ARRAYS`), ``compact_bytes`` (``Tc``), ``solver_bytes`` (the solver
    node's peak: the path's psi x psi arrays, or :func:`krylov_bytes`, plus ``Tc`` twice, as received and
    concatenated, plus ``B``), ``paths`` (``solver_bytes`` of every path), ``worker_bytes`` (one worker's
    peak: ``split_every + 2`` tiles while combining, plus one block of features and the kernel's panels).
    Independent of the number of rows (the build streams them). ``remote``: a cluster fit, whose krylov path
    leaves ``Tc`` on the workers (:mod:`scaleattn.distributed.operator`): its solver node holds no ``Tc``.
    ``dense``: only the dense paths (a ridge needs them; :func:`~scaleattn.linalg._spectrum.solver_path`). ``heads``
    other than ``"svd"`` expand ``G`` and two psi x psi loss factors on the krylov path too; up to
    ``DENSE_GRAM_MAX_PSI`` that path shares one dense ``G`` (with the small-eigenvalue solve's copies).
    ``n_rows`` below psi (the Gram is singular, its null space at least psi - n_rows): the krylov path past
    ``DENSE_GRAM_MAX_PSI`` also holds the LOBPCG blocks that find that null space (:func:`krylov_null_bytes`).
    """
    m, psi, dv = n_pairs(d), n_features(d), n_pairs(d)
    gram = 8.0 * psi * psi
    compact = 8.0 * n_pairs(m) * dv
    moments = 8.0 * psi * max(d_out, 1)
    small = psi <= DENSE_GRAM_MAX_PSI
    dense_g = 6 * gram * small + (3 * gram if heads != "svd" and not remote else 0.0)
    arrays = dict(SOLVER_ARRAYS, cholesky=SOLVER_ARRAYS["cholesky"] + small)  # up to it, the shared G and a copy
    if n_rows is not None and n_rows < psi and not small:
        dense_g += krylov_null_bytes(psi, psi - n_rows)
    paths = {p: (n * gram if p != "krylov" else krylov_bytes(d, d_out, remote=remote) + dense_g) + 2 * compact * (
        p != "krylov" or not remote) + 2 * moments for p, n in arrays.items()}
    path = solver_path(psi, solver, large_psi, fits=None if available is None else (lambda p: paths[p] <= available),
                       dense=dense)
    c0, c1 = tile_bounds(d, None, MAX_TILE_BYTES if max_tile_bytes is None else max_tile_bytes)[0]
    tile = 8.0 * (c1 - c0) * dv
    # one block of features (accumulate sizes it to BLOCK_BYTES; an explicit block_rows at its per-row bytes)
    block = float(BLOCK_BYTES) if block_rows is None else block_rows * block_bytes_per_sample(d, 1, True)
    panels = 8.0 * threads * PANEL_ROWS * PANEL_COLS
    return {"psi": psi, "path": path, "gram_bytes": gram, "gram_arrays": arrays[path], "compact_bytes": compact,
            "solver_bytes": paths[path], "paths": paths,
            "worker_bytes": (max(2, split_every) + 2) * tile + moments * (max(2, split_every) + 2) + block + panels}


def krylov_null_bytes(psi: int, null: int) -> float:
    """Bytes of the krylov path's LOBPCG run when the Gram has ``null`` null directions
    (:func:`scaleattn.linalg._krylov.krylov_solve`): its block grows 4x from 2 columns while it holds only null
    Ritz values, up to a third of the features, so it ends at ``k = min(4 (null + 1), psi / 3)`` columns and
    holds about 12 psi-vectors per column (X, its product, P, R and theirs, the 3k-column basis) plus two 3k x 3k
    projected matrices. At d = 32 with 2,500 rows: 7.6 GB, where the dense Gram is 2.3 GB."""
    k = min(4 * (int(null) + 1), max(int(psi) // 3, 1))
    return 8.0 * (12.0 * k * psi + 2.0 * (3 * k) ** 2)


def chunk_bytes(dataset, targets: bool = True) -> float:
    """Peak bytes a task holds for one chunk of ``dataset``'s rows as read (tokens, lengths, targets as stored,
    and their float64 copies), besides the features of :func:`fit_memory`, plus the cut chunks its process keeps
    for the next row group (:data:`scaleattn.data._dataset.CUT_CHUNKS`, as stored)."""
    T, d = dataset.length, dataset.d
    per = 8.0 * T * d + 8.0 * dataset.has_lengths
    if targets and dataset.has_targets:
        per += 8.0 * dataset.d_out * (T if dataset.causal else 1)
    one = per * min(dataset.chunk_samples, dataset.n_samples)
    return 2 * one + min(CUT_CHUNKS.entries * one, CUT_CHUNKS.max_bytes)


def available_memory(memory_limit=None) -> float:
    """Bytes available to the solver node: ``memory_limit``, else ``$SCALEATTN_MEMORY_LIMIT``, else psutil's
    ``virtual_memory().available``."""
    limit = memory_limit if memory_limit is not None else os.environ.get("SCALEATTN_MEMORY_LIMIT") or None
    if limit is not None:
        return parse_bytes(limit)
    import psutil

    return float(psutil.virtual_memory().available)


def small_workers(client, need: float) -> tuple[list[float], int]:
    """The memory limits (bytes) of the ``client``'s workers that are set but below ``need``, and the number of
    workers: what a per-worker refusal reports."""
    limits = [w.get("memory_limit") or 0 for w in client.scheduler_info().get("workers", {}).values()]
    return [lim for lim in limits if 0 < lim < need], len(limits)


def check_fit_memory(d: int, d_out: int, *, client=None, memory_limit=None, what: str = "fit",
                     chunk_bytes: float = 0.0, **kwargs) -> dict:
    """Refuse a fit (``what="fit"``) or certificate (``what="certificate"``, ``d_out = 0``) that cannot fit
    before it starts; return :func:`fit_memory`'s estimate (``kwargs``: its solver path and layout) when it can.
    Its ``path`` is the solver to use: with ``solver="auto"`` the krylov path when the dense one does not fit in
    the memory available.

    The solver node (this process) must have ``solver_bytes`` available; with a Dask ``client``, every worker
    with a memory limit must allow ``worker_bytes`` plus ``chunk_bytes`` (one chunk of the dataset as read,
    :func:`chunk_bytes`); without one, this process must hold that chunk too.

    Raises
    ------
    InsufficientMemoryError
        (a ``MemoryError`` and a ``ValueError``) with the memory needed, the memory there is, and the size of
        machine or worker it takes.
    """
    have = available_memory(memory_limit)
    # without a cluster this process also builds the statistics: "auto" must leave room for that
    reserve = fit_memory(d, d_out, **kwargs)["worker_bytes"] + chunk_bytes if client is None else 0.0
    est = fit_memory(d, d_out, available=have - reserve, remote=client is not None, **kwargs)
    est["worker_bytes"] += chunk_bytes
    need = est["solver_bytes"]
    task = est["worker_bytes"] + (need if client is None else 0)  # without a cluster this process does both
    if chunk_bytes > est["worker_bytes"] / 2 and (chunk_bytes > have or (client is None and task > have >= need)):
        raise InsufficientMemoryError(
            f"one chunk of the dataset takes {chunk_bytes / GIB:.2f} GiB to read (a task needs"
            f" {est['worker_bytes'] / GIB:.2f} GiB with its features); this machine has {have / GIB:.2f} GiB"
            " available. Rewrite the dataset with smaller chunks (write_dataset(chunk_samples=...), or scaleattn"
            " import) or use a machine with more memory.")
    alt = est["paths"]["krylov"] + task - need  # the same work on the krylov path (no psi x psi array)
    hint = f", or `solver='krylov'` ({alt / GIB:.2f} GiB)" if est["path"] != "krylov" and alt <= have else ""
    if client is None and task > have >= need:
        raise InsufficientMemoryError(
            f"a {what} with d = {d} ({est['path']} solver) needs {task / GIB:.2f} GiB in this process (statistics,"
            f" one block of features and the solver); this machine has {have / GIB:.2f} GiB available. Use a"
            f" machine with more memory{hint}.")
    if need > have:
        parts = (f"{est['gram_arrays']} x {est['gram_bytes'] / GIB:.2f} GiB psi x psi arrays + statistics"
                 if est["path"] != "krylov" else "preconditioner and Krylov vectors" if client is not None else
                 f"compact Gram {est['compact_bytes'] / GIB:.2f} GiB twice + preconditioner and Krylov vectors")
        rows = kwargs.get("n_rows")
        if est["path"] == "krylov" and rows is not None and rows < est["psi"]:
            parts += (f", and the eigen-blocks for a null space of at least {est['psi'] - rows:,} directions"
                      f" ({rows:,} rows, fewer than the features)")
            hint += ", or `solver='stream'` (the dual: an N x N kernel)"
        raise InsufficientMemoryError(
            f"a {what} with d = {d} (psi = {est['psi']:,}, {est['path']} solver) needs {need / GIB:.1f} GiB on the"
            f" solver node ({parts}); this machine has {have / GIB:.1f} GiB available. Run it on a machine with at"
            f" least {1.25 * need / GIB:.0f} GiB of memory{hint}, or use a smaller d.")
    if client is not None:
        small, n_workers = small_workers(client, est["worker_bytes"])
        if small:
            big_chunk = chunk_bytes > est["worker_bytes"] / 2
            why = (f"one chunk of the dataset takes {chunk_bytes / GIB:.2f} GiB to read" if big_chunk else
                   "compact Gram tile partials while combining")
            fix = ("; or rewrite the dataset with smaller chunks (write_dataset(chunk_samples=...))" if big_chunk
                   else ", or smaller tiles")
            raise InsufficientMemoryError(
                f"a {what} with d = {d} needs {est['worker_bytes'] / GIB:.2f} GiB per worker ({why}); {len(small)} of"
                f" {n_workers} workers have only {min(small) / GIB:.2f} GiB. Use workers with at least"
                f" {1.25 * est['worker_bytes'] / GIB:.1f} GiB (fewer workers per machine){fix}.")
    est["available_bytes"] = have
    return est


def fit_route(solver: str, n_rows: int, d: int, d_out: int, *, heads="svd", ridge: float = 0.0, client=None,
              chunk_bytes: float = 0.0) -> tuple[str | None, str]:
    """:func:`scaleattn.linalg._stream.fit_path` with the Gram route's memory: memory first (the Gram route's
    refusal by :func:`check_fit_memory`, if any, sends ``"auto"`` to the streaming path when that fits), then
    the cost model (:func:`scaleattn.linalg._stream.route_seconds`, the Gram route's solver dense or krylov as
    :func:`fit_memory` would choose). Returns ``(path or None, reason)``."""
    have = available_memory()
    refusal, dense = None, True
    if solver == "auto":
        try:
            est = check_fit_memory(d, d_out, client=client, solver="auto", chunk_bytes=chunk_bytes, dense=ridge > 0,
                                   heads=heads, n_rows=n_rows)
            dense = est["path"] != "krylov"
        except InsufficientMemoryError as e:
            refusal = str(e).split(";")[0]
    return fit_path(solver, n_rows, d, d_out, heads=heads, ridge=ridge, available=have, gram_refusal=refusal,
                    gram_dense=dense, extra_bytes=chunk_bytes)
