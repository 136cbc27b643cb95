"""A verdict that survives ill-conditioned data (issue 16, part 2): on Läuchli-type designs (token coordinates
nearly collinear, cond(Phi) ~ 1e9, cond(G) ~ 1e18) the Gram cannot settle the certificate, a QR of the features
can. References are independent: numpy's lstsq and matrix_rank on phi, and mpmath at 60 digits."""
import json
import subprocess
import sys

import mpmath
import numpy as np
import pytest

import scaleattn
from scaleattn.display._text import certificate_summary, fit_summary, verdict
from scaleattn.distributed.tsqr import compute_r
from scaleattn.errors import ParameterError
from scaleattn.features import phi, row_targets, token_features
from scaleattn.heads._algebra import coef_from_heads
from scaleattn.linalg._certificate import SETTLE_FACTOR, WITNESS_MIN_GAP, Certificate, ambiguity_witness
from scaleattn.linalg._qr import (
    QR_MAX_PSI,
    certificate_from_r,
    factor_from_arrays,
    merge_factors,
    needs_qr,
    residual_floor,
    solve_from_r,
)

EPS = np.finfo(np.float64).eps


def lauchli(d, n, T, delta, seed=0, noise=0.0, causal=False, lengths=None):
    """Tokens ``a_t u + delta e_t`` (u fixed, a_t and e_t Gaussian): coordinates nearly collinear, so phi's
    singular values fall like powers of ``delta``; targets of a random 1-head teacher plus relative ``noise``."""
    rng = np.random.default_rng(seed)
    u = np.ones(d) / np.sqrt(d)
    tok = rng.standard_normal((n, T, 1)) * u + delta * rng.standard_normal((n, T, d))
    if lengths is not None:
        tok[np.arange(T)[None, :] >= lengths[:, None]] = 0.0
    s, x = token_features(tok, lengths, causal)
    y = phi(s, x) @ coef_from_heads(rng.standard_normal((1, d, d)), rng.standard_normal((1, d, d)))
    y = y + noise * np.sqrt(np.mean(y**2)) * rng.standard_normal(y.shape)
    if causal:
        full = np.zeros((n, T, d))
        full[np.ones((n, T), bool) if lengths is None else np.arange(T)[None, :] < lengths[:, None]] = y
        y = full
    return tok, y


def reference(tok, y, lengths=None, causal=False):
    """numpy on the dense features: (phi, rows' targets, lstsq coefficients, its SSE, matrix_rank)."""
    s, x = token_features(tok, lengths, causal)
    P, Y = phi(s, x), row_targets(y, lengths, causal)
    c = np.linalg.lstsq(P, Y, rcond=None)[0]
    return P, Y, c, float(np.sum((Y - P @ c) ** 2)), int(np.linalg.matrix_rank(P))


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- the Gram fails, the QR settles: against numpy lstsq / matrix_rank ------------------------------------------
@pytest.mark.parametrize("d,delta,noise", [(2, 1e-3, 0.0), (2, 1e-3, 0.05), (3, 1e-3, 0.0), (3, 1e-3, 1e-3)])
def test_lauchli_qr_matches_lstsq(d, delta, noise):
    tok, y = lauchli(d, 2000, 6, delta, noise=noise)
    P, Y, c_ref, sse_ref, rank_ref = reference(tok, y)
    psi = P.shape[1]
    sv = np.linalg.svd(P / np.linalg.norm(P, axis=0), compute_uv=False)
    assert 1e8 < sv[0] / sv[-1] < 1e10 and rank_ref == psi  # cond(Phi) ~ 1e9: the float64 data determine c
    stats = scaleattn.statistics_from_arrays(tok, y)
    gram = scaleattn.solve(stats)
    assert gram.certificate.rank < psi and gram.certificate.verdict != "identifiable"  # the Gram cannot tell
    sol = solve_from_r(factor_from_arrays(tok, y), gram=gram.certificate)
    cert = sol.certificate
    assert cert.method == "qr" and cert.rank == rank_ref and cert.verdict == "identifiable" and cert.identifiable
    assert cert.margin >= SETTLE_FACTOR and cert.gram is gram.certificate
    assert rel(sol.coef, c_ref) < 1e-6
    sse = float(np.sum((Y - P @ sol.coef) ** 2))
    assert abs(sse - sse_ref) <= 1e-9 * max(sse_ref, 1e-300) + 1e-24 * float(np.sum(Y * Y))
    assert abs(sol.sse - sse) <= residual_floor(sol.factor, sol.coef)  # the R residual, not the Gram formula
    if noise:  # the Gram's fit misses the minimum the data determine (issue: 0.2-1 % above it)
        sse_gram = float(np.sum((Y - P @ gram.coef) ** 2))
        assert sse_gram > sse_ref * (1 + 1e-5)


