"""The fewest attention heads for fitted coefficients, and lower bounds on their number (DESIGN §2, §5).

Beyond [Y25]: the data fix only the coefficients ``c = p(W)`` (DESIGN §2, [Y25] Cor. 2.4), so any heads with
``c(V, Q) = c`` compute the fitted function. The paper's SVD heads (Algorithm 1) use up to
``min(d_out*d, d^2)`` of them; far fewer usually suffice.

- :func:`fit_heads`: the best H-head model for given coefficients, in the coefficient norm or in the training
  loss, by variable projection: for fixed ``Q`` the ``V`` solve a linear least-squares problem, and
  Levenberg-Marquardt steps on the reduced problem in ``Q`` use Kaufman's Jacobian (Golub & Pereyra 1973,
  Kaufman 1975). Several deterministic starts (SVD heads, random).
- :func:`search_heads`: ``"minimal"`` (fewest heads reproducing ``coef``) or ``H`` (an exact model with at
  most H heads when one is found, else the lowest-training-loss H-head model found), with the loss-versus-heads
  curve, a time budget, and a lower bound with its kind.
- :func:`loss_vs_heads`: the lowest training loss found with H = 1, 2, ... heads, from the statistics only.
- Lower bounds: :func:`flattening_bound` holds for every ``c``; :func:`generic_heads_bound` (a dimension
  count, made exact by :func:`image_dimension`, the rank of the Jacobian of ``(V, Q) -> c``) holds for generic
  ``c``, e.g. any data with noise.

Everything here works from coefficients and the statistics (DESIGN §3); the caller solves for ``coef``.
"""
from __future__ import annotations

import math
import time

import numpy as np

from ..linalg._gram import GramOperator, gram_for
from ._algebra import Heads, coef_from_heads, rank_r_heads, svd_heads
from ._bounds import KIND_EVERY_C, _reported_bound, flattening_bound, generic_heads_bound
from ._fit import (
    SMALL_D,
    _adjoint,
    _balanced,
    _CoefProblem,
    _loss_factor,
    _relative_residual,
    _split_spectrum,
    _start_factor,
    _starts,
    _svd,
    _Target,
    _varpro,
)

__all__ = ["search_heads", "loss_vs_heads", "DEFAULT_BUDGET"]

#: default time budget of a head search, seconds (the result's ``budget_exhausted`` says when it ran out)
DEFAULT_BUDGET = 60.0
#: Levenberg-Marquardt steps per head count of the loss-versus-heads curve (its lossy fits creep slowly: the
#: curve is an upper bound on the least loss within ~1% at d = 8; ``heads=H`` polishes its model further)
CURVE_ITERS = 12
#: a step is cheap when its normal matrix costs at most this many multiply-adds (~0.01 s): the curve then takes
#: five times as many steps; below PROBE_CHEAP (d <= 5 or so) each bisection probe takes four times the starts
CHEAP_STEP, PROBE_CHEAP = 1e8, 1e7
#: starts and Levenberg-Marquardt steps of each bisection probe for exact models below the dimension count; a
#: probe stops when 5 steps reduce the squared residual by less than PROBE_STALL (runs that converge do far more)
PROBE_STARTS, PROBE_ITERS, PROBE_STALL = 3, 60, 0.3
#: random starts of the retry one head below an exact model that is above the dimension count (step (4b) of
#: :func:`search_heads`), when a step is cheap (PROBE_CHEAP) and when it is not; the exact models of a tight count
#: (``H (a + b - H) = psi d_out``) are finitely many and their basins small: at d = 4, d_out = 2 between 1 in 40
#: and 2 in 3 random starts reach one. RETRY_DEFLATIONS: starts from the model found less one of its weakest heads
RETRY_STARTS, RETRY_STARTS_COSTLY, RETRY_DEFLATIONS = 48, 12, 4
#: the retry's random starts are numbered from here (the earlier steps use the first few)
RETRY_FIRST = 1000
#: coefficients whose training loss is within this factor of its round-off floor fit the data exactly (a
#: noise-free model): they need not be generic, so the retry goes below the dimension count for them
NOISE_FREE = 1e4


