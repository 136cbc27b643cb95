"""scaleattn.bench.build: the build-vs-floor table has its keys and consistent ratios (tiny sizes)."""
from scaleattn.bench.build import build_table, markdown


def test_build_table_keys_and_ratios():
    t = build_table([(2, 200, True), (3, 50, False), (2, 400, True, True)], rate=1e10, bandwidth=1e10, repeats=1)
    assert len(t) == 6 and {r["kernel"] for r in t} == {"numba", "numpy"}
    for r in t:
        assert r["floor_s"] == max(r["floor_macs_s"], r["floor_bytes_s"])
        assert abs(r["build_vs_floor"] - r["build_s"] / r["floor_s"]) < 1e-12
        assert r["speedup_vs_loop"] == r["loop_s"] / r["build_s"] and r["syrk_s"] is not None
    assert t[0]["rows"] == 200 and t[2]["rows"] == 50
    assert 4 <= t[4]["rows"] < 400 and t[4]["variable_lengths"]  # the rows are the valid prefixes only
    md = markdown(t)
    assert "| 2 | 200 | prefixes | numba |" in md and "| 3 | 50 | last tokens | numpy |" in md
    assert "prefixes, variable lengths" in md and ("<= 3: met" in md or "<= 3: NO" in md)
