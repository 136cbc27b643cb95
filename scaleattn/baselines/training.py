"""Training the baselines with AdamW ([Y25] §4.1 settings) and our closed-form fit on the same arrays, with
exact MSEs by a data pass. Needs the optional ``torch`` extra."""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without the extra
    from ..errors import MissingDependencyError

    raise MissingDependencyError.for_extra("scaleattn.baselines", "torch", "PyTorch") from e

from ..data._dataset import Dataset, open_dataset
from ..errors import DatasetError, ParameterError
from ..features import predict_rows, row_targets, token_features
from ..model import model_from_statistics
from ..statistics._container import statistics_from_arrays
from .models import make_model, valid_positions

__all__ = ["load_arrays", "coef_mse", "TrainResult", "model_mse", "train_adamw", "fit_closed_form", "PAPER"]

#: [Y25] §4.1 AdamW settings (DESIGN §9)
PAPER = dict(epochs=500, lr=1e-2, lrs=(1e-2, 1e-3), batch_size=32, schedule="cosine", clip=1.0)


def load_arrays(data, storage_options=None) -> dict:
    """``dict(tokens, targets, lengths)`` of in-memory arrays, a :class:`~scaleattn.data._dataset.Dataset`, or a
    dataset path/URL opened with ``storage_options`` (read whole with ``open_dataset(url).read(0, N)``).
    Raises :class:`~scaleattn.errors.DatasetError` without targets."""
    if isinstance(data, dict):
        out = {"tokens": data["tokens"], "targets": data["targets"], "lengths": data.get("lengths")}
    else:
        ds = data if isinstance(data, Dataset) else open_dataset(data, storage_options)
        tok, lens, y = ds.read(0, ds.n_samples)
        out = {"tokens": tok, "targets": y, "lengths": lens}
    if out["targets"] is None:
        raise DatasetError("targets: the dataset has none; AdamW and the fit need targets")
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
        err = err * valid_positions(tok, lens)[..., None]
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

    Raises :class:`~scaleattn.errors.ParameterError` when the model's causal flag or dimensions do not match the data.
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
        raise ParameterError(f"model causal={model.causal} but the targets have shape {d['targets'].shape}")
    if (model.d, model.d_out) != (d["tokens"].shape[-1], d["targets"].shape[-1]):
        raise ParameterError(f"model (d, d_out) = {(model.d, model.d_out)} but data have "
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
        raise ParameterError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
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

    Returns ``dict(coef, model, certificate, train_mse, val_mse, wall_s, statistics_s, solve_s)``; ``wall_s``
    covers statistics, solve and heads (the MSE passes are excluded, as for :func:`train_adamw`), split into
    ``statistics_s`` (the features' sums) and ``solve_s`` (solve, certificate and heads); the MSEs are exact data
    passes. The first call in a process also loads (or, on a cold cache, compiles) the statistics kernels: its
    ``statistics_s`` holds that start-up.
    """
    d = load_arrays(data)
    t0 = time.perf_counter()
    stats = statistics_from_arrays(d["tokens"], d["targets"], d["lengths"])
    t1 = time.perf_counter()
    model, sol, _ = model_from_statistics(stats, causal=d["targets"].ndim == 3, heads=heads)
    t2 = time.perf_counter()
    return {"coef": sol.coef, "model": model, "certificate": sol.certificate, "wall_s": t2 - t0,
            "statistics_s": t1 - t0, "solve_s": t2 - t1,
            "train_mse": coef_mse(sol.coef, d), "val_mse": None if val is None else coef_mse(sol.coef, val)}
