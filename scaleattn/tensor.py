"""Tensor (2-simplicial) attention: exact streamed forward/backward and the polynomial fast path.

Math: DESIGN §8, after [C25] Y. Cao, Y. Liang, Z. Shi, Z. Song, "Training Tensor Attention Efficiently: From Cubic
to Almost Linear Time", arXiv:2405.16411 (Def. of tensor attention, §3-§4; gradient, §4-§5), which builds on the
polynomial method of J. Alman and Z. Song, "How to Capture Higher-order Correlations? Generalizing Matrix Softmax
Attention to Kronecker Computation", ICLR 2024, arXiv:2310.04064.

For Q, K1, K2, V1, V2 of shape (..., n, d) (leading axes = batch and heads):

    S[i,j,k] = s <q_i, k1_j * k2_k>,  P[i,j,k] = exp(S[i,j,k]) / sum_{j',k'} exp(S[i,j',k']),
    O_i = sum_{j,k} P[i,j,k] (v1_j * v2_k)          i.e.  Att = D^-1 A (V1 (/) V2)

with s = 1/d by default ([C25]), ``scale="sqrt"`` for 1/sqrt(d), or any finite float.

Masks (``causal`` / ``window``), our convention: with ``causal=True`` query i sees the pairs (j, k) with j <= i and
k <= i. ``window=(w1, w2)`` gives causal *windows*: i - w1 < j <= i and i - w2 < k <= i (so w = 1 means "only the
query's own position"; a ``None`` entry means unbounded on that side). A window always implies the causal mask,
whatever ``causal`` says. Every query row keeps at least the pair (i, i), so no row is empty.

Exact path: streamed over (query, key1, key2) blocks with an online softmax (running row max m_i and row sum l_i,
as in FlashAttention) so memory is O(n d + block) rather than n^3; the backward recomputes P per block from the
saved log-sum-exp. Windowed attention only visits blocks that intersect the windows: O(n w1 w2 d) time.

Fast path (``poly_*``): exp(S) is replaced by its Taylor polynomial of degree g. Because
exp(s <q, k1*k2>) = exp(sum_t x_t) with x_t = s q_t k1_t k2_t, the multinomial expansion gives
T_g(S) = sum_{|alpha|<=g} (s q)^alpha / alpha! * k1^alpha * k2^alpha = U1 (U2 (/) U3)^T with rank
r = C(d+g, g) [Alman & Song, Lemma on low-rank exp approximation; C25 §5]. With
(A (/) B)^T (C (/) D) = (A^T C) * (B^T D) the forward and all five gradients cost O(n r d) time and
O(block*r + r*d) memory. With ``causal=True`` the r x d key statistics become prefix sums over j, k <= i (and the
backward needs suffix sums over queries i >= j), still O(n r d) time, O(block*r*d + r*d) memory
(``_poly_core_causal``); finite windows are not implemented on this path. It is only accurate while the logits
are bounded (C25: |S| <= o(log n) regime); outside it
no subcubic algorithm exists under SETH, so we detect it and fall back to the exact path or refuse (``on_large``).

Error estimate (a-priori, used by ``poly_error_bound`` and ``degree="auto"``): with |S| <= B,
|T_g(x) - e^x| <= eps_g e^x for |x| <= B where eps_g = e^B B^(g+1) / (g+1)! (Lagrange remainder). If eps_g < 1 the
approximate row sums are positive and every row of the attention matrix moves by at most
||P~_i - P_i||_1 <= 2 eps_g / (1 - eps_g), so |O~ - O| <= 2 eps_g/(1 - eps_g) * max|V1| * max|V2| entrywise.

All arithmetic is float64 (DESIGN §3); outputs are cast back to the inputs' common float dtype. Arrays may be numpy
or cupy (``scaleattn._backend.get_xp``); the code path is the same.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np

from scaleattn._backend import get_xp, to_numpy

__all__ = [
    "attention",
    "attention_grad",
    "poly_attention",
    "poly_attention_grad",
    "poly_error_bound",
    "logit_bound",
    "choose_degree",
    "TensorWeights",
    "khatri_rao",
    "weight_grad",
    "train",
]

_NAMES = ("Q", "K1", "K2", "V1", "V2")
_BLOCK_ELEMS = 1 << 20  # elements of one (bq, bj, bk) logit block per batch slab: ~8 MB in float64


# ----------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------
def _validate(arrays):
    """Check a dict name -> array: same shape (..., n, d), real float dtype, finite. Return (xp, arrays, dtype)."""
    xp = get_xp(*[a for a in arrays.values() if hasattr(a, "shape")])
    out, shape, first = {}, None, None
    for name, a in arrays.items():
        if a is None:
            raise TypeError(f"{name} is required (got None)")
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            try:
                a = xp.asarray(a)
            except Exception as exc:  # ragged lists, strings, ...
                raise TypeError(f"{name} must be an array of floats, got {type(a).__name__}") from exc
        if a.dtype.kind != "f":
            raise TypeError(f"{name} must have a real floating dtype (float32 or float64), got {a.dtype}")
        if a.ndim < 2:
            raise ValueError(f"{name} must have shape (..., n, d), got shape {tuple(a.shape)}")
        if shape is None:
            shape, first = tuple(a.shape), name
            if shape[-1] == 0 or shape[-2] == 0:
                raise ValueError(f"{name} must have n >= 1 and d >= 1, got shape {shape}")
        elif tuple(a.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {shape} (the shape of {first})")
        if not bool(xp.isfinite(a).all()):
            raise ValueError(f"{name} contains non-finite values (nan or inf)")
        out[name] = a
    dtype = np.result_type(*[a.dtype for a in out.values()])
    return xp, out, dtype


def _scale(scale, d):
    """s = 1/d ([C25], default), 1/sqrt(d) for ``"sqrt"``, or the given finite float."""
    if scale is None or (isinstance(scale, str) and scale in ("1/d", "paper")):
        return 1.0 / d
    if isinstance(scale, str):
        if scale in ("sqrt", "1/sqrt(d)"):
            return 1.0 / math.sqrt(d)
        raise ValueError(f"scale must be None, 'sqrt' or a float, got {scale!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be None, 'sqrt' or a float, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _window(window, causal):
    """Return (masked, w1, w2); w = None means unbounded. A window implies the causal mask."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is None:
        return bool(causal), None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be None or a pair (w1, w2) of positive ints, got {window!r}")
    ws = []
    for name, w in zip(("w1", "w2"), window):
        if w is None:
            ws.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
            raise ValueError(f"window {name} must be a positive int or None, got {w!r}")
        ws.append(int(w))
    return True, ws[0], ws[1]


def _flat(a, xp, B, n, d):
    """(..., n, d) -> contiguous float64 (B, n, d)."""
    return xp.ascontiguousarray(xp.asarray(a, dtype=xp.float64).reshape(B, n, d))


