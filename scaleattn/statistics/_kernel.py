"""The compact-Gram kernel ``Tc += u^T v`` (DESIGN §3) and its thread and BLAS machinery (layer L2).

On numpy, each (panel_rows, panel_cols) panel of ``u = vech(s s^T)`` is built in a cache-sized buffer and
accumulated with one GEMM into its slice of ``Tc``; groups of panels (disjoint rows of ``Tc``) run on a thread
pool with every BLAS call on one thread, under one process-wide lock, so the bits do not depend on the thread or
BLAS thread count. Other array API namespaces (CuPy, torch, ``array_api_strict``): :func:`_gram_update_xp`.

Two kernels compute the same sums on numpy (to 1e-14 relative; each gives the same bits for any thread count):
``"numba"`` (the default, :mod:`scaleattn.statistics._compiled`: features, ``u`` and the moments formed in
cache-sized buffers by compiled loops) and ``"numpy"`` (the array code above). Choose with the environment
variable ``SCALEATTN_KERNEL=numpy|numba`` or the module switch :data:`KERNEL`; :func:`kernel_name` says which.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import threading

import numpy as np

from .._backend import device_of, get_xp, is_numpy, on_accelerator
from ..errors import ParameterError
from ..features import expand_compact_gram, n_features, n_pairs, pair_products
from . import _compiled as _kernel_compiled

__all__ = ["gram_update", "fused_update", "expand_gram", "one_blas_thread", "kernel_name", "KERNEL", "KERNELS",
           "KERNEL_REVISIONS", "BLAS_MIN_D", "PANEL_ROWS", "PANEL_COLS", "DEVICE_PANEL_BYTES", "EXPAND_PAIRS",
           "device_panel_cols"]

#: the statistics kernels (:func:`kernel_name`)
KERNELS = ("numba", "numpy")
#: the arithmetic of each kernel: a checkpoint records it and a resume needs the same, since partials of another
#: revision differ from this build's in the last bits. numba 2: the micro-kernel at the host's full vector width
#: (:func:`scaleattn._jit.wide_vectors`), in 4 x 4 register blocks on 32-register hosts and 4 x 2 on 16-register
#: ones (the same sums to 1e-14; the bits are the host's, as the vector width is:
#: tests/statistics/test_kernel_compiled.py); 1: 4 x 2 blocks at 256 bits everywhere
KERNEL_REVISIONS = {"numba": 2, "numpy": 1}
#: module switch: ``"numba"``, ``"numpy"``, or None (then ``$SCALEATTN_KERNEL``, default ``"numba"``)
KERNEL: str | None = None
#: from this token dimension on, the numba kernel's ``Tc += u^T v`` is the BLAS GEMM of the numpy kernel (its
#: features and moments stay compiled): the GEMM's packing beats the compiled micro-kernel once v is wide
#: (measured: d = 12 compiled 1.3 s vs 1.7 s, d = 16 3.9 s vs 3.5 s on 2 shared cores)
BLAS_MIN_D = 14


def kernel_name(xp=np, kernel: str | None = None) -> str:
    """The kernel that builds statistics of ``xp`` arrays: ``kernel`` if given, else :data:`KERNEL`, else
    ``$SCALEATTN_KERNEL``, else ``"numba"``; always ``"numpy"`` (the array path) for any namespace but numpy's
    (CuPy, torch, ...).

    Raises
    ------
    ParameterError
        A name not in :data:`KERNELS`.

    Examples
    --------
    >>> kernel_name(kernel="numpy")
    'numpy'
    """
    name = kernel or KERNEL or os.environ.get("SCALEATTN_KERNEL") or "numba"
    if name not in KERNELS:
        raise ParameterError(f"kernel must be one of {', '.join(map(repr, KERNELS))} (SCALEATTN_KERNEL), got {name!r}")
    return name if is_numpy(xp) else "numpy"  # numpy itself, or array_api_compat's wrapper on numpy < 2.1

#: the numpy Gram kernel's u panels, one BLAS GEMM each into a slice of Tc (:func:`gram_update`): 1024 x 256
#: measured fastest on 2 cores (the GEMM's K = 1024 amortises the packing of v)
PANEL_ROWS = 1024
PANEL_COLS = 256
#: bytes of one ``u`` panel on a device (CuPy, torch): measured on an H200 at d = 8 to 32, 0.25 GB to 4 GB
#: panels were within 15 % of each other and 1 GB the best or near it
DEVICE_PANEL_BYTES = 1e9
#: below this many multiply-adds per call the kernel runs on one thread (handing work to a thread would dominate)
MIN_THREAD_MACS = 50_000_000
#: work groups per kernel thread (dynamic balance vs. cache reuse across the panels of a group)
GROUPS_PER_THREAD = 2


def _gemm_acc(c, a, b) -> None:
    """``c += a^T @ b`` in place (numpy). numpy's matmul releases the GIL, so the panels of
    :func:`gram_update` run in parallel threads (scipy's f2py ``dgemm`` with ``beta = 1`` holds the GIL and
    measured 2x slower on 2 cores); the temporary is one panel of ``c`` (panel_cols x d(d+1)/2)."""
    c += a.T @ b


#: the BLAS thread count saved while a kernel call holds BLAS at one thread (read by other callers meanwhile)
_LIMITED: int | None = None


def _blas_threads() -> int:
    """This process's BLAS thread count (the kernel's default thread count for numpy input).

    Dask workers run one BLAS thread (``threads_per_worker = 1``); a single process uses all its cores."""
    if _LIMITED is not None:
        return _LIMITED
    return max([int(c.num_threads or 1) for c in _blas_controller().lib_controllers] or [1])


@functools.lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl controller of the loaded BLAS libraries (numpy's and scipy's), made once (a scan is slow)."""
    import scipy.linalg.blas  # noqa: F401  (load scipy's BLAS before the scan)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


