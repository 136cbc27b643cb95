"""Extreme eigenvalues of the feature Gram without a factorisation: Lanczos and LOBPCG (DESIGN §4).

The identifiability certificate ([Y25] Lemma 2.3) needs ``lambda_max`` and ``lambda_min`` of the
Jacobi-scaled Gram ``Gs = D^-1/2 G D^-1/2`` (the rank decision) and of ``Lambda_D = G / N`` (the reported
values). Here they come from products ``G X`` only (:class:`scaleattn.linalg._gram.GramOperator`):

- largest eigenvalues by Lanczos with full reorthogonalisation from a seeded random start ([GVL13] §10.1);
  they converge in a few dozen products;
- smallest eigenvalues (and the numerical null space) by LOBPCG [K01] with the token-block preconditioner
  (:class:`scaleattn.linalg._gram.BlockJacobi`), the bases orthonormalised by SVQB [DSYG18]. The Jacobi-scaled
  Gram of realizable MHLA data has condition numbers of 1e5 and more at d >= 16 whose smallest eigenvalues
  crowd together (relative gaps of 1e-3): plain Lanczos would need thousands of products there, shift-invert
  Lanczos a full Krylov solve per step; the preconditioned block method needs a few hundred products.

:func:`spectrum_from_runs` turns the runs into the rank decision, the null vectors and the
:class:`KrylovSpectrum` that :func:`scaleattn.linalg._solver.certify` reports.

Every routine is a generator (:func:`scaleattn.linalg._krylov.lockstep`): it yields a block ``X`` (psi, k) in
original coordinates and receives ``G X``, so that several of them share one pass over the compact Gram per
iteration (phase B: one message per worker per iteration for all of them).

What the numbers guarantee. A Ritz value is a Rayleigh quotient of the operator, so the smallest is an upper
bound on ``lambda_min`` and the largest a lower bound on ``lambda_max`` (Courant-Fischer), to round-off. With
the residual ``rho = ||A v - theta v||`` of its unit Ritz vector, an eigenvalue lies within ``rho`` of
``theta`` (Krylov-Bogolyubov, [P98] Thm 4.5.1); that it is the extreme one is the standing assumption of every
Krylov eigensolver (the random start is not orthogonal to its eigenvector; it fails with probability zero).
:class:`EigenEstimate` reports ``value``, ``residual``, the interval ``[lower, upper]`` and whether the
residual met the requested relative accuracy within the budget.

References
----------
[Y25] Yau et al., "Learning Linear Attention in Polynomial Time", NeurIPS 2025, Lemma 2.3.
[K01] A. V. Knyazev, "Toward the optimal preconditioned eigensolver: LOBPCG", SIAM J. Sci. Comput. 23 (2001).
[DSYG18] J. A. Duersch, M. Shao, C. Yang, M. Gu, "A robust and efficient implementation of LOBPCG",
SIAM J. Sci. Comput. 40 (2018) (SVQB orthonormalisation, basis selection).
[HL06] U. Hetmaniuk, R. Lehoucq, "Basis selection in LOBPCG", J. Comput. Phys. 218 (2006).
[GVL13] G. H. Golub, C. F. Van Loan, "Matrix Computations", 4th ed. (2013), §10.1.
[P98] B. N. Parlett, "The Symmetric Eigenvalue Problem", SIAM (1998).
[KW92] J. Kuczynski, H. Wozniakowski, "Estimating the largest eigenvalue by the power and Lanczos algorithms
with a random start", SIAM J. Matrix Anal. Appl. 13 (1992) 1094-1122.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._backend import device_of, from_host, get_xp, numpy_or_cupy, to_numpy, vector_norm

__all__ = ["EigenEstimate", "RunningEstimate", "KrylovSpectrum", "lanczos_largest", "lanczos_preconditioned_smallest",
           "lobpcg_smallest", "svqb", "spectrum_from_runs", "product", "EPS"]

EPS = float(np.finfo(np.float64).eps)


@dataclasses.dataclass
class EigenEstimate:
    """An extreme eigenvalue from products only, with how far it is settled.

    ``value``: the Ritz value (for a smallest eigenvalue an upper bound, for a largest a lower bound);
    ``residual``: ``||A v - value v||`` of its unit Ritz vector; ``lower``/``upper``: the interval it is known
    to lie in (see the module notes); ``converged``: the residual met the requested relative accuracy within
    the budget; ``iterations``: operator products (passes) it took.
    """

    value: float
    residual: float
    lower: float
    upper: float
    converged: bool
    iterations: int

    def scaled(self, factor: float) -> EigenEstimate:
        """The same estimate for the operator multiplied by ``factor > 0`` (e.g. ``G / N``)."""
        f = float(factor)
        return EigenEstimate(self.value * f, self.residual * f, self.lower * f, self.upper * f, self.converged,
                             self.iterations)

    def summary(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RunningEstimate:
    """A Lanczos run's estimate while it runs, for the generators in lockstep with it that need it: ``value`` the
    current Ritz value, ``lower`` the lower end of its interval (the preconditioned smallest only), ``converged``
    at its accuracy, ``done`` once the run ended; the preconditioned smallest also keeps ``top`` (its largest
    Ritz value) and ``steps`` (Lanczos steps so far), what a Kuczynski-Wozniakowski bound reads
    (:func:`scaleattn.linalg._stream.kw_bound`)."""

    value: float | None = None
    lower: float | None = None
    converged: bool = False
    done: bool = False
    top: float | None = None
    steps: int = 0

    @property
    def ready(self) -> bool:
        """Converged, or the run is over: the value is as good as it gets."""
        return self.converged or self.done


def _cols(A, idx):
    """Columns ``idx`` (integers, on the host or on ``A``'s device) of ``A``: numpy's and CuPy's indexing (their
    layout, so their bits), else the standard's ``take``."""
    xp = get_xp(A)
    ix = from_host(idx, xp, device_of(A))
    return A[:, ix] if numpy_or_cupy(A) else xp.take(A, ix, axis=1)


