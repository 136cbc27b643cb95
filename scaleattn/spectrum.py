"""Spectra and factorisations of the feature Gram matrix ``G`` (layer L2; DESIGN §4).

The machinery the certificate and the solver share: the relative eigenvalue cutoff, the Jacobi-scaled
eigendecomposition (:class:`Spectrum`), and for large psi a Cholesky factor of the scaled Gram with block
Krylov estimates of its extreme eigenvalues (:class:`CholeskyFactor`, :mod:`scaleattn.dense`), so that no
psi x psi eigendecomposition is needed. Which path runs is :func:`solver_path`.

Numerics: Jacobi scaling ``Gs = D^-1/2 G D^-1/2`` (``D = diag G``) makes the rank decision independent of the
units of the features; eigenvalues at or below ``cutoff_rtol * lambda_max(Gs)`` are dropped, with
``cutoff_rtol`` set by the accumulation round-off (order ``psi * eps``), never by N.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ._params import choice
from .dense import blocked_cholesky, gemm, largest_eigenvalues
from .errors import ParameterError

__all__ = ["Spectrum", "scaled_spectrum", "CholeskyFactor", "cholesky_factor", "solver_path", "default_rtol",
           "syevd_workspace", "SOLVERS", "LARGE_PSI", "KRYLOV_PSI", "EIGH_FALLBACK_PSI", "SYEVD_MAX",
           "CUSOLVER_SYEVD_MAX", "EIG_RTOL", "EIG_BLOCK", "EIG_MAXITER"]

#: numpy's eigh (LAPACK syevd) sizes its workspace with 32-bit integers: 1 + 6n + 2n^2 overflows near 32,767
SYEVD_MAX = 30_000
#: cuSOLVER's syevd workspace (32-bit) overflows near n = 26,700 (DESIGN §4); a GPU eigh must stay below this
CUSOLVER_SYEVD_MAX = 26_000
#: above this psi, ``solver="auto"`` solves by Cholesky + Lanczos (``psi^3 / 3`` flops, 2 psi x psi arrays)
#: instead of a full eigh (~9 psi^3 flops, ~5 arrays, and memory-bound): at d = 16 (psi = 2,176) about 1 s
#: instead of ~20 s on 2 cores, at d = 32 (psi = 16,896) minutes instead of hours. The certificate then has
#: the extreme eigenvalues only (pass ``solver="eigh"`` for the whole spectrum). A Gram that is not
#: numerically positive definite falls back to eigh (which finds the null space).
LARGE_PSI = 2_000
#: above this psi, ``solver="auto"`` falls back to the krylov path (ridge 0) instead of a full eigh when the
#: Gram is not positive definite: eigh costs ~9 psi^3 flops at memory speed (minutes at d = 24, hours at d = 32)
EIGH_FALLBACK_PSI = 8_000
#: above this psi, ``solver="auto"`` takes the krylov path (:mod:`scaleattn.krylov`, no psi x psi array), and
#: below it whenever the dense path does not fit in the memory there is (:func:`solver_path` with ``fits``).
#: Cholesky's cost is fixed (psi^3 / 3); krylov's grows with the conditioning, worst with few rows per feature:
#: at d = 32 on 1.2 rows per feature (``scaleattn bench krylov``) Cholesky is the faster, so it stays the
#: default wherever it fits, up to d = 32
KRYLOV_PSI = 20_000
#: the Cholesky path's extreme eigenvalues (:func:`cholesky_factor`): the estimated relative error of the
#: smallest (``residual^2 / gap`` of its Ritz pair; the largest, well separated, run to 1e-1 of it: 8-10
#: products), the vectors per operator of their block Krylov runs and the products at most. What needs them: the
#: verdict (``w_min / w_max`` against the cutoff with a factor-10 margin,
#: :data:`scaleattn.certificate.SETTLE_FACTOR`) and the printed 4-digit ``lambda_min``. Measured errors are
#: 30-1000x below the estimate (realizable teachers, 1.2 rows per feature: at 1e-6 the smallest scaled
#: eigenvalue is 1e-8 off at d = 24, 8e-9 at d = 32 (1e-10 at 1e-8), the unscaled 9e-9 and 3e-8); the rigorous
#: intervals (``estimates``) are then ~1e-4 wide. The smallest eigenvalues of the scaled Gram of realizable data
#: crowd together (relative gaps ~1e-3): at 1e-6 their runs take 19 products of 16 vectors at d = 24 and 14 at
#: d = 32 (22 and 17 at 1e-8; ARPACK with single vectors took 80)
EIG_RTOL = 1e-6
EIG_BLOCK = 16
EIG_MAXITER = 60
#: the solver paths (``--solver``)
SOLVERS = ("auto", "eigh", "cholesky", "krylov")


def syevd_workspace(n: int) -> int:
    """Doubles of LAPACK ``syevd`` workspace for an n x n eigendecomposition with vectors: ``1 + 6n + 2n^2``.

    With 32-bit LAPACK integers (numpy's, scipy's wheels without ILP64, cuSOLVER) this must stay below 2^31.
    """
    return 1 + 6 * n + 2 * n * n


def default_rtol(psi: int) -> float:
    """Relative eigenvalue cutoff: ``16 * psi * eps64`` (the Gram's accumulation round-off; independent of N)."""
    return 16.0 * psi * np.finfo(np.float64).eps


def solver_path(psi: int, solver: str = "auto", large_psi: int | None = None, krylov_psi: int | None = None,
                fits=None, dense: bool = False) -> str:
    """The path :func:`~scaleattn.solve` and :func:`~scaleattn.certify` take: ``"eigh"``, ``"cholesky"`` or
    ``"krylov"``.

    Parameters
    ----------
    psi : int
        Number of features.
    solver : {"auto", "eigh", "cholesky", "krylov"}
        An explicit path is taken as is (``"eigh"`` past ``SYEVD_MAX`` through the O(n)-workspace MRRR driver).
        ``"auto"``: eigh up to ``large_psi`` (default :data:`LARGE_PSI`), Cholesky + Lanczos up to
        ``krylov_psi`` (default :data:`KRYLOV_PSI`), krylov above; and krylov whenever ``fits(path)`` says the
        dense path chosen does not fit in memory.
    large_psi, krylov_psi : int, optional
        Where ``"auto"`` switches to Cholesky and to krylov.
    fits : callable, optional
        ``fits(path) -> bool`` (:func:`scaleattn.distributed.memory.fit_memory` passes one comparing the
        path's peak with the memory available); None: no memory limit.
    dense : bool
        Only the dense paths (``ridge > 0`` needs the whole spectrum): ``"auto"`` never takes krylov.

    Returns
    -------
    str

    Raises
    ------
    ParameterError
        An unknown solver; ``"krylov"`` with ``dense``.

    Examples
    --------
    >>> solver_path(288), solver_path(16_896, "cholesky"), solver_path(43_560)
    ('eigh', 'cholesky', 'krylov')
    >>> solver_path(2_176, fits=lambda path: path == "krylov")
    'krylov'
    """
    choice("solver", solver, SOLVERS)
    if dense and solver == "krylov":
        raise ParameterError("ridge > 0 needs a dense solver (its effective degrees of freedom need the whole"
                             " spectrum): use solver='auto', 'cholesky' or 'eigh', or ridge=0 with krylov")
    if solver != "auto":
        return solver
    if psi <= (LARGE_PSI if large_psi is None else int(large_psi)):
        path = "eigh"
    elif psi <= (KRYLOV_PSI if krylov_psi is None else int(krylov_psi)) or dense:
        path = "cholesky"
    else:
        return "krylov"
    return path if fits is None or fits(path) or dense else "krylov"


@dataclasses.dataclass
class Spectrum:
    """Jacobi-scaled eigendecomposition of a Gram matrix: ``G = D^1/2 U diag(w) U^T D^1/2``.

    ``w`` ascending; ``keep`` marks eigenvalues above ``cutoff_rtol * w.max()``; ``scale = diag(G)^-1/2`` (0
    for all-zero features, which are then exactly null).
    """

    w: np.ndarray
    U: np.ndarray
    scale: np.ndarray
    cutoff_rtol: float

    @property
    def keep(self) -> np.ndarray:
        return self.w > self.cutoff_rtol * max(self.w[-1], 0.0)

    @property
    def rank(self) -> int:
        return int(self.keep.sum())

    def null_basis(self) -> np.ndarray:
        """Orthonormal basis (psi, psi - rank) of the numerical null space of G in original coordinates."""
        k = ~self.keep
        if not k.any():
            return np.zeros((self.U.shape[0], 0))
        # null(G) = D^-1/2 null(G_scaled); all-zero features are null directions themselves
        basis = np.where(self.scale[:, None] > 0, self.scale[:, None] * self.U[:, k], self.U[:, k])
        q, _ = np.linalg.qr(basis)
        return q

    def ridge_apply(self, rhs: np.ndarray, ridge: float) -> np.ndarray:
        """``(G + ridge * diag(G))^-1 rhs`` through all eigenvalues (negative round-off clipped to 0)."""
        t = self.U.T @ (self.scale[:, None] * rhs)
        return self.scale[:, None] * (self.U @ (t / (np.maximum(self.w, 0.0) + ridge)[:, None]))

    def effective_dof(self, ridge: float) -> float:
        """``sum_i w_i / (w_i + ridge)`` over the scaled eigenvalues; the rank when ``ridge == 0``."""
        if ridge == 0:
            return float(self.rank)
        w = np.maximum(self.w, 0.0)
        return float(np.sum(w / (w + ridge)))

    def pinv_apply(self, rhs: np.ndarray) -> np.ndarray:
        """``G^+ rhs`` through the kept spectrum (Jacobi-scaled pseudo-inverse)."""
        k = self.keep
        Uk = self.U[:, k]
        t = Uk.T @ (self.scale[:, None] * rhs)
        return self.scale[:, None] * (Uk @ (t / self.w[k][:, None]))


def _eigh(a: np.ndarray):
    if a.shape[0] <= SYEVD_MAX:
        return np.linalg.eigh(a)
    import scipy.linalg

    # MRRR driver: O(n) workspace, so no 32-bit workspace overflow past numpy's limit
    return scipy.linalg.eigh(a, driver="evr", overwrite_a=True, check_finite=False)


def _eigvalsh(a: np.ndarray):
    if a.shape[0] <= SYEVD_MAX:
        return np.linalg.eigvalsh(a)
    import scipy.linalg

    return scipy.linalg.eigh(a, eigvals_only=True, driver="evr", check_finite=False)


def scaled_spectrum(G: np.ndarray, cutoff_rtol: float | None = None) -> Spectrum:
    """Jacobi-scaled eigendecomposition of a symmetric PSD Gram matrix ``G`` (psi, psi) (DESIGN §4).

    ``G`` is not modified; the scaled copy becomes the eigenvectors (LAPACK works in place on it)."""
    diag = np.diag(G).copy()
    scale = np.where(diag > 0, 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0)), 0.0)
    Gs = G * scale[:, None] * scale[None, :]
    w, U = _eigh(Gs)
    return Spectrum(w, U, scale, default_rtol(G.shape[0]) if cutoff_rtol is None else float(cutoff_rtol))


