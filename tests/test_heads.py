"""Heads and identifiability beyond the paper: minimal heads, best H-head models, the loss-versus-heads
curve, ambiguity witnesses, model comparison and ridge (DESIGN §4, §5).

Independent references: teacher predictions straight from the heads (``mhla_forward``), data-pass MSEs,
dense least squares on the explicit feature matrix.
"""
import json

import numpy as np
import pytest

from scaleattn.certificate import ambiguity_witness
from scaleattn.cli import main
from scaleattn.features import phi, token_features
from scaleattn.generate import make_assoc, make_mhla, mhla_forward
from scaleattn.head_search import loss_vs_heads, search_heads
from scaleattn.heads import coef_from_heads, compare_models, svd_heads
from scaleattn.model import MHLAModel
from scaleattn.solver import solve
from scaleattn.statistics import statistics_from_arrays


def _fit(D):
    st = statistics_from_arrays(D["tokens"], D["targets"])
    return st, solve(st)


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _data_mse(V, Q, D, causal):
    r = mhla_forward(V, Q, D["tokens"], causal=causal) - D["targets"]
    return float(np.mean(r * r))


@pytest.mark.parametrize("d,H", [(2, 1), (4, 1), (4, 2), (4, 3), (8, 2)])
def test_minimal_heads_recover_realizable_teacher(d, H):
    causal = d < 8
    D = make_mhla(d=d, heads=H, length=100 if causal else 16, samples=64 if causal else 600, causal=causal, seed=d + H)
    st, sol = _fit(D)
    h = search_heads(st, sol.coef, "minimal")
    assert h.n_heads == H and h.method == "minimal"
    # same function as the teacher on fresh inputs (predictions straight from the heads)
    fresh = make_mhla(d=d, heads=H, length=30, samples=40, causal=True, teacher=(D["V"], D["Q"]), seed=123)
    assert _rel(mhla_forward(h.V, h.Q, fresh["tokens"], causal=True), fresh["targets"]) <= 1e-9
    # the teacher up to its symmetries (head order, V_h a / Q_h / a, ...): equal c(Theta)
    assert np.linalg.norm(coef_from_heads(h.V, h.Q) - coef_from_heads(D["V"], D["Q"])) <= 1e-8
    # the paper's SVD heads: the symmetric split raises the rank to the maximum
    s = search_heads(st, sol.coef, "svd")
    assert s.n_heads == d * d > H  # min(d_out * d, d^2) with d_out = d: 4 heads for (2, 1)
    # loss curve: positive below H (H - 1 heads cannot fit an H-head teacher), ~0 at H
    ks = [k for k, _ in h.curve]
    assert ks == list(range(1, H + 1))
    ms = np.mean(D["targets"] ** 2)
    assert all(v / (st.n_rows * d) > 1e-6 * ms for _, v in h.curve[:-1])
    assert h.curve[-1][1] / (st.n_rows * d) <= 1e-12 * ms


def test_best_h_heads_below_teacher_rank():
    D = make_mhla(d=3, heads=3, length=40, samples=100, causal=True, seed=5)
    st, sol = _fit(D)
    n_out = st.n_rows * st.d_out
    h2 = search_heads(st, sol.coef, 2)
    assert h2.n_heads == 2 and h2.method == "best-2" and h2.residual > 1e-3
    # its loss from the statistics is the loss of its heads measured on the data
    assert h2.sse / n_out == pytest.approx(_data_mse(h2.V, h2.Q, D, True), rel=1e-8)
    # no worse than the paper's heads truncated to 2 (the naive rank-2 model)
    s = svd_heads(sol.coef, 3)
    assert h2.sse / n_out <= _data_mse(s.V[:2], s.Q[:2], D, True) * (1 + 1e-12)
    # the curve is non-increasing and ends at the returned model
    losses = [v for _, v in h2.curve]
    assert [k for k, _ in h2.curve] == [1, 2] and losses[1] <= losses[0] and losses[1] == h2.sse
    # asking for more heads than needed returns the exact model with the fewest
    h5 = search_heads(st, sol.coef, 5)
    assert h5.n_heads == 3 and h5.residual <= 1e-10