# ---- the search -----------------------------------------------------------------------------------------
class _RidgeGram:
    """``G + ridge diag(G)`` without a copy of ``G``: the Gram of the scaled ridge objective
    ``||y - Phi c||^2 + ridge sum_j G_jj ||c_j||^2`` (:func:`scaleattn.solve`), whose minimiser is the ridge fit.
    The search measures its models with it, so that the losses are those of the objective the fit minimised
    (with the plain Gram, the lossy models of the curve fit the data better than the ridge fit itself). Has what
    the search uses of a Gram: ``@``, ``diagonal()`` and, for the loss factor, :meth:`dense`."""

    def __init__(self, G, ridge: float):
        self.G, self.ridge, self.shape = G, float(ridge), G.shape
        self._shift = self.ridge * np.asarray(G.diagonal(), np.float64)

    def __matmul__(self, x):
        x = np.asarray(x, np.float64)
        return np.asarray(self.G @ x) + (self._shift[:, None] * x if x.ndim == 2 else self._shift * x)

    def diagonal(self) -> np.ndarray:
        return np.asarray(self.G.diagonal(), np.float64) + self._shift

    def dense(self, stats) -> np.ndarray:
        """The psi x psi array (a copy; the statistics expand it when ``G`` is the matrix-free operator)."""
        G = stats.gram() if isinstance(self.G, GramOperator) else np.array(self.G, np.float64)
        G[np.diag_indices_from(G)] += self._shift
        return G


