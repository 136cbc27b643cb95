"""Benchmark of the certified dense solve (DESIGN §4b, "a verdict proved by one factorisation").

``run(out_dir, quick=False)`` (``scaleattn bench certified``) writes ``bench-certified.json`` and
``bench-certified.md``; at each d (16, 24, 32; quick: 8, 12), on statistics of a realizable 2-head teacher
(causal rows, d_out = 1):

- **the certified solve against a plain Cholesky solve on the same G**: :func:`scaleattn.solve` on the Cholesky
  path with the caller's dense ``G`` (the shifted factorisation that proves the verdict, the eigenvalue
  intervals, the solve with one refinement step, the SSE; the factor is a copy, as ``cho_factor``'s is) against
  ``scipy.linalg.cho_factor`` + ``cho_solve``, which certify nothing. Each side three times, interleaved (best of
  3; once at d = 32), so that a shared machine slows both alike. Target: at most :data:`TARGETS` ``solve_vs_cholesky``.
- **the whole fit against numpy's normal equations on a ready phi**: our statistics from the tokens (features and
  the compact Gram) and the default solve, against ``phi^T phi``, ``phi^T y`` and ``numpy.linalg.solve`` with
  ``phi`` already formed (not timed). Target: at least :data:`TARGETS` ``fit_vs_numpy_normal_eq`` faster.

The coefficients of both comparisons are checked against each other (relative difference reported).
"""
from __future__ import annotations

import contextlib
import json
import os
import time

import numpy as np

__all__ = ["run", "comparison", "markdown", "ROWS", "TARGETS"]

#: causal rows per d (length 100 from 10,000 rows, else 50)
ROWS = {8: 2_000, 12: 3_000, 16: 6_000, 24: 16_000, 32: 20_000}
#: the targets: certified solve / plain Cholesky solve at most, numpy normal equations / our fit at least
TARGETS = {"solve_vs_cholesky": 1.3, "fit_vs_numpy_normal_eq": 1.5}


