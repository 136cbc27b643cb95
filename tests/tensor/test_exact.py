"""Exact tensor attention: forward against the dense softmax, gradients against finite differences and torch
autograd (DESIGN §8). Dense references (tests/tensor/reference.py) are written independently of the package."""
import math

import numpy as np
import pytest

from scaleattn import tensor as T
from tests.tensor.reference import NAMES, dense_att, dense_loss, dense_mask, dense_P, fd_grad, rand, rel


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
