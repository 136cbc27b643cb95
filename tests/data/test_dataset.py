"""Datasets on Zarr: writes are aligned to the store's chunks and shards (DESIGN §6: misaligned dask-to-zarr
writes silently lose data), so datasets written from arrays with odd chunkings read back exactly; misaligned
block writes are refused; no store the package writes holds object or pickled data."""
from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import zarr

from scaleattn.data._dataset import open_dataset
from scaleattn.data._writer import create_dataset, write_block, write_dataset, write_unit


def _data(N=53, T=5, d=3, d_out=2, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.standard_normal((N, T, d))
    y = rng.standard_normal((N, T, d_out))
    lens = rng.integers(1, T + 1, N)
    return tok, y, lens


@pytest.mark.parametrize("chunk, shard", [(4, None), (4, 12), (7, 21), (53, None), (100, None), (1, 5)])
@pytest.mark.slow
def test_odd_dask_chunks_round_trip(tmp_path, chunk, shard):
    """Dask inputs chunked unevenly along every axis (and differently per array) -> exact round trip."""
    tok, y, lens = _data()
    dt = da.from_array(tok, chunks=((7, 1, 13, 2, 30), (2, 3), (1, 2)))
    dy = da.from_array(y, chunks=(11, 5, 1))
    dl = da.from_array(lens, chunks=9)
    ds = write_dataset(tmp_path / "d.zarr", dt, dy, dl, chunk_samples=chunk, shard_samples=shard)
    t, l, yy = ds.read(0, ds.n_samples)
    assert np.array_equal(t, tok) and np.array_equal(l, lens) and np.array_equal(yy, y)
    g = zarr.open_group(str(tmp_path / "d.zarr"), mode="r")
    chunk = min(chunk, len(tok))  # (a chunk beyond the samples is clamped to them)
    assert g["tokens"].chunks[0] == chunk and g["targets"].chunks[0] == chunk
    assert (g["tokens"].shards or (None,))[0] == shard
    # every chunk of every array holds data (none was skipped or lost)
    assert np.array_equal(g["tokens"][...], tok) and np.array_equal(g["lengths"][...], lens)


def test_numpy_and_last_token_round_trip(tmp_path):
    tok, y, _ = _data(N=10)
    ds = write_dataset(tmp_path / "d.zarr", tok, y[:, -1], chunk_samples=3)
    t, l, yy = ds.read(0, 10)
    assert l is None and np.array_equal(t, tok) and np.array_equal(yy, y[:, -1])
    # reading across chunk boundaries in odd slices gives the same values
    for a, b in [(0, 1), (2, 7), (5, 10), (9, 10)]:
        assert np.array_equal(ds.read(a, b)[0], tok[a:b])


def test_misaligned_block_writes_are_refused(tmp_path):
    g = create_dataset(str(tmp_path / "d.zarr"), 30, 4, 2, 1, chunk_samples=3, shard_samples=6)
    assert write_unit(g) == 6
    tok = np.ones((6, 4, 2))
    write_block(g, 6, tok, np.ones((6, 1)))  # whole shard: fine
    for start, n in [(3, 6), (6, 3), (1, 6)]:  # chunk-aligned but not shard-aligned, or not aligned at all
        with pytest.raises(ValueError, match="not aligned"):
            write_block(g, start, np.ones((n, 4, 2)))
    write_block(g, 24, tok)  # the last block may end at N
    with pytest.raises(ValueError, match="multiple of chunk_samples"):
        create_dataset(str(tmp_path / "e.zarr"), 30, 4, 2, chunk_samples=4, shard_samples=6)


@pytest.mark.slow
def test_stores_hold_no_object_or_pickled_data(tmp_path):
    """Every array the package writes is a plain numeric dtype with no pickle/object codec."""
    tok, y, lens = _data(N=12)
    write_dataset(tmp_path / "d.zarr", tok, y, lens, chunk_samples=5, teacher=(np.ones((1, 2, 3)), np.ones((1, 3, 3))))
    ds = open_dataset(tmp_path / "d.zarr")
    from scaleattn.pipeline import fit

    fit(ds, str(tmp_path / "run"), client=None, plots=False)  # every store of a run (the PNGs are no stores)
    n = 0
    for path in (tmp_path / "d.zarr", tmp_path / "run"):
        for meta in path.rglob("zarr.json"):
            text = meta.read_text()
            assert "pickle" not in text.lower() and '"object"' not in text and "vlen" not in text, meta
            n += 1
    for store in [tmp_path / "d.zarr", *(tmp_path / "run").glob("*.zarr")]:
        g = zarr.open_group(str(store), mode="r")
        for _, a in g.arrays():
            assert a.dtype.kind in "fiub", (store, a.name, a.dtype)
    assert n >= 8


def test_chunk_cache_bounds_order_and_forget():
    from scaleattn.data._dataset import ChunkCache

    c = ChunkCache(entries=2, max_bytes=100)
    a, b, big = np.zeros(4), np.ones(4), np.zeros(20)  # 32, 32 and 160 bytes
    assert c.put(("u", None, "f", 1, 0, True), (a, None)) == (a, None) and not a.flags.writeable
    c.put(("u", None, "f", 1, 1, True), (b, None))
    assert c.get(("u", None, "f", 1, 0, True))[0] is a  # now the most recent: chunk 1 goes first
    c.put(("u", None, "f", 2, 2, True), (np.zeros(4),))
    assert c.get(("u", None, "f", 1, 1, True)) is None and c.get(("u", None, "f", 1, 0, True)) is not None
    c.put(("u", None, "f", 2, 3, True), (big,))  # larger than the bound: not kept, nothing dropped for it
    assert c.get(("u", None, "f", 2, 3, True)) is None and len(c._items) == 2 and c._bytes == 64
    c.forget(1)
    assert [k[3] for k in c._items] == [2] and c._bytes == 32
    assert (c.hits, c.misses) == (2, 2)


def test_a_store_without_manifest_keeps_no_chunk(tmp_path):
    from scaleattn.data._dataset import CUT_CHUNKS

    tok, y, _ = _data(N=20)
    write_dataset(str(tmp_path / "n.zarr"), tok, y, chunk_samples=8)
    g = zarr.open_group(str(tmp_path / "n.zarr"), mode="r+")
    for key in ("manifest", "format", "format_version"):  # as a store another tool wrote
        del g.attrs[key]
    ds = open_dataset(str(tmp_path / "n.zarr"))
    assert ds.manifest() is None
    misses = CUT_CHUNKS.misses
    got = np.concatenate([t for t, _, _ in ds.read_chunks(3, 13, reuse="x")])
    np.testing.assert_array_equal(got, tok[3:13])
    assert CUT_CHUNKS.misses == misses  # never looked up, never kept


def test_open_dataset_names_a_file_given_as_the_store(tmp_path):
    """The API says what a wrong-kind path is, as the CLI does: a file, or a path through a file."""
    from scaleattn.errors import ParameterError

    f = tmp_path / "f.txt"
    f.write_text("x")
    with pytest.raises(ParameterError, match=r"^dataset \S+f\.txt: is a file, expected a Zarr store"):
        open_dataset(f)
    with pytest.raises(ParameterError, match=r"^dataset \S+f\.txt/d\.zarr: \S+f\.txt is a file, not a directory"):
        open_dataset(f / "d.zarr")


@pytest.mark.parametrize("chunk, shard, want", [(20000, None, (100, None)), (20000, 40000, (100, 100)),
                                                (8, 40000, (8, 96)), (30, 60, (30, 60)), (30, 120, (30, 90)),
                                                (100, 200, (100, 100))])
def test_chunks_and_shards_larger_than_the_samples_are_clamped(tmp_path, chunk, shard, want):
    """A chunk or shard size beyond N is clamped to N (a shard to the largest multiple of the chunk within N):
    the store passes the store bounds (a chunk never holds more than the array) and reads back exactly."""
    rng = np.random.default_rng(0)
    tok, y = rng.standard_normal((100, 200, 4)), rng.standard_normal((100, 4))
    ds = write_dataset(tmp_path / "d.zarr", tok, y, chunk_samples=chunk, shard_samples=shard)
    arr = zarr.open_group(str(tmp_path / "d.zarr"), mode="r")["tokens"]
    assert (arr.chunks[0], None if arr.shards is None else arr.shards[0]) == want
    assert ds.chunk_samples == want[0]
    got_tok, _, got_y = open_dataset(str(tmp_path / "d.zarr")).read(0, 100)
    np.testing.assert_array_equal(got_tok, tok)
    np.testing.assert_array_equal(got_y, y)


def test_a_huge_chunk_size_allocates_what_the_samples_need(tmp_path):
    """generate with chunk_samples far beyond the samples: a store of N-sample chunks that opens and certifies
    (it was refused by the store bounds after being written whole), its buffers sized by N, not the chunk size."""
    import tracemalloc

    from scaleattn.generate import generate_mhla

    tracemalloc.start()
    try:
        ds = generate_mhla(str(tmp_path / "g.zarr"), d=4, length=20, samples=100, chunk_samples=10**6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ds.chunk_samples == 100 and ds.n_samples == 100
    assert peak < 32e6, f"peak {peak:,} bytes"  # (a chunk of 10^6 samples is 640 MB)
    open_dataset(str(tmp_path / "g.zarr")).read(0, 100)
