"""Min-norm least squares and the certificate from products ``G X`` only: the krylov solver (DESIGN §4).

[Y25] Algorithm 1 needs ``c = G^+ B`` and Lemma 2.3 the extreme eigenvalues of ``Lambda_D = G / N``; here both
come from the matrix-free operator of :mod:`scaleattn.linalg._gram` (``G`` is never formed), so the solver
node holds ``Tc`` (psi^2 / 4 floats) and a few psi x k blocks instead of two or five psi x psi arrays.

Method. Conjugate gradients on the Jacobi-scaled normal equations ``Gs x = S B`` (``S = diag(G)^-1/2``,
``Gs = S G S``, ``c = S x``), preconditioned by the block-Jacobi inverse of the token blocks
(:class:`scaleattn.linalg._gram.BlockJacobi`), with the d_out right-hand sides as independent recurrences
sharing each operator pass. Why this method:

- ``G`` is symmetric positive semidefinite and we have ``G``, not the feature matrix: LSQR/LSMR would need
  ``Phi`` (on ``G`` itself they square the condition number), MINRES minimises the residual of the normal
  equations, i.e. the gradient. CG minimises the ``G``-norm of the error over the Krylov space, and
  ``||c - c*||_G^2 / N`` IS the excess training loss: every iterate is the best fit the space allows.
- The preconditioner: the Gram's ill-conditioning sits in the vech(S) part of the features (prefix Grams of
  one sequence are strongly correlated), which the d token blocks of m x m capture: iterations ~ 160 at d = 16
  and ~ 280 at d = 32 to a backward error of ``psi eps`` on 1.2-1.4 psi causal rows (Jacobi alone: a
  condition number 500x larger, ~20x more iterations). ``preconditioner="kfac"`` takes instead K-FAC from the
  partial traces of ``Gs`` (:class:`scaleattn.linalg._kfac.TraceKFAC`): m^2 + d^2 numbers against block-Jacobi's
  d m^2 (35 MB against 2.2 GB at d = 64), one m x m eigendecomposition against d, and on a cluster one
  m(m+1)/2 vector per worker back against the m(m+1)/2 x d token columns; it took 6-28 % more passes than
  block-Jacobi on the causal data measured (d = 8-32, 1.2-1.4 rows per feature; docs/performance.md), so
  block-Jacobi stays the default.
- Independent recurrences rather than block CG: a pass over ``Tc`` costs a fixed part (the expansion of each
  segment, shared by all columns) plus ``psi^2`` multiply-adds per column (0.2 s + 0.06 s per column at
  d = 32 on this 2-core box), so sharing passes is worth doing but a column is never free; block CG would buy
  fewer iterations for the same column products only when the right-hand sides span distinct directions, and
  targets with zero or dependent columns (the associative-memory task has half of them zero) break a block
  recurrence down, while independent ones just finish.

Stopping rule. The Gram is accumulated with a relative round-off of order ``psi eps`` (hence the eigenvalue
cutoff ``rtol = 16 psi eps``, :func:`scaleattn.linalg._solver.default_rtol`). A column stops when its normwise
backward error [RG67] ``eta = ||S B - Gs x|| / (lambda_max(Gs) ||x|| + ||S B||)`` is at most ``btol``
(default ``rtol / 16 = psi eps``): ``x`` then solves exactly a system within ``btol`` relative of the scaled
one, as good as the statistics determine it. The residual is recomputed from ``G`` before a column stops
(recursive residuals drift in finite precision). An iteration budget ``maxiter`` bounds the passes; a column
that hits it is reported (``converged`` False, its ``eta``), never silently returned.

Certificate. In the same passes (:func:`lockstep`): ``lambda_max`` of ``Gs`` and of ``G`` by Lanczos; the
smallest eigenpairs of ``Gs`` (rank decision, ``lambda_min`` of the scaled Gram) and of ``G`` by LOBPCG with the
same preconditioner; and the smallest eigenvalue of the preconditioned Gram ``C = M^-1/2 Gs M^-1/2`` by
preconditioned Lanczos, which times the blocks' exact smallest eigenvalue bounds ``lambda_min`` from below
(:func:`scaleattn.linalg._lanczos.lanczos_preconditioned_smallest`). Every estimate is an interval
(:class:`scaleattn.linalg._lanczos.EigenEstimate`). By default (``eig_budget="solve"``) the eigenvalue runs stop with
the solve, once the rank decision is settled, and report the intervals they have; ``"full"`` runs them until
the intervals are ``eig_rtol`` narrow or the budget ends.

Rank-deficient Gram. Jacobi-preconditioned CG alone would not give the dense path's answer (pinv through the
Jacobi-scaled spectrum, then the null-space component removed in original coordinates), and directions with
eigenvalues at round-off level would absorb noise. The eigenvectors of ``Gs`` below ``rtol * lambda_max``
(found by the preconditioned LOBPCG of :mod:`scaleattn.linalg._lanczos`, which grows its block until one Ritz value
above the cutoff settles) are deflated: CG runs on their orthogonal complement (``P Gs P``, ``P = I - W W^T``),
which is the truncated pseudo-inverse; then ``c = S x`` minus its projection on ``null(G) = span(S W, e_j for
all-zero features)`` where that keeps the predictions (:func:`scaleattn.linalg._spectrum.min_norm`, as the dense path).
Guaranteed: the residual on the complement meets ``btol``; the null space is complete when
``rank_converged`` is True (the first Ritz value above the cutoff settled with its residual below the gap).
Once a null direction shows up (a Ritz value below the cutoff: Ritz values are upper bounds, so there is
an eigenvalue below it), a Gram of at most :data:`DENSE_NULL_MAX` features has its smallest eigenpairs
computed from the Jacobi-scaled Gram assembled column by column through the operator (exact, and cheaper
there than growing blocks); above it the LOBPCG block grows 4x while it holds only null Ritz values, and when
a third of the live features are null (the block's 3k-column basis no longer fits; a block method is then
no cheaper than a dense one) the result says ``rank_converged = False``.

References
----------
[Y25] Yau et al., "Learning Linear Attention in Polynomial Time", NeurIPS 2025, Algorithm 1, Lemma 2.3.
[HS52] M. R. Hestenes, E. Stiefel, "Methods of conjugate gradients for solving linear systems", J. Res. NBS
49 (1952). [RG67] J. L. Rigal, J. Gaches, "On the compatibility of a given solution with the data of a linear
system", J. ACM 14 (1967). [FV01] J. Frank, C. Vuik, "On the construction of deflation-based
preconditioners", SIAM J. Sci. Comput. 23 (2001).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._backend import device_of, from_host, get_xp, to_numpy, vector_norm
from ..errors import DatasetError, ParameterError
from ._gram import BlockJacobi, blas_single_thread
from ._kfac import TraceKFAC
from ._lanczos import (
    EPS,
    EigenEstimate,
    KrylovSpectrum,
    RunningEstimate,
    _cols,
    _set_cols,
    lanczos_largest,
    lanczos_preconditioned_smallest,
    lobpcg_smallest,
    product,
    spectrum_from_runs,
)
from ._spectrum import default_rtol, min_norm

__all__ = ["krylov_solve", "KrylovSolution", "lockstep", "pcg", "preconditioner_for", "PRECONDITIONERS",
           "DEFAULT_PRECONDITIONER", "MAXITER", "LANCZOS_MAX", "BLOCK", "EIG_RTOL"]

#: default budget of operator passes for each Krylov part (solve, each eigenvalue estimate)
MAXITER = 2000
#: Lanczos steps at most (its basis is kept for full reorthogonalisation: LANCZOS_MAX psi-vectors; the largest
#: eigenvalues converge in 20-60 steps on the MHLA Grams measured)
LANCZOS_MAX = 300
#: default relative residual that makes an eigenvalue estimate "converged": its interval is then this narrow (the
#: Ritz value's error is ~ residual^2 / gap: 1e-7 relative at d = 16 for a residual of 1e-2, measured)
EIG_RTOL = 1e-2
#: with ``eig_budget="solve"`` the eigenvalue runs take at least this many passes (cheap for a small Gram)
MIN_EIG_PASSES = 100
#: the largest diagonal entry of G the solver takes (norms of its products square it: 1e308 overflows)
MAX_DIAG = 1e150
#: null vectors are accepted when their residual is below this fraction of the first eigenvalue kept
NULL_RTOL = 1e-10
#: first LOBPCG block (grown 4x while it holds only null Ritz values); 2 needs the fewest products at d = 16
BLOCK = 2
#: the preconditioners of the krylov path on ``Tc`` (:func:`preconditioner_for`)
PRECONDITIONERS = ("block-jacobi", "kfac")
#: the default one (docs/performance.md, "K-FAC on the krylov path": block-Jacobi took fewer passes wherever measured)
DEFAULT_PRECONDITIONER = "block-jacobi"
#: up to this psi a null space of more than a quarter of the features is found from the assembled scaled Gram
DENSE_NULL_MAX = 4096


def lockstep(matmat, generators: dict) -> dict:
    """Run Krylov generators side by side, one operator pass per round for all of them.

    Each generator yields a block ``X`` (psi, k) and is sent ``matmat(X)``; the blocks pending in a round are
    concatenated into one product (one pass over ``Tc``; on a cluster, one message per worker). Returns
    ``{name: the generator's return value}``.

    Examples
    --------
    >>> import numpy as np
    >>> def twice(v):
    ...     y = yield v
    ...     return float(y[0, 0])
    >>> lockstep(lambda X: 2 * X, {"a": twice(np.ones((3, 1)))})
    {'a': 2.0}
    """
    with blas_single_thread():  # the generators' work is vectors and small blocks: threaded BLAS only contends
        return _lockstep(matmat, generators)


def _lockstep(matmat, generators: dict) -> dict:
    pending, out = {}, {}
    for name, g in generators.items():
        try:
            pending[name] = (g, next(g))
        except StopIteration as e:
            out[name] = e.value
    while pending:
        names = list(pending)
        blocks = [pending[n][1] for n in names]
        xp = get_xp(*blocks)
        Y = matmat(xp.concat(blocks, axis=1))
        at = 0
        for n, X in zip(names, blocks):
            g, k = pending[n][0], X.shape[1]
            try:
                pending[n] = (g, g.send(Y[:, at : at + k]))
            except StopIteration as e:
                out[n] = e.value
                del pending[n]
            at += k
    return out


def pcg(b, scale, precondition, *, btol: float, maxiter: int = MAXITER, lam_max: RunningEstimate | None = None,
        deflate=None, x0=None, interrupt=None):
    """Generator: preconditioned CG [HS52] for ``Gs x = b`` (``Gs = S G S``), one recurrence per column.

    Parameters
    ----------
    b : array (psi, k)
        Right-hand sides in scaled coordinates (``S B``).
    scale : array (psi,)
        ``S``.
    precondition : callable
        ``R -> Ms^-1 R`` (symmetric positive semidefinite).
    btol : float
        Backward-error target (module notes).
    maxiter : int
        Budget of passes.
    lam_max : RunningEstimate, optional
        The current estimate of ``lambda_max(Gs)`` (a lower bound, so the backward error is never
        underestimated); 1 before it has one (``Gs`` has unit diagonal, so ``lambda_max >= 1``).
    deflate : array (psi, j), optional
        Orthonormal vectors (scaled coordinates) to deflate: CG runs on their complement [FV01].
    x0 : array (psi, k), optional
        Start (projected on the complement).
    interrupt : callable, optional
        ``interrupt() -> bool``, asked before every step: True ends the run early (the caller restarts it,
        e.g. deflated once a null space has been found).

    Returns
    -------
    dict
        ``x`` (psi, k), ``backward_error`` (k,), ``converged`` (k,) bool, ``iterations`` (passes).
    """
    xp = get_xp(b)
    dev = device_of(b)
    W = deflate if deflate is not None and deflate.shape[1] else None

    def proj(v):
        return v if W is None else v - W @ (W.T @ v)

    def lam():
        return max(float(1.0 if lam_max is None or lam_max.value is None else lam_max.value), 1.0)

    # the vectors stay on b's device; per-column numbers (norms, inner products: k each) come to the host, where
    # the recurrences' scalars and the stopping decisions live
    k = b.shape[1]
    bn = to_numpy(vector_norm(b, xp, axis=0))
    x = xp.zeros_like(b) if x0 is None else proj(xp.asarray(x0, dtype=xp.float64, copy=True))
    it = 0
    if x0 is None:
        r = proj(xp.asarray(b, copy=True))
    else:
        r = proj(b - (yield from product(x, scale)))
        it += 1
    eta = np.zeros(k)
    done = bn == 0  # zero right-hand side: x = 0 exactly
    fails = np.zeros(k, dtype=int)  # true-residual checks that failed: the attainable accuracy is above btol
    z = proj(precondition(r))
    p = xp.asarray(z, copy=True)
    rz = to_numpy(xp.sum(r * z, axis=0))
    while True:
        xn = to_numpy(vector_norm(x, xp, axis=0))
        rn = to_numpy(vector_norm(r, xp, axis=0))
        eta = np.where(done & (bn == 0), 0.0, rn / np.maximum(lam() * xn + bn, 1e-300))
        check = ~done & (eta <= btol)
        if check.any() and it < maxiter:  # confirm with the true residual before a column stops
            idx = np.flatnonzero(check)
            rt = proj(_cols(b, idx) - (yield from product(_cols(x, idx), scale)))
            it += 1
            r = _set_cols(r, idx, rt)
            eta_t = to_numpy(vector_norm(rt, xp, axis=0)) / np.maximum(lam() * xn[idx] + bn[idx], 1e-300)
            eta[idx] = eta_t
            ok = eta_t <= btol
            done[idx[ok]] = True
            fails[idx[~ok]] += 1
            done[idx[~ok & (fails[idx] >= 3)]] = True  # at its floor: stop, reported as not converged
            redo = idx[~ok & (fails[idx] < 3)]  # drifted: restart these columns from the true residual
            if redo.size:
                z = _set_cols(z, redo, proj(precondition(_cols(r, redo))))
                p = _set_cols(p, redo, _cols(z, redo))
                rz[redo] = to_numpy(xp.sum(_cols(r, redo) * _cols(z, redo), axis=0))
        act = np.flatnonzero(~done)
        if act.size == 0 or it >= maxiter or (interrupt is not None and interrupt()):
            break
        p_a = _cols(p, act)
        q = proj((yield from product(p_a, scale)))
        it += 1
        pq = to_numpy(xp.sum(p_a * q, axis=0))
        alpha = np.where(pq > 0, rz[act] / np.where(pq > 0, pq, 1.0), 0.0)
        broke = act[pq <= 0]  # no curvature left along p: the column is solved as far as this space allows
        a = from_host(alpha, xp, dev)[None, :]
        x = _set_cols(x, act, _cols(x, act) + a * p_a)
        r = _set_cols(r, act, _cols(r, act) - a * q)
        r_a = _cols(r, act)  # gathered again: numpy's layout of the gather sets the bits of the sums below
        z_a = proj(precondition(r_a))
        rz_new = to_numpy(xp.sum(r_a * z_a, axis=0))
        beta = from_host(np.where(rz[act] > 0, rz_new / np.where(rz[act] > 0, rz[act], 1.0), 0.0), xp, dev)[None, :]
        z = _set_cols(z, act, z_a)
        p = _set_cols(p, act, z_a + beta * p_a)
        rz[act] = rz_new
        if broke.size:
            done[broke] = True
    return {"x": x, "backward_error": eta, "converged": done & (eta <= btol), "iterations": it}


@dataclasses.dataclass
class KrylovSolution:
    """Min-norm coefficients ``coef`` (psi, d_out) (numpy) from the krylov solver, with ``spectrum``
    (:class:`KrylovSpectrum`), ``null_basis`` (psi, psi - rank), the per-column ``backward_error`` and
    ``converged`` flags and the CG ``iterations`` (passes, deflated restart included)."""

    coef: np.ndarray
    spectrum: KrylovSpectrum
    null_basis: np.ndarray
    backward_error: np.ndarray
    converged: np.ndarray
    iterations: int
    preconditioner: str = DEFAULT_PRECONDITIONER


def preconditioner_for(op, kind=None, diagonal=None):
    """The preconditioner of :func:`krylov_solve` on ``op``: ``"block-jacobi"`` (the d token blocks of m x m,
    :class:`~scaleattn.linalg._gram.BlockJacobi`, from ``op.token_columns()``), ``"kfac"`` (``A's (x) B's / tr Gs``
    from the partial traces of the Jacobi-scaled ``Gs``, :class:`~scaleattn.linalg._kfac.TraceKFAC`, from
    ``op.partial_traces(scale)``), None for :data:`DEFAULT_PRECONDITIONER`, or an object with their interface (used
    as given). ``diagonal``: ``diag G`` when already at hand. Raises :class:`ParameterError` for another name."""
    kind = DEFAULT_PRECONDITIONER if kind is None else kind
    if not isinstance(kind, str):
        return kind
    if kind not in PRECONDITIONERS:
        raise ParameterError(f"the krylov preconditioner must be one of {', '.join(PRECONDITIONERS)}; got {kind!r}")
    diag = op.diagonal() if diagonal is None else diagonal
    if kind == "kfac":
        xp = get_xp(diag)
        live = diag > 0
        return TraceKFAC(*op.partial_traces(xp.where(live, 1.0 / xp.sqrt(xp.where(live, diag, 1.0)), 0.0)), diag)
    return BlockJacobi(op.token_columns(), diag, op.d)


@dataclasses.dataclass
class _LockstepState:
    """What the runs of one :func:`krylov_solve` read of each other as they go in lockstep."""

    lam_max_s: RunningEstimate = dataclasses.field(default_factory=RunningEstimate)  # lambda_max(Gs)
    lam_max_g: RunningEstimate = dataclasses.field(default_factory=RunningEstimate)  # lambda_max(G)
    lam_min_pre: RunningEstimate = dataclasses.field(default_factory=RunningEstimate)  # lambda_min(C), preconditioned
    null_found: bool = False  # G is singular (a Ritz value below the cutoff): CG restarts deflated
    solve_done: bool = False  # CG has finished


def _then_solve_done(gen, state: _LockstepState):
    """The generator ``gen``, setting ``state.solve_done`` when it returns."""
    out = yield from gen
    state.solve_done = True
    return out


def _dense_smallest(op, M, chunk: int = 256) -> dict:
    """All eigenpairs of ``Gs``, assembled column by column through the operator (small psi only), on the operator's
    device; the eigenvalues and residual norms (psi numbers, psi <= :data:`DENSE_NULL_MAX`) come to the host."""
    xp, psi = op.xp, op.psi
    s = M.scale
    dev = device_of(s)
    cols = []
    for a in range(0, psi, chunk):
        E = xp.eye(psi, min(psi, a + chunk) - a, k=-a, dtype=xp.float64, device=dev)  # identity columns a, a + 1, ..
        cols.append(s[:, None] * op.matmat(s[:, None] * E))
    Gs = xp.concat(cols, axis=1)
    Gs = (Gs + Gs.T) / 2
    li = xp.nonzero(M.live)[0]
    w, U = xp.linalg.eigh(xp.take(xp.take(Gs, li, axis=0), li, axis=1))
    # X: U's rows at the live features, zero rows at the others (a gather from U with a zero row appended)
    pos = xp.where(M.live, xp.cumulative_sum(xp.astype(M.live, xp.int64)) - 1, w.shape[0])
    X = xp.take(xp.concat([U, xp.zeros((1, w.shape[0]), dtype=U.dtype, device=dev)], axis=0), pos, axis=0)
    rn = vector_norm(Gs @ X - X * w[None, :], xp, axis=0)
    return {"theta": to_numpy(w), "X": X, "residuals": to_numpy(rn), "iterations": -(-psi // chunk),
            "status": "dense"}


def krylov_solve(op, B=None, *, rtol: float, btol: float | None = None, eig_rtol: float = EIG_RTOL,
                 maxiter: int = MAXITER, block: int = BLOCK, seed: int = 0, unscaled: bool = True,
                 dense_null_max: int = DENSE_NULL_MAX, eig_budget: str = "solve", yy: float | None = None,
                 preconditioner=None, min_eig_passes: int = MIN_EIG_PASSES, pre_start=None, pre_until=None):
    """Certificate quantities and, with ``B``, min-norm coefficients ``G^+ B`` from products ``G X`` only.

    Parameters
    ----------
    op : GramOperator
        Or any object with ``d``, ``psi``, ``xp``, ``matmat``, ``diagonal`` and ``token_columns`` (block-Jacobi)
        or ``partial_traces`` (K-FAC) (:mod:`scaleattn.linalg._gram`).
    B : array (psi, d_out), optional
        ``sum_i phi_i y_i^T``; None for the certificate alone. With ``yy`` (``sum ||y_i||^2``) the min-norm step
        moves predictions by ``MIN_NORM_RTOL`` of the residual at most, else of their norm (``spectrum.min_norm``).
    rtol : float
        Relative eigenvalue cutoff of the Jacobi-scaled Gram (:func:`scaleattn.linalg._solver.default_rtol`).
    btol : float, optional
        Backward-error target of the solve (default ``rtol / 16``; module notes).
    eig_rtol : float
        An eigenvalue estimate is converged when its residual is at most ``eig_rtol`` times its value.
    maxiter : int
        Budget of operator passes of each part (the CG solve, each eigen-estimate, each LOBPCG restart;
        Lanczos at most :data:`LANCZOS_MAX`).
    block : int
        First LOBPCG block size.
    seed : int
        Seed of the random starts (reruns give the same numbers).
    unscaled : bool
        Also estimate ``lambda_min``/``lambda_max`` of ``G`` itself (for ``Lambda_D = G / N``).
    eig_budget : {"solve", "full"}
        ``"solve"``: the smallest-eigenvalue runs stop when the solve has converged (for a certificate alone:
        when the preconditioned Lanczos has) and they have run ``min_eig_passes`` passes, once the rank decision is
        settled; their intervals are then reported as they are (``converged`` False where wider than ``eig_rtol``).
        ``"full"``: they run until ``eig_rtol`` or ``maxiter``. The smallest eigenvalues of Grams with few rows per
        feature crowd together and converge several times slower than the solve (d = 32, 1.2 rows per feature: 600-900
        passes against 280), while the Ritz values, upper bounds, are accurate long before their intervals close.
    dense_null_max : int
        Once a null direction shows up, a Gram with at most this many features has its smallest eigenpairs
        computed from the assembled scaled Gram (exact, and cheaper than growing LOBPCG blocks there); above
        it, or with 0, LOBPCG blocks grow 4x until a Ritz value above the cutoff settles.
    preconditioner : {"block-jacobi", "kfac"} or object, optional
        :func:`preconditioner_for`: by name (default :data:`DEFAULT_PRECONDITIONER`), or an object with ``scale``,
        ``live``, ``xp``, ``apply``, ``apply_scaled`` and ``min_eigenvalues`` as
        :class:`~scaleattn.linalg._gram.BlockJacobi` (the streaming path passes its K-FAC preconditioner,
        :class:`scaleattn.linalg._kfac.KFAC`, DESIGN §4b).
    min_eig_passes : int
        The least passes of the eigenvalue runs with ``eig_budget="solve"`` (:data:`MIN_EIG_PASSES`: cheap on a
        small Gram; the streaming path, where a pass reads all the data, asks for 0).
    pre_start : array (psi,), optional
        The preconditioned Lanczos run's start ``r_0`` in scaled coordinates
        (:func:`scaleattn.linalg._lanczos.lanczos_preconditioned_smallest`); its final Ritz values are returned in
        ``spectrum.preconditioned`` (the streaming path's probabilistic lower bound reads them).
    pre_until : callable, optional
        ``pre_until(theta_min, theta_max, steps, over) -> bool``, ``over`` True once the other runs' budget is
        over: when the preconditioned run ends, instead of its own convergence
        (:func:`~scaleattn.linalg._lanczos.lanczos_preconditioned_smallest`'s ``until``).

    Returns
    -------
    KrylovSolution
        With ``B``; else the :class:`KrylovSpectrum`.

    Raises
    ------
    ParameterError, DatasetError
        ``B`` without ``psi`` rows; a diagonal of ``G`` above :data:`MAX_DIAG` (its products would overflow).

    References
    ----------
    [Y25] Algorithm 1 and Lemma 2.3; DESIGN §4; the module notes.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.linalg._gram import GramOperator
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> rng = np.random.default_rng(0)
    >>> st = statistics_from_arrays(rng.standard_normal((400, 6, 3)), rng.standard_normal((400, 2)))
    >>> sol = krylov_solve(GramOperator.from_compact(st.gram_compact, 3), st.moments, rtol=1e-12)
    >>> c = np.linalg.lstsq(st.gram(), st.moments, rcond=None)[0]
    >>> bool(np.allclose(sol.coef, c, rtol=1e-8, atol=1e-10)), sol.spectrum.rank
    (True, 18)
    """
    xp, psi = op.xp, op.psi
    if B is not None and B.shape[0] != psi:
        raise ParameterError(f"B has {B.shape[0]} rows, expected psi = {psi}")
    if eig_budget not in ("solve", "full"):
        raise ParameterError(f"eig_budget must be 'solve' or 'full', got {eig_budget!r}")
    btol = min(rtol, default_rtol(psi)) / 16 if btol is None else float(btol)  # G's round-off, whatever the cutoff
    passes0, diag = getattr(op, "passes", 0), op.diagonal()
    if float(xp.max(diag)) > MAX_DIAG:  # the unscaled runs' norms square G's entries: refused, not NaN
        raise DatasetError(f"the Gram's diagonal reaches {float(xp.max(diag)):.1e}: the krylov solver's products"
                           " would overflow float64; rescale the tokens, or use solver='cholesky' or 'eigh'")
    M = preconditioner_for(op, preconditioner, diag)
    pname = getattr(M, "name", type(M).__name__)
    scale, live = M.scale, M.live
    dev = device_of(diag)
    nlive = int(xp.count_nonzero(live))
    rng = np.random.default_rng(seed)
    livef = xp.astype(live, xp.float64)[:, None]

    def rand(k):  # seeded on the host (the same numbers on every device), moved to the operator's device
        return from_host(rng.standard_normal((psi, k)), xp, dev) * livef

    state = _LockstepState()
    notes: list[str] = []
    dead_any = nlive < psi  # all-zero features: G is singular
    floor = 32 * EPS

    def budget_over(it):
        return eig_budget == "solve" and it >= min_eig_passes and (
            state.solve_done if B is not None else state.lam_min_pre.done)

    def pre_lower():
        """Lower bound on lambda_min(Gs) from the preconditioned Lanczos: lambda_min(C) lambda_min(Ms)."""
        low = state.lam_min_pre.lower
        return max(float(0.0 if low is None else low), 0.0) * M.min_eigenvalues()[0]

    def stop_s(theta, rn, it):
        if not state.lam_max_s.ready:
            return None
        c = rtol * state.lam_max_s.value
        below = int(np.sum(theta <= c))  # Ritz values are upper bounds: at least this many eigenvalues below c
        if below:
            state.null_found = True  # G is singular: lambda_min(G) = 0, no need to estimate it
        if below == theta.size:
            return "grow"
        j = int(np.sum(np.cumprod(theta + rn <= c)))  # leading Ritz values settled below the cutoff
        if j != below:
            return None
        if j and np.any(rn[:j] > max(NULL_RTOL * theta[j], floor * state.lam_max_s.value)):
            return None  # null vectors not yet accurate enough to deflate
        kept = theta[j] - rn[j] > c or (j == 0 and pre_lower() > c)  # the first Ritz value above c is settled
        if kept and rn[j] <= eig_rtol * theta[j]:
            return "done"
        return "solve-budget" if kept and budget_over(it) else None

    def stop_g(theta, rn, it):
        if state.null_found or dead_any:
            return "singular"
        if budget_over(it):
            return "solve-budget"
        if not state.lam_max_g.ready:
            return None
        if theta[0] + rn[0] <= rtol * state.lam_max_g.value:
            return "zero"
        return "done" if rn[0] <= eig_rtol * theta[0] else None

    zero = EigenEstimate(0.0, 0.0, 0.0, 0.0, True, 0)
    if nlive == 0:  # all-zero data: everything is null
        spec = KrylovSpectrum(psi, 0, rtol, zero, zero, zero if unscaled else None, zero if unscaled else None,
                              xp.zeros((psi, 0), dtype=xp.float64, device=dev), to_numpy(~live), True, 0, [])
        if B is None:
            return spec
        return KrylovSolution(np.zeros((psi, B.shape[1])), spec, spec.null_basis(scale), np.zeros(B.shape[1]),
                              np.ones(B.shape[1], bool), 0, pname)
    lan = min(int(maxiter), LANCZOS_MAX)
    gens = {"lmax_s": lanczos_largest(psi, scale, xp=xp, rtol=1e-8, maxiter=lan, seed=seed, live=livef[:, 0],
                                      state=state.lam_max_s, device=dev, halt=budget_over)}
    k0 = min(int(block), max(1, nlive // 4))
    dense = nlive <= 16 * k0  # a handful of features: the assembled scaled Gram is the cheaper way
    if dense:
        small = _dense_smallest(op, M)
        state.null_found = bool(small["theta"][0] <= rtol * small["theta"][-1])
    else:
        gens["small_s"] = lobpcg_smallest(rand(k0), scale, M.apply_scaled, stop=stop_s, maxiter=maxiter)
        gens["pre"] = lanczos_preconditioned_smallest(psi, scale, M.apply_scaled, xp=xp, rtol=eig_rtol, maxiter=lan,
                                                      seed=seed, live=livef[:, 0], state=state.lam_min_pre, device=dev,
                                                      halt=budget_over, start=pre_start,
                                                      until=None if pre_until is None else
                                                      lambda lo, hi, k: pre_until(lo, hi, k, budget_over(k)))
    if unscaled:
        gens["lmax_g"] = lanczos_largest(psi, None, xp=xp, rtol=1e-8, maxiter=lan, seed=seed + 1,
                                         live=livef[:, 0], state=state.lam_max_g, device=dev, halt=budget_over)
        # lambda_min(Lambda_D) is reported, not decided on: one column (block 2 halves the passes, not the work)
        gens["small_g"] = lobpcg_smallest(rand(1), None, M.apply, stop=stop_g, maxiter=maxiter)
    if B is not None:
        b = scale[:, None] * xp.asarray(B, dtype=xp.float64)
        gens["cg"] = _then_solve_done(pcg(b, scale, M.apply_scaled, btol=btol, maxiter=maxiter,
                                          lam_max=state.lam_max_s, interrupt=lambda: state.null_found), state)
    res = lockstep(op.matmat, gens)
    small = small if dense else res["small_s"]
    lam_s = res["lmax_s"].value
    while small["status"] != "dense" and np.all(small["theta"] <= rtol * lam_s):
        # the block holds only null directions: a larger one, seeded with them
        k = small["theta"].size
        k_new = min(4 * k, (nlive - 1) // 3)  # LOBPCG needs its 3k-column basis inside the live features
        if psi <= dense_null_max or k_new <= k:
            if psi <= dense_null_max:
                small = _dense_smallest(op, M)
            else:
                notes.append(f"more than {k} numerically null directions: the null space is not complete")
            break
        X0 = xp.concat([small["X"], rand(k_new - k)], axis=1)
        small = lockstep(op.matmat, {"s": lobpcg_smallest(X0, scale, M.apply_scaled, stop=stop_s,
                                                             maxiter=maxiter)})["s"]
    lmax_s = res["lmax_s"]
    bounds = None
    if "pre" in res and res["pre"].lower > 0:
        bmin = M.min_eigenvalues()
        bounds = (res["pre"].lower * bmin[0], res["pre"].lower * bmin[1])  # lambda_min of Gs and of G, from below
    spec = spectrum_from_runs(small, lmax_s, res.get("lmax_g"), res.get("small_g"), M, diag, rtol, eig_rtol, nlive,
                              psi, notes, bounds)
    if "pre" in res:  # the preconditioned run's last Ritz values (a probabilistic bound from a random start)
        pre = state.lam_min_pre
        spec.preconditioned = {"theta_min": pre.value, "theta_max": pre.top, "steps": pre.steps, "n": nlive}
    if B is None:
        spec.passes = getattr(op, "passes", 0) - passes0
        return spec
    cg = res["cg"]
    iters = cg["iterations"]
    if spec.null_scaled.shape[1]:  # deflate the null space and finish from the projected iterate
        cg = lockstep(op.matmat, {"cg": pcg(b, scale, M.apply_scaled, btol=btol, maxiter=maxiter,
                                            lam_max=state.lam_max_s, deflate=spec.null_scaled, x0=cg["x"])})["cg"]
        iters += cg["iterations"]
    # the results come to the host once (coef, null basis: psi x d_out and psi x (psi - rank)); the min-norm step
    # below works there (its products with G move one psi x d_out block each way, twice, rank-deficient data only)
    coef = to_numpy(scale[:, None] * cg["x"])
    Nb = spec.null_basis(scale)
    if Nb.shape[1] and B is not None:  # min-norm in original coordinates where that keeps the fit, as the dense path
        quad = lambda n: float(np.sum(n * to_numpy(op.matmat(from_host(n, xp, dev)))))  # noqa: E731 (n^T G n)
        yy = quad(coef) if yy is None else yy  # (no yy: the predictions' own norm)
        sse = yy + quad(coef) - 2.0 * float(np.sum(coef * to_numpy(B)))
        coef = min_norm(coef, Nb, quad, np.sqrt(np.clip(to_numpy(diag), 0.0, None)), sse, yy)
    if not cg["converged"].all():
        notes.append(f"CG: {int((~cg['converged']).sum())} of {coef.shape[1]} outputs did not reach the backward"
                     f" error {btol:.1e} in {maxiter} passes (worst {float(np.max(cg['backward_error'])):.2e})")
    spec.passes = getattr(op, "passes", 0) - passes0
    return KrylovSolution(coef, spec, Nb, np.asarray(cg["backward_error"]), np.asarray(cg["converged"]), iters,
                          pname)
