"""The matrix-free Gram operator and the krylov solver (issue 15), each against an independent dense computation:
the expanded Gram ``Statistics.gram()``, ``phi^T phi`` from the definition, ``numpy.linalg.eigvalsh``, and
min-norm least squares (pinv / SVD) on the dense features ``phi``."""
from __future__ import annotations

import numpy as np
import pytest

from scaleattn._backend import have_cupy
from scaleattn.distributed.memory import check_fit_memory, fit_memory
from scaleattn.distributed.partition import tile_bounds
from scaleattn.errors import InsufficientMemoryError
from scaleattn.features import n_features, phi, token_features
from scaleattn.generate import generate_mhla, make_assoc, make_mhla
from scaleattn.linalg import _solver as solver
from scaleattn.linalg._gram import (
    BlockJacobi,
    GramOperator,
    tile_diagonal,
    tile_matmat,
    tile_segments,
    tile_token_columns,
)
from scaleattn.linalg._krylov import lockstep
from scaleattn.linalg._solver import certify
from scaleattn.linalg._spectrum import default_rtol, solver_path
from scaleattn.statistics._container import Statistics, statistics_from_arrays


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _data(d, causal, variable, samples=40, length=9, seed=0):
    D = make_mhla(d=d, heads=2, length=length, samples=samples, causal=causal, variable_lengths=variable, seed=seed)
    return D, statistics_from_arrays(D["tokens"], D["targets"], D["lengths"], causal)


# ---- part 1: the operator ---------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [4, 8, pytest.param(16, marks=pytest.mark.slow)])  # d = 16: 2 s each
@pytest.mark.parametrize("causal,variable", [(True, True), (False, True), (True, False)])
def test_operator_matches_dense_product(d, causal, variable):
    D, st = _data(d, causal, variable, samples=12 if d == 16 else 40)
    G = st.gram()
    X = np.random.default_rng(1).standard_normal((st.psi, 3))
    ref = G @ X
    op = GramOperator.from_compact(st.gram_compact, d)
    assert rel(op @ X, ref) <= 1e-13
    assert rel(op @ X[:, 0], ref[:, 0]) <= 1e-13  # one vector
    # partials of any tiling add up to G X (phase B sums one partial per worker)
    for rows in (1, 7, 1000):
        tiles = tile_bounds(d, tile_rows=rows)
        part = sum(tile_matmat(st.gram_compact[a:b], a, d, X) for a, b in tiles)
        assert rel(part, ref) <= 1e-13
        if rows == 7:  # any subset of tiles: its partial is that subset's rows of Tc expanded
            Tsub = np.zeros_like(st.gram_compact)
            for a, b in tiles[::3]:
                Tsub[a:b] = st.gram_compact[a:b]
            sub = sum(tile_matmat(st.gram_compact[a:b], a, d, X) for a, b in tiles[::3])
            assert rel(sub, Statistics(Tsub, st.moments, 0.0, 1, d).gram() @ X) <= 1e-13
    assert rel(GramOperator.from_compact(st.gram_compact, d, tile_rows=5, threads=2) @ X, ref) <= 1e-13
    # independent of the compact form: phi^T (phi X) from the definition of the features
    s, x = token_features(D["tokens"], D["lengths"], causal)
    P = phi(s, x)
    assert rel(op @ X, P.T @ (P @ X)) <= 1e-11
    # diagonal and the token blocks, from any tiling
    assert rel(op.diagonal(), np.diag(G)) <= 1e-15
    tiles = tile_bounds(d, tile_rows=11)
    diag = sum(tile_diagonal(st.gram_compact[a:b], a, d) for a, b in tiles)
    assert np.array_equal(diag, op.diagonal())
    cols = np.concatenate([tile_token_columns(st.gram_compact[a:b], a, d) for a, b in tiles])
    m = d * (d + 1) // 2
    G4 = G.reshape(m, d, m, d)
    I, J = np.triu_indices(m)
    for l in (0, d - 1):
        assert np.array_equal(cols[:, l], G4[I, l, J, l])


