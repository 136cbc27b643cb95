"""The AdamW benchmark on a Zarr dataset: our fit reaches the float64 floor, the JSON and markdown are written."""
import json

import pytest

torch = pytest.importorskip("torch")

from scaleattn.data._writer import write_dataset  # noqa: E402
from scaleattn.generate import make_mhla  # noqa: E402


def test_bench_adamw_on_a_dataset(tmp_path):
    from scaleattn.bench.adamw import run

    D = make_mhla(2, 1, 10, 40, causal=True, seed=6)
    url = str(tmp_path / "d.zarr")
    write_dataset(url, D["tokens"], D["targets"])
    res = run(tmp_path / "out", dataset=url, heads=2, epochs=2)
    row = res["rows"][0]
    assert row["N"] == 32 and row["ours"]["train_mse"] < 1e-25
    assert all(t["ours_s"] is not None for t in row["time_to_mse"])
    assert json.loads((tmp_path / "out" / "adamw.json").read_text())["rows"][0]["epochs"] == 2
    assert "AdamW" in (tmp_path / "out" / "adamw.md").read_text()
