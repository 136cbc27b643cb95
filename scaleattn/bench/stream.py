"""Benchmark of the streaming path against the Gram route (DESIGN §4b): ``scaleattn bench stream``.

``run(out_dir, quick=False)`` writes ``bench-stream.json`` and ``bench-stream.md``:

- :func:`compare` per d (16 / 24 / 32 by default; 44 with ``dims``): realizable causal data (a 2-head teacher) with
  3 rows per feature and d_out = d, fitted once by the Gram route (statistics, then :func:`scaleattn.solve`,
  path ``auto``) and once by :func:`scaleattn.linalg._stream.stream_solve`, each in a fresh process (its peak RSS
  is its own: ``ru_maxrss``, data generation included; and the fit's own, ``VmHWM`` reset once the data are made,
  the tokens and targets held): wall, passes over the data, peak RSS, the verdicts and the
  coefficients' largest relative difference;
- :func:`pass_timing` at d = 64, d_out = 1, 3 rows per feature (about 400,000 causal rows of random tokens: the
  cost of a pass does not depend on the values): the first sweep and
  the time of passes with 1 and 7 columns (a CG step with the eigenvalue runs beside it carries about 7), the
  token features recomputed in each pass (they do not fit the cache), and the peak RSS.

- :func:`cli_fit` at d = 64, d_out = 1, 3 rows per feature: ``scaleattn fit DATA --solver stream`` in a child
  process on a realizable dataset, its wall, peak RSS, passes, verdict and distance to the teacher.

- :func:`workers_timing` at d = 24, d_out = d, 3 rows per feature, causal: the same streaming fit of a Zarr dataset
  in this process and on an embedded LocalCluster of 1 and of 2 worker processes (one thread each;
  :mod:`scaleattn.distributed.stream`): wall, passes, whether the token features stayed on the workers, the
  speed-up of 2 workers over 1, and whether the three answers (coefficients, SSE, certificate) are bit-identical.

Quick mode: d = 8 and 12, the pass timing at d = 24, the command at d = 12 and the workers at d = 8 (a smoke
test, a few minutes). The machine may be shared: the load average is recorded with every figure.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import time

__all__ = ["run", "compare", "pass_timing", "cli_fit", "workers_timing", "markdown", "ROWS_PER_FEATURE"]

#: causal rows per feature of the data fitted
ROWS_PER_FEATURE = 3


def _data(d: int, d_out: int, rows_per_feature: float, seed: int = 0):
    from scaleattn.features import n_features
    from scaleattn.generate import make_mhla

    length = 50
    samples = max(int(rows_per_feature * n_features(d)) // length, 1)
    D = make_mhla(d=d, heads=2, length=length, samples=samples, causal=True, d_out=d_out, seed=seed)
    return D["tokens"], D["targets"]


def _peak_rss() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux: KiB


def _reset_peak() -> bool:
    """Start the process's peak RSS (``VmHWM``) again from its RSS now, the freed heap handed back first (Linux
    ``clear_refs`` 5): what a route's fit holds, the data generation's buffers not counted. False where the
    kernel does not offer it."""
    from scaleattn.distributed.memory import trim_heap

    trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _hwm() -> float:
    """``VmHWM`` (bytes) of this process, NaN where /proc has none."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024.0 for line in fh if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return float("nan")


def _route(args):
    """One fit in this (fresh) process: ``(figures, coef)``."""
    route, d, d_out, rpf = args
    import numpy as np

    tok, y = _data(d, d_out, rpf)
    reset = _reset_peak()  # (the fit's own peak from here: the tokens and targets held, the generation's buffers not)
    t = time.perf_counter()
    out = {"route": route, "d": d, "rows": int(tok.shape[0] * tok.shape[1]), "load_before": os.getloadavg()[0]}
    if route == "gram":
        import scaleattn

        stats = scaleattn.statistics_from_arrays(tok, y, causal=True)
        out["build_s"] = time.perf_counter() - t
        sol = scaleattn.solve(stats)
        out["passes"] = (sol.certificate.estimates or {}).get("passes")
        out["path"] = "gram (" + ((sol.certificate.estimates or {}).get("solver") or "eigh/cholesky") + ")"
    else:
        from scaleattn.linalg._stream import rows_from_arrays, stream_solve

        sol = stream_solve(rows_from_arrays(tok, y, causal=True))
        est = sol.certificate.estimates
        out["passes"] = est["data_passes"]
        out["cg_iterations"] = est["cg_iterations"]
        kw = est["lambda_min_lower_probabilistic"]
        out["kw_lower"] = None if kw is None else kw["lower"]
        out["kw_steps"] = None if kw is None else kw["steps"]
        out["path"] = "stream (K-FAC)"
    out["wall_s"] = time.perf_counter() - t
    out.update(verdict=sol.certificate.verdict, lambda_min=sol.certificate.lambda_min,
               lambda_max=sol.certificate.lambda_max, peak_rss_gib=_peak_rss() / 2**30,
               fit_peak_rss_gib=_hwm() / 2**30 if reset else float("nan"),
               load_after=os.getloadavg()[0])
    return out, np.asarray(sol.coef)


