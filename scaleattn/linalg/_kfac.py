"""The Kronecker-factored (K-FAC) preconditioner of the feature Gram, shared by the streaming and the krylov paths.

:class:`KFAC` approximates ``G`` by ``(A (x) B) / N`` with ``A`` (m x m) on the pair coordinates and ``B`` (d x d)
on the token coordinates (feature ``(P, l)`` at ``P d + l``, :mod:`scaleattn.features`) and applies its inverse
by two small products: on the streaming path ``A = S^T S`` and ``B = X^T X`` are summed over the rows
(:mod:`scaleattn.linalg._stream`); on the krylov path, which holds the compact Gram and no rows, they are the
partial traces of the Jacobi-scaled ``G`` (:class:`TraceKFAC`,
:meth:`scaleattn.linalg._gram.GramOperator.partial_traces`).
DESIGN §4b.

References
----------
[MG15] J. Martens, R. Grosse, "Optimizing neural networks with Kronecker-factored approximate curvature",
ICML 2015 (K-FAC).
"""
from __future__ import annotations

import math

from .._backend import device_of, get_xp

__all__ = ["KFAC", "TraceKFAC", "FACTOR_FLOOR"]

#: the K-FAC factors' eigenvalues are clipped at this fraction of their largest (Jacobi-scaled). Rank-deficient
#: data make a factor singular; a floor at its round-off (1e-13) lets the preconditioner amplify the 1e-10 error
#: of the deflated null vectors (:data:`scaleattn.linalg._krylov.NULL_RTOL`) past the residual: CG then stalled
#: at a backward error of 1e-13 for 2,000 passes on tokens in a 3-dimensional subspace of R^4, where 1e-10 takes 47
FACTOR_FLOOR = 1e-10


def _clipped_inverse(F, rel: float):
    """``(F_s)^-1`` pieces of an SPD factor ``F``: Jacobi-scaled eigendecomposition with eigenvalues clipped at
    ``rel`` times the largest. Returns ``(D^-1/2, U, w)`` with ``F ~ D^1/2 U diag(w) U^T D^1/2`` and a lower bound
    on the smallest eigenvalue of that (the applied) matrix."""
    xp = get_xp(F)
    dg = xp.linalg.diagonal(F) if hasattr(xp, "linalg") and hasattr(xp.linalg, "diagonal") else xp.diagonal(F)
    live = dg > 0
    dinv = xp.where(live, 1.0 / xp.sqrt(xp.where(live, dg, 1.0)), 0.0)
    Fs = F * dinv[:, None] * dinv[None, :]
    # all-zero coordinates: identity (never used); the standard has no diag(v): eye times v (the same bits)
    eye = xp.eye(F.shape[0], dtype=F.dtype, device=device_of(F))
    Fs = (Fs + Fs.T) / 2 + eye * (1.0 - xp.astype(live, F.dtype))[None, :]
    w, U = xp.linalg.eigh(Fs)
    w = xp.maximum(w, rel * max(float(w[-1]), 1.0))
    dmin = float(xp.min(xp.where(live, dg, xp.inf))) if bool(xp.any(live)) else 0.0
    return dinv, U, w, float(w[0]) * dmin


