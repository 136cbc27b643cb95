"""A fitted MHLA model: coefficients and heads, prediction, storage, and a scikit-learn style estimator."""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _storage
from ._backend import get_xp
from .features import predict_rows, row_targets, token_features

FORMAT = "scaleattn-model"
FORMAT_VERSION = 1


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

    def predict(self, tokens, lengths=None, causal: bool | None = None, use_heads: bool = False):
        """Predict targets of sequences.

        Parameters
        ----------
        tokens : (n, T, d) or (T, d) float, numpy or cupy
        lengths : (n,) int, optional
        causal : bool, optional
            Predict at every prefix (returns (n, T, d_out), zeros at padding); default ``self.causal``.
        use_heads : bool
            Compute ``sum_h V_h S Q_h x`` from the heads instead of ``phi . coef`` (equal up to round-off).

        Returns (n, d_out), (n, T, d_out) or, for a single (T, d) sequence, without the leading axis.
        """
        xp = get_xp(tokens)
        z = xp.asarray(tokens, dtype=xp.float64)
        single = z.ndim == 2
        if single:
            z = z[None]
        if z.ndim != 3 or z.shape[-1] != self.d:
            raise ValueError(f"tokens: expected shape (n, T, {self.d}), got {tuple(tokens.shape)}")
        causal = self.causal if causal is None else causal
        s, x = token_features(z, lengths, causal)
        if use_heads:
            from .features import triu_index

            d = self.d
            I, J, _ = triu_index(d)
            S = xp.zeros((s.shape[0], d, d))
            S[:, I, J] = s
            S[:, J, I] = s
            y = xp.einsum("haj,rjk,hkl,rl->ra", xp.asarray(self.V), S, xp.asarray(self.Q), x)
        else:
            y = predict_rows(xp.asarray(self.coef), s, x)
        if causal:
            n, T = z.shape[:2]
            if lengths is None:
                y = y.reshape(n, T, -1)
            else:
                full = xp.zeros((n, T, y.shape[-1]))
                full[xp.arange(T)[None, :] < xp.asarray(lengths)[:, None]] = y
                y = full
        return y[0] if single else y

    def save(self, url, overwrite: bool = False, storage_options=None) -> None:
        """Write ``coef``, ``V``, ``Q`` to a Zarr v3 group (atomically)."""
        with _storage.atomic_output(url, overwrite, storage_options) as tmp:
            g = _storage.open_group(tmp, "w", storage_options)
            g.attrs.update({**self.attrs, "format": FORMAT, "format_version": FORMAT_VERSION, "d": self.d,
                            "d_out": self.d_out, "n_heads": self.n_heads, "causal": self.causal,
                            "description": "one-layer multi-head linear attention y = sum_h V_h Z^T Z Q_h x"})
            g.create_array("coef", data=np.asarray(self.coef), dimension_names=("feature", "output"),
                           attributes={"description": "coefficients of phi = vech(Z^T Z) kron x, P-major"})
            g.create_array("V", data=np.asarray(self.V), dimension_names=("head", "output", "embed"),
                           attributes={"description": "value/output matrices V_h"})
            g.create_array("Q", data=np.asarray(self.Q), dimension_names=("head", "embed", "embed_2"),
                           attributes={"description": "fused key-query matrices Q_h"})

    @classmethod
    def load(cls, url, storage_options=None) -> "MHLAModel":
        """Read a model written by :meth:`save`; ``ValueError`` if the store is not a model."""
        try:
            g = _storage.open_group(url, "r", storage_options)
            a = dict(g.attrs)
        except Exception as e:
            raise ValueError(f"{url}: not a readable model store ({type(e).__name__}: {e})") from None
        if a.get("format") != FORMAT or a.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{url}: not a scaleattn model store (format {a.get('format')!r})")
        keep = {k: v for k, v in a.items() if k not in ("format", "format_version", "d", "d_out", "n_heads", "causal")}
        return cls(np.asarray(g["coef"][...]), np.asarray(g["V"][...]), np.asarray(g["Q"][...]), int(a["d"]),
                   bool(a.get("causal", False)), keep)


def group_errors(dataset, start: int, stop: int, coef) -> np.ndarray:
    """``[sum of squared residuals, sum y^2, count of target entries]`` of samples ``[start, stop)``."""
    tot = np.zeros(3)
    for a in range(start, stop, dataset.chunk_samples):
        tok, lens, y = dataset.read(a, min(stop, a + dataset.chunk_samples))
        s, x = token_features(tok, lens, dataset.causal)
        yr = row_targets(y, lens, dataset.causal)
        r = yr - predict_rows(coef, s, x)
        tot += [float((r * r).sum()), float((yr * yr).sum()), yr.size]
    return tot


