"""Every output goes where it outlives the command: an in-memory file system (``memory://``) is gone when the
process exits, HTTP(S), archives (``zip://``, ``tar://``), ``github://`` and chained cache URLs
(``simplecache::``, ``filecache::``) cannot be written or keep the writes in a local cache; each is refused with one
line naming the option, the URL and why, exit 2, and nothing written. ``memory://`` inputs stay readable in this
process, never by Dask workers of other processes."""
from __future__ import annotations

import os
import re

import fsspec
import numpy as np
import pytest

from scaleattn.errors import UnsafeOutputError, UnsupportedError
from scaleattn.store._location import Location, resolve
from scaleattn.store._outputs import check_output_location

from .conftest import FIT, Inputs, dataset, error_line, expect, run_main

#: (URL, what the refusal says about it)
PLACES = [
    ("memory://runs/x", r"an in-memory file system, gone when this process exits"),
    ("MEMORY://runs/x", r"an in-memory file system"),
    ("http://127.0.0.1:9/runs/x", r"HTTP\(S\) .*read-only"),
    ("https://example.invalid/runs/x", r"HTTP\(S\) .*read-only"),
    ("simplecache::memory://runs/x", r"a chained URL"),
    ("filecache::file:///tmp/never/x", r"a chained URL"),
    ("zip://x::file:///tmp/never.zip", r"a chained URL"),
    ("zip://runs/x", r"an archive .*read-only"),
    ("tar://runs/x", r"an archive .*read-only"),
    ("github://org:repo@main/runs/x", r"read-only"),
    ("reference://runs/x", r"read-only"),
    ("dask://runs/x", r"cannot check that .*keeps what is written"),
]


def _memory_files() -> list[str]:
    return sorted(fsspec.filesystem("memory").store)


@pytest.fixture
def clean_memory():
    fs = fsspec.filesystem("memory")
    store, dirs = dict(fs.store), list(fs.pseudo_dirs)
    yield
    fs.store.clear()
    fs.store.update(store)
    fs.pseudo_dirs[:] = dirs


def _argvs(url):
    """(role, argv) of every command that writes an output, with ``url`` as that output."""
    return [
        ("--out", ["fit", "d.zarr", "--out", url, *FIT]),
        ("--checkpoint", ["fit", "d.zarr", "--out", "run", "--checkpoint", url, *FIT]),
        ("output", ["generate", "mhla", url, "--samples", "4", "--length", "3"]),
        ("output", ["import", url, "--npz", "a.npz"]),
        ("--out", ["plot", "run0", "--out", url]),
        ("--out", ["bench", "--out", url, "--quick"]),
    ]


@pytest.mark.parametrize("url,why", PLACES, ids=[u.split(":")[0] + str(i) for i, (u, _) in enumerate(PLACES)])
def test_outputs_that_do_not_persist_are_refused(tmp_path, capsys, clean_memory, url, why):
    dataset(tmp_path / "d.zarr")
    tok = np.random.default_rng(0).standard_normal((4, 3, 2))
    np.savez(tmp_path / "a.npz", tokens=tok, targets=tok[:, -1])
    rc, err = run_main(["fit", "d.zarr", "--out", "run0", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    inputs = Inputs(tmp_path / "d.zarr", tmp_path / "run0")
    listing = sorted(os.listdir(tmp_path))
    memory = _memory_files()
    for role, argv in _argvs(url):
        rc, err = run_main(argv, capsys, cwd=tmp_path)
        assert rc == 2, (argv, err)
        line = error_line(err)
        expect(line, rf"{re.escape(role)} {re.escape(resolve(url).url)}: ")  # (the scheme in lower case)
        expect(line, why)
        assert sorted(os.listdir(tmp_path)) == listing, argv  # no local stand-in (a "memory:" folder, ...)
        assert _memory_files() == memory, argv
    inputs.unchanged()


@pytest.mark.parametrize("url", ["memory://m", "s3://bucket", "memory://"])
def test_an_output_needs_a_place_beside_it(url):
    """Its lock and temporaries go next to it: the root of a bucket has no such place (the lock went into a local
    folder named ``s3:`` before)."""
    with pytest.raises(UnsafeOutputError, match=rf"--out {re.escape(url.rstrip('/'))}"):
        check_output_location(resolve(url), "--out")


@pytest.mark.parametrize("url", ["/tmp/somewhere/run", "file:///tmp/somewhere/run", "s3://bucket/run",
                                 "gs://bucket/a/run", "az://container/run", "sftp://host/home/run"])
def test_persistent_places_are_accepted(url, monkeypatch):
    from scaleattn.store import _outputs

    monkeypatch.setattr(_outputs, "check_outside_stores", lambda *a, **k: None)  # (no network here)
    check_output_location(resolve(url), "--out")


def test_bench_writes_local_files_only(tmp_path, capsys):
    """``bench --out`` is written with local file calls: a persistent URL is refused too (it made a local folder
    named ``s3:`` before), naming the option."""
    rc, err = run_main(["bench", "--out", "s3://bucket/bench", "--quick"], capsys, cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), r"--out s3://bucket/bench: this command writes its files to a local directory")
    assert not os.listdir(tmp_path)


def test_library_writers_refuse_memory_outputs(tmp_path, clean_memory):
    from scaleattn.data._writer import write_dataset
    from scaleattn.model import MHLAModel
    from scaleattn.statistics._container import statistics_from_arrays

    tok = np.random.default_rng(1).standard_normal((4, 3, 2))
    stats = statistics_from_arrays(tok, tok[:, -1])
    model = MHLAModel(np.zeros((6, 2)), np.zeros((1, 2, 2)), np.zeros((1, 2, 2)), 2)
    memory = _memory_files()
    for write in (lambda: write_dataset("memory://lib/d.zarr", tok, tok[:, -1]),
                  lambda: stats.save("memory://lib/s.zarr"), lambda: model.save("memory://lib/m.zarr")):
        with pytest.raises(UnsafeOutputError, match=r"output memory://lib/\w\.zarr: an in-memory file system"):
            write()
    assert _memory_files() == memory


def _memory_dataset(tmp_path, name):
    """A dataset copied into this process's memory file system (as a notebook could hold one)."""
    dataset(tmp_path / "src.zarr")
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "src.zarr"), f"/{name}", recursive=True)
    return Location(f"memory://{name}")


