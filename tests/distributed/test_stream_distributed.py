"""The streaming path's passes on a Dask cluster (scaleattn.distributed.stream): one map over the row groups and
the fixed-order tree per pass, bit-identical to the in-process operator and for any number of workers, and right
against dense products and lstsq on the explicit features."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

import scaleattn
from scaleattn._tree import tree_reduce
from scaleattn.distributed.stream import DistributedStreamOperator, span, stream_operator
from scaleattn.features import phi, row_targets, token_features
from scaleattn.linalg._stream import stream_solve


def _data(tmp_path, seed=3, n=48, T=6, d=3, d_out=2):
    """A causal variable-length dataset in several chunks per row group, and its explicit features."""
    rng = np.random.default_rng(seed)
    tok, y = rng.standard_normal((n, T, d)), rng.standard_normal((n, T, d_out))
    lengths = rng.integers(2, T + 1, n)
    ds = scaleattn.write_dataset(str(tmp_path / "d.zarr"), tok, y, lengths=lengths, chunk_samples=3)
    s, x = token_features(tok, lengths, causal=True)
    return ds, phi(s, x), row_targets(y, lengths, causal=True)


def _local(n_workers: int):
    """A LocalCluster of ``n_workers`` threads in this process (cheap to start) and its client."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=False, dashboard_address=":0")
    return cluster, Client(cluster)


def _same_solution(a, b) -> bool:
    ca, cb = a.certificate, b.certificate
    return (np.array_equal(a.coef, b.coef) and a.sse == b.sse and a.passes == b.passes
            and np.array_equal(a.backward_error, b.backward_error) and ca.rank == cb.rank
            and ca.lambda_min == cb.lambda_min and ca.lambda_max == cb.lambda_max
            and json.dumps(ca.estimates, sort_keys=True, default=str) == json.dumps(cb.estimates, sort_keys=True,
                                                                                     default=str))