def test_lauchli_causal_variable_lengths_and_estimator():
    rng = np.random.default_rng(5)
    lens = rng.integers(2, 7, size=300)
    tok, y = lauchli(2, 300, 6, 3e-3, seed=5, noise=0.01, causal=True, lengths=lens)
    P, Y, c_ref, sse_ref, rank_ref = reference(tok, y, lens, causal=True)
    est = scaleattn.MHLARegressor().fit(tok, y, lens)
    cert = est.certificate_
    assert cert.method == "qr" and cert.rank == rank_ref == 6 and cert.verdict == "identifiable"
    assert rel(est.coef_, c_ref) < 1e-6
    assert est.solution_.sse == pytest.approx(sse_ref, rel=1e-9)
    gram_only = scaleattn.MHLARegressor(certificate="gram").fit(tok, y, lens)
    assert gram_only.certificate_.method == "gram" and not gram_only.certificate_.identifiable
    with pytest.raises(ParameterError, match="certificate"):
        scaleattn.MHLARegressor(certificate="svd").fit(tok, y, lens)


def test_mpmath_exact_reference_small_case():
    """60 rows, d = 2: the exact least-squares solution and singular values of the float64 data, at 60 digits."""
    tok, y = lauchli(2, 60, 5, 1e-3, seed=2, noise=0.01)
    P, Y, _, _, _ = reference(tok, y)
    mpmath.mp.dps = 60
    Pm, Ym = mpmath.matrix(P.tolist()), mpmath.matrix(Y.tolist())
    c_exact = np.array((mpmath.lu_solve(Pm.T * Pm, Pm.T * Ym)).tolist(), dtype=float).reshape(6, -1) \
        if Y.shape[1] == 1 else np.column_stack([np.array(mpmath.lu_solve(Pm.T * Pm, Pm.T * Ym[:, a]).tolist(),
                                                           dtype=float).ravel() for a in range(Y.shape[1])])
    r = Ym - Pm * mpmath.matrix(c_exact.tolist())
    sse_exact = float(sum(r[i, j] ** 2 for i in range(r.rows) for j in range(r.cols)))
    scale = np.linalg.norm(P, axis=0)
    s_exact = np.array(mpmath.svd_r(mpmath.matrix((P / scale).tolist()), compute_uv=False).tolist(), float).ravel()
    sol = solve_from_r(factor_from_arrays(tok, y))
    assert sol.certificate.rank == 6 and s_exact.min() / s_exact.max() > 1e3 * 16 * 6 * EPS
    assert rel(sol.coef, c_exact) < 1e-6
    assert sol.sse == pytest.approx(sse_exact, rel=1e-9)
    kept = np.sqrt(np.sort(sol.certificate.spectrum_scaled)[::-1])  # singular values of the scaled R
    assert np.allclose(kept, np.sort(s_exact)[::-1], rtol=1e-6)


# ---- truly ambiguous data stay ambiguous; well-conditioned data stay on the Gram -------------------------------
@pytest.mark.parametrize("case", ["collinear", "subspace"])
def test_truly_not_identifiable_stays_not_identifiable(case):
    rng = np.random.default_rng(3)
    if case == "collinear":  # every token on one line: phi has rank 1
        tok = rng.standard_normal((400, 5, 1)) * (np.array([1.0, 2.0]) / np.sqrt(5))
    else:  # tokens in a 2-d subspace of R^3
        tok = rng.standard_normal((800, 5, 2)) @ np.linalg.qr(rng.standard_normal((3, 2)))[0].T
    s, x = token_features(tok)
    y = phi(s, x) @ rng.standard_normal((phi(s, x).shape[1], 1))
    rank_ref = int(np.linalg.matrix_rank(phi(s, x)))
    est = scaleattn.MHLARegressor().fit(tok, y)
    cert = est.certificate_
    assert cert.method == "qr" and cert.rank == rank_ref < cert.psi and cert.verdict == "not identifiable"
    assert cert.margin >= SETTLE_FACTOR and cert.gram.verdict == "not identifiable"
    w = ambiguity_witness(est.solution_, scaleattn.statistics_from_arrays(tok, y))
    assert w is not None and w.conclusive and w.prediction_relative_difference > 0.5
    assert w.summary()["loss_relative_difference"] <= 1e-12


