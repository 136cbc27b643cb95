"""The statistics build against its floors, the chunked numpy loop and numpy SYRK, per kernel (layer L5).

:func:`build_table` measures, in one run (the machine may be shared: every ratio is taken within the run):

- ``floor_macs_s``: ``2 x rows x m(m+1)/2 x d(d+1)/2`` (the compact Gram's multiply-adds, DESIGN §3) over the
  float64 GEMM rate (a square ``numpy`` product on all BLAS threads);
- ``floor_bytes_s``: the bytes of the tokens over the memory bandwidth (``np.copyto`` of 80 MB: bytes read
  plus written per second), the floor where the per-row work is small;
- both rates are measured right before and right after each size's builds and the larger of the two is used
  (unless given): on a shared machine the rate drifts by 10-30 % within a run (55.7-74.8 GFLOP/s measured on
  one VM), so a rate taken minutes away would move every ratio with the machine, not with the code; the larger
  one keeps the floor strict. ``vs_best`` is the ratio against the fastest rates measured anywhere in the run;
- ``floor_s = max`` of the two; ``build_s``: :func:`scaleattn.statistics._container.statistics_from_arrays` (features,
  ``Tc``, ``B``, ``yy``) with each kernel (:data:`scaleattn.statistics._kernel.KERNELS`), best of ``repeats`` rounds with
  the kernels alternating, more rounds of a kernel (up to :data:`MAX_ROUNDS`) while its own builds took under
  ``min_time`` (1 s) in all: builds of 30 ms sample the machine's speed of one instant;
- ``loop_s``: the loop a user would write (``phi`` per chunk of rows, ``G += phi^T phi``, ``B += phi^T y``);
  at large ``d`` it runs a SYRK, ``psi^2/2`` multiply-adds per row against our ``psi^2/4``, so about 2x is
  the physical bound of ``speedup_vs_loop`` there;
- ``syrk_s``: ``phi^T phi`` by numpy on a ready ``phi`` (when it fits in ``max_phi_bytes``);
- the loop and SYRK run in a fresh process per size (:func:`run_child`), on the same data: OpenBLAS's threaded
  SYRK with its AVX-512 (SkylakeX) kernels dies with SIGSEGV at psi = 16,896 (d = 32, 4,000 rows; the same
  failure as its ``dpotrf``, :mod:`scaleattn.linalg._dense`), and a peer's crash is then a result of the table
  (``syrk_failed``), not the end of the run.

Example: ``python -m scaleattn.bench.build --quick`` prints the table (markdown).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

__all__ = ["build_table", "gemm_rate", "starved_probe", "copy_bandwidth", "markdown", "target_vs_floor", "run_child", "SIZES",
           "QUICK_SIZES", "TARGET_VS_LOOP", "MAX_ROUNDS"]

#: the build's target speed-up over the chunked numpy loop (issue 19), at every d from 4 to 32
TARGET_VS_LOOP = 3.0
#: rounds of builds per size and kernel at most (:func:`build_table`'s ``min_time``): 30 builds of d = 4's 20-30 ms
MAX_ROUNDS = 30


def target_vs_floor(d: int) -> float | None:
    """The build-vs-floor target of issue 19 at ``d``: <= 3x at d = 4, <= 2x at d = 8, <= 1.3x at d >= 16
    (None in between)."""
    return 3.0 if d <= 4 else 2.0 if d <= 8 else 1.3 if d >= 16 else None

#: (d, rows, causal[, variable lengths]) of the full table: causal rows are 100-token prefixes (variable lengths:
#: uniform in [1, 100], about half the rows per sequence), d = 32 last-token rows
SIZES = ((4, 1_000_000, True), (4, 1_000_000, True, True), (4, 100_000, False), (8, 200_000, True),
         (8, 200_000, True, True), (16, 40_000, True), (24, 16_000, True), (32, 4_000, False))
#: the quick table (about a minute on 2 cores)
QUICK_SIZES = ((4, 100_000, True), (8, 20_000, True), (16, 4_000, True))


def _best(f, repeats: int) -> float:
    best = float("inf")
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def _settle(max_s: float = 1.0, step: float = 0.02) -> None:
    """Wait (at most ``max_s``) until this process is idle: after a threaded BLAS call (the loop, SYRK, the GEMM
    rate) OpenBLAS's helper threads spin for about 0.1 s (measured: 0.05-0.07 s of CPU in a 0.3 s sleep after a
    2-thread GEMM, whatever the BLAS thread limit), taking a core from the build timed next."""
    end = time.perf_counter() + max_s
    while time.perf_counter() < end:
        cpu = time.process_time()
        time.sleep(step)
        if time.process_time() - cpu < 0.1 * step:
            return


def gemm_rate(n: int = 2000, repeats: int = 3, product=None) -> float:
    """float64 GEMM rate (FLOP/s) of an ``n x n`` product, best of ``repeats``: numpy's ``@`` on all BLAS threads,
    or ``product(a, a)`` (the dense solve times scipy's BLAS, the library it calls: :mod:`scaleattn.bench.solve`)."""
    a = np.random.default_rng(0).standard_normal((n, n))
    product = np.matmul if product is None else product
    product(a, a)
    return 2.0 * n**3 / _best(lambda: product(a, a), repeats)


def copy_bandwidth(nbytes: float = 80e6, repeats: int = 3) -> float:
    """Memory bandwidth (bytes read + written per second) of ``np.copyto`` on ``nbytes``, best of ``repeats``."""
    a = np.ones(int(nbytes) // 8)
    b = np.empty_like(a)
    return 2.0 * a.nbytes / _best(lambda: np.copyto(b, a), repeats)


def _loop(tokens, targets, causal: bool, lengths=None, chunk_bytes: float = 32e6):
    """The chunked numpy loop: ``phi`` per chunk of samples, ``G += phi^T phi``, ``B += phi^T y``."""
    from scaleattn.features import n_features, phi, row_targets, token_features

    n, T, d = tokens.shape
    psi = n_features(d)
    rows_per = T if causal else 1
    step = max(1, int(chunk_bytes // (8 * psi * rows_per)))
    G, B = np.zeros((psi, psi)), np.zeros((psi, targets.shape[-1]))
    for a in range(0, n, step):
        lens = None if lengths is None else lengths[a : a + step]
        f = phi(*token_features(tokens[a : a + step], lens, causal))
        G += f.T @ f
        B += f.T @ row_targets(targets[a : a + step], lens, causal)
    return G, B


def _data(d: int, rows: int, causal: bool, var: bool, T: int = 100):
    """The table's data for one size (the same in the child that times the peers): tokens, targets, lengths and
    the feature rows. C-ordered, as a dataset's reads hand them to the build (make_mhla's targets come out of an
    einsum position-major, a layout no fit sees: the build would time a transposing copy of them as well)."""
    from scaleattn.generate import make_mhla

    n = max(1, rows // T) if causal else rows
    D = make_mhla(d=d, heads=2, length=T, samples=n, causal=causal, variable_lengths=var, seed=0)
    nrows = int(D["lengths"].sum()) if causal and var else (n * T if causal else n)
    return np.ascontiguousarray(D["tokens"]), np.ascontiguousarray(D["targets"]), D["lengths"], nrows


def run_child(args, *, env=None, timeout: float = 1800.0) -> dict:
    """Run ``python ARGS`` in a fresh process and collect what it reports: each stdout line that is a JSON object
    is merged into the result, then ``returncode`` (negative: killed by that signal; None: timed out),
    ``crashed``, ``signal`` (its name), ``timed_out``, ``failure`` (``"SIGSEGV"``, ``"exit 3"``, ``"timed out"``
    or None), ``wall_s`` and, for a failure that is not a crash, ``stderr_tail``.

    For peers that may die inside a library, so that a crash is a measured result and the run goes on.

    Examples
    --------
    >>> r = run_child(["-c", "print('{\\"x\\": 1}')"])
    >>> r["x"], r["returncode"], r["crashed"], r["failure"]
    (1, 0, False, None)
    """
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = None, e.stdout or "", "timed out"
    r = {}
    for line in (stdout if isinstance(stdout, str) else stdout.decode()).splitlines():
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict):
            r.update(v)
    crashed = rc is not None and rc < 0
    try:
        name = signal.Signals(-rc).name if crashed else None
    except ValueError:  # a real-time signal has no name
        name = f"signal {-rc}"
    r.update(returncode=rc, crashed=crashed, signal=name, timed_out=rc is None, wall_s=time.perf_counter() - t,
             failure=name or ("timed out" if rc is None else f"exit {rc}" if rc else None))
    if rc and not crashed:
        r["stderr_tail"] = (stderr if isinstance(stderr, str) else stderr.decode())[-500:]
    return r


def _peers(d: int, rows: int, causal: bool, var: bool, max_phi_bytes: float, threads: int) -> None:
    """(In the child of :func:`build_table`.) The chunked loop, then numpy's SYRK on a ready ``phi`` where it fits
    in ``max_phi_bytes``, on ``threads`` BLAS threads (the parent's): one JSON line as each starts and ends."""
    from threadpoolctl import threadpool_limits

    from scaleattn.features import n_features, phi, token_features

    tokens, targets, lengths, nrows = _data(d, rows, causal, var)
    with threadpool_limits(threads, user_api="blas"):  # each timed once, warm: the same calls on two samples first
        _loop(tokens[:2], targets[:2], causal, None if lengths is None else lengths[:2])
        print(json.dumps({"loop_s": _best(lambda: _loop(tokens, targets, causal, lengths), 1)}), flush=True)
        if nrows * n_features(d) * 8 <= max_phi_bytes:
            f = phi(*token_features(tokens, lengths, causal))
            f[:64].T @ f[:64]
            print(json.dumps({"syrk_started": True}), flush=True)
            print(json.dumps({"syrk_s": _best(lambda: f.T @ f, 1)}), flush=True)


_PEERS_CHILD = "import json, sys; from scaleattn.bench.build import _peers; _peers(*json.loads(sys.argv[1]))"


def build_table(sizes=SIZES, rate: float | None = None, *, bandwidth: float | None = None,
                kernels=None, repeats: int = 2, loop: bool = True, max_phi_bytes: float = 2e9,
                loop_max_s: float = 60.0, gemm_n: int = 2000, min_time: float = 1.0) -> list[dict]:
    """The build against its floors and the numpy baselines, one row per (size, kernel).

    Parameters
    ----------
    sizes : sequence of (d, rows, causal) or (d, rows, causal, variable_lengths)
        Causal rows come from sequences of 100 tokens (``rows / 100`` of them), last-token rows one per sequence
        of 100 tokens; with ``variable_lengths`` the sequences have lengths uniform in [1, 100] (causal: about
        half the rows).
    rate, bandwidth : float, optional
        GEMM rate (FLOP/s) and memory bandwidth (bytes/s) for every size; when not given, measured
        (:func:`gemm_rate`, :func:`copy_bandwidth`) before and after each size's builds, the larger used.
    kernels : sequence of str, optional
        Default :data:`scaleattn.statistics._kernel.KERNELS`.
    repeats : int
        Best of at least this many builds of each kernel; more (at most :data:`MAX_ROUNDS`) while that kernel's
        builds of the size have taken under ``min_time`` seconds in all (``rounds`` in each row).
    gemm_n : int
        Size of the square product that measures the GEMM rate.
    loop : bool
        Also time the chunked loop and SYRK, in a fresh process per size on the same data (skipped where the
        loop's flops alone would exceed ``loop_max_s`` at ``rate``, or ``phi`` would exceed ``max_phi_bytes``:
        then ``None``; ``loop_failed`` / ``syrk_failed`` name the signal or exit status of a peer that died).

    Returns
    -------
    list of dict
        Keys ``d, rows, causal, variable_lengths, kernel, build_s, macs, token_bytes, floor_macs_s,
        floor_bytes_s, floor_s, build_vs_floor, vs_best, loop_s, speedup_vs_loop, loop_vs_floor (the most
        ``speedup_vs_loop`` a build at the floor could show), syrk_s, loop_failed, syrk_failed, rate_gflops,
        bandwidth_gbs`` (the rates this size's floor used), ``load_avg``.
    """
    from threadpoolctl import threadpool_info

    from scaleattn.features import n_features, n_pairs
    from scaleattn.statistics._container import Statistics, accumulate
    from scaleattn.statistics._kernel import KERNELS

    fixed_rate, fixed_bandwidth = rate, bandwidth

    def rates():  # (GEMM rate, bandwidth) now, or the given ones
        _settle()
        return (gemm_rate(gemm_n) if fixed_rate is None else float(fixed_rate),
                copy_bandwidth() if fixed_bandwidth is None else float(fixed_bandwidth))
    out = []
    for d, rows, causal, *var in sizes:
        rate, bandwidth = rates()
        var = bool(var and var[0])
        tokens, targets, lengths, nrows = _data(d, rows, causal, var)
        m = n_pairs(d)
        psi = n_features(d)
        macs, nbytes = nrows * (m * (m + 1) // 2) * n_pairs(d), tokens.nbytes
        peers = {}
        if loop and 2.0 * nrows * psi * psi / 2 / rate <= loop_max_s:  # in a fresh process: a crash is a result
            threads = max([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] or [1])
            peers = run_child(["-c", _PEERS_CHILD, json.dumps([d, rows, causal, var, max_phi_bytes, threads])])
        loop_s, syrk_s = peers.get("loop_s"), peers.get("syrk_s")
        failed = peers.get("failure")
        kerns = tuple(KERNELS if kernels is None else kernels)

        def build(kern):
            accumulate(Statistics.zeros(d, targets.shape[-1]), tokens, targets, lengths, causal, kernel=kern)
        for kern in kerns:  # compile / warm each kernel on two samples
            accumulate(Statistics.zeros(d, targets.shape[-1]), tokens[:2], targets[:2],
                       None if lengths is None else lengths[:2], causal, kernel=kern)
        # the kernels alternate, in reverse order every other round, so that none is always timed right after the
        # loop's threaded BLAS or after the other kernel (the machine drifts within seconds)
        # more rounds of a kernel (up to MAX_ROUNDS) while its own builds of this size took under min_time: a 30 ms
        # build is a sample of the machine's speed in that instant (one VM's one-thread DGEMM moved 39-61 GFLOP/s in
        # 30 s; d = 4's build 18-30 ms on 2 threads, back to back). Counted per kernel: counted together, a 0.4 s
        # numpy build ended the rounds of a 25 ms numba build after 2-3 samples
        best, spent, rounds = (dict.fromkeys(kerns, v) for v in (float("inf"), 0.0, 0))
        more = lambda k: rounds[k] < max(1, repeats) or (spent[k] < min_time and rounds[k] < MAX_ROUNDS)
        while any(more(k) for k in kerns):
            for kern in (kerns if max(rounds.values()) % 2 == 0 else kerns[::-1]):
                if more(kern):
                    _settle()
                    t = _best(lambda: build(kern), 1)
                    best[kern], spent[kern], rounds[kern] = min(best[kern], t), spent[kern] + t, rounds[kern] + 1
        size_rows = [{"d": d, "rows": nrows, "causal": causal, "variable_lengths": var, "kernel": kern,
                      "build_s": t, "loop_s": loop_s, "speedup_vs_loop": None if loop_s is None else loop_s / t,
                      "syrk_s": syrk_s, "macs": macs, "token_bytes": nbytes, "load_avg": os.getloadavg()[0],
                      "rounds": rounds[kern],
                      "loop_failed": failed if loop_s is None else None,  # (how the peer's process died)
                      "syrk_failed": failed if peers.get("syrk_started") and syrk_s is None else None}
                     for kern, t in best.items()]
        after = rates()
        rate, bandwidth = max(rate, after[0]), max(bandwidth, after[1])
        for r in size_rows:
            r.update(_floors(r, rate, bandwidth), rate_gflops=rate / 1e9, bandwidth_gbs=bandwidth / 1e9)
        out += size_rows
    best_rate, best_bw = (max(r[k] for r in out) for k in ("rate_gflops", "bandwidth_gbs"))
    for r in out:
        r["vs_best"] = r["build_s"] / _floors(r, best_rate * 1e9, best_bw * 1e9)["floor_s"]
    return out


def starved_probe(ratios, rates_gflops) -> str | None:
    """The warning of a run whose rate probes were starved, or None: a build / floor ratio below 1 means a build
    ran faster than its lower bound, which no build can: the GEMM probe (or the copy) ran while other load took
    the cores, so its rate, every floor computed from it and every ratio to them understate this machine (a quick
    benchmark under load printed builds at 0.37-0.43x "the floor", its probe at 7.9 GFLOP/s, without a word).

    Examples
    --------
    >>> starved_probe([1.8, 0.41], [7.9, 12.0])[:66]
    '1 of 2 builds ran below their floor (down to 0.41x): a lower bound'
    >>> starved_probe([1.8, 1.2], [50.0]) is None
    True
    """
    ratios = [r for r in ratios if r is not None]
    below = [r for r in ratios if r < 1.0]
    if not below:
        return None
    rates = [r for r in rates_gflops if r is not None]
    probe = f" ({min(rates):.1f}-{max(rates):.1f} GFLOP/s here)" if rates else ""
    return (f"{len(below)} of {len(ratios)} builds ran below their floor (down to {min(below):.2f}x): a lower bound"
            f" cannot be beaten, so the GEMM probe{probe} was starved by other load on the cores while it ran; the"
            " floors and the build / floor ratios of this run understate the machine: run the benchmark again on an"
            " idle machine")


def _ratio(value, target) -> str:
    """A build / floor ratio with its target, or, below 1 (faster than a lower bound), said to be a starved
    probe's (:func:`starved_probe`)."""
    if value is not None and value < 1.0:
        return f"{value:.2f} (below the floor: starved probe)"
    return f"{'-' if value is None else f'{value:.2f}'} ({_met(value, target, le=True)})"


def _floors(r: dict, rate: float, bandwidth: float) -> dict:
    """The multiply-add floor, the bytes floor, their max and the build's ratio to it at these rates."""
    f = {"floor_macs_s": 2.0 * r["macs"] / rate, "floor_bytes_s": r["token_bytes"] / bandwidth}
    f["floor_s"] = max(f.values())
    f["build_vs_floor"] = r["build_s"] / f["floor_s"]
    # the speed-up over the loop that a build AT the floor would show: below 3, issue 19's ">= 3x faster than
    # the loop" cannot be met in this run by any build (the loop's SYRK does 2x our multiply-adds)
    f["loop_vs_floor"] = None if r["loop_s"] is None else r["loop_s"] / f["floor_s"]
    return f


def markdown(table: list[dict]) -> str:
    """The table as markdown (times in seconds; what is timed said under it)."""
    f = lambda v, p=3: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))
    lines = ["| d | rows | rows of | kernel | build s | floor s (macs / bytes) | build / floor (target) |"
             " vs run's best rates | GEMM GF/s, copy GB/s | loop s |"
             f" vs loop (target >= {TARGET_VS_LOOP:g}) | at most (loop / floor) | SYRK s | load |", "|" + "---|" * 14]
    for r in table:
        kind = ("prefixes" if r["causal"] else "last tokens") + (", variable lengths" if r.get("variable_lengths")
                                                                 else "")
        lines.append(f"| {r['d']} | {r['rows']:,} | {kind} | {r['kernel']} | {f(r['build_s'])} |"
                     f" {f(r['floor_s'], 4)} ({f(r['floor_macs_s'], 4)} / {f(r['floor_bytes_s'], 4)}) |"
                     f" {_ratio(r['build_vs_floor'], target_vs_floor(r['d']))} |"
                     f" {f(r['vs_best'], 2)} | {r['rate_gflops']:.1f}, {r['bandwidth_gbs']:.1f} |"
                     f" {_peer(r, 'loop')} | {f(r['speedup_vs_loop'], 2)}"
                     f" ({_met(r['speedup_vs_loop'], TARGET_VS_LOOP, le=False)}) | {f(r['loop_vs_floor'], 2)} |"
                     f" {_peer(r, 'syrk')} | {r['load_avg']:.2f} |")
    if table:
        starved = starved_probe([r["build_vs_floor"] for r in table], [r["rate_gflops"] for r in table])
        if starved:
            lines.append(f"\n**Warning**: {starved}.")
        lo, hi = min(r["rate_gflops"] for r in table), max(r["rate_gflops"] for r in table)
        rounds = sorted({r["rounds"] for r in table})
        lines.append(f"\nbuild s: the best of {rounds[0]}{'' if len(rounds) == 1 else f'-{rounds[-1]}'} builds per"
                     " kernel, warm (each kernel first ran untimed on two samples of the same data); loop and SYRK:"
                     " one call each in a fresh process, after the same call on two samples.")
        lines.append(f"\nEach size's floor uses the larger of the GEMM rate and copy bandwidth measured right before"
                     f" and after its builds (GEMM {lo:.1f}-{hi:.1f} GFLOP/s in this run); 'vs run's best rates'"
                     f" divides by the floor at the fastest rates measured anywhere in the run.")
    return "\n".join(lines)


def _peer(r: dict, name: str) -> str:
    """A peer's seconds, ``crashed (SIGSEGV)`` where its process died of a signal in it, ``timed out`` /
    ``exit N`` where it ended otherwise, or '-' where it was not run."""
    failed = r.get(f"{name}_failed")
    if failed:
        return f"crashed ({failed})" if failed.startswith(("SIG", "signal")) else failed
    return "-" if r[f"{name}_s"] is None else f"{r[f'{name}_s']:.3f}"


def _met(value, target, le: bool) -> str:
    """``<= 3: met`` / ``<= 3: NO`` for a ratio against its target ('-' where there is none)."""
    if value is None or target is None:
        return "-"
    ok = value <= target if le else value >= target
    return f"{'<=' if le else '>='} {target:g}: {'met' if ok else 'NO'}"


if __name__ == "__main__":  # pragma: no cover
    import sys

    quick = "--quick" in sys.argv
    print(markdown(build_table(QUICK_SIZES if quick else SIZES, repeats=1 if quick else 2)))
