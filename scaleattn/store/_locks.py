"""Locks next to stores: one writer per output, and no store replaced while another run reads it.

- :func:`hold`: an exclusive lock next to an output (``.NAME.lock``: owner host, pid and start time). Local
  locks are ``flock`` locks, released by the kernel when the process dies, so a stale lock of a killed run is
  taken over at once; on object stores the lock object is created exclusively and a lock of a dead process
  on this host is detected from its pid and start time.
- :func:`reading` / :func:`check_unread`: a run reading an input keeps a marker next to it
  (``.NAME.read-TOKEN.lock``: host, pid, start; never inside the store, and none where nothing can be
  written); a store with the marker of a live reader (next to it, or of a store directly inside it) is never
  replaced or deleted, and a reader is refused while a writer holds the store's lock (or that of the directory
  holding it). Markers of dead readers are ignored and removed, as stale locks are.

:mod:`scaleattn.store._outputs` builds the output rules on these (and re-exports them).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import re
import socket
import time
import uuid

from ..errors import OutputInUseError, ScaleattnError, StorageError, UnsafeOutputError
from ._formats import loads
from ._location import Location

__all__ = ["hold", "lock_location", "reading", "check_unread", "is_store", "store_holding"]


def _read_json(loc: Location) -> dict | None:
    """The JSON object stored at ``loc`` (a lock, a marker, a ``zarr.json``, a report), or None when there is
    none: absent, unreadable, not JSON, or JSON of another type (``[1]`` is no metadata or owner)."""
    try:
        return _object(loc.read_bytes())
    except OSError:
        return None


def _object(data: bytes) -> dict | None:
    """``data`` parsed as a JSON object, or None (not JSON, nested too deep, or not an object)."""
    try:
        value = loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ---- one run per output -------------------------------------------------------------------------------
#: locks this process holds: url -> [depth, release callback]
_HELD: dict[str, list] = {}


def physical(loc: Location) -> Location:
    """``loc`` with the symbolic links of a local path resolved: the store itself, whatever name reaches it, is
    what its lock and its readers' markers sit next to (a link's name would hide them from the store's)."""
    return loc if loc.is_remote else Location(os.path.realpath(loc.url), loc.storage_options)


def is_store(loc: Location) -> bool:
    """Whether ``loc`` is a Zarr store (a group or an array of zarr v3 or v2)."""
    return any(loc.join(doc).exists() for doc in ("zarr.json", ".zgroup", ".zarray"))


def store_holding(loc: Location, test=is_store) -> Location | None:
    """The nearest Zarr store (or other directory for which ``test`` holds) that ``loc`` lies inside (its
    parents, links resolved), or None."""
    if loc.is_remote:
        scheme, _, rest = loc.url.partition("://")
        parts = rest.rstrip("/").split("/")
        parents = [Location(f"{scheme}://{'/'.join(parts[:k])}", loc.storage_options)
                   for k in range(len(parts) - 1, 0, -1)]
    else:
        p, parents = os.path.realpath(loc.url), []
        while os.path.dirname(p) != p:
            p = os.path.dirname(p)
            parents.append(Location(p))
    return next((parent for parent in parents if test(parent)), None)


def lock_location(loc: Location) -> Location:
    """Where the lock of ``loc`` lives: ``.NAME.lock`` next to it (next to the store a link names)."""
    loc = physical(loc)
    url = loc.url.rstrip("/")
    parent, name = (posixpath if loc.is_remote else os.path).split(url)
    sep = "/" if loc.is_remote else os.sep
    return Location(f"{parent}{sep}.{name}.lock", loc.storage_options)


def _owner() -> dict:
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": psutil.Process().create_time(), "locked_at": time.time(), "token": uuid.uuid4().hex}


