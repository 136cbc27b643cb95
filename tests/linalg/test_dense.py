"""The dense path's algebra (:mod:`scaleattn.linalg._dense`): the blocked Cholesky against scipy's one-call LAPACK
factor, the block Krylov extreme eigenvalues and the Cholesky path's certificate against dense ``eigvalsh``."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from scaleattn.generate import make_mhla
from scaleattn.linalg._dense import NARROW, blocked_cholesky, gemm, largest_eigenvalues, row_gram
from scaleattn.linalg._solver import certify
from scaleattn.linalg._spectrum import (
    EIG_MAXITER,
    EIG_RTOL,
    INVERSE_STEPS,
    cholesky_factor,
    default_rtol,
    lambda_min_full_rank,
    scaled_spectrum,
)
from scaleattn.statistics._container import statistics_from_arrays


def _spd(n, seed=0, cond=1e3):
    x = np.random.default_rng(seed).standard_normal((n + 10, n))
    return x.T @ x / n + np.eye(n) * (4.0 / cond)


@pytest.mark.parametrize("n,block", [(1, 16), (7, 16), (100, 16), (257, 64), (300, 300), (301, 300), (520, 128)])
def test_blocked_cholesky_is_scipys_factor(n, block):
    a = _spd(n, seed=n)
    ref = scipy.linalg.cholesky(a, lower=True)
    L = blocked_cholesky(a, block=block)
    assert L.flags.c_contiguous and np.array_equal(np.triu(L, 1), np.zeros((n, n)))
    assert np.abs(L - ref).max() <= 1e-13 * np.abs(ref).max()
    assert np.abs(L @ L.T - a).max() <= 1e-14 * n * np.abs(a).max()
    b = a.copy()
    assert blocked_cholesky(b, block=block, overwrite_a=True) is b  # in place: its memory becomes L
    assert np.array_equal(b, L)


@pytest.mark.parametrize("threads", [1, 2])
def test_cholesky_past_potrf_max_takes_lapack_on_one_thread_and_blocks_on_several(threads, monkeypatch):
    """Past POTRF_MAX the factor is LAPACK's one call on one BLAS thread (safe there, and faster) and the blocked
    one on several (OpenBLAS's threaded dpotrf dies there): which ran is seen by the call made, and both are
    scipy's factor."""
    import scaleattn.linalg._dense as dense

    a = _spd(300, seed=3)
    monkeypatch.setattr(dense, "POTRF_MAX", 100)
    monkeypatch.setattr(dense, "_blas_threads", lambda: threads)
    calls = []
    real = dense.blocked_cholesky
    monkeypatch.setattr(dense, "blocked_cholesky", lambda *x, **k: calls.append(1) or real(*x, **k))
    L = dense.cholesky(a)
    assert calls == ([] if threads == 1 else [1])
    np.testing.assert_allclose(L, scipy.linalg.cholesky(a, lower=True), rtol=0, atol=1e-12)


def test_blocked_cholesky_refuses_what_scipy_refuses():
    a = _spd(200, cond=1e2)
    a[150, 150] = -1.0  # the leading minor of order 151 is indefinite
    with pytest.raises(np.linalg.LinAlgError) as ours:
        blocked_cholesky(a, block=64)
    with pytest.raises(np.linalg.LinAlgError) as theirs:
        scipy.linalg.cholesky(a, lower=True)
    assert str(ours.value) == str(theirs.value) == "151-th leading minor of the array is not positive definite"
    # numerically singular (rank 150 of 200): refused by both, and the Cholesky path says None (falls back)
    x = np.random.default_rng(1).standard_normal((150, 200))
    g = x.T @ x
    for f in (lambda: blocked_cholesky(g, block=64), lambda: scipy.linalg.cholesky(g, lower=True)):
        with pytest.raises(np.linalg.LinAlgError):
            f()
    assert cholesky_factor(g, default_rtol(200), 150) is None
    with pytest.raises(ValueError, match="square"):
        blocked_cholesky(np.ones((3, 4)))


@pytest.mark.parametrize("n,block", [(1, 4), (16, 16), (17, 16), (100, 7), (333, 64)])
def test_row_gram_is_the_rows_gram_matrix(n, block):
    """Row blocks of GEMM give ``A A^T`` (einsum over the rows, no BLAS) to round-off, every block size."""
    a = np.random.default_rng(n).standard_normal((n, 9)) * np.logspace(-3, 3, 9)
    ref = np.einsum("ik,jk->ij", a, a)
    g = row_gram(a, block=block)
    assert g.shape == (n, n)
    np.testing.assert_allclose(g, ref, rtol=1e-13, atol=1e-13 * np.abs(ref).max())


@pytest.mark.slow
def test_row_gram_past_the_size_at_which_threaded_dsyrk_dies():
    """20,000 x 528 (the dual's kernel at d = 32): ``a @ a.T`` on numpy's threaded OpenBLAS died with SIGSEGV here;
    the row blocks run, and sampled rows equal their own products (each a GEMM of a few rows)."""
    a = np.random.default_rng(0).standard_normal((20_000, 528))
    g = row_gram(a)
    rows = [0, 4095, 4096, 12_345, 19_999]
    np.testing.assert_allclose(g[rows], np.einsum("ik,jk->ij", a[rows], a), rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(g[:, rows].T, g[rows], rtol=1e-12, atol=1e-9)


def test_gemm_is_matmul():
    rng = np.random.default_rng(2)
    a, x = rng.standard_normal((50, 40)), rng.standard_normal((40, 3))
    assert np.allclose(gemm(a, x), a @ x, rtol=1e-14, atol=1e-13)
    assert np.allclose(gemm(a, rng.standard_normal((50, 2)), trans=True).shape, (40, 2))
    y = rng.standard_normal((50, 2))
    assert np.allclose(gemm(a, y, trans=True), a.T @ y, rtol=1e-14, atol=1e-13)


@pytest.mark.parametrize("k", [0, 1, 16, NARROW, NARROW + 1])
@pytest.mark.parametrize("layout", ["C", "F", "strided"])
def test_gemm_both_orientations_and_layouts(k, layout):
    """Narrow products put ``a`` in BLAS's A operand (Fortran result), wide ones in B (C result): both against
    numpy's matmul, for ``x`` C-ordered, Fortran-ordered and a strided view, with and without ``trans``."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((70, 45))
    for trans, rows in ((False, 45), (True, 70)):
        x = rng.standard_normal((rows, 2 * k + 1))[:, ::2][:, :k] if layout == "strided" else \
            np.asarray(rng.standard_normal((rows, k)), order=layout)
        ref = (a.T if trans else a) @ x
        y = gemm(a, x, trans=trans)
        assert y.shape == ref.shape and np.allclose(y, ref, rtol=1e-13, atol=1e-13)
        assert (y.flags.f_contiguous if k <= NARROW else y.flags.c_contiguous)
    assert gemm(a[:, :0], np.ones((0, 3))).shape == (70, 3) and not gemm(a[:, :0], np.ones((0, 3))).any()


def _reference_krylov(A, X, rtol, maxiter):
    """The block Krylov run in plain numpy, the residual ``||A u - theta u||`` formed every step: (value,
    residual, steps) at the same stopping rule."""
    Q = np.linalg.qr(X)[0]
    basis, V = np.zeros((A.shape[0], 0)), Q
    for step in range(1, maxiter + 1):
        basis = np.hstack([basis, V])
        H = basis.T @ A @ basis
        w, U = np.linalg.eigh((H + H.T) / 2)
        u = basis @ U[:, -1]
        res = np.linalg.norm(A @ u - w[-1] * u)
        gap = w[-1] - w[-2] if w.size > 1 else w[-1]
        if res * min(res / max(gap, res), 1.0) <= rtol * w[-1]:
            return w[-1], res, step
        W = A @ V
        for _ in range(2):
            W -= basis @ (basis.T @ W)
        V = np.linalg.qr(W)[0]
    return w[-1], res, maxiter


@pytest.mark.parametrize("rtol", [1e-6, 1e-10])
def test_largest_eigenvalues_match_a_plain_numpy_run(rtol):
    """The runs decide convergence on a cheap residual stand-in and form the residual from the stored basis only
    then: the same values, residuals and steps as a numpy run forming ``A u - theta u`` every step (two
    operators side by side, the scaled one with a crowded top, as ``Gs^-1`` has it), and each interval holds
    eigvalsh's value."""
    n, k, seed = 400, 8, 7
    rng = np.random.default_rng(1)
    q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    a = (q * np.concatenate([np.geomspace(1e-2, 1.0, n - 40), np.linspace(1.0, 1.02, 40)])) @ q.T
    a = (a + a.T) / 2
    s = rng.uniform(0.5, 2.0, n)
    ests = largest_eigenvalues(lambda X: a @ X, n, [None, s], block=k, rtol=rtol, maxiter=40, seed=seed)
    starts = np.random.default_rng(seed)
    for e, op in zip(ests, (a, s[:, None] * a * s[None, :])):
        value, res, steps = _reference_krylov(op, starts.standard_normal((n, k)), rtol, 40)
        assert e.converged and e.iterations == steps
        assert e.value == pytest.approx(value, rel=1e-12) and e.residual == pytest.approx(res, rel=1e-3, abs=1e-12)
        ref = np.linalg.eigvalsh(op)[-1]
        assert e.lower * (1 - 1e-12) <= ref <= e.upper * (1 + 1e-12)


def test_cholesky_factor_is_of_G_and_solves_with_the_scaled_gram():
    """The factor kept is that of G itself minus the proof's shift times diag G (no pass scaling it); solve() is
    Gs^-1 and gram_solve() G^-1 (dense references), so the Jacobi scaling lives in O(psi) vector scalings only."""
    d = np.geomspace(1e-3, 1e3, 150)  # feature scales over six decades: Jacobi scaling matters
    G = d[:, None] * _spd(150, seed=5, cond=1e4) * d[None, :]
    f = cholesky_factor(G, default_rtol(150), 100)
    assert f.proof is not None and f.shift == f.proof["shift"] > 0
    shifted = G - f.shift * np.diag(np.diag(G))
    sc = 1.0 / np.sqrt(np.diag(G))
    assert np.abs(sc[:, None] * (f.L @ f.L.T - shifted) * sc[None, :]).max() <= 1e-13
    sc = 1.0 / np.sqrt(np.diag(G))
    Gs = G * sc[:, None] * sc[None, :]
    rhs = np.random.default_rng(6).standard_normal((150, 3))
    for got, ref in ((f.solve(rhs), np.linalg.solve(Gs, rhs)), (f.solve(rhs[:, 0]), np.linalg.solve(Gs, rhs[:, 0])),
                     (f.gram_solve(rhs), np.linalg.solve(G, rhs))):
        assert got.shape == ref.shape and np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()
    w = np.linalg.eigvalsh(Gs)
    # (a few inverse and power steps: the intervals hold the truth, the estimates are within them and close)
    assert f.w_interval[0] <= w[0] <= f.w_interval[1] and f.w_min == pytest.approx(w[0], rel=0.1)
    # (lambda_max from the one product of the Gershgorin pass: on this unstructured spectrum, random eigenvectors,
    # a lower bound within 2x; on Grams of data within 25 %, test_cholesky_certificate_against_dense_eigvalsh)
    assert f.w_max_interval[0] <= w[-1] <= f.w_max_interval[1] and w[-1] / 3 <= f.w_max <= w[-1] * (1 + 1e-12)


def test_largest_eigenvalues_against_eigvalsh():
    a = _spd(300, seed=3, cond=1e4)
    s = np.random.default_rng(4).uniform(0.1, 10.0, 300)
    ests = largest_eigenvalues(lambda X: a @ X, 300, [None, s], block=8, rtol=1e-12)
    for e, ref in zip(ests, (np.linalg.eigvalsh(a)[-1], np.linalg.eigvalsh(s[:, None] * a * s[None, :])[-1])):
        assert e.converged and e.value == pytest.approx(ref, rel=1e-10)
        assert e.lower * (1 - 1e-12) <= ref <= e.upper * (1 + 1e-12)  # the interval holds the true value


@pytest.mark.parametrize("d", [8, 10])
def test_cholesky_certificate_against_dense_eigvalsh(d):
    D = make_mhla(d=d, heads=2, length=20, samples=60 if d == 8 else 90, causal=True, seed=d)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    G = st.gram()
    n = st.n_rows
    lam = np.linalg.eigvalsh(G / n)
    sc = 1.0 / np.sqrt(np.diag(G))
    w = np.linalg.eigvalsh(G * sc[:, None] * sc[None, :])
    c = certify(st, solver="cholesky")
    assert c.rank == st.psi and c.converged and c.eigenvalues is None
    assert c.proof is not None and c.verdict == "identifiable"  # proved by the shifted factorisation
    # lambda_max: a few power steps (a Ritz value, a lower bound) in an interval that holds the truth
    lo, hi = c.lambda_max_interval
    assert lo <= lam[-1] * (1 + 1e-12) and lam[-1] <= hi and c.lambda_max == pytest.approx(lam[-1], rel=0.25)
    # lambda_min: a few inverse-iteration steps (an upper bound, a digit or so), rigorous intervals around it
    assert c.lambda_min == pytest.approx(lam[0], rel=0.5)  # eigvalsh(G) resolves it to eps * lambda_max
    assert c.lambda_min_scaled == pytest.approx(w[0], rel=0.5) and c.lambda_min_scaled >= w[0] * (1 - 1e-12)
    lo, hi = c.lambda_min_scaled_interval
    assert c.proof["threshold"] <= lo <= w[0] <= hi and lo > 0
    ref = lambda_min_full_rank(scaled_spectrum(G)) / n  # relative accuracy (eigvalsh(G) only absolute)
    lo, hi = c.lambda_min_interval
    assert 0 < lo <= ref * (1 + 1e-10) and ref * (1 - 1e-10) <= hi <= ref * 1.5
    assert c.spectrum_scaled[-1] == pytest.approx(w[-1], rel=0.25)
    assert c.condition_number == pytest.approx(w[-1] / w[0], rel=0.6)
    f = cholesky_factor(G, default_rtol(st.psi), n)
    e = f.estimates
    assert e["lambda_max_scaled"].lower * (1 - 1e-12) <= w[-1] <= e["lambda_max_scaled"].upper * (1 + 1e-12)
    assert e["lambda_min_scaled_inverse"].lower * (1 - 1e-12) <= 1 / (w[0] - f.shift)  # a Ritz value of the inverse


def test_auto_falls_back_to_krylov_not_eigh_past_the_fallback_size(monkeypatch):
    """A Gram that is not positive definite on the Cholesky path: auto takes krylov past EIGH_FALLBACK_PSI (a
    full eigh would take hours at d = 32), an explicit solver="cholesky" still falls back to eigh."""
    import scaleattn.linalg._solver
    from scaleattn.linalg._solver import solve

    D = make_mhla(d=3, heads=1, length=6, samples=8, seed=1)  # 8 rows < psi = 18: rank deficient
    st = statistics_from_arrays(D["tokens"], D["targets"])
    ref = solve(st, solver="eigh")
    monkeypatch.setattr(scaleattn.linalg._solver, "EIGH_FALLBACK_PSI", 10)  # (one router for solve and certify)
    auto = solve(st, large_psi=10)
    assert auto.certificate.estimates["solver"] == "krylov" and auto.rank == ref.rank < st.psi
    assert np.abs(auto.coef - ref.coef).max() <= 1e-6 * np.abs(ref.coef).max()
    assert certify(st, large_psi=10).estimates["solver"] == "krylov"
    explicit = solve(st, solver="cholesky")
    assert explicit.certificate.estimates is None and np.allclose(explicit.coef, ref.coef, rtol=1e-10, atol=1e-12)


def _crowded_gram(n, bottom, seed=0):
    """``G = D A D``: ``A = Q diag(w) Q^T`` with the 300 smallest of ``w`` spread evenly over ``[bottom, 1.3
    bottom]`` (relative gaps 1e-3, as the scaled Grams of realizable data at d = 24, 32 have them), the rest
    log-spaced up to 1, and feature scales ``D`` spanning two decades (Jacobi scaling has work to do)."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    w = np.concatenate([bottom * np.linspace(1.0, 1.3, 300), np.geomspace(1.4 * bottom, 1.0, n - 300)])
    a = (q * w) @ q.T
    dsc = np.geomspace(0.1, 10.0, n)[rng.permutation(n)]
    g = dsc[:, None] * ((a + a.T) / 2) * dsc[None, :]
    return (g + g.T) / 2


@pytest.mark.parametrize("bottom", [pytest.param(1e-6, marks=pytest.mark.slow),
                                    pytest.param(30 * default_rtol(1200), marks=pytest.mark.slow),
                                    3 * default_rtol(1200)])
def test_cholesky_lambda_min_interval_against_eigvalsh_on_crowded_bottom(bottom):
    """psi = 1,200, the bottom eigenvalues crowded (relative gaps ~1e-3, as the scaled Grams of realizable data at
    d = 24, 32): the Cholesky path's lambda_min (scaled and unscaled) inside its reported interval, within EIG_RTOL
    of dense references where the inverse runs go to convergence (the unshifted path; on the proved path, capped at
    INVERSE_STEPS, lambda_min(G) to EIG_RTOL and the intervals' upper ends not vacuous), and the verdict the eigh
    path's (identifiable; near the cutoff: settled at a margin of ~30, "not settled" at ~3)."""
    from scaleattn.linalg._certificate import certificate_from_factor, certificate_from_spectrum
    from scaleattn.linalg._spectrum import lambda_min_full_rank, scaled_spectrum

    n, rows = 1200, 5000
    G = _crowded_gram(n, bottom)
    sc = 1.0 / np.sqrt(np.diag(G))
    w = np.linalg.eigvalsh(G * sc[:, None] * sc[None, :])
    assert (w[1] - w[0]) / w[0] < 1e-2 and w[99] / w[0] < 1.3  # crowded (Jacobi scaling spreads it a little)
    spec = scaled_spectrum(G)
    ref = certificate_from_spectrum(G, spec, rows)
    lam_min = lambda_min_full_rank(spec)  # lambda_min(G) from the scaled decomposition (DESIGN §4)
    f = cholesky_factor(G, default_rtol(n), rows)
    cert = certificate_from_factor(f, default_rtol(n), rows)
    assert cert.verdict == ref.verdict == ("not settled" if bottom < 10 * default_rtol(n) else "identifiable")
    e = f.estimates
    inv, ginv = e["lambda_min_scaled_inverse"], e["lambda_min_inverse"]
    # the scaled value: eigvalsh of the scaled Gram resolves it to ~psi eps absolute
    tol_w = EIG_RTOL + 1e3 * n * np.finfo(float).eps / w[0]
    if f.proof is None:  # the unshifted path (near the cutoff): the inverse runs go to EIG_RTOL
        assert inv.converged and ginv.converged and inv.iterations < EIG_MAXITER
        assert cert.lambda_min_scaled == pytest.approx(w[0], rel=tol_w)
        assert 1 / inv.upper * (1 - tol_w) <= w[0] <= 1 / inv.lower * (1 + tol_w)
        assert inv.lower <= inv.value < inv.upper and (inv.upper - inv.lower) / inv.value < 1e-2  # honest
    else:  # proved by the shifted factor: at most INVERSE_STEPS inverse steps, which on a crowded bottom need
        # not converge (the verdict needs none); what must hold are the rigorous intervals, and upper ends that
        # are not vacuous (lambda_min(Gs) to ~1e-3 here: the Ritz step on 14 steps' bases; lambda_min(G), which
        # the report prints, to EIG_RTOL below)
        assert inv.iterations <= INVERSE_STEPS and ginv.iterations <= INVERSE_STEPS
        lo, hi = f.w_interval
        assert lo <= w[0] * (1 + tol_w) and w[0] <= hi * (1 + tol_w)
        assert lo <= cert.lambda_min_scaled <= hi and (hi - w[0]) / w[0] < 0.5
        assert 1 / inv.lower * (1 + tol_w) >= w[0] - f.proof["shift"]  # a Ritz value: a bound with no convergence
        assert f.lam_interval[0] * (1 - 1e-9) <= lam_min / rows <= f.lam_interval[1] * (1 + 1e-9)
        assert (f.lam_interval[1] * rows - lam_min) / lam_min < 0.5  # (a Rayleigh quotient after 3 steps)
    # the unscaled one (what the report prints): against the scaled decomposition, and plain eigvalsh(G / N)
    assert cert.lambda_min * rows == pytest.approx(lam_min, rel=EIG_RTOL + 1e-9 if f.proof is None else 0.5)
    if f.proof is None:  # (on the proved path ginv is of G - shift D: its interval is lam_interval, above)
        assert 1 / ginv.upper * (1 - 1e-9) <= lam_min <= 1 / ginv.lower * (1 + 1e-9)
    lam = np.linalg.eigvalsh(G / rows)
    assert cert.lambda_min == pytest.approx(lam[0], rel=1e3 * n * np.finfo(float).eps * lam[-1] / lam[0]
                                            + (1e-6 if f.proof is None else 0.5))
    if f.proof is None:
        assert cert.lambda_max == pytest.approx(lam[-1], rel=EIG_RTOL)
    else:  # a few power steps: the interval holds it
        lo, hi = cert.lambda_max_interval
        assert lo <= lam[-1] * (1 + 1e-12) and lam[-1] <= hi and lo <= cert.lambda_max <= hi
