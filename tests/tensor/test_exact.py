"""Tests for scaleattn.tensor (issue 8, DESIGN §8). Dense references here are written independently of the module."""
import json
import math

import numpy as np
import pytest

from scaleattn import tensor as T

NAMES = ("Q", "K1", "K2", "V1", "V2")


# ---------------------------------------------------------------- independent dense reference
def dense_mask(n, causal=False, window=None):
    i = np.arange(n)[:, None, None]
    j = np.arange(n)[None, :, None]
    k = np.arange(n)[None, None, :]
    if window is None and not causal:
        return None
    m = (j <= i) & (k <= i)
    if window is not None:
        w1, w2 = window
        if w1 is not None:
            m &= j > i - w1
        if w2 is not None:
            m &= k > i - w2
    return m


def dense_P(Q, K1, K2, s, mask=None):
    S = s * np.einsum("...it,...jt,...kt->...ijk", Q, K1, K2)
    if mask is not None:
        S = np.where(mask, S, -np.inf)
    S = S - S.max(axis=(-2, -1), keepdims=True)
    P = np.exp(S)
    return P / P.sum(axis=(-2, -1), keepdims=True)


def dense_att(Q, K1, K2, V1, V2, s, mask=None):
    return np.einsum("...ijk,...jt,...kt->...it", dense_P(Q, K1, K2, s, mask), V1, V2)


def dense_loss(X, E, s, mask=None):
    return 0.5 * float(((dense_att(*X, s, mask) - E) ** 2).sum())


def rand(rng, shape, k=5, scale=1.0):
    return [scale * rng.normal(size=shape) for _ in range(k)]


def fd_grad(f, x, h=1e-5):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = x[idx]
        x[idx] = old + h
        fp = f()
        x[idx] = old - h
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * h)
    return g


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# ---------------------------------------------------------------- exact forward
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 5)), (True, (1, 2)),
                                          (False, (None, 4))])
@pytest.mark.parametrize("bs", [None, (4, 5, 3), 1, (7, 2, 11)])
def test_forward_matches_dense(causal, window, bs):
    rng = np.random.default_rng(1)
    n, d = 13, 3
    X = rand(rng, (2, 3, n, d))  # batch and head axes
    mask = dense_mask(n, causal, window)
    ref = dense_att(*X, 1 / d, mask)
    out = T.attention(*X, causal=causal, window=window, block_size=bs)
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() < 1e-12


def test_forward_scales_and_dtype():
    rng = np.random.default_rng(2)
    n, d = 9, 4
    X = rand(rng, (n, d))
    assert np.abs(T.attention(*X, scale="sqrt") - dense_att(*X, 1 / math.sqrt(d))).max() < 1e-12
    assert np.abs(T.attention(*X, scale=0.7) - dense_att(*X, 0.7)).max() < 1e-12
    out32 = T.attention(*[x.astype(np.float32) for x in X])
    assert out32.dtype == np.float32
    # large logits: the online softmax must not overflow
    Xl = [10 * x for x in X]
    assert np.abs(T.attention(*Xl, scale=1.0, block_size=2) - dense_att(*Xl, 1.0)).max() < 1e-11


def test_rowsum_identity():
    # rowsum(P * (R V^T)) = rowsum(O * R): sum_jk P[i,j,k] <R_i, v1_j*v2_k> = <R_i, O_i>
    rng = np.random.default_rng(3)
    n, d = 7, 3
    X = rand(rng, (n, d))
    E = rng.normal(size=(n, d))
    P = dense_P(*X[:3], 1 / d)
    O = T.attention(*X)
    R = O - E
    RV = np.einsum("it,jt,kt->ijk", R, X[3], X[4])
    assert np.allclose((P * RV).sum(axis=(1, 2)), (O * R).sum(-1), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- exact gradients
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (2, 3))])
def test_grad_finite_differences(causal, window):
    rng = np.random.default_rng(4)
    n, d = 6, 3
    X = rand(rng, (n, d))
    E = rng.normal(size=(n, d))
    mask = dense_mask(n, causal, window)
    s = 1 / d
    loss, g = T.attention_grad(*X, E, causal=causal, window=window, block_size=(4, 5, 3))
    assert abs(loss - dense_loss(X, E, s, mask)) < 1e-12 * max(1, loss)
    for name, x in zip(NAMES, X):
        num = fd_grad(lambda: dense_loss(X, E, s, mask), x)
        assert rel(g[name], num) < 1e-7, name


def test_grad_batch_axes_sum():
    rng = np.random.default_rng(5)
    n, d = 5, 2
    X = rand(rng, (2, n, d))
    E = rng.normal(size=(2, n, d))
    loss, g = T.attention_grad(*X, E, scale="sqrt")
    tot = 0.0
    for b in range(2):
        lb, gb = T.attention_grad(*[x[b] for x in X], E[b], scale="sqrt")
        tot += lb
        for k in NAMES:
            assert np.allclose(g[k][b], gb[k], rtol=1e-13, atol=1e-14)
    assert abs(loss - tot) < 1e-12


