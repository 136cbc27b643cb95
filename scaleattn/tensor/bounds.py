"""A-priori error bounds of the polynomial fast path (DESIGN §8; [C25] §5, Alman & Song): logit bounds, the
Taylor remainder eps_g, and the degree that meets a tolerance."""
from __future__ import annotations

import math

import numpy as np

from .._backend import contiguous
from ..errors import ParameterError
from ._common import _prepare
from .exact import _block_sizes

__all__ = ["logit_bound", "poly_error_bound", "choose_degree"]


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
        b1 = float(xp.max(xp.sum(xp.max(aq, axis=1) * xp.max(a1, axis=1) * xp.max(a2, axis=1), axis=-1)))
        nq = float(xp.max(xp.sqrt(xp.sum(Q * Q, axis=-1))))
        n1, n2 = float(xp.max(xp.sqrt(xp.sum(K1 * K1, axis=-1)))), float(xp.max(xp.sqrt(xp.sum(K2 * K2, axis=-1))))
        b2 = nq * min(float(xp.max(a1)) * n2, n1 * float(xp.max(a2)))
        return abs(s) * min(b1, b2)
    if method != "exact":
        raise ParameterError(f"method must be 'cheap' or 'exact', got {method!r}")
    Bt, n, d = Q.shape
    bq, bj, bk = _block_sizes(n, Bt, False, None, None, block_size)
    K2T = contiguous(xp.permute_dims(K2, (0, 2, 1)), xp)
    best = 0.0
    for i0 in range(0, n, bq):
        for j0 in range(0, n, bj):
            i1, j1 = min(i0 + bq, n), min(j0 + bj, n)  # in-bounds slice stops (the standard's)
            QK = xp.reshape(s * Q[:, i0:i1, None, :] * K1[:, None, j0:j1, :], (Bt, -1, d))
            for k0 in range(0, n, bk):
                best = max(best, float(xp.max(xp.abs(xp.matmul(QK, K2T[:, :, k0:min(k0 + bk, n)])))))
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
        raise ParameterError(f"degree must be 'auto' or an int >= 1, got {degree!r}")
    return int(degree)


def choose_degree(logit_max, d, tol, vmax=1.0, *, max_degree=40, max_rank=200_000):
    """Smallest g >= 1 with 2 eps_g/(1-eps_g) * vmax <= tol and C(d+g, g) <= max_rank, or None if there is none."""
    for g in range(1, max_degree + 1):
        if math.comb(d + g, g) > max_rank:
            return None
        if _pl1(_eps(logit_max, g)) * vmax <= tol:
            return g
    return None
