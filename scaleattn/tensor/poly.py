"""The polynomial (Taylor) fast path of tensor attention (DESIGN §8; [C25] §5): exp(S) ~ U1 (U2 (/) U3)^T of
rank r = C(d+g, g), forward and all gradients in O(n r d) time, causal mode by prefix sums."""
from __future__ import annotations

import math
import warnings
from functools import lru_cache

import numpy as np

from .._backend import device_of, from_host, is_numpy
from ..errors import ParameterError, UnsupportedError
from ._common import _BLOCK_ELEMS, _NAMES, _cast, _empty, _window, _zeros
from .bounds import _LargeLogits, _plan_poly, _poly_grad_bounds
from .exact import _prepare, attention, attention_grad

__all__ = ["poly_attention", "poly_attention_grad"]


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


def _mono_xp(mono, xp, dev=None):
    """The monomial tables of :func:`_monomials` in namespace ``xp`` on device ``dev`` (numpy: as they are)."""
    if is_numpy(xp):
        return mono
    out = dict(mono)
    for k in ("parent", "var", "inv_fact"):
        out[k] = from_host(mono[k], xp, dev)
    out["deriv"] = [tuple(from_host(a, xp, dev) for a in tr) for tr in mono["deriv"]]
    return out


def _features(X, mono, xp, coef):
    """Monomial features X (B, b, d) -> U (B, b, r) with U[..., alpha] = X^alpha (times 1/alpha! if coef)."""
    r, off = mono["r"], mono["off"]
    U = _empty(tuple(X.shape[:-1]) + (r,), xp, X)
    U[..., 0] = 1.0
    par, var = mono["parent"], mono["var"]
    last = X.ndim - 1
    for lv in range(1, len(off) - 1):  # one vectorised product per degree level
        a, b = off[lv], off[lv + 1]
        U[..., a:b] = xp.take(U, par[a:b], axis=last) * xp.take(X, var[a:b], axis=last)
    if coef:
        U *= mono["inv_fact"]
    return U


def _chain(dU, U, mono, xp, use_mult):
    """d/dX from dL/dU through the monomial map: dX_t = sum_{alpha_t>=1} dU_alpha * mult * U_{alpha - e_t}."""
    out = _empty(tuple(dU.shape[:-1]) + (len(mono["deriv"]),), xp, dU)
    last = dU.ndim - 1
    for t, (idx, lower, mult) in enumerate(mono["deriv"]):
        if idx.shape[0] == 0:
            out[..., t] = 0.0
            continue
        prod = xp.take(dU, idx, axis=last) * xp.take(U, lower, axis=last)
        if use_mult:
            prod = prod * mult
        out[..., t] = xp.sum(prod, axis=-1)
    return out


def _outer_rows(U, X, Y, xp):
    """``sum_i U[b,i,r] X[b,i,t] Y[b,i,a]`` (B, r, t, a) as one batched matmul (no einsum in the standard)."""
    Bt, nb = U.shape[0], U.shape[1]
    XY = xp.reshape(X[:, :, :, None] * Y[:, :, None, :], (Bt, nb, X.shape[-1] * Y.shape[-1]))
    return xp.reshape(xp.matmul(xp.permute_dims(U, (0, 2, 1)), XY), (Bt, U.shape[-1], X.shape[-1], Y.shape[-1]))


