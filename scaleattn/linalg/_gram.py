"""The feature Gram as a matrix-free operator on its compact form (DESIGN §3, §4, §6).

``G[(P,l),(P',l')] = Tc[pair(P,P'), pair(l,l')]`` (DESIGN §3): every product ``G X`` can be formed from the
compact Gram ``Tc`` (m(m+1)/2, d(d+1)/2) without ever holding the psi x psi ``G`` (2.3 GB at d = 32, 15 GB at
d = 44, 142 GB at d = 64). Row ``(p, q)``, ``p <= q``, of ``Tc`` is the vech of the d x d block
``M_pq = G[(p, .), (q, .)]``; so the rows of one tile (a contiguous row range ``[c0, c1)``, as
:func:`scaleattn.distributed.partition.tile_bounds` makes them) contribute

    Y[p] += M_pq X[q]      and, for p < q,      Y[q] += M_pq X[p]          (X, Y viewed as (m, d, k))

Rows ``(p, q0..q1)`` with the same ``p`` are contiguous in ``Tc``: each such segment is expanded to
``(q1 - q0) d x d`` (a few MB) and applied with two GEMMs, ``2 d^2 k`` multiply-adds per row of ``Tc``, so
``G X`` costs ``psi^2 k`` multiply-adds in all (the dense product's count) and one read of ``Tc``.

The contributions of disjoint tiles add up to ``G X`` exactly: :func:`tile_matmat` is the primitive a worker
runs on the tiles it holds (one partial ``G X`` of psi x k numbers per worker per iteration), and
:class:`GramOperator` sums it over the tiles of one process. :func:`tile_diagonal` and
:func:`tile_token_columns` give what the preconditioners need from a tile, also as partials that add up.
The Krylov code (:mod:`scaleattn.linalg._krylov`) needs only an object with ``d``, ``psi``, ``matmat(X)``,
``diagonal()`` and ``token_columns()``; :class:`GramOperator` is that object for tiles held in memory.
All functions take numpy or cupy arrays (the array module comes from the input) and accumulate in float64.
References: [Y25] Yau et al., "Learning Linear Attention in Polynomial Time", NeurIPS 2025, §2.1 and
Algorithm 1 (the features and the normal equations ``G c = B``).
"""
from __future__ import annotations

import concurrent.futures
import functools
import os

import numpy as np

from .._backend import get_xp, is_numpy
from ..errors import ParameterError
from ..features import n_features, n_pairs, triu_index
from ..statistics._kernel import kernel_name
from . import _gram_compiled

__all__ = ["GramOperator", "BlockJacobi", "tile_matmat", "tile_diagonal", "tile_token_columns", "tile_partial_traces",
           "partial_trace_factors", "tile_segments", "blas_single_thread", "gram_for", "operator_of",
           "DENSE_GRAM_MAX_PSI"]

#: above this psi the heads step and the witness take ``G @ c`` from the matrix-free operator (:func:`gram_for`)
DENSE_GRAM_MAX_PSI = 4_096


@functools.lru_cache(maxsize=256)
def tile_segments(d: int, c0: int, c1: int) -> tuple[tuple[int, int, int, int], ...]:
    """Segments ``(p, q0, q1, r0)`` of the rows ``[c0, c1)`` of ``Tc``: tile rows ``r0 .. r0 + q1 - q0`` are the
    pairs ``(p, q)``, ``q0 <= q < q1`` (row-major upper triangle of the m x m pair matrix, DESIGN §3).

    Raises :class:`~scaleattn.errors.ParameterError` when ``[c0, c1)`` is not inside ``[0, m(m+1)/2)``.
    """
    m = n_pairs(d)
    mm = m * (m + 1) // 2
    if not 0 <= c0 <= c1 <= mm:
        raise ParameterError(f"tile rows [{c0}, {c1}) are not inside the compact Gram's {mm} rows (d = {d})")
    off = np.concatenate([[0], np.cumsum(np.arange(m, 0, -1))])
    out = []
    p = max(int(np.searchsorted(off, c0, side="right")) - 1, 0)
    while p < m and off[p] < c1:
        lo, hi = max(int(off[p]), c0), min(int(off[p + 1]), c1)
        if hi > lo:
            out.append((p, p + lo - int(off[p]), p + hi - int(off[p]), lo - c0))
        p += 1
    return tuple(out)


