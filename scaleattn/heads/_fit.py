"""The best H-head model for given coefficients, by variable projection (DESIGN §2, §5).

For fixed ``Q`` the ``V`` solve a linear least-squares problem, and Levenberg-Marquardt steps on the reduced
problem in ``Q`` use Kaufman's Jacobian (Golub & Pereyra 1973, Kaufman 1975); :func:`fit_heads` runs several
deterministic starts (SVD heads, random), in the coefficient norm or in the training loss (the Gram's norm).
The search for the fewest heads built on it is :mod:`scaleattn.heads._search`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np

from ..features import n_pairs, triu_index
from ..linalg._dense import row_gram
from ._algebra import Heads, coef_from_heads, coef_to_W

__all__ = ["fit_heads", "VARPRO_MAX", "WORK_MAX", "SMALL_D"]

#: largest side of the Levenberg-Marquardt normal matrix of one variable-projection step (288 MB); larger
#: problems fall back to alternating projections ([Y25]-style SVD truncation, DESIGN §5) for exact models
VARPRO_MAX = 6000
#: largest temporary of one step's normal matrix, entries (320 MB)
WORK_MAX = 40_000_000
#: up to this d the head search runs single-threaded BLAS (thousands of small products; threads only contend)
SMALL_D = 8

_EPS = np.finfo(np.float64).eps


# ---- the bilinear map (V, Q) -> c ------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _selector(d: int) -> np.ndarray:
    """``E`` (m, d, d) with ``c[(P, l), a] = sum_h sum_{i,k} E[P, i, k] V_h[a, i] Q_h[k, l]`` (DESIGN §2):
    ``E[P, j, k] = E[P, k, j] = 1`` for ``P = (j, k)``, ``j < k``, and ``E[P, j, j] = 1``."""
    I, J, _ = triu_index(d)
    E = np.zeros((I.size, d, d))
    E[np.arange(I.size), I, J] = 1.0
    off = np.flatnonzero(I != J)
    E[off, J[off], I[off]] += 1.0
    E.setflags(write=False)
    return E


def _v_matrix(E, Q) -> np.ndarray:
    """``M`` (m n_l, H d): ``c[:, a] = M @ vec(V[:, a, :])`` for fixed ``Q`` (H, d, n_l) (rows (P, l),
    columns (h, i))."""
    m, d, _ = E.shape
    return np.einsum("pik,hkl->plhi", E, Q).reshape(m * Q.shape[2], Q.shape[0] * d)


def _q_tensor(E, V) -> np.ndarray:
    """``N0`` (m, n_a, H, d): ``dc[(P, l), a] / dQ_h[k, l'] = delta_{l l'} N0[P, a, h, k]``."""
    return np.einsum("pik,hai->pahk", E, V)


def _linalg():
    """``scipy.linalg``, imported on first use (it would add ~0.3 s or more to ``import scaleattn``)."""
    import scipy.linalg

    return scipy.linalg


def _svd(a, full_matrices=False, compute_uv=True):
    """numpy's SVD (LAPACK gesdd), falling back to gesvd on the rare gesdd convergence failure."""
    try:
        return np.linalg.svd(a, full_matrices=full_matrices, compute_uv=compute_uv)
    except np.linalg.LinAlgError:
        return _linalg().svd(a, full_matrices=full_matrices, compute_uv=compute_uv, lapack_driver="gesvd")


def _orthonormal(Q) -> np.ndarray:
    """Heads ``Q`` mixed to orthonormal vec(Q_h): ``range(M(Q))`` and hence the reduced residual are unchanged
    (M is linear in Q and mixes heads column-block by column-block), and the problem stays well scaled."""
    B = np.linalg.qr(Q.reshape(Q.shape[0], -1).T)[0]
    return np.ascontiguousarray(B.T).reshape(Q.shape)


