"""The rows of a data pass and its arithmetic, per row group (DESIGN §4b, §6): :class:`RowSource` (the rows in
row groups, kept between passes when they fit), the blocks of rows a pass cuts from the tokens, the two GEMMs of
``Phi^T (Phi W)`` on a block, a row group's sums over its blocks in order, and the fixed-order tree's combine.
:class:`scaleattn.linalg._stream.StreamOperator` (in this process) and the tasks of :mod:`scaleattn.distributed.stream`
(on a cluster's workers) run these very functions on the same row groups and add the groups' partials in the same
tree (:mod:`scaleattn._tree`), each product on one BLAS thread and on aligned operands of the same layout: the
same bits in process and on any number of workers.
"""
from __future__ import annotations

import threading

import numpy as np

from .._backend import device_of, get_xp, is_numpy
from ..features import n_pairs, row_targets, token_features
from ..statistics._compiled import features_t

__all__ = ["RowSource", "rows_from_arrays", "rows_from_dataset", "BLOCK_ROWS", "CACHE_BYTES", "cut_blocks",
           "block_bytes", "phi_w", "phi_t_r", "group_sweep", "group_gw", "group_sse", "add_parts", "c_order",
           "aligned"]


#: rows per block of a pass (each block holds rows x (m + d k) floats: 2 MB x k at d = 64)
BLOCK_ROWS = 2048
#: the rows' token features are kept between passes when they take at most this many bytes (else recomputed)
CACHE_BYTES = 1 << 30


class RowSource:
    """The rows of a data set as blocks ``(s, x, y)`` in a fixed order, in row groups, recomputed at every pass.

    ``chunks`` returns an iterator of ``(tokens (n, T, d), lengths (n,) or None, targets or None)``: without
    ``groups``, ``chunks()`` over the whole data (one group); with ``groups`` (sample ranges ``[a, b)``, e.g.
    :func:`scaleattn.distributed.partition.row_groups`), ``chunks(a, b)`` over each group in turn. Each chunk is cut
    into blocks of about ``block_rows`` rows (:func:`cut_blocks`) and turned into token features
    (:func:`scaleattn.features.token_features`). A group's blocks are kept after its first pass while all kept
    groups take at most ``cache_bytes``. The row groups fix the order of every sum of a pass (each group's
    partial over its blocks in order, then the groups' partials in the fixed-order tree of :mod:`scaleattn._tree`),
    so the bits are those of the same pass on a Dask cluster (:mod:`scaleattn.distributed.stream`).
    """

    def __init__(self, chunks, d: int, d_out: int, causal: bool, *, block_rows: int = BLOCK_ROWS,
                 cache_bytes: float = CACHE_BYTES, groups=None):
        self.chunks, self.d, self.d_out, self.causal = chunks, int(d), int(d_out), bool(causal)
        self.block_rows, self.cache_bytes = max(1, int(block_rows)), float(cache_bytes)
        self.groups = None if groups is None else [(int(a), int(b)) for a, b in groups]
        self.n_groups = 1 if self.groups is None else len(self.groups)
        self.n_rows: int | None = None
        self._kept: list = [None] * self.n_groups
        self._rows: list = [None] * self.n_groups
        self._held = 0.0
        self._lock = threading.Lock()

    def group_blocks(self, gi: int):
        """Yields group ``gi``'s blocks ``(s (rows, m), x (rows, d), y (rows, d_out) or None)``, float64, in the
        tokens' namespace (thread-safe: the groups of a pass may be read at once)."""
        kept = self._kept[gi]
        if kept is not None:
            yield from kept
            return
        chunks = self.chunks() if self.groups is None else self.chunks(*self.groups[gi])
        keep, size, rows = [], 0, 0
        for blk in cut_blocks(chunks, self.block_rows, self.causal):
            rows += blk[0].shape[0]
            if keep is not None:
                nb = block_bytes(blk)
                with self._lock:  # reserve its bytes in the budget, or give the group's reservation back
                    if self._held + nb <= self.cache_bytes:
                        self._held += nb
                        size += nb
                        keep.append(blk)
                    else:
                        self._held -= size
                        keep = None
            yield blk
        with self._lock:
            self._rows[gi] = rows
            if keep is not None:
                self._kept[gi] = keep
            if all(r is not None for r in self._rows):
                self.n_rows = int(sum(self._rows))

    def blocks(self):
        """Every group's blocks in order (:meth:`group_blocks`)."""
        for gi in range(self.n_groups):
            yield from self.group_blocks(gi)


def rows_from_arrays(tokens, targets=None, lengths=None, causal: bool = False, *, block_rows: int = BLOCK_ROWS,
                     cache_bytes: float = CACHE_BYTES, groups=None) -> RowSource:
    """A :class:`RowSource` over arrays: ``tokens`` (n, T, d), ``targets`` (n, d_out) or (n, T, d_out) for
    ``causal``, ``lengths`` (n,) optional (as :func:`scaleattn.features.token_features`); ``groups``: sample ranges
    (default one group)."""
    d_out = 0 if targets is None else int(targets.shape[-1])

    def chunks(a=0, b=tokens.shape[0]):
        yield (tokens[a:b, ...], None if lengths is None else lengths[a:b],
               None if targets is None else targets[a:b, ...])

    return RowSource(chunks, tokens.shape[2], d_out, causal, block_rows=block_rows, cache_bytes=cache_bytes,
                     groups=groups)


