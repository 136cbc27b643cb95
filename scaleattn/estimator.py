"""scikit-learn style estimator for in-memory arrays: :class:`MHLARegressor`."""
from __future__ import annotations

import functools
import inspect

import numpy as np

from ._backend import as_float64, get_xp, is_numpy, to_numpy
from ._params import choice, heads_spec
from .data._checks import check_arrays, check_lengths, check_values, is_real
from .distributed.memory import available_memory, fit_route
from .errors import DatasetError, NotFittedError
from .linalg._certificate import check_cutoff
from .linalg._qr import CERTIFICATE_METHODS, factor_from_arrays, needs_qr, solve_from_r
from .linalg._solver import check_no_worse_than_zero, check_ridge, shared_gram, solve_validated
from .linalg._stream import (
    FIT_SOLVERS,
    check_path_memory,
    count_rows,
    dual_solve,
    rows_from_arrays,
    stream_solve,
)
from .model import heads_are_exact, model_from_heads, model_from_statistics, recover_heads, residual_sums
from .statistics._container import block_samples, statistics_from_arrays

__all__ = ["MHLARegressor"]



def _as_float(name: str, a):
    """``a`` as float64 in its own namespace and on its own device (numpy for host array-likes): integers are
    converted, booleans, complex, strings and objects refused; NaN, Inf and overflowing magnitudes refused naming
    the sample (:func:`scaleattn.data._checks.check_values`)."""
    if a is None:
        return None
    xp = get_xp(a)
    a = np.asarray(a) if is_numpy(xp) else a
    if a.ndim == 0 or not is_real(a):
        raise DatasetError(f"{name}: expected an array of a float (or integer) dtype, got {a.dtype}"
                           + (" (a scalar)" if a.ndim == 0 else ""))
    check_values(name, a, 0)  # (before the conversion: integers beyond 2^53 would be rounded by it)
    return as_float64(a, xp)


def _as_lengths(lengths):
    """``lengths`` as given when they are another library's array (the kernels move host lengths to the tokens'
    device themselves), else a numpy array."""
    if lengths is None or not is_numpy(get_xp(lengths)):
        return lengths
    return np.asarray(lengths)


@functools.cache
def _not_fitted_error() -> type:
    """:class:`~scaleattn.errors.NotFittedError`, also scikit-learn's ``NotFittedError`` where scikit-learn is
    installed (imported only then: its import takes a second)."""
    try:
        from sklearn.exceptions import NotFittedError as SklearnNotFitted
    except ImportError:
        return NotFittedError
    return type("NotFittedError", (NotFittedError, SklearnNotFitted), {"__module__": __name__})


