"""The polynomial fast path: equal to exact attention at high degree, within its a-priori error bounds, converging
with the degree, causal by prefix sums, falling back when logits are large (DESIGN §8). Dense references
(tests/tensor/reference.py) are written independently of the package."""
import math

import numpy as np
import pytest

from scaleattn import tensor as T
from tests.tensor.reference import NAMES, dense_att, dense_mask, fd_grad, rand, rel


def test_poly_matches_exact_high_degree():
    rng = np.random.default_rng(9)
    n, d = 20, 3
    X = rand(rng, (2, n, d), scale=0.6)
    E = rng.normal(size=(2, n, d))
    info = {}
    out = T.poly_attention(*X, degree=20, info=info, block_size=7)
    assert info["path"] == "poly" and info["rank"] == math.comb(23, 3)
    assert np.abs(out - T.attention(*X)).max() < 1e-13
    l0, g0 = T.attention_grad(*X, E)
    l1, g1 = T.poly_attention_grad(*X, E, degree=20, info=info, block_size=5)
    assert abs(l0 - l1) < 1e-12 * l0
    for k in NAMES:
        assert rel(g1[k], g0[k]) < 1e-12, k


def test_poly_within_estimate_and_converges():
    rng = np.random.default_rng(10)
    n, d = 16, 4
    X = rand(rng, (n, d), scale=0.45)
    E = rng.normal(size=(n, d))
    ref = T.attention(*X)
    l0, g0 = T.attention_grad(*X, E)
    errs = []
    for g in range(1, 7):
        info = {}
        out = T.poly_attention(*X, degree=g, info=info, on_large="raise")
        err = np.abs(out - ref).max()
        errs.append(err)
        assert err <= info["out_bound"]
        assert info["p_l1_bound"] == pytest.approx(T.poly_error_bound(*X[:3], g))
        gi = {}
        _, gp = T.poly_attention_grad(*X, E, degree=g, info=gi, on_large="raise")
        for k in NAMES:
            assert np.abs(gp[k] - g0[k]).max() <= gi["grad_bound"][k], (g, k)
    assert all(b < a for a, b in zip(errs, errs[1:]))  # error falls as the degree grows
    assert errs[-1] < 1e-5 * errs[0]


def test_on_large():
    rng = np.random.default_rng(12)
    n, d = 8, 3
    X = rand(rng, (n, d), scale=4.0)
    E = rng.normal(size=(n, d))
    with pytest.raises(ValueError, match="logit"):
        T.poly_attention(*X, degree=3, on_large="raise")
    with pytest.raises(ValueError, match="logit"):
        T.poly_attention_grad(*X, E, degree="auto", on_large="raise")
    info = {}
    with pytest.warns(RuntimeWarning, match="falling back"):
        out = T.poly_attention(*X, degree=3, info=info)
    assert info["path"] == "exact"
    assert np.abs(out - T.attention(*X)).max() < 1e-14
    with pytest.warns(RuntimeWarning):
        l, g = T.poly_attention_grad(*X, E, degree="auto")
    l0, g0 = T.attention_grad(*X, E)
    assert l == l0 and all(np.array_equal(g[k], g0[k]) for k in NAMES)
    with pytest.raises(ValueError, match="on_large"):
        T.poly_attention(*X, on_large="ignore")
    with pytest.raises(NotImplementedError, match="window"):
        T.poly_attention(*X, window=(None, 3))
    with pytest.raises(NotImplementedError, match="window"):
        T.poly_attention_grad(*X, E, window=(2, 2))
    # causal: the fallback is the exact *causal* attention
    with pytest.warns(RuntimeWarning, match="falling back"):
        out = T.poly_attention(*X, causal=True, degree=3)
    assert np.abs(out - T.attention(*X, causal=True)).max() < 1e-14
    with pytest.warns(RuntimeWarning):
        l, g = T.poly_attention_grad(*X, E, causal=True, degree=3)
    l0, g0 = T.attention_grad(*X, E, causal=True)
    assert l == l0 and all(np.array_equal(g[k], g0[k]) for k in NAMES)
    with pytest.raises(ValueError, match="logit"):
        T.poly_attention(*X, causal=True, degree=3, on_large="raise")


def test_poly_causal_matches_exact_high_degree():
    rng = np.random.default_rng(21)
    n, d = 17, 3
    X = rand(rng, (2, 2, n, d), scale=0.6)  # batch and head axes
    E = rng.normal(size=(2, 2, n, d))
    ref = T.attention(*X, causal=True)
    assert np.abs(ref - T.attention(*X)).max() > 1e-2  # the mask matters
    assert np.abs(ref - dense_att(*X, 1 / d, dense_mask(n, causal=True))).max() < 1e-13
    l0, g0 = T.attention_grad(*X, E, causal=True)
    for bs in (1, 5, None):  # one row per block, several blocks, one block
        info = {}
        out = T.poly_attention(*X, causal=True, degree=20, info=info, block_size=bs, on_large="raise")
        assert info["path"] == "poly" and 0 < info["min_rowsum"]
        assert np.abs(out - ref).max() < 1e-12, bs
        l1, g1 = T.poly_attention_grad(*X, E, causal=True, degree=20, block_size=bs, on_large="raise")
        assert abs(l1 - l0) < 1e-12 * l0
        for k in NAMES:
            assert rel(g1[k], g0[k]) < 1e-11, (bs, k)
    # window=(None, None) is the causal mask; float32 in -> float32 out
    assert np.array_equal(T.poly_attention(*X, window=(None, None), degree=20), T.poly_attention(*X, causal=True,
                                                                                                   degree=20))
    o32 = T.poly_attention(*[x.astype(np.float32) for x in X], causal=True, degree=20)
    assert o32.dtype == np.float32 and np.abs(o32 - ref).max() < 1e-5


def test_poly_causal_grad_finite_differences_and_bounds():
    rng = np.random.default_rng(22)
    n, d, g = 7, 2, 3  # low degree: the Taylor model differs from exp, so FD checks the model's own gradient
    X = rand(rng, (n, d), scale=0.6)
    E = rng.normal(size=(n, d))
    kw = dict(causal=True, degree=g, on_large="raise", block_size=3)
    info = {}
    loss, grads = T.poly_attention_grad(*X, E, info=info, **kw)
    out = T.poly_attention(*X, **kw)
    assert loss == pytest.approx(0.5 * float(((out - E) ** 2).sum()), rel=1e-13)
    l_ex, g_ex = T.attention_grad(*X, E, causal=True)
    assert rel(grads["Q"], g_ex["Q"]) > 1e-6  # really a different model at this degree

    def f():
        o = T.poly_attention(*X, **kw)
        return 0.5 * float(((o - E) ** 2).sum())

    for k, x in zip(NAMES, X):
        assert rel(grads[k], fd_grad(f, x)) < 1e-7, k
        assert np.abs(grads[k] - g_ex[k]).max() <= info["grad_bound"][k], k  # a-priori bounds still hold
    fi = {}
    out = T.poly_attention(*X, info=fi, **kw)
    assert np.abs(out - T.attention(*X, causal=True)).max() <= fi["out_bound"]
