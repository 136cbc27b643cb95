"""Benchmark of the matrix-free krylov solver against the Cholesky path (DESIGN §4), in ONE run.

``run(out_dir, quick=False)`` writes ``bench-krylov.json`` and ``bench-krylov.md`` into ``out_dir``:

- d = 32 (psi = 16,896): the statistics of 20,000 causal rows (200 sequences x 100 prefixes) of a realizable
  2-head teacher with d_out = 1 are built once and saved; each solver path then runs in a fresh process
  (so that its peak RSS is its own): the Cholesky path (expand G, factor, Lanczos for the extreme
  eigenvalues) and the krylov path three times, by default (block-Jacobi; the eigenvalue runs share the solve's
  passes and stop with it, reporting their intervals), with ``preconditioner="kfac"`` (the passes the preconditioner
  choice makes) and with ``eig_budget="full"`` (intervals closed to 1%). Reported: wall time, peak
  RSS (``VmHWM``) and the RSS with only the statistics loaded, operator passes, and the accuracy of each answer:
  relative distance to the teacher's coefficients and to the Cholesky answer, the relative training MSE by a pass over
  the rows, the certificate values side by side;
- the same d with 3x the rows (60,000): Cholesky's cost is the same, krylov's (both preconditioners) falls with the
  conditioning;
- the cluster-side operator on a 2-worker LocalCluster (Tc left on the workers): seconds and bytes moved per
  product against the same product in process (d = 32; quick: d = 16);
- d = 44 (psi = 43,560): the heads step on the coefficients of a 2-head teacher (d_out = 1), with the
  statistics of a few hundred rows (the loss needs them): SVD of W ([Y25] Alg. 1), and the minimal-head search
  (DESIGN §5), in a fresh process with its peak RSS; the Gram is used only through products;
- d = 44 (psi = 43,560): the whole certified fit of 60,000 causal rows (600 sequences x 100 prefixes) of a
  realizable 2-head teacher with d_out = 1, one ``scaleattn fit --local --solver krylov`` process: its wall
  time, peak RSS against ``Tc + one data block`` and the coefficients' distance to the teacher's.

- the preconditioners of the krylov path (``preconditioner_passes``): operator passes and CG iterations of block-Jacobi,
  K-FAC from ``Tc``'s partial traces and (for comparison, from the rows) K-FAC with the plain factors ``S^T S``,
  ``X^T X`` to the same backward error, on causal data of a 2-head teacher with 1.19 rows per feature at d = 16, 24,
  32, and with one token coordinate x100 at d = 16, 24 (quick: d = 8);

- one product ``G X`` of the operator at d = 32 and d = 44 (k = 1, 7, 16; random ``Tc``, 0.6 and 3.9 GB):
  the numpy path (np.take expansion + BLAS) against the compiled kernel, seconds and G-multiply-adds per second.

``only`` (``scaleattn bench krylov --only PART``) runs one part: solvers, heads, cluster, fit, products or
preconditioners.

Quick mode: d = 16 (3,000 and 9,000 rows), d = 20 heads and a d = 12 fit in their place (a smoke test of the benchmark, a minute or
two). Ratios are taken within the run, but the machine may be shared: the load average is recorded at the start
and the end, and each path's CPU seconds (user + system of its process) are reported next to its wall time,
as they depend far less on what else the machine runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["run", "markdown", "TARGETS"]

#: the target: the krylov solve no slower than Cholesky at d = 32
TARGETS = {"krylov_vs_cholesky_time": 1.0}

_SOLVE_CHILD = """
import json, os, sys, time
import numpy as np
from scaleattn.statistics._container import Statistics
from scaleattn.linalg import _solver as solver
path, how, out = sys.argv[1], sys.argv[2], sys.argv[3]
def rss(key):
    return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key)][0]