class KFAC:
    """The Kronecker-factored preconditioner ``M = (A (x) B) / N`` of the feature Gram [MG15] (DESIGN §4b).

    ``G = sum_i (s_i s_i^T) (x) (x_i x_i^T)`` and ``N E[s s^T] (x) E[x x^T] = (A (x) B) / N`` with the sums
    ``A = S^T S`` (m x m), ``B = X^T X`` (d x d). ``M^-1 W`` is ``N A^-1 W_(m, d k)`` then ``B^-1`` on the d axis:
    two small dense products per application. Each factor is inverted through the eigendecomposition of its
    Jacobi-scaled form, eigenvalues clipped at :data:`FACTOR_FLOOR` of the largest, so ``M`` is SPD
    however singular the data; ``lambda_min(M)`` is bounded from below exactly for the ``M`` applied.

    The interface is :class:`scaleattn.linalg._gram.BlockJacobi`'s: ``scale`` (``diag(G)^-1/2``, 0 for all-zero
    features), ``live``, :meth:`apply` (``M^-1``), :meth:`apply_scaled` (``Ms^-1`` with ``Ms = S M S``),
    :meth:`min_eigenvalues`; plus :meth:`half_inverse` (``L^-1`` and ``L^-T`` with ``M = L L^T``).

    Parameters
    ----------
    A : array (m, m)
    B : array (d, d)
        The sums ``S^T S`` and ``X^T X`` (:class:`StreamOperator`).
    diagonal : array (psi,)
        ``diag G``.
    n_rows : int

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.features import token_features, phi
    >>> s, x = token_features(np.random.default_rng(0).standard_normal((300, 4, 2)))
    >>> F = phi(s, x)
    >>> M = KFAC(s.T @ s, x.T @ x, np.sum(F * F, axis=0), 300)
    >>> Mdense = np.kron(s.T @ s, x.T @ x) / 300
    >>> bool(np.allclose(M.apply(np.eye(6)), np.linalg.inv(Mdense)))
    True
    """

    name = "kfac"

    def __init__(self, A, B, diagonal, n_rows: int):
        xp = get_xp(A, B, diagonal)
        self.xp, self.m, self.d = xp, A.shape[0], B.shape[0]
        self.psi, self.n = self.m * self.d, max(int(n_rows), 1)
        self.live = diagonal > 0
        self.scale = xp.where(self.live, 1.0 / xp.sqrt(xp.where(self.live, diagonal, 1.0)), 0.0)
        self._root = xp.where(self.live, xp.sqrt(xp.where(self.live, diagonal, 0.0)), 0.0)  # S^-1 on live
        self._dA, self._UA, self._wA, lowA = _clipped_inverse(A, FACTOR_FLOOR)
        self._dB, self._UB, self._wB, lowB = _clipped_inverse(B, FACTOR_FLOOR)
        self._lam_min = lowA * lowB / self.n
        dmax = float(xp.max(xp.where(self.live, diagonal, 0.0)))
        self._lam_min_s = self._lam_min / dmax if dmax > 0 else 0.0
        # F^-1 = D^-1/2 U diag(1/w) U^T D^-1/2, formed once: each application is then two GEMMs
        self._Ainv = (self._dA[:, None] * self._UA / self._wA[None, :]) @ (self._UA.T * self._dA[None, :])
        self._Binv = (self._dB[:, None] * self._UB / self._wB[None, :]) @ (self._UB.T * self._dB[None, :])

    def _kron(self, FA, FB, R):
        """``(FA (x) FB) R`` for R (psi, k), feature order P-major (P d + l)."""
        xp, m, d = self.xp, self.m, self.d
        k = R.shape[1]
        T = xp.reshape(xp.matmul(FA, xp.reshape(R, (m, d * k))), (m, d, k))
        return xp.reshape(xp.matmul(FB, T), (self.psi, k))

    def apply(self, R):
        """``M^-1 R`` (original coordinates; zero on all-zero features)."""
        lv = self.xp.astype(self.live, self.xp.float64)[:, None]
        return self.n * self._kron(self._Ainv, self._Binv, R * lv) * lv

    def apply_scaled(self, R):
        """``Ms^-1 R = S^-1 M^-1 S^-1 R`` (Jacobi-scaled coordinates, ``S = diag(G)^-1/2``)."""
        r = self._root[:, None]
        return r * self.apply(r * R)

    def half_inverse(self, R, transpose: bool = False):
        """``L^-1 R`` (or ``L^-T R``) with ``M = L L^T``, ``L = sqrt(N)^-1 (D_A^1/2 U_A w_A^1/2) (x) (D_B^1/2 U_B
        w_B^1/2)``: ``C = L^-1 G L^-T`` has the eigenvalues of ``M^-1 G``."""
        xp = self.xp
        lv = xp.astype(self.live, xp.float64)[:, None]
        if transpose:  # L^-T = sqrt(N) (D^-1/2 U w^-1/2) (x) ...
            FA = self._dA[:, None] * self._UA / xp.sqrt(self._wA)[None, :]
            FB = self._dB[:, None] * self._UB / xp.sqrt(self._wB)[None, :]
            return math.sqrt(self.n) * self._kron(FA, FB, R) * lv
        FA = (self._UA / xp.sqrt(self._wA)[None, :]).T * self._dA[None, :]
        FB = (self._UB / xp.sqrt(self._wB)[None, :]).T * self._dB[None, :]
        return math.sqrt(self.n) * self._kron(FA, FB, R * lv)

    def half(self, R):
        """``L R`` with ``M = L L^T`` (:meth:`half_inverse`'s ``L``): ``L g`` for a Gaussian ``g`` has covariance
        ``M``, the start that makes the preconditioned Lanczos run's first vector uniform on the sphere."""
        xp = self.xp
        lv = xp.astype(self.live, xp.float64)[:, None]
        root = lambda d: xp.where(d > 0, 1.0 / xp.where(d > 0, d, 1.0), 0.0)  # noqa: E731 (D^1/2 from D^-1/2)
        FA = root(self._dA)[:, None] * self._UA * xp.sqrt(self._wA)[None, :]
        FB = root(self._dB)[:, None] * self._UB * xp.sqrt(self._wB)[None, :]
        return self._kron(FA, FB, R * lv) * lv / math.sqrt(self.n)

    def min_eigenvalues(self) -> tuple[float, float]:
        """``(lower bound on lambda_min(Ms), lower bound on lambda_min(M))``: ``lambda_min(M) >=
        lambda_min(A_s) min(diag A) lambda_min(B_s) min(diag B) / N`` for the factors applied, and
        ``lambda_min(Ms) >= lambda_min(M) / max(diag G)``."""
        return self._lam_min_s, self._lam_min


