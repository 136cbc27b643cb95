"""Exact tensor attention, streamed over (query, key1, key2) blocks with an online softmax (DESIGN §8;
[C25] Def. 1.1): forward and closed-form backward in O(n d + block) memory; windows visit only the blocks that
intersect them (O(n w1 w2 d))."""
from __future__ import annotations

import math

import numpy as np

from .._backend import contiguous, device_of
from ..errors import ParameterError
from ._common import _BLOCK_ELEMS, _cast, _empty, _full, _prepare, _zeros

__all__ = ["attention", "attention_grad"]


def _block_sizes(n, B, masked, w1, w2, block_size):
    if block_size is not None:
        if isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool):
            bs = (int(block_size),) * 3
        else:
            bs = tuple(int(b) for b in block_size)
        if len(bs) != 3 or min(bs) < 1:
            raise ParameterError(f"block_size must be a positive int or a triple (bq, bj, bk), got {block_size!r}")
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


def _key_blocks(i0, i1, n, b, masked, w, xp, dev=None):
    """Key blocks [k0, k1) that some query in [i0, i1) can see, each with a (bq, bk) bool mask or None (all seen);
    masks made on device ``dev``."""
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
            i = xp.arange(i0, i1, device=dev)[:, None]
            k = xp.arange(k0, k1, device=dev)[None, :]
            mask = k <= i
            if w is not None:
                mask &= k > i - w
        out.append((k0, k1, mask))
    return out


def _logits(QK, K2T, k0, k1, shape, mask, xp):
    """S block (B, bq, bj, bk) = (s q_i * k1_j) . k2_k; masked entries -> -inf."""
    S = xp.reshape(xp.matmul(QK, K2T[:, :, k0:k1]), shape)
    if mask is not None:
        S = xp.where(mask, S, -math.inf)
    return S


def _combine(mj, mk):
    if mj is None and mk is None:
        return None
    if mj is None:
        return mk[:, None, :]  # (bq, 1, bk): every key1 seen
    if mk is None:
        return mj[:, :, None]  # (bq, bj, 1)
    return mj[:, :, None] & mk[:, None, :]


def _exact_forward(Q, K1, K2, V1, V2, s, masked, w1, w2, bs, xp):
    """Streamed forward on float64 (B, n, d) arrays. Returns O (B, n, d) and lse (B, n) = m + log l."""
    B, n, d = Q.shape
    bq, bj, bk = bs
    dev = device_of(Q)
    K2T = contiguous(xp.permute_dims(K2, (0, 2, 1)), xp)
    O = _empty((B, n, d), xp, Q)
    lse = _empty((B, n), xp, Q)
    for i0 in range(0, n, bq):
        i1 = min(i0 + bq, n)
        nq = i1 - i0
        m = _full((B, nq), -math.inf, xp, Q)
        l = _zeros((B, nq), xp, Q)
        acc = _zeros((B, nq, d), xp, Q)
        kblocks = _key_blocks(i0, i1, n, bk, masked, w2, xp, dev)
        for j0, j1, mj in _key_blocks(i0, i1, n, bj, masked, w1, xp, dev):
            nj = j1 - j0
            QK = xp.reshape(s * Q[:, i0:i1, None, :] * K1[:, None, j0:j1, :], (B, nq * nj, d))
            for k0, k1, mk in kblocks:
                S = _logits(QK, K2T, k0, k1, (B, nq, nj, k1 - k0), _combine(mj, mk), xp)
                m_new = xp.maximum(m, xp.max(S, axis=(2, 3)))
                m_safe = xp.where(xp.isfinite(m_new), m_new, 0.0)  # rows with nothing seen yet
                alpha = xp.exp(m - m_safe)
                P = xp.exp(S - m_safe[:, :, None, None])
                l = l * alpha + xp.sum(P, axis=(2, 3))
                PV2 = xp.reshape(xp.matmul(xp.reshape(P, (B, nq * nj, k1 - k0)), V2[:, k0:k1, :]), (B, nq, nj, d))
                acc = acc * alpha[:, :, None] + xp.sum(PV2 * V1[:, None, j0:j1, :], axis=2)
                m = m_new
        O[:, i0:i1, :] = acc / l[:, :, None]
        lse[:, i0:i1] = m + xp.log(l)
    return O, lse


