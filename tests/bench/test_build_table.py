"""scaleattn.bench.build: the build-vs-floor table has its keys and consistent ratios (tiny sizes)."""
import pytest

from scaleattn.bench.build import MAX_ROUNDS, build_table, markdown


@pytest.mark.slow
def test_build_table_keys_and_ratios():
    t = build_table([(2, 200, True), (3, 50, False), (2, 400, True, True)], rate=1e10, bandwidth=1e10, repeats=1)
    assert len(t) == 6 and {r["kernel"] for r in t} == {"numba", "numpy"}
    for r in t:
        assert r["floor_s"] == max(r["floor_macs_s"], r["floor_bytes_s"])
        assert abs(r["build_vs_floor"] - r["build_s"] / r["floor_s"]) < 1e-12
        assert r["speedup_vs_loop"] == r["loop_s"] / r["build_s"] and r["syrk_s"] is not None
        assert abs(r["loop_vs_floor"] - r["loop_s"] / r["floor_s"]) < 1e-12 * r["loop_vs_floor"]
    assert t[0]["rows"] == 200 and t[2]["rows"] == 50
    assert 4 <= t[4]["rows"] < 400 and t[4]["variable_lengths"]  # the rows are the valid prefixes only
    md = markdown(t)
    assert "| 2 | 200 | prefixes | numba |" in md and "| 3 | 50 | last tokens | numpy |" in md
    assert "prefixes, variable lengths" in md and ("<= 3: met" in md or "<= 3: NO" in md)
    # the floor from first principles: d = 2 has m = 3 pairs, u = vech(s s^T) 6 entries, v = vech(x x^T) 3
    assert t[0]["macs"] == 200 * 6 * 3 and t[0]["floor_macs_s"] == 2.0 * 200 * 18 / 1e10
    assert t[0]["token_bytes"] == 2 * 100 * 2 * 8 and t[0]["floor_bytes_s"] == 3200 / 1e10
    assert all(r["vs_best"] == r["build_vs_floor"] for r in t)  # one given rate: the run's best is the same
    assert all(r["rounds"] == MAX_ROUNDS for r in t)  # builds of microseconds: as many rounds as allowed


def test_a_fast_kernel_gets_its_own_rounds(monkeypatch):
    """Rounds are counted per kernel: a slow kernel reaching ``min_time`` does not end a fast one's sampling
    (a 0.4 s numpy build used to stop a 25 ms numba build after 2-3 samples)."""
    import time

    import scaleattn.bench.build as build
    import scaleattn.statistics._container as statistics

    calls = {"numba": 0, "numpy": 0}

    def fake(stats, tokens, *args, kernel=None, **kw):
        if tokens.shape[0] > 2:  # not the warm-up call on two samples
            calls[kernel] += 1
            time.sleep(0.25 if kernel == "numpy" else 0.001)
        return stats

    monkeypatch.setattr(statistics, "accumulate", fake)
    monkeypatch.setattr(build, "_settle", lambda *a, **k: None)
    t = build.build_table([(2, 400, True)], rate=1e10, bandwidth=1e10, repeats=1, loop=False, min_time=0.4)
    rounds = {r["kernel"]: r["rounds"] for r in t}
    assert rounds == {"numpy": 2, "numba": MAX_ROUNDS} == calls
    fast = next(r for r in t if r["kernel"] == "numba")
    assert 0.001 <= fast["build_s"] < 0.25


def test_build_table_measures_the_rates_around_each_size():
    t = build_table([(2, 200, True), (3, 50, False)], kernels=("numpy",), loop=False, repeats=1, gemm_n=300)
    for r in t:
        assert r["rate_gflops"] > 0.1 and r["bandwidth_gbs"] > 0.1
        assert abs(r["floor_macs_s"] - 2.0 * r["macs"] / (r["rate_gflops"] * 1e9)) < 1e-12 * r["floor_macs_s"]
        assert r["vs_best"] >= r["build_vs_floor"] * (1 - 1e-12)  # the best rates give the strictest floor
    assert "GEMM" in markdown(t) and "vs run's best rates" in markdown(t)


def test_a_peer_that_dies_is_a_result_not_the_end_of_the_run(monkeypatch):
    """The loop and SYRK run in a child per size: OpenBLAS's threaded SYRK with AVX-512 kernels dies with SIGSEGV
    at psi = 16,896. Here the child reports the loop, starts SYRK and is killed the same way; the table says so,
    and the builds are still timed."""
    import scaleattn.bench.build as build

    die = ("import json, os, signal; print(json.dumps({'loop_s': 0.5})); print(json.dumps({'syrk_started': True}),"
           " flush=True); os.kill(os.getpid(), signal.SIGSEGV)")
    monkeypatch.setattr(build, "_PEERS_CHILD", die)
    t = build.build_table([(2, 200, True)], rate=1e10, bandwidth=1e10, kernels=("numpy",), repeats=1)
    assert t[0]["loop_s"] == 0.5 and t[0]["syrk_s"] is None and t[0]["syrk_failed"] == "SIGSEGV"
    assert t[0]["loop_failed"] is None and t[0]["build_s"] > 0
    assert "crashed (SIGSEGV)" in build.markdown(t)
    monkeypatch.setattr(build, "_PEERS_CHILD", "import sys; sys.exit(3)")
    t = build.build_table([(2, 200, True)], rate=1e10, bandwidth=1e10, kernels=("numpy",), repeats=1)
    assert t[0]["loop_s"] is None and t[0]["loop_failed"] == "exit 3" and t[0]["syrk_failed"] is None
    assert "| exit 3 |" in build.markdown(t) and "crashed" not in build.markdown(t)


def test_the_peers_child_reports_the_loop_and_syrk():
    """The child times the loop and SYRK on the table's data and reports them as JSON lines (run_child)."""
    import json

    import scaleattn.bench.build as build

    r = build.run_child(["-c", build._PEERS_CHILD, json.dumps([3, 300, True, True, 2e9, 1])])
    assert r["returncode"] == 0 and r["loop_s"] > 0 and r["syrk_s"] > 0 and not r["crashed"] and r["failure"] is None


def test_run_child_names_every_way_a_child_can_end():
    """A real-time signal has no name, a timeout no exit code; a child's JSON cannot overwrite how it ended."""
    import scaleattn.bench.build as build

    r = build.run_child(["-c", "import json, os; print(json.dumps({'returncode': 0, 'x': 1}), flush=True);"
                               " os.kill(os.getpid(), 40)"])
    assert r["x"] == 1 and r["returncode"] == -40 and r["crashed"] and r["failure"] == r["signal"] == "signal 40"
    r = build.run_child(["-c", "import time; time.sleep(5)"], timeout=0.5)
    assert r["returncode"] is None and r["timed_out"] and r["failure"] == "timed out" and not r["crashed"]
