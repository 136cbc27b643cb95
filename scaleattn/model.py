"""A fitted MHLA model (layer L2): coefficients and heads, prediction, storage, and the fit from statistics
(solve, certificate, heads) that produces it."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ._backend import as_float64, device_of, from_host, get_xp, on_device
from .data._checks import check_lengths, check_values
from .display import _html as _html
from .errors import FormatError, InputNotFoundError, IntegrityError, ParameterError
from .features import n_features, predict_rows, row_targets, token_features, triu_index
from .heads._algebra import Heads, coef_from_heads, svd_heads
from .heads._search import DEFAULT_BUDGET, search_heads
from .linalg._solver import Solution, check_no_worse_than_zero, shared_gram, solve
from .store import _formats, _integrity
from .store._location import check_kind, check_path, check_storage_options, did_you_mean, resolve
from .store._outputs import atomic_output

__all__ = ["MHLAModel", "model_from_statistics", "model_from_heads", "recover_heads", "heads_are_exact",
           "check_heads", "residual_sums", "EXACT_HEADS_RTOL", "HEADS_MATCH_RTOL"]

FORMAT, FORMAT_VERSION = _formats.MODEL


@dataclasses.dataclass
class MHLAModel:
    """One-layer multi-head linear attention ``y_hat = sum_h V_h (Z^T Z) Q_h x`` ([Y25] Def. 2.1).

    Attributes
    ----------
    coef : (psi, d_out) float64
        Coefficients of the cubic features, the paper's ``p(Theta)``; they define the function.
    V : (H, d_out, d) float64, Q : (H, d, d) float64
        Heads computing the same function (up to the head search's residual).
    d : int
    causal : bool
        Whether the model was trained on prefixes (used as the default of :meth:`predict`).
    attrs : dict
        Free-form metadata saved with the model.

    Raises
    ------
    ParameterError
        :meth:`predict` on tokens of another ``d``.

    See Also
    --------
    scaleattn.fit : fits one; :func:`model_from_statistics` from statistics.
    scaleattn.compare_models : whether two models compute the same function.

    Examples
    --------
    >>> import numpy as np
    >>> from scaleattn.heads._algebra import coef_from_heads
    >>> V, Q = np.ones((1, 2, 2)), np.eye(2)[None]
    >>> model = MHLAModel(coef_from_heads(V, Q), V, Q, d=2)
    >>> z = np.random.default_rng(0).standard_normal((3, 5, 2))
    >>> bool(np.allclose(model.predict(z), model.predict(z, use_heads=True)))
    True
    """

    coef: np.ndarray
    V: np.ndarray
    Q: np.ndarray
    d: int
    causal: bool = False
    attrs: dict = dataclasses.field(default_factory=dict)

    @property
    def d_out(self) -> int:
        return int(self.coef.shape[1])

    @property
    def n_heads(self) -> int:
        return int(self.V.shape[0])

    def __repr__(self) -> str:
        return (f"MHLAModel(d={self.d}, d_out={self.d_out}, n_heads={self.n_heads}, causal={self.causal}"
                + (f", heads_method={self.attrs['heads_method']!r}" if "heads_method" in self.attrs else "") + ")")

    def _repr_html_(self) -> str:
        """The model card in Jupyter (:func:`scaleattn.display._html.model_html`): heads, sizes, head norms."""
        def render():
            V, Q = np.asarray(self.V), np.asarray(self.Q)
            norms = [(float(np.linalg.norm(V[h])), float(np.linalg.norm(Q[h]))) for h in range(self.n_heads)]
            return _html.model_html({"d": self.d, "d_out": self.d_out, "psi": int(self.coef.shape[0]),
                                       "n_heads": self.n_heads, "causal": self.causal, "attrs": self.attrs,
                                       "coef_norm": float(np.linalg.norm(np.asarray(self.coef))),
                                       "head_norms": norms})

        return _html.safe_html(render, lambda: repr(self))

    def check_dataset(self, dataset) -> None:
        """Refuse a :class:`~scaleattn.data._dataset.Dataset` this model cannot predict or be measured on: without
        targets, or of another token or target dimension (one line naming both, not a shape error deep in a
        prediction or a plot)."""
        if not dataset.has_targets:
            raise ParameterError(f"{dataset.url}: no targets to compare the model's predictions with")
        if (dataset.d, dataset.d_out) != (self.d, self.d_out):
            raise ParameterError(f"model has (d, d_out) = {(self.d, self.d_out)} but {dataset.url} has"
                                 f" {(dataset.d, dataset.d_out)}")

    def predict(self, tokens, lengths=None, causal: bool | None = None, use_heads: bool = False):
        """Predict targets of sequences.

        Parameters
        ----------
        tokens : (n, T, d) or (T, d) float, numpy or any array API array (CuPy, torch, ...)
            The predictions are in its namespace, on its device (the coefficients are moved there).
        lengths : (n,) int, optional
        causal : bool, optional
            Predict at every prefix (returns (n, T, d_out), zeros at padding); default ``self.causal``.
        use_heads : bool
            Compute ``sum_h V_h S Q_h x`` from the heads instead of ``phi . coef`` (equal up to round-off).

        Returns (n, d_out), (n, T, d_out) or, for a single (T, d) sequence, without the leading axis.
        """
        xp = get_xp(tokens)
        dev = device_of(tokens)
        z = np.asarray(tokens) if isinstance(tokens, (list, tuple)) else tokens
        single = z.ndim == 2
        if single:
            z = z[None, ...]
        if z.ndim != 3 or z.shape[-1] != self.d:
            raise ParameterError(f"tokens: expected shape (n, T, {self.d}), got {tuple(tokens.shape)}")
        # the checks of a dataset's reads and of the estimator: a NaN never comes back as a prediction
        check_values("tokens", z, 0)
        if lengths is not None:
            lengths = np.asarray(lengths) if isinstance(lengths, (list, tuple)) else lengths
            check_lengths(lengths, 0, z.shape[1])
        z = as_float64(z, xp)
        causal = self.causal if causal is None else causal
        s, x = token_features(z, lengths, causal)
        if use_heads:  # sum_h V_h S Q_h x with S (rows, d, d) gathered from vech(S): three batched matmuls
            _, _, pos = triu_index(self.d)
            S = xp.reshape(xp.take(s, from_host(pos.reshape(-1), xp, dev), axis=1), (s.shape[0], self.d, self.d))
            V, Q = (as_float64(on_device(a, xp, dev), xp) for a in (self.V, self.Q))
            Qx = xp.matmul(x[None, ...], xp.permute_dims(Q, (0, 2, 1)))  # (H, rows, d): Q_h x
            SQx = xp.matmul(S[None, ...], Qx[..., None])[..., 0]  # (H, rows, d): S Q_h x
            y = xp.sum(xp.matmul(SQx, xp.permute_dims(V, (0, 2, 1))), axis=0)  # (rows, d_out)
        else:
            y = predict_rows(as_float64(on_device(self.coef, xp, dev), xp), s, x)
        if causal:
            n, T = z.shape[:2]
            if lengths is None:
                y = xp.reshape(y, (n, T, -1))
            else:
                full = xp.zeros((n, T, y.shape[-1]), dtype=xp.float64, device=dev)
                full[xp.arange(T, device=dev)[None, :] < on_device(lengths, xp, dev)[:, None]] = y
                y = full
        return y[0, ...] if single else y

    def save(self, url, overwrite: bool = False, storage_options=None, attrs=None) -> None:
        """Write ``coef``, ``V``, ``Q`` to a Zarr v3 group (atomically); ``url`` a path, URL or Location.
        ``attrs``: attributes written besides ``self.attrs`` (a run's binding to its report).

        Raises :class:`~scaleattn.errors.ParameterError` when the heads do not compute the coefficients'
        function (:func:`check_heads`): such a store would be one model to ``evaluate``, another to ``compare``."""
        check_heads(self.coef, self.V, self.Q, self.d, "model")
        check_storage_options(storage_options, url)  # (fsspec's options of a local path: ignored, so refused)
        with atomic_output(resolve(url, storage_options), overwrite, _formats.MODEL[0]) as tmp:
            g = tmp.open_group("w")
            sums = {}
            _integrity.create_checked(g, "coef", self.coef, sums, dimension_names=("feature", "output"),
                                      attributes={"description": "coefficients of phi = vech(Z^T Z) kron x, P-major"})
            _integrity.create_checked(g, "V", self.V, sums, dimension_names=("head", "output", "embed"),
                                      attributes={"description": "value/output matrices V_h"})
            _integrity.create_checked(g, "Q", self.Q, sums, dimension_names=("head", "embed", "embed_2"),
                                      attributes={"description": "fused key-query matrices Q_h"})
            meta = {**self.attrs, **(attrs or {}), "format": FORMAT, "format_version": FORMAT_VERSION, "d": self.d,
                    "d_out": self.d_out, "n_heads": self.n_heads, "causal": bool(self.causal),
                    "description": "one-layer multi-head linear attention y = sum_h V_h Z^T Z Q_h x"}
            g.attrs.update({**meta, _integrity.MANIFEST: _integrity.small_manifest(sums, meta)})

    @classmethod
    def load(cls, url, storage_options=None) -> MHLAModel:
        """Read a model written by :meth:`save`.

        Raises
        ------
        FormatError
            The store is not a model, or an array's metadata cannot be read.
        IntegrityError
            The store is not the one written (:func:`scaleattn.store._integrity.read_store`: manifest, attributes,
            absent chunks), or its attributes, coefficients and heads do not describe one model.
        InputNotFoundError
            Nothing at ``url``.
        ParameterError
            ``url`` is a file (or a path through one).
        """
        check_path(url, "MHLAModel.load", "a model store's path or URL (RUN/model.zarr)")
        check_storage_options(storage_options, url)
        loc = resolve(url, storage_options)
        check_kind(loc, "model", "a model store (a Zarr directory)", directory=True)
        if not loc.exists():
            raise InputNotFoundError(f"{loc.url}: no such model store{did_you_mean(loc.url)}")
        try:
            g = _integrity.open_store(loc, "model")
        except FormatError:
            if loc.join("model.zarr").exists():  # a run directory given where its model goes
                raise FormatError(f"{loc.url}: a run directory, not a model store: pass"
                                  f" {loc.join('model.zarr').url}") from None
            raise
        a, arrays = _integrity.read_store(loc, g, _formats.MODEL, "model", ("coef", "V", "Q"),
                                          shapes=functools.partial(_shapes, where=loc.url))
        coef, V, Q = arrays["coef"], arrays["V"], arrays["Q"]
        d = int(a["d"])
        try:
            check_heads(coef, V, Q, d, loc.url)
        except ParameterError as e:
            raise IntegrityError(str(e)) from None
        keep = {k: v for k, v in a.items() if k not in ("format", "format_version", "d", "d_out", "n_heads", "causal",
                                                        "run", _integrity.MANIFEST)}
        return cls(coef, V, Q, d, bool(a.get("causal", False)), keep)


def _shapes(a: dict, declared: dict, where: str) -> dict:
    """The shapes of a model store's arrays its attributes imply (``d``, ``d_out``, ``n_heads``; in stores
    without the last two, the coefficients' and heads' declared sizes), checked before any chunk is read."""
    _formats.check_types(a, {"d": int, "causal": bool, "d_out": int, "n_heads": int}, where,
                         optional=("causal", "d_out", "n_heads"))
    d = a["d"]
    if d < 1:
        raise IntegrityError(f"{where}: attribute 'd' is {d}: the store was edited")
    coef, V = declared["coef"], declared["V"]
    d_out = a.get("d_out", coef[1] if len(coef) == 2 else -1)
    H = a.get("n_heads", V[0] if len(V) == 3 else -1)
    for k, n in (("d_out", coef[1] if len(coef) == 2 else None), ("n_heads", V[0] if len(V) == 3 else None)):
        if k in a and n is not None and a[k] != n:
            raise IntegrityError(f"{where}: attribute {k!r} is {a[k]} but the arrays hold {n}: the store was edited")
    want = {"coef": (n_features(d), d_out), "V": (H, d_out, d), "Q": (H, d, d)}
    for name, shape in declared.items():
        if shape != want[name]:
            raise IntegrityError(f"{name} in {where}: shape {shape}, but d = {d} in the attributes means"
                                 f" {want[name]}: the store was edited")
    return want


#: a model's heads and coefficients compute the same function to this relative distance (``compare``'s default
#: tolerance: models that pass it are one model to ``evaluate``, which uses ``coef``, and to ``compare``)
HEADS_MATCH_RTOL = 1e-8


def check_heads(coef, V, Q, d: int, where: str) -> None:
    """Refuse a model whose heads ``V``, ``Q`` do not compute the function of its coefficients ``coef`` (relative
    distance above :data:`HEADS_MATCH_RTOL`): ``predict`` uses ``coef``, ``compare`` the heads.

    Raises
    ------
    ParameterError
        Naming ``where``, the distance and what to do.
    """
    coef, V, Q = np.asarray(coef), np.asarray(V), np.asarray(Q)
    if coef.shape != (n_features(d), coef.shape[-1] if coef.ndim else 0) or V.ndim != 3 or Q.shape != (
            V.shape[0], d, d) or V.shape[1:] != (coef.shape[1], d):
        raise ParameterError(f"{where}: coef {coef.shape}, V {V.shape}, Q {Q.shape} are not the shapes of one"
                             f" model of d = {d} ((psi, d_out), (H, d_out, d), (H, d, d))")
    ref = float(np.linalg.norm(coef))
    dist = float(np.linalg.norm(coef_from_heads(V, Q) - coef)) if V.shape[0] else ref
    if not dist <= HEADS_MATCH_RTOL * ref:
        raise ParameterError(f"{where}: its heads V, Q compute other coefficients than its coef (relative distance"
                             f" {dist / max(ref, 1e-300):.2e} > {HEADS_MATCH_RTOL:.0e}): predictions and comparisons"
                             " would disagree; give heads that compute coef (scaleattn.heads._algebra.svd_heads)")


#: heads reproducing the fitted coefficients to this relative residual define the same model
EXACT_HEADS_RTOL = 1e-10


def heads_are_exact(heads: Heads) -> bool:
    """Whether ``heads`` reproduce the least-squares coefficients (then the model is the least-squares fit;
    otherwise it is the heads' own, lossy, model)."""
    return heads.residual <= EXACT_HEADS_RTOL


def recover_heads(coef, d: int, heads="svd", stats=None, gram=None, budget: float | None = DEFAULT_BUDGET,
                  ridge: float = 0.0, progress=None) -> Heads:
    """Heads for coefficients: ``"svd"`` ([Y25] Alg. 1), ``"minimal"`` or an integer H (best H-head model).

    With ``stats`` (and optionally their expanded ``gram``) the heads carry their training loss, the
    loss-versus-heads curve and a lower bound on the head count (:func:`scaleattn.heads._search.search_heads`,
    ``budget`` seconds; with ``ridge``, the scaled ridge ``coef`` was fitted with, its losses are that fit's
    objective; ``progress(text)`` hears how the search goes); without, only ``"svd"`` is available. ``heads``
    as the public entries validated it (:func:`scaleattn._params.heads_spec`: fit, MHLARegressor, the CLI).
    Raises :class:`~scaleattn.errors.ParameterError` for a search without ``stats``.
    """
    if stats is None:
        if heads != "svd":
            raise ParameterError(f"heads={heads!r} needs the statistics (the training loss decides)")
        return svd_heads(coef, d)
    return search_heads(stats, coef, heads, gram=gram, budget=budget, ridge=ridge, progress=progress)


def model_from_statistics(stats, causal: bool = False, heads="svd", cutoff_rtol=None, ridge: float = 0.0,
                          solver: str = "auto", gram=None, solution: Solution | None = None,
                          heads_budget: float | None = DEFAULT_BUDGET,
                          progress=None) -> tuple[MHLAModel, Solution, Heads]:
    """Solve, certify and recover heads from statistics alone ([Y25] Algorithm 1): ``(model, solution, heads)``.

    The feature Gram is expanded from the compact one once (or taken from ``gram``, which is not modified) and
    shared by the solve and the head search. ``solution``: a solution the caller already has (e.g. from a QR
    of the features, :func:`scaleattn.linalg._qr.solve_from_r`) instead of solving here. When the heads cannot
    reproduce the fit (``heads=H`` below the minimal head count, :func:`heads_are_exact`) the model's
    coefficients are the heads' own ``c(Theta)``: the model is the H-head model. ``heads_budget``: seconds for
    the head search (None: no limit); ``progress(text)``: told the head count the search tries, as it goes.
    """
    stats = stats.to_numpy()
    G = shared_gram(stats, solver) if gram is None else gram  # krylov: no psi x psi array past 4,096 features
    sol = solve(stats, cutoff_rtol, ridge=ridge, solver=solver, gram=G) if solution is None else solution
    h = recover_heads(sol.coef, stats.d, heads, stats, gram=G, budget=heads_budget, ridge=sol.ridge, progress=progress)
    model = model_from_heads(sol, h, stats.d, causal)
    if not heads_are_exact(h):  # V = 0 is an H-head model: a search that ends above it failed (ill-conditioned G)
        check_no_worse_than_zero(stats.sse(model.coef, G), stats.yy, stats.sse_floor(model.coef, G), model.n_heads)
    return model, sol, h


def residual_sums(coef, tokens, targets, lengths=None, causal: bool = False) -> np.ndarray:
    """``[sum of squared residuals, sum y^2, count of target entries]`` of coefficients ``coef`` (psi, d_out) on
    a block of samples, by :func:`~scaleattn.features.predict_rows` (``phi`` never formed); numpy or any array API
    arrays (``coef`` is moved to the tokens' device). What a data pass sums (``distributed.evaluate``)."""
    xp = get_xp(tokens, targets)
    s, x = token_features(tokens, lengths, causal)
    y = row_targets(targets, lengths, causal)
    r = y - predict_rows(as_float64(on_device(coef, xp, device_of(tokens)), xp), s, x)
    return np.array([float(xp.sum(r * r)), float(xp.sum(y * y)), float(np.prod(y.shape))])


def model_from_heads(solution: Solution, heads: Heads, d: int, causal: bool = False) -> MHLAModel:
    """The model of a solution and its heads: the least-squares coefficients when the heads reproduce them
    (:func:`heads_are_exact`), else the heads' own ``c(Theta)`` (the lossy H-head model)."""
    coef = solution.coef if heads_are_exact(heads) else coef_from_heads(heads.V, heads.Q)
    return MHLAModel(coef, heads.V, heads.Q, d, causal)
