"""From coefficients to attention heads and back ([Y25] Algorithm 1; DESIGN §2, §5).

``W[a, j, k, l] = sum_h V_h[a, j] Q_h[k, l]`` viewed as a (d_out*d, d*d) matrix; the data see only the
symmetrised coefficients ``c = p(W)`` (DESIGN §2). Heads are rank-one terms of W.

- :func:`coef_from_heads`: ``c(Theta)`` of a model, the paper's ``p(Theta)`` (Cor. 2.4, eq. 15's argument).
- :func:`svd_heads`: the paper's Algorithm 1 heads: split off-diagonal coefficients in half, SVD.
- :func:`search_heads`: the fewest heads computing the same function, or the best H-head model (beyond the
  paper: loss-optimal ALS from the statistics plus alternating projections onto ``{W : p(W) = c}``).
- :func:`loss_vs_heads`: the lowest-training-loss model with H heads (alternating least
  squares on the statistics, DESIGN §3) and the loss-versus-heads curve.
- :func:`compare_models`: distance ``||c(Theta) - c(Theta')||_F`` (eq. 15) and a function-equivalence verdict.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .errors import ParameterError
from .features import coef_distance, n_pairs, triu_index
from .solver import solve

__all__ = ["Heads", "coef_to_W", "coef_from_W", "coef_from_heads", "coef_distance", "svd_heads", "rank_r_heads",
           "loss_vs_heads", "search_heads", "compare_models"]


def _shape(coef, d):
    coef = np.asarray(coef, dtype=np.float64)
    m = n_pairs(d)
    if coef.shape[0] != m * d:
        raise ParameterError(f"coef has {coef.shape[0]} rows, expected psi = {m * d} for d = {d}")
    return coef.reshape(m, d, -1)


def coef_to_W(coef, d: int) -> np.ndarray:
    """Symmetric-split W (d_out*d, d*d) of coefficients (psi, d_out) ([Y25] Alg. 1 step 3; DESIGN §5).

    ``W[a,j,k,l] = W[a,k,j,l] = c[(j,k),l] / 2`` for ``j < k`` and ``W[a,j,j,l] = c[(j,j),l]``.
    """
    c = _shape(coef, d)  # (m, d, d_out)
    I, J, _ = triu_index(d)
    half = np.where(I == J, 1.0, 0.5)[:, None, None] * c
    W = np.zeros((c.shape[2], d, d, d))  # [a, j, k, l]
    W[:, I, J, :] = np.moveaxis(half, 2, 0)
    W[:, J, I, :] = np.moveaxis(half, 2, 0)
    return W.reshape(c.shape[2] * d, d * d)


def coef_from_W(W, d: int, d_out: int) -> np.ndarray:
    """``c = p(W)`` (psi, d_out): ``c[(j,k),l,a] = W[a,j,k,l] + W[a,k,j,l]`` (j < k), ``W[a,j,j,l]`` (j = k)."""
    W4 = np.asarray(W).reshape(d_out, d, d, d)
    I, J, _ = triu_index(d)
    sym = W4[:, I, J, :] + np.where(I != J, 1.0, 0.0)[None, :, None] * W4[:, J, I, :]  # (a, m, l)
    return np.moveaxis(sym, 0, 2).reshape(-1, d_out)


def coef_from_heads(V, Q) -> np.ndarray:
    """Coefficients ``c(Theta)`` (psi, d_out) of heads ``V`` (H, d_out, d), ``Q`` (H, d, d) (DESIGN §2).

    Two models compute the same function iff their coefficients agree ([Y25] Cor. 2.4).
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
    """Attention heads ``V`` (H, d_out, d), ``Q`` (H, d, d) with the singular values of W (``spectrum``) and
    the relative residual ``||p(W_H) - c|| / ||c||`` of the coefficients they reproduce."""

    V: np.ndarray
    Q: np.ndarray
    spectrum: np.ndarray
    residual: float
    method: str
    #: training sum of squared residuals of these heads from the statistics (None when not computed)
    sse: float | None = None
    #: loss-versus-heads curve: ``[(H, sse), ...]`` for each head count tried
    curve: list = dataclasses.field(default_factory=list)

    @property
    def n_heads(self) -> int:
        return int(self.V.shape[0])


