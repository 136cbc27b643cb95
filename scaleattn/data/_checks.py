"""Checks of a dataset (layer L1): shapes and dtypes of its arrays, their values (NaN/Inf, magnitudes whose
features or squares overflow or underflow float64, lengths), its attributes, and that the chunks it stores are
the ones that were written (absent chunks, manifests, the identity of the store a worker opened). Every error is one
:class:`~scaleattn.errors.DatasetError` (or :class:`~scaleattn.errors.IntegrityError`) naming the array and
the sample (range) and the store. :mod:`scaleattn.data._dataset` calls these; DESIGN §7.
"""
from __future__ import annotations

import hashlib
import json
import math
import socket
import sys

import array_api_compat
import numpy as np

from .._backend import get_xp
from ..errors import DatasetError, IntegrityError
from ..store import _bounds, _formats, _integrity

__all__ = ["check_arrays", "check_values", "check_lengths", "is_real", "check_attrs", "check_chunks", "content_id",
           "verify_identity", "here", "fingerprint", "chunk_absent", "read_arrays", "row_bindings", "object_digests",
           "check_objects", "expected_rows", "check_underflow", "check_consolidated", "ARRAYS", "MAX_TOKEN",
           "MAX_TARGET", "MIN_TOKEN", "MIN_TARGET"]

#: the arrays of a dataset whose rows are samples (DESIGN §7)
ARRAYS = ("tokens", "lengths", "targets")
#: the largest |token| accepted: beyond it the compact Gram (degree 6 in the tokens) can overflow float64
MAX_TOKEN = 1e38
#: the largest |target| accepted: beyond it y^2 and the moments (degree 3 in tokens times y) can overflow
MAX_TARGET = 1e100
#: the largest |integer| accepted in integer tokens and targets: float64 holds every integer up to 2^53, not all
#: beyond (2^53 + 1 would be read as 2^53)
MAX_EXACT_INTEGER = 2**53
#: the smallest largest |token| of a sample that is not all zero: below it the compact Gram (degree 6) leaves
#: float64's normal range (1e-38 ** 6 = 1e-228; at 1e-53 it is subnormal, at 1e-60 zero, and a realizable
#: dataset would be certified "not identifiable")
MIN_TOKEN = 1e-38
#: the smallest largest |target| of a sample that is not all zero: below it y^2 leaves float64's normal range
#: (1e-100 ** 2 = 1e-200; at 1e-160 it is subnormal, at 1e-200 zero, and a fit reported "train MSE 0 (relative
#: nan)" and a flattening-rank bound of 0 heads); the mirror of :data:`MAX_TARGET`
MIN_TARGET = 1e-100
#: per array checked for magnitude: (smallest and largest accepted largest |value| of a sample, what underflows,
#: what overflows)
_RANGE = {"tokens": (MIN_TOKEN, MAX_TOKEN, "its degree-6 features near the underflow of",
                     "its cubic features overflow"),
          "targets": (MIN_TARGET, MAX_TARGET, "its square nears the underflow of",
                      "its square and its products with the cubic features (the moments) overflow")}


def check_values(name: str, a, start: int) -> None:
    """NaN/Inf, values so large that the features (tokens) or the squares and moments (targets) overflow float64
    or so small that they underflow (:data:`_RANGE`), and integers float64 cannot hold exactly (beyond
    :data:`MAX_EXACT_INTEGER`; check integer arrays before converting them), naming the first bad sample
    (``start`` + its index in ``a``). ``a``: numpy or any array API array (checked on its device; one transfer of a
    flag per check)."""
    if a.ndim == 0 or a.shape[0] == 0:
        return
    xp = get_xp(a)
    flat = xp.reshape(a, (a.shape[0], -1))
    bad = ~xp.all(xp.isfinite(flat), axis=1)
    if bool(xp.any(bad)):
        raise DatasetError(f"{name}: sample {start + _first(bad, xp)} contains NaN or Inf")
    if not flat.shape[1]:
        return
    if _dtype_is(a, ("integral",)):  # exact in float64, in which everything is computed, up to 2^53 only
        big = xp.any((flat > MAX_EXACT_INTEGER) | (flat < -MAX_EXACT_INTEGER), axis=1)
        if bool(xp.any(big)):
            i = _first(big, xp)
            v = int(flat[i][_first((flat[i] > MAX_EXACT_INTEGER) | (flat[i] < -MAX_EXACT_INTEGER), xp)])
            raise DatasetError(f"{name}: sample {start + i} holds the integer {v}, beyond 2^53: float64, in which"
                               " scaleattn computes, cannot hold it exactly; rescale the data or store it as"
                               " floating point")
        return  # (and far below the overflow limits)
    low, limit, _, over = _RANGE["tokens" if name == "tokens" else "targets"]
    mag = xp.astype(xp.max(xp.abs(flat), axis=1), xp.float64)  # (float16 cannot hold the limit: no cast warning)
    big = mag > limit
    if bool(xp.any(big)):
        i = _first(big, xp)
        raise DatasetError(f"{name}: sample {start + i} has a value of magnitude {float(mag[i]):.1e}: {over}"
                           f" float64 (|{name}| <= {limit:.0e} is accepted); rescale the data")
    _check_tiny(mag, start, xp, name)