def test_well_conditioned_stays_gram_and_bit_identical(tmp_path, monkeypatch):
    from scaleattn import pipeline
    from scaleattn.generate import generate_mhla

    ds = generate_mhla(tmp_path / "g.zarr", d=3, heads=2, length=10, samples=200, causal=True, seed=1)
    ref = scaleattn.fit(ds, certificate="gram", exact_mse=False)
    monkeypatch.setattr(pipeline, "compute_r", lambda *a, **k: pytest.fail("no QR pass for identifiable data"))
    res = scaleattn.fit(ds, exact_mse=False)
    assert res.report["certificate_method"] == "gram" and res.report["verdict"] == "identifiable"
    assert np.array_equal(res.statistics.gram_compact, ref.statistics.gram_compact)
    assert np.array_equal(res.model.coef, ref.model.coef) and "qr" not in res.report["timings"]
    same = {k for k in ref.report if k not in ("timings", "seconds", "heads_search_seconds")}
    assert all(res.report[k] == ref.report[k] for k in same if k != "dataset")


def test_forced_qr_agrees_with_gram_on_good_data_ridge_too():
    rng = np.random.default_rng(4)
    tok, y = rng.standard_normal((500, 6, 2)), rng.standard_normal((500, 2))
    stats, f = scaleattn.statistics_from_arrays(tok, y), factor_from_arrays(tok, y)
    for ridge in (0.0, 1e-3):
        g, q = scaleattn.solve(stats, ridge=ridge), solve_from_r(f, ridge=ridge)
        assert q.certificate.rank == g.certificate.rank == 6 and rel(q.coef, g.coef) < 1e-10
        assert q.sse == pytest.approx(g.sse, rel=1e-10) and q.effective_dof == pytest.approx(g.effective_dof)
    c = certificate_from_r(f)
    gc = scaleattn.certify(stats)
    assert c.lambda_min == pytest.approx(gc.lambda_min, rel=1e-8) and c.lambda_max == pytest.approx(gc.lambda_max)
    assert np.allclose(c.eigenvalues, gc.eigenvalues, rtol=1e-8)


# ---- the verdict: margin, settle factor, when the QR runs -------------------------------------------------------
def _cert(w, rank, method="gram", rtol=1e-12):
    w = np.sort(np.asarray(w, float))
    return Certificate(100, w.size, rank, rtol, 0.0, 1.0, float(w[0]), 1.0, w, None, method=method)


def test_verdict_and_margin():
    assert _cert([1e-9, 0.5, 1.0], 3).verdict == "identifiable"  # 1e-9 / 1e-12 = 1000x above
    c = _cert([5e-12, 0.5, 1.0], 3)
    assert c.verdict == "not settled" and c.margin == pytest.approx(5.0) and not c.identifiable
    c = _cert([1e-15, 0.5, 1.0], 2)
    assert c.verdict == "not identifiable" and c.margin == pytest.approx(1e3) and c.ambiguous_dim == 1
    assert _cert([3e-13, 0.5, 1.0], 2).verdict == "not settled"
    assert _cert([-1e-16, 0.0, 1.0], 1).margin == pytest.approx(1e4)  # a negative round-off counts by its size
    assert _cert([0.0, 0.0, 1.0], 1).margin == pytest.approx(1e12)  # exact zeros: the kept side alone decides
    q = _cert([1e-20, 1e-8, 1.0], 2, method="qr", rtol=1e-16)  # singular values 1e-10 and 1e-4 vs cutoff 1e-8
    assert q.cutoff == pytest.approx(1e-8) and q.margin == pytest.approx(100.0) and q.verdict == "not identifiable"
    s = q.summary()
    assert s["certificate_method"] == "qr" and s["largest_dropped_relative"] == pytest.approx(1e-10)
    assert s["smallest_kept_relative"] == pytest.approx(1e-4) and s["settle_factor"] == SETTLE_FACTOR
    assert _cert([0.0, 0.0, 0.0], 0).verdict == "not identifiable"  # all-zero features
    good, near = _cert([1e-9, 0.5, 1.0], 3), _cert([5e-12, 0.5, 1.0], 3)
    assert not needs_qr("auto", good, 6) and needs_qr("auto", near, 6) and not needs_qr("gram", near, 6)
    assert needs_qr("qr", good, 10**6) and not needs_qr("auto", near, QR_MAX_PSI + 1)
    with pytest.raises(ParameterError, match="certificate must be one of"):
        needs_qr("eigh", good, 6)


