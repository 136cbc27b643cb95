"""Least-squares coefficients and the identifiability certificate from sufficient statistics ([Y25] Algorithm 1,
Lemma 2.3; DESIGN §4): the solver paths and the one router between them.

[Y25] Algorithm 1 solves ``min_c sum_i ||y_i - c^T phi_i||^2`` over the cubic features; from the statistics
that is ``G c = B``. :func:`solve` returns the min-norm solution ``c = G^+ B`` together with its certificate
(:class:`~scaleattn.linalg._certificate.Certificate`), optionally with a scaled ridge; :func:`certify` the
certificate alone. Three paths, each a ``_solve_*`` / ``_certify_*`` pair (scikit-learn's ``_ridge.py`` shape):

- ``"eigh"``: the Jacobi-scaled eigendecomposition (:func:`~scaleattn.linalg._spectrum.scaled_spectrum`): the
  pseudo-inverse with one step of iterative refinement, the null directions removed in the original coordinates
  where that keeps the predictions (:func:`~scaleattn.linalg._spectrum.min_norm`), the whole spectrum;
- ``"cholesky"``: a Cholesky factor of the scaled Gram and the extreme eigenvalues by block Krylov
  (:func:`~scaleattn.linalg._spectrum.factor_gram`; full rank only: it declines a Gram that is not positive
  definite beyond the cutoff);
- ``"krylov"``: preconditioned CG with deflation and Lanczos/LOBPCG eigenvalue intervals on the matrix-free
  operator of the compact Gram (:mod:`scaleattn.linalg._krylov`, :mod:`scaleattn.linalg._gram`): ``G`` is
  never formed.

:func:`route` is the one choice between them for both (:func:`~scaleattn.linalg._spectrum.solver_path`, then the
fallback of a declined Cholesky path); a new path is one more entry in the tables :func:`solve` and
:func:`certify` hand it. The public :func:`solve` and :func:`certify` validate their parameters;
:func:`solve_validated` and :func:`certify_validated` are the same for callers that validated them already
(:func:`scaleattn.pipeline.fit`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._backend import numpy_or_cupy, to_numpy
from .._params import real
from ..errors import DatasetError, ParameterError
from ._certificate import (
    Certificate,
    certificate_from_factor,
    certificate_from_krylov,
    certificate_from_spectrum,
    check_cutoff,
)
from ._dense import cholesky
from ._gram import gram_for, operator_of
from ._krylov import krylov_solve
from ._spectrum import EIGH_FALLBACK_PSI, UNIT, default_rtol, factor_gram, min_norm, scaled_spectrum, solver_path

__all__ = ["Solution", "solve", "solve_validated", "certify", "certify_validated", "route", "shared_gram",
           "check_ridge", "check_no_worse_than_zero", "MAX_RIDGE"]

#: the largest ridge accepted. The scaled eigenvalues are at most psi, so past it the effective dof is below
#: psi / 1e12 (the coefficients are zero to round-off); near 1e308, ``ridge * diag(G)`` overflows float64
MAX_RIDGE = 1e12
#: the paths that run on host statistics (the solver node; statistics built on a GPU come back first); the
#: others run in the statistics' own array module
HOST_PATHS = ("eigh", "cholesky")


def check_ridge(ridge) -> float:
    """``ridge`` validated: a number in ``[0, MAX_RIDGE]``."""
    return real("ridge", ridge, 0.0, MAX_RIDGE)


def check_no_worse_than_zero(sse: float, yy: float, floor: float, heads: int | None = None) -> None:
    """Refuse a fit whose training SSE exceeds that of predicting zero (``yy``) beyond its round-off ``floor``
    (:meth:`scaleattn.Statistics.sse_floor`, a bound by absolute values) or is NaN: every least-squares fit,
    truncated, ridge or CG, has ``sse <= yy`` (``c = 0`` is feasible and each of them minimises over a subspace
    that contains it), so a larger one is a solve that lost its accuracy, never a result.

    Raises
    ------
    DatasetError
        Naming both figures and the likely cause (features whose scales span many orders of magnitude; with
        ``heads``, the head search that made an H-head model).
    """
    if sse <= yy + floor:  # (NaN is refused)
        return
    if heads is not None:  # a head search's lossy model (V = 0 is one of them): the search failed, not the solve
        raise DatasetError(f"the head search's {heads}-head model fits worse than predicting zero (its training"
                           f" error {sse:.3e} against {yy:.3e}): the search lost its accuracy on this"
                           " ill-conditioned Gram; use heads='svd' (the least-squares fit's exact heads)")
    raise DatasetError(f"the fit lost its accuracy on these data: its training error {sse:.3e}"
                       f" exceeds that of predicting zero ({yy:.3e}) beyond round-off ({floor:.1e}):"
                       " the features' scales span too many orders of magnitude for float64 (a few tokens far"
                       " larger than the rest?); rescale the tokens or remove the outlying samples")


def _checked(sol: Solution, stats, gram) -> Solution:
    """``sol`` once :func:`check_no_worse_than_zero` passed on its statistics."""
    check_no_worse_than_zero(sol.sse, float(stats.yy), stats.sse_floor(sol.coef, gram))
    return sol


@dataclasses.dataclass
class Solution:
    """Least-squares solution ([Y25] Algorithm 1, min-norm ``c = G^+ B``).

    ``coef`` (psi, d_out) float64 is the paper's ``p(Theta)`` (DESIGN §2); ``certificate`` as above;
    ``null_basis`` (psi, ambiguous_dim) spans the coefficient directions the data do not determine;
    ``sse`` the sum of squared residuals from the statistics. Min-norm in the original coordinates where removing
    the null directions keeps the predictions (:func:`scaleattn.linalg._spectrum.min_norm`), else in the Jacobi-scaled
    ones.

    Attributes
    ----------
    coef : ndarray (psi, d_out) float64
    certificate : Certificate
    null_basis : ndarray (psi, psi - rank)
    sse : float
    ridge, effective_dof : float

    See Also
    --------
    solve : makes one.

    Examples
    --------
    >>> import scaleattn
    >>> from scaleattn.generate import make_mhla
    >>> data = make_mhla(d=2, heads=1, length=20, samples=100, causal=True)
    >>> sol = scaleattn.solve(scaleattn.statistics_from_arrays(data["tokens"], data["targets"]))
    >>> sol.rank, sol.null_basis.shape
    (6, (6, 0))
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

    def objective(self, gram) -> float:
        """What the fit minimised, summed over outputs: ``sse + ridge sum_j G_jj ||c_j||^2`` (:func:`solve`'s
        scaled ridge; ``sse`` when ``ridge`` is 0). ``gram``: the statistics' Gram, an array or the matrix-free
        operator (only its diagonal is read)."""
        if self.ridge == 0:
            return float(self.sse)
        dg = np.asarray(gram.diagonal(), np.float64)
        return float(self.sse) + self.ridge * float(np.sum(dg[:, None] * np.asarray(self.coef, np.float64) ** 2))


