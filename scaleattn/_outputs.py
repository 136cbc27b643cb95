"""Writing outputs safely (layer L0): never into an input, never over a foreign directory, never two runs at
once, all or nothing.

- :func:`check_disjoint`: an output, checkpoint or temporary that is, contains or lies inside an input store
  (after resolving ``.``, ``..``, trailing slashes and symlinks; URLs by prefix) is refused.
- :func:`owner_of` / :func:`check_replaceable`: ``--overwrite`` replaces only what scaleattn wrote: a Zarr
  store whose ``format`` starts with ``scaleattn-``, or a run directory (report.json, the run's stores, plots).
- :func:`hold`: an exclusive lock next to an output (``.NAME.lock``: owner host, pid and start time). Local
  locks are ``flock`` locks, released by the kernel when the process dies, so a stale lock of a killed run is
  taken over at once; on object stores the lock object is created exclusively and a lock of a dead process
  on this host is detected from its pid and start time.
- :func:`atomic_output`: a temporary next to the output, renamed on success; temporaries left by a killed run
  are removed by the next run that holds the lock.
"""
from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import posixpath
import socket
import time
import uuid

from . import _formats
from ._storage import Location, remove
from .errors import OutputExistsError, OutputInUseError, ScaleattnError, StorageError, UnsafeOutputError

__all__ = ["check_disjoint", "check_companions", "check_outside_stores", "relation", "owner_of",
           "check_replaceable", "RUN", "hold", "atomic_output", "clean_leftovers", "lock_location", "companions",
           "is_temporary_of"]


# ---- outputs never touch inputs ----------------------------------------------------------------------
def _key(loc: Location) -> tuple[str, str]:
    """(scheme, normalised path): symlinks resolved for local paths, ``.``/``..``/``//``/trailing ``/`` for URLs."""
    if not loc.is_remote:
        return "file", os.path.realpath(loc.url)
    scheme, _, rest = loc.url.partition("://")
    scheme = {"s3a": "s3", "s3n": "s3", "gcs": "gs"}.get(scheme, scheme)
    return scheme, posixpath.normpath("/" + rest).rstrip("/") or "/"


def _inside(a: str, b: str, sep: str) -> bool:
    return a != b and a.startswith(b.rstrip(sep) + sep)


