"""Benchmark (layer L5): the statistics build on a local Dask cluster against the in-process build, and where
the cluster's time goes.

Each configuration runs in a fresh process on the same Zarr dataset and row groups (the default split of
:func:`~scaleattn.distributed.partition.row_groups`, equal rows; ``split="chunks"``: one group per Zarr chunk,
the split before it):

- ``in-process, 1 thread``: :func:`scaleattn.compute_statistics` without a client, BLAS at one thread (what one
  Dask worker has, ``threads_per_worker = 1``);
- ``1 worker`` and ``2 workers``: a :class:`distributed.LocalCluster` of one-thread workers, timed after the
  workers imported scaleattn and loaded the compiled kernel (a start-up cost paid once per worker). Dask's task
  stream splits each worker's time into the partial tasks (read and accumulate a row group), the reduction
  tasks (tree of :mod:`scaleattn.distributed.reduction`), transfers of partials between workers and their
  (de)serialisation; what is left of the wall time is scheduling, the client's submission and the gather of the
  root (``overhead_s``). Per worker: its busy time, the feature rows of the groups it ran, and the imbalance
  (busiest / mean - 1: the time a worker idles while another finishes); the in-process child also times the
  reads (a chunk cut by a group bound is read by both groups) against reading every chunk once.

Ratios: ``worker_vs_in_process`` = 1-worker build / in-process build (target <= 1.05) and
``speedup_2_workers`` = 1-worker / 2-worker build (target >= 1.8), both from the same run.
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
from scaleattn.datacheck import expected_rows
from scaleattn.dataset import open_dataset
from scaleattn.distributed.build import compute_statistics
from scaleattn.distributed.partition import row_groups

def _warm():  # imports, the BLAS scan and the compiled kernel's cache load: once per worker, outside the timing
    import numpy as np
    import scaleattn.distributed.build, scaleattn.kernel  # noqa: F401
    from scaleattn.statistics import statistics_from_arrays
    scaleattn.kernel._blas_controller()
    statistics_from_arrays(np.ones((2, 3, 2)), np.ones((2, 3, 1)))

def _env():
    return {k: os.environ.get(k) for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "OPENBLAS_NUM_THREADS")}

if __name__ == "__main__":
    path, workers, split = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ds = open_dataset(path)
    gs = ds.chunk_samples if split == "chunks" else None
    groups = row_groups(ds, gs)
    rows = {(a, b): expected_rows(ds, a, b) for a, b in groups}
    common = {"groups": len(groups), "group_rows": [min(rows.values()), max(rows.values())]}
    if workers == 0:
        compute_statistics(ds, group_samples=gs, targets=True)  # warm: imports, first-touch of the buffers
        t = time.perf_counter()
        st = compute_statistics(ds, group_samples=gs)
        build = time.perf_counter() - t
        # the reads as the tasks do them (a chunk cut by a group bound is read whole by both groups) against
        # every chunk read once: what cutting chunks costs
        t = time.perf_counter()
        for a, b in groups:
            for _ in ds.read_chunks(a, b):
                pass
        read = time.perf_counter() - t
        t = time.perf_counter()
        for _ in ds.read_chunks(0, ds.n_samples):
            pass
        print(json.dumps({"build_s": build, "rows": st.n_rows, **common, "read_s": read,
                          "read_once_s": time.perf_counter() - t, "env": _env()}))
        sys.exit(0)
    from distributed import get_task_stream
    from scaleattn.distributed.cluster import connect
    with connect(workers=workers, quiet=True) as client:
        client.run(_warm)
        env = next(iter(client.run(_env).values()))
        with get_task_stream(client) as ts:
            t = time.perf_counter()
            st = compute_statistics(ds, client, group_samples=gs)
            wall = time.perf_counter() - t
    busy = collections.defaultdict(float)
    parts = collections.defaultdict(float)
    n_parts = collections.Counter()
    n_rows = collections.Counter()
    for e in ts.data:
        key = str(e["key"])
        kind = "partial" if key.startswith("stats-part") else "reduce"
        for ss in e["startstops"]:
            dt = ss["stop"] - ss["start"]
            action = ss["action"] if ss["action"] != "compute" else kind
            parts[action] += dt
            if ss["action"] == "compute":
                busy[e["worker"]] += dt
                if kind == "partial":  # key: stats-part-...-{a}-{b}-{c0}-{c1}-{source}
                    n_parts[e["worker"]] += 1
                    a, b = (int(v) for v in key.split("-")[-5:-3])
                    n_rows[e["worker"]] += rows[(a, b)]
    ws = sorted(busy)
    b = [busy[w] for w in ws]
    print(json.dumps({"build_s": wall, "rows": st.n_rows, **common, "seconds_by_kind": parts, "env": env,
                      "busy_s_per_worker": b, "partials_per_worker": [n_parts[w] for w in ws],
                      "rows_per_worker": [n_rows[w] for w in ws],
                      "imbalance": max(b) / (sum(b) / len(b)) - 1 if b else 0.0,
                      "overhead_s": wall - max(b, default=0.0)}))
"""