def route(stats, solver: str, large_psi: int | None, paths: dict, *, dense: bool = False):
    """The one choice of path for :func:`solve` and :func:`certify`: ``paths[name](stats)`` for the path
    :func:`~scaleattn.linalg._spectrum.solver_path` picks (``dense``: the dense paths only), on host statistics
    for :data:`HOST_PATHS`. A path that declines (returns None: a Cholesky factor of a Gram not positive definite
    beyond the cutoff) falls back to eigh, which finds the null space; to krylov where ``"auto"`` chose it past
    :data:`~scaleattn.linalg._spectrum.EIGH_FALLBACK_PSI` without ``dense`` (eigh would take hours there)."""
    path = solver_path(stats.psi, solver, large_psi, dense=dense)
    if path not in HOST_PATHS:
        return paths[path](stats)
    stats = stats.to_numpy()
    out = paths[path](stats)
    if out is not None:
        return out
    if solver == "auto" and not dense and stats.psi > EIGH_FALLBACK_PSI:
        return paths["krylov"](stats)
    return paths["eigh"](stats)


def _solve_eigh(stats, gram, cutoff_rtol: float, refine: bool, ridge: float) -> Solution:
    """[Y25] Alg. 1 through the Jacobi-scaled eigendecomposition: ``c = G^+ B`` (min-norm), or the scaled ridge
    ``(G + lambda diag G) c = B``, with one refinement step; the whole spectrum in the certificate."""
    G = gram if isinstance(gram, np.ndarray) else stats.gram()  # (a factor in place took the first expansion)
    B = np.asarray(stats.moments)
    spec = scaled_spectrum(G, cutoff_rtol)
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
        c = min_norm(c, null, lambda n: float(np.sum(n * (G @ n))), np.sqrt(np.clip(np.diag(G), 0.0, None)),
                     stats.sse(c, G), stats.yy)
    cert = certificate_from_spectrum(G, spec, stats.n_rows)
    return _checked(Solution(c, cert, null, stats.sse(c, G), float(ridge), spec.effective_dof(ridge)), stats, G)


