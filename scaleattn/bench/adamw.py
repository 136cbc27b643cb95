"""Benchmark ``scaleattn bench --vs adamw``: AdamW-trained one-layer MHLA vs our closed-form fit on the
same data, side by side in one run.

``run(out_dir, quick=False, dataset=None)`` measures, per configuration,
- our fit: wall time of statistics + solve + heads, exact train / validation MSE (data passes); called twice on
  the same data: the first call's extra time is the start-up (loading or compiling the statistics kernels, once
  per process), the second's is split into statistics and solve (with heads);
- AdamW ([Y25] §4.1 settings, :func:`scaleattn.baselines.train_adamw`, float64, 1 torch thread, per-head
  forward): train / validation MSE per epoch, cumulative training time (evaluation passes excluded);
- time to reach each relative train MSE threshold (MSE / mean y^2) for both (None: not reached);
- at equal accuracy (``equal_accuracy``): the AdamW time to reach our train MSE (None: not within its epochs, then
  its best MSE and when it got there), and our time to reach AdamW's best train MSE (our warm wall time, or
  None where its best is below ours): the two methods are compared on the same error, not a 1e-34 fit against
  a 1e-4 one.
Data: realizable causal MHLA (DESIGN §9: d = 2, N = 512 and d = 4, N = 2048, T = 100; quick: d = 2, N = 256),
validation = N/4 fresh sequences from the same teacher; or a dataset of ours (``dataset`` URL: 80/20 split).
Writes ``adamw.json`` and ``adamw.md`` into ``out_dir`` and returns the same dict. quick=True: well under 60 s.
Needs the ``torch`` extra.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

__all__ = ["run"]

THRESHOLDS = (1e-2, 1e-4, 1e-6, 1e-8)


def _configs(quick):
    if quick:
        return [dict(d=2, N=256, length=100, heads=4, epochs=15)]
    return [dict(d=2, N=512, length=100, heads=4, epochs=100), dict(d=4, N=2048, length=100, heads=16, epochs=15)]


def _split(data, frac=0.8):
    n = data["tokens"].shape[0]
    k = max(1, int(round(frac * n)))
    part = lambda a, sl: None if a is None else a[sl]  # noqa: E731
    return ({key: part(v, slice(0, k)) for key, v in data.items()},
            {key: part(v, slice(k, n)) for key, v in data.items()} if k < n else None)


def compare(train, val, heads: int, epochs: int, thresholds=THRESHOLDS, **train_kw) -> dict:
    """Our fit and AdamW on the same arrays: one result row (see the module docstring)."""
    from scaleattn import baselines as B

    ms = float(np.mean(np.asarray(train["targets"]) ** 2))
    first = B.fit_closed_form(train, val)  # with the start-up of this process (kernels loaded or compiled)
    cf = B.fit_closed_form(train, val)
    r = B.train_adamw("mhla", train, val, heads=heads, epochs=epochs, **train_kw)
    reach = []
    for rel in thresholds:
        t_adamw = r.time_to(rel * ms)
        t_ours = cf["wall_s"] if cf["train_mse"] <= rel * ms else None
        reach.append({"relative_mse": rel, "mse": rel * ms, "ours_s": t_ours, "adamw_s": t_adamw,
                      "adamw_epoch": next((i for i, m in enumerate(r.train_mse) if m <= rel * ms), None)})
    best = int(np.argmin(r.train_mse))
    equal = {"ours_mse": cf["train_mse"], "adamw_s_to_ours_mse": r.time_to(cf["train_mse"]),
             "adamw_best_mse": float(r.train_mse[best]), "adamw_s_to_best": float(r.wall_s[best]),
             "adamw_budget_s": float(r.wall_s[-1]),
             "ours_s_to_adamw_best": cf["wall_s"] if cf["train_mse"] <= r.train_mse[best] else None}
    return {
        "target_mean_square": ms, "heads": heads, "epochs": epochs, "adamw_settings": r.settings,
        "ours": {"wall_s": cf["wall_s"], "train_mse": cf["train_mse"], "val_mse": cf["val_mse"],
                 "first_call_s": first["wall_s"], "startup_s": max(first["wall_s"] - cf["wall_s"], 0.0),
                 "statistics_s": cf["statistics_s"], "solve_s": cf["solve_s"],
                 "lambda_min": cf["certificate"].lambda_min, "identifiable": cf["certificate"].identifiable},
        "equal_accuracy": equal,
        "adamw": {"wall_s": r.wall_s[-1], "train_mse": r.final_train_mse,
                  "val_mse": None if r.val_mse is None else r.val_mse[-1], "train_curve": r.train_mse,
                  "val_curve": r.val_mse, "wall_curve": r.wall_s,
                  "coef_distance_to_ours": float(np.linalg.norm(r.model.coef() - cf["coef"]))},
        "time_to_mse": reach,
    }


def run(out_dir, quick: bool = False, dataset=None, heads: int | None = None, epochs: int | None = None,
        thresholds=THRESHOLDS, **train_kw) -> dict:
    """Run the comparison and write ``adamw.json`` / ``adamw.md`` into ``out_dir`` (created if missing).

    ``dataset``: URL of one of our datasets to use instead of the synthetic configurations (first 80% train,
    rest validation); ``heads`` / ``epochs`` override the defaults (4 heads; 15 epochs quick, else per config).
    Raises ``ValueError`` for a dataset without targets.
    """
    from scaleattn import baselines as B
    from scaleattn.generate import make_mhla

    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if dataset is not None:
        tr, va = _split(B.load_arrays(dataset))
        cfg = dict(dataset=str(dataset), N=int(tr["tokens"].shape[0]), d=int(tr["tokens"].shape[-1]),
                   length=int(tr["tokens"].shape[1]), heads=heads or 4, epochs=epochs or (15 if quick else 100))
        rows.append({**cfg, **compare(tr, va, cfg["heads"], cfg["epochs"], thresholds, **train_kw)})
    else:
        for cfg in _configs(quick):
            cfg = {**cfg, "heads": heads or cfg["heads"], "epochs": epochs or cfg["epochs"]}
            tr = make_mhla(cfg["d"], 1, cfg["length"], cfg["N"], causal=True, seed=0)
            va = make_mhla(cfg["d"], 1, cfg["length"], max(1, cfg["N"] // 4), causal=True,
                           teacher=(tr["V"], tr["Q"]), seed=[0, 7])
            rows.append({**cfg, "data": "realizable MHLA, 1 teacher head, causal",
                         **compare(tr, va, cfg["heads"], cfg["epochs"], thresholds, **train_kw)})
    import torch

    res = {"meta": {"quick": quick, "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "torch": torch.__version__, "dtype": "float64",
                    "timing": "ours: statistics + solve + heads; AdamW: training steps only (eval excluded)",
                    "wall_s": None},
           "rows": rows}
    res["meta"]["wall_s"] = time.perf_counter() - t_start
    (out / "adamw.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "adamw.md").write_text(_markdown(res))
    return res


def _f(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def equal_accuracy_lines(r: dict) -> list[str]:
    """The comparison at equal error, in words: how long AdamW takes to reach our train MSE (or, within its
    epochs, its best and when), and how long we take to reach its best; and where our time goes."""
    e, o = r["equal_accuracy"], r["ours"]
    ms = r["target_mean_square"] or 1.0
    if e["adamw_s_to_ours_mse"] is None:
        adamw = (f"AdamW did not reach our train MSE ({e['ours_mse'] / ms:.2g} x mean y^2) in {r['epochs']} epochs"
                 f" ({e['adamw_budget_s']:.3g} s of training); its best train MSE, {e['adamw_best_mse'] / ms:.2g} x"
                 f" mean y^2, came after {e['adamw_s_to_best']:.3g} s")
    else:
        adamw = f"AdamW reached our train MSE after {e['adamw_s_to_ours_mse']:.3g} s"
    ours = ("we reach AdamW's best in " + f"{e['ours_s_to_adamw_best']:.3g} s" if e["ours_s_to_adamw_best"] is not None
            else "AdamW's best is below our train MSE")
    where = (f"our time: start-up {o['startup_s']:.3g} s once per process (the first call, {o['first_call_s']:.3g} s,"
             f" loads or compiles the statistics kernels), then statistics {o['statistics_s']:.3g} s and solve +"
             f" heads {o['solve_s']:.3g} s")
    return [f"- d = {r['d']}, N = {r['N']}: {adamw}; {ours}.", f"  {where[0].upper() + where[1:]}."]


def _markdown(res):
    L = ["# AdamW vs closed-form MHLA fit", "",
         f"Same data, one run; float64; {res['meta']['timing']}. Wall {res['meta']['wall_s']:.1f} s.", "",
         "| data | d | N | heads | epochs | ours: time (s) | ours: start-up (s) | ours: train MSE | ours: val MSE |"
         " AdamW: time (s) | AdamW: train MSE | AdamW: val MSE | AdamW to our MSE (s) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        o, a, e = r["ours"], r["adamw"], r["equal_accuracy"]
        L.append(f"| {r.get('dataset', r.get('data'))} | {r['d']} | {r['N']} | {r['heads']} | {r['epochs']} | "
                 f"{o['wall_s']:.3g} | {o['startup_s']:.3g} | {o['train_mse']:.2e} | {_f(o['val_mse'], '.2e')} |"
                 f" {a['wall_s']:.3g} | {a['train_mse']:.2e} | {_f(a['val_mse'], '.2e')} |"
                 f" {_f(e['adamw_s_to_ours_mse']) if e['adamw_s_to_ours_mse'] is not None else 'not reached'} |")
    L += ["", "## At equal accuracy", "",
          "Times of methods that stop at different errors (ours at the float64 floor of realizable data, AdamW where"
          " its epochs end) do not compare; the same error does:", ""]
    for r in res["rows"]:
        L += equal_accuracy_lines(r)
    L += ["", "## Time to reach a train MSE (relative to mean y^2)", "",
          "| d | N | relative MSE | ours (s) | AdamW (s) | AdamW epoch |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        for t in r["time_to_mse"]:
            L.append(f"| {r['d']} | {r['N']} | {t['relative_mse']:.0e} | {_f(t['ours_s'])} | "
                     f"{_f(t['adamw_s']) if t['adamw_s'] is not None else 'not reached'} | {_f(t['adamw_epoch'], '')} |")
    return "\n".join(L) + "\n"
