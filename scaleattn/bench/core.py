"""Benchmark of the statistics build and the solver (DESIGN §3, §4), all measured in ONE run.

``run(out_dir, quick=False)`` writes ``bench.json`` and ``bench.md`` into ``out_dir`` and returns the dict:

- the machine's float64 GEMM rate (square product, all BLAS threads) and the floor of the statistics build,
  ``2 x (compact Gram multiply-adds) / rate``; our build (:func:`scaleattn.statistics._container.statistics_from_arrays`,
  features included) against it and against a bare GEMM ``u^T v`` of the same shape on precomputed factors;
- the naive normal equations: ``phi`` materialised and ``phi^T phi`` by numpy (SYRK);
- ``numpy.linalg.lstsq`` and ``dask.array.linalg.lstsq`` (TSQR) on ``phi``: time and the accuracy of each answer
  (relative distance to the teacher's coefficients and to ours, relative training residual);
- a fit (:func:`scaleattn.pipeline.fit`, in a fresh subprocess) on N, 2N, 4N rows: wall time and peak RSS;
- the statistics build on a local Dask cluster with 1 and 2 workers (one thread each);
- d = 4, 8, 16: build and solve time per d.

Every time is warm, the best of N calls after one untimed call of the same path (on two samples where the call
is costly), so that none counts numba's first compile or cache load, an import or a thread pool's start; the
fits of the rows table run in a fresh process each, after an untimed fit of a tiny dataset of the same d.

Ratios are taken within the run (the machine may be shared). Full mode: d = 16 on 40,000 causal rows
(400 sequences x 100 prefixes), about 10 minutes on 2 cores; ``quick``: d = 8 for the comparison and small
sizes, a smoke test (:data:`scaleattn.bench.QUICK_HELP`: 11 minutes measured on 2 cores shared with other work).
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from scaleattn._version import __version__
from scaleattn.bench import build as build_bench
from scaleattn.bench import solve as solve_bench
from scaleattn.bench import workers as workers_bench
from scaleattn.bench.build import gemm_rate
from scaleattn.features import n_features, n_pairs, phi, row_targets, token_features

__all__ = ["run", "machine"]

TARGETS = {"build_vs_floor": 1.5, "speedup_vs_numpy_syrk": 1.5, "speedup_vs_numpy_lstsq": 3.0,
           "speedup_vs_dask_tsqr": 10.0, "rss_growth_n_to_4n": 0.10}


def _best(fn, reps=2, budget=20.0, warm=None):
    """Best wall time of up to ``reps`` calls (fewer when one call exceeds ``budget`` s), warm: ``warm()`` (by
    default one call of ``fn``) runs once untimed first, so that no timed call is the process's first call of a
    compiled kernel or of a code path (numba's compile or cache load, imports, thread pools); returns
    (t, last result). Callers whose ``fn`` is costly pass a ``warm`` that runs the same path on tiny data."""
    (fn if warm is None else warm)()
    best, out, total = math.inf, None, 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best, total = min(best, dt), total + dt
        if total > budget:
            break
    return best, out


def _mhla(d, samples, length, causal, seed=0):
    from scaleattn.generate import make_mhla

    return make_mhla(d=d, heads=2, length=length, samples=samples, causal=causal, seed=seed)


def _teacher_coef(D):
    from scaleattn.heads._algebra import coef_from_heads

    return coef_from_heads(D["V"], D["Q"])


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _bare_gemm_s(s, x) -> float:
    """Best time of the bare GEMM ``u^T v`` on precomputed compact factors of rows ``(s, x)``."""
    from scaleattn.features import compact_factors

    u, v = compact_factors(s, x)
    return _best(lambda: u.T @ v)[0]


def core_comparison(d, samples, length, rate, baselines=True) -> dict:
    """Our build + solve against the floor, a bare GEMM, numpy SYRK, numpy lstsq and dask TSQR (same data)."""
    from scaleattn.linalg._solver import solve
    from scaleattn.linalg._spectrum import solver_path
    from scaleattn.statistics._container import statistics_from_arrays

    D = _mhla(d, samples, length, causal=True)
    tok, y3 = D["tokens"], D["targets"]
    rows = samples * length
    m, dv, psi = n_pairs(d), n_pairs(d), n_features(d)
    macs = n_pairs(m) * dv * rows
    r = {"d": d, "rows": rows, "psi": psi, "compact_macs": macs, "floor_s": 2.0 * macs / rate}
    # every figure: best of N after one untimed warm-up (the build's on two samples: same kernels and layout)
    r["build_s"], st = _best(lambda: statistics_from_arrays(tok, y3), reps=3,
                             warm=lambda: statistics_from_arrays(tok[:2], y3[:2]))
    r["build_vs_floor"] = r["build_s"] / r["floor_s"]
    r["gram_build_s"], _ = _best(lambda: statistics_from_arrays(tok, None, causal=True), reps=3,  # Tc only
                                 warm=lambda: statistics_from_arrays(tok[:2], None, causal=True))
    r["solve_s"], sol = _best(lambda: solve(st), reps=2)  # (warm: the same solve, its path depends on psi)
    r["solver_path"] = solver_path(psi)
    c_true = _teacher_coef(D)
    r["ours_s"] = r["build_s"] + r["solve_s"]
    r["ours_coef_err_vs_teacher"] = _rel(sol.coef, c_true)
    r["identifiable"] = bool(sol.certificate.identifiable)
    r["condition_number"] = float(sol.certificate.condition_number)
    # bare GEMM of the same shape on precomputed factors (on a slice of rows, scaled to all rows)
    s, x = token_features(tok, None, True)
    sub = min(rows, 10_000)
    r["bare_gemm_s"] = _bare_gemm_s(s[:sub], x[:sub]) * rows / sub  # the factors are freed on return
    r["build_vs_bare_gemm"] = r["build_s"] / r["bare_gemm_s"]
    if not baselines:
        return r
    y = row_targets(y3, None, True)
    t_phi, f = _best(lambda: phi(s, x), reps=1, warm=lambda: phi(s[:64], x[:64]))
    t_syrk, _ = _best(lambda: f.T @ f, reps=2, warm=lambda: f[:64].T @ f[:64])
    t_fty, _ = _best(lambda: f.T @ y, reps=2, warm=lambda: f[:64].T @ y[:64])
    r["numpy_phi_s"], r["numpy_syrk_s"], r["numpy_phi_t_y_s"] = t_phi, t_syrk, t_fty
    r["numpy_normal_eq_s"] = t_phi + t_syrk + t_fty
    # like for like: our Gram (features + Tc) against numpy's Gram (SYRK on a ready phi); and the whole build
    # (features + Tc + B) against phi formed + SYRK + phi^T y
    r["speedup_vs_numpy_syrk"] = t_syrk / r["gram_build_s"]
    r["speedup_vs_numpy_normal_eq"] = r["numpy_normal_eq_s"] / r["build_s"]
    t_ls, (c_ls, *_) = _best(lambda: np.linalg.lstsq(f, y, rcond=None), reps=1,
                             warm=lambda: np.linalg.lstsq(f[:64], y[:64], rcond=None))
    r["numpy_lstsq_s"] = t_phi + t_ls
    r["speedup_vs_numpy_lstsq"] = r["numpy_lstsq_s"] / r["ours_s"]
    r["numpy_lstsq_coef_err_vs_teacher"] = _rel(c_ls, c_true)
    r["numpy_lstsq_vs_ours"] = _rel(c_ls, sol.coef)
    import dask
    import dask.array as da

    def tsqr(f=f, y=y):
        k = f.shape[1]
        A = da.from_array(f, chunks=(max(k, f.shape[0] // 8), k))
        c, *_ = da.linalg.lstsq(A, da.from_array(y, chunks=(A.chunks[0], y.shape[1])))
        with dask.config.set(scheduler="threads"):
            return c.compute()

    tiny = np.random.default_rng(0).standard_normal((64, 9))  # warm: the scheduler's threads, dask's linalg
    t_ts, c_ts = _best(tsqr, reps=1, warm=lambda: tsqr(tiny[:, :8], tiny[:, 8:]))
    r["dask_tsqr_s"] = t_phi + t_ts
    r["speedup_vs_dask_tsqr"] = r["dask_tsqr_s"] / r["ours_s"]
    r["dask_tsqr_coef_err_vs_teacher"] = _rel(c_ts, c_true)
    r["dask_tsqr_vs_ours"] = _rel(c_ts, sol.coef)
    for name, c in (("ours", sol.coef), ("numpy_lstsq", c_ls), ("dask_tsqr", c_ts)):
        r[f"{name}_rel_residual"] = float(np.linalg.norm(f @ c - y) / np.linalg.norm(y))
    return r


_CHILD = """
import json, resource, sys, time
from scaleattn.pipeline import fit
fit(sys.argv[2], exact_mse=False)  # warm, untimed: imports, the kernels' compile or cache load, the solve's path
t = time.perf_counter()
res = fit(sys.argv[1], exact_mse=False)
hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")]
print(json.dumps({"fit_s": time.perf_counter() - t, "peak_rss_bytes": hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "n_rows": res.report["n_rows"], "identifiable": bool(res.report["identifiable"]),
                  "rel_train_mse": res.report["relative_train_mse"]}))
"""


def rows_scaling(tmp, d, samples, length) -> list[dict]:
    """A fit in a fresh process on N, 2N, 4N rows: wall time (warm: after an untimed fit of a small dataset of the
    same d, identifiable, in the same process) and peak RSS (the build streams the rows)."""
    from scaleattn.generate import generate_mhla

    out = []
    warm = os.path.join(tmp, "rows-warm.zarr")
    generate_mhla(warm, d=d, heads=2, length=length, samples=-(-3 * n_features(d) // (2 * length)), causal=True,
                  seed=0)
    for k in (1, 2, 4):
        path = os.path.join(tmp, f"rows{k}.zarr")
        generate_mhla(path, d=d, heads=2, length=length, samples=k * samples, causal=True, seed=k)
        p = subprocess.run([sys.executable, "-c", _CHILD, path, warm], capture_output=True, text=True, check=True)
        out.append({"factor": k, **json.loads(p.stdout.strip().splitlines()[-1])})
    base = out[0]["peak_rss_bytes"]
    for o in out:
        o["rss_growth"] = o["peak_rss_bytes"] / base - 1.0
    return out


def d_scaling(sizes, rate) -> list[dict]:
    """Build and solve time per d (``sizes``: (d, samples, length, causal)), each the best of 2 warm calls."""
    from scaleattn.distributed.memory import fit_memory
    from scaleattn.linalg._solver import solve
    from scaleattn.statistics._container import statistics_from_arrays

    out = []
    for d, samples, length, causal in sizes:
        D = _mhla(d, samples, length, causal)
        rows = samples * (length if causal else 1)
        macs = n_pairs(n_pairs(d)) * n_pairs(d) * rows
        tok, y = D["tokens"], D["targets"]
        # best of 2 after a warm-up on two samples (the first call of a size would time numba's compile or cache
        # load: 3.3 s for a 0.005 s build at d = 4); the solve warmed by the same solve (its path depends on psi)
        tb, st = _best(lambda t=tok: statistics_from_arrays(t, y), reps=2,
                       warm=lambda t=tok: statistics_from_arrays(t[:2], y[:2]))
        del D["tokens"], tok
        est = fit_memory(d, d)
        ts, sol = _best(lambda s=st: solve(s), reps=2)
        out.append({"d": d, "psi": n_features(d), "rows": rows, "build_s": tb, "build_vs_floor": tb * rate / (2 * macs),
                    "solve_s": ts, "solver_path": est["path"], "solver_memory_estimate_gib": est["solver_bytes"] / 2**30,
                    "identifiable": bool(sol.certificate.identifiable), "lambda_min": sol.certificate.lambda_min,
                    "coef_err_vs_teacher": _rel(sol.coef, _teacher_coef(D))})
        del st, sol
    return out


def machine() -> dict:
    import psutil
    from threadpoolctl import threadpool_info

    return {"platform": platform.platform(), "processor": platform.processor(), "cores": os.cpu_count(),
            "memory_gib": psutil.virtual_memory().total / 2**30, "python": platform.python_version(),
            "numpy": np.__version__, "blas": [{k: i.get(k) for k in ("internal_api", "version", "num_threads",
                                                                       "architecture", "prefix")}
                                               for i in threadpool_info() if i.get("user_api") == "blas"],
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"), "load_avg": os.getloadavg(),
            "scaleattn": __version__, "commit": _commit()}


def _commit() -> str | None:
    """The git commit of the scaleattn checkout being measured (``-dirty`` with uncommitted changes; None
    outside a git checkout), so that figures copied into docs/performance.md can say which code produced them."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[2])]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def run(out_dir, quick: bool = False) -> dict:
    """Run the benchmark; write ``bench.json`` and ``bench.md`` into ``out_dir``; return the results."""
    import scipy.linalg.blas  # noqa: F401  (so threadpoolctl sees scipy's BLAS too)
    from threadpoolctl import threadpool_limits

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    res = {"quick": quick, "targets": TARGETS}
    with threadpool_limits(os.cpu_count() or 1, user_api="blas"), tempfile.TemporaryDirectory() as tmp:
        res["machine"] = machine()
        rate = gemm_rate(1500 if quick else 2500)
        bandwidth = build_bench.copy_bandwidth()
        res["gemm_gflops"], res["copy_gbs"] = rate / 1e9, bandwidth / 1e9
        _say(f"GEMM {rate / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s")
        samples = 40 if quick else 400  # x 100 prefixes: 4,000 / 40,000 rows
        res["core"] = core_comparison(8, 100, 100, rate) if quick else core_comparison(16, samples, 100, rate)
        c = res["core"]
        _say(f"core d={c['d']}: build {c['build_s']:.2f} s = {c['build_vs_floor']:.2f} x floor"
             + (f", {c['speedup_vs_numpy_syrk']:.2f} x faster than SYRK" if "speedup_vs_numpy_syrk" in c else ""))
        # each size's floor uses the rates measured right around its builds (the machine drifts within a run)
        res["build_table"] = build_bench.build_table(build_bench.QUICK_SIZES if quick else build_bench.SIZES,
                                                     repeats=1 if quick else 2)
        _say("build: " + "; ".join(f"d={r['d']} {r['kernel']} {r['build_vs_floor']:.2f} x floor"
                                   for r in res["build_table"]))
        res["rows_scaling"] = rows_scaling(tmp, 16 if not quick else 8, samples if not quick else 100, 100)
        _say("rows: " + "; ".join(f"{o['n_rows']:,} in {o['fit_s']:.1f} s, {o['peak_rss_bytes'] / 2**20:.0f} MiB"
                                  for o in res["rows_scaling"]))
        res["workers"] = workers_bench.workers_scaling(os.path.join(tmp, "rows4.zarr"))
        _say("workers: " + "; ".join(f"{o['workers']}: {o['build_s']:.1f} s" for o in res["workers"]["workers"])
             + f" (in process, 1 thread: {res['workers']['in_process']['build_s']:.1f} s)")
        sizes = [(4, 200, 100, True), (8, 200, 100, True), (16, samples, 100, True)]
        res["d_scaling"] = d_scaling(sizes, rate)
        # the dense (Cholesky) solve against psi^3/3 flops at the DGEMM rate of the library it calls
        res["solve_floor"] = [solve_bench.solve_floor(d) for d in ((16,) if quick else (24, 32))]
        _say("solve: " + "; ".join(f"d={r['d']} {r['seconds']['total']:.1f} s = {r['floor_ratio']:.2f} x floor"
                                   for r in res["solve_floor"]))
        _say("d: " + "; ".join(f"{o['d']}: build {o['build_s']:.2f} s, solve {o['solve_s']:.2f} s" for o in res["d_scaling"]))
        gemm_after = gemm_rate(1500 if quick else 2500)
        res["gemm_gflops_end"] = gemm_after / 1e9
    res["seconds"] = time.perf_counter() - t_start
    res["met"] = _met(res)
    res["probe_starved"] = _starved(res)
    if res["probe_starved"]:  # (a line on stderr as well: the tables that follow read as if the floor were beaten)
        warnings.warn(res["probe_starved"], stacklevel=2)
    (out_dir / "bench.json").write_text(json.dumps(res, indent=2, default=float))
    (out_dir / "bench.md").write_text(markdown(res))
    return res


def _starved(res) -> str | None:
    """:func:`scaleattn.bench.build.starved_probe` over every build / floor ratio of the run."""
    ratios = [res["core"]["build_vs_floor"], *(r["build_vs_floor"] for r in res["build_table"]),
              *(o["build_vs_floor"] for o in res["d_scaling"])]
    rates = [res["gemm_gflops"], res.get("gemm_gflops_end"), *(r["rate_gflops"] for r in res["build_table"])]
    return build_bench.starved_probe(ratios, rates)


def _met(res) -> dict:
    c = res["core"]
    met = {"build_vs_floor": c["build_vs_floor"] <= TARGETS["build_vs_floor"]}
    for k in ("speedup_vs_numpy_syrk", "speedup_vs_numpy_lstsq", "speedup_vs_dask_tsqr"):
        if k in c:
            met[k] = c[k] >= TARGETS[k]
    for k in ("numpy_lstsq", "dask_tsqr"):
        if f"{k}_rel_residual" in c:
            met[f"accuracy_vs_{k}"] = c["ours_rel_residual"] <= max(c[f"{k}_rel_residual"], 1e-12)
    met["rss_growth_n_to_4n"] = res["rows_scaling"][-1]["rss_growth"] <= TARGETS["rss_growth_n_to_4n"]
    return met


def markdown(res) -> str:
    c = res["core"]
    m = res["machine"]
    blas = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']} x{b['num_threads']}" for b in m["blas"])
    L = [f"# scaleattn core benchmark{' (quick)' if res['quick'] else ''}", ""]
    if res.get("probe_starved"):
        L += [f"**Warning**: {res['probe_starved']}.", ""]
    if res["quick"]:
        L += ["Quick mode: d = 8 and small sizes, a smoke test of the benchmark itself. The targets are set for the"
              " full run (d = 16, 40,000 rows); at these sizes fixed costs dominate and the 'met' column means"
              " little.", ""]
    L += [
         f"Machine: {m['cores']} cores, {m['memory_gib']:.0f} GiB, {m['processor'] or m['platform']}; BLAS "
         f"{blas};"
         f" load average at start {m['load_avg'][0]:.1f}. float64 GEMM {res['gemm_gflops']:.1f} GFLOP/s"
         f" (at the end {res['gemm_gflops_end']:.1f}). Total {res['seconds']:.0f} s; scaleattn {m['scaleattn']},"
         f" commit {m['commit'] or 'unknown'}.", "",
         f"## Statistics build and solve, d = {c['d']}, {c['rows']:,} rows, psi = {c['psi']:,}", "",
         "Warm times: each the best of N calls (our builds 3, the bare GEMM, SYRK, phi^T y and our solve 2, the"
         " rest 1) after one untimed call of the same path (on 64 rows or two samples where the call is costly).",
         "",
         "| what | seconds | ratio | target | met |", "|---|---|---|---|---|",
         f"| floor 2 x {c['compact_macs']:.3g} MACs / GEMM rate | {c['floor_s']:.3f} | | | |",
         f"| our build (features + compact Gram + B) | {c['build_s']:.3f} | {c['build_vs_floor']:.2f} x floor"
         f"{' (below: starved probe)' if c['build_vs_floor'] < 1 else ''} | <= 1.5 x |"
         f" {_yn(res['met'].get('build_vs_floor'))} |",
         f"| bare GEMM u^T v on precomputed factors | {c['bare_gemm_s']:.3f} | build = {c['build_vs_bare_gemm']:.2f} x bare | | |",
         f"| our Gram only (features + compact Gram) | {c['gram_build_s']:.3f} | {c['gram_build_s'] / c['floor_s']:.2f} x floor | | |"]
    if "numpy_syrk_s" in c:
        L += [f"| numpy phi^T phi (SYRK, phi ready) | {c['numpy_syrk_s']:.3f} | our Gram {c['speedup_vs_numpy_syrk']:.2f} x faster |"
              f" >= 1.5 x | {_yn(res['met'].get('speedup_vs_numpy_syrk'))} |",
              f"| numpy phi, phi^T phi, phi^T y | {c['numpy_normal_eq_s']:.3f} | our build {c['speedup_vs_numpy_normal_eq']:.2f} x"
              " faster | | |",
              f"| our fit: build + solve (solve {c['solve_s']:.2f} s) | {c['ours_s']:.3f} | | | |",
              f"| numpy lstsq on phi (incl. forming phi) | {c['numpy_lstsq_s']:.3f} | ours {c['speedup_vs_numpy_lstsq']:.2f} x faster"
              f" | >= 3 x | {_yn(res['met'].get('speedup_vs_numpy_lstsq'))} |",
              f"| dask TSQR lstsq on phi | {c['dask_tsqr_s']:.3f} | ours {c['speedup_vs_dask_tsqr']:.2f} x faster | >= 10 x |"
              f" {_yn(res['met'].get('speedup_vs_dask_tsqr'))} |", "",
              "| answer | rel. distance to teacher c | rel. distance to ours | rel. training residual |",
              "|---|---|---|---|",
              f"| ours (normal equations, Jacobi-scaled {c.get('solver_path', 'eigh')} + one refinement step) |"
              f" {c['ours_coef_err_vs_teacher']:.2e} | 0 | {c['ours_rel_residual']:.2e} |",
              f"| numpy lstsq | {c['numpy_lstsq_coef_err_vs_teacher']:.2e} | {c['numpy_lstsq_vs_ours']:.2e} |"
              f" {c['numpy_lstsq_rel_residual']:.2e} |",
              f"| dask TSQR | {c['dask_tsqr_coef_err_vs_teacher']:.2e} | {c['dask_tsqr_vs_ours']:.2e} |"
              f" {c['dask_tsqr_rel_residual']:.2e} |"]
    if "numpy_lstsq_rel_residual" in c:
        L += ["", "Accuracy target read as: our relative training residual <= the baseline's, or <= 1e-12 (both at"
              f" round-off): vs numpy lstsq {_yn(res['met'].get('accuracy_vs_numpy_lstsq'))}, vs dask TSQR"
              f" {_yn(res['met'].get('accuracy_vs_dask_tsqr'))}."]
    L += ["", f"Certificate: identifiable {c['identifiable']}, condition number (scaled) {c['condition_number']:.3g}.",
          "", "## Rows: fit in a fresh process (N, 2N, 4N)", "",
          "Each fit timed once, warm: after an untimed fit of a small dataset of the same d in the same process"
          " (imports, the kernels' compile or cache load); peak RSS of the whole process.", "", "| rows | fit s | peak RSS MiB | growth vs N |",
          "|---|---|---|---|"]
    L += [f"| {o['n_rows']:,} | {o['fit_s']:.2f} | {o['peak_rss_bytes'] / 2**20:.0f} | {100 * o['rss_growth']:+.1f}% |"
          for o in res["rows_scaling"]]
    L += ["", f"Target: peak memory N -> 4N grows <= 10%: {_yn(res['met']['rss_growth_n_to_4n'])}.", "",
          "## Workers (local Dask cluster, 1 thread each, statistics build of the 4N set)", "",
          f"{res['workers']['in_process']['rows']:,} rows; each build in a fresh process; seconds by kind from Dask's"
          " task stream (partial tasks summed over workers; overhead = wall - the busiest worker's compute).", ""]
    L += workers_bench.markdown(res["workers"])
    L += ["", "## The statistics build against its floors, per d and kernel", "",
          "floor = max(2 x compact multiply-adds / GEMM rate, token bytes / copy bandwidth), both measured in this"
          " run; loop = phi per chunk, G += phi^T phi, B += phi^T y (numpy); SYRK = phi^T phi on a ready phi.", "",
          build_bench.markdown(res["build_table"]), "", "## d", "",
          "Build and solve: the best of 2 warm calls (one untimed call first: the build on two samples, the"
          " solve the same solve), so that no figure counts a first compile.", "",
          "| d | psi | rows | build s | build / floor | solve s | solver | est. solver GiB | identifiable | coef err vs teacher |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    L += [f"| {o['d']} | {o['psi']:,} | {o['rows']:,} | {o['build_s']:.2f} | {o['build_vs_floor']:.2f} | {o['solve_s']:.2f} |"
          f" {o['solver_path']} | {o['solver_memory_estimate_gib']:.2f} | {o['identifiable']} | {o['coef_err_vs_teacher']:.1e} |"
          for o in res["d_scaling"]]
    L += ["", "## The dense solve against psi^3/3 flops at the DGEMM rate", "",
          *solve_bench.floors_markdown(res["solve_floor"]), "", "Target: total <= 2 x floor at d = 24 and 32 (expansion and certificate included). The crash check of"
          " the large factorisation (OPENBLAS_CORETYPE unset) is `scaleattn bench solve`."]
    return "\n".join(L) + "\n"


def _yn(v) -> str:
    return "n/a" if v is None else ("yes" if v else "NO")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
