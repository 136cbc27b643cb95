"""What is stored is what was written (layer L0): the checksumming codec of every array scaleattn writes,
value checksums and the manifests built from them, and listings of the chunks a store really holds.

Zarr returns the fill value for a chunk it cannot find, so a deleted chunk or an array shape enlarged in
``zarr.json`` reads as zeros without an error. Three defences, from the cheapest:

- **Chunk listings** (:func:`list_chunks`, :func:`absent_chunks`): the storage keys an array should have
  (its chunk grid, or shard grid when sharded) against the keys the store lists. Used for every store,
  including those written by other tools (where absent chunks are refused unless the user says they mean
  the fill value).
- **Manifests** (:func:`manifest_entry`, :func:`verify_rows`): stores scaleattn writes record, in their
  attributes, the shape of each array and a crc32c of its values per chunk of rows; every read of whole
  chunks is checked against it, so a missing, stale or edited chunk fails with the array and sample range.
- **The crc32c codec** (:func:`compressors`, zarr v3's own ``crc32c``): a flipped bit fails the read.

The listing also gives each stored object a cheap *signature* (size and modification time, or the object
store's ETag), which binds checkpointed partials to the chunks they came from (:func:`signature_digest`), and
binds every read of a store without manifest to the objects the client listed when it opened the store
(:func:`object_signatures` of the objects just read, :func:`scaleattn.data._checks.check_objects`).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os

import numpy as np

from ..errors import FormatError, IntegrityError, StorageError
from . import _bounds, _formats

__all__ = ["compressors", "writable", "crc32c", "manifest_entry", "verify_rows", "verify_whole", "list_chunks",
           "object_signatures", "informative", "block_keys", "expected_keys", "absent_chunks", "storage_grid",
           "signature_digest", "digest64", "manifest_digest", "checksum_failure", "create_checked", "read_checked",
           "read_store", "store_attrs", "stored_bytes", "well_formed", "small_manifest", "bound_attrs", "MANIFEST"]

#: a chunk grid larger than this, and than 4 times the objects stored, is refused before it is enumerated
GRID_FLOOR = 1 << 20
#: the group attribute holding a store's manifest
MANIFEST = "manifest"


def compressors():
    """Bytes-to-bytes codecs of every array scaleattn writes: zarr's default zstd, then crc32c (so that any
    changed bit of a stored chunk fails its read)."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return (ZstdCodec(level=0, checksum=False), Crc32cCodec())


def writable(array):
    """``array`` with ``write_empty_chunks`` on: every chunk is stored, even one equal to the fill value, so
    that an absent key always means a missing chunk."""
    return array.with_config({"write_empty_chunks": True})