def test_noisy_agnostic_loss_vs_heads():
    D = make_mhla(d=3, heads=2, length=20, samples=150, causal=True, noise=0.2, seed=11)
    st, sol = _fit(D)
    n_out = st.n_rows * st.d_out
    h = search_heads(st, sol.coef, "minimal")
    losses = np.array([v for _, v in h.curve])
    assert [k for k, _ in h.curve] == list(range(1, h.n_heads + 1))
    assert np.all(np.diff(losses) <= 1e-12 * st.yy)  # non-increasing in H
    assert np.all(losses >= sol.sse - 1e-12 * st.yy)  # never below the unconstrained least squares
    assert losses[-1] == pytest.approx(sol.sse, rel=1e-10)  # at the minimal head count: the unconstrained loss
    assert losses[0] > sol.sse * (1 + 1e-6)  # one head is not enough for noise
    # each model of the curve: its statistics loss is its data-pass loss
    for m in loss_vs_heads(st, 2):
        assert m.sse / n_out == pytest.approx(_data_mse(m.V, m.Q, D, True), rel=1e-8)


def test_witness_orthogonal_associative_memory():
    D = make_assoc(2, 2048, orthogonal=True, seed=0)
    st, sol = _fit(D)
    cert = sol.certificate
    assert not cert.identifiable and cert.ambiguous_dim == sol.null_basis.shape[1] > 0
    w = ambiguity_witness(sol, st)
    s, x = token_features(D["tokens"])
    F = phi(s, x)
    ya, yb = F @ w.coef_a, F @ w.coef_b
    ms = float(np.mean(D["targets"] ** 2))
    mse_a, mse_b = np.mean((ya - D["targets"]) ** 2), np.mean((yb - D["targets"]) ** 2)
    # equal training loss: on the data (independent pass) and as reported, relative to the target scale
    assert abs(mse_a - mse_b) <= 1e-10 * max(mse_a, mse_b, ms)
    r = w.summary()
    assert r["loss_relative_difference"] <= 1e-10 and abs(r["loss_a"] - r["loss_b"]) <= 1e-10 * ms
    assert np.max(np.abs(ya - yb)) <= 1e-10 * np.sqrt(ms)  # same predictions on every training sample
    # different predictions on the witness input, recomputed from the full W = p^-1(c) by a dense sum
    tok = np.asarray(r["tokens"])
    S, xl = tok.T @ tok, tok[-1]

    def dense(c):
        h = svd_heads(c, st.d)
        return np.einsum("haj,jk,hkl,l->a", h.V, S, h.Q, xl)

    pa, pb = dense(w.coef_a), dense(w.coef_b)
    assert np.allclose(pa, r["prediction_a"], atol=1e-12) and np.allclose(pb, r["prediction_b"], atol=1e-12)
    assert np.linalg.norm(pa - pb) >= 0.1 * np.sqrt(ms)
    # two models built from the witness really are different functions
    ma = MHLAModel(w.coef_a, *_vq(w.coef_a, st.d), st.d)
    mb = MHLAModel(w.coef_b, *_vq(w.coef_b, st.d), st.d)
    assert not compare_models(ma, mb)["equivalent"]
    # identifiable data (unit-norm Gaussian keys): no witness
    D2 = make_assoc(2, 2048, seed=1)
    st2, sol2 = _fit(D2)
    assert sol2.certificate.identifiable and ambiguity_witness(sol2, st2) is None


def _vq(c, d):
    h = svd_heads(c, d)
    return h.V, h.Q


def test_compare_models_symmetries():
    rng = np.random.default_rng(0)
    V, Q = rng.standard_normal((2, 3, 3)), rng.standard_normal((2, 3, 3))
    a = MHLAModel(coef_from_heads(V, Q), V, Q, 3)
    # head permutation and per-head rescaling V_h * s, Q_h / s: the same function
    s = np.array([2.0, -0.5])[:, None, None]
    b = MHLAModel(a.coef, (V * s)[::-1], (Q / s)[::-1], 3)
    # the paper's SVD heads (9 of them) compute it too
    h = svd_heads(a.coef, 3)
    c = MHLAModel(a.coef, h.V, h.Q, 3)
    for other in (b, c):
        r = compare_models(a, other)
        assert r["equivalent"] and r["distance"] <= 1e-12 * np.linalg.norm(a.coef)
    # a transposed Q_h is a different function: distance = ||c - c'|| recomputed here
    Vp, Qp = V.copy(), Q.copy()
    Qp[0] = Qp[0].T
    d = MHLAModel(coef_from_heads(Vp, Qp), Vp, Qp, 3)
    r = compare_models(a, d)
    assert not r["equivalent"] and r["distance"] == pytest.approx(np.linalg.norm(a.coef - d.coef), rel=1e-12)
    with pytest.raises(ValueError, match="d, d_out"):
        compare_models(a, MHLAModel(coef_from_heads(V[:, :2], Q), V[:, :2], Q, 3))


