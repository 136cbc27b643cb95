"""Every store scaleattn writes (dataset, statistics, model, spectrum) opens in xarray with named dimensions,
descriptions and a format version, and xarray reads the same values as zarr."""
import numpy as np
import pytest
import zarr

import scaleattn as sa
from scaleattn import generate

xr = pytest.importorskip("xarray")


def _open_both(url, group=None):
    a = xr.open_zarr(url, group=group, consolidated=False)
    b = xr.open_dataset(url, group=group, engine="zarr", consolidated=False)
    return a, b


def _check_store(url, fmt, group=None):
    a, b = _open_both(url, group)
    g = zarr.open_group(url if group is None else f"{url}/{group}", mode="r")
    if fmt is not None:
        assert a.attrs["format"] == fmt and isinstance(a.attrs["format_version"], int)
    assert set(a.data_vars) == set(g.array_keys()) and len(a.data_vars) > 0
    for name, var in a.data_vars.items():
        arr = g[name]
        assert var.dims == tuple(arr.metadata.dimension_names)
        assert len(set(var.dims)) == var.ndim, f"{name}: repeated dimension names {var.dims}"
        assert var.attrs.get("description"), f"{name}: no description"
        np.testing.assert_array_equal(var.values, arr[...])
        np.testing.assert_array_equal(b[name].values, arr[...])
    return a


@pytest.fixture(scope="module")
def run(tmp_path_factory, causal_varlen_ds):
    """The shared variable-length causal dataset (d = 3, d_out = 2) and its fit written to a run directory."""
    tmp = tmp_path_factory.mktemp("xr")
    ds = causal_varlen_ds
    res = sa.fit(ds, str(tmp / "run"), plots=False)
    return tmp, ds, res


@pytest.mark.slow
def test_dataset_store(run):
    tmp, ds, _ = run
    x = _check_store(ds.url, "scaleattn-dataset")
    assert x["tokens"].dims == ("sample", "position", "embed")
    assert x["targets"].dims == ("sample", "position", "output")
    assert x["lengths"].dims == ("sample",)
    assert dict(x.sizes) == {"sample": 40, "position": 8, "embed": 3, "output": 2}
    tok, lens, y = ds.read(0, 40)
    np.testing.assert_array_equal(x["tokens"].values, tok)
    np.testing.assert_array_equal(x["lengths"].values, lens)
    t = _check_store(ds.url, None, group="teacher")
    V, Q = ds.teacher()
    np.testing.assert_array_equal(t["V"].values, V)
    assert t["Q"].dims == ("head", "embed", "embed_2")  # square matrix: distinct dimension names


def test_last_token_dataset(tmp_path):
    data = generate.make_assoc(pairs=2, samples=64, seed=0)
    ds = sa.write_dataset(str(tmp_path / "a.zarr"), data["tokens"], data["targets"])
    x = _check_store(ds.url, "scaleattn-dataset")
    assert x["targets"].dims == ("sample", "output") and x.sizes["embed"] == 4


def test_statistics_store(run):
    tmp, ds, res = run
    x = _check_store(str(tmp / "run" / "stats.zarr"), "scaleattn-statistics")
    st = res.statistics
    assert x.attrs["n_rows"] == st.n_rows and x.attrs["d"] == 3
    np.testing.assert_array_equal(x["gram_compact"].values, st.gram_compact)
    assert x["moments"].dims == ("feature", "output") and x.sizes["feature"] == st.psi == 18


def test_statistics_without_targets(tmp_path):
    data = generate.make_mhla(d=2, heads=1, length=6, samples=20, seed=0)
    st = sa.statistics_from_arrays(data["tokens"])
    st.save(str(tmp_path / "g.zarr"))
    x = xr.open_zarr(str(tmp_path / "g.zarr"), consolidated=False)
    assert x["moments"].shape == (6, 0)
    np.testing.assert_array_equal(x["gram_compact"].values, st.gram_compact)


def test_model_store(run):
    tmp, ds, res = run
    x = _check_store(str(tmp / "run" / "model.zarr"), "scaleattn-model")
    m = res.model
    np.testing.assert_array_equal(x["coef"].values, m.coef)
    assert x["Q"].dims == ("head", "embed", "embed_2") and x.sizes["head"] == m.n_heads
    assert x.attrs["n_heads"] == m.n_heads and x.attrs["causal"] is True


def test_spectrum_store(run):
    tmp, ds, res = run
    x = _check_store(str(tmp / "run" / "spectrum.zarr"), "scaleattn-spectrum")
    # independent: eigenvalues of Lambda_D = G / N by dense numpy
    lam = np.linalg.eigvalsh(res.statistics.gram() / res.statistics.n_rows)
    np.testing.assert_allclose(x["eigenvalues"].values, lam, rtol=1e-10, atol=1e-18)
    assert x["eigenvalues"].dims == ("eigenvalue",) and x["eigenvalues"].attrs["units"]
    assert x.attrs["lambda_min"] == pytest.approx(max(lam[0], 0.0), rel=1e-8, abs=1e-18)
    assert x.attrs["identifiable"] is True