def _fresh(fn, args):
    """``fn(args)`` in a fresh process (a worker killed for memory raises BrokenProcessPool, never hangs)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, args).result()


def compare(d: int, d_out: int | None = None, rows_per_feature: float = ROWS_PER_FEATURE) -> dict:
    """The Gram route and the streaming path on the same data, each in a fresh process (module notes)."""
    import numpy as np

    d_out = d if d_out is None else d_out
    g, cg = _fresh(_route, ("gram", d, d_out, rows_per_feature))
    s, cs = _fresh(_route, ("stream", d, d_out, rows_per_feature))
    diff = float(np.abs(cs - cg).max() / max(np.abs(cg).max(), 1e-300))
    return {"d": d, "d_out": d_out, "rows_per_feature": rows_per_feature, "gram": g, "stream": s,
            "coef_rel_diff": diff, "wall_ratio": s["wall_s"] / g["wall_s"],
            "rss_ratio": s["peak_rss_gib"] / g["peak_rss_gib"],
            "fit_rss_ratio": s["fit_peak_rss_gib"] / g["fit_peak_rss_gib"]}


def _timing(args):
    d, d_out, rpf, passes = args
    import numpy as np

    from scaleattn.features import n_features
    from scaleattn.linalg._stream import StreamOperator, rows_from_arrays

    # random tokens and targets: a pass costs the same, and the teacher's forward pass would hold every prefix's
    # d x d Gram (13 GB at d = 64)
    rng = np.random.default_rng(0)
    length = 50
    samples = max(int(rpf * n_features(d)) // length, 1)
    tok = rng.standard_normal((samples, length, d)) / np.sqrt(length)
    y = rng.standard_normal((samples, length, d_out))
    out = {"d": d, "rows": int(tok.shape[0] * tok.shape[1]), "load_before": os.getloadavg()[0]}
    t = time.perf_counter()
    op = StreamOperator(rows_from_arrays(tok, y, causal=True))
    out["sweep_s"] = time.perf_counter() - t
    out["cached"] = all(k is not None for k in op.source._kept)
    rng = np.random.default_rng(0)
    for k in (1, 7):
        W = rng.standard_normal((op.psi, k))
        t = time.perf_counter()
        for _ in range(passes):
            op.matmat(W)
        out[f"pass_{k}_s"] = (time.perf_counter() - t) / passes
    out.update(peak_rss_gib=_peak_rss() / 2**30, load_after=os.getloadavg()[0])
    return out


def pass_timing(d: int = 64, d_out: int = 1, rows_per_feature: float = ROWS_PER_FEATURE, passes: int = 1) -> dict:
    """Time of the first sweep and of one pass with 1 and 7 columns at ``d`` (fresh process; module notes)."""
    return _fresh(_timing, (d, d_out, rows_per_feature, passes))


def cli_fit(d: int = 64, d_out: int = 1, rows_per_feature: float = ROWS_PER_FEATURE, out_dir: str | None = None,
            length: int = 50) -> dict:
    """``scaleattn fit DATA --solver stream`` on realizable causal data (a 2-head teacher, ``d_out`` outputs,
    ``rows_per_feature`` rows per feature), as a user runs it: the dataset written first (not timed with the fit),
    then the command in a child process, its wall time and peak RSS (the child's ``ru_maxrss``: tokens, features
    and solver together), and from its report the passes, the verdict, the probabilistic bound and the
    coefficients' distance to the teacher's (absolute and relative to ``||c_teacher||``)."""
    import resource
    import shutil
    import subprocess
    import sys
    import tempfile

    import numpy as np

    from scaleattn.data import open_dataset
    from scaleattn.features import n_features
    from scaleattn.generate import generate_mhla
    from scaleattn.heads import coef_from_heads
    from scaleattn.linalg._stream import route_seconds

    where = tempfile.mkdtemp(prefix="scaleattn-bench-stream-", dir=out_dir)
    try:
        samples = max(int(rows_per_feature * n_features(d)) // length, 1)
        t = time.perf_counter()
        data = os.path.join(where, "data.zarr")
        generate_mhla(data, d=d, heads=2, length=length, samples=samples, d_out=d_out, causal=True, seed=1)
        out = {"d": d, "d_out": d_out, "rows": samples * length, "generate_s": time.perf_counter() - t,
               "load_before": os.getloadavg()[0]}
        run_dir = os.path.join(where, "run")
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "scaleattn", "fit", data, "--out", run_dir, "--solver", "stream"],
                              capture_output=True, text=True)
        out["wall_s"] = time.perf_counter() - t
        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024.0 / 2**30
        out["load_after"] = os.getloadavg()[0]
        if proc.returncode != 0:
            out["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            return out
        with open(os.path.join(run_dir, "report.json")) as f:
            rep = json.load(f)
        est = rep.get("estimates") or {}
        kw = est.get("lambda_min_lower_probabilistic") or {}
        ct = coef_from_heads(*open_dataset(data).teacher())
        out.update(passes=est.get("data_passes"), cg_iterations=est.get("cg_iterations"), verdict=rep["verdict"],
                   identifiable_with_probability=est.get("identifiable_with_probability"),
                   kw_lower=kw.get("lower"), lambda_min=rep.get("lambda_min"), solve_s=rep["timings"]["solve"],
                   teacher_coef_distance=rep.get("teacher_coef_distance"),
                   teacher_coef_relative=rep.get("teacher_coef_distance", float("nan")) / float(np.linalg.norm(ct)),
                   predicted_s=route_seconds(samples * length, d, d_out)["stream"])
        return out
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _workers_fit(args):
    """One streaming fit of the dataset at ``url``: in this process (``workers`` 0) or on a fresh LocalCluster of
    ``workers`` processes. ``(figures, coef, sse, certificate numbers)``."""
    url, workers = args
    import numpy as np

    from scaleattn.data import open_dataset
    from scaleattn.distributed.stream import stream_operator
    from scaleattn.linalg._stream import stream_solve

    ds = open_dataset(url)
    out = {"workers": workers, "load_before": os.getloadavg()[0]}
    if workers:
        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address=None)
        client = Client(cluster)
    else:
        cluster = client = None
    try:
        t = time.perf_counter()
        op = stream_operator(ds, client)
        out["sweep_s"] = time.perf_counter() - t
        sol = stream_solve(op.source, op=op)
        out["wall_s"] = time.perf_counter() - t
        out["features_kept"] = bool(getattr(op, "features_kept", all(k is not None for k in op.source._kept)))
    finally:
        if client is not None:
            client.close()
            cluster.close()
    cert = sol.certificate
    out.update(passes=int(sol.passes), verdict=cert.verdict, load_after=os.getloadavg()[0])
    numbers = json.dumps([cert.rank, cert.lambda_min, cert.lambda_max, cert.estimates], sort_keys=True, default=str)
    return out, np.asarray(sol.coef), float(sol.sse), numbers


def workers_timing(d: int = 24, rows_per_feature: float = ROWS_PER_FEATURE, out_dir=None) -> dict:
    """The same streaming fit in this process and on 1 and 2 worker processes (module notes), each run in a fresh
    process; the dataset (d_out = d, causal, a 2-head teacher) written under ``out_dir`` (a temporary folder)."""
    import tempfile

    import numpy as np

    from scaleattn.features import n_features
    from scaleattn.generate import generate_mhla

    length = 50
    samples = max(int(rows_per_feature * n_features(d)) // length, 1)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        url = os.path.join(tmp, "workers.zarr")
        generate_mhla(url, d=d, heads=2, length=length, samples=samples, causal=True, d_out=d, seed=0)
        runs = {n: _fresh(_workers_fit, (url, n)) for n in (0, 1, 2)}
    ref = runs[0]
    same = {n: bool(np.array_equal(r[1], ref[1]) and r[2] == ref[2] and r[3] == ref[3]) for n, r in runs.items()}
    return {"d": d, "rows": samples * length, "rows_per_feature": rows_per_feature, "cores": os.cpu_count(),
            "runs": [r[0] for r in runs.values()], "bit_identical": all(same.values()),
            "speedup_2_over_1": runs[1][0]["wall_s"] / runs[2][0]["wall_s"]}


def markdown(result: dict) -> str:
    """The tables of ``bench-stream.md``."""
    lines = ["| d | psi | rows | route | passes (CG) | wall (s) | peak RSS (GiB) | the fit's peak RSS (GiB) | verdict |"
             " coef rel. diff |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["compare"]:
        psi = c["d"] ** 2 * (c["d"] + 1) // 2
        for r in ("gram", "stream"):
            x = c[r]
            cg = f" ({x['cg_iterations']})" if x.get("cg_iterations") else ""
            lines.append(f"| {c['d']} | {psi:,} | {x['rows']:,} | {x['path']} | {x['passes'] or '-'}{cg} |"
                         f" {x['wall_s']:.1f} | {x['peak_rss_gib']:.2f} | {x.get('fit_peak_rss_gib', float('nan')):.2f} |"
                         f" {x['verdict']} |"
                         f" {c['coef_rel_diff']:.1e} |")
    t = result.get("pass_timing")
    if t:
        lines += ["", f"Pass timing at d = {t['d']} ({t['rows']:,} causal rows, d_out = 1, features"
                      f" {'cached' if t['cached'] else 'recomputed each pass'}): first sweep {t['sweep_s']:.1f} s,"
                      f" a pass with 1 column {t['pass_1_s']:.1f} s, with 7 columns {t['pass_7_s']:.1f} s;"
                      f" peak RSS {t['peak_rss_gib']:.2f} GiB."]
    f = result.get("cli_fit")
    if f and "error" not in f:
        lines += ["", f"`scaleattn fit DATA --solver stream` at d = {f['d']}, d_out = {f['d_out']} ({f['rows']:,} causal"
                      f" rows of a 2-head teacher): wall {f['wall_s']:.0f} s (solve {f['solve_s']:.0f} s; the model"
                      f" predicted {f['predicted_s']:.0f} s), {f['passes']} data passes (CG {f['cg_iterations']}),"
                      f" peak RSS {f['peak_rss_gib']:.2f} GiB, {f['verdict']}"
                      + (f" with probability >= {f['identifiable_with_probability']:g}"
                         if f.get("identifiable_with_probability") else "")
                      + f", ||c - c_teacher|| = {f['teacher_coef_distance']:.1e}"
                        f" ({f['teacher_coef_relative']:.1e} relative); load {f['load_before']:.1f}-{f['load_after']:.1f}."]
    elif f:
        lines += ["", f"`scaleattn fit --solver stream` at d = {f['d']} failed: {f['error']}"]
    w = result.get("workers")
    if w:
        lines += ["", f"Workers at d = {w['d']} ({w['rows']:,} causal rows, d_out = d, the same Zarr dataset; answers"
                      f" {'bit-identical' if w['bit_identical'] else 'NOT bit-identical'}; 2 workers"
                      f" {w['speedup_2_over_1']:.2f}x faster than 1):", "",
                  "| where | passes | first sweep (s) | wall (s) | features kept | load avg before / after |",
                  "|---|---|---|---|---|---|"]
        for r in w["runs"]:
            where = f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}" if r["workers"] else "in process"
            lines.append(f"| {where} | {r['passes']} | {r['sweep_s']:.1f} | {r['wall_s']:.1f} |"
                         f" {'yes' if r['features_kept'] else 'no'} | {r['load_before']:.2f} / {r['load_after']:.2f} |")
    return "\n".join(lines) + "\n"


def run(out_dir, quick: bool = False, dims=None, timing_d: int | None = None, workers_d: int | None = None) -> dict:
    """The parts of the module notes; writes ``bench-stream.json`` and ``bench-stream.md`` into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    dims = dims or ((8, 12) if quick else (16, 24, 32))
    result = {"compare": [compare(d) for d in dims]}
    result["pass_timing"] = pass_timing(timing_d or (24 if quick else 64))
    result["cli_fit"] = cli_fit(12 if quick else 64, out_dir=out_dir)
    result["workers"] = workers_timing(workers_d or (8 if quick else 24), out_dir=out_dir)
    with open(os.path.join(out_dir, "bench-stream.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(os.path.join(out_dir, "bench-stream.md"), "w") as f:
        f.write(markdown(result))
    return result
