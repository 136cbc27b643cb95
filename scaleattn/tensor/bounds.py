"""A-priori error bounds of the polynomial fast path (DESIGN §8; [C25] §5, Alman & Song): logit bounds, the
Taylor remainder eps_g, and the degree that meets a tolerance."""
from __future__ import annotations

import math

import numpy as np

from .._backend import contiguous
from ..errors import ParameterError
from ._common import _NAMES, _prepare
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
    ``method="exact"``: the actual maximum, streamed in O(n^3 d). The regime of the fast path is set by it
    ([C25] §5: bounded logits; DESIGN §8).

    Parameters
    ----------
    Q, K1, K2 : array (..., n, d), float32/float64
        As in :func:`attention` (one shape, namespace and device).
    scale : None, ``"sqrt"`` or float
        The logit scale s, as in :func:`attention`.
    method : ``"cheap"`` or ``"exact"``
        The O(n d) bound or the streamed maximum.
    block_size : int or (bq, bj, bk), optional
        Blocks of the ``"exact"`` scan, as in :func:`attention`.

    Returns
    -------
    float
        ``B >= max |S[i,j,k]|`` (``"exact"``: equal to it, up to round-off).

    Raises
    ------
    TypeError, ParameterError, DeviceMismatchError
        As :func:`attention` for the arrays and ``scale``; ``method`` neither ``"cheap"`` nor ``"exact"``.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.tensor import logit_bound
    >>> Q, K1, K2 = np.random.default_rng(0).standard_normal((3, 32, 4))
    >>> S_max = np.abs(np.einsum("it,jt,kt->ijk", Q, K1, K2)).max() / 4  # s = 1/d
    >>> bool(np.isclose(logit_bound(Q, K1, K2, method="exact"), S_max)), bool(logit_bound(Q, K1, K2) >= S_max)
    (True, True)
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

    Parameters
    ----------
    Q, K1, K2 : array (..., n, d), float32/float64
        As in :func:`attention`.
    degree : int >= 1
        Taylor degree g.
    scale : None, ``"sqrt"`` or float
        As in :func:`attention`.
    method : ``"cheap"`` or ``"exact"``
        How the logit bound B is found (:func:`logit_bound`).

    Returns
    -------
    float
        The bound on the rows of the attention matrix; ``inf`` when eps_g >= 1.

    Raises
    ------
    ParameterError
        ``degree`` not an int >= 1; as :func:`logit_bound`.
    TypeError
        As :func:`logit_bound`.

    See Also
    --------
    choose_degree : the smallest degree that meets a tolerance.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.tensor import attention, poly_attention, poly_error_bound
    >>> Q, K1, K2, V1, V2 = np.random.default_rng(0).standard_normal((5, 32, 4)) / 2
    >>> bound = poly_error_bound(Q, K1, K2, degree=6)
    >>> err = np.abs(poly_attention(Q, K1, K2, V1, V2, degree=6) - attention(Q, K1, K2, V1, V2)).max()
    >>> bound, bool(err <= bound * np.abs(V1).max() * np.abs(V2).max())  # doctest: +ELLIPSIS
    (0.00199..., True)
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
    """Smallest g >= 1 with 2 eps_g/(1-eps_g) * vmax <= tol and C(d+g, g) <= max_rank, or None if there is none.

    eps_g = e^B B^(g+1) / (g+1)! with B = ``logit_max`` (Taylor remainder; [C25] §5, DESIGN §8). Used by
    ``degree="auto"``.

    Parameters
    ----------
    logit_max : float
        Bound B on the logits (:func:`logit_bound`).
    d : int
        Attention width (r = C(d+g, g) features).
    tol : float
        Allowed entrywise output error.
    vmax : float
        ``max|V1| * max|V2|`` (the output error is the row bound times it).
    max_degree, max_rank : int
        Largest g and r tried.

    Returns
    -------
    int or None
        The degree, or None when no g <= ``max_degree`` with r <= ``max_rank`` reaches ``tol``.

    Examples
    --------
    >>> from scaleattn.tensor import choose_degree
    >>> choose_degree(1.0, d=4, tol=1e-6), choose_degree(1.0, d=64, tol=1e-6)  # r > max_rank first
    (10, None)
    """
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
    vmax = float(xp.max(xp.abs(f["V1"]))) * float(xp.max(xp.abs(f["V2"])))
    if isinstance(degree, str):
        if degree != "auto":
            raise ParameterError(f"degree must be 'auto' or an int >= 1, got {degree!r}")
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
    w = xp.abs(xp.sum(O * R, axis=-1))
    R1, Rinf = xp.sum(xp.abs(R), axis=-1), xp.max(xp.abs(R), axis=-1)
    e = gam * (R1 * U + w) + dO1 * U + dO1 * (Rinf + U)  # (B, n)
    ev = pi * (Rinf + U)
    mx = {k: float(xp.max(xp.abs(f[k]))) for k in _NAMES}
    esum, emax = float(xp.max(xp.sum(e, axis=-1))), float(xp.max(e))
    evsum = float(xp.max(xp.sum(ev, axis=-1)))
    return {"Q": abs(s) * mx["K1"] * mx["K2"] * emax,
            "K1": abs(s) * mx["Q"] * mx["K2"] * esum,
            "K2": abs(s) * mx["Q"] * mx["K1"] * esum,
            "V1": mx["V2"] * evsum, "V2": mx["V1"] * evsum,
            "_row_e_total": float(xp.sum(e))}