class _Search:
    """State of one head search (:func:`search_heads`): targets, budget, the best models found per head count."""

    def __init__(self, stats, coef, G, tol, iters, starts, seed, deadline, progress=None):
        self.stats, self.coef, self.G, self.tol, self.progress = stats, coef, G, tol, progress
        self.d, self.d_out = stats.d, coef.shape[1]
        self.iters, self.starts, self.seed, self.deadline = iters, starts, seed, deadline
        self.prob = _CoefProblem(coef, self.d)
        self._loss_tg = None
        self.exhausted = False
        self.attempts = {}  # r -> (residual, V, Q): best coefficient-space attempt
        self.fewest, self.lossy = None, {}  # for progress: (r, sse) of the fewest exact heads; r -> sse on the curve

    def say(self, r: int, what: str) -> None:
        """Tell ``progress`` the head count tried now and the best losses so far (MSE over rows and outputs)."""
        if self.progress is None:
            return
        n = max(self.stats.n_rows * self.d_out, 1)
        name = "objective" if isinstance(self.G, _RidgeGram) else "train MSE"

        def heads(k):
            return f"{k} head" + ("s" if k > 1 else "")
        known = [] if self.fewest is None else [f"exact with {heads(self.fewest[0])}, {name} {self.fewest[1] / n:.4g}"]
        below = [k for k in self.lossy if self.fewest is None or k < self.fewest[0]]
        known += [f"{heads(max(below))} {name} {self.lossy[max(below)] / n:.4g}"] if below else []
        self.progress(f"trying {heads(r)} ({what})" + ("; so far: " + ", ".join(known) if known else ""))

    @property
    def loss_tg(self) -> _Target:
        if self._loss_tg is None:
            # the loss-weighted head fits need the loss factor of the dense Gram (an eigh): expanded only here
            if isinstance(self.G, _RidgeGram):
                G = self.G.dense(self.stats)
            else:
                G = self.stats.gram() if isinstance(self.G, GramOperator) else self.G
            self._loss_tg = _Target(self.coef, self.d, _loss_factor(G))
        return self._loss_tg

    def out_of_time(self) -> bool:
        if time.perf_counter() > self.deadline:
            self.exhausted = True
        return self.exhausted

    def sse(self, V, Q) -> float:
        return self.stats.sse(coef_from_heads(V, Q), self.G) if V.shape[0] else float(self.stats.yy)

    def exact(self, r: int, n_starts: int, extra=(), iters: int | None = None, stall_rtol: float = 1e-3,
              what: str = "exact fit", first: int = 0, svd: bool = True):
        """An exact r-head model ``(V, Q)`` in the coefficient norm from up to ``n_starts`` starts (the models
        ``extra`` first, then :func:`_starts`' from ``first`` and ``svd``), or None; the best attempt is kept in
        ``attempts``."""
        if not self.prob.feasible(r):  # too large for a Newton-type step: alternating projections
            if self.out_of_time():
                return None
            self.say(r, what)
            h = rank_r_heads(self.coef, self.d, r, tol=self.tol * 1e-3)
            return self._found(r, (h.V, h.Q)) if h.residual <= self.tol else None
        specs = _starts(n_starts, extra, first, svd)
        for i, spec in enumerate(specs):
            if self.out_of_time():
                return None
            self.say(r, f"{what}, start {i + 1} of {len(specs)}")
            V, Q, _, _ = self.prob.run(r, spec, self.seed, iters or self.iters, self.tol, self.deadline, stall_rtol)
            res = _relative_residual(V, Q, self.coef)
            if r not in self.attempts or res < self.attempts[r][0]:
                self.attempts[r] = (res, V, Q)
            if res <= self.tol:
                return self._found(r, (V, Q))
        return None

    def _found(self, r: int, model):
        """``model``, an exact r-head one, noted for progress when it has the fewest heads so far."""
        if self.progress is not None and (self.fewest is None or r < self.fewest[0]):
            self.fewest = (r, self.sse(*model))
        return model

    def loss_run(self, Q0, iters, stall_rtol):
        run = _varpro(self.loss_tg, Q0, iters, 0.0, stall_rtol, self.deadline)
        if run.reason == "budget":
            self.exhausted = True
        V, Q = _balanced(run.V, run.Q)
        return run.f, V, Q

    def grow(self, V, Q, f_prev):
        """Lowest-loss model found with one head more than (V, Q): add the steepest-descent head (top singular
        pair of the loss gradient in W), then variable projection; never worse than (V, Q) plus a zero head."""
        tg = self.loss_tg
        cur = coef_from_heads(V, Q) if V.shape[0] else np.zeros_like(self.coef)
        grad = _adjoint(tg.Lt.T @ (tg.Lt @ (cur - self.coef)), self.d)
        q_new = _svd(grad)[2][0].reshape(1, self.d, self.d)
        n = 5 * CURVE_ITERS if tg.step_cost(Q.shape[0] + 1) <= CHEAP_STEP else CURVE_ITERS
        f, Vn, Qn = self.loss_run(np.concatenate([Q, q_new]), min(self.iters, n), 1e-4)
        if f > f_prev:
            return f_prev, np.concatenate([V, np.zeros((1, self.d_out, self.d))]), np.concatenate([Q, q_new])
        return f, Vn, Qn


class _Curve:
    """The loss-versus-heads pass (step 3 of :func:`search_heads`), resumable: ``extend(top)`` adds models up to
    ``top`` heads and returns ``(r, (V, Q))`` for the first r with an exact model found from it, else
    ``(None, None)``."""

    def __init__(self, s: _Search, every_c: int):
        self.s, self.every_c = s, every_c
        self.V, self.Q, self.f = np.zeros((0, s.d_out, s.d)), np.zeros((0, s.d, s.d)), None
        self.points, self.models = [], {}

    def extend(self, top: int):
        s = self.s
        for r in range(self.V.shape[0] + 1, top + 1):
            if s.out_of_time() or not s.loss_tg.feasible(r):
                break
            s.say(r, "loss curve")
            self.f, self.V, self.Q = s.grow(self.V, self.Q, s.loss_tg.norm2 if self.f is None else self.f)
            self.models[r] = (self.V, self.Q)
            self.points.append((r, s.sse(self.V, self.Q)))
            s.lossy[r] = self.points[-1][1]
            if r >= self.every_c and self.f <= max(1e-8, s.tol) * s.loss_tg.norm2:
                found = s.exact(r, 2, extra=[(self.V, self.Q)])
                if found is not None:
                    return r, found
        return None, None