class _Client:
    """Stands for a distributed.Client: only what the reachability check asks."""

    def __init__(self, *addresses):
        self.addresses = addresses

    def scheduler_info(self, **kw):
        return {"workers": {a: {"nthreads": 1} for a in self.addresses}}


def test_memory_inputs_are_read_in_process_never_by_other_processes(tmp_path, clean_memory):
    from scaleattn import certify_dataset
    from scaleattn.data._dataset import open_dataset
    from scaleattn.distributed.evaluate import evaluate
    from scaleattn.model import MHLAModel

    loc = _memory_dataset(tmp_path, "mem/d.zarr")
    ds = open_dataset(loc)
    assert certify_dataset(ds).n_rows > 0  # in this process: allowed
    model = MHLAModel(np.zeros((6, 2)), np.zeros((1, 2, 2)), np.zeros((1, 2, 2)), 2, causal=True)
    remote = _Client("tcp://10.0.0.7:4711", "tcp://10.0.0.8:4711")
    from scaleattn.distributed.build import compute_statistics
    from scaleattn.distributed.tsqr import compute_r

    for run in (lambda: certify_dataset(ds, client=remote), lambda: evaluate(model, ds, remote),
                lambda: compute_statistics(ds, remote), lambda: compute_r(ds, remote)):
        with pytest.raises(UnsupportedError, match=r"dataset memory://mem/d\.zarr: .*memory of this process.*"
                                                   r"workers .*other processes"):
            run()


@pytest.mark.slow
def test_memory_inputs_on_real_clusters(tmp_path, clean_memory):
    """Threads of this process (``processes=False``) read it; worker processes are refused before any task."""
    from distributed import Client, LocalCluster

    from scaleattn import certify_dataset
    from scaleattn.data._dataset import open_dataset

    ds = open_dataset(_memory_dataset(tmp_path, "mem2/d.zarr"))
    ref = certify_dataset(ds)
    with LocalCluster(processes=False, n_workers=1, dashboard_address=None) as c, Client(c) as client:
        assert certify_dataset(ds, client=client).lambda_min == ref.lambda_min
    with LocalCluster(processes=True, n_workers=1, dashboard_address=None) as c, Client(c) as client:
        with pytest.raises(UnsupportedError, match=r"memory of this process"):
            certify_dataset(ds, client=client)


def test_files_are_never_added_into_a_store_and_outputs_are_not_links(tmp_path, capsys):
    """``plot --out`` and ``bench --out`` add files into their directory: an existing Zarr store there (a dataset,
    the run's own model) is refused, as a path inside one is. An output that is a symbolic link is refused (an
    --overwrite replaced the link and left 'Cannot call rmtree on a symbolic link' for every later run), and a
    link left aside by such a run is removed as a link, its target untouched."""
    from scaleattn.store._location import remove

    dataset(tmp_path / "d.zarr")
    dataset(tmp_path / "e.zarr", seed=2)  # a store no command here reads
    assert run_main(["fit", str(tmp_path / "d.zarr"), "--out", str(tmp_path / "run"), *FIT], capsys)[0] == 0
    inputs = Inputs(tmp_path / "d.zarr", tmp_path / "e.zarr", tmp_path / "run")
    for argv in (["plot", str(tmp_path / "run"), "--out", str(tmp_path / "e.zarr")],
                 ["plot", str(tmp_path / "run"), "--out", f"local://{tmp_path / 'run' / 'model.zarr'}"],
                 ["bench", "--quick", "--out", str(tmp_path / "e.zarr")]):
        rc, err = run_main(argv, capsys)
        assert rc == 2, err
        expect(error_line(err), r"--out \S+\.zarr (is a Zarr store: this command adds files into its --out|is the"
                                r" input model)")
    os.symlink(tmp_path / "d.zarr", tmp_path / "link.zarr")
    rc, err = run_main(["generate", "mhla", str(tmp_path / "link.zarr"), "--d", "2", "--heads", "1", "--length", "6",
                        "--samples", "32", "--overwrite"], capsys)
    assert rc == 2, err
    expect(error_line(err), r"--out \S+link\.zarr is a symbolic link \(to \S+d\.zarr\)|link\.zarr is a symbolic link")
    inputs.unchanged()
    remove(str(tmp_path / "link.zarr"))
    assert not os.path.lexists(tmp_path / "link.zarr") and (tmp_path / "d.zarr" / "zarr.json").exists()


