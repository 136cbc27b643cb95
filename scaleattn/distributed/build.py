"""The distributed statistics build (DESIGN §6): row groups x column tiles as Dask tasks, each
streaming its rows chunk by chunk into a partial, combined by the fixed-order tree of :mod:`.reduction`, with every
finished partial checkpointed (:mod:`.checkpoint`). Without a client the same tasks and tree run in process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets

import numpy as np

from .. import _testing
from .._backend import array_module, check_device, is_numpy
from ..data._checks import expected_rows, fingerprint, row_bindings
from ..data._dataset import CUT_CHUNKS, Dataset, check_dataset_argument, open_dataset
from ..display._progress import as_reporter
from ..errors import IntegrityError, ParameterError
from ..features import n_features
from ..statistics._compiled import kernels_cached
from ..statistics._container import Statistics, accumulate
from ..statistics._kernel import kernel_name
from ..store._location import Location, resolve, with_retries
from .checkpoint import Checkpoint
from .memory import chunk_bytes, fit_memory, release_large_buffers
from .partition import MAX_TILE_BYTES, TILED_MAX_GROUPS, row_groups, tile_bounds
from .reduction import SPLIT_EVERY, TreeReducer, check_reachable, leaf_places, run_trees

__all__ = ["compute_statistics", "build_statistics", "Build", "group_statistics", "check_unchanged"]

log = logging.getLogger("scaleattn")


def group_statistics(dataset, start: int, stop: int, targets: bool = True, device: str = "auto",
                     cols: tuple[int, int] | None = None, kernel: str | None = None, reuse=None) -> Statistics:
    """Statistics of samples ``[start, stop)`` of a dataset, streamed chunk by chunk (one Dask task;
    :meth:`~scaleattn.data._dataset.Dataset.read_chunks`: a chunk cut by the range is read whole and checked).

    ``device``: ``"cpu"``, ``"gpu"`` (CuPy) or ``"auto"`` (GPU when this worker has one). Returned on the host.
    ``cols = (c0, c1)`` builds one tile: ``gram_compact`` is then rows ``[c0, c1)`` of ``Tc`` only
    ((c1 - c0, d(d+1)/2); memory bounded by the tile and one block of rows, DESIGN §6); ``B``, ``yy`` and
    ``N`` are as usual (pass ``targets=False`` to skip ``B`` and ``yy`` in all but one tile). ``kernel``: the
    statistics kernel (:func:`scaleattn.statistics._kernel.kernel_name`; the client's, so that every worker uses it).
    ``reuse``: the build's token for the chunks its bounds cut (read and checked once per process, not once per
    group: :meth:`~scaleattn.data._dataset.Dataset.read_chunks`). Raises :class:`~scaleattn.data._dataset.DatasetError`
    on bad values (naming the array and the sample).
    """
    xp = array_module(device)
    if cols is None:
        stats = Statistics.zeros(dataset.d, dataset.d_out if targets else 0, xp)
        sl = None
    else:
        sl = slice(int(cols[0]), int(cols[1]))
        stats = Statistics(xp.zeros((sl.stop - sl.start, dataset.d * (dataset.d + 1) // 2), dtype=xp.float64),
                           xp.zeros((n_features(dataset.d), dataset.d_out if targets else 0), dtype=xp.float64), 0.0,
                           0, dataset.d)  # float64 whatever the namespace's default float
    for tok, lens, y in dataset.read_chunks(start, stop, targets=targets, reuse=reuse):
        if not is_numpy(xp):
            tok, lens, y = (None if t is None else xp.asarray(t) for t in (tok, lens, y))
        accumulate(stats, tok, y, lens, dataset.causal, cols=sl, kernel=kernel)
    return stats.to_numpy()


def _add_all(*parts: Statistics, inplace: bool = False) -> Statistics:
    """Sum in order (same bits as ``((p0 + p1) + p2) + ...``) into a new buffer, or into ``parts[0]`` with
    ``inplace`` (only for partials this process owns: a Dask task must never modify its inputs)."""
    out = parts[0] if inplace else (parts[0] + parts[1] if len(parts) > 1 else parts[0])
    for p in parts[1 if inplace else 2:]:
        if p.gram_compact.shape != out.gram_compact.shape or p.moments.shape != out.moments.shape:
            raise ParameterError(f"cannot add statistics of (d, d_out) = {(out.d, out.d_out)} and {(p.d, p.d_out)}")
        out.gram_compact += p.gram_compact
        out.moments += p.moments
        out.yy += p.yy
        out.n_rows += p.n_rows
    return out


def _partial(dataset, gi: int, ti: int, start: int, stop: int, cols, targets: bool, device: str, ckpt, source=0,
             kernel: str | None = None, reuse=None):
    """One task: the partial of row group ``gi``, tile ``ti``. With a checkpoint, a partial already marked done
    is read back when it is bound to the input rows as they are now (``source``, from
    :func:`~scaleattn.data._checks.row_bindings`) and passes its checksum and row count (a retry after a lost worker
    or a resume recomputes nothing); anything else is recomputed, written there, then marked done, by this
    worker, with this process's glibc thresholds set (:func:`~.memory.release_large_buffers`: a Dask nanny's
    64 KiB trim threshold made a worker's build slower than the in-process one). Store hiccups are retried here
    (:func:`~scaleattn.store._location.with_retries`); bad data fails the task once. ``kernel``: the client's
    statistics kernel (the checkpoint's, when there is one); ``reuse``: the build's token for its cut chunks
    (:func:`group_statistics`)."""
    dataset.group()  # the store this worker sees is the one the client checked (else one line naming the worker)
    if ckpt is not None and ckpt.is_done(gi, ti):
        part, why = ckpt.verified(gi, ti, source, expected_rows(dataset, start, stop))
        if part is not None:
            return part
        if "damaged" in why:  # (stale ones the client has reported)
            log.warning("checkpoint %s: the partial of samples [%d, %d) (tile %d) %s: recomputed", ckpt.url, start,
                        stop, ti, why)
        ckpt.forget(gi, ti)
    _testing.before_task()
    release_large_buffers()  # glibc thresholds of this worker, whatever its cluster's environment (cheap)
    part = with_retries(group_statistics, dataset, start, stop, targets and ti == 0, device, cols,
                        ckpt.kernel if ckpt is not None else kernel, reuse)
    if ckpt is not None:
        with_retries(ckpt.write, gi, ti, part, source)
    return part


def _task_bytes(dataset, targets: bool) -> float | None:
    """Bytes a worker holds for one statistics task (its partials while it combines, a block of features, a chunk
    as read): what a worker's memory limit must allow (said when workers die under the tasks)."""
    try:
        return fit_memory(dataset.d, dataset.d_out if targets else 0)["worker_bytes"] + chunk_bytes(dataset, targets)
    except Exception:  # (an estimate for a message: never the reason a build fails)
        return None


def _assemble(tiles: list, d: int) -> Statistics:
    """Concatenate per-tile statistics (tile 0 carries ``B`` and ``yy``) into one :class:`Statistics`."""
    first = tiles[0]
    rows = {int(t.n_rows) for t in tiles}
    if len(rows) != 1:
        raise RuntimeError(f"tiles disagree on the row count: {sorted(rows)}")
    gram = first.gram_compact if len(tiles) == 1 else np.concatenate([t.gram_compact for t in tiles], axis=0)
    return Statistics(gram, first.moments, float(first.yy), int(first.n_rows), d)


@dataclasses.dataclass
class Build:
    """What a statistics build returns (:func:`build_statistics`): the statistics and what a fit reports of the
    build. ``groups_resumed`` counts the groups whose every tile was read from the checkpoint; ``bindings`` is
    ``(groups, targets, sources)``, what a later pass over the rows is checked against (:func:`check_unchanged`)."""

    statistics: object  # Statistics; with ``persist``, ``(tiles, roots)``
    groups: int
    tiles: int
    groups_computed: int
    groups_resumed: int
    tasks_computed: int
    tasks_resumed: int
    checkpoint: str | None
    bindings: tuple


def compute_statistics(dataset, client=None, *, targets: bool = True, group_samples: int | None = None,
                       split_every: int = SPLIT_EVERY, device: str = "auto", progress=False,
                       tile_rows: int | None = None, max_tile_bytes: float | None = MAX_TILE_BYTES,
                       checkpoint=None, storage_options=None, persist: bool = False):
    """Build the statistics of a dataset on a Dask cluster by tree reduction (DESIGN §6).

    Each task streams one row group (:func:`~scaleattn.distributed.partition.row_groups`) for one column tile of
    ``Tc`` (:func:`~scaleattn.distributed.partition.tile_bounds`; a single tile unless ``Tc`` exceeds
    ``max_tile_bytes``) and accumulates locally. Partials are combined per tile by the fixed-order tree on the
    workers, always in group order, so the result is bit-identical for any worker count, completion order,
    retry or resume; tiled and untiled builds agree to round-off. The client receives only the per-tile roots
    and concatenates them.

    Parameters
    ----------
    dataset : Dataset, str or path-like
        From :func:`scaleattn.open_dataset` (a path or URL is opened with ``storage_options``).
    client : distributed.Client, optional
        Without one the tasks run in this process (same tree, same bits).
    targets : bool
        False builds only the Gram (enough for the certificate).
    group_samples : int, optional
        Samples per row group (exactly; chunks cut where they fall); default: groups of equal rows from
        :func:`~scaleattn.distributed.partition.row_groups` (at most ``TILED_MAX_GROUPS`` when tiled).
    split_every : int
        Partials combined per reduction task.
    device : {"auto", "cpu", "gpu"}
        Array device of the tasks (:func:`scaleattn._backend.array_module`).
    progress : bool or Reporter
        A bar in rows (samples for causal data with variable lengths) with the rate and time left.
    tile_rows, max_tile_bytes
        Tiling: rows of ``Tc`` per tile, or the size above which ``Tc`` is tiled.
    checkpoint : str, path-like or Location, optional
        Checkpoint store (:class:`~scaleattn.distributed.checkpoint.Checkpoint`), created if absent: every
        finished partial is written there by its worker and marked done; partials already done are read back,
        not recomputed.
    storage_options : dict, optional
        fsspec options of ``checkpoint`` (default the dataset's).
    persist : bool
        With a client: leave each tile's root on the worker that computed it and return ``(tiles, roots)`` (the
        row ranges of ``Tc`` and the futures of their :class:`Statistics`) instead of gathering them: the
        client never holds ``Tc`` (:func:`scaleattn.distributed.operator.remote_statistics`).

    Returns
    -------
    Statistics
        On the host, float64.

    Raises
    ------
    ParameterError
        An unknown ``device``, or a dataset the cluster's workers cannot reach.
    CheckpointError
        ``checkpoint`` exists but belongs to another dataset, chunking, grouping, tiling or version.
    DatasetError
        Bad values in the dataset (naming the array and the sample).

    See Also
    --------
    build_statistics : the same with the build's counts (a :class:`Build`), for callers that validated.
    scaleattn.statistics_from_arrays : the same for in-memory arrays.
    scaleattn.fit : statistics, solve, certificate and heads in one call.

    Examples
    --------
    >>> import scaleattn
    >>> from scaleattn.generate import generate_mhla
    >>> ds = generate_mhla("_doc_stats.zarr", d=2, heads=1, length=10, samples=64, causal=True, overwrite=True)
    >>> st = scaleattn.compute_statistics(ds)  # in this process; client= runs the same tree on a cluster
    >>> st.n_rows, st.d_out
    (640, 2)
    """
    check_dataset_argument(dataset, "compute_statistics")
    if not isinstance(dataset, Dataset):
        dataset = open_dataset(dataset, storage_options)
    check_device(device)
    check_reachable(client, [("dataset", dataset.store)])
    if checkpoint is not None and not isinstance(checkpoint, Location):
        checkpoint = resolve(checkpoint, dataset.storage_options if storage_options is None else storage_options)
    return build_statistics(dataset, client, targets=targets, group_samples=group_samples, split_every=split_every,
                            device=device, progress=progress, tile_rows=tile_rows, max_tile_bytes=max_tile_bytes,
                            checkpoint=checkpoint, persist=persist).statistics


def build_statistics(dataset, client=None, *, targets: bool = True, group_samples: int | None = None,
                     split_every: int = SPLIT_EVERY, device: str = "auto", progress=False,
                     tile_rows: int | None = None, max_tile_bytes: float | None = MAX_TILE_BYTES,
                     checkpoint: Location | None = None, persist: bool = False, on_group=None) -> Build:
    """:func:`compute_statistics` for a caller that validated ``device`` and the cluster's reach and resolved
    ``checkpoint`` (:func:`scaleattn.fit`): the statistics with the build's counts, a :class:`Build`.
    ``on_group(k)``, if given, is called as the k-th row group this run computes has every tile finished (and
    checkpointed): the moment a test stops a build at (the whole build is one call otherwise)."""
    reporter = as_reporter(progress)
    kernel = "numpy" if device == "gpu" else kernel_name()  # the client's choice, for every worker (CuPy: numpy)
    tiles = tile_bounds(dataset.d, tile_rows, max_tile_bytes)
    groups = row_groups(dataset, group_samples, TILED_MAX_GROUPS if len(tiles) > 1 else None)
    ckpt = None
    done = np.zeros((len(groups), len(tiles)), dtype=bool)
    sources = row_bindings(dataset, groups, targets)  # the input rows as they are now
    if checkpoint is not None:
        ckpt = dataclasses.replace(Checkpoint.open(checkpoint, dataset, groups, tiles, targets, kernel),
                                   run=secrets.randbits(62) + 1)
        done = ckpt.reusable(sources)
        stale = np.flatnonzero((ckpt.done_mask() & ~done).any(axis=1))
        if stale.size:
            a, b = groups[stale[0]]
            reporter.line(f"checkpoint: {stale.size} row group(s) recomputed: their input rows changed since they were"
                          f" checkpointed (first: samples [{a}, {b}))")
    todo = [gi for gi in range(len(groups)) if not done[gi].all()]
    rows_per_sample, unit = _row_unit(dataset)
    rows = [(b - a) * rows_per_sample for a, b in groups]
    resumed = sum(r for gi, r in enumerate(rows) if gi not in todo)
    n_resumed = int(done.all(axis=1).sum())
    note = f"{n_resumed} of {len(groups)} row groups resumed from the checkpoint" if resumed else ""
    # the bar counts rows, and row groups done (tasks, groups x tiles, when the Gram is tiled)
    steps, step_unit = (len(groups), "groups") if len(tiles) == 1 else (done.size, "tasks")
    steps_done = n_resumed if len(tiles) == 1 else int(done.sum())
    # this build's token for the chunks its group bounds cut: each is read and checked once per process (the
    # next group there slices the kept copy), never shared with another build (which checks them anew)
    reuse = secrets.token_hex(8)
    with reporter.bar("statistics", sum(rows), unit, done=resumed, note=note, steps=steps, step_unit=step_unit,
                      steps_done=steps_done, wait_reason=_wait_reason(kernel)) as advance:
        if client is None:
            try:
                result = _reduce_in_process(dataset, groups, tiles, rows, todo, done, split_every, advance, on_group,
                                            lambda gi, ti, a, b, cols: _partial(dataset, gi, ti, a, b, cols, targets,
                                                                                device, ckpt, sources[gi], kernel,
                                                                                reuse))
            finally:  # (a worker keeps its last cut chunks until later builds' push them out: bounded)
                CUT_CHUNKS.forget(reuse)
        else:
            tag = f"{dataset.fingerprint}-{int(targets)}-{kernel}-{'' if ckpt is None else _url_token(ckpt.url)}"
            places = leaf_places(client, len(groups))  # a group's tiles on one worker, groups in runs
            futs = [[client.submit(_partial, dataset, gi, ti, a, b, cols, targets, device, ckpt, sources[gi], kernel,
                                   reuse, key=f"stats-part-{tag}-{a}-{b}-{cols[0]}-{cols[1]}-{sources[gi]:x}",
                                   **places[gi])
                     for ti, cols in enumerate(tiles)] for gi, (a, b) in enumerate(groups)]  # retries: in the task
            # a leaf read back from the checkpoint weighs 0 rows and is no new step (the bar started with it done)
            weights = {futs[gi][ti].key: (rows[gi] / len(tiles) if not done[gi, ti] else 0)
                       for gi in range(len(groups)) for ti in range(len(tiles))}
            roots = run_trees(client, [[f[ti] for f in futs] for ti in range(len(tiles))], _add_all, split_every,
                              advance=lambda w: advance(w, steps=1 if w else 0), weights=weights,
                              on_leaf=None if on_group is None else _groups_finished(futs, todo, on_group),
                              gather=not persist, what="a statistics task", need=_task_bytes(dataset, targets))
            result = (tiles, roots) if persist else _assemble(roots, dataset.d)
    check_unchanged(dataset, groups, targets, sources)
    # what was computed: with a checkpoint, what this run wrote (stale or damaged partials too)
    fresh = ~done if ckpt is None else ckpt.written_by(ckpt.run)
    return Build(result, len(groups), len(tiles), int(fresh.any(axis=1).sum()), int((~fresh).all(axis=1).sum()),
                 int(fresh.sum()), int((~fresh).sum()), None if ckpt is None else ckpt.url,
                 (groups, targets, sources))


def _reduce_in_process(dataset, groups, tiles, rows, todo, done, split_every, advance, on_group, partial):
    """The in-process build: one tile at a time (every row group through that tile's tree, then the next tile),
    each finished tile copied into one preallocated ``Tc``. Peak memory is ``Tc`` plus about ``log2(groups)``
    partials of one tile (group by group over all tiles would hold that many partials of the whole ``Tc``, and
    concatenating the tiles a second ``Tc``); the trees are those of the cluster build, so are the bits."""
    last = len(tiles) - 1
    gram = first = None
    for ti, cols in enumerate(tiles):
        red = TreeReducer(_add_inplace, split_every)
        for gi, (a, b) in enumerate(groups):
            red.add(partial(gi, ti, a, b, cols))
            if gi in todo:  # a tile read back from the checkpoint is no new step (as on a cluster)
                advance(rows[gi] / len(tiles) if last else rows[gi], steps=int(not (last and done[gi, ti])))
                if ti == last and on_group is not None:
                    on_group(todo.index(gi) + 1)  # this group has every tile done
        part = red.result()
        if not last:
            return _assemble([part], dataset.d)
        if ti == 0:  # tile 0 carries B and yy
            first = part
            gram = np.empty((tiles[-1][1], part.gram_compact.shape[1]))
        elif int(part.n_rows) != int(first.n_rows):
            raise RuntimeError(f"tiles disagree on the row count: {int(part.n_rows)} != {int(first.n_rows)}")
        gram[cols[0]:cols[1]] = part.gram_compact
        part.gram_compact = None  # (first's too): only the assembled Tc stays
    return Statistics(gram, first.moments, float(first.yy), int(first.n_rows), dataset.d)


def check_unchanged(dataset, groups, targets: bool, sources: list[int],
                    during: str = "its statistics were built") -> None:
    """Refuse results of a dataset that changed since the build began: its metadata (shapes, chunking, attributes:
    :func:`~scaleattn.data._checks.fingerprint` of the store opened anew) or the chunks' signatures of any row group
    (:func:`~scaleattn.data._checks.row_bindings` against ``sources``, taken at the start). Called at the end of the
    build, and by a fit after each later pass over the rows (the evaluation, the QR), which would otherwise mix
    two versions of the data (``during`` names the pass). A kept checkpoint recomputes the changed groups."""
    try:
        fresh = fingerprint(dataset.store, dataset.store.open_group("r"))
    except Exception as e:  # (gone, or no longer a dataset)
        fresh = f"unreadable ({type(e).__name__}: {e})"
    if fresh != dataset.fingerprint:
        raise IntegrityError(f"{dataset.url} changed while {during} (its arrays' shapes, chunking, attributes or"
                             " contents): the result could mix two versions of the data; run again once nothing"
                             " writes to it")
    now = row_bindings(dataset, groups, targets)
    changed = [g for g, s, t in zip(groups, sources, now) if s != t]
    if changed:
        raise IntegrityError(f"{dataset.url} changed while {during} ({len(changed)} row group(s), first samples"
                             f" [{changed[0][0]}, {changed[0][1]})): the result could mix old and new rows; run"
                             " again once nothing writes to it")


def _wait_reason(kernel: str) -> str:
    """What the statistics bar says while no row group is done yet: the kernels being compiled where numba's cache
    of them is cold (:func:`scaleattn.statistics._compiled.kernels_cached`: the first run after an install), else
    nothing (every later run printed that reason too)."""
    if kernel != "numba":
        return ""
    return "" if kernels_cached() else ("the first run after an install compiles the kernels: about 30 s on 2 idle"
                                        " cores, longer on busy ones")


def _row_unit(dataset) -> tuple[int, str]:
    """Rows per sample and the unit the progress bar counts: feature rows where their number is known up front
    (T per sample for causal data of full length), else samples."""
    if not dataset.causal:
        return 1, "rows"
    return (1, "samples") if dataset.has_lengths else (dataset.length, "rows")


def _add_inplace(*parts: Statistics) -> Statistics:
    """:func:`_add_all` into ``parts[0]`` (an in-process build owns its partials)."""
    return _add_all(*parts, inplace=True)


def _url_token(url: str) -> str:
    """A short stable token of a store URL (for task keys)."""
    return hashlib.sha1(str(url).encode()).hexdigest()[:10]


def _groups_finished(futs, todo: list[int], on_group):
    """The leaf callback of the Dask path that calls ``on_group(k)`` as the k-th group of ``todo`` has all its
    tiles finished."""
    left = {gi: len(futs[gi]) for gi in todo}
    owner = {f.key: gi for gi in todo for f in futs[gi]}
    finished = [0]

    def on_leaf(fut):
        gi = owner.get(fut.key)
        if gi is None:
            return
        left[gi] -= 1
        if left[gi] == 0:
            finished[0] += 1
            on_group(finished[0])

    return on_leaf