def svd_heads(coef, d: int, rtol: float = 1e-12) -> Heads:
    """Heads by SVD of the symmetric-split W ([Y25] Alg. 1; DESIGN §5): ``V_r = fold(sqrt(sigma_r) u_r)``,
    ``Q_r = fold(sqrt(sigma_r) v_r)``, keeping ``sigma_r > rtol * sigma_1``. Up to ``min(d_out*d, d^2)`` heads."""
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
    """Best r-head model found by alternating projections between rank-r matrices (truncated SVD) and the
    affine set ``{W : p(W) = coef}`` (DESIGN §5, beyond [Y25]). Returns the rank-r heads of the last iterate;
    their residual is 0 (to ``tol``) when r heads can represent the function exactly."""
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


# ---- loss-optimal heads from the statistics (beyond [Y25]) ------------------------------------------------
#: largest d for which the loss-optimal head search builds the d^3 x d^3 Gram of the unsymmetrised features
ALS_MAX_D = 16


def _full_index(d: int) -> np.ndarray:
    """Feature index ``pos(j,k) * d + l`` of each full index ``(j, k, l)`` (d^3,), j-major."""
    _, _, pos = triu_index(d)
    return (pos[:, :, None] * d + np.arange(d)[None, None, :]).reshape(-1)


class _LossInW:
    """The training loss as a quadratic in ``W`` (DESIGN §3): with ``W4[a, j, (k,l)] = sum_h V_h[a,j] Q_h[k,l]``
    and unsymmetrised features ``S_jk x_l = phi[pos(j,k), l]``,
    ``sse(W) = yy - 2 sum_a <W4[a], Bf[..., a]> + sum_a W4[a] . Gf . W4[a]`` with ``Gf = G[idx, idx]``."""

    def __init__(self, stats, gram=None):
        d = stats.d
        self.stats, self.d, self.d_out = stats, d, stats.d_out
        self.G = np.asarray(stats.gram() if gram is None else gram)
        idx = _full_index(d)
        self.Gf = self.G[np.ix_(idx, idx)].reshape(d, d * d, d, d * d)  # [j, (k,l), j', (k',l')]
        self.Bf = np.asarray(stats.moments)[idx].reshape(d, d * d, self.d_out)  # [j, (k,l), a]

    def sse(self, V, Q) -> float:
        if V.shape[0] == 0:
            return float(self.stats.yy)
        return self.stats.sse(coef_from_heads(V, Q), self.G)

    def v_step(self, Qm):
        """Optimal V (H, d_out, d) for fixed ``Qm`` (H, d*d): one (H d)-dim system shared by all outputs."""
        H, d = Qm.shape[0], self.d
        GQ = np.tensordot(self.Gf, Qm, axes=([3], [1]))  # (j, m, i, g)
        M = np.einsum("hm,jmig->hjgi", Qm, GQ).reshape(H * d, H * d)
        R = np.einsum("hm,jma->hja", Qm, self.Bf).reshape(H * d, self.d_out)
        return _psd_solve(M, R).reshape(H, d, self.d_out).transpose(0, 2, 1)

    def q_step(self, V, full: bool = False):
        """Optimal ``Qm`` (H, d*d) for fixed V (H, d_out, d): one (H d^2)-dim system ``M q = R``
        (``full``: also return M and R, so that ``sse = yy - 2 R.q + q.M.q``)."""
        H, d2 = V.shape[0], self.d * self.d
        K = np.einsum("haj,gai->hjgi", V, V)
        M = np.tensordot(K, self.Gf, axes=([1, 3], [0, 2])).transpose(0, 2, 1, 3).reshape(H * d2, H * d2)
        R = np.einsum("haj,jma->hm", V, self.Bf).reshape(H * d2)
        Qm = _psd_solve(M, R[:, None]).reshape(H, d2)
        return (Qm, M, R) if full else Qm

    def descent_head(self, V, Q):
        """Best single head to add to (V, Q): top singular pair of the negative gradient, exact line search."""
        d, d_out = self.d, self.d_out
        W4 = np.einsum("haj,hm->ajm", V, Q.reshape(Q.shape[0], -1)) if V.shape[0] else np.zeros((d_out, d, d * d))
        R = np.moveaxis(self.Bf, 2, 0) - np.tensordot(W4, self.Gf, axes=([1, 2], [0, 1]))  # (a, i, n)
        U, s, Vt = np.linalg.svd(R.reshape(d_out * d, d * d), full_matrices=False)
        Dm = np.outer(U[:, 0], Vt[0]).reshape(d_out, d, d * d)
        curv = float(np.einsum("ajm,jmin,ain->", Dm, self.Gf, Dm))
        t = s[0] / curv if curv > 0 and s[0] > 0 else 0.0
        root = np.sqrt(t)
        return (root * U[:, 0]).reshape(1, d_out, d), (root * Vt[0]).reshape(1, d, d)


