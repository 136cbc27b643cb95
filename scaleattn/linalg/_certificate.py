"""The identifiability certificate ([Y25] Lemma 2.3, Corollary 2.4; DESIGN §4): identifiability as a type.

If ``lambda_min(Lambda_D) > 0`` with ``Lambda_D = G / N`` (the uncentred second moment of the features) then
every empirical risk minimiser computes the same function on all inputs of any length. :class:`Certificate`
records that decision (the rank of the Jacobi-scaled Gram beyond the relative cutoff) and its verdict; each
solver path builds one from what it computed (``certificate_from_spectrum``, ``_from_factor``, ``_from_krylov``;
:func:`scaleattn.linalg._solver.certify` routes between them). When it fails, :func:`ambiguity_witness` gives
two models with equal training loss that disagree on a concrete input.

The verdict is honest about precision: a rank decision is *settled* only when every eigenvalue (singular value,
for a certificate from a QR of the features, :mod:`scaleattn.linalg._qr`) clears the cutoff by at least
:data:`SETTLE_FACTOR`; otherwise it is ``"not settled"`` (round-off of the method could flip it). The float64
Gram squares the condition number of the features, so its verdicts hold "at the precision of the Gram": a
direction whose eigenvalue is below the Gram's round-off may still be determined by the float64 data, which a
QR of the features decides.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .._params import real
from ..display import _html as _html
from ..display import _text as _report
from ..features import coef_distance, predict_rows, token_features
from ..features import phi as features_phi
from ._gram import gram_for
from ._lanczos import EPS
from ._spectrum import PROOF_FACTOR, CholeskyFactor, Spectrum, eigvalsh, lambda_min_full_rank

__all__ = ["Certificate", "certificate_from_spectrum", "certificate_from_factor", "certificate_from_krylov",
           "check_cutoff", "Witness", "ambiguity_witness", "SETTLE_FACTOR", "VERDICTS", "WITNESS_MIN_GAP"]

#: a rank decision is settled when the nearest kept and dropped values are at least this factor from the cutoff
#: (eigenvalues of the Jacobi-scaled Gram for ``method="gram"``, singular values of the scaled R for ``"qr"``).
#: Both are computed to an absolute error of a few ``psi * eps`` of the largest, below the cutoff ``16 psi eps``
#: (relative): one decade either side of it covers that error and its constant. Exactly null directions land
#: 140-3,300x below the cutoff on both paths (collinear or subspace tokens, orthogonal associative memory).
SETTLE_FACTOR = PROOF_FACTOR  # (10: the Cholesky path's factorisation proves this margin, _spectrum.cholesky_factor)
#: the three verdicts of :attr:`Certificate.verdict`
VERDICTS = ("identifiable", "not identifiable", "not settled")
#: a witness proves ambiguity only when its predictions differ by at least this fraction of the prediction scale:
#: a smaller gap means the step along the null direction was shrunk to keep the losses equal (the loss changes)
WITNESS_MIN_GAP = 0.1
@dataclasses.dataclass
class Certificate:
    """Identifiability certificate ([Y25] Lemma 2.3; DESIGN §4).

    ``lambda_min``, ``lambda_max``: extreme eigenvalues of ``Lambda_D = G / N`` (the paper's quantity).
    ``verdict``: ``"identifiable"`` (full rank, every value clears the cutoff by :data:`SETTLE_FACTOR`: every
    least-squares fit computes the same function), ``"not identifiable"`` (``ambiguous_dim = psi - rank``
    directions are null at the method's precision, by the same margin) or ``"not settled"`` (a value lies within
    that factor of the cutoff: round-off of the method could flip the rank). ``identifiable`` is
    ``verdict == "identifiable"`` (certified). ``method`` says what decided: ``"gram"`` (eigenvalues of the
    float64 Gram, DESIGN §4) or ``"qr"`` (singular values of the R of a QR of the features,
    :mod:`scaleattn.linalg._qr`; it resolves values down to ``psi eps`` where the Gram stops at ``sqrt(psi eps)``).
    ``spectrum_scaled`` (psi,): ascending eigenvalues of the Jacobi-scaled Gram (for ``"qr"`` the squared
    singular values of the scaled R); ``eigenvalues`` (psi,) float64: ascending eigenvalues of ``Lambda_D``
    itself (for plots; DESIGN §4).

    Attributes
    ----------
    n_rows, psi, rank : int
        Rows the statistics saw, features, numerical rank of the Jacobi-scaled Gram.
    cutoff_rtol : float
        The relative eigenvalue cutoff the rank uses (``"qr"``: the square of its singular-value cutoff).
    lambda_min, lambda_max : float
        Extreme eigenvalues of ``Lambda_D = G / N``.
    lambda_min_scaled, condition_number : float
        Smallest eigenvalue and condition number of the kept Jacobi-scaled spectrum.
    spectrum_scaled : ndarray (psi,) or (2,)
    eigenvalues : ndarray (psi,) or None
        None on the Cholesky path (extreme eigenvalues only).
    method : {"gram", "qr"}
        What decided the rank.
    gram : Certificate or None
        For ``method="qr"``: the Gram's certificate that the QR settled (its verdict is ``gram_verdict``).
    converged : bool
        The method's own run settled the rank decision (always True for the factorising paths; the krylov path
        says False when its budget ran out first: the verdict is then ``"not settled"``, never guessed).
    estimates : dict or None
        The krylov path's estimates: per eigenvalue its Ritz value, residual, the interval it lies in and
        whether that is as narrow as requested (:class:`scaleattn.linalg._lanczos.EigenEstimate`), the passes over
        ``Tc``, notes on what was not settled; for a solve also ``solve_converged`` and the backward errors.
    nearest : tuple or None
        ``(smallest kept, largest dropped)`` relative to the largest value, when the spectrum is not whole
        (krylov: the lower end of the kept eigenvalue's interval and the largest Ritz value below the cutoff,
        so that the margin is one the intervals guarantee).
    lambda_min_interval, lambda_min_scaled_interval : tuple or None
        ``(lower, upper)`` holding ``lambda_min(Lambda_D)`` and ``lambda_min(Gs)``: rigorous on the Cholesky
        path's proof (a shifted factorisation below, Rayleigh quotients above), the Ritz intervals on the krylov
        path, LAPACK's error bound ``2 psi eps lambda_max`` on the eigh path; None where a path has none.
    proof : dict or None
        The Cholesky path's proof (:func:`~scaleattn.linalg._spectrum.cholesky_factor`, DESIGN §4b): the
        ``threshold`` ``lambda_min(Gs)`` is proved above, the ``shift`` factored, its ``rounding`` term, the
        ``gershgorin`` bound on ``lambda_max(Gs)`` and the ``factorisations`` it took; None elsewhere.
    lambda_max_interval : tuple or None
        ``(lower, upper)`` holding ``lambda_max(Lambda_D)`` where ``lambda_max`` is an estimate (the Cholesky
        path: a Ritz value below, the smaller of its residual bound and the Gershgorin bound above); None where it
        is settled to round-off.

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
    >>> cert.verdict, cert.method, cert.margin > 1e3
    ('identifiable', 'gram', True)
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
    method: str = "gram"
    gram: Certificate | None = None
    converged: bool = True
    estimates: dict | None = None
    nearest: tuple | None = None
    lambda_min_interval: tuple | None = None
    lambda_min_scaled_interval: tuple | None = None
    proof: dict | None = None
    lambda_max_interval: tuple | None = None

    def _nearest(self) -> tuple[float, float | None]:
        """``(smallest kept, largest dropped in magnitude)`` relative to the largest value, in the method's own
        quantity (eigenvalues for ``"gram"``, singular values for ``"qr"``); nan/None where the spectrum does not
        say."""
        if self.nearest is not None:
            return self.nearest
        w = np.asarray(self.spectrum_scaled, np.float64)
        top = max(float(w[-1]), 0.0) if w.size else 0.0
        if top <= 0:
            return float("nan"), None
        rel = w / top if self.method == "gram" else np.sqrt(np.maximum(w, 0.0) / top)
        if w.size != self.psi:  # extreme eigenvalues only (Cholesky path): full rank by construction
            return (float(rel[0]), None) if self.rank == self.psi else (float("nan"), None)
        k = self.psi - self.rank
        kept = float(rel[k]) if self.rank else float("nan")
        # dropped: the largest magnitude (a negative round-off eigenvalue of the Gram is as far from 0 as its size)
        return kept, (float(np.max(np.abs(rel[:k]))) if k else None)

    @property
    def cutoff(self) -> float:
        """The cutoff in the method's quantity, relative to the largest value: ``cutoff_rtol`` (eigenvalues) for
        ``"gram"``, ``sqrt(cutoff_rtol)`` (singular values) for ``"qr"``."""
        return float(self.cutoff_rtol if self.method == "gram" else np.sqrt(self.cutoff_rtol))

    @property
    def margin(self) -> float:
        """Factor by which the value nearest to the cutoff clears it (>= 1; inf when none is near, nan when the
        spectrum does not say): ``min(smallest kept / cutoff, cutoff / largest dropped)``."""
        kept, dropped = self._nearest()
        if np.isnan(kept) and dropped is None:
            return float("nan")
        up = kept / self.cutoff if np.isfinite(kept) else float("inf")
        down = self.cutoff / dropped if dropped else float("inf")  # exactly null (zero) values: no limit
        return float(min(up, down))

    @property
    def verdict(self) -> str:
        """``"identifiable"``, ``"not identifiable"`` or ``"not settled"`` (see the class docstring)."""
        m = self.margin
        if not self.converged:  # the krylov budget ran out before the rank decision settled
            return "not settled"
        if np.isnan(m):  # no spectrum to measure a margin on: an all-zero Gram is null, a full rank unproven
            return "not identifiable" if self.rank < self.psi else "not settled"
        if m < SETTLE_FACTOR:
            return "not settled"
        return "identifiable" if self.rank == self.psi else "not identifiable"

    @property
    def identifiable(self) -> bool:
        """Certified identifiable: ``verdict == "identifiable"`` (full rank, settled)."""
        return self.verdict == "identifiable"

    @property
    def ambiguous_dim(self) -> int:
        return self.psi - self.rank

    def __repr__(self) -> str:
        return (f"Certificate({self.verdict} ({self.method}, margin {self.margin:.3g}x): rank {self.rank} of psi"
                f" {self.psi}, lambda_min {self.lambda_min:.4g}, lambda_max {self.lambda_max:.4g}, rows {self.n_rows})")

    def _repr_html_(self) -> str:
        """The verdict card in Jupyter (:func:`scaleattn.display._html.certificate_html`): the verdict, lambda_min,
        the rank, the margin to the cutoff and the spectrum thumbnail."""
        return _html.safe_html(lambda: _html.certificate_html(self.summary(), self.spectrum_scaled),
                                 lambda: _report.certificate_summary(self.summary()))

    def summary(self) -> dict:
        """JSON-ready numbers: the keys of docs/report.md §2 (``verdict``, ``certificate_method``, ``margin``,
        ``smallest_kept_relative``, ``largest_dropped_relative``, ``settle_factor`` and the Gram's own
        ``gram_verdict``, ``gram_rank``, ``gram_margin`` besides the rank and eigenvalues)."""
        kept, dropped = self._nearest()
        g = self.gram if self.gram is not None else self
        return {"n_rows": self.n_rows, "psi": self.psi, "rank": self.rank, "cutoff_rtol": self.cutoff_rtol,
                "lambda_min": self.lambda_min, "lambda_max": self.lambda_max,
                "lambda_min_scaled": self.lambda_min_scaled, "condition_number": self.condition_number,
                "identifiable": self.identifiable, "ambiguous_dim": self.ambiguous_dim,
                "verdict": self.verdict, "certificate_method": self.method, "margin": self.margin,
                "smallest_kept_relative": kept, "largest_dropped_relative": dropped,
                "settle_factor": SETTLE_FACTOR, "gram_verdict": g.verdict, "gram_rank": g.rank,
                "gram_margin": g.margin, "certificate_converged": bool(self.converged),
                "lambda_min_interval": _pair(self.lambda_min_interval),
                "lambda_min_scaled_interval": _pair(self.lambda_min_scaled_interval),
                **({"lambda_max_interval": _pair(self.lambda_max_interval)} if self.lambda_max_interval else {}),
                **({"certificate_proof": {k: float(v) for k, v in self.proof.items()}} if self.proof else {}),
                **({"estimates": self.estimates} if self.estimates is not None else {})}