def _describe(owner: dict | None) -> str:
    """Who holds a lock or marker, from the owner it wrote (:func:`_owner`), for one line of a message: its pid,
    host and since when, each only where it has its type (the file is another process's, maybe not ours)."""
    if not owner:
        return "another scaleattn run"
    pid, host, at = owner.get("pid"), owner.get("host"), owner.get("locked_at")
    try:
        when = f" (since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))})"
    except (TypeError, ValueError, OverflowError, OSError):  # not a time: none said
        when = ""
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else "?"
    host = host if isinstance(host, str) and host.isprintable() and 0 < len(host) <= 255 else "?"
    return f"the scaleattn run of pid {pid} on host {host}{when}"


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
            owner = _object(os.pread(fd, 4096, 0))
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
        foreign = bool(old) and not isinstance((_object(old) or {}).get("pid"), int)
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
    key = physical(loc).url
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


def file_system_refusal(e: BaseException) -> str | None:
    """What the file system refused, ``PATH: No space left on device``, for an error no layer named (a write of a
    library, a removal): a full disk, a quota or a read-only file system (with or without a path) or a refused
    permission on a path; None for anything else (a bug, raised as it is)."""
    if not isinstance(e, OSError) or isinstance(e, ScaleattnError):
        return None
    if not (e.errno in _FULL or (e.errno in _DENIED and e.filename)):
        return None
    what = e.strerror or os.strerror(e.errno)
    return f"{e.filename}: {what}" if e.filename else f"{what} (the file system refused a write)"


def _refused(e: OSError, loc: Location, role: str, *, always: bool = False, inside: str | None = None,
             kept: str = ""):
    """``e`` as a :class:`StorageError` naming the output (the CLI's one line, exit 2) when the file system
    refused to create or write it: ``always`` (taking its place), a full or read-only file system, or a refused
    permission on a path inside ``inside`` (the output's temporary); else None (another path's error, or a bug
    of ours: raised as it is). ``kept`` ends the message: what the refusal left (``nothing of it was written``)."""
    if isinstance(e, ScaleattnError):
        return None
    name = str(e.filename or "")
    root = (inside or "").rstrip("/" + os.sep)
    ours = bool(root) and (name == root or name.startswith((root + "/", root + os.sep)))
    if not (always or (e.errno in _FULL and (not name or ours)) or (e.errno in _DENIED and ours)):
        return None
    where = f" ({e.filename})" if e.filename and str(e.filename) != loc.url else ""
    return StorageError(f"cannot write {role} {loc.url}: {e.strerror or e}{where}{f'; {kept}' if kept else ''}")


# ---- nothing a run reads is replaced under it -----------------------------------------------------------
#: reader markers this process holds: url -> [depth, release callback]
_READING: dict[str, list] = {}


def _parent_and_name(loc: Location) -> tuple[str, str, str]:
    """``(parent URL, name, separator)`` of ``loc``."""
    url = loc.url.rstrip("/") or loc.url
    sep = "/" if loc.is_remote else os.sep
    parent, name = (posixpath if loc.is_remote else os.path).split(url)
    return parent, name, sep


def _parent(loc: Location) -> Location | None:
    """The directory holding ``loc``; None for a root (``/``, a bucket ``s3://b``), which has nothing next to it."""
    parent, _, _ = _parent_and_name(loc)
    if loc.is_remote:
        path = parent.split("://", 1)[1] if "://" in parent else ""
        return Location(parent, loc.storage_options) if path.strip("/") else None
    return None if os.path.dirname(loc.url.rstrip(os.sep) or os.sep) == (loc.url.rstrip(os.sep) or os.sep) \
        else Location(parent)  # (only "/" itself is a root: "/data.zarr" has "/" next to it)


#: a reader's marker, ``.NAME.read-TOKEN.lock`` (TOKEN: 12 hex digits, the last ``.read-`` of the name), or one
#: being made, ``.NAME.read-TOKEN.partial-lock`` (:func:`_mark_local` locks it before renaming it: one nobody locks
#: is of a reader killed in between, and goes as a dead reader's marker does)
_MARKER = re.compile(r"\.(.+)\.read-[0-9a-f]{12}\.(?:partial-)?lock")
PARTIAL_S = 10.0