#: the relative accuracy of the Cholesky path's refinement correction (Neumann steps with the shifted factor stop
#: there; one solve when the factor's contraction is below it): the correction's own error is that fraction of the
#: solution's error, at round-off already
REFINED_RTOL = 1e-3
#: the relative change at which the Neumann steps of the solve itself stop before the refinement step: its error
#: times the correction's (at most REFINED_RTOL, ~1e-5 typically) is below round-off
REFINED_MAIN_RTOL = 1e-12


def _solve_large(stats, gram, cutoff_rtol: float, refine: bool, ridge: float) -> Solution | None:
    """[Y25] Alg. 1 by Cholesky of the Jacobi-scaled Gram (full rank only): ``c = D^-1/2 Gs^-1 D^-1/2 B``
    with one refinement step; ridge: ``(Gs + lambda I)``, effective dof ``psi - lambda tr (Gs + lambda I)^-1``.
    A dense ``gram`` is not modified; without one ``G`` is expanded into the factor's memory and the products
    after the factor (refinement, SSE) go to the operator on ``Tc``
    (:func:`~scaleattn.linalg._spectrum.factor_gram`).
    None when ``G`` is not positive definite beyond the cutoff."""
    import scipy.linalg

    moments = np.asarray(stats.moments, np.float64)
    # the solve of B rides on the factorisation's inverse iteration (one call per pass over the factor); before a
    # refinement step it needs REFINED_MAIN_RTOL only (the step multiplies its error by the correction's accuracy,
    # the shifted factor's contraction: below REFINED_RTOL)
    f = factor_gram(stats, gram, cutoff_rtol, rhs=None if ridge > 0 else moments,
                    rhs_rtol=REFINED_MAIN_RTOL if refine else UNIT)
    if f is None:
        return None
    cert = certificate_from_factor(f, cutoff_rtol, stats.n_rows)
    psi = f.L.shape[0]
    rhs = f.scale[:, None] * moments
    if ridge > 0:  # D^-1/2 chol(G + ridge diag G) is the factor of Gs + ridge I; it reuses the factor's memory
        if isinstance(f.G, np.ndarray):
            f.L[...] = f.G
        else:  # the factor took G's memory: expand it again
            stats.gram(out=f.L)
        f.L[np.diag_indices(psi)] += ridge * f.diag
        f.L = cholesky(f.L, overwrite_a=True)  # (scaleattn.linalg._dense: LAPACK, or by blocks when large)
        f.shift = 0.0  # (the proved factor was of G - shift D)
    cs = f.solve(rhs) if f.rhs_solution is None else f.rhs_solution / f.scale[:, None]
    sse = None
    if refine:  # the correction needs a few digits only: its error is that fraction of one at round-off already
        Gcs = f.scaled_matvec(cs)
        r = rhs - Gcs - ridge * cs
        step = f.solve(r, REFINED_RTOL)
        if ridge == 0:
            # the SSE from the product the step made: sse(c + d) = sse(c) - 2 d.r + d.Gs d, and Gs d = r to the
            # correction's accuracy (an error REFINED_RTOL |d|^2 ||Gs||, second order in the small step): no pass
            # over G of its own
            sse = float(stats.yy - 2.0 * np.sum(cs * rhs) + np.sum(cs * Gcs) - np.sum(step * r))
        cs += step
    dof = float(psi)
    if ridge > 0:
        Linv, info = scipy.linalg.lapack.dtrtri(f.L.T, lower=0, overwrite_c=1)  # L^-T, in place (F view)
        # tr (Gs + lambda I)^-1 = tr D^1/2 L^-T L^-1 D^1/2 = sum_ij (L^-T)_ji^2 D_j (L L^T = G + lambda D)
        dof = float(psi - ridge * np.einsum("ji,ji,j->", Linv, Linv, f.diag))
    c = f.scale[:, None] * cs
    sse = stats.sse(c, f.G) if sse is None else sse
    return _checked(Solution(c, cert, np.zeros((psi, 0)), sse, float(ridge), dof), stats, f.G)


