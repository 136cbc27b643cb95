"""Heads beyond the paper: minimal heads, best H-head models, the loss-versus-heads curve and model comparison
(DESIGN §4, §5).

Independent references: teacher predictions straight from the heads (``mhla_forward``), data-pass MSEs.
"""
import numpy as np
import pytest

from scaleattn.errors import ParameterError
from scaleattn.generate import make_mhla, mhla_forward
from scaleattn.heads._algebra import coef_from_heads, compare_models, svd_heads
from scaleattn.heads._search import loss_vs_heads, search_heads
from scaleattn.model import MHLAModel
from tests.helpers import solve_arrays


def _data_mse(V, Q, D, causal):
    r = mhla_forward(V, Q, D["tokens"], causal=causal) - D["targets"]
    return float(np.mean(r * r))


@pytest.mark.parametrize("d,H", [(2, 1), (4, 1), (4, 2), (4, 3), (8, 2)])
def test_minimal_heads_recover_realizable_teacher(rel_err, d, H):
    causal = d < 8
    D = make_mhla(d=d, heads=H, length=100 if causal else 16, samples=64 if causal else 600, causal=causal, seed=d + H)
    st, sol = solve_arrays(D)
    h = search_heads(st, sol.coef, "minimal")
    assert h.n_heads == H and h.method == "minimal"
    # same function as the teacher on fresh inputs (predictions straight from the heads)
    fresh = make_mhla(d=d, heads=H, length=30, samples=40, causal=True, teacher=(D["V"], D["Q"]), seed=123)
    assert rel_err(mhla_forward(h.V, h.Q, fresh["tokens"], causal=True), fresh["targets"]) <= 1e-9
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
    st, sol = solve_arrays(D)
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
    st, sol = solve_arrays(D)
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
    # a tolerance that is not a finite number > 0 is refused: -1 or NaN called a model different from itself
    for bad, msg in ((-1.0, "rtol must be > 0"), (0.0, "rtol must be > 0"), (float("nan"), "rtol must be finite"),
                     (float("inf"), "rtol must be finite")):
        with pytest.raises(ParameterError, match=msg):
            compare_models(a, a, rtol=bad)
