"""fsspec's storage options reach URLs only: ``--storage-option KEY=VALUE`` (or ``storage_options=``) with local
paths alone was ignored without a word; it is refused in one line naming the options and the paths, before
anything is read or written. Where one path of the command is a URL, the options are its and are taken."""
from __future__ import annotations

import os

import numpy as np
import pytest

from scaleattn.errors import ParameterError

from .conftest import FIT, Inputs, dataset, error_line, expect, run_main

REFUSED = r"storage options \(anon\) apply to fsspec URLs such as s3://BUCKET/KEY, not to local paths \(.*\)"


def test_the_cli_refuses_storage_options_of_local_paths(tmp_path, capsys):
    dataset(tmp_path / "d.zarr")
    np.savez(tmp_path / "a.npz", tokens=np.ones((4, 3, 2)), targets=np.ones((4, 2)))
    assert run_main(["fit", "d.zarr", "--out", "run0", *FIT], capsys, cwd=tmp_path)[0] == 0
    inputs = Inputs(tmp_path / "d.zarr", tmp_path / "run0")
    listing = sorted(os.listdir(tmp_path))
    for argv in (["generate", "mhla", "g.zarr", "--samples", "4", "--length", "3"], ["import", "i.zarr", "--npz",
                 "a.npz"], ["fit", "d.zarr", "--out", "run", *FIT], ["certify", "d.zarr", "--local"],
                 ["evaluate", "run0/model.zarr", "d.zarr", "--local"], ["compare", "run0/model.zarr",
                 "run0/model.zarr"], ["plot", "run0", "--dataset", "d.zarr", "--out", "figs"],
                 ["plot", "run0", "--out", "figs"], ["plot", "run0"]):  # (the report's dataset: local too)
        rc, err = run_main([*argv, "--storage-option", "anon=true"], capsys, cwd=tmp_path)
        assert rc == 2, (argv, err)
        expect(error_line(err), REFUSED)
        assert sorted(os.listdir(tmp_path)) == listing, argv
    inputs.unchanged()


def test_the_api_refuses_storage_options_of_local_paths(tmp_path):
    from scaleattn import certify_dataset, fit
    from scaleattn.data._writer import write_dataset
    from scaleattn.generate import generate_mhla
    from scaleattn.importers import import_arrays

    ds = dataset(tmp_path / "d.zarr")
    np.savez(tmp_path / "a.npz", tokens=np.ones((4, 3, 2)), targets=np.ones((4, 2)))
    opts = {"anon": True}
    for call in (lambda: fit(str(tmp_path / "d.zarr"), str(tmp_path / "run"), storage_options=opts),
                 lambda: fit(ds, str(tmp_path / "run"), storage_options=opts),
                 lambda: certify_dataset(str(tmp_path / "d.zarr"), storage_options=opts),
                 lambda: generate_mhla(str(tmp_path / "g.zarr"), 2, 1, 3, 4, storage_options=opts),
                 lambda: write_dataset(str(tmp_path / "w.zarr"), np.ones((4, 3, 2)), np.ones((4, 2)),
                                       storage_options=opts),
                 lambda: import_arrays(str(tmp_path / "i.zarr"), str(tmp_path / "a.npz"), storage_options=opts)):
        with pytest.raises(ParameterError, match=REFUSED):
            call()
    assert sorted(os.listdir(tmp_path)) == ["a.npz", "d.zarr"]


def test_options_of_a_url_among_local_paths_are_taken(tmp_path):
    from scaleattn.store._location import check_storage_options

    check_storage_options({"anon": True}, "d.zarr", "s3://bucket/run")
    check_storage_options(["anon=true"], "d.zarr", "S3://bucket/run")
    check_storage_options(None, "d.zarr")


def _baselines_loader(d, opts):
    """The baselines' loader call where PyTorch is installed (the ``torch`` extra; ``.[test]`` alone lacks it)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return []
    from scaleattn.baselines.training import load_arrays

    return [lambda: load_arrays(d, opts)]


def test_the_readers_and_writers_of_stores_refuse_them_too(tmp_path, monkeypatch):
    """The class beyond the commands: every function of the API that takes ``storage_options`` with a store's path
    (open_dataset, the models' and statistics' load and save, read_run, the plots, the baselines' loader)."""
    from scaleattn import fit, open_dataset, plot
    from scaleattn.model import MHLAModel
    from scaleattn.plot import run_figures, sample_predictions, save_run_plots
    from scaleattn.run import read_run
    from scaleattn.statistics._container import Statistics

    dataset(tmp_path / "d.zarr")
    d, run = str(tmp_path / "d.zarr"), str(tmp_path / "run")
    result = fit(d, run, client=None, plots=False)
    inputs = Inputs(tmp_path / "d.zarr", tmp_path / "run")
    listing = sorted(os.listdir(tmp_path))
    opts = {"anon": True}
    for call in (lambda: open_dataset(d, opts), lambda: MHLAModel.load(f"{run}/model.zarr", opts),
                 lambda: result.model.save(str(tmp_path / "m.zarr"), storage_options=opts),
                 lambda: Statistics.load(f"{run}/stats.zarr", opts),
                 lambda: result.statistics.save(str(tmp_path / "s.zarr"), storage_options=opts),
                 lambda: read_run(run, opts), lambda: run_figures(run, storage_options=opts),
                 lambda: run_figures(result, d, storage_options=opts),
                 lambda: sample_predictions(result.model, d, storage_options=opts),
                 lambda: save_run_plots(run, str(tmp_path / "p"), storage_options=opts),
                 *_baselines_loader(d, opts)):
        with pytest.raises(ParameterError, match=REFUSED):
            call()
    assert sorted(os.listdir(tmp_path)) == listing
    inputs.unchanged()
    # a URL among the paths takes them: the dataset at the URL is opened with them, the local run read without
    opened = []
    monkeypatch.setattr(plot, "open_dataset", lambda url, o: opened.append((url, o)) or open_dataset(d))
    figs = run_figures(run, "s3://bucket/d.zarr", storage_options=opts)
    assert opened == [("s3://bucket/d.zarr", opts)] and "predictions" in figs