def search_heads(stats, coef, heads="svd", gram=None, tol: float = 1e-10, *, iters: int = 200,
                 budget: float | None = DEFAULT_BUDGET, starts: int = 4, seed: int = 0, ridge: float = 0.0,
                 progress=None) -> Heads:
    """Heads for the fitted coefficients ``coef`` (psi, d_out), with losses from the statistics (DESIGN §5).

    ``heads``:

    - ``"svd"``: the paper's heads ([Y25] Alg. 1), up to ``min(d_out*d, d^2)``;
    - ``"minimal"``: the fewest heads found that reproduce ``coef`` to relative residual ``tol``;
    - an int H: at most H heads; the fewest exact ones when some r <= H reproduce ``coef``, else the H-head
      model of lowest training loss found (``exact`` False, ``residual`` and ``loss_gap`` say how far it is).

    The search. (1) Bounds: :func:`flattening_bound` (every c) and :func:`generic_heads_bound` (generic c).
    (2) From the generic bound up: exact models by variable projection in the coefficient norm (as
    :func:`fit_heads`; ``starts`` deterministic starts each; the SVD heads at ``min(d_out*d, d^2)``).
    (3) From 1 head up to one below the count found: the lowest-loss model with r heads (the (r-1)-head model
    plus the steepest-descent head, then variable projection on the training loss, DESIGN §3); where its loss
    reaches that of ``coef`` (and r is at least the every-c bound) an exact r-head model is sought from it.
    When a flattening has low rank (``flattening_bound < min(d, d_out)``: visibly not generic, e.g. a teacher)
    (3) runs before (2). (4) Bisection of [every-c bound, count found) with short exact runs
    (``PROBE_STARTS``, ``PROBE_ITERS``): non-generic coefficients (teachers with min(d, d_out) or more heads)
    whose greedy curve missed them. (4b) While the count found is above both bounds (above the every-c bound for
    coefficients that fit the data to round-off, ``NOISE_FREE``: a noise-free model need not be generic): one
    head fewer from further starts (the found model less one of its weakest heads, the curve's model,
    ``RETRY_STARTS`` random ones not tried before), again below on success; for ``heads=H`` with no exact model,
    the same at H. At a tight count (``H (a + b - H) = psi d_out``, e.g. d_out = 2, H = d) generic coefficients
    have finitely many H-head models over C: real ones exist for some data and not for others, and their basins
    are small. (5) For ``heads=H`` with no exact model: the best of the curve's H-head model, the closest
    coefficient fit and further loss-space starts, polished. The losses form ``curve``:
    ``[(r, sse), ...]`` for r = 1 .. the head count, non-increasing (a running minimum: fewer heads plus zero
    heads are more heads), ending at the returned model. Steps larger than ``VARPRO_MAX`` / ``WORK_MAX`` use
    alternating projections (:func:`scaleattn.heads._algebra.rank_r_heads`) for (2) and skip the curve. The budget is
    checked between Levenberg-Marquardt steps and between starts.

    Parameters
    ----------
    stats : Statistics
        With targets (DESIGN §3).
    coef : array (psi, d_out)
        The fitted coefficients (the caller solves, e.g. ``solve(stats).coef``).
    heads : "svd" | "minimal" | int
    gram : array (psi, psi), optional
        ``stats.gram()``, when the caller has it.
    tol : float
        Relative coefficient residual of an exact model.
    iters : int
        Levenberg-Marquardt steps per start.
    budget : float or None
        Seconds for the search (None: no limit). When it runs out the best models so far are returned
        (``minimal`` without an exact model below the maximum: the SVD heads) and ``budget_exhausted`` is set.
    starts, seed : int
        Starts per head count in step (2), and their seed (results are deterministic).
    ridge : float
        The scaled ridge ``coef`` was fitted with (:func:`scaleattn.solve`; 0: least squares). The search's loss
        is then the fit's objective, the training sum of squares plus ``ridge * sum_j G_jj ||c_j||^2``, which
        ``coef`` minimises: ``curve`` and ``loss_gap`` are in it, ``sse`` stays the heads' sum of squares.
    progress : callable, optional
        Called with one line of text as the search moves on: the head count tried, the step, the fewest exact
        heads and the lowest loss with fewer heads so far (``reporter.phase``'s ``note``).

    Returns
    -------
    Heads
        With ``sse``, ``curve``, ``exact``, ``loss_gap``, ``lower_bound`` / ``lower_bound_kind`` (see
        :func:`_reported_bound`: the dimension count unless an exact model with fewer heads proves ``coef``
        non-generic), ``bound_every_c``, ``bound_generic``, ``budget_exhausted``, ``seconds``.

    Raises
    ------
    ParameterError
        ``heads`` not ``"svd"``, ``"minimal"`` or a positive count; ``coef`` of the wrong shape.

    See Also
    --------
    scaleattn.svd_heads : the paper's heads (Algorithm 1), no search.
    scaleattn.heads._fit.fit_heads : the best H-head model from given starts.
    scaleattn.heads._bounds.generic_heads_bound, scaleattn.heads._bounds.flattening_bound : the lower bounds.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.generate import make_mhla
    >>> from scaleattn.linalg._solver import solve
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> D = make_mhla(d=3, heads=2, length=20, samples=200, causal=True, noise=0.3, seed=0)  # agnostic
    >>> st = statistics_from_arrays(D["tokens"], D["targets"])
    >>> h = search_heads(st, solve(st).coef, "minimal")
    >>> h.n_heads, h.lower_bound, h.lower_bound_kind, h.residual < 1e-10   # the paper's SVD gives 9
    (4, 4, 'dimension count (generic data)', True)
    """
    t0 = time.perf_counter()
    coef = np.asarray(coef, np.float64)
    d, d_out = stats.d, coef.shape[1]
    if budget is not None and not budget > 0:
        raise ValueError(f"budget must be positive seconds or None, got {budget!r}")
    if not (heads in ("svd", "minimal") or (isinstance(heads, (int, np.integer)) and heads >= 1)):
        raise ValueError(f"heads must be 'svd', 'minimal' or a positive integer, got {heads!r}")
    G = gram_for(stats) if gram is None else gram  # the operator past DENSE_GRAM_MAX_PSI: only G @ c is needed
    G = G if isinstance(G, GramOperator) else np.asarray(G, np.float64)
    plain, G = G, (_RidgeGram(G, ridge) if ridge > 0 else G)  # G: the loss the search minimises
    from threadpoolctl import threadpool_limits

    deadline = math.inf if budget is None else t0 + budget
    # thousands of small BLAS calls: extra threads only contend (several times slower on a loaded 2-core box)
    with threadpool_limits(limits=1 if d <= SMALL_D else None, user_api="blas"):
        every_c, generic = flattening_bound(coef, d, tol), generic_heads_bound(d, d_out)
        if heads == "svd" or every_c == 0:
            h = svd_heads(coef, d)
            h.method = "svd"
            h.sse = stats.sse(coef_from_heads(h.V, h.Q), G) if h.n_heads else float(stats.yy)
            h.curve = [(h.n_heads, h.sse)]
            return _finish(h, stats, coef, G, plain, tol, (every_c, KIND_EVERY_C), every_c, generic, False, t0)
        s = _Search(stats, coef, G, tol, iters, starts, seed, deadline, progress)
        noise_free = stats.sse(coef, plain) <= NOISE_FREE * stats.sse_floor(coef, plain)
        h = _run_search(s, heads, every_c, generic, noise_free)
    bound = _reported_bound(h.n_heads, h.exact, every_c, generic)
    return _finish(h, stats, coef, G, plain, tol, bound, every_c, generic, s.exhausted, t0)