def crc32c(values) -> str:
    """crc32c (zarr's ``google_crc32c``) of an array's values as little-endian bytes, 8 hex digits."""
    import google_crc32c

    a = np.ascontiguousarray(values)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False).reshape(-1)
    h = google_crc32c.Checksum()  # streamed in 16 MB pieces: a whole-array tobytes() would copy Tc once more
    step = max(1, (16 << 20) // max(a.itemsize, 1))
    for i in range(0, a.size, step):
        h.update(a[i : i + step].tobytes())
    return h.hexdigest().decode()


def manifest_entry(shape, rows: int, checksums) -> dict:
    """The manifest entry of one array: its ``shape``, ``rows`` per checksum along axis 0 and the crc32c of
    each block of rows, concatenated (8 hex digits each)."""
    return {"shape": [int(n) for n in shape], "rows": int(rows), "crc32c": "".join(checksums)}


def manifest_digest(manifest) -> str:
    """A short digest of a whole manifest (part of a dataset's fingerprint)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def verify_rows(entry: dict, name: str, values, start: int, where: str, *, missing=None) -> None:
    """Check the rows ``[start, start + len(values))`` of array ``name`` against its manifest ``entry``: every
    block of rows the slice covers whole is compared with its recorded crc32c (partial blocks at the ends are
    skipped). ``missing(block_index)`` says whether the block's chunk is absent from the store (for the message).

    Raises
    ------
    IntegrityError
        ``"{name}: samples [a, b) of {where} ..."``: a block whose values are not the ones written.
    """
    rows, sums = int(entry["rows"]), entry["crc32c"]
    n_total = int(entry["shape"][0])
    stop = start + len(values)
    first = -(-start // rows)
    for k in range(first, math.ceil(n_total / rows)):
        a, b = k * rows, min(n_total, (k + 1) * rows)
        if b > stop:
            break
        if crc32c(values[a - start : b - start]) != sums[8 * k : 8 * k + 8]:
            gone = missing is not None and missing(k)
            why = ("its chunk is missing from the store (zarr would have read the fill value)" if gone else
                   "the values do not match the checksum recorded when it was written (changed or damaged since)")
            raise IntegrityError(f"{name}: samples [{a}, {b}) of {where}: {why}")


def verify_whole(entry: dict, name: str, values, where: str) -> None:
    """:func:`verify_rows` for a whole small array (statistics, models, spectra, teachers)."""
    if [int(n) for n in np.shape(values)] != entry["shape"]:
        raise IntegrityError(f"{name}: shape {list(np.shape(values))} in {where} differs from the shape"
                             f" {entry['shape']} recorded when it was written")
    if crc32c(values) != entry["crc32c"]:
        raise IntegrityError(f"{name} in {where}: the values do not match the checksum recorded when it was"
                             " written (a chunk is missing, changed or damaged)")


def checksum_failure(e: BaseException) -> bool:
    """Whether ``e`` is zarr's crc32c codec refusing a damaged chunk."""
    return "checksum" in str(e).lower() and isinstance(e, ValueError)


def storage_grid(array) -> tuple[int, ...]:
    """Shape of the objects an array is stored in: its shards when sharded, else its chunks (zarr v2 or v3)."""
    meta = array.metadata
    grid = getattr(meta, "chunk_grid", None)
    shape = getattr(grid, "chunk_shape", None) if grid is not None else getattr(meta, "chunks", None)
    return tuple(int(n) for n in shape)


def expected_keys(array) -> dict[str, tuple[int, ...]]:
    """Storage key (relative to the array) -> grid coordinates, of every object the array's shape implies."""
    grid = storage_grid(array)
    counts = [math.ceil(int(n) / g) for n, g in zip(array.shape, grid)]
    enc = array.metadata.encode_chunk_key
    return {enc(c): c for c in itertools.product(*(range(n) for n in counts))}


def list_chunks(loc, name: str) -> dict[str, str]:
    """Storage key (relative to array ``name`` of the group at ``loc``) -> signature (size and modification
    time, or the object store's ETag) of every object stored under the array, metadata documents excluded.
    Local symbolic links are followed (the signature is the target's), once each: a folder reached twice raises
    :class:`~scaleattn.errors.IntegrityError`."""
    meta = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}
    out = {}
    if not loc.is_remote:
        root = os.path.join(loc.url, name)
        seen = set()
        # symbolic links to directories are followed, as zarr's reads follow them (a chunk folder on another disk)
        for dirpath, _, files in os.walk(root, followlinks=True):
            real = os.path.realpath(dirpath)
            if real in seen:
                raise IntegrityError(f"{name}: the folder {os.path.relpath(dirpath, root)!r} of {loc.url} is reached"
                                     f" twice through symbolic links ({real}): a link loop, or two keys sharing"
                                     " their chunks; copy the store without them")
            seen.add(real)
            for f in files:
                p = os.path.join(dirpath, f)
                rel = os.path.relpath(p, root).replace(os.sep, "/")
                if rel in meta:
                    continue
                try:
                    out[rel] = _local_signature(os.stat(p))
                except FileNotFoundError:  # removed while listing
                    continue
        return out
    fs, p = loc.fs()
    base = f"{p.rstrip('/')}/{name}"
    try:
        found = fs.find(base, detail=True)
    except FileNotFoundError:
        return out
    for path, info in found.items():
        rel = path[len(base):].lstrip("/")
        if rel in meta or info.get("type") == "directory":
            continue
        out[rel] = _remote_signature(info)
    return out