def _is_marker(entry: str, name: str | None = None) -> bool:
    """Whether ``entry`` is the name of a reader's marker (of ``name``, when given), made or being made."""
    m = _MARKER.fullmatch(entry)
    return m is not None and (name is None or m.group(1) == name)


def _mark_local(loc: Location):
    """Create this reader's marker next to local ``loc`` (flock-locked while it lives); the release callback, or
    None where nothing can be written there."""
    import fcntl

    parent, name, _ = _parent_and_name(loc)
    token = uuid.uuid4().hex[:12]
    final = os.path.join(parent, f".{name}.read-{token}.lock")
    tmp = os.path.join(parent, f".{name}.read-{token}.partial-lock")  # (locked before it is renamed)
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:  # a read-only place (or no permission): read without a marker
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (nobody else has this name: never waits)
        os.pwrite(fd, json.dumps(_owner()).encode(), 0)
        os.rename(tmp, final)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(fd)
        return None

    def release():
        with contextlib.suppress(OSError):
            os.unlink(final)
        os.close(fd)

    return release


def _mark_remote(loc: Location):
    """The same on an fsspec store (an object holding the owner); None where it cannot be written."""
    parent, name, sep = _parent_and_name(loc)
    marker = Location(f"{parent}{sep}.{name}.read-{uuid.uuid4().hex[:12]}.lock", loc.storage_options)
    try:
        marker.write_bytes(json.dumps(_owner()).encode())
    except Exception:  # read-only credentials, a public bucket, a read-only file system: read without a marker
        return None

    def release():
        with contextlib.suppress(Exception):
            marker.remove()

    return release


def _try_flock(path: str, shared: bool) -> tuple[int, bool, dict | None]:
    """Open ``path`` and try to take its flock without waiting: ``(fd, held, owner)``, ``held`` True when another
    process holds it (``owner``: the JSON it wrote, or None), None when the file system refuses flock. The
    caller closes ``fd`` (releasing what it took). Raises the ``OSError`` of the open."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return fd, True, _object(os.pread(fd, 4096, 0))
    except OSError:  # no flock here (some network file systems): unknown
        return fd, None, None
    return fd, False, None


def _writer_of(target: Location) -> tuple[bool, dict | None]:
    """``(held, owner)`` of the lock of ``target`` (:func:`hold`) by another live process."""
    lock = lock_location(target)
    if not lock.is_remote:
        try:
            fd, held, owner = _try_flock(lock.url, shared=True)
        except OSError:
            return False, None
        os.close(fd)  # (and with it our shared lock)
        return bool(held), owner
    try:
        fs, p = lock.fs()
        fs.invalidate_cache(p)  # (another process wrote it: never a cached listing)
        if not lock.exists():
            return False, None
    except StorageError:
        return False, None
    owner = _read_json(lock)
    return owner is None or _alive_here(owner), owner


def _check_not_written(loc: Location, role: str) -> None:
    """Refuse to read ``loc`` while another run holds the lock of it or of the directory holding it (a fit
    replacing the run directory whose model is the input)."""
    phys = physical(loc)
    for target in (phys, _parent(phys)):
        if target is None or _parent(target) is None or target.url in _HELD:  # (a root has no lock next to it)
            continue
        held, owner = _writer_of(target)
        if held:
            inside = f" (it replaces {target.url}, which holds it)" if target is not phys else ""
            raise OutputInUseError(f"{role} {loc.url} is being written by {_describe(owner)}{inside}: a run never"
                                   " reads a store while another replaces it; wait for that run to finish")


@contextlib.contextmanager
def reading(loc: Location, role: str = "input"):
    """Mark ``loc`` as read by this process for the block: a marker next to it (``.NAME.read-TOKEN.lock``,
    owner host, pid and start time; never inside the store) that :func:`check_unread` sees, so that no other
    run replaces or deletes the store meanwhile. Re-entrant within a process. Where no marker can be written (a
    read-only place, read-only credentials) the block runs without one. Markers that readers killed without
    clean-up left next to ``loc`` are removed (as :func:`check_unread` does).

    Raises
    ------
    OutputInUseError
        Another run holds the lock of ``loc`` (or of the directory holding it): it is replacing it.
    """
    phys = physical(loc)  # (a link's name: the marker goes next to the store it names)
    key = phys.url
    if key in _READING:
        _READING[key][0] += 1
        try:
            yield
        finally:
            _READING[key][0] -= 1
        return
    # no marker where there is no place next to it: a root, or inside another store (a subgroup: never written)
    release = None if _parent(phys) is None or store_holding(phys) is not None else \
        (_mark_remote if phys.is_remote else _mark_local)(phys)
    if release is not None:  # markers of readers that died (killed) go: ours is the one now
        with contextlib.suppress(Exception):
            for marker, _ in _markers(phys, inside=False):
                _live_reader(marker)
    try:
        _check_not_written(loc, role)  # after marking: a writer that takes its lock from now on sees the marker
        _READING[key] = [1, release]
        try:
            yield
        finally:
            del _READING[key]
    finally:
        if release is not None:
            release()


def _markers(loc: Location, inside: bool = True) -> list[tuple[Location, Location]]:
    """``(marker, store read)`` of every reader's marker of ``loc`` (and of the stores directly inside it)."""
    found = []
    parent = _parent(loc)
    _, name, sep = _parent_and_name(loc)
    for where, only in ((parent, name), (loc if inside else None, None)):
        if where is None:
            continue
        if where.is_remote:
            fs, p = where.fs()
            try:
                fs.invalidate_cache(p)  # (other processes' markers: never a cached listing)
                entries = [posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)]
            except (FileNotFoundError, NotADirectoryError):
                continue
        else:
            try:
                entries = os.listdir(where.url)
            except OSError:  # absent, or a file
                continue
        for e in sorted(entries):
            if _is_marker(e, only):
                store = loc if only else where.join(_MARKER.fullmatch(e).group(1))
                found.append((Location(f"{where.url.rstrip(sep)}{sep}{e}", loc.storage_options), store))
    return found


