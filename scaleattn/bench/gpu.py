"""GPU benchmark: one script for a CUDA machine, under 10 minutes, ``scaleattn bench gpu``.

Measures on CuPy, in ONE run:

- the device's float64 GEMM rate (square product) and copy bandwidth, and the floor of the statistics build: the
  larger of ``2 x (compact Gram multiply-adds) / rate`` (DESIGN §3) and the tokens' bytes over the bandwidth
  (docs/performance.md, "Definitions"); our build (features, checks and moments included, tokens already on the
  device) against it, and as a fraction of the GEMM rate (issue 19: >= 0.8 where the multiply-adds dominate); the
  same for the build's matmuls alone (its ceiling at the device's GEMM efficiency on those shapes);
- agreement of the GPU statistics with the CPU (numpy) statistics on the same rows (must be <= 1e-12 relative:
  float64 accumulation, never TF32/FP16);
- d = 4, 8, 16, 24, 32 last tokens (psi up to 16,896) and d = 16 causal with variable lengths;
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


def copy_rate(nbytes: float = 2e9) -> float:
    """Device memory bandwidth (bytes/s): a float64 copy, counting the bytes read and written."""
    import cupy

    a = cupy.ones(int(nbytes // 8))
    b = cupy.empty_like(a)
    t, _ = _timed(lambda: cupy.copyto(b, a), reps=5)
    return 2.0 * a.nbytes / t


def build(d: int, rows: int, rate: float, bandwidth: float, causal: bool = False, check_rows: int = 2000) -> dict:
    """GPU statistics build on ``rows`` rows at dimension d (last tokens of length-16 samples, or every prefix of
    variable-length causal samples): time, both floors, CPU agreement on the first ``check_rows`` rows."""
    import cupy

    from scaleattn.statistics._container import block_samples, statistics_from_arrays

    length = 16
    rng = np.random.default_rng(d)
    samples = rows if not causal else -(-rows * 2 // (length + 1))  # lengths 1..16: (T + 1) / 2 rows a sample
    tok = rng.standard_normal((samples, length, d)) / np.sqrt(length)
    lens = rng.integers(1, length + 1, samples) if causal else None
    y = rng.standard_normal((samples, length, d) if causal else (samples, d))
    gt, gy = cupy.asarray(tok), cupy.asarray(y)
    gl = None if lens is None else cupy.asarray(lens)
    t, st = _timed(lambda: statistics_from_arrays(gt, gy, gl, causal=causal), reps=2)
    n_rows = st.n_rows
    m = n_pairs(d)
    macs = n_rows * (m * (m + 1) // 2) * (d * (d + 1) // 2)
    floor_flops, floor_bytes = 2.0 * macs / rate, tok.nbytes / bandwidth
    floor = max(floor_flops, floor_bytes)
    k = min(check_rows if not causal else max(1, check_rows // 8), samples)
    ck = (tok[:k], y[:k], None if lens is None else lens[:k])
    cpu = statistics_from_arrays(*ck, causal=causal)
    gpu = statistics_from_arrays(gt[:k], gy[:k], None if gl is None else gl[:k], causal=causal).to_numpy()
    err = float(np.abs(gpu.gram_compact - cpu.gram_compact).max() / np.abs(cpu.gram_compact).max())
    errb = float(np.abs(gpu.moments - cpu.moments).max() / np.abs(cpu.moments).max())
    t_mm = matmuls_seconds(d, n_rows, -(-samples // block_samples(d, length, causal, device=True)))
    return {"d": d, "causal": causal, "rows": n_rows, "seconds": t, "floor_flops_seconds": floor_flops,
            "floor_bytes_seconds": floor_bytes, "floor_seconds": floor, "build_vs_floor": t / floor,
            "gemm_fraction": floor_flops / t, "matmuls_seconds": t_mm, "matmuls_gemm_fraction": floor_flops / t_mm,
            "rows_per_second": n_rows / t, "gram_rel_err_vs_cpu": err, "moments_rel_err_vs_cpu": errb,
            "dtype": str(st.gram_compact.dtype)}


def matmuls_seconds(d: int, n_rows: int, blocks: int) -> float:
    """The build's ``u^T v`` matmuls alone, on random panels of the shapes the device path uses (``blocks`` blocks
    of ``n_rows / blocks`` rows, panels of ``scaleattn.statistics._kernel.device_panel_cols``): the ceiling of the build's
    formulation at this device's GEMM efficiency on those shapes (H200, d = 32: 0.73 of the square GEMM's rate)."""
    import cupy

    from scaleattn.statistics._kernel import device_panel_cols

    rows, mm, dd = -(-n_rows // blocks), n_pairs(n_pairs(d)), n_pairs(d)
    width = min(mm, device_panel_cols(rows))
    rng = cupy.random.default_rng(d)
    u, v = rng.random((rows, width)), rng.random((rows, dd))
    t, _ = _timed(lambda: u.T @ v)
    return blocks * (mm / width) * t


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
    lines = [f"# GPU benchmark ({res['device']})", "", f"float64 GEMM: {res['gemm_tflops']:.2f} TFLOP/s, copy: "
             f"{res['copy_tbps']:.2f} TB/s", "",
             "| d | rows | build s | floor s (flops, bytes) | build / floor | of GEMM rate | its matmuls alone | "
             "rows/s | rel err vs CPU (G, B) |", "|---|---|---|---|---|---|---|---|---|"]
    for b in res["builds"]:
        lines.append(f"| {b['d']}{' causal' if b['causal'] else ''} | {b['rows']:,} | {b['seconds']:.3g} | "
                     f"{b['floor_flops_seconds']:.3g}, {b['floor_bytes_seconds']:.3g} | {b['build_vs_floor']:.2f} | "
                     f"{b['gemm_fraction']:.2f} | {b['matmuls_seconds']:.3g} s, {b['matmuls_gemm_fraction']:.2f} | "
                     f"{b['rows_per_second']:.3g} | "
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
    rate, bandwidth = gemm_rate(4096 if quick else 8192), copy_rate(2e8 if quick else 2e9)
    res["gemm_tflops"], res["copy_tbps"] = rate / 1e12, bandwidth / 1e12
    sizes = ([(8, 20_000, False), (16, 20_000, False), (8, 20_000, True)] if quick else
             [(4, 2_000_000, False), (8, 1_000_000, False), (16, 200_000, False), (24, 100_000, False),
              (32, 100_000, False), (16, 200_000, True)])
    res["builds"] = []
    for d, rows, causal in sizes:
        res["builds"].append(build(d, rows, rate, bandwidth, causal))
        print(res["builds"][-1], flush=True)  # a partial result survives a later failure
    res["tensor"] = tensor_scaling((256, 512, 1024) if quick else (256, 512, 1024, 2048, 4096))
    res["seconds"] = time.perf_counter() - t0
    (out_dir / "gpu.json").write_text(json.dumps(res, indent=2, default=float))
    (out_dir / "gpu.md").write_text(markdown(res))
    return res