def test_grad_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    n, d = 6, 3
    X = rand(rng, (2, n, d))
    E = rng.normal(size=(2, n, d))
    for causal in (False, True):
        loss, g = T.attention_grad(*X, E, causal=causal, scale="sqrt")
        tX = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in X]
        S = torch.einsum("bit,bjt,bkt->bijk", tX[0], tX[1], tX[2]) / math.sqrt(d)
        if causal:
            S = S.masked_fill(~torch.tensor(dense_mask(n, True)), float("-inf"))
        P = torch.softmax(S.reshape(2, n, n * n), dim=-1).reshape(2, n, n, n)
        O = torch.einsum("bijk,bjt,bkt->bit", P, tX[3], tX[4])
        L = 0.5 * ((O - torch.tensor(E)) ** 2).sum()
        L.backward()
        assert abs(loss - L.item()) < 1e-12
        for name, t in zip(NAMES, tX):
            assert rel(g[name], t.grad.numpy()) < 1e-12, name


def x_loss(X, A1, A2, A3, V1, V2, E, s):
    """Dense loss as a function of [C25]'s X (p, p^2): S = s A1 X (A2 (x) A3)^T."""
    n = A1.shape[0]
    S = s * (A1 @ X @ np.kron(A2, A3).T).reshape(n, n, n)
    S = S - S.max(axis=(1, 2), keepdims=True)
    P = np.exp(S)
    P /= P.sum(axis=(1, 2), keepdims=True)
    O = np.einsum("ijk,jt,kt->it", P, V1, V2)
    return 0.5 * float(((O - E) ** 2).sum())


@pytest.mark.parametrize("path", ["exact", "poly"])
def test_weight_and_x_grad_fd(path):
    rng = np.random.default_rng(7)
    n, p, d = 5, 3, 2
    A = rand(rng, (n, p))
    W = T.TensorWeights.random(p, d, seed=1)
    E = rng.normal(size=(n, d))
    s = 1 / d
    kw = dict(path=path, degree=30) if path == "poly" else {}
    loss, g = T.weight_grad(*A, W, E, **kw)
    tol = 1e-7 if path == "exact" else 1e-6  # poly: degree-30 Taylor equals exp to ~1e-16 here

    def wloss():
        return dense_loss([a @ w for a, w in zip(A, W.as_dict().values())], E, s)

    assert abs(loss - wloss()) < 1e-10 * max(1, loss)
    for name, w in W.as_dict().items():
        assert rel(g[name], fd_grad(wloss, w)) < tol, name
    X = W.X()
    V1, V2 = A[3] @ W.W_V1, A[4] @ W.W_V2
    assert abs(x_loss(X, A[0], A[1], A[2], V1, V2, E, s) - loss) < 1e-10 * max(1, loss)
    num = fd_grad(lambda: x_loss(X, A[0], A[1], A[2], V1, V2, E, s), X)
    assert g["X"].shape == (p, p * p)
    assert rel(g["X"], num) < tol


def test_weight_grad_batch_and_causal_x():
    rng = np.random.default_rng(8)
    n, p, d = 6, 2, 3
    A = rand(rng, (2, n, p))
    W = T.TensorWeights.random(p, d, seed=2)
    E = rng.normal(size=(2, n, d))
    loss, g = T.weight_grad(*A, W, E, causal=True)
    tot, gx = 0.0, 0.0
    for b in range(2):
        lb, gb = T.weight_grad(*[a[b] for a in A], W, E[b], causal=True)
        tot, gx = tot + lb, gx + gb["X"]
    assert abs(loss - tot) < 1e-12 and np.allclose(g["X"], gx, rtol=1e-12, atol=1e-14)
    # exact path X gradient also against the poly path at high degree (no mask)
    l1, g1 = T.weight_grad(*A, W, E)
    l2, g2 = T.weight_grad(*A, W, E, path="poly", degree=25)
    assert abs(l1 - l2) < 1e-11
    for k in g1:
        assert rel(g2[k], g1[k]) < 1e-10, k


# ---------------------------------------------------------------- poly fast path
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


def test_poly_auto_degree_and_bounds():
    rng = np.random.default_rng(11)
    n, d = 12, 3
    X = rand(rng, (n, d), scale=0.5)
    B = T.logit_bound(*X[:3])
    assert B >= T.logit_bound(*X[:3], method="exact") > 0
    info = {}
    out = T.poly_attention(*X, degree="auto", tol=1e-9, info=info)
    assert info["out_bound"] <= 1e-9
    assert np.abs(out - T.attention(*X)).max() <= 1e-9
    g = info["degree"]
    assert T.choose_degree(B, d, 1e-9, np.abs(X[3]).max() * np.abs(X[4]).max()) == g


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


# ---------------------------------------------------------------- poly fast path, causal (prefix sums)
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