def _pair(iv) -> list | None:
    return None if iv is None else [float(iv[0]), float(iv[1])]


def certificate_from_spectrum(G, spec: Spectrum, n_rows: int) -> Certificate:
    """The certificate of the eigh path: rank from the scaled spectrum, ``lambda_min`` and ``lambda_max`` of
    ``Lambda_D`` (the whole spectrum of ``Lambda_D`` kept for plots)."""
    lam = eigvalsh(G / max(n_rows, 1))
    kept = spec.w[spec.keep]
    cond = float(kept[-1] / kept[0]) if kept.size else float("inf")
    # full rank: lambda_min from the scaled decomposition (eigvalsh(G) only sees it above eps * lambda_max)
    lam_min = lambda_min_full_rank(spec) / max(n_rows, 1) if spec.rank == G.shape[0] else max(lam[0], 0.0)
    # LAPACK's eigh is backward stable: each eigenvalue within p(psi) eps ||A||_2 of the computed one (p = 2 psi
    # taken; a bound of that form, not a proof)
    err = 2.0 * G.shape[0] * EPS
    ws = err * max(abs(float(spec.w[-1])), abs(float(spec.w[0])))
    wl = err * max(abs(float(lam[-1])), abs(float(lam[0])))
    lo = min(float(lam[0]) - wl, float(lam_min))
    return Certificate(n_rows, G.shape[0], spec.rank, spec.cutoff_rtol, float(lam_min), float(lam[-1]),
                       float(spec.w[0]), cond, spec.w.copy(), np.asarray(lam),
                       lambda_min_interval=(lo, max(float(lam[0]) + wl, float(lam_min))),
                       lambda_min_scaled_interval=(float(spec.w[0]) - ws, float(spec.w[0]) + ws))