def _run_search(s: _Search, heads, every_c: int, generic: int, noise_free: bool) -> Heads:
    d, d_out, coef = s.d, s.d_out, s.coef
    n_max = min(d_out * d, d * d)
    cap = n_max if heads == "minimal" else min(int(heads), n_max)
    method = "minimal" if heads == "minimal" else f"best-{int(heads)}"
    curve = _Curve(s, every_c)
    hi, model = None, None
    if every_c < min(d, d_out):  # visibly not generic (a flattening of low rank): fewer heads likely do
        hi, model = curve.extend(cap)
    if hi is None:  # (2) exact models from the generic bound up (the SVD heads at n_max)
        for r in range(max(generic, every_c, 1), cap + 1):
            if r == n_max:
                sv = svd_heads(coef, d)
                hi, model = r, s._found(r, (sv.V, sv.Q))
                break
            found = s.exact(r, s.starts)
            if found is not None:
                hi, model = r, found
                break
            if s.out_of_time():
                break
        if hi is None and heads == "minimal":  # out of time before any exact model: the paper's heads are exact
            sv = svd_heads(coef, d)
            hi, model = sv.n_heads, (sv.V, sv.Q)
        # (3) the loss curve below, probing for exact models with fewer heads
        low, low_model = curve.extend(cap if hi is None else hi - 1)
        if low is not None:
            hi, model = low, low_model
    # (4) coefficients that are not generic may need fewer heads than the count although the greedy curve
    # missed them: bisect [every_c, hi) with short coefficient-norm runs (exact models persist as H grows)
    lo, top = max(every_c, 1), (cap + 1 if hi is None else hi)
    while lo < top and not s.out_of_time():
        mid = (lo + top) // 2
        extra = [] if model is None else [_pruned(*model, mid)]  # the exact model less its weakest heads
        extra += [curve.models[mid]] if mid in curve.models else []
        n = PROBE_STARTS * (4 if s.prob.cheap(mid, PROBE_CHEAP) else 1)
        found = s.exact(mid, n, extra=extra, iters=min(s.iters, PROBE_ITERS), stall_rtol=PROBE_STALL,
                        what="bisection")
        if found is not None:
            hi, model, top = mid, found, mid
        else:
            lo = mid + 1
    # (4b) where the bounds allow fewer heads than found, more starts one head below (each success, again below):
    # at a tight count the few real models are easily missed by the starts above, while ``heads=H`` may hit one
    floor = max(every_c, 1) if noise_free else max(generic, every_c, 1)
    while hi is not None and hi - 1 >= floor and not s.out_of_time():
        found = _retry(s, hi - 1, model, curve)
        if found is None:
            break
        hi, model = hi - 1, found
    if hi is None and cap >= floor and not s.out_of_time():  # heads=H with no exact model yet: the same at H
        found = _retry(s, cap, None, curve)
        if found is not None:
            hi, model = cap, found
    points = [p for p in curve.points if hi is None or p[0] < hi]
    curve_models = curve.models
    if hi is not None:
        V, Q = model
        sse = s.sse(V, Q)
        return Heads(V, Q, _split_spectrum(coef, d), _relative_residual(V, Q, coef), method, sse=sse,
                     curve=_monotone(points + [(hi, sse)]), exact=True)
    # (5) no exact model with at most H heads: the lowest training loss found with H heads
    cands = [(s.sse(*curve_models[cap]), *curve_models[cap])] if cap in curve_models else []
    if cap in s.attempts:
        cands.append((s.sse(s.attempts[cap][1], s.attempts[cap][2]), s.attempts[cap][1], s.attempts[cap][2]))
    extra = [(c[1], c[2]) for c in cands]  # polish them on the loss, then further starts
    for i, spec in enumerate(_starts(max(s.starts, len(extra) + 1), extra)):
        if s.out_of_time() or not s.loss_tg.feasible(cap):
            break
        s.say(cap, f"lowest loss, start {i + 1}")
        _, Vc, Qc = s.loss_run(_start_factor(spec, coef, d, cap, s.seed, False), s.iters, 1e-6)
        cands.append((s.sse(Vc, Qc), Vc, Qc))
    if not cands:  # nothing ran (budget or size): the paper's heads truncated to H
        sv = svd_heads(coef, d)
        cands.append((s.sse(sv.V[:cap], sv.Q[:cap]), sv.V[:cap], sv.Q[:cap]))
    sse, V, Q = min(cands, key=lambda t: t[0])
    pts = [p for p in points if p[0] < cap] + [(cap, sse)]
    return Heads(V, Q, _split_spectrum(coef, d), _relative_residual(V, Q, coef), method, sse=sse,
                 curve=_monotone(pts), exact=_relative_residual(V, Q, coef) <= s.tol)


