"""Real data: the built-in digits dataset imports with its shape and fits with a real error and a failed
certificate."""
import pytest

from scaleattn.pipeline import fit


@pytest.mark.slow
def test_real_digits_dataset(tmp_path):
    from scaleattn.importers import load_digits_dataset

    ds = load_digits_dataset(tmp_path / "digits.zarr")
    res = fit(ds)
    assert ds.n_samples == 1797 and ds.d == 8 and ds.d_out == 8
    # real data: a real error (about 0.10 of mean y^2) and a failed certificate: the first pixel column of
    # the digits is almost always blank, so some cubic features never vary
    assert 0.05 < res.report["relative_train_mse"] < 0.2
    assert res.report["psi"] == 288 and not res.report["identifiable"] and 150 < res.report["rank"] < 288