def _local_signature(st: os.stat_result) -> str:
    return f"{st.st_size}:{st.st_mtime_ns}"


def _remote_signature(info: dict) -> str:
    tag = next((str(info[k]) for k in ("ETag", "etag", "md5Hash", "crc32c", "mtime", "LastModified",
                                      "last_modified", "Last-Modified", "created") if info.get(k) is not None), "")
    return f"{info.get('size', '')}:{tag}"


def informative(signature: str) -> bool:
    """Whether a listed signature identifies its object (an HTTP listing has neither size nor tag)."""
    size, _, tag = signature.partition(":")
    return size not in ("", "None") or bool(tag)


def block_keys(array, k: int) -> list[str]:
    """Storage keys (relative to the array) of the objects holding block ``k`` along axis 0 of its storage grid
    (:func:`storage_grid`: one object per block for arrays chunked along the samples only)."""
    grid = storage_grid(array)
    counts = [math.ceil(int(n) / g) for n, g in zip(array.shape[1:], grid[1:])]
    enc = array.metadata.encode_chunk_key
    return [enc((k, *c)) for c in itertools.product(*(range(n) for n in counts))]


def object_signatures(loc, name: str, keys) -> dict[str, str]:
    """The :func:`list_chunks` signature of each of ``keys`` (relative to array ``name`` of the group at
    ``loc``) that is stored, found one object at a time (a stat, or the object store's HEAD) rather than by a
    listing of the whole array: what a reader checks for the few objects it has just read."""
    out = {}
    if not loc.is_remote:
        for key in keys:
            try:
                out[key] = _local_signature(os.stat(os.path.join(loc.url, name, key)))
            except (FileNotFoundError, NotADirectoryError):
                pass
        return out
    fs, p = loc.fs()
    for key in keys:
        path = f"{p.rstrip('/')}/{name}/{key}"
        fs.invalidate_cache(path)  # ask the store: a listing cached at open (s3fs, gcsfs) would answer otherwise
        try:
            out[key] = _remote_signature(fs.info(path))
        except FileNotFoundError:
            pass
    return out


def absent_chunks(array, listed: dict[str, str], where: str = "") -> tuple[list[tuple[int, int]], list[str]]:
    """``(sample ranges, stray keys)``: the ranges ``[a, b)`` along axis 0 whose objects are absent from
    ``listed`` (merged where adjacent), and keys beyond the shape (a shape edited down in ``zarr.json``)."""
    grid = storage_grid(array)
    count = math.prod(math.ceil(int(n) / g) for n, g in zip(array.shape, grid))
    if count > max(4 * len(listed), GRID_FLOOR):  # (the grid is not enumerated: a shape of 10^12 rows would be)
        raise IntegrityError(f"{where or array.path}: shape {tuple(array.shape)} in chunks of {grid} implies"
                             f" {count:,} chunks, the store holds {len(listed):,}: its metadata (zarr.json) was"
                             " edited or the store is a crafted one")
    want = expected_keys(array)
    rows = grid[0]
    n = int(array.shape[0])
    gone = sorted({c[0] for k, c in want.items() if k not in listed})
    ranges = []
    for k in gone:
        a, b = k * rows, min(n, (k + 1) * rows)
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    stray = sorted(k for k in listed if k not in want and _is_chunk_key(k))
    return ranges, stray


def _is_chunk_key(key: str) -> bool:
    """A v3 ``c/...`` key or a v2 ``0.1.2`` key (other files under an array are not chunks)."""
    parts = key.split("/")
    if parts[0] == "c":
        return all(p.isdigit() for p in parts[1:])
    return all(p.isdigit() for p in key.replace("/", ".").split("."))


def signature_digest(*parts) -> int:
    """A 63-bit digest of the given texts (never 0, the fill value of 'no binding')."""
    return digest64("\x00".join(map(str, parts)).encode())