def _exact_backward(Q, K1, K2, V1, V2, O, lse, R, s, masked, w1, w2, bs, xp, xargs=None):
    """Streamed gradients of L = 1/2 ||O - E||^2 given R = O - E (DESIGN §8; C25 §4).

    F = P (<R_i, v1_j*v2_k> - w_i) is dL/dS; P is recomputed per block from lse. ``xargs = (A1, A2, A3)`` (B, n, p)
    also accumulates grad_X[a,b,c] = s sum_ijk F A1_ia A2_jb A3_kc (the paper's s A1^T F (A2 (x) A3)).
    """
    B, n, d = Q.shape
    bq, bj, bk = bs
    dev = device_of(Q)
    K2T = contiguous(xp.permute_dims(K2, (0, 2, 1)), xp)
    V2T = contiguous(xp.permute_dims(V2, (0, 2, 1)), xp)
    w = xp.sum(O * R, axis=-1)  # w_i = <O_i, R_i> = rowsum(P * (R V^T)) (identity, DESIGN §8)
    dQ, dK1, dK2 = xp.zeros_like(Q), xp.zeros_like(K1), xp.zeros_like(K2)
    dV1, dV2 = xp.zeros_like(V1), xp.zeros_like(V2)
    gX = None
    if xargs is not None:
        A1, A2, A3 = xargs
        p = A1.shape[-1]
        gX = _zeros((p, p, p), xp, Q)
    for i0 in range(0, n, bq):
        i1 = min(i0 + bq, n)
        nq = i1 - i0
        kblocks = _key_blocks(i0, i1, n, bk, masked, w2, xp, dev)
        for j0, j1, mj in _key_blocks(i0, i1, n, bj, masked, w1, xp, dev):
            nj = j1 - j0
            QK = xp.reshape(s * Q[:, i0:i1, None, :] * K1[:, None, j0:j1, :], (B, nq * nj, d))
            RV1 = xp.reshape(R[:, i0:i1, None, :] * V1[:, None, j0:j1, :], (B, nq * nj, d))
            H = _zeros((B, nq * nj, d), xp, Q)  # sum_k F[i,j,k] k2_k
            PV2 = _zeros((B, nq * nj, d), xp, Q)  # sum_k P[i,j,k] v2_k
            H3 = None if xargs is None else _zeros((B, nq * nj, A3.shape[-1]), xp, Q)
            for k0, k1, mk in kblocks:
                nk = k1 - k0
                S = _logits(QK, K2T, k0, k1, (B, nq, nj, nk), _combine(mj, mk), xp)
                P = xp.exp(S - lse[:, i0:i1, None, None])
                G = xp.reshape(xp.matmul(RV1, V2T[:, :, k0:k1]), (B, nq, nj, nk))
                F = xp.reshape(P * (G - w[:, i0:i1, None, None]), (B, nq * nj, nk))
                P = xp.reshape(P, (B, nq * nj, nk))
                H += xp.matmul(F, K2[:, k0:k1, :])
                PV2 += xp.matmul(P, V2[:, k0:k1, :])
                dK2[:, k0:k1, :] += xp.matmul(xp.permute_dims(F, (0, 2, 1)), QK)
                dV2[:, k0:k1, :] += xp.matmul(xp.permute_dims(P, (0, 2, 1)), RV1)
                if H3 is not None:
                    H3 += xp.matmul(F, A3[:, k0:k1, :])
            H = xp.reshape(H, (B, nq, nj, d))
            PV2 = xp.reshape(PV2, (B, nq, nj, d))
            dQ[:, i0:i1, :] += s * xp.sum(H * K1[:, None, j0:j1, :], axis=2)
            dK1[:, j0:j1, :] += s * xp.sum(H * Q[:, i0:i1, None, :], axis=1)
            dV1[:, j0:j1, :] += xp.sum(PV2 * R[:, i0:i1, None, :], axis=1)
            if H3 is not None:
                H3 = xp.reshape(H3, (B, nq, nj, -1))
                # tmp[b,i,y,c] = sum_j A2[b,j,y] (F A3)[b,i,j,c]; gX[x,y,c] += s sum_{b,i} A1[b,i,x] tmp[b,i,y,c]
                tmp = xp.matmul(xp.permute_dims(A2[:, j0:j1, :], (0, 2, 1))[:, None, :, :], H3)  # (B, nq, p, p)
                pa = A1.shape[-1]
                gX += s * xp.reshape(xp.matmul(xp.reshape(A1[:, i0:i1, :], (B * nq, pa)).T,
                                               xp.reshape(tmp, (B * nq, -1))), gX.shape)
    return {"Q": dQ, "K1": dK1, "K2": dK2, "V1": dV1, "V2": dV2}, gX


