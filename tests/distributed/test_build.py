"""The distributed build (DESIGN §6): row groups and column tiles of the compact Gram; tiled == untiled == dense
numpy whatever the tiling; bit-identical statistics whichever workers (and how many) ran the same tree."""
import numpy as np
import pytest

from scaleattn.data._writer import write_dataset
from scaleattn.distributed.build import build_statistics, compute_statistics, group_statistics
from scaleattn.distributed.partition import MAX_TILE_BYTES, row_groups, tile_bounds
from scaleattn.features import n_pairs, phi, row_targets, token_features
from scaleattn.generate import make_mhla
from scaleattn.statistics._container import statistics_from_arrays


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    D = make_mhla(d=4, heads=2, length=9, samples=60, d_out=3, causal=True, variable_lengths=True, seed=7)
    ds = write_dataset(tmp_path_factory.mktemp("t") / "d.zarr", D["tokens"], D["targets"], D["lengths"],
                       chunk_samples=8)
    # independent reference: dense features, G = phi^T phi, B = phi^T y (DESIGN §2-3)
    s, x = token_features(D["tokens"], D["lengths"], causal=True)
    P = phi(s, x)
    y = row_targets(D["targets"], D["lengths"], causal=True)
    return ds, P.T @ P, P.T @ y, float((y * y).sum()), P.shape[0]


def test_tile_bounds_cover_tc_and_bound_memory():
    assert tile_bounds(8) == [(0, 666)]  # small jobs: one task per group
    assert len(tile_bounds(16)) == 1 and len(tile_bounds(32)) == 3  # Tc at d=32 is 0.6 GB > 256 MB
    for d in (32, 48, 64):
        m = n_pairs(d)
        mm, nv = m * (m + 1) // 2, d * (d + 1) // 2
        t = tile_bounds(d)
        assert t[0][0] == 0 and t[-1][1] == mm and all(a[1] == b[0] for a, b in zip(t, t[1:]))
        assert max(8 * (c1 - c0) * nv for c0, c1 in t) <= MAX_TILE_BYTES  # no task holds more than one tile
    assert len(tile_bounds(64)) == 141  # d = 64: Tc 36 GB in 141 tiles
    assert tile_bounds(4, tile_rows=20) == [(0, 20), (20, 40), (40, 55)]
    assert tile_bounds(4, max_tile_bytes=8 * 10 * 10) == [(c, min(55, c + 10)) for c in range(0, 55, 10)]
    assert tile_bounds(64, max_tile_bytes=None) == [(0, 2080 * 2081 // 2)]


@pytest.mark.parametrize("tile_rows,group_samples", [(None, None), pytest.param(5, 160, marks=pytest.mark.slow),
                                                     (7, 32), (20, 16), (54, 48), (55, 160)])
def test_tiled_statistics_match_untiled_and_dense(rel_err, data, tile_rows, group_samples):
    ds, G, B, yy, N = data
    base = compute_statistics(ds)
    info = build_statistics(ds, tile_rows=tile_rows, group_samples=group_samples)
    st = info.statistics
    assert info.tiles == (1 if tile_rows is None else -(-55 // tile_rows))
    assert rel_err(st.gram_compact, base.gram_compact, np.inf) <= 1e-12
    assert rel_err(st.gram(), G, np.inf) <= 1e-12 and rel_err(st.moments, B, np.inf) <= 1e-12
    assert st.n_rows == N and st.yy == pytest.approx(yy, rel=1e-12)
    assert st.gram_compact.shape == base.gram_compact.shape and st.moments.shape == (40, 3)


def test_tile_partial_holds_only_its_rows(rel_err, data):
    ds, *_ = data
    full = group_statistics(ds, 0, 32)
    t = group_statistics(ds, 0, 32, targets=False, cols=(20, 40))
    assert t.gram_compact.shape == (20, 10) and t.moments.shape == (40, 0)  # memory: tile rows x d(d+1)/2
    assert t.n_rows == full.n_rows
    assert rel_err(t.gram_compact, full.gram_compact[20:40], np.inf) <= 1e-13


@pytest.mark.slow
def test_small_max_tile_bytes_turns_tiling_on(rel_err, data):
    ds, G, *_ = data
    info = build_statistics(ds, max_tile_bytes=8 * 10 * 10)
    st = info.statistics
    assert info.tiles == 6 and rel_err(st.gram(), G, np.inf) <= 1e-12
    assert info.groups == len(row_groups(ds, max_groups=16))


@pytest.mark.slow
def test_distributed_tiled_is_bit_identical_to_local(rel_err, data, client):
    ds, G, B, *_ = data
    local = compute_statistics(ds, tile_rows=13)  # one process
    info = build_statistics(ds, client, tile_rows=13, group_samples=16, split_every=3)  # 2 workers
    dist = info.statistics
    local3 = compute_statistics(ds, tile_rows=13, group_samples=16, split_every=3)
    assert info.tiles == 5
    # same groups, same fixed reduction order -> same bits, whatever the workers
    np.testing.assert_array_equal(dist.gram_compact, local3.gram_compact)
    np.testing.assert_array_equal(dist.moments, local3.moments)
    assert dist.yy == local3.yy and dist.n_rows == local3.n_rows
    assert rel_err(dist.gram_compact, local.gram_compact, np.inf) <= 1e-12 and rel_err(dist.gram(), G, np.inf) <= 1e-12
    # a different chunking of the same data gives the same statistics to round-off
    D = ds.read(0, ds.n_samples)
    other = write_dataset(ds.url + ".rechunk", D[0], D[2], D[1], chunk_samples=24)
    re = compute_statistics(other, client, tile_rows=29)
    assert rel_err(re.gram_compact, local.gram_compact, np.inf) <= 1e-12 and rel_err(re.moments, B, np.inf) <= 1e-12


@pytest.mark.slow
def test_distributed_statistics_independent_of_workers_and_chunking(tmp_path, client):
    D = make_mhla(d=3, heads=2, length=12, samples=300, causal=True, variable_lengths=True, seed=5)
    a = write_dataset(tmp_path / "a.zarr", D["tokens"], D["targets"], D["lengths"], chunk_samples=16)
    b = write_dataset(tmp_path / "b.zarr", D["tokens"], D["targets"], D["lengths"], chunk_samples=37)
    ref = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"])
    two = compute_statistics(a, client)
    local = compute_statistics(a)  # one process: same tree
    other = compute_statistics(b, client)
    for st in (two, local, other):
        assert st.n_rows == ref.n_rows
        assert np.abs(st.gram_compact - ref.gram_compact).max() <= 1e-12 * np.abs(ref.gram_compact).max()
        assert np.abs(st.moments - ref.moments).max() <= 1e-12 * np.abs(ref.moments).max()
    # same chunking -> the same reduction tree -> bit-identical, whichever workers ran it
    assert np.array_equal(two.gram_compact, local.gram_compact) and np.array_equal(two.moments, local.moments)
    again = compute_statistics(a, client, group_samples=16)
    assert np.array_equal(again.gram_compact, compute_statistics(a, client, group_samples=16).gram_compact)