def test_operator_rejects_bad_tiles():
    st = _data(3, True, False)[1]
    with pytest.raises(ValueError, match="partition"):
        GramOperator(3, [(0, st.gram_compact[:10]), (12, st.gram_compact[12:])])
    with pytest.raises(ValueError, match="cover"):
        GramOperator(3, [(0, st.gram_compact[:10])])
    with pytest.raises(ValueError, match="shape"):
        tile_matmat(st.gram_compact[:, :3], 0, 3, np.ones((18, 1)))
    with pytest.raises(ValueError, match="inside"):
        tile_segments(3, 0, 10**6)
    with pytest.raises(ValueError, match="psi"):
        GramOperator.from_compact(st.gram_compact, 3) @ np.ones((17, 1))


def test_block_jacobi_is_the_inverse_of_the_token_blocks():
    d = 4
    st = _data(d, True, True)[1]
    G = st.gram()
    op = GramOperator.from_compact(st.gram_compact, d)
    M = BlockJacobi(op.token_columns(), op.diagonal(), d, ridge=0.0)
    psi, m = st.psi, 10
    Mb = np.zeros_like(G)
    for l in range(d):
        idx = np.arange(m) * d + l
        Mb[np.ix_(idx, idx)] = G[np.ix_(idx, idx)]
    R = np.random.default_rng(0).standard_normal((psi, 2))
    assert rel(M.apply(R), np.linalg.solve(Mb, R)) <= 1e-8
    # a zero token coordinate: its features are exactly null, the preconditioner is zero there
    tok = np.random.default_rng(1).standard_normal((50, 6, d))
    tok[..., 2] = 0.0
    st0 = statistics_from_arrays(tok)
    op0 = GramOperator.from_compact(st0.gram_compact, d)
    M0 = BlockJacobi(op0.token_columns(), op0.diagonal(), d)
    dead = np.diag(st0.gram()) == 0
    assert dead.any() and np.all(M0.apply(np.ones((psi, 1)))[dead] == 0)


def test_lockstep_shares_one_pass_per_round():
    st = _data(4, True, False)[1]
    op = GramOperator.from_compact(st.gram_compact, 4)

    def power(k, n):
        v = np.ones((op.psi, k))
        for _ in range(n):
            v = yield v
        return v

    out = lockstep(op.matmat, {"a": power(1, 3), "b": power(2, 5)})
    G = st.gram()
    assert op.passes == 5 and op.products == 3 * 3 + 2 * 2
    assert rel(out["a"][:, 0], np.linalg.matrix_power(G, 3) @ np.ones(op.psi)) <= 1e-12


# ---- parts 2 and 3: solve and certificate ------------------------------------------------------------------
def _dense_spectra(st):
    G = st.gram()
    dg = np.diag(G)
    s = np.where(dg > 0, 1 / np.sqrt(np.where(dg > 0, dg, 1)), 0)
    return np.linalg.eigvalsh(G * s[:, None] * s[None, :]), np.linalg.eigvalsh(G / st.n_rows)


@pytest.mark.parametrize("d,samples", [pytest.param(8, 100, marks=pytest.mark.slow),
                                       pytest.param(16, 60, marks=pytest.mark.slow)])