def test_runs_of_span_groups_are_whole_subtrees_of_the_tree():
    """What lets a task add several groups' partials itself: summing runs of ``span`` groups, then the runs' sums,
    is the tree of the groups' partials, for any count and any span the operator may choose (checked on the tree's
    shape, an expression string, not on numbers that could agree by chance); a run off the alignment is not."""
    def expr(*p):
        return "(" + ",".join(p) + ")"

    for n in range(1, 40):
        parts = [str(i) for i in range(n)]
        whole = tree_reduce(parts, expr)
        for workers in (1, 2, 3, 5, 8):
            k = span(n, workers)
            assert k & (k - 1) == 0 and (k == 1 or -(-n // k) >= 2 * workers)
            runs = [tree_reduce(parts[j:j + k], expr) for j in range(0, n, k)]
            assert tree_reduce(runs, expr) == whole, (n, workers, k)
    parts = [str(i) for i in range(8)]
    shifted = [parts[0]] + [tree_reduce(parts[j:j + 2], expr) for j in (1, 3, 5)] + [parts[7]]
    assert tree_reduce(shifted, expr) != tree_reduce(parts, expr)
    assert [span(16, w) for w in (1, 2, 3, 4, 8, 16)] == [8, 4, 2, 2, 1, 1]


def test_a_pass_on_workers_is_the_in_process_pass_bit_for_bit(client, tmp_path):
    ds, F, Y = _data(tmp_path)
    here = stream_operator(ds)  # in this process: the same row groups, the same tree
    there = stream_operator(ds, client)
    assert isinstance(there, DistributedStreamOperator) and here.source.n_groups == len(there.groups) == 16
    assert there.features_kept
    G = F.T @ F
    W = np.asfortranarray(np.random.default_rng(0).standard_normal((G.shape[0], 3)))  # (any layout)
    out = there @ W
    assert np.array_equal(out, here @ W)
    assert np.abs(out - G @ W).max() <= 1e-12 * np.abs(G @ W).max()  # the dense product, independently
    for name in ("A", "B", "moments"):
        assert np.array_equal(getattr(there, name), getattr(here, name)), name
    assert np.array_equal(there.diagonal(), here.diagonal()) and there.yy == here.yy
    assert there.n_rows == F.shape[0] and np.allclose(there.diagonal(), np.diag(G), rtol=1e-13)
    assert np.allclose(there.moments, F.T @ Y, rtol=1e-12, atol=1e-12 * np.abs(F.T @ Y).max())
    c = np.random.default_rng(1).standard_normal((G.shape[0], Y.shape[1]))
    sse = there.residual_sse(c)
    assert sse == here.residual_sse(c) and sse == pytest.approx(float(np.sum((Y - F @ c) ** 2)), rel=1e-12)
    # features not kept on the workers (read and recomputed in every pass): the same bits
    again = stream_operator(ds, client, cache_bytes=0)
    assert not again.features_kept and np.array_equal(again @ W, out)
    there.release()


def test_a_dropped_group_makes_the_pass_wrong(client, tmp_path):
    """The comparison above can fail: a pass that loses one row group's partial differs from the in-process pass
    and from the dense product."""
    ds, F, _ = _data(tmp_path, seed=4)
    here, there = stream_operator(ds), stream_operator(ds, client, cache_bytes=0)
    W = np.random.default_rng(2).standard_normal((F.shape[1], 2))
    assert np.array_equal(there @ W, here @ W)
    there._runs[-1] = there._runs[-1][:-1]  # the last group dropped
    bad = there @ W
    assert not np.array_equal(bad, here @ W)
    assert np.abs(bad - F.T @ (F @ W)).max() > 1e-6 * np.abs(F.T @ (F @ W)).max()
    there.release()


@pytest.mark.slow
def test_stream_fit_is_bit_identical_for_1_2_3_workers_and_is_lstsq(client, tmp_path):
    ds, F, Y = _data(tmp_path, seed=5, n=80)
    here = stream_operator(ds)
    ref = stream_solve(here.source, op=here)
    ls = np.linalg.lstsq(F, Y, rcond=None)[0]
    assert np.abs(ref.coef - ls).max() <= 1e-8 * np.abs(ls).max()
    assert ref.certificate.verdict == "identifiable"
    sols = {}
    for n in (1, 3):
        cluster, c = _local(n)
        with cluster, c:
            op = stream_operator(ds, c)
            sols[n] = stream_solve(op.source, op=op)
            op.release()
    op = stream_operator(ds, client)  # 2 worker processes
    sols[2] = stream_solve(op.source, op=op)
    op.release()
    for n, sol in sols.items():
        assert _same_solution(sol, ref), n
    cert = {}
    for n in (1, 3):
        cluster, c = _local(n)
        with cluster, c:
            cert[n] = scaleattn.certify_dataset(ds, client=c, solver="stream")
    assert cert[1].summary() == cert[3].summary() == scaleattn.certify_dataset(ds, solver="stream").summary()
    assert cert[1].rank == F.shape[1]


@pytest.mark.slow
def test_a_lost_worker_reruns_its_part_of_the_pass(tmp_path):
    """A worker killed in the middle of a fit: Dask recomputes its kept features and re-runs its tasks on the
    other; the answer is the in-process one, bit for bit."""
    from distributed import Client, LocalCluster

    ds, _, _ = _data(tmp_path, seed=6)
    here = stream_operator(ds)
    ref = stream_solve(here.source, op=here)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        op = stream_operator(ds, c)
        victim, pid = sorted(c.run(os.getpid).items())[0]
        matmat, killed = op.matmat, []

        def kill_at_pass_5(W):
            if op.passes == 5 and not killed:
                killed.append(victim)
                os.kill(pid, signal.SIGKILL)  # with its kept features (its nanny starts a fresh worker)
            return matmat(W)

        op.matmat = kill_at_pass_5
        sol = stream_solve(op.source, op=op)
        op.release()
        assert killed and victim not in c.scheduler_info()["workers"]
    assert _same_solution(sol, ref)


@pytest.mark.slow
def test_cli_fit_with_workers_runs_the_stream_passes_on_the_cluster(tmp_path, cli):
    ds, F, Y = _data(tmp_path, seed=7)
    cli("fit", ds.url, "--out", str(tmp_path / "run"), "--solver", "stream", "--workers", "2", "--quiet", "--no-plots")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    sp = report["solver_path"]
    assert sp["path"] == "stream" and sp["cluster"]["workers"] == 2 and sp["cluster"]["row_groups"] == 16
    assert sp["cluster"]["groups_per_task"] == 4
    assert "on the Dask cluster (2 workers" in sp["reason"]
    model = scaleattn.MHLAModel.load(str(tmp_path / "run" / "model.zarr"))
    ls = np.linalg.lstsq(F, Y, rcond=None)[0]
    assert np.abs(model.coef - ls).max() <= 1e-8 * np.abs(ls).max()
    here = scaleattn.fit(ds, solver="stream")  # in this process: the same bits
    assert np.array_equal(here.model.coef, model.coef) and "cluster" not in here.report["solver_path"]