def certificate_from_factor(f: CholeskyFactor, cutoff_rtol: float, n_rows: int) -> Certificate:
    """The certificate of the Cholesky path (full rank; the extreme eigenvalues only): with ``f.proof`` a settled
    "identifiable" proved by the shifted factorisation (DESIGN §4b) and rigorous ``lambda_min`` intervals; else the
    Krylov estimates decide (three-valued)."""
    psi = f.L.shape[0]
    return Certificate(n_rows, psi, psi, cutoff_rtol, f.lam_min, f.lam_max, f.w_min, f.w_max / f.w_min,
                       np.array([f.w_min, f.w_max]), None, converged=f.settled(SETTLE_FACTOR * cutoff_rtol),
                       lambda_min_interval=f.lam_interval, lambda_min_scaled_interval=f.w_interval,
                       proof=None if f.proof is None else dict(f.proof), lambda_max_interval=f.lam_max_interval)


def certificate_from_krylov(spec, n_rows: int) -> Certificate:
    """The certificate of the krylov path from a :class:`scaleattn.linalg._lanczos.KrylovSpectrum` (``Lambda_D = G /
    N``): the extreme eigenvalues only, each with its interval in ``estimates``; ``converged`` is whether the
    run settled the rank decision, and the margin is measured on the intervals (``nearest``)."""
    n = max(n_rows, 1)
    lmax_s, lmin_s, kept = spec.lam_max_scaled, spec.lam_min_scaled, spec.lam_min_kept
    cond = float(lmax_s.value / kept.value) if kept is not None and kept.value > 0 else float("inf")
    top = lmax_s.value if lmax_s.value > 0 else float("nan")
    near = (float(kept.lower / top) if kept is not None and spec.rank else float("nan"),
            float(spec.dropped_max / top) if spec.rank < spec.psi else None)
    est = {"solver": "krylov", "passes": int(spec.passes), "verdict_settled": spec.verdict_settled,
           "eigenvalues_converged": spec.converged, "rank_converged": bool(spec.rank_converged),
           "lambda_max_scaled": lmax_s.summary(), "lambda_min_scaled": lmin_s.summary(),
           "lambda_min_kept_scaled": None if kept is None else kept.summary(),
           "lambda_max": None if spec.lam_max is None else spec.lam_max.scaled(1.0 / n).summary(),
           "lambda_min": None if spec.lam_min is None else spec.lam_min.scaled(1.0 / n).summary(),
           "notes": list(spec.notes)}
    lam_max = float("nan") if spec.lam_max is None else spec.lam_max.value / n
    lam_min = float("nan") if spec.lam_min is None else max(spec.lam_min.value, 0.0) / n
    # the Ritz values' own rounding: a Rayleigh quotient is computed to psi eps lambda_max or so
    slack_s = spec.psi * EPS * abs(float(lmax_s.upper))
    slack = 0.0 if spec.lam_max is None else spec.psi * EPS * abs(float(spec.lam_max.upper)) / n
    lam_iv = None if spec.lam_min is None else (spec.lam_min.lower / n - slack, spec.lam_min.upper / n + slack)
    cert = Certificate(n_rows, spec.psi, spec.rank, spec.rtol, lam_min, lam_max, float(lmin_s.value), cond,
                       np.array([lmin_s.value, lmax_s.value]), None, converged=spec.verdict_settled,
                       estimates=est, nearest=near, lambda_min_interval=lam_iv,
                       lambda_min_scaled_interval=(float(lmin_s.lower) - slack_s, float(lmin_s.upper) + slack_s))
    psd_intervals(cert, spec.psi)
    return cert