def _adjoint(R, d: int) -> np.ndarray:
    """``p^T R`` (d_out*d, d*d): ``W[a, j, k, l] = R[(pos(j, k), l), a]``, the adjoint of ``c = p(W)``."""
    _, _, pos = triu_index(d)
    R3 = np.asarray(R).reshape(n_pairs(d), d, -1)
    return np.moveaxis(R3[pos], 3, 0).reshape(-1, d * d)


def _transpose_coef(coef, d: int) -> np.ndarray:
    """``c^T`` (m d_out, d) with ``c^T[(P, a), l] = c[(P, l), a]``: the coefficients of the heads
    ``(Q_h^T, V_h^T)`` (E is symmetric in its last two indices), so Q can be eliminated instead of V."""
    m = n_pairs(d)
    return np.ascontiguousarray(np.asarray(coef).reshape(m, d, -1).transpose(0, 2, 1)).reshape(-1, d)


class _Target:
    """Coefficients ``coef`` (m n_l, n_a) to reproduce in the norm ``||Lt (c - coef)||_F`` with ``Lt`` (r, m n_l)
    (``None``: the coefficient norm; ``Lt^T Lt = G``: the training loss above ``coef``'s, DESIGN §3), by heads
    ``V`` (H, n_a, d) (eliminated) and ``Q`` (H, d, n_l) (searched). ``n_l = d, n_a = d_out`` for ``coef``
    itself; ``n_l = d_out, n_a = d`` for :func:`_transpose_coef` (heads ``(Q^T, V^T)``)."""

    def __init__(self, coef, d: int, Lt=None):
        self.coef, self.d, self.m = coef, d, n_pairs(d)
        self.n_l, self.n_a = coef.shape[0] // self.m, coef.shape[1]
        self.E, self.Lt = _selector(d), Lt
        self.T = coef if Lt is None else Lt @ coef
        self.norm2 = float(np.sum(self.T * self.T))
        self.rows = self.T.shape[0]

    def project(self, Q):
        """Variable projection at ``Q``: the optimal ``V`` (H, n_a, d), the reduced residual ``rho``
        (n_perp, n_a) = ``U_perp^T T``, ``Ut = Lt^T U_perp`` (m n_l, n_perp) and ``f = ||rho||^2``."""
        H, d = Q.shape[0], self.d
        M = _v_matrix(self.E, Q)
        Mw = M if self.Lt is None else self.Lt @ M
        U, s, Vt = _svd(Mw, full_matrices=True)
        k = int(np.sum(s > 1e-13 * s[0])) if s.size and s[0] > 0 else 0
        x = Vt[:k].T @ ((U[:, :k].T @ self.T) / s[:k, None])  # (H d, n_a), min-norm
        V = np.ascontiguousarray(x.reshape(H, d, self.n_a).transpose(0, 2, 1))
        Up = U[:, k:]
        rho = Up.T @ self.T
        Ut = Up if self.Lt is None else self.Lt.T @ Up
        return V, rho, Ut, float(np.sum(rho * rho))

    def normal(self, V, Ut):
        """Normal matrix of Kaufman's Jacobian ``J = -Ut^T dc/dQ`` (rows (s, a), columns Q[h, k, l]), built
        from its block structure: ``(J J^T, True)`` when J has fewer rows than columns, else ``(J^T J, False)``;
        and ``N0``."""
        m, d, nl, na, H = self.m, self.d, self.n_l, self.n_a, V.shape[0]
        N0 = _q_tensor(self.E, V)
        n_perp = Ut.shape[1]
        U3 = Ut.reshape(m, nl, n_perp)
        if n_perp * na < H * d * nl:  # J J^T = sum_l U_l^T (N0 N0^T) U_l
            N2 = N0.reshape(m * na, H * d)
            K = row_gram(N2).reshape(m, na, m, na)  # (row_gram: never the threaded dsyrk numpy would call)
            Y = np.tensordot(U3, K, axes=([0], [0]))  # (l, s, a, p', a')
            A = np.tensordot(Y, U3, axes=([0, 3], [1, 0]))  # (s, a, a', s')
            return A.transpose(0, 1, 3, 2).reshape(n_perp * na, n_perp * na), True, N0
        Pi = row_gram(Ut).reshape(m, nl, m, nl)  # J^T J = sum_a N0_a^T (Ut Ut^T) N0_a
        X = np.tensordot(Pi, N0, axes=([2], [0]))  # (p, l, l', a, h', k')
        A = np.tensordot(N0, X, axes=([0, 1], [0, 3]))  # (h, k, l, l', h', k')
        return A.transpose(0, 1, 2, 4, 5, 3).reshape(H * d * nl, H * d * nl), False, N0

    def jt(self, N0, Ut, y):
        """``J^T y`` for ``y`` (n_perp, n_a): (H, d, n_l)."""
        Z = (Ut @ y).reshape(self.m, self.n_l, self.n_a)
        return -np.tensordot(N0, Z, axes=([0, 1], [0, 2]))

    def jx(self, N0, Ut, x):
        """``J x`` for ``x`` (H, d, n_l): (n_perp, n_a)."""
        D = np.tensordot(N0, x, axes=([2, 3], [0, 1]))  # (p, a, l)
        return -(Ut.T @ D.transpose(0, 2, 1).reshape(-1, self.n_a))

    def normal_side(self, H: int) -> int:
        """Side of the normal matrix of one step with H heads (the smaller of J's two dimensions)."""
        return min(max(self.rows - H * self.d, 0) * self.n_a, H * self.d * self.n_l)

    def step_cost(self, H: int) -> float:
        """Multiply-adds of one step's normal matrix with H heads (side^2 times the other dimension of J)."""
        rows, cols = max(self.rows - H * self.d, 0) * self.n_a, H * self.d * self.n_l
        return float(min(rows, cols)) ** 2 * max(rows, cols)

    def feasible(self, H: int) -> bool:
        """Whether one step with H heads fits: normal matrix side <= ``VARPRO_MAX`` and its largest temporary
        (``Y`` or ``X`` of :meth:`normal`) <= ``WORK_MAX`` entries."""
        n_perp = max(self.rows - H * self.d, 0)
        if n_perp * self.n_a < H * self.d * self.n_l:
            work = self.n_l * n_perp * self.n_a * self.m * self.n_a
        else:
            work = self.m * self.n_l * max(self.n_l * self.n_a * H * self.d, self.m * self.n_l)
        return self.normal_side(H) <= VARPRO_MAX and work <= WORK_MAX


