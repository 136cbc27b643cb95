"""Every public entry that takes a store's path refuses a value that is no path (arrays, a tuple, a dict, a
number) in one line naming the entry and the value's type and shape, never a "no such dataset" built from the
value's repr; the dataset entries point to what takes arrays (MHLARegressor, write_dataset, scaleattn import)."""
import numpy as np
import pytest

import scaleattn
from scaleattn.errors import ParameterError
from scaleattn.generate import generate_mhla
from scaleattn.importers import import_arrays
from scaleattn.plot import save_run_plots
from scaleattn.run import read_run

A = np.ones((8, 3, 2))
VALUES = [(A, "a numpy.ndarray of shape (8, 3, 2)"), ((A, A[:, 0]), "a tuple of 2 items"),
          ({"tokens": A}, "a dict of 1 item"), (3, "the int 3"), (None, "the NoneType None")]


def _one_line(call, *words):
    with pytest.raises(ParameterError) as e:
        call()
    text = str(e.value)
    assert "\n" not in text and len(text) < 400 and "1. 1." not in text, text
    for w in words:
        assert w in text, text
    return text


@pytest.mark.parametrize("value, said", VALUES)
def test_dataset_entries_point_to_the_estimator(value, said, tmp_path):
    model = scaleattn.MHLAModel(np.zeros((6, 2)), np.zeros((1, 2, 2)), np.zeros((1, 2, 2)), 2)
    entries = {"fit": lambda: scaleattn.fit(value), "certify_dataset": lambda: scaleattn.certify_dataset(value),
               "open_dataset": lambda: scaleattn.open_dataset(value),
               "compute_statistics": lambda: scaleattn.compute_statistics(value),
               "evaluate": lambda: scaleattn.evaluate(model, value)}
    for entry, call in entries.items():
        if value is None and entry == "fit":
            continue
        _one_line(call, f"{entry} takes a dataset", said, "MHLARegressor", "scaleattn import")


@pytest.mark.parametrize("value, said", VALUES[:2])
def test_other_store_entries_name_themselves(value, said, tmp_path):
    np.savez(tmp_path / "x.npz", tokens=A, targets=A[:, 0])
    for entry, call in {"Statistics.load": lambda: scaleattn.Statistics.load(value),
                        "MHLAModel.load": lambda: scaleattn.MHLAModel.load(value),
                        "read_run": lambda: read_run(value), "save_run_plots": lambda: save_run_plots(value),
                        "write_dataset": lambda: scaleattn.write_dataset(value, A, A[:, 0]),
                        "generate_mhla": lambda: generate_mhla(value),
                        "import": lambda: import_arrays(value, tmp_path / "x.npz")}.items():
        _one_line(call, f"{entry} takes", said)
    _one_line(lambda: scaleattn.fit(tmp_path / "nowhere.zarr", value), "fit takes as `out`", said)
    _one_line(lambda: import_arrays(tmp_path / "y.zarr", value), "import takes as `path`", said, "write_dataset")


def test_paths_still_work_for_evaluate_and_compute_statistics(tmp_path):
    ds = generate_mhla(tmp_path / "d.zarr", d=2, samples=20, length=4)
    res = scaleattn.fit(ds)
    by_path = scaleattn.evaluate(res.model, str(tmp_path / "d.zarr"))
    assert by_path == scaleattn.evaluate(res.model, ds)
    np.testing.assert_array_equal(scaleattn.compute_statistics(tmp_path / "d.zarr").gram_compact,
                                  res.statistics.gram_compact)
