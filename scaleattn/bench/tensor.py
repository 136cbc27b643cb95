"""Benchmark of tensor attention (DESIGN §8): exact streamed O(n^3 d) vs Taylor fast path O(n r d).

``run(out_dir, quick=False)`` measures, for each attention width d and Taylor degree g,
- wall time (best of a few runs) and peak traced memory (tracemalloc, a separate run) against n for the exact and
  the fast forward and gradient; log-log slopes fitted on the larger n; the crossover n* where the fitted lines meet
  (and the smallest measured n where fast beats exact);
- the error against degree (max |O~ - O|, max relative gradient error, the a-priori bound);
- the windowed exact variant (O(n w1 w2 d)) against n.
It writes ``tensor.json`` and ``tensor.md`` into out_dir and returns the same dict. quick=True: < 60 s on 2 cores.
Inputs are uniform in [-sigma, sigma] with sigma = 0.8 and s = 1/d, so |S| <= sigma^3 ~ 0.51: the polynomial regime.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
import tracemalloc
from pathlib import Path

import numpy as np

from scaleattn import tensor as T

__all__ = ["run"]

SIGMA = 0.8


def _data(n, d, seed=0, sigma=SIGMA):
    rng = np.random.default_rng(seed)
    X = [rng.uniform(-sigma, sigma, size=(n, d)) for _ in range(5)]
    E = rng.normal(size=(n, d))
    return X, E


def _time(fn, budget=1.0, reps=3):
    best, total, k = math.inf, 0.0, 0
    while k < reps and (k == 0 or total < budget):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, total, k = min(best, dt), total + dt, k + 1
    return best


def _peak(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _fit(ns, ts):
    """Least-squares line log t = a log n + b over the given points: returns (a, b)."""
    if len(ns) < 2:
        return None, None
    a, b = np.polyfit(np.log(ns), np.log(ts), 1)
    return float(a), float(b)


def _top(ns, ts, k=3):
    pts = sorted(zip(ns, ts))[-k:]
    return [p[0] for p in pts], [p[1] for p in pts]


def _measure(fn_factory, ns, mem_max_n):
    rows = []
    for n in ns:
        fn = fn_factory(n)
        t = _time(fn)
        mem = _peak(fn) if n <= mem_max_n else None
        rows.append({"n": n, "time_s": t, "peak_bytes": mem})
    return rows


def run(out_dir, *, quick=False, _tiny=False) -> dict:
    """Run the benchmark; write tensor.json and tensor.md into out_dir; return the result dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if _tiny:
        ds, gs = [3], [2]
        n_exact, n_fast, n_grad = [16, 32, 48], [16, 32, 64, 128], [16, 32]
        err_n, err_deg, win_ns, win = 24, [1, 2, 3, 4], [32, 64], (4, 4)
    elif quick:
        ds, gs = [4], [2, 3]
        n_exact, n_fast, n_grad = [32, 64, 128], [32, 64, 128, 512, 2048], [32, 64, 96]
        err_n, err_deg, win_ns, win = 48, list(range(1, 7)), [64, 128, 256, 512], (8, 8)
    else:
        ds, gs = [4, 8], [2, 3, 4]
        n_exact, n_fast = [64, 128, 256, 384, 512], [64, 128, 256, 512, 2048, 4096, 16384]
        n_grad = [64, 128, 192, 256]
        err_n, err_deg, win_ns, win = 96, list(range(1, 11)), [256, 512, 1024, 2048, 4096], (16, 16)
    mem_max_exact = 256 if not _tiny else 64

    timing, fit, cross = [], [], []
    for d in ds:
        ex_f = _measure(lambda n: (lambda X=_data(n, d)[0]: T.attention(*X)), n_exact, mem_max_exact)
        ex_g = _measure(lambda n: (lambda XE=_data(n, d): T.attention_grad(*XE[0], XE[1])), n_grad, mem_max_exact)
        for r in ex_f:
            timing.append({"method": "exact", "op": "forward", "d": d, "g": None, **r})
        for r in ex_g:
            timing.append({"method": "exact", "op": "grad", "d": d, "g": None, **r})
        a_ef, b_ef = _fit(*_top([r["n"] for r in ex_f], [r["time_s"] for r in ex_f]))
        a_eg, b_eg = _fit(*_top([r["n"] for r in ex_g], [r["time_s"] for r in ex_g]))
        fit.append({"method": "exact", "op": "forward", "d": d, "g": None, "slope": a_ef})
        fit.append({"method": "exact", "op": "grad", "d": d, "g": None, "slope": a_eg})
        for g in gs:
            kw = dict(degree=g, on_large="raise")
            fa_f = _measure(lambda n: (lambda X=_data(n, d)[0]: T.poly_attention(*X, **kw)), n_fast, 10**9)
            fa_g = _measure(lambda n: (lambda XE=_data(n, d): T.poly_attention_grad(*XE[0], XE[1], **kw)),
                            n_fast, 10**9)
            for op, rows, (a_e, b_e), ex_rows in (("forward", fa_f, (a_ef, b_ef), ex_f),
                                                   ("grad", fa_g, (a_eg, b_eg), ex_g)):
                for r in rows:
                    timing.append({"method": "poly", "op": op, "d": d, "g": g, **r})
                a_f, b_f = _fit(*_top([r["n"] for r in rows], [r["time_s"] for r in rows]))
                fit.append({"method": "poly", "op": op, "d": d, "g": g, "slope": a_f,
                            "rank": math.comb(d + g, g)})
                n_star = None
                if None not in (a_e, a_f) and a_e > a_f:
                    n_star = float(math.exp((b_f - b_e) / (a_e - a_f)))
                tf = {r["n"]: r["time_s"] for r in rows}
                measured = [r["n"] for r in ex_rows if r["n"] in tf and tf[r["n"]] < r["time_s"]]
                cross.append({"op": op, "d": d, "g": g, "n_star_fit": n_star,
                              "n_star_measured": min(measured) if measured else None,
                              "speedup_at_max_common_n": max(
                                  ((r["time_s"] / tf[r["n"]], r["n"]) for r in ex_rows if r["n"] in tf),
                                  default=(None, None))})

    # error against degree: forward max abs error, gradient max relative error, a-priori bounds
    errs = []
    for d in ds:
        for sig in (SIGMA, 1.2 * SIGMA):
            X, E = _data(err_n, d, seed=1, sigma=sig)
            ref = T.attention(*X)
            l0, g0 = T.attention_grad(*X, E)
            for g in err_deg:
                info = {}
                try:
                    o = T.poly_attention(*X, degree=g, on_large="raise", info=info)
                    _, gp = T.poly_attention_grad(*X, E, degree=g, on_large="raise")
                except ValueError:
                    errs.append({"d": d, "sigma": sig, "g": g, "in_regime": False,
                                 "logit_bound": T.logit_bound(*X[:3])})
                    continue
                gerr = max(float(np.abs(gp[k] - g0[k]).max() / np.abs(g0[k]).max()) for k in g0)
                errs.append({"d": d, "sigma": sig, "g": g, "in_regime": True, "rank": info["rank"],
                             "logit_bound": info["logit_bound"],
                             "logit_max": T.logit_bound(*X[:3], method="exact"),
                             "out_err": float(np.abs(o - ref).max()), "out_bound": info["out_bound"],
                             "grad_rel_err": gerr})

    # windowed exact variant against n (and full exact at the same n where cheap)
    wrows = []
    d = ds[-1]
    for n in win_ns:
        X, E = _data(n, d)
        t = _time(lambda: T.attention(*X, window=win))
        tg = _time(lambda: T.attention_grad(*X, E, window=win))
        mem = _peak(lambda: T.attention(*X, window=win))
        wrows.append({"n": n, "d": d, "window": list(win), "time_s": t, "grad_time_s": tg, "peak_bytes": mem})
    a_w, _ = _fit(*_top([r["n"] for r in wrows], [r["time_s"] for r in wrows]))

    res = {
        "meta": {"quick": quick, "tiny": _tiny, "sigma": SIGMA, "scale": "1/d", "cpu_count": os.cpu_count(),
                 "python": platform.python_version(), "numpy": np.__version__,
                 "memory": "tracemalloc peak of one call (numpy allocations)",
                 "fit": "log-log least squares on the 3 largest n"},
        "timing": timing,
        "fit": fit,
        "crossover": cross,
        "error_vs_degree": errs,
        "window": {"rows": wrows, "slope": a_w},
    }
    res["meta"]["wall_s"] = time.perf_counter() - t_start
    (out / "tensor.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "tensor.md").write_text(_markdown(res))
    return res


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    return format(x, spec)


def _markdown(res):
    L = ["# Tensor attention benchmark", "",
         f"Exact streamed O(n^3 d) vs Taylor fast path O(n r d); inputs U(-{SIGMA}, {SIGMA}), s = 1/d. "
         f"Wall {res['meta']['wall_s']:.1f} s.", "",
         "## Time and peak memory against n", "",
         "| method | op | d | g | n | time (s) | peak mem (MB) |", "|---|---|---|---|---|---|---|"]
    for r in res["timing"]:
        mem = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20
        L.append(f"| {r['method']} | {r['op']} | {r['d']} | {_fmt(r['g'], '')} | {r['n']} | {r['time_s']:.4g} | "
                 f"{_fmt(mem, '.3g')} |")
    L += ["", "## Log-log slopes", "", "| method | op | d | g | rank r | slope |", "|---|---|---|---|---|---|"]
    for r in res["fit"]:
        L.append(f"| {r['method']} | {r['op']} | {r['d']} | {_fmt(r['g'], '')} | {_fmt(r.get('rank'), '')} | "
                 f"{_fmt(r['slope'], '.2f')} |")
    L += ["", "## Crossover n*", "",
          "| op | d | g | n* (fitted lines) | first measured n with fast < exact | speedup at largest common n |",
          "|---|---|---|---|---|---|"]
    for r in res["crossover"]:
        sp, n = r["speedup_at_max_common_n"]
        L.append(f"| {r['op']} | {r['d']} | {r['g']} | {_fmt(r['n_star_fit'], '.3g')} | "
                 f"{_fmt(r['n_star_measured'], '')} | {_fmt(sp, '.3g')}x (n={n}) |")
    L += ["", "## Error against degree", "",
          "| d | sigma | g | rank | logit bound | max logit | max abs out err | a-priori out bound | "
          "max rel grad err |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["error_vs_degree"]:
        if not r["in_regime"]:
            L.append(f"| {r['d']} | {r['sigma']:.2f} | {r['g']} | - | {r['logit_bound']:.3g} | - | "
                     f"out of regime | - | - |")
            continue
        L.append(f"| {r['d']} | {r['sigma']:.2f} | {r['g']} | {r['rank']} | {r['logit_bound']:.3g} | "
                 f"{r['logit_max']:.3g} | {r['out_err']:.2e} | {r['out_bound']:.2e} | {r['grad_rel_err']:.2e} |")
    w = res["window"]
    L += ["", f"## Windowed exact attention (slope {_fmt(w['slope'], '.2f')})", "",
          "| n | d | window | forward (s) | grad (s) | peak mem (MB) |", "|---|---|---|---|---|---|"]
    for r in w["rows"]:
        L.append(f"| {r['n']} | {r['d']} | {tuple(r['window'])} | {r['time_s']:.4g} | {r['grad_time_s']:.4g} | "
                 f"{r['peak_bytes'] / 2**20:.3g} |")
    return "\n".join(L) + "\n"