def digest64(data: bytes) -> int:
    """63-bit blake2b of ``data`` as an int (fits int64 and uint64; 0 is reserved for 'none')."""
    v = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)
    return v or 1


def create_checked(group, name: str, data, sums: dict, **kwargs):
    """``group.create_array(name, data=data, ...)`` with the crc32c codec; the array's manifest entry (one
    checksum for the whole array) goes into ``sums[name]``. For the small stores: statistics, models, spectra."""
    data = np.asarray(data)
    arr = group.create_array(name, data=data, compressors=compressors(), config={"write_empty_chunks": True},
                             **kwargs)  # (an all-zero array is stored too: from v3 an absent chunk is refused)
    sums[name] = manifest_entry(data.shape, max(1, data.shape[0]) if data.ndim else 1, [crc32c(data)])
    return arr


def well_formed(manifest) -> bool:
    """Whether ``manifest`` has the layout scaleattn writes: ``{"arrays": {name: entry}}`` with each entry's
    ``shape``, ``rows`` and ``crc32c`` of the right types (and, optionally, ``attrs``: a dict)."""
    return (isinstance(manifest, dict) and isinstance(manifest.get("arrays"), dict)
            and isinstance(manifest.get("attrs", {}), dict) and all(
                isinstance(e, dict) and isinstance(e.get("crc32c"), str) and isinstance(e.get("rows"), int)
                and isinstance(e.get("shape"), list) and e["rows"] > 0 and len(e["crc32c"]) % 8 == 0
                for e in manifest["arrays"].values()))


def small_manifest(sums: dict, attrs: dict) -> dict:
    """The manifest of a small store (v3): the arrays' entries ``sums`` and a copy of ``attrs``, the other
    attributes written with it (:func:`read_store` refuses any that differ)."""
    return {"arrays": sums, "attrs": bound_attrs(attrs)}


def bound_attrs(attrs: dict) -> dict:
    """The attributes a small store's manifest records (all but the manifest itself), for :func:`read_store`."""
    return {k: v for k, v in attrs.items() if k != MANIFEST}


def _same(a, b) -> bool:
    # as JSON: True is not 1, and a NaN equals the NaN written
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _array(group, name: str, where: str):
    """Array ``name`` of a small store, its metadata readable and its data type float64 (what scaleattn writes):
    an edited or damaged zarr.json is one :class:`FormatError` naming the array, not zarr's own error."""
    try:
        arr = group[name]
    except KeyError:
        raise IntegrityError(f"{where}: array {name!r} is missing") from None
    except (ValueError, TypeError, AttributeError) as e:  # a zarr.json that is not JSON, or not an array's metadata
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise FormatError(f"{name} in {where}: its metadata (zarr.json) cannot be read ({type(e).__name__}:"
                          f" {msg[:200]}): the store is damaged or was edited") from None
    if not hasattr(arr, "dtype"):
        raise FormatError(f"{name} in {where}: a group where scaleattn writes an array")
    if arr.dtype != np.float64:
        raise FormatError(f"{name} in {where}: data type {arr.dtype} in its metadata (zarr.json), scaleattn writes"
                          " float64: the metadata was edited")
    return arr


def read_checked(group, name: str, where: str):
    """The values of array ``name`` of a small store, checked against the store's manifest when it has one
    (stores of format v1 have none). Raises :class:`IntegrityError` naming the array and the store
    (:class:`FormatError` for metadata that cannot be read or is not float64)."""
    arr = _array(group, name, where)
    try:
        values = np.asarray(arr[...])
    except ValueError as e:
        if checksum_failure(e):
            raise IntegrityError(f"{name} in {where}: a stored chunk fails its crc32c checksum (damaged)") from None
        raise FormatError(f"{name} in {where}: its chunks cannot be decoded with its metadata (zarr.json):"
                          f" {str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}") from None
    manifest = group.attrs.get(MANIFEST)
    if manifest is not None:
        entry = (manifest.get("arrays") or {}).get(name) if isinstance(manifest, dict) else None
        if entry is None:
            raise IntegrityError(f"{where}: array {name!r} is not in the store's manifest (damaged attributes)")
        verify_whole(entry, name, values, where)
    return values