def _psd_solve(M, R):
    """Solve ``M X = R`` for a symmetric PSD ``M`` (Cholesky with a relative jitter, least squares fallback)."""
    import scipy.linalg

    jitter = 1e-13 * max(float(np.max(np.diag(M))), 1e-300)
    try:
        return scipy.linalg.cho_solve(scipy.linalg.cho_factor(M + jitter * np.eye(M.shape[0])), R)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(M, R, rcond=None)[0]


def _als(loss: _LossInW, V, Q, iters: int, rtol: float):
    """Alternating least squares over V and Q from (V, Q); each half-step cannot increase the loss.
    Returns ``(sse, V, Q)`` of the best iterate (sse by the statistics formula)."""
    H, d = V.shape[0], loss.d
    Qm = Q.reshape(H, d * d)
    yy = float(loss.stats.yy)
    best = (loss.sse(V, Q), V, Q)
    for _ in range(iters):
        V = loss.v_step(Qm)
        Qm, M, R = loss.q_step(V, full=True)
        q = Qm.reshape(-1)
        cur = float(yy - 2 * R @ q + q @ (M @ q))  # sse of the new (V, Q): the q-step's quadratic
        nv = np.linalg.norm(V.reshape(H, -1), axis=1)
        nq = np.linalg.norm(Qm, axis=1)
        f = np.sqrt(np.where((nv > 0) & (nq > 0), nq / np.where(nv > 0, nv, 1.0), 1.0))
        V, Qm = V * f[:, None, None], Qm / f[:, None]  # balance ||V_h|| = ||Q_h||: same W, better conditioned
        prev = best[0]
        if cur < prev:
            best = (cur, V, Qm.reshape(H, d, d))
        if prev - cur <= rtol * abs(cur) + 1e-15 * yy:
            break
    sse = loss.sse(best[1], best[2])
    return (sse, best[1], best[2])


def _grow(loss: _LossInW, V, Q, prev_sse: float, iters: int, rtol: float):
    """Model with one head more than (V, Q): add the best descent head, then ALS; never worse than
    ``prev_sse`` (else (V, Q) plus a zero head). Returns ``(sse, V, Q)``."""
    v1, q1 = loss.descent_head(V, Q)
    sse, Vn, Qn = _als(loss, np.concatenate([V, v1]), np.concatenate([Q, q1]), iters, rtol)
    if sse > prev_sse:
        return prev_sse, np.concatenate([V, 0 * v1]), np.concatenate([Q, 0 * q1])
    return sse, Vn, Qn


