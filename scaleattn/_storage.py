"""Where stores live: local paths or fsspec URLs (``s3://...``), opened through zarr; atomic outputs.

URLs go through fsspec (s3fs for ``s3://``) with the caller's ``storage_options``; what they leave out comes
from the standard environment: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, and the
endpoint ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` (read by botocore >= 1.31 itself). An unreachable
endpoint or refused credentials raise :class:`StorageError` (a ``ValueError``: the CLI exits with code 2).
See docs/object-storage.md.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid

import zarr

#: top-level modules whose exceptions mean "the remote store could not be reached or refused us"
_REMOTE_ERROR_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs", "urllib3", "requests")


class StorageError(ValueError):
    """An object store cannot be reached or refuses access (endpoint, credentials, permissions).

    The message names the URL, the underlying error and where the endpoint and credentials come from."""


def access_error(url: str, e: BaseException) -> StorageError | None:
    """``e`` as a :class:`StorageError`, or None when it is not an access problem (e.g. a missing key)."""
    if isinstance(e, (FileNotFoundError, StorageError)) or not isinstance(e, Exception):
        return None
    remote = type(e).__module__.split(".")[0] in _REMOTE_ERROR_MODULES
    if not (remote or isinstance(e, (PermissionError, ConnectionError, TimeoutError))):
        return None
    hint = ("check the endpoint (--storage-option endpoint_url=http://HOST:PORT or AWS_ENDPOINT_URL) and the"
            " credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or --storage-option key=..."
            " --storage-option secret=...)") if str(url).startswith(("s3://", "s3a://")) else (
            "check the URL, the --storage-option values and the credentials")
    return StorageError(f"{url}: cannot access the object store ({type(e).__name__}: {e}); {hint}")


def transient(e: BaseException) -> bool:
    """Whether ``e`` is worth retrying: a connection or timeout error, or an error of a remote store's client
    library; not a missing key, a refused permission or bad data (those fail the same way every time)."""
    if isinstance(e, (FileNotFoundError, PermissionError, StorageError)) or not isinstance(e, Exception):
        return False
    return isinstance(e, (ConnectionError, TimeoutError)) or type(e).__module__.split(".")[0] in _REMOTE_ERROR_MODULES


def with_retries(fn, *args, attempts: int = 3, delay: float = 1.0, **kwargs):
    """``fn(*args, **kwargs)``, retried up to ``attempts`` times in all when it raises a :func:`transient` error
    (waiting ``delay``, then twice as long, ...). Dask tasks call their work through this and are submitted
    without Dask retries, so bad data fails once, with one log line, while a flaky store is retried."""
    for k in range(max(1, int(attempts))):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if k + 1 >= attempts or not transient(e):
                raise
            time.sleep(delay * 2**k)


@contextlib.contextmanager
def _remote_access(url: str):
    """Turn connection / credential / permission errors of a URL operation into :class:`StorageError`."""
    try:
        yield
    except Exception as e:
        err = access_error(url, e)
        if err is None:
            raise
        raise err from e


def is_url(path: str) -> bool:
    """True for fsspec URLs such as ``s3://bucket/x.zarr`` (anything with a protocol but ``file``)."""
    return "://" in str(path) and not str(path).startswith("file://")


def local_path(path) -> str:
    """``file:///x/y`` -> ``/x/y``; other paths and URLs unchanged."""
    p = str(path)
    return p[len("file://"):] if p.startswith("file://") else p


def join(base: str, name: str) -> str:
    """Join a store path or URL and a child name."""
    return f"{str(base).rstrip('/')}/{name}"


def fs_for(url: str, storage_options: dict | None = None):
    """The fsspec filesystem and path for ``url`` (local paths use the local filesystem)."""
    import fsspec

    return fsspec.core.url_to_fs(str(url), **(storage_options or {}))


def exists(url: str, storage_options: dict | None = None) -> bool:
    """True when something (file, directory or prefix) exists at ``url``; :class:`StorageError` when a URL's
    store cannot be reached or refuses the credentials (never a silent False)."""
    if not is_url(url):
        return os.path.exists(local_path(url))
    with _remote_access(url):
        fs, p = fs_for(url, storage_options)
        return fs.exists(p)


def remove(url: str, storage_options: dict | None = None) -> None:
    """Delete ``url`` recursively if it exists (:class:`StorageError` as :func:`exists`)."""
    if not is_url(url):
        url = local_path(url)
        if os.path.isdir(url):
            shutil.rmtree(url)
        elif os.path.exists(url):
            os.remove(url)
        return
    with _remote_access(url):
        fs, p = fs_for(url, storage_options)
        if fs.exists(p):
            fs.rm(p, recursive=True)


def open_group(url: str, mode: str = "r", storage_options: dict | None = None) -> zarr.Group:
    """Open a Zarr v3 group; ``mode='r'`` never writes to the store. URLs go through zarr's fsspec store
    with ``storage_options``. Raises :class:`StorageError` when the store cannot be reached."""
    if not is_url(url):
        return zarr.open_group(local_path(url), mode=mode, zarr_format=3 if mode in ("w", "w-") else None)
    with _remote_access(url):
        return zarr.open_group(str(url), mode=mode, zarr_format=3 if mode in ("w", "w-") else None,
                               storage_options=storage_options or {})


@contextlib.contextmanager
def atomic_output(url: str, overwrite: bool = False, storage_options: dict | None = None):
    """Yield a temporary location next to ``url`` that becomes ``url`` only if the block succeeds.

    A failure leaves nothing behind: neither a half-written store nor the temporary. An existing ``url`` is
    refused (``FileExistsError``) unless ``overwrite``; locally it is replaced only after the new output is
    complete. Object stores cannot rename: there ``overwrite`` deletes the old output first, and the new one
    is written in place and removed on failure.
    """
    url = local_path(url).rstrip("/")
    if exists(url, storage_options) and not overwrite:
        raise FileExistsError(f"output {url!r} already exists (pass --overwrite to replace it)")
    if is_url(url):
        remove(url, storage_options)
        try:
            yield url
        except BaseException:
            remove(url, storage_options)
            raise
        return
    parent = os.path.dirname(os.path.abspath(url))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(url)}.partial-{uuid.uuid4().hex[:8]}")
    aside = f"{tmp}.old"
    try:
        yield tmp
        if os.path.exists(url):  # move the old output aside first: a crash now loses neither copy
            os.replace(url, aside)
        os.replace(tmp, url)
    finally:
        remove(tmp)
        remove(aside)