def _has_crc32c(arr) -> bool:
    return "crc32c" in json.dumps(arr.metadata.to_dict().get("codecs", []), default=str)


def open_store(loc, what: str):
    """The Zarr group of a small store scaleattn wrote (``what``: "model", ...), opened read-only with its
    attributes read. Raises :class:`FormatError` ``not a readable {what} store`` naming why."""
    try:
        g = loc.open_group("r")
        dict(g.attrs)
    except StorageError:  # (already one line naming the entry: a FIFO or a broken link in the store)
        raise
    except Exception as e:
        raise FormatError(f"{loc.url}: not a readable {what} store ({type(e).__name__}: {e})") from None
    return g


def read_store(loc, group, kind: tuple[str, int], what: str, names, shapes=None) -> tuple[dict, dict]:
    """Check a small store scaleattn wrote (statistics, model, spectrum) and read its arrays: ``(attributes,
    {name: values})``. Every check refuses rather than read something other than what was written, and every
    check that needs no chunk is done before any chunk is read (a crafted store of a few KB could otherwise make
    the read decompress gigabytes):

    - format and version (:func:`scaleattn.store._formats.check_format`);
    - from v2 on, the manifest is there and well formed; from v3 on it also records every attribute as written
      (an edited, added or removed attribute is refused; a v3 store whose version was edited down is refused
      by the attributes its manifest records, a v2 or later one edited to v1 by its crc32c codec);
    - each array's metadata is readable, float64, of the shape the attributes imply (``shapes``) and the
      manifest records, chunked no larger than itself, with the codecs scaleattn writes
      (:func:`scaleattn.store._bounds.check_array`), and the arrays declare no more than their stored chunks
      can hold (:func:`scaleattn.store._bounds.check_ratio`);
    - every chunk each array's shape implies is stored (zarr would read an absent one as zeros), none beyond it
      (in v2 stores, which left all-zero chunks out, the manifest's checksums decide);
    - each array's values are those the manifest records (each chunk decoded within its declared size:
      :func:`scaleattn.store._bounds.install`).

    Parameters
    ----------
    loc : Location
        The store (for the listing and the messages).
    group : zarr.Group
        The store, opened for reading.
    kind : (str, int)
        :data:`scaleattn.store._formats.MODEL`, ...; ``what``: its name in messages ("model", ...).
    names : iterable of str
        The arrays to read.
    shapes : callable, optional
        ``shapes(attributes, declared)`` -> ``{name: shape}``: the shape of each array its attributes imply
        (``declared``: each array's shape in its metadata, for the dimensions the attributes do not fix); it
        may raise the reader's own errors (an attribute of the wrong type).

    Raises
    ------
    FormatError
        Not a store of ``kind`` in a version read here; an array's metadata unreadable, not float64, chunked
        larger than the array or with other codecs.
    IntegrityError
        Naming the store and the array or attribute: a manifest missing, damaged or not matching, a shape the
        attributes or the manifest do not give, an absent chunk, values that are not the ones written.
    """
    where = loc.url
    attrs, version = store_attrs(group, kind, what, where)
    names = tuple(names)
    arrays = {name: _array(group, name, where) for name in names}
    declared = {name: tuple(int(n) for n in arr.shape) for name, arr in arrays.items()}
    want = shapes(attrs, declared) if shapes is not None else {}
    manifest = attrs.get(MANIFEST)
    listings, stored = {}, 0
    for name, arr in arrays.items():
        if manifest is not None:
            entry = manifest["arrays"].get(name)
            if entry is None:
                raise IntegrityError(f"{where}: array {name!r} is not in the store's manifest (damaged attributes)")
            if list(declared[name]) != entry["shape"]:
                raise IntegrityError(f"{name}: shape {list(declared[name])} in {where} differs from the shape"
                                     f" {entry['shape']} recorded when it was written")
        _bounds.check_array(arr, name, where, shape=want.get(name), codecs=SMALL_CODECS)
        listings[name] = listed = list_chunks(loc, name)
        held = stored_bytes(listed)
        stored = None if stored is None or held is None else stored + held
    _bounds.check_ratio(where, sum(8 * math.prod(s) for s in declared.values()), stored)
    values = {}
    for name, arr in arrays.items():
        if version < 2 and _has_crc32c(arr):
            raise IntegrityError(f"{name} in {where}: stored with the crc32c codec scaleattn writes since format v2,"
                                 f" but the attributes say v{version} and hold no manifest: they were edited")
        # (v2 wrote all-zero chunks of these stores as absent keys: there the manifest's checksum decides)
        ranges, stray = absent_chunks(arr, listings[name], f"{name} in {where}") if version != 2 else ([], [])
        if ranges or stray:
            which = (f"no chunk stored for rows [{ranges[0][0]}, {ranges[0][1]})" if ranges else
                     f"a stored chunk beyond its shape {tuple(arr.shape)} ({stray[0]!r})")
            raise IntegrityError(f"{name} in {where}: {which} (zarr would read missing rows as zeros): the store"
                                 " was damaged, partly copied or its metadata edited")
        values[name] = read_checked(group, name, where)
    return attrs, values