z = np.load(path, allow_pickle=False)
st = Statistics(z["Tc"], z["B"], float(z["yy"]), int(z["n"]), int(z["d"]))
base = rss("VmRSS")
opts = {"eig_budget": "full"} if how == "krylov-full" else {"preconditioner": "kfac"} if how == "krylov-kfac" else None
t, c0 = time.perf_counter(), os.times()
sol = solver.solve(st, solver="krylov" if how.startswith("krylov") else how, krylov=opts)
dt, c1 = time.perf_counter() - t, os.times()
np.save(out, sol.coef)
c = sol.certificate
print(json.dumps({"seconds": dt, "cpu_seconds": (c1.user - c0.user) + (c1.system - c0.system),
                  "peak_rss_bytes": rss("VmHWM"), "stats_rss_bytes": base,
                  "certificate": c.summary()}, default=float))
"""

_HEADS_CHILD = """
import json, sys, time
import numpy as np
from scaleattn.generate import make_mhla
from scaleattn.heads._search import search_heads
from scaleattn.heads._algebra import coef_from_heads, svd_heads
from scaleattn.statistics._container import statistics_from_arrays
d, samples = int(sys.argv[1]), int(sys.argv[2])
def rss(key):
    return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key)][0]
D = make_mhla(d=d, heads=2, length=100, samples=samples, causal=True, d_out=1, seed=0)
t = time.perf_counter()
st = statistics_from_arrays(D["tokens"], D["targets"])
out = {"d": d, "psi": st.psi, "rows": st.n_rows, "stats_build_s": time.perf_counter() - t}
del D["tokens"], D["targets"]
coef = coef_from_heads(D["V"], D["Q"])
out["stats_rss_bytes"] = rss("VmRSS")
for name, fn in (("svd_heads", lambda: svd_heads(coef, d)), ("search_svd", lambda: search_heads(st, coef, "svd")),
                 ("search_minimal", lambda: search_heads(st, coef, "minimal")),
                 ("search_3", lambda: search_heads(st, coef, 3))):
    t = time.perf_counter()
    h = fn()
    out[name] = {"seconds": time.perf_counter() - t, "heads": int(h.n_heads), "residual": float(h.residual),
                 "relative_sse": None if h.sse is None else float(h.sse / st.yy)}