@functools.lru_cache(maxsize=32)
def _token_index(d: int) -> tuple[np.ndarray, np.ndarray]:
    """``(full, diag)``: vech positions of the d x d token matrix flattened row-major (d*d,), and of its
    diagonal ``(l, l)`` (d,)."""
    _, _, pos = triu_index(d)
    return pos.reshape(-1).copy(), pos[np.arange(d), np.arange(d)].copy()


def _index(xp, d: int):
    full, diag = _token_index(d)
    return xp.asarray(full), xp.asarray(diag)


def _check_tile(tile, c0: int, d: int) -> None:
    nv = d * (d + 1) // 2
    if tile.ndim != 2 or tile.shape[1] != nv:
        raise ParameterError(f"a compact Gram tile at d = {d} has shape (rows, {nv}), got {tuple(tile.shape)}")
    tile_segments(d, int(c0), int(c0) + int(tile.shape[0]))  # raises for rows outside Tc


def tile_matmat(tile, c0: int, d: int, X, out=None):
    """Partial product ``G X`` of the compact-Gram rows ``[c0, c0 + tile.shape[0])`` (DESIGN §3, §6).

    Summing the partials of tiles that partition the rows of ``Tc`` gives ``G X`` exactly (each pair of
    feature groups ``(p, q)`` is in one tile); psi x k numbers per partial, whatever the tile size.

    Parameters
    ----------
    tile : array (rows, d(d+1)/2) float64
        Rows ``[c0, c0 + rows)`` of the compact Gram ``Tc``.
    c0 : int
        First row of the tile in ``Tc``.
    d : int
        Token dimension.
    X : array (psi, k) or (psi,) float64
        Vectors to multiply (same array module as ``tile``).
    out : array (psi, k) or (psi,), optional
        Accumulate into this array (in place) instead of a new zero array.

    Returns
    -------
    array (psi, k) or (psi,) float64
        The tile's contribution to ``G X`` (``out`` when given).

    Raises
    ------
    ParameterError
        Tile or vector shapes that do not fit ``d``.

    References
    ----------
    DESIGN §3 (the index map of the compact Gram); [Y25] Algorithm 1 (the normal equations).

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> st = statistics_from_arrays(np.random.default_rng(0).standard_normal((50, 4, 2)))
    >>> X = np.ones((6, 1))
    >>> bool(np.allclose(tile_matmat(st.gram_compact, 0, 2, X), st.gram() @ X))
    True
    """
    xp = get_xp(tile, X)
    _check_tile(tile, c0, d)
    psi = n_features(d)
    if X.shape[0] != psi:
        raise ParameterError(f"X has {X.shape[0]} rows, expected psi = {psi} for d = {d}")
    vec = X.ndim == 1
    X2 = xp.asarray(X, dtype=xp.float64).reshape(psi, -1)
    k = X2.shape[1]
    if out is None:
        Y = xp.zeros((psi, k), dtype=xp.float64)
    else:
        if out.shape[0] != psi or out.reshape(psi, -1).shape[1] != k:
            raise ParameterError(f"out has shape {tuple(out.shape)}, expected {tuple(X.shape)}")
        Y = out.reshape(psi, k)
    segs = tile_segments(d, int(c0), int(c0) + int(tile.shape[0]))
    (_gram_compiled.matmat_into if kernel_name(xp) == "numba" else _apply_segments)(tile, segs, d, X2, Y)
    if out is not None:
        return out
    return Y.reshape(psi) if vec else Y


#: numpy: a segment is expanded in chunks of about this many bytes, so that the expansion stays in cache for
#: its two products (whole segments are 4 MB at d = 32; chunks of 1 MB measured about 10% faster per pass)
CHUNK_BYTES = 1024 * 1024


