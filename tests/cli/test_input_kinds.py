"""An input path of the wrong kind for its option says what it is and what was expected, in one line with the
option's name, exit 2: a directory where a file goes (``--npz``, ``--csv``, the TLS files), a file where a Zarr
store or run directory goes (a dataset, ``--checkpoint``, a model, a run), and a path through a file
(``file.txt/sub``), which does not exist because a file has no entries."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from scaleattn.errors import ParameterError
from tests.helpers import run_cli


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A directory ``dir``, a file ``file.txt``, a dataset ``d.zarr`` and a fit's run ``run``; cwd there."""
    from scaleattn.generate import generate_mhla

    (tmp_path / "dir").mkdir()
    (tmp_path / "file.txt").write_text("not a store\n")
    generate_mhla(str(tmp_path / "d.zarr"), d=2, heads=1, length=4, samples=8, causal=True, seed=0)
    monkeypatch.chdir(tmp_path)
    return tmp_path


FIT = ["--local", "--quiet", "--no-plots"]
DIR = r"is a directory, expected"
FILE = r"is a file, expected"
THROUGH = r"\S*file\.txt is a file, not a directory"
#: (id, argv, option, the path as named, what the line says)
CASES = [
    ("npz-dir", ["import", "o.zarr", "--npz", "dir"], "--npz", "dir", DIR + r" a \.npz or \.npy file"),
    ("npz-through-file", ["import", "o.zarr", "--npz", "file.txt/a.npz"], "--npz", "file.txt/a.npz", THROUGH),
    ("csv-dir", ["import", "o.zarr", "--csv", "dir"], "--csv", "dir", DIR + r" a CSV file"),
    ("csv-through-file", ["import", "o.zarr", "--csv", "file.txt/s.csv"], "--csv", "file.txt/s.csv", THROUGH),
    ("tls-dir", ["fit", "d.zarr", "--out", "r", "--tls-ca-file", "dir", "--tls-cert", "file.txt", "--tls-key",
                 "file.txt", "--quiet"], "--tls-ca-file", "dir", DIR + r" a PEM file"),
    ("fit-data-file", ["fit", "file.txt", "--out", "r", *FIT], "dataset", "file.txt", FILE + r" a Zarr store"),
    ("fit-data-through-file", ["fit", "file.txt/d.zarr", "--out", "r", *FIT], "dataset", "file.txt/d.zarr", THROUGH),
    ("certify-data-file", ["certify", "file.txt", "--local", "--quiet"], "dataset", "file.txt", FILE + " a Zarr store"),
    ("certify-through-file", ["certify", "file.txt/x", "--local"], "dataset", "file.txt/x", THROUGH),
    ("evaluate-model-file", ["evaluate", "file.txt", "d.zarr", "--local"], "model", "file.txt",
     FILE + r" a model store"),
    ("evaluate-model-through-file", ["evaluate", "file.txt/m.zarr", "d.zarr", "--local"], "model", "file.txt/m.zarr",
     THROUGH),
    ("evaluate-data-file", ["evaluate", "run/model.zarr", "file.txt", "--local"], "dataset", "file.txt",
     FILE + " a Zarr store"),
    ("compare-file", ["compare", "run/model.zarr", "file.txt"], "model", "file.txt", FILE + r" a model store"),
    ("plot-run-file", ["plot", "file.txt"], "run", "file.txt", FILE + r" a run directory"),
    ("plot-run-through-file", ["plot", "file.txt/run"], "run", "file.txt/run", THROUGH),
    ("plot-dataset-file", ["plot", "run", "--out", "pl", "--dataset", "file.txt"], "dataset", "file.txt",
     FILE + " a Zarr store"),
    ("resume-checkpoint-file", ["fit", "d.zarr", "--out", "r", "--checkpoint", "file.txt", "--resume", *FIT],
     "--checkpoint", "file.txt", FILE + r" a checkpoint store"),
    ("checkpoint-file", ["fit", "d.zarr", "--out", "r", "--checkpoint", "file.txt", *FIT], "--checkpoint",
     "file.txt", FILE + r" a checkpoint store"),
]