def test_krylov_fit_realizable_matches_dense(tmp_path, d, samples):
    """DESIGN §9 setup (V, Q ~ N(0,1)/sqrt(d), Z ~ N(0,1)/sqrt(T), T = 100, all prefixes): the krylov fit has the
    dense path's coefficients to 1e-8, an exact training MSE (data pass) <= 1e-20 relative, and a certificate
    whose eigenvalues match dense eigvalsh to the accuracy it reports."""
    from scaleattn.pipeline import fit

    ds = generate_mhla(tmp_path / "d.zarr", d=d, heads=2, length=100, samples=samples, causal=True, seed=0)
    res_k = fit(ds, solver="krylov", plots=False)
    res_d = fit(ds, solver="eigh" if d == 8 else "cholesky", plots=False)
    assert rel(res_k.solution.coef, res_d.solution.coef) <= 1e-8
    rk = res_k.report
    assert rk["relative_train_mse"] <= 1e-20 and rk["identifiable"] and rk["rank"] == n_features(d)
    assert rk["certificate_converged"] and rk["estimates"]["solver"] == "krylov"
    assert max(rk["estimates"]["backward_error"]) <= default_rtol(n_features(d)) / 16
    w, lam = _dense_spectra(res_k.statistics)
    c = res_k.certificate
    assert c.lambda_max == pytest.approx(lam[-1], rel=1e-10)
    # default budget (the solve's passes): every reported interval holds the true value
    for key, true in (("lambda_min_scaled", w[0]), ("lambda_max_scaled", w[-1]), ("lambda_min", lam[0]),
                      ("lambda_max", lam[-1])):
        e = rk["estimates"][key]
        assert e["lower"] * (1 - 1e-12) <= true <= e["upper"] * (1 + 1e-12), key
    assert c.lambda_min == pytest.approx(lam[0], rel=1e-2)
    # the full budget: intervals within eig_rtol = 1% (the Ritz values far closer)
    full = certify(res_k.statistics, solver="krylov", krylov={"eig_budget": "full"})
    assert full.converged and full.estimates["eigenvalues_converged"]
    assert full.lambda_min == pytest.approx(lam[0], rel=1e-4)
    assert full.lambda_min_scaled == pytest.approx(w[0], rel=1e-4)
    assert full.condition_number == pytest.approx(w[-1] / w[0], rel=1e-4)
    for key, true in (("lambda_min_scaled", w[0]), ("lambda_min", lam[0])):
        e = full.estimates[key]
        assert e["converged"] and e["lower"] * (1 - 1e-12) <= true <= e["upper"] * (1 + 1e-12), key
        assert e["upper"] - e["lower"] <= 1e-2 * e["upper"]
    assert rk["teacher_coef_distance"] <= 1e-8 * np.linalg.norm(res_d.solution.coef)


def _dense_phi(tokens):
    n, _, d = tokens.shape
    I, J = np.triu_indices(d)
    S = np.einsum("ntj,ntk->njk", tokens, tokens)
    return np.einsum("rp,rl->rpl", S[:, I, J], tokens[:, -1]).reshape(n, -1)


def _rank_deficient(kind):
    rng = np.random.default_rng(0)
    if kind == "fewer-rows":  # d = 8, 250 generic rows for psi = 288: rank 250, found by LOBPCG (block grown)
        tok = rng.standard_normal((250, 12, 8))
    elif kind == "plane":
        tok = rng.standard_normal((400, 5, 3))
        tok[..., 2] = tok[..., 0] - 2 * tok[..., 1]
    elif kind == "zero-coordinate":
        tok = rng.standard_normal((400, 5, 3))
        tok[..., 1] = 0.0
    else:  # line
        tok = rng.standard_normal((400, 5, 1)) * np.array([1.0, -2.0, 0.5])
    return tok, rng.standard_normal((tok.shape[0], 2))


@pytest.mark.parametrize("kind", ["fewer-rows", "plane", "zero-coordinate", "line"])
def test_krylov_rank_deficient_min_norm(kind):
    """Rank-deficient Grams: the same rank and verdict as the dense path and the min-norm least-squares answer
    of pinv on the dense features (no component in null(Phi)), with a null basis spanning null(Phi)."""
    tok, y = _rank_deficient(kind)
    st = statistics_from_arrays(tok, y)
    P = _dense_phi(tok)
    rank_ref = np.linalg.matrix_rank(P)
    dense = solver.solve(st, solver="eigh")
    sol = solver.solve(st, solver="krylov")
    assert sol.rank == dense.rank == rank_ref < st.psi and not sol.certificate.identifiable
    assert sol.certificate.verdict == dense.certificate.verdict == "not identifiable"
    assert sol.certificate.margin >= 10  # the margin the Ritz intervals guarantee clears the settle factor
    assert sol.certificate.ambiguous_dim == st.psi - rank_ref and sol.certificate.converged
    c_ref = np.linalg.pinv(P, rcond=1e-10) @ y
    assert rel(sol.coef, c_ref) <= 1e-8 and rel(sol.coef, dense.coef) <= 1e-8
    _, _, Vt = np.linalg.svd(P)
    assert np.linalg.norm(Vt[rank_ref:] @ sol.coef) <= 1e-9 * np.linalg.norm(sol.coef)
    Nb = sol.null_basis
    assert Nb.shape == (st.psi, st.psi - rank_ref)
    assert np.linalg.norm(P @ Nb) <= 1e-7 * np.linalg.norm(P)
    # the statistics' SSE formula has a round-off floor ~ eps * sum(y^2) (an exact fit for "fewer-rows")
    assert sol.sse == pytest.approx(np.sum((P @ c_ref - y) ** 2), rel=1e-8, abs=1e-12 * np.sum(y**2))


