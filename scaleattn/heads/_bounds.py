"""Lower bounds on the number of heads that reproduce given coefficients (DESIGN §5).

:func:`flattening_bound` holds for every ``c`` (ranks of contractions of ``c``); :func:`generic_heads_bound` is
a dimension count, made exact by :func:`image_dimension` (the rank of the Jacobian of ``(V, Q) -> c``), that
holds for generic ``c``, e.g. any data with noise: fewer heads reach only a set of smaller dimension.
"""
from __future__ import annotations

import functools

import numpy as np

from ..features import n_features, n_pairs, triu_index
from ._fit import _EPS, SMALL_D, _linalg, _q_tensor, _selector, _svd, _v_matrix

__all__ = ["flattening_bound", "naive_dimension", "image_dimension", "generic_heads_bound", "KIND_EVERY_C",
           "KIND_GENERIC", "JACOBIAN_CHECK_MAX"]

#: largest ``psi * d_out`` for which :func:`generic_heads_bound` checks the Jacobian (else the naive count)
JACOBIAN_CHECK_MAX = 4000
#: ``heads_lower_bound_kind`` values
KIND_EVERY_C = "flattening rank (every c)"
KIND_GENERIC = "dimension count (generic data)"


# ---- lower bounds ---------------------------------------------------------------------------------------
def flattening_bound(coef, d: int, tol: float = 1e-10, draws: int = 8, seed: int = 0) -> int:
    """A lower bound on the heads of ANY model reproducing ``coef`` to relative residual ``tol`` (every c).

    Two flattenings of ``c`` whose rank per head is bounded, for any heads (V, Q) with ``c(V, Q) = c``:

    - ``M_w[a, l] = sum_{j<=k} c[(j,k), l, a] w_j w_k = sum_h (V_h w)_a (Q_h^T w)_l``: rank <= H;
    - ``N[j, k] = sum_{a,l} alpha_a beta_l C[a, j, k, l] = sum_h (x_h y_h^T + y_h x_h^T)`` with
      ``x_h = V_h^T alpha``, ``y_h = Q_h beta`` and ``C = W + W^{j<->k}`` (known from c): rank <= 2H.

    Heads with ``||c' - c|| <= tol ||c||`` change ``M_w`` by at most ``tol ||c|| ||w||^2`` and ``N`` by at
    most ``2 tol ||c|| ||alpha|| ||beta||`` (2-norm), so by Weyl's inequality H is at least the number of
    singular values above those margins (and half of it for ``N``). Random unit ``w``, ``alpha``, ``beta``
    (``draws`` of each, from ``seed``) reach the generic rank; the bound is at most ``min(d_out, d)``.

    Parameters
    ----------
    coef : array (psi, d_out)
    d : int
    tol : float
        Relative coefficient residual the heads may have.
    draws, seed : int
        Random contractions tried, and their seed.

    Returns
    -------
    int
        0 for ``c = 0``, else at least 1.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.heads._algebra import coef_from_heads
    >>> rng = np.random.default_rng(1)
    >>> V, Q = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 4))  # a 2-head model, d = 4
    >>> flattening_bound(coef_from_heads(V, Q), 4)   # no model with 1 head computes it
    2
    """
    c = np.asarray(coef, np.float64)
    d_out = c.shape[1]
    norm = float(np.linalg.norm(c))
    if norm == 0:
        return 0
    m = n_pairs(d)
    C3 = c.reshape(m, d, d_out)  # [P, l, a]
    I, J, _ = triu_index(d)
    rng = np.random.default_rng(seed)
    best = 1
    for _ in range(draws):
        w = rng.standard_normal(d)
        w /= np.linalg.norm(w)
        Mw = np.tensordot(w[I] * w[J], C3, axes=([0], [0])).T  # (a, l)
        s = np.linalg.svd(Mw, compute_uv=False)
        best = max(best, int(np.sum(s > tol * norm + 64 * _EPS * (s[0] + norm))))
        alpha, beta = rng.standard_normal(d_out), rng.standard_normal(d)
        alpha /= np.linalg.norm(alpha)
        beta /= np.linalg.norm(beta)
        n = np.einsum("pla,l,a->p", C3, beta, alpha) * np.where(I == J, 2.0, 1.0)
        Nm = np.zeros((d, d))
        Nm[I, J] = n
        Nm[J, I] = n
        s = np.linalg.svd(Nm, compute_uv=False)
        best = max(best, (int(np.sum(s > 2 * tol * norm + 64 * _EPS * (s[0] + norm))) + 1) // 2)
    return best


def naive_dimension(d: int, d_out: int, H: int) -> int:
    """``min(H (a + b - H), psi d_out)`` with ``a = d_out d``, ``b = d^2``: the dimension of rank-H matrices W
    (a, b), capped at the coefficient space's (DESIGN §2). An upper bound on :func:`image_dimension`.

    Examples
    --------
    >>> naive_dimension(3, 3, 3), naive_dimension(3, 3, 4)   # psi * d_out = 54
    (45, 54)
    """
    a, b = d_out * d, d * d
    full = n_features(d) * d_out
    return full if H >= min(a, b) else min(H * (a + b - H), full)


def _heads_jacobian(d: int, d_out: int, V, Q) -> np.ndarray:
    """Dense Jacobian of ``vec c(V, Q)`` (psi d_out,) in ``(vec V, vec Q)`` (H (d_out d + d^2),)."""
    E = _selector(d)
    m, H = E.shape[0], V.shape[0]
    JV = np.einsum("plhi,ab->plahbi", _v_matrix(E, Q).reshape(m, d, H, d), np.eye(d_out))
    JQ = np.einsum("pahk,lL->plahkL", _q_tensor(E, V), np.eye(d))
    n = m * d * d_out
    return np.hstack([JV.reshape(n, -1), JQ.reshape(n, -1)])


def image_dimension(d: int, d_out: int, H: int, seed: int = 0, rtol: float = 1e-9) -> int:
    """Dimension of the set of coefficients that H heads reach: the rank of the Jacobian of
    ``(V, Q) -> c(V, Q)`` at a random point (DESIGN §2, §5).

    The rank at a random point is the generic rank, which is the dimension of the image (a semialgebraic set)
    with probability one; it is at most :func:`naive_dimension` (each head pair ``W = A B^T`` has the
    ``GL(H)`` symmetry ``A X, B X^-T``) and smaller where ``p`` folds more directions together: for
    ``d_out = 1`` it is ``H (d + d^2 - H) - d H (H - 1) / 2`` (each pair of heads has the d extra symmetries
    ``Q_g += v_h u^T, Q_h -= v_g u^T``). Numerical rank: singular values above ``rtol`` times the largest.

    Parameters
    ----------
    d, d_out, H : int
        Token dimension, outputs, heads.
    seed : int
        The random point is drawn from ``[seed, d, d_out, H]``.
    rtol : float
        Relative singular-value cutoff.

    Returns
    -------
    int
        The rank, at most ``psi * d_out``.

    Examples
    --------
    >>> image_dimension(3, 3, 3), naive_dimension(3, 3, 3)   # 3 heads: 45 of the 54 coefficient dimensions
    (45, 45)
    >>> image_dimension(3, 1, 2), naive_dimension(3, 1, 2)   # d_out = 1 loses d H (H - 1) / 2 = 3
    (17, 18)
    """
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng([seed, d, d_out, H])
    J = _heads_jacobian(d, d_out, rng.standard_normal((H, d_out, d)), rng.standard_normal((H, d, d)))
    with threadpool_limits(limits=1 if d <= SMALL_D else None, user_api="blas"):
        s = _svd(J, compute_uv=False)
    return int(np.sum(s > rtol * s[0]))


def _full_image(d: int, d_out: int, H: int) -> bool:
    """Whether H heads reach an open set of coefficients: ``J J^T`` (psi d_out square, from its block structure)
    is positive definite with a margin at one of two random points (a proof of full rank at that point, so of
    the generic rank; failing at both means, with probability one, a defective count)."""
    E = _selector(d)
    m = E.shape[0]
    n = m * d * d_out
    for seed in (0, 1):
        rng = np.random.default_rng([seed, d, d_out, H])
        V, Q = rng.standard_normal((H, d_out, d)), rng.standard_normal((H, d, d))
        M = _v_matrix(E, Q)
        N2 = _q_tensor(E, V).reshape(m * d_out, H * d)
        A = np.zeros((m, d, d_out, m, d, d_out))
        A += (M @ M.T).reshape(m, d, 1, m, d, 1) * np.eye(d_out)[None, None, :, None, None, :]
        A += (N2 @ N2.T).reshape(m, 1, d_out, m, 1, d_out) * np.eye(d)[None, :, None, None, :, None]
        A = A.reshape(n, n)
        margin = 1e-9 * float(np.max(np.sum(np.abs(A), axis=1)))
        try:
            _linalg().cholesky(A - margin * np.eye(n), lower=True, check_finite=False)
            return True
        except np.linalg.LinAlgError:
            continue
    return False


@functools.lru_cache(maxsize=256)
def generic_heads_bound(d: int, d_out: int) -> int:
    """Fewest heads that fit generic coefficients exactly, by counting dimensions (DESIGN §2, §5).

    H heads reach a set of dimension :func:`image_dimension` ``<= H (a + b - H)`` (rank-H matrices W of size
    (d_out d, d^2) mapped by the linear ``p``). Below ``psi * d_out`` that set is a null set, so almost every
    ``c`` (any data with noise in the targets, for instance) needs more heads: the bound is the smallest H
    whose image has full dimension. It starts at the naive count (the smallest H with
    ``H (a + b - H) >= psi d_out``: a valid bound in any case) and moves up while the Jacobian at random points
    is rank deficient (``d_out = 1``: the bound is d). For ``psi d_out > JACOBIAN_CHECK_MAX`` the naive count
    is returned. It is a bound for generic ``c`` only: coefficients of a model with fewer heads (a teacher)
    are not generic; :func:`flattening_bound` holds for every ``c``.

    Parameters
    ----------
    d, d_out : int
        Token dimension and outputs.

    Returns
    -------
    int
        Between the naive count and ``min(d_out*d, d^2)`` (where the SVD heads are always exact).

    Examples
    --------
    >>> generic_heads_bound(3, 3), generic_heads_bound(5, 3), generic_heads_bound(4, 4), generic_heads_bound(5, 1)
    (4, 7, 7, 5)
    """
    n_max = min(d_out * d, d * d)
    full = n_features(d) * d_out
    H = next(h for h in range(1, n_max + 1) if naive_dimension(d, d_out, h) >= full)
    if full > JACOBIAN_CHECK_MAX:
        return H
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1 if d <= SMALL_D else None, user_api="blas"):
        while H < n_max and not _full_image(d, d_out, H):
            H += 1
    return H


def _reported_bound(n_heads: int, exact: bool, every_c: int, generic: int) -> tuple[int, str]:
    """The bound to report with a head count, and its kind: the dimension count unless it is beaten (an exact
    model with fewer heads proves the coefficients non-generic) or the every-c bound is as large."""
    if every_c >= generic or (exact and n_heads < generic):
        return every_c, KIND_EVERY_C
    return generic, KIND_GENERIC
