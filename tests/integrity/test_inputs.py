"""Class 1 of issue 14: inputs are never deleted or written into. Every output, checkpoint, temporary or
``--overwrite`` target that is, contains or lies inside an input (after ``.``, ``..``, trailing slashes,
symlinks) is refused with exit 2 before anything is written or removed; ``--overwrite`` replaces only what
scaleattn wrote. Through the real CLI (in process), with every input store hashed before and after."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from scaleattn.store._location import Location
from scaleattn.store._outputs import relation

from .conftest import FIT, Inputs, dataset, error_line, expect, foreign, rows, run_main, tree_hash


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """d.zarr (scaleattn), run/ (a finished fit of it), in.npz, data.csv."""
    from scaleattn.cli import main

    b = tmp_path_factory.mktemp("inputs")
    dataset(b / "d.zarr")
    assert main(["fit", str(b / "d.zarr"), "--out", str(b / "run"), *FIT]) == 0
    tok, y = rows(causal=False)
    np.savez(b / "in.npz", tokens=tok, targets=y)
    (b / "data.csv").write_text("a,b\n" + "".join(f"{i},{i * i % 7}\n" for i in range(40)))
    return b


def _setup(w, case):
    if case in ("out-symlink-to-dataset",):
        os.symlink(w / "d.zarr", w / "link")
    if case == "dataset-via-symlink":
        os.symlink(w / "d.zarr", w / "alias.zarr")
    if case == "out-symlinked-parent":
        os.symlink(w, w / "here")
    if case.endswith("foreign-dir") or case == "generate-over-foreign":
        (w / "foreign").mkdir()
        (w / "foreign" / "notes.txt").write_text("precious")
    if case == "out-foreign-file":
        (w / "foreign").write_text("precious")
    if case in ("out-foreign-zarr", "generate-over-foreign-zarr"):
        foreign(w / "foreign", *rows())
    if case == "ckpt-default-foreign":
        (w / "new.checkpoint.zarr").mkdir()
        (w / "new.checkpoint.zarr" / "notes.txt").write_text("precious")
    if case == "run-plus-user-file":
        (w / "run" / "notes.txt").write_text("my notes about this run")
    if case == "dotdot":
        (w / "sub").mkdir()
    if case == "dataset-named-like-a-temporary":
        shutil.copytree(w / "d.zarr", w / ".new.partial-0badc0de")
    if case == "npz-named-like-the-lock":
        shutil.copy(w / "in.npz", w / ".o.zarr.lock")
    if case == "user-file-where-the-lock-goes":
        (w / ".new.lock").write_text("my shopping list")
    if case == "dataset-named-like-the-lock":
        shutil.copytree(w / "d.zarr", w / ".new.lock")
    user_files = {"run-user-folder-named-like-a-plot": "run/figs.png/thesis.tex",
                  "run-user-image-named-like-a-plot": "run/spectrum.png",
                  "run-user-file-named-like-a-lock": "run/.mynotes.lock",
                  "run-user-file-named-like-a-temporary": "run/draft.partial-1.txt",
                  "run-store-holds-a-user-file": "run/model.zarr/README.txt",
                  "dataset-holds-a-user-file": "d.zarr/notes.txt",
                  "plot-over-a-user-image": "figs/spectrum.png"}
    if case in user_files:
        (w / user_files[case]).parent.mkdir(exist_ok=True)
        (w / user_files[case]).write_text("the user's own")
    if case == "plot-into-another-run":
        shutil.copytree(w / "run", w / "run2")
    if case == "dotdot-after-a-symlink":  # the OS reads sym/../d.zarr as a/d.zarr, which does not exist
        (w / "a" / "b").mkdir(parents=True)
        os.symlink(w / "a" / "b", w / "sym")


FIT_D = ["fit", "d.zarr"]
CASES = [
    # (id, argv, expected message, inputs hashed)
    ("out-is-dataset", FIT_D + ["--out", "d.zarr", "--overwrite"], r"--out \S*/d\.zarr is the input dataset"),
    ("out-is-dataset-trailing-slash", FIT_D + ["--out", "d.zarr/", "--overwrite"], r"--out \S*d\.zarr is the input"),
    ("out-is-dataset-dot", FIT_D + ["--out", "./d.zarr/.", "--overwrite"], r"is the input dataset"),
    ("dotdot", FIT_D + ["--out", "sub/../d.zarr", "--overwrite"], r"is the input dataset"),
    ("out-is-parent", FIT_D + ["--out", ".", "--overwrite"], r"--out \S+ contains the input dataset \S*d\.zarr"),
    ("out-inside", FIT_D + ["--out", "d.zarr/run"], r"--out \S*d\.zarr/run lies inside the input dataset"),
    ("out-inside-array", FIT_D + ["--out", "d.zarr/tokens/x", "--overwrite"], r"lies inside the input dataset"),
    ("out-symlink-to-dataset", FIT_D + ["--out", "link", "--overwrite"], r"--out \S*link is the input dataset"),
    ("dataset-via-symlink", ["fit", "alias.zarr", "--out", "d.zarr", "--overwrite"], r"is the input dataset"),
    ("out-symlinked-parent", FIT_D + ["--out", "here", "--overwrite"], r"contains the input dataset"),
    ("ckpt-is-dataset", FIT_D + ["--out", "new", "--checkpoint", "d.zarr", "--overwrite"],
     r"--checkpoint \S*d\.zarr is the input dataset"),
    ("ckpt-inside-dataset", FIT_D + ["--out", "new", "--checkpoint", "d.zarr/ck.zarr"],
     r"--checkpoint \S*d\.zarr/ck\.zarr lies inside the input dataset"),
    ("ckpt-contains-dataset", FIT_D + ["--out", "new", "--checkpoint", ".", "--overwrite"],
     r"--checkpoint \S+ contains the input dataset"),
    ("ckpt-is-out", FIT_D + ["--out", "new", "--checkpoint", "new"], r"--checkpoint \S*new is the output --out"),
    ("ckpt-inside-out", FIT_D + ["--out", "new", "--checkpoint", "new/ck.zarr"], r"lies inside the output --out"),
    ("dataset-named-like-a-temporary", ["fit", ".new.partial-0badc0de", "--out", "new"],
     r"--out \S*new: the input dataset \S*\.new\.partial-0badc0de is named like the lock or a temporary"),
    ("dataset-named-like-the-lock", ["fit", ".new.lock", "--out", "new"], r"is named like the lock or a temporary"),
    ("npz-named-like-the-lock", ["import", "o.zarr", "--npz", ".o.zarr.lock"], r"is named like the lock"),
    ("user-file-where-the-lock-goes", FIT_D + ["--out", "new"],
     r"--out \S*new: \S*\.new\.lock exists and is not a scaleattn lock; move it away"),
    ("out-foreign-dir", FIT_D + ["--out", "foreign", "--overwrite"],
     r"--out \S*foreign exists and was not written by scaleattn \(it holds 'notes\.txt'"),
    ("out-foreign-file", FIT_D + ["--out", "foreign", "--overwrite"], r"not written by scaleattn \(it is a file\)"),
    ("out-foreign-zarr", FIT_D + ["--out", "foreign", "--overwrite"], r"was not written by scaleattn"),
    ("ckpt-foreign-dir", FIT_D + ["--out", "new", "--checkpoint", "foreign", "--overwrite"],
     r"--checkpoint \S*foreign exists and was not written by scaleattn"),
    ("ckpt-default-foreign", FIT_D + ["--out", "new", "--overwrite"],
     r"--checkpoint \S*new\.checkpoint\.zarr exists and was not written by scaleattn"),
    ("run-plus-user-file", FIT_D + ["--out", "run", "--overwrite"], r"it holds 'notes\.txt', which scaleattn did not"),
    ("import-over-its-npz", ["import", "in.npz", "--npz", "in.npz", "--overwrite"],
     r"output \S*in\.npz is the input file"),
    ("import-over-its-csv", ["import", "data.csv", "--csv", "data.csv", "--length", "4", "--overwrite"],
     r"output \S*data\.csv is the input file"),
    ("generate-over-foreign", ["generate", "mhla", "foreign", "--samples", "4", "--length", "3", "--overwrite"],
     r"output \S*foreign exists and was not written by scaleattn"),
    ("generate-over-foreign-zarr", ["generate", "mhla", "foreign", "--samples", "4", "--length", "3", "--overwrite"],
     r"was not written by scaleattn"),
    ("plot-into-dataset", ["plot", "run", "--dataset", "d.zarr", "--out", "d.zarr/plots"],
     r"--out \S*d\.zarr/plots lies inside the input dataset"),
    ("plot-into-dataset-itself", ["plot", "run", "--dataset", "d.zarr", "--out", "d.zarr"],
     r"--out \S*d\.zarr is the input dataset"),
    ("plot-into-another-store", ["plot", "run", "--out", "d.zarr/plots"],
     r"--out \S*d\.zarr/plots lies inside the Zarr store \S*d\.zarr"),
    ("generate-inside-a-store", ["generate", "mhla", "d.zarr/x.zarr", "--samples", "4", "--length", "3"],
     r"output \S*x\.zarr lies inside the Zarr store \S*d\.zarr"),
    ("plot-into-model", ["plot", "run", "--out", "run/model.zarr"], r"--out \S*model\.zarr is the input model\.zarr"),
    # --overwrite and plots replace only what scaleattn wrote, whatever the user's file is named
    ("run-user-folder-named-like-a-plot", FIT_D + ["--out", "run", "--overwrite"],
     r"it holds 'figs\.png', which is not a plot scaleattn drew"),
    ("run-user-image-named-like-a-plot", FIT_D + ["--out", "run", "--overwrite"],
     r"it holds 'spectrum\.png', which is not a plot scaleattn drew"),
    ("run-user-file-named-like-a-lock", FIT_D + ["--out", "run", "--overwrite"],
     r"it holds '\.mynotes\.lock', which scaleattn did not write"),
    ("run-user-file-named-like-a-temporary", FIT_D + ["--out", "run", "--overwrite"],
     r"it holds 'draft\.partial-1\.txt', which scaleattn did not write"),
    ("run-store-holds-a-user-file", FIT_D + ["--out", "run", "--overwrite"],
     r"its model\.zarr holds 'README\.txt', which is not part of a Zarr store"),
    ("dataset-holds-a-user-file", ["generate", "mhla", "d.zarr", "--samples", "4", "--length", "3", "--overwrite"],
     r"output \S*d\.zarr exists and was not written by scaleattn \(it holds 'notes\.txt', which is not part of a"),
    ("plot-over-a-user-image", ["plot", "run", "--out", "figs"],
     r"\S*figs/spectrum\.png exists and is not a plot scaleattn drew: not replaced"),
    ("plot-into-another-run", ["plot", "run", "--out", "run2"],
     r"--out \S*run2 is a run directory: this command adds files into its --out"),
    ("checkpoint-inside-a-run", FIT_D + ["--out", "new", "--checkpoint", "run/ck.zarr"],
     r"--checkpoint \S*run/ck\.zarr lies inside the run directory \S*run, which holds only its own"),
    ("out-inside-a-run", FIT_D + ["--out", "run/sub"], r"--out \S*run/sub lies inside the run directory"),
    ("bench-into-a-run", ["bench", "--quick", "--out", "run"], r"--out \S*run is a run directory"),
    ("generate-inside-a-run", ["generate", "mhla", "run/d2.zarr", "--samples", "4", "--length", "3"],
     r"output \S*run/d2\.zarr lies inside the run directory"),
    ("dotdot-after-a-symlink", ["fit", "sym/../d.zarr", "--out", "new"], r"\S*/a/d\.zarr"),
]


@pytest.mark.parametrize("case, argv, pattern", CASES, ids=[c[0] for c in CASES])
def test_input_is_never_written_or_removed(case, argv, pattern, base, tmp_path, capsys):
    w = tmp_path / "w"
    shutil.copytree(base, w, symlinks=True)
    _setup(w, case)
    names = sorted(os.listdir(w))
    inputs = Inputs(*(w / n for n in names if not (w / n).is_symlink() and n not in ("sub",)))
    args = argv + (FIT if argv[0] == "fit" else [])
    rc, err = run_main(args, capsys, cwd=w)
    assert rc == 2, err
    expect(error_line(err), pattern)
    inputs.unchanged()
    assert sorted(os.listdir(w)) == names, "something was created or left next to the inputs"


@pytest.mark.slow
def test_overwrite_replaces_our_own_outputs(base, tmp_path, capsys):
    """The positive controls: a run directory, a dataset and a checkpoint scaleattn wrote are replaced."""
    w = tmp_path / "w"
    shutil.copytree(base, w)
    before = tree_hash(w / "run")
    rc, err = run_main(["fit", "d.zarr", "--out", "run", "--overwrite", *FIT], capsys, cwd=w)
    assert rc == 0, err
    assert tree_hash(w / "run").keys() == before.keys()
    rc, err = run_main(["generate", "mhla", "d.zarr", "--samples", "8", "--length", "3", "--overwrite"], capsys, cwd=w)
    assert rc == 0, err
    rc, err = run_main(["plot", "run"], capsys, cwd=w)  # plots into the run directory itself: fine
    assert rc == 0, err
    for _ in range(2):  # its plots are scaleattn's: redrawn, and replaced with the run
        rc, err = run_main(["plot", "run"], capsys, cwd=w)
        assert rc == 0, err
    rc, err = run_main(["fit", "d.zarr", "--out", "run", "--overwrite", *FIT], capsys, cwd=w)
    assert rc == 0, err
    assert sorted(os.listdir(w)) == sorted(os.listdir(base))  # no lock, no temporary left


@pytest.mark.parametrize("out, inp, rel", [
    ("s3://b/d.zarr", "s3://b/d.zarr", "is"), ("s3://b/d.zarr/", "s3://b/d.zarr", "is"),
    ("s3://b/x/../d.zarr", "s3://b/d.zarr", "is"), ("s3a://b/d.zarr", "s3://b/d.zarr", "is"),
    ("s3://b/d.zarr/run", "s3://b/d.zarr", "lies inside"), ("s3://b", "s3://b/d.zarr", "contains"),
    ("s3://b/runs", "s3://b/d.zarr", None), ("s3://b/d.zarr2", "s3://b/d.zarr", None),
    ("s3://other/d.zarr", "s3://b/d.zarr", None), ("/b/d.zarr", "s3://b/d.zarr", None),
])
def test_object_store_outputs_are_compared_by_prefix(out, inp, rel):
    assert relation(Location(out.rstrip("/") if out.endswith("/") else out), Location(inp)) == rel


@pytest.mark.parametrize("spelling", ["FILE:///{p}", "File:///{p}", "file:/{p}", "file://localhost/{p}"])
def test_file_uris_name_the_local_path_in_any_spelling(spelling, tmp_path, capsys):
    """Schemes are case-insensitive (RFC 3986) and ``file:/x``, ``file://localhost/x`` are local paths (RFC 8089):
    each spelling of an input's own path is refused as an output that is the input (fsspec read them as
    ``./FILE:/...``, ``./localhost/...`` or an unknown protocol), and ``S3://`` is ``s3://``."""
    from scaleattn.store._location import resolve

    src = tmp_path / "in.zarr"
    dataset(src)
    assert resolve(spelling.format(p=str(src).lstrip("/"))).url == str(src)
    assert resolve("S3://bucket/d.zarr").url == "s3://bucket/d.zarr"
    inputs = Inputs(src)
    rc, err = run_main(["fit", src, "--out", spelling.format(p=str(src).lstrip("/")), *FIT], capsys, cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), r"is the input|lies inside|--out .* is the")
    inputs.unchanged()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr"]