def _mT(a, xp):
    """Swap the last two axes of a 3-D array."""
    return xp.permute_dims(a, (0, 2, 1))


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
    mono = _mono_xp(_monomials(d, g), xp, device_of(Q))
    r = mono["r"]
    b = _poly_rows(r, Bt, block_size)
    C2 = _zeros((Bt, r, d), xp, Q)
    C3 = _zeros((Bt, r, d), xp, Q)
    c2 = _zeros((Bt, r), xp, Q)
    c3 = _zeros((Bt, r), xp, Q)
    for j0 in range(0, n, b):  # key side: U2 = k1^alpha, U3 = k2^alpha (coefficients live in U1)
        j1 = min(j0 + b, n)  # the standard leaves out-of-bounds slice stops unspecified
        U2 = _features(K1[:, j0:j1, :], mono, xp, False)
        U3 = _features(K2[:, j0:j1, :], mono, xp, False)
        C2 += xp.matmul(_mT(U2, xp), V1[:, j0:j1, :])
        c2 += xp.sum(U2, axis=1)
        C3 += xp.matmul(_mT(U3, xp), V2[:, j0:j1, :])
        c3 += xp.sum(U3, axis=1)
    CC, cc = C2 * C3, c2 * c3
    O = _empty((Bt, n, d), xp, Q)
    D = _empty((Bt, n), xp, Q)
    out = {}
    if want_grad:
        E = f["E"]
        dQ = _empty((Bt, n, d), xp, Q)
        M1 = _zeros((Bt, r, d), xp, Q)
        m1 = _zeros((Bt, r), xp, Q)
        if xargs is not None:
            A1, A2, A3 = xargs
            p = A1.shape[-1]
            P1 = _zeros((Bt, r, d, p), xp, Q)
            p1 = _zeros((Bt, r, p), xp, Q)
    for i0 in range(0, n, b):  # query side: U1 = (s q)^alpha / alpha!
        sl = slice(i0, min(i0 + b, n))
        U1 = _features(s * Q[:, sl, :], mono, xp, True)
        Di = xp.matmul(U1, cc[:, :, None])[..., 0]
        Oi = xp.matmul(U1, CC) / Di[..., None]
        O[:, sl, :], D[:, sl] = Oi, Di
        if want_grad:  # O_i depends on row i only, so R_i is available here: one pass for forward + dQ
            Ri = Oi - E[:, sl, :]
            wi = xp.sum(Oi * Ri, axis=-1)
            dU1 = (xp.matmul(Ri, _mT(CC, xp)) - wi[..., None] * cc[:, None, :]) / Di[..., None]
            dQ[:, sl, :] = s * _chain(dU1, U1, mono, xp, False)  # d/dq (sq)^a/a! = s (sq)^(a-e_t)/(a-e_t)!
            Ut = U1 / Di[..., None]
            M1 += xp.matmul(_mT(Ut, xp), Ri)
            m1 += xp.matmul(_mT(Ut, xp), wi[..., None])[..., 0]
            if xargs is not None:
                P1 += _outer_rows(Ut, Ri, A1[:, sl, :], xp)
                p1 += xp.matmul(_mT(Ut * wi[..., None], xp), A1[:, sl, :])
    out["O"], out["D"] = O, D
    out["minD"] = float(xp.min(D))
    if not want_grad:
        return out
    W3, W2 = M1 * C3, M1 * C2
    w3, w2 = m1 * c3, m1 * c2
    dK1, dK2 = _empty((Bt, n, d), xp, Q), _empty((Bt, n, d), xp, Q)
    dV1, dV2 = _empty((Bt, n, d), xp, Q), _empty((Bt, n, d), xp, Q)
    if xargs is not None:
        P2 = _zeros((Bt, r, d, p), xp, Q)
        P3 = _zeros((Bt, r, d, p), xp, Q)
        p2 = _zeros((Bt, r, p), xp, Q)
        p3 = _zeros((Bt, r, p), xp, Q)
    for j0 in range(0, n, b):
        sl = slice(j0, min(j0 + b, n))
        U2 = _features(K1[:, sl, :], mono, xp, False)
        U3 = _features(K2[:, sl, :], mono, xp, False)
        # dL/dU2[j,a] = sum_t v1_jt M1[a,t] C3[a,t] - m1[a] c3[a]  (and symmetric for U3)
        dU2 = xp.matmul(V1[:, sl, :], _mT(W3, xp)) - w3[:, None, :]
        dU3 = xp.matmul(V2[:, sl, :], _mT(W2, xp)) - w2[:, None, :]
        dK1[:, sl, :] = _chain(dU2, U2, mono, xp, True)
        dK2[:, sl, :] = _chain(dU3, U3, mono, xp, True)
        dV1[:, sl, :] = xp.matmul(U2, W3)
        dV2[:, sl, :] = xp.matmul(U3, W2)
        if xargs is not None:
            P2 += _outer_rows(U2, V1[:, sl, :], A2[:, sl, :], xp)
            P3 += _outer_rows(U3, V2[:, sl, :], A3[:, sl, :], xp)
            p2 += xp.matmul(_mT(U2, xp), A2[:, sl, :])
            p3 += xp.matmul(_mT(U3, xp), A3[:, sl, :])
    R = O - E
    out["R"] = R
    out["loss"] = 0.5 * float(xp.sum(R * R))
    out["grads"] = {"Q": dQ, "K1": dK1, "K2": dK2, "V1": dV1, "V2": dV2}
    if xargs is not None:
        # grad_X[a,b,c] = s sum_alpha sum_t P1[a,t,.] P2[a,t,.] P3[a,t,.] - s sum_alpha p1 p2 p3 (per batch entry)
        T12 = xp.reshape(P1[..., :, None] * P2[..., None, :], (Bt * r * d, p * p))
        gX = xp.reshape(xp.matmul(T12.T, xp.reshape(P3, (Bt * r * d, p))), (p, p, p))
        t12 = xp.reshape(p1[..., :, None] * p2[..., None, :], (Bt * r, p * p))
        gX -= xp.reshape(xp.matmul(t12.T, xp.reshape(p3, (Bt * r, p))), (p, p, p))
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
    mono = _mono_xp(_monomials(d, g), xp, device_of(Q))
    r = mono["r"]
    p = 0 if xargs is None else xargs[0].shape[-1]
    b = _poly_rows(r * (d + 1) * max(1, p * p), Bt, block_size)  # ~10 (B, b, r, d[, p, p]) blocks live at once

    def prefix(Y, carry):  # inclusive prefix sums over the rows of the block plus the carried sum
        return xp.cumulative_sum(Y, axis=1) + carry[:, None, ...]

    def suffix(Y, carry):  # inclusive suffix sums over the rows of the block plus the carried sum
        return xp.flip(xp.cumulative_sum(xp.flip(Y, axis=1), axis=1), axis=1) + carry[:, None, ...]

    C2, C3 = _zeros((Bt, r, d), xp, Q), _zeros((Bt, r, d), xp, Q)
    c2, c3 = _zeros((Bt, r), xp, Q), _zeros((Bt, r), xp, Q)
    O, D = _empty((Bt, n, d), xp, Q), _empty((Bt, n), xp, Q)
    if want_grad:
        E = f["E"]
        dQ = _empty((Bt, n, d), xp, Q)
    if xargs is not None:
        A1, A2, A3 = xargs
        P2, P3 = _zeros((Bt, r, d, p), xp, Q), _zeros((Bt, r, d, p), xp, Q)
        p2, p3 = _zeros((Bt, r, p), xp, Q), _zeros((Bt, r, p), xp, Q)
        gX = _zeros((p, p, p), xp, Q)
    starts = []  # each block's carried prefixes, for pass 2 (O((n / b) r d): no subtraction, no n eps error)
    for i0 in range(0, n, b):  # pass 1, rows in order: forward, dQ and the grad_X prefixes
        sl = slice(i0, min(i0 + b, n))
        if want_grad:
            starts.append((C2, C3, c2, c3))
        U2 = _features(K1[:, sl, :], mono, xp, False)
        U3 = _features(K2[:, sl, :], mono, xp, False)
        C2i = prefix(U2[..., None] * V1[:, sl, None, :], C2)
        C3i = prefix(U3[..., None] * V2[:, sl, None, :], C3)
        c2i, c3i = prefix(U2, c2), prefix(U3, c3)
        C2, C3, c2, c3 = C2i[:, -1, ...], C3i[:, -1, ...], c2i[:, -1, ...], c3i[:, -1, ...]
        U1 = _features(s * Q[:, sl, :], mono, xp, True)
        CCi, cci = C2i * C3i, c2i * c3i
        Di = xp.sum(U1 * cci, axis=-1)
        Oi = xp.matmul(U1[:, :, None, :], CCi)[:, :, 0, :] / Di[..., None]
        O[:, sl, :], D[:, sl] = Oi, Di
        if not want_grad:
            continue
        Ri = Oi - E[:, sl, :]
        wi = xp.sum(Oi * Ri, axis=-1)
        dU1 = (xp.matmul(CCi, Ri[..., None])[..., 0] - wi[..., None] * cci) / Di[..., None]
        dQ[:, sl, :] = s * _chain(dU1, U1, mono, xp, False)
        if xargs is not None:
            P2i = prefix(U2[..., None, None] * V1[:, sl, None, :, None] * A2[:, sl, None, None, :], P2)
            P3i = prefix(U3[..., None, None] * V2[:, sl, None, :, None] * A3[:, sl, None, None, :], P3)
            p2i = prefix(U2[..., None] * A2[:, sl, None, :], p2)
            p3i = prefix(U3[..., None] * A3[:, sl, None, :], p3)
            P2, P3, p2, p3 = P2i[:, -1, ...], P3i[:, -1, ...], p2i[:, -1, ...], p3i[:, -1, ...]
            Ut = U1 / Di[..., None]
            W = (Ut[..., None] * Ri[:, :, None, :])[..., None] * P2i  # (B, b, r, d, p_y)
            L = xp.reshape(A1[:, sl, None, None, :, None] * W[..., None, :], (-1, p * p))
            gX += xp.reshape(xp.matmul(L.T, xp.reshape(P3i, (-1, p))), (p, p, p))
            w2 = (Ut * wi[..., None])[..., None] * p2i  # (B, b, r, p_y)
            L = xp.reshape(A1[:, sl, None, :, None] * w2[..., None, :], (-1, p * p))
            gX -= xp.reshape(xp.matmul(L.T, xp.reshape(p3i, (-1, p))), (p, p, p))
    out = {"O": O, "D": D, "minD": float(xp.min(D))}
    if not want_grad:
        return out
    T2, T3 = _zeros((Bt, r, d), xp, Q), _zeros((Bt, r, d), xp, Q)  # suffix sums over the queries after the block
    t2, t3 = _zeros((Bt, r), xp, Q), _zeros((Bt, r), xp, Q)
    dK1, dK2, dV1, dV2 = (_empty((Bt, n, d), xp, Q) for _ in range(4))
    for i0, (C2, C3, c2, c3) in zip(reversed(range(0, n, b)), reversed(starts)):  # pass 2, rows in reverse order
        sl = slice(i0, min(i0 + b, n))
        U2 = _features(K1[:, sl, :], mono, xp, False)
        U3 = _features(K2[:, sl, :], mono, xp, False)
        cs2 = xp.cumulative_sum(U2[..., None] * V1[:, sl, None, :], axis=1)
        cs3 = xp.cumulative_sum(U3[..., None] * V2[:, sl, None, :], axis=1)
        ds2, ds3 = xp.cumulative_sum(U2, axis=1), xp.cumulative_sum(U3, axis=1)
        # prefixes per row of the block: the block's start (saved in pass 1) plus the in-block cumsum
        C2i, C3i = cs2 + C2[:, None, ...], cs3 + C3[:, None, ...]
        c2i, c3i = ds2 + c2[:, None, ...], ds3 + c3[:, None, ...]
        Ut = _features(s * Q[:, sl, :], mono, xp, True) / D[:, sl, None]
        Oi = O[:, sl, :]
        Ri = Oi - E[:, sl, :]
        uw = Ut * xp.sum(Oi * Ri, axis=-1)[..., None]
        Z = Ut[..., None] * Ri[:, :, None, :]
        T2i, T3i = suffix(Z * C3i, T2), suffix(Z * C2i, T3)
        t2i, t3i = suffix(uw * c3i, t2), suffix(uw * c2i, t3)
        T2, T3, t2, t3 = T2i[:, 0, ...], T3i[:, 0, ...], t2i[:, 0, ...], t3i[:, 0, ...]
        dU2 = xp.matmul(T2i, V1[:, sl, :, None])[..., 0] - t2i
        dU3 = xp.matmul(T3i, V2[:, sl, :, None])[..., 0] - t3i
        dK1[:, sl, :] = _chain(dU2, U2, mono, xp, True)
        dK2[:, sl, :] = _chain(dU3, U3, mono, xp, True)
        dV1[:, sl, :] = xp.matmul(U2[:, :, None, :], T2i)[:, :, 0, :]
        dV2[:, sl, :] = xp.matmul(U3[:, :, None, :], T3i)[:, :, 0, :]
    R = O - E
    out["R"] = R
    out["loss"] = 0.5 * float(xp.sum(R * R))
    out["grads"] = {"Q": dQ, "K1": dK1, "K2": dK2, "V1": dV1, "V2": dV2}
    if xargs is not None:
        out["gX"] = s * gX
    return out