def _retry(s: _Search, r: int, model, curve: _Curve):
    """An exact r-head model from further starts, or None: ``model`` (exact, r + 1 heads) less one of its
    ``RETRY_DEFLATIONS`` weakest heads each, the curve's r-head model, then random starts not tried before."""
    if not s.prob.feasible(r):  # alternating projections are deterministic: step (2) ran them already
        return None
    extra = []
    if model is not None:
        V, Q = model
        w = np.linalg.norm(V.reshape(V.shape[0], -1), axis=1) * np.linalg.norm(Q.reshape(Q.shape[0], -1), axis=1)
        for k in np.argsort(w, kind="stable")[:RETRY_DEFLATIONS]:
            keep = np.arange(V.shape[0]) != k
            extra.append((V[keep], Q[keep]))
    extra += [curve.models[r]] if r in curve.models else []
    n = RETRY_STARTS if s.prob.cheap(r, PROBE_CHEAP) else RETRY_STARTS_COSTLY
    return s.exact(r, len(extra) + n, extra=extra, what="more starts", first=RETRY_FIRST, svd=False)


def _pruned(V, Q, r: int):
    """The r heads of (V, Q) with the largest ``||V_h|| ||Q_h||`` (a start for an r-head model)."""
    w = np.linalg.norm(V.reshape(V.shape[0], -1), axis=1) * np.linalg.norm(Q.reshape(Q.shape[0], -1), axis=1)
    keep = np.sort(np.argsort(-w, kind="stable")[:r])
    return V[keep], Q[keep]