def _heads_of(V, Q, coef, method, sse) -> Heads:
    W = np.einsum("haj,hm->ajm", V, Q.reshape(Q.shape[0], -1)).reshape(-1, Q.shape[1] ** 2)
    return Heads(V, Q, np.linalg.svd(W, compute_uv=False), _residual(V, Q, coef), method, sse=sse)


def loss_vs_heads(stats, max_heads: int, gram=None, iters: int = 200, rtol: float = 1e-9) -> list[Heads]:
    """Lowest-training-loss models with H = 1 .. ``max_heads`` heads found from the statistics (beyond [Y25]).

    Minimises ``L(W) = (yy - 2 tr(c^T B) + tr(c^T G c)) / N`` with ``c = p(W)`` over ``W`` of rank H by
    alternating least squares over V and Q (each half-step is a linear least-squares problem in the
    statistics; DESIGN §3). Model H starts from model H-1 plus the best descent head (the top singular pair
    of the negative gradient with an exact line search), so the losses are non-increasing in H.
    Returns one :class:`Heads` per H with ``sse`` set (``residual`` relative to the least-squares fit).
    Raises :class:`~scaleattn.errors.ParameterError` for ``d > ALS_MAX_D`` (the (d^3, d^3) Gram would be too
    large) or statistics without targets.
    """
    if stats.d > ALS_MAX_D:
        raise ParameterError(f"loss-optimal head search needs d <= {ALS_MAX_D}, got d = {stats.d}")
    if stats.d_out == 0:
        raise ParameterError("these statistics have no targets; cannot compute losses")
    loss = _LossInW(stats, gram)
    coef = solve(stats, gram=loss.G).coef
    d, d_out = stats.d, stats.d_out
    V, Q, sse = np.zeros((0, d_out, d)), np.zeros((0, d, d)), float(stats.yy)
    out = []
    for H in range(1, max_heads + 1):
        sse, V, Q = _grow(loss, V, Q, sse, iters, rtol)
        out.append(_heads_of(V, Q, coef, f"als-{H}", sse))
    return out


def search_heads(stats, coef, heads="svd", gram=None, tol: float = 1e-10, curve: bool = True,
                 iters: int = 200) -> Heads:
    """Heads for the fitted coefficients ``coef`` (psi, d_out), with losses from the statistics.

    ``heads``: ``"svd"`` ([Y25] Alg. 1), ``"minimal"`` (the fewest heads reproducing ``coef`` to ``tol``
    relative) or an int H, an upper bound: when r <= H heads reproduce ``coef`` the r-head exact model is
    returned, else the H-head model of lowest training loss found.

    For r = 1, 2, ...: the lowest-loss r-head model by ALS (as :func:`loss_vs_heads`), then alternating
    projections onto ``{W : p(W) = coef}`` at rank r (DESIGN §5), started from the ALS model when that
    explains the data as well as ``coef`` (it then converges in a few sweeps), else from the symmetric
    split; the first r whose projection reproduces ``coef`` is exact. A lossy H-head model is the best of
    ALS-from-growth, ALS-from-the-projection and the projection itself.

    The result's ``sse`` is its training sum of squares and ``curve`` lists ``(r, sse)`` for r = 1 .. its
    head count. For ``d > ALS_MAX_D`` only alternating projections run (``curve`` has the last model).
    """
    coef = np.asarray(coef, np.float64)
    d = stats.d
    G = np.asarray(stats.gram() if gram is None else gram)

    def sse_of(V, Q):
        return stats.sse(coef_from_heads(V, Q), G) if V.shape[0] else float(stats.yy)

    if heads == "svd":
        h = svd_heads(coef, d)
        h.sse = sse_of(h.V, h.Q)
        h.curve = [(h.n_heads, h.sse)]
        return h
    from threadpoolctl import threadpool_limits

    # thousands of small BLAS calls: extra threads only contend (10x slower on a loaded 2-core box)
    with threadpool_limits(limits=1 if d <= SMALL_D else None, user_api="blas"):
        return _search(stats, coef, heads, G, sse_of, tol, curve, iters)


