"""The compiled (numba) statistics kernel: token features, compact-Gram panels and moments without numpy
temporaries (layer L2, below :mod:`scaleattn.statistics._kernel`, which runs these functions on its threads).

Why numba. The build's per-row work at small ``d`` (d = 4: 55 x 10 multiply-adds of ``Tc``, 10 of ``s``) is
smaller than what a numpy call costs per row: the numpy kernel spends 48x the multiply-add floor at d = 4,
mostly in ``pair_products``' temporaries, the moments' ``x (x) y`` temporary and skinny BLAS GEMMs (K = 1024,
N = 10). A better numpy kernel cannot remove those passes over memory; a compiled loop can. numba is a wheel
(no compiler at install, unlike Cython or pythran), LLVM-vectorises the loops below for the host CPU (AVX2,
or AVX-512 at its full width: :func:`scaleattn._jit.wide_vectors`), releases the GIL (``nogil``) so the
kernel's own thread pool runs them, and caches the machine code (``cache``) so Dask workers do not recompile.
``parallel=True`` is not used: numba's threading layers are not safe under Dask's worker threads; the threads
are :mod:`scaleattn.statistics._kernel`'s. Measured (docs/performance.md, :mod:`scaleattn.bench.build`) on 2 AVX2 cores
and on 2 AVX-512 (Emerald Rapids) cores.

Two ways in. :func:`piece_stats` is the whole build of a piece of samples in one pass (features, ``Tc``,
``B``, ``yy``: the ``accumulate`` path below ``BLAS_MIN_D``, run on the kernel's threads by
:func:`scaleattn.statistics._kernel.fused_update`); :func:`features_t`, :func:`tc_panel` and :func:`moments_panel` work
on ready feature-major ``s``, ``x`` (``gram_update`` on given features, and the BLAS side from ``BLAS_MIN_D``).

The functions are plain Python until :func:`compiled` compiles them (numba is imported lazily: it costs
0.5 s at start-up, as much as the rest of the package). Every reduction runs in an order fixed by the code and
the panel, piece and chunk boundaries only (never by the thread count): ``fastmath`` allows reassociation (for
vectorised sums) but not ``nnan`` / ``ninf``, so NaNs propagate.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from .._jit import njit_module, wide_vectors
from ..features import n_pairs, triu_index

__all__ = ["compiled", "kernels_cached", "KERNELS",
           "expand_rows", "row_pieces", "sample_pieces", "features_t", "tc_panel", "moments_panel",
           "piece_stats", "u_panel", "pair_columns", "CHUNK_ROWS", "PANEL_COLS", "MIN_PANELS",
           "MAX_PIECES", "MIN_PIECE_ROWS", "PIECE_MACS", "MAX_SAMPLE_PIECES", "MAX_PARTIAL_BYTES", "STAGE_SAMPLES",
           "TOKEN_MACS"]

#: rows per chunk: u and v of a chunk are formed in (PANEL_COLS, CHUNK_ROWS) buffers and summed by the
#: micro-kernel (its K; measured fastest of 64, 128, 256, 512 at d = 4 and 8)
CHUNK_ROWS = 256
#: columns of ``u`` per job of the compiled kernel (fixed, so the bits do not depend on the thread count;
#: 64 measured fastest of 16, 32, 64 at d = 4 and 8)
PANEL_COLS = 64
#: below this many panels a call is also cut into row pieces (:func:`row_pieces`), each summed on its own and
#: added in piece order, so that small ``d`` (d = 4: one panel) still uses every thread
MIN_PANELS = 4
#: row pieces per call at most, and rows per piece at least (:func:`row_pieces`)
MAX_PIECES, MIN_PIECE_ROWS = 4, 8192
#: the fused pass (:func:`piece_stats`, :func:`sample_pieces`): a piece of whole samples has about this many
#: multiply-adds at least (a few ms: the thread hand-off and the partial's sum stay small), at most
#: :data:`MAX_SAMPLE_PIECES` pieces per call, their partials :data:`MAX_PARTIAL_BYTES` at most together
PIECE_MACS = 20_000_000
MAX_SAMPLE_PIECES = 64
#: a last-token row's cost per token (its copy and its share of ``vech(Z^T Z)``) for :func:`sample_pieces` and the
#: kernel's threads, in multiply-adds per entry of ``(s, x)`` (m + d): measured at d = 4 on one thread, about
#: 6 ns per token against 0.085 ns per multiply-add of a causal row (a 100-token row costs as much as 13 causal rows)
TOKEN_MACS = 5
MAX_PARTIAL_BYTES = 32e6
#: samples :func:`_piece` stages at a time from position-major input (:func:`_stage`): 64 x 100 tokens x d = 4
#: float64 is 200 kB, in L2 alongside the chunk buffers
STAGE_SAMPLES = 64


def row_pieces(rows: int, panels: int) -> list[tuple[int, int]]:
    """Row ranges a call of :func:`tc_panel` / :func:`moments_panel` is cut into: a function of the shapes only
    (never of the thread count), so each piece, and their sum in piece order, has the same bits on any number
    of threads. One piece when there are :data:`MIN_PANELS` panels or more.

    Examples
    --------
    >>> row_pieces(20000, 1)
    [(0, 10000), (10000, 20000)]
    """
    k = 1 if panels >= MIN_PANELS else max(1, min(MAX_PIECES, rows // MIN_PIECE_ROWS))
    edges = [rows * i // k for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def sample_pieces(rows_per_sample, macs_per_row: float, partial_bytes: float, tokens_per_sample=None,
                  macs_per_token: float = 0.0) -> list[tuple[int, int]]:
    """Sample ranges ``[i0, i1)`` of about equal cost (``rows x macs_per_row``, plus ``tokens x macs_per_token``
    where ``tokens_per_sample`` is given: a last-token row reads all of its sample's tokens) that
    :func:`piece_stats` sums apart (added in this order; an even number of them from 2 on, a multiple of 4 from
    4 on, bounded by the samples, :data:`MAX_SAMPLE_PIECES` and :data:`MAX_PARTIAL_BYTES`): a function of the
    rows and tokens of each sample and the shapes only (never of the thread count), so every piece, and their sum
    in order, has the same bits on any number of threads.

    Examples
    --------
    >>> sample_pieces(np.full(4, 10_000), 5500, 5000)
    [(0, 1), (1, 2), (2, 3), (3, 4)]
    """
    cost = np.asarray(rows_per_sample, dtype=np.int64) * float(macs_per_row)
    if tokens_per_sample is not None:
        cost = cost + np.asarray(tokens_per_sample, dtype=np.int64) * float(macs_per_token)
    cum = np.cumsum(cost)
    n, total = len(cum), float(cum[-1]) if len(cum) else 0.0
    k = int(total // PIECE_MACS)
    k = k if k < 3 else -(-k // 4) * 4  # 2, or a multiple of 4: equal shares on 2 or 4 threads (13 or 3 equal
    # pieces on 2 threads leave one thread idle through the last)
    k = max(1, min(k, n, MAX_SAMPLE_PIECES, int(MAX_PARTIAL_BYTES // max(partial_bytes, 1))))
    edges = sorted({0, n, *(int(np.searchsorted(cum, total * i / k, side="right")) for i in range(1, k))})
    return list(zip(edges[:-1], edges[1:]))


def _features(z, lengths, causal, sT, xT):  # pragma: no cover - compiled
    """Fill ``sT`` (m, rows) and ``xT`` (d, rows), feature-major, from tokens ``z`` (n, T, d) float64 and
    ``lengths`` (n,) int64 (clipped to [0, T]); rows as :func:`scaleattn.features.token_features` orders them
    (causal: the running sum of ``vech(z_t z_t^T)``, as numpy's cumsum)."""
    n, T, d = z.shape
    m = sT.shape[0]
    acc = np.zeros(m)
    row = 0
    for i in range(n):
        L = min(max(lengths[i], 0), T)
        acc[:] = 0.0
        for t in range(L):
            k = 0
            for a in range(d):
                za = z[i, t, a]
                for b in range(a, d):
                    acc[k] += za * z[i, t, b]
                    k += 1
            if causal:
                for k in range(m):
                    sT[k, row] = acc[k]
                for a in range(d):
                    xT[a, row] = z[i, t, a]
                row += 1
        if not causal:
            for k in range(m):
                sT[k, row] = acc[k]
            for a in range(d):
                xT[a, row] = z[i, L - 1, a] if L > 0 else 0.0
            row += 1
    return row


#: columns of ``out`` per register block of :func:`_acc`: 4 where the host has 32 vector registers (AVX-512, at
#: 512 bits), 2 where it has 16 (AVX2: a 4 x 4 block's 16 accumulators and 8 loaded vectors spill). Set by
#: :func:`_compile` from :func:`scaleattn._jit.wide_vectors` before anything is compiled, read by numba as a
#: constant (the on-disk cache is kept per host CPU and features, so per width too)
_J_BLOCK = 4


def _acc(A, B, out, na, nb, R):  # pragma: no cover - compiled
    """``out[i, j] += sum_{r < R} A[i, r] B[j, r]`` for ``i < na``, ``j < nb``: register-blocked, 4 rows by
    :data:`_J_BLOCK` columns (4 x 2 blocks for the rest), vectorised along ``r`` (LLVM's loop vectoriser; numba
    leaves its SLP vectoriser off, so a block along ``j`` would run scalar). A 4 x 4 block: 16 accumulators and
    8 loads per 16 FMAs, FMA-bound at 512 bits (:func:`scaleattn._jit.wide_vectors`; measured on one Emerald
    Rapids core at the DGEMM's rate, 64.5 against 64.9 GFLOP/s; 4 x 2 blocks 44.6). With 16 vector registers
    (AVX2) it spills: on one AMD EPYC (Zen 3) core, 4 x 4 blocks 26.4, 4 x 2 blocks 39.5 GFLOP/s, the DGEMM 44 (``out``
    56 x 10, 256 rows: d = 4's ``Tc``). Callers pad: ``na`` a multiple of 4 and ``nb`` even (``A``, ``out`` have ``na``
    rows, ``B`` and ``out``'s columns ``nb``; an odd ``nb`` would drop or overrun a column), the padding rows zero, so
    every entry is summed by the same loop, in an order fixed by ``R``, ``nb`` and the block width only."""
    n4 = nb - nb % 4 if _J_BLOCK == 4 else 0
    for i in range(0, na, 4):
        for j in range(0, n4, 4):
            a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = f0 = f1 = f2 = f3 = 0.0
            for r in range(R):
                b0, b1, b2, b3 = B[j, r], B[j + 1, r], B[j + 2, r], B[j + 3, r]
                u0, u1, u2, u3 = A[i, r], A[i + 1, r], A[i + 2, r], A[i + 3, r]
                a0, a1, a2, a3 = a0 + u0 * b0, a1 + u1 * b0, a2 + u2 * b0, a3 + u3 * b0
                c0, c1, c2, c3 = c0 + u0 * b1, c1 + u1 * b1, c2 + u2 * b1, c3 + u3 * b1
                e0, e1, e2, e3 = e0 + u0 * b2, e1 + u1 * b2, e2 + u2 * b2, e3 + u3 * b2
                f0, f1, f2, f3 = f0 + u0 * b3, f1 + u1 * b3, f2 + u2 * b3, f3 + u3 * b3
            for k, (x0, x1, x2, x3) in enumerate(((a0, c0, e0, f0), (a1, c1, e1, f1), (a2, c2, e2, f2),
                                                  (a3, c3, e3, f3))):
                out[i + k, j] += x0
                out[i + k, j + 1] += x1
                out[i + k, j + 2] += x2
                out[i + k, j + 3] += x3
        for j in range(n4, nb, 2):
            a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = 0.0
            for r in range(R):
                b0, b1 = B[j, r], B[j + 1, r]
                u0, u1, u2, u3 = A[i, r], A[i + 1, r], A[i + 2, r], A[i + 3, r]
                a0, a1, a2, a3 = a0 + u0 * b0, a1 + u1 * b0, a2 + u2 * b0, a3 + u3 * b0
                c0, c1, c2, c3 = c0 + u0 * b1, c1 + u1 * b1, c2 + u2 * b1, c3 + u3 * b1
            for k, (x0, x1) in enumerate(((a0, c0), (a1, c1), (a2, c2), (a3, c3))):
                out[i + k, j] += x0
                out[i + k, j + 1] += x1


def _tc_panel(sT, xT, P, Q, out, chunk, lo, hi):  # pragma: no cover - compiled
    """``out += u[:, cols]^T v`` for the pairs ``(P[c], Q[c])`` of the panel's columns (``u = vech(s s^T)``,
    ``v = vech(x x^T)``; ``sT``, ``xT`` feature-major), streaming the rows ``[lo, hi)`` in chunks of ``chunk``: u
    and v of a chunk are formed (transposed, contiguous) in small buffers, then :func:`_acc` into a padded
    local sum, added to ``out`` once at the end."""
    d = xT.shape[0]
    w, nv = P.shape[0], out.shape[1]
    wp, nvp = w + (-w) % 4, nv + nv % 2
    U, V, acc = np.zeros((wp, chunk)), np.zeros((nvp, chunk)), np.zeros((wp, nvp))
    for r0 in range(lo, hi, chunk):
        R = min(chunk, hi - r0)
        k = 0
        for a in range(d):
            xa = xT[a, r0 : r0 + R]
            for b in range(a, d):
                xb, vk = xT[b, r0 : r0 + R], V[k]
                for r in range(R):
                    vk[r] = xa[r] * xb[r]
                k += 1
        for c in range(w):
            sp, sq, uc = sT[P[c], r0 : r0 + R], sT[Q[c], r0 : r0 + R], U[c]
            for r in range(R):
                uc[r] = sp[r] * sq[r]
        _acc(U, V, acc, wp, nvp, R)
    for c in range(w):
        for k in range(nv):
            out[c, k] += acc[c, k]


def _moments_panel(sT, xT, y, out, chunk, lo, hi):  # pragma: no cover - compiled
    """``out[P, l * d_out + a] += sum_r s[r, P] x[r, l] y[r, a]``: ``B = phi^T y`` as (m, d * d_out), ``y``
    feature-major (d_out, rows), over the rows ``[lo, hi)``."""
    m = sT.shape[0]
    d, k_out = xT.shape[0], y.shape[0]
    nb = d * k_out
    mp, nbp = m + (-m) % 4, nb + nb % 2
    A, B, acc = np.zeros((mp, chunk)), np.zeros((nbp, chunk)), np.zeros((mp, nbp))
    for r0 in range(lo, hi, chunk):
        R = min(chunk, hi - r0)
        for p in range(m):
            sp, ap = sT[p, r0 : r0 + R], A[p]
            for r in range(R):
                ap[r] = sp[r]
        for l in range(d):
            xl = xT[l, r0 : r0 + R]
            for a in range(k_out):
                ya, bk = y[a, r0 : r0 + R], B[l * k_out + a]
                for r in range(R):
                    bk[r] = xl[r] * ya[r]
        _acc(A, B, acc, mp, nbp, R)
    for p in range(m):
        for k in range(nb):
            out[p, k] += acc[p, k]


def _flush(S, X, Y, V, U, XY, P, Q, tc, mom, R, start, carry):  # pragma: no cover - compiled
    """Add one chunk of ``R`` rows (feature-major ``X`` (d, chunk), ``Y`` (d_out, chunk)) to ``tc`` (wp, nvp) and
    ``mom`` (nbp, mq), ``B`` transposed: ``v = vech(x x^T)`` formed once in ``V`` (mp, chunk); with ``start``
    (causal) ``S`` is its running sum along the rows, restarting where ``start[r]`` (a sample's first token) and
    carried from the last chunk in ``carry``, else ``S`` (mp, chunk) is given; ``u`` is formed four columns at a
    time in ``U`` (4, chunk; stays in L1) just before :func:`_acc` runs them against all of ``v``; the moments'
    ``x (x) y`` in ``XY`` (nbp, chunk), run as the micro-kernel's ``A`` against ``s`` (its ``m`` rows padded to 2,
    not 4: 160 rather than 192 multiply-adds per row at d = 4 with 4 targets; the same sums, so the same bits).
    Padding rows of ``S``, ``V``, ``XY`` are zero, so every entry is summed by the same loops in an order fixed by
    ``R`` and the sample starts. Returns the chunk's ``sum y^2``."""
    d, k_out = X.shape[0], Y.shape[0]
    w, wp, nvp, mp = P.shape[0], tc.shape[0], tc.shape[1], S.shape[0]
    k = 0
    for a in range(d):
        for b in range(a, d):
            for r in range(R):
                V[k, r] = X[a, r] * X[b, r]
            k += 1
    if start.shape[0]:
        for k0 in range(0, mp, 4):  # four independent running sums at a time (numpy's cumsum order)
            c0, c1, c2, c3 = carry[k0], carry[k0 + 1], carry[k0 + 2], carry[k0 + 3]
            for r in range(R):
                if start[r]:
                    c0 = c1 = c2 = c3 = 0.0
                c0 += V[k0, r]
                c1 += V[k0 + 1, r]
                c2 += V[k0 + 2, r]
                c3 += V[k0 + 3, r]
                S[k0, r] = c0
                S[k0 + 1, r] = c1
                S[k0 + 2, r] = c2
                S[k0 + 3, r] = c3
            carry[k0], carry[k0 + 1], carry[k0 + 2], carry[k0 + 3] = c0, c1, c2, c3
    for i in range(0, wp, 4):
        for c in range(4):
            if i + c < w:
                p, q = P[i + c], Q[i + c]
                for r in range(R):
                    U[c, r] = S[p, r] * S[q, r]
            else:
                for r in range(R):
                    U[c, r] = 0.0
        _acc(U, V, tc[i : i + 4], 4, nvp, R)
    if k_out:
        for l in range(d):
            for a in range(k_out):
                for r in range(R):
                    XY[l * k_out + a, r] = X[l, r] * Y[a, r]
        _acc(XY, S, mom, mom.shape[0], mom.shape[1], R)
    yy = 0.0
    for a in range(k_out):  # vectorised (a serial sum per row would cost a 4-cycle latency per target)
        for r in range(R):
            yy += Y[a, r] * Y[a, r]
    return yy


def _stage(src, lens, g0, g1, buf):  # pragma: no cover - compiled
    """Copy the valid positions of samples ``[g0, g1)`` of a position-major ``src`` (n, T, k) (its stride along
    T larger than along the samples, as an einsum's output) into ``buf[: g1 - g0]`` in ``src``'s memory order:
    each position's samples are one contiguous run, so the copy streams where a sample-by-sample read would miss
    the cache once per token (measured: gathering make_mhla's position-major targets 0.029 s per 1M causal rows
    more than C-ordered ones at d = 4)."""
    T, k = src.shape[1], src.shape[2]
    for t in range(T):
        for i in range(g0, g1):
            if t < lens[i]:
                for a in range(k):
                    buf[i - g0, t, a] = src[i, t, a]


def _piece(z, lens, tg, causal, i0, i1, P, Q, tc, mom, chunk, stage_z, stage_tg):  # pragma: no cover - compiled
    """The statistics of the samples ``[i0, i1)`` in one pass over their tokens, ``chunk`` rows at a time in
    cache-sized buffers, each full chunk added by :func:`_flush` to the piece's own partials ``tc`` (wp, nvp)
    and ``mom`` (nbp, mq) (``B`` transposed). Causal: the tokens are copied feature-major and ``s`` is the
    running sum of ``v`` (restarting per sample, so a piece of whole samples is independent); last-token:
    ``s = vech(Z^T Z)`` per sample, its tokens copied feature-major, a row at a time, then each entry one
    vectorised sum over them. ``tg`` (n, T or 1, d_out): causal targets per
    position, else one row per sample. With ``stage_z`` / ``stage_tg`` (position-major ``z`` / ``tg``) the
    samples are first copied :data:`STAGE_SAMPLES` at a time by :func:`_stage` (the same values, so the same
    bits). Returns ``sum y^2`` of the piece's rows."""
    n, T, d = z.shape
    k_out = tg.shape[2]
    mp = d * (d + 1) // 2 + (-(d * (d + 1) // 2)) % 4
    S, X, Y = np.zeros((mp, chunk)), np.zeros((d, chunk)), np.zeros((k_out, chunk))
    V, U, XY = np.zeros((mp, chunk)), np.zeros((4, chunk)), np.zeros((mom.shape[0], chunk))
    start, carry = np.zeros(chunk if causal else 0, dtype=np.bool_), np.zeros(mp)
    G = STAGE_SAMPLES
    Zb = np.zeros((G if stage_z else 0, T, d), dtype=z.dtype)
    Tb = np.zeros((G if stage_tg else 0, tg.shape[1], k_out), dtype=tg.dtype)
    Zt = np.zeros((d, T))
    R, yy = 0, 0.0
    for g0 in range(i0, i1, G):
        g1 = min(i1, g0 + G)
        if stage_z:
            _stage(z, lens, g0, g1, Zb)
        if stage_tg:
            _stage(tg, lens, g0, g1, Tb)
        for i in range(g0, g1):
            L = min(max(lens[i], 0), T)
            zi = Zb[i - g0] if stage_z else z[i]
            ti = Tb[i - g0] if stage_tg else tg[i]
            if causal:
                t = 0
                while t < L:
                    cnt = min(L - t, chunk - R)
                    for j in range(cnt):
                        start[R + j] = False
                    start[R] = t == 0
                    for j in range(cnt):
                        for a in range(d):
                            X[a, R + j] = zi[t + j, a]
                        for a in range(k_out):
                            Y[a, R + j] = ti[t + j, a]
                    R, t = R + cnt, t + cnt
                    if R == chunk:
                        yy += _flush(S, X, Y, V, U, XY, P, Q, tc, mom, R, start, carry)
                        R = 0
            else:
                for a in range(d):  # the sample's tokens feature-major, then s = vech(Z^T Z) by vectorised sums
                    for t in range(L):
                        Zt[a, t] = zi[t, a]
                k = 0
                for a in range(d):
                    for b in range(a, d):
                        c = 0.0
                        for t in range(L):
                            c += Zt[a, t] * Zt[b, t]
                        S[k, R] = c
                        k += 1
                for a in range(d):
                    X[a, R] = zi[L - 1, a] if L > 0 else 0.0
                for a in range(k_out):
                    Y[a, R] = ti[0, a]
                R += 1
                if R == chunk:
                    yy += _flush(S, X, Y, V, U, XY, P, Q, tc, mom, R, start, carry)
                    R = 0
    if R:
        yy += _flush(S, X, Y, V, U, XY, P, Q, tc, mom, R, start, carry)
    return yy


def _u_panel(sT, P, Q, r0, out):  # pragma: no cover - compiled
    """``out[c, r] = sT[P[c], r0 + r] * sT[Q[c], r0 + r]``: columns of ``u = vech(s s^T)`` for the rows
    ``[r0, r0 + out.shape[1])``, column-major (one multiply per entry, so the same values as
    :func:`scaleattn.features.pair_products`)."""
    R = out.shape[1]
    for c in range(P.shape[0]):
        sp, sq, o = sT[P[c], r0 : r0 + R], sT[Q[c], r0 : r0 + R], out[c]
        for r in range(R):
            o[r] = sp[r] * sq[r]


def _expand(tc, ppos, lpos, G, p0, p1):
    """Rows ``(P, l)``, ``p0 <= P < p1``, of ``G``: ``G[P d + l, Q d + k] = tc[ppos[P, Q], lpos[l, k]]`` (a copy:
    each row of ``G`` is written once, in order; the ``Tc`` row it gathers from is 4 KB at d = 32, in cache)."""
    m, d = ppos.shape[0], lpos.shape[0]
    for P in range(p0, p1):
        for l in range(d):
            r = P * d + l
            for Q in range(m):
                t = tc[ppos[P, Q]]
                for k in range(d):
                    G[r, Q * d + k] = t[lpos[l, k]]


_COMPILE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _compile():
    global _J_BLOCK
    _J_BLOCK = 4 if wide_vectors() >= 512 else 2
    return njit_module(globals(), ("_acc", "_flush", "_stage"), KERNELS)


#: the kernels :func:`compiled` compiles (their names in numba's cache files)
KERNELS = ("_features", "_tc_panel", "_moments_panel", "_piece", "_expand", "_u_panel")


def kernels_cached() -> bool:
    """Whether numba's on-disk cache holds machine code of this module's kernels that the installed numba would
    load: an index file (``__pycache__/_compiled._piece-315.py311.nbi``, or under ``NUMBA_CACHE_DIR``) written by
    this numba version and newer than this source file, for one kernel at least. False on the first run after an
    install, an upgrade of numba or an edit of this file: the first statistics task then compiles the kernels (up
    to ~40 s on 2 busy cores), which the statistics bar says while it waits (never on later runs). Read from the
    files, without importing numba (0.5 s).

    Examples
    --------
    >>> isinstance(kernels_cached(), bool)
    True
    """
    import glob
    import importlib.metadata
    import os
    import pickle
    import sys

    try:
        version = importlib.metadata.version("numba")
        source = os.stat(__file__).st_mtime
    except (importlib.metadata.PackageNotFoundError, OSError):
        return False
    stem, tag = os.path.splitext(os.path.basename(__file__))[0], f"py{sys.version_info[0]}{sys.version_info[1]}"
    places = [os.path.join(os.path.dirname(__file__), "__pycache__")]
    if os.environ.get("NUMBA_CACHE_DIR"):
        places.append(os.path.join(os.environ["NUMBA_CACHE_DIR"], "**"))
    for place in places:
        for name in KERNELS:
            for index in glob.glob(os.path.join(place, f"{stem}.{name}-*.{tag}.nbi"), recursive=True):
                try:
                    with open(index, "rb") as f:  # numba's index: its version first, then (source stamp, entries)
                        if os.fstat(f.fileno()).st_mtime >= source and pickle.load(f) == version:
                            return True
                except (OSError, EOFError, pickle.UnpicklingError, ValueError):
                    continue
    return False


def compiled():
    """The njit-compiled functions ``(features, tc_panel, moments_panel, piece, expand, u_panel)`` (numba imported
    here, once; the first call may come from several kernel threads at once, hence the lock)."""
    with _COMPILE_LOCK:
        return _compile()


def features_t(tokens, lengths=None, causal: bool = False):
    """:func:`scaleattn.features.token_features` (numpy input), compiled and feature-major: ``(sT, xT)``,
    (m, rows) and (d, rows) float64 C-contiguous (``s = sT.T``, ``x = xT.T``)."""
    z = np.ascontiguousarray(tokens, dtype=np.float64)
    n, T, d = z.shape
    lens = np.full(n, T, dtype=np.int64) if lengths is None else np.clip(np.asarray(lengths, np.int64), 0, T)
    rows = int(lens.sum()) if causal else n
    sT, xT = np.empty((d * (d + 1) // 2, rows)), np.empty((d, rows))
    compiled()[0](z, lens, bool(causal), sT, xT)
    return sT, xT


@functools.lru_cache(maxsize=64)
def pair_columns(m: int, c0: int, c1: int):
    """``(P, Q)`` int64: the pair ``(p, q >= p)`` of each column ``c0 <= c < c1`` of ``u = vech(s s^T)``."""
    I, J = np.triu_indices(m)
    return np.ascontiguousarray(I[c0:c1], dtype=np.int64), np.ascontiguousarray(J[c0:c1], dtype=np.int64)


def tc_panel(out, sT, xT, c0: int, c1: int, rows: tuple[int, int] | None = None, chunk: int | None = None) -> None:
    """``out += u[lo:hi, c0:c1]^T v[lo:hi]`` in place (``out`` (c1 - c0, d(d+1)/2) float64 C-contiguous;
    ``rows = (lo, hi)``, default all)."""
    P, Q = pair_columns(sT.shape[0], c0, c1)
    lo, hi = (0, sT.shape[1]) if rows is None else rows
    compiled()[1](sT, xT, P, Q, out, int(chunk or CHUNK_ROWS), int(lo), int(hi))


def u_panel(out, sT, P, Q, r0: int) -> None:
    """The columns ``(P[c], Q[c])`` (a slice of :func:`pair_columns`, taken once per call: at d = 32 a kernel call
    has 546 panels) of ``u = vech(s s^T)`` for the rows ``[r0, r0 + out.shape[1])`` into ``out`` (len(P), rows')
    float64 C-contiguous (``out.T`` is the F-ordered panel the BLAS GEMM reads), from ``sT`` (m, rows) float64
    C-contiguous: the same values as :func:`scaleattn.features.pair_products` (one multiply per entry), formed in
    one compiled pass (measured at d = 16: 0.3 against 1.1 ns per entry, one thread)."""
    compiled()[5](sT, P, Q, int(r0), out)


def piece_stats(z, lens, tg, causal: bool, i0: int, i1: int, c0: int, c1: int, tc, mom, chunk: int | None = None):
    """Add samples ``[i0, i1)`` to the piece partials ``tc`` (wp, nvp) and ``mom`` (nbp, mq), ``B``
    transposed (padded to multiples of 4 rows, 2 columns; zero on entry) in one fused pass (:func:`_piece`);
    ``z`` (n, T, d) and ``tg`` (n, T or 1, d_out) float32 or float64 in any strides (read in place, each value
    converted to float64), ``lens`` (n,) int64; returns ``sum y^2``."""
    P, Q = pair_columns(z.shape[2] * (z.shape[2] + 1) // 2, c0, c1)
    return compiled()[3](z, lens, tg, bool(causal), int(i0), int(i1), P, Q, tc, mom, int(chunk or CHUNK_ROWS),
                         _position_major(z), _position_major(tg))


def _position_major(a) -> bool:
    """Whether ``a`` (n, T, k) is laid out position-major (stride along T above the stride along samples):
    :func:`_piece` then stages its samples (:func:`_stage`)."""
    return a.shape[0] > 1 and a.shape[1] > 1 and abs(a.strides[1]) > abs(a.strides[0])


def expand_rows(tc, d: int, G, p0: int, p1: int) -> None:
    """Rows ``(P, l)``, ``p0 <= P < p1`` (pairs ``P`` of ``vech`` positions), of ``G`` (psi, psi) float64
    C-contiguous from the compact Gram ``tc`` (m(m+1)/2, d(d+1)/2) float64 C-contiguous, in place: the same
    values as :func:`scaleattn.features.expand_compact_gram` (a copy, so the same bits)."""
    ppos, lpos = triu_index(n_pairs(d))[2], triu_index(d)[2]
    compiled()[4](tc, ppos, lpos, G, int(p0), int(p1))


def moments_panel(moments, sT, xT, y, rows: tuple[int, int] | None = None, chunk: int | None = None) -> None:
    """``moments += phi[lo:hi]^T y[lo:hi]`` in place (``moments`` (psi, d_out) float64, ``y`` (rows, d_out);
    ``rows = (lo, hi)``, default all)."""
    m, d = sT.shape[0], xT.shape[0]
    yT = np.ascontiguousarray(np.asarray(y, dtype=np.float64).T)
    if y.shape[1] == 0 or sT.shape[1] == 0:
        return
    out = moments if moments.flags.c_contiguous else np.zeros(moments.shape)
    lo, hi = (0, sT.shape[1]) if rows is None else rows
    compiled()[2](sT, xT, yT, out.reshape(m, d * y.shape[1]), int(chunk or CHUNK_ROWS), int(lo), int(hi))
    if out is not moments:
        moments += out