@pytest.mark.slow
def test_krylov_null_space_by_lobpcg_alone():
    """The LOBPCG path that large Grams take (here forced with dense_null_max=0): blocks grown 2 -> 8 -> 32 -> 95
    until a Ritz value above the cutoff settles (null dimension 38); the pinv answer and null(Phi) as above."""
    tok, y = _rank_deficient("fewer-rows")
    st = statistics_from_arrays(tok, y)
    P = _dense_phi(tok)
    rank_ref = np.linalg.matrix_rank(P)
    lob = solver.solve(st, solver="krylov", krylov={"dense_null_max": 0})
    assert lob.rank == rank_ref and lob.certificate.converged
    assert rel(lob.coef, np.linalg.pinv(P, rcond=1e-10) @ y) <= 1e-8
    assert np.linalg.norm(P @ lob.null_basis) <= 1e-7 * np.linalg.norm(P)


def test_krylov_rank_deficient_real_and_assoc_cases():
    """The not-identifiable cases of the other tests: orthogonal associative memory and all-zero data."""
    orth = statistics_from_arrays(make_assoc(2, 2048, orthogonal=True, seed=0)["tokens"],
                                  make_assoc(2, 2048, orthogonal=True, seed=0)["targets"])
    a, b = solver.solve(orth, solver="eigh"), solver.solve(orth, solver="krylov")
    assert not b.certificate.identifiable and b.rank == a.rank and b.certificate.ambiguous_dim > 0
    assert b.certificate.verdict == a.certificate.verdict
    assert rel(b.coef, a.coef) <= 1e-8
    assert certify(orth, solver="krylov").rank == a.rank
    zero = statistics_from_arrays(np.zeros((20, 4, 2)), np.ones((20, 2)))
    z = solver.solve(zero, solver="krylov")
    assert z.rank == 0 and np.array_equal(z.coef, np.zeros((6, 2))) and z.certificate.lambda_max == 0


@pytest.mark.slow
def test_krylov_digits_same_verdict_and_rank():
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    img = load_digits().images / 16.0  # (1797, 8, 8): 7 pixel rows predict the 8th, as import --builtin digits
    tok, y = img[:, :7, :], img[:, 7, :]
    st = statistics_from_arrays(np.ascontiguousarray(tok), np.ascontiguousarray(y))
    a, b = solver.solve(st, solver="eigh"), solver.solve(st, solver="krylov")
    assert not b.certificate.identifiable and b.rank == a.rank
    assert b.certificate.verdict == a.certificate.verdict
    assert rel(b.coef, a.coef) <= 1e-6


def test_budget_is_reported_not_guessed():
    st = _data(8, True, False, samples=30, length=40)[1]
    sol = solver.solve(st, solver="krylov", krylov={"maxiter": 4})
    c = sol.certificate
    s = c.summary()
    assert not c.converged and s["certificate_converged"] is False and c.verdict == "not settled"
    assert not s["solve_converged"] if "solve_converged" in s else not c.estimates["solve_converged"]
    assert any("CG" in n for n in c.estimates["notes"])
    assert c.estimates["lambda_min_scaled"]["converged"] is False
    for k in ("n_rows", "psi", "rank", "cutoff_rtol", "lambda_min", "lambda_max", "lambda_min_scaled",
              "condition_number", "identifiable", "ambiguous_dim"):
        assert k in s  # the summary keys of the other paths are all there


