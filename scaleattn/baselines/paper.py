"""The paper's experiments at reduced size: [Y25] Figure 1 (MSE against epoch for m heads), Figure 2(b)
(distance to the truth on associative memories), and in-context linear regression. Needs the ``torch`` extra."""
from __future__ import annotations

import numpy as np

from ..errors import ParameterError
from ..features import coef_distance
from ..generate import make_assoc, make_icl_regression, make_mhla
from .training import PAPER, fit_closed_form, train_adamw

__all__ = ["figure1", "figure1_table", "markdown_table", "plot_figure1", "assoc_truth", "figure2b", "plot_figure2b",
           "OneStepGD", "ridge_in_context", "icl_regression", "plot_icl"]


# ---- Figure 1: MSE against epoch for m heads ------------------------------------------------------------
def _mean_se(rows):
    a = np.asarray(rows, dtype=np.float64)
    se = a.std(axis=0, ddof=1) / np.sqrt(a.shape[0]) if a.shape[0] > 1 else np.zeros(a.shape[1:])
    return a.mean(axis=0), se


def figure1(dims=((2, 512), (4, 2048)), heads=(1, 2, 4, 8, 16), *, seeds: int = 3, epochs: int = 500,
            lrs=PAPER["lrs"], batch_size: int = PAPER["batch_size"], length: int = 100, teacher_heads: int = 1,
            val_samples: int | None = None, verbose: bool = False, **train_kw) -> dict:
    """[Y25] Figure 1: AdamW-trained one-layer MHLA with ``m`` heads on realizable causal data vs our fit.

    For each ``(d, N)`` in ``dims`` and seed: data ``make_mhla(d, teacher_heads, length, N, causal=True)``
    (DESIGN §9 setup), a validation set of ``val_samples`` (default N/4) fresh sequences from the same teacher,
    our closed-form fit, and AdamW runs for every ``m`` in ``heads`` and lr in ``lrs``. The lr kept for a
    ``(d, m)`` is the one with the lowest mean final train MSE over seeds.

    Returns ``dict(settings, runs, closed_form, best_lr)``; see :func:`figure1_table` / :func:`plot_figure1`.
    """

    runs, closed = [], []
    for d, N in dims:
        for seed in range(seeds):
            tr = make_mhla(d, teacher_heads, length, N, causal=True, seed=seed)
            va = make_mhla(d, teacher_heads, length, val_samples or max(1, N // 4), causal=True,
                           teacher=(tr["V"], tr["Q"]), seed=[seed, 7])
            cf = fit_closed_form(tr, va)
            closed.append({"d": d, "N": N, "seed": seed, "train_mse": cf["train_mse"], "val_mse": cf["val_mse"],
                           "wall_s": cf["wall_s"], "lambda_min": cf["certificate"].lambda_min})
            for m in heads:
                for lr in lrs:
                    r = train_adamw("mhla", tr, va, heads=m, epochs=epochs, lr=lr, batch_size=batch_size,
                                    seed=seed, **train_kw)
                    runs.append({"d": d, "N": N, "m": m, "lr": lr, "seed": seed, "train_mse": r.train_mse,
                                 "val_mse": r.val_mse, "wall_s": r.wall_s,
                                 "coef_distance": coef_distance(r.model.coef(), cf["coef"])})
                    if verbose:
                        print(f"d={d} N={N} seed={seed} m={m} lr={lr:g}: train {r.final_train_mse:.3e} "
                              f"({r.wall_s[-1]:.1f}s), closed form {cf['train_mse']:.1e} ({cf['wall_s']:.3f}s)")
    best = {}
    for d, _N in dims:
        for m in heads:
            fin = {lr: np.mean([r["train_mse"][-1] for r in runs if (r["d"], r["m"], r["lr"]) == (d, m, lr)])
                   for lr in lrs}
            best[f"{d},{m}"] = min(fin, key=fin.get)
    settings = dict(dims=[list(x) for x in dims], heads=list(heads), seeds=seeds, epochs=epochs, lrs=list(lrs),
                    batch_size=batch_size, length=length, teacher_heads=teacher_heads, **train_kw)
    return {"settings": settings, "runs": runs, "closed_form": closed, "best_lr": best}


def figure1_table(res) -> list[dict]:
    """One row per ``(d, N, m)`` at its best lr: final train / val MSE (mean and standard error over seeds),
    AdamW wall time (mean), and our fit's train MSE and wall time (mean over the same seeds)."""
    rows = []
    for d, N in res["settings"]["dims"]:
        cf = [c for c in res["closed_form"] if (c["d"], c["N"]) == (d, N)]
        for m in res["settings"]["heads"]:
            lr = res["best_lr"][f"{d},{m}"]
            rs = [r for r in res["runs"] if (r["d"], r["N"], r["m"], r["lr"]) == (d, N, m, lr)]
            tm, ts = _mean_se([[r["train_mse"][-1]] for r in rs])
            vm, vs = _mean_se([[r["val_mse"][-1]] for r in rs])
            rows.append({"d": d, "N": N, "m": m, "lr": lr, "seeds": len(rs), "adamw_train_mse": float(tm[0]),
                         "adamw_train_se": float(ts[0]), "adamw_val_mse": float(vm[0]), "adamw_val_se": float(vs[0]),
                         "adamw_wall_s": float(np.mean([r["wall_s"][-1] for r in rs])),
                         "adamw_coef_distance": float(np.mean([r["coef_distance"] for r in rs])),
                         "closed_form_train_mse": float(np.mean([c["train_mse"] for c in cf])),
                         "closed_form_val_mse": float(np.mean([c["val_mse"] for c in cf])),
                         "closed_form_wall_s": float(np.mean([c["wall_s"] for c in cf]))})
    return rows


def markdown_table(rows: list[dict], floatfmt: str = ".3g") -> str:
    """Rows of dicts (same keys) as a markdown table."""
    if not rows:
        return ""
    keys = list(rows[0])
    f = lambda v: format(v, floatfmt) if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                     + ["| " + " | ".join(f(r[k]) for k in keys) + " |" for r in rows]) + "\n"