def _set_cols(A, idx, V):
    """``A`` with its columns ``idx`` (host integers) replaced by ``V``: in place on numpy and CuPy; else a new array
    (the standard has no scatter: ``where`` over the columns)."""
    xp = get_xp(A)
    dev = device_of(A)
    if numpy_or_cupy(A):
        A[:, from_host(idx, xp, dev)] = V
        return A
    pos, sel = np.zeros(A.shape[1], dtype=np.int64), np.zeros(A.shape[1], dtype=bool)
    pos[idx], sel[idx] = np.arange(len(idx)), True
    return xp.where(from_host(sel, xp, dev)[None, :], xp.take(V, from_host(pos, xp, dev), axis=1), A)


def product(X, scale=None):
    """Sub-generator: ``A X`` for ``A = G`` (``scale`` None) or ``A = S G S`` with ``S = diag(scale)``."""
    if scale is None:
        return (yield X)
    return scale[:, None] * (yield scale[:, None] * X)


#: the relative width at which a largest-eigenvalue run may end when the runs it serves are over
HALT_RTOL = 1e-4


def lanczos_largest(n: int, scale=None, *, xp=np, rtol: float = 1e-10, maxiter: int = 300, seed: int = 0,
                    live=None, state: dict | None = None, key: str = "lam_max", device=None, halt=None):
    """Generator: the largest eigenvalue of ``A`` (``G``, or ``S G S``) by Lanczos, full reorthogonalisation.

    Parameters
    ----------
    n : int
        Order of the operator (psi).
    scale : array (n,), optional
        Jacobi scaling ``S`` (see :func:`product`).
    xp : module
        Array namespace of the operator (numpy, CuPy, any array API library).
    rtol : float
        Stop when the residual bound ``|beta_j s_j|`` of the top Ritz pair is at most ``rtol * theta``.
    maxiter : int
        Budget in products.
    seed : int
        Seed of the random start (reruns give the same numbers).
    live : array (n,) bool, optional
        Coordinates the start vector may use (features with ``diag G > 0``).
    state : RunningEstimate, optional
        Updated after every step (``value``, ``converged``; ``done`` at the end), for generators running in
        lockstep that need the estimate.
    device : optional
        The operator's device (default ``live``'s): the seeded start is made on the host and moved there, the
        Lanczos basis is kept there; only the tridiagonal's numbers come to the host.
    halt : callable, optional
        ``halt(steps) -> bool``: True ends the run before ``rtol`` once its interval is :data:`HALT_RTOL` narrow
        (the runs it serves are over and a cutoff needs no more digits: at d = 64 the run went on alone, a pass
        of the data each step, long after CG and the rank decision had finished).

    Returns
    -------
    EigenEstimate
        (as the generator's return value).

    References
    ----------
    [GVL13] §10.1; [P98] Thm 4.5.1 (the residual bound).

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.linalg._krylov import lockstep
    >>> A = np.diag(np.arange(1.0, 51.0))
    >>> est = lockstep(lambda X: A @ X, {"top": lanczos_largest(50)})["top"]
    >>> round(est.value, 8), est.converged
    (50.0, True)
    """
    import scipy.linalg

    dev = device if device is not None or live is None else device_of(live)
    v = from_host(np.random.default_rng(seed).standard_normal(n), xp, dev)
    if live is not None:
        v = v * live
    nv = float(vector_norm(v, xp))
    if nv == 0:
        return EigenEstimate(0.0, 0.0, 0.0, 0.0, True, 0)
    maxiter = max(1, min(int(maxiter), n))
    V = xp.empty((maxiter, n), dtype=xp.float64, device=dev)
    q = v / nv
    alpha, beta = [], []
    theta, res, conv = 0.0, float("inf"), False
    for j in range(maxiter):
        V[j, ...] = q
        w = (yield from product(q[:, None], scale))[:, 0]
        a = float(q @ w)
        w = w - a * q - (beta[-1] * V[j - 1, ...] if j else 0.0)
        for _ in range(2):  # full reorthogonalisation, twice is enough [GVL13 §10.1.5]
            w = w - V[: j + 1, ...].T @ (V[: j + 1, ...] @ w)
        b = float(vector_norm(w, xp))
        alpha.append(a)
        beta.append(b)
        # the tridiagonal is host floats (alpha, beta): its eigenproblem is j x j, solved on the host
        ev, evec = scipy.linalg.eigh_tridiagonal(np.array(alpha), np.array(beta[:-1]))
        theta, res = float(ev[-1]), abs(b * float(evec[-1, -1]))
        conv = res <= rtol * max(abs(theta), 1e-300) or b <= EPS * max(abs(theta), 1e-300)
        if state is not None:
            state.value, state.converged = theta, conv
        if conv or (halt is not None and res <= HALT_RTOL * abs(theta) and halt(j + 1)):
            break
        q = w / b
    if state is not None:
        state.done = True
    return EigenEstimate(theta, res, theta, theta + res, bool(conv), j + 1)


