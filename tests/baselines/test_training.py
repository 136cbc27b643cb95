"""AdamW baselines vs the closed-form fit (issue 9): small sizes, independent references."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from scaleattn import baselines as B  # noqa: E402
from scaleattn.dataset import write_dataset  # noqa: E402
from scaleattn.generate import make_assoc, make_icl_regression, make_mhla, mhla_forward  # noqa: E402
from scaleattn.heads import coef_from_heads  # noqa: E402


def _set_heads(model, V, Q):
    with torch.no_grad():
        model.V[0].copy_(torch.as_tensor(V))
        model.Q[0].copy_(torch.as_tensor(Q))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_mhla_forward_is_design_s1(causal, fused):
    # teacher heads loaded into the torch model reproduce the numpy teacher (DESIGN §1, no 1/n) with padding
    D = make_mhla(3, 2, 9, 12, d_out=2, causal=causal, variable_lengths=True, seed=3)
    m = B.MHLA(3, 2, heads=2, causal=causal, fused=fused)
    _set_heads(m, D["V"], D["Q"])
    with torch.no_grad():
        y = m(torch.as_tensor(D["tokens"]), torch.as_tensor(D["lengths"])).numpy()
    np.testing.assert_allclose(y, D["targets"], rtol=0, atol=1e-13)
    np.testing.assert_allclose(m.coef(), coef_from_heads(D["V"], D["Q"]), atol=1e-15)
    assert B.model_mse(m, D) < 1e-28 and B.coef_mse(m.coef(), D) < 1e-28


def test_two_layer_forward_matches_numpy():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((4, 6, 3)) / 3
    m = B.MHLA(3, 1, heads=2, layers=2, causal=True, seed=1)
    V0, Q0, V1, Q1 = (p.detach().numpy() for p in (m.V[0], m.Q[0], m.V[1], m.Q[1]))
    z1 = z + mhla_forward(V0, Q0, z, causal=True)  # residual first layer
    ref = mhla_forward(V1, Q1, z1, causal=True)
    with torch.no_grad():
        np.testing.assert_allclose(m(torch.as_tensor(z)).numpy(), ref, atol=1e-14)
    with pytest.raises(ValueError, match="one-layer"):
        m.coef()


def test_adamw_decreases_loss_and_never_beats_the_fit():
    # noisy data: the fit's floor is ~noise^2, which AdamW can approach but (same function class) never pass
    tr = make_mhla(2, 1, 20, 96, causal=True, noise=0.02, seed=0)
    va = make_mhla(2, 1, 20, 32, causal=True, noise=0.02, teacher=(tr["V"], tr["Q"]), seed=[0, 1])
    cf = B.fit_closed_form(tr, va)
    assert cf["train_mse"] == pytest.approx(4e-4, rel=0.2)  # noise^2
    for m in (1, 4):
        r = B.train_adamw("mhla", tr, va, heads=m, epochs=8, lr=1e-2, batch_size=16, seed=m)
        assert len(r.train_mse) == len(r.val_mse) == len(r.wall_s) == 9
        excess = np.array(r.train_mse) - cf["train_mse"]
        assert excess[-1] < 0.5 * excess[0] and r.val_mse[-1] < r.val_mse[0]
        assert np.all(np.diff(r.wall_s) > 0)
        assert min(r.train_mse) >= cf["train_mse"] * (1 - 1e-9)
        # c(Theta) of the trained model evaluated through the cubic features gives the same loss
        assert B.coef_mse(r.model.coef(), tr) == pytest.approx(r.train_mse[-1], rel=1e-9)


def test_fit_at_float64_floor_on_realizable_data():
    tr = make_mhla(2, 1, 100, 64, causal=True, seed=1)
    cf = B.fit_closed_form(tr)
    ms = float(np.mean(tr["targets"] ** 2))
    assert cf["train_mse"] < 1e-25 * ms
    assert cf["certificate"].identifiable


def test_softmax_transformer_trains_with_padding():
    D = make_mhla(2, 1, 8, 64, causal=False, variable_lengths=True, seed=2)
    r = B.train_adamw("full", D, epochs=6, lr=3e-3, batch_size=16, width=16, heads=2)
    assert r.train_mse[-1] < r.train_mse[0]
    Dc = make_mhla(2, 1, 8, 32, causal=True, seed=2)
    rc = B.train_adamw("full", Dc, epochs=3, lr=3e-3, batch_size=16, width=16, heads=2)
    assert rc.train_mse[-1] < rc.train_mse[0]
    # causal outputs must not see the future: changing the last token leaves earlier outputs unchanged
    z = torch.as_tensor(Dc["tokens"][:2]).clone()
    with torch.no_grad():
        a = rc.model(z)
        z[:, -1] += 1.0
        b = rc.model(z)
    np.testing.assert_allclose(a[:, :-1].numpy(), b[:, :-1].numpy(), atol=1e-12)


def test_mismatched_model_is_refused():
    D = make_mhla(2, 1, 8, 8, causal=True, seed=0)
    with pytest.raises(ValueError, match="causal"):
        B.train_adamw(B.MHLA(2, 2, causal=False), D, epochs=1)
    with pytest.raises(ValueError, match="kind"):
        B.make_model("rnn", 2)


def test_zarr_dataset_gives_the_same_run_as_arrays(tmp_path):
    D = make_mhla(2, 1, 10, 24, causal=True, seed=4)
    url = str(tmp_path / "d.zarr")
    write_dataset(url, D["tokens"], D["targets"], chunk_samples=8)
    a = B.train_adamw("mhla", D, heads=2, epochs=2, batch_size=8)
    b = B.train_adamw("mhla", url, heads=2, epochs=2, batch_size=8)
    assert a.train_mse == b.train_mse


def test_icl_generator_and_references():
    D = make_icl_regression(3, 7, 50, seed=0)
    assert D["tokens"].shape == (50, 8, 4) and D["targets"].shape == (50, 1)
    assert np.all(D["tokens"][:, -1, 3] == 0)
    # least squares on a context of n >= k points recovers w exactly (noise-free)
    np.testing.assert_allclose(B.ridge_in_context(D["tokens"]), D["targets"], atol=1e-10)
    with pytest.raises(ValueError, match="context"):
        make_icl_regression(3, 0, 5)


def test_closed_form_not_worse_than_one_step_gd():
    # the one-step GD predictor x_q^T Gamma (1/n) sum y_i x_i is inside the MHLA class for a fixed n
    # (sum y_i x_i is a block of Z^T Z): train error exactly <=; test error <= up to the estimation
    # tolerance 10 * psi / N_train (measured ratios 0.999..1.013 at psi = 18, N = 8192 over 4 seeds)
    N = 8192
    rows = B.icl_regression(k=2, contexts=(4, 16), train_samples=N, test_samples=N, adamw_epochs=0)
    for r in rows:
        assert r["closed_form_train"] <= r["gd_train"] * (1 + 1e-10)
        assert r["closed_form_test"] <= r["gd_test"] * (1 + 10 * r["psi"] / N)
        # optimal scalar step for x ~ N(0, I): Gamma = n / (n + k + 1) I (matrix fit's mean diagonal)
        assert r["gd_gamma_mean_diag"] == pytest.approx(r["context"] / (r["context"] + 3), abs=0.04)
        assert r["ls_context_test"] < 1e-20  # n >= k: the context determines w


def test_assoc_truth_and_figure2b_closed_form():
    truth = B.assoc_truth(2)
    orth = make_assoc(2, 256, orthogonal=True, seed=5)
    assert B.coef_mse(truth, orth) < 1e-25  # the truth also fits the orthogonal data exactly
    res = B.figure2b(samples=256, epochs=2, seeds=1, batch_size=64)
    cf = {c["data"]: c for c in res["closed_form"]}
    assert cf["identifiable"]["identifiable"] and cf["identifiable"]["distance"] < 1e-10
    assert not cf["orthogonal"]["identifiable"] and cf["orthogonal"]["distance"] > 0.1
    assert all(len(r["distance"]) == 3 for r in res["runs"])


def test_figure1_small_and_table():
    res = B.figure1(dims=((2, 24),), heads=(1, 2), seeds=2, epochs=2, lrs=(1e-2, 1e-3), length=10)
    rows = B.figure1_table(res)
    assert [r["m"] for r in rows] == [1, 2]
    for r in rows:
        assert r["closed_form_train_mse"] < 1e-25 < r["adamw_train_mse"]
        assert r["lr"] in (1e-2, 1e-3)
    json.dumps(res)  # serialisable as is
    assert "| d | N | m |" in B.markdown_table(rows)


def test_bench_adamw_on_a_dataset(tmp_path):
    from scaleattn.bench.adamw import run

    D = make_mhla(2, 1, 10, 40, causal=True, seed=6)
    url = str(tmp_path / "d.zarr")
    write_dataset(url, D["tokens"], D["targets"])
    res = run(tmp_path / "out", dataset=url, heads=2, epochs=2)
    row = res["rows"][0]
    assert row["N"] == 32 and row["ours"]["train_mse"] < 1e-25
    assert all(t["ours_s"] is not None for t in row["time_to_mse"])
    assert json.loads((tmp_path / "out" / "adamw.json").read_text())["rows"][0]["epochs"] == 2
    assert "AdamW" in (tmp_path / "out" / "adamw.md").read_text()