def _solve_krylov(stats, cutoff_rtol: float, options: dict | None) -> Solution:
    """[Y25] Alg. 1 on the matrix-free operator (:func:`scaleattn.linalg._krylov.krylov_solve`), in the statistics'
    own array module (numpy, or cupy on a GPU); the coefficients come back to the host."""
    op = operator_of(stats)
    ks = krylov_solve(op, stats.moments, rtol=cutoff_rtol, yy=float(stats.yy), **(options or {}))
    cert = certificate_from_krylov(ks.spectrum, stats.n_rows)
    Gc = to_numpy(op.matmat(op.xp.asarray(ks.coef)))
    sse = float(stats.yy - 2 * np.sum(ks.coef * to_numpy(stats.moments)) + np.sum(ks.coef * Gc))
    cert.estimates.update({"cg_iterations": int(ks.iterations), "backward_error": ks.backward_error.tolist(),
                           "solve_converged": bool(ks.converged.all()), "preconditioner": ks.preconditioner})
    if hasattr(op, "traffic_summary"):  # Tc on the workers: what each pass moved
        cert.estimates["traffic"] = op.traffic_summary()
    return _checked(Solution(ks.coef, cert, ks.null_basis, sse, 0.0, float(ks.spectrum.rank)), stats, op)


def _certify_eigh(stats, gram, cutoff_rtol: float) -> Certificate:
    """The certificate from the whole Jacobi-scaled spectrum."""
    G = gram if isinstance(gram, np.ndarray) else stats.gram()  # (a factor in place took the first expansion)
    return certificate_from_spectrum(G, scaled_spectrum(G, cutoff_rtol), stats.n_rows)


def _certify_cholesky(stats, gram, cutoff_rtol: float) -> Certificate | None:
    """The certificate from a Cholesky factor and the extreme eigenvalues; None when ``G`` is not positive definite
    beyond the cutoff."""
    f = factor_gram(stats, gram, cutoff_rtol)
    return None if f is None else certificate_from_factor(f, cutoff_rtol, stats.n_rows)


def _certify_krylov(stats, cutoff_rtol: float, options: dict | None) -> Certificate:
    """The certificate from eigenvalue intervals on the matrix-free operator, in the statistics' own array module
    (numpy or cupy; others via the host)."""
    op = operator_of(stats if numpy_or_cupy(stats.gram_compact) else stats.to_numpy())
    return certificate_from_krylov(krylov_solve(op, None, rtol=cutoff_rtol, **(options or {})), stats.n_rows)