class MHLARegressor:
    """Multi-head linear attention fitted by certified least squares, scikit-learn style ([Y25] Algorithm 1).

    Parameters
    ----------
    heads : "svd", "minimal" or int
        Head recovery (:func:`scaleattn.heads._search.search_heads`).
    cutoff_rtol : float, optional
        Relative eigenvalue cutoff of the solver in (0, 1) (default ``16 psi eps``).
    ridge : float
        Scaled ridge strength >= 0 (:func:`scaleattn.solve`).
    solver : "auto", "eigh", "cholesky", "krylov" or "stream"
        Solver path (:func:`scaleattn.linalg._spectrum.solver_path`; ``"krylov"``: matrix-free CG and Lanczos on the
        compact Gram, ``G`` never formed; ``"stream"``: CG and the certificate from passes over the tokens, no
        statistics and no psi^2 object, or the dual for fewer rows than features, :mod:`scaleattn.linalg._stream`,
        svd heads only). ``"auto"`` takes the dual for fewer rows than features past psi = 2,000, and the stream
        path when the Gram route does not fit in memory or the cost model predicts it 1.5x faster
        (:func:`scaleattn.linalg._stream.fit_path`); ``path_`` says which path ran and why.
    certificate : "auto", "gram" or "qr"
        What decides the rank and solves (:func:`scaleattn.fit`): ``"auto"`` a QR of the features
        (:mod:`scaleattn.linalg._qr`) only when the Gram does not certify identifiability and psi is small.

    Attributes
    ----------
    model_ : MHLAModel
    solution_ : Solution
    heads_result_ : Heads
    certificate_ : Certificate
    coef_ : ndarray (psi, d_out)
    n_heads_ : int

    Raises
    ------
    ParameterError
        From :meth:`fit`: a parameter out of range or not one of its choices.
    DatasetError
        From :meth:`fit`: arrays of the wrong shape or dtype, or with NaN/Inf (naming the sample).

    See Also
    --------
    scaleattn.fit : the same on a Zarr dataset, on a Dask cluster, with a run directory.

    Examples
    --------
    >>> from scaleattn.generate import make_mhla
    >>> data = make_mhla(d=2, heads=1, length=20, samples=200)
    >>> est = MHLARegressor(heads="minimal").fit(data["tokens"], data["targets"])
    >>> est.n_heads_, bool(est.certificate_.identifiable)
    (1, True)
    """

    def __init__(self, heads="svd", cutoff_rtol=None, ridge: float = 0.0, solver: str = "auto",
                 certificate: str = "auto"):
        self.heads = heads
        self.cutoff_rtol = cutoff_rtol
        self.ridge = ridge
        self.solver = solver
        self.certificate = certificate

    def get_params(self, deep=True) -> dict:
        """The constructor's parameters (read from its signature, as scikit-learn's ``BaseEstimator``)."""
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return {k: getattr(self, k) for k in names}

    def set_params(self, **params):
        valid = self.get_params()
        for k, v in params.items():
            if k not in valid:
                raise ValueError(f"invalid parameter {k!r} for {type(self).__name__}; valid: {sorted(valid)}")
            setattr(self, k, v)
        return self

    def _checked(self) -> dict:
        return {"heads": heads_spec(self.heads), "cutoff_rtol": check_cutoff(self.cutoff_rtol),
                "ridge": check_ridge(self.ridge), "solver": choice("solver", self.solver, FIT_SOLVERS),
                "certificate": choice("certificate", self.certificate, CERTIFICATE_METHODS)}

    def fit(self, tokens, targets, lengths=None):
        """Fit to tokens (n, T, d) and targets (n, d_out) or (n,) (last token) or (n, T, d_out) (every prefix).

        Targets (n,), one output as scikit-learn's ``y``, are fitted as (n, 1); :meth:`predict` then returns
        (n,) as scikit-learn regressors do. Integer tokens and targets are converted to float64. Raises
        :class:`~scaleattn.errors.ParameterError` for a bad parameter and
        :class:`~scaleattn.errors.DatasetError` for bad arrays (shapes, dtypes, non-finite values).
        """
        params = self._checked()
        tokens, targets = _as_float("tokens", tokens), _as_float("targets", targets)
        one_d = targets.ndim == 1
        if one_d:  # one output per sample (scikit-learn's y)
            targets = targets[:, None]
        lengths = _as_lengths(lengths)
        T = check_arrays(tokens, targets, lengths)[1]
        if lengths is not None:
            check_lengths(lengths, 0, T)
        causal = targets.ndim == 3
        rows = count_rows(tokens.shape[0], T, causal, lengths)
        have = available_memory()
        path, why = fit_route(params["solver"], rows, tokens.shape[2], targets.shape[-1], heads=params["heads"],
                              ridge=params["ridge"])
        if path is not None:
            check_path_memory(path, rows, tokens.shape[2], targets.shape[-1], have)
            return self._fit_streaming(path, why, params, tokens, targets, lengths, causal)
        self.path_ = {"path": "gram", "reason": why}
        stats = statistics_from_arrays(tokens, targets, lengths)  # on the arrays' device; solved on the host
        G = shared_gram(stats, params["solver"])
        sol = solve_validated(stats, params["cutoff_rtol"], ridge=params["ridge"], solver=params["solver"], gram=G)
        if needs_qr(params["certificate"], sol.certificate, stats.psi):  # the arrays are here: no second pass
            host = [None if a is None else to_numpy(a) for a in (tokens, targets, lengths)]  # the QR runs on numpy
            sol = solve_from_r(factor_from_arrays(*host), params["cutoff_rtol"], params["ridge"], gram=sol.certificate)
        self.model_, self.solution_, self.heads_result_ = model_from_statistics(
            stats, causal=targets.ndim == 3, heads=params["heads"], cutoff_rtol=params["cutoff_rtol"],
            ridge=params["ridge"], solver=params["solver"], gram=G, solution=sol)
        self.certificate_ = self.solution_.certificate
        self.coef_ = self.model_.coef
        self.n_heads_ = self.model_.n_heads
        self._check_training_error(stats.to_numpy(), G, tokens, targets, lengths)
        self._one_d_targets = one_d
        return self

    def _fit_streaming(self, path, why, params, tokens, targets, lengths, causal):
        """The streaming or dual fit (:mod:`scaleattn.linalg._stream`): no statistics, svd heads; the training SSE
        is the path's own pass over the rows."""
        src = rows_from_arrays(tokens, targets, lengths, causal)
        solve_ = dual_solve if path == "dual" else stream_solve
        sol = solve_(src, cutoff_rtol=params["cutoff_rtol"])
        h = recover_heads(sol.coef, tokens.shape[2], "svd")
        check_no_worse_than_zero(sol.sse, sol.yy, 1e-9 * sol.yy)
        self.model_, self.solution_, self.heads_result_ = model_from_heads(sol, h, tokens.shape[2], causal), sol, h
        self.certificate_ = sol.certificate
        self.coef_ = self.model_.coef
        self.n_heads_ = self.model_.n_heads
        self.path_ = {"path": path, "reason": why}
        return self

    def _check_training_error(self, stats, gram, tokens, targets, lengths) -> None:
        """The fitted model's training error is at most the zero model's, or
        :func:`scaleattn.linalg._solver.check_no_worse_than_zero` refuses the fit (no model is kept): from the
        statistics where their SSE formula is precise (round-off below ``1e-6 yy``), else measured on the arrays in
        blocks of samples (that formula loses its digits on ill-conditioned data; a pass costs about a prediction)."""
        coef, yy = self.model_.coef, float(stats.yy)
        floor = stats.sse_floor(coef, gram)
        if floor <= 1e-6 * yy:
            sse = stats.sse(coef, gram)
        else:
            causal, (n, T, d) = targets.ndim == 3, tokens.shape
            step = block_samples(d, T, causal)
            sse, yy, _ = sum(residual_sums(coef, tokens[a : a + step, ...], targets[a : a + step, ...],
                                           None if lengths is None else lengths[a : a + step], causal)
                             for a in range(0, n, step))
            floor = 1e-9 * yy
        try:
            check_no_worse_than_zero(sse, yy, floor, None if heads_are_exact(self.heads_result_) else self.n_heads_)
        except DatasetError:
            for name in ("model_", "solution_", "heads_result_", "certificate_", "coef_", "n_heads_"):
                self.__dict__.pop(name, None)
            raise

    #: what scikit-learn < 1.6 reads (``is_regressor``; ``cross_val_score`` picks its splitter and scorer by it)
    _estimator_type = "regressor"

    def __sklearn_tags__(self):
        """scikit-learn's tags (>= 1.6; imported only when scikit-learn asks): a regressor of 3-d token arrays with
        multi-output targets. Without them ``cross_val_score`` and ``GridSearchCV`` refused the estimator
        (scikit-learn >= 1.7: "no attribute '__sklearn_tags__'")."""
        from sklearn.utils import InputTags, RegressorTags, Tags, TargetTags

        return Tags(estimator_type="regressor", target_tags=TargetTags(required=True, multi_output=True,
                                                                       single_output=True),
                    regressor_tags=RegressorTags(), array_api_support=True,
                    input_tags=InputTags(two_d_array=False, three_d_array=True))

    def __sklearn_is_fitted__(self) -> bool:
        """Whether :meth:`fit` ran (what scikit-learn's ``check_is_fitted`` asks)."""
        return hasattr(self, "model_")

    def _check_fitted(self, method: str) -> None:
        if not self.__sklearn_is_fitted__():
            raise _not_fitted_error()(f"this MHLARegressor is not fitted yet: call fit(tokens, targets) before"
                                      f" {method}()")

    def predict(self, tokens, lengths=None):
        """Predictions (n, d_out) or (n, T, d_out) of the fitted model ((n,) when fitted to targets (n,)), in the
        tokens' namespace and on their device (numpy, CuPy, torch, ...). Raises
        :class:`~scaleattn.errors.DatasetError` for bad tokens or lengths (naming the sample),
        :class:`~scaleattn.errors.NotFittedError` before :meth:`fit`."""
        self._check_fitted("predict")
        tokens, lengths = _as_float("tokens", tokens), _as_lengths(lengths)
        T = check_arrays(tokens, None, lengths)[1]
        if lengths is not None:
            check_lengths(lengths, 0, T)
        y = self.model_.predict(tokens, lengths)
        return y[:, 0] if getattr(self, "_one_d_targets", False) else y

    def score(self, tokens, targets, lengths=None) -> float:
        """Coefficient of determination R^2 of the predictions, as scikit-learn's ``r2_score`` with its defaults:
        each output's ``1 - SS_res / SS_tot`` (totals about that output's mean over all rows), averaged uniformly
        over the outputs; an output whose targets are constant scores 1.0 when predicted exactly, else 0.0 (never
        ``-inf``). Computed in the arrays' namespace; :class:`~scaleattn.errors.NotFittedError` before
        :meth:`fit`."""
        self._check_fitted("score")
        y = _as_float("targets", targets)
        xp = get_xp(y)
        r = y - self.predict(tokens, lengths)
        k = y.shape[-1] if y.ndim > 1 else 1
        y, r = xp.reshape(y, (-1, k)), xp.reshape(r, (-1, k))
        ss_res = xp.sum(r * r, axis=0)
        ss_tot = xp.sum((y - xp.mean(y, axis=0)) ** 2, axis=0)
        # on the arrays' device: only the final mean leaves it, as one Python float
        constant = ss_tot == 0
        ratio = ss_res / xp.where(constant, xp.ones_like(ss_tot), ss_tot)
        exact = xp.astype(ss_res == 0, ss_res.dtype)
        return float(xp.mean(xp.where(constant, exact, 1.0 - ratio)))

    def __repr__(self):
        return f"MHLARegressor({', '.join(f'{k}={v!r}' for k, v in self.get_params().items())})"
