"""Names and versions of every store scaleattn writes, and strict JSON (layer L0).

Each store records ``format`` and ``format_version`` in its attributes; readers refuse anything else with a
:class:`~scaleattn.errors.FormatError`. Changing a layout means bumping its version here.
"""
from __future__ import annotations

import json
import math

import numpy as np

from .errors import FormatError

__all__ = ["DATASET", "STATISTICS", "MODEL", "CHECKPOINT", "SPECTRUM", "check_format", "json_default", "dumps"]

#: ``(format, format_version)`` of each store kind
DATASET = ("scaleattn-dataset", 1)
STATISTICS = ("scaleattn-statistics", 1)
MODEL = ("scaleattn-model", 1)
CHECKPOINT = ("scaleattn-checkpoint", 1)
SPECTRUM = ("scaleattn-spectrum", 1)


def stamp(kind: tuple[str, int]) -> dict:
    """The attributes that mark a store as ``kind``: ``{"format": name, "format_version": version}``."""
    return {"format": kind[0], "format_version": kind[1]}


def check_format(attrs: dict, kind: tuple[str, int], where: str, what: str) -> None:
    """Raise :class:`FormatError` unless ``attrs`` mark a store of ``kind`` (``what``: "statistics", ...)."""
    if attrs.get("format") != kind[0] or attrs.get("format_version") != kind[1]:
        raise FormatError(f"{where}: not a scaleattn {what} store (format {attrs.get('format')!r}"
                          f" v{attrs.get('format_version')}, expected {kind[0]!r} v{kind[1]})")


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
