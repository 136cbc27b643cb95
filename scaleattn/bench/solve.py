"""Benchmark of the dense solve against its floor and of the large factorisation's crash immunity (the dense solve's targets).

``run(out_dir, quick=False)`` (``scaleattn bench solve``) writes ``bench-solve.json`` and ``bench-solve.md``:

- :func:`solve_floor` at d = 24 (16,000 causal rows) and d = 32 (20,000 rows): the Cholesky path's whole solve
  (expansion of ``Tc`` to ``G``, blocked factor, block Krylov extreme eigenvalues, solve with refinement, SSE)
  against ``psi^3 / 3`` flops at the DGEMM rate measured in the same process, with its breakdown;
- :func:`factorisation_check` at d = 32 (psi = 16,896): numpy's and scipy's plain ``cholesky`` and ours
  (:func:`scaleattn.linalg._dense.blocked_cholesky`), each in a fresh process whose environment lacks
  ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` (so OpenBLAS picks its kernels for the CPU, AVX-512
  SkylakeX ones on most servers, where its threaded ``dpotrf`` dies with SIGSEGV at this size): the kernel
  architecture picked (threadpoolctl), whether the process died of a signal, the time and the rate.

Quick mode: d = 16 and d = 20 floors, the factorisation check at d = 20 (a smoke test, about a minute). The
machine may be shared: the load average is recorded with every figure.

:func:`solve_floor` is self-contained so that the main ``scaleattn bench`` run can call it (it accepts
statistics already built).
"""
from __future__ import annotations

import json
import os
import time

__all__ = ["run", "solve_floor", "factorisation_check", "dgemm_rate", "markdown", "floors_markdown", "ROWS",
           "CLEARED_ENV"]

#: causal rows of the statistics :func:`solve_floor` builds per d (a realizable 2-head teacher, d_out = 1)
ROWS = {16: 6_000, 20: 10_000, 24: 16_000, 32: 20_000}
#: what the factorisation check removes from the environment: this project's machines pin Haswell kernels and
#: their L2 size through them, which hides the SkylakeX failure
CLEARED_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def dgemm_rate(n: int = 4000, repeats: int = 3) -> float:
    """Best of ``repeats`` float64 GEMMs of order ``n`` through scipy's BLAS (the dense path's): flop/s."""
    from scaleattn.bench.build import gemm_rate
    from scaleattn.linalg._dense import gemm

    return gemm_rate(n, repeats, product=gemm)


