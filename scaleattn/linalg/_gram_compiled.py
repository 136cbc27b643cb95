"""The compiled (numba) product of the matrix-free Gram operator (layer L2, below :mod:`scaleattn.linalg._gram`,
which runs it on its thread pool).

Row ``r = pair(p, q)`` of the compact Gram ``Tc`` is the vech of the symmetric d x d block ``S = M_pq``
(``S[a, b] = Tc[r, pair(a, b)]``, DESIGN §3); it adds ``Y[p] += S X[q]`` and, for ``q != p``, ``Y[q] += S X[p]``
(X, Y viewed as (m, d, k)). The numpy path expands the rows of a segment into memory (``np.take``, 1 MB chunks)
and runs two BLAS GEMMs; the expansion, not the GEMMs, sets its pace. Here each row is expanded once into a
local (dp, dp) buffer ``S`` that stays in L1 (15 KB at d = 44) and applied to all k columns from there: for each
column j, ``y_p += sum_b S[b, :] xq[b]`` and ``y_q += sum_b S[b, :] xp[b]`` (``S`` symmetric: its rows are its
columns), four rows ``b`` per pass of the vectorised loop over the outputs ``a`` and two columns j at a time, so
four loads of ``S`` feed 16 multiply-adds. The vectors live transposed and zero-padded as (m, k, dp), ``dp`` =
d rounded up to a multiple of 4 (:func:`padded`, :func:`unpadded`): the loop over ``a`` is contiguous and
whole blocks of 4 rows ``b`` need no tail. Multiply-adds per row ``2 dp^2 k`` (``psi^2 k`` per product up to
the padding); memory beyond the vectors one (dp, dp) buffer per call.

Why not vectorise along k (the natural layout): k is 1 to ~20, mostly small, and a vector of 4 along k
would waste 3/4 of the work at k = 1; along ``a`` no k wastes any. Why not apply the packed rows directly
(no ``S``): the packed triangle turns half the work into reductions over ``b >= a``, loops of d/2 elements on
average whose horizontal sums and tails cost more than the expansion (prototypes at d = 44 on one core:
1.2-1.6 G multiply-adds/s against 1.4-6.8 for this one).
Measured, one product at d = 44 on the 2 shared cores (about one core free): 3.0x the numpy path at k = 1,
2.1x at k = 7, 1.3x at k = 16 (docs/performance.md). numba as in :mod:`scaleattn.statistics._compiled`: ``nogil``
(the operator's own threads run it), ``cache``, ``fastmath`` reassociation only (NaNs propagate), never
``parallel=True`` (not safe under Dask's worker threads). Every sum runs in an order fixed by the segments alone, so
one call gives the same bits on any thread.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from .._jit import njit_module

__all__ = ["compiled", "padded", "unpadded", "apply_segments", "matmat_into", "PAD"]

#: the vectors' token axis is padded to a multiple of this (the rows ``b`` go in blocks of 4)
PAD = 4


def _expand(t, S, d):  # pragma: no cover - compiled
    """``S[:d, :d]`` = the symmetric d x d block whose vech (row-major upper triangle) is ``t``; the padding of
    ``S`` stays zero."""
    o = 0
    for a in range(d):
        S[a, a:d] = t[o : o + d - a]
        o += d - a
    for a in range(1, d):
        sa = S[a]
        for b in range(a):
            sa[b] = S[b, a]


def _apply1(S, xq, xp, yp, yq, dp, both):  # pragma: no cover - compiled
    """``yp += S xq`` and, with ``both``, ``yq += S xp`` (one column; vectors of length ``dp``)."""
    for b in range(0, dp, 4):
        s0, s1, s2, s3 = S[b], S[b + 1], S[b + 2], S[b + 3]
        q0, q1, q2, q3 = xq[b], xq[b + 1], xq[b + 2], xq[b + 3]
        if both:
            p0, p1, p2, p3 = xp[b], xp[b + 1], xp[b + 2], xp[b + 3]
            for a in range(dp):
                u0, u1, u2, u3 = s0[a], s1[a], s2[a], s3[a]
                yp[a] += u0 * q0 + u1 * q1 + u2 * q2 + u3 * q3
                yq[a] += u0 * p0 + u1 * p1 + u2 * p2 + u3 * p3
        else:
            for a in range(dp):
                yp[a] += s0[a] * q0 + s1[a] * q1 + s2[a] * q2 + s3[a] * q3


def _apply2(S, xq, xp, xq1, xp1, yp, yq, yp1, yq1, dp):  # pragma: no cover - compiled
    """:func:`_apply1` with ``both`` for two columns at once (four independent outputs per loaded ``S``)."""
    for b in range(0, dp, 4):
        s0, s1, s2, s3 = S[b], S[b + 1], S[b + 2], S[b + 3]
        q0, q1, q2, q3 = xq[b], xq[b + 1], xq[b + 2], xq[b + 3]
        p0, p1, p2, p3 = xp[b], xp[b + 1], xp[b + 2], xp[b + 3]
        g0, g1, g2, g3 = xq1[b], xq1[b + 1], xq1[b + 2], xq1[b + 3]
        h0, h1, h2, h3 = xp1[b], xp1[b + 1], xp1[b + 2], xp1[b + 3]
        for a in range(dp):
            u0, u1, u2, u3 = s0[a], s1[a], s2[a], s3[a]
            yp[a] += u0 * q0 + u1 * q1 + u2 * q2 + u3 * q3
            yq[a] += u0 * p0 + u1 * p1 + u2 * p2 + u3 * p3
            yp1[a] += u0 * g0 + u1 * g1 + u2 * g2 + u3 * g3
            yq1[a] += u0 * h0 + u1 * h1 + u2 * h2 + u3 * h3


def _segments(T, segs, d, XT, YT):  # pragma: no cover - compiled
    """``YT += (rows of the segments) XT``: ``T`` the tile (rows, d(d+1)/2), ``segs`` (n, 4) int64 rows
    ``(p, q0, q1, r0)`` (:func:`scaleattn.linalg._gram.tile_segments`), ``XT``, ``YT`` (m, k, dp) padded."""
    k, dp = XT.shape[1], XT.shape[2]
    S = np.zeros((dp, dp))
    for s in range(segs.shape[0]):
        p, q0, q1, r0 = segs[s, 0], segs[s, 1], segs[s, 2], segs[s, 3]
        for q in range(q0, q1):
            _expand(T[r0 + q - q0], S, d)
            j = 0
            if q != p:  # the diagonal block (p, p) adds S X[p] once
                while j + 2 <= k:
                    _apply2(S, XT[q, j], XT[p, j], XT[q, j + 1], XT[p, j + 1], YT[p, j], YT[q, j], YT[p, j + 1],
                            YT[q, j + 1], dp)
                    j += 2
            while j < k:
                _apply1(S, XT[q, j], XT[p, j], YT[p, j], YT[q, j], dp, q != p)
                j += 1


_COMPILE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _compile():
    return njit_module(globals(), ("_expand", "_apply1", "_apply2"), ("_segments",))[0]


def compiled():
    """The njit-compiled segment kernel (numba imported here, once; several operator threads may ask at once)."""
    with _COMPILE_LOCK:
        return _compile()


def padded(X, d: int):
    """X (psi, k) float64 as the kernel's vectors: (m, k, dp) C-contiguous, zero beyond token ``d``."""
    psi, k = X.shape
    m, dp = psi // d, d + (-d) % PAD
    XT = np.zeros((m, k, dp))
    XT[:, :, :d] = X.reshape(m, d, k).transpose(0, 2, 1)
    return XT