#: up to this d the head search runs single-threaded BLAS (its matrices are small)
SMALL_D = 8


def _search(stats, coef, heads, G, sse_of, tol, curve, iters) -> Heads:
    d, d_out = stats.d, coef.shape[1]
    n_max = min(d_out * d, d * d)
    H = n_max if heads == "minimal" else min(int(heads), n_max)
    method = "minimal" if heads == "minimal" else f"best-{H}"
    loss = _LossInW(stats, G) if curve and d <= ALS_MAX_D else None
    best_sse = stats.sse(coef, G)
    explainable = max(float(stats.yy) - best_sse, 0.0)
    V, Q, sse = np.zeros((0, d_out, d)), np.zeros((0, d, d)), float(stats.yy)
    points = []
    for r in range(1, H + 1):
        if loss is not None:
            sse, V, Q = _grow(loss, V, Q, sse, iters, 1e-9)
        if r == n_max:
            h = svd_heads(coef, d)  # exact with the maximal head count
        else:
            h = None
            if loss is not None and sse - best_sse <= 1e-6 * explainable:
                W0 = np.einsum("haj,hm->ajm", V, Q.reshape(r, -1)).reshape(d_out * d, d * d)
                h = rank_r_heads(coef, d, r, tol=tol * 1e-3, W0=W0)
            if h is None or h.residual > tol:
                h = rank_r_heads(coef, d, r, tol=tol * 1e-3)
        if h.residual <= tol:
            h.sse, h.method = sse_of(h.V, h.Q), method
            h.curve = points + [(h.n_heads, h.sse)]
            return h
        points.append((r, sse if loss is not None else sse_of(h.V, h.Q)))
    # no exact model with H heads: the lowest training loss found
    cands = [(sse_of(h.V, h.Q), h.V, h.Q)]
    if d <= ALS_MAX_D:
        cands.append(_als(loss or _LossInW(stats, G), h.V, h.Q, iters, 1e-9))
    if loss is not None:
        cands.append((sse, V, Q))
    sse, V, Q = min(cands, key=lambda t: t[0])
    out = _heads_of(V, Q, coef, method, sse)
    out.curve = points[:-1] + [(H, sse)]
    return out


# ---- model comparison ---------------------------------------------------------------------------------
def compare_models(model_a, model_b, rtol: float = 1e-8) -> dict:
    """Distance ``||c(Theta_a) - c(Theta_b)||_F`` of two models' heads ([Y25] eq. 15; DESIGN §2) and the
    verdict ``equivalent`` (distance <= ``rtol`` x the larger coefficient norm: the two compute the same
    function on every input of every length, Cor. 2.4). Also the distance of the stored coefficients
    (what ``predict`` uses). Raises :class:`~scaleattn.errors.ParameterError` when (d, d_out) differ."""
    if (model_a.d, model_a.d_out) != (model_b.d, model_b.d_out):
        raise ParameterError(f"models have (d, d_out) = {(model_a.d, model_a.d_out)} and {(model_b.d, model_b.d_out)}:"
                         " they do not map the same inputs to the same outputs")
    ca, cb = coef_from_heads(model_a.V, model_a.Q), coef_from_heads(model_b.V, model_b.Q)
    dist = coef_distance(ca, cb)
    norm = max(float(np.linalg.norm(ca)), float(np.linalg.norm(cb)))
    return {"d": model_a.d, "d_out": model_a.d_out, "n_heads_a": model_a.n_heads, "n_heads_b": model_b.n_heads,
            "distance": dist, "relative_distance": dist / norm if norm > 0 else 0.0,
            "coef_distance": coef_distance(model_a.coef, model_b.coef), "rtol": rtol,
            "equivalent": bool(dist <= rtol * norm)}
