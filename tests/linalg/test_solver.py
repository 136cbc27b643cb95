"""The solve (DESIGN §4): numerical edge cases, each against an independent dense computation; the large-psi
path (Cholesky + Lanczos) against the eigh path; ridge against its dense solution.

For the edge cases the reference is always built here from the definition (phi = vech(Z^T Z) (x) x, DESIGN §2)
and solved with numpy/scipy on the dense (rows, psi) matrix -- never through scaleattn.features or the Gram -- so
the check does not share code (or the squared condition number of the normal equations) with the solver.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from scaleattn.features import phi, token_features
from scaleattn.generate import make_mhla
from scaleattn.linalg import _solver as solver
from scaleattn.linalg._solver import certify, solve
from scaleattn.linalg._spectrum import default_rtol
from scaleattn.statistics._container import statistics_from_arrays


def dense_phi(tokens, causal=False):
    """(rows, psi) cubic features straight from the definition, P-major, j <= k row-major."""
    n, T, d = tokens.shape
    I, J = np.triu_indices(d)
    if causal:
        S = np.cumsum(np.einsum("ntj,ntk->ntjk", tokens, tokens), axis=1).reshape(n * T, d, d)
        x = tokens.reshape(n * T, d)
    else:
        S = np.einsum("ntj,ntk->njk", tokens, tokens)
        x = tokens[:, -1]
    return np.einsum("rp,rl->rpl", S[:, I, J], x).reshape(len(x), -1)


def col_scaled_lstsq(P, y, drop=0):
    """Least squares on column-normalised P by SVD (min-norm; ``drop`` smallest singular values removed)."""
    norms = np.linalg.norm(P, axis=0)
    s_ = np.where(norms > 0, 1 / np.where(norms > 0, norms, 1), 0.0)
    U, s, Vt = np.linalg.svd(P * s_, full_matrices=False)
    k = len(s) - drop
    return s_[:, None] * (Vt[:k].T @ ((U[:, :k].T @ y) / s[:k, None]))


@pytest.mark.parametrize("kind", ["plane", "zero-coordinate", "line"])
def test_rank_deficient_min_norm(rel_err, kind):
    """Exactly rank-deficient features: the min-norm least-squares answer (pinv), the true rank, no blow-up."""
    rng = np.random.default_rng(0)
    tok = rng.standard_normal((400, 5, 3))
    if kind == "plane":  # tokens span a plane: psi = 18, rank 3 * 2 = 6
        tok[..., 2] = tok[..., 0] - 2 * tok[..., 1]
    elif kind == "zero-coordinate":  # an all-zero coordinate: zero features (diag G = 0)
        tok[..., 1] = 0.0
    else:  # tokens on a line: rank 1
        tok = rng.standard_normal((400, 5, 1)) * np.array([1.0, -2.0, 0.5])
    y = rng.standard_normal((400, 2))  # not realizable: the residual is non-zero
    P = dense_phi(tok)
    c_ref = np.linalg.pinv(P, rcond=1e-10) @ y
    rank_ref = np.linalg.matrix_rank(P)
    sol = solve(statistics_from_arrays(tok, y))
    assert rank_ref < 18
    assert sol.rank == rank_ref and sol.certificate.ambiguous_dim == 18 - rank_ref
    assert not sol.certificate.identifiable
    assert np.all(np.isfinite(sol.coef))
    assert rel_err(sol.coef, c_ref) < 1e-10
    # min-norm: no component in null(Phi) (basis from the dense SVD), and the same residual as lstsq
    _, _, Vt = np.linalg.svd(P)
    null = Vt[rank_ref:].T
    assert np.linalg.norm(null.T @ sol.coef) < 1e-10 * np.linalg.norm(sol.coef)
    res_ref = scipy.linalg.lstsq(P, y)[1].sum() if rank_ref == P.shape[1] else np.sum((P @ c_ref - y) ** 2)
    assert sol.sse == pytest.approx(res_ref, rel=1e-9)
    # the reported null basis spans the same space
    nb = sol.null_basis
    assert nb.shape == (18, 18 - rank_ref)
    assert np.linalg.norm(P @ nb) < 1e-8 * np.linalg.norm(P)


def test_all_zero_tokens():
    """All-zero data: rank 0, coefficients exactly 0, finite certificate fields."""
    tok = np.zeros((20, 4, 2))
    y = np.random.default_rng(0).standard_normal((20, 2))
    sol = solve(statistics_from_arrays(tok, y))
    assert sol.rank == 0 and np.array_equal(sol.coef, np.zeros((6, 2)))
    assert sol.certificate.lambda_max == 0 and sol.sse == pytest.approx(np.sum(y**2))


@pytest.mark.parametrize("causal", [False, True])
def test_constant_coordinate(rel_err, causal):
    """A constant token coordinate (a 'bias' feature): full rank here; matches lstsq on the dense features."""
    rng = np.random.default_rng(1)
    tok = rng.standard_normal((300, 5, 3))
    tok[..., 1] = 1.0
    y = rng.standard_normal((300, 5, 2) if causal else (300, 2))
    P, Y = dense_phi(tok, causal), y.reshape(-1, 2)
    c_ref = scipy.linalg.lstsq(P, Y)[0]
    sol = solve(statistics_from_arrays(tok, y))
    assert sol.rank == np.linalg.matrix_rank(P) == 18
    assert rel_err(sol.coef, c_ref) < 1e-10


def test_badly_scaled_coordinates():
    """Coordinates at 1e-6, 1 and 1e6 (features from 1e-18 to 1e18): Jacobi scaling keeps every real direction
    and recovers every coefficient; plain lstsq on the raw features loses most of them."""
    rng = np.random.default_rng(2)
    d = 3
    scales = np.array([1e-6, 1.0, 1e6])
    I, J = np.triu_indices(d)
    fscale = (scales[I][:, None] * scales[J][:, None] * scales[None, :]).ravel()  # scale of each feature
    tok0 = rng.standard_normal((2000, 4, d))
    c0 = rng.standard_normal((18, 2))
    y = dense_phi(tok0) @ c0
    tok, c_true = tok0 * scales, c0 / fscale[:, None]  # the same data in badly scaled coordinates
    sol = solve(statistics_from_arrays(tok, y))
    assert sol.rank == 18 and sol.certificate.identifiable
    assert np.max(np.abs(sol.coef - c_true) / np.abs(c_true)) < 1e-9  # every coefficient, down to 1e-18 scale
    P = dense_phi(tok)
    assert np.max(np.abs(col_scaled_lstsq(P, y) - c_true) / np.abs(c_true)) < 1e-9  # the reference agrees
    assert np.linalg.matrix_rank(P) < 18  # ...and unscaled rank decisions would drop real directions


def test_badly_scaled_lambda_min():
    """The certificate's lambda_min(Lambda_D) of badly scaled full-rank data (~1e-35 next to lambda_max ~1e37)
    is the true one (80-digit eigenvalues of the same Gram with mpmath), not eigvalsh's round-off (0)."""
    mpmath = pytest.importorskip("mpmath")
    rng = np.random.default_rng(2)
    tok = rng.standard_normal((2000, 4, 3)) * np.array([1e-6, 1.0, 1e6])
    y = rng.standard_normal((2000, 2))
    cert = solve(statistics_from_arrays(tok, y)).certificate
    P = dense_phi(tok)
    G = P.T @ P / len(P)  # entrywise accurate in float64 (every term of an entry has the same scale)
    with mpmath.workdps(80):
        ref = float(min(mpmath.eigsy(mpmath.matrix(G.tolist()), eigvals_only=True)))
    assert cert.identifiable and 1e-36 < ref < 1e-34
    assert cert.lambda_min == pytest.approx(ref, rel=1e-10)
    assert abs(np.linalg.eigvalsh(G)[0] - ref) > 1e6 * ref  # plain eigvalsh cannot see it


