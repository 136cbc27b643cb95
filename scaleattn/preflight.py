"""The checks a fit makes before and around its work (before :mod:`scaleattn.pipeline`): the input is
complete and has targets; outputs and checkpoint neither are, contain, nor lie inside an input (or each other);
``--overwrite`` replaces only what scaleattn wrote; one run per output (locks); and what a failed or
interrupted build leaves behind (a checkpoint worth resuming, with its hint, or nothing).
"""
from __future__ import annotations

import contextlib
import os
import shlex

from .data._dataset import Dataset, open_dataset
from .errors import CheckpointError, DatasetError, IntegrityError, OutputExistsError, UnsafeOutputError, with_hint
from .store import _bounds, _formats
from .store._location import Location, check_kind, check_storage_options, options_for, resolve
from .store._names import ADDED, name_size, takes
from .store._outputs import (
    RUN,
    check_companions,
    check_disjoint,
    check_output_location,
    check_replaceable,
    clean_leftovers,
    hold,
    owner_of,
    reading,
)

__all__ = ["preflight", "holding", "open_input", "run_locations", "after_failed_build", "kept_hint"]


def open_input(dataset, storage_options, fill_absent_chunks: bool = False) -> Dataset:
    """The dataset of a run: a :class:`~scaleattn.data._dataset.Dataset` as is, else opened (and checked; a file or a
    path through a file is refused as such, :func:`scaleattn.store._location.check_kind`)."""
    if isinstance(dataset, Dataset):
        return dataset
    return open_dataset(dataset, options_for(dataset, storage_options), fill_absent_chunks=fill_absent_chunks)


def run_locations(ds: Dataset, out, checkpoint, storage_options) -> tuple[Location | None, Location | None]:
    """The run directory and the checkpoint store of a fit, resolved with the fit's options."""
    opts = ds.storage_options if storage_options is None else storage_options
    out = None if out is None else resolve(out, None if isinstance(out, Location) else opts)
    return out, _checkpoint_location(out, checkpoint, opts)


def preflight(dataset, out=None, overwrite: bool = False, storage_options=None, *, checkpoint=None,
              resume: bool = False, fill_absent_chunks: bool = False) -> Dataset:
    """The checks :func:`fit` makes before any work (callers run them before starting a cluster too): the
    dataset opens, is complete and has targets; ``out`` and the checkpoint are neither, nor contain, nor lie
    inside the dataset (or each other); ``out`` does not exist unless ``overwrite``, and what ``overwrite``
    would replace was written by scaleattn. Returns the dataset.

    Raises
    ------
    DatasetError
        The dataset is malformed, has absent chunks (:class:`~scaleattn.errors.IntegrityError`) or no targets.
    UnsafeOutputError
        An output overlaps the input, or ``overwrite`` would replace something scaleattn did not write.
    OutputExistsError
        ``out`` exists and not ``overwrite``, or a checkpoint exists without ``resume`` or ``overwrite``.
    OutputInUseError
        A live run holds ``out`` or the checkpoint (said first: its name and pid).
    """
    check_storage_options(storage_options, dataset, out, checkpoint)  # (fsspec's options reach URLs only)
    ds = open_input(dataset, storage_options, fill_absent_chunks)
    if not ds.has_targets:
        raise DatasetError(f"{ds.url}: has no 'targets' array; use certify for the certificate alone")
    out, ckpt = run_locations(ds, out, checkpoint, storage_options)
    check_disjoint([("`out`", out), ("`checkpoint`", ckpt)], [("dataset", ds.store)])
    check_disjoint([("`checkpoint`", ckpt)], [("`out`", out)], kind="output")
    check_companions([("`out`", out), ("`checkpoint`", ckpt)], [("dataset", ds.store)])
    # (OUT.checkpoint.zarr, when not given, is named as such: --checkpoint PATH is the way round its name)
    for role, loc in (("`out`", out), ("`checkpoint`" if checkpoint is not None else "the default `checkpoint`", ckpt)):
        if loc is not None:
            if loc is ckpt and checkpoint is None:
                _check_default_checkpoint_name(ckpt)
            check_output_location(loc, role)
    if ckpt is not None and (resume or ckpt.exists()):  # (a checkpoint to resume is an input too)
        check_kind(ckpt, "`checkpoint`", "a checkpoint store (a Zarr directory)", directory=True)
    # an output a live run writes is in use, before whatever else is true of it (the advice of "exists", pass
    # --overwrite or --resume, would only meet the lock next); --out first, as the fit takes the locks
    if any(loc is not None and loc.exists() for loc in (out, ckpt)):
        for role, loc in (("`out`", out), ("`checkpoint`", ckpt)):
            if loc is not None and (loc.is_remote or os.path.isdir(os.path.dirname(loc.url))):
                with hold(loc, role):
                    pass
    if out is not None and out.exists():
        if not overwrite:
            if resume and not (ckpt is not None and ckpt.exists()):
                raise OutputExistsError(f"nothing to resume: {out.url!r} is a finished run and no checkpoint"
                                        f" {ckpt.url!r} is left (`resume=True` continues a fit that was"
                                        " interrupted; pass `overwrite=True` to fit again)")
            raise OutputExistsError(f"output {out.url!r} already exists (pass `overwrite=True` to replace it)")
        check_replaceable(out, "`out`", RUN)
    if ckpt is not None and ckpt.exists() and not resume:
        if not overwrite:
            raise OutputExistsError(f"checkpoint {ckpt.url!r} of an unfinished fit exists: pass `resume=True` to"
                                    " continue it, or `overwrite=True` to start over")
        # either kind of checkpoint (a statistics build's, a streaming fit's pass journal) is a fit's to replace
        journal = owner_of(ckpt)[1] == _formats.JOURNAL[0]
        check_replaceable(ckpt, "`checkpoint`", _formats.JOURNAL[0] if journal else _formats.CHECKPOINT[0])
    return ds


