"""Least-squares solve and identifiability certificate from sufficient statistics (DESIGN §4).

[Y25] Algorithm 1 solves ``min_c sum_i ||y_i - c^T phi_i||^2`` over the cubic features; Lemma 2.3 /
Corollary 2.4: if ``lambda_min(Lambda_D) > 0`` with ``Lambda_D = G / N`` (uncentred second moment) then every
empirical risk minimiser computes the same function on all inputs of any length.

Numerics: Jacobi scaling ``D^-1/2 G D^-1/2`` before ``eigh``; eigenvalues at or below a RELATIVE cutoff
``rtol * lambda_max`` are dropped (``rtol`` is set by the accumulation round-off, order ``psi * eps``, never
by N); min-norm coefficients ``c = G^+ B`` with one step of iterative refinement.
"""
from __future__ import annotations

import dataclasses

import numpy as np

#: numpy's eigh (LAPACK syevd) sizes its workspace with 32-bit integers: 1 + 6n + 2n^2 overflows near 32,767
SYEVD_MAX = 30_000
#: cuSOLVER's syevd workspace (32-bit) overflows near n = 26,700 (DESIGN §4); a GPU eigh must stay below this
CUSOLVER_SYEVD_MAX = 26_000
#: above this psi, ``method="auto"`` solves by Cholesky + Lanczos (``psi^3 / 3`` flops, 2 psi x psi arrays)
#: instead of a full eigh (~9 psi^3 flops, ~5 arrays, and memory-bound): at d = 16 (psi = 2,176) about 1 s
#: instead of ~20 s on 2 cores, at d = 32 (psi = 16,896) minutes instead of hours. The certificate then has
#: the extreme eigenvalues only (pass ``method="eigh"`` for the whole spectrum). A Gram that is not
#: numerically positive definite falls back to eigh (which finds the null space).
LARGE_PSI = 2_000


def syevd_workspace(n: int) -> int:
    """Doubles of LAPACK ``syevd`` workspace for an n x n eigendecomposition with vectors: ``1 + 6n + 2n^2``.

    With 32-bit LAPACK integers (numpy's, scipy's wheels without ILP64, cuSOLVER) this must stay below 2^31.
    """
    return 1 + 6 * n + 2 * n * n


def default_rtol(psi: int) -> float:
    """Relative eigenvalue cutoff: ``16 * psi * eps64`` (the Gram's accumulation round-off; independent of N)."""
    return 16.0 * psi * np.finfo(np.float64).eps


@dataclasses.dataclass
class Spectrum:
    """Jacobi-scaled eigendecomposition of a Gram matrix: ``G = D^1/2 U diag(w) U^T D^1/2``.

    ``w`` ascending; ``keep`` marks eigenvalues above ``rtol * w.max()``; ``scale = diag(G)^-1/2`` (0 for
    all-zero features, which are then exactly null).
    """

    w: np.ndarray
    U: np.ndarray
    scale: np.ndarray
    rtol: float

    @property
    def keep(self) -> np.ndarray:
        return self.w > self.rtol * max(self.w[-1], 0.0)

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


def scaled_spectrum(G: np.ndarray, rtol: float | None = None) -> Spectrum:
    """Jacobi-scaled eigendecomposition of a symmetric PSD Gram matrix ``G`` (psi, psi) (DESIGN §4)."""
    diag = np.diag(G).copy()
    scale = np.where(diag > 0, 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0)), 0.0)
    Gs = G * scale[:, None] * scale[None, :]
    w, U = _eigh(Gs)
    return Spectrum(w, U, scale, default_rtol(G.shape[0]) if rtol is None else float(rtol))


