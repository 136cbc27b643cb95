"""Where stores live: local paths or fsspec URLs (``s3://...``), opened through zarr; atomic outputs."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid

import zarr


def is_url(path: str) -> bool:
    """True for fsspec URLs such as ``s3://bucket/x.zarr`` (anything with a protocol but ``file``)."""
    return "://" in str(path) and not str(path).startswith("file://")


def join(base: str, name: str) -> str:
    """Join a store path or URL and a child name."""
    return f"{str(base).rstrip('/')}/{name}"


def fs_for(url: str, storage_options: dict | None = None):
    """The fsspec filesystem and path for ``url`` (local paths use the local filesystem)."""
    import fsspec

    return fsspec.core.url_to_fs(str(url), **(storage_options or {}))


def exists(url: str, storage_options: dict | None = None) -> bool:
    """True when something (file, directory or prefix) exists at ``url``."""
    if not is_url(url):
        return os.path.exists(url)
    fs, p = fs_for(url, storage_options)
    return fs.exists(p)


def remove(url: str, storage_options: dict | None = None) -> None:
    """Delete ``url`` recursively if it exists."""
    if not is_url(url):
        if os.path.isdir(url):
            shutil.rmtree(url)
        elif os.path.exists(url):
            os.remove(url)
        return
    fs, p = fs_for(url, storage_options)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def open_group(url: str, mode: str = "r", storage_options: dict | None = None) -> zarr.Group:
    """Open a Zarr v3 group; ``mode='r'`` never writes to the store."""
    kwargs = {"storage_options": storage_options} if (is_url(url) and storage_options) else {}
    return zarr.open_group(str(url), mode=mode, zarr_format=3 if mode in ("w", "w-") else None, **kwargs)


@contextlib.contextmanager
def atomic_output(url: str, overwrite: bool = False, storage_options: dict | None = None):
    """Yield a temporary location next to ``url`` that becomes ``url`` only if the block succeeds.

    A failure leaves nothing behind: neither a half-written store nor the temporary. An existing ``url`` is
    refused (``FileExistsError``) unless ``overwrite``; it is replaced only after the new output is complete.
    On object stores (no rename) the output is written in place and removed on failure.
    """
    url = str(url).rstrip("/")
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
    try:
        yield tmp
        if os.path.exists(url):
            remove(url)
        os.replace(tmp, url)
    finally:
        remove(tmp)