def test_krylov_certify_matches_cholesky_and_ridge_is_refused():
    st = _data(4, True, True, samples=60)[1]
    ck, cc = certify(st, solver="krylov"), certify(st, solver="cholesky")
    assert ck.rank == cc.rank == st.psi and ck.converged
    # the dense values (the Cholesky path reports intervals around rough points since it proves by factorisation)
    G = st.gram()
    root = np.sqrt(np.diag(G))
    w, ws = np.linalg.eigvalsh(G / st.n_rows), np.linalg.eigvalsh(G / np.outer(root, root))
    dense = {"lambda_min": w[0], "lambda_max": w[-1], "lambda_min_scaled": ws[0], "condition_number": ws[-1] / ws[0]}
    for k in ("lambda_min", "lambda_max", "lambda_min_scaled", "condition_number"):
        assert getattr(ck, k) == pytest.approx(dense[k], rel=1e-3), k
        if k != "condition_number":  # the dense value lies in the interval the estimate reports
            e = ck.estimates[k]
            assert e["lower"] * (1 - 1e-12) <= dense[k] <= e["upper"] * (1 + 1e-12), k
    lo, hi = cc.lambda_min_interval
    assert lo <= dense["lambda_min"] <= hi
    tight = certify(st, solver="krylov", krylov={"eig_rtol": 1e-5, "eig_budget": "full"})
    for k in ("lambda_min", "lambda_max", "lambda_min_scaled", "condition_number"):
        assert getattr(tight, k) == pytest.approx(dense[k], rel=1e-9), k
    with pytest.raises(ValueError, match="ridge"):
        solver.solve(st, ridge=1e-3, solver="krylov")
    with pytest.raises(TypeError, match="method"):  # (no alias of the unreleased API)
        certify(st, method="eigh")


# ---- part 5: auto, memory, CLI ------------------------------------------------------------------------------
def test_auto_path_and_memory_know_three_paths():
    assert solver_path(288) == "eigh" and solver_path(2176) == "cholesky"
    assert solver_path(43_560) == "krylov"
    assert solver_path(2176, fits=lambda p: p == "krylov") == "krylov"
    e = fit_memory(44, 1)
    assert e["path"] == "krylov" and set(e["paths"]) == {"eigh", "cholesky", "krylov"}
    # no psi x psi array: krylov needs almost a whole one (8 psi^2 bytes) less than Cholesky, which factors in place
    assert e["paths"]["cholesky"] - e["paths"]["krylov"] > 0.9 * 8 * 43_560**2
    # d = 24 (Cholesky by psi): with memory between the two paths' peaks auto takes krylov, cholesky is refused
    e24 = fit_memory(24, 1)
    lo, hi = e24["paths"]["krylov"], e24["paths"]["cholesky"]
    assert e24["path"] == "cholesky" and lo < 0.6 * hi
    w = e24["worker_bytes"]  # without a cluster this process builds the statistics too
    assert check_fit_memory(24, 1, memory_limit=w + (lo + hi) / 2)["path"] == "krylov"
    assert check_fit_memory(24, 1, memory_limit=w + 2 * hi)["path"] == "cholesky"
    with pytest.raises(InsufficientMemoryError, match="cholesky solver.*`solver='krylov'`"):
        check_fit_memory(24, 1, memory_limit=w + (lo + hi) / 2, solver="cholesky")
    with pytest.raises(InsufficientMemoryError, match="a certificate with d = 64 .*krylov solver"):
        check_fit_memory(64, 0, memory_limit="24GiB", what="certificate")


@pytest.mark.slow
def test_cli_fit_and_certify_with_krylov(tmp_path):
    import json

    from scaleattn.cli import main

    data = str(tmp_path / "d.zarr")
    assert main(["generate", "mhla", data, "--d", "4", "--heads", "2", "--length", "30", "--samples", "200",
                 "--causal"]) == 0
    outs = {}
    for s in ("krylov", "eigh"):
        assert main(["fit", data, "--out", str(tmp_path / s), "--local", "--quiet", "--no-plots", "--solver", s]) == 0
        outs[s] = json.loads((tmp_path / s / "report.json").read_text())
    k, e = outs["krylov"], outs["eigh"]
    assert k["identifiable"] and k["rank"] == e["rank"] == 40 and k["relative_train_mse"] <= 1e-20
    assert k["lambda_min"] == pytest.approx(e["lambda_min"], rel=1e-4) and k["certificate_converged"]
    assert main(["certify", data, "--local", "--json", "--solver", "krylov"]) == 0


