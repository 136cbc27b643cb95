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


def _certificate(G, spec: Spectrum, n_rows: int) -> Certificate:
    lam = _eigvalsh(G / max(n_rows, 1))
    kept = spec.w[spec.keep]
    cond = float(kept[-1] / kept[0]) if kept.size else float("inf")
    return Certificate(n_rows, G.shape[0], spec.rank, spec.rtol, float(max(lam[0], 0.0)), float(lam[-1]),
                       float(spec.w[0]), cond, spec.w.copy())


def certify(stats, rtol: float | None = None) -> Certificate:
    """Certificate from statistics (only the Gram is used; targets are not needed).

    Raises ``ValueError`` for empty statistics.
    """
    if stats.n_rows == 0:
        raise ValueError("no rows: the statistics are empty")
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

    @property
    def rank(self) -> int:
        return self.certificate.rank


def solve(stats, rtol: float | None = None, refine: bool = True) -> Solution:
    """Min-norm least-squares coefficients and certificate from statistics (DESIGN §4).

    Parameters
    ----------
    stats : Statistics
        With targets (``d_out >= 1``).
    rtol : float, optional
        Relative eigenvalue cutoff (default :func:`default_rtol`).
    refine : bool
        One step of iterative refinement ``c += G^+ (B - G c)``.

    Raises
    ------
    ValueError
        Statistics without targets or without rows.
    """
    if stats.d_out == 0:
        raise ValueError("these statistics have no targets (built for the certificate only); cannot solve")
    if stats.n_rows == 0:
        raise ValueError("no rows: the statistics are empty")
    G = stats.gram()
    B = np.asarray(stats.moments)
    spec = scaled_spectrum(G, rtol)
    c = spec.pinv_apply(B)
    if refine:
        c = c + spec.pinv_apply(B - G @ c)
    null = spec.null_basis()
    if null.shape[1]:
        c = c - null @ (null.T @ c)  # min-norm: no component in the null space of G
    cert = _certificate(G, spec, stats.n_rows)
    return Solution(c, cert, null, stats.sse(c, G))