def check_underflow(a, start: int = 0, name: str = "tokens") -> None:
    """Refuse tokens whose features underflow float64, or targets whose squares do: a sample that is not all
    zero but whose largest |value| is below :data:`MIN_TOKEN` (its degree-6 Gram terms are subnormal or zero) or
    :data:`MIN_TARGET` (its y^2), naming the first such sample (``start`` + its index) and how to rescale.

    Parameters
    ----------
    a : array
        (n, ...) numpy or any array API array of tokens or targets.
    start : int
        The global index of its first sample (for the message).
    name : {"tokens", "targets"}
        Which array ``a`` is.

    Raises
    ------
    DatasetError
        ``"tokens: sample i has values of magnitude at most 1.0e-60: ..."``.
    """
    if a.ndim == 0 or a.shape[0] == 0 or not math.prod(a.shape[1:]):
        return
    xp = get_xp(a)
    _check_tiny(xp.astype(xp.max(xp.abs(xp.reshape(a, (a.shape[0], -1))), axis=1), xp.float64), start, xp, name)


def _check_tiny(mag, start: int, xp, name: str) -> None:
    low, _, under, _ = _RANGE["tokens" if name == "tokens" else "targets"]
    tiny = (mag > 0) & (mag < low)
    if bool(xp.any(tiny)):
        i = _first(tiny, xp)
        m = float(mag[i])
        raise DatasetError(f"{name}: sample {start + i} has values of magnitude at most {m:.1e}: {under} float64 (a"
                           f" sample that is not all zero needs a |{name.rstrip('s')}| >= {low:.0e}); rescale the"
                           f" {name} (multiply them by 1e{-math.floor(math.log10(m))})")


def check_lengths(lens, start: int, T: int, low: int = 1) -> None:
    """Every length in ``low <= length <= T``, naming the first sample that is not (as :func:`check_values`);
    ``low = 0`` for in-memory causal blocks (a sample of no prefixes adds no rows), 1 for datasets and
    last-token rows (the row is the last token)."""
    xp = get_xp(lens)
    bad = (lens < low) | (lens > T)
    if bool(xp.any(bad)):
        i = _first(bad, xp)
        raise DatasetError(f"lengths: sample {start + i} has length {int(lens[i])}, expected {low} <= length <= T"
                           f" = {T}")


def _first(mask, xp) -> int:
    """Index of the first True of a 1-D boolean array (``argmax`` returns the first maximum: array API)."""
    return int(xp.argmax(xp.astype(mask, xp.int8)))


def _dtype_is(a, kinds: tuple[str, ...]) -> bool:
    """Whether array ``a``'s dtype is of one of the array API ``kinds`` (``"real floating"``, ``"integral"``).

    numpy dtypes (numpy, CuPy, zarr) through ``np.issubdtype``; other array API arrays (torch,
    ``array_api_strict``) through their namespace's ``isdtype``; anything else (zarr string / bytes types): no."""
    np_kinds = {"real floating": np.floating, "integral": np.integer}
    try:
        if np.dtype(a.dtype).kind in "mM":  # numpy files timedelta64 under signed integers: times are no numbers
            return False
        return any(np.issubdtype(a.dtype, np_kinds[k]) for k in kinds)
    except TypeError:  # not a numpy dtype
        if not array_api_compat.is_array_api_obj(a):
            return False
        return bool(array_api_compat.array_namespace(a).isdtype(a.dtype, kinds))


def is_real(a) -> bool:
    """Real numbers: floating point or integer (read as float64); bool, complex, string and object refused."""
    return _dtype_is(a, ("real floating", "integral"))


