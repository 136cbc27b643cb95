"""The streaming path's passes on a Dask cluster (DESIGN §4b, §6): one pass = one map over row groups, no node
holding anything of size psi^2 or N x psi.

:class:`DistributedStreamOperator` is :class:`scaleattn.linalg._stream.StreamOperator` with its sums taken on
the workers. The dataset is cut into the build's row groups (:func:`scaleattn.distributed.partition.row_groups`:
they depend on the dataset only, never on the workers). On a worker, each group's Zarr chunks are read through the
:class:`~scaleattn.data.Dataset` (every read checked against the manifest, as the statistics build's are), cut
into the blocks of :func:`scaleattn.linalg._passes.cut_blocks`, and summed by the very block functions the
in-process operator uses (:func:`~scaleattn.linalg._passes.group_gw`, ``group_sweep``, ``group_sse``) into the
group's partial (psi x k for ``G W``). The partials are added by the fixed-order tree (:mod:`scaleattn._tree`,
:func:`scaleattn.distributed.reduction.submit_tree` on the workers), and only the root comes back. A task takes a
run of :func:`span` groups (at least two tasks per worker), which is a whole subtree of that tree: it adds its
groups' partials itself, the tree adds the runs' sums, and the bits are those of one task per group. Every
product runs on one BLAS thread and on aligned operands of the layout the in-process pass has (a GEMM's bits
depend on both), so the answer is bit-identical for 1, 2 or 8 workers, and to the in-process operator given the
same row groups.

Traffic per pass: ``X`` (psi x k) is scattered once, and each worker fetches it once; each task's partial
(psi x k) goes into the tree; the sum (psi x k) comes back. The first sweep (``diag G``, the K-FAC factors ``A``
(m x m) and ``B`` (d x d), ``Phi^T Y``, ``sum y^2``, the row count) is one such map and tree too.

The groups' token features (N x (m + d + d_out) floats in all, a share on each worker) are kept on the workers
between passes when each worker's share fits its budget (``cache_bytes``; by default a quarter of the smallest
worker memory limit): one task per group computes them once and stays persisted, and each pass's task of those
groups runs where they are. Otherwise every pass reads the chunks again and recomputes them. A lost worker's
tasks are re-run by Dask (its kept features recomputed from the dataset, their lineage); a pass with no live
worker for the watch's timeout ends with a :class:`~scaleattn.errors.ClusterError` (:mod:`.reduction`); Ctrl-C
cancels the pass's tasks.
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from .._tree import TreeReducer
from ..data._checks import expected_rows
from ..errors import ParameterError
from ..features import n_features, n_pairs
from ..linalg._gram import blas_single_thread
from ..linalg._passes import add_parts, aligned, c_order, cut_blocks, group_gw, group_sse, group_sweep
from ..linalg._stream import BLOCK_ROWS, StreamOperator, rows_from_dataset
from ..store._location import with_retries
from .partition import row_groups
from .reduction import SPLIT_EVERY, WATCH_S, _Watch, check_reachable, leaf_places, submit_tree, wait_stopped

__all__ = ["DistributedStreamOperator", "stream_operator", "feature_bytes", "span", "CACHE_FRACTION"]

#: the token features kept on a worker take at most this fraction of its memory limit (default budget)
CACHE_FRACTION = 0.25


class _Group:
    """A row group to read on a worker: samples ``[a, b)`` of ``dataset``."""

    def __init__(self, dataset, a: int, b: int, targets: bool, block_rows: int):
        self.dataset, self.a, self.b, self.targets, self.block_rows = dataset, a, b, targets, block_rows

    def blocks(self):
        ds = self.dataset
        return cut_blocks(ds.read_chunks(self.a, self.b, targets=self.targets), self.block_rows, ds.causal)


_one_lock = threading.Lock()
_one_state: list = [0, None]  # tasks inside _one_blas_thread in this process, and the limit they hold


@contextlib.contextmanager
def _one_blas_thread():
    """BLAS on one thread while any task of this process is inside (the limit is process-wide: on a worker with
    several threads, or a LocalCluster of threads, nested enter/exit pairs of :func:`blas_single_thread` from
    tasks running at once would restore the thread count under another task's GEMM, and change its bits)."""
    with _one_lock:
        if _one_state[0] == 0:
            _one_state[1] = blas_single_thread()
            _one_state[1].__enter__()
        _one_state[0] += 1
    try:
        yield
    finally:
        with _one_lock:
            _one_state[0] -= 1
            if _one_state[0] == 0:
                _one_state[1].__exit__(None, None, None)
                _one_state[1] = None


def _read_run(groups: list) -> list:
    """The blocks of a run of groups, all of them, per group (a task whose result stays on its worker between
    passes)."""
    groups[0].dataset.group()  # the store this worker sees is the one the client checked (else one line naming it)
    with _one_blas_thread():
        return [with_retries(lambda g=g: list(g.blocks())) for g in groups]


def _leaf(func, args, split_every: int, srcs):
    """The partial of a run of row groups (an aligned subtree of the pass's tree): ``func(blocks, *args)`` of each
    group, over its kept blocks (a list) or its chunks read again (a :class:`_Group`), on one BLAS thread, added
    in the fixed-order tree."""
    args = tuple(c_order(a) if isinstance(a, np.ndarray) else a for a in args)  # (as deserialised: maybe misaligned)
    red = TreeReducer(add_parts, split_every)
    with _one_blas_thread():
        for src in srcs:
            if isinstance(src, _Group):
                src.dataset.group()
                red.add(with_retries(lambda g=src: func(g.blocks(), *args)))
            else:  # (kept blocks that moved here from another worker may arrive misaligned)
                red.add(func(((aligned(s), aligned(x), aligned(y)) for s, x, y in src), *args))
    return red.result()


def span(n_groups: int, workers: int, split_every: int = SPLIT_EVERY) -> int:
    """Row groups per task of a pass: the largest power of ``split_every`` that leaves at least two tasks per
    worker. A run of that many groups starting at a multiple of it is a whole subtree of the fixed-order tree
    (:func:`scaleattn._tree.tree_reduce` of the runs' sums is that of the groups' partials, bit for bit), so the
    span changes the number of tasks, never the answer; fewer tasks, fewer scheduler round trips per pass."""
    k = 1
    while -(-n_groups // (k * split_every)) >= 2 * max(int(workers), 1):
        k *= split_every
    return k


def _aligned(part):
    """A partial as received, its arrays aligned and in C order (:func:`scaleattn.linalg._passes.c_order`: numpy
    multiplies a misaligned array outside BLAS, with other bits, in every later product of the solve)."""
    if isinstance(part, tuple):
        return tuple(_aligned(p) for p in part)
    return c_order(part) if isinstance(part, np.ndarray) else part


def feature_bytes(n_rows: int, d: int, d_out: int) -> int:
    """Bytes of the token features of ``n_rows`` rows: ``s``, ``x`` and ``y`` (``m + d + d_out`` floats a row)."""
    return 8 * int(n_rows) * (n_pairs(d) + d + d_out)


class DistributedStreamOperator(StreamOperator):
    """``G W`` by one map over row groups on a Dask cluster and the fixed-order tree (DESIGN §4b, §6).

    The operator of :func:`scaleattn.linalg._stream.stream_solve` (pass it as ``op``) with every pass on the
    workers: bit-identical to :class:`~scaleattn.linalg._stream.StreamOperator` over
    ``rows_from_dataset(dataset, groups=groups)`` and for any number of workers.

    Parameters
    ----------
    client : distributed.Client
    dataset : Dataset
        The rows to fit (its workers must reach its store).
    targets : bool
        Read the targets (False: a certificate, tokens only).
    groups : list of (int, int), optional
        Sample ranges; default :func:`scaleattn.distributed.partition.row_groups` of ``dataset``.
    block_rows : int
        Rows per block of a pass (:data:`scaleattn.linalg._stream.BLOCK_ROWS`).
    cache_bytes : float, optional
        Per-worker budget for the kept token features (default :data:`CACHE_FRACTION` of the smallest worker
        memory limit, 1 GiB where the workers have none); 0 never keeps them.
    split_every : int
        Partials combined per reduction task.
    note : callable, optional
        ``note(text)``: told of the first sweep and of each pass (a progress phase's note).
    journal : PassJournal, optional
        As :class:`~scaleattn.linalg._stream.StreamOperator`'s: kept and read back here, on the client (the
        workers only compute passes; a journal made in this process is resumed on a cluster and the other way).

    Attributes
    ----------
    passes : int
        Products ``G W`` so far (the first sweep is not one).
    features_kept : bool
        Whether the groups' token features stay on the workers between passes.
    workers : int
        Workers when the operator was made.

    Raises
    ------
    ParameterError
        No client.
    DatasetError
        No rows; features that overflow float64.
    ClusterError
        The cluster lost its workers (:mod:`.reduction`).

    Examples
    --------
    >>> from distributed import Client, LocalCluster  # doctest: +SKIP
    >>> from scaleattn.linalg._stream import stream_solve  # doctest: +SKIP
    >>> op = DistributedStreamOperator(Client(LocalCluster(n_workers=2)), dataset)  # doctest: +SKIP
    >>> sol = stream_solve(op.source, op=op)  # the passes on the workers  # doctest: +SKIP
    """

    def __init__(self, client, dataset, *, targets: bool = True, groups=None, block_rows: int = BLOCK_ROWS,
                 cache_bytes: float | None = None, split_every: int = SPLIT_EVERY, note=None, journal=None):
        if client is None:
            raise ParameterError("DistributedStreamOperator needs a Dask client (without one, StreamOperator)")
        check_reachable(client, [("dataset", dataset.store)])
        self.client, self.split_every, self.note = client, int(split_every), note or (lambda text: None)
        self.journal = journal
        self.d = dataset.d
        self.m, self.psi = n_pairs(self.d), n_features(self.d)
        self.passes = 0
        with_y = bool(targets) and dataset.d_out > 0
        self.groups = row_groups(dataset) if groups is None else [(int(a), int(b)) for a, b in groups]
        # the same rows on the client (never read there by a pass; the dual, which needs them all, reads them)
        self.source = rows_from_dataset(dataset, targets=with_y, block_rows=block_rows, groups=self.groups)
        info = client.scheduler_info().get("workers", {})
        self.workers = len(info)
        if cache_bytes is None:
            limits = [w.get("memory_limit") or 0 for w in info.values()]
            cache_bytes = CACHE_FRACTION * min(limits) if limits and min(limits) > 0 else float(1 << 30)
        need = feature_bytes(expected_rows(dataset, 0, dataset.n_samples), self.d, dataset.d_out if with_y else 0)
        share = need * (1 + 1 / max(len(self.groups), 1)) / max(self.workers, 1)  # (a group more than its share)
        self.features_kept, self.feature_bytes = bool(cache_bytes > 0 and share <= cache_bytes), need
        specs = [_Group(dataset, a, b, with_y, block_rows) for a, b in self.groups]
        self.span = span(len(specs), self.workers, self.split_every)
        self._runs = [specs[j:j + self.span] for j in range(0, len(specs), self.span)]
        self.task_places = leaf_places(client, len(self._runs))
        # kept features: one task per run, pinned to a worker (runs of runs per worker, as the leaves' places): a
        # pass's task of that run then runs there and moves no features. Pinned, not preferred: Dask's work
        # stealing moved preferred ones between the workers (measured: 8 groups each, interleaved, so that every
        # task of a pass fetched features and one worker ran 3 of 4). A worker lost is healed (:meth:`_heal`).
        self._kept, self._kept_on = [], []
        if self.features_kept:
            slots = sorted(info)
            for j, run in enumerate(self._runs):
                self._keep(j, run, slots[j * len(slots) // len(self._runs)] if slots else None)
        try:
            self._finish_sweep(self._swept(lambda: self._pass(group_sweep, self.d, self.source.d_out)))
            self.note(f"first sweep (diag G, K-FAC factors, moments): {self.n_rows:,} rows, {len(self.groups)} row"
                      f" groups on {self.workers} workers")
        except BaseException:
            self.release()
            raise

    def _keep(self, j: int, run: list, worker) -> None:
        """(Re)submit run ``j``'s kept features, pinned to ``worker``."""
        fut = self.client.submit(_read_run, run, pure=False, **({} if worker is None else {"workers": [worker]}))
        if j < len(self._kept):
            old, self._kept[j], self._kept_on[j] = self._kept[j], fut, worker
            self.client.cancel([old])
        else:
            self._kept.append(fut)
            self._kept_on.append(worker)

    def _heal(self) -> bool:
        """Kept features pinned to a worker that left the cluster are computed again on the live worker holding
        the fewest (the same bits: the same reads). True when any was."""
        if not self._kept:
            return False
        live = sorted(self.client.scheduler_info().get("workers", {}))
        lost = [j for j, w in enumerate(self._kept_on) if w is not None and w not in live]
        for j in lost if live else []:
            w = min(live, key=lambda a: (sum(1 for x in self._kept_on if x == a), a))
            self._keep(j, self._runs[j], w)
        return bool(lost and live)

    def _pass(self, func, *args):
        """``func(blocks, *args)`` of every group on the workers, added by the fixed-order tree; the sum here.
        Array arguments are scattered once, to one worker; each other worker fetches them once (Dask moves a
        dependency to a worker once however many of its tasks need it). A broadcast scatter would be one message
        less per worker, but it waits (30 s per try, for ever) on a worker that died since the last pass. A worker
        lost during the pass: its kept features are computed again elsewhere and the pass submitted again."""
        from distributed import wait

        client = self.client
        while True:
            self._heal()
            sent = tuple(client.scatter(a, hash=False) if isinstance(a, np.ndarray) else a for a in args)
            srcs = self._kept or self._runs
            # a task where its run's features are kept (else placed in runs): named, not left to the data's
            # locality, which Dask's queuing of many-task groups ignores (measured: 3 of 4 tasks on one worker)
            places = ([{"workers": [w], "allow_other_workers": True} if w else {} for w in self._kept_on]
                      if self._kept else self.task_places if len(srcs) == len(self.task_places) else [{}] * len(srcs))
            leaves = [client.submit(_leaf, func, list(sent), self.split_every, src, pure=False, **p)
                      for src, p in zip(srcs, places)]
            root, combines = submit_tree(client, leaves, add_parts, self.split_every)
            keys = [f.key for f in leaves + combines]
            watch = _Watch(client, keys + [f.key for f in self._kept])
            try:
                healed = False
                while not healed:
                    try:
                        wait([root], timeout=WATCH_S)
                        return _aligned(root.result())
                    except TimeoutError:  # nothing finished for a while: a worker lost? still one to finish it?
                        healed = self._heal()
                        if not healed:
                            watch.check()
                client.cancel(leaves + combines)  # (healed: this pass again, on the features as they are now)
            except BaseException as e:
                client.cancel(leaves + combines)
                wait_stopped(client, keys, timeout=5.0 if isinstance(e, KeyboardInterrupt) else 30.0)
                lost = watch.lost(e, "a streaming pass", None)
                if lost is not None:
                    raise lost from e
                raise

    def map_groups(self, func, *args):
        return self._pass(func, *args)

    def matmat(self, W):
        """``G W`` for ``W`` (psi, k): one map over the row groups on the workers."""
        W = np.asarray(W, np.float64)
        k = W.shape[1]
        t = time.perf_counter()
        out, back = self._journaled("gw", group_gw, c_order(W.reshape(self.m, self.d * k)), k)
        self.passes += 1
        took = f"{time.perf_counter() - t:.1f} s, {self.workers} workers"
        self.note(f"data pass {self.passes} ({k} columns, {'read back from the checkpoint' if back else took})")
        return out.reshape(self.psi, k)

    def residual_sse(self, coef) -> float:
        c = np.asarray(coef, np.float64)
        k = c.shape[1]
        return float(self._journaled("sse", group_sse, c_order(c.reshape(self.m, self.d * k)), k)[0])

    def release(self) -> None:
        """Drop the kept token features from the workers (a fit does so when it ends, failed or not)."""
        kept, self._kept = self._kept, []
        if kept:
            self.client.cancel(kept)

    def summary(self) -> dict:
        """What a report says of the cluster's part: workers, row groups, whether the features were kept."""
        return {"workers": self.workers, "row_groups": len(self.groups), "groups_per_task": self.span,
                "features_kept": self.features_kept, "feature_bytes": int(self.feature_bytes)}


def stream_operator(dataset, client=None, *, targets: bool = True, **kwargs) -> StreamOperator:
    """The streaming operator of ``dataset`` in its row groups: on the cluster of ``client``
    (:class:`DistributedStreamOperator`), or in this process (``client=None``:
    :class:`~scaleattn.linalg._stream.StreamOperator`); the same bits either way."""
    if client is not None:
        return DistributedStreamOperator(client, dataset, targets=targets, **kwargs)
    with_y = bool(targets) and dataset.d_out > 0
    return StreamOperator(rows_from_dataset(dataset, targets=with_y, groups=row_groups(dataset),
                                            **{k: v for k, v in kwargs.items() if k == "block_rows"}),
                          kwargs.get("note"), kwargs.get("journal"))