def _band(ax, x, curves, label, color=None, floor=1e-40):
    """Mean of log10 curves with a +/- standard-error band (log scale: MSEs span 30 decades)."""
    lg = np.log10(np.maximum(np.asarray(curves, dtype=np.float64), floor))
    m, se = _mean_se(lg)
    line, = ax.plot(x, 10 ** m, label=label, color=color)
    ax.fill_between(x, 10 ** (m - se), 10 ** (m + se), color=line.get_color(), alpha=0.25)
    return line


def plot_figure1(res, axes=None, key: str = "train_mse"):
    """Plot [Y25] Figure 1 from :func:`figure1`: one panel per (d, N), MSE (``key``) against epoch for each m at
    its best lr (mean of log10 over seeds, standard-error band) and our fit as a dashed line. Returns the figure."""
    import matplotlib.pyplot as plt

    dims = res["settings"]["dims"]
    if axes is None:
        fig, axes = plt.subplots(1, len(dims), figsize=(5 * len(dims), 3.6), squeeze=False)
        axes = axes[0]
    for ax, (d, N) in zip(axes, dims):
        for m in res["settings"]["heads"]:
            lr = res["best_lr"][f"{d},{m}"]
            rs = [r[key] for r in res["runs"] if (r["d"], r["N"], r["m"], r["lr"]) == (d, N, m, lr)]
            _band(ax, np.arange(len(rs[0])), rs, f"AdamW m={m} (lr {lr:g})")
        cf = np.mean([c[key] for c in res["closed_form"] if (c["d"], c["N"]) == (d, N)])
        ax.axhline(max(cf, 1e-40), color="k", ls="--", label=f"closed form ({cf:.1e})")
        ax.set(yscale="log", xlabel="epoch", ylabel=key.replace("_", " "),
               title=f"d={d}, N={N}, causal T={res['settings']['length']}")
        ax.legend(fontsize=7)
    return axes[0].figure


# ---- Figure 2(b): distance to the truth on associative memories --------------------------------------
def assoc_truth(pairs: int = 2, dim: int | None = None, samples: int = 2**12, seed: int = 12345):
    """``c(Theta*)`` (psi, d_out) of the associative-memory task ([Y25] §4.2): the unique least-squares fit on
    identifiable (unit-norm Gaussian) data, which the task realises exactly (residual ~1e-31, DESIGN §9)."""

    return fit_closed_form(make_assoc(pairs, samples, dim=dim, seed=seed))["coef"]