out["peak_rss_bytes"] = rss("VmHWM")
print(json.dumps(out))
"""


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def solver_comparison(tmp, d: int, samples: int, length: int = 100,
                      paths=("cholesky", "krylov", "krylov-kfac", "krylov-full")) -> dict:
    """Statistics once, then the Cholesky and krylov paths each in a fresh process (module docstring)."""
    from scaleattn.features import predict_rows, row_targets, token_features
    from scaleattn.generate import make_mhla
    from scaleattn.heads._algebra import coef_from_heads
    from scaleattn.statistics._container import statistics_from_arrays

    D = make_mhla(d=d, heads=2, length=length, samples=samples, causal=True, d_out=1, seed=0)
    t = time.perf_counter()
    st = statistics_from_arrays(D["tokens"], D["targets"])
    r = {"d": d, "psi": st.psi, "rows": st.n_rows, "stats_build_s": time.perf_counter() - t,
         "compact_gram_bytes": st.gram_compact.nbytes, "dense_gram_bytes": 8 * st.psi**2}
    path = os.path.join(tmp, f"stats{d}.npz")
    np.savez(path, Tc=st.gram_compact, B=st.moments, yy=st.yy, n=st.n_rows, d=d)
    st_rows = st.n_rows
    del st
    c_true = coef_from_heads(D["V"], D["Q"])
    s, x = token_features(D["tokens"], None, True)
    y = row_targets(D["targets"], None, True)
    coefs = {}
    for how in paths:
        _say(f"d = {d}, {st_rows:,} rows: {how} ...")
        out = os.path.join(tmp, f"coef-{how}.npy")
        p = subprocess.run([sys.executable, "-c", _SOLVE_CHILD, path, how, out], capture_output=True, text=True,
                           check=True)
        res = json.loads(p.stdout.strip().splitlines()[-1])
        coefs[how] = np.load(out, allow_pickle=False)
        pred = predict_rows(coefs[how], s, x)
        res["coef_err_vs_teacher"] = _rel(coefs[how], c_true)
        res["rel_train_mse"] = float(np.mean((pred - y) ** 2) / np.mean(y**2))  # a pass over the rows
        r[how] = res
        _say(f"  {res['seconds']:.1f} s ({res['cpu_seconds']:.1f} s CPU),"
             f" peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB,"
             f" coef err vs teacher {res['coef_err_vs_teacher']:.2e}")
    for how in paths[1:]:
        r[how]["coef_vs_cholesky"] = _rel(coefs[how], coefs["cholesky"])
        r[how]["time_vs_cholesky"] = r[how]["seconds"] / r["cholesky"]["seconds"]
        r[how]["cpu_vs_cholesky"] = r[how]["cpu_seconds"] / r["cholesky"]["cpu_seconds"]
    return r


def heads_step(d: int, samples: int) -> dict:
    """The heads step at ``d`` in a fresh process (module docstring)."""
    _say(f"heads at d = {d} ...")
    p = subprocess.run([sys.executable, "-c", _HEADS_CHILD, str(d), str(samples)], capture_output=True, text=True,
                       check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def cluster_products(tmp, d: int, samples: int, k: int = 3, repeats: int = 5) -> dict:
    """The cluster-side operator (:mod:`scaleattn.distributed.operator`) on a 2-worker LocalCluster: Tc left on
    the workers, seconds and bytes moved per product ``G X`` (X psi x k) against the same product in process."""
    from distributed import Client, LocalCluster

    from scaleattn.distributed.operator import remote_statistics
    from scaleattn.generate import generate_mhla
    from scaleattn.linalg._gram import GramOperator

    _say(f"cluster operator at d = {d} ...")
    ds = generate_mhla(os.path.join(tmp, f"op{d}.zarr"), d=d, heads=2, length=100, samples=samples, causal=True,
                       d_out=1, seed=0)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        rs = remote_statistics(ds, client)
        op = rs.operator
        X = np.random.default_rng(0).standard_normal((rs.psi, k))
        t = time.perf_counter()
        for _ in range(repeats):
            Y = op @ X
        remote_s = (time.perf_counter() - t) / repeats
        local = GramOperator(d, [(c0, f.result().gram_compact) for c0, f in op.tiles])  # for comparison only
        t = time.perf_counter()
        for _ in range(repeats):
            Yl = local @ X
        local_s = (time.perf_counter() - t) / repeats
        tr = op.traffic_summary()
    return {"d": d, "psi": rs.psi, "rows": rs.n_rows, "k": k, "tiles": tr["tiles"], "workers": tr["workers"],
            "compact_gram_bytes": sum(int(t.nbytes) for _, t in local.tiles), "cluster_s": remote_s,
            "in_process_s": local_s, "bytes_out_per_pass": tr["bytes_out_per_pass"],
            "bytes_back_per_pass": tr["bytes_back_per_pass"], "rel_diff": _rel(Y, Yl)}


def whole_fit(tmp, d: int, samples: int, length: int = 100) -> dict:
    """The whole certified fit with ``--solver krylov`` as one ``scaleattn fit --local`` process (statistics
    build, krylov solve and certificate, SVD heads, model written): wall time, peak RSS against
    ``Tc + one data block``, and the relative distance of the coefficients to the realizable teacher's."""
    import resource

    from scaleattn.data._dataset import open_dataset
    from scaleattn.features import n_features
    from scaleattn.generate import generate_mhla
    from scaleattn.heads._algebra import coef_from_heads
    from scaleattn.model import MHLAModel
    from scaleattn.statistics._container import BLOCK_BYTES

    psi = n_features(d)
    _say(f"whole fit at d = {d} (psi = {psi:,}): writing {samples * length:,} causal rows ...")
    ds = generate_mhla(os.path.join(tmp, f"fit{d}.zarr"), d=d, heads=2, length=length, samples=samples,
                       causal=True, d_out=1, seed=0)
    out = os.path.join(tmp, f"run{d}")
    cmd = [sys.executable, "-m", "scaleattn.cli", "fit", ds.url, "--out", out, "--local", "--solver", "krylov",
           "--heads", "svd", "--no-plots", "--json"]
    _say("  " + " ".join(cmd[2:]))
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if p.returncode:
        raise RuntimeError(f"the d = {d} fit failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child: this fit
    report = json.loads(p.stdout)
    coef = MHLAModel.load(os.path.join(out, "model.zarr")).coef
    c_true = coef_from_heads(*open_dataset(ds.url).teacher())
    tc_bytes = 8 * psi**2 / 4
    r = {"d": d, "psi": psi, "rows": samples * length, "seconds": seconds, "peak_rss_bytes": peak,
         "compact_gram_bytes": tc_bytes, "block_bytes": BLOCK_BYTES,
         "peak_vs_tc_plus_block": peak / (tc_bytes + BLOCK_BYTES), "coef_rel_err_vs_teacher": _rel(coef, c_true),
         "report": {k: report.get(k) for k in ("verdict", "identifiable", "rank", "lambda_min", "lambda_max",
                                               "margin", "certificate_converged", "train_mse", "relative_train_mse",
                                               "timings", "solver", "n_heads")}}
    _say(f"  {seconds:.0f} s, peak RSS {peak / 2**30:.2f} GiB ({r['peak_vs_tc_plus_block']:.2f} x (Tc + one block)),"
         f" coef err vs teacher {r['coef_rel_err_vs_teacher']:.2e}, verdict {report.get('verdict')}")
    return r


def operator_products(d: int, ks=(1, 7, 16), repeats: int = 3) -> dict:
    """One product ``G X`` of :class:`~scaleattn.linalg._gram.GramOperator` (default threads) on a random
    ``Tc`` (the time does not depend on the values), the numpy path against the compiled kernel
    (:data:`scaleattn.statistics._kernel.KERNEL`): best and median wall seconds of ``repeats``, CPU seconds, and
    G-multiply-adds per second ``psi^2 k / best``."""
    import scaleattn.statistics._kernel as kernel
    from scaleattn.features import n_features, n_pairs
    from scaleattn.linalg._gram import GramOperator

    m, psi = n_pairs(d), n_features(d)
    Tc = np.empty((m * (m + 1) // 2, m))
    np.random.default_rng(0).random(out=Tc)
    op, X0 = GramOperator.from_compact(Tc, d), np.random.default_rng(1).standard_normal((psi, max(ks)))
    r, saved = {"d": d, "psi": psi, "compact_gram_bytes": Tc.nbytes, "threads": op.threads}, kernel.KERNEL
    try:
        for k in ks:
            X = np.ascontiguousarray(X0[:, :k])
            for name in ("numpy", "numba"):
                kernel.KERNEL = name
                op @ X[:, :1]  # compile on first use
                walls, cpus = [], []
                for _ in range(repeats):
                    t, c = time.perf_counter(), time.process_time()
                    op @ X
                    walls.append(time.perf_counter() - t)
                    cpus.append(time.process_time() - c)
                walls.sort()
                r[f"{name}_k{k}"] = {"best_s": walls[0], "median_s": walls[len(walls) // 2], "cpu_s": min(cpus),
                                     "gmacs": psi**2 * k / walls[0] / 1e9}
                _say(f"  d = {d}, k = {k}, {name}: {walls[0]:.3f} s, {psi**2 * k / walls[0] / 1e9:.2f} G MAC/s")
    finally:
        kernel.KERNEL = saved
    return r


def preconditioner_passes(d: int, samples: int, scaled_coordinate: bool = False, length: int = 100) -> dict:
    """Passes of :func:`~scaleattn.linalg._krylov.krylov_solve` (d_out = 1, default tolerances) with each
    preconditioner on the statistics of ``samples`` causal sequences of a realizable 2-head teacher (token
    coordinate 0 x100 with ``scaled_coordinate``): ``"block-jacobi"``, ``"kfac"`` (partial traces of ``Tc``) and
    ``"rows-kfac"`` (:class:`~scaleattn.linalg._kfac.KFAC` on ``S^T S``, ``X^T X``, which ``Tc`` does not hold).
    Passes and iterations do not depend on the machine; seconds are after one warm-up product."""
    from scaleattn.features import token_features
    from scaleattn.generate import make_mhla
    from scaleattn.linalg._certificate import certificate_from_krylov
    from scaleattn.linalg._gram import GramOperator
    from scaleattn.linalg._kfac import KFAC
    from scaleattn.linalg._krylov import krylov_solve
    from scaleattn.linalg._spectrum import default_rtol
    from scaleattn.statistics._container import statistics_from_arrays

    D = make_mhla(d=d, heads=2, length=length, samples=samples, causal=True, d_out=1, seed=0)
    tok = D["tokens"] * np.where(np.arange(d) == 0, 100.0, 1.0) if scaled_coordinate else D["tokens"]
    t = time.perf_counter()
    st = statistics_from_arrays(tok, D["targets"])
    r = {"d": d, "psi": st.psi, "rows": st.n_rows, "rows_per_feature": st.n_rows / st.psi,
         "scaled_coordinate": scaled_coordinate, "stats_build_s": time.perf_counter() - t}
    _say(f"preconditioners at d = {d}, {st.n_rows:,} rows{', coordinate 0 x100' if scaled_coordinate else ''} ...")
    s, x = token_features(tok, None, True)
    op = GramOperator.from_compact(st.gram_compact, d)
    op @ np.ones((st.psi, 1))  # compile the kernel before anything is timed
    ref = None
    for name in ("block-jacobi", "kfac", "rows-kfac"):
        p0, t = op.passes, time.perf_counter()
        M = KFAC(s.T @ s, x.T @ x, op.diagonal(), s.shape[0]) if name == "rows-kfac" else name
        sol = krylov_solve(op, st.moments, rtol=default_rtol(st.psi), yy=float(st.yy), preconditioner=M)
        ref = sol.coef if ref is None else ref
        r[name] = {"passes": op.passes - p0, "cg_iterations": int(sol.iterations), "seconds": time.perf_counter() - t,
                   "backward_error": float(np.max(sol.backward_error)), "converged": bool(sol.converged.all()),
                   "rank": int(sol.spectrum.rank), "coef_vs_block_jacobi": _rel(sol.coef, ref),
                   "verdict": certificate_from_krylov(sol.spectrum, st.n_rows).verdict}
        _say(f"  {name}: {r[name]['passes']} passes ({r[name]['cg_iterations']} CG), {r[name]['seconds']:.1f} s")
    return r


#: the parts of the benchmark, for ``--only``
PARTS = ("solvers", "heads", "cluster", "fit", "products", "preconditioners")


def run(out_dir, quick: bool = False, only: str | None = None) -> dict:
    """Run the benchmark (``only``: one of :data:`PARTS`); write ``bench-krylov.json`` and ``bench-krylov.md``;
    return the results."""
    from .core import machine

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = {"quick": quick, "targets": TARGETS, "machine": machine()}
    want = set(PARTS) if only is None else {only}
    with tempfile.TemporaryDirectory() as tmp:
        if "solvers" in want:
            res["solvers"] = solver_comparison(tmp, 16, 30) if quick else solver_comparison(tmp, 32, 200)
            # the same d with 3x the rows: krylov's cost falls with the conditioning, Cholesky's does not
            paths = ("cholesky", "krylov", "krylov-kfac")
            res["solvers_more_rows"] = (solver_comparison(tmp, 16, 90, paths=paths) if quick
                                        else solver_comparison(tmp, 32, 600, paths=paths))
        if "heads" in want:
            res["heads"] = heads_step(20, 2) if quick else heads_step(44, 3)
        if "cluster" in want:
            res["cluster"] = cluster_products(tmp, 16, 30) if quick else cluster_products(tmp, 32, 200)
        if "products" in want:  # one product of the operator, numpy path vs compiled kernel
            res["products"] = [operator_products(16, repeats=2)] if quick else [operator_products(32),
                                                                                operator_products(44)]
        if "preconditioners" in want:  # passes of block-Jacobi and K-FAC on 1.19 rows per feature
            cases = ([(8, 4, False), (8, 4, True)] if quick else
                     [(16, 26, False), (16, 26, True), (24, 86, False), (24, 86, True), (32, 200, False)])
            res["preconditioners"] = [preconditioner_passes(d, n, sc) for d, n, sc in cases]
        if "fit" in want:  # the d = 44 fit: about 60,000 causal rows of a realizable teacher, d_out = 1
            res["fit"] = whole_fit(tmp, 12, 40) if quick else whole_fit(tmp, 44, 600)
    res["load_avg_end"] = os.getloadavg()
    res["seconds"] = time.perf_counter() - t0
    if "solvers" in res:
        k, more = res["solvers"], res["solvers_more_rows"]
        res["met"] = {f"{what}{suffix}": r[how][key] <= TARGETS["krylov_vs_cholesky_time"]
                      for what, r, how in (("krylov", k, "krylov"), ("krylov_full", k, "krylov-full"),
                                           ("krylov_more_rows", more, "krylov"))
                      for suffix, key in (("_wall", "time_vs_cholesky"), ("_cpu", "cpu_vs_cholesky"))}
    if "fit" in res:
        f = res["fit"]
        res.setdefault("met", {}).update(
            fit_certified=f["report"]["verdict"] == "identifiable", fit_coef_err=f["coef_rel_err_vs_teacher"] <= 1e-6,
            fit_peak_rss=f["peak_vs_tc_plus_block"] <= 1.5)
    (out_dir / "bench-krylov.json").write_text(json.dumps(res, indent=2, default=float))
    (out_dir / "bench-krylov.md").write_text(markdown(res))
    return res


_NAMES = {"cholesky": "Cholesky + Lanczos", "krylov": "krylov (default: eigenvalue runs within the solve's passes)",
          "krylov-kfac": "krylov, preconditioner=kfac (K-FAC from Tc's partial traces)",
          "krylov-full": "krylov, eig_budget=full (intervals to 1%)"}


def _solver_tables(k) -> list[str]:
    gib = 2.0**30
    paths = [p for p in _NAMES if p in k]
    L = [f"Statistics of {k['rows']:,} causal rows ({k['rows'] / k['psi']:.2f} per feature) built once in"
         f" {k['stats_build_s']:.1f} s: compact Gram {k['compact_gram_bytes'] / gib:.2f} GiB (the dense G would be"
         f" {k['dense_gram_bytes'] / gib:.2f} GiB). Each path in a fresh process.", "",
         "| path | wall s | vs Cholesky | CPU s | vs Cholesky | peak RSS GiB | RSS with stats only | passes |"
         " coef vs teacher | coef vs Cholesky | rel. train MSE (data pass) | verdict settled |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for how in paths:
        r = k[how]
        c = r["certificate"]
        est = c.get("estimates") or {}
        L.append(f"| {_NAMES[how]} | {r['seconds']:.1f} | {r.get('time_vs_cholesky', 1.0):.2f} |"
                 f" {r['cpu_seconds']:.1f} | {r.get('cpu_vs_cholesky', 1.0):.2f} | {r['peak_rss_bytes'] / gib:.2f} |"
                 f" {r['stats_rss_bytes'] / gib:.2f} | {est.get('passes', '')} |"
                 f" {r['coef_err_vs_teacher']:.2e} | {r.get('coef_vs_cholesky', 0.0):.2e} | {r['rel_train_mse']:.2e} |"
                 f" {c.get('certificate_converged', True)} |")
    L += ["", "| path | rank | lambda_min(Lambda_D) | lambda_max(Lambda_D) | lambda_min scaled | condition |",
          "|---|---|---|---|---|---|"]
    for how in paths:
        c = k[how]["certificate"]
        L.append(f"| {_NAMES[how]} | {c['rank']:,} | {c['lambda_min']:.6e} | {c['lambda_max']:.6e} |"
                 f" {c['lambda_min_scaled']:.6e} | {c['condition_number']:.4e} |")
    L += ["", "Intervals of the krylov estimates (Cholesky's values are exact to round-off):", "",
          "| path | lambda_min(Lambda_D) in | lambda_min scaled in | eigenvalues converged |", "|---|---|---|---|"]
    for how in paths[1:]:
        est = k[how]["certificate"].get("estimates") or {}
        a, b = est.get("lambda_min") or {}, est.get("lambda_min_scaled") or {}
        L.append(f"| {_NAMES[how]} | [{a.get('lower', float('nan')):.6e}, {a.get('upper', float('nan')):.6e}] |"
                 f" [{b.get('lower', float('nan')):.6e}, {b.get('upper', float('nan')):.6e}] |"
                 f" {est.get('eigenvalues_converged')} |")
    return L


def markdown(res) -> str:
    m = res["machine"]
    gib = 2.0**30
    L = [f"# scaleattn krylov benchmark{' (quick)' if res['quick'] else ''}", "",
         f"Machine: {m['cores']} cores, {m['memory_gib']:.0f} GiB; load average {m['load_avg'][0]:.1f} at the start,"
         f" {res['load_avg_end'][0]:.1f} at the end (a shared machine: times are of this run). Total"
         f" {res['seconds']:.0f} s."]
    if "solvers" in res:
        k, met = res["solvers"], res["met"]
        L += ["", f"## Solve and certificate, d = {k['d']} (psi = {k['psi']:,}), d_out = 1", ""]
        L += _solver_tables(k)
        L += ["", f"### The same d with {res['solvers_more_rows']['rows']:,} rows", ""]
        L += _solver_tables(res["solvers_more_rows"])
        L += ["", "Target: krylov no slower than Cholesky (wall / CPU time): default"
              f" {_yn(met['krylov_wall'])} / {_yn(met['krylov_cpu'])}, eig_budget=full {_yn(met['krylov_full_wall'])}"
              f" / {_yn(met['krylov_full_cpu'])}; with 3x the rows {_yn(met['krylov_more_rows_wall'])} /"
              f" {_yn(met['krylov_more_rows_cpu'])}."]
    if "products" in res:
        L += ["", "## One product G X of the operator: numpy path vs compiled kernel", "",
              "| d | psi | k | numpy s | compiled s | numpy G MAC/s | compiled G MAC/s | ratio |", "|---|---|---|---|---|---|---|---|"]
        for p in res["products"]:
            for key in sorted((k for k in p if k.startswith("numba_k")), key=lambda k: int(k[7:])):
                a, b = p["numpy" + key[5:]], p[key]
                L.append(f"| {p['d']} | {p['psi']:,} | {key[7:]} | {a['best_s']:.3f} | {b['best_s']:.3f} | {a['gmacs']:.2f}"
                         f" | {b['gmacs']:.2f} | {a['best_s'] / b['best_s']:.2f}x |")
    h = res.get("heads")
    if h:
        L += ["", f"## Heads step, d = {h['d']} (psi = {h['psi']:,}), 2-head teacher, d_out = 1", "",
              f"Statistics of {h['rows']:,} rows ({h['stats_build_s']:.1f} s to build; RSS with them"
              f" {h['stats_rss_bytes'] / gib:.2f} GiB); peak RSS of the whole step {h['peak_rss_bytes'] / gib:.2f}"
              f" GiB (the dense G alone would be {8 * h['psi']**2 / gib:.1f} GiB).", "",
              "| step | seconds | heads | residual | rel. training SSE |", "|---|---|---|---|---|"]
        for name in ("svd_heads", "search_svd", "search_minimal", "search_3"):
            r = h[name]
            L.append(f"| {name} | {r['seconds']:.2f} | {r['heads']} | {r['residual']:.1e} |"
                     f" {'' if r['relative_sse'] is None else format(r['relative_sse'], '.1e')} |")
    f = res.get("fit")
    if f:
        rep, met = f["report"], res["met"]
        L += ["", f"## Whole certified fit, d = {f['d']} (psi = {f['psi']:,}), {f['rows']:,} causal rows,"
              " `fit --local --solver krylov --heads svd`", "",
              "| wall s | peak RSS GiB | Tc GiB | peak / (Tc + one block) | coef rel. err vs teacher | verdict |"
              " rank | lambda_min | rel. train MSE |", "|---|---|---|---|---|---|---|---|---|",
              f"| {f['seconds']:.0f} | {f['peak_rss_bytes'] / gib:.2f} | {f['compact_gram_bytes'] / gib:.2f} |"
              f" {f['peak_vs_tc_plus_block']:.2f} | {f['coef_rel_err_vs_teacher']:.2e} | {rep['verdict']} |"
              f" {rep['rank']} | {rep['lambda_min']:.3e} | {rep['relative_train_mse']:.2e} |", "",
              f"Targets: certified {_yn(met['fit_certified'])}, coefficients within 1e-6 of the teacher"
              f" {_yn(met['fit_coef_err'])}, peak RSS <= 1.5 x (Tc + one block) {_yn(met['fit_peak_rss'])}."
              f" Phases: {rep.get('timings')}"]
    if res.get("preconditioners"):
        L += ["", "## Preconditioners of the krylov path: operator passes (CG iterations) to the same backward error", "",
              "| d | psi | rows (per feature) | data | block-Jacobi | K-FAC (Tc's partial traces) |"
              " K-FAC (rows' S^T S, X^T X) | verdicts | max coef diff vs block-Jacobi |", "|---|---|---|---|---|---|---|---|---|"]
        for p in res["preconditioners"]:
            names = ("block-jacobi", "kfac", "rows-kfac")
            L.append(f"| {p['d']} | {p['psi']:,} | {p['rows']:,} ({p['rows_per_feature']:.2f}) |"
                     f" {'coordinate 0 x100' if p['scaled_coordinate'] else 'as generated'} |"
                     + "".join(f" {p[n]['passes']} ({p[n]['cg_iterations']}) |" for n in names)
                     + f" {', '.join(sorted({p[n]['verdict'] for n in names}))} |"
                     f" {max(p[n]['coef_vs_block_jacobi'] for n in names):.1e} |")
    c = res.get("cluster")
    if c:
        L += ["", f"## Cluster-side operator, d = {c['d']} (psi = {c['psi']:,}), 2 workers", "",
              f"Tc ({c['compact_gram_bytes'] / 1e6:.1f} MB, {c['tiles']} tiles) stays on the workers; per product"
              f" G X with k = {c['k']}: X out to the workers, one partial per worker back into the tree sum.", "",
              "| where | seconds per product | MB out per product | MB back per product | rel. diff |",
              "|---|---|---|---|---|",
              f"| cluster ({c['workers']} workers) | {c['cluster_s']:.3f} | {c['bytes_out_per_pass'] / 1e6:.3f} |"
              f" {c['bytes_back_per_pass'] / 1e6:.3f} | {c['rel_diff']:.1e} |",
              f"| in process (Tc here) | {c['in_process_s']:.3f} | 0 | 0 | 0 |"]
    return "\n".join(L) + "\n"


def _yn(v) -> str:
    return "yes" if v else "NO"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