def test_heads_and_witness_use_the_operator_at_large_psi(monkeypatch):
    import scaleattn.linalg._certificate as C
    import scaleattn.linalg._gram as gram
    from scaleattn.heads._search import search_heads

    tok, y = _rank_deficient("plane")
    st = statistics_from_arrays(tok, y)
    sol = solver.solve(st, solver="krylov")
    ref_h, ref_w = search_heads(st, sol.coef, "svd"), C.ambiguity_witness(sol, st)
    monkeypatch.setattr(gram, "DENSE_GRAM_MAX_PSI", 1)
    assert isinstance(gram.gram_for(st), GramOperator) and isinstance(solver.shared_gram(st, "krylov"), GramOperator)
    assert isinstance(solver.shared_gram(st, "eigh"), np.ndarray)
    h, w = search_heads(st, sol.coef, "svd"), C.ambiguity_witness(sol, st)
    assert h.sse == pytest.approx(ref_h.sse, rel=1e-10)
    assert w.sse_b == pytest.approx(ref_w.sse_b, rel=1e-10)
    assert np.allclose(w.prediction_b, ref_w.prediction_b, rtol=1e-8)
    assert st.sse_floor(sol.coef, gram.gram_for(st)) == pytest.approx(st.sse_floor(sol.coef), rel=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not have_cupy(), reason="needs CuPy and a CUDA GPU")
def test_operator_and_krylov_on_gpu_equal_cpu():
    """The same operator, preconditioner and solver code on CuPy arrays (statistics held on the device)."""
    import cupy

    st = _data(8, True, True)[1]
    X = np.random.default_rng(0).standard_normal((st.psi, 3))
    op_g = GramOperator.from_compact(cupy.asarray(st.gram_compact), 8)
    assert rel(cupy.asnumpy(op_g @ cupy.asarray(X)), st.gram() @ X) <= 1e-13
    gst = Statistics(cupy.asarray(st.gram_compact), cupy.asarray(st.moments), st.yy, st.n_rows, 8)
    a, b = solver.solve(st, solver="krylov"), solver.solve(gst, solver="krylov")
    assert isinstance(b.coef, np.ndarray) and rel(b.coef, a.coef) <= 1e-10 and b.rank == a.rank


def test_krylov_margin_counts_negative_round_off_as_the_dense_path_does():
    """A round-off eigenvalue below zero is as far from zero as its size: with the most negative scaled
    eigenvalue at -0.3 x the cutoff the verdict is not settled on both paths (krylov used to clip it to 0 and
    claim a settled 'not identifiable' with margin 644), and at -0.05 x it is settled on both."""
    import scaleattn

    rng = np.random.default_rng(1)
    Z = rng.standard_normal((500, 5, 4))
    Z[..., 3] = Z[..., 2]  # collinear token coordinates: an exact null space
    y = rng.standard_normal((500, 2))
    st = statistics_from_arrays(Z, y)
    one = statistics_from_arrays(rng.standard_normal((1, 5, 4)), np.zeros((1, 2)))
    G, g1 = st.gram(), one.gram()
    D = np.sqrt(np.diag(G))
    cut = st.psi * 16 * np.finfo(float).eps * np.linalg.eigvalsh(G / D[:, None] / D[None, :])[-1]
    for f, verdict in ((0.3, "not settled"), (0.05, "not identifiable")):
        lo, hi = 0.0, 1.0  # bisect the multiple of one sample's Gram whose removal gives that negative eigenvalue
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.linalg.eigvalsh((G - mid * g1) / D[:, None] / D[None, :])[0] < -f * cut:
                hi = mid
            else:
                lo = mid
        s2 = statistics_from_arrays(Z, y)
        s2.gram_compact = st.gram_compact - hi * one.gram_compact
        dense, kry = scaleattn.solve(s2, solver="eigh").certificate, scaleattn.solve(s2, solver="krylov").certificate
        assert dense.verdict == kry.verdict == verdict and dense.rank == kry.rank
        assert abs(np.log10(kry.margin / dense.margin)) < 0.1