def _data(d: int, rows: int):
    from scaleattn.generate import make_mhla

    length = 100 if rows >= 10_000 else 50
    return make_mhla(d=d, heads=2, length=length, samples=max(rows // length, 1), causal=True, d_out=1, seed=0)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _solve_comparison(st, reps: int) -> dict:
    """The certified solve against ``cho_factor`` + ``cho_solve`` on the same dense ``G``, interleaved."""
    import scipy.linalg

    from scaleattn.linalg._dense import POTRF_MAX
    from scaleattn.linalg._gram import blas_single_thread
    from scaleattn.linalg._solver import solve

    G, B = st.gram(), np.asarray(st.moments)
    ours, peer = [], []
    # OpenBLAS's threaded dpotrf dies with SIGSEGV past POTRF_MAX (d = 32): there the peer runs on one thread
    single = G.shape[0] > POTRF_MAX

    def peer_solve():
        with blas_single_thread() if single else contextlib.nullcontext():
            return scipy.linalg.cho_solve(scipy.linalg.cho_factor(G, lower=True, check_finite=False), B,
                                          check_finite=False)

    for _ in range(reps):  # interleaved, best of reps
        t, sol = _timed(lambda: solve(st, solver="cholesky", gram=G))
        ours.append(t)
        t, c_cho = _timed(peer_solve)
        peer.append(t)
    cert = sol.certificate
    return {"certified_solve_s": min(ours), "cho_factor_solve_s": min(peer),
            "solve_vs_cholesky": min(ours) / min(peer), "solve_coef_rel_diff": _rel(sol.coef, c_cho),
            "peer_single_thread": single, "verdict": cert.verdict, "proved": cert.proof is not None,
            "lambda_min": cert.lambda_min, "lambda_min_interval": list(cert.lambda_min_interval or []),
            "condition_number": cert.condition_number}


def comparison(d: int, rows: int | None = None, reps: int | None = None) -> dict:
    """Both comparisons at ``d`` (module docstring): seconds, ratios, the certificate, the load average."""
    from scaleattn.features import phi, row_targets, token_features
    from scaleattn.linalg._gram import blas_single_thread
    from scaleattn.linalg._solver import solve
    from scaleattn.statistics._container import statistics_from_arrays

    rows = rows or ROWS.get(d, int(1.2 * d * d * (d + 1) / 2))
    reps = reps or (1 if d >= 32 else 3)
    D = _data(d, rows)
    tok, y3 = D["tokens"], D["targets"]
    tiny = _data(4, 400)  # warm: the compiled kernels, the Cholesky path's imports and BLAS handles
    solve(statistics_from_arrays(tiny["tokens"], tiny["targets"]), solver="cholesky")
    statistics_from_arrays(tok[:2], y3[:2])  # (the build's kernels at this d, compiled or loaded: not timed)
    load0 = os.getloadavg()[0]
    r: dict = {"d": d, "rows": int(rows), "psi": d * d * (d + 1) // 2,
               "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default")}
    t_build, st = _timed(lambda: statistics_from_arrays(tok, y3))
    r.update(_solve_comparison(st, reps))
    # the whole fit: our statistics from the tokens and the default solve (G expanded into the factor's memory)
    t_solve, fit = _timed(lambda: solve(st))
    r.update({"build_s": t_build, "fit_solve_s": t_solve, "fit_s": t_build + t_solve})
    st = None  # (freed before phi: at d = 32 the statistics' Tc is 0.6 GB, phi 2.7 GB)
    s, x = token_features(tok, None, True)
    y = row_targets(y3, None, True)
    f = phi(s, x)  # ready: not timed
    del s, x
    # numpy's f.T @ f is OpenBLAS's threaded dsyrk, which dies with SIGSEGV past POTRF_MAX too (20,000 x 16,896):
    # there the peer runs on one BLAS thread, as cho_factor does
    with blas_single_thread() if r["peer_single_thread"] else contextlib.nullcontext():
        t_np, c_np = _timed(lambda: np.linalg.solve(f.T @ f, f.T @ y))
    r.update({"numpy_normal_eq_s": t_np, "fit_vs_numpy_normal_eq": t_np / r["fit_s"],
              "fit_coef_rel_diff": _rel(fit.coef, c_np), "load_average": [load0, os.getloadavg()[0]]})
    return r


def markdown(result: dict) -> str:
    """The table of :func:`run`'s result."""
    lines = ["## The certified solve against cho_factor + cho_solve; the whole fit against numpy's normal equations",
             "", f"commit {result.get('commit')}; targets: solve at most {TARGETS['solve_vs_cholesky']}x the plain"
             f" Cholesky solve, fit at least {TARGETS['fit_vs_numpy_normal_eq']}x faster than numpy on a ready phi.",
             "", "| d | psi | rows | certified solve s | cho_factor+cho_solve s | ratio | verdict (proved) |"
             " lambda_min | our fit s (build + solve) | numpy normal eq s | speed-up | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    from scaleattn.display._text import interval_text

    for r in result["comparisons"]:
        lines.append(f"| {r['d']} | {r['psi']:,} | {r['rows']:,} | {r['certified_solve_s']:.2f} |"
                     f" {r['cho_factor_solve_s']:.2f} | {r['solve_vs_cholesky']:.2f} | {r['verdict']}"
                     f" ({'yes' if r['proved'] else 'no'}) | {interval_text(r['lambda_min'], r['lambda_min_interval'] or None)} |"
                     f" {r['fit_s']:.1f} ({r['build_s']:.1f} + {r['fit_solve_s']:.1f}) | {r['numpy_normal_eq_s']:.1f} |"
                     f" {r['fit_vs_numpy_normal_eq']:.2f}x | {r['load_average'][0]:.1f}-{r['load_average'][1]:.1f} |")
    return "\n".join(lines) + "\n"


def run(out_dir, quick: bool = False, ds=None) -> dict:
    """The comparisons at d = 16, 24, 32 (quick: 8, 12); writes ``bench-certified.json`` and ``.md``."""
    from scaleattn.bench.core import machine

    os.makedirs(out_dir, exist_ok=True)
    ds = ds or ((8, 12) if quick else (16, 24, 32))
    about = machine()
    result = {"commit": about.get("commit"), "machine": about, "comparisons": []}
    for d in ds:
        result["comparisons"].append(comparison(d))
        with open(os.path.join(out_dir, "bench-certified.json"), "w") as fh:  # (after each d: a long run)
            json.dump(result, fh, indent=1, default=float)
    with open(os.path.join(out_dir, "bench-certified.md"), "w") as fh:
        fh.write(markdown(result))
    return result