@dataclasses.dataclass
class _Run:
    Q: np.ndarray
    V: np.ndarray
    f: float
    iters: int
    reason: str  # "converged", "stalled", "iterations", "budget"


def _varpro(tg: _Target, Q0, iters: int, ftol2: float, stall_rtol: float, deadline: float) -> _Run:
    """Levenberg-Marquardt on the variable-projection functional ``f(Q) = ||P_perp(Q) T||^2`` (V eliminated)
    from ``Q0``, with Kaufman's Jacobian and Nielsen's damping update. Stops when ``f <= ftol2``, when ``f``
    fell by less than ``stall_rtol`` relative over 5 steps, after ``iters`` steps or at ``deadline``."""
    sla = _linalg()
    Q = _orthonormal(Q0)
    V, rho, Ut, f = tg.project(Q)
    lam, nu, hist = None, 2.0, [f]
    it, reason = 0, "iterations"
    for it in range(1, iters + 1):  # noqa: B007 (the count is returned)
        if f <= ftol2:
            reason = "converged"
            break
        if time.perf_counter() > deadline:
            reason = "budget"
            break
        A, rowform, N0 = tg.normal(V, Ut)
        g = tg.jt(N0, Ut, rho)
        top = max(float(np.max(np.diag(A))), 1e-300)
        lam = 1e-3 * top if lam is None else lam
        accepted = False
        while lam <= 1e16 * top:
            try:
                cf = sla.cho_factor(A + lam * np.eye(A.shape[0]), check_finite=False)
            except np.linalg.LinAlgError:
                lam, nu = lam * nu, nu * 2
                continue
            if rowform:
                step = -tg.jt(N0, Ut, sla.cho_solve(cf, rho.reshape(-1), check_finite=False)
                              .reshape(rho.shape))
            else:
                step = -sla.cho_solve(cf, g.reshape(-1), check_finite=False).reshape(g.shape)
            pred = f - float(np.sum((tg.jx(N0, Ut, step) + rho) ** 2))
            Qn = _orthonormal(Q + step)
            Vn, rhon, Utn, fn = tg.project(Qn)
            if fn < f:
                ratio = min((f - fn) / pred, 1.0) if pred > 0 else 0.0
                lam *= max(1 / 3, 1 - (2 * ratio - 1) ** 3) if ratio > 0 else nu
                nu = 2.0
                Q, V, rho, Ut, f = Qn, Vn, rhon, Utn, fn
                accepted = True
                break
            lam, nu = lam * nu, nu * 2
        hist.append(f)
        if not accepted:
            reason = "stalled"
            break
        if len(hist) > 5 and f > (1 - stall_rtol) * hist[-6]:
            reason = "stalled"
            break
    else:
        reason = "converged" if f <= ftol2 else "iterations"
    return _Run(Q, V, f, it, reason)