def psd_intervals(cert: Certificate, psi: int) -> None:
    """Make the certificate's ``lambda_min`` intervals (``lambda_min_interval``, ``lambda_min_scaled_interval`` and
    ``estimates["lambda_min"]``, ``["lambda_min_scaled"]``, ``["lambda_min_kept_scaled"]``) respect that ``G / N``
    and ``Gs`` are positive semidefinite, in place: each lower end clamped at minus the path's round-off resolution
    ``psi eps lambda_max``, and each upper end widened to at least it (a Ritz interval on a singular Gram lay
    entirely below 0, ``[-1.6e-13, -1.0e-14]``, which cannot hold the truth 0)."""
    est = cert.estimates

    def top(key, fallback):
        x = est.get(key)
        v = fallback if x is None else max(abs(float(x.get("upper", fallback))), abs(float(x.get("value", 0.0))))
        return float(v) if math.isfinite(float(v)) else 0.0

    res = psi * EPS * top("lambda_max", cert.lambda_max)
    spec = cert.spectrum_scaled
    res_s = psi * EPS * top("lambda_max_scaled", 0.0 if spec is None else float(np.asarray(spec)[-1]))

    def fix(lo, hi, r, widen=0.0):
        # not below -r: G / N is semidefinite, and its stored float64 form is so to within its round-off r
        lo = max(float(lo) - widen, -r)
        return lo, max(float(hi) + widen, r, lo)

    # the estimates' Ritz intervals carry no rounding term (the certificate's own intervals do,
    # certificate_from_krylov): a Rayleigh quotient is computed to about psi eps lambda_max, so widen them by it
    for key, r in (("lambda_min", res), ("lambda_min_scaled", res_s), ("lambda_min_kept_scaled", res_s)):
        x = est.get(key)
        if x is not None and "lower" in x and "upper" in x:
            lo, hi = fix(x["lower"], x["upper"], r if key != "lambda_min_kept_scaled" else 0.0, r)
            est[key] = {**x, "lower": lo, "upper": hi, "value": min(max(float(x.get("value", lo)), lo), hi)}
    if cert.lambda_min_interval is not None:
        cert.lambda_min_interval = fix(*cert.lambda_min_interval, res)
    if cert.lambda_min_scaled_interval is not None:
        cert.lambda_min_scaled_interval = fix(*cert.lambda_min_scaled_interval, res_s)