def lanczos_preconditioned_smallest(n: int, scale, precondition, *, xp=np, rtol: float = 1e-2,
                                    maxiter: int = 300, seed: int = 0, live=None,
                                    state: RunningEstimate | None = None, halt=None, start=None, until=None,
                                    device=None):
    """Generator: the smallest eigenvalue of ``C = M^-1/2 A M^-1/2`` (``A = S G S``, ``M^-1`` = ``precondition``)
    by Lanczos in the ``M^-1`` inner product, full reorthogonalisation.

    ``A = M^1/2 C M^1/2`` gives ``lambda_min(A) >= lambda_min(C) lambda_min(M)``: with the block-Jacobi ``M``
    (whose blocks' eigenvalues are exact and cheap) a lower bound on ``lambda_min`` of the scaled Gram, and of
    ``G`` itself (``M^-1 G`` and ``Ms^-1 Gs`` are similar). ``C`` is well conditioned (the preconditioner's
    purpose), so its bottom converges in about as many steps as CG needs; a random start (not the right-hand
    side, which has no component in a null space) makes a singular Gram show up as ``lambda_min(C) ~ 0``.
    The recurrence works with ``r_j = M^1/2 q_j`` and ``z_j = M^-1 r_j`` ([GVL13] §11.3.7, "preconditioned
    Lanczos"): one product ``A z_j`` and one preconditioner application per step.

    Parameters
    ----------
    n, scale, xp, maxiter, seed, live, state, device
        As :func:`lanczos_largest` (``state.value`` is the current smallest Ritz value, ``state.lower`` the
        lower end of its interval).
    precondition : callable
        ``R -> M^-1 R`` (symmetric positive definite on the live coordinates).
    rtol : float
        Stop when the residual bound of the bottom Ritz pair is at most ``rtol * theta``.
    halt : callable, optional
        ``halt(steps) -> bool``, asked after every step: True ends the run (the budget of the runs it serves is
        over).
    start : array (n,), optional
        The first ``r_0`` (``q_0 = M^-1/2 r_0``); default a Gaussian vector on the live coordinates. ``r_0 = F g``
        with ``F F^T = M`` and ``g`` Gaussian makes ``q_0`` uniformly distributed on the sphere (``M^-1/2 F`` is
        orthogonal), the start [KW92] Theorem 4.2 assumes: the run's Ritz values then bound ``lambda_min(C)``
        from below with a known failure probability (:func:`scaleattn.linalg._stream.kw_bound`).
    until : callable, optional
        ``until(theta_min, theta_max, steps) -> bool`` replaces the stopping rule (``rtol`` and ``halt``): the run
        ends when it returns True (or after ``maxiter`` steps), for a caller that needs more of the run than the
        bottom Ritz pair's convergence (the probabilistic bound's steps).

    Returns
    -------
    EigenEstimate
        ``lambda_min(C)``: ``value`` the smallest Ritz value (an upper bound), ``lower = value - residual``.

    References
    ----------
    [GVL13] §10.1 and §11.3.7; [P98] Thm 4.5.1.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.linalg._krylov import lockstep
    >>> A = np.diag(np.arange(1.0, 41.0)); d = np.arange(1.0, 41.0) ** 0.5
    >>> gen = lanczos_preconditioned_smallest(40, None, lambda R: R / d[:, None] ** 2, rtol=1e-10)
    >>> round(lockstep(lambda X: A @ X, {"c": gen})["c"].value, 6)  # C = I here
    1.0
    """
    import scipy.linalg

    dev = device if device is not None or live is None else device_of(live)
    r = from_host(np.random.default_rng([seed, 7]).standard_normal(n), xp, dev) if start is None else start
    if live is not None:
        r = r * live
    z = precondition(r[:, None])[:, 0]
    nr = float(r @ z)
    if not nr > 0:
        return EigenEstimate(0.0, 0.0, 0.0, 0.0, True, 0)
    maxiter = max(1, min(int(maxiter), n))
    R = xp.empty((maxiter, n), dtype=xp.float64, device=device_of(r))
    Z = xp.empty((maxiter, n), dtype=xp.float64, device=device_of(r))
    r, z = r / float(np.sqrt(nr)), z / float(np.sqrt(nr))  # (a Python float: the standard takes no numpy scalar)
    alpha, beta = [], []
    theta, res, conv = 0.0, float("inf"), False
    for j in range(maxiter):
        R[j, ...], Z[j, ...] = r, z
        w = (yield from product(z[:, None], scale))[:, 0]  # A z_j = M^1/2 C q_j
        a = float(z @ w)
        w = w - a * r - (beta[-1] * R[j - 1, ...] if j else 0.0)
        for _ in range(2):  # reorthogonalise q against the basis: r -= R (Z^T r)
            w = w - R[: j + 1, ...].T @ (Z[: j + 1, ...] @ w)
        zw = precondition(w[:, None])[:, 0]
        b = float(np.sqrt(max(float(w @ zw), 0.0)))
        alpha.append(a)
        beta.append(b)
        ev, evec = scipy.linalg.eigh_tridiagonal(np.array(alpha), np.array(beta[:-1]))
        theta, res = float(ev[0]), abs(b * float(evec[-1, 0]))
        conv = res <= rtol * abs(theta) or b <= EPS * max(abs(float(ev[-1])), 1e-300)
        if state is not None:
            state.value, state.lower, state.converged = theta, theta - res, conv
            state.top, state.steps = float(ev[-1]), j + 1
        if until is not None:
            if until(theta, float(ev[-1]), j + 1):
                break
        elif conv or (halt is not None and halt(j + 1)):
            break
        r, z = w / b, zw / b
    if state is not None:
        state.done = True
    return EigenEstimate(theta, res, theta - res, theta, bool(conv), j + 1)