class TraceKFAC:
    """K-FAC of the Jacobi-scaled Gram from its partial traces: ``Ms = A's (x) B's / tr(Gs)`` (the krylov path).

    ``Gs = S G S`` (``S = diag(G)^-1/2``, 0 for all-zero features) is the matrix the krylov path's CG runs on, and a
    compact Gram gives of it no rows, only its partial traces ``A's = sum_l Gs[(., l), (., l)]`` (m x m) and
    ``B's = sum_P Gs[(P, .), (P, .)]`` (d x d) (:meth:`scaleattn.linalg._gram.GramOperator.partial_traces`). The
    normalisation makes ``Ms`` exact on a Kronecker Gram (``Gs = A (x) B``: ``A's = A tr(B)``, ``B's = tr(A) B``,
    ``tr(Gs) = tr(A) tr(B)``); the scaled traces make it invariant, as ``Gs`` is, under a diagonal scaling of the
    features (one token coordinate x100: 306 and 304 passes at d = 16, where the traces of ``G`` itself
    took 296 and 355). ``Ms^-1`` is :class:`KFAC`'s on the unit diagonal; ``M = S^-1 Ms S^-1``.

    The interface is :class:`KFAC`'s (``scale``, ``live``, :meth:`apply`, :meth:`apply_scaled`,
    :meth:`min_eigenvalues`, :meth:`half_inverse`, :meth:`half`), ``name`` ``"kfac"``.

    Parameters
    ----------
    A_trace : array (m, m)
    B_trace : array (d, d)
        The partial traces of ``S G S``.
    diagonal : array (psi,)
        ``diag G``.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> G = np.kron(np.cov(rng.standard_normal((3, 9))), np.cov(rng.standard_normal((2, 9))))
    >>> s = 1 / np.sqrt(np.diag(G))
    >>> G4 = (G * s[:, None] * s[None, :]).reshape(3, 2, 3, 2)
    >>> M = TraceKFAC(np.einsum("plql->pq", G4), np.einsum("plpk->lk", G4), np.diag(G))
    >>> bool(np.allclose(M.apply(G), np.eye(6)))
    True
    """

    name = "kfac"

    def __init__(self, A_trace, B_trace, diagonal):
        xp = get_xp(A_trace, B_trace, diagonal)
        self.xp, self.live = xp, diagonal > 0
        self.scale = xp.where(self.live, 1.0 / xp.sqrt(xp.where(self.live, diagonal, 1.0)), 0.0)
        unit = xp.astype(self.live, xp.float64)
        ntr = float(xp.sum(unit))  # tr(Gs): one per live feature
        self._unit = KFAC(A_trace / max(ntr, 1.0), B_trace, unit, 1)  # Ms, the scaled coordinates as its own
        self._dmin = float(xp.min(xp.where(self.live, diagonal, xp.inf))) if ntr > 0 else 0.0

    def apply_scaled(self, R):
        """``Ms^-1 R`` (Jacobi-scaled coordinates)."""
        return self._unit.apply(R)

    def apply(self, R):
        """``M^-1 R = S Ms^-1 S R`` (original coordinates)."""
        s = self.scale[:, None]
        return s * self._unit.apply(s * R)

    def half_inverse(self, R, transpose: bool = False):
        """``L^-1 R`` (``L^-T R``) with ``M = L L^T``, ``L = S^-1 Ls`` (``Ms = Ls Ls^T``)."""
        s = self.scale[:, None]
        return s * self._unit.half_inverse(R, True) if transpose else self._unit.half_inverse(s * R)

    def half(self, R):
        """``L R`` with ``M = L L^T`` (:meth:`half_inverse`'s ``L = S^-1 Ls``)."""
        xp = self.xp
        return xp.where(self.live, 1.0 / xp.where(self.live, self.scale, 1.0), 0.0)[:, None] * self._unit.half(R)

    def min_eigenvalues(self) -> tuple[float, float]:
        """``(lower bound on lambda_min(Ms), lower bound on lambda_min(M))``: :class:`KFAC`'s bound for ``Ms``,
        times ``min(diag G)`` for ``M = S^-1 Ms S^-1``."""
        low = self._unit.min_eigenvalues()[1]
        return low, low * self._dmin