def _sum(*parts):
    return np.sum(parts, axis=0)


def evaluate(model: MHLAModel, dataset, client=None, progress: bool = False) -> dict:
    """Mean squared error of a model on a dataset, by a pass over the data (distributed when ``client``).

    Returns ``dict(mse, target_mean_square, relative_mse, n_rows)``; ``mse`` is averaged over rows and outputs.
    Raises ``ValueError`` when the dataset has no targets or other dimensions than the model.
    """
    from .statistics import row_groups, submit_tree, tree_reduce

    if not dataset.has_targets:
        raise ValueError(f"{dataset.url}: no targets to evaluate against")
    if (dataset.d, dataset.d_out) != (model.d, model.d_out):
        raise ValueError(f"model has (d, d_out) = {(model.d, model.d_out)} but {dataset.url} has {(dataset.d, dataset.d_out)}")
    groups = row_groups(dataset)
    coef = np.asarray(model.coef)
    if client is None:
        tot = tree_reduce([group_errors(dataset, a, b, coef) for a, b in groups], _sum)
    else:
        from .cluster import wait_with_progress

        cf = client.scatter(coef, broadcast=True)
        tag = f"{dataset.fingerprint}-{cf.key}"
        futs = [client.submit(_storage.with_retries, group_errors, dataset, a, b, cf, key=f"evaluate-{a}-{b}-{tag}")
                for a, b in groups]
        root, combos = submit_tree(client, futs, _sum)
        try:
            wait_with_progress(futs, "evaluate", progress)
            tot = root.result()
        except BaseException:  # a task failed or we were interrupted: do not leave the cluster computing
            client.cancel(futs + combos)
            raise
    sse, yy, count = tot
    mse, ms = sse / max(count, 1), yy / max(count, 1)
    return {"mse": mse, "target_mean_square": ms, "relative_mse": mse / ms if ms > 0 else float("nan"),
            "n_rows": int(count // max(model.d_out, 1))}


class MHLARegressor:
    """scikit-learn style estimator: ``fit(tokens, targets, lengths=None)`` in memory, ``predict(tokens)``.

    Parameters
    ----------
    heads : "svd", "minimal" or int
        Head recovery (see :mod:`scaleattn.heads`).
    rtol : float, optional
        Relative eigenvalue cutoff of the solver (default ``16 psi eps``).

    Fitted attributes: ``model_`` (MHLAModel), ``certificate_``, ``coef_`` (psi, d_out), ``n_heads_``.
    """

    def __init__(self, heads="svd", rtol=None):
        self.heads = heads
        self.rtol = rtol

    def get_params(self, deep=True):
        return {"heads": self.heads, "rtol": self.rtol}

    def set_params(self, **params):
        for k, v in params.items():
            setattr(self, k, v)
        return self

    def fit(self, tokens, targets, lengths=None):
        from .job import model_from_statistics
        from .statistics import statistics_from_arrays

        tokens, targets = np.asarray(tokens, np.float64), np.asarray(targets, np.float64)
        if tokens.ndim != 3:
            raise ValueError(f"tokens: expected (n, T, d), got shape {tokens.shape}")
        if targets.ndim not in (2, 3) or targets.shape[0] != tokens.shape[0]:
            raise ValueError(f"targets: expected (n, d_out) or (n, T, d_out) with n = {tokens.shape[0]}, got {targets.shape}")
        stats = statistics_from_arrays(tokens, targets, lengths)
        self.model_, self.solution_, self.heads_result_ = model_from_statistics(
            stats, causal=targets.ndim == 3, heads=self.heads, rtol=self.rtol)
        self.certificate_ = self.solution_.certificate
        self.coef_ = self.model_.coef
        self.n_heads_ = self.model_.n_heads
        return self

    def predict(self, tokens, lengths=None):
        return self.model_.predict(tokens, lengths)

    def score(self, tokens, targets, lengths=None) -> float:
        """Coefficient of determination R^2 (uncentred residual over centred total, as scikit-learn)."""
        y = np.asarray(targets, np.float64)
        r = y - self.predict(tokens, lengths)
        return 1.0 - float((r * r).sum() / ((y - y.mean(axis=0)) ** 2).sum())

    def __repr__(self):
        return f"MHLARegressor(heads={self.heads!r}, rtol={self.rtol!r})"

