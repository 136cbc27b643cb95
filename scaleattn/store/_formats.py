"""Names and versions of every store scaleattn writes, and strict JSON.

Each store records ``format`` and ``format_version`` in its attributes; readers refuse anything else with a
:class:`~scaleattn.errors.FormatError`. Changing a layout means bumping its version here.

Version 2 of every store (scaleattn 0.1 after the integrity work): arrays use the crc32c codec, every chunk
is stored (even all-zero ones), and the attributes carry a ``manifest`` of array shapes and value checksums
(:mod:`scaleattn.store._integrity`); checkpoints bind each partial to its input rows and carry its checksum.
Version 3 of statistics, models and spectra: the manifest also records every other attribute as written (an
edited ``d``, ``causal`` or ``n_rows`` is refused). Older versions are still read without the checks they do not
carry (v1 datasets, statistics, models and spectra; v2 statistics, models and spectra), with every chunk present
and the attributes checked against the arrays; version 1 checkpoints are refused (their partials cannot be
verified).
"""
from __future__ import annotations

import json
import math

import numpy as np

from ..errors import FormatError

__all__ = ["DATASET", "STATISTICS", "MODEL", "CHECKPOINT", "JOURNAL", "SPECTRUM", "READABLE", "RUN_ENTRIES",
           "RUN_STORES", "PREFIX", "PLOT_SOFTWARE", "LOSS_KEYS", "loss_key", "entries_key", "loss_curve",
           "check_format", "check_types", "json_default", "dumps", "loads"]

#: ``(format, format_version)`` of each store kind (what is written)
DATASET = ("scaleattn-dataset", 2)
STATISTICS = ("scaleattn-statistics", 3)
MODEL = ("scaleattn-model", 3)
CHECKPOINT = ("scaleattn-checkpoint", 2)
#: the pass journal of a streaming fit (:mod:`scaleattn.distributed.journal`): its checkpoint
JOURNAL = ("scaleattn-pass-journal", 1)
SPECTRUM = ("scaleattn-spectrum", 3)
#: versions each kind's reader accepts
READABLE = {DATASET[0]: (1, 2), STATISTICS[0]: (1, 2, 3), MODEL[0]: (1, 2, 3), CHECKPOINT[0]: (2,), JOURNAL[0]: (1,),
            SPECTRUM[0]: (1, 2, 3)}
#: the ``format`` of every scaleattn store starts with this (how ``--overwrite`` recognises its own outputs)
PREFIX = "scaleattn-"
#: the stores of a run directory (:mod:`scaleattn.run`) and the ``format`` of each
RUN_STORES = {"model.zarr": MODEL[0], "stats.zarr": STATISTICS[0], "spectrum.zarr": SPECTRUM[0]}
#: what a run directory holds (besides ``*.png`` plots): report.json and the stores of :mod:`scaleattn.run`
RUN_ENTRIES = ("report.json", *RUN_STORES)
#: the start of the PNG ``Software`` text of every plot scaleattn draws (:func:`scaleattn.plot.figure_pngs`):
#: how ``--overwrite`` and ``plot --out`` tell its plots from a user's images of the same name
PLOT_SOFTWARE = "scaleattn"


def stamp(kind: tuple[str, int]) -> dict:
    """The attributes that mark a store as ``kind``: ``{"format": name, "format_version": version}``."""
    return {"format": kind[0], "format_version": kind[1]}


def check_format(attrs: dict, kind: tuple[str, int], where: str, what: str) -> None:
    """Raise :class:`FormatError` unless ``attrs`` mark a store of ``kind`` in a version its reader accepts
    (:data:`READABLE`; ``what``: "statistics", ...). Returns the store's version."""
    ok = READABLE.get(kind[0], (kind[1],))
    version = attrs.get("format_version")
    if attrs.get("format") != kind[0] or isinstance(version, bool) or version not in ok:
        raise FormatError(f"{where}: not a scaleattn {what} store (format {attrs.get('format')!r}"
                          f" v{version}, expected {kind[0]!r} v{' or v'.join(map(str, ok))})")
    return version


def check_types(attrs: dict, types: dict, where: str, optional=()) -> None:
    """Raise :class:`FormatError` when an attribute a reader relies on is missing or of the wrong JSON type
    (``causal: "false"`` is a string, not false; ``d: 2.5`` is not an integer)."""
    for k, t in types.items():
        if k not in attrs:
            if k in optional:
                continue
            raise FormatError(f"{where}: attribute {k!r} is missing")
        v = attrs[k]
        if t is bool:
            ok, want = isinstance(v, bool), "true or false"
        elif t is int:
            ok, want = isinstance(v, int) and not isinstance(v, bool), "an integer"
        else:
            ok, want = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
        if not ok:
            raise FormatError(f"{where}: attribute {k!r} must be {want}, got {v!r} ({type(v).__name__})")


def json_default(o):
    """``json.dump`` hook for numpy scalars and arrays."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _strict(o):
    """``o`` with non-finite floats replaced by None (strict JSON has no NaN or Infinity)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _strict(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_strict(v) for v in o]
    return o


def dumps(obj, indent: int | None = 2) -> str:
    """Strict JSON text of ``obj`` (numpy values converted; NaN and Infinity written as ``null``)."""
    return json.dumps(_strict(json.loads(json.dumps(obj, default=json_default))), indent=indent, allow_nan=False)


def loads(data):
    """JSON text or bytes read from a file another program may have written (a report, a lock, a ``zarr.json``):
    ``json.loads``, with a document nested too deep for Python's parser (``[[[[...``, a RecursionError that the
    callers' ``except ValueError`` missed: an internal error) refused as not JSON.

    Raises
    ------
    ValueError
        Not JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``), or nested too deep.
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deep to be read") from None


#: the loss of a report's ``loss_vs_heads`` entries, by their key: the train MSE, or with a ridge the ridge fit's
#: objective per row and output (the head search measures what the fit minimised; docs/report.md)
LOSS_KEYS = {"train_mse_stats": "train MSE", "train_objective_stats": "train MSE + ridge penalty"}


def loss_key(ridge: float) -> str:
    """The key of a fit's ``loss_vs_heads`` entries (:data:`LOSS_KEYS`) after a fit with scaled ``ridge``."""
    return "train_objective_stats" if ridge > 0 else "train_mse_stats"


def entries_key(entries) -> str:
    """The loss key of a report's ``loss_vs_heads`` entries (:data:`LOSS_KEYS`; the first entry's)."""
    return next((k for k in LOSS_KEYS if entries and k in entries[0]), "train_mse_stats")


def loss_curve(entries) -> tuple[str, list[tuple[int, float]]]:
    """What a report's ``loss_vs_heads`` measures (:data:`LOSS_KEYS`) and its points ``[(H, loss), ...]``.

    Examples
    --------
    >>> loss_curve([{"heads": 1, "train_objective_stats": 0.5}, {"heads": 2, "train_objective_stats": 0.25}])
    ('train MSE + ridge penalty', [(1, 0.5), (2, 0.25)])
    """
    key = entries_key(entries)
    return LOSS_KEYS[key], [(int(e["heads"]), float(e[key])) for e in entries]