def _near_collinear(n, eps, seed):
    rng = np.random.default_rng(seed)
    tok = rng.standard_normal((n, 3, 2))
    tok[..., 1] = tok[..., 0] + eps * rng.standard_normal((n, 3))
    return tok, rng


@pytest.mark.slow
def test_cutoff_does_not_grow_with_n(rel_mse):
    """10^6 rows with a real direction whose Jacobi-scaled eigenvalue is ~6e-12 x lambda_max: far above the
    round-off cutoff 16 psi eps, below an N-growing cutoff like N * eps (2e-10). It must be kept: the fit is
    exact, while dropping it (the reference SVD truncated by one) leaves an error 8 orders of magnitude larger."""
    n = 10**6
    tok, rng = _near_collinear(n, 0.03, 1)
    c_true = rng.standard_normal((6, 1))
    P = dense_phi(tok)
    y = P @ c_true
    sol = solve(statistics_from_arrays(tok, y))
    w = sol.certificate.spectrum_scaled
    assert sol.certificate.cutoff_rtol == default_rtol(6)  # the same cutoff at any N
    assert default_rtol(6) < w[0] / w[-1] < n * np.finfo(float).eps
    assert sol.rank == 6 and sol.certificate.identifiable
    mse, mse_dropped = rel_mse(P @ sol.coef, y), rel_mse(P @ col_scaled_lstsq(P, y, drop=1), y)
    assert mse < 1e-17 and mse_dropped > 1e-13 and mse < 1e-4 * mse_dropped
    # the smallest scaled eigenvalue is the reference's smallest squared singular value
    s = np.linalg.svd(P / np.linalg.norm(P, axis=0), compute_uv=False)
    assert w[0] == pytest.approx(s[-1] ** 2, rel=1e-3)


