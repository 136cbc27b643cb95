"""Tensor-attention weights: gradients of the weights and of X against finite differences, batch and causal;
training lowers the loss, locally and on Dask alike (DESIGN §8). Dense references (tests/tensor/reference.py) are
written independently of the package."""

import numpy as np
import pytest

from scaleattn import tensor as T
from tests.tensor.reference import dense_loss, fd_grad, rand, rel, x_loss


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