#: one numpy kernel call at a time per process: the BLAS thread limit is process-wide, so concurrent callers
#: would restore each other's settings out of order; calls made from inside a kernel thread run inline
_KERNEL_LOCK = threading.Lock()
_IN_KERNEL = threading.local()


@functools.lru_cache(maxsize=1)
def _pool():
    """The kernel's persistent helper threads (one fewer than the cores; made once, not per block)."""
    return concurrent.futures.ThreadPoolExecutor(max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="scaleattn-gram")


def _after_fork_in_child() -> None:  # a forked child has neither the parent's threads nor its lock holder
    global _KERNEL_LOCK, _LIMITED
    _KERNEL_LOCK, _LIMITED = threading.Lock(), None
    _pool.cache_clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def one_blas_thread():
    """Run the block with numpy's BLAS on one thread, under the kernel's process-wide lock (as the kernel's own
    calls): LAPACK factorisations (the QR of :mod:`scaleattn.linalg._qr`) then give the same bits for any BLAS thread
    count, i.e. in process and on single-threaded Dask workers, and never oversubscribe a loaded machine
    (measured: a 6,000 x 296 QR in 0.26 s on one thread, 6.2 s on two busy cores). A no-op where BLAS already
    runs one thread.

    Examples
    --------
    >>> import numpy as np
    >>> with one_blas_thread():
    ...     r = np.linalg.qr(np.ones((4, 2)), mode="r")
    >>> r.shape
    (2, 2)
    """
    global _LIMITED
    if getattr(_IN_KERNEL, "active", False) or _blas_threads() == 1:
        yield
        return
    with _KERNEL_LOCK:
        _LIMITED = _blas_threads()
        try:
            with _blas_controller().limit(limits=1):
                yield
        finally:
            _LIMITED = None