def test_near_singular_full_rank(rel_err):
    """Near-singular (condition ~1e8 after scaling) but full rank, noisy targets: the lstsq answer."""
    tok, rng = _near_collinear(20000, 0.2, 3)
    y = dense_phi(tok) @ rng.standard_normal((6, 2)) + 1e-3 * rng.standard_normal((20000, 2))
    P = dense_phi(tok)
    c_ref = col_scaled_lstsq(P, y)
    sol = solve(statistics_from_arrays(tok, y))
    cond = sol.certificate.condition_number
    assert 1e5 < cond < 1e12 and sol.rank == 6
    assert rel_err(sol.coef, c_ref) < cond * 1e-14
    # the statistics' SSE formula has a round-off floor ~ eps * sum(y^2) (Statistics.sse)
    assert sol.sse == pytest.approx(np.sum((P @ c_ref - y) ** 2), abs=1e-12 * np.sum(y**2))


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_large_psi_path_agrees_with_eigh_path(noisy_causal_arrays, ridge):
    D = noisy_causal_arrays
    st = statistics_from_arrays(D["tokens"], D["targets"])
    a = solver.solve(st, ridge=ridge)  # psi = 40: eigh
    b = solver.solve(st, ridge=ridge, large_psi=10)  # forced: Cholesky + Lanczos
    assert a.certificate.eigenvalues is not None and b.certificate.eigenvalues is None
    assert np.abs(b.coef - a.coef).max() <= 1e-10 * np.abs(a.coef).max()
    ca, cb = a.certificate, b.certificate
    assert cb.identifiable and cb.rank == ca.rank == st.psi
    # the Cholesky path's extreme eigenvalues come from a few steps (the proof needs none): its intervals hold the
    # eigh path's values, with the point estimates inside them and upper ends not vacuous
    for c in (cb, certify(st, solver="cholesky")):
        for k, iv, close in (("lambda_min", "lambda_min_interval", 0.3), ("lambda_min_scaled",
                             "lambda_min_scaled_interval", 0.3), ("lambda_max", "lambda_max_interval", 0.3)):
            lo, hi = getattr(c, iv)
            truth = getattr(ca, k)
            assert lo <= truth * (1 + 1e-12) and truth <= hi * (1 + 1e-12) and lo <= getattr(c, k) <= hi, k
            assert getattr(c, k) == pytest.approx(truth, rel=close), k
        assert c.proof is not None and c.verdict == "identifiable"
    assert b.sse == pytest.approx(a.sse, rel=1e-9)
    assert b.effective_dof == pytest.approx(a.effective_dof, rel=1e-10)


