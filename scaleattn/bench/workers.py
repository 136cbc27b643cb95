"""Benchmark: the statistics build on a local Dask cluster against the in-process build, and where
the cluster's time goes.

Each configuration runs in a fresh process on the same Zarr dataset and row groups (the default split of
:func:`~scaleattn.distributed.partition.row_groups`, equal rows; ``split="chunks"``: one group per Zarr chunk,
the split before it), builds once untimed (imports, the compiled kernel's cache, the store opened and its identity
checked in every process, first-touch of the buffers: the in-process child and every worker alike), then times
the same build; ``rounds`` rounds of the three configurations are interleaved and the fastest of each is kept, so
that the VM's drift hits them alike:

- ``in-process, 1 thread``: :func:`scaleattn.compute_statistics` without a client, BLAS at one thread (what one
  Dask worker has, ``threads_per_worker = 1``: its nanny sets the BLAS variables to 1), so the kernel runs one
  thread too (its thread count is the BLAS one); both sides record their kernel and BLAS thread counts;
- ``1 worker`` and ``2 workers``: a :class:`distributed.LocalCluster` of one-thread workers. Dask's task
  stream splits each worker's time into the partial tasks (read and accumulate a row group), the reduction
  tasks (tree of :mod:`scaleattn.distributed.reduction`), transfers of partials between workers and their
  (de)serialisation; what is left of the wall time (``overhead_s`` = wall - busiest worker) is split into the
  time before the first task starts, each worker's idle time between its tasks (waiting for a transfer or for
  work), the time from the last partial to the root (the reduction's tail) and from the root to the client's
  return (gather, the end-of-build checks). Per worker: its busy time, the feature rows of the groups it ran,
  and the imbalance (busiest / mean - 1: the time a worker idles while another finishes); the in-process child
  also times the reads as the tasks do them (a chunk cut by group bounds read and checked once per process and
  build), as they did before (read by every group it is in) and every chunk read once; the workers count the cut
  chunks they kept (hits) and read. CPU beside the tasks (``cpu_s``): the client process's CPU time (scheduler,
  nannies, client) plus each worker's beyond its task thread (event loop: heartbeats, profiler, memory checks,
  messages), which, where every core runs a worker, the tasks wait for: ``tasks_waited`` = the tasks' busy time
  minus their threads' CPU time.

Ratios: ``worker_vs_in_process`` = 1-worker build / in-process build (target <= 1.05) and
``speedup_2_workers`` = 1-worker / 2-worker build (target >= 1.8), both from the fastest builds of one run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["workers_scaling", "TARGETS"]

TARGETS = {"worker_vs_in_process": 1.05, "speedup_2_workers": 1.8}

_CHILD = r"""
import collections, json, os, sys, time
from scaleattn.data._checks import expected_rows
from scaleattn.data._dataset import open_dataset
from scaleattn.distributed.build import compute_statistics
from scaleattn.distributed.partition import row_groups

def _warm():  # imports, the BLAS scan and the compiled kernel's cache load: once per worker, outside the timing
    import numpy as np
    import scaleattn.distributed.build, scaleattn.statistics._kernel  # noqa: F401
    from scaleattn.statistics._container import statistics_from_arrays
    scaleattn.statistics._kernel._blas_controller()
    statistics_from_arrays(np.ones((2, 3, 2)), np.ones((2, 3, 1)))

def _env():  # what decides a build's speed in this process: glibc and BLAS variables, the threads it runs on
    import scaleattn.statistics._kernel as k
    out = {v: os.environ.get(v) for v in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "OPENBLAS_NUM_THREADS")}
    blas = [int(c.num_threads) for c in k._blas_controller().lib_controllers]
    return {**out, "kernel_threads": k._blas_threads(), "blas_threads": blas}

def _cpu():  # CPU seconds of this process and of its Dask task threads (None where a thread's clock is unreadable)
    import threading
    tasks = 0.0
    for t in threading.enumerate():
        if "Dask-Default-Threads" in t.name:  # the worker's executor ("0-Dask-Default-Threads-<pid>-0")
            try:  # the thread's own CPU clock, in ns: /proc's 10 ms ticks read a few-ms build's tasks as 0
                tasks += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (AttributeError, OSError, TypeError):
                return time.process_time(), None
    return time.process_time(), tasks

def _one_clock():  # every process of a LocalCluster reads the same clock, but Dask adds to a worker's task start /
    # stop its estimate of the worker's offset from the scheduler (its last heartbeat's reply time minus the
    # round trip's middle: tens of ms either way on a loaded machine), which would shift the tasks against the
    # client's t0 / t1 and make the waits negative; pinned to 0 here, the task stream is on the client's clock
    from distributed import Worker
    Worker.scheduler_delay = property(lambda self: 0.0, lambda self, value: None)

