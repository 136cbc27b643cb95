"""Independent dense references for the tensor-attention tests: the softmax over all (j, k) pairs written out
with einsum, finite differences, and the loss as a function of [C25]'s X."""
import numpy as np

from tests.helpers import rel_err

NAMES = ("Q", "K1", "K2", "V1", "V2")


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
    """Max-abs relative error (``tests.helpers.rel_err`` with ``ord=inf``)."""
    return rel_err(a, b, np.inf)


def x_loss(X, A1, A2, A3, V1, V2, E, s):
    """Dense loss as a function of [C25]'s X (p, p^2): S = s A1 X (A2 (x) A3)^T."""
    n = A1.shape[0]
    S = s * (A1 @ X @ np.kron(A2, A3).T).reshape(n, n, n)
    S = S - S.max(axis=(1, 2), keepdims=True)
    P = np.exp(S)
    P /= P.sum(axis=(1, 2), keepdims=True)
    O = np.einsum("ijk,jt,kt->it", P, V1, V2)
    return 0.5 * float(((O - E) ** 2).sum())