def svqb(V, AV=None, drop: float = 1e-12):
    """Orthonormal basis of the columns of V (n, k) by SVQB [DSYG18]: ``V T`` with ``T`` from the eigenvectors
    of the normalised Gram ``V^T V``, directions below ``drop`` (relative) removed; ``AV T`` too when given.

    Examples
    --------
    >>> import numpy as np
    >>> V = np.array([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]).T  # third column zero
    >>> Q, _ = svqb(V)
    >>> Q.shape, bool(np.allclose(Q.T @ Q, np.eye(2)))
    ((3, 2), True)
    """
    xp = get_xp(V)
    if V.shape[1] == 0:
        return V, AV
    Gm = to_numpy(V.T @ V)  # k x k (the block's columns): small, decomposed on the host
    d = np.sqrt(np.maximum(np.diag(Gm), 0.0))
    ok = d > 0
    d = np.where(ok, d, 1.0)
    w, U = np.linalg.eigh(Gm / d[:, None] / d[None, :] * ok[:, None] * ok[None, :])
    keep = w > drop * max(w.max(), 0.0)
    T = from_host((U[:, keep] / np.sqrt(w[keep])[None, :]) / d[:, None], xp, device_of(V))
    return V @ T, (None if AV is None else AV @ T)


def _orth_against(V, Q, AV=None, AQ=None):
    """``V - Q (Q^T V)`` twice (Q orthonormal); ``AV`` updated the same way with ``AQ``."""
    for _ in range(2):
        C = Q.T @ V
        V = V - Q @ C
        if AV is not None:
            AV = AV - AQ @ C
    return V, AV