@dataclasses.dataclass
class Certificate:
    """Identifiability certificate ([Y25] Lemma 2.3; DESIGN §4).

    ``lambda_min``, ``lambda_max``: extreme eigenvalues of ``Lambda_D = G / N`` (the paper's quantity).
    ``identifiable``: the Jacobi-scaled Gram has full rank beyond the relative cutoff, i.e. ``lambda_min > 0``
    up to round-off: every least-squares fit computes the same function. ``ambiguous_dim = psi - rank``.
    ``spectrum_scaled`` (psi,): ascending eigenvalues of the Jacobi-scaled Gram (the rank decision uses these);
    ``eigenvalues`` (psi,) float64: ascending eigenvalues of ``Lambda_D`` itself (for plots; DESIGN §4).
    """

    n_rows: int
    psi: int
    rank: int
    rtol: float
    lambda_min: float
    lambda_max: float
    lambda_min_scaled: float
    condition_number: float
    spectrum_scaled: np.ndarray
    eigenvalues: np.ndarray | None = None

    @property
    def identifiable(self) -> bool:
        return self.rank == self.psi

    @property
    def ambiguous_dim(self) -> int:
        return self.psi - self.rank

    def summary(self) -> dict:
        return {"n_rows": self.n_rows, "psi": self.psi, "rank": self.rank, "cutoff_rtol": self.rtol,
                "lambda_min": self.lambda_min, "lambda_max": self.lambda_max,
                "lambda_min_scaled": self.lambda_min_scaled, "condition_number": self.condition_number,
                "identifiable": self.identifiable, "ambiguous_dim": self.ambiguous_dim}


def _lambda_min_full_rank(spec: Spectrum) -> float:
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


def _certificate(G, spec: Spectrum, n_rows: int) -> Certificate:
    lam = _eigvalsh(G / max(n_rows, 1))
    kept = spec.w[spec.keep]
    cond = float(kept[-1] / kept[0]) if kept.size else float("inf")
    # full rank: lambda_min from the scaled decomposition (eigvalsh(G) only sees it above eps * lambda_max)
    lam_min = _lambda_min_full_rank(spec) / max(n_rows, 1) if spec.rank == G.shape[0] else max(lam[0], 0.0)
    return Certificate(n_rows, G.shape[0], spec.rank, spec.rtol, float(lam_min), float(lam[-1]),
                       float(spec.w[0]), cond, spec.w.copy(), np.asarray(lam))


# ---- large psi: Cholesky + Lanczos (DESIGN §4) ---------------------------------------------------------
def use_large_path(psi: int, method: str = "auto", large_psi: int | None = None) -> bool:
    """Whether :func:`solve` / :func:`certify` take the Cholesky + Lanczos path.

    ``method``: ``"eigh"`` (full spectrum; past ``SYEVD_MAX`` through the O(n)-workspace MRRR driver),
    ``"cholesky"``, or ``"auto"`` (Cholesky when ``psi > large_psi``, default :data:`LARGE_PSI`).
    Raises ``ValueError`` for another method.
    """
    if method not in ("auto", "eigh", "cholesky"):
        raise ValueError(f"method must be 'auto', 'eigh' or 'cholesky', got {method!r}")
    if method != "auto":
        return method == "cholesky"
    return psi > (LARGE_PSI if large_psi is None else int(large_psi))


def _extreme_eig(matvec, n: int, tol: float = 1e-10) -> float:
    """Largest eigenvalue of a symmetric PSD operator by Lanczos (ARPACK)."""
    from scipy.sparse.linalg import LinearOperator, eigsh

    if n <= 2:
        return float(np.linalg.eigvalsh(np.column_stack([matvec(e) for e in np.eye(n)]))[-1])
    op = LinearOperator((n, n), matvec=matvec, dtype=np.float64)
    v0 = np.random.default_rng(0).standard_normal(n)  # fixed start: reruns give the same numbers
    return float(eigsh(op, k=1, which="LA", tol=tol, v0=v0, ncv=min(n - 1, 40), return_eigenvectors=False)[0])


@dataclasses.dataclass
class _Factor:
    """Cholesky factor of the Jacobi-scaled Gram ``Gs = D^-1/2 G D^-1/2 = L L^T`` and its extreme eigenvalues."""

    Gs: np.ndarray
    L: np.ndarray
    scale: np.ndarray
    w_min: float
    w_max: float
    lam_min: float
    lam_max: float

    def solve(self, rhs: np.ndarray) -> np.ndarray:
        """``Gs^-1 rhs``."""
        from scipy.linalg import cho_solve

        return cho_solve((self.L, True), rhs, check_finite=False)


