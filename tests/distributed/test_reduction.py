"""The fixed-order tree reduction and the one submit / wait / cancel helper (DESIGN §6): the level-by-level
shape, leaves counted by weight as they finish, a task's error re-raised and everything else cancelled."""
import time

import pytest

from scaleattn.display._progress import Reporter
from scaleattn.distributed.reduction import leaf_places, run_trees, tree_reduce


@pytest.mark.parametrize("split_every", [2, 3, 8])
def test_streaming_tree_reduction_has_the_level_by_level_shape(split_every):
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


class _Info:
    def __init__(self, threads):
        self.workers = {f"tcp://w{i}": {"nthreads": t} for i, t in enumerate(threads)}

    def scheduler_info(self):
        return {"workers": self.workers}


def test_leaves_prefer_one_worker_per_run_of_neighbours():
    got = leaf_places(_Info([1, 1]), 16)  # two workers: groups 0-7 on one, 8-15 on the other
    assert [p["workers"] for p in got] == [["tcp://w0"]] * 8 + [["tcp://w1"]] * 8
    assert all(p["allow_other_workers"] for p in got)  # a preference: stealing and lost workers still work
    runs = [p["workers"][0] for p in leaf_places(_Info([2, 1, 1]), 10)]  # by threads: 2 + 1 + 1 of 4 slots
    assert runs == ["tcp://w0"] * 5 + ["tcp://w1"] * 3 + ["tcp://w2"] * 2
    assert runs == sorted(runs)  # consecutive leaves share a worker: the tree's low levels combine there
    assert leaf_places(_Info([4]), 5) == [{}] * 5 and leaf_places(_Info([]), 2) == [{}] * 2


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


@pytest.mark.slow
def test_reporter_counts_rows_weighted_by_task(client):
    futs = [client.submit(time.sleep, 0.01, key=f"nap-{i}", pure=False) for i in range(6)]
    rec = _Recorder()
    with rec.bar("statistics", 60) as advance:
        run_trees(client, [futs], _first, advance=advance, weights={f.key: 10 for f in futs})
    assert rec.events[0] == ("bar", "statistics", 60, "rows", 0)
    assert sorted(e[1] for e in rec.events[1:]) == [10] * 6


def _first(*parts):
    return parts[0]


def _blocked(name):
    """A task that runs until the event ``name`` is set (so a test can free the worker thread afterwards)."""
    from distributed import Event

    Event(name).wait(60)


def test_run_trees_reraises_task_error_and_cancels(client):
    """A task's error comes back with its own type while another task is pending or running; that task is
    cancelled, and run_trees returns only once no worker still runs it (a running task finishes its current
    call: here when the event is set a second later, not at the event's 60 s timeout)."""
    import threading

    from distributed import Event

    def boom():
        raise ValueError("tokens: sample 7 contains NaN or Inf")

    release = Event("release-blocked-task", client=client)
    timer = threading.Timer(1.0, release.set)
    try:
        failing = client.submit(boom, pure=False)  # first: it runs first even if both land on one worker
        slow = client.submit(_blocked, release.name, pure=False)
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(ValueError, match="sample 7"):
            run_trees(client, [[failing, slow]], _first)
        assert time.monotonic() - t0 < 30, "the error waited for more than the running task"

        def running(dask_worker):
            return [k for k, ts in dask_worker.state.tasks.items()
                    if k == slow.key and ts.state in ("executing", "cancelled", "resumed")]
        assert not any(client.run(running).values()), "returned while a worker still ran the cancelled task"
        deadline = time.monotonic() + 10
        while slow.status != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.status == "cancelled"
    finally:
        timer.cancel()
        release.set()  # the cancelled task's thread returns: the shared cluster is free again