def test_large_psi_path_falls_back_to_eigh_when_not_identifiable():
    D = make_mhla(d=3, heads=1, length=6, samples=8, seed=1)  # 8 rows < psi = 18: rank deficient
    st = statistics_from_arrays(D["tokens"], D["targets"])
    a, b = solver.solve(st), solver.solve(st, solver="cholesky")
    assert b.rank == a.rank < st.psi and b.null_basis.shape[1] == st.psi - a.rank
    assert np.allclose(b.coef, a.coef, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="solver must be one of"):
        solver.solve(st, solver="qr")
    with pytest.raises(TypeError, match="method"):  # no aliases of the unreleased API
        solver.solve(st, method="cholesky")


def test_ridge_against_dense_solution(rel_err):
    D = make_mhla(d=3, heads=1, length=10, samples=80, noise=0.3, seed=2)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    s, x = token_features(D["tokens"])
    F = phi(s, x)
    A = F.T @ F
    for lam in (1e-3, 0.1):
        sol = solve(st, ridge=lam)
        M = A + lam * np.diag(np.diag(A))
        c = np.linalg.solve(M, F.T @ D["targets"])
        assert rel_err(sol.coef, c) <= 1e-8
        hat = F @ np.linalg.solve(M, F.T)  # effective dof = trace of the hat matrix
        assert sol.effective_dof == pytest.approx(np.trace(hat), rel=1e-8)
        assert sol.ridge == lam
    base = solve(st)
    assert base.effective_dof == base.rank and base.ridge == 0.0
    assert solve(st, ridge=0.1).sse > base.sse  # ridge trades training loss for a smaller model
    with pytest.raises(ValueError, match="ridge"):
        solve(st, ridge=-1.0)


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_cholesky_in_place_is_the_copy_path(ridge, monkeypatch):
    """The Cholesky path factors ``G`` in its own memory when it expands it (no ``gram``, or the operator of
    ``shared_gram`` past DENSE_GRAM_MAX_PSI) and takes the products after the factor (refinement, SSE, heads)
    from ``Tc``: the same certificate bits and coefficients to round-off as on a caller's dense ``G``, which
    is left unmodified."""
    import scaleattn.linalg._gram
    from scaleattn.linalg._gram import GramOperator
    from scaleattn.linalg._spectrum import cholesky_factor
    from scaleattn.model import model_from_statistics

    D = make_mhla(d=4, heads=2, length=20, samples=60, causal=True, noise=0.1, seed=4)
    st = statistics_from_arrays(D["tokens"], D["targets"])  # psi = 40
    G = st.gram()
    G0 = G.copy()
    a = solve(st, solver="cholesky", ridge=ridge, gram=G)
    assert np.array_equal(G, G0)  # the caller's G: the factor is a copy
    ref = solve(st, solver="eigh", ridge=ridge)
    monkeypatch.setattr(scaleattn.linalg._gram, "DENSE_GRAM_MAX_PSI", 10)  # shared_gram: the operator from here
    op = solver.shared_gram(st, "cholesky")
    assert isinstance(op, GramOperator) and isinstance(solver.shared_gram(st, "eigh"), np.ndarray)
    for b in (solve(st, solver="cholesky", ridge=ridge), solve(st, solver="cholesky", ridge=ridge, gram=op)):
        ca, cb = a.certificate, b.certificate
        for k in ("lambda_min", "lambda_max", "lambda_min_scaled", "condition_number", "verdict"):
            assert getattr(cb, k) == getattr(ca, k), k  # the same eigenvalue runs, on the same numbers
        assert np.abs(b.coef - a.coef).max() <= 1e-12 * np.abs(a.coef).max()
        assert np.abs(b.coef - ref.coef).max() <= 1e-10 * np.abs(ref.coef).max()  # and the eigh path's
        assert b.sse == pytest.approx(a.sse, rel=1e-9) and b.effective_dof == pytest.approx(a.effective_dof)
    model, sol, h = model_from_statistics(st, causal=True, ridge=ridge, solver="cholesky")  # heads: G @ c on Tc
    assert np.abs(sol.coef - a.coef).max() <= 1e-12 * np.abs(a.coef).max() and h.residual < 1e-6
    f = cholesky_factor(G, default_rtol(st.psi), st.n_rows, overwrite_g=True, gram=op)
    assert np.shares_memory(f.L, G) and f.G is op  # G's memory became L
    with pytest.raises(ValueError, match="needs gram="):
        cholesky_factor(G0, default_rtol(st.psi), st.n_rows, overwrite_g=True)


