"""Checkpoints, resume and lost workers (DESIGN §6): same statistics, bit for bit, after any interruption."""
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import zarr

from scaleattn import __version__
from scaleattn.data._writer import write_dataset
from scaleattn.distributed.build import build_statistics, compute_statistics
from scaleattn.distributed.checkpoint import Checkpoint
from scaleattn.distributed.partition import row_groups, tile_bounds
from scaleattn.generate import make_mhla
from scaleattn.pipeline import fit
from scaleattn.statistics._container import Statistics
from scaleattn.store._location import resolve
from tests.helpers import assert_same_stats


@pytest.fixture
def data(tmp_path):
    D = make_mhla(d=3, heads=2, length=8, samples=64, causal=True, seed=3)
    D["tokens"][:8] = 0.0  # the first group's partial is all zeros: zarr writes no chunk for it
    D["targets"][:8] = 0.0
    return write_dataset(tmp_path / "d.zarr", D["tokens"], D["targets"], chunk_samples=8)


@pytest.mark.slow
def test_resume_reads_done_partials_and_is_bit_identical(data, tmp_path):
    ck = str(tmp_path / "ck.zarr")
    ref = compute_statistics(data, group_samples=8, tile_rows=8)  # 8 groups x 3 tiles, no checkpoint
    first = build_statistics(data, group_samples=8, tile_rows=8, checkpoint=resolve(ck))
    assert_same_stats(first.statistics, ref)
    assert (first.groups_computed, first.groups_resumed, first.tiles) == (8, 0, 3)
    # the all-zero partial has no chunk key, yet it is done: the done-mask, not the keys, is the authority
    assert not os.path.exists(os.path.join(ck, "gram_compact", "c", "0", "0", "0"))
    assert os.path.exists(os.path.join(ck, "gram_compact", "c", "1", "0", "0"))
    again = build_statistics(data, group_samples=8, tile_rows=8, checkpoint=resolve(ck))
    assert_same_stats(again.statistics, ref)
    assert (again.groups_computed, again.groups_resumed, again.tasks_computed) == (0, 8, 0)
    # forget two groups' tiles (as if the job died before their done flags were written): only they are redone
    g = zarr.open_group(ck, mode="r+")
    g["done"][2, 1] = False
    g["done"][5, :] = False
    g["gram_compact"][5] = np.nan  # a half-written partial is never read: it is recomputed and overwritten
    info = build_statistics(data, group_samples=8, tile_rows=8, checkpoint=resolve(ck))
    assert_same_stats(info.statistics, ref)
    assert (info.groups_computed, info.groups_resumed, info.tasks_computed) == (2, 6, 4)
    assert Checkpoint.open(resolve(ck), data, row_groups(data, 8), tile_bounds(3, 8)).done_mask().all()


@pytest.mark.slow
def test_resume_on_a_cluster_reads_partials_on_the_workers(data, tmp_path, client):
    ck = str(tmp_path / "ck.zarr")
    ref = compute_statistics(data, group_samples=16, tile_rows=8)  # in-process, same tree
    assert_same_stats(compute_statistics(data, client, group_samples=16, tile_rows=8, checkpoint=ck), ref)
    zarr.open_group(ck, mode="r+")["done"][1:3, 0] = False
    info = build_statistics(data, client, group_samples=16, tile_rows=8, checkpoint=resolve(ck))
    assert_same_stats(info.statistics, ref)
    assert (info.groups, info.tiles, info.groups_computed, info.tasks_computed) == (4, 3, 2, 2)


def test_foreign_checkpoint_is_refused(data, tmp_path):
    ck = str(tmp_path / "ck.zarr")
    compute_statistics(data, group_samples=16, checkpoint=ck)
    with pytest.raises(ValueError, match="groups"):  # another grouping
        compute_statistics(data, group_samples=8, checkpoint=ck)
    with pytest.raises(ValueError, match="tiles"):
        compute_statistics(data, group_samples=16, tile_rows=10, checkpoint=ck)
    with pytest.raises(ValueError, match="d_out"):  # a Gram-only build is not a fit's build
        compute_statistics(data, group_samples=16, targets=False, checkpoint=ck)
    tok, _, y = data.read(0, data.n_samples)
    for other in (write_dataset(tmp_path / "same.zarr", tok, y, chunk_samples=8),  # same values, new dataset uid
                  write_dataset(tmp_path / "rechunk.zarr", tok, y, chunk_samples=16)):
        with pytest.raises(ValueError, match="dataset_fingerprint"):
            compute_statistics(other, group_samples=16, checkpoint=ck)
    zarr.open_group(ck, mode="r+").attrs["scaleattn_version"] = "0.0.1"
    with pytest.raises(ValueError, match=f"scaleattn_version.*{__version__}"):
        compute_statistics(data, group_samples=16, checkpoint=ck)
    os.makedirs(tmp_path / "junk")
    with pytest.raises(ValueError, match="not a scaleattn checkpoint|different build"):
        compute_statistics(data, checkpoint=str(tmp_path / "junk"))