def _poly_args(on_large, causal, window):
    if on_large not in ("exact", "raise"):
        raise ParameterError(f"on_large must be 'exact' or 'raise', got {on_large!r}")
    masked, w1, w2 = _window(window, causal)
    if w1 is not None or w2 is not None:
        raise UnsupportedError(
            "the polynomial path supports causal=True but not window=(w1, w2) with a finite w1 or w2 (the windowed "
            "prefix-difference variant is not implemented); use the exact attention(..., window=(w1, w2)), which is "
            "O(n w1 w2 d)")
    return masked


def _large(msg, on_large, info):
    if on_large == "raise":
        raise ParameterError("tensor attention: " + msg)
    warnings.warn("tensor attention: " + msg + "; falling back to the exact O(n^3 d) path", RuntimeWarning,
                  stacklevel=3)
    if info is not None:
        info.update(path="exact", reason=msg)


def poly_attention(Q, K1, K2, V1, V2, scale=None, causal=False, window=None, *, degree="auto", tol=None,
                   on_large="exact", max_degree=40, max_rank=200_000, info=None, block_size=None):
    """Fast tensor attention via the degree-g Taylor polynomial of exp ([Alman & Song 2024]; [C25] §5; DESIGN §8).

    Same inputs/output as :func:`attention`. Time O(n r d), memory O(block r + r d), r = C(d+g, g): exp(S) is
    replaced by ``U1 (U2 (/) U3)^T`` with monomial features, so nothing n^2-sized is formed.

    Parameters
    ----------
    Q, K1, K2, V1, V2, scale
        As in :func:`attention`: arrays (..., n, d), float32/float64, one namespace and device.
    causal : bool
        ``True``: prefix sums of the key statistics over j, k <= i (same mask as :func:`attention`),
        still O(n r d) time, memory O(block r d + r d) (see ``_poly_core_causal``); the error bounds are unchanged
        (the per-entry bound holds for any subset of keys).
    window : None or (None, None)
        (None, None) is ``causal=True``; a finite w1 or w2 is refused.
    degree : int >= 1 or ``"auto"``
        Taylor degree g; ``"auto"``: the smallest g whose a-priori output bound is <= ``tol`` (default tol 1e-6).
    tol : float, optional
        With an explicit degree, ``tol`` (if given) is the allowed output error bound.
    on_large : ``"exact"`` or ``"raise"``
        When the logits are outside the polynomial regime (eps_g >= 1/2, the bound exceeds ``tol``, no degree
        reaches ``tol``, or an approximate row sum is <= 0): warn with RuntimeWarning and compute the exact
        :func:`attention` (default), or raise.
    max_degree, max_rank : int
        Largest g and r = C(d+g, g) that ``degree="auto"`` may pick.
    info : dict, optional
        Filled with path ("poly"/"exact"), degree, rank, logit_bound, eps (relative entry error bound),
        p_l1_bound (row l1 bound on P), out_bound (entrywise |O~ - O| bound), min_rowsum.
    block_size : int or tuple, optional
        Rows per block (the first entry of a tuple); default about 8 MB of features.

    Returns
    -------
    array (..., n, d)
        The approximate ``O`` in the inputs' common float dtype, within ``info["out_bound"]`` of :func:`attention`.

    Raises
    ------
    TypeError, ParameterError
        As :func:`attention`; a bad ``degree`` or ``on_large``; with ``on_large="raise"``, logits outside the
        polynomial regime (the message names the logit bound and the error bound).
    UnsupportedError
        (a NotImplementedError) A finite window.

    See Also
    --------
    poly_error_bound, choose_degree : the a-priori bound and the degree it gives.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.tensor import attention, poly_attention
    >>> Q, K1, K2, V1, V2 = np.random.default_rng(0).standard_normal((5, 64, 4)) / 2
    >>> O = poly_attention(Q, K1, K2, V1, V2, info=(info := {}))  # degree "auto", tol 1e-6
    >>> info["path"], info["degree"], bool(np.allclose(O, attention(Q, K1, K2, V1, V2), rtol=0, atol=1e-6))
    ('poly', 11, True)
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
    return _cast(xp.reshape(res["O"], shape), dtype, xp)


def poly_attention_grad(Q, K1, K2, V1, V2, E, scale=None, causal=False, window=None, *, degree="auto", tol=None,
                        on_large="exact", max_degree=40, max_rank=200_000, info=None, block_size=None):
    """Loss and the five gradients of L = 1/2 ||Att~ - E||^2 for the Taylor model, in O(n r d) ([C25] §5).

    These are the exact gradients of the polynomial model (features U1 = (s q)^alpha/alpha!, U2 = k1^alpha,
    U3 = k2^alpha, chain rule through the monomials), computed with the Khatri-Rao identity so no n^2 object is
    formed. Same signature/return as :func:`attention_grad`, options as :func:`poly_attention`.
    ``causal=True``: gradients of the causal Taylor model, O(n r d) with a second pass over the rows in reverse
    order for the key side (suffix sums over queries i >= j; formulas in ``_poly_core_causal``).

    Parameters
    ----------
    Q, K1, K2, V1, V2, E, scale, causal, window
        As in :func:`attention_grad` (arrays (..., n, d), float32/float64); a finite window is refused.
    degree, tol, on_large, max_degree, max_rank, block_size
        As in :func:`poly_attention`.
    info : dict, optional
        As in :func:`poly_attention`, plus ``grad_bound``: dict of entrywise bounds on |grad~ - grad| per tensor
        (see ``bounds._poly_grad_bounds``).

    Returns
    -------
    loss : float
        ``1/2 ||Att~ - E||_F^2`` summed over the batch axes.
    grads : dict of str to array (..., n, d)
        ``"Q"``, ``"K1"``, ``"K2"``, ``"V1"``, ``"V2"``, in the inputs' common float dtype.

    Raises
    ------
    ParameterError, UnsupportedError, TypeError
        As :func:`poly_attention` (``E`` is checked like the others).

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.tensor import attention_grad, poly_attention_grad
    >>> Q, K1, K2, V1, V2, E = np.random.default_rng(0).standard_normal((6, 64, 4)) / 2
    >>> loss, g = poly_attention_grad(Q, K1, K2, V1, V2, E, degree=6, info=(info := {}))
    >>> loss_ex, g_ex = attention_grad(Q, K1, K2, V1, V2, E)
    >>> bool(abs(loss - loss_ex) < 1e-7), all(np.abs(g[k] - g_ex[k]).max() <= info["grad_bound"][k] for k in g)
    (True, True)
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
    return res["loss"], {k: _cast(xp.reshape(v, shape), dtype, xp) for k, v in res["grads"].items()}