def _cholesky_factor(G: np.ndarray, rtol: float, n_rows: int) -> _Factor | None:
    """Jacobi-scale ``G`` IN PLACE and factor it; None when it is not numerically positive definite (then the
    caller falls back to eigh, which finds the null space). Extreme eigenvalues of ``Gs`` and of
    ``Lambda_D = G / N`` by Lanczos on ``Gs``/``G`` and on their inverses through the factor (one Cholesky,
    ``psi^3 / 3`` flops; memory two psi x psi arrays)."""
    import scipy.linalg

    psi = G.shape[0]
    diag = np.diag(G).copy()
    if not np.all(diag > 0):
        return None  # an all-zero feature: G is singular
    scale = 1.0 / np.sqrt(diag)
    G *= scale[:, None]
    G *= scale[None, :]
    try:
        L = scipy.linalg.cholesky(G, lower=True, overwrite_a=False, check_finite=False)
    except np.linalg.LinAlgError:
        return None
    f = _Factor(G, L, scale, 0.0, 0.0, 0.0, 0.0)
    f.w_max = _extreme_eig(lambda x: G @ x, psi)
    f.w_min = 1.0 / _extreme_eig(lambda x: f.solve(x), psi)
    if not f.w_min > rtol * f.w_max:
        return None  # rank-deficient beyond the cutoff: needs the eigh path (null basis, min-norm)
    n = max(n_rows, 1)  # Lambda_D = G / N with G = D^1/2 Gs D^1/2
    f.lam_max = _extreme_eig(lambda x: (G @ (x / scale)) / scale, psi) / n
    f.lam_min = 1.0 / _extreme_eig(lambda x: scale * f.solve(scale * x), psi) / n
    return f


def _factor_certificate(f: _Factor, rtol: float, n_rows: int) -> Certificate:
    psi = f.Gs.shape[0]
    return Certificate(n_rows, psi, psi, rtol, f.lam_min, f.lam_max, f.w_min, f.w_max / f.w_min,
                       np.array([f.w_min, f.w_max]), None)


def _solve_large(stats, G, rtol: float, refine: bool, ridge: float) -> Solution | None:
    """[Y25] Alg. 1 by Cholesky of the Jacobi-scaled Gram (full rank only): ``c = D^-1/2 Gs^-1 D^-1/2 B``
    with one refinement step; ridge: ``(Gs + lambda I)``, effective dof ``psi - lambda tr (Gs + lambda I)^-1``."""
    f = _cholesky_factor(G, rtol, stats.n_rows)
    if f is None:
        return None
    cert = _factor_certificate(f, rtol, stats.n_rows)
    psi = G.shape[0]
    rhs = f.scale[:, None] * np.asarray(stats.moments)
    if ridge > 0:
        import scipy.linalg

        f.L[...] = f.Gs
        f.L[np.diag_indices(psi)] += ridge
        f.L = scipy.linalg.cholesky(f.L, lower=True, overwrite_a=True, check_finite=False)
    cs = f.solve(rhs)
    if refine:
        cs += f.solve(rhs - f.Gs @ cs - ridge * cs)
    dof = float(psi)
    if ridge > 0:
        import scipy.linalg

        Linv, info = scipy.linalg.lapack.dtrtri(f.L, lower=1, overwrite_c=1)
        dof = float(psi - ridge * np.einsum("ij,ij->", Linv, Linv))  # tr (Gs + lambda I)^-1 = ||L^-1||_F^2
    c = f.scale[:, None] * cs
    G = f.Gs  # unscale for the residual: G = D^1/2 Gs D^1/2
    G /= f.scale[:, None]
    G /= f.scale[None, :]
    return Solution(c, cert, np.zeros((psi, 0)), stats.sse(c, G), float(ridge), dof)


def certify(stats, rtol: float | None = None, method: str = "auto", large_psi: int | None = None) -> Certificate:
    """Certificate from statistics (only the Gram is used; targets are not needed).

    ``method``/``large_psi``: see :func:`use_large_path`; the Cholesky path reports only the extreme
    eigenvalues (``spectrum_scaled`` is then ``[w_min, w_max]`` and ``eigenvalues`` None).
    Raises ``ValueError`` for empty statistics.
    """
    if stats.n_rows == 0:
        raise ValueError("no rows: the statistics are empty")
    stats = stats.to_numpy()  # the solver node works on the host (statistics built on a GPU included)
    rtol = default_rtol(stats.psi) if rtol is None else float(rtol)
    if use_large_path(stats.psi, method, large_psi):
        f = _cholesky_factor(stats.gram(), rtol, stats.n_rows)
        if f is not None:
            return _factor_certificate(f, rtol, stats.n_rows)
    G = stats.gram()
    return _certificate(G, scaled_spectrum(G, rtol), stats.n_rows)