@contextlib.contextmanager
def holding(dataset, out=None, checkpoint=None, storage_options=None):
    """Hold the locks of a fit's run directory and checkpoint for the block (:func:`scaleattn.store._outputs.hold`):
    a second run to the same output is refused naming the first. Temporaries a killed run left are removed.
    The dataset is marked as read meanwhile (:func:`scaleattn.store._outputs.reading`): no other run replaces it, and
    a run replacing it now refuses this one."""
    ds = open_input(dataset, storage_options)
    out, ckpt = run_locations(ds, out, checkpoint, storage_options)
    with contextlib.ExitStack() as stack:
        stack.enter_context(reading(ds.store, "dataset"))
        for role, loc in (("`out`", out), ("`checkpoint`", ckpt)):
            if loc is not None:
                stack.enter_context(hold(loc, role))
                clean_leftovers(loc, protect=[ds.store])
        yield


#: the most (row group, tile) cells the resume hint reads from a checkpoint's done mask
MAX_DONE_CELLS = 1 << 22


def _done_groups(ckpt: Location) -> tuple[int, int] | None:
    """(finished row groups, row groups) of the checkpoint at ``ckpt``, None when there is none readable."""
    try:
        arr = ckpt.open_group("r")["done"]
        # (a hint only: a done mask that is not one a checkpoint writes, or is too large to be one, says nothing)
        if arr.ndim != 2 or arr.size > MAX_DONE_CELLS:
            return None
        _bounds.check_array(arr, "done", ckpt.url, dtype=bool)
        done = arr[...]
    except Exception:  # absent, never got its arrays, or refused by the checks above
        return None
    return int(done.all(axis=1).sum()), int(done.shape[0])


def kept_hint(ckpt: Location, what: str | None = None) -> str:
    """The resume hint for a kept checkpoint."""
    n = _done_groups(ckpt)
    held = what or ("nothing" if n is None else f"{n[0]} of {n[1]} row groups")
    return f"the checkpoint {ckpt.url} keeps {held}: repeat the fit with `resume=True` to continue"


def rerun_command(dataset_url: str, out: str | None, ckpt: Location, checkpoint_given: bool) -> str:
    """The command that solves again from a kept checkpoint without rebuilding any row group:
    ``scaleattn fit DATASET --out OUT [--checkpoint CKPT] --resume`` (the run's other options go with it)."""
    cmd = ["scaleattn", "fit", dataset_url] + (["--out", out] if out else [])
    cmd += ["--checkpoint", ckpt.url] if checkpoint_given or not out else []
    return shlex.join(cmd + ["--resume"])


def solve_hint(ckpt: Location, command: str, e: BaseException | None = None) -> str:
    """The hint of a fit that failed after its build (with ``e``): where the statistics are and how to solve
    again; after the input changed (an :class:`IntegrityError` of a later pass), what a rerun recomputes."""
    if isinstance(e, IntegrityError):
        return (f"the checkpoint {ckpt.url} holds statistics of the data as it was before: once nothing writes to"
                " the input, run again with `overwrite=True` instead of `resume=True` (a resume is refused: the data"
                " changed)")
    return (f"the checkpoint {ckpt.url} keeps all row groups: `{command}` (with this run's other options, or"
            " another `solver`) solves again from them without rebuilding any")


def after_failed_build(e: BaseException, ckpt: Location | None, new_ckpt: bool) -> None:
    """After a build failed or was interrupted: remove a checkpoint this fit created when it holds nothing
    worth resuming (bad data, or not one finished group), otherwise attach the resume hint to ``e``."""
    if ckpt is None:
        return
    if isinstance(e, CheckpointError):  # someone else's store: never touched
        return
    n = _done_groups(ckpt)
    if new_ckpt and (isinstance(e, DatasetError) or not n or n[0] == 0) and ckpt.exists():
        ckpt.remove()  # nothing worth resuming
        with_hint(e, "no checkpoint was kept")
        return
    if ckpt.exists():
        with_hint(e, kept_hint(ckpt))


def _check_default_checkpoint_name(ckpt: Location) -> None:
    """``OUT.checkpoint.zarr`` holds its lock and temporaries too (:func:`scaleattn.store._names.check_output_name`);
    too long, the way round is said: its name follows --out's (advised 'a name of at most N bytes', not its own)."""
    size, limit = name_size(ckpt)
    room = limit - ADDED - len(CHECKPOINT_SUFFIX)  # (none: the folder's prefix alone is too long)
    if size + ADDED > limit:
        raise UnsafeOutputError(f"the default `checkpoint` {ckpt.url}: the name is {size} bytes long,"
                                f" {size + ADDED - limit} too many: scaleattn keeps names up to {ADDED} bytes longer"
                                f" next to it and {takes(ckpt, limit)}; choose " + (
                                    f"an `out` name of at most {room} bytes" if room > 0 else "a shorter folder for"
                                    " `out`") + ", or `checkpoint=PATH`")


#: what the default checkpoint adds to --out's name
CHECKPOINT_SUFFIX = ".checkpoint.zarr"


def _checkpoint_location(out: Location | None, checkpoint, storage_options) -> Location | None:
    """The checkpoint store: ``checkpoint`` resolved with the fit's options, else ``OUT.checkpoint.zarr``."""
    if checkpoint is not None:
        return resolve(checkpoint, None if isinstance(checkpoint, Location) else storage_options)
    return None if out is None else Location(out.url + CHECKPOINT_SUFFIX, out.storage_options)