# ----------------------------------------------------------------------------------------------------------------
# exact streamed kernel
# ----------------------------------------------------------------------------------------------------------------
def _block_sizes(n, B, masked, w1, w2, block_size):
    if block_size is not None:
        if isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool):
            bs = (int(block_size),) * 3
        else:
            bs = tuple(int(b) for b in block_size)
        if len(bs) != 3 or min(bs) < 1:
            raise ValueError(f"block_size must be a positive int or a triple (bq, bj, bk), got {block_size!r}")
        return tuple(min(b, n) for b in bs)
    if masked and (w1 is not None or w2 is not None):
        # query blocks about as long as the window: the visited key span per block is bq + w - 1
        wmin = min(w for w in (w1, w2) if w is not None)
        bq = max(1, min(n, wmin, 64))
        bj = min(n, 256, bq + (w1 - 1 if w1 is not None else n))
        bk = min(n, 256, bq + (w2 - 1 if w2 is not None else n))
    else:
        bq, bj, bk = min(n, 64), min(n, 32), min(n, 256)
    budget = max(1, _BLOCK_ELEMS // max(B, 1))
    while bq * bj * bk > budget and bq > 1:
        bq = max(1, bq // 2)
    while bq * bj * bk > budget and bj > 1:
        bj = max(1, bj // 2)
    return bq, bj, bk


def _key_blocks(i0, i1, n, b, masked, w, xp):
    """Key blocks [k0, k1) that some query in [i0, i1) can see, each with a (bq, bk) bool mask or None (all seen)."""
    lo, hi = 0, n
    if masked:
        hi = i1  # causal: k <= i <= i1 - 1
        if w is not None:
            lo = max(0, i0 - w + 1)  # k > i - w >= i0 - w
    out = []
    for k0 in range(lo, hi, b):
        k1 = min(k0 + b, hi)
        mask = None
        if masked and not (k1 - 1 <= i0 and (w is None or k0 > i1 - 1 - w)):
            i = xp.arange(i0, i1)[:, None]
            k = xp.arange(k0, k1)[None, :]
            mask = k <= i
            if w is not None:
                mask &= k > i - w
        out.append((k0, k1, mask))
    return out


def _logits(QK, K2T, k0, k1, shape, mask, xp):
    """S block (B, bq, bj, bk) = (s q_i * k1_j) . k2_k; masked entries -> -inf."""
    S = xp.matmul(QK, K2T[:, :, k0:k1]).reshape(shape)
    if mask is not None:
        S = xp.where(mask, S, -xp.inf)
    return S


def _combine(mj, mk):
    if mj is None and mk is None:
        return None
    bq = (mj if mj is not None else mk).shape[0]
    xp = get_xp(mj if mj is not None else mk)
    a = mj if mj is not None else xp.ones((bq, 1), dtype=bool)
    b = mk if mk is not None else xp.ones((bq, 1), dtype=bool)
    return a[:, :, None] & b[:, None, :]


def _exact_forward(Q, K1, K2, V1, V2, s, masked, w1, w2, bs, xp):
    """Streamed forward on float64 (B, n, d) arrays. Returns O (B, n, d) and lse (B, n) = m + log l."""
    B, n, d = Q.shape
    bq, bj, bk = bs
    K2T = xp.ascontiguousarray(K2.transpose(0, 2, 1))
    O = xp.empty((B, n, d))
    lse = xp.empty((B, n))
    for i0 in range(0, n, bq):
        i1 = min(i0 + bq, n)
        nq = i1 - i0
        m = xp.full((B, nq), -xp.inf)
        l = xp.zeros((B, nq))
        acc = xp.zeros((B, nq, d))
        kblocks = _key_blocks(i0, i1, n, bk, masked, w2, xp)
        for j0, j1, mj in _key_blocks(i0, i1, n, bj, masked, w1, xp):
            nj = j1 - j0
            QK = (s * Q[:, i0:i1, None, :] * K1[:, None, j0:j1, :]).reshape(B, nq * nj, d)
            for k0, k1, mk in kblocks:
                S = _logits(QK, K2T, k0, k1, (B, nq, nj, k1 - k0), _combine(mj, mk), xp)
                m_new = xp.maximum(m, S.max(axis=(2, 3)))
                m_safe = xp.where(xp.isfinite(m_new), m_new, 0.0)  # rows with nothing seen yet
                alpha = xp.exp(m - m_safe)
                P = xp.exp(S - m_safe[:, :, None, None])
                l = l * alpha + P.sum(axis=(2, 3))
                PV2 = xp.matmul(P.reshape(B, nq * nj, k1 - k0), V2[:, k0:k1]).reshape(B, nq, nj, d)
                acc = acc * alpha[:, :, None] + (PV2 * V1[:, None, j0:j1, :]).sum(axis=2)
                m = m_new
        O[:, i0:i1] = acc / l[:, :, None]
        lse[:, i0:i1] = m + xp.log(l)
    return O, lse


def _exact_backward(Q, K1, K2, V1, V2, O, lse, R, s, masked, w1, w2, bs, xp, xargs=None):
    """Streamed gradients of L = 1/2 ||O - E||^2 given R = O - E (DESIGN §8; C25 §4).

    F = P (<R_i, v1_j*v2_k> - w_i) is dL/dS; P is recomputed per block from lse. ``xargs = (A1, A2, A3)`` (B, n, p)
    also accumulates grad_X[a,b,c] = s sum_ijk F A1_ia A2_jb A3_kc (the paper's s A1^T F (A2 (x) A3)).
    """
    B, n, d = Q.shape
    bq, bj, bk = bs
    K2T = xp.ascontiguousarray(K2.transpose(0, 2, 1))
    V2T = xp.ascontiguousarray(V2.transpose(0, 2, 1))
    w = (O * R).sum(axis=-1)  # w_i = <O_i, R_i> = rowsum(P * (R V^T)) (identity, DESIGN §8)
    dQ, dK1, dK2 = xp.zeros_like(Q), xp.zeros_like(K1), xp.zeros_like(K2)
    dV1, dV2 = xp.zeros_like(V1), xp.zeros_like(V2)
    gX = None
    if xargs is not None:
        A1, A2, A3 = xargs
        p = A1.shape[-1]
        gX = xp.zeros((p, p, p))
    for i0 in range(0, n, bq):
        i1 = min(i0 + bq, n)
        nq = i1 - i0
        kblocks = _key_blocks(i0, i1, n, bk, masked, w2, xp)
        for j0, j1, mj in _key_blocks(i0, i1, n, bj, masked, w1, xp):
            nj = j1 - j0
            QK = (s * Q[:, i0:i1, None, :] * K1[:, None, j0:j1, :]).reshape(B, nq * nj, d)
            RV1 = (R[:, i0:i1, None, :] * V1[:, None, j0:j1, :]).reshape(B, nq * nj, d)
            H = xp.zeros((B, nq * nj, d))  # sum_k F[i,j,k] k2_k
            PV2 = xp.zeros((B, nq * nj, d))  # sum_k P[i,j,k] v2_k
            H3 = None if xargs is None else xp.zeros((B, nq * nj, A3.shape[-1]))
            for k0, k1, mk in kblocks:
                nk = k1 - k0
                S = _logits(QK, K2T, k0, k1, (B, nq, nj, nk), _combine(mj, mk), xp)
                P = xp.exp(S - lse[:, i0:i1, None, None])
                G = xp.matmul(RV1, V2T[:, :, k0:k1]).reshape(B, nq, nj, nk)
                F = (P * (G - w[:, i0:i1, None, None])).reshape(B, nq * nj, nk)
                P = P.reshape(B, nq * nj, nk)
                H += xp.matmul(F, K2[:, k0:k1])
                PV2 += xp.matmul(P, V2[:, k0:k1])
                dK2[:, k0:k1] += xp.matmul(QK.transpose(0, 2, 1), F).transpose(0, 2, 1)
                dV2[:, k0:k1] += xp.matmul(RV1.transpose(0, 2, 1), P).transpose(0, 2, 1)
                if H3 is not None:
                    H3 += xp.matmul(F, A3[:, k0:k1])
            H = H.reshape(B, nq, nj, d)
            PV2 = PV2.reshape(B, nq, nj, d)
            dQ[:, i0:i1] += s * (H * K1[:, None, j0:j1, :]).sum(axis=2)
            dK1[:, j0:j1] += s * (H * Q[:, i0:i1, None, :]).sum(axis=1)
            dV1[:, j0:j1] += (PV2 * R[:, i0:i1, None, :]).sum(axis=1)
            if H3 is not None:
                H3 = H3.reshape(B, nq, nj, -1)
                tmp = xp.einsum("bjy,bijc->biyc", A2[:, j0:j1], H3)  # sum_j A2_jb (F A3)_ijc
                gX += s * xp.einsum("bix,biyc->xyc", A1[:, i0:i1], tmp)
    return {"Q": dQ, "K1": dK1, "K2": dK2, "V1": dV1, "V2": dV2}, gX


def _prepare(arrays, scale, causal, window):
    xp, arrs, dtype = _validate(arrays)
    shape = arrs["Q"].shape
    n, d = shape[-2], shape[-1]
    B = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
    s = _scale(scale, d)
    masked, w1, w2 = _window(window, causal)
    flat = {k: _flat(v, xp, B, n, d) for k, v in arrs.items()}
    return xp, flat, dtype, shape, (B, n, d), s, (masked, w1, w2)


def attention(Q, K1, K2, V1, V2, scale=None, causal=False, window=None, *, block_size=None):
    """Exact tensor (2-simplicial) attention Att = D^-1 A (V1 (/) V2), streamed (DESIGN §8; [C25] Def. 1.1).

    Parameters
    ----------
    Q, K1, K2, V1, V2 : array (..., n, d), float32/float64, numpy or cupy, all the same shape. Leading axes are batch
        and heads and are independent.
    scale : None (s = 1/d, as in [C25]), ``"sqrt"`` (1/sqrt(d)) or a finite float.
    causal : bool. Pairs (j, k) with j <= i and k <= i only.
    window : None or (w1, w2): causal windows i - w1 < j <= i, i - w2 < k <= i (``None`` entry = unbounded);
        implies ``causal``. Cost O(n w1 w2 d) instead of O(n^3 d).
    block_size : None, int or (bq, bj, bk): block of the online softmax (memory O(B bq bj bk + n d)).

    Returns
    -------
    O : array (..., n, d) in the inputs' common float dtype (computed in float64).

    Raises
    ------
    TypeError : non-float dtype / non-array input (the message names the argument).
    ValueError : shape mismatch, ndim < 2, non-finite entries, bad window/scale.
    """
    xp, f, dtype, shape, _, s, (masked, w1, w2) = _prepare(
        {"Q": Q, "K1": K1, "K2": K2, "V1": V1, "V2": V2}, scale, causal, window)
    bs = _block_sizes(shape[-2], f["Q"].shape[0], masked, w1, w2, block_size)
    O, _ = _exact_forward(f["Q"], f["K1"], f["K2"], f["V1"], f["V2"], s, masked, w1, w2, bs, xp)
    return O.reshape(shape).astype(dtype, copy=False)


def attention_grad(Q, K1, K2, V1, V2, E, scale=None, causal=False, window=None, *, block_size=None):
    """Exact closed-form gradient of L = 1/2 ||Att - E||_F^2 (summed over batch axes), streamed.

    Formulas (DESIGN §8; [C25] §4, Lemma on the gradient of tensor attention): R = O - E, w_i = <O_i, R_i>,
    F = P (<R_i, v1_j*v2_k> - w_i); dQ_i = s sum_jk F (k1_j*k2_k), dK1_j = s sum_ik F (q_i*k2_k), dK2 symmetric,
    dV1_j = sum_ik P (R_i*v2_k), dV2 symmetric. P is recomputed per block from the saved row log-sum-exp, as in
    FlashAttention's backward: memory O(n d + block).

    Parameters as :func:`attention`; ``E`` (..., n, d) is the target.

    Returns
    -------
    (loss, grads) : float, dict with keys "Q", "K1", "K2", "V1", "V2" (arrays shaped like the inputs).
    """
    xp, f, dtype, shape, _, s, (masked, w1, w2) = _prepare(
        {"Q": Q, "K1": K1, "K2": K2, "V1": V1, "V2": V2, "E": E}, scale, causal, window)
    bs = _block_sizes(shape[-2], f["Q"].shape[0], masked, w1, w2, block_size)
    args = (f["Q"], f["K1"], f["K2"], f["V1"], f["V2"])
    O, lse = _exact_forward(*args, s, masked, w1, w2, bs, xp)
    R = O - f["E"]
    loss = 0.5 * float((R * R).sum())
    g, _ = _exact_backward(*args, O, lse, R, s, masked, w1, w2, bs, xp)
    return loss, {k: v.reshape(shape).astype(dtype, copy=False) for k, v in g.items()}


# ----------------------------------------------------------------------------------------------------------------
# polynomial (Taylor) fast path
# ----------------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _monomials(d, g):
    """Multi-indices |alpha| <= g in d variables, graded order.

    Returns a dict of numpy arrays: ``off`` (g+2,) level offsets, ``parent``/``var`` (r,) so that
    x^alpha = x^parent * x_var, ``inv_fact`` (r,) = 1/alpha!, and ``deriv`` a list over t of (idx, lower, mult):
    d x^alpha / d x_t = mult * x^lower for the alphas in idx (alpha_t >= 1).
    """
    alphas = [tuple([0] * d)]
    last = [0]
    parent, var, off = [0], [0], [0, 1]
    start = 0
    for _ in range(1, g + 1):
        stop = len(alphas)
        for a in range(start, stop):
            for t in range(last[a], d):  # non-decreasing variable sequences: each monomial once
                al = list(alphas[a])
                al[t] += 1
                alphas.append(tuple(al))
                last.append(t)
                parent.append(a)
                var.append(t)
        start = stop
        off.append(len(alphas))
    index = {a: i for i, a in enumerate(alphas)}
    inv_fact = np.array([1.0 / math.prod(math.factorial(x) for x in a) for a in alphas])
    deriv = []
    for t in range(d):
        idx, lower, mult = [], [], []
        for i, a in enumerate(alphas):
            if a[t] >= 1:
                lo = list(a)
                lo[t] -= 1
                idx.append(i)
                lower.append(index[tuple(lo)])
                mult.append(float(a[t]))
        deriv.append((np.array(idx, dtype=np.int64), np.array(lower, dtype=np.int64), np.array(mult)))
    return {"off": off, "parent": np.array(parent, dtype=np.int64), "var": np.array(var, dtype=np.int64),
            "inv_fact": inv_fact, "deriv": deriv, "r": len(alphas)}


def _mono_xp(mono, xp):
    if xp is np:
        return mono
    out = dict(mono)
    for k in ("parent", "var", "inv_fact"):
        out[k] = xp.asarray(mono[k])
    out["deriv"] = [tuple(xp.asarray(a) for a in tr) for tr in mono["deriv"]]
    return out


def _features(X, mono, xp, coef):
    """Monomial features X (B, b, d) -> U (B, b, r) with U[..., alpha] = X^alpha (times 1/alpha! if coef)."""
    r, off = mono["r"], mono["off"]
    U = xp.empty(X.shape[:-1] + (r,))
    U[..., 0] = 1.0
    par, var = mono["parent"], mono["var"]
    for lv in range(1, len(off) - 1):  # one vectorised product per degree level
        a, b = off[lv], off[lv + 1]
        U[..., a:b] = U[..., par[a:b]] * X[..., var[a:b]]
    if coef:
        U *= mono["inv_fact"]
    return U


def _chain(dU, U, mono, xp, use_mult):
    """d/dX from dL/dU through the monomial map: dX_t = sum_{alpha_t>=1} dU_alpha * mult * U_{alpha - e_t}."""
    out = xp.empty(dU.shape[:-1] + (len(mono["deriv"]),))
    for t, (idx, lower, mult) in enumerate(mono["deriv"]):
        if len(idx) == 0:
            out[..., t] = 0.0
            continue
        prod = dU[..., idx] * U[..., lower]
        if use_mult:
            prod = prod * mult
        out[..., t] = prod.sum(axis=-1)
    return out


def _log_eps(B, g):
    """log of eps_g = e^B B^(g+1) / (g+1)!: relative error of T_g vs exp on [-B, B] (Lagrange remainder)."""
    if g < 0:
        return 0.0
    if B <= 0:
        return -math.inf
    return B + (g + 1) * math.log(B) - math.lgamma(g + 2)


def _eps(B, g):
    le = _log_eps(B, g)
    return 0.0 if le == -math.inf else (math.exp(le) if le < 700 else math.inf)


def _pl1(eps):
    """Bound on ||P~_i - P_i||_1 when every entry of A has relative error <= eps (Alman & Song style)."""
    return 2.0 * eps / (1.0 - eps) if eps < 1.0 else math.inf


def logit_bound(Q, K1, K2, scale=None, *, method="cheap", block_size=None):
    """Upper bound B >= max_{i,j,k} |S[i,j,k]| over all batch entries (masks ignored, so still an upper bound).

    ``method="cheap"`` (O(n d)): the smaller of s sum_t max|q_t| max|k1_t| max|k2_t| and
    s max||q_i||_2 * min(max||k1_j||_inf max||k2_k||_2, max||k1_j||_2 max||k2_k||_inf) (Cauchy-Schwarz).
    ``method="exact"``: the actual maximum, streamed in O(n^3 d).
    """
    xp, f, dtype, shape, (B, n, d), s, _ = _prepare({"Q": Q, "K1": K1, "K2": K2}, scale, False, None)
    return _logit_bound_flat(f["Q"], f["K1"], f["K2"], s, xp, method, block_size)


def _logit_bound_flat(Q, K1, K2, s, xp, method="cheap", block_size=None):
    if method == "cheap":
        aq, a1, a2 = xp.abs(Q), xp.abs(K1), xp.abs(K2)
        b1 = float((aq.max(axis=1) * a1.max(axis=1) * a2.max(axis=1)).sum(axis=-1).max())
        nq = float(xp.sqrt((Q * Q).sum(-1)).max())
        n1, n2 = float(xp.sqrt((K1 * K1).sum(-1)).max()), float(xp.sqrt((K2 * K2).sum(-1)).max())
        b2 = nq * min(float(a1.max()) * n2, n1 * float(a2.max()))
        return abs(s) * min(b1, b2)
    if method != "exact":
        raise ValueError(f"method must be 'cheap' or 'exact', got {method!r}")
    Bt, n, d = Q.shape
    bq, bj, bk = _block_sizes(n, Bt, False, None, None, block_size)
    K2T = xp.ascontiguousarray(K2.transpose(0, 2, 1))
    best = 0.0
    for i0 in range(0, n, bq):
        for j0 in range(0, n, bj):
            QK = (s * Q[:, i0:i0 + bq, None, :] * K1[:, None, j0:j0 + bj, :]).reshape(Bt, -1, d)
            for k0 in range(0, n, bk):
                best = max(best, float(xp.abs(xp.matmul(QK, K2T[:, :, k0:k0 + bk])).max()))
    return best


def poly_error_bound(Q, K1, K2, degree, scale=None, *, method="cheap"):
    """A-priori bound on max_i ||P~_i - P_i||_1 for the degree-g Taylor fast path (inf if the bound is void).

    With B = :func:`logit_bound` and eps_g = e^B B^(g+1)/(g+1)! (Taylor remainder), the bound is
    2 eps_g / (1 - eps_g) (valid for eps_g < 1, which also guarantees positive approximate row sums). The output
    error is then at most ``bound * max|V1| * max|V2|`` entrywise. [Alman & Song 2024, arXiv:2310.04064; C25 §5.]
    """
    g = _check_degree(degree)
    xp, f, dtype, shape, (B, n, d), s, _ = _prepare({"Q": Q, "K1": K1, "K2": K2}, scale, False, None)
    Bl = _logit_bound_flat(f["Q"], f["K1"], f["K2"], s, xp, method)
    return _pl1(_eps(Bl, g))


def _check_degree(degree):
    if isinstance(degree, bool) or not isinstance(degree, (int, np.integer)) or degree < 1:
        raise ValueError(f"degree must be 'auto' or an int >= 1, got {degree!r}")
    return int(degree)


def choose_degree(logit_max, d, tol, vmax=1.0, *, max_degree=40, max_rank=200_000):
    """Smallest g >= 1 with 2 eps_g/(1-eps_g) * vmax <= tol and C(d+g, g) <= max_rank, or None if there is none."""
    for g in range(1, max_degree + 1):
        if math.comb(d + g, g) > max_rank:
            return None
        if _pl1(_eps(logit_max, g)) * vmax <= tol:
            return g
    return None


class _LargeLogits(Exception):
    pass


def _plan_poly(f, s, xp, degree, tol, max_degree, max_rank):
    """Pick g and compute the a-priori estimate; raise _LargeLogits(message) outside the polynomial regime."""
    Bt, n, d = f["Q"].shape
    Bl = _logit_bound_flat(f["Q"], f["K1"], f["K2"], s, xp)
    vmax = float(xp.abs(f["V1"]).max()) * float(xp.abs(f["V2"]).max())
    if isinstance(degree, str):
        if degree != "auto":
            raise ValueError(f"degree must be 'auto' or an int >= 1, got {degree!r}")
        tol_ = 1e-6 if tol is None else float(tol)
        g = choose_degree(Bl, d, tol_, max(vmax, 1e-300), max_degree=max_degree, max_rank=max_rank)
        if g is None:
            raise _LargeLogits(
                f"max |logit| <= {Bl:.4g} (bound s*max|q|*max|k1*k2|): no degree <= {max_degree} with rank "
                f"<= {max_rank} reaches the output error tol {tol_:.3g} (Taylor bound e^B B^(g+1)/(g+1)!)")
    else:
        g = _check_degree(degree)
    eps = _eps(Bl, g)
    pl1 = _pl1(eps)
    out_bound = pl1 * vmax
    if eps >= 0.5 or (tol is not None and out_bound > float(tol)):
        what = f"tol {float(tol):.3g}" if tol is not None else "the regime limit eps_g < 1/2"
        raise _LargeLogits(
            f"max |logit| <= {Bl:.4g} (bound s*max|q|*max|k1*k2|) is too large for degree {g}: Taylor relative "
            f"error bound eps_g = {eps:.3g}, output error bound {out_bound:.3g} exceeds {what}")
    return {"degree": g, "rank": math.comb(d + g, g), "logit_bound": Bl, "eps": eps, "p_l1_bound": pl1,
            "out_bound": out_bound, "vmax": vmax}


def _poly_rows(r, B, block_size):
    if block_size is not None:
        return max(1, int(block_size if np.isscalar(block_size) else block_size[0]))
    return max(1, _BLOCK_ELEMS // (4 * max(B, 1) * r))


def _poly_core(f, s, g, xp, want_grad, block_size=None, xargs=None, causal=False):
    """O(n r d) forward (and backward) of the Taylor model; f holds float64 (B, n, d) arrays.

    Returns dict with O, minD and (if want_grad) the five gradients, loss and the per-row quantities used by the
    error estimate. Uses (A (/) B)^T (C (/) D) = (A^T C) * (B^T D) [C25 §5]: the key side collapses to
    C2 = U2^T V1, C3 = U3^T V2, c2 = U2^T 1, c3 = U3^T 1 (r x d each), so nothing n^2-sized is formed.
    ``causal=True``: prefix-sum variant, :func:`_poly_core_causal`.
    """
    if causal:
        return _poly_core_causal(f, s, g, xp, want_grad, block_size, xargs)
    Q, K1, K2, V1, V2 = (f[k] for k in _NAMES)
    Bt, n, d = Q.shape
    mono = _mono_xp(_monomials(d, g), xp)
    r = mono["r"]
    b = _poly_rows(r, Bt, block_size)
    C2 = xp.zeros((Bt, r, d)); C3 = xp.zeros((Bt, r, d))
    c2 = xp.zeros((Bt, r)); c3 = xp.zeros((Bt, r))
    for j0 in range(0, n, b):  # key side: U2 = k1^alpha, U3 = k2^alpha (coefficients live in U1)
        U2 = _features(K1[:, j0:j0 + b], mono, xp, False)
        U3 = _features(K2[:, j0:j0 + b], mono, xp, False)
        C2 += xp.matmul(U2.transpose(0, 2, 1), V1[:, j0:j0 + b]); c2 += U2.sum(axis=1)
        C3 += xp.matmul(U3.transpose(0, 2, 1), V2[:, j0:j0 + b]); c3 += U3.sum(axis=1)
    CC, cc = C2 * C3, c2 * c3
    O = xp.empty((Bt, n, d)); D = xp.empty((Bt, n))
    out = {}
    if want_grad:
        E = f["E"]
        dQ = xp.empty((Bt, n, d))
        M1 = xp.zeros((Bt, r, d)); m1 = xp.zeros((Bt, r))
        if xargs is not None:
            A1, A2, A3 = xargs
            p = A1.shape[-1]
            P1 = xp.zeros((Bt, r, d, p)); p1 = xp.zeros((Bt, r, p))
    for i0 in range(0, n, b):  # query side: U1 = (s q)^alpha / alpha!
        sl = slice(i0, i0 + b)
        U1 = _features(s * Q[:, sl], mono, xp, True)
        Di = xp.matmul(U1, cc[:, :, None])[..., 0]
        Oi = xp.matmul(U1, CC) / Di[..., None]
        O[:, sl], D[:, sl] = Oi, Di
        if want_grad:  # O_i depends on row i only, so R_i is available here: one pass for forward + dQ
            Ri = Oi - E[:, sl]
            wi = (Oi * Ri).sum(axis=-1)
            dU1 = (xp.matmul(Ri, CC.transpose(0, 2, 1)) - wi[..., None] * cc[:, None, :]) / Di[..., None]
            dQ[:, sl] = s * _chain(dU1, U1, mono, xp, False)  # d/dq (sq)^a/a! = s (sq)^(a-e_t)/(a-e_t)!
            Ut = U1 / Di[..., None]
            M1 += xp.matmul(Ut.transpose(0, 2, 1), Ri)
            m1 += xp.matmul(Ut.transpose(0, 2, 1), wi[..., None])[..., 0]
            if xargs is not None:
                P1 += xp.einsum("bir,bit,bia->brta", Ut, Ri, A1[:, sl])
                p1 += xp.einsum("bir,bi,bia->bra", Ut, wi, A1[:, sl])
    out["O"], out["D"] = O, D
    out["minD"] = float(D.min())
    if not want_grad:
        return out
    W3, W2 = M1 * C3, M1 * C2
    w3, w2 = m1 * c3, m1 * c2
    dK1, dK2 = xp.empty((Bt, n, d)), xp.empty((Bt, n, d))
    dV1, dV2 = xp.empty((Bt, n, d)), xp.empty((Bt, n, d))
    if xargs is not None:
        P2 = xp.zeros((Bt, r, d, p)); P3 = xp.zeros((Bt, r, d, p))
        p2 = xp.zeros((Bt, r, p)); p3 = xp.zeros((Bt, r, p))
    for j0 in range(0, n, b):
        sl = slice(j0, j0 + b)
        U2 = _features(K1[:, sl], mono, xp, False)
        U3 = _features(K2[:, sl], mono, xp, False)
        # dL/dU2[j,a] = sum_t v1_jt M1[a,t] C3[a,t] - m1[a] c3[a]  (and symmetric for U3)
        dU2 = xp.matmul(V1[:, sl], W3.transpose(0, 2, 1)) - w3[:, None, :]
        dU3 = xp.matmul(V2[:, sl], W2.transpose(0, 2, 1)) - w2[:, None, :]
        dK1[:, sl] = _chain(dU2, U2, mono, xp, True)
        dK2[:, sl] = _chain(dU3, U3, mono, xp, True)
        dV1[:, sl] = xp.matmul(U2, W3)
        dV2[:, sl] = xp.matmul(U3, W2)
        if xargs is not None:
            P2 += xp.einsum("bjr,bjt,bja->brta", U2, V1[:, sl], A2[:, sl])
            P3 += xp.einsum("bjr,bjt,bja->brta", U3, V2[:, sl], A3[:, sl])
            p2 += xp.matmul(U2.transpose(0, 2, 1), A2[:, sl])
            p3 += xp.matmul(U3.transpose(0, 2, 1), A3[:, sl])
    R = O - E
    out["R"] = R
    out["loss"] = 0.5 * float((R * R).sum())
    out["grads"] = {"Q": dQ, "K1": dK1, "K2": dK2, "V1": dV1, "V2": dV2}
    if xargs is not None:
        # grad_X[a,b,c] = s sum_alpha sum_t P1[a,t,.] P2[a,t,.] P3[a,t,.] - s sum_alpha p1 p2 p3 (per batch entry)
        T12 = (P1[..., :, None] * P2[..., None, :]).reshape(Bt * r * d, p * p)
        gX = xp.matmul(T12.T, P3.reshape(Bt * r * d, p)).reshape(p, p, p)
        t12 = (p1[..., :, None] * p2[..., None, :]).reshape(Bt * r, p * p)
        gX -= xp.matmul(t12.T, p3.reshape(Bt * r, p)).reshape(p, p, p)
        out["gX"] = s * gX
    return out


def _poly_core_causal(f, s, g, xp, want_grad, block_size=None, xargs=None):
    """Causal (j <= i, k <= i) variant of :func:`_poly_core`: O(n r d) time, O(b r d (p^2) + (n/b) r d) memory.

    Query i uses the prefix statistics C2^(i) = sum_{j<=i} U2_j (x) v1_j, C3^(i) = sum_{k<=i} U3_k (x) v2_k and
    c2^(i), c3^(i): N_i = U1_i (C2^(i) * C3^(i)), D_i = U1_i . (c2^(i) * c3^(i)), O_i = N_i / D_i. Rows go in
    blocks of b, in order; the running sums are carried and a cumsum inside the block gives the per-row prefixes,
    so the largest object is one (B, b, r, d) block (never (n, r, d)).

    Backward (chain rule through the same model; DESIGN §8, [C25] §5): dU1_i = (C^(i) R_i - w_i c^(i)) / D_i with
    C^(i) = C2^(i) * C3^(i), c^(i) = c2^(i) * c3^(i) (pass 1, with dQ). With Ut_i = U1_i / D_i, Z_i = Ut_i (x) R_i,
    the key side needs suffix sums over the queries i >= j that see key j:
    T2_j = sum_{i>=j} Z_i * C3^(i), t2_j = sum_{i>=j} Ut_i w_i c3^(i) (T3, t3 the same with C2, c2), then
    dU2_j = T2_j v1_j - t2_j, dV1_j = U2_j T2_j (and U3/V2 symmetrically). They are accumulated in a second pass
    over the blocks in reverse order, from each block's starting prefixes saved in pass 1 (O((n/b) r d) memory;
    no subtraction of prefixes, so no cancellation). ``xargs``: grad_X =
    s sum_i [sum_{a,t} Z_i[a,t] A1_i (x) P2^(i)[a,t] (x) P3^(i)[a,t] - sum_a Ut_ia w_i A1_i (x) p2^(i)[a] (x) p3^(i)[a]]
    with the prefixes P2^(i)[a,t,:] = sum_{j<=i} U2_ja v1_jt A2_j, p2^(i)[a,:] = sum_{j<=i} U2_ja A2_j (pass 1).
    """
    Q, K1, K2, V1, V2 = (f[k] for k in _NAMES)
    Bt, n, d = Q.shape
    mono = _mono_xp(_monomials(d, g), xp)
    r = mono["r"]
    p = 0 if xargs is None else xargs[0].shape[-1]
    b = _poly_rows(r * (d + 1) * max(1, p * p), Bt, block_size)  # ~10 (B, b, r, d[, p, p]) blocks live at once

    def prefix(Y, carry):  # inclusive prefix sums over the rows of the block plus the carried sum
        return xp.cumsum(Y, axis=1) + carry[:, None]

    def suffix(Y, carry):  # inclusive suffix sums over the rows of the block plus the carried sum
        return xp.cumsum(Y[:, ::-1], axis=1)[:, ::-1] + carry[:, None]

    C2, C3 = xp.zeros((Bt, r, d)), xp.zeros((Bt, r, d))
    c2, c3 = xp.zeros((Bt, r)), xp.zeros((Bt, r))
    O, D = xp.empty((Bt, n, d)), xp.empty((Bt, n))
    if want_grad:
        E = f["E"]
        dQ = xp.empty((Bt, n, d))
    if xargs is not None:
        A1, A2, A3 = xargs
        P2, P3 = xp.zeros((Bt, r, d, p)), xp.zeros((Bt, r, d, p))
        p2, p3 = xp.zeros((Bt, r, p)), xp.zeros((Bt, r, p))
        gX = xp.zeros((p, p, p))
    starts = []  # each block's carried prefixes, for pass 2 (O((n / b) r d): no subtraction, no n eps error)
    for i0 in range(0, n, b):  # pass 1, rows in order: forward, dQ and the grad_X prefixes
        sl = slice(i0, i0 + b)
        if want_grad:
            starts.append((C2, C3, c2, c3))
        U2 = _features(K1[:, sl], mono, xp, False)
        U3 = _features(K2[:, sl], mono, xp, False)
        C2i = prefix(U2[..., None] * V1[:, sl, None, :], C2)
        C3i = prefix(U3[..., None] * V2[:, sl, None, :], C3)
        c2i, c3i = prefix(U2, c2), prefix(U3, c3)
        C2, C3, c2, c3 = C2i[:, -1], C3i[:, -1], c2i[:, -1], c3i[:, -1]
        U1 = _features(s * Q[:, sl], mono, xp, True)
        CCi, cci = C2i * C3i, c2i * c3i
        Di = (U1 * cci).sum(axis=-1)
        Oi = xp.matmul(U1[:, :, None, :], CCi)[:, :, 0] / Di[..., None]
        O[:, sl], D[:, sl] = Oi, Di
        if not want_grad:
            continue
        Ri = Oi - E[:, sl]
        wi = (Oi * Ri).sum(axis=-1)
        dU1 = (xp.matmul(CCi, Ri[..., None])[..., 0] - wi[..., None] * cci) / Di[..., None]
        dQ[:, sl] = s * _chain(dU1, U1, mono, xp, False)
        if xargs is not None:
            P2i = prefix(U2[..., None, None] * V1[:, sl, None, :, None] * A2[:, sl, None, None, :], P2)
            P3i = prefix(U3[..., None, None] * V2[:, sl, None, :, None] * A3[:, sl, None, None, :], P3)
            p2i = prefix(U2[..., None] * A2[:, sl, None, :], p2)
            p3i = prefix(U3[..., None] * A3[:, sl, None, :], p3)
            P2, P3, p2, p3 = P2i[:, -1], P3i[:, -1], p2i[:, -1], p3i[:, -1]
            Ut = U1 / Di[..., None]
            W = (Ut[..., None] * Ri[:, :, None, :])[..., None] * P2i  # (B, b, r, d, p_y)
            L = (A1[:, sl, None, None, :, None] * W[..., None, :]).reshape(-1, p * p)
            gX += xp.matmul(L.T, P3i.reshape(-1, p)).reshape(p, p, p)
            w2 = (Ut * wi[..., None])[..., None] * p2i  # (B, b, r, p_y)
            L = (A1[:, sl, None, :, None] * w2[..., None, :]).reshape(-1, p * p)
            gX -= xp.matmul(L.T, p3i.reshape(-1, p)).reshape(p, p, p)
    out = {"O": O, "D": D, "minD": float(D.min())}
    if not want_grad:
        return out
    T2, T3 = xp.zeros((Bt, r, d)), xp.zeros((Bt, r, d))  # suffix sums over the queries after the block
    t2, t3 = xp.zeros((Bt, r)), xp.zeros((Bt, r))
    dK1, dK2, dV1, dV2 = (xp.empty((Bt, n, d)) for _ in range(4))
    for i0, (C2, C3, c2, c3) in zip(reversed(range(0, n, b)), reversed(starts)):  # pass 2, rows in reverse order
        sl = slice(i0, i0 + b)
        U2 = _features(K1[:, sl], mono, xp, False)
        U3 = _features(K2[:, sl], mono, xp, False)
        cs2 = xp.cumsum(U2[..., None] * V1[:, sl, None, :], axis=1)
        cs3 = xp.cumsum(U3[..., None] * V2[:, sl, None, :], axis=1)
        ds2, ds3 = xp.cumsum(U2, axis=1), xp.cumsum(U3, axis=1)
        # prefixes per row of the block: the block's start (saved in pass 1) plus the in-block cumsum
        C2i, C3i, c2i, c3i = cs2 + C2[:, None], cs3 + C3[:, None], ds2 + c2[:, None], ds3 + c3[:, None]
        Ut = _features(s * Q[:, sl], mono, xp, True) / D[:, sl, None]
        Oi = O[:, sl]
        Ri = Oi - E[:, sl]
        uw = Ut * (Oi * Ri).sum(axis=-1)[..., None]
        Z = Ut[..., None] * Ri[:, :, None, :]
        T2i, T3i = suffix(Z * C3i, T2), suffix(Z * C2i, T3)
        t2i, t3i = suffix(uw * c3i, t2), suffix(uw * c2i, t3)
        T2, T3, t2, t3 = T2i[:, 0], T3i[:, 0], t2i[:, 0], t3i[:, 0]
        dU2 = xp.matmul(T2i, V1[:, sl, :, None])[..., 0] - t2i
        dU3 = xp.matmul(T3i, V2[:, sl, :, None])[..., 0] - t3i
        dK1[:, sl] = _chain(dU2, U2, mono, xp, True)
        dK2[:, sl] = _chain(dU3, U3, mono, xp, True)
        dV1[:, sl] = xp.matmul(U2[:, :, None, :], T2i)[:, :, 0]
        dV2[:, sl] = xp.matmul(U3[:, :, None, :], T3i)[:, :, 0]
    R = O - E
    out["R"] = R
    out["loss"] = 0.5 * float((R * R).sum())
    out["grads"] = {"Q": dQ, "K1": dK1, "K2": dK2, "V1": dV1, "V2": dV2}
    if xargs is not None:
        out["gX"] = s * gX
    return out


def _poly_grad_bounds(f, s, plan, R, O, xp):
    """Rigorous a-posteriori-from-a-priori bounds on the entrywise error of the five poly gradients.

    With pi = 2 eps_g/(1-eps_g), gamma = (eps_{g-1} + eps_g)/(1 - eps_g) (the gradients see T_{g-1} = T_g'),
    U = max|V1| max|V2|, dO_1 <= d pi U per row: per row i the l1 error of F~ - F is at most
    e_i = gamma (||R~_i||_1 U + |w~_i|) + dO_1 U + dO_1 (||R~_i||_inf + U). Then
    |d dQ| <= s max|K1| max|K2| max_i e_i, |d dK1| <= s max|Q| max|K2| sum_i e_i (K2 symmetric),
    |d dV1| <= max|V2| sum_i pi (||R~_i||_inf + U) (V2 symmetric); max over batch entries.
    """
    g, U = plan["degree"], plan["vmax"]
    eg = plan["eps"]
    eg1 = _eps(plan["logit_bound"], g - 1)
    pi = plan["p_l1_bound"]
    gam = (eg1 + eg) / (1.0 - eg)
    d = f["Q"].shape[-1]
    dO1 = d * pi * U
    w = xp.abs((O * R).sum(-1))
    R1, Rinf = xp.abs(R).sum(-1), xp.abs(R).max(-1)
    e = gam * (R1 * U + w) + dO1 * U + dO1 * (Rinf + U)  # (B, n)
    ev = pi * (Rinf + U)
    mx = {k: float(xp.abs(f[k]).max()) for k in _NAMES}
    esum, emax, evsum = float(e.sum(-1).max()), float(e.max()), float(ev.sum(-1).max())
    return {"Q": abs(s) * mx["K1"] * mx["K2"] * emax,
            "K1": abs(s) * mx["Q"] * mx["K2"] * esum,
            "K2": abs(s) * mx["Q"] * mx["K1"] * esum,
            "V1": mx["V2"] * evsum, "V2": mx["V1"] * evsum,
            "_row_e_total": float(e.sum())}


def _poly_args(on_large, causal, window):
    if on_large not in ("exact", "raise"):
        raise ValueError(f"on_large must be 'exact' or 'raise', got {on_large!r}")
    masked, w1, w2 = _window(window, causal)
    if w1 is not None or w2 is not None:
        raise NotImplementedError(
            "the polynomial path supports causal=True but not window=(w1, w2) with a finite w1 or w2 (the windowed "
            "prefix-difference variant is not implemented); use the exact attention(..., window=(w1, w2)), which is "
            "O(n w1 w2 d)")
    return masked


def _large(msg, on_large, info):
    if on_large == "raise":
        raise ValueError("tensor attention: " + msg)
    warnings.warn("tensor attention: " + msg + "; falling back to the exact O(n^3 d) path", RuntimeWarning,
                  stacklevel=3)
    if info is not None:
        info.update(path="exact", reason=msg)


def poly_attention(Q, K1, K2, V1, V2, scale=None, causal=False, window=None, *, degree="auto", tol=None,
                   on_large="exact", max_degree=40, max_rank=200_000, info=None, block_size=None):
    """Fast tensor attention via the degree-g Taylor polynomial of exp ([Alman & Song 2024]; [C25] §5; DESIGN §8).

    Same inputs/output as :func:`attention`. Time O(n r d), memory O(block r + r d), r = C(d+g, g).
    causal : bool. ``True``: prefix sums of the key statistics over j, k <= i (same mask as :func:`attention`),
        still O(n r d) time, memory O(block r d + r d) (see ``_poly_core_causal``); the error bounds are unchanged
        (the per-entry bound holds for any subset of keys).
    window : only None or (None, None) (= causal); a finite w1 or w2 raises NotImplementedError.

    degree : int >= 1 or ``"auto"`` (smallest g whose a-priori output bound is <= ``tol``, default tol 1e-6).
    tol : float or None. With an explicit degree, ``tol`` (if given) is the allowed output error bound.
    on_large : ``"exact"`` (default: warn with RuntimeWarning and compute the exact attention) or ``"raise"``
        (ValueError naming the logit bound and the error bound) when the logits are outside the polynomial regime:
        eps_g >= 1/2, the bound exceeds ``tol``, no degree reaches ``tol``, or an approximate row sum is <= 0.
    info : optional dict, filled with path ("poly"/"exact"), degree, rank, logit_bound, eps (relative entry error
        bound), p_l1_bound (row l1 bound on P), out_bound (entrywise |O~ - O| bound), min_rowsum.
    """
    masked = _poly_args(on_large, causal, window)
    xp, f, dtype, shape, _, s, _ = _prepare({"Q": Q, "K1": K1, "K2": K2, "V1": V1, "V2": V2}, scale, False, None)
    try:
        plan = _plan_poly(f, s, xp, degree, tol, max_degree, max_rank)
        res = _poly_core(f, s, plan["degree"], xp, False, block_size, causal=masked)
        if not (res["minD"] > 0 and math.isfinite(res["minD"])):  # positivity guard on the row sums
            raise _LargeLogits(f"approximate row sum {res['minD']:.3g} <= 0 at degree {plan['degree']} "
                               f"(logit bound {plan['logit_bound']:.4g})")
    except _LargeLogits as exc:
        _large(str(exc), on_large, info)
        return attention(Q, K1, K2, V1, V2, scale=scale, causal=masked, block_size=None)
    if info is not None:
        info.update(path="poly", min_rowsum=res["minD"], **{k: v for k, v in plan.items() if k != "vmax"})
    return res["O"].reshape(shape).astype(dtype, copy=False)


def poly_attention_grad(Q, K1, K2, V1, V2, E, scale=None, causal=False, window=None, *, degree="auto", tol=None,
                        on_large="exact", max_degree=40, max_rank=200_000, info=None, block_size=None):
    """Loss and the five gradients of L = 1/2 ||Att~ - E||^2 for the Taylor model, in O(n r d) ([C25] §5).

    These are the exact gradients of the polynomial model (features U1 = (s q)^alpha/alpha!, U2 = k1^alpha,
    U3 = k2^alpha, chain rule through the monomials), computed with the Khatri-Rao identity so no n^2 object is
    formed. Same signature/return as :func:`attention_grad`, options as :func:`poly_attention`. ``info`` also gets
    ``grad_bound``: dict of entrywise bounds on |grad~ - grad| per tensor (see ``_poly_grad_bounds``).
    ``causal=True``: gradients of the causal Taylor model, O(n r d) with a second pass over the rows in reverse
    order for the key side (suffix sums over queries i >= j; formulas in ``_poly_core_causal``).
    """
    masked = _poly_args(on_large, causal, window)
    xp, f, dtype, shape, _, s, _ = _prepare(
        {"Q": Q, "K1": K1, "K2": K2, "V1": V1, "V2": V2, "E": E}, scale, False, None)
    try:
        plan = _plan_poly(f, s, xp, degree, tol, max_degree, max_rank)
        res = _poly_core(f, s, plan["degree"], xp, True, block_size, causal=masked)
        if not (res["minD"] > 0 and math.isfinite(res["minD"])):
            raise _LargeLogits(f"approximate row sum {res['minD']:.3g} <= 0 at degree {plan['degree']} "
                               f"(logit bound {plan['logit_bound']:.4g})")
    except _LargeLogits as exc:
        _large(str(exc), on_large, info)
        return attention_grad(Q, K1, K2, V1, V2, E, scale=scale, causal=masked)
    if info is not None:
        gb = _poly_grad_bounds(f, s, plan, res["R"], res["O"], xp)
        gb.pop("_row_e_total")
        info.update(path="poly", min_rowsum=res["minD"], grad_bound=gb,
                    **{k: v for k, v in plan.items() if k != "vmax"})
    return res["loss"], {k: v.reshape(shape).astype(dtype, copy=False) for k, v in res["grads"].items()}


# ----------------------------------------------------------------------------------------------------------------
# parameters, X and weight gradients
# ----------------------------------------------------------------------------------------------------------------
def khatri_rao(A, B):
    """Column-wise Khatri-Rao product A (/) B: (p, d), (q, d) -> (p*q, d), row b*q + c = A[b] * B[c]."""
    return (A[:, None, :] * B[None, :, :]).reshape(A.shape[0] * B.shape[0], A.shape[1])


@dataclass
class TensorWeights:
    """Weights of one tensor-attention head: Q = A1 W_Q, K1 = A2 W_K1, K2 = A3 W_K2, V1 = A4 W_V1, V2 = A5 W_V2.

    Each is (p, d) (p = input width, d = attention width). ``X()`` is [C25]'s X = W_Q (W_K1 (/) W_K2)^T (p, p^2).
    """

    W_Q: object
    W_K1: object
    W_K2: object
    W_V1: object
    W_V2: object

    def X(self):
        return self.W_Q @ khatri_rao(self.W_K1, self.W_K2).T

    def as_dict(self):
        return {fl.name: getattr(self, fl.name) for fl in fields(self)}

    @classmethod
    def random(cls, p, d, *, scale=1.0, seed=0):
        """Gaussian N(0, scale^2/p) weights (numpy float64)."""
        rng = np.random.default_rng(seed)
        return cls(*[rng.normal(0.0, scale / math.sqrt(p), (p, d)) for _ in range(5)])


_WNAMES = ("W_Q", "W_K1", "W_K2", "W_V1", "W_V2")


def weight_grad(A1, A2, A3, A4, A5, W, E, scale=None, causal=False, window=None, *, path="exact", degree="auto",
                tol=None, on_large="exact", with_x=True, info=None, block_size=None):
    """Loss and gradients w.r.t. the weights and [C25]'s X for one or a batch of sequences.

    A1..A5 : (..., n, p) inputs (self-attention: pass the same array five times); W : :class:`TensorWeights` with
    (p, d) matrices; E : (..., n, d) target. L = 1/2 sum over batch of ||Att - E||_F^2, Att computed from
    Q = A1 W_Q, ..., V2 = A5 W_V2 with scale s (default 1/d).

    path : "exact" (streamed, any mask) or "poly" (Taylor fast path, options degree/tol/on_large/info as in
    :func:`poly_attention_grad`; ``causal=True`` supported, grad_X included, a finite window raises
    NotImplementedError).

    Returns (loss, grads) with grads "W_Q", "W_K1", "W_K2", "W_V1", "W_V2" (chain rule: dW_Q = sum A1^T dQ, ...)
    and, if ``with_x``, "X" (p, p^2) = s A1^T F (A2 (x) A3) summed over the batch ([C25] §4; DESIGN §8): the
    gradient of L as a function of X (row a, column b*p + c). Inputs and weights are used in float64; outputs are
    float64.
    """
    if path not in ("exact", "poly"):
        raise ValueError(f"path must be 'exact' or 'poly', got {path!r}")
    if not isinstance(W, TensorWeights):
        raise TypeError(f"W must be a TensorWeights, got {type(W).__name__}")
    xp, A, _ = _validate({"A1": A1, "A2": A2, "A3": A3, "A4": A4, "A5": A5})
    xpw, Wd, _ = _validate(W.as_dict())
    Wd = {k: xp.asarray(v, dtype=xp.float64) for k, v in Wd.items()}
    if any(w.ndim != 2 or w.shape != Wd["W_Q"].shape for w in Wd.values()):
        raise ValueError("all weights must be 2-d with the same shape (p, d)")
    p, d = Wd["W_Q"].shape
    shape = A["A1"].shape
    if shape[-1] != p:
        raise ValueError(f"A1..A5 have width {shape[-1]} but the weights expect p = {p}")
    n = shape[-2]
    Bt = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
    Af = {k: _flat(v, xp, Bt, n, p) for k, v in A.items()}
    xp_, Ev, _ = _validate({"E": E})
    if tuple(Ev["E"].shape) != tuple(shape[:-1]) + (d,):
        raise ValueError(f"E has shape {tuple(Ev['E'].shape)}, expected {tuple(shape[:-1]) + (d,)}")
    f = {nm: xp.matmul(Af[a], Wd[w]) for nm, a, w in zip(_NAMES, ("A1", "A2", "A3", "A4", "A5"), _WNAMES)}
    f["E"] = _flat(Ev["E"], xp, Bt, n, d)
    s = _scale(scale, d)
    masked, w1, w2 = _window(window, causal)
    xargs = (Af["A1"], Af["A2"], Af["A3"]) if with_x else None
    gX = None
    if path == "poly":
        if on_large not in ("exact", "raise"):
            raise ValueError(f"on_large must be 'exact' or 'raise', got {on_large!r}")
        _poly_args(on_large, causal, window)  # causal is supported (with grad_X), finite windows are not
        try:
            plan = _plan_poly(f, s, xp, degree, tol, max_degree=40, max_rank=200_000)
            res = _poly_core(f, s, plan["degree"], xp, True, block_size, xargs, causal=masked)
            if not (res["minD"] > 0 and math.isfinite(res["minD"])):
                raise _LargeLogits(f"approximate row sum {res['minD']:.3g} <= 0 at degree {plan['degree']}")
            loss, g, gX = res["loss"], res["grads"], res.get("gX")
            if info is not None:
                info.update(path="poly", min_rowsum=res["minD"], **{k: v for k, v in plan.items() if k != "vmax"})
        except _LargeLogits as exc:
            _large(str(exc), on_large, info)
            path = "exact"
    if path == "exact":
        if info is not None:
            info.setdefault("path", "exact")
        bs = _block_sizes(n, Bt, masked, w1, w2, block_size)
        args = tuple(f[k] for k in _NAMES)
        O, lse = _exact_forward(*args, s, masked, w1, w2, bs, xp)
        R = O - f["E"]
        loss = 0.5 * float((R * R).sum())
        g, gX = _exact_backward(*args, O, lse, R, s, masked, w1, w2, bs, xp, xargs)
    grads = {w: xp.einsum("bnp,bnd->pd", Af[a], g[nm])
             for nm, a, w in zip(_NAMES, ("A1", "A2", "A3", "A4", "A5"), _WNAMES)}
    if with_x:
        grads["X"] = gX.reshape(p, p * p)
    return loss, grads


# ----------------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------------
def _batch_grad(batch, W, kw):
    """Worker function (top level so Dask can pickle it): sum of loss and weight gradients over one batch."""
    A, E = batch
    loss, g = weight_grad(*A, W, E, with_x=False, **kw)
    return loss, {k: to_numpy(v) for k, v in g.items()}


def train(A, E, W0, *, steps=100, lr=1e-2, optimizer="adam", path="exact", degree="auto", tol=None,
          on_large="exact", scale=None, causal=False, window=None, batch_size=None, client=None,
          betas=(0.9, 0.999), adam_eps=1e-8, callback=None):
    """Full-batch gradient descent or Adam on the weights W = (W_Q, W_K1, W_K2, W_V1, W_V2).

    (X = W_Q (W_K1 (/) W_K2)^T of [C25] is trained through its factors; ``weight_grad`` also gives grad_X.)

    A : (N, n, p) array (self-attention: A1 = ... = A5 = A) or a tuple of five (N, n, p) arrays.
    E : (N, n, d) targets. W0 : :class:`TensorWeights` (not modified).
    The objective is the mean over the N sequences of 1/2 ||Att - E||_F^2. Each step sums per-batch gradients over
    ``batch_size`` sequences (all N if None); with a ``distributed.Client`` the batches are scattered once and the
    per-batch gradients are computed with ``client.map`` and summed here, else locally.
    path : "exact" or "poly" (options degree, tol, on_large as in :func:`weight_grad`).

    Returns a dict: weights (TensorWeights, numpy), loss (steps + 1 values: before each step and after the last),
    time (cumulative wall seconds at each loss value), grad_norm (per step).
    """
    if optimizer not in ("adam", "gd"):
        raise ValueError(f"optimizer must be 'adam' or 'gd', got {optimizer!r}")
    if path not in ("exact", "poly"):
        raise ValueError(f"path must be 'exact' or 'poly', got {path!r}")
    As = tuple(A) if isinstance(A, (tuple, list)) else (A,) * 5
    if len(As) != 5:
        raise ValueError(f"A must be one array or a tuple of five arrays, got {len(As)}")
    As = tuple(np.asarray(to_numpy(a), dtype=np.float64) for a in As)
    E = np.asarray(to_numpy(E), dtype=np.float64)
    if As[0].ndim != 3 or E.ndim != 3 or E.shape[0] != As[0].shape[0]:
        raise ValueError(f"A must be (N, n, p) and E (N, n, d) with the same N; got {As[0].shape}, {E.shape}")
    N = E.shape[0]
    bsz = N if batch_size is None else int(batch_size)
    if bsz < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batches = [(tuple(a[i:i + bsz] for a in As), E[i:i + bsz]) for i in range(0, N, bsz)]
    kw = dict(scale=scale, causal=causal, window=window, path=path, degree=degree, tol=tol, on_large=on_large)
    if client is not None:
        try:  # lazy: distributed is optional
            import distributed  # noqa: F401
        except ImportError:
            pass  # a duck-typed client (submit/map/gather/scatter) still works
        remote = client.scatter(batches)

    def full_grad(Wc):
        if client is None:
            parts = [_batch_grad(bt, Wc, kw) for bt in batches]
        else:
            parts = client.gather(client.map(_batch_grad, remote, W=Wc, kw=kw, pure=False))
        loss = sum(pt[0] for pt in parts) / N
        g = {k: sum(pt[1][k] for pt in parts) / N for k in _WNAMES}
        return loss, g

    W = {k: np.array(to_numpy(v), dtype=np.float64) for k, v in W0.as_dict().items()}
    m = {k: np.zeros_like(v) for k, v in W.items()}
    v2 = {k: np.zeros_like(v) for k, v in W.items()}
    b1, b2 = betas
    hist = {"loss": [], "time": [], "grad_norm": []}
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        loss, g = full_grad(TensorWeights(**W))
        hist["loss"].append(loss)
        hist["time"].append(time.perf_counter() - t0)
        hist["grad_norm"].append(float(math.sqrt(sum(float((gk * gk).sum()) for gk in g.values()))))
        for k in W:
            if optimizer == "gd":
                W[k] = W[k] - lr * g[k]
            else:
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v2[k] = b2 * v2[k] + (1 - b2) * g[k] * g[k]
                mh, vh = m[k] / (1 - b1 ** step), v2[k] / (1 - b2 ** step)
                W[k] = W[k] - lr * mh / (np.sqrt(vh) + adam_eps)
        if callback is not None:
            callback(step, loss, TensorWeights(**W))
    loss, _ = full_grad(TensorWeights(**W))
    hist["loss"].append(loss)
    hist["time"].append(time.perf_counter() - t0)
    hist["weights"] = TensorWeights(**W)
    return hist