def _apply_segments(tile, segments, d: int, X, Y) -> None:
    """``Y += (rows of these segments) X`` in place; X, Y (psi, k) float64 of the tile's array module."""
    xp = get_xp(tile, X)
    m, k = n_pairs(d), X.shape[1]
    X3, Y3 = X.reshape(m, d, k), Y.reshape(m, d, k)
    full, _ = _index(xp, d)
    rows = max(8, CHUNK_BYTES // (8 * d * d)) if is_numpy(xp) else m  # a device takes whole segments
    buf = xp.empty(min(rows, m) * d * d) if is_numpy(xp) else None
    for p, q0, q1, r0 in segments:
        for a in range(0, q1 - q0, rows):
            nb = min(rows, q1 - q0 - a)
            qa, ra = q0 + a, r0 + a
            if buf is None:
                E = xp.take(tile[ra : ra + nb], full, axis=1)
            else:
                E = buf[: nb * d * d].reshape(nb, d * d)
                xp.take(tile[ra : ra + nb], full, axis=1, out=E)
            E = E.reshape(nb * d, d)  # rows (q, l'), columns l: the blocks M_pq
            Y3[p] += E.T @ X3[qa : qa + nb].reshape(nb * d, k)  # Y[p] += sum_q M_pq X[q]   (M_pq symmetric)
            skip = 1 if qa == p else 0  # the diagonal block (p, p) is counted once
            if nb > skip:
                Y3[qa + skip : qa + nb] += (E[skip * d :] @ X3[p]).reshape(nb - skip, d, k)  # Y[q] += M_pq X[p]


#: below this many entries of Tc times m (about the multiply-adds of one product) the operator runs on one thread
MIN_THREAD_ENTRIES = 20_000_000


@functools.lru_cache(maxsize=4)
def _pool(n: int):
    """Persistent helper threads of the operator (made once per size)."""
    return concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="scaleattn-gramop")


@functools.lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl controller of the loaded BLAS libraries, made once (the library scan is slow)."""
    import scipy.linalg.blas  # noqa: F401  (load scipy's BLAS before the scan)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def blas_single_thread():
    """Context: BLAS on one thread while the operator's threads run (process-wide, as threadpoolctl is)."""
    return _blas_controller().limit(limits=1)


def tile_diagonal(tile, c0: int, d: int, out=None):
    """The tile's part of ``diag G`` (psi,): ``G[(P,l),(P,l)] = Tc[pair(P,P), pair(l,l)]`` for the diagonal
    pairs ``(P, P)`` among its rows (zeros elsewhere; partials of a partition of ``Tc`` add up to ``diag G``).

    Parameters
    ----------
    tile : array (rows, d(d+1)/2); c0 : int; d : int
        As :func:`tile_matmat`.
    out : array (psi,), optional
        Accumulate into it.

    Returns
    -------
    array (psi,) float64

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> st = statistics_from_arrays(np.random.default_rng(0).standard_normal((50, 4, 2)))
    >>> bool(np.allclose(tile_diagonal(st.gram_compact, 0, 2), np.diag(st.gram())))
    True
    """
    xp = get_xp(tile)
    _check_tile(tile, c0, d)
    m, psi = n_pairs(d), n_features(d)
    D = xp.zeros(psi, dtype=xp.float64) if out is None else out
    D2 = D.reshape(m, d)
    _, diag = _index(xp, d)
    for p, q0, _q1, r0 in tile_segments(d, int(c0), int(c0) + int(tile.shape[0])):
        if q0 == p:
            D2[p] += xp.take(tile[r0], diag)
    return D


def tile_token_columns(tile, c0: int, d: int):
    """The tile's rows of the token-diagonal columns ``Tc[:, pair(l, l)]``: (rows, d) float64.

    Column l of the full (m(m+1)/2, d) array is the vech of the m x m block ``G[(., l), (., l)]`` of the
    features that share the query coordinate l (the block-Jacobi preconditioner's blocks,
    :class:`scaleattn.linalg._krylov.BlockJacobi`); tile ``[c0, c1)`` holds its rows ``[c0, c1)``.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> st = statistics_from_arrays(np.random.default_rng(0).standard_normal((50, 4, 2)))
    >>> tile_token_columns(st.gram_compact, 0, 2).shape
    (6, 2)
    """
    xp = get_xp(tile)
    _check_tile(tile, c0, d)
    _, diag = _index(xp, d)
    return xp.take(tile, diag, axis=1)