def lambda_min_full_rank(spec: Spectrum) -> float:
    """``lambda_min(G)`` of a full-rank ``G`` from its Jacobi-scaled eigendecomposition:
    ``1 / ||D^-1/2 U diag(w)^-1/2||_2^2`` (``G^-1 = A A^T`` with that ``A``).

    Accurate in relative terms even when ``diag(G)`` spans many orders of magnitude (badly scaled coordinates),
    where ``eigvalsh(G)`` resolves eigenvalues only down to ``eps * lambda_max(G)`` (DESIGN §4).
    """
    A = spec.U * (1.0 / np.sqrt(spec.w))[None, :]
    A *= spec.scale[:, None]
    if A.shape[0] <= 1024:
        smax = np.linalg.norm(A, 2)
    else:
        from scipy.sparse.linalg import svds

        smax = svds(A, k=1, return_singular_vectors=False, random_state=0)[0]  # reproducible bits
    return float(1.0 / smax**2)


@dataclasses.dataclass
class CholeskyFactor:
    """Cholesky factor ``L`` of the Jacobi-scaled Gram ``Gs = D^-1/2 G D^-1/2 = L L^T`` and Lanczos estimates of
    the extreme eigenvalues of ``Gs`` (``w_min``, ``w_max``) and of ``Lambda_D = G / N`` (``lam_min``,
    ``lam_max``). ``G`` itself is kept unmodified (callers reuse it)."""

    G: np.ndarray
    L: np.ndarray
    scale: np.ndarray
    w_min: float = 0.0
    w_max: float = 0.0
    lam_min: float = 0.0
    lam_max: float = 0.0
    #: the :class:`scaleattn.lanczos.EigenEstimate` of ``lambda_max(Gs)``, ``lambda_max(Gs^-1)``, ``lambda_max(G)``
    #: and ``lambda_max(G^-1)`` (keys ``lambda_max_scaled``, ``lambda_min_scaled_inverse``, ``lambda_max``,
    #: ``lambda_min_inverse``)
    estimates: dict = dataclasses.field(default_factory=dict)

    @property
    def converged(self) -> bool:
        """Every extreme eigenvalue met its relative accuracy."""
        return all(e.converged for e in self.estimates.values())

    def settled(self, threshold: float) -> bool:
        """Whether ``w_min / w_max >= threshold`` is decided: every estimate converged, or the ratio is on the
        same side of ``threshold`` at both ends of the eigenvalues' intervals."""
        if self.converged or not self.estimates:
            return True
        top, inv = self.estimates["lambda_max_scaled"], self.estimates["lambda_min_scaled_inverse"]
        low, high = 1.0 / inv.upper / top.upper, 1.0 / max(inv.lower, 1e-300) / max(top.lower, 1e-300)
        return (low >= threshold) == (high >= threshold)

    def scaled_matvec(self, x: np.ndarray) -> np.ndarray:
        """``Gs x`` without forming ``Gs``."""
        if x.ndim == 1:
            return self.scaled_matvec(x[:, None])[:, 0]
        return self.scale[:, None] * gemm(self.G, self.scale[:, None] * x)  # scipy's BLAS, as the solves

    def solve(self, rhs: np.ndarray) -> np.ndarray:
        """``Gs^-1 rhs`` through the factor."""
        from scipy.linalg import cho_solve

        if self.L.flags.c_contiguous:  # (blocked_cholesky) L in C order is the upper factor L^T in Fortran's
            return cho_solve((self.L.T, False), rhs, check_finite=False)
        return cho_solve((self.L, True), rhs, check_finite=False)


