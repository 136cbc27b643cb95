"""Timings that do not mislead: a build faster than its floor (a lower bound) is said to come from a starved GEMM
probe, in the table and in a warning, never printed as if the bound were beaten."""

import pytest

from scaleattn.bench import build, core


@pytest.mark.slow
def test_builds_below_their_floor_are_said_to_be_a_starved_probe():
    sizes = [(2, 200, True), (3, 50, False)]
    starved = build.build_table(sizes, rate=1e5, bandwidth=1e5, repeats=1, loop=False)  # a probe 1e5x too slow
    assert all(r["build_vs_floor"] < 1 for r in starved)
    md = build.markdown(starved)
    assert md.count("below the floor: starved probe") == len(starved) and "**Warning**: 4 of 4 builds ran below" in md
    assert "GEMM probe (0.0-0.0 GFLOP/s here) was starved" in md
    honest = build.build_table(sizes, rate=1e15, bandwidth=1e15, repeats=1, loop=False)
    assert all(r["build_vs_floor"] > 1 for r in honest)
    assert "starved" not in build.markdown(honest) and "Warning" not in build.markdown(honest)


def test_core_run_warns_when_any_ratio_is_below_one():
    res = {"core": {"build_vs_floor": 1.7}, "build_table": [{"build_vs_floor": 0.41, "rate_gflops": 7.9}],
           "d_scaling": [{"build_vs_floor": 2.0}], "gemm_gflops": 7.9, "gemm_gflops_end": 9.0}
    said = core._starved(res)
    assert said.startswith("1 of 3 builds ran below their floor (down to 0.41x)") and "7.9-9.0 GFLOP/s" in said
    res["build_table"][0]["build_vs_floor"] = 1.1
    assert core._starved(res) is None



def test_quick_help_says_what_was_measured(cli):
    import re

    from scaleattn.bench import QUICK_HELP

    text = re.sub(r"\s+", " ", cli("bench", "--help").stdout)
    assert QUICK_HELP in text and "about 2 minutes" not in text
    assert re.search(r"core: \d+ minutes measured on 2 cores", QUICK_HELP)