def attention(Q, K1, K2, V1, V2, scale=None, causal=False, window=None, *, block_size=None):
    """Exact tensor (2-simplicial) attention Att = D^-1 A (V1 (/) V2), streamed (DESIGN §8; [C25] Def. 1.1).

    ``S[i,j,k] = s <q_i, k1_j * k2_k>``, ``P[i,j,k] = softmax of S[i]`` over the n^2 pairs (j, k),
    ``O_i = sum_jk P[i,j,k] (v1_j * v2_k)``; an online softmax over (query, key1, key2) blocks keeps memory at
    O(n d + block) for O(n^3 d) time.

    Parameters
    ----------
    Q, K1, K2, V1, V2 : array (..., n, d), float32/float64
        Queries, keys and values: numpy or any array API array (CuPy, torch, ...), all the same shape, namespace
        and device (the outputs are too). Leading axes are batch and heads and are independent.
    scale : None, ``"sqrt"`` or float
        The logit scale s: None for 1/d (as in [C25]), ``"sqrt"`` for 1/sqrt(d), or a finite float.
    causal : bool
        Pairs (j, k) with j <= i and k <= i only.
    window : (w1, w2), optional
        Causal windows i - w1 < j <= i, i - w2 < k <= i (``None`` entry = unbounded); implies ``causal``. Cost
        O(n w1 w2 d) instead of O(n^3 d).
    block_size : int or (bq, bj, bk), optional
        Block of the online softmax (memory O(B bq bj bk + n d)); default about 8 MB of logits.

    Returns
    -------
    O : array (..., n, d)
        In the inputs' common float dtype (computed in float64).

    Raises
    ------
    TypeError
        A missing or non-array input, a non-float dtype, ``scale`` neither a string nor a number, ``causal`` not a
        bool (the message names the argument).
    ParameterError
        (a ValueError) Shape mismatch, ndim < 2, n or d = 0, non-finite entries, a bad window, scale or block_size.
    DeviceMismatchError
        Arrays of different libraries or devices.

    See Also
    --------
    poly_attention : the O(n r d) polynomial approximation.
    attention_grad : the loss and the gradients.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.tensor import attention
    >>> Q, K1, K2, V1, V2 = np.random.default_rng(0).standard_normal((5, 6, 3))
    >>> S = np.einsum("it,jt,kt->ijk", Q, K1, K2) / 3  # s = 1/d
    >>> P = np.exp(S) / np.exp(S).sum(axis=(1, 2), keepdims=True)
    >>> bool(np.allclose(attention(Q, K1, K2, V1, V2), np.einsum("ijk,jt,kt->it", P, V1, V2)))
    True
    >>> bool(np.allclose(attention(Q, K1, K2, V1, V2, causal=True)[0], V1[0] * V2[0]))  # query 0 sees (0, 0)
    True
    """
    xp, f, dtype, shape, _, s, (masked, w1, w2) = _prepare(
        {"Q": Q, "K1": K1, "K2": K2, "V1": V1, "V2": V2}, scale, causal, window)
    bs = _block_sizes(shape[-2], f["Q"].shape[0], masked, w1, w2, block_size)
    O, _ = _exact_forward(f["Q"], f["K1"], f["K2"], f["V1"], f["V2"], s, masked, w1, w2, bs, xp)
    return _cast(xp.reshape(O, shape), dtype, xp)