_CLIENT_SOLVE = r"""
import sys
import numpy as np
from scaleattn.generate import make_mhla
from scaleattn.linalg._solver import solve
from scaleattn.statistics._container import Statistics, accumulate
from scaleattn.model import model_from_statistics

D = make_mhla(d=2, heads=1, length=10, samples=64, seed=0)  # built without numba, as a fit's client gets them
stats = accumulate(Statistics.zeros(2, 2), D["tokens"], D["targets"], None, False, kernel="numpy")
sol = solve(stats)
model_from_statistics(stats, False, "svd")
print("numba" in sys.modules, sol.certificate.identifiable)
"""


def test_a_small_solve_does_not_load_the_compiled_kernels():
    """A fit's client solves statistics its workers built: at small psi the solve and the heads take numpy's
    expansion, so that process never loads numba for it (0.55 s: a psi-6 fit's solve took 1 s on a cluster and
    0.00 s in process)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CLIENT_SOLVE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"], out


def _outlier_data(magnitude):
    """A causal MHLA teacher on d = 2 with one token ``magnitude`` times the rest (sample 10, position 0)."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 20, 2))
    V, Q = rng.standard_normal((2, 2)), rng.standard_normal((2, 2))
    S = np.cumsum(np.einsum("ntd,nte->ntde", X, X), axis=1) / 20
    Y = np.einsum("od,ntde,ef,ntf->nto", V, S, Q, X)
    X[10, 0, 0] = magnitude
    return X, Y


@pytest.mark.parametrize("magnitude", [1e10, 1e20, 1e30])
@pytest.mark.parametrize("path", ["gram", "qr"])
def test_one_outlying_token_gives_a_least_squares_fit_not_garbage(magnitude, path):
    """Feature scales 1e60 apart: a direction null in the Jacobi-scaled Gram was not null for the data in the
    original coordinates, and removing it for min-norm moved the SSE from 7.6e3 to 1.4e40 (worse than predicting
    zero, reported as a normal fit). The fit's SSE is now at most the zero model's and equals the column-scaled
    SVD reference's at the rank the solve chose, measured on the dense features (not from the statistics)."""
    from scaleattn.linalg._qr import factor_from_arrays, solve_from_r

    X, Y = _outlier_data(magnitude)
    P, y = dense_phi(X, causal=True), Y.reshape(-1, 2)
    sol = solve(statistics_from_arrays(X, Y)) if path == "gram" else solve_from_r(factor_from_arrays(X, Y))
    sse = float(np.sum((P @ sol.coef - y) ** 2))
    assert sse <= float(np.sum(y * y))
    ref = col_scaled_lstsq(P, y, drop=P.shape[1] - sol.certificate.rank)
    assert sse == pytest.approx(float(np.sum((P @ ref - y) ** 2)), rel=1e-6)


def test_a_fit_worse_than_predicting_zero_is_refused(monkeypatch):
    """The guard behind every path: had the min-norm step still projected along a direction that is not null for
    the data (the old behaviour, forced here), the solve is refused with one line instead of returned."""
    from scaleattn.errors import DatasetError

    def always(c, null, *_):
        return c - null @ (null.T @ c)
    monkeypatch.setattr(solver, "min_norm", always)
    X, Y = _outlier_data(1e10)
    with pytest.raises(DatasetError, match="lost its accuracy.*exceeds that of predicting zero"):
        solve(statistics_from_arrays(X, Y))
    solver.check_no_worse_than_zero(10.0, 10.0, 0.0)  # equal: a fit that explains nothing is still a fit
    with pytest.raises(DatasetError):
        solver.check_no_worse_than_zero(10.0 + 1.0, 10.0, 1e-3)