def check_arrays(tokens, targets=None, lengths=None) -> tuple[int, int, int, int, bool]:
    """Check shapes and dtypes of dataset arrays (anything with ``shape``/``ndim``/``dtype``: zarr, numpy,
    dask, CuPy, torch or any array API array) against the layout of DESIGN §7; values are not read. Returns
    ``(N, T, d, d_out, causal)``.

    Raises
    ------
    DatasetError
        Wrong number of dimensions, a ``tokens``/``targets`` dtype that is not real numbers (bool, complex,
        string, object; integers are read as float64), a non-integer ``lengths``, mismatched sample counts, a
        ``targets`` T or d_out of 0 / mismatch, an empty dataset.
    """
    if tokens.ndim != 3:
        raise DatasetError(f"tokens: expected 3 dimensions (sample, position, embed), got shape {tokens.shape}")
    if not is_real(tokens):
        raise DatasetError(f"tokens: expected a float (or integer) dtype, got {tokens.dtype}")
    N, T, d = (int(n) for n in tokens.shape)
    if N == 0 or T == 0 or d == 0:
        raise DatasetError(f"tokens: empty dataset (shape {tokens.shape})")
    if lengths is not None:
        if lengths.ndim != 1 or lengths.shape[0] != N:
            raise DatasetError(f"lengths: expected shape ({N},) to match tokens, got {lengths.shape}")
        if not _dtype_is(lengths, ("integral",)):
            raise DatasetError(f"lengths: expected an integer dtype, got {lengths.dtype}")
    d_out, causal = 0, False
    if targets is not None:
        if not is_real(targets):
            raise DatasetError(f"targets: expected a float (or integer) dtype, got {targets.dtype}")
        if targets.ndim not in (2, 3):
            raise DatasetError(
                f"targets: expected (sample, output) or (sample, position, output), got shape {targets.shape}"
            )
        if targets.shape[0] != N:
            raise DatasetError(f"targets: {targets.shape[0]} samples but tokens has {N}")
        causal = targets.ndim == 3
        if causal and targets.shape[1] != T:
            raise DatasetError(f"targets: {targets.shape[1]} positions but tokens has T = {T}")
        d_out = int(targets.shape[-1])
        if d_out == 0:
            raise DatasetError(f"targets: d_out = 0 (shape {targets.shape})")
    return N, T, d, d_out, causal


def check_attrs(attrs: dict, url: str, has_targets: bool, causal: bool) -> bool:
    """The attributes a reader relies on have their types (``causal`` a JSON boolean, ``uid`` a string, a
    scaleattn ``format_version`` this reader knows, a well-formed ``manifest``) and agree with the arrays.
    Returns ``causal`` (from the targets' shape, else from the attribute)."""
    c = attrs.get("causal")
    if c is not None and not isinstance(c, bool):
        raise DatasetError(f"{url}: attribute 'causal' must be true or false, got {c!r} ({type(c).__name__})")
    if has_targets and c is not None and c != causal:
        shape = "(sample, position, output)" if causal else "(sample, output)"
        raise DatasetError(f"{url}: attribute 'causal' is {str(c).lower()} but the targets are {shape}")
    uid = attrs.get("uid")
    if uid is not None and not isinstance(uid, str):
        raise DatasetError(f"{url}: attribute 'uid' must be a string, got {uid!r}")
    if attrs.get("format") == _formats.DATASET[0]:
        v = attrs.get("format_version")
        if isinstance(v, bool) or v not in _formats.READABLE[_formats.DATASET[0]]:
            raise DatasetError(f"{url}: scaleattn dataset format v{v!r}, this scaleattn reads v1 and v2 (a newer"
                               " scaleattn wrote it?)")
    m = attrs.get(_integrity.MANIFEST)
    if attrs.get("format") == _formats.DATASET[0] and attrs.get("format_version") == 2:
        if m is None:
            raise IntegrityError(f"{url}: a scaleattn v2 dataset without its manifest (its attributes were edited)")
        if isinstance(m, dict) and m.get("pending"):
            raise IntegrityError(f"{url}: an unfinished dataset (its writer stopped before it was complete)")
    if m is not None:
        if not _integrity.well_formed(m):
            raise IntegrityError(f"{url}: the attribute 'manifest' is damaged (not the manifest scaleattn wrote)")
    return causal if has_targets else bool(c)