def test_report_text_for_each_verdict():
    base = {"rank": 5, "psi": 6, "ambiguous_dim": 1, "identifiable": False, "settle_factor": 10.0}
    assert verdict({**base, "verdict": "not settled", "margin": 7.7}).startswith(
        "NOT SETTLED at the precision of the float64 Gram: rank 5 of 6")
    assert verdict({**base, "verdict": "not identifiable", "certificate_method": "qr", "margin": 300.0}).startswith(
        "NOT identifiable: 1 feature direction(s)")
    assert verdict({"identifiable": True, "ambiguous_dim": 0}) == (  # an old report without verdict keys
        "IDENTIFIABLE: every least-squares fit computes the same function")
    s = {"n_rows": 9, "psi": 6, "rank": 6, "lambda_min": 1e-17, "lambda_max": 1.0, "identifiable": True,
         "ambiguous_dim": 0, "verdict": "identifiable", "certificate_method": "qr", "margin": 3e4,
         "gram_verdict": "not settled", "gram_rank": 5, "gram_margin": 7.7}
    text = certificate_summary(s)
    assert "a QR of the features, margin 3e+04x" in text and "the Gram alone said: not settled, rank 5" in text
    assert "; settled by a QR of the features)" in text
    # a Gram that had decided was 'settled' by the QR too, as if it had been in doubt: confirmed, or overruled
    for gram, how in (("identifiable", "confirmed"), ("not identifiable", "overruled")):
        g = certificate_summary({**s, "gram_verdict": gram, "gram_rank": 6})
        assert f"the Gram alone said: {gram}, rank 6, margin 7.7x; {how} by a QR of the features)" in g, g
    # a QR that does not settle it either did not 'settle' it (the line said so under a NOT SETTLED verdict)
    both = certificate_summary({**s, "verdict": "not settled", "identifiable": False, "margin": 9.56})
    assert "; not settled by a QR of the features either)" in both and "; settled by" not in both


def test_the_witness_line_reads_as_a_distance_and_a_ratio():
    """'differ by 18.1 (norm) (1 of the prediction scale)' read awkwardly."""
    r = {"n_rows": 9, "n_samples": 9, "length": 1, "causal": False, "d": 2, "d_out": 1, "psi": 6, "rank": 5,
         "cutoff_rtol": 1e-12, "lambda_min": 0.0, "lambda_max": 1.0, "identifiable": False, "ambiguous_dim": 1,
         "verdict": "not identifiable", "margin": 1e3, "train_mse": 0.1, "relative_train_mse": 0.1,
         "target_mean_square": 1.0, "n_heads": 1, "heads_method": "svd", "seconds": 0.0,
         "witness": {"loss_a": 0.1, "loss_b": 0.1, "prediction_difference": 18.1,
                     "prediction_relative_difference": 1.0, "tokens": [[0.0, 0.0]] * 9, "conclusive": True}}
    text = fit_summary(r)
    assert "differ by 18.1 in norm (1.0x the prediction scale) in their predictions on a 9-token input" in text