def _balanced(V, Q):
    """Rescale each head to ``||V_h|| = ||Q_h||`` (same W, better conditioned heads)."""
    nv = np.linalg.norm(V.reshape(V.shape[0], -1), axis=1)
    nq = np.linalg.norm(Q.reshape(Q.shape[0], -1), axis=1)
    ok = (nv > 0) & (nq > 0)
    f = np.sqrt(np.where(ok, nq / np.where(ok, nv, 1.0), 1.0))
    return V * f[:, None, None], Q / f[:, None, None]


def _relative_residual(V, Q, coef) -> float:
    ref = float(np.linalg.norm(coef))
    got = coef_from_heads(V, Q) if V.shape[0] else np.zeros_like(coef)
    return float(np.linalg.norm(got - coef) / ref) if ref > 0 else float(np.linalg.norm(got))


def _start_factor(spec, coef, d: int, H: int, seed, transposed: bool) -> np.ndarray:
    """The searched factor of a start: ``Q`` (H, d, d), or ``V^T`` (H, d, d_out) for the transposed problem.

    ``spec``: ``("pair", V, Q)`` (a model), ``("svd",)`` (the paper's top-H SVD heads, [Y25] Alg. 1) or
    ``("random", i)`` (Gaussian from ``[seed, H, i]``: deterministic)."""
    d_out = coef.shape[1]
    if spec[0] == "pair":
        return np.asarray(spec[1], np.float64).transpose(0, 2, 1) if transposed else np.asarray(spec[2], np.float64)
    if spec[0] == "svd":
        U, _, Vt = _svd(coef_to_W(coef, d))
        return U[:, :H].T.reshape(H, d_out, d).transpose(0, 2, 1) if transposed else Vt[:H].reshape(H, d, d)
    rng = np.random.default_rng([int(seed), H, int(spec[1]), int(transposed)])
    return rng.standard_normal((H, d, d_out if transposed else d))


def _starts(n: int, extra=(), first: int = 0, svd: bool = True) -> list:
    """Start specs (:func:`_start_factor`): the models ``extra`` (V, Q), the SVD heads (``svd``), random ones
    numbered from ``first`` (a later pass draws other starts than an earlier one); n in all."""
    out = [("pair", V, Q) for V, Q in extra][:n]
    if len(out) < n and svd:
        out.append(("svd",))
    out += [("random", first + i) for i in range(n - len(out))]
    return out