def _same_local(a: str, b: str) -> bool:
    """Same directory or file reached another way (bind mount, hard link to a directory's inode)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def relation(out: Location, inp: Location) -> str | None:
    """``"is"``, ``"lies inside"``, ``"contains"`` or None: where ``out`` stands relative to ``inp``."""
    (s1, a), (s2, b) = _key(out), _key(inp)
    if s1 != s2:
        return None
    sep = os.sep if s1 == "file" else "/"
    if a == b or (s1 == "file" and _same_local(a, b)):
        return "is"
    if _inside(a, b, sep):
        return "lies inside"
    if _inside(b, a, sep):
        return "contains"
    if s1 == "file":  # reached through a bind mount: compare the existing ancestors by inode
        for x, y, what in ((a, b, "lies inside"), (b, a, "contains")):
            p = os.path.dirname(x)
            while p and p != os.path.dirname(p):
                if _same_local(p, y):
                    return what
                p = os.path.dirname(p)
    return None


def check_disjoint(outputs, inputs, *, kind: str = "input", contains_ok: bool = False) -> None:
    """Refuse any output that is, contains or lies inside an input, before anything is written or removed.

    Parameters
    ----------
    outputs, inputs : iterable of (role, Location or None)
        E.g. ``[("--out", out), ("--checkpoint", ckpt)]`` and ``[("dataset", ds.store)]``; None entries skipped.
    kind : str
        What the second list holds, for the message ("input", or "output" for two outputs of one run).
    contains_ok : bool
        Allow an output that contains an input (for outputs that only add files, never remove: plots).

    Raises
    ------
    UnsafeOutputError
        Naming the option, both paths and how they overlap.
    """
    ins = [(r, loc) for r, loc in inputs if loc is not None]
    for role, out in outputs:
        if out is None:
            continue
        for what, inp in ins:
            rel = relation(out, inp)
            if rel is not None and not (contains_ok and rel == "contains"):
                never = ("scaleattn never writes into or removes an input" if kind == "input" else
                         "each output of a run needs its own place")
                raise UnsafeOutputError(f"{role} {out.url} {rel} the {kind} {what} {inp.url}: {never}; choose a"
                                        " path outside it")


def companions(loc: Location) -> list[Location]:
    """What a run writes next to output ``loc`` besides it: its lock (temporaries are matched by name,
    :func:`is_temporary_of`)."""
    return [lock_location(loc)]


def is_temporary_of(path: Location, loc: Location) -> bool:
    """Whether ``path`` is named like a temporary of output ``loc`` (``.NAME.partial-*`` next to it)."""
    if path.is_remote != loc.is_remote:
        return False
    mod = posixpath if loc.is_remote else os.path
    (p1, n1), (p2, n2) = mod.split(path.url.rstrip("/")), mod.split(loc.url.rstrip("/"))
    return _key(Location(p1)) == _key(Location(p2)) and n1.startswith(f".{n2}.partial-")


def check_companions(outputs, inputs) -> None:
    """Refuse outputs whose lock or temporaries would be, or be removed as, an input (an input named
    ``.NAME.lock`` or ``.NAME.partial-...`` next to output NAME).

    Raises
    ------
    UnsafeOutputError
    """
    ins = [(r, loc) for r, loc in inputs if loc is not None]
    for role, out in outputs:
        if out is None:
            continue
        for what, inp in ins:
            if is_temporary_of(inp, out) or any(relation(c, inp) for c in companions(out)):
                raise UnsafeOutputError(f"{role} {out.url}: the input {what} {inp.url} is named like the lock or a"
                                        " temporary scaleattn keeps next to that output; choose another output path")


def check_outside_stores(loc: Location, role: str = "output") -> None:
    """Refuse an output inside an existing Zarr store (any: a dataset, a model, another tool's), whether or not
    that store is an input of this command: nothing is ever written into a store from outside it.

    Raises
    ------
    UnsafeOutputError
        Naming the output and the store it lies inside.
    """
    if loc.is_remote:
        scheme, _, rest = loc.url.partition("://")
        parts = rest.rstrip("/").split("/")
        parents = [Location(f"{scheme}://{'/'.join(parts[:k])}", loc.storage_options) for k in range(1, len(parts))]
    else:
        p, parents = os.path.realpath(loc.url), []
        while os.path.dirname(p) != p:
            p = os.path.dirname(p)
            parents.append(Location(p))
    for parent in parents:
        if any(parent.join(doc).exists() for doc in ("zarr.json", ".zgroup", ".zarray")):
            raise UnsafeOutputError(f"{role} {loc.url} lies inside the Zarr store {parent.url}: nothing is written"
                                    " into a store from outside it; choose a path outside it")


# ---- --overwrite replaces only scaleattn's own outputs ------------------------------------------------
def _read_json(loc: Location) -> dict | None:
    try:
        return json.loads(loc.read_text())
    except (OSError, ValueError):
        return None


def _entries(loc: Location) -> list[str] | None:
    """Names directly under ``loc`` (None when it is a file)."""
    if not loc.is_remote:
        return sorted(os.listdir(loc.url)) if os.path.isdir(loc.url) else None
    fs, p = loc.fs()
    if fs.isfile(p):
        return None
    return sorted(posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))


def _is_scaleattn_store(loc: Location) -> str | None:
    meta = _read_json(loc.join("zarr.json"))
    fmt = ((meta or {}).get("attributes") or {}).get("format")
    return fmt if isinstance(fmt, str) and fmt.startswith(_formats.PREFIX) else None


def owner_of(loc: Location) -> tuple[bool, str]:
    """``(ours, what)`` for an existing output: a scaleattn store (``what`` its format), a run directory, an
    empty directory; otherwise ``(False, reason)`` naming what scaleattn did not write."""
    fmt = _is_scaleattn_store(loc)
    if fmt:
        return True, fmt
    names = _entries(loc)
    if names is None:
        return False, "it is a file"
    if not names:
        return True, "an empty directory"
    foreign = [n for n in names if n not in _formats.RUN_ENTRIES and not fnmatch.fnmatch(n, "*.png")
               and not fnmatch.fnmatch(n, ".*.lock") and ".partial-" not in n]  # (our own companions)
    if foreign:
        return False, f"it holds {foreign[0]!r}, which scaleattn did not write"
    report = _read_json(loc.join("report.json")) if "report.json" in names else None
    if (isinstance(report, dict) and "scaleattn_version" in report) or any(
            _is_scaleattn_store(loc.join(n)) for n in names if n.endswith(".zarr")):
        return True, "a run directory"
    return False, "it is not a scaleattn store or run directory"


def check_replaceable(loc: Location, role: str = "output", kind: str | None = None) -> None:
    """Refuse to replace (``--overwrite``) an existing ``loc`` that scaleattn did not write, or (with ``kind``: a
    store format such as ``"scaleattn-model"``, or :data:`RUN`) one of another kind: a dataset given as a
    checkpoint or a model where a run directory goes is never deleted.

    Raises
    ------
    UnsafeOutputError
        Naming the path and what is there.
    """
    if not loc.exists():
        return
    ours, what = owner_of(loc)
    if not ours:
        raise UnsafeOutputError(f"{role} {loc.url} exists and was not written by scaleattn ({what}): --overwrite"
                                " replaces only scaleattn's own outputs; remove it yourself or choose another path")
    if kind is not None and what not in (kind, "an empty directory"):
        raise UnsafeOutputError(f"{role} {loc.url} is {_kind_name(what)}, not {_kind_name(kind)}: --overwrite"
                                " replaces only an output of the same kind; remove it yourself or choose another"
                                " path")


#: the kind of a run directory for :func:`check_replaceable` (store kinds are their ``format``)
RUN = "a run directory"


def _kind_name(what: str) -> str:
    return f"a {what[len(_formats.PREFIX):]} store" if what.startswith(_formats.PREFIX) else what


# ---- one run per output -------------------------------------------------------------------------------
#: locks this process holds: url -> [depth, release callback]
_HELD: dict[str, list] = {}


def lock_location(loc: Location) -> Location:
    """Where the lock of ``loc`` lives: ``.NAME.lock`` next to it."""
    url = loc.url.rstrip("/")
    parent, name = (posixpath if loc.is_remote else os.path).split(url)
    sep = "/" if loc.is_remote else os.sep
    return Location(f"{parent}{sep}.{name}.lock", loc.storage_options)


def _owner() -> dict:
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": psutil.Process().create_time(), "locked_at": time.time(), "token": uuid.uuid4().hex}


def _describe(owner: dict | None) -> str:
    if not owner:
        return "another scaleattn run"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("locked_at", 0)))
    return f"the scaleattn run of pid {owner.get('pid')} on host {owner.get('host')} (since {when})"


def _alive_here(owner: dict) -> bool:
    """Whether the owner of a lock is a live process of this host (same pid and start time)."""
    import psutil

    if owner.get("host") != socket.gethostname():
        return True  # cannot tell: another machine's process
    try:
        return abs(psutil.Process(int(owner["pid"])).create_time() - float(owner["started"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def _acquire_local(lock: Location, role: str, loc: Location):
    import fcntl

    path = lock.url
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = json.loads(os.pread(fd, 4096, 0) or b"null")
            except ValueError:
                owner = None
            os.close(fd)
            raise OutputInUseError(f"{role} {loc.url} is in use by {_describe(owner)}: two runs never share an"
                                   " output; wait for it to finish or choose another path") from None
        try:  # the file may have been unlinked by its last holder between our open and flock: retry then
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                os.close(fd)
                continue
        except FileNotFoundError:
            os.close(fd)
            continue
        old = os.pread(fd, 4096, 0)
        try:
            foreign = bool(old) and not isinstance(json.loads(old).get("pid"), int)
        except (ValueError, AttributeError):
            foreign = True
        if foreign:  # a file of the user's with our lock's name: never overwritten
            os.close(fd)
            raise UnsafeOutputError(f"{role} {loc.url}: {path} exists and is not a scaleattn lock; move it away")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_owner()).encode(), 0)
        except BaseException:  # a full disk: never keep the lock (and its descriptor) of an output we gave up
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            raise

        def release(fd=fd):
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)

        return release
    raise OutputInUseError(f"{role} {loc.url}: cannot take its lock {path} (it keeps changing)")


def _acquire_remote(lock: Location, role: str, loc: Location):
    fs, p = lock.fs()
    me = _owner()
    for _ in range(2):
        try:
            with fs.open(p, "xb") as f:  # exclusive create (S3 conditional write)
                f.write(json.dumps(me).encode())
        except FileExistsError:
            owner = _read_json(lock)
            if owner is not None and not _alive_here(owner):
                fs.rm(p)  # a lock of a process of this host that is gone: stale
                continue
            raise OutputInUseError(f"{role} {loc.url} is in use by {_describe(owner)}: two runs never share an"
                                   f" output; if that run is gone, remove {lock.url}") from None
        except Exception:  # no exclusive mode on this store: create, then check that we own it
            if fs.exists(p):
                owner = _read_json(lock)
                if owner is None or _alive_here(owner):
                    raise OutputInUseError(f"{role} {loc.url} is in use by {_describe(owner)}: if that run is gone,"
                                           f" remove {lock.url}") from None
            with fs.open(p, "wb") as f:
                f.write(json.dumps(me).encode())
        if (_read_json(lock) or {}).get("token") != me["token"]:
            raise OutputInUseError(f"{role} {loc.url} is in use by {_describe(_read_json(lock))}")
        return lambda: fs.rm(p) if (_read_json(lock) or {}).get("token") == me["token"] else None
    raise OutputInUseError(f"{role} {loc.url}: cannot take its lock {lock.url}")


@contextlib.contextmanager
def hold(loc: Location, role: str = "output"):
    """Hold the exclusive lock of output ``loc`` for the block (re-entrant within a process).

    Raises
    ------
    OutputInUseError
        Another live run holds it (the message names its host, pid and start time).
    StorageError
        The file system refuses the lock next to it (a file where a folder must be, no permission, no such
        place, disk full).
    """
    key = loc.url
    if key in _HELD:
        _HELD[key][0] += 1
        try:
            yield
        finally:
            _HELD[key][0] -= 1
        return
    lock = lock_location(loc)
    try:
        release = (_acquire_remote if loc.is_remote else _acquire_local)(lock, role, loc)
    except OSError as e:  # the first write next to the output: a file in the way, no permission, no such place
        if (err := _refused(e, loc, role, always=True)) is None:
            raise
        raise err from e
    _HELD[key] = [1, release]
    try:
        yield
    finally:
        del _HELD[key]
        release()


#: errors of the file system that no code of ours causes while writing (no space, over quota, read-only): the
#: output's, also without a path (a failed write()); a refused permission only on a path of the output's
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
_DENIED = {errno.EACCES, errno.EPERM}


def _refused(e: OSError, loc: Location, role: str, *, always: bool = False, inside: str | None = None):
    """``e`` as a :class:`StorageError` naming the output (the CLI's one line, exit 2) when the file system
    refused to create or write it: ``always`` (taking its place), a full or read-only file system, or a refused
    permission on a path inside ``inside`` (the output's temporary); else None (another path's error, or a bug
    of ours: raised as it is)."""
    if isinstance(e, ScaleattnError):
        return None
    name = str(e.filename or "")
    ours = bool(inside) and name.startswith(inside)
    if not (always or (e.errno in _FULL and (not name or ours)) or (e.errno in _DENIED and ours)):
        return None
    where = f" ({e.filename})" if e.filename and str(e.filename) != loc.url else ""
    return StorageError(f"cannot write {role} {loc.url}: {e.strerror or e}{where}")


# ---- all or nothing -----------------------------------------------------------------------------------
def _temporaries(loc: Location) -> tuple[str, str]:
    parent, name = os.path.split(loc.url)
    return parent, f".{name}.partial-"


def clean_leftovers(loc: Location, protect=()) -> list[str]:
    """Remove the temporaries a killed run left next to local output ``loc`` (``.NAME.partial-*``), restoring
    the previous output when a run died between moving it aside and putting the new one in place; never
    anything in ``protect`` (input Locations). Call only while holding the lock of ``loc`` (:func:`hold`).
    Returns the paths removed."""
    if loc.is_remote:
        return []
    parent, prefix = _temporaries(loc)
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix) and not any(
            relation(Location(os.path.join(parent, n)), p) for p in protect))
    except FileNotFoundError:
        return []
    asides = [n for n in names if n.endswith(".old") and owner_of(Location(os.path.join(parent, n)))[0]]
    if asides and not os.path.exists(loc.url):  # the previous output, moved aside by a run killed just then
        os.replace(os.path.join(parent, asides[-1]), loc.url)
        names.remove(asides[-1])
    for n in names:
        remove(os.path.join(parent, n))
    return [os.path.join(parent, n) for n in names]


@contextlib.contextmanager
def atomic_output(loc: Location, overwrite: bool = False, kind: str | None = None):
    """Yield a temporary :class:`Location` next to ``loc`` that becomes ``loc`` only if the block succeeds.

    A failure leaves nothing behind: neither a half-written store nor the temporary. An existing ``loc`` is
    refused (:class:`~scaleattn.errors.OutputExistsError`) unless ``overwrite``, and even then when scaleattn
    did not write it or it is of another ``kind`` than the new one (:func:`check_replaceable`;
    :class:`~scaleattn.errors.UnsafeOutputError`), as is one inside a Zarr store
    (:func:`check_outside_stores`); locally it is replaced only after the
    new output is complete. The lock of ``loc`` is held throughout (:func:`hold`), and temporaries of a
    killed run are removed first. Object stores cannot rename: there ``overwrite`` deletes the old output
    first, and the new one is written in place and removed on failure.
    """
    check_outside_stores(loc)
    with hold(loc):
        clean_leftovers(loc)
        if loc.exists():
            if not overwrite:
                raise OutputExistsError(f"output {loc.url!r} already exists (pass --overwrite to replace it)")
            check_replaceable(loc, kind=kind)
        if loc.is_remote:
            loc.remove()
            try:
                yield loc
            except BaseException:
                loc.remove()
                raise
            return
        url = loc.url
        parent, prefix = _temporaries(loc)
        tmp = os.path.join(parent, f"{prefix}{uuid.uuid4().hex[:8]}")
        aside = f"{tmp}.old"
        try:
            os.makedirs(parent, exist_ok=True)
            yield Location(tmp, loc.storage_options)
            if os.path.exists(url):  # move the old output aside first: a crash now loses neither copy
                os.replace(url, aside)
            os.replace(tmp, url)
        except OSError as e:  # disk full, read-only, ...: the output's problem, not a bug (nothing is left)
            if (err := _refused(e, loc, "output", inside=tmp)) is None:
                raise
            raise err from e
        finally:
            remove(tmp)
            remove(aside)