def check_chunks(loc, group, names, manifest: dict | None, fill_absent: bool) -> dict[str, dict[str, str]]:
    """Every chunk the arrays ``names`` of ``group`` imply is stored (and, with a ``manifest``, their shapes
    are the ones written); keys beyond a shape are refused too (a shape edited down). Returns each array's
    listing (:func:`scaleattn.store._integrity.list_chunks`).

    Raises
    ------
    IntegrityError
        ``"tokens: no chunk stored for samples [a, b) of URL ..."`` (unless ``fill_absent`` for a store
        without manifest), an enlarged or shrunk shape, or stray chunk keys.
    """
    listings = {}
    for name in names:
        arr = group[name]
        _bounds.check_array(arr, name, loc.url)  # chunks no larger than the array, codecs bounded: before any read
        if manifest is not None:
            entry = manifest["arrays"].get(name)
            if entry is None:
                raise IntegrityError(f"{name}: not in the manifest of {loc.url} (an array added after it was written)")
            if list(arr.shape) != entry["shape"]:
                extra = (f"; samples [{entry['shape'][0]}, {arr.shape[0]}) were never written"
                         if arr.shape[0] > entry["shape"][0] else "")
                raise IntegrityError(f"{name}: shape {tuple(arr.shape)} in the metadata of {loc.url} differs from"
                                     f" the shape {tuple(entry['shape'])} written (manifest): the zarr.json was"
                                     f" edited{extra}")
        listings[name] = listed = _integrity.list_chunks(loc, name)
        ranges, stray = _integrity.absent_chunks(arr, listed, f"{name} in {loc.url}")
        if stray:
            raise IntegrityError(f"{name}: {len(stray)} stored chunk(s) lie beyond the shape {tuple(arr.shape)} in"
                                 f" the metadata of {loc.url} (first {stray[0]!r}): was the shape edited?")
        if not ranges or (fill_absent and manifest is None):
            continue
        shown = ", ".join(f"[{a}, {b})" for a, b in ranges[:3]) + (" ..." if len(ranges) > 3 else "")
        n = sum(b - a for a, b in ranges)
        if manifest is not None:
            raise IntegrityError(f"{name}: chunks of samples {shown} ({n} samples) are missing from {loc.url},"
                                 " which scaleattn wrote complete: the store was damaged or partly copied")
        raise IntegrityError(
            f"{name}: no chunk stored for samples {shown} ({n} of {arr.shape[0]} samples) of {loc.url}: zarr"
            f" would read them as the fill value {_plain(arr.fill_value)}; if the writer skipped such chunks on"
            " purpose, pass `fill_absent_chunks=True`")
    return listings


def check_consolidated(loc, group, names) -> None:
    """The group's consolidated copy of the metadata of arrays ``names`` (which zarr decodes them with, in place of
    their own) says what their own documents say: a copy left stale by an edit of an array (a resize, another
    codec) made the fit read other shapes than the array declares to every other reader, and let chunks beyond
    its own shape be read.

    Raises
    ------
    IntegrityError
        ``"tokens: the consolidated metadata of URL differs from the array's own (shape [6, 4, 2] there,
        [4, 4, 2] in its own): ..."``."""
    if getattr(group.metadata, "consolidated_metadata", None) is None:
        return
    own = loc.open_group("r", use_consolidated=False)
    try:
        held = set(own.array_keys())
    except Exception:  # (corrupt metadata: said by the reads below, or by the dataset's own checks)
        held = set(names)
    for name in ARRAYS:  # an array added or removed after consolidating: the copy hides it, or lists a ghost
        gone = name in names and name not in held and not loc.join(f"{name}/zarr.json").exists()
        if gone or (name in held and name not in names):
            raise IntegrityError(
                f"{name}: the consolidated metadata of {loc.url} {'lists' if gone else 'does not list'} the array,"
                f" which the group {'does not hold' if gone else 'holds'}: the copy is stale (the array was"
                f" {'removed' if gone else 'added'} after zarr.consolidate_metadata); consolidate the store again"
                " or remove the copy")
    for name in names:
        try:
            mine, copy = own[name].metadata.to_dict(), group[name].metadata.to_dict()
        except Exception as e:
            raise DatasetError(f"{name}: corrupt Zarr metadata in {loc.url} ({type(e).__name__}: {e})") from None
        if mine != copy:
            key = next(k for k in sorted(set(mine) | set(copy), key=str) if mine.get(k) != copy.get(k))
            raise IntegrityError(
                f"{name}: the consolidated metadata of {loc.url} differs from the array's own ({key}"
                f" {_plain(copy.get(key))} there, {_plain(mine.get(key))} in its own): the copy is stale (the array"
                " was changed after zarr.consolidate_metadata, or the copy edited); consolidate the store again or"
                " remove the copy")