def _live_reader(marker: Location) -> tuple[bool, dict | None]:
    """``(alive, owner)`` of a reader's marker; a dead reader's marker is removed."""
    if not marker.is_remote:
        try:
            fd, held, owner = _try_flock(marker.url, shared=False)
        except FileNotFoundError:
            return False, None
        # nobody holds it: its reader is gone (one being made is locked microseconds after it is created: left
        # alone for PARTIAL_S, so that no reader loses its marker to this sweep)
        young = marker.url.endswith(".partial-lock") and time.time() - os.fstat(fd).st_mtime < PARTIAL_S
        if held is False and not young:
            with contextlib.suppress(OSError):
                os.unlink(marker.url)
        os.close(fd)
        return held is not False, owner  # (no flock: a reader cannot be ruled out)
    owner = _read_json(marker)
    if owner is not None and not _alive_here(owner):
        with contextlib.suppress(Exception):
            marker.remove()
        return False, owner
    return True, owner


def check_unread(loc: Location, role: str = "output") -> None:
    """Refuse to replace or delete ``loc`` while another scaleattn run reads it, or a store directly inside it
    (a run directory whose model is read), as its input (:func:`reading`). Markers of dead readers are ignored
    and removed: local markers are held with ``flock`` (released by the kernel when the reader dies); on object
    stores a marker of a process of this host that is gone is stale, one of another host is refused with the
    marker to remove once that run is gone.

    Raises
    ------
    OutputInUseError
        Naming ``role``, the store, the reader (pid, host, since when) and what it reads.
    """
    phys = physical(loc)
    for marker, store in _markers(phys):
        alive, owner = _live_reader(marker)
        if not alive:
            continue
        inner = f" (it reads {store.url})" if store is not phys else ""
        gone = f"; if that run is gone, remove {marker.url}" if marker.is_remote else ""
        raise OutputInUseError(f"{role} {loc.url} is being read by {_describe(owner)}{inner}: a store another run"
                               f" reads is never replaced or deleted; wait for it to finish{gone}")