def _monotone(points):
    """Running minimum of ``[(H, sse), ...]`` in H: a model with fewer heads plus zero heads has more heads."""
    out, best = [], math.inf
    for k, v in sorted(points):
        best = min(best, v)
        out.append((int(k), float(best)))
    return out


def _finish(h: Heads, stats, coef, G, plain, tol, bound, every_c, generic, exhausted, t0) -> Heads:
    """The search's result fields; ``G`` the Gram of its loss, ``plain`` the statistics' own."""
    c = coef_from_heads(h.V, h.Q) if h.n_heads else np.zeros_like(coef)
    delta = c - coef
    # loss(c) - loss(coef) without cancellation against yy: delta^T G delta + 2 delta^T (G coef - B)
    h.loss_gap = float(np.sum(delta * (G @ delta)) + 2 * np.sum(delta * (G @ coef - np.asarray(stats.moments))))
    if G is not plain:  # the curve is in the ridge objective; the heads' own training loss is the plain one
        h.ridge = G.ridge
        h.sse = stats.sse(c, plain) if h.n_heads else float(stats.yy)
    h.exact = bool(h.residual <= tol)
    h.lower_bound, h.lower_bound_kind = int(bound[0]), bound[1]
    h.bound_every_c, h.bound_generic = int(every_c), int(generic)
    h.budget_exhausted = bool(exhausted)
    h.seconds = time.perf_counter() - t0
    return h