def _block_digest(name: str, signatures: dict[str, str], keys) -> int:
    return _integrity.signature_digest(*sorted(f"{name}/{k}={signatures.get(k, 'absent')}" for k in keys))


def _metadata_digest(array) -> int:
    """Digest of the metadata zarr decodes an array with (its own document, or the group's consolidated copy)."""
    meta = array.metadata.to_dict()
    return _integrity.digest64(json.dumps(meta, sort_keys=True, default=str).encode())


def object_digests(loc, group, listings: dict[str, dict[str, str]]) -> tuple:
    """What binds the reads of a store without manifest to what the client checked when it opened it: per array,
    ``(name, digest of its decoding metadata, samples per stored object, digest of each block's objects'
    signatures)`` (the objects holding each block of samples, their size and modification time or ETag;
    :func:`check_objects`). Objects whose listing does not identify them (HTTP) are asked one by one."""
    out = []
    for name, listed in listings.items():
        arr = group[name]
        if not all(map(_integrity.informative, listed.values())):
            listed = _integrity.object_signatures(loc, name, listed)
        rows = _integrity.storage_grid(arr)[0]
        blocks = math.ceil(int(arr.shape[0]) / rows)
        out.append((name, _metadata_digest(arr), rows,
                    tuple(_block_digest(name, listed, _integrity.block_keys(arr, k)) for k in range(blocks))))
    return tuple(out)


