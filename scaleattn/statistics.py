"""Sufficient statistics of MHLA least squares: compact Gram, B, yy, N (DESIGN §3).

``G = sum phi phi^T`` (kept compact as ``Tc``), ``B = sum phi y^T``, ``yy = sum ||y||^2`` and the row count
``N`` determine every least-squares quantity ([Y25] Alg. 1 needs only these). They form a commutative
monoid: add across chunks, files and machines; save, load and merge them. ``G`` does not depend on the
targets, so one ``Tc`` serves any number of target sets (and the certificate needs nothing else).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import threading
import time

import numpy as np

from . import _storage
from ._backend import get_xp, to_numpy
from .features import expand_compact_gram, n_features, n_pairs, pair_products, row_targets, token_features

FORMAT = "scaleattn-statistics"
FORMAT_VERSION = 1
#: bytes of features per block of :func:`accumulate` (:func:`block_bytes_per_sample`): large blocks amortise the
#: kernel's per-call work, small ones bound memory (32 MB: about 7,000 causal rows at d = 16)
BLOCK_BYTES = 32e6
#: the Gram kernel forms u in (PANEL_ROWS, PANEL_COLS) panels and accumulates each with one BLAS GEMM into its
#: slice of Tc (:func:`gram_update`); 1024 x 256 measured fastest on 2 cores (the GEMM's K = 1024 amortises the
#: packing of v)
PANEL_ROWS = 1024
PANEL_COLS = 256
#: below this many multiply-adds per call the kernel runs on one thread (handing work to a thread would dominate)
MIN_THREAD_MACS = 50_000_000
#: work groups per kernel thread (dynamic balance vs. cache reuse across the panels of a group)
GROUPS_PER_THREAD = 2


@dataclasses.dataclass
class Statistics:
    """Sufficient statistics of a dataset (float64).

    Attributes
    ----------
    gram_compact : array (m(m+1)/2, d(d+1)/2)
        ``Tc = sum_i vech(s_i s_i^T) vech(x_i x_i^T)^T`` with ``m = d(d+1)/2`` (DESIGN §3).
    moments : array (psi, d_out)
        ``B = sum_i phi_i y_i^T``; ``d_out = 0`` when built without targets.
    yy : float
        ``sum_i ||y_i||^2``.
    n_rows : int
        Number of rows (samples, or prefixes in causal mode).
    d : int
        Token dimension.
    """

    gram_compact: np.ndarray
    moments: np.ndarray
    yy: float
    n_rows: int
    d: int

    @classmethod
    def zeros(cls, d: int, d_out: int = 0, xp=np) -> "Statistics":
        m = n_pairs(d)
        return cls(xp.zeros((m * (m + 1) // 2, d * (d + 1) // 2)), xp.zeros((n_features(d), d_out)), 0.0, 0, d)

    @property
    def d_out(self) -> int:
        return int(self.moments.shape[1])

    @property
    def psi(self) -> int:
        return n_features(self.d)

    def __add__(self, other: "Statistics") -> "Statistics":
        if (self.d, self.d_out) != (other.d, other.d_out):
            raise ValueError(f"cannot add statistics of (d, d_out) = {(self.d, self.d_out)} and {(other.d, other.d_out)}")
        return Statistics(self.gram_compact + other.gram_compact, self.moments + other.moments,
                          self.yy + other.yy, self.n_rows + other.n_rows, self.d)

    def gram(self):
        """The feature Gram ``G = sum phi phi^T`` (psi, psi), expanded from the compact form."""
        return expand_compact_gram(self.gram_compact, self.d)

    def second_moment(self):
        """``Lambda_D = G / N`` (psi, psi): the uncentred second moment of the features ([Y25] Lemma 2.3)."""
        return self.gram() / max(self.n_rows, 1)

    def sse(self, coef, gram=None) -> float:
        """Sum of squared residuals of ``coef`` (psi, d_out): ``yy - 2 tr(c^T B) + tr(c^T G c)``, no data pass.

        Its round-off floor is about ``eps * yy``; use a data pass (``evaluate``) for errors far below it.
        """
        G = self.gram() if gram is None else gram
        c = np.asarray(coef)
        return float(self.yy - 2 * np.sum(c * self.moments) + np.sum(c * (G @ c)))

    @property
    def target_mean_square(self) -> float:
        """Mean of ``y^2`` over rows and outputs."""
        return self.yy / max(self.n_rows * self.d_out, 1)

    def to_numpy(self) -> "Statistics":
        return Statistics(to_numpy(self.gram_compact), to_numpy(self.moments), float(self.yy), int(self.n_rows), self.d)

    # ---- storage -------------------------------------------------------------------------------------
    def save(self, url, overwrite: bool = False, storage_options=None, attrs=None) -> None:
        """Write to a Zarr v3 group (atomically): arrays ``gram_compact``, ``moments``; ``yy``, ``n_rows``, ``d``
        in the attributes. Reload with :meth:`load`; merge with ``+``."""
        s = self.to_numpy()
        with _storage.atomic_output(url, overwrite, storage_options) as tmp:
            g = _storage.open_group(tmp, "w", storage_options)
            g.attrs.update({**(attrs or {}), "format": FORMAT, "format_version": FORMAT_VERSION,
                            "yy": float(s.yy), "n_rows": int(s.n_rows), "d": int(s.d), "d_out": s.d_out})
            g.create_array("gram_compact", data=s.gram_compact, dimension_names=("vech_pair", "vech_token"),
                           attributes={"description": "compact Gram sum_i vech(s s^T) vech(x x^T)^T", "units": "1"})
            g.create_array("moments", data=s.moments, dimension_names=("feature", "output"),
                           attributes={"description": "B = sum_i phi_i y_i^T"})

    @classmethod
    def load(cls, url, storage_options=None) -> "Statistics":
        """Read statistics written by :meth:`save`.

        Raises ``ValueError`` if the store is not a statistics group of a supported version.
        """
        g = _storage.open_group(url, "r", storage_options)
        a = dict(g.attrs)
        if a.get("format") != FORMAT or a.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{url}: not a scaleattn statistics store (format {a.get('format')!r} v{a.get('format_version')})")
        return cls(np.asarray(g["gram_compact"][...]), np.asarray(g["moments"][...]), float(a["yy"]),
                   int(a["n_rows"]), int(a["d"]))


def block_bytes_per_sample(d: int, T: int, causal: bool) -> float:
    """Peak bytes :func:`accumulate` holds per sample of a block: the float64 token copy and mask (2 T d), the
    row features s, s^T, v, x (and, causal, the pair products and their cumsum: per row 4 m + m + d), and the
    moments' x (x) y for up to d targets. Independent of ``d_out`` so that ``Tc``'s bits are too."""
    m = n_pairs(d)  # = d(d+1)/2, also the width of v
    rows = T if causal else 1
    return 8.0 * (2 * T * d + rows * (5 * m + d + d * d))


def block_samples(d: int, T: int, causal: bool, block_rows: int | None = None) -> int:
    """Samples per block of :func:`accumulate`: ``block_rows`` feature rows if given, else about ``BLOCK_BYTES``."""
    if block_rows is not None:
        return max(1, int(block_rows) // (T if causal else 1))
    return max(1, int(BLOCK_BYTES // block_bytes_per_sample(d, T, causal)))


def accumulate(stats: Statistics, tokens, targets=None, lengths=None, causal: bool = False,
               block_rows: int | None = None, cols: slice | None = None) -> Statistics:
    """Add a block of samples to ``stats`` in place (and return it).

    Parameters
    ----------
    tokens : array (n, T, d) float; targets : (n, d_out) or (n, T, d_out), optional; lengths : (n,) int, optional
        numpy or cupy (the statistics' arrays must live on the same device).
    causal : bool
        Prefix mode (DESIGN §1): every valid position is a row.
    block_rows : int, optional
        Feature rows formed at a time (default: about ``BLOCK_BYTES`` of features, :func:`block_samples`); the
        result does not depend on it beyond round-off.
    cols : slice, optional
        Column tile of ``u`` (= rows of ``Tc``, DESIGN §6): ``stats.gram_compact`` then holds only those rows.

    Per block: ``Tc += u^T v`` by :func:`gram_update` (DESIGN §3) and, in the same threads,
    ``B += s^T (x (x) y)``. Memory: about ``BLOCK_BYTES`` beyond the statistics, whatever ``n``.
    """
    n, T, d = tokens.shape
    step = block_samples(d, T, causal, block_rows)
    for a in range(0, n, step):
        b = min(n, a + step)
        lens = None if lengths is None else lengths[a:b]
        s, x = token_features(tokens[a:b], lens, causal)
        extra, yy = [], 0.0
        if targets is not None:
            y = row_targets(targets[a:b], lens, causal)
            extra.append((s.shape[0] * s.shape[1] * x.shape[1] * y.shape[1],
                          functools.partial(_moments_update, stats.moments, s, x, y)))
            yy = float((y * y).sum())
        gram_update(stats.gram_compact, s, x, cols, extra=extra)
        stats.yy += yy
        stats.n_rows += int(s.shape[0])
    return stats


def _moments_update(moments, s, x, y) -> None:
    """``B += s^T (x (x) y)`` in place: ``phi^T y`` without forming ``phi = s (x) x`` ([Y25] Alg. 1, DESIGN §3)."""
    xy = (x[:, :, None] * y[:, None, :]).reshape(x.shape[0], -1)
    moments += (s.T @ xy).reshape(moments.shape)


def _gemm_acc(c, a, b) -> None:
    """``c += a^T @ b`` in place (numpy or cupy). numpy's matmul releases the GIL, so the panels of
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


def gram_update(gram, s, x, cols: slice | None = None, *, threads: int | None = None, panel_rows: int = PANEL_ROWS,
                panel_cols: int = PANEL_COLS, extra=()):
    """The compact-Gram kernel: ``gram += u[:, cols]^T v`` with ``u = vech(s s^T)``, ``v = vech(x x^T)``
    (DESIGN §3), in place; returns ``gram``.

    Parameters
    ----------
    gram : array (width, d(d+1)/2) float64
        Rows ``cols`` of ``Tc`` (all of ``Tc``, (m(m+1)/2, d(d+1)/2), when ``cols`` is None); numpy or cupy.
    s : array (rows, m) float64; x : array (rows, d) float64
        From :func:`~scaleattn.features.token_features`, same module as ``gram``.
    cols : slice, optional
        Step-1 column range of ``u`` (a column tile of ``Tc``, DESIGN §6).
    threads : int, optional
        numpy only (default: this process's BLAS thread count). Groups of panels (disjoint rows of ``gram``) are
        taken by whichever thread is free; every BLAS call runs on one thread. Each entry of ``gram`` is summed by
        one thread in a fixed order, so the bits do not depend on ``threads`` or on the BLAS thread count.
    extra : sequence of (multiply-adds, callable)
        Other work on the same rows (the moments update), run once each in the same threads.

    Raises
    ------
    ValueError
        ``gram`` has the wrong number of rows for ``cols``. An exception in any job is re-raised here, after
        every thread has stopped.

    ``u`` is never formed whole: each (panel_rows, panel_cols) panel is built in a cache-sized buffer and
    accumulated with one GEMM ``gram[panel] += u_panel^T v``. Multiply-adds: ``rows * width * d(d+1)/2``;
    extra memory: one panel per thread.
    """
    xp = get_xp(gram, s, x)
    mm = n_pairs(s.shape[1])
    c0, c1, _ = (slice(0, mm) if cols is None else cols).indices(mm)
    if gram.shape[0] != c1 - c0:
        raise ValueError(f"gram has {gram.shape[0]} rows but the column range [{c0}, {c1}) has {c1 - c0}")
    rows = s.shape[0]
    panel_rows = max(1, min(int(panel_rows), rows))
    panel_cols = max(1, min(int(panel_cols), c1 - c0))
    v = pair_products(x)  # vech(x x^T), (rows, d(d+1)/2), C-contiguous
    sT = xp.ascontiguousarray(s.T)  # (m, rows): u panels are built column-major, one contiguous run per pair
    jobs = [(cost, ("call", f)) for cost, f in extra]
    jobs += [(rows * (b - a) * v.shape[1], ("panel", (a, b)))
             for a, b in ((a, min(c1, a + panel_cols)) for a in range(c0, c1, panel_cols))]

    def run_group(group, buf):
        panels = [job for kind, job in group if kind == "panel"]
        for r in range(0, rows, panel_rows):  # rows outer: this chunk of s and v stays in cache across panels
            sr = sT[:, r : r + panel_rows].T  # (rows', m) view, columns contiguous
            for a, b in panels:
                out = buf[: sr.shape[0] * (b - a)].reshape(b - a, sr.shape[0]).T  # (rows', width), F-contiguous
                _gemm_acc(gram[a - c0 : b - c0], pair_products(sr, slice(a, b), out), v[r : r + panel_rows])
        for kind, job in group:
            if kind == "call":
                job()

    if xp is not np or getattr(_IN_KERNEL, "active", False) or (_blas_threads() == 1 and (threads or 1) <= 1):
        # a device stream, a call from a kernel thread (BLAS already at one thread), or nothing to share or limit
        run_group([job for _, job in jobs], xp.empty(panel_rows * panel_cols))
        return gram
    with _KERNEL_LOCK:
        total = sum(c for c, _ in jobs)
        n = _blas_threads() if threads is None else int(threads)
        n = max(1, min(n, len(jobs), total // max(MIN_THREAD_MACS, 1) + 1))
        _run_shared(_groups(jobs, n * GROUPS_PER_THREAD if n > 1 else 1), run_group, n, panel_rows * panel_cols)
    return gram


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


def statistics_from_arrays(tokens, targets=None, lengths=None, causal=None, block_rows=None) -> Statistics:
    """Statistics of in-memory arrays (numpy or cupy), no Dask. ``causal`` defaults to ``targets.ndim == 3``."""
    if causal is None:
        causal = targets is not None and targets.ndim == 3
    xp = get_xp(tokens)
    d_out = 0 if targets is None else targets.shape[-1]
    stats = Statistics.zeros(tokens.shape[-1], d_out, xp)
    return accumulate(stats, tokens, targets, lengths, causal, block_rows)


# ---- distributed build ----------------------------------------------------------------------------------
#: the compact Gram is split into column tiles when it is larger than this (bytes, DESIGN §6)
MAX_TILE_BYTES = 256e6
#: default cap on the number of row groups when tiled: parallelism then comes from the tiles, and the number
#: of partials (and of checkpointed bytes) stays groups x |Tc| instead of chunks x |Tc|
TILED_MAX_GROUPS = 16


def row_groups(dataset, group_samples: int | None = None, max_groups: int | None = None) -> list[tuple[int, int]]:
    """Split samples into contiguous groups of whole Zarr chunks (one Dask task each).

    The split depends only on the dataset (never on the number of workers), so the reduction tree and the
    statistics are bit-identical across worker counts, retries and resumes (DESIGN §6). By default about
    32 MB of tokens per group, and at least 8 groups when the dataset has 8 chunks; ``max_groups`` enlarges
    the default groups so that there are at most that many.
    """
    N, chunk = dataset.n_samples, dataset.chunk_samples
    if group_samples is None:
        bytes_per_chunk = 8 * chunk * dataset.length * dataset.d
        per = max(1, int(32e6 // bytes_per_chunk))
        per = min(per, max(1, math.ceil(dataset.n_chunks / 8)))
        if max_groups:
            per = max(per, math.ceil(dataset.n_chunks / max_groups))
        group_samples = per * chunk
    group_samples = max(chunk, (int(group_samples) // chunk) * chunk)
    return [(a, min(N, a + group_samples)) for a in range(0, N, group_samples)]


def tile_bounds(d: int, tile_rows: int | None = None, max_tile_bytes: float | None = MAX_TILE_BYTES) -> list[tuple[int, int]]:
    """Row ranges ``[c0, c1)`` of the compact Gram ``Tc`` (= column ranges of ``u = vech(s s^T)``), DESIGN §6.

    One tile ``[(0, m(m+1)/2)]`` while ``Tc`` fits in ``max_tile_bytes`` (None: never tile); otherwise tiles of
    ``tile_rows`` rows (default: as many as fit in ``max_tile_bytes``), all equal but the last. At d = 64
    (``Tc`` 36 GB) the default gives 141 tiles of 256 MB.
    """
    m = n_pairs(d)
    mm, nv = m * (m + 1) // 2, d * (d + 1) // 2
    if tile_rows is None:
        if max_tile_bytes is None or 8 * mm * nv <= max_tile_bytes:
            return [(0, mm)]
        tile_rows = int(max_tile_bytes // (8 * nv))
    tile_rows = max(1, min(int(tile_rows), mm))
    return [(c, min(mm, c + tile_rows)) for c in range(0, mm, tile_rows)]


def group_statistics(dataset, start: int, stop: int, targets: bool = True, device: str = "auto",
                     cols: tuple[int, int] | None = None) -> Statistics:
    """Statistics of samples ``[start, stop)`` of a dataset, streamed chunk by chunk (one Dask task).

    ``device``: ``"cpu"``, ``"gpu"`` (CuPy) or ``"auto"`` (GPU when this worker has one). Returned on the host.
    ``cols = (c0, c1)`` builds one tile: ``gram_compact`` is then rows ``[c0, c1)`` of ``Tc`` only
    ((c1 - c0, d(d+1)/2); memory bounded by the tile and one block of rows, DESIGN §6); ``B``, ``yy`` and
    ``N`` are as usual (pass ``targets=False`` to skip ``B`` and ``yy`` in all but one tile).
    Raises :class:`~scaleattn.dataset.DatasetError` on bad values (naming the array and the sample).
    """
    xp = _device_module(device)
    if cols is None:
        stats = Statistics.zeros(dataset.d, dataset.d_out if targets else 0, xp)
        sl = None
    else:
        sl = slice(int(cols[0]), int(cols[1]))
        stats = Statistics(xp.zeros((sl.stop - sl.start, dataset.d * (dataset.d + 1) // 2)),
                           xp.zeros((n_features(dataset.d), dataset.d_out if targets else 0)), 0.0, 0, dataset.d)
    for a in range(start, stop, dataset.chunk_samples):
        b = min(stop, a + dataset.chunk_samples)
        tok, lens, y = dataset.read(a, b, targets=targets)
        if xp is not np:
            tok, lens, y = (None if t is None else xp.asarray(t) for t in (tok, lens, y))
        accumulate(stats, tok, y, lens, dataset.causal, cols=sl)
    return stats.to_numpy()


def _device_module(device):
    """numpy or cupy for ``device``. ``"auto"`` picks the GPU only where one is assigned to this process
    (``CUDA_VISIBLE_DEVICES``, as dask-cuda sets per worker), so CPU workers never pile onto GPU 0."""
    if device == "cpu":
        return np
    from ._backend import have_cupy

    assigned = bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if device == "gpu" or (device == "auto" and assigned and have_cupy()):
        import cupy

        return cupy
    return np


def _add_all(*parts: Statistics, inplace: bool = False) -> Statistics:
    """Sum in order (same bits as ``((p0 + p1) + p2) + ...``) into a new buffer, or into ``parts[0]`` with
    ``inplace`` (only for partials this process owns: a Dask task must never modify its inputs)."""
    out = parts[0] if inplace else (parts[0] + parts[1] if len(parts) > 1 else parts[0])
    for p in parts[1 if inplace else 2:]:
        if p.gram_compact.shape != out.gram_compact.shape or p.moments.shape != out.moments.shape:
            raise ValueError(f"cannot add statistics of (d, d_out) = {(out.d, out.d_out)} and {(p.d, p.d_out)}")
        out.gram_compact += p.gram_compact
        out.moments += p.moments
        out.yy += p.yy
        out.n_rows += p.n_rows
    return out


#: partials combined per reduction task: a binary tree, so an in-process build holds about log2(groups)
#: partials at once (its peak memory hardly grows with the number of rows)
SPLIT_EVERY = 2


class TreeReducer:
    """Streaming tree reduction: :meth:`add` items in order, :meth:`result` combines them ``split_every``
    neighbours at a time, level by level, exactly as :func:`tree_reduce` would, while holding only
    ``O(split_every * log n)`` items (a fit's memory does not grow with the number of row groups)."""

    def __init__(self, combine, split_every: int = SPLIT_EVERY):
        self.combine, self.split_every = combine, max(2, int(split_every))
        self.levels: list[list] = []  # levels[k]: items at depth k not yet in a full group
        self.count = 0

    def add(self, item) -> None:
        self.count += 1
        k = 0
        while True:
            if len(self.levels) == k:
                self.levels.append([])
            self.levels[k].append(item)
            if len(self.levels[k]) < self.split_every:
                return
            item, self.levels[k] = self.combine(*self.levels[k]), []
            k += 1

    def result(self):
        if not self.count:
            raise ValueError("nothing to reduce")
        carry = None
        for k, pending in enumerate(self.levels):  # each level's last, partial group; a lone item passes up
            items = pending + ([carry] if carry is not None else [])
            if not items:
                continue
            if len(items) == 1 and not any(self.levels[k + 1:]):
                return items[0]
            carry = self.combine(*items) if len(items) > 1 else items[0]
        return carry


def tree_reduce(parts, combine, split_every: int = SPLIT_EVERY):
    """Reduce ``parts`` by combining ``split_every`` neighbours at a time, level by level, in a fixed order
    (so floating-point results do not depend on which worker finished first). Raises ``ValueError`` when
    ``parts`` is empty."""
    red = TreeReducer(combine, split_every)
    for p in parts:
        red.add(p)
    return red.result()


def submit_tree(client, futures: list, func, split_every: int = SPLIT_EVERY):
    """:func:`tree_reduce` of ``futures`` on a cluster with ``func`` (submitted with retries).

    Returns ``(root, combines)``: every reduction future, for the caller to keep referenced until the end (so
    a cancel finds each of them still wanted) and to cancel with the inputs when something fails.
    """
    combines = []

    def combine(*parts):
        combines.append(client.submit(func, *parts, retries=3))
        return combines[-1]

    return tree_reduce(futures, combine, split_every), combines


def _partial(dataset, gi: int, ti: int, start: int, stop: int, cols, targets: bool, device: str, ckpt):
    """One task: the partial of row group ``gi``, tile ``ti``. With a checkpoint, a partial already marked done
    is read back (a retry after a lost worker or a resume recomputes nothing); a new one is written there, then
    marked done, by this worker. Store hiccups are retried here (:func:`~scaleattn._storage.with_retries`);
    bad data fails the task once."""
    if ckpt is not None and ckpt.is_done(gi, ti):
        return ckpt.read(gi, ti)
    delay = float(os.environ.get("SCALEATTN_TEST_TASK_DELAY", 0) or 0)  # test hook: slow tasks down
    if delay:
        time.sleep(delay)
    part = _storage.with_retries(group_statistics, dataset, start, stop, targets and ti == 0, device, cols)
    if ckpt is not None:
        _storage.with_retries(ckpt.write, gi, ti, part)
    return part


def _assemble(tiles: list, d: int) -> Statistics:
    """Concatenate per-tile statistics (tile 0 carries ``B`` and ``yy``) into one :class:`Statistics`."""
    first = tiles[0]
    rows = {int(t.n_rows) for t in tiles}
    if len(rows) != 1:
        raise RuntimeError(f"tiles disagree on the row count: {sorted(rows)}")
    gram = first.gram_compact if len(tiles) == 1 else np.concatenate([t.gram_compact for t in tiles], axis=0)
    return Statistics(gram, first.moments, float(first.yy), int(first.n_rows), d)


def _stop_after_groups() -> int | None:
    """Test hook ``SCALEATTN_TEST_STOP_AFTER_GROUPS=k``: the client process exits (code 75, no cleanup) once
    k row groups have been computed and checkpointed in this run, as a crash would."""
    v = os.environ.get("SCALEATTN_TEST_STOP_AFTER_GROUPS")
    return int(v) if v else None


def compute_statistics(dataset, client=None, *, targets: bool = True, group_samples: int | None = None,
                       split_every: int = SPLIT_EVERY, device: str = "auto", progress: bool = False,
                       tile_rows: int | None = None, max_tile_bytes: float | None = MAX_TILE_BYTES,
                       checkpoint: str | None = None, storage_options: dict | None = None,
                       info: dict | None = None) -> Statistics:
    """Build the statistics of a dataset on a Dask cluster by tree reduction (DESIGN §6).

    Each task streams one row group (:func:`row_groups`) for one column tile of ``Tc`` (:func:`tile_bounds`;
    a single tile unless ``Tc`` exceeds ``max_tile_bytes``) and accumulates locally. Partials are combined per
    tile by :func:`tree_reduce` on the workers, always in group order, so the result is bit-identical for any
    worker count, completion order, retry or resume; tiled and untiled builds agree to round-off. The client
    receives only the per-tile roots and concatenates them (so it holds the whole ``Tc``: at d = 64, 36 GB;
    a distributed solver for that size is future work).

    Parameters
    ----------
    dataset : Dataset
        From :func:`scaleattn.dataset.open_dataset`.
    client : distributed.Client, optional
        Without one the tasks run in this process (same tree, same bits).
    targets : bool
        False builds only the Gram (enough for the certificate).
    group_samples : int, optional
        Samples per row group (rounded to whole chunks); default from :func:`row_groups` (at most
        ``TILED_MAX_GROUPS`` groups when tiled).
    tile_rows, max_tile_bytes
        Tiling (:func:`tile_bounds`): rows of ``Tc`` per tile, or the size above which ``Tc`` is tiled.
    checkpoint : str, optional
        Checkpoint store (:class:`scaleattn.checkpoint.Checkpoint`), created if absent: every finished partial
        is written there by its worker and marked done; partials already done are read back, not recomputed.
        ``storage_options`` are its fsspec options (default the dataset's).
    info : dict, optional
        Filled with ``groups``, ``tiles``, ``groups_computed``, ``groups_resumed`` (groups whose every tile was
        read from the checkpoint), ``tasks_computed``, ``tasks_resumed``, ``checkpoint``.
    progress : bool
        Show a progress bar driven by this job's futures.

    Raises
    ------
    ValueError
        ``checkpoint`` exists but belongs to another dataset, chunking, grouping, tiling or version.
    DatasetError
        Bad values in the dataset.
    """
    tiles = tile_bounds(dataset.d, tile_rows, max_tile_bytes)
    groups = row_groups(dataset, group_samples, TILED_MAX_GROUPS if len(tiles) > 1 else None)
    ckpt = None
    done = np.zeros((len(groups), len(tiles)), dtype=bool)
    if checkpoint is not None:
        from .checkpoint import Checkpoint

        opts = dataset.storage_options if storage_options is None else storage_options
        ckpt = Checkpoint.open(checkpoint, dataset, groups, tiles, targets, opts)
        done = ckpt.done_mask()
    if info is not None:
        info.update({"groups": len(groups), "tiles": len(tiles), "groups_resumed": int(done.all(axis=1).sum()),
                     "groups_computed": int((~done.all(axis=1)).sum()), "tasks_resumed": int(done.sum()),
                     "tasks_computed": int((~done).sum()), "checkpoint": None if ckpt is None else ckpt.url})
    stop_after = _stop_after_groups()
    todo = [gi for gi in range(len(groups)) if not done[gi].all()]
    if client is None:
        from .cluster import progress_bar

        add_into = functools.partial(_add_all, inplace=True)  # our own partials: sum in place
        reducers = [TreeReducer(add_into, split_every) for _ in tiles]  # same tree (and bits) as on a cluster
        with progress_bar(len(groups), "statistics", progress) as advance:
            for gi, (a, b) in enumerate(groups):
                for ti, cols in enumerate(tiles):
                    reducers[ti].add(_partial(dataset, gi, ti, a, b, cols, targets, device, ckpt))
                advance()
                if stop_after is not None and gi in todo and todo.index(gi) + 1 >= stop_after:
                    os._exit(75)
        return _assemble([r.result() for r in reducers], dataset.d)
    from .cluster import wait_with_progress

    tag = f"{dataset.fingerprint}-{int(targets)}-{'' if ckpt is None else _url_token(ckpt.url)}"
    futs = [[client.submit(_partial, dataset, gi, ti, a, b, cols, targets, device, ckpt,  # retries: in the task
                           key=f"stats-part-{tag}-{a}-{b}-{cols[0]}-{cols[1]}") for ti, cols in enumerate(tiles)]
            for gi, (a, b) in enumerate(groups)]
    trees = [submit_tree(client, [f[ti] for f in futs], _add_all, split_every) for ti in range(len(tiles))]
    roots, combos = [r for r, _ in trees], [c for _, cs in trees for c in cs]
    flat = [f for row in futs for f in row]
    try:
        if stop_after is not None:
            _exit_after_groups(futs, todo, stop_after)
        wait_with_progress(flat, "statistics", progress)
        return _assemble(client.gather(roots), dataset.d)
    except BaseException:  # a task failed or we were interrupted: do not leave the cluster computing
        client.cancel(flat + combos)
        raise


def _url_token(url: str) -> str:
    """A short stable token of a store URL (for task keys)."""
    import hashlib

    return hashlib.sha1(str(url).encode()).hexdigest()[:10]


def _exit_after_groups(futs, todo: list[int], k: int) -> None:
    """The test hook of :func:`_stop_after_groups` for the Dask path."""
    from distributed import as_completed

    left = {gi: len(futs[gi]) for gi in todo}
    owner = {f.key: gi for gi in todo for f in futs[gi]}
    finished = 0
    for fut in as_completed([f for gi in todo for f in futs[gi]]):
        gi = owner[fut.key]
        left[gi] -= 1
        if left[gi] == 0:
            finished += 1
            if finished >= k:
                os._exit(75)