def cholesky_factor(G: np.ndarray, cutoff_rtol: float, n_rows: int, *, eig_rtol: float = EIG_RTOL,
                    block: int = EIG_BLOCK) -> CholeskyFactor | None:
    """Factor the Jacobi-scaled Gram; None when it is not numerically positive definite beyond the cutoff (the
    caller then falls back to eigh, which finds the null space).

    ``G`` is factored as is (:func:`scaleattn.dense.blocked_cholesky`: LAPACK only on small diagonal blocks,
    GEMM for the rest) and the factor's rows scaled by ``D^-1/2`` (``D^-1/2 L`` is the Cholesky factor of
    ``Gs``; Cholesky is unaffected by diagonal scaling, van der Sluis), so ``G`` stays intact for the heads and
    the witness. One Cholesky (``psi^3 / 3`` flops; memory ``G`` and its factor), then block Krylov
    (:func:`scaleattn.dense.largest_eigenvalues`) for the extreme eigenvalues ([Y25] Lemma 2.3 needs
    ``lambda_min``): ``Gs`` and ``G`` side by side on products with ``G``, ``Gs^-1`` and ``G^-1`` side by side
    on solves with the factor, ``block`` vectors each, until the estimated error of each smallest eigenvalue is
    ``eig_rtol`` of its value (``0.1 eig_rtol`` for the largest: they take a few passes).
    ``estimates`` keeps the four :class:`scaleattn.lanczos.EigenEstimate` (value, residual, interval, passes).
    """
    psi = G.shape[0]
    diag = np.diag(G).copy()
    if not np.all(diag > 0):
        return None  # an all-zero feature: G is singular
    scale = 1.0 / np.sqrt(diag)
    try:
        L = blocked_cholesky(G)
    except np.linalg.LinAlgError:
        return None
    L *= scale[:, None]
    f = CholeskyFactor(G, L, scale)
    # the largest eigenvalues are well separated (a few passes): 0.1 eig_rtol; the smallest crowd: eig_rtol
    opts = dict(block=block, maxiter=EIG_MAXITER)
    w_max, g_max = largest_eigenvalues(lambda X: gemm(G, X), psi, [scale, None], rtol=0.1 * eig_rtol, **opts)
    w_inv, g_inv = largest_eigenvalues(f.solve, psi, [None, scale], rtol=eig_rtol, **opts)
    f.w_max, f.w_min = w_max.value, 1.0 / w_inv.value
    f.estimates = {"lambda_max_scaled": w_max, "lambda_min_scaled_inverse": w_inv, "lambda_max": g_max,
                   "lambda_min_inverse": g_inv}
    if not f.w_min > cutoff_rtol * f.w_max:
        return None  # rank-deficient beyond the cutoff: needs the eigh path (null basis, min-norm)
    n = max(n_rows, 1)
    f.lam_max = g_max.value / n
    f.lam_min = 1.0 / g_inv.value / n
    return f