def tile_partial_traces(tile, c0: int, d: int, scale=None, out=None):
    """The tile's part of the partial traces of ``G`` (or of ``Gs = S G S``): ``vech A'`` then ``vech B'`` in one
    (m(m+1)/2 + d(d+1)/2,) vector; partials of a partition of ``Tc`` add up to the whole (DESIGN §4b).

    ``A'[P, Q] = sum_l G[(P,l),(Q,l)]`` (m x m; from the token-diagonal columns, so the tile's rows ``[c0, c1)``
    give ``vech A'`` at those positions) and ``B'[l, l'] = sum_P G[(P,l),(P,l')]`` (d x d; from the tile's rows
    ``(P, P)``). For ``G = A (x) B`` they are ``A tr(B)`` and ``tr(A) B``: the factors of
    :class:`scaleattn.linalg._kfac.TraceKFAC` (from the traces of ``S G S``).

    Parameters
    ----------
    tile : array (rows, d(d+1)/2); c0 : int; d : int
        As :func:`tile_matmat`.
    scale : array (psi,), optional
        ``S = diag(G)^-1/2`` (0 for all-zero features): the partial traces of ``S G S`` instead of ``G``.
    out : array (m(m+1)/2 + d(d+1)/2,), optional
        Accumulate into it.

    Returns
    -------
    array (m(m+1)/2 + d(d+1)/2,) float64
        Unpack with :func:`partial_trace_factors`.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> st = statistics_from_arrays(np.random.default_rng(0).standard_normal((50, 4, 2)))
    >>> A, B = partial_trace_factors(tile_partial_traces(st.gram_compact, 0, 2), 2)
    >>> G4 = st.gram().reshape(3, 2, 3, 2)
    >>> bool(np.allclose(A, np.einsum("plql->pq", G4)) and np.allclose(B, np.einsum("plpk->lk", G4)))
    True
    """
    xp = get_xp(tile)
    _check_tile(tile, c0, d)
    m, nv = n_pairs(d), d * (d + 1) // 2
    mm = m * (m + 1) // 2
    T = xp.zeros(mm + nv, dtype=xp.float64) if out is None else out
    _, diag = _index(xp, d)
    I, J, _ = triu_index(d)
    I, J = xp.asarray(I), xp.asarray(J)
    s2 = None if scale is None else xp.reshape(xp.asarray(scale, dtype=xp.float64), (m, d))
    c0, rows = int(c0), int(tile.shape[0])
    for p, q0, q1, r0 in tile_segments(d, c0, c0 + rows):
        C = xp.take(tile[r0 : r0 + q1 - q0, :], diag, axis=1)  # (q, l): G[(p, l), (q, l)]
        if s2 is not None:
            C = C * s2[p, :][None, :] * s2[q0:q1, :]
        T[c0 + r0 : c0 + r0 + q1 - q0] += xp.sum(C, axis=1)
        if q0 == p:  # row (p, p): the d x d block G[(p, .), (p, .)]
            T[mm:] += tile[r0, :] if s2 is None else tile[r0, :] * xp.take(s2[p, :], I) * xp.take(s2[p, :], J)
    return T


def partial_trace_factors(traces, d: int):
    """``(A' (m, m), B' (d, d))`` from the vector of :func:`tile_partial_traces` (summed over a partition)."""
    xp = get_xp(traces)
    m = n_pairs(d)
    mm = m * (m + 1) // 2
    _, _, ppos = triu_index(m)
    _, _, tpos = triu_index(d)
    return (xp.reshape(xp.take(traces[:mm], xp.asarray(ppos.reshape(-1))), (m, m)),
            xp.reshape(xp.take(traces[mm:], xp.asarray(tpos.reshape(-1))), (d, d)))