def gram_update(gram, s, x, cols: slice | None = None, *, threads: int | None = None, panel_rows: int | None = None,
                panel_cols: int | None = None, extra=(), kernel: str | None = None):
    """The compact-Gram kernel: ``gram += u[:, cols]^T v`` with ``u = vech(s s^T)``, ``v = vech(x x^T)``
    (DESIGN §3), in place; returns ``gram``.

    Parameters
    ----------
    gram : array (width, d(d+1)/2) float64
        Rows ``cols`` of ``Tc`` (all of ``Tc``, (m(m+1)/2, d(d+1)/2), when ``cols`` is None); numpy or any
        array API array (CuPy, torch, ...).
    s : array (rows, m) float64; x : array (rows, d) float64
        From :func:`~scaleattn.features.token_features`, same namespace and device as ``gram``.
    cols : slice, optional
        Step-1 column range of ``u`` (a column tile of ``Tc``, DESIGN §6).
    threads : int, optional
        numpy only (default: this process's BLAS thread count). Groups of panels (disjoint rows of ``gram``) are
        taken by whichever thread is free; every BLAS call runs on one thread. Each entry of ``gram`` is summed by
        one thread in a fixed order, so the bits do not depend on ``threads`` or on the BLAS thread count.
    panel_rows, panel_cols : int, optional
        ``u`` panel, built in a buffer, one GEMM each: numpy :data:`PANEL_ROWS` x :data:`PANEL_COLS` (cache-sized);
        on an accelerator all rows x :func:`device_panel_cols` (:func:`_gram_update_xp`)
    extra : sequence of (multiply-adds, callable)
        Other work on the same rows (the moments update), run once each in the same threads.
    kernel : {"numba", "numpy"}, optional
        :func:`kernel_name` (default: :data:`KERNEL` or ``$SCALEATTN_KERNEL``, else numba; numpy for CuPy).
        ``"numba"`` streams ``s`` and ``x`` through :func:`scaleattn.statistics._compiled.tc_panel` in panels of
        :data:`scaleattn.statistics._compiled.PANEL_COLS` columns (an F-ordered ``s``, ``x`` is read in place);
        from ``d = BLAS_MIN_D`` on, both run the BLAS panels (same bits for the same ``s``, ``x``), the numba
        kernel's ``u`` panels formed by :func:`scaleattn.statistics._compiled.u_panel` (3.5x faster than numpy's).

    Raises
    ------
    ValueError
        ``gram`` has the wrong number of rows for ``cols``. An exception in any job is re-raised here, after
        every thread has stopped.

    Multiply-adds: ``rows * width * d(d+1)/2``; extra memory: one panel per thread.
    """
    xp = get_xp(gram, s, x)
    if not is_numpy(xp):
        return _gram_update_xp(xp, gram, s, x, cols, panel_rows, panel_cols, extra)
    mm = n_pairs(s.shape[1])
    c0, c1, _ = (slice(0, mm) if cols is None else cols).indices(mm)
    if gram.shape[0] != c1 - c0:
        raise ValueError(f"gram has {gram.shape[0]} rows but the column range [{c0}, {c1}) has {c1 - c0}")
    rows = s.shape[0]
    compiled_u = kernel_name(xp, kernel) == "numba"
    if compiled_u and x.shape[1] < BLAS_MIN_D:
        return _gram_update_compiled(gram, s, x, c0, c1, threads, extra)
    panel_rows = max(1, min(int(PANEL_ROWS if panel_rows is None else panel_rows), rows))
    panel_cols = max(1, min(int(PANEL_COLS if panel_cols is None else panel_cols), c1 - c0))
    v = pair_products(x)  # vech(x x^T), (rows, d(d+1)/2), C-contiguous
    sT = xp.ascontiguousarray(s.T, dtype=xp.float64)  # (m, rows): u panels are built column-major, one contiguous
    # run per pair; the numba kernel forms them compiled (the same products, so the same bits as pair_products)
    pq = _kernel_compiled.pair_columns(sT.shape[0], c0, c1) if compiled_u else None
    jobs = [(cost, ("call", f)) for cost, f in extra]
    jobs += [(rows * (b - a) * v.shape[1], ("panel", (a, b)))
             for a, b in ((a, min(c1, a + panel_cols)) for a in range(c0, c1, panel_cols))]

    def run_group(group, buf):
        panels = [job for kind, job in group if kind == "panel"]
        for r in range(0, rows, panel_rows):  # rows outer: this chunk of s and v stays in cache across panels
            sr = sT[:, r : r + panel_rows].T  # (rows', m) view, columns contiguous
            for a, b in panels:
                out = buf[: sr.shape[0] * (b - a)].reshape(b - a, sr.shape[0])  # its .T: (rows', width), F-ordered
                if compiled_u:
                    _kernel_compiled.u_panel(out, sT, pq[0][a - c0 : b - c0], pq[1][a - c0 : b - c0], r)
                else:
                    pair_products(sr, slice(a, b), out.T)
                _gemm_acc(gram[a - c0 : b - c0], out.T, v[r : r + panel_rows])
        for kind, job in group:
            if kind == "call":
                job()

    if getattr(_IN_KERNEL, "active", False) or (_blas_threads() == 1 and (threads or 1) <= 1):
        # a call from a kernel thread (BLAS already at one thread), or nothing to share or limit
        run_group([job for _, job in jobs], xp.empty(panel_rows * panel_cols))
        return gram
    with _KERNEL_LOCK:
        total = sum(c for c, _ in jobs)
        n = _blas_threads() if threads is None else int(threads)
        n = max(1, min(n, len(jobs), total // max(MIN_THREAD_MACS, 1) + 1))
        _run_shared(_groups(jobs, n * GROUPS_PER_THREAD if n > 1 else 1), run_group, n, panel_rows * panel_cols)
    return gram


def _gram_update_xp(xp, gram, s, x, cols, panel_rows, panel_cols, extra):
    """:func:`gram_update` in a non-numpy array API namespace: ``u`` panels built into one reused buffer, one
    ``matmul`` each (DESIGN §3); on an accelerator of all rows x :func:`device_panel_cols`, since a device pays per
    launch, not per cache miss (measured: docs/performance.md, "GPU"); else the host's cache-sized panels."""
    mm = n_pairs(s.shape[1])
    c0, c1, _ = (slice(0, mm) if cols is None else cols).indices(mm)
    if gram.shape[0] != c1 - c0:
        raise ValueError(f"gram has {gram.shape[0]} rows but the column range [{c0}, {c1}) has {c1 - c0}")
    rows, big = s.shape[0], on_accelerator(s)
    panel_rows = max(1, min(int(panel_rows or (rows if big else PANEL_ROWS)), rows))
    panel_cols = max(1, min(int(panel_cols or (device_panel_cols(panel_rows) if big else PANEL_COLS)), c1 - c0))
    v = pair_products(x)  # vech(x x^T), (rows, d(d+1)/2)
    buf = xp.empty((panel_rows, panel_cols), dtype=xp.float64, device=device_of(s))  # reused by every panel
    for r, r1 in ((r, min(r + panel_rows, rows)) for r in range(0, rows, panel_rows)):  # (in-bounds stops)
        sr, vr = s[r:r1, :], v[r:r1, :]
        for a, b in ((a, min(c1, a + panel_cols)) for a in range(c0, c1, panel_cols)):
            gram[a - c0 : b - c0, :] += xp.matmul(pair_products(sr, slice(a, b), out=buf).T, vr)
    for _, job in extra:
        job()
    return gram


def device_panel_cols(rows: int) -> int:
    """Columns of a ``u`` panel of ``rows`` rows on an accelerator: about :data:`DEVICE_PANEL_BYTES`."""
    return max(1, int(DEVICE_PANEL_BYTES // (8 * max(rows, 1))))


def _gram_update_compiled(gram, s, x, c0: int, c1: int, threads, extra):
    """The ``"numba"`` branch of :func:`gram_update`: one job per fixed panel of columns and, with few panels,
    per fixed row piece (:func:`scaleattn.statistics._compiled.row_pieces`; pieces summed apart and added in
    order), so each entry's sums depend on the shapes only, never on the grouping or the thread count."""
    kc = _kernel_compiled
    sT, xT = np.ascontiguousarray(s.T), np.ascontiguousarray(x.T)  # free for the F-ordered s, x of features_t
    nv, w = xT.shape[0] * (xT.shape[0] + 1) // 2, kc.PANEL_COLS
    out = gram if gram.flags.c_contiguous and gram.dtype == np.float64 else np.ascontiguousarray(gram, np.float64)
    panels = [(a, min(c1, a + w)) for a in range(c0, c1, w)]
    pieces = kc.row_pieces(sT.shape[1], len(panels))
    parts = [[out[a - c0 : b - c0]] if len(pieces) == 1 else [np.zeros((b - a, nv)) for _ in pieces]
             for a, b in panels]
    jobs = [(cost, f) for cost, f in extra]
    jobs += [((hi - lo) * (b - a) * nv, functools.partial(kc.tc_panel, part, sT, xT, a, b, (lo, hi)))
             for (a, b), ps in zip(panels, parts) for (lo, hi), part in zip(pieces, ps)]
    if getattr(_IN_KERNEL, "active", False) or (threads or _blas_threads()) <= 1:
        _call_all([f for _, f in jobs], None)
    else:
        with _KERNEL_LOCK:
            total = sum(c for c, _ in jobs)
            n = _blas_threads() if threads is None else int(threads)
            n = max(1, min(n, len(jobs), total // max(MIN_THREAD_MACS, 1) + 1))
            _run_shared(_groups(jobs, n * GROUPS_PER_THREAD if n > 1 else 1), _call_all, n, 1)
    if len(pieces) > 1:
        for (a, b), ps in zip(panels, parts):
            for part in ps:  # in piece order
                out[a - c0 : b - c0] += part
    if out is not gram:
        gram[...] = out
    return gram


#: bytes from the start of one thread's partial sums to the next: whole pages, so that no cache line (nor the
#: pair of lines the adjacent-line prefetcher moves together) is written by two kernel threads. The fused pass
#: adds into its piece's partial once per chunk of rows; two threads whose partials were allocated side by side
#: ran at 1.5x (d = 4) and 1.7x (d = 8) one thread's rate, 1.85x and 1.99x page-aligned (2 Emerald Rapids
#: vCPUs; in the build's own allocation order the difference was within the VM's noise). Alignment changes no
#: sum, so not the bits
PARTIAL_ALIGN = 4096


def _private_zeros(shapes) -> list[np.ndarray]:
    """Zeroed float64 arrays of the given shapes, each starting on its own :data:`PARTIAL_ALIGN` boundary of one
    buffer: partial sums that different threads update in place without sharing a cache line (false sharing).

    Examples
    --------
    >>> a, b = _private_zeros([(3, 2), (5,)])
    >>> a.shape, b.shape, a.ctypes.data % PARTIAL_ALIGN, b.ctypes.data % PARTIAL_ALIGN, float(a.sum() + b.sum())
    ((3, 2), (5,), 0, 0, 0.0)
    """
    step = PARTIAL_ALIGN // 8
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    buf = np.zeros(sum(-(-n // step) * step for n in sizes) + step)
    at = (-(buf.ctypes.data // 8)) % step
    out = []
    for shape, n in zip(shapes, sizes):
        out.append(buf[at : at + n].reshape(shape))
        at += -(-n // step) * step
    return out


def fused_update(gram, moments, tokens, targets=None, lengths=None, causal: bool = False, cols: slice | None = None,
                 threads: int | None = None) -> tuple[float, int]:
    """The ``"numba"`` kernel's whole statistics of a block of samples in one pass over its tokens (d <
    :data:`BLAS_MIN_D`): ``gram += Tc[cols]``, ``moments += B`` (when ``targets`` is given) in place; returns
    ``(sum y^2, rows)``.

    The samples are cut into pieces (:func:`scaleattn.statistics._compiled.sample_pieces`, whole samples, a function
    of the shapes and lengths only); each piece forms its own features chunk by chunk (the causal prefix sum restarts
    per sample) and sums ``Tc`` and ``B`` into its own partial (:func:`scaleattn.statistics._compiled.piece_stats`), on
    this kernel's threads; the partials are added in piece order, so the bits do not depend on ``threads``, nor (pieces
    of the whole ``Tc``) on ``cols`` or on whether ``targets`` are given. ``tokens`` (n, T, d), ``targets`` (n, d_out)
    or causal (n, T, d_out), ``lengths`` (n,) as in :func:`scaleattn.statistics._container.accumulate` (numpy).
    """
    kc = _kernel_compiled
    z = _float_input(tokens)
    n, T, d = z.shape
    lens = np.full(n, T, dtype=np.int64) if lengths is None else np.clip(np.asarray(lengths, np.int64), 0, T)
    if targets is None:
        tg = np.zeros((n, 1, 0))
    else:
        tg = _float_input(targets)
        tg = tg if causal else tg[:, None, :]
    m, k_out = n_pairs(d), tg.shape[2]
    c0, c1, _ = (slice(0, n_pairs(m)) if cols is None else cols).indices(n_pairs(m))
    if gram.shape[0] != c1 - c0:
        raise ValueError(f"gram has {gram.shape[0]} rows but the column range [{c0}, {c1}) has {c1 - c0}")
    w, nb = c1 - c0, d * k_out
    shape_tc, shape_mom = (w + (-w) % 4, m + m % 2), (nb + (-nb) % 4, m + m % 2)
    rows = lens if causal else np.ones(n, dtype=np.int64)
    # the pieces of the whole Tc, with or without targets (a tile, or Tc built without B, has the same bits as the
    # full build); a last-token row reads all of its sample's tokens, so their cost counts too
    mm, per_token = n_pairs(m), kc.TOKEN_MACS * (m + d)
    pieces = kc.sample_pieces(rows, mm * m, 8.0 * (mm + 3) * (m + 1), None if causal else lens, per_token)
    sums = _private_zeros([shape for _ in pieces for shape in (shape_tc, shape_mom)])
    parts = [(sums[2 * i], sums[2 * i + 1], [0.0]) for i in range(len(pieces))]

    def job(i0, i1, tc, mom, yy):
        yy[0] = kc.piece_stats(z, lens, tg, causal, i0, i1, c0, c1, tc, mom)

    jobs = [(int(rows[i0:i1].sum()) * (w * m + m * nb) + (0 if causal else int(lens[i0:i1].sum()) * per_token),
             functools.partial(job, i0, i1, *part))
            for (i0, i1), part in zip(pieces, parts)]
    small = sum(c for c, _ in jobs) < MIN_THREAD_MACS
    if getattr(_IN_KERNEL, "active", False) or (threads or _blas_threads()) <= 1 or len(jobs) == 1 or small:
        _call_all([f for _, f in jobs], None)
    else:
        with _KERNEL_LOCK:
            nt = _blas_threads() if threads is None else int(threads)
            nt = max(1, min(nt, len(jobs)))
            _run_shared(_groups(jobs, len(jobs)), _call_all, nt, 1)
    yy = 0.0
    for tc, mom, y2 in parts:  # in piece order
        gram += tc[:w, :m]
        if k_out:
            moments += mom[:nb, :m].T.reshape(m * d, k_out)
        yy += y2[0]
    return yy, int(rows.sum())


def _float_input(a):
    """``a`` as the compiled pass reads it: float32 and float64 arrays as they are, in any strides (the pass
    converts each value to float64 as it gathers it, exactly as a cast would; a copy here would be a serial pass
    over the block before the threads start: 0.026 s per 500k causal rows of make_mhla's T-major targets),
    any other dtype cast to float64."""
    a = np.asarray(a)
    return a if a.dtype in (np.float32, np.float64) else a.astype(np.float64)


#: pairs ``P`` (row groups of ``d`` rows of ``G``) per job of :func:`expand_gram`
EXPAND_PAIRS = 16
#: below this psi :func:`expand_gram` takes numpy's gather: as fast there (4.5 ms at psi 936, against 2.7-4.2
#: ms compiled), and a process that has not run the compiled kernels yet (a fit's client, whose workers built the
#: statistics) does not load numba for it (0.55 s: the solve of a psi-6 fit took 1 s on a cluster, 0.00 s in
#: process)
EXPAND_COMPILED_MIN_PSI = 1000


def expand_gram(gram_compact, d: int, *, threads: int | None = None, kernel: str | None = None, out=None):
    """The feature Gram ``G`` (psi, psi) from the compact ``Tc``: :func:`scaleattn.features.expand_compact_gram`,
    on numpy with the ``"numba"`` kernel (:func:`kernel_name`) from psi :data:`EXPAND_COMPILED_MIN_PSI` on by the
    compiled copy (:func:`scaleattn.statistics._compiled.expand_rows`) into one new C-ordered array (or into ``out``, a
    C-contiguous (psi, psi) float64 array, e.g. memory already touched: a fresh 2.3 GB array costs this VM 1-4 s
    of page faults), jobs of :data:`EXPAND_PAIRS` row groups on the kernel's threads (``threads``, default the
    BLAS thread count). The same bits either way (a copy); the compiled one runs at memory speed (measured at
    d = 32, 2.3 GB: about 1.2 s on one thread of 2 shared cores, the array-API gather 7.8 s)."""
    xp = get_xp(gram_compact)
    m, psi = n_pairs(d), n_features(d)
    if out is not None and (not is_numpy(xp) or out.shape != (psi, psi) or out.dtype != np.float64
                            or not out.flags.c_contiguous):
        raise ParameterError(f"expand_gram: out must be a C-contiguous ({psi}, {psi}) float64 numpy array")
    if not is_numpy(xp) or kernel_name(xp, kernel) != "numba" or psi < EXPAND_COMPILED_MIN_PSI:
        G = expand_compact_gram(gram_compact, d)
        if out is None:
            return G
        out[...] = G
        return out
    tc = np.ascontiguousarray(gram_compact, dtype=np.float64)
    G = np.empty((psi, psi)) if out is None else out
    jobs = [((min(p + EXPAND_PAIRS, m) - p) * d * psi,
             functools.partial(_kernel_compiled.expand_rows, tc, d, G, p, min(p + EXPAND_PAIRS, m)))
            for p in range(0, m, EXPAND_PAIRS)]
    n = _blas_threads() if threads is None else int(threads)
    if getattr(_IN_KERNEL, "active", False) or n <= 1 or len(jobs) == 1:
        _call_all([f for _, f in jobs], None)
    else:
        with _KERNEL_LOCK:
            _run_shared(_groups(jobs, len(jobs)), _call_all, min(n, len(jobs)), 1)
    return G


def _call_all(group, buf) -> None:
    """Run every job (a callable) of a group (``buf`` unused: the compiled jobs keep their own buffers)."""
    for f in group:
        f()


def _groups(jobs, k: int) -> list[list]:
    """``jobs`` ((cost, job) pairs) cut into at most ``k`` contiguous groups of about equal cost."""
    total = sum(c for c, _ in jobs)
    groups, done = [[]], 0
    for cost, job in jobs:
        if len(groups) < k and done >= total * len(groups) / k:
            groups.append([])
        groups[-1].append(job)
        done += cost
    return groups


def _run_shared(groups, run_group, n: int, buf_size: int) -> None:
    """``run_group(group, buf)`` for every group on ``n`` threads (this one and ``n - 1`` pool helpers), each
    taking the next group when free, every BLAS call on one thread (so the bits do not depend on ``n``). Returns
    or raises only once every helper has stopped; after a failure the others take no further group."""
    global _LIMITED
    todo, lock, failed = iter(groups), threading.Lock(), threading.Event()

    def run():
        _IN_KERNEL.active = True
        buf = np.empty(buf_size)
        try:
            while not failed.is_set():
                with lock:
                    group = next(todo, None)
                if group is None:
                    return
                run_group(group, buf)
        except BaseException:
            failed.set()
            raise
        finally:
            _IN_KERNEL.active = False

    _LIMITED = _blas_threads()
    try:
        with _blas_controller().limit(limits=1):
            futs = [_pool().submit(run) for _ in range(n - 1)]
            try:
                run()
            finally:  # never return or raise while a helper still writes
                for f in futs:
                    f.cancel()  # a helper that never started finds no work left
                concurrent.futures.wait(futs)
    finally:
        _LIMITED = None
    for f in futs:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