@pytest.mark.parametrize("path", ["eigh", "krylov"])
def test_a_loose_cutoff_gives_the_truncated_fit_not_one_worse_than_zero(path):
    """cutoff_rtol = 1e-3 drops directions the data determine; removing them again in the original coordinates
    (the min-norm step) gave an SSE of 2.7e3 against the zero model's 1.9e3, on both paths. The fit is now the
    truncated column-scaled SVD's of the dense features at the same rank."""
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((2000, 6, 5))
    Z[..., 0] *= 3e-2
    Z[..., 1] = Z[..., 2] + 1e-3 * Z[..., 1]  # badly conditioned, full rank
    y = rng.standard_normal((2000, 1))
    sol = solve(statistics_from_arrays(Z, y), 1e-3, solver=path)
    P = dense_phi(Z)
    assert sol.certificate.rank < P.shape[1]
    sse = float(np.sum((P @ sol.coef - y) ** 2))
    ref = col_scaled_lstsq(P, y, drop=P.shape[1] - sol.certificate.rank)
    assert sse <= float(np.sum(y * y))
    assert sse == pytest.approx(float(np.sum((P @ ref - y) ** 2)), rel=1e-6)


def _ill_conditioned(case):
    """Data on which the min-norm step used to move the fit: nearly collinear coordinates with a tiny third one,
    one moderate outlier (x1e3, causal), nearly collinear coordinates alone."""
    if case == "collinear-tiny":
        rng = np.random.default_rng(0)
        t = rng.standard_normal((50, 4, 3))
        t[..., 1] = t[..., 0] + 1e-5 * rng.standard_normal((50, 4))
        t[..., 2] *= 1e-6
        return t, rng.standard_normal((50, 2)), False
    if case == "outlier-1e3":
        rng = np.random.default_rng(31)
        t = rng.standard_normal((30, 4, 4))
        t[3, 1] *= 1e3
        return t, rng.standard_normal((30, 4, 2)), True
    rng = np.random.default_rng(22)
    t = rng.standard_normal((30, 4, 3))
    t[..., 1] = t[..., 0] + 1e-6 * rng.standard_normal((30, 4))
    return t, rng.standard_normal((30, 2)), False


@pytest.mark.parametrize("case", ["collinear-tiny", "outlier-1e3", "collinear"])
@pytest.mark.parametrize("path", ["eigh", "cholesky", "krylov", "qr"])
def test_ill_conditioned_fits_are_the_truncated_least_squares_fit(case, path):
    """Every path's fit, measured on the dense features, is the column-scaled SVD's at the rank it reports (up to
    round-off of that rank's fit): the min-norm step had made them 2.4e4 / 8.3e8 (sum y^2 53), 284 (zero model
    267) and 9.7 % worse than the reference, with reported SSEs down to -1.8e10."""
    from scaleattn.linalg._qr import factor_from_arrays, solve_from_r

    t, y, causal = _ill_conditioned(case)
    P, Y = dense_phi(t, causal), y.reshape(-1, y.shape[-1])
    if path == "qr":
        sol = solve_from_r(factor_from_arrays(t, y))
    else:
        sol = solve(statistics_from_arrays(t, y), solver=path)
    sse = float(np.sum((P @ sol.coef - Y) ** 2))
    ref = col_scaled_lstsq(P, Y, drop=P.shape[1] - sol.certificate.rank)
    assert sse <= float(np.sum(Y * Y))
    assert sse == pytest.approx(float(np.sum((P @ ref - Y) ** 2)), rel=1e-3)
    assert sol.sse == pytest.approx(sse, rel=1e-3)


