"""The core and krylov benchmarks' parts run at tiny sizes and measure what they say (a stale name inside a
benchmark used to surface only when a user ran ``scaleattn bench``)."""
import numpy as np
import pytest

from scaleattn.bench import core, krylov, workers


def test_core_comparison_tiny():
    r = core.core_comparison(3, 30, 8, rate=core.gemm_rate(200))
    assert r["rows"] == 240 and r["build_s"] > 0 and r["floor_s"] > 0
    for name in ("ours", "numpy_lstsq", "dask_tsqr"):  # realizable data: every method fits it to round-off
        assert r[f"{name}_rel_residual"] < 1e-8, name


def test_d_scaling_tiny():
    out = core.d_scaling([(3, 30, 8, True)], rate=core.gemm_rate(200))
    assert out[0]["d"] == 3 and out[0]["build_s"] > 0 and out[0]["solve_s"] > 0


@pytest.fixture
def first_calls_compile(monkeypatch):
    """A clock that all but stands still except in the first call of each path (of the build with and without targets,
    of the solve), which takes 1000 "seconds", as a first compile does: a timed figure >= 1000 timed one."""
    import types

    import scaleattn.linalg._solver as solver
    import scaleattn.statistics._container as statistics

    clock, seen = [0.0], set()

    def first_is_slow(fn, key):
        def wrapped(*a, **k):
            path = key(*a, **k)
            if path not in seen:
                seen.add(path)
                clock[0] += 1000.0
            return fn(*a, **k)
        return wrapped
    def perf_counter():  # a microsecond per reading (ratios of times stay finite)
        clock[0] += 1e-6
        return clock[0]
    monkeypatch.setattr(core, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(statistics, "statistics_from_arrays", first_is_slow(
        statistics.statistics_from_arrays, lambda tok, targets=None, *a, **k: ("build", targets is None)))
    monkeypatch.setattr(solver, "solve", first_is_slow(solver.solve, lambda *a, **k: "solve"))
    return seen


def test_no_timed_figure_is_a_first_call(first_calls_compile):
    out = core.d_scaling([(3, 30, 8, True)], rate=1e9)
    assert out[0]["build_s"] < 1000 and out[0]["solve_s"] < 1000
    r = core.core_comparison(3, 30, 8, rate=1e9, baselines=False)
    assert r["build_s"] < 1000 and r["gram_build_s"] < 1000 and r["solve_s"] < 1000
    assert first_calls_compile == {("build", False), ("build", True), "solve"}


@pytest.mark.slow
def test_workers_scaling_tiny(tmp_path):
    from scaleattn.generate import generate_mhla

    ds = generate_mhla(str(tmp_path / "d.zarr"), d=3, heads=1, length=8, samples=32, causal=True, seed=0,
                      chunk_samples=8)
    r = workers.workers_scaling(ds.url, rounds=2)
    assert [o["workers"] for o in r["workers"]] == [1, 2] and r["rounds"] == 2
    for o in (r["in_process"], *r["workers"]):  # the fastest of the rounds, every build warm and on one thread
        assert len(o["builds_s"]) == 2 and o["build_s"] == min(o["builds_s"])
        assert o["env"]["kernel_threads"] == 1 and set(o["env"]["blas_threads"]) == {1}
    assert r["in_process"]["rows"] == 256 and all(o["rows"] == 256 for o in r["workers"])
    two = r["workers"][1]
    assert two["seconds_by_kind"]["partial"] > 0 and len(two["busy_s_per_worker"]) <= 2
    assert sum(two["partials_per_worker"]) == two["groups"] == 16  # one partial per row group (equal rows)
    assert sum(two["rows_per_worker"]) == 256 and two["group_rows"] == [16, 16] and two["imbalance"] >= 0
    w = two["waits_s"]  # the wall time no worker computes, in parts: all of it within the build's wall time
    assert min(w["start"], w["after_last_partial"], w["finish"], *w["idle_per_worker"]) >= 0
    assert w["start"] + w["after_last_partial"] + w["finish"] <= two["build_s"]
    assert r["in_process"]["read_s"] > 0 and r["in_process"]["read_once_s"] > 0
    assert r["in_process"]["read_every_group_s"] > 0
    for o in r["workers"]:  # the cluster's own CPU: every process and task thread measured, per worker one figure
        c = o["cpu_s"]
        assert c["client_process"] > 0 and len(c["workers"]) == len(c["task_threads"]) == o["workers"]
        assert all(w >= t >= 0 for w, t in zip(c["workers"], c["task_threads"]))
        # (on a loaded machine one of two workers may get no partial; read from the threads' own ns clocks, the
        # few ms the other spent are never 0 — CI once read them from /proc's 10 ms ticks as 0)
        assert sum(c["task_threads"]) > 0
        assert c["beside_tasks"] == pytest.approx(c["client_process"] + sum(c["workers"]) - sum(c["task_threads"]))
        assert c["tasks_waited"] == pytest.approx(sum(o["busy_s_per_worker"]) - sum(c["task_threads"]))
    assert r["in_process"]["cpu_s"] > 0
    # 16 groups of 2 samples in 4 chunks of 8: every group reads one cut chunk, each process reads it once
    assert r["workers"][0]["cut_chunk_hits_misses"] == [12, 4]
    hits, misses = two["cut_chunk_hits_misses"]  # (a stolen task may read a chunk once more)
    assert hits + misses == 16 and misses >= 4
    old = workers.workers_scaling(ds.url, split="chunks", rounds=1)
    assert old["workers"][1]["groups"] == sum(old["workers"][1]["partials_per_worker"]) == 4  # one per chunk
    assert r["speedup_2_workers"] == pytest.approx(r["workers"][0]["build_s"] / two["build_s"])
    md = "\n".join(workers.markdown(r))
    assert "| 2 worker(s) |" in md and "CPU beside the tasks" in md


@pytest.mark.slow
def test_krylov_whole_fit_tiny(tmp_path):
    r = krylov.whole_fit(str(tmp_path), 3, 40, length=10)
    assert r["report"]["verdict"] == "identifiable" and r["coef_rel_err_vs_teacher"] < 1e-8
    assert r["peak_rss_bytes"] > r["compact_gram_bytes"] and np.isfinite(r["peak_vs_tc_plus_block"])


def test_krylov_operator_products_tiny():
    import scaleattn.statistics._kernel as kernel

    saved = kernel.KERNEL
    r = krylov.operator_products(4, ks=(1, 3), repeats=1)
    assert kernel.KERNEL == saved  # the switch is restored
    for key in ("numpy_k1", "numba_k1", "numpy_k3", "numba_k3"):
        k = int(key[-1])
        assert r[key]["best_s"] > 0 and r[key]["gmacs"] == pytest.approx(r["psi"] ** 2 * k / r[key]["best_s"] / 1e9)
    md = krylov.markdown({"quick": True, "machine": {"cores": 2, "memory_gib": 1.0, "load_avg": (0.0,)},
                          "load_avg_end": (0.0,), "seconds": 1.0, "products": [r]})
    assert "| 4 | 40 | 3 |" in md
