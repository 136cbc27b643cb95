"""Names of paths: what an output's name may be, checked before anything is written
(:func:`check_output_name`), and paths shown in one line whatever characters they hold (:func:`one_line`).

- Control characters (a newline, a tab, an escape) are refused in an output path: every later line naming it
  (an error, a log, a shell's listing) would break in two or change the terminal.
- An output's name must leave room for the longest name scaleattn keeps next to it (:data:`COMPANIONS`): a
  legal 250-character name failed half-way with "File name too long" naming an internal temporary.
"""
from __future__ import annotations

import os
import posixpath
import unicodedata

from ..errors import UnsafeOutputError
from ._location import Location

__all__ = ["check_output_name", "one_line", "control_character", "name_max", "name_size", "takes", "COMPANIONS",
           "ADDED", "NAME_MAX", "KEY_MAX", "INNER"]

#: the names scaleattn keeps next to an output NAME: its lock (:func:`scaleattn.store._locks.lock_location`), a
#: temporary holding the previous output moved aside (:func:`scaleattn.store._outputs.atomic_output`) and a reader's
#: marker being made (:func:`scaleattn.store._locks.reading`); the tokens are as long as the real ones
COMPANIONS = (".{}.lock", ".{}.partial-0123abcd.old", ".{}.read-0123456789ab.partial-lock")
#: characters the longest of :data:`COMPANIONS` adds to NAME
ADDED = max(len(c.format("")) for c in COMPANIONS)
#: the longest name (in bytes) where the file system does not say (``os.pathconf`` absent, a URL): POSIX's usual
NAME_MAX = 255
#: object stores (S3, Google Cloud Storage, Azure Blob Storage) limit a whole key, not a name: 1,024 bytes
KEY_MAX = 1024
#: bytes of a key kept for the keys scaleattn writes inside an output (the longest, ``spectrum.zarr/
#: eigenvalues_scaled/zarr.json``, is 42 bytes)
INNER = 128
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def control_character(text: str) -> str | None:
    """The first control character of ``text`` (a C0/C1 control or a line or paragraph separator), or None."""
    return next((c for c in text if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)


def one_line(text: str) -> str:
    """``text`` with its control characters escaped as Python writes them (``\\n``, ``\\x1b``): a message naming
    a path with a newline stays one line.

    Examples
    --------
    >>> one_line("/data/x\\ny.zarr: no such store")
    '/data/x\\\\ny.zarr: no such store'
    """
    if control_character(text) is None:
        return text
    return "".join(repr(c)[1:-1] if control_character(c) else c for c in text)


def _object_key(loc: Location) -> str | None:
    """The key of ``loc`` in its bucket where it is in an object store (:data:`OBJECT_STORES`), else None."""
    scheme, _, rest = loc.url.split("::")[-1].partition("://")
    return rest.partition("/")[2].rstrip("/") if loc.is_remote and scheme.lower() in OBJECT_STORES else None


def name_max(loc: Location) -> int:
    """The longest name, in bytes, that the store of ``loc`` takes: in an object store what :data:`KEY_MAX` leaves
    after the key's prefix and :data:`INNER`; on a file system ``os.pathconf(DIR, 'PC_NAME_MAX')`` of its nearest
    existing folder; :data:`NAME_MAX` where it does not say (no ``pathconf``, another URL)."""
    key = _object_key(loc)
    if key is not None:
        parent = posixpath.dirname(key)
        return KEY_MAX - INNER - len(os.fsencode(parent)) - bool(parent)
    if loc.is_remote:
        return NAME_MAX
    folder = os.path.dirname(loc.url)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        n = os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # (no pathconf on this platform, or no such limit named)
        return NAME_MAX
    return n if n > 0 else NAME_MAX


def takes(loc: Location, limit: int) -> str:
    """What limits the name of ``loc`` to ``limit`` bytes, in words for an error."""
    if _object_key(loc) is None:
        return f"the file system takes at most {limit}"
    return (f"the object store's keys take at most {KEY_MAX} bytes, of which its folder's prefix and the {INNER}"
            f" kept for the keys inside leave it {limit}")


def name_size(loc: Location) -> tuple[int, int]:
    """``(bytes of the name of loc, the longest name its file system takes)`` (:func:`name_max`)."""
    name = (posixpath if loc.is_remote else os.path).basename(loc.url.rstrip("/"))
    return len(os.fsencode(name)), name_max(loc)


def check_output_name(loc: Location, role: str = "output") -> None:
    """Refuse, before anything is written, an output path holding a control character, or whose name leaves no
    room for the names scaleattn keeps next to it (:data:`COMPANIONS`: up to :data:`ADDED` more characters) on
    its file system (:func:`name_max`). Called by :func:`scaleattn.store._outputs.check_output_location`, which every
    output passes.

    Raises
    ------
    UnsafeOutputError
        E.g. ``--out /x/aaa...: the name is 250 bytes long, 27 too many: ...``.
    """
    c = control_character(loc.url)
    if c is not None:
        raise UnsafeOutputError(f"{role} {one_line(loc.url)}: the path holds the control character {repr(c)[1:-1]}"
                                " (every line naming it would break or garble the terminal); choose a path of"
                                " printable characters")
    size, limit = name_size(loc)
    if limit - ADDED < 1 and _object_key(loc) is not None:  # (the prefix alone is too long: no name would do)
        raise UnsafeOutputError(f"{role} {loc.url}: {takes(loc, limit)}, and with the {ADDED} bytes scaleattn"
                                " keeps next to it its folder's prefix leaves no room for a name: choose a shorter"
                                f" folder (at most {KEY_MAX - INNER - ADDED - 2} bytes)")
    if size + ADDED > limit:
        raise UnsafeOutputError(f"{role} {loc.url}: the name is {size} bytes long, {size + ADDED - limit} too many:"
                                f" scaleattn keeps names up to {ADDED} bytes longer next to it"
                                f" ({COMPANIONS[-1].format('NAME').replace('0123456789ab', 'TOKEN')}) and"
                                f" {takes(loc, limit)}; choose a name of at most {limit - ADDED} bytes")