def test_a_head_fit_worse_than_predicting_zero_is_refused_not_kept():
    """heads=1 on data with a x1e4 outlier: the head search returned a model with training SSE 7.9e6 against
    the zero model's 386 (its statistics SSE -1.8e8). The estimator measures its training error on the arrays and
    refuses such a fit, keeping no model."""
    import scaleattn
    from scaleattn.errors import DatasetError, NotFittedError

    rng = np.random.default_rng(25)
    t = rng.standard_normal((40, 5, 2))
    t[3, 1] *= 1e4
    y = rng.standard_normal((40, 5, 2))
    est = scaleattn.MHLARegressor(heads=1)
    try:
        est.fit(t, y)
    except DatasetError as e:
        assert "head search's 1-head model fits worse than predicting zero" in str(e)
        with pytest.raises(NotFittedError):
            est.predict(t)
    else:  # a search that found a fit no worse than zero is a fit
        assert float(np.sum((est.predict(t) - y) ** 2)) <= float(np.sum(y * y))


def test_the_head_search_result_is_checked_from_the_statistics_too():
    """heads=1 on noise targets with a x1e4 token: the search's model had SSE 731 against the zero model's 597 by
    the statistics (round-off 2.8); without a data pass (exact_mse=False) it was returned. Now
    model_from_statistics refuses it, naming the head search; a NaN SSE is refused too."""
    from scaleattn.errors import DatasetError
    from scaleattn.model import model_from_statistics

    data = make_mhla(d=2, heads=2, length=6, samples=300, seed=2)
    tok = data["tokens"].copy()
    tok[7, 2] *= 1e4
    y = np.random.default_rng(0).standard_normal(data["targets"].shape)
    st = statistics_from_arrays(tok, y)
    try:
        model, _, _ = model_from_statistics(st, heads=1)
    except DatasetError as e:
        assert "head search's 1-head model fits worse than predicting zero" in str(e)
    else:
        P = dense_phi(tok)
        assert float(np.sum((P @ model.coef - y) ** 2)) <= st.yy
    with pytest.raises(DatasetError):
        solver.check_no_worse_than_zero(float("nan"), 1.0, 0.0)


def test_the_estimator_measures_on_the_data_only_where_the_statistics_cannot_tell(monkeypatch):
    """Well-conditioned data: the training error comes from the statistics (no prediction pass, which tripled the
    fit's time and memory); the outlier data of the tests above: measured on the arrays."""
    import scaleattn
    from scaleattn import estimator

    calls = []
    real = estimator.residual_sums
    monkeypatch.setattr(estimator, "residual_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    data = make_mhla(d=2, heads=1, length=10, samples=200, causal=True, seed=0)
    scaleattn.MHLARegressor().fit(data["tokens"], data["targets"])
    assert calls == []
    X, Y = _outlier_data(1e10)
    est = scaleattn.MHLARegressor().fit(X, Y)
    assert calls and float(np.sum((est.predict(X) - Y) ** 2)) <= float(np.sum(Y * Y))


def test_a_fit_without_its_data_pass_still_measures_where_the_statistics_cannot_tell(tmp_path):
    """Nearly collinear O(1) tokens, noise targets, heads=1, exact_mse=False: the statistics' round-off was 100x
    mean y^2, the report said train MSE 0 for a model worse than predicting zero (1.02 on the data). The pass now
    runs where the statistics cannot tell, and the refusal names the head search."""
    import scaleattn
    from scaleattn.data._writer import write_dataset
    from scaleattn.errors import DatasetError

    rng = np.random.default_rng(0)
    Z = rng.normal(size=(500, 4, 1)) + 1e-3 * rng.normal(size=(500, 4, 3))
    y = rng.normal(size=(500, 1))
    ds = write_dataset(str(tmp_path / "d.zarr"), Z, y)
    try:
        r = scaleattn.fit(ds, str(tmp_path / "run"), heads=1, exact_mse=False, plots=False)
    except DatasetError as e:
        assert "head search's 1-head model fits worse than predicting zero" in str(e)
        assert not (tmp_path / "run").exists()
    else:
        P = dense_phi(Z)
        sse = float(np.sum((P @ r.model.coef - y) ** 2))
        assert sse <= float(np.sum(y * y))
        assert r.report["train_mse"] == pytest.approx(sse / y.size, rel=1e-9)
