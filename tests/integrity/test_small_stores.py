"""Models, statistics and spectra are read only as written (issue: stores without a manifest were read unchecked,
absent chunks as zeros): a missing or edited manifest, an edited attribute, an absent chunk, unreadable array
metadata, or heads that do not compute the coefficients are one error naming the store (and array), exit 2."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import zarr

from scaleattn.errors import FormatError, IntegrityError, ParameterError
from scaleattn.heads._algebra import coef_from_heads
from scaleattn.model import MHLAModel
from scaleattn.run import load_spectrum
from scaleattn.statistics._container import Statistics

from .conftest import error_line, expect, run_main


def _model(causal=True) -> MHLAModel:
    rng = np.random.default_rng(0)
    V, Q = rng.standard_normal((2, 2, 2)), rng.standard_normal((2, 2, 2))
    return MHLAModel(coef_from_heads(V, Q), V, Q, 2, causal)


def _stats() -> Statistics:
    rng = np.random.default_rng(1)
    return Statistics(rng.standard_normal((6, 3)), rng.standard_normal((6, 2)), 3.0, 10, 2)


@pytest.fixture
def stores(tmp_path):
    _model().save(tmp_path / "m.zarr")
    _stats().save(tmp_path / "s.zarr")
    return tmp_path


def _edit(store, **changes):
    """Set (or, with None, remove) attributes of ``store`` in its zarr.json, as a hand edit would."""
    p = store / "zarr.json"
    doc = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            doc["attributes"].pop(k, None)
        else:
            doc["attributes"][k] = v
    p.write_text(json.dumps(doc))


def _v1(store):
    """``store`` rewritten as a v1 store (what scaleattn wrote before manifests: no crc32c codec, no manifest)."""
    g = zarr.open_group(str(store), mode="r")
    arrays = {n: a[...] for n, a in g.arrays()}
    attrs = {k: v for k, v in g.attrs.items() if k != "manifest"}
    shutil.rmtree(store)
    g = zarr.open_group(str(store), mode="w")
    for n, a in arrays.items():
        g.create_array(n, data=a)
    g.attrs.update({**attrs, "format_version": 1})


LOADERS = {"m.zarr": MHLAModel.load, "s.zarr": Statistics.load}


@pytest.mark.parametrize("name", ["m.zarr", "s.zarr"])
@pytest.mark.parametrize("edit, pattern", [
    ({"manifest": None}, r"a scaleattn v3 \w+ store without its manifest"),
    ({"manifest": None, "format_version": 1}, r"crc32c codec scaleattn writes since format v2"),
    ({"format_version": 1}, r"format_version 1 but a manifest"),
    ({"format_version": 2}, r"format_version 2 but its manifest records the attributes"),
    ({"d": 3}, r"attribute 'd' is 3, not the value written"),
    ({"d_out": 5}, r"attribute 'd_out' is 5, not the value written"),
    ({"extra": 1}, r"attribute 'extra' was added"),
], ids=["no-manifest", "v1-no-manifest", "v1", "v2", "d", "d_out", "added"])
def test_edited_attributes_are_refused(stores, name, edit, pattern):
    _edit(stores / name, **edit)
    with pytest.raises(IntegrityError, match=pattern):
        LOADERS[name](stores / name)


def test_edited_causal_and_counts_are_refused(stores):
    _edit(stores / "m.zarr", causal=False)
    with pytest.raises(IntegrityError, match=r"attribute 'causal' is false, not the value written"):
        MHLAModel.load(stores / "m.zarr")
    _edit(stores / "s.zarr", n_rows=11)
    with pytest.raises(IntegrityError, match=r"attribute 'n_rows' is 11"):
        Statistics.load(stores / "s.zarr")


@pytest.mark.parametrize("name, array", [("m.zarr", "coef"), ("m.zarr", "V"), ("s.zarr", "moments"),
                                         ("s.zarr", "gram_compact")])
def test_absent_chunks_are_refused_whatever_the_version(stores, name, array):
    _v1(stores / name)
    LOADERS[name](stores / name)  # a v1 store is still read
    chunk = stores / name / array / "c" / "0" / "0"
    (chunk / "0" if chunk.is_dir() else chunk).unlink()  # (3-d arrays keep their chunk one level deeper)
    with pytest.raises(IntegrityError, match=rf"{array} in \S+{name}: no chunk stored for rows \[0, "):
        LOADERS[name](stores / name)


def test_v1_model_whose_coef_and_heads_disagree_is_refused(stores):
    _v1(stores / "m.zarr")
    zarr.open_group(str(stores / "m.zarr"), mode="r+")["coef"][0, 0] = 7.0
    with pytest.raises(IntegrityError, match=r"m\.zarr: its heads V, Q compute other coefficients than its coef"):
        MHLAModel.load(stores / "m.zarr")


def test_v1_attributes_are_checked_against_the_arrays(stores):
    _v1(stores / "m.zarr")
    _edit(stores / "m.zarr", d_out=5)
    with pytest.raises(IntegrityError, match=r"attribute 'd_out' is 5 but the arrays hold 2"):
        MHLAModel.load(stores / "m.zarr")
    _v1(stores / "s.zarr")
    _edit(stores / "s.zarr", d=3)
    with pytest.raises(IntegrityError, match=r"gram_compact in \S+s\.zarr: shape \(6, 3\), but d = 3"):
        Statistics.load(stores / "s.zarr")


def test_a_model_whose_heads_do_not_compute_its_coef_is_not_saved(tmp_path):
    m = _model()
    with pytest.raises(ParameterError, match=r"heads V, Q compute other coefficients"):
        MHLAModel(m.coef + 1.0, m.V, m.Q, 2).save(tmp_path / "x.zarr")
    assert not (tmp_path / "x.zarr").exists()


@pytest.mark.parametrize("damage, pattern", [
    (lambda p: p.write_text("{bad"), r"coef in \S+m\.zarr: its metadata \(zarr\.json\) cannot be read"),
    (lambda p: p.write_text(p.read_text().replace('"float64"', '"int8"')),
     r"coef in \S+m\.zarr: data type int8 in its metadata"),
], ids=["not-json", "int8"])
def test_damaged_array_metadata_is_one_line_exit_2(stores, capsys, damage, pattern):
    damage(stores / "m.zarr" / "coef" / "zarr.json")
    with pytest.raises(FormatError, match=pattern):
        MHLAModel.load(stores / "m.zarr")
    _model().save(stores / "ok.zarr")
    for argv in (["compare", "m.zarr", "ok.zarr"], ["compare", "ok.zarr", "m.zarr"]):
        rc, err = run_main(argv, capsys, cwd=stores)
        assert rc == 2  # not 1 ("DIFFERENT"): a crash never reads as a verdict
        expect(error_line(err), r"^scaleattn compare: error: " + pattern)


def test_cli_refuses_a_model_without_manifest_and_an_absent_chunk(stores, capsys):
    """The reviewer's case: evaluate read the coefficients as zeros, compare called the store equivalent."""
    shutil.copytree(stores / "m.zarr", stores / "n1.zarr")
    _edit(stores / "n1.zarr", manifest=None)
    (stores / "n1.zarr/coef/c/0/0").unlink()
    rc, err = run_main(["compare", "n1.zarr", "m.zarr"], capsys, cwd=stores)
    assert rc == 2
    expect(error_line(err), r"^scaleattn compare: error: \S+n1\.zarr: a scaleattn v3 model store without its"
                            r" manifest")


def test_spectrum_store_is_checked(tmp_path):
    from scaleattn.linalg._solver import certify
    from scaleattn.run import save_spectrum
    from scaleattn.store._location import resolve

    rng = np.random.default_rng(0)
    from scaleattn.statistics._container import statistics_from_arrays

    cert = certify(statistics_from_arrays(rng.standard_normal((40, 3, 2)), rng.standard_normal((40, 2))))
    save_spectrum(cert, resolve(tmp_path / "sp.zarr"))
    ev, _ = load_spectrum(resolve(tmp_path / "sp.zarr"))
    np.testing.assert_array_equal(ev, cert.eigenvalues)
    _edit(tmp_path / "sp.zarr", rank=1)
    with pytest.raises(IntegrityError, match=r"sp\.zarr: attribute 'rank' is 1, not the value written"):
        load_spectrum(resolve(tmp_path / "sp.zarr"))