def test_a_loose_cutoff_does_not_loosen_the_krylov_coefficients():
    """The CG target is the Gram's round-off whatever the rank cutoff: with cutoff_rtol = 1e-3 the coefficients
    still agree with the dense path's (they differed by 5e-4 relative when the target followed the cutoff)."""
    import scaleattn

    rng = np.random.default_rng(0)
    Z = rng.standard_normal((2000, 6, 5))
    Z[..., 0] *= 3e-2
    Z[..., 1] = Z[..., 2] + 1e-3 * Z[..., 1]  # badly conditioned, full rank
    st = statistics_from_arrays(Z, rng.standard_normal((2000, 1)))
    a, b = scaleattn.solve(st, 1e-3, solver="eigh"), scaleattn.solve(st, 1e-3, solver="krylov")
    assert a.certificate.rank == b.certificate.rank
    assert np.abs(a.coef - b.coef).max() <= 1e-8 * np.abs(a.coef).max()


def test_ridge_never_takes_krylov_and_is_refused_with_it_before_the_build(monkeypatch, causal_ds):
    """A ridge needs the whole spectrum: 'auto' stays dense past psi 20,000 (and where memory pushes krylov),
    and an explicit krylov with a ridge is refused before any statistics are built (it used to fail after)."""
    import scaleattn
    from scaleattn import pipeline
    from scaleattn.errors import ParameterError
    from scaleattn.linalg._spectrum import solver_path

    assert solver_path(43_560) == "krylov" and solver_path(43_560, dense=True) == "cholesky"
    assert fit_memory(20, 1, available=3e8, dense=True)["path"] == "cholesky"

    def no_build(*a, **k):
        raise AssertionError("the statistics were built before the refusal")

    monkeypatch.setattr(pipeline, "build_statistics", no_build)
    with pytest.raises(ParameterError, match="`ridge` > 0 needs a dense solver"):
        scaleattn.fit(causal_ds, solver="krylov", ridge=0.1)


def test_a_gram_whose_products_would_overflow_is_refused_in_one_line():
    """A token 1e30 times the rest: G's diagonal reaches 2.5e178 and the krylov solver's unscaled runs squared it
    into inf (numpy's multi-line "array must not contain infs or NaNs"); the dense paths, Jacobi-scaled, fit it."""
    import scaleattn
    from scaleattn.errors import DatasetError

    rng = np.random.default_rng(0)
    t = rng.standard_normal((40, 5, 2))
    t[3, 1] *= 1e30
    st = statistics_from_arrays(t, rng.standard_normal((40, 5, 1)), causal=True)
    with pytest.raises(DatasetError, match="krylov solver's products would overflow float64"):
        scaleattn.solve(st, solver="krylov")
    assert scaleattn.solve(st, solver="eigh").certificate.verdict == "not identifiable"


@pytest.mark.parametrize("noise", [0.0, 1e-4])
def test_krylov_lambda_min_intervals_are_not_below_zero_on_singular_grams(noise):
    """G / N is positive semidefinite: the krylov path's lambda_min intervals (certificate and printed estimates)
    never lie entirely below 0 (it printed [-1.6e-13, -1.0e-14] on collinear tokens) and hold eigvalsh's value of
    the explicit features' Gram to round-off."""
    from scaleattn import solve, statistics_from_arrays
    from scaleattn.features import phi, token_features

    r = np.random.default_rng(3)
    t = r.standard_normal((400, 5, 3))
    t[..., 2] = 0.5 * t[..., 0] + noise * r.standard_normal((400, 5))
    y = r.standard_normal((400, 1))
    cert = solve(statistics_from_arrays(t, y), solver="krylov").certificate
    F = phi(*token_features(t))
    truth = np.linalg.eigvalsh(F.T @ F / len(F))[0]
    tol = 18 * np.finfo(float).eps * np.linalg.eigvalsh(F.T @ F / len(F))[-1] * 10
    for lo, hi in (cert.lambda_min_interval, (cert.estimates["lambda_min"]["lower"],
                                              cert.estimates["lambda_min"]["upper"])):
        assert hi >= 0.0 and lo - tol <= truth <= hi + tol, (lo, hi, truth)