#: LOBPCG recomputes ``A X`` and ``A P`` with a fresh product every this many iterations (the recurrences
#: for them accumulate round-off, which held null-vector residuals at 1e-12 instead of 1e-14, measured)
REFRESH = 16


def lobpcg_smallest(X0, scale=None, precondition=None, *, stop, maxiter: int = 500, lock: float = 0.0):
    """Generator: the k smallest eigenpairs of ``A`` (``G`` or ``S G S``) by preconditioned LOBPCG [K01].

    Parameters
    ----------
    X0 : array (n, k)
        Start block (random, or the vectors of a previous run); zero rows stay zero when ``precondition``
        maps them to zero (features with ``diag G = 0``).
    scale : array (n,), optional
        Jacobi scaling (see :func:`product`).
    precondition : callable, optional
        ``R -> T R`` with ``T`` symmetric positive (semi)definite, ``T ~ A^-1`` (the block-Jacobi inverse).
    stop : callable
        ``stop(theta, residuals, iteration)`` -> None (go on), or any other value (returned as ``status``).
    maxiter : int
        Budget in iterations (one product of the active columns each).
    lock : float
        Columns whose residual is at most ``lock`` get no new search direction (soft locking).

    Returns
    -------
    dict
        ``theta`` (k,) ascending Ritz values (numpy), ``X`` (n, k) their orthonormal Ritz vectors,
        ``residuals`` (k,), ``iterations`` (products), ``status`` (the stop value, or ``"budget"``).

    References
    ----------
    [K01] Algorithm 4.1; [HL06] (the basis kept orthonormal, P from its coefficients); [DSYG18] (SVQB).

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.linalg._krylov import lockstep
    >>> A = np.diag(np.arange(1.0, 101.0))
    >>> done = lambda theta, rn, it: "done" if rn.max() < 1e-10 else None
    >>> X0 = np.random.default_rng(0).standard_normal((100, 2))
    >>> r = lockstep(lambda X: A @ X, {"low": lobpcg_smallest(X0, stop=done, precondition=lambda R: R / 50)})["low"]
    >>> np.round(r["theta"], 8).tolist(), r["status"]
    ([1.0, 2.0], 'done')
    """
    xp = get_xp(X0)
    dev = device_of(X0)
    X, _ = svqb(X0)
    k = X.shape[1]
    AX = yield from product(X, scale)
    # the projected problems (k x k here, 3k x 3k below) and the residual norms (k) are small: on the host
    theta, C = np.linalg.eigh(_sym(to_numpy(X.T @ AX)))
    C = from_host(C, xp, dev)
    X, AX = X @ C, AX @ C
    P = AP = None
    it, status = 1, "budget"
    while True:
        if it % REFRESH == 0:  # fresh A X and A P (one extra product per REFRESH iterations)
            XP = X if P is None or not P.shape[1] else xp.concat([X, P], axis=1)
            AXP = yield from product(XP, scale)
            AX, AP = AXP[:, :k], (AXP[:, k:] if XP.shape[1] > k else AP)
        R = AX - X * from_host(theta, xp, dev)[None, :]
        rn = to_numpy(vector_norm(R, xp, axis=0))
        s = stop(theta, rn, it)
        if s is not None:
            status = s
            break
        if it >= maxiter:
            break
        act = rn > lock
        Ra = _cols(R, np.flatnonzero(act))
        W = Ra if precondition is None else precondition(Ra)
        blocks = [X] + ([P] if P is not None and P.shape[1] else [])
        for Q in blocks:
            W, _ = _orth_against(W, Q)
        W, _ = svqb(W, drop=1e-10)
        if W.shape[1] == 0:
            status = "stagnated"
            break
        AW = yield from product(W, scale)
        it += 1
        # S = [X, W, P] is orthonormal by construction (no mixing of the blocks: [HL06])
        S = xp.concat(blocks + [W], axis=1)
        AS = xp.concat([AX] + ([AP] if len(blocks) > 1 else []) + [AW], axis=1)
        theta_all, Q = np.linalg.eigh(_sym(to_numpy(S.T @ AS)))
        Cx = from_host(Q[:, :k], xp, dev)
        Xn, AXn = S @ Cx, AS @ Cx
        # the new P: the W and P part of the step, as combinations of orthonormal vectors (no cancellation),
        # then made orthogonal to the new X (a correction of the order of its square) [HL06 §3]
        Pn, APn = S[:, k:] @ Cx[k:, ...], AS[:, k:] @ Cx[k:, ...]
        Pn, APn = _orth_against(Pn, Xn, APn, AXn)
        P, AP = svqb(Pn, APn, drop=1e-10)
        X, AX, theta = Xn, AXn, theta_all[:k]
    return {"theta": np.asarray(theta), "X": X, "residuals": rn, "iterations": it, "status": status}


