"""The fewest attention heads for fitted coefficients, and lower bounds on their number (DESIGN §2, §5).

Beyond [Y25]: the data fix only the coefficients ``c = p(W)`` (DESIGN §2, [Y25] Cor. 2.4), so any heads with
``c(V, Q) = c`` compute the fitted function. The paper's SVD heads (Algorithm 1) use up to
``min(d_out*d, d^2)`` of them; far fewer usually suffice.

- :func:`fit_heads`: the best H-head model for given coefficients, in the coefficient norm or in the training
  loss, by variable projection: for fixed ``Q`` the ``V`` solve a linear least-squares problem, and
  Levenberg-Marquardt steps on the reduced problem in ``Q`` use Kaufman's Jacobian (Golub & Pereyra 1973,
  Kaufman 1975). Several deterministic starts (SVD heads, random).
- :func:`search_heads`: ``"minimal"`` (fewest heads reproducing ``coef``) or ``H`` (an exact model with at
  most H heads when one is found, else the lowest-training-loss H-head model found), with the loss-versus-heads
  curve, a time budget, and a lower bound with its kind.
- :func:`loss_vs_heads`: the lowest training loss found with H = 1, 2, ... heads, from the statistics only.
- Lower bounds: :func:`flattening_bound` holds for every ``c``; :func:`generic_heads_bound` (a dimension
  count, made exact by :func:`image_dimension`, the rank of the Jacobian of ``(V, Q) -> c``) holds for generic
  ``c``, e.g. any data with noise.

Everything here works from coefficients and the statistics (DESIGN §3); the caller solves for ``coef``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np

from .features import n_features, n_pairs, triu_index
from .heads import Heads, coef_from_heads, coef_to_W, rank_r_heads, svd_heads

#: default time budget of a head search, seconds (the result's ``budget_exhausted`` says when it ran out)
DEFAULT_BUDGET = 60.0
#: largest side of the Levenberg-Marquardt normal matrix of one variable-projection step (288 MB); larger
#: problems fall back to alternating projections ([Y25]-style SVD truncation, DESIGN §5) for exact models
VARPRO_MAX = 6000
#: largest temporary of one step's normal matrix, entries (320 MB)
WORK_MAX = 40_000_000
#: largest ``psi * d_out`` for which :func:`generic_heads_bound` checks the Jacobian (else the naive count)
JACOBIAN_CHECK_MAX = 4000
#: Levenberg-Marquardt steps per head count of the loss-versus-heads curve (its lossy fits creep slowly: the
#: curve is an upper bound on the least loss within ~1% at d = 8; ``heads=H`` polishes its model further)
CURVE_ITERS = 12
#: a step is cheap when its normal matrix costs at most this many multiply-adds (~0.01 s): the curve then takes
#: five times as many steps; below PROBE_CHEAP (d <= 5 or so) each bisection probe takes four times the starts
CHEAP_STEP, PROBE_CHEAP = 1e8, 1e7
#: starts and Levenberg-Marquardt steps of each bisection probe for exact models below the dimension count; a
#: probe stops when 5 steps reduce the squared residual by less than PROBE_STALL (runs that converge do far more)
PROBE_STARTS, PROBE_ITERS, PROBE_STALL = 3, 60, 0.3
#: up to this d the head search runs single-threaded BLAS (thousands of small products; threads only contend)
SMALL_D = 8
#: ``heads_lower_bound_kind`` values
KIND_EVERY_C = "flattening rank (every c)"
KIND_GENERIC = "dimension count (generic data)"

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
            K = (N2 @ N2.T).reshape(m, na, m, na)
            Y = np.tensordot(U3, K, axes=([0], [0]))  # (l, s, a, p', a')
            A = np.tensordot(Y, U3, axes=([0, 3], [1, 0]))  # (s, a, a', s')
            return A.transpose(0, 1, 3, 2).reshape(n_perp * na, n_perp * na), True, N0
        Pi = (Ut @ Ut.T).reshape(m, nl, m, nl)  # J^T J = sum_a N0_a^T (Ut Ut^T) N0_a
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
    for it in range(1, iters + 1):
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


def _starts(n: int, extra=()) -> list:
    """Start specs (:func:`_start_factor`): the models ``extra`` (V, Q), the SVD heads, random ones; n in all."""
    out = [("pair", V, Q) for V, Q in extra][:n]
    if len(out) < n:
        out.append(("svd",))
    out += [("random", i) for i in range(n - len(out))]
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
    >>> from scaleattn.heads import coef_from_heads
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
    >>> from scaleattn.heads import coef_from_heads
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


# ---- the search -----------------------------------------------------------------------------------------
class _Search:
    """State of one head search (:func:`search_heads`): targets, budget, the best models found per head count."""

    def __init__(self, stats, coef, G, tol, iters, starts, seed, deadline):
        self.stats, self.coef, self.G, self.tol = stats, coef, G, tol
        self.d, self.d_out = stats.d, coef.shape[1]
        self.iters, self.starts, self.seed, self.deadline = iters, starts, seed, deadline
        self.prob = _CoefProblem(coef, self.d)
        self._loss_tg = None
        self.exhausted = False
        self.attempts = {}  # r -> (residual, V, Q): best coefficient-space attempt

    @property
    def loss_tg(self) -> _Target:
        if self._loss_tg is None:
            self._loss_tg = _Target(self.coef, self.d, _loss_factor(self.G))
        return self._loss_tg

    def out_of_time(self) -> bool:
        if time.perf_counter() > self.deadline:
            self.exhausted = True
        return self.exhausted

    def sse(self, V, Q) -> float:
        return self.stats.sse(coef_from_heads(V, Q), self.G) if V.shape[0] else float(self.stats.yy)

    def exact(self, r: int, n_starts: int, extra=(), iters: int | None = None, stall_rtol: float = 1e-3):
        """An exact r-head model ``(V, Q)`` in the coefficient norm from up to ``n_starts`` starts (the models
        ``extra`` first), or None; the best attempt is kept in ``attempts``."""
        if not self.prob.feasible(r):  # too large for a Newton-type step: alternating projections
            if self.out_of_time():
                return None
            h = rank_r_heads(self.coef, self.d, r, tol=self.tol * 1e-3)
            return (h.V, h.Q) if h.residual <= self.tol else None
        for spec in _starts(n_starts, extra):
            if self.out_of_time():
                return None
            V, Q, _, _ = self.prob.run(r, spec, self.seed, iters or self.iters, self.tol, self.deadline, stall_rtol)
            res = _relative_residual(V, Q, self.coef)
            if r not in self.attempts or res < self.attempts[r][0]:
                self.attempts[r] = (res, V, Q)
            if res <= self.tol:
                return V, Q
        return None

    def loss_run(self, Q0, iters, stall_rtol):
        run = _varpro(self.loss_tg, Q0, iters, 0.0, stall_rtol, self.deadline)
        if run.reason == "budget":
            self.exhausted = True
        V, Q = _balanced(run.V, run.Q)
        return run.f, V, Q

    def grow(self, V, Q, f_prev):
        """Lowest-loss model found with one head more than (V, Q): add the steepest-descent head (top singular
        pair of the loss gradient in W), then variable projection; never worse than (V, Q) plus a zero head."""
        tg = self.loss_tg
        cur = coef_from_heads(V, Q) if V.shape[0] else np.zeros_like(self.coef)
        grad = _adjoint(tg.Lt.T @ (tg.Lt @ (cur - self.coef)), self.d)
        q_new = _svd(grad)[2][0].reshape(1, self.d, self.d)
        n = 5 * CURVE_ITERS if tg.step_cost(Q.shape[0] + 1) <= CHEAP_STEP else CURVE_ITERS
        f, Vn, Qn = self.loss_run(np.concatenate([Q, q_new]), min(self.iters, n), 1e-4)
        if f > f_prev:
            return f_prev, np.concatenate([V, np.zeros((1, self.d_out, self.d))]), np.concatenate([Q, q_new])
        return f, Vn, Qn


class _Curve:
    """The loss-versus-heads pass (step 3 of :func:`search_heads`), resumable: ``extend(top)`` adds models up to
    ``top`` heads and returns ``(r, (V, Q))`` for the first r with an exact model found from it, else
    ``(None, None)``."""

    def __init__(self, s: _Search, every_c: int):
        self.s, self.every_c = s, every_c
        self.V, self.Q, self.f = np.zeros((0, s.d_out, s.d)), np.zeros((0, s.d, s.d)), None
        self.points, self.models = [], {}

    def extend(self, top: int):
        s = self.s
        for r in range(self.V.shape[0] + 1, top + 1):
            if s.out_of_time() or not s.loss_tg.feasible(r):
                break
            self.f, self.V, self.Q = s.grow(self.V, self.Q, s.loss_tg.norm2 if self.f is None else self.f)
            self.models[r] = (self.V, self.Q)
            self.points.append((r, s.sse(self.V, self.Q)))
            if r >= self.every_c and self.f <= max(1e-8, s.tol) * s.loss_tg.norm2:
                found = s.exact(r, 2, extra=[(self.V, self.Q)])
                if found is not None:
                    return r, found
        return None, None


def search_heads(stats, coef, heads="svd", gram=None, tol: float = 1e-10, *, iters: int = 200,
                 budget: float | None = DEFAULT_BUDGET, starts: int = 4, seed: int = 0) -> Heads:
    """Heads for the fitted coefficients ``coef`` (psi, d_out), with losses from the statistics (DESIGN §5).

    ``heads``:

    - ``"svd"``: the paper's heads ([Y25] Alg. 1), up to ``min(d_out*d, d^2)``;
    - ``"minimal"``: the fewest heads found that reproduce ``coef`` to relative residual ``tol``;
    - an int H: at most H heads; the fewest exact ones when some r <= H reproduce ``coef``, else the H-head
      model of lowest training loss found (``exact`` False, ``residual`` and ``loss_gap`` say how far it is).

    The search. (1) Bounds: :func:`flattening_bound` (every c) and :func:`generic_heads_bound` (generic c).
    (2) From the generic bound up: exact models by variable projection in the coefficient norm (as
    :func:`fit_heads`; ``starts`` deterministic starts each; the SVD heads at ``min(d_out*d, d^2)``).
    (3) From 1 head up to one below the count found: the lowest-loss model with r heads (the (r-1)-head model
    plus the steepest-descent head, then variable projection on the training loss, DESIGN §3); where its loss
    reaches that of ``coef`` (and r is at least the every-c bound) an exact r-head model is sought from it.
    When a flattening has low rank (``flattening_bound < min(d, d_out)``: visibly not generic, e.g. a teacher)
    (3) runs before (2). (4) Bisection of [every-c bound, count found) with short exact runs
    (``PROBE_STARTS``, ``PROBE_ITERS``): non-generic coefficients (teachers with min(d, d_out) or more heads)
    whose greedy curve missed them. (5) For ``heads=H`` with no exact model: the best of the curve's H-head
    model, the closest coefficient fit and further loss-space starts, polished. The losses form ``curve``:
    ``[(r, sse), ...]`` for r = 1 .. the head count, non-increasing (a running minimum: fewer heads plus zero
    heads are more heads), ending at the returned model. Steps larger than ``VARPRO_MAX`` / ``WORK_MAX`` use
    alternating projections (:func:`scaleattn.heads.rank_r_heads`) for (2) and skip the curve. The budget is
    checked between Levenberg-Marquardt steps and between starts.

    Parameters
    ----------
    stats : Statistics
        With targets (DESIGN §3).
    coef : array (psi, d_out)
        The fitted coefficients (the caller solves, e.g. ``solve(stats).coef``).
    heads : "svd" | "minimal" | int
    gram : array (psi, psi), optional
        ``stats.gram()``, when the caller has it.
    tol : float
        Relative coefficient residual of an exact model.
    iters : int
        Levenberg-Marquardt steps per start.
    budget : float or None
        Seconds for the search (None: no limit). When it runs out the best models so far are returned
        (``minimal`` without an exact model below the maximum: the SVD heads) and ``budget_exhausted`` is set.
    starts, seed : int
        Starts per head count in step (2), and their seed (results are deterministic).

    Returns
    -------
    Heads
        With ``sse``, ``curve``, ``exact``, ``loss_gap``, ``lower_bound`` / ``lower_bound_kind`` (see
        :func:`_reported_bound`: the dimension count unless an exact model with fewer heads proves ``coef``
        non-generic), ``bound_every_c``, ``bound_generic``, ``budget_exhausted``, ``seconds``.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.generate import make_mhla
    >>> from scaleattn.solver import solve
    >>> from scaleattn.statistics import statistics_from_arrays
    >>> D = make_mhla(d=3, heads=2, length=20, samples=200, causal=True, noise=0.3, seed=0)  # agnostic
    >>> st = statistics_from_arrays(D["tokens"], D["targets"])
    >>> h = search_heads(st, solve(st).coef, "minimal")
    >>> h.n_heads, h.lower_bound, h.lower_bound_kind, h.residual < 1e-10   # the paper's SVD gives 9
    (4, 4, 'dimension count (generic data)', True)
    """
    t0 = time.perf_counter()
    coef = np.asarray(coef, np.float64)
    d, d_out = stats.d, coef.shape[1]
    if budget is not None and not budget > 0:
        raise ValueError(f"budget must be positive seconds or None, got {budget!r}")
    if not (heads in ("svd", "minimal") or (isinstance(heads, (int, np.integer)) and heads >= 1)):
        raise ValueError(f"heads must be 'svd', 'minimal' or a positive integer, got {heads!r}")
    G = np.asarray(stats.gram() if gram is None else gram, np.float64)
    from threadpoolctl import threadpool_limits

    deadline = math.inf if budget is None else t0 + budget
    # thousands of small BLAS calls: extra threads only contend (several times slower on a loaded 2-core box)
    with threadpool_limits(limits=1 if d <= SMALL_D else None, user_api="blas"):
        every_c, generic = flattening_bound(coef, d, tol), generic_heads_bound(d, d_out)
        if heads == "svd" or every_c == 0:
            h = svd_heads(coef, d)
            h.method = "svd"
            h.sse = stats.sse(coef_from_heads(h.V, h.Q), G) if h.n_heads else float(stats.yy)
            h.curve = [(h.n_heads, h.sse)]
            return _finish(h, stats, coef, G, tol, (every_c, KIND_EVERY_C), every_c, generic, False, t0)
        s = _Search(stats, coef, G, tol, iters, starts, seed, deadline)
        h = _run_search(s, heads, every_c, generic)
    bound = _reported_bound(h.n_heads, h.exact, every_c, generic)
    return _finish(h, stats, coef, G, tol, bound, every_c, generic, s.exhausted, t0)


def _run_search(s: _Search, heads, every_c: int, generic: int) -> Heads:
    d, d_out, coef = s.d, s.d_out, s.coef
    n_max = min(d_out * d, d * d)
    cap = n_max if heads == "minimal" else min(int(heads), n_max)
    method = "minimal" if heads == "minimal" else f"best-{int(heads)}"
    curve = _Curve(s, every_c)
    hi, model = None, None
    if every_c < min(d, d_out):  # visibly not generic (a flattening of low rank): fewer heads likely do
        hi, model = curve.extend(cap)
    if hi is None:  # (2) exact models from the generic bound up (the SVD heads at n_max)
        for r in range(max(generic, every_c, 1), cap + 1):
            if r == n_max:
                sv = svd_heads(coef, d)
                hi, model = r, (sv.V, sv.Q)
                break
            found = s.exact(r, s.starts)
            if found is not None:
                hi, model = r, found
                break
            if s.out_of_time():
                break
        if hi is None and heads == "minimal":  # out of time before any exact model: the paper's heads are exact
            sv = svd_heads(coef, d)
            hi, model = sv.n_heads, (sv.V, sv.Q)
        # (3) the loss curve below, probing for exact models with fewer heads
        low, low_model = curve.extend(cap if hi is None else hi - 1)
        if low is not None:
            hi, model = low, low_model
    # (4) coefficients that are not generic may need fewer heads than the count although the greedy curve
    # missed them: bisect [every_c, hi) with short coefficient-norm runs (exact models persist as H grows)
    lo, top = max(every_c, 1), (cap + 1 if hi is None else hi)
    while lo < top and not s.out_of_time():
        mid = (lo + top) // 2
        extra = [] if model is None else [_pruned(*model, mid)]  # the exact model less its weakest heads
        extra += [curve.models[mid]] if mid in curve.models else []
        n = PROBE_STARTS * (4 if s.prob.cheap(mid, PROBE_CHEAP) else 1)
        found = s.exact(mid, n, extra=extra, iters=min(s.iters, PROBE_ITERS), stall_rtol=PROBE_STALL)
        if found is not None:
            hi, model, top = mid, found, mid
        else:
            lo = mid + 1
    points = [p for p in curve.points if hi is None or p[0] < hi]
    curve_models = curve.models
    if hi is not None:
        V, Q = model
        sse = s.sse(V, Q)
        return Heads(V, Q, _split_spectrum(coef, d), _relative_residual(V, Q, coef), method, sse=sse,
                     curve=_monotone(points + [(hi, sse)]), exact=True)
    # (5) no exact model with at most H heads: the lowest training loss found with H heads
    cands = [(s.sse(*curve_models[cap]), *curve_models[cap])] if cap in curve_models else []
    if cap in s.attempts:
        cands.append((s.sse(s.attempts[cap][1], s.attempts[cap][2]), s.attempts[cap][1], s.attempts[cap][2]))
    extra = [(c[1], c[2]) for c in cands]  # polish them on the loss, then further starts
    for spec in _starts(max(s.starts, len(extra) + 1), extra):
        if s.out_of_time() or not s.loss_tg.feasible(cap):
            break
        _, Vc, Qc = s.loss_run(_start_factor(spec, coef, d, cap, s.seed, False), s.iters, 1e-6)
        cands.append((s.sse(Vc, Qc), Vc, Qc))
    if not cands:  # nothing ran (budget or size): the paper's heads truncated to H
        sv = svd_heads(coef, d)
        cands.append((s.sse(sv.V[:cap], sv.Q[:cap]), sv.V[:cap], sv.Q[:cap]))
    sse, V, Q = min(cands, key=lambda t: t[0])
    pts = [p for p in points if p[0] < cap] + [(cap, sse)]
    return Heads(V, Q, _split_spectrum(coef, d), _relative_residual(V, Q, coef), method, sse=sse,
                 curve=_monotone(pts), exact=_relative_residual(V, Q, coef) <= s.tol)


def _pruned(V, Q, r: int):
    """The r heads of (V, Q) with the largest ``||V_h|| ||Q_h||`` (a start for an r-head model)."""
    w = np.linalg.norm(V.reshape(V.shape[0], -1), axis=1) * np.linalg.norm(Q.reshape(Q.shape[0], -1), axis=1)
    keep = np.sort(np.argsort(-w, kind="stable")[:r])
    return V[keep], Q[keep]


def _monotone(points):
    """Running minimum of ``[(H, sse), ...]`` in H: a model with fewer heads plus zero heads has more heads."""
    out, best = [], math.inf
    for k, v in sorted(points):
        best = min(best, v)
        out.append((int(k), float(best)))
    return out


def _finish(h: Heads, stats, coef, G, tol, bound, every_c, generic, exhausted, t0) -> Heads:
    c = coef_from_heads(h.V, h.Q) if h.n_heads else np.zeros_like(coef)
    delta = c - coef
    # sse(c) - sse(coef) without cancellation against yy: delta^T G delta + 2 delta^T (G coef - B)
    h.loss_gap = float(np.sum(delta * (G @ delta)) + 2 * np.sum(delta * (G @ coef - np.asarray(stats.moments))))
    h.exact = bool(h.residual <= tol)
    h.lower_bound, h.lower_bound_kind = int(bound[0]), bound[1]
    h.bound_every_c, h.bound_generic = int(every_c), int(generic)
    h.budget_exhausted = bool(exhausted)
    h.seconds = time.perf_counter() - t0
    return h


def loss_vs_heads(stats, max_heads: int, gram=None, *, coef=None, iters: int = 60,
                  budget: float | None = DEFAULT_BUDGET) -> list[Heads]:
    """Lowest training losses found with H = 1 .. ``max_heads`` heads, from the statistics only (DESIGN §3, §5).

    Model H is model H-1 plus the steepest-descent head (top singular pair of the loss gradient in W), then
    variable projection on ``tr((c - coef)^T G (c - coef))`` (the training loss above the least-squares one);
    never worse than model H-1 plus a zero head, so the losses are non-increasing in H. ``coef`` defaults to
    ``G^+ B`` on the numerically nonzero spectrum of the Jacobi-scaled Gram (DESIGN §4). Stops early (fewer
    models) when ``budget`` seconds run out or a step would exceed ``VARPRO_MAX`` / ``WORK_MAX``.

    Parameters
    ----------
    stats : Statistics
        With targets (DESIGN §3).
    max_heads : int
        Largest head count (capped at ``min(d_out*d, d^2)``).
    gram : array (psi, psi), optional
        ``stats.gram()``, when the caller has it.
    coef : array (psi, d_out), optional
        The coefficients the losses are measured from (e.g. ``solve(stats).coef``).
    iters : int
        At most this many Levenberg-Marquardt steps per head count (``CURVE_ITERS`` caps it on large steps).
    budget : float or None
        Seconds.

    Returns
    -------
    list of Heads
        One per H with ``sse`` set and ``residual`` relative to ``coef``.

    Examples
    --------
    >>> from scaleattn.generate import make_mhla
    >>> from scaleattn.statistics import statistics_from_arrays
    >>> D = make_mhla(d=3, heads=2, length=20, samples=100, causal=True, seed=0)   # a 2-head teacher
    >>> st = statistics_from_arrays(D["tokens"], D["targets"])
    >>> [round(max(h.sse, 0.0) / st.yy, 3) for h in loss_vs_heads(st, 3)]   # 2 heads explain it all
    [0.041, 0.0, 0.0]
    """
    if stats.d_out == 0:
        raise ValueError("these statistics have no targets; cannot compute losses")
    if max_heads < 1:
        raise ValueError(f"max_heads must be >= 1, got {max_heads}")
    G = np.asarray(stats.gram() if gram is None else gram, np.float64)
    d = stats.d
    if coef is None:
        Lt = _loss_factor(G)
        coef = np.linalg.lstsq(Lt, np.linalg.lstsq(Lt.T, np.asarray(stats.moments), rcond=None)[0], rcond=None)[0]
    coef = np.asarray(coef, np.float64)
    from threadpoolctl import threadpool_limits

    t0 = time.perf_counter()
    s = _Search(stats, coef, G, 1e-10, iters, 1, 0, math.inf if budget is None else t0 + budget)
    V, Q, f, out = np.zeros((0, stats.d_out, d)), np.zeros((0, d, d)), None, []
    with threadpool_limits(limits=1 if d <= SMALL_D else None, user_api="blas"):
        for H in range(1, min(max_heads, stats.d_out * d, d * d) + 1):
            if s.out_of_time() or not s.loss_tg.feasible(H):
                break
            f, V, Q = s.grow(V, Q, s.loss_tg.norm2 if f is None else f)
            out.append(Heads(V, Q, _split_spectrum(coef, d), _relative_residual(V, Q, coef), f"loss-{H}",
                             sse=s.sse(V, Q), budget_exhausted=s.exhausted))
    return out