def check_objects(loc, array, name: str, digests: tuple, start: int, stop: int) -> None:
    """Refuse a read of samples ``[start, stop)`` of array ``name`` (just read from ``loc`` through ``array``)
    unless it was decoded with the metadata the client checked and the objects holding those samples are those
    the client listed (``digests``: :func:`object_digests` as the store was opened): the only binding of the
    values of a store without manifest (no checksums) to the store the client checked. A worker that reads
    another copy at the same path, a chunk rewritten since the store was opened (even during this read), or
    metadata edited since (a codec, a consolidated copy), is one error naming the process, the array and the
    samples.

    Raises
    ------
    IntegrityError
        The metadata or the objects' signatures differ, or an object is gone."""
    for n, meta, rows, blocks in digests:
        if n != name:
            continue
        if _metadata_digest(array) != meta:
            raise IntegrityError(
                f"{here()}: {name}: the metadata of {loc.url} that zarr decodes samples [{start}, {stop}) with"
                " differs from that checked when the job opened it (its zarr.json, or the group's consolidated"
                " copy, was edited since, or this process sees another copy at the same path); every process"
                " must read the same store, unchanged while the job runs")
        for k in range(start // rows, min(len(blocks), math.ceil(stop / rows))):
            keys = _integrity.block_keys(array, k)
            if _block_digest(name, _integrity.object_signatures(loc, name, keys), keys) != blocks[k]:
                a, b = k * rows, min(int(array.shape[0]), (k + 1) * rows)
                raise IntegrityError(
                    f"{here()}: {name}: the stored chunks of samples [{a}, {b}) of {loc.url} differ from those"
                    " checked when the job opened it (size and modification time, or ETag; or one is gone): it"
                    " was rewritten since, or this process sees another copy at the same path; every process must"
                    " read the same store (a shared file system or an object store URL), unchanged while the job"
                    " runs")


def content_id(loc, names, manifest: dict | None) -> str:
    """What identifies a store's content cheaply: the manifest's digest for stores scaleattn wrote; else a
    digest of the arrays' metadata, the stored keys and sizes, and the bytes of each array's first and last
    stored object (a same-shaped store elsewhere differs in these)."""
    if manifest is not None:
        return "m" + _integrity.manifest_digest(manifest)
    h = hashlib.sha256()
    for name in names:
        for doc in ("zarr.json", ".zarray"):  # the array's metadata document, as stored
            meta = loc.join(f"{name}/{doc}")
            if meta.exists():
                fs, p = meta.fs()
                with fs.open(p, "rb") as f:
                    h.update(f.read())
        listed = _integrity.list_chunks(loc, name)
        keys = sorted(listed)
        h.update(repr([(k, listed[k].split(":")[0]) for k in keys]).encode())
        for k in sorted({keys[0], keys[-1]}) if keys else ():
            fs, p = loc.join(f"{name}/{k}").fs()
            with fs.open(p, "rb") as f:
                h.update(f.read())
    return "l" + h.hexdigest()[:16]


def here() -> str:
    """This process as an error names it: the Dask worker's address and host, or the host."""
    dist = sys.modules.get("distributed")
    try:
        return f"worker {dist.get_worker().address} (host {socket.gethostname()})"
    except (AttributeError, ValueError):  # not inside a worker (or distributed not loaded)
        return f"host {socket.gethostname()}"


def verify_identity(expected: str, actual: str, url: str) -> None:
    """Refuse a store whose fingerprint here differs from the client's (another file at the same path on a
    worker's machine, or a store changed since it was checked)."""
    if expected != actual:
        raise IntegrityError(f"{here()}: {url} is not the dataset the client checked (fingerprint {actual} here,"
                             f" {expected} on the client): the workers must read the same store (a shared file"
                             " system or an object store URL), unchanged while the job runs")


def chunk_absent(loc, array, k: int) -> bool:
    """Whether the stored object holding chunk ``k`` (along samples) of ``array`` is absent from ``loc``."""
    rows = int(array.chunks[0])
    grid = _integrity.storage_grid(array)
    key = array.metadata.encode_chunk_key((k * rows // grid[0],) + (0,) * (array.ndim - 1))
    return not loc.join(f"{array.basename}/{key}").exists()


def fingerprint(loc, g) -> str:
    """The fingerprint of an open dataset group (:class:`scaleattn.data._dataset.Dataset`): shapes, chunking, uid and
    :func:`content_id`."""
    names = [n for n in ARRAYS if n in set(g.array_keys())]
    tok = g["tokens"]
    N, T, d = tok.shape
    y = g["targets"] if "targets" in names else None
    d_out = int(y.shape[-1]) if y is not None else 0
    causal = y.ndim == 3 if y is not None else bool(g.attrs.get("causal", False))
    content = content_id(loc, names, g.attrs.get(_integrity.MANIFEST))
    return (f"{N}x{T}x{d}:{d_out}:{int(causal)}:{int('lengths' in names)}:{int(tok.chunks[0])}:"
            f"{g.attrs.get('uid', '')}:{content}")


def read_arrays(ds, targets: bool = True) -> list[str]:
    """The arrays a statistics build reads from dataset ``ds``."""
    return ["tokens"] + (["lengths"] if ds.has_lengths else []) + (["targets"] if targets and ds.has_targets else [])


def row_bindings(ds, groups, targets: bool = True) -> list[int]:
    """One digest per row group ``[a, b)`` of dataset ``ds``: of the storage signature (size and modification
    time, or ETag) of every stored object holding its rows, of their manifest checksums, and of the dataset's
    fingerprint. A checkpointed partial is reused only while its group's digest is unchanged: any rewrite of
    the chunks it read (an edit in place, a copy, a restored backup) makes it be recomputed."""
    g, manifest = ds.group(), ds.manifest()
    parts = {}
    for name in read_arrays(ds, targets):
        arr = g[name]
        listed = _integrity.list_chunks(ds.store, name)
        by_row: dict[int, list[str]] = {}
        for key, coords in _integrity.expected_keys(arr).items():
            by_row.setdefault(coords[0], []).append(f"{name}/{key}={listed.get(key, 'absent')}")
        entry = (manifest or {}).get("arrays", {}).get(name)
        parts[name] = (_integrity.storage_grid(arr)[0], by_row, entry)
    out = []
    for a, b in groups:
        text = [ds.fingerprint, str(int(targets)), f"{a}:{b}"]
        for rows, by_row, entry in parts.values():
            for k in range(a // rows, (b - 1) // rows + 1):
                text += sorted(by_row.get(k, []))
            if entry is not None:
                r = entry["rows"]
                text.append(entry["crc32c"][8 * (a // r) : 8 * math.ceil(b / r)])
        out.append(_integrity.signature_digest(*text))
    return out


def expected_rows(ds, start: int, stop: int) -> int:
    """Feature rows of samples ``[start, stop)``: one per sample, T per causal sample, or the sum of the
    lengths of causal samples with lengths (read, and checked)."""
    if not ds.causal:
        return stop - start
    if not ds.has_lengths:
        return (stop - start) * ds.length
    return int(ds.read_lengths(start, stop).sum())  # checked as every read is (manifest or objects, 1 <= L <= T)


def _plain(value) -> str:
    """A fill value as a user reads it (``0.0``, not ``np.float64(0.0)``)."""
    return repr(value.item()) if hasattr(value, "item") else repr(value)