def _sym(H):
    return (H + H.T) / 2


@dataclasses.dataclass
class KrylovSpectrum:
    """What the krylov certificate knows about the spectrum (DESIGN §4; [Y25] Lemma 2.3).

    ``lam_max_scaled``/``lam_min_scaled``: largest and smallest eigenvalue of ``Gs`` (the smallest is at
    round-off level when ``Gs`` is singular); ``lam_max``/``lam_min``: of ``G`` itself (divide by N for ``Lambda_D``;
    ``lam_min`` is 0 when the rank is not full); ``rank`` and ``null_scaled`` (psi, j): the eigenvectors of ``Gs`` below
    the cutoff (scaled coordinates), ``dead`` (psi,) bool: all-zero features (exactly null); ``lam_min_kept``: the
    smallest eigenvalue of ``Gs`` above the cutoff (the condition number's denominator); ``rank_converged``: the null
    space is complete and accurate (:mod:`scaleattn.linalg._krylov`, rank-deficient Gram); ``passes``: operator passes
    of the whole computation; ``notes``: what was not settled, in words.
    """

    psi: int
    rank: int
    rtol: float
    lam_max_scaled: EigenEstimate
    lam_min_scaled: EigenEstimate
    lam_max: EigenEstimate | None
    lam_min: EigenEstimate | None
    null_scaled: object
    dead: object
    rank_converged: bool
    passes: int = 0
    notes: list = dataclasses.field(default_factory=list)
    #: the smallest eigenvalue of ``Gs`` above the cutoff (``lam_min_scaled`` when the rank is full) and the
    #: largest Ritz value below it (an upper bound on the largest dropped eigenvalue; 0 when none)
    lam_min_kept: EigenEstimate | None = None
    dropped_max: float = 0.0
    #: the preconditioned Lanczos run's last extreme Ritz values of ``C`` and its steps (``theta_min``,
    #: ``theta_max``, ``steps``, ``n`` live features); None without that run
    preconditioned: dict | None = None

    @property
    def verdict_settled(self) -> bool:
        """The rank decision (and so the identifiability verdict) is settled: the null space complete and
        lambda_max(Gs), which sets the cutoff, known to :data:`HALT_RTOL` (a run ended with the solve is that
        narrow, not at its own ``rtol``)."""
        top = self.lam_max_scaled
        return bool(self.rank_converged and (top.converged or top.residual <= HALT_RTOL * abs(top.value)))

    @property
    def converged(self) -> bool:
        """The verdict is settled and every eigenvalue interval is within the requested relative width."""
        parts = [self.lam_max_scaled, self.lam_min_scaled, self.lam_min_kept, self.lam_max, self.lam_min]
        return self.verdict_settled and all(p.converged for p in parts if p is not None)

    def null_basis(self, scale):
        """Orthonormal basis (psi, psi - rank) of ``null(G)`` in original coordinates (numpy: a result, copied to
        the host once)."""
        cols = [to_numpy(scale[:, None] * self.null_scaled)] if self.null_scaled.shape[1] else []
        idx = np.flatnonzero(self.dead)
        if idx.size:
            E = np.zeros((scale.shape[0], int(idx.size)))
            E[idx, np.arange(int(idx.size))] = 1.0
            cols.append(E)
        if not cols:
            return np.zeros((scale.shape[0], 0))
        q, _ = np.linalg.qr(np.concatenate(cols, axis=1))
        return q


