"""Least squares and the certificate from passes over the tokens: no psi^2 object anywhere (DESIGN §4b).

The Gram route forms ``Tc`` (psi^2 / 4 floats: 0.6 GB at d = 32, 36 GB at d = 64) at a cost of ``N psi^2 / 2``
multiply-adds. Everything [Y25] Algorithm 1 and Lemma 2.3 need can instead come from *data passes*, each a pair of
GEMMs over the rows (DESIGN §4b): for a block of rows with ``S`` (rows, m) the vech of each row's token Gram (for
causal prefixes the running sum of ``z z^T``) and ``X`` (rows, d) the query tokens, and coefficients ``W``
(psi, k) viewed as (m, d, k) in the feature order of :mod:`scaleattn.features` (feature ``(P, l)`` at ``P d + l``)::

    (Phi W)[i, :]      = sum_{P,l} S[i,P] X[i,l] W[P,l,:]  = rowwise contraction of (S @ W_(m, d k)) with X
    (Phi^T R)[P, l, :] = sum_i S[i,P] X[i,l] R[i,:]        = S^T @ (X (x)_row R)

so ``G W = Phi^T (Phi W)`` costs about ``4 N psi k`` flops and holds ``O(rows m + psi k)`` (:class:`StreamOperator`).
``S`` is recomputed from the tokens in every pass unless the rows fit in :data:`CACHE_BYTES`.

Devices. The tokens may be arrays of any array API library (numpy, CuPy; :mod:`scaleattn._backend`): the first
sweep's sums, the K-FAC factors, the krylov vectors and every pass stay on the tokens' device; per-column numbers,
the small projected eigenproblems and the Lanczos tridiagonals go to the host, and the results (:class:`StreamSolution`,
the certificate) are numpy whatever the device, as for numpy tokens.

Three paths live here:

- :func:`stream_solve` (N >= psi): CG on the normal equations ``G c = Phi^T Y`` through
  :func:`scaleattn.linalg._krylov.krylov_solve` (independent recurrences for the d_out columns sharing each pass,
  the Jacobi-scaled backward-error stop, deflation of the null space for the min-norm answer, a column that does
  not converge reported), preconditioned by K-FAC (:class:`KFAC`): ``G ~ N (A (x) B)`` with ``A = E[s s^T]``
  (m x m) and ``B = E[x x^T]`` (d x d), both from the first sweep, applied by two small products per pass
  (DESIGN §4b, "K-FAC preconditioner").
- :func:`dual_solve` (N < psi): the min-norm solution lies in the rows' span, ``c = Phi^T alpha`` with
  ``K alpha = Y`` on ``K``'s range and ``K = Phi Phi^T = (S S^T) * (X X^T)`` (elementwise; DESIGN §4b, "the
  dual"): O(N^2 (m + d)) work and N^2 memory, never psi^2. ``rank(G) = rank(K) <= N < psi``: not identifiable,
  by dimension count.
- the certificate from passes: ``lambda_max`` by Lanczos and ``lambda_min`` by LOBPCG with the K-FAC
  preconditioner (the krylov path's runs, each an interval), plus a *probabilistic* lower bound on
  ``lambda_min(G / N)`` (:func:`kw_lower_bound`): Lanczos on ``C = L^-1 G L^-T`` (``M = L L^T`` the K-FAC
  preconditioner) from a Gaussian start, the Kuczynski-Wozniakowski bound [KW92] on how far its smallest Ritz
  value can lie above ``lambda_min(C)``, times ``lambda_min(M)`` (DESIGN §4b, "Eigenvalues from passes"). It
  holds except with the stated failure probability; Krylov iterates alone never prove a lower bound, and the
  report never shows this one as a proof.

References
----------
[Y25] Yau et al., "Learning Linear Attention in Polynomial Time", NeurIPS 2025, Algorithm 1, Lemma 2.3.
[MG15] J. Martens, R. Grosse, "Optimizing neural networks with Kronecker-factored approximate curvature",
ICML 2015 (K-FAC). [KW92] J. Kuczynski, H. Wozniakowski, "Estimating the largest eigenvalue by the power and
Lanczos algorithms with a random start", SIAM J. Matrix Anal. Appl. 13 (1992) 1094-1122, Theorem 4.2.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._backend import device_of, from_host, get_xp, is_numpy, on_device, to_numpy, vector_norm
from .._tree import TreeReducer
from ..errors import DatasetError, InsufficientMemoryError, ParameterError
from ..features import n_features, n_pairs
from ._certificate import Certificate, certificate_from_krylov
from ._dense import row_gram
from ._gram import _blas_controller, blas_single_thread
from ._kfac import FACTOR_FLOOR, KFAC  # noqa: F401  (KFAC and its floor are re-exported here)
from ._krylov import LANCZOS_MAX, MAXITER, MIN_EIG_PASSES, krylov_solve, lockstep
from ._lanczos import EPS, _cols
from ._passes import (
    BLOCK_ROWS,
    CACHE_BYTES,
    RowSource,
    add_parts,
    c_order,
    group_gw,
    group_sse,
    group_sweep,
    rows_from_arrays,
    rows_from_dataset,
)
from ._passes import phi_t_r as _phi_t_r
from ._passes import phi_w as _phi_w
from ._spectrum import MIN_NORM_RTOL, SSE_SLACK, default_rtol

__all__ = ["heads_bytes", "RowSource", "rows_from_arrays", "rows_from_dataset", "StreamOperator", "KFAC", "Jacobi",
           "StreamSolution", "stream_solve", "dual_solve", "kw_bound", "kw_lower_bound", "stream_bytes", "dual_bytes",
           "fit_path", "route_seconds", "predicted_passes", "gemm_rate", "path_bytes", "check_path_memory",
           "count_rows", "FIT_SOLVERS", "BLOCK_ROWS", "CACHE_BYTES",
           "KW_FAILURE"]

#: default failure probability of the probabilistic lower bound on lambda_min
KW_FAILURE = 1e-3
#: the probabilistic bound's run stops once the bound is this fraction of its smallest Ritz value (times
#: lambda_min(M)); past it each halving of the gap costs about sqrt(2) times the steps
KW_TARGET = 0.5


@functools.lru_cache(maxsize=1)
def _threads() -> int:
    """BLAS threads of this process when first asked (outside the krylov driver's one-thread limit)."""
    return max([int(i.get("num_threads", 1)) for i in _blas_controller().info()] + [1])


def _blas_threads():
    """Context: BLAS on the process's threads (a pass is a GEMM; the krylov driver runs its small products under
    one thread, :func:`scaleattn.linalg._krylov.lockstep`)."""
    return _blas_controller().limit(limits=_threads())


class StreamOperator:
    """``G W`` by a pass over the rows, ``G`` never formed (DESIGN §4b): the operator of
    :func:`scaleattn.linalg._krylov.krylov_solve` for the streaming path.

    The first sweep (at construction) gathers what every later step needs: the row count, ``diag G``
    (``(S o S)^T (X o X)``), the K-FAC factors ``A = S^T S`` (m x m) and ``B = X^T X`` (d x d) (sums, not
    means), with targets ``Phi^T Y`` (psi, d_out) and ``sum ||y||^2``. ``passes`` counts the products ``G W``
    since then (the sweep is not one).

    Every sum is taken per row group of the source (its blocks in order), then over the groups in the fixed-order
    tree of :mod:`scaleattn._tree` (:meth:`map_groups`): the bits of :class:`scaleattn.distributed.stream.
    DistributedStreamOperator` on any number of workers. With several groups they run on a pool of the process's
    BLAS threads, each product on one BLAS thread (as on a worker: the thread count changes a GEMM's bits).

    Parameters
    ----------
    source : RowSource
    note : callable, optional
        ``note(text)``: where the sweep and each pass say how far they are (a progress phase's note).
    journal : object, optional
        Where the sweep and the passes are kept and read back (:class:`scaleattn.distributed.journal.PassJournal`:
        ``sweep()``, ``record_sweep(total)``, ``replay(kind, W)``, ``record(kind, W, out)``, host arrays): the
        sweep, and each pass the journal holds for that very input, is read back instead of computed, every other
        one computed and recorded (an interrupted fit resumed, bit-identical to one never interrupted).
    """

    def __init__(self, source: RowSource, note=None, journal=None):
        self.source, self.note, self.journal = source, note or (lambda text: None), journal
        self.d = source.d
        self.m, self.psi = n_pairs(self.d), n_features(self.d)
        self.passes = 0
        rows = [0]

        def swept(part):  # (the groups' rows so far, for the progress note)
            rows[0] += 0 if part is None else part[5]
            self.note(f"first sweep (diag G, K-FAC factors, moments): {rows[0]:,} rows")

        self._finish_sweep(self._swept(lambda: self.map_groups(group_sweep, self.d, source.d_out, on_part=swept)))

    def _swept(self, compute):
        """The first sweep's sums: read back from the journal, else ``compute()`` (and recorded)."""
        j = self.journal
        total = None if j is None else j.sweep()
        if total is not None:
            self.note(f"first sweep read back from the checkpoint: {total[5]:,} rows")
            return total
        total = compute()
        if j is not None and total is not None:
            j.record_sweep(tuple(to_numpy(t) if not isinstance(t, (int, float)) else t for t in total))
        return total

    def _journaled(self, kind: str, func, W3, k: int):
        """``(map_groups(func, W3, k), read back?)``: the pass from the journal when it holds this very input (its
        host values moved to the rows' device), else computed and recorded."""
        j = self.journal
        if j is not None:
            out = j.replay(kind, to_numpy(W3))
            if out is not None:
                return (from_host(out, self.xp, self.device) if kind == "gw" else float(out[0])), True
        out = self.map_groups(func, W3, k)
        if j is not None:
            j.record(kind, to_numpy(W3), to_numpy(out) if kind == "gw" else [out])
        return out, False

    def _finish_sweep(self, total) -> None:
        """Keep the first sweep's sums (:func:`group_sweep`'s tuple over all groups)."""
        if total is None:
            raise DatasetError("the data have no rows: nothing to fit")
        diag, A, Bx, mom, yy, rows = total
        xp = get_xp(diag)
        k = mom.shape[1] // self.d
        self.xp, self.device, self.n_rows, self.yy = xp, device_of(diag), int(rows), float(yy)
        self._diag = xp.reshape(diag, (self.psi,))
        self.A, self.B = A, Bx
        self.moments = xp.reshape(mom, (self.psi, k)) if k else None
        if not bool(xp.all(xp.isfinite(self._diag))):
            raise DatasetError("the features overflow float64 (token entries too large): rescale the tokens")

    def map_groups(self, func, *args, on_part=None):
        """``func(blocks, *args)`` of every row group, added in the fixed-order tree (:func:`add_parts`);
        ``on_part(part)`` is told of each group's part as it is added."""
        src = self.source
        n = src.n_groups
        on_part = on_part or (lambda part: None)
        if n == 1:
            with _blas_threads():
                part = func(src.group_blocks(0), *args)
            on_part(part)
            return part
        red = TreeReducer(add_parts)
        pool = ThreadPoolExecutor(min(_threads(), n))
        try:
            with blas_single_thread():
                for part in pool.map(lambda gi: func(src.group_blocks(gi), *args), range(n)):
                    on_part(part)
                    red.add(part)
        finally:  # (Ctrl-C: the groups not started are dropped, not waited for)
            pool.shutdown(wait=False, cancel_futures=True)
        return red.result()

    def diagonal(self):
        """``diag G`` (psi,)."""
        return self._diag

    def matmat(self, W):
        """``G W = Phi^T (Phi W)`` for ``W`` (psi, k) on the rows' device (a host ``W`` is moved there): one pass
        over the rows."""
        xp, m, d = self.xp, self.m, self.d
        k = W.shape[1]
        W3 = xp.reshape(xp.asarray(on_device(W, xp, self.device), dtype=xp.float64), (m, d * k))
        t = time.perf_counter()
        out, back = self._journaled("gw", group_gw, c_order(W3), k)
        self.passes += 1
        self.note(f"data pass {self.passes} ({k} columns, "
                  + ("read back from the checkpoint)" if back else f"{time.perf_counter() - t:.1f} s)"))
        return xp.reshape(out, (self.psi, k))

    def __matmul__(self, W):
        return self.matmat(W)

    def residual_sse(self, coef) -> float:
        """``sum_i ||y_i - c^T phi_i||^2`` by a pass (exact to round-off; no cancellation against ``yy``)."""
        xp = self.xp
        c = xp.asarray(on_device(coef, xp, self.device), dtype=xp.float64)  # host coefficients moved to the rows
        k = c.shape[1]
        return float(self._journaled("sse", group_sse, c_order(xp.reshape(c, (self.m, self.d * k))), k)[0])

    def rows(self):
        """All rows at once: ``(S (N, m), X (N, d), Y (N, d_out) or None)`` (the dual path; N x (m + d) floats)."""
        xp = self.xp
        parts = list(self.source.blocks())
        S = xp.concat([p[0] for p in parts], axis=0)
        X = xp.concat([p[1] for p in parts], axis=0)
        Y = None if parts[0][2] is None else xp.concat([p[2] for p in parts], axis=0)
        return S, X, Y


class Jacobi(KFAC):
    """Diagonal (Jacobi) preconditioner ``M = diag(G)`` in :class:`KFAC`'s interface: the baseline K-FAC is measured
    against (``scaleattn bench stream``)."""

    name = "jacobi"

    def __init__(self, diagonal, n_rows: int):
        xp = get_xp(diagonal)
        self.xp, self.psi, self.n = xp, diagonal.shape[0], max(int(n_rows), 1)
        self.live = diagonal > 0
        self.scale = xp.where(self.live, 1.0 / xp.sqrt(xp.where(self.live, diagonal, 1.0)), 0.0)
        self._dmin = float(xp.min(xp.where(self.live, diagonal, xp.inf))) if bool(xp.any(self.live)) else 0.0

    def apply(self, R):
        return (self.scale * self.scale)[:, None] * R

    def apply_scaled(self, R):
        return self.xp.astype(self.live, self.xp.float64)[:, None] * R

    def half_inverse(self, R, transpose: bool = False):
        return self.scale[:, None] * R

    def half(self, R):
        return self.xp.where(self.live, 1.0 / self.xp.where(self.live, self.scale, 1.0), 0.0)[:, None] * R

    def min_eigenvalues(self) -> tuple[float, float]:
        return 1.0, self._dmin


def kw_bound(theta_min: float, theta_max: float, steps: int, n: int, lam_m: float, failure: float,
             max_steps: int) -> tuple[float, float]:
    """The Kuczynski-Wozniakowski lower bound on ``lambda_min(G)`` from ``steps`` Lanczos steps on
    ``C = L^-1 G L^-T`` ([KW92] Theorem 4.2 on ``C`` and ``-C``; DESIGN §4b, "Eigenvalues from passes").

    With ``theta_min``/``theta_max`` the extreme Ritz values after ``steps`` steps from a start uniform on the
    sphere of the ``n`` live coordinates, each of the two one-sided events has probability at most
    ``1.648 sqrt(n) exp(-sqrt(eps) (2 steps - 1))``, set to ``failure / (2 max_steps)`` so that the bounds of all
    ``max_steps`` steps hold together except with probability ``failure``. Returns ``(bound, eps)``: ``bound =
    max(theta_min - eps theta_max / (1 - eps), 0) lam_m`` (``lam_m`` a lower bound on ``lambda_min(M)``), 0 while
    ``eps >= 1``.

    Examples
    --------
    >>> b, eps = kw_bound(1.0, 4.0, 60, 1000, 0.5, 1e-3, 300)
    >>> round(eps, 4), round(b, 4)
    (0.021, 0.457)
    """
    log_term = math.log(1.648 * math.sqrt(n) * 2 * max(int(max_steps), 1) / failure)
    eps = (log_term / (2 * max(int(steps), 1) - 1)) ** 2
    if eps >= 1:
        return 0.0, eps
    return max(theta_min - eps * theta_max / (1 - eps), 0.0) * lam_m, eps


def _kw_record(failure: float, **values) -> dict:
    """What the report keeps of a probabilistic lower bound (:func:`kw_lower_bound`'s keys), ``values`` set."""
    return {"lower": 0.0, "failure_probability": float(failure), "steps": 0, "theta_min": float("nan"),
            "theta_max": float("nan"), "eps": float("nan"), "rigorous": False, "method": "Kuczynski-Wozniakowski",
            **values}


def kw_lower_bound(op, M, *, failure: float = KW_FAILURE, maxiter: int = 300, seed: int = 0,
                   target: float = KW_TARGET) -> dict:
    """A probabilistic lower bound on ``lambda_min(G)`` from passes: Lanczos on ``C = L^-1 G L^-T`` ([KW92]).

    Lanczos with full reorthogonalisation from a Gaussian start (uniform direction on the live coordinates'
    sphere, as [KW92] Theorem 4.2 assumes) gives after k steps the extreme Ritz values ``theta_1 <= theta_k`` of
    ``C`` (n live features). By the theorem, applied to ``-C`` and to ``C``, each of
    ``(theta_1 - lambda_min) / (lambda_max - lambda_min) >= eps`` and ``(lambda_max - theta_k) / (lambda_max -
    lambda_min) >= eps`` has probability at most ``1.648 sqrt(n) exp(-sqrt(eps) (2k - 1))``; with that set to
    ``failure / 2`` divided by the steps allowed (a union bound: the run stops at a step its own Ritz values
    choose, so every step's bound must hold at once), except with probability ``failure``: ``lambda_max(C) <=
    theta_k / (1 - eps)`` and ``lambda_min(C) >= theta_1 - eps theta_k / (1 - eps)`` (:func:`kw_bound`).
    ``lambda_min(G) >= lambda_min(C) lambda_min(M)`` (``G = L C L^T``). Stops once the bound is at least
    ``target`` of ``theta_1 lambda_min(M)``, or after ``maxiter`` steps. DESIGN §4b, "Eigenvalues from passes".
    :func:`stream_solve` reads the same bound off the preconditioned Lanczos run that shares CG's passes, and
    runs this only when that run ended before its bound became positive.

    Returns
    -------
    dict
        ``lower`` (the bound on ``lambda_min(G)``, 0 when the steps did not make it positive; never negative),
        ``failure_probability``, ``steps``, ``theta_min``/``theta_max`` (Ritz values of ``C``), ``eps``,
        ``rigorous`` (False: a probabilistic bound).
    """
    import scipy.linalg

    xp, psi = op.xp, op.psi
    n = int(xp.count_nonzero(M.live))
    out = _kw_record(failure)
    if n == 0:
        return out
    lam_m = M.min_eigenvalues()[1]
    steps = min(int(maxiter), n)

    def gen():
        # the seeded start is made on the host (the same numbers on every device) and moved to the rows' device
        g = from_host(np.random.default_rng([seed, 11]).standard_normal(psi), xp, device_of(op.diagonal()))
        g = g * xp.astype(M.live, xp.float64)
        q = g / vector_norm(g, xp)
        Q, alpha, beta = [], [], []
        for j in range(steps):
            Q.append(q)
            w = M.half_inverse((yield M.half_inverse(q[:, None], transpose=True)))[:, 0]
            a = float(xp.sum(q * w))
            w = w - a * q - (beta[-1] * Q[-2] if j else 0.0)
            Qm = xp.stack(Q, axis=1)
            for _ in range(2):
                w = w - Qm @ (Qm.T @ w)
            b = float(vector_norm(w, xp))
            alpha.append(a)
            ev = scipy.linalg.eigh_tridiagonal(np.array(alpha), np.array(beta), eigvals_only=True)
            k = j + 1
            out["lower"], eps = kw_bound(float(ev[0]), float(ev[-1]), k, n, lam_m, failure, steps)
            out.update(steps=k, theta_min=float(ev[0]), theta_max=float(ev[-1]), eps=eps)
            if out["lower"] >= target * float(ev[0]) * lam_m > 0:
                return
            if k == n or b <= EPS * max(abs(float(ev[-1])), 1e-300):
                # the Krylov space is invariant (or the whole space): the Ritz values are eigenvalues of C to
                # round-off, the bound no longer probabilistic in the start (only round-off, n eps theta_k)
                out["lower"] = max(float(ev[0]) - n * EPS * float(ev[-1]), 0.0) * lam_m
                out["invariant_subspace"] = True
                return
            beta.append(b)
            q = w / b

    lockstep(op.matmat, {"kw": gen()})
    return out


@dataclasses.dataclass
class StreamSolution:
    """Least squares from passes over the tokens ([Y25] Algorithm 1; DESIGN §4b).

    ``coef`` (psi, d_out) float64 in the layout of :func:`scaleattn.solve`'s (the paper's ``p(Theta)``);
    ``certificate`` (:class:`~scaleattn.linalg._certificate.Certificate`; ``estimates["solver"]`` says
    ``"stream"`` or ``"dual"``, with the passes, the preconditioner and the probabilistic lower bound);
    ``null_basis`` (psi, j): the null directions found (``"stream"``: the whole numerical null space when
    ``rank_converged``; ``"dual"``: one null direction, the witness, since the null space has psi - N dimensions);
    ``sse`` the training sum of squares by a pass over the rows; ``backward_error`` and ``converged`` per output
    (the dual: the relative residual of ``Phi^T (Phi c - Y)`` is not iterated, always converged); ``passes``
    over the data (the first sweep included); ``path``: ``"stream"`` or ``"dual"``.
    """

    coef: np.ndarray
    certificate: Certificate
    null_basis: np.ndarray
    sse: float
    backward_error: np.ndarray
    converged: np.ndarray
    passes: int
    path: str
    n_rows: int
    yy: float
    ridge: float = 0.0
    effective_dof: float = float("nan")

    @property
    def rank(self) -> int:
        return self.certificate.rank


def heads_bytes(d: int, d_out: int) -> int:
    """Bytes of the svd heads of coefficients (psi, d_out): ``W`` (d_out d, d^2) and its SVD factors."""
    return 8 * 3 * d_out * d * d * d


def stream_bytes(d: int, d_out: int, *, block_rows: int = BLOCK_ROWS, eig_columns: int = 8) -> int:
    """Bytes the streaming path holds besides the tokens: the K-FAC factors and their inverses (``4 m^2``), ``diag G``
    and the moments, the krylov vectors (about ``(8 d_out + 6 eig_columns) psi`` incl. the Lanczos bases of at most
    300 vectors), one block's products (``rows (m + 3 d k)``) and the svd heads (:func:`heads_bytes`)."""
    m, psi = n_pairs(d), n_features(d)
    k = d_out + eig_columns
    return 8 * (4 * m * m + psi * (9 * d_out + 6 * eig_columns + 1) + 2 * 300 * psi + block_rows * (m + 3 * d * k)) \
        + heads_bytes(d, d_out)


def dual_bytes(n_rows: int, d: int, d_out: int) -> int:
    """Bytes the dual path holds: the rows' features (``N (m + d + d_out)``), ``K``, the eigenvectors of the scaled
    and the unscaled ``K`` and a work copy (``4 N^2``), ``diag G``, the moments, the coefficients and their
    products (``psi (3 d_out + 2)``) and the svd heads (:func:`heads_bytes`)."""
    m, psi = n_pairs(d), n_features(d)
    return 8 * (n_rows * (m + d + d_out) + 4 * n_rows * n_rows + psi * (3 * d_out + 2)) + heads_bytes(d, d_out)


def _preconditioner(op: StreamOperator, kind):
    if not isinstance(kind, str):
        return kind  # an object with the interface (tests inject one)
    if kind == "kfac":
        return KFAC(op.A, op.B, op.diagonal(), op.n_rows)
    if kind == "jacobi":
        return Jacobi(op.diagonal(), op.n_rows)
    raise ParameterError(f"preconditioner must be 'kfac' or 'jacobi', got {kind!r}")


def stream_solve(source: RowSource, *, cutoff_rtol: float | None = None, btol: float | None = None,
                 maxiter: int = MAXITER, preconditioner="kfac", eig_budget: str = "solve", seed: int = 0,
                 lower_bound: bool = True, failure: float = KW_FAILURE, op: StreamOperator | None = None,
                 certify_only: bool = False, note=None) -> StreamSolution | Certificate:
    """Min-norm least squares and the certificate from passes over the tokens ([Y25] Algorithm 1, Lemma 2.3;
    DESIGN §4b): ``G``, ``Tc`` and ``Phi`` are never formed.

    CG on the Jacobi-scaled normal equations with the K-FAC preconditioner, the d_out columns sharing each pass,
    each stopping on its backward error ``||S B - Gs x|| / (lambda_max(Gs) ||x|| + ||S B||) <= btol`` (default
    ``psi eps``, :mod:`scaleattn.linalg._krylov`), null directions deflated for the min-norm answer; the extreme
    eigenvalues of ``G / N`` as intervals from the same passes, and (``lower_bound``) the probabilistic lower bound
    of :func:`kw_lower_bound` on a full-rank Gram.

    Parameters
    ----------
    source : RowSource
        The rows (:func:`rows_from_arrays`, :func:`rows_from_dataset`); with targets unless ``certify_only``.
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff of the Jacobi-scaled Gram (default ``16 psi eps``).
    btol : float, optional
        Backward-error target (default ``cutoff_rtol / 16``).
    maxiter : int
        Pass budget of each Krylov run; a column that does not converge within it is reported
        (``converged`` False, ``certificate.estimates["notes"]``), never silently returned.
    preconditioner : {"kfac", "jacobi"} or object
        K-FAC (default) or diagonal; an object with :class:`KFAC`'s interface is used as given.
    eig_budget, seed
        As :func:`scaleattn.linalg._krylov.krylov_solve`.
    lower_bound : bool
        Run :func:`kw_lower_bound` (extra passes of one column) when the rank is full.
    failure : float
        Its failure probability.
    op : StreamOperator, optional
        The operator of ``source`` if already made (its first sweep is then not repeated).
    certify_only : bool
        Return the :class:`Certificate` alone (no targets needed).
    note : callable, optional
        ``note(text)`` told of the first sweep's rows and of each pass (:class:`StreamOperator`).

    Returns
    -------
    StreamSolution or Certificate

    Raises
    ------
    ParameterError
        No targets (unless ``certify_only``); an unknown preconditioner.
    DatasetError
        No rows; features that overflow float64.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.features import token_features, row_targets, phi
    >>> rng = np.random.default_rng(0)
    >>> tok, y = rng.standard_normal((300, 5, 2)), rng.standard_normal((300, 5, 2))
    >>> sol = stream_solve(rows_from_arrays(tok, y, causal=True))
    >>> s, x = token_features(tok, causal=True)
    >>> ref = np.linalg.lstsq(phi(s, x), row_targets(y, causal=True), rcond=None)[0]
    >>> bool(np.abs(sol.coef - ref).max() < 1e-9 * np.abs(ref).max()), sol.certificate.verdict
    (True, 'identifiable')
    """
    if source.d_out == 0 and not certify_only:
        raise ParameterError("the data have no targets; cannot solve (certify_only=True gives the certificate)")
    op = StreamOperator(source, note) if op is None else op
    xp, psi = op.xp, op.psi
    rtol = float(default_rtol(psi)) if cutoff_rtol is None else float(cutoff_rtol)
    M = _preconditioner(op, preconditioner)
    B = None if certify_only else op.moments
    # the preconditioned Lanczos run starts from r_0 = S L g (g Gaussian, M = L L^T): its Ritz values then give the
    # probabilistic lower bound with no passes of its own (kw_bound); the eigenvalue runs end with the solve
    g = from_host(np.random.default_rng([seed, 11]).standard_normal((psi, 1)), xp, device_of(M.scale))  # host seed
    start = M.scale * M.half(g)[:, 0]
    n_live, lam_m, steps_max = int(xp.count_nonzero(M.live)), M.min_eigenvalues()[1], min(maxiter, LANCZOS_MAX)

    def enough(lo, hi, k, over):  # the bound reached KW_TARGET of what the run shows, or the rest is done and it holds
        b = kw_bound(lo, hi, k, n_live, lam_m, failure, steps_max)[0]
        return b >= KW_TARGET * lo * lam_m > 0 or (over and b > 0)

    res = krylov_solve(op, B, rtol=rtol, btol=btol, maxiter=maxiter, eig_budget=eig_budget, seed=seed,
                       yy=None if certify_only else op.yy, preconditioner=M, min_eig_passes=0, pre_start=start,
                       pre_until=enough if lower_bound else None)
    spec = res if certify_only else res.spectrum
    passes = op.passes
    kw = None
    if lower_bound and spec.rank == psi and bool(xp.all(M.live)):
        pre = spec.preconditioned
        if pre is not None and pre["theta_min"] is not None and pre["steps"] > 0:
            low, eps = kw_bound(pre["theta_min"], pre["theta_max"], pre["steps"], pre["n"], lam_m, failure,
                                steps_max)
            kw = _kw_record(failure, lower=low, steps=pre["steps"], theta_min=pre["theta_min"],
                            theta_max=pre["theta_max"], eps=eps, shared_passes=True)
        if kw is None or kw["lower"] <= 0:  # the shared run ended too early: a run of its own
            kw = kw_lower_bound(op, M, failure=failure, maxiter=min(maxiter, 300), seed=seed)
    cert = certificate_from_krylov(spec, op.n_rows)
    est = cert.estimates
    if kw is not None and kw["lower"] > 0 and lam_m > 0:
        # what the verdict rests on: Krylov iterates decide the rank; the same Kuczynski-Wozniakowski bound, times
        # lambda_min(Ms) instead of lambda_min(M), bounds lambda_min(Gs) from below and clears the cutoff or not
        low_s = kw["lower"] / lam_m * M.min_eigenvalues()[0]
        est["identifiable_with_probability"] = (1.0 - failure) if low_s > rtol * spec.lam_max_scaled.upper else None
    est.update({"solver": "stream", "preconditioner": getattr(M, "name", type(M).__name__),
                "data_passes": int(op.passes + 1), "krylov_passes": int(passes),
                "lambda_min_lower_rigorous": 0.0,
                "lambda_min_lower_probabilistic": None if kw is None else {
                    **kw, "lower": kw["lower"] / max(op.n_rows, 1)}})
    est["notes"] = list(est.get("notes", [])) + [
        "lambda_min's lower ends come from Krylov iterates (an eigenvalue lies in each interval; that it is the"
        " extreme one is assumed, not proved); the only rigorous lower bound from passes is 0"
        + ("" if kw is None else f"; with probability >= {1 - failure:g} lambda_min >="
           f" {kw['lower'] / max(op.n_rows, 1):.3e} (Kuczynski-Wozniakowski, {kw['steps']} Lanczos steps)")]
    if certify_only:
        return cert
    est.update({"cg_iterations": int(res.iterations), "backward_error": res.backward_error.tolist(),
                "solve_converged": bool(res.converged.all())})
    sse = op.residual_sse(res.coef)
    est["data_passes"] = int(op.passes + 1)
    return StreamSolution(res.coef, cert, res.null_basis, sse, res.backward_error, res.converged, op.passes + 1,
                          "stream", op.n_rows, op.yy, 0.0, float(spec.rank))


def dual_solve(source: RowSource, *, cutoff_rtol: float | None = None, seed: int = 0,
               op: StreamOperator | None = None, certify_only: bool = False,
               note=None) -> StreamSolution | Certificate:
    """Min-norm least squares for fewer rows than features by the dual ([Y25] Algorithm 1; DESIGN §4b, "the dual").

    ``c = Phi^T alpha`` with ``alpha = K^+ Y`` on the eigenvectors of ``K = Phi Phi^T = (S S^T) * (X X^T)``
    (elementwise; N x N) above ``cutoff_rtol`` times its largest eigenvalue: the min-norm solution in the
    original coordinates (``numpy.linalg.lstsq`` on the explicit features), never forming ``Phi`` or ``G``.
    ``rank(G) = rank(K) <= N < psi``, so the verdict is "not identifiable" by dimension count, whatever the
    round-off; ``lambda_min(G / N) = 0`` and ``lambda_max = lambda_max(K) / N``. The witness direction is a
    random vector with its row-space part removed (``v - Phi^T K^+ Phi v``).

    Parameters
    ----------
    source : RowSource
        With targets.
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff on ``K`` (default ``16 psi eps``).
    seed : int
        Seed of the witness direction.
    op : StreamOperator, optional
        The operator of ``source`` if already made.
    certify_only : bool
        Return the :class:`Certificate` alone (no targets needed).
    note : callable, optional
        ``note(text)`` told of the sweep's rows (:class:`StreamOperator`).

    Returns
    -------
    StreamSolution or Certificate
        ``path = "dual"``; ``null_basis`` (psi, 1) one unit null direction.

    Raises
    ------
    ParameterError
        No targets, or at least as many rows as features (use :func:`stream_solve`).

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.features import token_features, phi
    >>> rng = np.random.default_rng(0)
    >>> tok, y = rng.standard_normal((30, 4, 4)), rng.standard_normal((30, 2))
    >>> sol = dual_solve(rows_from_arrays(tok, y))
    >>> s, x = token_features(tok)
    >>> ref = np.linalg.lstsq(phi(s, x), y, rcond=None)[0]
    >>> bool(np.abs(sol.coef - ref).max() < 1e-9 * np.abs(ref).max()), sol.rank, sol.certificate.verdict
    (True, 30, 'not identifiable')
    """
    if source.d_out == 0 and not certify_only:
        raise ParameterError("the data have no targets; cannot solve")
    op = StreamOperator(source, note) if op is None else op
    xp, psi, m, d = op.xp, op.psi, op.m, op.d
    if op.n_rows >= psi:
        raise ParameterError(f"the dual path needs fewer rows than features ({op.n_rows} rows, psi = {psi})")
    rtol = float(default_rtol(psi)) if cutoff_rtol is None else float(cutoff_rtol)
    S, X, Y = op.rows()
    # Jacobi-like scaling that keeps the Kronecker structure: S's columns by their RMS, X's by theirs. A rescaling
    # of the token coordinates scales phi's columns by exactly such a product, so K~ = (S~ S~^T) * (X~ X~^T) does not
    # depend on it; the rank is decided and the system solved there (an unscaled K lost rank 40 -> 11 on tokens
    # with coordinates 1e3 .. 1e-3 apart).
    ds, dx = xp.sqrt(xp.mean(S * S, axis=0)), xp.sqrt(xp.mean(X * X, axis=0))
    ds, dx = xp.where(ds > 0, ds, 1.0), xp.where(dx > 0, dx, 1.0)
    St, Xt = S / ds[None, :], X / dx[None, :]
    fscale = xp.reshape(ds[:, None] * dx[None, :], (psi, 1))  # phi~ = phi / fscale (feature P d + l)
    with _blas_threads():
        # (row_gram: by GEMMs of row blocks; numpy's S @ S.T is a threaded dsyrk, which dies at N = 20,000)
        K = row_gram(S) * row_gram(X)
        K = (K + K.T) / 2
        w0 = xp.linalg.eigvalsh(K)
        Kt = row_gram(St) * row_gram(Xt)
        Kt = (Kt + Kt.T) / 2
        w, U = xp.linalg.eigh(Kt)
    del Kt
    top = max(float(w0[-1]), 0.0)  # lambda_max(G) = lambda_max(K), unscaled
    top_s = max(float(w[-1]), 0.0)
    keep = w > rtol * top_s
    rank = int(xp.count_nonzero(keep))
    n = max(op.n_rows, 1)
    ki = xp.nonzero(keep)[0]  # the eigenvalues stay on the device: only the scalars below come to the host
    wr = xp.take(w, ki)
    cond = float(wr[-1] / wr[0]) if rank else float("inf")
    est = {"solver": "dual", "kernel_rows": int(op.n_rows), "kernel_rank": rank,
           "kernel_eigenvalues_relative": [float(w[0] / top_s) if top_s else 0.0, 1.0],
           "kernel_scaled": True,
           "data_passes": 1, "lambda_min_lower_rigorous": 0.0, "lambda_min_lower_probabilistic": None,
           "notes": [f"fewer rows ({op.n_rows}) than features ({psi}): rank(G) = rank(K) = {rank} < psi, not"
                     " identifiable by dimension count; solved by the dual (K = Phi Phi^T, rank decided on the"
                     " Kronecker-scaled kernel)"]}
    cert = Certificate(op.n_rows, psi, rank, rtol, 0.0, top / n, 0.0, cond, np.array([0.0, top / n]), None,
                       converged=True, estimates=est)
    if certify_only:
        del K
        return cert
    Ur = _cols(U, ki)
    del U

    def phi_t(R, s=S, x=X):  # Phi^T R (psi, k) from the rows held
        return xp.reshape(_phi_t_r(s, x, R), (psi, R.shape[1]))

    def phi_w(W, s=S, x=X):
        return _phi_w(s, x, xp.reshape(W, (m, d * W.shape[1])), W.shape[1])

    k_out = Y.shape[1]
    root = xp.sqrt(xp.maximum(op.diagonal(), 0.0))
    with _blas_threads():
        # the scaled answer: c~ = Phi~^T K~^+ Y, c = c~ / fscale, predictions Phi~ c~
        ct = phi_t(Ur @ ((Ur.T @ Y) / wr[:, None]), St, Xt)
        coef = ct / fscale
        pred = phi_w(ct, St, Xt)
        sse = float(xp.sum((Y - pred) ** 2))
        # the original-coordinate min-norm answer c0 = Phi^T K^+ p (as lstsq; DESIGN §4), kept only when its SSE
        # is the scaled answer's to round-off (as scaleattn.linalg._spectrum.min_norm decides for the Gram path)
        w0, U0 = xp.linalg.eigh(K)
        del K
        k0 = xp.nonzero(w0 > rtol * top)[0]
        U0r, w0r = _cols(U0, k0), xp.take(w0, k0)
        del U0
        c0 = phi_t(U0r @ ((U0r.T @ pred) / w0r[:, None]))
        pred0 = phi_w(c0 * fscale, St, Xt)
        sse0 = float(xp.sum((Y - pred0) ** 2))
        yy = max(float(op.yy), 0.0)
        floor = EPS * sum(float((math.sqrt(yy / max(k_out, 1)) + float(xp.sum(root * xp.abs(c[:, j])))) ** 2)
                          for c in (coef, c0) for j in range(k_out))
        allowed = max(MIN_NORM_RTOL**2 * min(max(sse, 0.0), yy), min(SSE_SLACK * floor, MIN_NORM_RTOL**2 * yy))
        min_norm_kept = bool(math.isfinite(sse0) and sse0 - sse <= allowed)
        if min_norm_kept:
            coef, pred, sse = c0, pred0, sse0
        est["min_norm_original_coordinates"] = min_norm_kept
        # the witness: a random direction without its row-space part (orthogonal to every phi_i), found in the
        # scaled coordinates (Phi v = Phi~ (fscale v)) and mapped back
        u = from_host(np.random.default_rng([seed, 5]).standard_normal((psi, 1)), xp, device_of(S))  # host seed
        for _ in range(2):  # twice: one projection leaves round-off of the row-space part
            u = u - phi_t(Ur @ ((Ur.T @ phi_w(u, St, Xt)) / wr[:, None]), St, Xt)
        v = u / fscale
        v = v / vector_norm(v, xp)
        # normwise backward error [RG67] of the normal equations G c = B, ||G||_2 = lambda_max(K) (d_out numbers)
        g = phi_t(pred - Y)
        be = to_numpy(vector_norm(g, xp, axis=0)) / np.maximum(
            to_numpy(top * vector_norm(coef, xp, axis=0) + vector_norm(op.moments, xp, axis=0)), 1e-300)
    est.update(backward_error=be.tolist(), solve_converged=True)
    # the results (coef, the witness: psi x d_out and psi x 1) come to the host once: the solution is host-side
    return StreamSolution(to_numpy(coef), cert, to_numpy(v), sse, be, np.ones(be.shape[0], bool), 1, "dual",
                          op.n_rows, op.yy, 0.0, float(rank))


#: the solver choices of a fit from the data (the statistics' SOLVERS plus the streaming path)
FIT_SOLVERS = ("auto", "eigh", "cholesky", "krylov", "stream")


def count_rows(n_samples: int, length: int, causal: bool, lengths=None) -> int:
    """Rows of a data set: ``n`` (last token), ``n T`` or ``sum(lengths)`` (causal)."""
    if not causal:
        return int(n_samples)
    if lengths is None:
        return int(n_samples) * int(length)
    xp = get_xp(lengths)  # device lengths are summed on their device; host array-likes (zarr, lists) through numpy
    return int(np.sum(to_numpy(lengths))) if is_numpy(xp) else int(xp.sum(lengths))


#: efficiencies (fractions of the DGEMM rate) of the work the cost model counts, measured on the 2-core test VM:
#: a stream pass (its two GEMMs and the token features, 86-95 of 148 GFLOP/s at d = 32), the statistics build
#: (the compact Gram's multiply-adds at 1.1-1.4x their floor), a dense factorisation and one column of a krylov
#: pass over ``Tc`` (memory-bound: 0.06 s per column at d = 32, plus 0.2 s shared by the columns)
EFFICIENCY = {"pass": 0.6, "build": 0.75, "factor": 0.5, "tc_column": 0.07}
#: the shared part of a krylov pass over ``Tc``, in columns
TC_FIXED_COLUMNS = 3.3
#: CG passes against sqrt of the preconditioned condition number: measured 65 / 31 / 284 passes at 3 / 10 / 1.2
#: rows per feature (d = 8-24), 12.9-17.4 times the Marchenko-Pastur ``(1 + sqrt g) / (1 - sqrt g)``, g = psi / N
PASSES_PER_ROOT_CONDITION = 16.0
#: columns the eigenvalue runs add to each pass of the streaming path (Lanczos, LOBPCG block 2, the
#: preconditioned Lanczos, the unscaled runs; the Lanczos runs end early)
EIG_COLUMNS = 5
#: ``auto`` leaves the Gram route (reusable statistics, plots, every head method) for the stream path only when
#: the model predicts it this many times faster
STREAM_MARGIN = 1.5


@functools.lru_cache(maxsize=1)
def gemm_rate() -> float:
    """This machine's float64 GEMM rate (flop/s), best of three 1024^3 products on the process's threads."""
    a = np.random.default_rng(0).standard_normal((1024, 1024))
    best = float("inf")
    with _blas_threads():
        for _ in range(3):
            t = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t)
    return 2.0 * 1024**3 / max(best, 1e-9)