def test_overwrite_never_deletes_a_folder_of_the_user_under_a_run_s_store_name(tmp_path, capsys):
    """--overwrite of a run directory looked at its top-level names only: a folder of the user's named
    ``spectrum.zarr`` (notes in it) was deleted with the run. Each of the run's store names must hold a store
    scaleattn wrote."""
    import shutil

    from .conftest import tree_hash

    dataset(tmp_path / "d.zarr")
    assert run_main(["fit", str(tmp_path / "d.zarr"), "--out", str(tmp_path / "run"), *FIT], capsys)[0] == 0
    shutil.rmtree(tmp_path / "run" / "spectrum.zarr")
    (tmp_path / "run" / "spectrum.zarr").mkdir()
    (tmp_path / "run" / "spectrum.zarr" / "notes.txt").write_text("precious")
    before = tree_hash(tmp_path / "run")
    rc, err = run_main(["fit", str(tmp_path / "d.zarr"), "--out", str(tmp_path / "run"), "--overwrite", *FIT], capsys)
    assert rc == 2, err
    expect(error_line(err), r"its spectrum\.zarr is not a store scaleattn wrote")
    assert tree_hash(tmp_path / "run") == before


@pytest.mark.parametrize("member, kind", [("stats.zarr", "a dataset store, not a statistics store"),
                                          ("model.zarr", "a statistics store, not a model store")])
def test_overwrite_never_deletes_another_kind_of_store_under_a_run_s_store_name(tmp_path, capsys, member, kind):
    """--overwrite took any scaleattn store under a run's store names for the run's: a dataset copied in as
    ``stats.zarr`` (the user's only copy of imported data, say) was deleted with the run."""
    import shutil

    from .conftest import tree_hash

    dataset(tmp_path / "d.zarr")
    assert run_main(["fit", str(tmp_path / "d.zarr"), "--out", str(tmp_path / "run"), *FIT], capsys)[0] == 0
    shutil.rmtree(tmp_path / "run" / member)
    source = tmp_path / "d.zarr" if member == "stats.zarr" else tmp_path / "run" / "stats.zarr"
    shutil.copytree(source, tmp_path / "run" / member)
    before = tree_hash(tmp_path / "run")
    rc, err = run_main(["fit", str(tmp_path / "d.zarr"), "--out", str(tmp_path / "run"), "--overwrite", *FIT], capsys)
    assert rc == 2, err
    expect(error_line(err), rf"exists and was not written by scaleattn \(its {re.escape(member)} is {kind}\)")
    assert tree_hash(tmp_path / "run") == before


@pytest.mark.parametrize("meta", ["[1]", '{"attributes": [1]}', '{"attributes": {"format": ["scaleattn-"]}}',
                                  "[" * 5000, "\xff\xfe"], ids=["list", "attributes-list", "format-list", "nested",
                                                                "not-utf8"])
def test_overwrite_of_a_directory_with_any_zarr_json_is_refused_in_one_line(tmp_path, meta):
    """A zarr.json is any program's file: one that is JSON but not an object, or nested too deep, was an internal
    error (AttributeError, RecursionError) of --overwrite instead of "not written by scaleattn"."""
    from scaleattn.store._outputs import check_replaceable

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "zarr.json").write_bytes(meta.encode("latin-1"))
    with pytest.raises(UnsafeOutputError, match=r"exists and was not written by scaleattn \(it holds 'zarr\.json'"):
        check_replaceable(Location(str(tmp_path / "out")), "--out")


@pytest.mark.parametrize("url", ["s3://bucket/.", "s3://bucket/x/..", "gs://b/./"])
def test_a_bucket_root_spelled_with_dots_is_a_bucket_root(url):
    with pytest.raises(UnsafeOutputError, match=r"the root of a bucket or file system has no place next to it"):
        check_output_location(resolve(url), "--out")