def spectrum_from_runs(small, lmax_s, lmax_g, small_g, M, diag, rtol, eig_rtol, nlive, psi, notes,
                       bounds=None) -> KrylovSpectrum:
    """Rank decision, null vectors and eigenvalue estimates from the runs of
    :func:`scaleattn.linalg._krylov.krylov_solve`
    (``small``: the smallest eigenpairs of ``Gs``; ``lmax_s``/``lmax_g``: Lanczos estimates; ``small_g``: the
    LOBPCG run on ``G``; ``M``: the preconditioner, for the scaling; ``notes`` is appended to; ``bounds``:
    lower bounds on ``lambda_min`` of ``Gs`` and of ``G`` from the preconditioned Lanczos, used when the rank
    is full). An estimate is converged when its interval is at most ``eig_rtol`` of its value wide."""
    xp = M.xp
    theta, X, rn = small["theta"], small["X"], np.asarray(small["residuals"])
    if not lmax_s.converged:
        notes.append(f"lambda_max(Gs) not converged in {lmax_s.iterations} passes (residual {lmax_s.residual:.2e})")
    c = rtol * lmax_s.value
    j = int(np.sum(theta <= c))  # ascending: the Ritz values below the cutoff are the null directions
    exact = small["status"] == "dense"
    settled = exact or small["status"] in ("done", "solve-budget")
    rank = nlive - j
    if j < theta.size:
        lo = max(float(theta[j] - rn[j]), 0.0)
        if bounds is not None and j == 0 and nlive == psi:
            lo = max(lo, min(bounds[0], float(theta[j])))
        kept = EigenEstimate(float(theta[j]), float(rn[j]), lo, float(theta[j]),
                             bool(exact or theta[j] - lo <= eig_rtol * theta[j]), int(small["iterations"]))
    else:
        kept = EigenEstimate(float("nan"), float("nan"), 0.0, float(c), False, int(small["iterations"]))
        notes.append(f"every Ritz value found is below the cutoff: rank <= {rank}, the null space may be larger")
        settled = False
    if not settled:
        notes.append(f"rank decision not settled ({small['status']} after {small['iterations']} iterations)")
    first = EigenEstimate(float(theta[0]), float(rn[0]), float(theta[0] - rn[0]), float(theta[0]),
                          bool(exact or rn[0] <= eig_rtol * abs(theta[0]) or j > 0), int(small["iterations"]))
    if nlive < psi:  # all-zero features are exact null directions of Gs (its rows there are zero)
        first = EigenEstimate(min(0.0, first.value), 0.0, min(0.0, first.lower), 0.0, True, first.iterations)
    # dropped side of the margin: the largest magnitude below the cutoff, as on the dense path
    W, dropped = X[:, :j], float(np.max(np.abs(theta[:j]))) if j else 0.0
    if j:
        W, _ = svqb(W * xp.astype(M.live, xp.float64)[:, None])
    # dead: one flag per feature, on the host with the certificate (psi bytes, once per solve)
    spec = KrylovSpectrum(psi, rank, rtol, lmax_s, kept if j == 0 and nlive == psi else first, lmax_g, None, W,
                          to_numpy(~M.live), bool(settled), 0, notes, kept, dropped)
    if small_g is not None:
        spec.lam_min = _unscaled_min(small_g, kept, lmax_g, diag, M, rtol, rank == psi, notes, eig_rtol,
                                     None if bounds is None else bounds[1], first=first, vector=X[:, :1],
                                     dead=nlive < psi)
    if rank == psi and not kept.lower > c:
        spec.rank_converged = False
        notes.append(f"identifiability not settled: lambda_min of the scaled Gram is only known to be in"
                     f" [{kept.lower:.3e}, {kept.upper:.3e}], the cutoff is {c:.3e}")
    return spec


