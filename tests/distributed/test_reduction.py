"""The fixed-order tree reduction and the one submit / wait / cancel helper (DESIGN §6): the level-by-level
shape, leaves counted by weight as they finish, a task's error re-raised and everything else cancelled."""
import time

import pytest

import scaleattn.distributed.cluster as cluster
from scaleattn.distributed.reduction import run_trees
from scaleattn.progress import Reporter


@pytest.mark.parametrize("split_every", [2, 3, 8])
def test_streaming_tree_reduction_has_the_level_by_level_shape(split_every):
    from scaleattn.distributed.reduction import tree_reduce

    def level_by_level(parts):  # the reference shape, written out independently
        while len(parts) > 1:
            parts = [f"({','.join(parts[i:i + split_every])})" if len(parts[i:i + split_every]) > 1 else parts[i]
                     for i in range(0, len(parts), split_every)]
        return parts[0]

    for n in range(1, 80):
        parts = [str(i) for i in range(n)]
        assert tree_reduce(iter(parts), lambda *p: f"({','.join(p)})", split_every) == level_by_level(parts)
    with pytest.raises(ValueError):
        tree_reduce([], lambda *p: p)


@pytest.fixture(scope="module")
def job():
    """A job's client: a real process LocalCluster of one single-threaded worker via connect."""
    with cluster.connect(workers=1, quiet=True) as c:
        yield c


class _Recorder(Reporter):
    """A reporter that records what it is told (the reporter is injected; compute code never imports UI)."""

    def __init__(self):
        self.events = []

    def bar(self, name, total, unit="rows", done=0, note=""):
        import contextlib

        self.events.append(("bar", name, total, unit, done))

        @contextlib.contextmanager
        def cm():
            yield lambda n=1: self.events.append(("advance", n))

        return cm()


def test_reporter_counts_rows_weighted_by_task(job):
    futs = [job.submit(time.sleep, 0.01, key=f"nap-{i}", pure=False) for i in range(6)]
    rec = _Recorder()
    with rec.bar("statistics", 60) as advance:
        run_trees(job, [futs], _first, advance=advance, weights={f.key: 10 for f in futs})
    assert rec.events[0] == ("bar", "statistics", 60, "rows", 0)
    assert sorted(e[1] for e in rec.events[1:]) == [10] * 6


def _first(*parts):
    return parts[0]


def test_run_trees_reraises_task_error_and_cancels(job):

    def boom():
        raise ValueError("tokens: sample 7 contains NaN or Inf")

    slow = job.submit(time.sleep, 30, pure=False)
    with pytest.raises(ValueError, match="sample 7"):
        run_trees(job, [[job.submit(boom, pure=False), slow]], _first)
    deadline = time.monotonic() + 10
    while slow.status != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow.status == "cancelled"
