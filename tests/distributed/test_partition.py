"""The default row groups (DESIGN §6): equal feature rows within one sample, every sample once, decided by the
dataset alone (never the workers), deterministic; chunks cut by a group are still read whole and checked; the
statistics of any split equal a dense reference; a checkpoint of another split is refused."""
import numpy as np
import pytest
import zarr

from scaleattn.data._dataset import open_dataset
from scaleattn.data._writer import write_dataset
from scaleattn.distributed.build import build_statistics, compute_statistics, group_statistics
from scaleattn.distributed.partition import GROUP_BYTES, MIN_GROUPS, SNAP_CHUNKS, row_groups
from scaleattn.errors import CheckpointError, IntegrityError, ParameterError
from scaleattn.features import phi, row_targets, token_features
from scaleattn.generate import make_mhla


def _write(path, samples, chunk, length=10, d=3, lengths=False, seed=0):
    D = make_mhla(d=d, heads=2, length=length, samples=samples, causal=True, variable_lengths=lengths, seed=seed)
    return write_dataset(path, D["tokens"], D["targets"], D["lengths"] if lengths else None,
                         chunk_samples=chunk), D


def _covers_once(groups, n):
    assert groups[0][0] == 0 and groups[-1][1] == n
    assert all(a < b for a, b in groups) and all(p[1] == q[0] for p, q in zip(groups, groups[1:]))


def test_few_chunks_with_a_remainder_give_equal_groups(tmp_path):
    # the benchmark's shape in small: 6 chunks, the last a remainder of 40 / 312 samples
    ds, _ = _write(tmp_path / "a.zarr", samples=5 * 31 + 4, chunk=31)
    groups = row_groups(ds)
    _covers_once(groups, ds.n_samples)
    assert len(groups) == MIN_GROUPS
    sizes = [b - a for a, b in groups]
    assert max(sizes) - min(sizes) <= 1  # equal rows (T per sample) within one sample
    assert any(a % ds.chunk_samples for a, _ in groups)  # chunks are cut: whole chunks could not be equal