@pytest.mark.parametrize("argv, victim, pattern", [
    (["fit", "f.zarr", "--out", "r2", "--checkpoint", "d.zarr", "--overwrite", *FIT], "d.zarr",
     r"--checkpoint .*d\.zarr is a dataset store, not a checkpoint store"),
    (["fit", "f.zarr", "--out", "d.zarr", "--overwrite", *FIT], "d.zarr",
     r"--out .*d\.zarr is a dataset store, not a run directory"),
    (["fit", "f.zarr", "--out", "run/model.zarr", "--overwrite", *FIT], "run",
     r"--out .*model\.zarr lies inside the run directory \S*run"),
    (["fit", "f.zarr", "--out", "r2", "--checkpoint", "run", "--overwrite", *FIT], "run",
     r"--checkpoint .*run is a run directory, not a checkpoint store"),
    (["generate", "mhla", "run/model.zarr", "--samples", "8", "--length", "3", "--overwrite"], "run",
     r"output .*model\.zarr lies inside the run directory \S*run"),
    (["generate", "mhla", "run", "--samples", "8", "--length", "3", "--overwrite"], "run",
     r"output .*run is a run directory, not a dataset store"),
])
def test_overwrite_replaces_only_an_output_of_the_same_kind(argv, victim, pattern, tmp_path, capsys):
    """``--overwrite`` never deletes a scaleattn output of another kind given in the wrong place (a dataset as
    the checkpoint: it was deleted, and the checkpoint after it, exit 0)."""
    w = tmp_path / "w"
    w.mkdir()
    dataset(w / "d.zarr")
    tok, y = rows()
    foreign(w / "f.zarr", tok, y)
    rc, err = run_main(["fit", "f.zarr", "--out", "run", *FIT], capsys, cwd=w)
    assert rc == 0, err
    names, before = sorted(os.listdir(w)), tree_hash(w / victim)
    rc, err = run_main(argv, capsys, cwd=w)
    assert rc == 2, err
    expect(error_line(err), pattern)
    assert tree_hash(w / victim) == before and sorted(os.listdir(w)) == names
