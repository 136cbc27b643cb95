"""Fixed-order tree reduction, in process and on a Dask cluster (DESIGN §6).

Partials are combined ``split_every`` neighbours at a time, level by level, always in the same order, so
floating-point results do not depend on which worker finished first, on the worker count, retries or resumes.
:class:`TreeReducer` streams the same tree in process holding only ``O(split_every log n)`` items;
:func:`run_trees` submits it to a cluster, waits with progress and cancels everything on failure.
"""
from __future__ import annotations

import time

from .._tree import SPLIT_EVERY, TreeReducer, tree_reduce
from ..errors import ClusterError, ParameterError, UnsupportedError

__all__ = ["SPLIT_EVERY", "TreeReducer", "tree_reduce", "submit_tree", "run_trees", "wait_stopped", "leaf_places",
           "check_reachable", "no_worker_timeout", "NO_WORKER_S"]


def submit_tree(client, futures: list, func, split_every: int = SPLIT_EVERY):
    """:func:`tree_reduce` of ``futures`` on a cluster with ``func``.

    Combine tasks get no Dask retries: a failing sum is a bug, not a flaky store (the leaves retry their own
    store reads, :func:`~scaleattn.store._location.with_retries`). Returns ``(root, combines)``: every reduction
    future, for the caller to keep referenced until the end (so a cancel finds each of them still wanted) and
    to cancel with the inputs when something fails.
    """
    combines = []

    def combine(*parts):  # ahead of any leaf where both are ready: the tree is summed as it goes (memory)
        combines.append(client.submit(func, *parts, priority=1))
        return combines[-1]

    return tree_reduce(futures, combine, split_every), combines


def run_trees(client, leaves: list[list], func, split_every: int = SPLIT_EVERY, *, advance=None,
              weights: dict | None = None, on_leaf=None, gather: bool = True, what: str = "a task",
              need: float | None = None) -> list:
    """Reduce each list of leaf futures in ``leaves`` on the cluster (:func:`submit_tree` with ``func``), wait,
    and return the roots' results in order: the one submit / wait / cancel helper of the distributed steps.

    ``advance(weight)`` is called as each leaf finishes (``weights[key]``, default 1: e.g. rows for a progress
    bar) and ``on_leaf(future)`` after it. ``gather=False`` returns the roots as futures, finished and held on
    the workers that computed them (the krylov path's persisted tiles, :mod:`.operator`). A task's exception is
    re-raised here with its own type and message. On any failure or interrupt every leaf and combine task is
    cancelled, and this returns (raises) only once no worker still runs one of them (:func:`wait_stopped`): a
    cancelled task that was already running would otherwise go on writing (into a checkpoint the caller is
    about to remove, say).

    The wait is bounded (:class:`_Watch`): a cluster with no live worker for :func:`no_worker_timeout` seconds,
    or tasks whose workers died under them past distributed's ``allowed-failures`` (``KilledWorker``: a worker
    past its memory limit, ended by its nanny or the kernel's OOM killer), end with a
    :class:`~scaleattn.errors.ClusterError` that says so: ``what`` names the task (``"a statistics task"``),
    ``need`` the bytes one worker holds for it (:func:`~.memory.fit_memory`'s ``worker_bytes``).
    """
    from distributed import as_completed

    trees = [submit_tree(client, ls, func, split_every) for ls in leaves]
    flat = [f for ls in leaves for f in ls]
    combines = [c for _, cs in trees for c in cs]
    roots = [root for root, _ in trees]
    watch = _Watch(client, [f.key for f in flat + combines])
    try:
        done = as_completed(flat)
        while not done.is_empty():
            batch = done.next_batch(block=False)
            if not batch:  # nothing finished: is there still a worker to finish anything?
                watch.check()
                time.sleep(0.05)
            for fut in batch:
                if fut.status == "error":
                    fut.result()  # re-raise the task's exception here
                if advance is not None:
                    advance((weights or {}).get(fut.key, 1))
                if on_leaf is not None:
                    on_leaf(fut)
        while not all(r.done() for r in roots):
            watch.check()
            time.sleep(0.05)
        for r in roots:
            if r.status == "error":
                r.result()
        return roots if not gather else client.gather(roots)
    except BaseException as e:  # a task failed or we were interrupted: do not leave the cluster computing
        client.cancel(flat + combines)
        # after a failure the caller may remove the checkpoint: wait until nothing writes into it; after Ctrl-C or
        # SIGTERM the checkpoint is kept (a late write only adds a finished partial) and the pod's grace period
        # is short, so wait only briefly
        wait_stopped(client, [f.key for f in flat + combines], timeout=5.0 if isinstance(e, KeyboardInterrupt)
                     else 120.0)
        lost = watch.lost(e, what, need)
        if lost is not None:
            raise lost from None
        raise