def test_variable_lengths_balance_rows_not_samples(tmp_path):
    ds, D = _write(tmp_path / "v.zarr", samples=300, chunk=16, length=12, lengths=True, seed=4)
    groups = row_groups(ds)
    _covers_once(groups, ds.n_samples)
    rows = np.array([int(D["lengths"][a:b].sum()) for a, b in groups])
    ideal = D["lengths"].sum() / len(groups)
    assert np.abs(rows - ideal).max() <= D["lengths"].max()  # within one sample's rows of equal
    by_samples = [(k * 300) // len(groups) for k in range(len(groups) + 1)]
    naive = np.array([int(D["lengths"][a:b].sum()) for a, b in zip(by_samples, by_samples[1:])])
    assert np.abs(rows - ideal).max() < np.abs(naive - ideal).max()  # better than equal samples


def test_split_depends_on_the_dataset_only_and_is_deterministic(tmp_path):
    ds, D = _write(tmp_path / "a.zarr", samples=200, chunk=16, lengths=True, seed=1)
    first = row_groups(ds)
    assert row_groups(open_dataset(ds.url)) == first == row_groups(ds)  # reopened, again: the same bounds
    # a copy with the same rows and chunking splits the same; another chunking may move only snapped bounds
    same, _ = _write(tmp_path / "b.zarr", samples=200, chunk=16, lengths=True, seed=1)
    assert row_groups(same) == first


def test_many_chunks_per_group_snap_to_chunk_boundaries(tmp_path):
    chunk = 2
    ds, _ = _write(tmp_path / "m.zarr", samples=SNAP_CHUNKS * MIN_GROUPS * chunk + 3, chunk=chunk)
    groups = row_groups(ds)
    _covers_once(groups, ds.n_samples)
    assert len(groups) == MIN_GROUPS and all(a % chunk == 0 for a, _ in groups)
    sizes = [b - a for a, b in groups]
    assert max(sizes) - min(sizes) <= chunk + 3


def test_large_datasets_get_groups_of_about_group_bytes(tmp_path):
    class Big:  # row_groups reads only the shape of a dataset without lengths
        n_samples, length, d, chunk_samples, causal, has_lengths = 10**6, 100, 16, 10**6 // 4, True, False
        n_chunks = 4
    groups = row_groups(Big())
    assert len(groups) == int(np.ceil(8 * 10**8 * 16 / GROUP_BYTES))
    assert len(row_groups(Big(), max_groups=16)) == 16
    with pytest.raises(ParameterError, match="group_samples"):
        row_groups(Big(), group_samples=0)
    assert row_groups(Big(), group_samples=300_000) == [(0, 300_000), (300_000, 600_000), (600_000, 900_000),
                                                        (900_000, 1_000_000)]


def test_tiny_datasets_have_one_group_per_sample(tmp_path):
    ds, _ = _write(tmp_path / "t.zarr", samples=5, chunk=2)
    assert row_groups(ds) == [(k, k + 1) for k in range(5)]


@pytest.mark.parametrize("lengths", [False, True])
def test_cut_groups_match_the_dense_statistics(rel_err, tmp_path, lengths):
    ds, D = _write(tmp_path / "c.zarr", samples=70, chunk=9, lengths=lengths, seed=2)
    groups = row_groups(ds)
    assert any(a % 9 for a, _ in groups)  # the default split cuts chunks here
    lens = D["lengths"] if lengths else None
    s, x = token_features(D["tokens"], lens, causal=True)
    P, y = phi(s, x), row_targets(D["targets"], lens, causal=True)
    info = build_statistics(ds)
    st = info.statistics
    assert info.groups == len(groups) and st.n_rows == P.shape[0]
    assert rel_err(st.gram(), P.T @ P, np.inf) <= 1e-12 and rel_err(st.moments, P.T @ y, np.inf) <= 1e-12
    assert st.yy == pytest.approx(float((y * y).sum()), rel=1e-12)
    odd = compute_statistics(ds, group_samples=4)  # an explicit size: exactly 4 samples, chunks cut too
    assert rel_err(odd.gram_compact, st.gram_compact, np.inf) <= 1e-12


def test_a_cut_chunk_is_still_checked_against_its_manifest(tmp_path):
    ds, _ = _write(tmp_path / "e.zarr", samples=32, chunk=8)
    g = zarr.open_group(ds.url, mode="r+")
    g["tokens"][8:16] = np.asarray(g["tokens"][8:16]) + 1.0  # behind the manifest's back
    with pytest.raises(IntegrityError, match=r"tokens: samples \[8, 16\)"):
        group_statistics(ds, 10, 12)  # only part of the changed chunk: read whole, so checked
    group_statistics(ds, 0, 8)  # an intact chunk reads as before


def test_a_checkpoint_of_another_split_is_refused(tmp_path):
    ds, _ = _write(tmp_path / "k.zarr", samples=48, chunk=8)
    ck = str(tmp_path / "ck.zarr")
    compute_statistics(ds, group_samples=8, checkpoint=ck)  # whole chunks, as an older scaleattn split them
    with pytest.raises(CheckpointError, match="different build \\(groups"):
        compute_statistics(ds, checkpoint=ck)  # the default split differs: never mixed in


@pytest.mark.slow
def test_cut_groups_on_a_cluster_are_bit_identical_to_in_process(tmp_path, client):
    ds, _ = _write(tmp_path / "w.zarr", samples=5 * 13 + 3, chunk=13, lengths=True, seed=6)
    assert any(a % 13 for a, _ in row_groups(ds))
    local = compute_statistics(ds)
    two = compute_statistics(ds, client)  # 2 workers, any completion order
    np.testing.assert_array_equal(two.gram_compact, local.gram_compact)
    np.testing.assert_array_equal(two.moments, local.moments)
    assert two.yy == local.yy and two.n_rows == local.n_rows


def test_a_cut_chunk_is_read_and_checked_once_per_build(tmp_path, monkeypatch):
    from scaleattn.data._dataset import CUT_CHUNKS, Dataset

    ds, _ = _write(tmp_path / "o.zarr", samples=70, chunk=9, seed=3)
    groups = row_groups(ds)
    cut = {b // 9 for _, b in groups[:-1] if b % 9}
    assert cut and len(groups) > ds.n_chunks  # several groups per chunk: chunks cut, some more than once
    reads, read = [], Dataset.read

    def counting(self, start, stop, *args, **kwargs):
        reads.append((start, stop))
        return read(self, start, stop, *args, **kwargs)

    monkeypatch.setattr(Dataset, "read", counting)
    st = compute_statistics(ds)
    assert sorted(reads) == sorted(set(reads)) and len(reads) == ds.n_chunks  # each chunk read (and checked) once
    assert not any(k[3] for k in CUT_CHUNKS._items if k[0] == ds.url)  # the build let go of its chunks
    reads.clear()
    again = compute_statistics(ds)  # a new build reads (and checks) every chunk anew
    assert len(reads) == ds.n_chunks
    np.testing.assert_array_equal(again.gram_compact, st.gram_compact)
    monkeypatch.setattr(Dataset, "read", read)
    g = zarr.open_group(ds.url, mode="r+")  # a cut chunk changed behind the manifest's back after a build
    k = min(cut)
    g["tokens"][9 * k : 9 * k + 9] = np.asarray(g["tokens"][9 * k : 9 * k + 9]) * 2.0
    with pytest.raises(IntegrityError, match=rf"tokens: samples \[{9 * k}, {9 * k + 9}\)"):
        compute_statistics(ds)


def test_kept_cut_chunks_are_never_handed_out(tmp_path):
    ds, _ = _write(tmp_path / "h.zarr", samples=20, chunk=8, seed=5)
    plain = [t for t, _, _ in ds.read_chunks(3, 13)]
    first = [t for t, _, _ in ds.read_chunks(3, 13, reuse="t")]
    first[0][...] = 7.0  # a caller writing into what it got
    second = [t for t, _, _ in ds.read_chunks(2, 13, reuse="t")]  # chunk 0 kept from the first read
    np.testing.assert_array_equal(second[0][1:], plain[0])
    np.testing.assert_array_equal(second[1], plain[1])
    assert all(t.flags.writeable for t in second)