def predicted_passes(n_rows: int, d: int) -> int:
    """CG passes of the streaming path predicted from rows per feature (:data:`PASSES_PER_ROOT_CONDITION`)."""
    g = min(n_features(d) / max(int(n_rows), 1), 0.999)
    return int(math.ceil(PASSES_PER_ROOT_CONDITION * (1 + math.sqrt(g)) / (1 - math.sqrt(g)))) + 4


def route_seconds(n_rows: int, d: int, d_out: int, *, dense: bool = True, rate: float | None = None) -> dict:
    """Predicted seconds of a fit by the Gram route and by the streaming path on this machine (DESIGN §4b, "cost
    model"): flops at :data:`EFFICIENCY` of the measured :func:`gemm_rate`.

    Gram route: the build's ``N psi^2 / 2`` flops (the compact Gram's ``N psi^2 / 4`` multiply-adds), then a
    dense factorisation (``psi^3 / 3``) when ``dense``, else krylov passes over ``Tc`` (as many as CG needs, at
    least :data:`scaleattn.linalg._krylov.MIN_EIG_PASSES`, each ``2 psi^2`` flops per column). Streaming: the first
    sweep (``2 N m^2``) and :func:`predicted_passes` passes of ``4 N psi (d_out + EIG_COLUMNS)`` flops.

    Returns
    -------
    dict
        ``gram``, ``stream`` (seconds), ``passes`` (predicted), ``rate`` (flop/s).

    Examples
    --------
    >>> c = route_seconds(130_680, 44, 44, dense=False, rate=1e11)
    >>> c["passes"], c["gram"] > 1.5 * c["stream"]
    (64, True)
    """
    rate = gemm_rate() if rate is None else float(rate)
    n, psi, m = float(n_rows), float(n_features(d)), float(n_pairs(d))
    passes = predicted_passes(n_rows, d)
    e = EFFICIENCY
    build = n * psi * psi / 2 / (e["build"] * rate)
    if dense:
        solve = psi**3 / 3 / (e["factor"] * rate)
    else:
        solve = max(passes, MIN_EIG_PASSES) * 2 * psi * psi * (TC_FIXED_COLUMNS + d_out + EIG_COLUMNS) / (
            e["tc_column"] * rate)
    stream = (2 * n * m * m + passes * 4 * n * psi * (d_out + EIG_COLUMNS)) / (e["pass"] * rate)
    return {"gram": build + solve, "stream": stream, "passes": passes, "rate": rate}


