"""The identifiability certificate ([Y25] Lemma 2.3, Corollary 2.4; DESIGN §4): identifiability as one idea
(layer L2).

If ``lambda_min(Lambda_D) > 0`` with ``Lambda_D = G / N`` (the uncentred second moment of the features) then
every empirical risk minimiser computes the same function on all inputs of any length. :func:`certify` decides
it from the statistics (the rank of the Jacobi-scaled Gram beyond the relative cutoff); when it fails,
:func:`ambiguity_witness` gives two models with equal training loss that disagree on a concrete input.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ._params import no_other_kwargs, real, renamed
from .errors import ParameterError
from .features import coef_distance, predict_rows, token_features
from .features import phi as features_phi
from .spectrum import (
    CholeskyFactor,
    Spectrum,
    _eigvalsh,
    cholesky_factor,
    default_rtol,
    lambda_min_full_rank,
    scaled_spectrum,
    solver_path,
)

__all__ = ["Certificate", "certify", "certificate_from_spectrum", "certificate_from_factor", "Witness",
           "ambiguity_witness"]


@dataclasses.dataclass
class Certificate:
    """Identifiability certificate ([Y25] Lemma 2.3; DESIGN §4).

    ``lambda_min``, ``lambda_max``: extreme eigenvalues of ``Lambda_D = G / N`` (the paper's quantity).
    ``identifiable``: the Jacobi-scaled Gram has full rank beyond the relative cutoff, i.e. ``lambda_min > 0``
    up to round-off: every least-squares fit computes the same function. ``ambiguous_dim = psi - rank``.
    ``spectrum_scaled`` (psi,): ascending eigenvalues of the Jacobi-scaled Gram (the rank decision uses these);
    ``eigenvalues`` (psi,) float64: ascending eigenvalues of ``Lambda_D`` itself (for plots; DESIGN §4).

    Attributes
    ----------
    n_rows, psi, rank : int
        Rows the statistics saw, features, numerical rank of the Jacobi-scaled Gram.
    cutoff_rtol : float
        The relative eigenvalue cutoff the rank uses.
    lambda_min, lambda_max : float
        Extreme eigenvalues of ``Lambda_D = G / N``.
    lambda_min_scaled, condition_number : float
        Smallest eigenvalue and condition number of the kept Jacobi-scaled spectrum.
    spectrum_scaled : ndarray (psi,) or (2,)
    eigenvalues : ndarray (psi,) or None
        None on the Cholesky path (extreme eigenvalues only).

    See Also
    --------
    certify : makes one from statistics.

    Examples
    --------
    >>> import numpy as np, scaleattn
    >>> stats = scaleattn.statistics_from_arrays(np.random.default_rng(1).standard_normal((300, 4, 2)))
    >>> cert = scaleattn.certify(stats)
    >>> cert.identifiable, cert.rank == cert.psi == 6, cert.lambda_min > 0
    (True, True, True)
    """

    n_rows: int
    psi: int
    rank: int
    cutoff_rtol: float
    lambda_min: float
    lambda_max: float
    lambda_min_scaled: float
    condition_number: float
    spectrum_scaled: np.ndarray
    eigenvalues: np.ndarray | None = None

    @property
    def rtol(self) -> float:
        """Deprecated name of :attr:`cutoff_rtol`."""
        return self.cutoff_rtol

    @property
    def identifiable(self) -> bool:
        return self.rank == self.psi

    @property
    def ambiguous_dim(self) -> int:
        return self.psi - self.rank

    def summary(self) -> dict:
        return {"n_rows": self.n_rows, "psi": self.psi, "rank": self.rank, "cutoff_rtol": self.cutoff_rtol,
                "lambda_min": self.lambda_min, "lambda_max": self.lambda_max,
                "lambda_min_scaled": self.lambda_min_scaled, "condition_number": self.condition_number,
                "identifiable": self.identifiable, "ambiguous_dim": self.ambiguous_dim}


def certificate_from_spectrum(G, spec: Spectrum, n_rows: int) -> Certificate:
    """The certificate of the eigh path: rank from the scaled spectrum, ``lambda_min`` and ``lambda_max`` of
    ``Lambda_D`` (the whole spectrum of ``Lambda_D`` kept for plots)."""
    lam = _eigvalsh(G / max(n_rows, 1))
    kept = spec.w[spec.keep]
    cond = float(kept[-1] / kept[0]) if kept.size else float("inf")
    # full rank: lambda_min from the scaled decomposition (eigvalsh(G) only sees it above eps * lambda_max)
    lam_min = lambda_min_full_rank(spec) / max(n_rows, 1) if spec.rank == G.shape[0] else max(lam[0], 0.0)
    return Certificate(n_rows, G.shape[0], spec.rank, spec.cutoff_rtol, float(lam_min), float(lam[-1]),
                       float(spec.w[0]), cond, spec.w.copy(), np.asarray(lam))


def certificate_from_factor(f: CholeskyFactor, cutoff_rtol: float, n_rows: int) -> Certificate:
    """The certificate of the Cholesky path (full rank; the extreme eigenvalues only)."""
    psi = f.G.shape[0]
    return Certificate(n_rows, psi, psi, cutoff_rtol, f.lam_min, f.lam_max, f.w_min, f.w_max / f.w_min,
                       np.array([f.w_min, f.w_max]), None)


def check_cutoff(cutoff_rtol) -> float | None:
    """``cutoff_rtol`` validated: None (the default) or a number in (0, 1)."""
    return real("cutoff_rtol", cutoff_rtol, 0.0, 1.0, low_open=True, high_open=True, none_ok=True)


def certify(stats, cutoff_rtol: float | None = None, solver: str = "auto", large_psi: int | None = None, *,
            gram=None, **deprecated) -> Certificate:
    """Identifiability certificate from statistics ([Y25] Lemma 2.3; only the Gram is used, targets are not).

    Parameters
    ----------
    stats : Statistics
        Sufficient statistics (:func:`scaleattn.compute_statistics`); targets are not needed.
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff in (0, 1) (default ``16 psi eps``, :func:`~scaleattn.spectrum.default_rtol`).
    solver : {"auto", "eigh", "cholesky"}
        ``"eigh"`` gives the whole spectrum; ``"cholesky"`` (``"auto"`` past psi = 2,000) only the extreme
        eigenvalues (``spectrum_scaled`` is then ``[w_min, w_max]`` and ``eigenvalues`` None); see
        :func:`~scaleattn.spectrum.solver_path`.
    large_psi : int, optional
        Where ``"auto"`` switches to Cholesky.
    gram : array (psi, psi), optional
        ``stats.gram()`` if the caller has it already (not modified).
    rtol, method
        Deprecated names of ``cutoff_rtol`` and ``solver``.

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
    """
    cutoff_rtol = renamed(deprecated, "rtol", "cutoff_rtol", cutoff_rtol)
    solver = renamed(deprecated, "method", "solver", solver, "auto")
    no_other_kwargs(deprecated, "certify")
    cutoff_rtol = check_cutoff(cutoff_rtol)
    if stats.n_rows == 0:
        raise ParameterError("no rows: the statistics are empty")
    stats = stats.to_numpy()  # the solver node works on the host (statistics built on a GPU included)
    rtol = default_rtol(stats.psi) if cutoff_rtol is None else float(cutoff_rtol)
    G = stats.gram() if gram is None else gram
    if solver_path(stats.psi, solver, large_psi) == "cholesky":
        f = cholesky_factor(G, rtol, stats.n_rows)
        if f is not None:
            return certificate_from_factor(f, rtol, stats.n_rows)
    return certificate_from_spectrum(G, scaled_spectrum(G, rtol), stats.n_rows)


@dataclasses.dataclass
class Witness:
    """Two models that fit the training data equally well but compute different functions (DESIGN §4).

    ``coef_a`` is the fit, ``coef_b = coef_a + t n e_a^T`` with ``n`` (psi,) the null direction of the Gram
    with the smallest Rayleigh quotient; ``tokens`` (T, d) is an input on which their last-token predictions
    ``prediction_a``, ``prediction_b`` (d_out,) differ; ``sse_a``, ``sse_b`` their training sums of squares
    (``sse_b - sse_a = t^2 n^T G n + 2 t n^T (G c_a - B_a)`` exactly, no cancellation against yy).
    """

    coef_a: np.ndarray
    coef_b: np.ndarray
    tokens: np.ndarray
    prediction_a: np.ndarray
    prediction_b: np.ndarray
    sse_a: float
    sse_b: float
    n_out: int
    target_sum_squares: float

    def summary(self) -> dict:
        """JSON-ready: tokens, predictions, losses (MSE over rows and outputs) and their relative gap."""
        la, lb = max(self.sse_a, 0.0) / self.n_out, max(self.sse_b, 0.0) / self.n_out  # floor ~eps * mean y^2
        return {"tokens": self.tokens.tolist(), "prediction_a": self.prediction_a.tolist(),
                "prediction_b": self.prediction_b.tolist(), "loss_a": float(la), "loss_b": float(lb),
                "loss_relative_difference": float(abs(self.sse_b - self.sse_a) / max(
                    self.sse_a, self.sse_b, self.target_sum_squares, 1e-300)),
                "prediction_difference": float(np.linalg.norm(self.prediction_b - self.prediction_a)),
                "coef_distance": coef_distance(self.coef_a, self.coef_b)}


def ambiguity_witness(solution, stats, gram=None, length: int | None = None, candidates: int = 16,
                      seed: int = 0, loss_rtol: float = 1e-12) -> Witness | None:
    """Witness of non-identifiability ([Y25] Lemma 2.3 fails; DESIGN §4): ``None`` when identifiable.

    Moves the fit along the null direction ``n`` of the Gram (in ``solution.null_basis``) with the smallest
    ``n^T G n``, in the output column of largest coefficient norm, by a step ``t`` that changes the
    prediction on the witness input by about the scale of the targets, shrunk if needed so that the
    training losses agree to ``loss_rtol`` relative (to the larger of the loss and ``yy``, the scale the
    statistics resolve). The witness input (``length`` tokens, default d + 1, entries N(0, 1/length)) is the
    best of ``candidates`` random draws by ``|phi . n| / ||phi||``.
    """
    Nb = np.asarray(solution.null_basis)
    if Nb.shape[1] == 0:
        return None
    G = np.asarray(stats.gram() if gram is None else gram)
    c = np.asarray(solution.coef, np.float64)
    d = stats.d
    w, U = np.linalg.eigh(Nb.T @ (G @ Nb))
    n = Nb @ U[:, 0]
    n /= np.linalg.norm(n)
    a = int(np.argmax(np.linalg.norm(c, axis=0)))
    T = d + 1 if length is None else int(length)
    rng = np.random.default_rng(seed)
    tok = rng.standard_normal((candidates, T, d)) / np.sqrt(T)
    s, x = token_features(tok)
    f = features_phi(s, x)
    score = np.abs(f @ n) / np.maximum(np.linalg.norm(f, axis=1), 1e-300)
    i = int(np.argmax(score))
    pa = predict_rows(c, s[i : i + 1], x[i : i + 1])[0]
    unit = float(f[i] @ n)
    scale = max(float(np.linalg.norm(pa)), np.sqrt(stats.target_mean_square), 1e-12)
    t = scale / unit if unit != 0 else 0.0
    sse_a = stats.sse(c, G)
    nGn, cross = float(n @ G @ n), float(n @ (G @ c[:, a] - np.asarray(stats.moments)[:, a]))
    ref = max(abs(sse_a), float(stats.yy), 1e-300)
    for _ in range(60):  # shrink until the losses agree (the gap is t^2 nGn + 2 t cross)
        gap = t * t * nGn + 2 * t * cross
        if abs(gap) <= loss_rtol * ref:
            break
        t *= 0.5
    cb = c.copy()
    cb[:, a] += t * n
    pb = predict_rows(cb, s[i : i + 1], x[i : i + 1])[0]
    return Witness(c, cb, tok[i], pa, pb, float(sse_a), float(sse_a + t * t * nGn + 2 * t * cross),
                   max(stats.n_rows * stats.d_out, 1), float(stats.yy))