def _stats(d: int, rows: int):
    from scaleattn.generate import make_mhla
    from scaleattn.statistics._container import statistics_from_arrays

    length = 100 if rows >= 10_000 else 50
    D = make_mhla(d=d, heads=2, length=length, samples=max(rows // length, 1), causal=True, d_out=1, seed=0)
    return statistics_from_arrays(D["tokens"], D["targets"])


def solve_floor(d: int, rows: int | None = None, stats=None) -> dict:
    """The Cholesky path's whole solve at ``d`` against ``psi^3 / 3`` flops at the measured DGEMM rate.

    Parameters
    ----------
    d : int
        Token dimension (psi = d^2 (d + 1) / 2).
    rows : int, optional
        Causal rows of the statistics built here (default :data:`ROWS`, else 1.2 psi).
    stats : Statistics, optional
        Statistics already built (then ``d`` and ``rows`` are theirs).

    Returns
    -------
    dict
        ``d``, ``psi``, ``rows``, ``dgemm_gflops``, ``floor_s`` (``psi^3 / 3`` at that rate), ``seconds`` (the
        breakdown: ``expand`` (``Tc`` to ``G``, inside the solve as in a fit), ``factor``, ``eigenvalues``,
        ``solve_and_sse`` (the rest: scaling, the solve with one refinement step, the SSE), ``total``), ``floor_ratio`` (total over floor), ``factor_ratio``,
        the eigenvalue runs' ``eig_passes`` and whether they ``converged``, the certificate's ``verdict``,
        ``lambda_min``, ``lambda_max`` and ``condition_number``, the ``load_average`` before and after.
    """
    import numpy as np

    import scaleattn.linalg._spectrum as spectrum
    import scaleattn.statistics._container as statistics
    from scaleattn.linalg._gram import GramOperator
    from scaleattn.linalg._solver import shared_gram, solve

    st = _stats(d, rows or ROWS.get(d, int(1.2 * d * d * (d + 1) / 2))) if stats is None else stats.to_numpy()
    psi = st.psi
    load0 = os.getloadavg()
    rate = dgemm_rate()
    seconds, passes, converged = {"expand": 0.0, "factor": 0.0, "eigenvalues": 0.0}, [], []
    factor, eigs, expand = spectrum.blocked_cholesky, spectrum.largest_eigenvalues, statistics.expand_gram

    def count_passes(out):
        passes.append(max(e.iterations for e in out))
        converged.extend(e.converged for e in out)

    timed_expand, timed_factor = _timed(expand, seconds, "expand"), _timed(factor, seconds, "factor")
    timed_eigs = _timed(eigs, seconds, "eigenvalues", count_passes)

    # the compiled copy and the operator's compiled product loaded (a fit's build has done it): neither counted,
    # nor a first compile of the product inside the solve (4 s at d = 24 on a fresh install)
    expand(np.zeros((6, 3)), 2)
    GramOperator.from_compact(np.zeros((6, 3)), 2) @ np.ones((6, 1))
    tiny = _stats(4, 400)  # and the Cholesky path itself once (its imports, the BLAS handles), on psi = 40
    solve(tiny, solver="cholesky", gram=shared_gram(tiny, "cholesky"))
    spectrum.blocked_cholesky, spectrum.largest_eigenvalues, statistics.expand_gram = (timed_factor, timed_eigs,
                                                                                      timed_expand)
    try:  # as a fit calls it (shared_gram: the operator past 4,096 features; the solve expands G itself)
        t = time.perf_counter()
        sol = solve(st, solver="cholesky", gram=shared_gram(st, "cholesky"))
        seconds["total"] = time.perf_counter() - t
    finally:
        spectrum.blocked_cholesky, spectrum.largest_eigenvalues, statistics.expand_gram = factor, eigs, expand
    seconds["solve_and_sse"] = seconds["total"] - seconds["factor"] - seconds["eigenvalues"] - seconds["expand"]
    floor = psi**3 / 3 / rate
    c = sol.certificate
    return {"d": st.d, "psi": psi, "rows": st.n_rows, "dgemm_gflops": rate / 1e9, "floor_s": floor,
            "seconds": seconds, "floor_ratio": seconds["total"] / floor, "factor_ratio": seconds["factor"] / floor,
            "eig_passes": passes, "eig_converged": bool(all(converged)), "verdict": c.verdict,
            "lambda_min": c.lambda_min, "lambda_max": c.lambda_max, "condition_number": c.condition_number,
            "load_average": [load0[0], os.getloadavg()[0]]}



def _timed(fn, seconds: dict, key: str, then=None):
    """``fn`` that adds its wall time to ``seconds[key]`` (raised or not) and passes its result to ``then``."""
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            out = fn(*a, **k)
        finally:
            seconds[key] += time.perf_counter() - t
        if then is not None:
            then(out)
        return out
    return timed

_FACTOR_CHILD = r"""
import json, sys, time
import numpy as np
import scipy.linalg
from threadpoolctl import threadpool_info
how, n = sys.argv[1], int(sys.argv[2])
from scaleattn.bench.solve import dgemm_rate
from scaleattn.linalg._dense import blocked_cholesky
rate = dgemm_rate()
rng = np.random.default_rng(0)
a = rng.random((n, n))
a += a.T
a[np.diag_indices(n)] += 3.0 * n  # diagonally dominant: positive definite, made in O(n^2)
arch = sorted({f"{i['internal_api']} {i.get('architecture')} ({i['filepath'].rsplit('/', 1)[-1]})"
               for i in threadpool_info() if i["user_api"] == "blas"})
print(json.dumps({"architectures": arch, "dgemm_gflops": rate / 1e9, "started": True}), flush=True)
f = {"numpy": np.linalg.cholesky, "scipy": lambda x: scipy.linalg.cholesky(x, lower=True, check_finite=False),
     "scaleattn": blocked_cholesky}[how]
t = time.perf_counter()
L = f(a)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "floor_ratio": dt / (n**3 / 3 / rate),
                  "residual": float(abs(L[-1] @ L[-1] - a[-1, -1]) / a[-1, -1])}), flush=True)
"""


def factorisation_check(d: int = 32, timeout: float = 1800.0) -> list[dict]:
    """numpy's, scipy's and our Cholesky of a psi x psi SPD matrix, each in a fresh process without
    :data:`CLEARED_ENV` (module docstring). One dict per factorisation: ``how``, ``psi``, ``returncode``
    (negative: killed by that signal), ``crashed``, ``signal``, ``architectures`` (OpenBLAS kernels picked),
    ``seconds``, ``floor_ratio`` (seconds over ``psi^3 / 3`` flops at the child's DGEMM rate), ``load_average``."""
    from scaleattn.bench.build import run_child

    psi = d * d * (d + 1) // 2
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    out = []
    for how in ("numpy", "scipy", "scaleattn"):
        load = os.getloadavg()[0]
        r = {"how": how, "psi": psi, **run_child(["-c", _FACTOR_CHILD, how, str(psi)], env=env, timeout=timeout)}
        r["load_average"] = [load, os.getloadavg()[0]]
        out.append(r)
    return out


def floors_markdown(floors: list[dict]) -> list[str]:
    """The table of :func:`solve_floor` results (lines)."""
    lines = ["One warm solve per d (the compiled expansion and operator product and the Cholesky path ran first,"
             " untimed, on tiny data).", "",
             "| d | psi | rows | DGEMM GF/s | floor s | expand | factor | eigenvalues (passes) | solve+SSE | total s"
             " | x floor | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in floors:
        s = r["seconds"]
        lines.append(f"| {r['d']} | {r['psi']:,} | {r['rows']:,} | {r['dgemm_gflops']:.0f} | {r['floor_s']:.2f} |"
                     f" {s['expand']:.2f} | {s['factor']:.2f} | {s['eigenvalues']:.2f} ({'+'.join(map(str, r['eig_passes']))})"
                     f" | {s['solve_and_sse']:.2f} | {s['total']:.2f} | {r['floor_ratio']:.2f} |"
                     f" {r['load_average'][0]:.1f}-{r['load_average'][1]:.1f} |")
    return lines


def markdown(result: dict) -> str:
    """The tables of :func:`run`'s result."""
    lines = ["## The dense solve against psi^3/3 flops at the DGEMM rate", "", *floors_markdown(result["floors"])]
    lines += ["", "## Large factorisation, OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (fresh process each)", "",
              "| how | psi | kernels | result | seconds | x floor | load |", "|---|---|---|---|---|---|---|"]
    for r in result["factorisations"]:
        res = f"crashed ({r['signal']})" if r["crashed"] else "ok" if r["returncode"] == 0 else f"rc {r['returncode']}"
        secs = f"{r['seconds']:.1f}" if "seconds" in r else "-"
        rate = f"{r['floor_ratio']:.2f}" if "floor_ratio" in r else "-"
        lines.append(f"| {r['how']} | {r['psi']:,} | {'; '.join(r.get('architectures', []))} | {res} | {secs} |"
                     f" {rate} | {r['load_average'][0]:.1f} |")
    return "\n".join(lines) + "\n"


def run(out_dir, quick: bool = False) -> dict:
    """Both parts (module docstring); writes ``bench-solve.json`` and ``bench-solve.md`` into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    ds = (16, 20) if quick else (24, 32)
    result = {"floors": [solve_floor(d) for d in ds], "factorisations": factorisation_check(ds[-1])}
    with open(os.path.join(out_dir, "bench-solve.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(os.path.join(out_dir, "bench-solve.md"), "w") as f:
        f.write(markdown(result))
    return result
