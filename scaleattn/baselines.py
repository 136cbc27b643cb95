"""Gradient-descent baselines against the closed-form fit (issue 9; needs the optional ``torch`` extra).

- :class:`MHLA`: multi-head linear attention with ``m`` heads and ``n`` layers in PyTorch. One layer computes
  exactly DESIGN §1 / [Y25] Def. 2.1, ``y_hat = sum_h V_h (Z^T Z) Q_h x`` (no 1/n; causal prefixes
  ``S_t = sum_{s<=t} z_s z_s^T``), so :meth:`MHLA.coef` is ``c(Theta)`` of :func:`scaleattn.heads.coef_from_heads`.
  Deeper models stack residual layers ``z_t <- z_t + sum_h V_h S Q_h z_t``; the last layer maps to ``d_out``.
- :class:`SoftmaxTransformer` (``"full"``): pre-LayerNorm softmax attention + MLP blocks.
- :func:`train_adamw`: AdamW with the paper's settings as defaults ([Y25] §4.1; DESIGN §9: 500 epochs, lr 1e-2
  (sweep 1e-2 / 1e-3), batch 32, cosine schedule, gradient clipping), logging train / validation MSE per epoch
  and the cumulative training wall time (evaluation passes excluded). float64 on CPU by default: AdamW reaches
  ~1e-16 only in fp64.
- :func:`fit_closed_form`: our certified least squares on the same arrays (statistics -> solve -> heads).
- :func:`figure1`, :func:`figure2b`: [Y25] Figure 1 (MSE vs epoch for m heads, realizable causal data) and
  Figure 2(b) (distance ``||c(Theta) - c(Theta*)||`` of AdamW models on identifiable vs orthogonal
  associative memories); :func:`icl_regression`: in-context linear regression, closed-form MHLA vs AdamW MHLA
  vs the one-step preconditioned GD predictor (:class:`OneStepGD`) over context length.

MSE everywhere is the mean over valid rows (samples, or prefixes in causal mode) and outputs, like
:func:`scaleattn.model.evaluate`.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("scaleattn.baselines needs PyTorch: pip install 'scaleattn[torch]'") from e

from .features import predict_rows, row_targets, token_features
from .heads import coef_distance, coef_from_heads

#: [Y25] §4.1 AdamW settings (DESIGN §9)
PAPER = dict(epochs=500, lr=1e-2, lrs=(1e-2, 1e-3), batch_size=32, schedule="cosine", clip=1.0)


# ---- data ----------------------------------------------------------------------------------------------
def load_arrays(data) -> dict:
    """``dict(tokens, targets, lengths)`` of in-memory arrays, a :class:`~scaleattn.dataset.Dataset` or a
    dataset URL (read whole with ``open_dataset(url).read(0, N)``). Raises ``ValueError`` without targets."""
    if isinstance(data, dict):
        out = {"tokens": data["tokens"], "targets": data["targets"], "lengths": data.get("lengths")}
    else:
        from .dataset import Dataset, open_dataset

        ds = data if isinstance(data, Dataset) else open_dataset(str(data))
        tok, lens, y = ds.read(0, ds.n_samples)
        out = {"tokens": tok, "targets": y, "lengths": lens}
    if out["targets"] is None:
        raise ValueError("targets: the dataset has none; AdamW and the fit need targets")
    out["tokens"] = np.asarray(out["tokens"], np.float64)
    out["targets"] = np.asarray(out["targets"], np.float64)
    return out


def coef_mse(coef, data) -> float:
    """Exact MSE of cubic-feature coefficients ``coef`` (psi, d_out) on arrays, by a data pass (DESIGN §2)."""
    d = load_arrays(data)
    causal = d["targets"].ndim == 3
    s, x = token_features(d["tokens"], d["lengths"], causal)
    r = row_targets(d["targets"], d["lengths"], causal) - predict_rows(np.asarray(coef), s, x)
    return float(np.mean(r * r))


# ---- models --------------------------------------------------------------------------------------------
def _valid(tokens, lengths):
    B, T, _ = tokens.shape
    if lengths is None:
        return None
    return torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]


def _last(h, lengths):
    if lengths is None:
        return h[:, -1]
    return h[torch.arange(h.shape[0], device=h.device), lengths - 1]


class MHLA(nn.Module):
    """Multi-head linear attention ([Y25] Def. 2.1; DESIGN §1) with ``heads`` heads and ``layers`` layers.

    Parameters: ``V[i]`` (H, d_i, d) with ``d_i = d_out`` for the last layer and ``d`` before, ``Q[i]`` (H, d, d),
    initialised ``N(0, 1) * init_scale`` (default ``1/sqrt(d)``, the teacher scale of [Y25] §4.1).
    ``fused=True`` evaluates each layer through ``W = sum_h V_h (x) Q_h`` and the cubic features: the same
    function and gradients (chain rule through W), faster for small d, O(d^3) per token.
    ``forward(tokens (B, T, d), lengths (B,) | None)`` returns (B, d_out), or (B, T, d_out) when ``causal``.
    """

    def __init__(self, d: int, d_out: int | None = None, heads: int = 1, layers: int = 1, causal: bool = False,
                 init_scale: float | None = None, dtype=torch.float64, seed: int | None = None,
                 fused: bool = False):
        super().__init__()
        self.fused = fused
        if min(d, heads, layers) < 1:
            raise ValueError(f"d, heads and layers must be >= 1, got {d}, {heads}, {layers}")
        self.d, self.d_out = d, d if d_out is None else d_out
        self.heads, self.layers, self.causal = heads, layers, causal
        g = torch.Generator().manual_seed(0 if seed is None else int(seed))
        sc = 1.0 / math.sqrt(d) if init_scale is None else init_scale
        shape_v = [(heads, self.d_out if i == layers - 1 else d, d) for i in range(layers)]
        self.V = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g, dtype=dtype) * sc) for s in shape_v])
        self.Q = nn.ParameterList([nn.Parameter(torch.randn((heads, d, d), generator=g, dtype=dtype) * sc)
                                   for _ in range(layers)])

    def _attend(self, z, V, Q, x=None):
        """``sum_h V_h S Q_h x`` for every position (causal prefixes / whole sequence) or, with ``x`` (B, d),
        for that query only. Batched matmuls (a 3-operand einsum is several times slower on CPU)."""
        H, a, d = V.shape
        Vm = V.permute(2, 0, 1).reshape(d * H, a)  # [(j, h), a] = V_h[a, j]
        if self.fused:  # W (d^3, a): the same function through the cubic features (DESIGN §2)
            Wf = torch.einsum("haj,hkl->jkla", V, Q).reshape(d ** 3, a)
        if x is not None:
            S = torch.einsum("btj,btk->bjk", z, z)
            if self.fused:
                return (S[..., None] * x[:, None, None, :]).reshape(x.shape[0], -1) @ Wf
            q = (x @ Q.reshape(H * d, d).T).reshape(-1, H, d).transpose(1, 2)  # (B, k, h)
            return (S @ q).reshape(-1, d * H) @ Vm
        B, T, _ = z.shape
        if self.causal:
            S = torch.cumsum(z[..., :, None] * z[..., None, :], dim=1)  # (B, T, d, d) prefix Grams
        else:
            S = torch.einsum("btj,btk->bjk", z, z)[:, None].expand(B, T, d, d)
        if self.fused:
            return (S[..., None] * z[:, :, None, None, :]).reshape(B, T, -1) @ Wf
        q = (z @ Q.reshape(H * d, d).T).reshape(B, T, H, d).transpose(2, 3)  # (B, T, k, h) = Q_h z_t
        return (S @ q).reshape(B, T, d * H) @ Vm

    def forward(self, tokens, lengths=None):
        valid = _valid(tokens, lengths)
        z = tokens if valid is None else tokens * valid[..., None]
        for i in range(self.layers - 1):
            z = z + self._attend(z, self.V[i], self.Q[i])
            if valid is not None:
                z = z * valid[..., None]
        if self.causal:
            return self._attend(z, self.V[-1], self.Q[-1])
        return self._attend(z, self.V[-1], self.Q[-1], _last(z, lengths))  # only the query's output

    def coef(self) -> np.ndarray:
        """``c(Theta)`` (psi, d_out) float64 of a one-layer model ([Y25] Cor. 2.4; :func:`coef_from_heads`).
        Raises ``ValueError`` for deeper models (not in the cubic class)."""
        if self.layers != 1:
            raise ValueError(f"coef() is defined for one-layer MHLA only, this model has {self.layers} layers")
        return coef_from_heads(self.V[0].detach().cpu().double().numpy(), self.Q[0].detach().cpu().double().numpy())


class SoftmaxTransformer(nn.Module):
    """Small softmax transformer ("full"): linear embedding to ``width``, ``layers`` pre-LayerNorm blocks of
    ``heads``-head softmax attention (scaled dot product, causal mask when ``causal``) and a GELU MLP
    (``mlp_ratio * width``), final LayerNorm and a linear read-out to ``d_out``. No positional encoding (the
    MHLA tasks are permutation-invariant in the context). Output shapes as :class:`MHLA`."""

    def __init__(self, d: int, d_out: int | None = None, width: int = 32, heads: int = 4, layers: int = 1,
                 mlp_ratio: int = 4, causal: bool = False, dtype=torch.float64, seed: int | None = None):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        torch.manual_seed(0 if seed is None else int(seed))
        self.d, self.d_out, self.heads, self.causal = d, d if d_out is None else d_out, heads, causal
        self.embed = nn.Linear(d, width, dtype=dtype)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(width, dtype=dtype), "qkv": nn.Linear(width, 3 * width, dtype=dtype),
                "proj": nn.Linear(width, width, dtype=dtype), "ln2": nn.LayerNorm(width, dtype=dtype),
                "mlp": nn.Sequential(nn.Linear(width, mlp_ratio * width, dtype=dtype), nn.GELU(),
                                     nn.Linear(mlp_ratio * width, width, dtype=dtype))}))
        self.ln = nn.LayerNorm(width, dtype=dtype)
        self.out = nn.Linear(width, self.d_out, dtype=dtype)

    def forward(self, tokens, lengths=None):
        B, T, _ = tokens.shape
        valid = _valid(tokens, lengths)
        mask = None
        if self.causal:
            mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        elif valid is not None:
            mask = valid[:, None, None, :]  # keys beyond the length are padding
        h = self.embed(tokens)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](h)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + blk["proj"](a.transpose(1, 2).reshape(B, T, -1))
            h = h + blk["mlp"](blk["ln2"](h))
        y = self.out(self.ln(h))
        return y if self.causal else _last(y, lengths)


def make_model(kind: str, d: int, d_out: int | None = None, causal: bool = False, **kw) -> nn.Module:
    """``kind`` ``"mhla"`` (:class:`MHLA`, keywords heads, layers, init_scale, seed) or ``"full"``
    (:class:`SoftmaxTransformer`). ``ValueError`` otherwise."""
    if kind == "mhla":
        return MHLA(d, d_out, causal=causal, **kw)
    if kind == "full":
        return SoftmaxTransformer(d, d_out, causal=causal, **kw)
    raise ValueError(f"model kind must be 'mhla' or 'full', got {kind!r}")


# ---- training ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainResult:
    """History of an AdamW run: lists indexed by epoch (entry 0 = initialisation).

    ``train_mse``, ``val_mse`` (None without validation data): exact full-pass MSE after each epoch;
    ``wall_s``: cumulative seconds spent in training steps (evaluation passes excluded); ``tracked``: values of
    the ``track`` callback; ``settings``: the hyper-parameters; ``model``: the trained module.
    """

    model: nn.Module
    train_mse: list
    val_mse: list | None
    wall_s: list
    tracked: list
    settings: dict

    @property
    def final_train_mse(self) -> float:
        return self.train_mse[-1]

    def time_to(self, mse: float) -> float | None:
        """Training seconds until the train MSE first reached ``mse`` (None if never)."""
        return next((t for m, t in zip(self.train_mse, self.wall_s) if m <= mse), None)


def _tensors(d, dtype):
    tok = torch.as_tensor(d["tokens"], dtype=dtype)
    y = torch.as_tensor(d["targets"], dtype=dtype)
    lens = None if d["lengths"] is None else torch.as_tensor(np.asarray(d["lengths"]), dtype=torch.long)
    return tok, y, lens


def _loss_sums(model, tok, y, lens):
    """(sum of squared errors, number of target entries) over a batch; causal padding is excluded."""
    err = model(tok, lens) - y
    if model.causal and lens is not None:
        err = err * _valid(tok, lens)[..., None]
        return (err * err).sum(), int(lens.sum()) * y.shape[-1]
    return (err * err).sum(), err.numel()


@torch.no_grad()
def model_mse(model, data, batch: int = 1024, dtype=torch.float64) -> float:
    """Exact MSE of a torch model on arrays / a dataset (mean over valid rows and outputs)."""
    tok, y, lens = _tensors(load_arrays(data), dtype)
    sse, cnt = 0.0, 0
    for a in range(0, tok.shape[0], batch):
        s, c = _loss_sums(model, tok[a:a + batch], y[a:a + batch], None if lens is None else lens[a:a + batch])
        sse, cnt = sse + float(s), cnt + c
    return sse / max(cnt, 1)


def train_adamw(model, data, val=None, *, epochs: int = PAPER["epochs"], lr: float = PAPER["lr"],
                batch_size: int = PAPER["batch_size"], weight_decay: float = 0.01, betas=(0.9, 0.999),
                eps: float = 1e-8, clip: float | None = PAPER["clip"], schedule: str = PAPER["schedule"],
                seed: int = 0, track=None, dtype=torch.float64, eval_batch: int = 1024, threads: int | None = 1,
                verbose: bool = False, **model_kw) -> TrainResult:
    """Train ``model`` (a module, or ``"mhla"`` / ``"full"`` built by :func:`make_model` with ``model_kw``)
    with AdamW on ``data`` (arrays dict, Dataset or URL; causal iff targets are (N, T, d_out)).

    Defaults are [Y25] §4.1's (DESIGN §9): 500 epochs, lr 1e-2, batch 32, cosine decay of the lr to 0 over all
    steps (``schedule="constant"`` to switch it off), global gradient-norm clipping at ``clip``; weight decay
    0.01 (PyTorch's AdamW default; DESIGN records none for the paper). Batches are reshuffled every epoch from
    ``seed``. ``track(model) -> float`` is called at every epoch end (e.g. a coefficient distance).
    ``threads``: torch intra-op threads during the call (default 1: the small batched matmuls here run
    slower with more, and far slower on a shared box; None keeps torch's setting).

    Raises ``ValueError`` when the model's causal flag or dimensions do not match the data.
    """
    prev = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        return _train(model, data, val, epochs, lr, batch_size, weight_decay, betas, eps, clip, schedule, seed,
                      track, dtype, eval_batch, verbose, model_kw)
    finally:
        torch.set_num_threads(prev)


def _train(model, data, val, epochs, lr, batch_size, weight_decay, betas, eps, clip, schedule, seed, track,
           dtype, eval_batch, verbose, model_kw) -> TrainResult:
    d = load_arrays(data)
    causal = d["targets"].ndim == 3
    if isinstance(model, str):
        model = make_model(model, d["tokens"].shape[-1], d["targets"].shape[-1], causal, seed=seed, **model_kw)
    if bool(model.causal) != causal:
        raise ValueError(f"model causal={model.causal} but the targets have shape {d['targets'].shape}")
    if (model.d, model.d_out) != (d["tokens"].shape[-1], d["targets"].shape[-1]):
        raise ValueError(f"model (d, d_out) = {(model.d, model.d_out)} but data have "
                         f"{(d['tokens'].shape[-1], d['targets'].shape[-1])}")
    tok, y, lens = _tensors(d, dtype)
    vd = None if val is None else load_arrays(val)
    N = tok.shape[0]
    steps = epochs * math.ceil(N / batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps)))
    elif schedule == "constant":
        sched = None
    else:
        raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
    gen = torch.Generator().manual_seed(int(seed))

    def record(elapsed):
        model.eval()
        hist["train"].append(model_mse(model, d, eval_batch, dtype))
        if vd is not None:
            hist["val"].append(model_mse(model, vd, eval_batch, dtype))
        if track is not None:
            hist["track"].append(float(track(model)))
        hist["wall"].append(elapsed)
        model.train()

    hist = {"train": [], "val": [], "track": [], "wall": []}
    record(0.0)
    elapsed = 0.0
    for ep in range(epochs):
        t0 = time.perf_counter()
        perm = torch.randperm(N, generator=gen)
        for a in range(0, N, batch_size):
            idx = perm[a:a + batch_size]
            sse, cnt = _loss_sums(model, tok[idx], y[idx], None if lens is None else lens[idx])
            loss = sse / max(cnt, 1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if sched is not None:
                sched.step()
        elapsed += time.perf_counter() - t0
        record(elapsed)
        if verbose:
            print(f"epoch {ep + 1}/{epochs} train {hist['train'][-1]:.3e}"
                  + (f" val {hist['val'][-1]:.3e}" if vd is not None else "") + f" {elapsed:.1f}s")
    settings = dict(epochs=epochs, lr=lr, batch_size=batch_size, weight_decay=weight_decay, betas=list(betas),
                    eps=eps, clip=clip, schedule=schedule, seed=seed, dtype=str(dtype), model=type(model).__name__)
    return TrainResult(model, hist["train"], hist["val"] if vd is not None else None, hist["wall"],
                       hist["track"], settings)


def fit_closed_form(data, val=None, heads="svd") -> dict:
    """Our certified least-squares fit on the same arrays (statistics -> solve -> heads, DESIGN §3-5).

    Returns ``dict(coef, model, certificate, train_mse, val_mse, wall_s)``; ``wall_s`` covers statistics,
    solve and heads (the MSE passes are excluded, as for :func:`train_adamw`); the MSEs are exact data passes.
    """
    from .job import model_from_statistics
    from .statistics import statistics_from_arrays

    d = load_arrays(data)
    t0 = time.perf_counter()
    stats = statistics_from_arrays(d["tokens"], d["targets"], d["lengths"])
    model, sol, _ = model_from_statistics(stats, causal=d["targets"].ndim == 3, heads=heads)
    wall = time.perf_counter() - t0
    return {"coef": sol.coef, "model": model, "certificate": sol.certificate, "wall_s": wall,
            "train_mse": coef_mse(sol.coef, d), "val_mse": None if val is None else coef_mse(sol.coef, val)}


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
    from .generate import make_mhla

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
    for d, N in dims:
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
        ax.set(yscale="log", xlabel="epoch", ylabel=key.replace("_", " "), title=f"d={d}, N={N}, causal T={res['settings']['length']}")
        ax.legend(fontsize=7)
    return axes[0].figure


# ---- Figure 2(b): distance to the truth on associative memories --------------------------------------
def assoc_truth(pairs: int = 2, dim: int | None = None, samples: int = 2**12, seed: int = 12345):
    """``c(Theta*)`` (psi, d_out) of the associative-memory task ([Y25] §4.2): the unique least-squares fit on
    identifiable (unit-norm Gaussian) data, which the task realises exactly (residual ~1e-31, DESIGN §9)."""
    from .generate import make_assoc

    return fit_closed_form(make_assoc(pairs, samples, dim=dim, seed=seed))["coef"]


def figure2b(pairs: int = 2, samples: int = 2**12, *, heads: int = 4, seeds: int = 1, epochs: int = 100,
             lr: float = 1e-2, batch_size: int = 64, dim: int | None = None, **train_kw) -> dict:
    """[Y25] Figure 2(b): ``||c(Theta_t) - c(Theta*)||_F`` per epoch of AdamW-trained one-layer MHLA on
    identifiable (Gaussian keys, lambda_min ~ 0.067 for K=2) and orthogonal (lambda_min = 0) associative
    memories, with the train MSE and our closed-form fit's distance (min-norm on the orthogonal data).

    Returns ``dict(settings, runs, closed_form)``.
    """
    from .generate import make_assoc

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
            raise ValueError(f"preconditioner must be 'matrix' or 'scalar', got {preconditioner!r}")
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
                   seed: int = 0, preconditioner: str = "matrix", adamw_epochs: int = 20, adamw_heads: int | None = None,
                   adamw_lr: float = 1e-2, adamw_init_scale: float = 1e-2, batch_size: int = 64,
                   **train_kw) -> list[dict]:
    """In-context linear regression over context length: test MSE of the closed-form MHLA optimum, AdamW-trained
    one-layer MHLA (``adamw_heads``, default d = k + 1, which spans the class since d_out = 1; skipped when
    ``adamw_epochs`` is 0), the one-step GD predictor (:class:`OneStepGD`) and least squares on the context
    (reference), all on the same train / test sets. One row per context length.
    AdamW starts from a small init (``adamw_init_scale`` 1e-2, as in the ICL literature): with unit-variance
    tokens and no 1/n, ``S`` grows like n and the default 1/sqrt(d) init starts at a loss ~1e4 that 8 epochs
    do not undo (measured at k=3, n=20)."""
    from .generate import make_icl_regression

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
    """Test MSE against context length for each predictor. Returns the figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.6))
    n = [r["context"] for r in rows]
    for key, label in (("closed_form_test", "closed-form MHLA"), ("adamw_test", "AdamW MHLA"),
                       ("gd_test", "one-step preconditioned GD"), ("ls_context_test", "least squares on context")):
        if key in rows[0]:
            ax.plot(n, [max(r[key], 1e-40) for r in rows], "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="context length n", ylabel="test MSE",
           title=f"in-context linear regression, k={rows[0]['k']}")
    ax.legend(fontsize=7)
    return ax.figure
