"""Where stores live (layer L0): a :class:`Location` handle for a local path or fsspec URL (``s3://...``),
resolved once at the public entry; zarr groups, existence, removal, atomic outputs and retries on it.

URLs go through fsspec (s3fs for ``s3://``) with the location's ``storage_options``; what they leave out comes
from the standard environment: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, and the
endpoint ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` (read by botocore >= 1.31 itself). An unreachable
endpoint or refused credentials raise :class:`~scaleattn.errors.StorageError` (docs/object-storage.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import time

import zarr

from .._params import parse_storage_options, storage_option_pairs
from ..errors import MissingDependencyError, ParameterError, StorageError
from . import _bounds

_bounds.install()  # every store opened in this process decodes its chunks within their declared sizes

__all__ = ["Location", "resolve", "check_path", "describe_value", "StorageError", "access_error", "transient",
           "with_retries", "is_url", "protocols", "check_kind", "settle_writes", "did_you_mean",
           "check_storage_options", "options_for", "RETRY_ATTEMPTS", "RETRY_DELAY"]

#: top-level modules whose exceptions mean "the remote store could not be reached or refused us"
_REMOTE_ERROR_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs", "urllib3", "requests")
#: names of remote errors that fail the same way every time (credentials, permissions): never retried
_REFUSALS = ("credential", "accessdenied", "forbidden", "invalidaccesskey", "signaturedoesnotmatch", "permission",
             "nosuchbucket", "unauthorized")
#: the retry policy of store reads (:func:`with_retries`): attempts in all, and the first wait in seconds
RETRY_ATTEMPTS, RETRY_DELAY = 3, 1.0


@dataclasses.dataclass(frozen=True)
class Location:
    """A store resolved once: an absolute local path or a URL, with the fsspec options to reach it.

    Made by :func:`resolve` at the public entry; every lower layer takes a ``Location`` instead of
    ``(url, storage_options)`` pairs. Cheap to pickle to Dask workers.

    Attributes
    ----------
    url : str
        Absolute local path, or a URL such as ``s3://bucket/data.zarr`` (no trailing slash).
    storage_options : dict or None
        fsspec options (endpoint, credentials) for URLs.

    Examples
    --------
    >>> loc = resolve("/tmp/run1")
    >>> loc.join("model.zarr").url
    '/tmp/run1/model.zarr'
    """

    url: str
    storage_options: dict | None = None

    def __str__(self) -> str:
        return self.url

    @property
    def is_remote(self) -> bool:
        return is_url(self.url)

    @property
    def in_memory(self) -> bool:
        """Whether the store lives in the memory of this process (``memory://``, also behind a cache layer):
        other processes, Dask workers among them, see an empty file system of their own."""
        return self.is_remote and "memory" in protocols(self.url)

    def join(self, name: str) -> Location:
        """The child ``name`` of this location (same options)."""
        return Location(join(self.url, name), self.storage_options)

    def exists(self) -> bool:
        return exists(self.url, self.storage_options)

    def remove(self) -> None:
        remove(self.url, self.storage_options)

    def open_group(self, mode: str = "r", use_consolidated: bool | None = None) -> zarr.Group:
        return open_group(self.url, mode, self.storage_options, use_consolidated)

    def fs(self):
        """The fsspec filesystem and path of this location."""
        return fs_for(self.url, self.storage_options)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def read_bytes(self) -> bytes:
        if not self.is_remote:
            check_regular(self.url)  # (a FIFO would block the read for ever)
        with _remote_access(self.url):
            fs, p = self.fs()
            with fs.open(p, "rb") as f:
                return f.read()

    def write_bytes(self, data: bytes) -> None:
        with _remote_access(self.url):
            fs, p = self.fs()
            with fs.open(p, "wb") as f:
                f.write(data)


def resolve(url, storage_options=None) -> Location:
    """A :class:`Location` for a path, ``file://`` URL, fsspec URL or an existing Location.

    Local paths are made absolute (relative to this process's working directory, so that Dask workers elsewhere
    read the same store); ``storage_options`` go through :func:`parse_storage_options`. A Location is
    returned as is (``storage_options`` must then be None or equal to its own).

    Raises
    ------
    ParameterError
        An empty path, options given twice, or something that is no path (an array, a tuple: :func:`check_path`).
    """
    if isinstance(url, Location):
        if storage_options is not None and parse_storage_options(storage_options) != url.storage_options:
            raise ParameterError(f"{url.url}: storage options given twice (the location already has its own)")
        return url
    check_path(url)
    text = _normal_url(os.fspath(url) if isinstance(url, os.PathLike) else str(url))
    if not text:
        raise ParameterError("empty path: give a store path or URL")
    opts = parse_storage_options(storage_options)
    if is_url(text):
        bare = text.rstrip("/")
        return Location(bare if not bare.endswith(":") else bare + "//", opts)  # (a root "s3://" stays a URL)
    return Location(_absolute(local_path(text)), opts)


def check_path(value, entry: str | None = None, takes: str = "a store's path or URL", instead: str = "") -> None:
    """Refuse, in one line, a value that is no path (an array, a tuple, a number) where a store's path or URL goes:
    every public entry that takes one resolves it here. Its ``str()`` made a path of it (a 700-character "no such
    dataset" built from the working directory and the array's repr). ``entry`` names the function, ``takes`` what
    it takes, ``instead`` what to use for such a value.

    Raises
    ------
    ParameterError
        ``value`` is not a str, a path-like or a :class:`Location`.

    Examples
    --------
    >>> import numpy as np
    >>> check_path(np.ones((4, 3, 2)), "fit", "a path")
    Traceback (most recent call last):
    ...
    scaleattn.errors.ParameterError: fit takes a path, not a numpy.ndarray of shape (4, 3, 2)
    """
    if isinstance(value, (str, os.PathLike, Location)):
        return
    raise ParameterError(f"{entry or 'this'} takes {takes}, not {describe_value(value)}{instead}")


def describe_value(value) -> str:
    """A value as an error names it without printing it: ``a numpy.ndarray of shape (4, 3, 2)``, ``a tuple of 2
    items``, ``the int 3``."""
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__name__}"
    if hasattr(value, "shape"):
        return f"a {name} of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list, dict, set)):
        return f"a {name} of {len(value)} item{'s' * (len(value) != 1)}"
    if isinstance(value, (bytes, int, float, bool)) or value is None:
        return f"the {name} {value!r}"[:80]
    return f"a {name}"


def check_storage_options(storage_options, *paths) -> None:
    """Refuse fsspec ``storage_options`` given where none of ``paths`` (one call's; None skipped, a Location by
    its URL) is a URL: the operating system reads a local path, and the options were ignored without a word.

    Raises
    ------
    ParameterError
        Naming the options and the local paths.
    """
    given = [p for p in paths if p is not None]
    if not storage_options or not given or any(is_url(_normal_url(str(getattr(p, "url", p)))) for p in given):
        return
    keys = list(storage_options) if isinstance(storage_options, dict) else list(storage_option_pairs(storage_options))
    local = ", ".join(str(getattr(p, "url", p)) for p in given)
    raise ParameterError(f"storage options ({', '.join(map(str, keys))}) apply to fsspec URLs such as"
                         f" s3://BUCKET/KEY, not to local paths ({local}): nothing would read them; drop them")


def options_for(path, storage_options):
    """``storage_options`` where ``path`` (a path, URL or Location) is a URL, None where it is a local path."""
    return storage_options if is_url(_normal_url(str(getattr(path, "url", path)))) else None


def _absolute(path: str) -> str:
    """``path`` made absolute as the operating system reads it: ``..`` after a symbolic link leaves the link's
    target (``os.path.abspath`` alone drops ``link/..`` as text: a fit read another store than ``ls`` shows
    there); without ``..`` both agree, and links stay as given: ``_absolute("/a/./b/") == "/a/b"``."""
    full = os.path.join(os.getcwd(), os.path.expanduser(path))
    parts = full.split(os.sep)
    if ".." not in parts:
        return os.path.abspath(full)
    last = len(parts) - 1 - parts[::-1].index("..")
    return os.path.abspath(os.path.join(os.path.realpath(os.sep.join(parts[: last + 1])), *parts[last + 1 :]))


def access_error(url: str, e: BaseException) -> StorageError | None:
    """``e`` as a :class:`StorageError`, or None when it is not an access problem (e.g. a missing key).

    The error keeps whether it is worth retrying (:attr:`StorageError.transient`, from :func:`transient`).
    Local paths are called local files, never an object store."""
    if isinstance(e, (FileNotFoundError, StorageError)) or not isinstance(e, Exception):
        return None
    remote = type(e).__module__.split(".")[0] in _REMOTE_ERROR_MODULES
    if not (remote or isinstance(e, (PermissionError, ConnectionError, TimeoutError))):
        return None
    flaky = transient(e)
    if not is_url(url):
        what = "permission denied" if isinstance(e, PermissionError) else "cannot read or write it"
        return StorageError(f"{url}: {what} on the local file system ({type(e).__name__}: {e}); check the path's"
                            " owner and permissions", transient=flaky)
    hint = ("check the endpoint (`storage_options={'endpoint_url': 'http://HOST:PORT'}` or AWS_ENDPOINT_URL) and"
            " the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or `storage_options={'key':"
            " ..., 'secret': ...}`)") if str(url).startswith(("s3://", "s3a://")) else (
            "check the URL, the `storage_options` values and the credentials")
    return StorageError(f"{url}: cannot access the object store ({type(e).__name__}: {e}); {hint}", transient=flaky)


def transient(e: BaseException) -> bool:
    """Whether ``e`` is worth retrying: a connection or timeout error, an error of a remote store's client
    library other than a refusal of credentials or permissions, or a :class:`StorageError` made from one; not a
    missing key, a refused permission or bad data (those fail the same way every time)."""
    if isinstance(e, StorageError):
        return e.transient
    if isinstance(e, (FileNotFoundError, PermissionError)) or not isinstance(e, Exception):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if type(e).__module__.split(".")[0] not in _REMOTE_ERROR_MODULES:
        return False
    text = f"{type(e).__name__} {e}".lower().replace(" ", "")
    return not any(word in text for word in _REFUSALS)


def with_retries(fn, *args, attempts: int | None = None, delay: float | None = None, **kwargs):
    """``fn(*args, **kwargs)``, retried up to ``attempts`` times in all when it raises a :func:`transient` error
    (waiting about ``delay``, then twice as long, ..., each wait with up to 50% random jitter so that many
    workers do not retry in step). Dask tasks call their work through this and are submitted without Dask
    retries, so bad data fails once, with one log line, while a flaky store is retried. ``attempts`` and
    ``delay`` default to :data:`RETRY_ATTEMPTS` and :data:`RETRY_DELAY`."""
    attempts = RETRY_ATTEMPTS if attempts is None else attempts
    delay = RETRY_DELAY if delay is None else delay
    for k in range(max(1, int(attempts))):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if k + 1 >= attempts or not transient(e):
                raise
            time.sleep(delay * 2**k * (1.0 + 0.5 * random.random()))


@contextlib.contextmanager
def _remote_access(url: str):
    """Turn connection / credential / permission errors of a URL operation into :class:`StorageError`, and an
    option its file system does not take into a :class:`ParameterError`."""
    try:
        yield
    except Exception as e:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(e)) if isinstance(e, TypeError) else None
        if bad and is_url(url):  # an fsspec option its file system does not take (s3fs finds it at first use)
            raise ParameterError(f"{url}: the storage option {bad.group(1)!r} is not one its file system takes"
                                 f" ({type(e).__name__}: {e}); check the option's name") from None
        err = access_error(url, e)
        if err is None:
            raise
        raise err from e


def _normal_url(text: str) -> str:
    """A URL's scheme in lower case (schemes are case-insensitive, RFC 3986 §3.1; fsspec knows only lower case),
    and the file URIs of RFC 8089 that name a local path (``file:/x``, ``file://localhost/x``) as ``file:///x``
    (fsspec would read them as relative paths ``./file:/x`` and ``./localhost/x``); fsspec's ``local://`` is
    ``file://`` (a local path, with every local path's checks and locks)."""
    scheme, sep, rest = text.partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]+", scheme):  # (one letter: a Windows drive, no scheme)
        return text
    scheme = scheme.lower()
    if scheme == "local":  # fsspec's other name for the local file system: a local path like file://
        scheme = "file"
    if scheme == "file":
        if rest.startswith("//localhost/"):
            rest = "//" + rest[len("//localhost"):]
        elif rest.startswith("/") and not rest.startswith("//"):
            rest = "//" + rest
    return f"{scheme}:{rest}" if rest.startswith("//") else text


def is_url(path: str) -> bool:
    """True for fsspec URLs such as ``s3://bucket/x.zarr`` (anything with a protocol but ``file``)."""
    return "://" in str(path) and not str(path).startswith("file://")


def protocols(url) -> list[str]:
    """The fsspec protocols of ``url``, outermost first, in lower case: ``["simplecache", "s3"]`` for
    ``simplecache::s3://b/k``, ``["zip", "file"]`` for ``zip://a::/x.zip``, ``["file"]`` for a local path.

    Examples
    --------
    >>> protocols("simplecache::s3://bucket/d.zarr"), protocols("/data/d.zarr")
    (['simplecache', 's3'], ['file'])
    """
    parts = str(url).split("::") if is_url(url) else [str(url)]
    return [p.split("://", 1)[0].lower() if "://" in p else ("file" if k == len(parts) - 1 else p.lower())
            for k, p in enumerate(parts)]


def check_kind(path, role: str, expected: str, *, directory: bool, storage_options=None) -> None:
    """Refuse an input path of the wrong kind for ``role``, in one line naming it, what it is and what was
    ``expected``: a directory where a file goes (``directory=False``: ``--npz``, ``--csv``), a file where a
    directory goes (``directory=True``: a Zarr store, a run directory), or a local path through a file
    (``file.txt/sub``, which cannot exist). A path that does not exist passes: its reader says "no such ...".

    Parameters
    ----------
    path : str, path-like or Location
        The input as given (resolved with ``storage_options``).
    role : str
        The option or argument it was given as (``"--npz"``, ``"dataset"``); empty for none.
    expected : str
        What belongs there, for the message (``"a .npz or .npy file"``, ``"a Zarr store (a directory)"``).
    directory : bool
        Whether a directory (store) is expected rather than a file.

    Raises
    ------
    ParameterError
        E.g. ``--npz /x/d: is a directory, expected a .npz or .npy file``.
    StorageError
        A URL's store cannot be reached.
    """
    loc = resolve(path, None if isinstance(path, Location) else storage_options)
    name = f"{role} {loc.url}" if role else loc.url
    if loc.is_remote:  # an object where a store goes (an object store has no directories, only prefixes)
        if directory:
            with _remote_access(loc.url):
                fs, p = loc.fs()
                if fs.isfile(p):
                    raise ParameterError(f"{name}: is a file (an object), expected {expected}")
        return
    p = loc.url
    if os.path.isdir(p):
        if not directory:
            raise ParameterError(f"{name}: is a directory, expected {expected}")
        return
    if os.path.lexists(p):
        if directory:
            raise ParameterError(f"{name}: is {'a file' if os.path.isfile(p) else 'not a directory'}, expected"
                                 f" {expected}")
        if os.path.exists(p) and not os.path.isfile(p):  # a FIFO, a socket, a device: nothing to read whole
            raise ParameterError(f"{name}: is not a regular file, expected {expected}")
        return
    parent = os.path.dirname(p)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise ParameterError(f"{name}: {parent} is a file, not a directory (nothing lies inside a file); expected"
                             f" {expected}")


def local_path(path) -> str:
    """``file:///x/y`` -> ``/x/y``; other paths and URLs unchanged."""
    p = str(path)
    return p[len("file://"):] if p.startswith("file://") else p


def did_you_mean(path) -> str:
    """``" (did you mean /x/data.zarr?)"`` for a local path that does not exist when its folder holds a close
    name (a typo: ``difflib``'s ratio at least 0.6), else ``""``: the tail of a "no such ..." message.

    """
    import difflib

    p = local_path(path)
    if is_url(p) or os.path.exists(p):
        return ""
    parent, name = os.path.split(os.path.abspath(p))
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return ""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (did you mean {os.path.join(parent, close[0])}?)" if close else ""


def join(base: str, name: str) -> str:
    """Join a store path or URL and a child name."""
    return f"{str(base).rstrip('/')}/{name}"


def fs_for(url: str, storage_options: dict | None = None):
    """The fsspec filesystem and path for ``url`` (local paths use the local filesystem)."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    except ImportError as e:  # the filesystem of this protocol is an optional package (s3fs for s3://)
        if str(url).split("://", 1)[0] in ("s3", "s3a"):
            raise MissingDependencyError.for_extra(str(url), "s3", "s3fs") from None
        raise MissingDependencyError(f"{url}: {e}") from None
    except ValueError as e:  # fsspec: "Protocol not known: xyz"
        raise ParameterError(f"{url}: {e} (a path, file://, or an fsspec URL such as s3://bucket/key)") from None


def exists(url: str, storage_options: dict | None = None) -> bool:
    """True when something (file, directory or prefix) exists at ``url``; :class:`StorageError` when a URL's
    store cannot be reached or refuses the credentials (never a silent False)."""
    if not is_url(url):
        return os.path.exists(local_path(url))
    with _remote_access(url):
        fs, p = fs_for(url, storage_options)
        return fs.exists(p)


#: how long :func:`settle_writes` waits for the writes in flight, in seconds
SETTLE_TIMEOUT = 60.0


def settle_writes(timeout: float = SETTLE_TIMEOUT) -> None:
    """Wait for the store I/O this process still has in flight on zarr's and fsspec's event-loop threads.

    A write (``array[a:b] = ...``) runs its chunks' puts as tasks on such a thread; when the calling thread stops
    waiting for them (Ctrl-C, an exception), the puts go on. An output removed on failure then got chunks back
    after its removal: a hidden temporary of 4-110 MB left behind by an interrupted ``generate``. Called before
    removing a failed output; waits for the tasks pending now (their own sub-tasks with them), at most
    ``timeout`` seconds per loop.
    """
    import asyncio
    import sys
    import threading

    async def pending_done():
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    for name in ("zarr.core.sync", "fsspec.asyn"):
        mod = sys.modules.get(name)  # (not imported: it never ran anything)
        loop, thread = ((getattr(mod, attr, None) or [None])[0] for attr in ("loop", "iothread"))
        if loop is None or loop.is_closed() or not loop.is_running() or thread is threading.current_thread():
            continue
        with contextlib.suppress(Exception):  # (a loop shutting down: nothing left to wait for)
            asyncio.run_coroutine_threadsafe(pending_done(), loop).result(timeout + 1)


def remove(url: str, storage_options: dict | None = None) -> None:
    """Delete ``url`` recursively if it exists (a symbolic link: the link alone; :class:`StorageError` as
    :func:`exists`); a local directory by :func:`_remove_tree`, which an interruption never leaves damaged."""
    if not is_url(url):
        url = local_path(url)
        if os.path.islink(url):  # the link, never what it points to
            os.unlink(url)
        elif os.path.isdir(url):
            _remove_tree(url)
        elif os.path.exists(url):
            os.remove(url)
        return
    with _remote_access(url):
        fs, p = fs_for(url, storage_options)
        if fs.exists(p):
            fs.rm(p, recursive=True)


def _remove_tree(path: str) -> None:
    """Delete the local directory ``path`` deepest first, a node's metadata (``zarr.json``, v2's ``.z*``) after
    all else in its directory: stopped anywhere (Ctrl-C, a kill), it leaves a smaller store, each chunk under its
    array's metadata, never a checkpoint without its ``zarr.json`` (``shutil.rmtree``'s order) that every later
    run refused as "not written by scaleattn". Links are removed, never followed."""
    meta = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")
    for root, dirs, files in os.walk(path, topdown=False):  # (its directories, emptied already, then its files)
        for p in [os.path.join(root, n) for n in dirs + sorted(files, key=lambda n: n in meta)]:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def check_regular(path: str) -> None:
    """Refuse a local file, or a store (directory) holding an entry, that is neither a regular file nor a
    directory: a FIFO, socket or device blocks a read, or never ends it (a hang instead of an answer). Links are
    followed to what they name (a link to a FIFO is refused), never into directories. ``os.scandir`` gives
    each entry's type without a stat call, so a store of 100,000 chunks is checked in a fraction of a second.

    Raises
    ------
    StorageError
        Naming the entry, e.g. ``/x/d.zarr/tokens/c/0/0: not a regular file (a FIFO, socket or device)``.
    """
    def refuse(p):
        what = "not a regular file (a FIFO, socket or device)"
        if os.path.islink(p) and not os.path.exists(p):  # (a loop's stat fails as a dangling link's does)
            what = f"a symbolic link to {os.readlink(p)}, which does not exist or loops back"
        raise StorageError(f"{p}: {what}: scaleattn reads only regular files; replace it with the data it stands"
                           " for")

    if not os.path.isdir(path):
        if os.path.exists(path) and not os.path.isfile(path):
            refuse(path)
        return
    todo = [path]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                    continue
                try:
                    regular = e.is_file() or e.is_dir()  # (is_file follows a link to its target)
                except OSError:  # a link that loops: ELOOP
                    regular = False
                if not regular:
                    refuse(e.path)


def open_group(url: str, mode: str = "r", storage_options: dict | None = None,
               use_consolidated: bool | None = None) -> zarr.Group:
    """Open a Zarr v3 group; ``mode='r'`` never writes to the store (and a local one is first checked to hold
    only regular files: :func:`check_regular`). URLs go through zarr's fsspec store with ``storage_options``;
    ``use_consolidated=False`` reads each array's own metadata, not the group's consolidated copy (zarr's).
    Raises :class:`StorageError` when the store cannot be reached."""
    fmt = 3 if mode in ("w", "w-") else None
    _bounds.install()  # (the arrays' codecs are resolved as the group is opened)
    if not is_url(url):
        if mode == "r":
            check_regular(local_path(url))
        return zarr.open_group(local_path(url), mode=mode, zarr_format=fmt, use_consolidated=use_consolidated)
    with _remote_access(url):
        return zarr.open_group(str(url), mode=mode, zarr_format=fmt, use_consolidated=use_consolidated,
                               storage_options=storage_options or {})