def figure2b(pairs: int = 2, samples: int = 2**12, *, heads: int = 4, seeds: int = 1, epochs: int = 100,
             lr: float = 1e-2, batch_size: int = 64, dim: int | None = None, **train_kw) -> dict:
    """[Y25] Figure 2(b): ``||c(Theta_t) - c(Theta*)||_F`` per epoch of AdamW-trained one-layer MHLA on
    identifiable (Gaussian keys, lambda_min ~ 0.067 for K=2) and orthogonal (lambda_min = 0) associative
    memories, with the train MSE and our closed-form fit's distance (min-norm on the orthogonal data).

    Returns ``dict(settings, runs, closed_form)``.
    """

    truth = assoc_truth(pairs, dim)
    runs, closed = [], []
    for orth in (False, True):
        name = "orthogonal" if orth else "identifiable"
        for seed in range(seeds):
            tr = make_assoc(pairs, samples, dim=dim, orthogonal=orth, seed=seed)
            cf = fit_closed_form(tr)
            closed.append({"data": name, "seed": seed, "lambda_min": cf["certificate"].lambda_min,
                           "identifiable": cf["certificate"].identifiable,
                           "distance": coef_distance(cf["coef"], truth), "train_mse": cf["train_mse"]})
            r = train_adamw("mhla", tr, heads=heads, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                            track=lambda mdl: coef_distance(mdl.coef(), truth), **train_kw)
            runs.append({"data": name, "seed": seed, "distance": r.tracked, "train_mse": r.train_mse,
                         "wall_s": r.wall_s})
    settings = dict(pairs=pairs, samples=samples, heads=heads, seeds=seeds, epochs=epochs, lr=lr,
                    batch_size=batch_size, truth_norm=float(np.linalg.norm(truth)), **train_kw)
    return {"settings": settings, "runs": runs, "closed_form": closed}