def test_an_inconclusive_witness_does_not_contradict_a_not_identifiable_verdict():
    """Near-collinear tokens, QR verdict 'not identifiable' at margin 11.3x: the witness line said 'the data do
    change it along that direction', which read as if the data determined the direction the verdict calls
    undetermined. It now says what was measured (a loss change weaker than the cutoff) and that the verdict stands;
    a settled margin within CLOSE_FACTOR of the settle factor is flagged as close to the cutoff."""
    from scaleattn.display._text import CLOSE_FACTOR

    w = {"loss_a": 0.1, "loss_b": 0.1, "prediction_difference": 10.3, "prediction_relative_difference": 7.6e-6,
         "tokens": [[0.0] * 6] * 7, "conclusive": False, "certificate_verdict": "not identifiable"}
    r = {"n_rows": 9, "n_samples": 9, "length": 1, "causal": False, "d": 6, "d_out": 6, "psi": 126, "rank": 125,
         "cutoff_rtol": 2e-25, "lambda_min": 0.0, "lambda_max": 1.0, "identifiable": False, "ambiguous_dim": 1,
         "verdict": "not identifiable", "certificate_method": "qr", "margin": 11.3, "settle_factor": SETTLE_FACTOR,
         "train_mse": 0.1, "relative_train_mse": 0.1, "target_mean_square": 1.0, "n_heads": 1,
         "heads_method": "svd", "seconds": 0.0, "witness": w}
    text = fit_summary(r)
    wit = next(line for line in text.splitlines() if line.startswith("witness:"))
    assert "data do change" not in wit and "does not overturn the verdict" in wit
    assert "more weakly than the cutoff, the precision of the float64 features" in wit
    assert "precision of the float64 Gram" in fit_summary({**r, "certificate_method": "gram"})
    flag = "close to the cutoff: settled from 10x"
    assert f"[a QR of the features, margin 11.3x, {flag}]" in text
    # the flag marks settled verdicts only, below CLOSE_FACTOR x the settle factor (here 30x)
    for margin, v, flagged in ((SETTLE_FACTOR * CLOSE_FACTOR * 0.99, "identifiable", True),
                               (SETTLE_FACTOR * CLOSE_FACTOR, "not identifiable", False),
                               (2.12e3, "identifiable", False), (9.56, "not settled", False)):
        assert (flag in verdict({**r, "margin": margin, "verdict": v})) is flagged, (margin, v)


# ---- the witness: round-off gaps are not proofs ------------------------------------------------------------------
@pytest.mark.slow
def test_gram_only_witness_on_lauchli_is_inconclusive(tmp_path):
    tok, y = lauchli(2, 4000, 6, 1e-3, noise=0.05)
    ds = scaleattn.write_dataset(tmp_path / "l.zarr", tok, y, chunk_samples=500)
    res = scaleattn.fit(ds, certificate="gram")
    w = res.report["witness"]
    assert res.report["certificate_method"] == "gram" and res.report["verdict"] != "identifiable"
    assert w["conclusive"] is False and w["prediction_relative_difference"] < WITNESS_MIN_GAP
    assert w["prediction_relative_difference"] == pytest.approx(w["prediction_difference"] / w["prediction_scale"])
    assert "witness: inconclusive, not a proof of ambiguity" in fit_summary(res.report)
    auto = scaleattn.fit(ds)  # the QR settles it: identifiable, no witness, lstsq's training error
    P, Y, c_ref, sse_ref, _ = reference(tok, y)
    assert auto.report["certificate_method"] == "qr" and auto.report["verdict"] == "identifiable"
    assert "witness" not in auto.report and auto.report["gram_verdict"] == res.report["verdict"]
    assert rel(auto.model.coef, c_ref) < 1e-6
    assert auto.report["train_mse"] == pytest.approx(sse_ref / Y.size, rel=1e-9)
    assert auto.report["lstsq_train_mse_stats"] == pytest.approx(sse_ref / Y.size, rel=1e-9)
    assert res.report["train_mse"] > auto.report["train_mse"] * (1 + 1e-5)
    cert = scaleattn.certify_dataset(ds)
    assert cert.method == "qr" and cert.verdict == "identifiable" and cert.rank == 6
    assert scaleattn.certify_dataset(ds, certificate="gram").method == "gram"
    with pytest.raises(ParameterError, match="certificate must be one of"):
        scaleattn.fit(ds, certificate="lstsq")