class GramOperator:
    """``G`` (psi x psi, never formed) from compact-Gram tiles held in this process (DESIGN §3, §6).

    Parameters
    ----------
    d : int
        Token dimension.
    tiles : sequence of (int, array)
        ``(c0, tile)`` pairs whose row ranges ``[c0, c0 + len(tile))`` partition the m(m+1)/2 rows of ``Tc``
        (any order; numpy or cupy, all on one device).

    Attributes
    ----------
    products : int
        Columns multiplied so far (``G X`` with k columns counts k), for the Krylov reports.
    passes : int
        Passes over ``Tc`` so far (one per :meth:`matmat` call).

    Raises
    ------
    ParameterError
        Tiles that overlap, leave rows out or have the wrong width.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> st = statistics_from_arrays(np.random.default_rng(0).standard_normal((50, 4, 3)))
    >>> op = GramOperator.from_compact(st.gram_compact, 3, tile_rows=7)
    >>> X = np.random.default_rng(1).standard_normal((18, 2))
    >>> bool(np.allclose(op @ X, st.gram() @ X))
    True
    """

    def __init__(self, d: int, tiles, threads: int | None = None):
        self.d = int(d)
        self.psi = n_features(self.d)
        m = n_pairs(self.d)
        mm = m * (m + 1) // 2
        self.tiles = sorted(((int(c0), t) for c0, t in tiles), key=lambda ct: ct[0])
        if not self.tiles:
            raise ParameterError("a Gram operator needs at least one compact-Gram tile")
        at = 0
        for c0, t in self.tiles:
            _check_tile(t, c0, self.d)
            if c0 != at:
                raise ParameterError(f"compact-Gram tiles must partition its {mm} rows: rows from {at} start at {c0}")
            at = c0 + int(t.shape[0])
        if at != mm:
            raise ParameterError(f"compact-Gram tiles cover rows [0, {at}) of {mm} (d = {self.d})")
        self.xp = get_xp(*[t for _, t in self.tiles])
        self.threads = max(1, int(os.cpu_count() or 1) if threads is None else int(threads))
        self.products = 0
        self.passes = 0
        # work items (tile, segments) cut into about `threads` groups of equal rows (numpy only; a device
        # stream runs them in one call)
        items = [(t, seg) for c0, t in self.tiles for seg in tile_segments(self.d, c0, c0 + int(t.shape[0]))]
        n = self.threads if is_numpy(self.xp) and mm * n_pairs(self.d) >= MIN_THREAD_ENTRIES else 1
        self._groups, total, done = [[]], mm, 0
        for t, seg in items:
            if len(self._groups) < n and done >= total * len(self._groups) / n:
                self._groups.append([])
            self._groups[-1].append((t, seg))
            done += seg[2] - seg[1]

    @classmethod
    def from_compact(cls, gram_compact, d: int, tile_rows: int | None = None,
                     threads: int | None = None) -> GramOperator:
        """Operator on a whole compact Gram (views, no copy), as one tile or split into tiles of ``tile_rows``
        rows (the result is the same to round-off; memory beyond ``Tc`` is one segment's expansion either way,
        at most ``m d^2`` floats: 68 MB at d = 64)."""
        mm = int(gram_compact.shape[0])
        rows = mm if tile_rows is None else max(1, int(tile_rows))
        return cls(d, [(c, gram_compact[c : min(mm, c + rows)]) for c in range(0, mm, rows)], threads)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.psi, self.psi)

    def matmat(self, X):
        """``G X`` for X (psi, k) or (psi,): the sum of :func:`tile_matmat` over the tiles.

        numpy: the segments run on ``threads`` threads, each summing into its own psi x k buffer (the compiled
        kernel of :mod:`scaleattn.linalg._gram_compiled` unless :func:`scaleattn.statistics._kernel.kernel_name` says
        numpy, else BLAS GEMMs on one thread each); the buffers are added in a fixed order: the bits do not depend on
        timing.
        """
        xp, fast = self.xp, kernel_name(self.xp) == "numba"
        if X.shape[0] != self.psi:
            raise ParameterError(f"X has {X.shape[0]} rows, expected psi = {self.psi} for d = {self.d}")
        X2 = xp.asarray(X, dtype=xp.float64).reshape(self.psi, -1)
        Xin = _gram_compiled.padded(X2, self.d) if fast else X2
        outs = [xp.zeros(Xin.shape, dtype=xp.float64) for _ in self._groups]

        def run(i):
            for t, seg in self._groups[i]:
                (_gram_compiled.apply_segments if fast else _apply_segments)(t, (seg,), self.d, Xin, outs[i])

        if not is_numpy(xp):
            run(0)
        elif len(self._groups) == 1:
            with blas_single_thread():
                run(0)
        else:
            with blas_single_thread():
                futs = [_pool(len(self._groups) - 1).submit(run, i) for i in range(1, len(self._groups))]
                try:
                    run(0)
                finally:
                    concurrent.futures.wait(futs)
                for f in futs:
                    f.result()
        Y = outs[0]
        for o in outs[1:]:
            Y += o
        Y = _gram_compiled.unpadded(Y, self.d) if fast else Y
        self.products += int(X2.shape[1])
        self.passes += 1
        return Y.reshape(X.shape)

    __matmul__ = matmat

    def diagonal(self):
        """``diag G`` (psi,) float64 (:func:`tile_diagonal` summed over the tiles)."""
        D = self.xp.zeros(self.psi, dtype=self.xp.float64)
        for c0, t in self.tiles:
            tile_diagonal(t, c0, self.d, out=D)
        return D

    def token_columns(self):
        """``Tc[:, pair(l, l)]`` (m(m+1)/2, d) float64: the vech of the m x m blocks ``G[(., l), (., l)]``."""
        return self.xp.concatenate([tile_token_columns(t, c0, self.d) for c0, t in self.tiles], axis=0)

    def partial_traces(self, scale=None):
        """``(A', B')``: the partial traces of ``G`` (with ``scale``: of ``S G S``), (m, m) and (d, d) float64
        (:func:`tile_partial_traces`)."""
        m, nv = n_pairs(self.d), self.d * (self.d + 1) // 2
        T = self.xp.zeros(m * (m + 1) // 2 + nv, dtype=self.xp.float64)
        for c0, t in self.tiles:
            tile_partial_traces(t, c0, self.d, scale, out=T)
        return partial_trace_factors(T, self.d)


class BlockJacobi:
    """Block-Jacobi preconditioner by token coordinate, straight from the compact Gram (DESIGN §3, §4).

    The features ``(P, l)`` that share the query coordinate ``l`` form one group of m; its diagonal block
    ``G[(., l), (., l)] = sum_i s_i s_i^T x_il^2`` is the vech column ``Tc[:, pair(l, l)]`` (the
    :meth:`GramOperator.token_columns`). The vech-S part of the features carries the ill-conditioning of the
    Gram (prefix Grams of one sequence are strongly correlated), so these d blocks of m x m capture it: on the
    DESIGN §9 realizable data the preconditioned condition number is 3.7 at d = 8 (Jacobi: 450) and 213 at
    d = 16 with N = 3,000 rows (Jacobi: 1.1e5); the d x d blocks by pair P gain nothing over Jacobi (measured).

    Works in Jacobi-scaled coordinates: with ``S = diag(G)^-1/2`` (0 for all-zero features) and
    ``Gs = S G S``, :meth:`apply_scaled` applies ``Ms^-1`` (the inverse of Gs's blocks, each factored as
    ``Bs + ridge I`` by Cholesky, or by eigh with its eigenvalues clipped at ``ridge x`` the largest when
    round-off makes a block indefinite); :meth:`apply` the same in original coordinates (``S Ms^-1 S``). Rows
    and columns of all-zero features are zero. Memory: d x m x m floats (71 MB at d = 32, 2.2 GB at d = 64).

    Parameters
    ----------
    token_columns : array (m(m+1)/2, d)
        ``Tc[:, pair(l, l)]`` (:meth:`GramOperator.token_columns`).
    diagonal : array (psi,)
        ``diag G`` (:meth:`GramOperator.diagonal`).
    d : int
        Token dimension.
    ridge : float, optional
        Relative shift of the unit-diagonal blocks (default ``16 psi eps``, the Gram's round-off level).

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> st = statistics_from_arrays(np.random.default_rng(0).standard_normal((200, 5, 3)))
    >>> op = GramOperator.from_compact(st.gram_compact, 3)
    >>> M = BlockJacobi(op.token_columns(), op.diagonal(), 3)
    >>> M.apply(np.ones((18, 1))).shape
    (18, 1)
    """

    name = "block-jacobi"

    def __init__(self, token_columns, diagonal, d: int, ridge: float | None = None):
        xp = get_xp(token_columns, diagonal)
        m, psi = n_pairs(d), n_features(d)
        if token_columns.shape != (m * (m + 1) // 2, d) or diagonal.shape != (psi,):
            raise ParameterError(f"token columns {tuple(token_columns.shape)} / diagonal {tuple(diagonal.shape)} do not"
                             f" fit d = {d} (expected ({m * (m + 1) // 2}, {d}) and ({psi},))")
        self.d, self.m, self.psi, self.xp = int(d), m, psi, xp
        self.ridge = 16.0 * psi * float(np.finfo(np.float64).eps) if ridge is None else float(ridge)
        diag = xp.asarray(diagonal, dtype=xp.float64)
        self.live = diag > 0
        self.scale = xp.where(self.live, 1.0 / xp.sqrt(xp.where(self.live, diag, 1.0)), 0.0)
        _, _, ppos = triu_index(m)
        ppos = xp.asarray(ppos)
        s2, live2 = self.scale.reshape(m, d), self.live.reshape(m, d)
        self.inv = xp.empty((d, m, m), dtype=xp.float64)
        self.fallbacks = 0  # blocks that needed the eigh fallback
        self.block_min = float("inf")  # smallest eigenvalue of the blocks (live features), scaled coordinates
        eye = xp.eye(m)
        for l in range(d):
            sl, dead = s2[:, l], ~live2[:, l]
            Bs = token_columns[:, l][ppos] * sl[:, None] * sl[None, :] + self.ridge * eye
            Bs[dead, :] = 0.0
            Bs[:, dead] = 0.0
            Bs[dead, dead] = 1.0
            if bool(live2[:, l].any()):
                self.block_min = min(self.block_min, float(xp.linalg.eigvalsh(Bs[live2[:, l]][:, live2[:, l]])[0]))
            inv = _spd_inverse(Bs, self.ridge)
            if inv is None:
                self.fallbacks += 1
                w, U = xp.linalg.eigh(Bs)
                w = xp.maximum(w, self.ridge * max(float(w.max()), 1.0))
                inv = (U / w[None, :]) @ U.T
            inv[dead, :] = 0.0
            inv[:, dead] = 0.0
            self.inv[l] = inv

    def min_eigenvalues(self) -> tuple[float, float]:
        """``(lambda_min(Ms), lower bound on lambda_min(M))``: the smallest eigenvalue of the preconditioner's
        blocks in scaled coordinates (exact, from one ``eigvalsh`` per block when it was made) and, in
        original coordinates, ``lambda_min(Ms) min(diag G)`` (``M = D^1/2 Ms D^1/2``). With
        ``C = M^-1/2 G M^-1/2``: ``lambda_min(G) >= lambda_min(C) lambda_min(M)``, the same for ``Gs``."""
        xp = self.xp
        dmin = float(xp.min(xp.where(self.live, 1.0 / xp.where(self.live, self.scale, 1.0) ** 2, xp.inf)))
        return self.block_min, self.block_min * dmin

    def apply_scaled(self, R):
        """``Ms^-1 R`` for R (psi, k) in Jacobi-scaled coordinates: one batched (d, m, m) x (d, m, k) product."""
        xp, m, d = self.xp, self.m, self.d
        k = R.shape[1]
        R3 = xp.ascontiguousarray(R.reshape(m, d, k).transpose(1, 0, 2))  # (d, m, k)
        return xp.ascontiguousarray(xp.matmul(self.inv, R3).transpose(1, 0, 2)).reshape(self.psi, k)

    def apply(self, R):
        """``M^-1 R = S Ms^-1 S R`` in original coordinates, R (psi, k)."""
        s = self.scale[:, None]
        return s * self.apply_scaled(s * R)


def _spd_inverse(A, ridge: float):
    """Inverse of a symmetric positive definite matrix by Cholesky (numpy or cupy); None when the factor fails
    or is not finite (cupy reports a failed factor as NaN)."""
    xp = get_xp(A)
    try:
        L = xp.linalg.cholesky(A)
    except np.linalg.LinAlgError:
        return None
    Li = xp.linalg.inv(L)
    inv = Li.T @ Li
    if not bool(xp.isfinite(inv).all()):
        return None
    return inv


def operator_of(stats) -> GramOperator:
    """The matrix-free operator of the statistics: their own (``stats.operator``: ``Tc`` on the workers,
    :class:`scaleattn.distributed.operator.RemoteStatistics`), else one on the compact Gram held here."""
    op = getattr(stats, "operator", None)
    return op if op is not None else GramOperator.from_compact(stats.gram_compact, stats.d)


def gram_for(stats):
    """``G`` for products ``G @ c``: the dense Gram up to :data:`DENSE_GRAM_MAX_PSI` features, else the
    matrix-free operator (on the host). Both support ``G @ c``, ``G.diagonal()``, ``stats.sse(c, G)`` and
    ``stats.sse_floor(c, G)``."""
    if getattr(stats, "operator", None) is not None:  # statistics whose Tc is held on the workers
        return stats.operator
    stats = stats.to_numpy()
    return stats.gram() if stats.psi <= DENSE_GRAM_MAX_PSI else operator_of(stats)
