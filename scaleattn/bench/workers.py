"""Benchmark (layer L5): the statistics build on a local Dask cluster against the in-process build, and where
the cluster's time goes.

Each configuration runs in a fresh process on the same Zarr dataset and row groups (one Zarr chunk each):

- ``in-process, 1 thread``: :func:`scaleattn.compute_statistics` without a client, BLAS at one thread (what one
  Dask worker has, ``threads_per_worker = 1``);
- ``1 worker`` and ``2 workers``: a :class:`distributed.LocalCluster` of one-thread workers, timed after the
  workers imported scaleattn and loaded the compiled kernel (a start-up cost paid once per worker). Dask's task stream splits each worker's time into the partial tasks (read and
  accumulate a row group), the reduction tasks (tree of :mod:`scaleattn.distributed.reduction`), transfers of
  partials between workers and their (de)serialisation; what is left of the wall time is scheduling, the
  client's submission and the gather of the root (``overhead_s``).

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
import collections, json, sys, time
from scaleattn.dataset import open_dataset
from scaleattn.distributed.build import compute_statistics

def _warm():  # imports, the BLAS scan and the compiled kernel's cache load: once per worker, outside the timing
    import numpy as np
    import scaleattn.distributed.build, scaleattn.kernel  # noqa: F401
    from scaleattn.statistics import statistics_from_arrays
    scaleattn.kernel._blas_controller()
    statistics_from_arrays(np.ones((2, 3, 2)), np.ones((2, 3, 1)))

if __name__ == "__main__":
    path, workers = sys.argv[1], int(sys.argv[2])
    ds = open_dataset(path)
    g = ds.chunk_samples
    if workers == 0:
        compute_statistics(ds, group_samples=g, targets=True)  # warm: imports, first-touch of the buffers
        t = time.perf_counter()
        st = compute_statistics(ds, group_samples=g)
        print(json.dumps({"build_s": time.perf_counter() - t, "rows": st.n_rows}))
        sys.exit(0)
    from distributed import get_task_stream
    from scaleattn.distributed.cluster import connect
    with connect(workers=workers, quiet=True) as client:
        client.run(_warm)
        with get_task_stream(client) as ts:
            t = time.perf_counter()
            st = compute_statistics(ds, client, group_samples=g)
            wall = time.perf_counter() - t
    busy = collections.defaultdict(float)
    parts = collections.defaultdict(float)
    n_parts = collections.Counter()
    for e in ts.data:
        kind = "partial" if str(e["key"]).startswith("stats-part") else "reduce"
        for ss in e["startstops"]:
            dt = ss["stop"] - ss["start"]
            action = ss["action"] if ss["action"] != "compute" else kind
            parts[action] += dt
            if ss["action"] == "compute":
                busy[e["worker"]] += dt
                n_parts[e["worker"]] += kind == "partial"
    print(json.dumps({"build_s": wall, "rows": st.n_rows, "seconds_by_kind": parts,
                      "busy_s_per_worker": sorted(busy.values()), "partials_per_worker": sorted(n_parts.values()),
                      "overhead_s": wall - max(busy.values(), default=0.0)}))
"""


def _child(path: str, workers: int) -> dict:
    env = dict(os.environ)
    if workers == 0:  # one BLAS thread, as a Dask worker has
        env.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    p = subprocess.run([sys.executable, "-c", _CHILD, path, str(workers)], capture_output=True, text=True, env=env,
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"the {workers}-worker build failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def workers_scaling(path) -> dict:
    """In-process (one BLAS thread) against 1- and 2-worker local clusters on the dataset at ``path``.

    Parameters
    ----------
    path : str
        A scaleattn dataset (Zarr); its chunks are the row groups.

    Returns
    -------
    dict
        ``in_process`` ({build_s, rows}), ``workers`` (a list of two dicts: workers, build_s, rows,
        seconds_by_kind: partial / reduce / transfer / deserialize..., busy_s_per_worker, partials_per_worker,
        overhead_s), ``worker_vs_in_process``, ``speedup_2_workers``, ``targets``, ``met``.

    Raises
    ------
    RuntimeError
        A child process failed (its stderr tail is in the message).
    """
    inproc = _child(path, 0)
    runs = [{"workers": w, **_child(path, w)} for w in (1, 2)]
    res = {"in_process": inproc, "workers": runs, "targets": TARGETS,
           "worker_vs_in_process": runs[0]["build_s"] / inproc["build_s"],
           "speedup_2_workers": runs[0]["build_s"] / runs[1]["build_s"]}
    res["met"] = {"worker_vs_in_process": res["worker_vs_in_process"] <= TARGETS["worker_vs_in_process"],
                  "speedup_2_workers": res["speedup_2_workers"] >= TARGETS["speedup_2_workers"]}
    return res


def markdown(res: dict) -> list[str]:
    """The workers table of ``bench.md`` (lines)."""
    ip = res["in_process"]
    L = ["| build | s | partial tasks s | reduce s | transfer s | overhead s | busy per worker s | partials per worker |",
         "|---|---|---|---|---|---|---|---|",
         f"| in process, 1 BLAS thread | {ip['build_s']:.2f} | | | | | | |"]
    for o in res["workers"]:
        k = o["seconds_by_kind"]
        L.append(f"| {o['workers']} worker(s) | {o['build_s']:.2f} | {k.get('partial', 0):.2f} | {k.get('reduce', 0):.3f} |"
                 f" {k.get('transfer', 0):.3f} | {o['overhead_s']:.2f} |"
                 f" {' / '.join(f'{b:.2f}' for b in o['busy_s_per_worker'])} |"
                 f" {' / '.join(map(str, o['partials_per_worker']))} |")
    yn = {True: "yes", False: "NO"}
    L += ["", f"1 worker / in process: {res['worker_vs_in_process']:.3f} (target <= {TARGETS['worker_vs_in_process']},"
          f" met: {yn[res['met']['worker_vs_in_process']]}); 1 -> 2 workers: {res['speedup_2_workers']:.2f} x"
          f" (target >= {TARGETS['speedup_2_workers']}, met: {yn[res['met']['speedup_2_workers']]})."]
    return L