def test_poly_causal_weight_and_x_grad():
    rng = np.random.default_rng(23)
    n, p, d = 7, 3, 2
    A = rand(rng, (2, n, p), scale=0.4)  # logits inside the degree-3 regime
    W = T.TensorWeights.random(p, d, seed=3)
    E = rng.normal(size=(2, n, d))
    l0, g0 = T.weight_grad(*A, W, E, causal=True)
    for bs in (2, None):
        info = {}
        l1, g1 = T.weight_grad(*A, W, E, causal=True, path="poly", degree=25, info=info, block_size=bs)
        assert info["path"] == "poly" and abs(l1 - l0) < 1e-12 * l0
        for k in g0:  # includes "X", the grad_X prefix-sum formula
            assert rel(g1[k], g0[k]) < 1e-11, (bs, k)
    # low degree: W gradients against finite differences of the causal poly loss
    s = 1 / d
    Wd = W.as_dict()

    def wloss():
        QKV = [a @ w for a, w in zip(A, Wd.values())]
        return 0.5 * float(((T.poly_attention(*QKV, causal=True, degree=3, on_large="raise") - E) ** 2).sum())

    _, g3 = T.weight_grad(*A, W, E, causal=True, path="poly", degree=3, on_large="raise", with_x=False)
    assert s > 0 and "X" not in g3
    for name, w in Wd.items():
        assert rel(g3[name], fd_grad(wloss, w)) < 1e-7, name
    with pytest.raises(NotImplementedError, match="window"):
        T.weight_grad(*A, W, E, window=(2, None), path="poly")


# ---------------------------------------------------------------- validation
def test_validation():
    rng = np.random.default_rng(13)
    X = rand(rng, (5, 3))
    bad = list(X)
    bad[2] = rng.normal(size=(5, 4))
    with pytest.raises(ValueError, match="K2"):
        T.attention(*bad)
    bad = list(X)
    bad[3] = np.ones((5, 3), dtype=np.int64)
    with pytest.raises(TypeError, match="V1"):
        T.attention(*bad)
    bad = list(X)
    bad[4] = X[4].copy()
    bad[4][1, 1] = np.nan
    with pytest.raises(ValueError, match="V2"):
        T.attention(*bad)
    with pytest.raises(ValueError, match="Q"):
        T.attention(np.ones(3), *X[1:])
    with pytest.raises(ValueError, match="E"):
        T.attention_grad(*X, np.ones((4, 3)))
    with pytest.raises(ValueError, match="window"):
        T.attention(*X, window=(0, 2))
    with pytest.raises(ValueError, match="scale"):
        T.attention(*X, scale="bogus")
    with pytest.raises(ValueError, match="degree"):
        T.poly_attention(*X, degree=0)
    with pytest.raises(ValueError, match="path"):
        T.weight_grad(*X, T.TensorWeights.random(3, 3), X[0], path="fast")


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("path,opt", [("exact", "adam"), ("poly", "adam"), ("exact", "gd")])
def test_training_lowers_loss(path, opt):
    rng = np.random.default_rng(14)
    N, n, p, d = 6, 5, 3, 3
    Aqk = 0.3 * rng.normal(size=(N, n, p))  # small logits: the poly path stays in its regime
    Av = rng.normal(size=(N, n, p))
    A = (Aqk, Aqk, Aqk, Av, Av)
    Wt = T.TensorWeights.random(p, d, seed=3)
    E = np.stack([T.attention(*[a[i] @ w for a, w in zip(A, Wt.as_dict().values())]) for i in range(N)])
    W0 = T.TensorWeights.random(p, d, seed=4)
    lr = 0.05 if opt == "adam" else 0.3
    h = T.train(A, E, W0, steps=25, lr=lr, optimizer=opt, path=path, degree=12, batch_size=4, on_large="raise")
    assert len(h["loss"]) == 26 and len(h["time"]) == 26
    assert h["loss"][-1] < 0.5 * h["loss"][0]


def test_training_dask():
    distributed = pytest.importorskip("distributed")
    rng = np.random.default_rng(15)
    N, n, p, d = 4, 4, 2, 2
    A = rng.normal(size=(N, n, p))
    E = rng.normal(size=(N, n, d))
    W0 = T.TensorWeights.random(p, d, seed=5)
    local = T.train(A, E, W0, steps=3, lr=0.05, batch_size=2)
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=":0") as c:
        remote = T.train(A, E, W0, steps=3, lr=0.05, batch_size=2, client=c)
    assert np.allclose(local["loss"], remote["loss"], rtol=1e-12)


# ---------------------------------------------------------------- benchmark smoke
def test_bench_tiny(tmp_path):
    from scaleattn.bench import tensor as bench

    res = bench.run(tmp_path, quick=True, _tiny=True)
    for key in ("timing", "fit", "crossover", "error_vs_degree", "window", "meta"):
        assert key in res
    data = json.loads((tmp_path / "tensor.json").read_text())
    assert set(res) <= set(data)
    assert (tmp_path / "tensor.md").read_text().count("|") > 10