class _CoefProblem:
    """``c(V, Q) = coef`` in the coefficient norm, in whichever orientation has the smaller Levenberg-Marquardt
    system: V eliminated (search over Q, H d^2 unknowns) or Q eliminated (search over V, H d_out d)."""

    def __init__(self, coef, d: int):
        self.coef, self.d = coef, d
        self.targets = (_Target(coef, d), _Target(_transpose_coef(coef, d), d))

    def feasible(self, H: int) -> bool:
        return any(t.feasible(H) for t in self.targets)

    def cheap(self, H: int, limit: float) -> bool:
        return min(t.step_cost(H) for t in self.targets) <= limit

    def run(self, H, spec, seed, iters, tol, deadline, stall_rtol: float = 1e-3):
        """One start: ``(V, Q, f, reason)`` with balanced heads and ``f`` the squared coefficient residual."""
        a, b = self.targets
        k = int(b.feasible(H) and (not a.feasible(H) or b.normal_side(H) < a.normal_side(H)))
        tg = self.targets[k]
        r = _varpro(tg, _start_factor(spec, self.coef, self.d, H, seed, bool(k)), iters, _ftol2(tg, tol),
                    stall_rtol, deadline)
        V, Q = (r.V, r.Q) if k == 0 else (r.Q.transpose(0, 2, 1), r.V.transpose(0, 2, 1))
        return (*_balanced(np.ascontiguousarray(V), np.ascontiguousarray(Q)), r.f, r.reason)


def fit_heads(coef, d: int, H: int, *, gram=None, starts: int = 4, seed: int = 0, tol: float = 1e-10,
              iters: int = 200, budget: float | None = None, Q0=None) -> Heads:
    """Best H-head model for coefficients ``coef`` by variable projection (DESIGN §5, beyond [Y25]).

    Minimises ``||c(V, Q) - coef||_F`` (or, with ``gram`` G, ``tr((c - coef)^T G (c - coef))``: the training
    loss above that of ``coef`` when ``coef`` is the least-squares fit, DESIGN §3) over H heads. For fixed
    ``Q`` the ``V`` solve a linear least-squares problem (one (psi, H d) matrix shared by all outputs), so
    the search runs over ``Q`` alone: Levenberg-Marquardt steps with Kaufman's Jacobian of the projected
    residual (Golub-Pereyra variable projection); in the coefficient norm, over ``V`` with ``Q`` eliminated
    instead when that system is smaller (``d_out < d``). Starts: ``Q0`` if given, the paper's top-H SVD heads
    ([Y25] Alg. 1), then random heads from ``seed`` (deterministic), ``starts`` in all; it stops at the
    first start whose relative coefficient residual is at most ``tol``.

    Parameters
    ----------
    coef : array (psi, d_out)
        Coefficients ``c`` (DESIGN §2), e.g. ``solve(stats).coef``.
    d : int
        Token dimension.
    H : int
        Number of heads, ``1 <= H <= min(d_out*d, d^2)``.
    gram : array (psi, psi), optional
        The feature Gram ``G`` of the statistics: minimise the training loss instead of the coefficient
        distance.
    starts, seed, tol, iters : int, int, float, int
        Starts, their seed, the exactness tolerance (relative coefficient residual) and the Levenberg-Marquardt
        steps per start.
    budget : float, optional
        Seconds; starts stop when it runs out (``budget_exhausted`` on the result).
    Q0 : array (H, d, d), optional
        First start.

    Raises
    ------
    ValueError
        H out of range, or a step too large (``VARPRO_MAX``, ``WORK_MAX``).

    Returns
    -------
    Heads
        ``method = "fit-H"``, ``residual`` the relative coefficient residual, ``exact`` whether it is at most
        ``tol``; ``sse`` unset (no statistics here).

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.heads._algebra import coef_from_heads
    >>> rng = np.random.default_rng(0)
    >>> c = rng.standard_normal((18, 3))            # d = 3, d_out = 3: generic coefficients (psi = 18)
    >>> fit_heads(c, 3, 4).residual < 1e-10        # 4 heads fit them exactly (generic_heads_bound(3, 3) = 4)
    True
    >>> fit_heads(c, 3, 3).residual > 1e-3         # 3 heads cannot (the dimension count)
    True
    """
    coef = np.asarray(coef, np.float64)
    d_out = coef.shape[1]
    _check_h(H, d, d_out)
    t0 = time.perf_counter()
    deadline = math.inf if budget is None else t0 + budget
    specs = _starts(starts, [] if Q0 is None else [(None, Q0)])
    if gram is not None:
        tg = _Target(coef, d, _loss_factor(np.asarray(gram, np.float64)))
        ok = tg.feasible(H)
    else:
        prob = _CoefProblem(coef, d)
        ok = prob.feasible(H) and (Q0 is None or prob.targets[0].feasible(H))
    if not ok:
        raise ValueError(f"H = {H} heads at d = {d}, d_out = {d_out}: a variable-projection step would exceed "
                         f"VARPRO_MAX = {VARPRO_MAX} / WORK_MAX = {WORK_MAX:,}; use rank_r_heads")
    if gram is None and Q0 is not None:  # a given Q starts the problem that searches over Q
        specs = [("q0", Q0)] + specs[1:]
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1 if d <= SMALL_D else None, user_api="blas"):
        best, exhausted = _fit_starts(coef, d, H, specs, gram, tg if gram is not None else prob, seed, tol, iters,
                                      deadline)
    _, V, Q = best
    res = _relative_residual(V, Q, coef)
    return Heads(V, Q, _split_spectrum(coef, d), res, f"fit-{H}", exact=res <= tol,
                 budget_exhausted=exhausted, seconds=time.perf_counter() - t0)