def _kept():  # look-ups of this process's cut chunks (hits: reads saved)
    from scaleattn.data._dataset import CUT_CHUNKS
    return CUT_CHUNKS.hits, CUT_CHUNKS.misses

def _stream(ts, t0, t1, rows):
    busy, parts, n_parts, n_rows = (collections.defaultdict(float), collections.defaultdict(float),
                                    collections.Counter(), collections.Counter())
    span, leaf_end, last_end, first = {}, 0.0, t0, t1
    for e in ts:
        key = str(e["key"])
        kind = "partial" if key.startswith("stats-part") else "reduce"
        w = e["worker"]
        for ss in e["startstops"]:
            dt = ss["stop"] - ss["start"]
            action = ss["action"] if ss["action"] != "compute" else kind
            parts[action] += dt
            lo, hi = span.get(w, (ss["start"], ss["stop"]))
            span[w] = (min(lo, ss["start"]), max(hi, ss["stop"]))
            first, last_end = min(first, ss["start"]), max(last_end, ss["stop"])
            if ss["action"] == "compute":
                busy[w] += dt
                if kind == "partial":  # key: stats-part-...-{a}-{b}-{c0}-{c1}-{source}
                    leaf_end = max(leaf_end, ss["stop"])
                    n_parts[w] += 1
                    a, b = (int(v) for v in key.split("-")[-5:-3])
                    n_rows[w] += rows[(a, b)]
    ws = sorted(busy)
    b = [busy[w] for w in ws]
    # the wall time no worker computes: before the first task, idle between a worker's tasks (waiting for a
    # transfer or for work), the reduction after the last partial, the gather and checks after the root
    return {"seconds_by_kind": parts, "busy_s_per_worker": b, "partials_per_worker": [n_parts[w] for w in ws],
            "rows_per_worker": [n_rows[w] for w in ws], "imbalance": max(b) / (sum(b) / len(b)) - 1 if b else 0.0,
            "overhead_s": (t1 - t0) - max(b, default=0.0),
            "waits_s": {"start": first - t0, "idle_per_worker": [span[w][1] - span[w][0] - busy[w] for w in ws],
                        "after_last_partial": last_end - leaf_end, "finish": t1 - last_end}}

if __name__ == "__main__":
    path, workers, split, repeats = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    ds = open_dataset(path)
    gs = ds.chunk_samples if split == "chunks" else None
    groups = row_groups(ds, gs)
    rows = {(a, b): expected_rows(ds, a, b) for a, b in groups}
    common = {"groups": len(groups), "group_rows": [min(rows.values()), max(rows.values())]}
    if workers == 0:
        # warm as the workers are (a whole build first: imports, kernel cache, zarr opened, identity checked,
        # first-touch of the buffers), then the same build timed ``repeats`` times
        compute_statistics(ds, group_samples=gs)
        times, cpu = [], []
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            st = compute_statistics(ds, group_samples=gs)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        # what cutting chunks costs: the reads as the tasks do them (a chunk cut by a group bound read and checked
        # once, kept for the next group), as they did before (read whole by every group it is in), every chunk once
        reads = {}
        for name, ranges, reuse in (("read_s", groups, "bench"), ("read_every_group_s", groups, None),
                                    ("read_once_s", [(0, ds.n_samples)], None)):
            t = time.perf_counter()
            for a, b in ranges:
                for _ in ds.read_chunks(a, b, reuse=reuse):
                    pass
            reads[name] = time.perf_counter() - t
        print(json.dumps({"build_s": min(times), "builds_s": times, "cpu_s": cpu[times.index(min(times))],
                          "rows": st.n_rows, **common, **reads,
                          "env": _env()}))
        sys.exit(0)
    from distributed import get_task_stream
    from scaleattn.distributed.cluster import connect
    with connect(workers=workers, quiet=True) as client:
        client.run(_warm)
        client.run(_one_clock)
        env = next(iter(client.run(_env).values()))
        compute_statistics(ds, client, group_samples=gs)  # warm, as in process (zarr opened on every worker...)
        runs = []
        for _ in range(repeats):
            before, cpu0 = client.run(_kept), client.run(_cpu)
            with get_task_stream(client) as ts:
                t0, c0 = time.time(), time.process_time()
                st = compute_statistics(ds, client, group_samples=gs)
                t1, c1 = time.time(), time.process_time()
            after, cpu1 = client.run(_kept), client.run(_cpu)
            kept = [[x - y for x, y in zip(after[w], before[w])] for w in sorted(after)]
            # CPU beside the tasks: the client's process (scheduler, nannies, client) and each worker's beyond
            # its task thread (its event loop: heartbeats, profiler, memory checks, messages); ``tasks_waited``:
            # the tasks' busy time not on a core (other threads and processes had it)
            s = _stream(ts.data, t0, t1, rows)
            ws = sorted(cpu1)
            wcpu = [cpu1[w][0] - cpu0[w][0] for w in ws]
            tcpu = None if any(cpu1[w][1] is None for w in ws) else [cpu1[w][1] - cpu0[w][1] for w in ws]
            cpu = {"client_process": c1 - c0, "workers": wcpu, "task_threads": tcpu, "beside_tasks": None,
                   "tasks_waited": None}
            if tcpu is not None:
                cpu.update(beside_tasks=c1 - c0 + sum(wcpu) - sum(tcpu),
                           tasks_waited=sum(s["busy_s_per_worker"]) - sum(tcpu))
            runs.append({"build_s": t1 - t0, **s, "cpu_s": cpu,
                         "cut_chunk_hits_misses": [sum(k[0] for k in kept), sum(k[1] for k in kept)]})
    best = min(runs, key=lambda r: r["build_s"])
    print(json.dumps({**best, "builds_s": [r["build_s"] for r in runs], "rows": st.n_rows, **common, "env": env}))