@dataclasses.dataclass
class Solution:
    """Least-squares solution ([Y25] Algorithm 1, min-norm ``c = G^+ B``).

    ``coef`` (psi, d_out) float64 is the paper's ``p(Theta)`` (DESIGN §2); ``certificate`` as above;
    ``null_basis`` (psi, ambiguous_dim) spans the coefficient directions the data do not determine;
    ``sse`` the sum of squared residuals from the statistics.
    """

    coef: np.ndarray
    certificate: Certificate
    null_basis: np.ndarray
    sse: float
    #: ridge strength (0: min-norm least squares) and effective degrees of freedom per output
    ridge: float = 0.0
    effective_dof: float = float("nan")

    @property
    def rank(self) -> int:
        return self.certificate.rank


def solve(stats, rtol: float | None = None, refine: bool = True, ridge: float = 0.0, method: str = "auto",
          large_psi: int | None = None) -> Solution:
    """Min-norm least-squares coefficients and certificate from statistics (DESIGN §4).

    With ``ridge = lambda > 0``: minimise ``||y - Phi c||^2 / N + lambda sum_j Lambda_jj c_j^2`` with
    ``Lambda_jj = G_jj / N`` (ridge on features scaled to unit mean square: dimensionless and the same at
    any N), i.e. ``(G + lambda diag G) c = B``, solved in the Jacobi-scaled eigenbasis; the effective
    degrees of freedom per output are ``sum_i w_i / (w_i + lambda)`` over the scaled eigenvalues ``w``
    (the rank when ``lambda = 0``). The certificate is the data's and does not depend on ``lambda``.

    Parameters
    ----------
    stats : Statistics
        With targets (``d_out >= 1``).
    rtol : float, optional
        Relative eigenvalue cutoff (default :func:`default_rtol`).
    refine : bool
        One step of iterative refinement ``c += G^+ (B - G c)``.

    ridge : float
        Ridge strength lambda >= 0 (default 0).
    method, large_psi
        Solver path (:func:`use_large_path`): above ``large_psi`` (default :data:`LARGE_PSI`) a Cholesky
        factor of the scaled Gram and Lanczos for the extreme eigenvalues replace the eigendecomposition
        (same coefficients to round-off; falls back to eigh when the Gram is not positive definite).

    Raises
    ------
    ValueError
        Statistics without targets or without rows; negative or non-finite ``ridge``.
    """
    if not (np.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge}")
    if stats.d_out == 0:
        raise ValueError("these statistics have no targets (built for the certificate only); cannot solve")
    if stats.n_rows == 0:
        raise ValueError("no rows: the statistics are empty")
    stats = stats.to_numpy()  # the solver node works on the host (statistics built on a GPU included)
    if use_large_path(stats.psi, method, large_psi):
        sol = _solve_large(stats, stats.gram(), default_rtol(stats.psi) if rtol is None else float(rtol),
                           refine, ridge)
        if sol is not None:
            return sol
    G = stats.gram()
    B = np.asarray(stats.moments)
    spec = scaled_spectrum(G, rtol)
    null = spec.null_basis()
    if ridge > 0:
        dG = np.diag(G)
        c = spec.ridge_apply(B, ridge)
        if refine:
            c = c + spec.ridge_apply(B - G @ c - ridge * dG[:, None] * c, ridge)
    else:
        c = spec.pinv_apply(B)
        if refine:
            c = c + spec.pinv_apply(B - G @ c)
        if null.shape[1]:
            c = c - null @ (null.T @ c)  # min-norm: no component in the null space of G
    cert = _certificate(G, spec, stats.n_rows)
    return Solution(c, cert, null, stats.sse(c, G), float(ridge), spec.effective_dof(ridge))
