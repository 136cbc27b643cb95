"""The paper's experiments at small sizes: in-context regression against one-step GD and ridge, associative memory
(Figure 2b), Figure 1 and its table."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from scaleattn import baselines as B  # noqa: E402
from scaleattn.generate import make_assoc, make_icl_regression  # noqa: E402


def test_icl_generator_and_references():
    D = make_icl_regression(3, 7, 50, seed=0)
    assert D["tokens"].shape == (50, 8, 4) and D["targets"].shape == (50, 1)
    assert np.all(D["tokens"][:, -1, 3] == 0)
    # least squares on a context of n >= k points recovers w exactly (noise-free)
    np.testing.assert_allclose(B.ridge_in_context(D["tokens"]), D["targets"], atol=1e-10)
    with pytest.raises(ValueError, match="context"):
        make_icl_regression(3, 0, 5)


@pytest.mark.slow
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


@pytest.mark.slow
def test_assoc_truth_and_figure2b_closed_form():
    truth = B.assoc_truth(2)
    orth = make_assoc(2, 256, orthogonal=True, seed=5)
    assert B.coef_mse(truth, orth) < 1e-25  # the truth also fits the orthogonal data exactly
    res = B.figure2b(samples=256, epochs=2, seeds=1, batch_size=64)
    cf = {c["data"]: c for c in res["closed_form"]}
    assert cf["identifiable"]["identifiable"] and cf["identifiable"]["distance"] < 1e-10
    assert not cf["orthogonal"]["identifiable"] and cf["orthogonal"]["distance"] > 0.1
    assert all(len(r["distance"]) == 3 for r in res["runs"])


@pytest.mark.slow  # trains AdamW models: 3 s
def test_figure1_small_and_table():
    res = B.figure1(dims=((2, 24),), heads=(1, 2), seeds=2, epochs=2, lrs=(1e-2, 1e-3), length=10)
    rows = B.figure1_table(res)
    assert [r["m"] for r in rows] == [1, 2]
    for r in rows:
        assert r["closed_form_train_mse"] < 1e-25 < r["adamw_train_mse"]
        assert r["lr"] in (1e-2, 1e-3)
    json.dumps(res)  # serialisable as is
    assert "| d | N | m |" in B.markdown_table(rows)


def test_the_icl_plot_shows_the_learned_predictors_not_30_decades_of_round_off():
    """Least squares on the context at ~1e-30 stretched the log axis over 30 decades: closed form, AdamW and GD
    (0.3-1.5) fell on one line, the comparison of the section invisible; ticks read 4x10^0, 6x10^0, ..."""
    pytest.importorskip("matplotlib")
    from scaleattn.baselines.paper import plot_icl

    rows = [{"k": 3, "context": c, "closed_form_test": v, "adamw_test": 1.02 * v, "gd_test": 0.98 * v,
             "ls_context_test": 3e-30} for c, v in ((4, 1.5), (8, 1.0), (16, 0.6), (32, 0.35))]
    ax = plot_icl(rows).axes[0]
    lo, hi = ax.get_ylim()
    assert lo > 0.1 and hi < 3, (lo, hi)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "8", "16", "32"]
    assert any("least squares on context: <= 3e-30" in t.get_text() for t in ax.get_legend().get_texts())
    far = [{**r, "ls_context_test": 0.5 * r["gd_test"]} for r in rows]  # n < k: on the scale of the others
    assert len(plot_icl(far).axes[0].get_lines()) == 4