def test_ridge_against_dense_solution():
    D = make_mhla(d=3, heads=1, length=10, samples=80, noise=0.3, seed=2)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    s, x = token_features(D["tokens"])
    F = phi(s, x)
    A = F.T @ F
    for lam in (1e-3, 0.1):
        sol = solve(st, ridge=lam)
        M = A + lam * np.diag(np.diag(A))
        c = np.linalg.solve(M, F.T @ D["targets"])
        assert _rel(sol.coef, c) <= 1e-8
        hat = F @ np.linalg.solve(M, F.T)  # effective dof = trace of the hat matrix
        assert sol.effective_dof == pytest.approx(np.trace(hat), rel=1e-8)
        assert sol.ridge == lam
    base = solve(st)
    assert base.effective_dof == base.rank and base.ridge == 0.0
    assert solve(st, ridge=0.1).sse > base.sse  # ridge trades training loss for a smaller model
    with pytest.raises(ValueError, match="ridge"):
        solve(st, ridge=-1.0)


def test_cli_fit_minimal_witness_and_compare(tmp_path, capsys):
    data, assoc = str(tmp_path / "d.zarr"), str(tmp_path / "a.zarr")
    assert main(["generate", "mhla", data, "--d", "3", "--heads", "2", "--length", "20", "--samples", "60",
                 "--causal"]) == 0
    assert main(["generate", "assoc", assoc, "--pairs", "2", "--samples", "1024", "--orthogonal"]) == 0
    r1, r2, r3 = (str(tmp_path / n) for n in ("r1", "r2", "r3"))
    assert main(["fit", data, "--out", r1, "--heads", "minimal", "--local", "--quiet", "--no-plots"]) == 0
    assert main(["fit", data, "--out", r2, "--heads", "svd", "--local", "--quiet", "--no-plots"]) == 0
    assert main(["fit", assoc, "--out", r3, "--local", "--quiet", "--no-plots", "--ridge", "1e-9"]) == 0
    rep1 = json.load(open(f"{r1}/report.json"))
    assert rep1["n_heads"] == 2 and [e["heads"] for e in rep1["loss_vs_heads"]] == [1, 2]
    assert rep1["loss_vs_heads"][-1]["train_mse_stats"] <= 1e-12 * rep1["target_mean_square"]
    assert "witness" not in rep1 and rep1["ridge"] == 0 and rep1["effective_dof"] == rep1["psi"]
    rep3 = json.load(open(f"{r3}/report.json"))
    assert not rep3["identifiable"] and rep3["ambiguous_dim"] > 0 and rep3["ridge"] == 1e-9
    assert rep3["effective_dof"] == pytest.approx(rep3["rank"], rel=1e-3)
    wit = rep3["witness"]
    assert np.asarray(wit["tokens"]).shape[1] == rep3["d"] and wit["prediction_difference"] > 0.1
    assert abs(wit["loss_a"] - wit["loss_b"]) <= 1e-10 * rep3["target_mean_square"]
    capsys.readouterr()
    # minimal (2 heads) and svd (9 heads) fits compute the same function; the assoc model is another one
    assert main(["compare", f"{r1}/model.zarr", f"{r2}/model.zarr", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equivalent"] and (out["n_heads_a"], out["n_heads_b"]) == (2, 9)
    assert main(["compare", f"{r1}/model.zarr", f"{r3}/model.zarr", "--quiet"]) == 2  # d 3 vs 4: bad input
    assert main(["fit", data, "--out", str(tmp_path / "r4"), "--heads", "1", "--local", "--quiet", "--no-plots"]) == 0
    assert main(["compare", f"{r1}/model.zarr", str(tmp_path / "r4/model.zarr"), "--quiet"]) == 1
    assert main(["compare", f"{r1}/model.zarr", str(tmp_path / "nothing.zarr"), "--quiet"]) == 2
