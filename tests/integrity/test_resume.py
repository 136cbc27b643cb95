"""Class 4 of issue 14: a resume never mixes stale or damaged partials. Each checkpointed partial is bound to
the input rows it came from (the storage signatures and manifest checksums of its chunks), to its row count
and to its own checksum; anything that does not match is recomputed, so a resumed fit is bit-identical to an
uninterrupted fit of the data as they are now (or fails the same way)."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import zarr

from scaleattn.data._dataset import open_dataset
from scaleattn.distributed.build import compute_statistics

from .conftest import (
    FIT,
    Inputs,
    dataset,
    error_line,
    expect,
    foreign,
    rows,
    run_cli,
    run_main,
    same_stats,
    stats_of,
)


@pytest.fixture
def w(tmp_path):
    dataset(tmp_path / "own.zarr")
    tok, y = rows()
    foreign(tmp_path / "foreign.zarr", tok, y)
    return tmp_path


def _checkpoint(w, name):
    """A finished checkpoint of ``name`` (the fit's own grouping), as an interrupted fit would leave it."""
    ck = w / "ck.zarr"
    compute_statistics(open_dataset(str(w / name)), checkpoint=str(ck))
    return ck


def _resume(w, name, capsys, out="run"):
    return run_main(["fit", name, "--out", out, "--checkpoint", "ck.zarr", "--resume", "--keep-checkpoint", *FIT],
                    capsys, cwd=w)


def _report(w, out="run"):
    return json.loads((w / out / "report.json").read_text())


def _reference(w, name, capsys, out="ref"):
    rc, err = run_main(["fit", name, "--out", out, *FIT], capsys, cwd=w)
    assert rc == 0, err
    return stats_of(w / out)


@pytest.mark.slow
def test_foreign_store_edited_in_place_recomputes_the_changed_group(w, capsys):
    _checkpoint(w, "foreign.zarr")
    g = zarr.open_group(str(w / "foreign.zarr"), mode="r+")
    g["tokens"][8:16] = np.asarray(g["tokens"][8:16]) * 2.0  # same shape and keys: only its content changed
    rc, err = _resume(w, "foreign.zarr", capsys)
    assert rc == 0, err
    rep = _report(w)
    assert (rep["groups_resumed"], rep["groups_computed"]) == (12, 4)  # the 4 groups of 2 samples in [8, 16)
    same_stats(stats_of(w / "run"), _reference(w, "foreign.zarr", capsys))


def test_own_store_edited_behind_its_manifest_fails_as_an_uninterrupted_fit_does(w, capsys):
    _checkpoint(w, "own.zarr")
    g = zarr.open_group(str(w / "own.zarr"), mode="r+")
    g["tokens"][8:16] = np.asarray(g["tokens"][8:16]) + 1.0
    inputs = Inputs(w / "own.zarr")
    rc, err = _resume(w, "own.zarr", capsys)
    assert rc == 2
    line = error_line(err)
    expect(line, r"tokens: samples \[8, 16\) of \S*own\.zarr: the values do not match the checksum recorded")
    expect(line, r"the checkpoint \S*ck\.zarr keeps 15 of 16 row groups: repeat the fit with --resume")
    rc, err = run_main(["fit", "own.zarr", "--out", "ref", *FIT], capsys, cwd=w)
    assert rc == 2 and "tokens: samples [8, 16)" in error_line(err)
    inputs.unchanged()


@pytest.mark.slow
def test_regenerated_dataset_is_never_mixed_in(w, capsys):
    _checkpoint(w, "own.zarr")
    dataset(w / "own.zarr", seed=2, overwrite=True)  # same shape, new content (and uid)
    rc, err = _resume(w, "own.zarr", capsys)
    assert rc == 2
    expect(error_line(err), r"checkpoint \S*ck\.zarr' was made by a different build \(dataset_fingerprint")


def _drop_partial(w, gi):
    """Remove a finished partial's data but leave its done flag (as a lost chunk or a stray flag would)."""
    ck = w / "ck.zarr"
    for rel in (f"gram_compact/c/{gi}/0/0", f"moments/c/{gi}/0/0", f"yy/c/{gi}"):
        os.remove(ck / rel)


def _flip(p):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 1
    p.write_bytes(bytes(b))


DAMAGE = {
    "partial-chunk-deleted": lambda w: os.remove(w / "ck.zarr/gram_compact/c/2/0/0"),
    "done-flag-without-partial": lambda w: _drop_partial(w, 1),
    "partial-bit-flipped": lambda w: _flip(w / "ck.zarr/moments/c/3/0/0"),
    "partial-values-edited": lambda w: zarr.open_group(str(w / "ck.zarr"), mode="r+")["yy"].__setitem__(0, 1e9),
    "row-count-edited": lambda w: zarr.open_group(str(w / "ck.zarr"), mode="r+")["n_rows"].__setitem__((2, 0), 7),
    "checksum-forged": lambda w: zarr.open_group(str(w / "ck.zarr"), mode="r+")["checksum"].__setitem__((1, 0), 5),
    "source-forged": lambda w: zarr.open_group(str(w / "ck.zarr"), mode="r+")["source"].__setitem__((0, 0), 5),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.slow
def test_damaged_partials_are_recomputed_bit_identically(w, damage, capsys):
    _checkpoint(w, "own.zarr")
    DAMAGE[damage](w)
    inputs = Inputs(w / "own.zarr")
    rc, err = _resume(w, "own.zarr", capsys)
    assert rc == 0, err
    rep = _report(w)
    assert rep["groups_computed"] == 1 and rep["groups_resumed"] == 15
    same_stats(stats_of(w / "run"), _reference(w, "own.zarr", capsys))
    inputs.unchanged()


def test_old_checkpoints_are_refused_clearly(w, capsys):
    ck = _checkpoint(w, "own.zarr")
    zarr.open_group(str(ck), mode="r+").attrs["format_version"] = 1
    rc, err = _resume(w, "own.zarr", capsys)
    assert rc == 2
    expect(error_line(err), r"checkpoint \S*ck\.zarr' was written by an older scaleattn \(format v1.*cannot be"
                            r" verified")
    assert os.path.exists(ck)  # never removed without --overwrite


@pytest.mark.slow
def test_killed_fit_resumes_bit_identically_after_its_stale_lock(w):
    """A fit killed after 2 of 16 groups (no cleanup: its lock file stays) is resumed by the next run, which
    takes over the dead process's lock, and gives the statistics of an uninterrupted fit."""
    args = ["fit", "own.zarr", "--out", "run", *FIT]
    r = run_cli(args, cwd=w, env={"SCALEATTN_TEST_STOP_AFTER_GROUPS": "2"})
    assert r.returncode == 75, r.stderr
    assert (w / ".run.lock").exists() and (w / "run.checkpoint.zarr").exists()
    r = run_cli(args + ["--resume", "--json"], cwd=w)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["groups_resumed"], rep["groups_computed"]) == (2, 14)
    ref = w / "ref"
    shutil.copytree(w / "own.zarr", w / "copy.zarr")
    assert run_cli(["fit", "copy.zarr", "--out", ref, *FIT], cwd=w).returncode == 0
    same_stats(stats_of(w / "run"), stats_of(ref))
    assert sorted(os.listdir(w)) == ["copy.zarr", "foreign.zarr", "own.zarr", "ref", "run"]