def test_resume_with_the_other_kernel_is_refused(data, tmp_path, monkeypatch):
    """A checkpoint records the statistics kernel that built it (one without the attribute: numpy); a resume
    with the other kernel is refused in one line naming both, never mixed in."""
    from scaleattn.errors import CheckpointError

    ck = str(tmp_path / "ck.zarr")
    monkeypatch.setenv("SCALEATTN_KERNEL", "numba")
    ref = compute_statistics(data, group_samples=16, checkpoint=ck)
    assert zarr.open_group(ck).attrs["kernel"] == "numba"
    monkeypatch.setenv("SCALEATTN_KERNEL", "numpy")
    with pytest.raises(CheckpointError, match="'numba' statistics kernel, this build uses 'numpy'") as e:
        compute_statistics(data, group_samples=16, checkpoint=ck)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("SCALEATTN_KERNEL", "numba")
    assert_same_stats(compute_statistics(data, group_samples=16, checkpoint=ck), ref)
    attrs = zarr.open_group(ck, mode="r+").attrs
    del attrs["kernel"], attrs["kernel_revision"]  # as written before the attributes: a numpy build
    with pytest.raises(CheckpointError, match="'numpy' statistics kernel, this build uses 'numba'"):
        compute_statistics(data, group_samples=16, checkpoint=ck)
    monkeypatch.setenv("SCALEATTN_KERNEL", "numpy")
    compute_statistics(data, group_samples=16, checkpoint=ck)  # accepted (the partials are reused as they are)


def test_resume_with_another_revision_of_the_kernel_is_refused(data, tmp_path, monkeypatch):
    """A checkpoint records its kernel's revision (one without it: revision 1, the numba kernel before its 4 x 4
    micro-kernel); a resume by another revision is refused in one line, never mixed in."""
    from scaleattn.errors import CheckpointError
    from scaleattn.statistics._kernel import KERNEL_REVISIONS

    ck = str(tmp_path / "ck.zarr")
    monkeypatch.setenv("SCALEATTN_KERNEL", "numba")
    ref = compute_statistics(data, group_samples=16, checkpoint=ck)
    assert zarr.open_group(ck).attrs["kernel_revision"] == KERNEL_REVISIONS["numba"] == 2
    assert_same_stats(compute_statistics(data, group_samples=16, checkpoint=ck), ref)  # the same revision: reused
    del zarr.open_group(ck, mode="r+").attrs["kernel_revision"]  # as an earlier scaleattn wrote it
    with pytest.raises(CheckpointError, match="revision 1 of the 'numba' statistics kernel .* revision 2") as e:
        compute_statistics(data, group_samples=16, checkpoint=ck)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_fit_refuses_a_leftover_checkpoint_without_resume(data, tmp_path):
    out = str(tmp_path / "run")
    ck = out + ".checkpoint.zarr"
    compute_statistics(data, checkpoint=ck)  # as left by an interrupted fit
    with pytest.raises(FileExistsError, match="pass `resume=True` to continue it, or `overwrite=True` to start over$"):
        fit(data, out, exact_mse=False, plots=False)
    res = fit(data, out, exact_mse=False, plots=False, resume=True, keep_checkpoint=True)
    assert res.report["groups_computed"] == 0 and res.report["groups_resumed"] == res.report["groups"] == 16
    assert res.report["checkpoint"] == ck and os.path.exists(ck)
    res2 = fit(data, out, exact_mse=False, plots=False, overwrite=True)  # starts over, then cleans up
    assert res2.report["groups_computed"] == 16 and res2.report["groups_resumed"] == 0
    assert not os.path.exists(ck)
    assert_same_stats(res.statistics, res2.statistics)


@pytest.mark.slow
def test_killed_fit_process_resumes_with_identical_statistics(causal_groups_ds, cli_process, tmp_path):
    ds = causal_groups_ds
    out = str(tmp_path / "run")
    ck = out + ".checkpoint.zarr"
    args = ["fit", ds.url, "--out", out, "--local", "--no-exact-mse", "--no-plots", "--quiet"]
    r = cli_process(*args, rc=75, extra_env={"SCALEATTN_TEST_STOP_AFTER_GROUPS": "3"})  # dies after 3 of 16 groups
    assert r.returncode == 75, r.stderr
    assert not os.path.exists(out) and os.path.exists(ck)
    assert zarr.open_group(ck, mode="r")["done"][...].all(axis=1).sum() == 3
    r = cli_process(*args, rc=2)
    assert r.returncode == 2 and "--resume" in r.stderr
    r = cli_process(*args, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["groups"], report["groups_computed"], report["groups_resumed"]) == (16, 13, 3)
    assert not os.path.exists(ck)  # removed after success
    assert_same_stats(Statistics.load(os.path.join(out, "stats.zarr")), compute_statistics(ds))  # uninterrupted build


@pytest.mark.slow
def test_lost_worker_mid_fit_gives_the_same_statistics(data, tmp_path, monkeypatch):
    from distributed import Client, LocalCluster

    ck = str(tmp_path / "ck.zarr")
    ref = compute_statistics(data, group_samples=8)
    monkeypatch.setenv("SCALEATTN_TEST_TASK_DELAY", "0.5")  # inherited by the worker processes: slow tasks
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.run(lambda: None)  # workers are up
        out = {}
        th = threading.Thread(target=lambda: out.update(
            st=compute_statistics(data, client, group_samples=8, checkpoint=ck)))
        th.start()
        done = 0
        deadline = time.monotonic() + 120
        while done < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                done = int(zarr.open_group(ck, mode="r")["done"][...].sum())
            except Exception:  # not created yet
                pass
        pids = client.run(os.getpid)
        victim = sorted(pids)[0]
        os.kill(pids[victim], signal.SIGKILL)  # the worker process dies mid-fit (its nanny restarts it)
        th.join(180)
        assert not th.is_alive()
        assert 2 <= done < 8  # killed while groups were still running
    assert_same_stats(out["st"], ref)
    assert zarr.open_group(ck, mode="r")["done"][...].all()
