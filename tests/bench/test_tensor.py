"""The tensor-attention benchmark runs end to end at a tiny size and writes its JSON and markdown."""
import json


def test_bench_tiny(tmp_path):
    from scaleattn.bench import tensor as bench

    res = bench.run(tmp_path, quick=True, _tiny=True)
    for key in ("timing", "fit", "crossover", "error_vs_degree", "window", "meta"):
        assert key in res
    data = json.loads((tmp_path / "tensor.json").read_text())
    assert set(res) <= set(data)
    assert (tmp_path / "tensor.md").read_text().count("|") > 10