"""


def _child(path: str, workers: int, split: str, repeats: int = 1) -> dict:
    env = dict(os.environ)
    if workers == 0:  # one BLAS thread, as a Dask worker has (its nanny sets these three)
        env.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    p = subprocess.run([sys.executable, "-c", _CHILD, path, str(workers), split, str(repeats)], capture_output=True,
                       text=True, env=env, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"the {workers}-worker build failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def workers_scaling(path, split: str = "rows", rounds: int = 2) -> dict:
    """In-process (one BLAS thread) against 1- and 2-worker local clusters on the dataset at ``path``, each
    warmed by a whole build, interleaved over ``rounds`` rounds of fresh processes, the best of each kept.

    Parameters
    ----------
    path : str
        A scaleattn dataset (Zarr).
    split : {"rows", "chunks"}
        The row groups: the default split (:func:`~scaleattn.distributed.partition.row_groups`, equal rows), or
        one group per Zarr chunk (the split before it, for comparison).
    rounds : int
        Rounds of (in process, 1 worker, 2 workers), each configuration in a fresh process that first builds
        once untimed; the fastest build of each configuration is reported (``builds_s``: all of them, in
        round order), so that the VM's drift hits all three alike and the ratios compare best with best.

    Returns
    -------
    dict
        ``split``, ``rounds``; ``in_process`` ({build_s, builds_s, rows, groups, group_rows: [min, max], read_s:
        every group's reads, read_once_s: every chunk read once, env}), ``workers`` (a list of two dicts:
        workers, build_s, builds_s, rows, groups, group_rows, seconds_by_kind: partial / reduce / transfer /
        deserialize..., busy_s_per_worker, partials_per_worker, rows_per_worker, imbalance = busiest / mean
        busy - 1, overhead_s = wall - busiest, waits_s: {start, idle_per_worker, after_last_partial, finish},
        env: the workers' glibc and BLAS variables and their kernel / BLAS thread counts), all of the fastest
        build, and ``cpu_s`` ({client_process, workers, task_threads: CPU s per worker, beside_tasks, tasks_waited};
        None where a thread's CPU clock is unreadable; in process: its CPU seconds);
        ``worker_vs_in_process``, ``speedup_2_workers``, ``targets``, ``met``.

    Raises
    ------
    RuntimeError
        A child process failed (its stderr tail is in the message).
    ValueError
        An unknown ``split``, or ``rounds`` below 1.
    """
    if split not in ("rows", "chunks"):
        raise ValueError(f"split must be 'rows' or 'chunks', got {split!r}")
    if int(rounds) < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    got: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for _ in range(int(rounds)):
        for w in got:
            got[w].append(_child(path, w, split))
    best = {w: {**min(rs, key=lambda r: r["build_s"]), "builds_s": [r["build_s"] for r in rs]}
            for w, rs in got.items()}
    inproc, runs = best[0], [{"workers": w, **best[w]} for w in (1, 2)]
    res = {"split": split, "rounds": int(rounds), "in_process": inproc, "workers": runs, "targets": TARGETS,
           "worker_vs_in_process": runs[0]["build_s"] / inproc["build_s"],
           "speedup_2_workers": runs[0]["build_s"] / runs[1]["build_s"]}
    res["met"] = {"worker_vs_in_process": res["worker_vs_in_process"] <= TARGETS["worker_vs_in_process"],
                  "speedup_2_workers": res["speedup_2_workers"] >= TARGETS["speedup_2_workers"]}
    return res


def markdown(res: dict) -> list[str]:
    """The workers table of ``bench.md`` (lines)."""
    ip = res["in_process"]

    def runs(o):
        return " / ".join(f"{t:.2f}" for t in o.get("builds_s", [o["build_s"]]))

    L = ["| build | best s | all s | groups (rows min-max) | partial tasks s | reduce s | transfer s | overhead s |"
         " start / idle / after last partial / finish s | busy per worker s | rows per worker | imbalance |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|",
         f"| in process, 1 BLAS thread | {ip['build_s']:.2f} | {runs(ip)} | {ip['groups']} ({ip['group_rows'][0]:,}-"
         f"{ip['group_rows'][1]:,}) | | | | | | | | |"]
    for o in res["workers"]:
        k, w = o["seconds_by_kind"], o.get("waits_s", {})
        waits = (f"{w['start']:.2f} / {' + '.join(f'{x:.2f}' for x in w['idle_per_worker'])} /"
                 f" {w['after_last_partial']:.2f} / {w['finish']:.2f}" if w else "")
        L.append(f"| {o['workers']} worker(s) | {o['build_s']:.2f} | {runs(o)} | {o['groups']} |"
                 f" {k.get('partial', 0):.2f} | {k.get('reduce', 0):.3f} | {k.get('transfer', 0):.3f} |"
                 f" {o['overhead_s']:.2f} | {waits} | {' / '.join(f'{b:.2f}' for b in o['busy_s_per_worker'])} |"
                 f" {' / '.join(f'{r:,}' for r in o['rows_per_worker'])} | {100 * o['imbalance']:.1f}% |")
    yn = {True: "yes", False: "NO"}
    env = res["workers"][0].get("env", {})
    one, two = (o["seconds_by_kind"].get("partial", 0.0) for o in res["workers"])
    if one > 0:  # the same tasks: what two at once cost each (cores and memory shared), whatever the split
        L += ["", f"The partial tasks of 2 workers take {100 * (two / one - 1):.0f}% longer in sum than on 1 worker"
              f" (both at once on this machine); 2-worker speed-up bound by that alone: {2 * one / two:.2f} x."]
    if all((o.get("cpu_s") or {}).get("beside_tasks") is not None for o in res["workers"]):
        L += ["", "CPU beside the tasks (the client's process: scheduler, nannies, client; each worker beyond its task"
              " thread) / the tasks' busy time not on a core: " + "; ".join(
                  f"{o['workers']} worker(s) {o['cpu_s']['beside_tasks']:.2f} s (client's process"
                  f" {o['cpu_s']['client_process']:.2f} s) / {o['cpu_s']['tasks_waited']:.2f} s of"
                  f" {sum(o['busy_s_per_worker']):.2f} s" for o in res["workers"])
              + (f"; in process {ip['cpu_s']:.2f} s of CPU for its {ip['build_s']:.2f} s build." if "cpu_s" in ip else ".")]
    L += ["", f"Best of {res.get('rounds', 1)} interleaved rounds, each build in a fresh process after one untimed"
          f" build. Threads: in process {ip.get('env', {}).get('kernel_threads', '?')} kernel /"
          f" {ip.get('env', {}).get('blas_threads', '?')} BLAS, a worker {env.get('kernel_threads', '?')} /"
          f" {env.get('blas_threads', '?')}.",
          "", f"Row groups: {res.get('split', 'rows')} split. Reading every group's rows in process as the tasks do"
          f" (a chunk cut by a group bound read and checked once, kept for the next group): {ip['read_s']:.3f} s;"
          f" read whole by every group it is in: {ip.get('read_every_group_s', float('nan')):.3f} s; every chunk"
          f" once: {ip['read_once_s']:.3f} s. Cut chunks kept / read by the workers (hits / misses): "
          + ", ".join(f"{o['workers']}: {' / '.join(map(str, o.get('cut_chunk_hits_misses', [])))}"
                      for o in res["workers"]) + f". Worker environment: {env}.",
          "", f"1 worker / in process: {res['worker_vs_in_process']:.3f} (target <= {TARGETS['worker_vs_in_process']},"
          f" met: {yn[res['met']['worker_vs_in_process']]}); 1 -> 2 workers: {res['speedup_2_workers']:.2f} x"
          f" (target >= {TARGETS['speedup_2_workers']}, met: {yn[res['met']['speedup_2_workers']]})."]
    return L