def attention_grad(Q, K1, K2, V1, V2, E, scale=None, causal=False, window=None, *, block_size=None):
    """Exact closed-form gradient of L = 1/2 ||Att - E||_F^2 (summed over batch axes), streamed.

    Formulas (DESIGN §8; [C25] §4, Lemma on the gradient of tensor attention): R = O - E, w_i = <O_i, R_i>,
    F = P (<R_i, v1_j*v2_k> - w_i); dQ_i = s sum_jk F (k1_j*k2_k), dK1_j = s sum_ik F (q_i*k2_k), dK2 symmetric,
    dV1_j = sum_ik P (R_i*v2_k), dV2 symmetric. P is recomputed per block from the saved row log-sum-exp, as in
    FlashAttention's backward: memory O(n d + block).

    Parameters
    ----------
    Q, K1, K2, V1, V2 : array (..., n, d), float32/float64
        As in :func:`attention`.
    E : array (..., n, d), float32/float64
        The target, same shape, namespace and device.
    scale, causal, window, block_size
        As in :func:`attention`.

    Returns
    -------
    loss : float
        ``1/2 ||O - E||_F^2`` summed over the batch axes (in float64).
    grads : dict of str to array (..., n, d)
        Keys "Q", "K1", "K2", "V1", "V2": ``dL/dQ``, ... shaped like the inputs, in their common float dtype.

    Raises
    ------
    TypeError, ParameterError, DeviceMismatchError
        As :func:`attention` (``E`` is checked like the others).

    See Also
    --------
    poly_attention_grad : the same for the polynomial approximation, O(n r d).
    weight_grad : gradients with respect to the weights and [C25]'s X.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.tensor import attention, attention_grad
    >>> Q, K1, K2, V1, V2, E = np.random.default_rng(0).standard_normal((6, 5, 3))
    >>> loss, g = attention_grad(Q, K1, K2, V1, V2, E)
    >>> L = lambda Qx: 0.5 * np.sum((attention(Qx, K1, K2, V1, V2) - E) ** 2)
    >>> h = np.zeros_like(Q)
    >>> h[2, 1] = 1e-6  # central difference in Q[2, 1]
    >>> bool(np.isclose(loss, L(Q))), bool(np.isclose(g["Q"][2, 1], (L(Q + h) - L(Q - h)) / 2e-6, atol=1e-6))
    (True, True)
    """
    xp, f, dtype, shape, _, s, (masked, w1, w2) = _prepare(
        {"Q": Q, "K1": K1, "K2": K2, "V1": V1, "V2": V2, "E": E}, scale, causal, window)
    bs = _block_sizes(shape[-2], f["Q"].shape[0], masked, w1, w2, block_size)
    args = (f["Q"], f["K1"], f["K2"], f["V1"], f["V2"])
    O, lse = _exact_forward(*args, s, masked, w1, w2, bs, xp)
    R = O - f["E"]
    loss = 0.5 * float(xp.sum(R * R))
    g, _ = _exact_backward(*args, O, lse, R, s, masked, w1, w2, bs, xp)
    return loss, {k: _cast(xp.reshape(v, shape), dtype, xp) for k, v in g.items()}