def test_witness_needs_a_gap_and_a_settled_verdict():
    """Gram only: a settled "not identifiable" whose loss changes along the null direction (the step shrinks), and
    a "not settled" one whose step does not shrink (the loss changes by ~1e-18 there): neither is a proof."""
    rng = np.random.default_rng(5)
    lens = rng.integers(2, 9, size=500)
    tok, y = lauchli(2, 500, 8, 3e-3, seed=5, noise=0.01, causal=True, lengths=lens)
    stats = scaleattn.statistics_from_arrays(tok, y, lens)
    sol = scaleattn.solve(stats)
    w = ambiguity_witness(sol, stats)
    assert sol.certificate.verdict == "not identifiable" and w.prediction_relative_difference < WITNESS_MIN_GAP
    text = fit_summary(_fit_report(stats, sol, w))
    assert not w.conclusive and "more weakly than the cutoff, the precision of the float64 Gram" in text
    tok, y = lauchli(3, 4000, 6, 1e-3, noise=1e-3)
    stats = scaleattn.statistics_from_arrays(tok, y)
    sol = scaleattn.solve(stats)
    w = ambiguity_witness(sol, stats)
    assert sol.certificate.verdict == "not settled" and w.prediction_relative_difference >= WITNESS_MIN_GAP
    assert not w.conclusive and w.summary()["certificate_verdict"] == "not settled"
    assert "the certificate is not settled" in fit_summary(_fit_report(stats, sol, w))


def _fit_report(stats, sol, w):
    return {"n_rows": stats.n_rows, "n_samples": 1, "length": 1, "causal": False, "d": stats.d, "d_out": stats.d_out,
            **sol.certificate.summary(), "train_mse": 0.0, "relative_train_mse": 0.0, "target_mean_square": 1.0,
            "n_heads": 1, "heads_method": "svd", "seconds": 0.0, "witness": w.summary()}


def test_spectrum_plot_of_a_qr_certificate():
    from scaleattn import plot

    tok, y = lauchli(2, 2000, 6, 1e-3)
    cert = solve_from_r(factor_from_arrays(tok, y)).certificate
    fig = plot.spectrum_figure(cert.eigenvalues, cert.spectrum_scaled, rtol=cert.cutoff_rtol,
                               lambda_min=cert.lambda_min, identifiable=cert.identifiable)
    ax, ax2 = fig.axes
    (lmin,) = [ln for ln in ax.get_lines() if ln.get_gid() == "lambda_min"]
    (cut,) = [ln for ln in ax2.get_lines() if ln.get_gid() == "cutoff"]
    assert "not identifiable" not in lmin.get_label() and lmin.get_ydata()[0] == pytest.approx(cert.lambda_min)
    assert cut.get_ydata()[0] == pytest.approx(cert.cutoff_rtol * cert.spectrum_scaled[-1])  # 4.5e-28, not floored
    assert not [ln for ln in ax2.get_lines() if ln.get_gid() == "dropped"]


# ---- train_mse_stats: its documented floor holds -----------------------------------------------------------------
def test_sse_floors_bound_the_real_error():
    mpmath.mp.dps = 50
    worst = 0.0
    for noise in (0.0, 0.01):
        tok, y = lauchli(2, 120, 5, 1e-3, seed=7, noise=noise)
        P, Y, _, _, _ = reference(tok, y)
        stats = scaleattn.statistics_from_arrays(tok, y)
        G = stats.gram()
        sol_g, sol_q = scaleattn.solve(stats, gram=G), solve_from_r(factor_from_arrays(tok, y))
        for c in (sol_g.coef, sol_q.coef):
            r = mpmath.matrix(Y.tolist()) - mpmath.matrix(P.tolist()) * mpmath.matrix(c.tolist())
            exact = float(sum(r[i, j] ** 2 for i in range(r.rows) for j in range(r.cols)))
            assert abs(stats.sse(c, G) - exact) <= stats.sse_floor(c, G)
            worst = max(worst, abs(stats.sse(c, G) - exact) / stats.yy)
        assert abs(sol_q.sse - exact) <= residual_floor(sol_q.factor, sol_q.coef)
        assert residual_floor(sol_q.factor, sol_q.coef) < 1e-6 * stats.sse_floor(sol_q.coef, G)
    assert worst > 1e3 * EPS  # eps * mean(y^2), the floor the docs used to promise, does not hold