def solve(stats, cutoff_rtol: float | None = None, refine: bool = True, ridge: float = 0.0, solver: str = "auto",
          large_psi: int | None = None, *, gram=None, krylov: dict | None = None) -> Solution:
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
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff in (0, 1) (default :func:`~scaleattn.linalg._spectrum.default_rtol`).
    refine : bool
        One step of iterative refinement ``c += G^+ (B - G c)``.
    ridge : float
        Ridge strength lambda in [0, MAX_RIDGE = 1e12] (default 0).
    solver : {"auto", "eigh", "cholesky", "krylov"}
        Solver path (:func:`~scaleattn.linalg._spectrum.solver_path`): above ``large_psi`` (default
        :data:`~scaleattn.linalg._spectrum.LARGE_PSI`) a Cholesky factor of the scaled Gram and Lanczos for the
        extreme eigenvalues replace the eigendecomposition (same coefficients to round-off; falls back to eigh
        when the Gram is not positive definite); ``"krylov"`` (``"auto"`` above
        :data:`~scaleattn.linalg._spectrum.KRYLOV_PSI`) solves by preconditioned CG with deflation on the matrix-free
        operator (the same min-norm answer to its backward-error target; the certificate from Lanczos/LOBPCG,
        saying how settled it is).
    large_psi : int, optional
        Where ``"auto"`` switches to Cholesky.
    gram : array (psi, psi) or GramOperator, optional
        ``stats.gram()`` if the caller has it already (it is not modified), or :func:`shared_gram`'s operator:
        the Cholesky path then expands ``G`` into its factor's memory (one psi x psi array, not two).
    krylov : dict, optional
        Options of :func:`scaleattn.linalg._krylov.krylov_solve` (``btol``, ``maxiter``, ``eig_rtol``, ``eig_budget``,
        ``block``, ``seed``, ``preconditioner``: ``"block-jacobi"``, the default, or ``"kfac"``).

    Returns
    -------
    Solution
        ``coef`` (psi, d_out) float64, the certificate, the null basis, the training sum of squares.

    Raises
    ------
    ParameterError
        Statistics without targets or without rows; a negative or non-finite ``ridge``; an unknown solver; a
        cutoff outside (0, 1); ``ridge > 0`` with the krylov path (its effective degrees of freedom need the
        whole spectrum).
    DatasetError
        Non-finite statistics; a solve that lost its accuracy, its training SSE above the zero model's
        (:func:`check_no_worse_than_zero`).

    See Also
    --------
    certify : the certificate alone (no targets needed).

    Examples
    --------
    >>> import scaleattn
    >>> from scaleattn.generate import make_mhla
    >>> data = make_mhla(d=2, heads=1, length=20, samples=200, causal=True)
    >>> stats = scaleattn.statistics_from_arrays(data["tokens"], data["targets"])
    >>> sol = scaleattn.solve(stats)
    >>> sol.certificate.identifiable, sol.coef.shape
    (True, (6, 2))
    >>> bool(abs(scaleattn.solve(stats, solver="krylov").coef - sol.coef).max() < 1e-8 * abs(sol.coef).max())
    True
    """
    ridge = check_ridge(ridge)
    return solve_validated(stats, check_cutoff(cutoff_rtol), refine, ridge, solver, large_psi, gram=gram,
                           krylov=krylov)


def solve_validated(stats, cutoff_rtol: float | None = None, refine: bool = True, ridge: float = 0.0,
                    solver: str = "auto", large_psi: int | None = None, *, gram=None, krylov: dict | None = None
                    ) -> Solution:
    """:func:`solve` with ``cutoff_rtol`` and ``ridge`` already validated by the caller
    (:func:`~scaleattn.linalg._certificate.check_cutoff`, :func:`check_ridge`)."""
    if stats.d_out == 0:
        raise ParameterError("these statistics have no targets (built for the certificate only); cannot solve")
    stats.check_usable()
    rtol = default_rtol(stats.psi) if cutoff_rtol is None else cutoff_rtol
    paths = {"eigh": lambda st: _solve_eigh(st, gram, rtol, refine, ridge),
             "cholesky": lambda st: _solve_large(st, gram, rtol, refine, ridge),
             "krylov": lambda st: _solve_krylov(st, rtol, krylov)}
    return route(stats, solver, large_psi, paths, dense=ridge > 0)


def certify(stats, cutoff_rtol: float | None = None, solver: str = "auto", large_psi: int | None = None, *,
            gram=None, krylov: dict | None = None) -> Certificate:
    """Identifiability certificate from statistics ([Y25] Lemma 2.3; only the Gram is used, targets are not).

    Parameters
    ----------
    stats : Statistics
        Sufficient statistics (:func:`scaleattn.compute_statistics`); targets are not needed.
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff in (0, 1) (default ``16 psi eps``, :func:`~scaleattn.linalg._spectrum.default_rtol`).
    solver : {"auto", "eigh", "cholesky", "krylov"}
        ``"eigh"`` gives the whole spectrum; ``"cholesky"`` (``"auto"`` past psi = 2,000) only the extreme
        eigenvalues (``spectrum_scaled`` is then ``[w_min, w_max]`` and ``eigenvalues`` None); ``"krylov"``
        (``"auto"`` past psi = 20,000) the same from products with the matrix-free operator, ``G`` never formed,
        with each eigenvalue's interval (``estimates``) and whether the run settled (``converged``); see
        :func:`~scaleattn.linalg._spectrum.solver_path`.
    large_psi : int, optional
        Where ``"auto"`` switches to Cholesky.
    gram : array (psi, psi) or GramOperator, optional
        ``stats.gram()`` if the caller has it already (not modified), or the operator of
        :func:`~scaleattn.linalg._gram.gram_for`.
    krylov : dict, optional
        Options of :func:`scaleattn.linalg._krylov.krylov_solve` (``maxiter``, ``eig_rtol``, ``eig_budget``, ``block``,
        ``seed``, ``preconditioner``).

    Returns
    -------
    Certificate

    Raises
    ------
    ParameterError
        Empty statistics, an unknown solver, a cutoff outside (0, 1).

    See Also
    --------
    scaleattn.certify_dataset : the certificate of a dataset (builds the Gram first).
    ambiguity_witness : when it fails, two fits that disagree on an input.

    Examples
    --------
    >>> import numpy as np, scaleattn
    >>> rng = np.random.default_rng(0)
    >>> stats = scaleattn.statistics_from_arrays(rng.standard_normal((200, 5, 2)))
    >>> scaleattn.certify(stats).identifiable
    True
    >>> scaleattn.certify(stats, solver="krylov").verdict
    'identifiable'
    """
    return certify_validated(stats, check_cutoff(cutoff_rtol), solver, large_psi, gram=gram, krylov=krylov)


def certify_validated(stats, cutoff_rtol: float | None = None, solver: str = "auto", large_psi: int | None = None,
                      *, gram=None, krylov: dict | None = None) -> Certificate:
    """:func:`certify` with ``cutoff_rtol`` already validated by the caller
    (:func:`~scaleattn.linalg._certificate.check_cutoff`)."""
    stats.check_usable()
    rtol = default_rtol(stats.psi) if cutoff_rtol is None else float(cutoff_rtol)
    paths = {"eigh": lambda st: _certify_eigh(st, gram, rtol),
             "cholesky": lambda st: _certify_cholesky(st, gram, rtol),
             "krylov": lambda st: _certify_krylov(st, rtol, krylov)}
    return route(stats, solver, large_psi, paths)


def shared_gram(stats, solver: str = "auto", large_psi: int | None = None):
    """The ``G`` a fit's solve, heads step and witness share: the dense Gram on the eigh path (it factors it
    anyway), on the Cholesky and krylov paths :func:`~scaleattn.linalg._gram.gram_for` (the matrix-free operator
    past ``DENSE_GRAM_MAX_PSI`` features: the Cholesky solve then expands ``G`` into its factor's memory, and
    the heads and the witness take ``G @ c`` from ``Tc``)."""
    if solver_path(stats.psi, solver, large_psi) == "eigh":
        return stats.to_numpy().gram()
    return gram_for(stats)