def plot_figure2b(res, ax=None):
    """Distance to the truth against epoch (identifiable vs orthogonal), closed form dotted. Returns the figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.6))
    for name in ("identifiable", "orthogonal"):
        rs = [r["distance"] for r in res["runs"] if r["data"] == name]
        line = _band(ax, np.arange(len(rs[0])), rs, f"AdamW, {name}")
        cf = np.mean([c["distance"] for c in res["closed_form"] if c["data"] == name])
        ax.axhline(max(cf, 1e-40), color=line.get_color(), ls=":", label=f"closed form, {name} ({cf:.1e})")
    ax.set(yscale="log", xlabel="epoch", ylabel="||c(Theta) - c(Theta*)||",
           title=f"associative memory K={res['settings']['pairs']}, {res['settings']['heads']} heads")
    ax.legend(fontsize=7)
    return ax.figure


# ---- in-context linear regression --------------------------------------------------------------------
class OneStepGD:
    """One step of preconditioned gradient descent from ``w = 0`` (von Oswald et al. 2023), as a predictor:
    ``y_hat = x_q^T Gamma h`` with ``h = (1/n) sum_i y_i x_i`` over the n context tokens ``(x_i, y_i)``.

    ``preconditioner="matrix"``: Gamma (k, k) fitted by least squares on the training set (linear in
    ``vec(Gamma)`` with features ``x_q (x) h``); ``"scalar"``: Gamma = gamma I, gamma by least squares.
    Both are in the one-layer linear-attention class for a fixed n (``sum_i y_i x_i`` is a block of Z^T Z),
    so the closed-form MHLA optimum can only be better up to estimation error.
    Input: ICL tokens (N, n + 1, k + 1) with the query last (:func:`scaleattn.generate.make_icl_regression`).
    """

    def __init__(self, preconditioner: str = "matrix"):
        if preconditioner not in ("matrix", "scalar"):
            raise ParameterError(f"preconditioner must be 'matrix' or 'scalar', got {preconditioner!r}")
        self.preconditioner = preconditioner

    @staticmethod
    def _parts(tokens):
        z = np.asarray(tokens, np.float64)
        ctx, xq = z[:, :-1], z[:, -1, :-1]
        h = np.einsum("nt,ntk->nk", ctx[..., -1], ctx[..., :-1]) / ctx.shape[1]
        return xq, h

    def _features(self, tokens):
        xq, h = self._parts(tokens)
        if self.preconditioner == "scalar":
            return np.einsum("nk,nk->n", xq, h)[:, None]
        return (xq[:, :, None] * h[:, None, :]).reshape(xq.shape[0], -1)

    def fit(self, tokens, targets):
        F = self._features(tokens)
        g = np.linalg.lstsq(F, np.asarray(targets, np.float64).reshape(-1), rcond=None)[0]
        k = np.asarray(tokens).shape[-1] - 1
        self.gamma_ = g[0] * np.eye(k) if self.preconditioner == "scalar" else g.reshape(k, k)
        return self

    def predict(self, tokens):
        xq, h = self._parts(tokens)
        return np.einsum("nk,kl,nl->n", xq, self.gamma_, h)[:, None]


def ridge_in_context(tokens, ridge: float = 0.0):
    """Per-sample least squares on the context (min-norm when n < k; ``ridge`` adds ``ridge * I``): the
    Bayes-optimal predictor for noise-free data with w ~ N(0, I) when ``ridge = 0``. Returns (N, 1)."""
    z = np.asarray(tokens, np.float64)
    X, y, xq = z[:, :-1, :-1], z[:, :-1, -1], z[:, -1, :-1]
    if ridge:
        A = np.einsum("ntk,ntl->nkl", X, X) + ridge * np.eye(X.shape[-1])
        w = np.linalg.solve(A, np.einsum("ntk,nt->nk", X, y)[..., None])[..., 0]
    else:
        w = np.einsum("nkt,nt->nk", np.linalg.pinv(X), y)
    return np.einsum("nk,nk->n", xq, w)[:, None]


def icl_regression(k: int = 4, contexts=(5, 10, 20, 40), *, train_samples: int = 4096, test_samples: int = 4096,
                   seed: int = 0, preconditioner: str = "matrix", adamw_epochs: int = 20,
                   adamw_heads: int | None = None,
                   adamw_lr: float = 1e-2, adamw_init_scale: float = 1e-2, batch_size: int = 64,
                   **train_kw) -> list[dict]:
    """In-context linear regression over context length: test MSE of the closed-form MHLA optimum, AdamW-trained
    one-layer MHLA (``adamw_heads``, default d = k + 1, which spans the class since d_out = 1; skipped when
    ``adamw_epochs`` is 0), the one-step GD predictor (:class:`OneStepGD`) and least squares on the context
    (reference), all on the same train / test sets. One row per context length.
    AdamW starts from a small init (``adamw_init_scale`` 1e-2, as in the ICL literature): with unit-variance
    tokens and no 1/n, ``S`` grows like n and the default 1/sqrt(d) init starts at a loss ~1e4 that 8 epochs
    do not undo (measured at k=3, n=20)."""

    rows = []
    for n in contexts:
        tr = make_icl_regression(k, n, train_samples, [seed, n, 0])
        te = make_icl_regression(k, n, test_samples, [seed, n, 1])
        cf = fit_closed_form(tr, te)
        gd = OneStepGD(preconditioner).fit(tr["tokens"], tr["targets"])
        gd_te = float(np.mean((gd.predict(te["tokens"]) - te["targets"]) ** 2))
        gd_tr = float(np.mean((gd.predict(tr["tokens"]) - tr["targets"]) ** 2))
        row = {"k": k, "context": n, "psi": int(cf["coef"].shape[0]), "closed_form_test": cf["val_mse"],
               "closed_form_train": cf["train_mse"], "gd_test": gd_te, "gd_train": gd_tr,
               "gd_gamma_mean_diag": float(np.mean(np.diag(gd.gamma_))),
               "ls_context_test": float(np.mean((ridge_in_context(te["tokens"]) - te["targets"]) ** 2))}
        if adamw_epochs:
            r = train_adamw("mhla", tr, te, heads=adamw_heads or k + 1, epochs=adamw_epochs, lr=adamw_lr,
                            batch_size=batch_size, seed=seed, init_scale=adamw_init_scale, **train_kw)
            row.update(adamw_test=r.val_mse[-1], adamw_train=r.final_train_mse, adamw_wall_s=r.wall_s[-1])
        rows.append(row)
    return rows


def plot_icl(rows, ax=None):
    """Test MSE against context length for each predictor. Returns the figure.

    Least squares on the context is drawn only where it is on the scale of the others: at its round-off (n >= k,
    ~1e-30) it took 30 decades of the log axis and hid the three learned predictors on one line; the legend
    then gives its value."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.6))
    n = [r["context"] for r in rows]
    learned = [(k, label, style) for k, label, style in (
        ("closed_form_test", "closed-form MHLA", "o-"), ("adamw_test", "AdamW MHLA", "s--"),
        ("gd_test", "one-step preconditioned GD", "^:")) if k in rows[0]]
    for key, label, style in learned:
        ax.plot(n, [max(r[key], 1e-40) for r in rows], style, label=label, alpha=0.85, markerfacecolor="none")
    if "ls_context_test" in rows[0]:
        ls = [r["ls_context_test"] for r in rows]
        low = min((r[k] for r in rows for k, _, _ in learned), default=float("inf"))
        if max(ls) < 1e-6 * low:
            ax.plot([], [], " ", label=f"least squares on context: <= {max(ls):.0e} (round-off)")
        else:
            ax.plot(n, [max(v, 1e-40) for v in ls], "d-", label="least squares on context")
    ax.set(xscale="log", yscale="log", xlabel="context length n", ylabel="test MSE",
           title=f"in-context linear regression, k={rows[0]['k']}")
    ax.set_xticks(n, [str(v) for v in n])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=7)
    return ax.figure