def _fit_starts(coef, d, H, specs, gram, problem, seed, tol, iters, deadline):
    """The starts of :func:`fit_heads`: ``((key, V, Q), budget_exhausted)`` of the best (coefficient residual,
    or loss with ``gram``); stops at the first exact one in the coefficient norm."""
    best, exhausted = None, False
    for i, spec in enumerate(specs):
        if i and time.perf_counter() > deadline:
            exhausted = True
            break
        if gram is None and spec[0] == "q0":
            tg0 = problem.targets[0]
            r = _varpro(tg0, spec[1], iters, _ftol2(tg0, tol), 1e-3, deadline)
            V, Q, f, reason = (*_balanced(r.V, r.Q), r.f, r.reason)
        elif gram is None:
            V, Q, f, reason = problem.run(H, spec, seed, iters, tol, deadline)
        else:
            r = _varpro(problem, _start_factor(spec, coef, d, H, seed, False), iters, 0.0, 1e-9, deadline)
            V, Q, f, reason = (*_balanced(r.V, r.Q), r.f, r.reason)
        exhausted |= reason == "budget"
        key = _relative_residual(V, Q, coef) if gram is None else f
        if best is None or key < best[0]:
            best = (key, V, Q)
        if gram is None and key <= tol:
            break
    return best, exhausted


def _check_h(H, d, d_out):
    if not 1 <= int(H) <= min(d_out * d, d * d):
        raise ValueError(f"H = {H} heads: must be in [1, min(d_out*d, d^2) = {min(d_out * d, d * d)}]")


def _ftol2(tg: _Target, tol: float) -> float:
    """Squared residual at which a coefficient-norm run has converged: 1% of the exactness tolerance."""
    return (1e-2 * tol) ** 2 * tg.norm2


def _split_spectrum(coef, d):
    """Singular values of the symmetric-split W ([Y25] Alg. 1; the report's ``head_singular_values``)."""
    return _svd(coef_to_W(coef, d), compute_uv=False)


def _loss_factor(G) -> np.ndarray:
    """``Lt`` (r, psi) with ``Lt^T Lt = G`` on the numerically nonzero spectrum (Jacobi-scaled eigh, DESIGN §4)."""
    dg = np.sqrt(np.clip(np.diag(G), 0.0, None))
    inv = np.where(dg > 0, 1.0 / np.where(dg > 0, dg, 1.0), 0.0)
    w, U = np.linalg.eigh(G * inv[:, None] * inv[None, :])
    keep = w > 16 * G.shape[0] * _EPS * max(w[-1], 0.0)
    return (np.sqrt(w[keep])[:, None] * U[:, keep].T) * dg[None, :]