def check_cutoff(cutoff_rtol) -> float | None:
    """``cutoff_rtol`` validated: None (the default) or a number in (0, 1)."""
    return real("cutoff_rtol", cutoff_rtol, 0.0, 1.0, low_open=True, high_open=True, none_ok=True)


@dataclasses.dataclass
class Witness:
    """Two models that fit the training data equally well but compute different functions (DESIGN §4).

    ``coef_a`` is the fit, ``coef_b = coef_a + t n e_a^T`` with ``n`` (psi,) the null direction of the Gram
    with the smallest Rayleigh quotient; ``tokens`` (T, d) is an input on which their last-token predictions
    ``prediction_a``, ``prediction_b`` (d_out,) differ; ``sse_a``, ``sse_b`` their training sums of squares
    (``sse_b - sse_a = t^2 n^T G n + 2 t n^T (G c_a - B_a)`` exactly, no cancellation against yy; from the R
    of a QR of the features when the solution has one, ``||R n||^2`` instead of ``n^T G n``).
    ``prediction_scale`` is the scale the step aimed the prediction gap at (the larger of ``||prediction_a||``
    and the root mean square target). The pair proves the ambiguity (:attr:`conclusive`) only when the gap is
    at least :data:`WITNESS_MIN_GAP` of that scale and the certificate's ``verdict`` (``certificate_verdict``)
    is a settled ``"not identifiable"``.
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
    prediction_scale: float = float("nan")
    certificate_verdict: str = "not identifiable"

    @property
    def prediction_relative_difference(self) -> float:
        """``||prediction_b - prediction_a|| / prediction_scale``: about 1 when the step along the null direction
        left the training loss unchanged, much less when the loss forced it down."""
        return float(np.linalg.norm(self.prediction_b - self.prediction_a) / self.prediction_scale)

    @property
    def conclusive(self) -> bool:
        """Whether the pair proves the ambiguity: the predictions differ by at least :data:`WITNESS_MIN_GAP` of
        the prediction scale with equal training losses, and the certificate settled "not identifiable". A
        smaller gap: the computed loss changes along that direction, if more weakly than the cutoff (not a proof); a
        "not settled" certificate means the direction may be determined by the data below the method's
        precision (nearly collinear tokens: a prediction-scale step then changes the loss by ~1e-18, below what
        the Gram resolves, yet the minimiser is unique). Neither is evidence that the function is undetermined."""
        return bool(self.prediction_relative_difference >= WITNESS_MIN_GAP
                    and self.certificate_verdict == "not identifiable")

    def summary(self) -> dict:
        """JSON-ready: tokens, predictions, losses (MSE over rows and outputs) and their relative gap, the
        prediction gap (absolute and relative to the prediction scale) and whether the pair is conclusive."""
        la, lb = max(self.sse_a, 0.0) / self.n_out, max(self.sse_b, 0.0) / self.n_out
        return {"tokens": self.tokens.tolist(), "prediction_a": self.prediction_a.tolist(),
                "prediction_b": self.prediction_b.tolist(), "loss_a": float(la), "loss_b": float(lb),
                "loss_relative_difference": float(abs(self.sse_b - self.sse_a) / max(
                    self.sse_a, self.sse_b, self.target_sum_squares, 1e-300)),
                "prediction_difference": float(np.linalg.norm(self.prediction_b - self.prediction_a)),
                "prediction_scale": float(self.prediction_scale),
                "prediction_relative_difference": self.prediction_relative_difference,
                "certificate_verdict": self.certificate_verdict, "conclusive": self.conclusive,
                "coef_distance": coef_distance(self.coef_a, self.coef_b)}


def _least_direction(Nb, M, gram_norm: float):
    """The direction ``Nb u`` with the smallest ``u^T M u`` (``M = Nb^T G Nb``), chosen as a function of the
    subspace, not of round-off: when several eigenvalues of ``M`` tie at the bottom within the Gram's round-off
    (``psi eps ||G||``; data exactly on a subspace make the whole null basis tie), the tied eigenvectors span
    a subspace that round-off does not move while their basis within it is arbitrary, so the direction is the
    projection of the null basis' first column onto that subspace (the eigenvector alone when it is unique)."""
    w, U = np.linalg.eigh(M)
    tol = Nb.shape[0] * np.finfo(np.float64).eps * float(gram_norm) if np.isfinite(gram_norm) else 0.0
    k = int(np.sum(w <= w[0] + tol))
    u = U[:, :k] @ U[0, :k] if k > 1 else U[:, 0]
    return Nb @ (u if np.linalg.norm(u) > 1e-8 else U[:, 0])


