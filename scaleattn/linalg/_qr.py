"""Rank, certificate and least squares from a QR of the features (layer L2; DESIGN §4, [Y25] Lemma 2.3, Alg. 1).

The Gram ``G = Phi^T Phi`` squares the condition number of the features: on ill-conditioned data (tokens whose
coordinates are nearly collinear, Läuchli-type designs, ``cond(Phi) ~ 1e8-1e10``) a direction the float64
data determine has an eigenvalue ``sigma^2 / sigma_max^2 ~ 1e-16-1e-20`` below the Gram's round-off and the
cutoff ``16 psi eps``. The R factor of a QR of the features has singular values ``sigma`` themselves, computed
to ``~ psi eps sigma_max`` (Householder QR is column-wise backward stable), so the same relative cutoff applied
to singular values resolves them.

This module is the local algebra: the R of the augmented rows ``[phi | y]`` of a block (:func:`accumulate_r`),
the merge of two R's (stack and re-factor, :func:`merge_factors`; associative up to round-off, so a fixed-order
tree like the Gram's gives reproducible bits, :mod:`scaleattn.distributed.tsqr`), and from the final R
``= [[R11, z], [0, R22]]`` (``p = psi + d_out`` square):

- the certificate (:func:`certificate_from_r`): singular values of the column-scaled ``R11`` (the square roots
  of the Jacobi-scaled Gram's eigenvalues), rank = those above ``cutoff * sigma_max``;
- the least-squares fit (:func:`solve_from_r`): ``c = R11^+ z`` (min-norm, Jacobi-scaled SVD) and its residual
  ``||z - R11 c||^2 + ||R22||_F^2`` with no cancellation against ``yy`` (floor ``~ eps^2`` relative).

When to use it is :func:`needs_qr`: ``certificate="auto"`` takes it when the Gram does not certify
identifiability and ``psi <= QR_MAX_PSI``.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._params import choice
from ..data._dataset import check_arrays
from ..errors import ParameterError
from ..features import n_features, phi, row_targets, token_features
from ..statistics._kernel import one_blas_thread
from ._certificate import Certificate
from ._solver import Solution, check_no_worse_than_zero
from ._spectrum import Spectrum, default_rtol, lambda_min_full_rank, min_norm

__all__ = ["QRFactor", "QRSolution", "accumulate_r", "merge_factors", "factor_from_arrays", "certificate_from_r",
           "solve_from_r", "needs_qr", "qr_cutoff", "residual_floor", "CERTIFICATE_METHODS", "QR_MAX_PSI",
           "QR_BLOCK_BYTES"]

#: the certificate options (``--certificate``): ``"gram"`` only the Gram, ``"qr"`` always a QR of the features
#: (a second data pass), ``"auto"`` a QR only when the Gram does not certify identifiability and
#: ``psi <= QR_MAX_PSI``
CERTIFICATE_METHODS = ("auto", "gram", "qr")
#: largest psi for which ``certificate="auto"`` runs the QR pass (d <= 12: psi = 936). The pass costs about
#: ``2 p^2`` flops per row (``p = psi + d_out``) against the compact Gram's ``psi^2 / 4`` multiply-adds:
#: measured on one core 12 us/row at d = 4 (2x the statistics build) and 88 us/row at d = 8 (4x); at psi = 936
#: about 1 ms/row (15 min per million rows per core), at d = 16 (psi = 2,176) about 5 ms/row (1.4 h), which
#: ``"auto"`` does not impose (``certificate="qr"`` forces it). Memory stays small at any psi allowed here: per
#: task one block of rows (``QR_BLOCK_BYTES``) and a few ``p x p`` R's (8 MB each at psi = 1,000), on the
#: solver node ``~4 psi^2`` floats (:func:`scaleattn.distributed.tsqr.qr_memory`).
QR_MAX_PSI = 1_000
#: bytes of ``[phi | y]`` rows factored at a time (at least ``2 p`` rows)
QR_BLOCK_BYTES = 32e6


@dataclasses.dataclass
class QRFactor:
    """R factor of the augmented feature rows ``[Phi | Y]`` ((N, p) -> R (p, p), ``p = psi + d_out``).

    Attributes
    ----------
    R : ndarray (p, p) float64
        Upper triangular, ``R^T R = [Phi | Y]^T [Phi | Y]`` (signs of its rows are LAPACK's).
    psi : int
        Features; ``d_out = p - psi`` (0 for a certificate-only factor).
    n_rows : int
        Rows factored.

    Examples
    --------
    >>> import numpy as np
    >>> f = factor_from_arrays(np.random.default_rng(0).standard_normal((50, 4, 2)))
    >>> f.R.shape, f.psi, f.d_out, f.n_rows
    ((6, 6), 6, 0, 50)
    """

    R: np.ndarray
    psi: int
    n_rows: int

    @property
    def d_out(self) -> int:
        return int(self.R.shape[1] - self.psi)

    @classmethod
    def zeros(cls, d: int, d_out: int = 0) -> QRFactor:
        p = n_features(d) + d_out
        return cls(np.zeros((p, p)), n_features(d), 0)


def _r_of(a: np.ndarray) -> np.ndarray:
    """The (p, p) R of ``a`` (k, p) by LAPACK's Householder QR (``dgeqrf``, one BLAS thread), zero rows appended
    when k < p."""
    import scipy.linalg

    p = a.shape[1]
    with one_blas_thread():  # the same bits for any BLAS thread count (in process and on Dask workers)
        r = scipy.linalg.qr(a, mode="r", overwrite_a=True, check_finite=False)[0]
    if r.shape[0] < p:
        r = np.vstack([r, np.zeros((p - r.shape[0], p))])
    return np.triu(r[:p])


def merge_factors(*parts: QRFactor) -> QRFactor:
    """The R of the stacked rows of ``parts`` in order: ``qr([R_1; R_2; ...])`` (TSQR's combine step, DESIGN §6:
    ``[A_1; A_2] = diag(Q_1, Q_2) [R_1; R_2]``, so the R of the stack is the R of all rows).

    Raises :class:`~scaleattn.errors.ParameterError` for factors of different shapes.

    Examples
    --------
    >>> import numpy as np
    >>> tok = np.random.default_rng(0).standard_normal((30, 4, 2))
    >>> f = merge_factors(factor_from_arrays(tok[:10]), factor_from_arrays(tok[10:]))
    >>> g = factor_from_arrays(tok)
    >>> f.n_rows, bool(np.allclose(f.R.T @ f.R, g.R.T @ g.R))
    (30, True)
    """
    if len({(f.psi, f.R.shape) for f in parts}) != 1:
        raise ParameterError("cannot merge R factors of different shapes")
    if len(parts) == 1:
        return parts[0]
    return QRFactor(_r_of(np.vstack([f.R for f in parts])), parts[0].psi, sum(f.n_rows for f in parts))


def accumulate_r(factor: QRFactor, tokens, targets=None, lengths=None, causal: bool = False) -> QRFactor:
    """Fold a block of samples into ``factor``: returns the R of its rows followed by the block's ``[phi | y]``.

    ``tokens`` (n, T, d), ``targets`` (n, d_out) or (n, T, d_out) (required when the factor has outputs),
    ``lengths`` (n,) as in :func:`scaleattn.features.token_features` (numpy, float64). The rows are formed
    ``QR_BLOCK_BYTES`` at a time (at least ``2 p``), each block stacked under the current R and re-factored.
    Raises :class:`~scaleattn.errors.ParameterError` when the factor has outputs and ``targets`` is None.

    Examples
    --------
    >>> import numpy as np
    >>> tok = np.random.default_rng(0).standard_normal((5, 3, 2))
    >>> accumulate_r(QRFactor.zeros(2), tok, causal=True).n_rows  # one row per prefix
    15
    """
    if factor.d_out and targets is None:
        raise ParameterError(f"this R factor has {factor.d_out} outputs: targets are needed")
    tokens = np.asarray(tokens)
    n, T, d = tokens.shape
    p = factor.R.shape[1]
    rows_per_sample = T if causal else 1
    step = max(1, int(max(2 * p, QR_BLOCK_BYTES // (8 * p)) // rows_per_sample))
    R, rows = factor.R, factor.n_rows
    for a in range(0, n, step):
        b = min(n, a + step)
        lens = None if lengths is None else np.asarray(lengths)[a:b]
        s, x = token_features(tokens[a:b], lens, causal)
        block = phi(s, x)
        if factor.d_out:
            block = np.hstack([block, row_targets(np.asarray(targets)[a:b], lens, causal)])
        R = _r_of(np.vstack([R, block]))
        rows += int(block.shape[0])
    return QRFactor(R, factor.psi, rows)


def factor_from_arrays(tokens, targets=None, lengths=None, causal=None) -> QRFactor:
    """R factor of in-memory arrays (numpy), the QR counterpart of :func:`scaleattn.statistics_from_arrays`.

    Parameters
    ----------
    tokens : array (n, T, d); targets : array (n, d_out) or (n, T, d_out), optional; lengths : (n,), optional
    causal : bool, optional
        Prefix mode; default ``targets.ndim == 3``.

    Returns
    -------
    QRFactor

    Raises
    ------
    DatasetError
        Shapes or dtypes that are not a dataset's.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> f = factor_from_arrays(rng.standard_normal((40, 3, 2)), rng.standard_normal((40, 1)))
    >>> f.R.shape, f.d_out
    ((7, 7), 1)
    """
    check_arrays(tokens, targets, lengths)
    if causal is None:
        causal = targets is not None and np.asarray(targets).ndim == 3
    d_out = 0 if targets is None else int(np.asarray(targets).shape[-1])
    return accumulate_r(QRFactor.zeros(np.asarray(tokens).shape[-1], d_out), tokens, targets, lengths, causal)


def qr_cutoff(psi: int, cutoff_rtol: float | None = None) -> float:
    """Relative singular-value cutoff of the QR path: ``16 psi eps`` (:func:`~scaleattn.linalg._spectrum.default_rtol`,
    the same number the Gram applies to eigenvalues, now on singular values: independent of N), or
    ``sqrt(cutoff_rtol)`` for an explicit eigenvalue cutoff (the same directions dropped as on the Gram).

    Examples
    --------
    >>> qr_cutoff(6) == 16 * 6 * 2.0**-52, qr_cutoff(6, 1e-10)
    (True, 1e-05)
    """
    return float(default_rtol(psi) if cutoff_rtol is None else np.sqrt(cutoff_rtol))


@dataclasses.dataclass
class _ScaledSVD:
    """SVD of the column-scaled ``R11 D^-1/2 = U diag(s) V^T`` (s descending), ``scale = D^-1/2``."""

    U: np.ndarray
    s: np.ndarray
    V: np.ndarray
    scale: np.ndarray
    cut: float

    @classmethod
    def of(cls, factor: QRFactor, cut: float) -> _ScaledSVD:
        R11 = factor.R[: factor.psi, : factor.psi]
        norms = np.linalg.norm(R11, axis=0)  # = the column norms of Phi: Jacobi scaling, as the Gram's
        scale = np.where(norms > 0, 1.0 / np.where(norms > 0, norms, 1.0), 0.0)
        U, s, Vt = np.linalg.svd(R11 * scale[None, :])
        return cls(U, s, Vt.T, scale, cut)

    @property
    def keep(self) -> np.ndarray:
        return self.s > self.cut * self.s[0]

    def spectrum(self) -> Spectrum:
        """The equivalent Jacobi-scaled Gram spectrum (ascending ``s^2``, eigenvectors ``V``, cutoff ``cut^2``)."""
        return Spectrum((self.s**2)[::-1].copy(), self.V[:, ::-1].copy(), self.scale, self.cut**2)

    def null_basis(self) -> np.ndarray:
        """Orthonormal basis (psi, psi - rank) of the dropped directions in original coordinates (as
        :meth:`scaleattn.linalg._spectrum.Spectrum.null_basis`: ``D^-1/2 V_dropped``; all-zero features are null)."""
        k = ~self.keep
        if not k.any():
            return np.zeros((self.V.shape[0], 0))
        basis = np.where(self.scale[:, None] > 0, self.scale[:, None] * self.V[:, k], self.V[:, k])
        return np.linalg.qr(basis)[0]


def certificate_from_r(factor: QRFactor, cutoff_rtol: float | None = None, gram: Certificate | None = None,
                       _svd: _ScaledSVD | None = None) -> Certificate:
    """Identifiability certificate ([Y25] Lemma 2.3) from the R factor of the features: ``method="qr"``.

    Rank: singular values of the column-scaled ``R11`` above :func:`qr_cutoff` times the largest; the
    certificate's ``cutoff_rtol`` is its square (an eigenvalue cutoff, as the Gram's), ``spectrum_scaled`` the
    squared singular values (eigenvalues of the Jacobi-scaled Gram, to ``eps^2`` instead of ``eps``),
    ``eigenvalues`` the squared singular values of ``R11`` over N (``Lambda_D``), ``lambda_min`` for full rank
    from the scaled SVD (accurate in relative terms). ``gram``: the Gram certificate this one settles.

    Examples
    --------
    >>> import numpy as np
    >>> cert = certificate_from_r(factor_from_arrays(np.random.default_rng(0).standard_normal((60, 4, 2))))
    >>> cert.method, cert.verdict, cert.rank
    ('qr', 'identifiable', 6)
    """
    psi, n = factor.psi, max(factor.n_rows, 1)
    sv = _ScaledSVD.of(factor, qr_cutoff(psi, cutoff_rtol)) if _svd is None else _svd
    spec = sv.spectrum()
    rank = int(sv.keep.sum())
    lam = (np.linalg.svd(factor.R[:psi, :psi], compute_uv=False) ** 2)[::-1] / n  # ascending, Lambda_D
    lam_min = lambda_min_full_rank(spec) / n if rank == psi else float(lam[0])
    kept = spec.w[spec.w.size - rank:]
    cond = float(kept[-1] / kept[0]) if rank else float("inf")
    return Certificate(factor.n_rows, psi, rank, spec.cutoff_rtol, float(lam_min), float(lam[-1]), float(spec.w[0]),
                       cond, spec.w, lam, method="qr", gram=gram)


@dataclasses.dataclass
class QRSolution(Solution):
    """A :class:`~scaleattn.linalg._solver.Solution` ([Y25] Alg. 1) solved from the R factor (``factor``): ``sse`` is
    the residual ``||z - R11 c||^2 + ||R22||_F^2`` (round-off :func:`residual_floor`, ``eps^2``-sized, not the Gram
    formula's ``eps``).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(1)
    >>> sol = solve_from_r(factor_from_arrays(rng.standard_normal((40, 3, 2)), rng.standard_normal((40, 1))))
    >>> isinstance(sol, Solution), sol.factor.n_rows
    (True, 40)
    """

    factor: QRFactor | None = None


def solve_from_r(factor: QRFactor, cutoff_rtol: float | None = None, ridge: float = 0.0, refine: bool = True,
                 gram: Certificate | None = None) -> QRSolution:
    """Min-norm least squares ([Y25] Alg. 1) and certificate from the R of ``[Phi | Y]`` (DESIGN §4).

    ``c = D^-1/2 V_k diag(1/s_k) U_k^T z`` over the kept singular values of the scaled ``R11 D^-1/2``
    (:func:`qr_cutoff`), one refinement step on ``z - R11 c``, the component in the dropped directions removed
    where that keeps the predictions (min-norm in the original coordinates, :func:`scaleattn.linalg._spectrum.min_norm`,
    as :func:`scaleattn.solve`). ``ridge = lambda > 0``: the scaled ridge of :func:`scaleattn.solve`,
    ``c_s = V diag(s / (s^2 + lambda)) U^T z``, effective dof ``sum s^2 / (s^2 + lambda)``. Numpy's ``lstsq`` on
    ``phi`` gives the same rank, coefficients and residual on data it resolves (tests/linalg/test_qr.py).

    Raises
    ------
    ParameterError
        A factor without targets.
    DatasetError
        A solve that lost its accuracy (:func:`scaleattn.linalg._solver.check_no_worse_than_zero`).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> tok, y = rng.standard_normal((80, 4, 2)), rng.standard_normal((80, 2))
    >>> sol = solve_from_r(factor_from_arrays(tok, y))
    >>> sol.certificate.method, sol.coef.shape, sol.sse > 0
    ('qr', (6, 2), True)
    """
    if factor.d_out == 0:
        raise ParameterError("this R factor has no targets (built for the certificate only); cannot solve")
    psi = factor.psi
    sv = _ScaledSVD.of(factor, qr_cutoff(psi, cutoff_rtol))
    cert = certificate_from_r(factor, cutoff_rtol, gram, _svd=sv)
    R11, z = factor.R[:psi, :psi], factor.R[:psi, psi:]
    null = sv.null_basis()
    if ridge > 0:
        def apply(rhs):
            return sv.scale[:, None] * (sv.V @ ((sv.s / (sv.s**2 + ridge))[:, None] * (sv.U.T @ rhs)))
        dof = float(np.sum(sv.s**2 / (sv.s**2 + ridge)))
    else:
        k = sv.keep

        def apply(rhs):
            return sv.scale[:, None] * (sv.V[:, k] @ ((sv.U[:, k].T @ rhs) / sv.s[k][:, None]))
        dof = float(cert.rank)
    c = apply(z)
    if refine and ridge == 0:
        c = c + apply(z - R11 @ c)
    def sse_of(c):
        r = z - R11 @ c
        return float(np.sum(r * r) + np.sum(factor.R[psi:, psi:] ** 2))
    yy = float(np.sum(factor.R[:, psi:] ** 2))
    if ridge == 0:
        c = min_norm(c, null, lambda n: float(np.sum((R11 @ n) ** 2)), np.linalg.norm(R11, axis=0), sse_of(c), yy)
    sse = sse_of(c)
    check_no_worse_than_zero(sse, yy, residual_floor(factor, c))
    return QRSolution(c, cert, null, sse, float(ridge), dof, factor=factor)


def needs_qr(certificate: str, gram_certificate: Certificate, psi: int, max_psi: int | None = None) -> bool:
    """Whether a fit or certificate takes the QR pass: always for ``"qr"``, never for ``"gram"``, and for
    ``"auto"`` when the Gram does not certify identifiability (verdict ``"not settled"`` or ``"not
    identifiable"``: below its round-off the Gram cannot tell a direction the data determine from a null one)
    and ``psi <= max_psi`` (default :data:`QR_MAX_PSI`). Raises :class:`ParameterError` for another name.

    Examples
    --------
    >>> import numpy as np, scaleattn
    >>> cert = scaleattn.certify(scaleattn.statistics_from_arrays(np.random.default_rng(0).standard_normal((99, 4, 2))))
    >>> needs_qr("auto", cert, 6), needs_qr("qr", cert, 6)
    (False, True)
    """
    choice("certificate", certificate, CERTIFICATE_METHODS)
    if certificate != "auto":
        return certificate == "qr"
    return gram_certificate.verdict != "identifiable" and psi <= (QR_MAX_PSI if max_psi is None else int(max_psi))



def residual_floor(factor: QRFactor, coef) -> float:
    """Order of magnitude of the round-off in the residual ``sse`` of ``coef`` computed from R
    (:func:`solve_from_r`): ``sum_a eps K_a (eps K_a + 2 sqrt(sse_a))`` with ``K_a = ||y_a|| + sum_j |c_ja|
    ||phi_j||``. The backward error of a Householder QR is ``~ eps`` of each column's norm and moves the
    residual norm by ``~ eps K_a``: a floor ``(eps K)^2``, the square of the relative size of
    :meth:`scaleattn.Statistics.sse_floor` (``eps``), plus the first-order term when the residual is not 0
    (DESIGN §3, §4).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(2)
    >>> f = factor_from_arrays(rng.standard_normal((50, 3, 2)), rng.standard_normal((50, 1)))
    >>> residual_floor(f, solve_from_r(f).coef) < 1e-12
    True
    """
    psi = factor.psi
    c = np.abs(np.asarray(coef))
    k = np.linalg.norm(factor.R[:, psi:], axis=0) + np.linalg.norm(factor.R[:psi, :psi], axis=0) @ c
    r = factor.R[:psi, psi:] - factor.R[:psi, :psi] @ np.asarray(coef)
    sse = np.sum(r * r, axis=0) + np.sum(factor.R[psi:, psi:] ** 2, axis=0)
    e = np.finfo(np.float64).eps * k
    return float(np.sum(e * (e + 2 * np.sqrt(sse))))