def loss_vs_heads(stats, max_heads: int, gram=None, *, coef=None, iters: int = 60,
                  budget: float | None = DEFAULT_BUDGET) -> list[Heads]:
    """Lowest training losses found with H = 1 .. ``max_heads`` heads, from the statistics only (DESIGN §3, §5).

    Model H is model H-1 plus the steepest-descent head (top singular pair of the loss gradient in W), then
    variable projection on ``tr((c - coef)^T G (c - coef))`` (the training loss above the least-squares one);
    never worse than model H-1 plus a zero head, so the losses are non-increasing in H. ``coef`` defaults to
    ``G^+ B`` on the numerically nonzero spectrum of the Jacobi-scaled Gram (DESIGN §4). Stops early (fewer
    models) when ``budget`` seconds run out or a step would exceed ``VARPRO_MAX`` / ``WORK_MAX``.

    Parameters
    ----------
    stats : Statistics
        With targets (DESIGN §3).
    max_heads : int
        Largest head count (capped at ``min(d_out*d, d^2)``).
    gram : array (psi, psi), optional
        ``stats.gram()``, when the caller has it.
    coef : array (psi, d_out), optional
        The coefficients the losses are measured from (e.g. ``solve(stats).coef``).
    iters : int
        At most this many Levenberg-Marquardt steps per head count (``CURVE_ITERS`` caps it on large steps).
    budget : float or None
        Seconds.

    Returns
    -------
    list of Heads
        One per H with ``sse`` set and ``residual`` relative to ``coef``.

    Examples
    --------
    >>> from scaleattn.generate import make_mhla
    >>> from scaleattn.statistics._container import statistics_from_arrays
    >>> D = make_mhla(d=3, heads=2, length=20, samples=100, causal=True, seed=0)   # a 2-head teacher
    >>> st = statistics_from_arrays(D["tokens"], D["targets"])
    >>> [round(max(h.sse, 0.0) / st.yy, 3) for h in loss_vs_heads(st, 3)]   # 2 heads explain it all
    [0.041, 0.0, 0.0]
    """
    if stats.d_out == 0:
        raise ValueError("these statistics have no targets; cannot compute losses")
    if max_heads < 1:
        raise ValueError(f"max_heads must be >= 1, got {max_heads}")
    G = np.asarray(stats.gram() if gram is None else gram, np.float64)
    d = stats.d
    if coef is None:
        Lt = _loss_factor(G)
        coef = np.linalg.lstsq(Lt, np.linalg.lstsq(Lt.T, np.asarray(stats.moments), rcond=None)[0], rcond=None)[0]
    coef = np.asarray(coef, np.float64)
    from threadpoolctl import threadpool_limits

    t0 = time.perf_counter()
    s = _Search(stats, coef, G, 1e-10, iters, 1, 0, math.inf if budget is None else t0 + budget)
    V, Q, f, out = np.zeros((0, stats.d_out, d)), np.zeros((0, d, d)), None, []
    with threadpool_limits(limits=1 if d <= SMALL_D else None, user_api="blas"):
        for H in range(1, min(max_heads, stats.d_out * d, d * d) + 1):
            if s.out_of_time() or not s.loss_tg.feasible(H):
                break
            f, V, Q = s.grow(V, Q, s.loss_tg.norm2 if f is None else f)
            out.append(Heads(V, Q, _split_spectrum(coef, d), _relative_residual(V, Q, coef), f"loss-{H}",
                             sse=s.sse(V, Q), budget_exhausted=s.exhausted))
    return out