@pytest.mark.parametrize("argv,option,path,says", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_path_of_the_wrong_kind_says_what_it_is(place, capfd, argv, option, path, says):
    if argv[0] in ("evaluate", "compare") or "--dataset" in argv:
        run_cli(capfd, "fit", "d.zarr", "--out", "run", *FIT)
    before = sorted(p.name for p in place.iterdir())
    r = run_cli(capfd, *argv, rc=2)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("scaleattn ")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.search(rf"error: {re.escape(option)} \S*{re.escape(path)}: {says}", lines[0]), lines[0]
    assert sorted(p.name for p in place.iterdir()) == before  # nothing written
    assert (place / "file.txt").read_text() == "not a store\n"


def test_the_library_says_it_too(place):
    from scaleattn.importers import import_arrays, import_csv
    from scaleattn.model import MHLAModel
    from scaleattn.pipeline import certify_dataset
    from scaleattn.run import read_run
    from scaleattn.statistics._container import Statistics

    for call, pattern in ((lambda: import_arrays("o.zarr", "dir"), r"dir: is a directory, expected a \.npz"),
                          (lambda: import_csv("o.zarr", "dir", length=2), r"dir: is a directory, expected a CSV"),
                          (lambda: certify_dataset("file.txt"), r"file\.txt: is a file, expected a Zarr store"),
                          (lambda: MHLAModel.load("file.txt"), r"file\.txt: is a file, expected a model store"),
                          (lambda: Statistics.load("file.txt"), r"file\.txt: is a file, expected a statistics"),
                          (lambda: read_run("file.txt/r"), r"file\.txt is a file, not a directory")):
        with pytest.raises(ParameterError, match=pattern):
            call()
    assert not (place / "o.zarr").exists()


def test_missing_paths_still_say_no_such(place, capfd):
    """The kind checks leave the messages of a path that does not exist as they were."""
    r = run_cli(capfd, "import", "o.zarr", "--npz", "dir/nope.npz", rc=2)
    assert re.search(r"dir/nope\.npz: no such file", r.stderr), r.stderr
    r = run_cli(capfd, "fit", "dir/nope.zarr", "--out", "r", *FIT, rc=2)
    assert re.search(r"nope\.zarr: no such dataset", r.stderr) and "did you mean" not in r.stderr, r.stderr
    os.makedirs("dir/data.zarr")  # a typo of a name in the folder gets the name
    r = run_cli(capfd, "fit", "dir/dta.zarr", "--out", "r", *FIT, rc=2)
    assert re.search(r"dta\.zarr: no such dataset \(did you mean \S*dir/data\.zarr\?\)", r.stderr), r.stderr
    os.rmdir("dir/data.zarr")
    np.testing.assert_equal(sorted(p.name for p in place.iterdir()), ["d.zarr", "dir", "file.txt"])


def test_a_fifo_and_a_run_directory_say_what_they_are(place, capfd):
    """A FIFO where a file is read whole (it said "no such file"), and a run directory given where its dataset
    goes (it said "not a readable Zarr group")."""
    import os

    os.mkfifo(place / "fifo")
    r = run_cli(capfd, "import", "o.zarr", "--npz", "fifo", rc=2)
    assert re.search(r"error: --npz \S*fifo: is not a regular file, expected a \.npz", r.stderr), r.stderr
    run_cli(capfd, "fit", "d.zarr", "--out", "run", *FIT)
    r = run_cli(capfd, "certify", "run", "--local", rc=2)
    assert re.search(r"error: \S*run: a run directory, not a dataset", r.stderr), r.stderr
    for args in (["evaluate", "run", "d.zarr", "--local"], ["compare", "run", "run"]):  # ... or where its model goes
        r = run_cli(capfd, *args, rc=2)
        assert re.search(r"error: \S*run: a run directory, not a model store: pass \S*run/model\.zarr$",
                         r.stderr.strip()), r.stderr
    assert not (place / "o.zarr").exists()