def rows_from_dataset(ds, *, targets: bool = True, block_rows: int = BLOCK_ROWS,
                      cache_bytes: float = CACHE_BYTES, groups=None) -> RowSource:
    """A :class:`RowSource` reading a :class:`scaleattn.data.Dataset` chunk by chunk, in order (every read checked
    against its manifest as the statistics build's reads are); the dataset is never modified. ``targets=False``:
    the tokens only (a certificate). ``groups``: its row groups (:func:`scaleattn.distributed.partition.row_groups`:
    then the sums are those of the same pass on a cluster); default one group."""
    with_y = bool(targets) and ds.d_out > 0

    def chunks(a=0, b=ds.n_samples):
        yield from ds.read_chunks(a, b, targets=with_y)

    return RowSource(chunks, ds.d, ds.d_out if with_y else 0, ds.causal, block_rows=block_rows,
                     cache_bytes=cache_bytes, groups=groups)


def cut_blocks(chunks, block_rows: int, causal: bool):
    """Blocks ``(s, x, y)`` of about ``block_rows`` rows cut from ``(tokens, lengths, targets)`` chunks, in order:
    the one cut a pass uses in process and on a cluster's workers (the same blocks, the same bits)."""
    for tok, lens, y in chunks:
        n, T = tok.shape[0], tok.shape[1]
        step = max(1, int(block_rows) // (T if causal else 1))
        for a in range(0, n, step):
            b = min(n, a + step)
            ln = None if lens is None else lens[a:b]
            if is_numpy(get_xp(tok)):  # one compiled pass (cumsum and pair products took 1/3 of a pass)
                sT, xT = features_t(tok[a:b, ...], ln, causal=causal)
                s, x = sT.T, xT.T
            else:
                s, x = token_features(tok[a:b, ...], ln, causal=causal)
            yt = None if y is None else row_targets(y[a:b, ...], ln, causal=causal)
            yield s, x, yt


def block_bytes(block) -> int:
    """Bytes of one block ``(s, x, y)``."""
    return sum(8 * int(np.prod(a.shape)) for a in block if a is not None)


def phi_w(s, x, W3, k: int):
    """``Phi W`` of one block (rows, k); ``W3`` is ``W`` viewed as (m, d k) (DESIGN §4b)."""
    xp = get_xp(s)
    T = xp.reshape(xp.matmul(s, W3), (s.shape[0], x.shape[1], k))
    return xp.sum(T * x[:, :, None], axis=1)


def phi_t_r(s, x, R):
    """``Phi^T R`` of one block as (m, d k): ``S^T (X (x)_row R)`` (DESIGN §4b)."""
    xp = get_xp(s)
    XR = xp.reshape(x[:, :, None] * R[:, None, :], (s.shape[0], x.shape[1] * R.shape[1]))
    return xp.matmul(s.T, XR)


def group_sweep(blocks, d: int, k: int):
    """One row group's part of the first sweep: ``(diag G as (m, d), S^T S, X^T X, Phi^T Y as (m, d k), sum y^2,
    rows)``, its blocks added in order (None for a group without rows)."""
    m = n_pairs(d)
    out = None
    for s, x, y in blocks:
        if out is None:  # the sums stay on the rows' device
            xp, dev = get_xp(s), device_of(s)
            out = [xp.zeros((m, d), dtype=xp.float64, device=dev), xp.zeros((m, m), dtype=xp.float64, device=dev),
                   xp.zeros((d, d), dtype=xp.float64, device=dev), xp.zeros((m, d * k), dtype=xp.float64, device=dev),
                   0.0, 0]
        out[0] += xp.matmul((s * s).T, x * x)
        out[1] += xp.matmul(s.T, s)
        out[2] += xp.matmul(x.T, x)
        if k:
            out[3] += phi_t_r(s, x, y)
            out[4] += float(xp.sum(y * y))
        out[5] += s.shape[0]
    return None if out is None else tuple(out)


def group_gw(blocks, W3, k: int):
    """One row group's partial ``G W`` as (m, d k): ``sum Phi_b^T (Phi_b W)`` over its blocks in order."""
    out = None
    for s, x, _ in blocks:
        part = phi_t_r(s, x, phi_w(s, x, W3, k))
        out = part if out is None else out + part
    return out


def group_sse(blocks, W3, k: int) -> float:
    """One row group's ``sum ||y_i - c^T phi_i||^2`` (``W3``: the coefficients as (m, d k))."""
    xp, sse = None, 0.0
    for s, x, y in blocks:
        xp = xp or get_xp(s)
        r = y - phi_w(s, x, W3, k)
        sse += float(xp.sum(r * r))
    return sse


def c_order(a):
    """``a`` in C order and aligned (a copy only if it is not). A GEMM's bits depend on its operands' layout, and
    numpy multiplies a misaligned array (as Dask may deserialise one) in its own loop, not BLAS: a pass must give
    the same bits in process and on any worker, whatever layout its arrays arrive in."""
    if a is None:
        return None
    xp = get_xp(a)
    if isinstance(a, np.ndarray):
        return np.require(a, requirements=["C", "A"])
    return xp.ascontiguousarray(a) if hasattr(xp, "ascontiguousarray") else a


def aligned(a):
    """``a`` aligned, its layout kept (a copy only if misaligned, as Dask may deserialise a block that moved between
    workers: numpy multiplies a misaligned array in its own loop, not BLAS, with other bits)."""
    return np.require(a, requirements=["A"]) if isinstance(a, np.ndarray) else a


def add_parts(a, b):
    """The tree's combine of two groups' partials (arrays, floats, or tuples of them; None is no rows)."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, tuple):
        return tuple(add_parts(p, q) for p, q in zip(a, b))
    return a + b
