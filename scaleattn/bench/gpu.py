"""GPU benchmark: one script for a CUDA machine, under 10 minutes, ``scaleattn bench gpu``.

Measures on CuPy, in ONE run:

- the device's float64 GEMM rate (square product) and the floor of the statistics build,
  ``2 x (compact Gram multiply-adds) / rate`` (DESIGN §3); our build (features included) against it;
- agreement of the GPU statistics with the CPU (numpy) statistics on the same rows (must be <= 1e-12 relative:
  float64 accumulation, never TF32/FP16);
- d = 8, 16, 32 (psi up to 16,896);
- tensor attention on the GPU: exact streamed forward vs the polynomial fast path against n.

Writes ``gpu.json`` and ``gpu.md``. Without CuPy or a GPU it raises ``RuntimeError`` with the reason.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from scaleattn.features import n_pairs

__all__ = ["run"]


def _sync():
    import cupy

    cupy.cuda.Device().synchronize()


def _timed(fn, reps: int = 3):
    best, out = float("inf"), None
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best, out


def gemm_rate(n: int = 8192) -> float:
    """float64 GEMM rate (flop/s) of the current device on an n x n product."""
    import cupy

    a = cupy.random.default_rng(0).random((n, n))
    t, _ = _timed(lambda: a @ a)
    return 2.0 * n**3 / t


def build(d: int, rows: int, rate: float, check_rows: int = 2000) -> dict:
    """GPU statistics build on ``rows`` last-token rows at dimension d: time, floor ratio, CPU agreement."""
    import cupy

    from scaleattn.statistics import statistics_from_arrays

    length = 16
    rng = np.random.default_rng(d)
    samples = rows
    tok = rng.standard_normal((samples, length, d)) / np.sqrt(length)
    y = rng.standard_normal((samples, d))
    gt, gy = cupy.asarray(tok), cupy.asarray(y)
    t, st = _timed(lambda: statistics_from_arrays(gt, gy), reps=2)
    m = n_pairs(d)
    macs = rows * (m * (m + 1) // 2) * (d * (d + 1) // 2)
    floor = 2.0 * macs / rate
    k = min(check_rows, samples)
    cpu = statistics_from_arrays(tok[:k], y[:k])
    gpu = statistics_from_arrays(gt[:k], gy[:k]).to_numpy()
    err = float(np.abs(gpu.gram_compact - cpu.gram_compact).max() / np.abs(cpu.gram_compact).max())
    errb = float(np.abs(gpu.moments - cpu.moments).max() / np.abs(cpu.moments).max())
    return {"d": d, "rows": rows, "seconds": t, "floor_seconds": floor, "build_vs_floor": t / floor,
            "rows_per_second": rows / t, "gram_rel_err_vs_cpu": err, "moments_rel_err_vs_cpu": errb,
            "dtype": str(st.gram_compact.dtype)}


def tensor_scaling(ns=(256, 512, 1024, 2048, 4096), d: int = 8, degree: int = 3) -> list[dict]:
    """Exact vs polynomial tensor attention on the device against n (bounded entries)."""
    import cupy

    from scaleattn import tensor

    out = []
    for n in ns:
        rng = cupy.random.default_rng(n)
        Q, K1, K2, V1, V2 = (0.3 * rng.standard_normal((n, d)) for _ in range(5))
        t_fast, fast = _timed(lambda: tensor.poly_attention(Q, K1, K2, V1, V2, degree=degree), reps=2)
        row = {"n": n, "d": d, "degree": degree, "poly_seconds": t_fast}
        if n <= 2048:  # the exact path is n^3 d
            t_exact, exact = _timed(lambda: tensor.attention(Q, K1, K2, V1, V2), reps=1)
            row.update(exact_seconds=t_exact, max_abs_err=float(cupy.abs(fast - exact).max()))
        out.append(row)
    return out


def markdown(res: dict) -> str:
    lines = [f"# GPU benchmark ({res['device']})", "", f"float64 GEMM: {res['gemm_tflops']:.2f} TFLOP/s", "",
             "| d | rows | build s | floor s | build / floor | rows/s | rel err vs CPU (G, B) |",
             "|---|---|---|---|---|---|---|"]
    for b in res["builds"]:
        lines.append(f"| {b['d']} | {b['rows']:,} | {b['seconds']:.3g} | {b['floor_seconds']:.3g} | "
                     f"{b['build_vs_floor']:.2f} | {b['rows_per_second']:.3g} | "
                     f"{b['gram_rel_err_vs_cpu']:.1e}, {b['moments_rel_err_vs_cpu']:.1e} |")
    lines += ["", "| n | d | degree | poly s | exact s | max abs err |", "|---|---|---|---|---|---|"]
    for r in res["tensor"]:
        lines.append(f"| {r['n']} | {r['d']} | {r['degree']} | {r['poly_seconds']:.3g} | "
                     f"{r.get('exact_seconds', float('nan')):.3g} | {r.get('max_abs_err', float('nan')):.2e} |")
    return "\n".join(lines) + "\n"


def run(out_dir, quick: bool = False) -> dict:
    """Run the GPU benchmark; write ``gpu.json`` and ``gpu.md`` into ``out_dir``; return the results.

    Raises ``RuntimeError`` when CuPy or a CUDA device is missing.
    """
    from scaleattn._backend import have_cupy
    from scaleattn.errors import install_hint

    if not have_cupy():
        raise RuntimeError(f"the GPU benchmark needs CuPy and a CUDA device ({install_hint('gpu', 'cupy-cuda12x')})")
    import cupy

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    res = {"device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
           "quick": quick}
    rate = gemm_rate(4096 if quick else 8192)
    res["gemm_tflops"] = rate / 1e12
    sizes = [(8, 20_000), (16, 20_000)] if quick else [(8, 200_000), (16, 100_000), (32, 20_000)]
    res["builds"] = [build(d, rows, rate) for d, rows in sizes]
    res["tensor"] = tensor_scaling((256, 512, 1024) if quick else (256, 512, 1024, 2048, 4096))
    res["seconds"] = time.perf_counter() - t0
    (out_dir / "gpu.json").write_text(json.dumps(res, indent=2, default=float))
    (out_dir / "gpu.md").write_text(markdown(res))
    return res