def leaf_places(client, n: int) -> list[dict]:
    """``client.submit`` keywords for ``n`` leaves of a tree in leaf order: consecutive leaves prefer one worker
    (runs of equal length, by its thread count), others may still take them (``allow_other_workers``: Dask's
    work stealing, a lost worker). Where the scheduler places a tree's leaves itself, it hands them out as
    workers free up, one at a time: neighbours land on different workers, so most combines first wait for a
    partial's transfer, and each worker waits for its next leaf from the scheduler (measured, 2 workers on 2
    cores: about 1 s idle per worker in a 10 s build, docs/performance.md). Placed in runs, a worker holds its
    leaves from the start and the tree's lower levels combine on the worker that computed both inputs. Where
    tasks run never changes the tree, so never the bits. One worker (or none known): no preferences."""
    workers = client.scheduler_info().get("workers", {})
    slots = [addr for addr, w in sorted(workers.items()) for _ in range(max(1, int(w.get("nthreads") or 1)))]
    if len(workers) < 2:
        return [{} for _ in range(n)]
    return [{"workers": [slots[i * len(slots) // n]], "allow_other_workers": True} for i in range(n)]


def check_client(client) -> None:
    """Refuse, in one line, a ``client`` that is not a Dask client: :func:`scaleattn.connect` is a context manager
    (``with scaleattn.connect(...) as client:``), so passing it as it is was a traceback deep in the build."""
    if client is None or callable(getattr(client, "scheduler_info", None)):
        return
    hint = (" (scaleattn.connect(...) is a context manager: `with scaleattn.connect(...) as client:` then pass"
            " `client`)" if hasattr(client, "__enter__") else "")
    raise ParameterError(f"client must be a dask.distributed.Client or None, not {type(client).__name__}{hint}")


def check_reachable(client, inputs) -> None:
    """Refuse, before any task, inputs the workers of ``client`` cannot read: a store in the memory of this
    process (``memory://``, :attr:`~scaleattn.store._location.Location.in_memory`) when a worker runs in another
    process (an address other than ``inproc://``: every worker of an external scheduler or of a LocalCluster of
    processes). In this process (``client=None``, or a LocalCluster of threads) such a store is read as any
    other.

    Parameters
    ----------
    client : distributed.Client or None
    inputs : iterable of (role, Location or None)
        E.g. ``[("dataset", ds.store)]``.

    Raises
    ------
    UnsupportedError
        Naming the role, the URL and a worker in another process.
    ParameterError
        ``client`` is not a Dask client (:func:`check_client`).
    """
    check_client(client)
    if client is None:
        return
    held = [(role, loc) for role, loc in inputs if loc is not None and loc.in_memory]
    if not held:
        return
    workers = sorted(client.scheduler_info().get("workers", {}))
    outside = [a for a in workers if not str(a).startswith("inproc://")]
    if workers and not outside:
        return
    role, loc = held[0]
    who = f"workers ({outside[0]}{', ...' if len(outside) > 1 else ''})" if outside else "workers (none joined yet)"
    raise UnsupportedError(f"{role} {loc.url}: lives in the memory of this process, and the cluster's {who} run in"
                           " other processes, which cannot read it: write it to a path or store they share"
                           " (s3://..., a shared file system), or compute in this process (`client=None`)")


#: states of a worker's task that still runs user code (distributed's worker state machine)
_RUNNING = ("executing", "long-running", "cancelled", "resumed")


def wait_stopped(client, keys, timeout: float = 120.0, poll: float = 0.1) -> bool:
    """Wait until no worker runs any task of ``keys`` (cancelled tasks that were executing finish their
    current call first: Dask cannot interrupt them). True when they stopped, False after ``timeout`` seconds
    or when the workers cannot be asked (the cluster went away)."""
    keys = set(keys)

    def running(dask_worker):
        return [k for k, ts in dask_worker.state.tasks.items() if k in keys and ts.state in _RUNNING]

    deadline = time.monotonic() + timeout
    while True:
        try:
            if not any(client.run(running).values()):
                return True
        except Exception:  # the cluster is gone (or refuses): nothing left to wait for here
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)


#: seconds a distributed step waits while its cluster has no live worker (or its tasks may run on none of the live
#: ones) before it gives up, unless the dask config ``distributed.scheduler.no-workers-timeout`` says otherwise
NO_WORKER_S = 60.0
#: seconds between two looks at the cluster while nothing finishes
WATCH_S = 1.0


def no_worker_timeout() -> float:
    """Seconds without a live worker before a step gives up: the dask config's
    ``distributed.scheduler.no-workers-timeout`` (distributed's own, which the embedded cluster's scheduler applies
    too), else :data:`NO_WORKER_S`."""
    import dask
    from dask.utils import parse_timedelta

    value = dask.config.get("distributed.scheduler.no-workers-timeout", None)
    return float(parse_timedelta(value, default="s")) if value is not None else NO_WORKER_S


def _census(keys, dask_scheduler=None) -> dict:
    """On the scheduler: its live workers and their memory limits, and of the tasks ``keys``: the most workers
    that died running one (distributed's ``suspicious`` count) and those waiting where no live worker may run
    them (``no-worker``). Such a task placed on a worker that died (loose restrictions: a preference) waits there
    for ever (distributed re-checks it only for a worker of the same address); its preference is dropped here,
    so that a live worker takes it, as ``allow_other_workers`` says."""
    import time as _time

    s = dask_scheduler
    ours = [s.tasks[k] for k in keys if k in s.tasks]
    stuck = [ts for ts in ours if ts.state == "no-worker"]
    freed = [ts for ts in stuck if ts.loose_restrictions and s.workers]
    for ts in freed:
        ts.worker_restrictions = None
        ts.loose_restrictions = False
    if freed:
        s.transitions({ts.key: "processing" for ts in freed}, f"scaleattn-unplaced-{_time.time()}")
    return {"workers": len(s.workers), "limits": [ws.memory_limit for ws in s.workers.values()],
            "deaths": max((ts.suspicious for ts in ours), default=0), "stuck": len(stuck) - len(freed)}


class _Watch:
    """Bounds a distributed step's wait: looks at the cluster (:func:`_census`) while nothing finishes and raises
    :class:`~scaleattn.errors.ClusterError` once no worker was alive for :func:`no_worker_timeout` seconds."""

    def __init__(self, client, keys):
        self.client, self.keys = client, list(keys)
        self.timeout = no_worker_timeout()
        self.last = time.monotonic()
        self.empty_since = None  # since when the cluster has had no worker (or none that may run our tasks)
        self.seen = {"workers": None, "limits": [], "deaths": 0, "stuck": 0}
        self.deaths, self.limits = 0, []  # the most workers a task saw die; the workers' memory limits, as last seen

    def look(self) -> dict:
        try:
            self.seen = self.client.run_on_scheduler(_census, self.keys)
        except Exception:  # (a scheduler that refuses pickled functions: only the count of its workers)
            try:
                self.seen = {**self.seen, "workers": len(self.client.nthreads())}
            except Exception:  # the scheduler is gone: the client's own calls say so
                pass
        self.deaths = max(self.deaths, int(self.seen.get("deaths") or 0))
        self.limits = [x for x in self.seen.get("limits") or [] if x] or self.limits
        return self.seen

    def check(self) -> None:
        now = time.monotonic()
        if now - self.last < WATCH_S:
            return
        self.last = now
        seen = self.look()
        if seen["workers"] or seen["workers"] is None:
            if not seen["stuck"]:
                self.empty_since = None
                return
        self.empty_since = self.empty_since or now
        if now - self.empty_since >= self.timeout:
            raise _NoWorker()

    def lost(self, e: BaseException, what: str, need: float | None) -> ClusterError | None:
        """The :class:`ClusterError` for ``e`` when it says the cluster lost its workers (None otherwise): tasks
        whose workers died (``KilledWorker``, distributed's ``NoWorkerError`` / ``NoValidWorkerError`` after its
        own ``no-workers-timeout``), or no worker for this watch's timeout."""
        from distributed.scheduler import KilledWorker, NoValidWorkerError, NoWorkerError

        if not isinstance(e, (_NoWorker, KilledWorker, NoWorkerError, NoValidWorkerError)):
            return None
        import dask

        if not isinstance(e, _NoWorker):
            self.look()  # (the deaths and limits up to the failure)
        limits = self.limits
        allowed = int(dask.config.get("distributed.scheduler.allowed-failures", 3))
        deaths = max(self.deaths, allowed + 1 if isinstance(e, KilledWorker) else 0)
        gib = 2.0**30
        need_text = f"; {what} holds about {need / gib:.2f} GiB" if need else ""
        terminate = dask.config.get("distributed.worker.memory.terminate", None)  # (the nanny's fraction)
        limit = "" if not limits else f" of {min(limits) / gib:.2f} GiB" + (
            f" (its nanny ends it at {terminate:.0%} of it: {min(limits) * terminate / gib:.2f} GiB)"
            if terminate else "")
        died = (f"the Dask workers running {what} died under it" + (f" {deaths} times" if deaths > 1 else "")
                + f" (as a worker past its memory limit{limit} is ended, or by the kernel's OOM killer)")
        if isinstance(e, (_NoWorker, NoWorkerError)):
            head = (f"the Dask cluster has had no live worker for {self.timeout:g} s (`worker_timeout`, or"
                    " `distributed.scheduler.no-workers-timeout` in the dask config, sets how long to wait)"
                    + (f"; {died}" if deaths else ""))
        else:
            head = died
        return ClusterError(f"{head}{need_text}: give each worker more memory (fewer `workers` on this machine,"
                            " each then gets a larger share; or Dask workers started with a larger `memory_limit`),"
                            " add workers with more memory, or use fewer rows per task (smaller chunks of the"
                            " dataset)")


class _NoWorker(Exception):
    """The cluster had no live worker for :func:`no_worker_timeout` seconds (turned into a ClusterError)."""