def fit_path(solver: str, n_rows: int, d: int, d_out: int, *, heads="svd", ridge: float = 0.0,
             available: float | None = None, large_psi: int = 2_000, gram_refusal: str | None = None,
             gram_dense: bool = True, extra_bytes: float = 0.0) -> tuple[str | None, str]:
    """Which path a fit from the data takes, and why: ``("stream" | "dual", reason)``, or ``(None, reason)`` for
    the Gram route (statistics, then :func:`scaleattn.solve`). DESIGN §4b.

    ``"stream"`` asked: the dual when ``n_rows < psi`` (the primal CG would only find the min-norm answer
    through psi - N deflated directions), else the streaming CG. ``"auto"``, memory first, then cost: the dual
    when ``n_rows < psi``, psi is past ``large_psi`` (where the Gram route factors or iterates on a singular
    psi x psi Gram) and ``K`` fits in ``available`` bytes; else the streaming CG when the Gram route does not
    fit (``gram_refusal``, its reason) and the stream path does, or when :func:`route_seconds` predicts it
    :data:`STREAM_MARGIN` times faster (``gram_dense``: the Gram route's solver would be dense, else krylov);
    else the Gram route. ``extra_bytes``: what the stream path holds besides :func:`stream_bytes` (a chunk of the
    dataset as read). The streaming paths give the least-squares coefficients and svd heads only.

    Raises
    ------
    ParameterError
        ``"stream"`` with ``heads`` other than ``"svd"`` or ``ridge > 0`` (both need the Gram).
    """
    psi = n_features(d)
    under = n_rows < psi
    if solver == "stream":
        if heads != "svd" or ridge > 0:
            what = ("heads " + (heads if isinstance(heads, str) else str(heads)) if heads != "svd" else
                    f"ridge {ridge:g}")
            raise ParameterError(f"the stream solver fits least squares with svd heads only ({what} needs the"
                                 " Gram): use the svd heads and no ridge, or another solver")
        if under:
            return "dual", f"fewer rows ({n_rows:,}) than features ({psi:,}): the dual (N x N kernel)"
        return "stream", "asked for (solver='stream')"
    capable = solver == "auto" and heads == "svd" and ridge == 0
    if capable and under and psi > large_psi:
        need = dual_bytes(n_rows, d, d_out)
        if available is None or need <= available:
            return "dual", (f"fewer rows ({n_rows:,}) than features ({psi:,}): the dual's N x N kernel"
                            f" ({need / 2**30:.2f} GiB with the coefficients and heads) instead of a singular"
                            " psi x psi Gram")
    if not capable or under:
        return None, "the Gram route"
    fits = available is None or stream_bytes(d, d_out) + extra_bytes <= available
    if gram_refusal is not None and fits:
        return "stream", (f"the Gram route does not fit ({gram_refusal}); the stream path needs"
                          f" {stream_bytes(d, d_out) / 2**30:.2f} GiB")
    if gram_refusal is not None or psi <= large_psi:
        return None, "the Gram route"
    c = route_seconds(n_rows, d, d_out, dense=gram_dense)
    said = (f"predicted {c['stream']:.3g} s by the stream path ({c['passes']} passes) against {c['gram']:.3g} s by"
            f" the Gram route ({'build and dense factorisation' if gram_dense else 'build and krylov on Tc'}),"
            f" at {c['rate'] / 1e9:.0f} GFLOP/s")
    if fits and c["stream"] * STREAM_MARGIN < c["gram"]:
        return "stream", said
    return None, "the Gram route: " + said


def path_bytes(path: str, n_rows: int, d: int, d_out: int) -> int:
    """Bytes :func:`stream_bytes` or :func:`dual_bytes` of ``path``."""
    return dual_bytes(n_rows, d, d_out) if path == "dual" else stream_bytes(d, d_out)


def check_path_memory(path: str, n_rows: int, d: int, d_out: int, available: float, extra: float = 0.0) -> None:
    """Refuse, before any work, a streaming or dual fit whose :func:`path_bytes` (plus ``extra``) exceed
    ``available`` bytes.

    Raises
    ------
    InsufficientMemoryError
        One line: the path, the size, what it holds, the memory there is.
    """
    need = path_bytes(path, n_rows, d, d_out) + extra
    if need > available:
        raise InsufficientMemoryError(f"a {path} fit with d = {d} ({n_rows:,} rows, psi = {n_features(d):,}) needs"
                                      f" {need / 2**30:.2f} GiB ({'the N x N kernel' if path == 'dual' else 'K-FAC'}"
                                      f" factors, coefficients, svd heads); this machine has {available / 2**30:.2f}"
                                      " GiB available. Use a machine with more memory or a smaller d.")