def ambiguity_witness(solution, stats, gram=None, length: int | None = None, candidates: int = 16,
                      seed: int = 0, loss_rtol: float = 1e-12) -> Witness | None:
    """Witness of non-identifiability ([Y25] Lemma 2.3 fails; DESIGN §4): ``None`` when identifiable.

    Moves the fit along the null direction ``n`` of the Gram (in ``solution.null_basis``) with the smallest
    ``n^T G n``, in the output column of largest coefficient norm, by a step ``t`` that changes the
    prediction on the witness input by about the scale of the targets, shrunk if needed so that the
    training losses agree to ``loss_rtol`` relative (to the larger of the loss and ``yy``, the scale the
    statistics resolve). The witness input (``length`` tokens, default d + 1, entries N(0, 1/length)) is the
    best of ``candidates`` random draws by ``|phi . n| / ||phi||``. A solution from a QR of the features
    (``solution.factor``, :mod:`scaleattn.linalg._qr`) gives the loss changes from ``R`` (exact to ``eps^2``), a Gram
    solution from ``G`` (to ``eps``). A pair whose step had to shrink below :data:`WITNESS_MIN_GAP` of the
    prediction scale, or of a certificate that is not settled, is returned with ``conclusive`` False.
    """
    Nb = np.asarray(solution.null_basis)
    if Nb.shape[1] == 0:
        return None
    G = gram_for(stats) if gram is None else gram
    c = np.asarray(solution.coef, np.float64)
    d = stats.d
    factor = getattr(solution, "factor", None)
    if factor is not None:  # [Phi | Y] = Q R: n^T G n = ||R11 n||^2, G c - B = R11^T (R11 c - z), no squaring
        R11, z = factor.R[: Nb.shape[0], : Nb.shape[0]], factor.R[: Nb.shape[0], Nb.shape[0]:]
        n = Nb @ np.linalg.svd(R11 @ Nb)[2][-1]
    else:
        n = _least_direction(Nb, Nb.T @ (G @ Nb), solution.certificate.lambda_max * max(stats.n_rows, 1))
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
    if factor is not None:
        Rn = R11 @ n
        sse_a = float(solution.sse)
        nGn, cross = float(Rn @ Rn), float(Rn @ (R11 @ c[:, a] - z[:, a]))
    else:
        sse_a = stats.sse(c, G)
        nGn, cross = float(n @ (G @ n)), float(n @ (G @ c[:, a] - np.asarray(stats.moments)[:, a]))
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
                   max(stats.n_rows * stats.d_out, 1), float(stats.yy), float(scale), solution.certificate.verdict)