def _unscaled_min(small_g, kept, lmax_g, diag, M, rtol, full_rank, notes, eig_rtol, lower=None, *, first=None,
                  vector=None, dead: bool = False) -> EigenEstimate:
    """``lambda_min(G)`` from its LOBPCG run; where products with ``G`` cannot resolve it (badly scaled
    features) the interval from ``Gs``: ``lambda_min(Gs) min(diag) <= lambda_min(G) <= lambda_min(Gs) max(diag)``.

    A rank below psi is not a singular ``G``: only all-zero features (``dead``) make ``lambda_min(G) = 0``
    exactly. Else the interval comes from the scaled Gram's smallest Ritz pair ``first`` (``vector``, unit, in
    scaled coordinates): below, ``first.lower`` times ``min(diag)`` (``max(diag)`` when negative); above, the
    Rayleigh quotient of ``G`` at ``D^-1/2 vector`` (``first.value / ||D^-1/2 vector||^2``) or the LOBPCG run's
    Ritz value on ``G``, whichever is smaller."""
    t, r, it = float(small_g["theta"][0]), float(small_g["residuals"][0]), int(small_g["iterations"])
    if not full_rank and (dead or first is None):  # all-zero features: G is exactly singular
        return EigenEstimate(0.0, 0.0, 0.0, 0.0, True, it)
    xp = M.xp
    if not full_rank:  # null directions of Gs below the cutoff, but G itself may well be nonsingular
        dl = diag[M.live]  # (on the device: only the scalars below come to the host)
        v = vector[:, 0][M.live]
        q = float(xp.sum(v**2 / dl))  # ||D^-1/2 v||^2 on the live coordinates (the others are 0)
        up = first.value / q if q > 0 else float("inf")
        up = min(up, t)  # (a Ritz value of G: a Rayleigh quotient, whatever the run's status)
        lo = first.lower * (float(xp.min(dl)) if first.lower >= 0 else float(xp.max(dl)))
        up = max(up, lo)
        return EigenEstimate(up, float(first.residual), lo, up, bool(up - lo <= eig_rtol * abs(up)), it)
    if small_g["status"] in ("done", "solve-budget", "budget") and t > rtol * lmax_g.value:
        lo = max(t - r, 0.0, min(lower or 0.0, t))
        return EigenEstimate(t, r, lo, t, bool(t - lo <= eig_rtol * t), it)
    dl = diag[M.live]
    lo, hi = kept.lower * float(xp.min(dl)), min(t, kept.upper * float(xp.max(dl)))
    notes.append(f"lambda_min(G) not resolved by products with G ({small_g['status']}): it lies in"
                 f" [{lo:.3e}, {hi:.3e}] (from lambda_min of the scaled Gram)")
    return EigenEstimate(hi, r, lo, hi, False, it)
