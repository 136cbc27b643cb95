"""What a reader will decompress, bounded before it reads.

A store is small on disk and may say anything in its metadata: a chunk of zeros compresses about 10,000 times
with zstd, so a store of a few hundred KB can make a reader allocate gigabytes before any check on what it read.
Two defences, both before a chunk is decoded:

- **Metadata** (:func:`check_array`): the array's data type and shape are the ones the store's attributes imply
  (the reader passes them), each chunk (shard, inner chunk) holds no more bytes than the array itself, and every
  codec that expands bytes is one whose output is bounded here; :func:`check_ratio` refuses a small store whose
  arrays declare far more than their chunks could hold.
- **Codecs** (:func:`install`, done when :mod:`scaleattn.store._location` is imported, so in every process that
  opens a store through scaleattn): zarr's ``zstd``, ``blosc`` and ``gzip`` decoders are replaced by subclasses
  that refuse a chunk whose decompressed size (from the zstd frame header or the blosc header; counted as it is
  inflated for gzip) exceeds what the chunk's shape and data type hold, before allocating it. Encoding is zarr's.

Zarr v2 arrays (``.zarray``, datasets written by other tools) decode with numcodecs, which gives the decoder no
chunk size: their compressor must declare its size in a header (zstd, blosc), which :func:`check_v2_chunks`
reads (a few bytes per chunk) before the chunk is read.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from ..errors import FormatError, IntegrityError

__all__ = ["install", "check_array", "check_ratio", "check_v2_chunks", "chunk_bound", "zstd_content_size", "RATIO",
           "RATIO_FLOOR", "CHUNK_FLOOR", "DecompressionBoundError"]

#: a small store whose arrays declare more than ``RATIO`` times the bytes its chunks hold (and more than
#: :data:`RATIO_FLOOR`) is refused: float64 statistics, models and spectra compress by a few percent, a crafted
#: chunk of zeros by 10,000 times
RATIO = 1024
RATIO_FLOOR = 32 << 20
#: a chunk may be larger than its array (a writer's fixed chunk size over a short array: scaleattn's writer aims
#: at 4 MB chunks whatever the number of samples) up to this many bytes
CHUNK_FLOOR = 16 << 20
#: the bytes-to-bytes codecs whose output :func:`install` bounds (and crc32c, which only removes 4 bytes)
BOUNDED = {"zstd", "blosc", "gzip", "crc32c"}
#: zarr v2 compressors accepted: their frames declare their size, which :func:`check_v2_chunks` reads first
V2_COMPRESSORS = {None, "zstd", "blosc"}


class DecompressionBoundError(FormatError):
    """A chunk would decompress to more bytes than its shape and data type hold (a crafted or damaged store)."""


def chunk_bound(chunk_spec) -> int | None:
    """The most bytes a bytes-to-bytes codec of a chunk of ``chunk_spec`` may produce: the chunk's bytes, with
    the slack of a compressor stacked under another (zstd's worst case is n + n/128 + 512), or None for data
    types of variable size."""
    try:
        item = int(chunk_spec.dtype.to_native_dtype().itemsize)
    except Exception:
        return None
    if item <= 0 or chunk_spec.dtype.to_native_dtype().kind == "O":
        return None
    n = math.prod(int(s) for s in chunk_spec.shape) * item
    return n + n // 64 + 4096


def zstd_content_size(data: bytes) -> int | None:
    """The decompressed size a zstd frame declares in its header (RFC 8878 section 3.1.1.1), or None when the
    data do not start with a zstd frame or the frame does not declare it."""
    b = bytes(data[:18])
    if len(b) < 6 or int.from_bytes(b[:4], "little") != 0xFD2FB528:
        return None
    fhd = b[4]
    fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[did_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(b) < pos + size:
        return None
    value = int.from_bytes(b[pos : pos + size], "little")
    return value + 256 if size == 2 else value


def _refuse(codec: str, have, bound: int, why: str = "") -> None:
    raise DecompressionBoundError(f"a {codec} chunk {why or f'would decompress to {have:,} bytes'}, more than the"
                                  f" {bound:,} its shape and data type hold: the store is crafted or damaged")


def _zstd_classes():
    from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec
    from zarr.core.buffer.cpu import as_numpy_array_wrapper

    class BoundedZstdCodec(ZstdCodec):
        """zarr's zstd codec, refusing a frame that declares no size or more than its chunk holds
        (numcodecs then allocates exactly the declared size, and zstd stops there)."""

        def _decode_sync(self, chunk_bytes, chunk_spec):
            bound = chunk_bound(chunk_spec)
            if bound is not None:
                raw = chunk_bytes.as_numpy_array()[:18].tobytes()
                size = zstd_content_size(raw)
                if size is None:
                    _refuse("zstd", None, bound, "has no frame header declaring its size (it could decompress to"
                                                 " any size)")
                if size > bound:
                    _refuse("zstd", size, bound)
            return super()._decode_sync(chunk_bytes, chunk_spec)

    class BoundedBloscCodec(BloscCodec):
        """zarr's blosc codec, refusing a header that declares more bytes than the chunk holds (numcodecs
        allocates what the header says)."""

        def _decode_sync(self, chunk_bytes, chunk_spec):
            bound = chunk_bound(chunk_spec)
            if bound is not None:
                raw = chunk_bytes.as_numpy_array()[:16].tobytes()
                if len(raw) < 16:
                    _refuse("blosc", None, bound, "is shorter than its 16-byte header")
                nbytes, block = int.from_bytes(raw[4:8], "little"), int.from_bytes(raw[8:12], "little")
                if nbytes > bound or block > max(nbytes, 1 << 16):
                    _refuse("blosc", nbytes, bound)
            return super()._decode_sync(chunk_bytes, chunk_spec)

    class BoundedGzipCodec(GzipCodec):
        """zarr's gzip codec, inflating at most the chunk's bytes plus one (gzip does not record its size
        reliably: it is counted as it is inflated)."""

        def _decode_sync(self, chunk_bytes, chunk_spec):
            bound = chunk_bound(chunk_spec)
            if bound is None:
                return super()._decode_sync(chunk_bytes, chunk_spec)
            return as_numpy_array_wrapper(lambda buf: _gunzip(bytes(buf), bound), chunk_bytes, chunk_spec.prototype)

    return BoundedZstdCodec, BoundedBloscCodec, BoundedGzipCodec


def _gunzip(data: bytes, bound: int) -> bytes:
    """Every gzip (or zlib) member of ``data`` inflated, refusing more than ``bound`` bytes in all."""
    out, rest = [], data
    total = 0
    while rest:
        d = zlib.decompressobj(47)  # (32 + 15: a gzip or zlib header, detected)
        piece = d.decompress(rest, bound + 1 - total)
        total += len(piece)
        if total > bound or d.unconsumed_tail:
            _refuse("gzip", total, bound, f"inflates past {bound:,} bytes")
        if not d.eof:
            raise FormatError("a gzip chunk is truncated: the store is damaged")
        out.append(piece)
        rest = d.unused_data
    return b"".join(out)


_INSTALLED = []


def install() -> None:
    """Make zarr decode ``zstd``, ``blosc`` and ``gzip`` chunks with the bounded codecs of this module (for
    every array opened afterwards in this process; encoding is unchanged). Idempotent and cheap: called before
    every open (:func:`scaleattn.store._location.open_group`), so that a zarr configuration reset since is
    undone."""
    import zarr

    if not _INSTALLED:
        from zarr.registry import register_codec

        classes = _zstd_classes()
        for name, cls in zip(("zstd", "blosc", "gzip"), classes):
            cls.__module__ = __name__
            cls.__qualname__ = cls.__name__
            globals()[cls.__name__] = cls  # (zarr's config names the class by its qualified name)
            register_codec(name, cls)
        _INSTALLED.append(classes)
    want = {f"codecs.{name}": f"{__name__}.{cls.__name__}"
            for name, cls in zip(("zstd", "blosc", "gzip"), _INSTALLED[0])}
    if any(zarr.config.get(k) != v for k, v in want.items()):
        zarr.config.set(want)


def _codec_names(codecs) -> list[tuple[str, object]]:
    """``(name, codec)`` of every codec of a v3 chain, the inner chains of a sharding codec included."""
    out = []
    for c in codecs:
        try:
            name = c.to_dict().get("name", type(c).__name__)
        except Exception:
            name = type(c).__name__
        out.append((name, c))
        if name == "sharding_indexed":
            out += _codec_names(getattr(c, "codecs", ())) + _codec_names(getattr(c, "index_codecs", ()))
    return out


def _chunk_shapes(arr) -> list[tuple[int, ...]]:
    """Every chunk shape a read of ``arr`` decodes: its chunks, and its shards when sharded."""
    meta = arr.metadata
    shapes = []
    for attr in ("chunks", "shards"):
        try:
            s = getattr(arr, attr)
        except Exception:
            s = None
        if s is not None:
            shapes.append(tuple(int(n) for n in s))
    grid = getattr(meta, "chunk_grid", None)
    if grid is not None and getattr(grid, "chunk_shape", None) is not None:
        shapes.append(tuple(int(n) for n in grid.chunk_shape))
    return shapes


def check_array(arr, name: str, where: str, *, shape=None, dtype=None, codecs=None) -> None:
    """Check array ``name`` of the store at ``where`` from its metadata alone, before any chunk is read.

    Parameters
    ----------
    arr : zarr.Array
        The array (opened: its metadata read).
    name, where : str
        For the messages: the array and the store.
    shape : tuple of int, optional
        The shape the store's attributes imply (a reader's expectation: ``(psi, d_out)`` from ``d``, ...).
    dtype : numpy dtype, optional
        The data type the reader expects (float64 for what scaleattn writes).
    codecs : collection of str, optional
        The names of the codecs allowed (those scaleattn writes, for its own stores); by default any codec
        whose output is bounded (:data:`BOUNDED`, and array-to-array and array-to-bytes codecs).

    Raises
    ------
    IntegrityError
        The shape differs from ``shape``.
    FormatError
        The data type differs from ``dtype``; a chunk (shard) holds more bytes than the array (and more than
        :data:`CHUNK_FLOOR`); a codec whose output cannot be bounded, or not in ``codecs``.

    Examples
    --------
    >>> import zarr, numpy as np
    >>> a = zarr.create_array(zarr.storage.MemoryStore(), shape=(4,), chunks=(1 << 30,), dtype="f8")
    >>> check_array(a, "x", "memory")
    Traceback (most recent call last):
    ...
    scaleattn.store._bounds.DecompressionBoundError: x in memory: chunks of shape (1073741824,) hold ...
    """
    declared = tuple(int(n) for n in arr.shape)
    if shape is not None and declared != tuple(int(n) for n in shape):
        raise IntegrityError(f"{name} in {where}: shape {declared} in its metadata (zarr.json), but the store's"
                             f" attributes mean {tuple(shape)}: the store was edited")
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise FormatError(f"{name} in {where}: data type {arr.dtype} in its metadata (zarr.json), scaleattn writes"
                          f" {np.dtype(dtype)}: the metadata was edited")
    item = max(1, int(np.dtype(arr.dtype).itemsize)) if np.dtype(arr.dtype).kind != "O" else 1
    whole = math.prod(max(1, n) for n in declared) * item
    for cs in _chunk_shapes(arr):
        if any(n < 1 for n in cs):  # (zarr divides by them: a ZeroDivisionError at the first read or listing)
            raise FormatError(f"{name} in {where}: chunks of shape {cs} in its metadata: every dimension of a"
                              " chunk must be >= 1 (a crafted or damaged zarr.json / .zarray)")
        held = math.prod(cs) * item
        if held > max(whole, CHUNK_FLOOR):
            raise DecompressionBoundError(
                f"{name} in {where}: chunks of shape {cs} hold {held:,} bytes, more than the array's {whole:,}"
                f" (shape {declared}): a crafted or damaged zarr.json")
    meta = arr.metadata
    if getattr(meta, "zarr_format", 3) == 2:
        if codecs is not None:
            raise FormatError(f"{name} in {where}: a zarr v2 array where scaleattn writes zarr v3: the store was"
                              " replaced or edited")
        cid = _v2_compressor(arr)
        filters = [getattr(f, "codec_id", type(f).__name__) for f in (getattr(meta, "filters", None) or ())]
        if cid not in V2_COMPRESSORS or filters:
            what = f"filters {filters}" if filters else f"compressor {cid!r}"
            raise FormatError(f"{name} in {where}: zarr v2 {what} not read by scaleattn (of zarr v2 it reads zstd,"
                              " blosc or no compressor, without filters, whose output is bounded): rewrite the store"
                              " as zarr v3")
        return
    from zarr.abc.codec import BytesBytesCodec

    for cname, c in _codec_names(getattr(meta, "codecs", ())):
        if codecs is not None and cname not in codecs:
            raise FormatError(f"{name} in {where}: codec {cname!r} in its metadata (zarr.json), scaleattn writes"
                              f" {sorted(codecs)}: the metadata was edited")
        if isinstance(c, BytesBytesCodec) and not (cname == "crc32c" or isinstance(c, _bounded_classes())):
            raise FormatError(f"{name} in {where}: codec {cname!r} decompresses without a bound scaleattn can check"
                              " before reading (it reads zstd, blosc, gzip and crc32c): rewrite the store with one"
                              " of those")


def _v2_compressor(arr) -> str | None:
    comp = getattr(arr.metadata, "compressor", None)
    return None if comp is None else getattr(comp, "codec_id", type(comp).__name__)


def check_v2_chunks(loc, arr, name: str, keys) -> None:
    """For a zarr v2 array (whose numcodecs decoder is given no chunk size, so :func:`install` cannot bound it):
    read the first bytes of each stored object among ``keys`` (relative to array ``name`` of the group at
    ``loc``) and refuse one whose zstd or blosc header declares more than a chunk holds. Absent keys are
    skipped. A no-op for zarr v3 arrays and uncompressed ones.

    Raises
    ------
    DecompressionBoundError
        Naming the array, the key and the sizes."""
    if getattr(arr.metadata, "zarr_format", 3) != 2:
        return
    cid = _v2_compressor(arr)
    if cid is None:
        return
    item = int(np.dtype(arr.dtype).itemsize)
    bound = math.prod(int(n) for n in arr.chunks) * item
    for key in keys:
        head = _head(loc, f"{name}/{key}")
        if head is None:
            continue
        size = zstd_content_size(head) if cid == "zstd" else (int.from_bytes(head[4:8], "little")
                                                               if len(head) >= 16 else None)
        if size is None or size > bound:
            raise DecompressionBoundError(
                f"{name} in {loc.url}: the {cid} chunk {key!r} "
                + ("declares no size" if size is None else f"would decompress to {size:,} bytes")
                + f", more than the {bound:,} its shape and data type hold: the store is crafted or damaged")


def _head(loc, key: str, n: int = 18) -> bytes | None:
    """The first ``n`` bytes of object ``key`` of the store at ``loc`` (None when absent)."""
    import os

    try:
        if not loc.is_remote:
            with open(os.path.join(loc.url, key), "rb") as f:
                return f.read(n)
        fs, p = loc.fs()
        return fs.cat_file(f"{p.rstrip('/')}/{key}", start=0, end=n)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _bounded_classes() -> tuple:
    install()
    return _INSTALLED[0]


def check_ratio(where: str, declared: int, stored: int | None) -> None:
    """Refuse a small store whose arrays declare ``declared`` bytes held in ``stored`` bytes of chunks, when that
    is more than :data:`RATIO` times as many (and more than :data:`RATIO_FLOOR`): what scaleattn writes there
    (float64 values of statistics, models, spectra) never compresses so far; a crafted chunk of zeros does.
    ``stored`` None (a listing without sizes): no check."""
    if stored is None or declared <= RATIO_FLOOR or declared <= RATIO * stored:
        return
    raise DecompressionBoundError(
        f"{where}: its arrays declare {declared:,} bytes but its chunks hold {stored:,} bytes"
        f" ({declared / max(stored, 1):,.0f} times as many; what scaleattn writes compresses by a few percent):"
        " a crafted or damaged store, refused before decompressing it")