def unpadded(YT, d: int):
    """The (psi, k) float64 array of vectors laid out by :func:`padded` (a new array)."""
    m, k = YT.shape[0], YT.shape[1]
    return np.ascontiguousarray(YT[:, :, :d].transpose(0, 2, 1)).reshape(m * d, k)


def apply_segments(tile, segments, d: int, XT, YT) -> None:
    """``YT += (rows of these segments) XT`` in place, compiled: ``tile`` numpy (rows, d(d+1)/2) float64,
    ``segments`` ``(p, q0, q1, r0)`` (:func:`scaleattn.linalg._gram.tile_segments`), ``XT``, ``YT`` (m, k, dp)
    float64 from :func:`padded`. The numpy path's sums to round-off (about 1e-15 relative)."""
    if len(segments):
        segs = np.asarray(segments, dtype=np.int64).reshape(-1, 4)
        compiled()(np.asarray(tile, dtype=np.float64), segs, int(d), XT, YT)


def matmat_into(tile, segments, d: int, X, Y) -> None:
    """``Y += (rows of these segments) X`` in place for X, Y (psi, k) float64 numpy (:func:`apply_segments` on
    the padded copies)."""
    YT = np.zeros((X.shape[0] // d, X.shape[1], d + (-d) % PAD))
    apply_segments(tile, segments, d, padded(X, d), YT)
    Y += unpadded(YT, d)
