"""Tensor attention in [C25]'s parameters (DESIGN §8): Q = A1 W_Q, K1 = A2 W_K1, ..., X = W_Q (W_K1 (/) W_K2)^T,
the weight gradients on the exact or polynomial path, and a small trainer (optionally on Dask)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

import numpy as np

from .._backend import as_float64, device_of, get_xp, on_device, to_numpy
from ..errors import ParameterError
from ._common import _NAMES, _flat, _scale, _validate, _window
from .bounds import _LargeLogits, _plan_poly
from .exact import _block_sizes, _exact_backward, _exact_forward
from .poly import _large, _poly_args, _poly_core

__all__ = ["khatri_rao", "TensorWeights", "weight_grad", "train"]


# ----------------------------------------------------------------------------------------------------------------
# parameters, X and weight gradients
# ----------------------------------------------------------------------------------------------------------------
def khatri_rao(A, B):
    """Column-wise Khatri-Rao product A (/) B: (p, d), (q, d) -> (p*q, d), row b*q + c = A[b] * B[c].

    The product of [C25]'s ``Att = D^-1 A (V1 (/) V2)`` and ``X = W_Q (W_K1 (/) W_K2)^T``; the fast path rests on
    ``(A (/) B)^T (C (/) D) = (A^T C) * (B^T D)`` (DESIGN §8).

    Parameters
    ----------
    A : array (p, d)
        Numpy or any array API array.
    B : array (q, d)
        Same namespace and device as ``A``.

    Returns
    -------
    array (p*q, d), the common dtype of ``A`` and ``B``

    Raises
    ------
    DeviceMismatchError
        ``A`` and ``B`` of different libraries or devices.

    Examples
    --------
    >>> import numpy as np
    >>> A, B, C, D = np.random.default_rng(0).standard_normal((4, 3, 2))
    >>> khatri_rao(A, B).shape, bool(np.allclose(khatri_rao(A, B).T @ khatri_rao(C, D), (A.T @ C) * (B.T @ D)))
    ((9, 2), True)
    """
    xp = get_xp(A, B)
    return xp.reshape(A[:, None, :] * B[None, :, :], (A.shape[0] * B.shape[0], A.shape[1]))


@dataclass
class TensorWeights:
    """Weights of one tensor-attention head: Q = A1 W_Q, K1 = A2 W_K1, K2 = A3 W_K2, V1 = A4 W_V1, V2 = A5 W_V2.

    Each is (p, d) (p = input width, d = attention width). ``X()`` is [C25]'s X = W_Q (W_K1 (/) W_K2)^T (p, p^2)
    (DESIGN §8).

    Parameters
    ----------
    W_Q, W_K1, W_K2, W_V1, W_V2 : array (p, d), float
        The five projections; numpy or any array API arrays (:func:`weight_grad` moves host weights to the
        inputs' device; :func:`train` works on numpy float64 copies).

    See Also
    --------
    weight_grad, train : gradients and training of these weights.

    Examples
    --------
    >>> W = TensorWeights.random(p=3, d=2, seed=0)
    >>> W.W_Q.shape, W.X().shape, sorted(W.as_dict())
    ((3, 2), (3, 9), ['W_K1', 'W_K2', 'W_Q', 'W_V1', 'W_V2'])
    """

    W_Q: object
    W_K1: object
    W_K2: object
    W_V1: object
    W_V2: object

    def X(self):
        """[C25]'s ``X = W_Q (W_K1 (/) W_K2)^T`` (p, p^2): ``X[a, b*p + c] = sum_t W_Q[a,t] W_K1[b,t] W_K2[c,t]``."""
        return self.W_Q @ khatri_rao(self.W_K1, self.W_K2).T

    def as_dict(self):
        """The five weights by name (``"W_Q"``, ...)."""
        return {fl.name: getattr(self, fl.name) for fl in fields(self)}

    @classmethod
    def random(cls, p, d, *, scale=1.0, seed=0):
        """Gaussian N(0, scale^2/p) weights (numpy float64)."""
        rng = np.random.default_rng(seed)
        return cls(*[rng.normal(0.0, scale / math.sqrt(p), (p, d)) for _ in range(5)])


_WNAMES = ("W_Q", "W_K1", "W_K2", "W_V1", "W_V2")


def weight_grad(A1, A2, A3, A4, A5, W, E, scale=None, causal=False, window=None, *, path="exact", degree="auto",
                tol=None, on_large="exact", with_x=True, info=None, block_size=None):
    """Loss and gradients w.r.t. the weights and [C25]'s X for one or a batch of sequences.

    L = 1/2 sum over batch of ||Att - E||_F^2, Att computed from Q = A1 W_Q, ..., V2 = A5 W_V2 with scale s
    (default 1/d). The weight gradients follow by the chain rule (dW_Q = sum A1^T dQ, ...); "X" (p, p^2) =
    s A1^T F (A2 (x) A3) summed over the batch ([C25] §4; DESIGN §8) is the gradient of L as a function of X
    (row a, column b*p + c). Inputs and weights are used in float64; outputs are float64.

    Parameters
    ----------
    A1, A2, A3, A4, A5 : array (..., n, p), float32/float64
        Inputs of the five projections (one shape, namespace and device; self-attention: pass the same array
        five times).
    W : TensorWeights
        (p, d) weights; host (numpy) weights are moved to the inputs' device.
    E : array (..., n, d), float
        Target of the attention output.
    scale, causal, window, block_size
        As in :func:`attention`.
    path : ``"exact"`` or ``"poly"``
        The streamed exact attention (any mask) or the Taylor fast path (``causal=True`` supported, grad_X
        included, a finite window raises NotImplementedError).
    degree, tol, on_large, info
        Of the ``"poly"`` path, as in :func:`poly_attention_grad` (``info`` without ``grad_bound``).
    with_x : bool
        Also return the gradient with respect to X.

    Returns
    -------
    loss : float
        ``1/2 sum ||Att - E||_F^2`` over the batch.
    grads : dict of str to array
        ``"W_Q"``, ... (p, d) float64, and ``"X"`` (p, p^2) float64 when ``with_x``; in the inputs' namespace.

    Raises
    ------
    TypeError
        ``W`` not a :class:`TensorWeights`; as :func:`attention` for the arrays.
    ParameterError
        A bad ``path`` or ``on_large``; weights not all (p, d); inputs whose width is not p; ``E`` not
        (..., n, d); as :func:`attention`; with ``on_large="raise"``, logits outside the polynomial regime.
    UnsupportedError
        A finite window on the ``"poly"`` path.

    See Also
    --------
    attention_grad : the gradients with respect to Q, K1, K2, V1, V2.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> A, E, W = rng.standard_normal((8, 3)), rng.standard_normal((8, 2)), TensorWeights.random(p=3, d=2, seed=1)
    >>> loss, g = weight_grad(A, A, A, A, A, W, E)  # self-attention: the same input five times
    >>> g["X"].shape, bool(np.allclose(g["W_Q"], g["X"] @ khatri_rao(W.W_K1, W.W_K2)))  # dL/dW_Q through X
    ((3, 9), True)
    """
    if path not in ("exact", "poly"):
        raise ParameterError(f"path must be 'exact' or 'poly', got {path!r}")
    if not isinstance(W, TensorWeights):
        raise TypeError(f"W must be a TensorWeights, got {type(W).__name__}")
    xp, A, _ = _validate({"A1": A1, "A2": A2, "A3": A3, "A4": A4, "A5": A5})
    _, Wd, _ = _validate(W.as_dict())  # host weights are moved to the inputs' device
    Wd = {k: as_float64(on_device(v, xp, device_of(A["A1"])), xp) for k, v in Wd.items()}
    if any(w.ndim != 2 or w.shape != Wd["W_Q"].shape for w in Wd.values()):
        raise ParameterError("all weights must be 2-d with the same shape (p, d)")
    p, d = Wd["W_Q"].shape
    shape = A["A1"].shape
    if shape[-1] != p:
        raise ParameterError(f"A1..A5 have width {shape[-1]} but the weights expect p = {p}")
    n = shape[-2]
    Bt = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
    Af = {k: _flat(v, xp, Bt, n, p) for k, v in A.items()}
    _, Ev, _ = _validate({"E": E})
    get_xp(A["A1"], Ev["E"])  # the target on the inputs' device (DeviceMismatchError otherwise)
    if tuple(Ev["E"].shape) != tuple(shape[:-1]) + (d,):
        raise ParameterError(f"E has shape {tuple(Ev['E'].shape)}, expected {tuple(shape[:-1]) + (d,)}")
    f = {nm: xp.matmul(Af[a], Wd[w]) for nm, a, w in zip(_NAMES, ("A1", "A2", "A3", "A4", "A5"), _WNAMES)}
    f["E"] = _flat(Ev["E"], xp, Bt, n, d)
    s = _scale(scale, d)
    masked, w1, w2 = _window(window, causal)
    xargs = (Af["A1"], Af["A2"], Af["A3"]) if with_x else None
    gX = None
    if path == "poly":
        if on_large not in ("exact", "raise"):
            raise ParameterError(f"on_large must be 'exact' or 'raise', got {on_large!r}")
        _poly_args(on_large, causal, window)  # causal is supported (with grad_X), finite windows are not
        try:
            plan = _plan_poly(f, s, xp, degree, tol, max_degree=40, max_rank=200_000)
            res = _poly_core(f, s, plan["degree"], xp, True, block_size, xargs, causal=masked)
            if not (res["minD"] > 0 and math.isfinite(res["minD"])):
                raise _LargeLogits(f"approximate row sum {res['minD']:.3g} <= 0 at degree {plan['degree']}")
            loss, g, gX = res["loss"], res["grads"], res.get("gX")
            if info is not None:
                info.update(path="poly", min_rowsum=res["minD"], **{k: v for k, v in plan.items() if k != "vmax"})
        except _LargeLogits as exc:
            _large(str(exc), on_large, info)
            path = "exact"
    if path == "exact":
        if info is not None:
            info.setdefault("path", "exact")
        bs = _block_sizes(n, Bt, masked, w1, w2, block_size)
        args = tuple(f[k] for k in _NAMES)
        O, lse = _exact_forward(*args, s, masked, w1, w2, bs, xp)
        R = O - f["E"]
        loss = 0.5 * float(xp.sum(R * R))
        g, gX = _exact_backward(*args, O, lse, R, s, masked, w1, w2, bs, xp, xargs)
    grads = {w: xp.matmul(xp.reshape(Af[a], (Bt * n, p)).T, xp.reshape(g[nm], (Bt * n, d)))  # sum_b A_b^T dQ_b
             for nm, a, w in zip(_NAMES, ("A1", "A2", "A3", "A4", "A5"), _WNAMES)}
    if with_x:
        grads["X"] = xp.reshape(gX, (p, p * p))
    return loss, grads


# ----------------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------------
def _batch_grad(batch, W, kw):
    """Worker function (top level so Dask can pickle it): sum of loss and weight gradients over one batch."""
    A, E = batch
    loss, g = weight_grad(*A, W, E, with_x=False, **kw)
    return loss, {k: to_numpy(v) for k, v in g.items()}


def train(A, E, W0, *, steps=100, lr=1e-2, optimizer="adam", path="exact", degree="auto", tol=None,
          on_large="exact", scale=None, causal=False, window=None, batch_size=None, client=None,
          betas=(0.9, 0.999), adam_eps=1e-8, callback=None):
    """Full-batch gradient descent or Adam on the weights W = (W_Q, W_K1, W_K2, W_V1, W_V2).

    (X = W_Q (W_K1 (/) W_K2)^T of [C25] is trained through its factors; ``weight_grad`` also gives grad_X.)

    The objective is the mean over the N sequences of 1/2 ||Att - E||_F^2. Each step sums per-batch gradients over
    ``batch_size`` sequences (all N if None); with a ``distributed.Client`` the batches are scattered once and the
    per-batch gradients are computed with ``client.map`` and summed here, else locally.

    Parameters
    ----------
    A : array (N, n, p) or tuple of five (N, n, p) arrays, float
        Inputs (self-attention: A1 = ... = A5 = A); device arrays are copied to the host.
    E : array (N, n, d), float
        Targets.
    W0 : TensorWeights
        Starting weights (p, d), not modified.
    steps : int
        Optimizer steps.
    lr : float
        Learning rate.
    optimizer : ``"adam"`` or ``"gd"``
        Adam (with ``betas``, ``adam_eps``) or plain gradient descent.
    path, degree, tol, on_large, scale, causal, window
        As in :func:`weight_grad`.
    batch_size : int, optional
        Sequences per gradient task (all N by default); every step uses all N sequences.
    client : distributed.Client, optional
        Computes the per-batch gradients on a Dask cluster.
    betas : (float, float)
        Adam's moment decay rates.
    adam_eps : float
        Adam's denominator guard.
    callback : callable, optional
        Called as ``callback(step, loss, weights)`` after each step (the loss before it, the new weights).

    Returns
    -------
    dict
        ``weights`` (TensorWeights of (p, d) float64 numpy arrays), ``loss`` (steps + 1 floats: before each step
        and after the last), ``time`` (cumulative wall seconds at each loss value), ``grad_norm`` (per step).

    Raises
    ------
    ParameterError
        A bad ``optimizer`` or ``path``; ``A`` not one array or five; shapes not (N, n, p) and (N, n, d) with one
        N; ``batch_size`` < 1; as :func:`weight_grad`.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> A, E = rng.standard_normal((4, 6, 3)), rng.standard_normal((4, 6, 2))
    >>> out = train(A, E, TensorWeights.random(p=3, d=2), steps=20, lr=0.05)
    >>> len(out["loss"]), out["loss"][-1] < out["loss"][0], out["weights"].W_Q.shape
    (21, True, (3, 2))
    """
    if optimizer not in ("adam", "gd"):
        raise ParameterError(f"optimizer must be 'adam' or 'gd', got {optimizer!r}")
    if path not in ("exact", "poly"):
        raise ParameterError(f"path must be 'exact' or 'poly', got {path!r}")
    As = tuple(A) if isinstance(A, (tuple, list)) else (A,) * 5
    if len(As) != 5:
        raise ParameterError(f"A must be one array or a tuple of five arrays, got {len(As)}")
    As = tuple(np.asarray(to_numpy(a), dtype=np.float64) for a in As)
    E = np.asarray(to_numpy(E), dtype=np.float64)
    if As[0].ndim != 3 or E.ndim != 3 or E.shape[0] != As[0].shape[0]:
        raise ParameterError(f"A must be (N, n, p) and E (N, n, d) with the same N; got {As[0].shape}, {E.shape}")
    N = E.shape[0]
    bsz = N if batch_size is None else int(batch_size)
    if bsz < 1:
        raise ParameterError(f"batch_size must be >= 1, got {batch_size}")
    batches = [(tuple(a[i:i + bsz] for a in As), E[i:i + bsz]) for i in range(0, N, bsz)]
    kw = dict(scale=scale, causal=causal, window=window, path=path, degree=degree, tol=tol, on_large=on_large)
    if client is not None:
        try:  # lazy: distributed is optional
            import distributed  # noqa: F401
        except ImportError:
            pass  # a duck-typed client (submit/map/gather/scatter) still works
        remote = client.scatter(batches)

    def full_grad(Wc):
        if client is None:
            parts = [_batch_grad(bt, Wc, kw) for bt in batches]
        else:
            parts = client.gather(client.map(_batch_grad, remote, W=Wc, kw=kw, pure=False))
        loss = sum(pt[0] for pt in parts) / N
        g = {k: sum(pt[1][k] for pt in parts) / N for k in _WNAMES}
        return loss, g

    W = {k: np.array(to_numpy(v), dtype=np.float64) for k, v in W0.as_dict().items()}
    m = {k: np.zeros_like(v) for k, v in W.items()}
    v2 = {k: np.zeros_like(v) for k, v in W.items()}
    b1, b2 = betas
    hist = {"loss": [], "time": [], "grad_norm": []}
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        loss, g = full_grad(TensorWeights(**W))
        hist["loss"].append(loss)
        hist["time"].append(time.perf_counter() - t0)
        hist["grad_norm"].append(float(math.sqrt(sum(float((gk * gk).sum()) for gk in g.values()))))
        for k in W:
            if optimizer == "gd":
                W[k] = W[k] - lr * g[k]
            else:
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v2[k] = b2 * v2[k] + (1 - b2) * g[k] * g[k]
                mh, vh = m[k] / (1 - b1 ** step), v2[k] / (1 - b2 ** step)
                W[k] = W[k] - lr * mh / (np.sqrt(vh) + adam_eps)
        if callback is not None:
            callback(step, loss, TensorWeights(**W))
    loss, _ = full_grad(TensorWeights(**W))
    hist["loss"].append(loss)
    hist["time"].append(time.perf_counter() - t0)
    hist["weights"] = TensorWeights(**W)
    return hist