# ---- TSQR: the merge, the row groups, the cluster ---------------------------------------------------------------
def test_tsqr_merge_equals_one_qr(tmp_path):
    tok, y = lauchli(3, 900, 5, 1e-2, seed=9, noise=0.1)
    whole = factor_from_arrays(tok, y)
    parts = merge_factors(factor_from_arrays(tok[:300], y[:300]), factor_from_arrays(tok[300:], y[300:]))
    assert parts.n_rows == whole.n_rows == 900
    A = np.hstack(reference(tok, y)[:2])
    assert np.allclose(parts.R.T @ parts.R, A.T @ A, rtol=1e-10, atol=1e-10 * np.abs(A.T @ A).max())
    assert np.allclose(np.abs(parts.R), np.abs(whole.R), rtol=1e-6, atol=1e-8 * np.abs(whole.R).max())
    ds = scaleattn.write_dataset(tmp_path / "t.zarr", tok, y, chunk_samples=100)
    f = compute_r(ds, group_samples=200)
    assert f.n_rows == 900 and np.allclose(np.abs(f.R), np.abs(whole.R), rtol=1e-6,
                                           atol=1e-8 * np.abs(whole.R).max())
    assert np.array_equal(compute_r(ds, group_samples=200).R, f.R)  # fixed tree: rerun bits
    g = compute_r(ds, targets=False, group_samples=200)
    assert g.d_out == 0 and certificate_from_r(g).rank == 18
    few = factor_from_arrays(tok[:4], y[:4])  # fewer rows than features: R padded with zero rows
    assert few.R.shape == (21, 21) and certificate_from_r(few).rank == 4 == np.linalg.matrix_rank(
        reference(tok[:4], y[:4])[0])


@pytest.mark.slow
def test_lauchli_d8_matches_lstsq(tmp_path):
    """d = 8 (psi = 288), cond(Phi) ~ 1e8: the Gram keeps about a third of the directions and misses the least-squares
    minimum by about 1 %; the QR pass (through fit, on a Zarr dataset) matches numpy."""
    tok, y = lauchli(8, 6000, 10, 3e-3, noise=0.01)
    P, Y, c_ref, sse_ref, rank_ref = reference(tok, y)
    ds = scaleattn.write_dataset(tmp_path / "l8.zarr", tok, y, chunk_samples=1000)
    res = scaleattn.fit(ds, plots=False)
    r = res.report
    assert r["certificate_method"] == "qr" and r["rank"] == rank_ref == 288 and r["verdict"] == "identifiable"
    assert r["gram_rank"] < 200 and r["gram_verdict"] != "identifiable"
    assert rel(res.model.coef, c_ref) < 1e-6
    assert r["train_mse"] == pytest.approx(sse_ref / Y.size, rel=1e-9)


@pytest.mark.slow
def test_tsqr_on_a_cluster_is_bit_identical(tmp_path, client):
    tok, y = lauchli(2, 3000, 6, 1e-3, seed=11, noise=0.02)
    ds = scaleattn.write_dataset(tmp_path / "c.zarr", tok, y, chunk_samples=250)
    here = compute_r(ds, group_samples=500)
    there = compute_r(ds, client, group_samples=500)
    assert np.array_equal(here.R, there.R) and there.n_rows == 3000
    res = scaleattn.fit(ds, client=client)
    assert res.report["certificate_method"] == "qr" and res.report["verdict"] == "identifiable"
    assert res.report["timings"]["qr"] > 0


# ---- through the CLI ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_fit_and_certify_json(tmp_path):
    tok, y = lauchli(3, 2000, 6, 1e-3, seed=1, noise=1e-3)
    scaleattn.write_dataset(tmp_path / "l.zarr", tok, y, chunk_samples=250)

    def run(*args):
        p = subprocess.run([sys.executable, "-m", "scaleattn.cli", *map(str, args)], capture_output=True, text=True,
                           timeout=300)
        return p

    p = run("fit", tmp_path / "l.zarr", "--out", tmp_path / "run", "--local", "--json", "--no-plots")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    P, Y, c_ref, sse_ref, rank_ref = reference(tok, y)
    assert rep["certificate_method"] == "qr" and rep["verdict"] == "identifiable" and rep["rank"] == rank_ref == 18
    assert rep["gram_verdict"] != "identifiable" and rep["gram_rank"] < 18
    assert rep["train_mse"] == pytest.approx(sse_ref / Y.size, rel=1e-8)
    model = scaleattn.MHLAModel.load(tmp_path / "run" / "model.zarr")
    assert rel(model.coef, c_ref) < 1e-6
    g = json.loads(run("certify", tmp_path / "l.zarr", "--local", "--json", "--certificate", "gram").stdout)
    assert g["certificate_method"] == "gram" and g["verdict"] != "identifiable"
    bad = run("certify", tmp_path / "l.zarr", "--local", "--certificate", "exact")
    assert bad.returncode == 2 and "--certificate" in bad.stderr
