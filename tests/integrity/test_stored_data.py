"""Classes 2 and 3 of issue 14: absent chunks are never read as zeros, and corruption is detected.

Stores scaleattn writes carry a manifest (shape and crc32c of every chunk of rows) and the crc32c codec;
stores of other tools are checked for absent chunks, with ``--absent-chunks-are-fill`` as the explicit opt-in.
Every case through the real CLI, input hashes unchanged, nothing written."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import zarr

from .conftest import (
    FIT,
    Inputs,
    dataset,
    error_line,
    expect,
    foreign,
    rows,
    run_main,
    same_stats,
    stats_of,
    swap_chunk,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    b = tmp_path_factory.mktemp("stored")
    dataset(b / "own.zarr")  # 32 samples, chunks of 8, causal
    dataset(b / "lens.zarr", variable_lengths=True, causal=True)
    tok, y = rows()
    foreign(b / "foreign.zarr", tok, y)
    dataset(b / "sharded.zarr")  # replaced below by a sharded copy
    from scaleattn.data._writer import write_dataset

    shutil.rmtree(b / "sharded.zarr")
    write_dataset(b / "sharded.zarr", tok, y, chunk_samples=4, shard_samples=8)
    from scaleattn.cli import main

    assert main(["fit", str(b / "own.zarr"), "--out", str(b / "run"), *FIT]) == 0
    return b


def _flip(path, byte=None):
    b = bytearray(path.read_bytes())
    i = len(b) // 2 if byte is None else byte
    b[i] ^= 0x10
    path.write_bytes(bytes(b))


def _shape(path, n):
    meta = json.loads(path.read_text())
    meta["shape"][0] = n
    path.write_text(json.dumps(meta))


def _delete(rel):
    return lambda w: os.remove(w / rel)


def _edit(rel, fn):
    return lambda w: fn(w / rel)


CASES = [
    # (id, damage(w), argv, expected message)
    ("own-tokens-chunk-deleted", _delete("own.zarr/tokens/c/2/0/0"), ["fit", "own.zarr"],
     r"tokens: chunks of samples \[16, 24\) \(8 samples\) are missing from \S*own\.zarr"),
    ("own-targets-chunk-deleted", _delete("own.zarr/targets/c/3/0/0"), ["fit", "own.zarr"],
     r"targets: chunks of samples \[24, 32\) .* are missing"),
    ("own-lengths-chunk-deleted", _delete("lens.zarr/lengths/c/1"), ["fit", "lens.zarr"],
     r"lengths: chunks of samples \[8, 16\) .* are missing"),
    ("own-chunk-deleted-certify", _delete("own.zarr/tokens/c/0/0/0"), ["certify", "own.zarr", "--local", "--quiet"],
     r"tokens: chunks of samples \[0, 8\)"),
    ("own-chunk-deleted-evaluate", _delete("own.zarr/targets/c/1/0/0"),
     ["evaluate", "run/model.zarr", "own.zarr", "--local", "--quiet"], r"targets: chunks of samples \[8, 16\)"),
    ("own-chunk-deleted-despite-fill-flag", _delete("own.zarr/tokens/c/2/0/0"),
     ["fit", "own.zarr", "--absent-chunks-are-fill"], r"tokens: chunks of samples \[16, 24\) .* scaleattn wrote"),
    ("own-shape-enlarged", lambda w: (_shape(w / "own.zarr/tokens/zarr.json", 40),
                                      _shape(w / "own.zarr/targets/zarr.json", 40)), ["fit", "own.zarr"],
     r"tokens: shape \(40, 6, 2\) .* differs from the shape \(32, 6, 2\) written .*samples \[32, 40\) were never"),
    ("own-shape-shrunk", lambda w: (_shape(w / "own.zarr/tokens/zarr.json", 24),
                                    _shape(w / "own.zarr/targets/zarr.json", 24)), ["fit", "own.zarr"],
     r"tokens: shape \(24, 6, 2\) .* differs from the shape \(32, 6, 2\) written"),
    ("own-manifest-damaged", lambda w: _attr(w / "own.zarr/zarr.json", "manifest", {"arrays": 3}), ["fit", "own.zarr"],
     r"attribute 'manifest' is damaged"),
    ("own-manifest-removed", lambda w: _attr(w / "own.zarr/zarr.json", "manifest", None), ["fit", "own.zarr"],
     r"own\.zarr: a scaleattn v2 dataset without its manifest"),
    ("unfinished-write", lambda w: _unfinished(w / "own.zarr"), ["fit", "own.zarr"],
     r"own\.zarr: an unfinished dataset \(its writer stopped before it was complete\)"),
    ("own-chunk-replaced-by-another",
     lambda w: shutil.copy(w / "own.zarr/tokens/c/0/0/0", w / "own.zarr/tokens/c/1/0/0"),
     ["fit", "own.zarr"], r"tokens: samples \[8, 16\) of \S*own\.zarr: the values do not match the checksum"),
    ("foreign-tokens-chunk-deleted", _delete("foreign.zarr/tokens/c/1/0/0"), ["fit", "foreign.zarr"],
     r"tokens: no chunk stored for samples \[8, 16\) \(8 of 32 samples\) .*fill value 0\.0.*--absent-chunks-are-fill"),
    ("foreign-targets-chunk-deleted", _delete("foreign.zarr/targets/c/3/0/0"), ["fit", "foreign.zarr"],
     r"targets: no chunk stored for samples \[24, 32\)"),
    ("foreign-shape-enlarged", lambda w: (_shape(w / "foreign.zarr/tokens/zarr.json", 48),
                                          _shape(w / "foreign.zarr/targets/zarr.json", 48)), ["fit", "foreign.zarr"],
     r"tokens: no chunk stored for samples \[32, 48\)"),
    ("foreign-shape-shrunk", lambda w: (_shape(w / "foreign.zarr/tokens/zarr.json", 16),
                                        _shape(w / "foreign.zarr/targets/zarr.json", 16)), ["fit", "foreign.zarr"],
     r"tokens: 2 stored chunk\(s\) lie beyond the shape \(16, 6, 2\)"),
    ("foreign-absent-certify", _delete("foreign.zarr/tokens/c/0/0/0"), ["certify", "foreign.zarr", "--local"],
     r"tokens: no chunk stored for samples \[0, 8\)"),
    # class 3: a flipped bit in any stored chunk fails the read
    ("bitflip-tokens", _edit("own.zarr/tokens/c/2/0/0", _flip), ["fit", "own.zarr"],
     r"tokens: samples \[16, 24\) of \S*own\.zarr are damaged: a stored chunk fails its crc32c checksum"),
    ("bitflip-targets", _edit("own.zarr/targets/c/0/0/0", _flip), ["fit", "own.zarr"],
     r"targets: samples \[0, 8\) of \S*own\.zarr are damaged"),
    ("bitflip-lengths", _edit("lens.zarr/lengths/c/3", _flip), ["fit", "lens.zarr"],
     r"lengths: samples \[24, 32\) .*damaged"),
    ("bitflip-shard", _edit("sharded.zarr/tokens/c/1/0/0", _flip), ["fit", "sharded.zarr"],
     r"tokens: samples \[\d+, \d+\) of \S*sharded\.zarr are damaged"),
    ("bitflip-shard-index", _edit("sharded.zarr/tokens/c/2/0/0", lambda p: _flip(p, -3)), ["fit", "sharded.zarr"],
     r"tokens: .*sharded\.zarr"),
    ("bitflip-model", _edit("run/model.zarr/coef/c/0/0", _flip), ["evaluate", "run/model.zarr", "own.zarr", "--local"],
     r"coef in \S*model\.zarr: a stored chunk fails its crc32c checksum"),
    ("model-chunk-deleted", _delete("run/model.zarr/coef/c/0/0"), ["evaluate", "run/model.zarr", "own.zarr", "--local"],
     r"coef in \S*model\.zarr: no chunk stored for rows \[0, 6\)"),
    ("teacher-chunk-deleted", _delete("own.zarr/teacher/V/c/0/0/0"), ["fit", "own.zarr"],
     r"teacher/V in \S*own\.zarr: the values do not match"),
    # class 8: attribute types
    ("causal-as-string", lambda w: _attr(w / "foreign.zarr/zarr.json", "causal", "false"), ["fit", "foreign.zarr"],
     r"attribute 'causal' must be true or false, got 'false' \(str\)"),
    ("causal-contradicts-targets", lambda w: _attr(w / "foreign.zarr/zarr.json", "causal", False),
     ["fit", "foreign.zarr"],
     r"attribute 'causal' is false but the targets are \(sample, position, output\)"),
    ("model-d-as-string", lambda w: _attr(w / "run/model.zarr/zarr.json", "d", "2"),
     ["evaluate", "run/model.zarr", "own.zarr", "--local"],
     r"model\.zarr: attribute 'd' is \"2\", not the value written \(manifest\)"),
    ("model-causal-as-string", lambda w: _attr(w / "run/model.zarr/zarr.json", "causal", "true"),
     ["evaluate", "run/model.zarr", "own.zarr", "--local"],
     r"model\.zarr: attribute 'causal' is \"true\", not the value written"),
    ("dataset-from-the-future", lambda w: _attr(w / "own.zarr/zarr.json", "format_version", 9), ["fit", "own.zarr"],
     r"scaleattn dataset format v9"),
]


def _attr(path, key, value):
    meta = json.loads(path.read_text())
    if value is None:
        del meta["attributes"][key]
    else:
        meta["attributes"][key] = value
    path.write_text(json.dumps(meta))


def _unfinished(path):
    """A dataset whose writer (create_dataset + write_block) stopped before finish_dataset, as a killed
    in-place write to an object store leaves it."""
    from scaleattn.data._writer import create_dataset, write_block
    from scaleattn.store._location import resolve

    shutil.rmtree(path)
    g = create_dataset(resolve(path), 32, 6, 2, 2, causal=True, chunk_samples=8)
    tok, y = rows()
    write_block(g, 0, tok[:16], y[:16])


@pytest.mark.parametrize("case, damage, argv, pattern", CASES, ids=[c[0] for c in CASES])
def test_damaged_stores_are_refused(case, damage, argv, pattern, base, tmp_path, capsys):
    w = tmp_path / "w"
    shutil.copytree(base, w)
    damage(w)
    names = sorted(os.listdir(w))
    inputs = Inputs(*(w / n for n in names))
    args = argv + (["--out", "new", *FIT] if argv[0] == "fit" else ["--quiet"] if "--quiet" not in argv else [])
    rc, err = run_main(args, capsys, cwd=w)
    assert rc == 2, err
    expect(error_line(err), pattern)
    inputs.unchanged()
    assert sorted(os.listdir(w)) == names  # no output, no checkpoint, no lock left


@pytest.mark.slow
def test_absent_chunks_are_the_fill_value_only_when_asked(base, tmp_path, capsys):
    """A foreign store whose writer skipped a chunk: with the opt-in the fit is bit-identical to the fit of the
    same data with that chunk stored as zeros."""
    w = tmp_path / "w"
    w.mkdir()
    tok, y = rows()
    tok[8:16] = 0.0
    y[8:16] = 0.0
    foreign(w / "skipped.zarr", tok, y)  # zarr skips all-zero chunks itself
    assert not (w / "skipped.zarr/tokens/c/1/0/0").exists()
    g = zarr.open_group(str(w / "full.zarr"), mode="w", zarr_format=3)
    for name, a in (("tokens", tok), ("targets", y)):
        arr = g.create_array(name, shape=a.shape, chunks=(8,) + a.shape[1:], dtype="f8",
                             config={"write_empty_chunks": True})
        arr[...] = a
    assert (w / "full.zarr/tokens/c/1/0/0").exists()
    inputs = Inputs(w / "skipped.zarr", w / "full.zarr")
    rc, err = run_main(["fit", "skipped.zarr", "--out", "a", *FIT], capsys, cwd=w)
    assert rc == 2 and "no chunk stored for samples [8, 16)" in error_line(err)
    rc, err = run_main(["fit", "skipped.zarr", "--out", "a", "--absent-chunks-are-fill", *FIT], capsys, cwd=w)
    assert rc == 0, err
    rc, err = run_main(["fit", "full.zarr", "--out", "b", *FIT], capsys, cwd=w)
    assert rc == 0, err
    same_stats(stats_of(w / "a"), stats_of(w / "b"))
    inputs.unchanged()


def test_stores_we_write_use_crc32c_and_keep_every_chunk(base):
    for store in ("own.zarr", "run/model.zarr", "run/stats.zarr", "run/spectrum.zarr"):
        g = zarr.open_group(str(base / store), mode="r")
        assert g.attrs["format_version"] == (2 if store == "own.zarr" else 3) and "manifest" in g.attrs
        for _, a in g.arrays():
            assert "crc32c" in json.dumps(a.metadata.to_dict()["codecs"]), (store, a.name)
    g = zarr.open_group(str(base / "sharded.zarr"), mode="r")
    assert "crc32c" in json.dumps(g["tokens"].metadata.to_dict()["codecs"])


def test_all_zero_chunks_of_our_datasets_are_stored(tmp_path):
    from scaleattn.data._dataset import open_dataset
    from scaleattn.data._writer import write_dataset

    tok, y = rows()
    tok[:8], y[:8] = 0.0, 0.0
    ds = write_dataset(tmp_path / "z.zarr", tok, y, chunk_samples=8)
    assert (tmp_path / "z.zarr/tokens/c/0/0/0").exists()
    assert open_dataset(ds.url).read(0, 8)[0].sum() == 0


def test_crc32c_streams_and_equals_the_checksum_of_the_whole_bytes():
    """The manifest checksum is taken in 16 MB pieces (a whole-array copy doubled the peak memory of a d = 44
    fit while it wrote stats.zarr) and equals crc32c of the array's little-endian bytes, empty and big-endian
    arrays included."""
    import google_crc32c
    import numpy as np

    from scaleattn.store._integrity import crc32c

    rng = np.random.default_rng(0)
    for a in (rng.standard_normal((3000, 1000)), np.zeros((0, 5)), rng.standard_normal(7).astype(">f8"),
              rng.standard_normal((40, 30))[:, ::3]):
        want = f"{google_crc32c.value(np.ascontiguousarray(a).astype('<f8').tobytes()):08x}"
        assert crc32c(a) == want


@pytest.mark.parametrize("when,argv", [("evaluate", []), ("compute_r", ["--certificate", "qr", "--no-exact-mse"])])
@pytest.mark.parametrize("change", ["chunk", "append"])
def test_an_input_changed_after_the_build_is_refused_by_the_later_pass(when, argv, change, tmp_path, capsys,
                                                                        monkeypatch):
    """A store of another tool (no manifest) changed between the statistics build and a later pass over its rows
    (the exact training MSE, the QR certificate): the fit must not report numbers of two versions of the data
    (it did, with exit 0). One line, exit 2, nothing written."""
    import numpy as np

    import scaleattn.pipeline as pipeline

    tok, y = rows(n=32)
    src = tmp_path / "in.zarr"
    foreign(src, tok, y)
    other = np.random.default_rng(9).standard_normal(tok.shape)

    def edit():
        g = zarr.open_group(str(src), mode="r+")
        if change == "chunk":  # one chunk of rows rewritten with other values
            g["tokens"][8:16] = other[8:16]
        else:  # samples appended
            g["tokens"].append(other[:8])
            g["targets"].append(y[:8])

    orig = getattr(pipeline, when)

    def edited_first(*a, **k):
        edit()
        return orig(*a, **k)

    monkeypatch.setattr(pipeline, when, edited_first)
    rc, err = run_main(["fit", src, "--out", tmp_path / "run", "--local", "--quiet", "--no-plots", *argv], capsys)
    assert rc == 2
    # found by the pass's first read: a rewritten chunk by its objects' signatures, appended samples by the
    # array's metadata (its shape)
    expect(error_line(err), r"host \S+: tokens: the stored chunks of samples \[8, 16\) of \S+in\.zarr differ from"
                            r" those checked when the job opened it" if change == "chunk" else
                            r"host \S+: tokens: the metadata of \S+in\.zarr that zarr decodes samples \[0, \d+\) with"
                            r" differs from that checked when the job opened it")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", ["same size", "other size", "deleted"])
def test_a_store_without_manifest_is_read_only_as_the_objects_checked_when_opened(tmp_path, how):
    """A store of another tool has no checksums: each read is bound to the objects listed when the store was
    opened (size and modification time), so a chunk rewritten afterwards, even to the same size with the store's
    fingerprint unchanged (its metadata, its listing's sizes, its first and last chunks), is one error naming
    the array and the samples, never other numbers; the untouched chunks still read."""
    import numpy as np

    from scaleattn.data._dataset import open_dataset
    from scaleattn.errors import IntegrityError

    tok, y = rows(n=32)
    foreign(tmp_path / "d.zarr", tok, y, compressors=None)
    foreign(tmp_path / "e.zarr", *rows(seed=5, n=32), compressors=None)
    ds = open_dataset(tmp_path / "d.zarr")
    if how == "same size":
        swap_chunk(tmp_path / "e.zarr", tmp_path / "d.zarr")
        assert open_dataset(tmp_path / "d.zarr").fingerprint == ds.fingerprint  # what a worker's check compares
    elif how == "other size":
        zarr.open_group(str(tmp_path / "d.zarr"), mode="r+")["tokens"][8:16] = 2 * tok[8:16]
    else:
        os.remove(tmp_path / "d.zarr" / "tokens" / "c" / "1" / "0" / "0")
    np.testing.assert_array_equal(ds.read(0, 8)[0], tok[:8])
    np.testing.assert_array_equal(ds.read(16, 32)[2], y[16:])
    for a, b in ((8, 16), (0, 32), (15, 17)):
        with pytest.raises(IntegrityError, match=r"^host \S+: tokens: the stored chunks of samples \[8, 16\) of"
                                                 r" \S+d\.zarr differ from those checked when the job opened it"):
            ds.read(a, b)


def test_a_store_without_manifest_read_as_fill_binds_its_absent_chunks_too(tmp_path):
    """With --absent-chunks-are-fill an absent chunk is part of what was checked: one stored later (other
    values where the fill value was read before) is refused as a rewritten one."""
    import numpy as np

    from scaleattn.data._dataset import open_dataset
    from scaleattn.errors import IntegrityError

    tok, y = rows(n=32)
    tok[8:16] = 0.0  # zarr skips the chunk equal to the fill value
    foreign(tmp_path / "d.zarr", tok, y)
    assert not (tmp_path / "d.zarr" / "tokens" / "c" / "1" / "0" / "0").exists()
    ds = open_dataset(tmp_path / "d.zarr", fill_absent_chunks=True)
    np.testing.assert_array_equal(ds.read(8, 16)[0], 0.0)
    zarr.open_group(str(tmp_path / "d.zarr"), mode="r+")["tokens"][8:16] = 1.0
    with pytest.raises(IntegrityError, match=r"tokens: the stored chunks of samples \[8, 16\)"):
        ds.read(8, 16)


@pytest.mark.parametrize("a,b", [(3, 10), (9, 10), (10, 17), (0, 9)])
def test_a_read_that_cuts_a_chunk_still_checks_it_against_the_manifest(tmp_path, a, b):
    """A store scaleattn wrote, one chunk replaced by the same chunk of another store (valid codec, its own
    crc32c, other values): a read of samples that cuts the chunk (the first n samples a plot reads) must not
    return its values unchecked. Reads that miss the chunk still work."""
    import numpy as np

    from scaleattn.data._dataset import open_dataset
    from scaleattn.errors import IntegrityError

    ds = dataset(tmp_path / "d.zarr", seed=1)
    dataset(tmp_path / "e.zarr", seed=2)
    key = "tokens/c/1/0/0"
    shutil.copyfile(tmp_path / "e.zarr" / key, tmp_path / "d.zarr" / key)
    ds = open_dataset(tmp_path / "d.zarr")
    whole = zarr.open_group(str(tmp_path / "d.zarr"), mode="r")["tokens"][:]
    np.testing.assert_array_equal(ds.read(0, 8)[0], whole[:8])
    np.testing.assert_array_equal(ds.read(17, 30)[0], whole[17:30])
    with pytest.raises(IntegrityError, match=r"^tokens: samples \[8, 16\) of \S+d\.zarr: the values do not match"):
        ds.read(a, b)


@pytest.mark.parametrize("where", ["array", "consolidated"])
def test_metadata_edited_after_opening_is_refused_by_the_next_read(tmp_path, where):
    """A store of another tool whose decoding metadata changes after it was opened (a transpose codec added to
    the array's zarr.json, or to the group's consolidated copy zarr decodes with): the same chunk objects would
    read as other values. The next read is one error naming the array, never the permuted values."""
    import numpy as np

    from scaleattn.data._dataset import open_dataset
    from scaleattn.errors import IntegrityError

    rng = np.random.default_rng(0)
    tok, y = rng.standard_normal((32, 4, 4)), rng.standard_normal((32, 2))
    foreign(tmp_path / "d.zarr", tok, y)
    if where == "consolidated":
        zarr.consolidate_metadata(str(tmp_path / "d.zarr"))
    ds = open_dataset(tmp_path / "d.zarr")
    np.testing.assert_array_equal(ds.read(0, 8)[0], tok[:8])
    doc = tmp_path / "d.zarr" / ("tokens/zarr.json" if where == "array" else "zarr.json")
    meta = json.loads(doc.read_text())
    arr = meta if where == "array" else meta["consolidated_metadata"]["metadata"]["tokens"]
    arr["codecs"].insert(0, {"name": "transpose", "configuration": {"order": [0, 2, 1]}})
    doc.write_text(json.dumps(meta))
    assert not np.array_equal(zarr.open_group(str(tmp_path / "d.zarr"), mode="r")["tokens"][:8], tok[:8])
    refused = r"host \S+: tokens: the metadata of \S+d\.zarr that zarr decodes samples \[0, 8\) with differs from" \
              r" that checked when the job opened"
    if where == "array":  # (this process keeps the consolidated copy it opened, and reads as checked)
        with pytest.raises(IntegrityError, match="^" + refused):
            ds.read(0, 8)
    # another process (a Dask worker) given the handle opens the store as it is now: refused by the fingerprint
    # (which hashes the array's own zarr.json) or by the read (the consolidated copy zarr decodes with)
    import pickle
    import subprocess
    import sys

    (tmp_path / "ds.pkl").write_bytes(pickle.dumps(ds))
    r = subprocess.run([sys.executable, "-c", "import pickle, sys; ds = pickle.load(open(sys.argv[1], 'rb'));"
                        " ds.read(0, 8)", str(tmp_path / "ds.pkl")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    expect(r.stderr.strip().splitlines()[-1], "IntegrityError: " + (refused if where == "consolidated" else
                                                                   r"host \S+: \S+d\.zarr is not the dataset the"
                                                                   r" client checked"))


@pytest.mark.slow
def test_a_replaced_store_is_refused_after_its_cached_group_was_evicted(tmp_path):
    """The open group is cached per process (a few entries) with its fingerprint check: a store replaced after
    opening by another scaleattn store (its own consistent manifest) stays refused after many other datasets
    pushed its group out of the cache (the group was reopened with the new manifest, its check still cached)."""
    import numpy as np

    from scaleattn.data._dataset import open_dataset
    from scaleattn.data._writer import write_dataset
    from scaleattn.errors import IntegrityError

    X, Y = np.random.default_rng(0).standard_normal((32, 4, 2)), np.ones((32, 2))
    write_dataset(tmp_path / "d.zarr", X, Y, chunk_samples=8)
    ds = open_dataset(tmp_path / "d.zarr")
    np.testing.assert_array_equal(ds.read(0, 32)[0], X)
    shutil.rmtree(tmp_path / "d.zarr")
    write_dataset(tmp_path / "d.zarr", X + 1.0, Y, chunk_samples=8)
    for i in range(20):
        open_dataset(write_dataset(tmp_path / f"o{i}.zarr", X, Y, chunk_samples=8).url).read(0, 8)
    with pytest.raises(IntegrityError, match=r"d\.zarr is not the dataset the client checked"):
        ds.read(0, 32)


@pytest.mark.parametrize("own", [True, False])
def test_chunk_folders_behind_symbolic_links_are_read_as_zarr_reads_them(own, base, tmp_path, capsys):
    """A chunk folder moved to another disk and linked back: zarr reads the store as before, and so does the fit
    (bit for bit); it was refused as "no chunk stored" / "damaged or partly copied". A link loop is refused in
    one line naming it."""
    src = base / ("own.zarr" if own else "foreign.zarr")
    w = tmp_path / "w"
    w.mkdir()
    shutil.copytree(src, w / "linked.zarr")
    os.rename(w / "linked.zarr/tokens/c", w / "elsewhere")
    os.symlink(w / "elsewhere", w / "linked.zarr/tokens/c")
    inputs = Inputs(w / "linked.zarr")
    rc, err = run_main(["fit", "linked.zarr", "--out", "a", *FIT], capsys, cwd=w)
    assert rc == 0, err
    rc, err = run_main(["fit", str(src), "--out", "b", *FIT], capsys, cwd=w)
    assert rc == 0, err
    same_stats(stats_of(w / "a"), stats_of(w / "b"))
    os.symlink(w / "elsewhere", w / "elsewhere" / "loop")
    rc, err = run_main(["fit", "linked.zarr", "--out", "c", *FIT], capsys, cwd=w)
    assert rc == 2 and "reached twice through symbolic links" in error_line(err)
    assert not (w / "c").exists()
    os.unlink(w / "elsewhere" / "loop")  # (the hash of the input walks the links too)
    inputs.unchanged()


@pytest.mark.parametrize("store, rel, name", [("lens.zarr", "lengths/c/2", "lengths"),
                                              ("own.zarr", "tokens/c/2/0/0", "tokens"),
                                              ("sharded.zarr", "targets/c/1/0/0", "targets")])
def test_a_read_over_many_chunks_names_the_damaged_chunk(base, tmp_path, store, rel, name):
    """A read of all the samples (the stream path reads every length at once) that meets a chunk failing its
    checksum names that chunk's samples, not the whole range read."""
    from scaleattn.data._dataset import open_dataset
    from scaleattn.errors import IntegrityError

    w = tmp_path / store
    shutil.copytree(base / store, w)
    _flip(w / rel)
    ds = open_dataset(str(w))
    with pytest.raises(IntegrityError) as e:
        ds.read_lengths(0, ds.n_samples) if name == "lengths" else ds.read(0, ds.n_samples)
    want = "[16, 24)" if store != "sharded.zarr" else "[12, 16)"  # (the shard's middle byte: its 2nd chunk of 4)
    assert f"{name}: samples {want} of" in str(e.value) and "damaged" in str(e.value), str(e.value)