def _child(path: str, workers: int, split: str) -> dict:
    env = dict(os.environ)
    if workers == 0:  # one BLAS thread, as a Dask worker has
        env.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    p = subprocess.run([sys.executable, "-c", _CHILD, path, str(workers), split], capture_output=True, text=True, env=env,
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"the {workers}-worker build failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def workers_scaling(path, split: str = "rows") -> dict:
    """In-process (one BLAS thread) against 1- and 2-worker local clusters on the dataset at ``path``.

    Parameters
    ----------
    path : str
        A scaleattn dataset (Zarr).
    split : {"rows", "chunks"}
        The row groups: the default split (:func:`~scaleattn.distributed.partition.row_groups`, equal rows), or
        one group per Zarr chunk (the split before it, for comparison).

    Returns
    -------
    dict
        ``split``; ``in_process`` ({build_s, rows, groups, group_rows: [min, max], read_s: every group's reads,
        read_once_s: every chunk read once, env}), ``workers`` (a list of two dicts: workers, build_s, rows,
        groups, group_rows, seconds_by_kind: partial / reduce / transfer / deserialize..., busy_s_per_worker,
        partials_per_worker, rows_per_worker, imbalance = busiest / mean busy - 1, overhead_s, env: the
        workers' glibc and BLAS variables), ``worker_vs_in_process``, ``speedup_2_workers``, ``targets``,
        ``met``.

    Raises
    ------
    RuntimeError
        A child process failed (its stderr tail is in the message).
    """
    if split not in ("rows", "chunks"):
        raise ValueError(f"split must be 'rows' or 'chunks', got {split!r}")
    inproc = _child(path, 0, split)
    runs = [{"workers": w, **_child(path, w, split)} for w in (1, 2)]
    res = {"split": split, "in_process": inproc, "workers": runs, "targets": TARGETS,
           "worker_vs_in_process": runs[0]["build_s"] / inproc["build_s"],
           "speedup_2_workers": runs[0]["build_s"] / runs[1]["build_s"]}
    res["met"] = {"worker_vs_in_process": res["worker_vs_in_process"] <= TARGETS["worker_vs_in_process"],
                  "speedup_2_workers": res["speedup_2_workers"] >= TARGETS["speedup_2_workers"]}
    return res


def markdown(res: dict) -> list[str]:
    """The workers table of ``bench.md`` (lines)."""
    ip = res["in_process"]
    L = ["| build | s | groups (rows min-max) | partial tasks s | reduce s | transfer s | overhead s |"
         " busy per worker s | rows per worker | imbalance |",
         "|---|---|---|---|---|---|---|---|---|---|",
         f"| in process, 1 BLAS thread | {ip['build_s']:.2f} | {ip['groups']} ({ip['group_rows'][0]:,}-"
         f"{ip['group_rows'][1]:,}) | | | | | | | |"]
    for o in res["workers"]:
        k = o["seconds_by_kind"]
        L.append(f"| {o['workers']} worker(s) | {o['build_s']:.2f} | {o['groups']} | {k.get('partial', 0):.2f} |"
                 f" {k.get('reduce', 0):.3f} | {k.get('transfer', 0):.3f} | {o['overhead_s']:.2f} |"
                 f" {' / '.join(f'{b:.2f}' for b in o['busy_s_per_worker'])} |"
                 f" {' / '.join(f'{r:,}' for r in o['rows_per_worker'])} | {100 * o['imbalance']:.1f}% |")
    yn = {True: "yes", False: "NO"}
    env = res["workers"][0].get("env", {})
    one, two = (o["seconds_by_kind"].get("partial", 0.0) for o in res["workers"])
    if one > 0:  # the same tasks: what two at once cost each (cores and memory shared), whatever the split
        L += ["", f"The partial tasks of 2 workers take {100 * (two / one - 1):.0f}% longer in sum than on 1 worker"
              f" (both at once on this machine); 2-worker speed-up bound by that alone: {2 * one / two:.2f} x."]
    L += ["", f"Row groups: {res.get('split', 'rows')} split. Reading every group's rows as the tasks do (a chunk cut"
          f" by a group bound is read whole by both groups): {ip['read_s']:.3f} s, every chunk once:"
          f" {ip['read_once_s']:.3f} s. Worker environment: {env}.",
          "", f"1 worker / in process: {res['worker_vs_in_process']:.3f} (target <= {TARGETS['worker_vs_in_process']},"
          f" met: {yn[res['met']['worker_vs_in_process']]}); 1 -> 2 workers: {res['speedup_2_workers']:.2f} x"
          f" (target >= {TARGETS['speedup_2_workers']}, met: {yn[res['met']['speedup_2_workers']]})."]
    return L