#: the codecs of the arrays of statistics, models and spectra (v1: bytes and zstd; from v2 crc32c too)
SMALL_CODECS = ("bytes", "zstd", "crc32c")


def stored_bytes(listed: dict[str, str]) -> int | None:
    """The bytes of the objects of a :func:`list_chunks` listing, from their signatures (None when the listing
    gave no sizes, as an HTTP listing may not)."""
    sizes = [sig.partition(":")[0] for sig in listed.values()]
    return None if not all(s.isdigit() for s in sizes) else sum(map(int, sizes))


def store_attrs(group, kind: tuple[str, int], what: str, where: str) -> tuple[dict, int]:
    """``(attributes, format version)`` of a small store, checked without reading its arrays: the attribute
    checks of :func:`read_store` (format, manifest, from v3 every attribute as written)."""
    attrs = dict(group.attrs)
    version = _formats.check_format(attrs, kind, where, what)
    m = attrs.get(MANIFEST)
    if version >= 2 and m is None:
        raise IntegrityError(f"{where}: a scaleattn v{version} {what} store without its manifest (its attributes"
                             " were edited)")
    if version < 2 and m is not None:
        raise IntegrityError(f"{where}: format_version {version} but a manifest, which scaleattn writes since v2:"
                             " the attributes were edited")
    if m is not None and not well_formed(m):
        raise IntegrityError(f"{where}: the attribute 'manifest' is damaged (not the manifest scaleattn wrote)")
    if version >= 3:
        _check_attrs(m, attrs, where)
    elif m is not None and "attrs" in m:
        raise IntegrityError(f"{where}: format_version {version} but its manifest records the attributes, which"
                             f" scaleattn writes since v3: the attributes were edited")
    return attrs, version


def _check_attrs(m: dict, attrs: dict, where: str) -> None:
    """The attributes are those the manifest recorded when the store was written (v3 stores)."""
    rec = m.get("attrs")
    if rec is None:
        raise IntegrityError(f"{where}: its manifest does not record the attributes (a v3 store always does):"
                             " the manifest was edited")
    now = bound_attrs(attrs)
    for k in sorted(set(rec) | set(now)):
        if k not in now:
            raise IntegrityError(f"{where}: attribute {k!r} was removed after the store was written (manifest)")
        if k not in rec:
            raise IntegrityError(f"{where}: attribute {k!r} was added after the store was written (manifest)")
        if not _same(rec[k], now[k]):
            shown = json.dumps(now[k], default=str)[:60]
            raise IntegrityError(f"{where}: attribute {k!r} is {shown}, not the value written (manifest): the"
                                 " attributes were edited")
