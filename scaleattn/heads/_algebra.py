"""From coefficients to attention heads and back ([Y25] Algorithm 1; DESIGN §2, §5).

``W[a, j, k, l] = sum_h V_h[a, j] Q_h[k, l]`` viewed as a (d_out*d, d*d) matrix; the data see only the
symmetrised coefficients ``c = p(W)`` (DESIGN §2). Heads are rank-one terms of W.

- :func:`coef_from_heads`: ``c(Theta)`` of a model, the paper's ``p(Theta)`` (Cor. 2.4, eq. 15's argument).
- :func:`svd_heads`: the paper's Algorithm 1 heads: split off-diagonal coefficients in half, SVD.
- :func:`rank_r_heads`: alternating projections onto ``{W : p(W) = c}`` at rank r (DESIGN §5).
- The search for the fewest heads, the loss-versus-heads curve and the lower bounds on the head count are in
  :mod:`scaleattn.heads._search` (after this module).
- :func:`compare_models`: distance ``||c(Theta) - c(Theta')||_F`` (eq. 15) and a function-equivalence verdict.
Layer L2.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._params import real
from ..errors import ParameterError
from ..features import coef_distance, n_pairs, triu_index

__all__ = ["Heads", "coef_to_W", "coef_from_W", "coef_from_heads", "coef_distance", "svd_heads", "rank_r_heads",
           "compare_models", "FEWER_HEADS_RTOL"]


#: a loss curve "flattens" at the fewest heads within this relative gap of the returned model's loss: the summary
#: then suggests ``--heads k`` (:meth:`Heads.fewer_within`); relative, so independent of the number of rows
FEWER_HEADS_RTOL = 0.02


def _shape(coef, d):
    coef = np.asarray(coef, dtype=np.float64)
    m = n_pairs(d)
    if coef.shape[0] != m * d:
        raise ParameterError(f"coef has {coef.shape[0]} rows, expected psi = {m * d} for d = {d}")
    return coef.reshape(m, d, -1)


def coef_to_W(coef, d: int) -> np.ndarray:
    """Symmetric-split W (d_out*d, d*d) of coefficients (psi, d_out) ([Y25] Alg. 1 step 3; DESIGN §5).

    ``W[a,j,k,l] = W[a,k,j,l] = c[(j,k),l] / 2`` for ``j < k`` and ``W[a,j,j,l] = c[(j,j),l]``.

    Parameters
    ----------
    coef : array (psi, d_out), float
        Coefficients, ``psi = d^2(d+1)/2`` (DESIGN §2).
    d : int
        Token dimension.

    Returns
    -------
    ndarray (d_out*d, d*d), float64
        Row ``a*d + j``, column ``k*d + l``; ``coef_from_W(coef_to_W(c, d), d, d_out) == c``.

    Raises
    ------
    ParameterError
        ``coef`` does not have psi rows.

    See Also
    --------
    coef_from_W : the inverse map ``p(W)``.
    svd_heads : heads from the SVD of this W.

    Examples
    --------
    >>> import numpy as np
    >>> c = np.arange(12.0).reshape(6, 2)
    >>> W = coef_to_W(c, d=2)
    >>> W.shape, bool(np.array_equal(coef_from_W(W, 2, 2), c))
    ((4, 4), True)
    """
    c = _shape(coef, d)  # (m, d, d_out)
    I, J, _ = triu_index(d)
    half = np.where(I == J, 1.0, 0.5)[:, None, None] * c
    W = np.zeros((c.shape[2], d, d, d))  # [a, j, k, l]
    W[:, I, J, :] = np.moveaxis(half, 2, 0)
    W[:, J, I, :] = np.moveaxis(half, 2, 0)
    return W.reshape(c.shape[2] * d, d * d)


def coef_from_W(W, d: int, d_out: int) -> np.ndarray:
    """``c = p(W)`` (psi, d_out): ``c[(j,k),l,a] = W[a,j,k,l] + W[a,k,j,l]`` (j < k), ``W[a,j,j,l]`` (j = k).

    What the data see of ``W[a,j,k,l] = sum_h V_h[a,j] Q_h[k,l]`` ([Y25] Cor. 2.4, eq. 15's ``p``; DESIGN §2).

    Parameters
    ----------
    W : array (d_out*d, d*d), float
        Row ``a*d + j``, column ``k*d + l``.
    d, d_out : int
        Token and output dimensions.

    Returns
    -------
    ndarray (psi, d_out), float64 (for float ``W``)
        The symmetrised coefficients, ``psi = d^2(d+1)/2``.

    Raises
    ------
    ValueError
        ``W`` does not have ``d_out * d^3`` entries (numpy's reshape error).

    Examples
    --------
    >>> import numpy as np
    >>> W = np.zeros((1, 2, 2, 2))  # [a, j, k, l]
    >>> W[0, 0, 1, :], W[0, 1, 0, :] = 3.0, -1.0  # only the sum over (j, k) <-> (k, j) is seen
    >>> coef_from_W(W.reshape(2, 4), d=2, d_out=1).ravel()
    array([0., 0., 2., 2., 0., 0.])
    """
    W4 = np.asarray(W).reshape(d_out, d, d, d)
    I, J, _ = triu_index(d)
    sym = W4[:, I, J, :] + np.where(I != J, 1.0, 0.0)[None, :, None] * W4[:, J, I, :]  # (a, m, l)
    return np.moveaxis(sym, 0, 2).reshape(-1, d_out)


def coef_from_heads(V, Q) -> np.ndarray:
    """Coefficients ``c(Theta)`` of a model's heads, the paper's ``p(Theta)`` (DESIGN §2).

    Two models compute the same function iff their coefficients agree ([Y25] Cor. 2.4).

    Parameters
    ----------
    V : array (H, d_out, d) float
        Value/output matrices of the heads.
    Q : array (H, d, d) float
        Fused key-query matrices.

    Returns
    -------
    ndarray (psi, d_out) float64
        ``c[(j,k),l,a] = sum_h V_h[a,j] Q_h[k,l] + V_h[a,k] Q_h[j,l]`` (j < k), ``sum_h V_h[a,j] Q_h[j,l]`` (j = k).

    Raises
    ------
    ValueError
        ``V`` and ``Q`` of inconsistent shapes (numpy's error).

    See Also
    --------
    svd_heads : heads from coefficients (the inverse direction).
    scaleattn.coef_distance : the paper's distance between two coefficient vectors (eq. 15).

    Examples
    --------
    >>> import numpy as np
    >>> coef_from_heads(np.ones((1, 1, 2)), np.eye(2)[None]).ravel()
    array([1., 0., 1., 1., 0., 1.])
    """
    V, Q = np.asarray(V, np.float64), np.asarray(Q, np.float64)
    H, d_out, d = V.shape
    W = np.einsum("haj,hkl->ajkl", V, Q).reshape(d_out * d, d * d)
    return coef_from_W(W, d, d_out)


def _fold(U, s, Vt, d, d_out):
    r = s.size
    root = np.sqrt(s)
    V = (U[:, :r] * root).T.reshape(r, d_out, d)
    Q = (Vt[:r].T * root).T.reshape(r, d, d)
    return V, Q


@dataclasses.dataclass
class Heads:
    """Attention heads of a model found from its coefficients ([Y25] Alg. 1; DESIGN §5).

    Heads ``V`` (H, d_out, d), ``Q`` (H, d, d) with the singular values of the symmetric-split W
    (``spectrum``, [Y25] Alg. 1) and the relative residual ``||c(V, Q) - c|| / ||c||`` of the coefficients
    they reproduce; the search fields are set by :func:`scaleattn.heads._search.search_heads` (DESIGN §5).

    Attributes
    ----------
    V : ndarray (H, d_out, d), float64
        Value/output matrices of the heads.
    Q : ndarray (H, d, d), float64
        Fused key-query matrices.
    spectrum : ndarray (min(d_out*d, d*d),), float64
        Singular values, descending, of the symmetric-split W (of the last iterate for :func:`rank_r_heads`).
    residual : float
        ``||c(V, Q) - c|| / ||c||`` (0 for exact heads, up to round-off).
    method : str
        ``"svd"``, ``"rank-r"``, or the search's (``"minimal"``, ``"best-H"``, ``"fit-H"``, ``"loss-H"``).
    n_heads : int
        ``H``; the other fields (``sse``, ``curve``, ``exact``, the bounds, ...) are commented in the class body.

    See Also
    --------
    svd_heads, scaleattn.search_heads : make them.
    coef_from_heads : the coefficients they compute.

    Examples
    --------
    >>> import numpy as np
    >>> h = svd_heads(coef_from_heads(np.ones((1, 1, 2)), np.eye(2)[None]), d=2)
    >>> h.n_heads, h.residual < 1e-12
    (2, True)
    """

    V: np.ndarray
    Q: np.ndarray
    spectrum: np.ndarray
    residual: float
    method: str
    #: training sum of squared residuals of these heads from the statistics (None when not computed)
    sse: float | None = None
    #: loss-versus-heads curve: ``[(H, loss), ...]`` for each head count tried, non-increasing in H; the loss is
    #: the training sum of squares, plus the penalty ``ridge * sum_j G_jj c_j^2`` when ``ridge`` > 0
    curve: list = dataclasses.field(default_factory=list)
    #: whether the heads reproduce the coefficients to the search tolerance (None when not searched)
    exact: bool | None = None
    #: the curve's loss of the heads minus that of the coefficients (0 up to round-off when exact)
    loss_gap: float | None = None
    #: the scaled ridge of the fit the heads were searched for (its objective is the curve's loss)
    ridge: float = 0.0
    #: no model with fewer heads reproduces the coefficients, by a bound of kind ``lower_bound_kind``
    lower_bound: int | None = None
    #: ``"flattening rank (every c)"`` (holds for any coefficients) or ``"dimension count (generic data)"``
    #: (holds for almost every coefficient vector, e.g. data with noise)
    lower_bound_kind: str | None = None
    #: the two bounds: flattening ranks (every c) and the dimension count (generic c)
    bound_every_c: int | None = None
    bound_generic: int | None = None
    #: the search stopped at its time budget (the heads are the best found by then)
    budget_exhausted: bool = False
    #: seconds the search took
    seconds: float | None = None

    @property
    def n_heads(self) -> int:
        return int(self.V.shape[0])

    @property
    def meets_bound(self) -> bool:
        """Exact heads whose count equals the lower bound: no fewer heads can do (for the bound's kind)."""
        return bool(self.exact) and self.lower_bound is not None and self.n_heads == self.lower_bound

    def fewer_within(self, floor: float = 0.0, rtol: float = FEWER_HEADS_RTOL) -> dict | None:
        """The fewest heads on the loss curve within ``rtol`` (relative) of the loss of these heads, when fewer.

        ``{"heads": k, "relative_gap": (loss_k - loss) / loss, "rtol": rtol}`` for the smallest ``k < n_heads``
        of ``curve`` with that gap at most ``rtol``; None when there is none, or the loss is at most ``floor``
        (its round-off, in the curve's units: a relative gap of round-off means nothing). ``rtol`` is relative to
        the loss, so it does not depend on the number of rows (report key ``heads_fewer_within``).

        Examples
        --------
        >>> h = Heads(np.zeros((4, 1, 1)), np.zeros((4, 1, 1)), np.zeros(0), 0.0, "minimal",
        ...           curve=[(1, 5.0), (2, 1.01), (3, 1.001), (4, 1.0)])
        >>> h.fewer_within()
        {'heads': 2, 'relative_gap': 0.01, 'rtol': 0.02}
        """
        if len(self.curve) < 2:
            return None
        k_last, last = self.curve[-1]
        if not last > max(floor, 0.0):
            return None
        for k, loss in self.curve:
            if k < k_last and loss - last <= rtol * last:
                return {"heads": int(k), "relative_gap": round(float((loss - last) / last), 12), "rtol": float(rtol)}
        return None


def svd_heads(coef, d: int, rtol: float = 1e-12) -> Heads:
    """Heads by SVD of the symmetric-split W ([Y25] Alg. 1; DESIGN §5).

    ``V_r = fold(sqrt(sigma_r) u_r)``, ``Q_r = fold(sqrt(sigma_r) v_r)``, keeping ``sigma_r > rtol * sigma_1``.

    Parameters
    ----------
    coef : array (psi, d_out) float
        Coefficients (e.g. ``solve(stats).coef``).
    d : int
        Token dimension.
    rtol : float
        Relative singular-value cutoff.

    Returns
    -------
    Heads
        Up to ``min(d_out*d, d^2)`` heads (often more than needed: the symmetric split raises the rank;
        :func:`scaleattn.search_heads` finds the fewest), with ``spectrum`` the singular values of W.

    Raises
    ------
    ParameterError
        ``coef`` does not have psi = d^2(d+1)/2 rows.

    See Also
    --------
    scaleattn.search_heads : the fewest heads, with a lower bound.

    Examples
    --------
    >>> import numpy as np
    >>> V, Q = np.ones((1, 2, 2)), np.eye(2)[None]
    >>> h = svd_heads(coef_from_heads(V, Q), d=2)
    >>> h.n_heads, bool(np.allclose(coef_from_heads(h.V, h.Q), coef_from_heads(V, Q)))
    (2, True)
    """
    coef = np.asarray(coef, np.float64)
    d_out = coef.shape[1]
    W = coef_to_W(coef, d)
    U, s, Vt = np.linalg.svd(W, full_matrices=False)
    r = int((s > rtol * s[0]).sum()) if s.size and s[0] > 0 else 0
    V, Q = _fold(U, s[:r], Vt, d, d_out)
    return Heads(V, Q, s, _residual(V, Q, coef), "svd")


def _residual(V, Q, coef) -> float:
    ref = np.linalg.norm(coef)
    if V.shape[0] == 0:
        return 1.0 if ref > 0 else 0.0
    return float(np.linalg.norm(coef_from_heads(V, Q) - coef) / max(ref, 1e-300))


def _project_affine(W, coef, d, d_out):
    """Closest W' (Frobenius) with p(W') = coef: shift each symmetric pair by half its defect."""
    defect = coef_from_W(W, d, d_out) - coef  # (psi, d_out)
    I, J, _ = triu_index(d)
    dm = np.moveaxis(defect.reshape(-1, d, d_out), 2, 0)  # (a, m, l)
    W4 = W.reshape(d_out, d, d, d).copy()
    o = I != J
    corr = np.where(o[None, :, None], dm / 2, dm)
    W4[:, I, J, :] -= corr
    W4[:, J[o], I[o], :] -= corr[:, o, :]
    return W4.reshape(d_out * d, d * d)


_STALL = 50


def rank_r_heads(coef, d: int, r: int, iters: int = 500, tol: float = 1e-13, W0=None) -> Heads:
    """Best r-head model found by alternating projections (DESIGN §5, beyond [Y25]).

    The projections alternate between rank-r matrices (truncated SVD) and the affine set ``{W : p(W) = coef}``.
    Returns the rank-r heads of the last iterate; their residual is 0 (to ``tol``) when r heads can represent the
    function exactly. They can stall short of an exact model that exists (DESIGN §5):
    :func:`scaleattn.search_heads` is the reliable search.

    Parameters
    ----------
    coef : array (psi, d_out), float
        Coefficients.
    d : int
        Token dimension.
    r : int
        Number of heads.
    iters : int
        Most projection sweeps.
    tol : float
        Stop when the relative residual ``||p(W_r) - coef|| / ||coef||`` is at most this.
    W0 : array (d_out*d, d*d), float, optional
        Start; default the symmetric split :func:`coef_to_W`.

    Returns
    -------
    Heads
        ``min(r, d_out*d, d*d)`` heads, ``method = "rank-r"``.

    Raises
    ------
    ParameterError
        ``coef`` does not have psi = d^2(d+1)/2 rows.

    See Also
    --------
    svd_heads : all the heads of the symmetric split, no search.

    Examples
    --------
    >>> import numpy as np
    >>> c = coef_from_heads(np.ones((1, 2, 2)), np.eye(2)[None])  # one head
    >>> svd_heads(c, d=2).n_heads, rank_r_heads(c, d=2, r=1).residual < 1e-12
    (2, True)
    """
    coef = np.asarray(coef, np.float64)
    d_out = coef.shape[1]
    W = coef_to_W(coef, d) if W0 is None else W0
    ref = max(np.linalg.norm(coef), 1e-300)
    history = []
    for it in range(iters):
        U, s, Vt = np.linalg.svd(W, full_matrices=False)
        Wr = (U[:, :r] * s[:r]) @ Vt[:r]
        res = np.linalg.norm(coef_from_W(Wr, d, d_out) - coef) / ref
        history.append(res)
        # stop when feasible, or stalled (< 1% progress in 50 sweeps: a rate that could not reach tol anyway)
        if res <= tol or (it >= _STALL and res > 0.99 * history[it - _STALL]):
            break
        W = _project_affine(Wr, coef, d, d_out)
    V, Q = _fold(U, s[:r], Vt, d, d_out)
    return Heads(V, Q, s, _residual(V, Q, coef), f"rank-{r}")


def compare_models(model_a, model_b, rtol: float = 1e-8) -> dict:
    """Distance ``||c(Theta_a) - c(Theta_b)||_F`` of two models' heads ([Y25] eq. 15; DESIGN §2), and a verdict.

    ``equivalent``: whether they compute the same function on every input of every length ([Y25] Cor. 2.4).

    Parameters
    ----------
    model_a, model_b : MHLAModel
        Models of the same ``(d, d_out)`` (any head counts).
    rtol : float
        ``equivalent`` when the distance is at most ``rtol`` x the larger coefficient norm.

    Returns
    -------
    dict
        ``d``, ``d_out``, ``n_heads_a``, ``n_heads_b``, ``distance``, ``relative_distance``,
        ``coef_distance`` (of the stored coefficients, what ``predict`` uses), ``rtol``, ``equivalent``.

    Raises
    ------
    ParameterError
        The models have different ``(d, d_out)``; ``rtol`` is not a finite number > 0 (a negative or NaN one
        called two identical models different).

    See Also
    --------
    scaleattn.coef_distance : the same distance for coefficient arrays.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn import MHLAModel
    >>> V, Q = np.ones((1, 1, 2)), np.eye(2)[None]
    >>> a = MHLAModel(coef_from_heads(V, Q), V, Q, d=2)
    >>> h = svd_heads(a.coef, d=2)  # other heads, same function
    >>> compare_models(a, MHLAModel(a.coef, h.V, h.Q, d=2))["equivalent"]
    True
    """
    rtol = real("rtol", rtol, 0.0, low_open=True)
    if (model_a.d, model_a.d_out) != (model_b.d, model_b.d_out):
        raise ParameterError(f"models have (d, d_out) = {(model_a.d, model_a.d_out)} and"
                             f" {(model_b.d, model_b.d_out)}: they do not map the same inputs to the same outputs")
    ca, cb = coef_from_heads(model_a.V, model_a.Q), coef_from_heads(model_b.V, model_b.Q)
    dist = coef_distance(ca, cb)
    norm = max(float(np.linalg.norm(ca)), float(np.linalg.norm(cb)))
    return {"d": model_a.d, "d_out": model_a.d_out, "n_heads_a": model_a.n_heads, "n_heads_b": model_b.n_heads,
            "distance": dist, "relative_distance": dist / norm if norm > 0 else 0.0,
            "coef_distance": coef_distance(model_a.coef, model_b.coef), "rtol": rtol,
            "equivalent": bool(dist <= rtol * norm)}
