"""MHLA datasets as Zarr v3 groups (DESIGN §7): open, validate, read row blocks, write.

Layout of a dataset group::

    tokens   float (N, T, d)        dims ("sample", "position", "embed"), chunked along N
    lengths  int   (N,)             optional; 1 <= lengths <= T, padding positions are zero and ignored
    targets  float (N, d_out)       last-token data, dims ("sample", "output")
             float (N, T, d_out)    causal (prefix) data, dims ("sample", "position", "output")
    teacher/V (H, d_out, d), teacher/Q (H, d, d)   optional ground truth of generated data

Group attributes: ``format = "scaleattn-dataset"``, ``format_version``, ``causal``, ``uid``, the
``manifest`` (shape and per-chunk crc32c of every array, :mod:`scaleattn._integrity`) and free-form metadata.
Arrays are written with the crc32c codec and every chunk stored. Reads check values, and the manifest where
there is one; opening checks that every chunk is stored (:mod:`scaleattn.datacheck`). Input stores are only
ever opened read-only. Layer L1.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import uuid

import numpy as np

from . import _formats, _integrity, _testing
from ._outputs import atomic_output
from ._storage import Location, access_error, resolve
from .datacheck import (
    ARRAYS,
    check_arrays,
    check_attrs,
    check_chunks,
    check_lengths,
    check_values,
    chunk_absent,
    fingerprint,
    here,
    verify_identity,
)
from .errors import DatasetError, IntegrityError, ParameterError

__all__ = ["Dataset", "DatasetError", "open_dataset", "create_dataset", "write_dataset", "write_block",
           "write_unit", "write_teacher", "finish_dataset", "check_arrays", "default_chunk_samples", "DIMS"]

FORMAT, FORMAT_VERSION = _formats.DATASET
DIMS = {
    "tokens": ("sample", "position", "embed"),
    "lengths": ("sample",),
    "targets": ("sample", "output"),
    "targets_causal": ("sample", "position", "output"),
}


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A validated, read-only handle on a dataset group (cheap to pickle to Dask workers).

    Attributes
    ----------
    store : Location
        Where the group lives (absolute path or URL, with its storage options).
    n_samples, length, d, d_out : int
        N, T, the token dimension, the output dimension (0 without targets).
    causal, has_lengths : bool
    chunk_samples : int
        Samples per Zarr chunk of ``tokens``.
    fingerprint : str
        Shapes, chunking, the store's uid and a digest of its content (its manifest, or for stores written by
        other tools its metadata, chunk listing and sample bytes): every process that opens the store checks
        it sees this same content (:func:`scaleattn.datacheck.verify_identity`).
    fill_absent : bool
        Absent chunks of a store without manifest read as the fill value (the user said so); otherwise they
        are refused when the dataset is opened.
    """

    store: Location
    n_samples: int
    length: int
    d: int
    d_out: int
    causal: bool
    has_lengths: bool
    chunk_samples: int
    fingerprint: str = ""
    fill_absent: bool = False

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def storage_options(self) -> dict | None:
        return self.store.storage_options

    @property
    def n_chunks(self) -> int:
        return math.ceil(self.n_samples / self.chunk_samples)

    @property
    def has_targets(self) -> bool:
        return self.d_out > 0

    def group(self):
        """The Zarr group, opened read-only (cached per process), after checking once per process that it is
        the store the handle was made from (:func:`scaleattn.datacheck.verify_identity`: a worker that sees
        another file at this path, or a store changed since, is refused naming the worker).

        Raises
        ------
        IntegrityError
            The store here is not the one checked, or cannot be opened here (naming the worker).
        """
        frozen = _freeze(self.storage_options)
        try:
            g = self.store.open_group("r") if frozen is None else _open_cached(self.url, frozen, self.fingerprint)
        except Exception as e:
            access = access_error(self.url, e)
            if access is not None:
                raise access from None
            raise IntegrityError(f"{here()}: cannot open the dataset {self.url} ({type(e).__name__}: {e}): the"
                                 " workers must see the same store as the client (a shared file system or an"
                                 " object store URL)") from None
        if self.fingerprint:
            _verified(self.url, frozen, self.fingerprint, g if frozen is None else None)
        return g

    def manifest(self) -> dict | None:
        """The manifest of a store scaleattn wrote (shapes and per-chunk checksums), None for other stores."""
        return self.group().attrs.get(_integrity.MANIFEST)

    def read(self, start: int, stop: int, targets: bool = True, check: bool = True):
        """Read samples ``[start, stop)``: ``(tokens, lengths, targets)`` as numpy arrays.

        ``lengths`` / ``targets`` are None when absent (or not requested). With ``check``, values are
        validated and a :class:`DatasetError` names the array and the first bad (global) sample index; chunks
        read whole are checked against the manifest (an :class:`IntegrityError` names the array and the sample
        range of a chunk that is missing, changed or damaged).
        """
        g = self.group()
        manifest = self.manifest()

        def get(name):
            try:
                _testing.before_read(self.url)
                values = np.asarray(g[name][start:stop])
            except Exception as e:  # a corrupt or missing chunk: zarr raises codec-specific types
                access = access_error(self.url, e)
                if access is not None:  # the store is unreachable, not the data bad: keep it resumable
                    raise access from None
                if _integrity.checksum_failure(e):
                    raise IntegrityError(f"{name}: samples [{start}, {stop}) of {self.url} are damaged: a stored"
                                         " chunk fails its crc32c checksum") from None
                raise IntegrityError(
                    f"{name}: cannot read samples [{start}, {stop}) of {self.url} ({type(e).__name__}: {e})"
                ) from None
            if check and manifest is not None:
                _integrity.verify_rows(manifest["arrays"][name], name, values, start, self.url,
                                       missing=functools.partial(chunk_absent, self.store, g[name]))
            return values

        tok = get("tokens")
        lens = get("lengths") if self.has_lengths else None
        y = get("targets") if (targets and self.has_targets) else None
        if check:
            check_values("tokens", tok, start)
            if lens is not None:
                check_lengths(lens, start, self.length)
            if y is not None:
                check_values("targets", y, start)
        return tok, lens, y

    def teacher(self):
        """Ground-truth heads ``(V (H, d_out, d), Q (H, d, d))`` of a generated dataset, or None."""
        g = self.group()
        try:
            t = g["teacher"]
        except KeyError:
            return None
        V, Q = np.asarray(t["V"][...]), np.asarray(t["Q"][...])
        arrays = (self.manifest() or {}).get("arrays", {})
        for name, a in (("teacher/V", V), ("teacher/Q", Q)):
            if name in arrays:
                _integrity.verify_whole(arrays[name], name, a, self.url)
        return V, Q

    @property
    def attrs(self) -> dict:
        return dict(self.group().attrs)


def _freeze(opts):
    """Hashable form of fsspec options (nested dicts such as s3fs ``client_kwargs`` included), None if not JSON."""
    try:
        return json.dumps(opts or {}, sort_keys=True)
    except TypeError:
        return None


@functools.lru_cache(maxsize=16)
def _open_cached(url, frozen_opts, fingerprint):
    return Location(url, json.loads(frozen_opts) or None).open_group("r")


@functools.lru_cache(maxsize=64)
def _verified_cached(url, frozen_opts, fp) -> None:
    loc = Location(url, json.loads(frozen_opts) or None)
    verify_identity(fp, fingerprint(loc, _open_cached(url, frozen_opts, fp)), url)


def _verified(url, frozen, fp, group) -> None:
    """Check, once per process (cached on success), that the store at ``url`` has fingerprint ``fp``."""
    if frozen is not None:
        _verified_cached(url, frozen, fp)
    else:
        verify_identity(fp, fingerprint(Location(url), group), url)


def open_dataset(url: str, storage_options: dict | None = None, *, fill_absent_chunks: bool = False) -> Dataset:
    """Open and validate the structure of a dataset group (shapes, dtypes, metadata, attributes, that every
    chunk is stored; values are checked when rows are read).

    Parameters
    ----------
    url : str, path-like or Location
        Local path or fsspec URL (``s3://bucket/data.zarr``) of a Zarr v3 group; local paths are made absolute.
    storage_options : dict or list of "KEY=VALUE", optional
        fsspec options (endpoint, credentials) for URLs (:func:`scaleattn._storage.parse_storage_options`).
    fill_absent_chunks : bool
        For stores written by other tools (no manifest): absent chunks mean the fill value (for writers that
        skip empty chunks). By default they are refused. Stores scaleattn wrote are always complete.

    Returns
    -------
    Dataset

    Raises
    ------
    DatasetError
        Not a Zarr group, corrupt metadata, missing ``tokens``, wrong number of dimensions, non-float dtype,
        mismatched sample counts, T or d_out mismatch, an empty dataset, an attribute of the wrong type.
    IntegrityError
        Absent chunks (naming the array and the sample range), a shape that differs from the manifest.
    StorageError
        The store cannot be reached.

    Examples
    --------
    >>> ds = open_dataset("data.zarr")  # doctest: +SKIP
    >>> ds.n_samples, ds.length, ds.d, ds.d_out  # doctest: +SKIP
    (512, 100, 2, 2)
    """
    loc = resolve(url, storage_options)
    url = loc.url
    if not loc.exists():
        raise DatasetError(f"{url}: no such dataset")
    try:
        g = loc.open_group("r")
    except Exception as e:  # zarr raises several types for a non-group / corrupt metadata
        raise DatasetError(f"{url}: not a readable Zarr group ({type(e).__name__}: {e})") from None
    try:
        names = set(g.array_keys())
    except Exception as e:
        raise DatasetError(f"{url}: corrupt Zarr metadata ({type(e).__name__}: {e})") from None
    for name in ("tokens", "lengths", "targets"):  # zarr skips members whose metadata it cannot parse
        if name not in names and loc.join(f"{name}/zarr.json").exists():
            raise DatasetError(f"{name}: corrupt Zarr metadata in {url} (not a readable array)")
    if "tokens" not in names:
        raise DatasetError(f"{url}: missing array 'tokens' (found: {sorted(names) or 'none'})")

    def get(name):
        try:
            return g[name] if name in names else None
        except Exception as e:
            raise DatasetError(f"{name}: corrupt Zarr metadata ({type(e).__name__}: {e})") from None

    tok = get("tokens")
    N, T, d, d_out, causal = check_arrays(tok, get("targets"), get("lengths"))
    has_lengths = "lengths" in names
    attrs = dict(g.attrs)
    causal = check_attrs(attrs, url, d_out > 0, causal)
    present = [n for n in ARRAYS if n in names]
    check_chunks(loc, g, present, attrs.get(_integrity.MANIFEST), bool(fill_absent_chunks))
    chunk = int(tok.chunks[0])
    ds = Dataset(loc, N, T, d, d_out, causal, has_lengths, chunk, fingerprint(loc, g), bool(fill_absent_chunks))
    ds.teacher()  # small: checked now rather than after the build
    return ds


def default_chunk_samples(T: int, d: int, target_bytes: float = 4e6) -> int:
    """Samples per Zarr chunk so that a chunk of float64 tokens is about ``target_bytes``."""
    return max(1, int(target_bytes // (8 * T * d)))


def create_dataset(
    loc: Location,
    n_samples: int,
    length: int,
    d: int,
    d_out: int = 0,
    *,
    causal: bool = False,
    lengths: bool = False,
    chunk_samples: int | None = None,
    shard_samples: int | None = None,
    attrs: dict | None = None,
):
    """Create an empty dataset group (mode ``w``) at ``loc`` and return the writable Zarr group.

    ``shard_samples`` (a multiple of the chunk size) stores the chunks in Zarr v3 shards of that many samples.
    Write it with :func:`write_block` in slabs aligned to chunks and shards, then :func:`finish_dataset` (until
    then the dataset is refused as unfinished). Use through :func:`write_dataset` or the generators, which wrap
    it in an atomic output. Raises :class:`ParameterError` for a bad chunk or shard size.
    """
    loc = resolve(loc)
    chunk = int(chunk_samples or default_chunk_samples(length, d))
    if chunk < 1:
        raise ParameterError(f"chunk_samples must be >= 1, got {chunk_samples}")
    if shard_samples is not None and (shard_samples < chunk or shard_samples % chunk):
        raise ParameterError(f"shard_samples = {shard_samples} must be a multiple of chunk_samples = {chunk}")

    def layout(shape):  # chunks (and shards) along the sample axis only; crc32c on every chunk
        kw = {"chunks": (chunk,) + tuple(shape[1:]), "compressors": _integrity.compressors()}
        if shard_samples is not None:
            kw["shards"] = (int(shard_samples),) + tuple(shape[1:])
        return kw

    g = loc.open_group("w")
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "causal": bool(causal), "uid": uuid.uuid4().hex,
            _integrity.MANIFEST: {"pending": True}}  # until finish_dataset: an unfinished write is refused
    g.attrs.update({**(attrs or {}), **meta})
    g.create_array(
        "tokens", shape=(n_samples, length, d), **layout((n_samples, length, d)), dtype="float64",
        dimension_names=DIMS["tokens"], attributes={"description": "token sequences, token-major", "units": "1"},
    )
    if lengths:
        g.create_array(
            "lengths", shape=(n_samples,), **layout((n_samples,)), dtype="int64", dimension_names=DIMS["lengths"],
            attributes={"description": "valid tokens per sequence; later positions are zero padding"},
        )
    if d_out:
        shape = (n_samples, length, d_out) if causal else (n_samples, d_out)
        g.create_array(
            "targets", shape=shape, **layout(shape), dtype="float64",
            dimension_names=DIMS["targets_causal" if causal else "targets"],
            attributes={"description": "regression targets" + (" per prefix" if causal else " of the last token")},
        )
    return g


def write_unit(group) -> int:
    """Samples per write unit of a dataset group: the shard size along N when sharded, else the chunk size
    (DESIGN §6: every write covers whole units, so no two writers ever share a chunk or a shard)."""
    arrays = [group[k] for k in ("tokens", "lengths", "targets") if k in group]
    return math.lcm(*(int((a.shards or a.chunks)[0]) for a in arrays))


def write_block(group, start: int, tokens, targets=None, lengths=None, sums: dict | None = None) -> dict:
    """Write samples ``[start, start + len(tokens))``; ``start`` and ``len(tokens)`` must be multiples of
    :func:`write_unit` (the last block may end at N), so every write covers whole chunks and shards and no two
    writers share one: misaligned writes lose data. Raises ``ValueError`` otherwise.

    Every chunk is stored (even all-zero ones). Returns ``sums`` (a new dict when None), updated with the
    crc32c of each chunk of rows written (``{array: {chunk index: crc}}``), for :func:`finish_dataset`."""
    chunk = write_unit(group)
    n = len(tokens)
    if start % chunk or (n % chunk and start + n != group["tokens"].shape[0]):
        raise ValueError(f"write_block: rows [{start}, {start + n}) are not aligned to chunks/shards of {chunk}")
    sums = {} if sums is None else sums
    rows = int(group["tokens"].chunks[0])
    for name, values, dtype in (("tokens", tokens, np.float64), ("lengths", lengths, np.int64),
                                ("targets", targets, np.float64)):
        if values is None:
            continue
        values = np.asarray(values, dtype=dtype)
        _integrity.writable(group[name])[start : start + n] = values
        mine = sums.setdefault(name, {})
        for a in range(0, n, rows):
            mine[(start + a) // rows] = _integrity.crc32c(values[a : a + rows])
    return sums


def finish_dataset(group, sums: dict) -> None:
    """Record the manifest of a dataset written with :func:`write_block` (and :func:`write_teacher`): the
    shape of each array and the crc32c of each chunk of rows. Call last: a dataset is complete once it has one.

    Raises ``ValueError`` when a chunk of an array was never written."""
    rows = int(group["tokens"].chunks[0])
    arrays = {}
    for name in ("tokens", "lengths", "targets"):
        if name not in group:
            continue
        shape = group[name].shape
        n_chunks = math.ceil(shape[0] / rows)
        got = sums.get(name, {})
        if sorted(got) != list(range(n_chunks)):
            gone = sorted(set(range(n_chunks)) - set(got))
            raise ValueError(f"{name}: chunk(s) {gone[:5]} of {n_chunks} were never written")
        arrays[name] = _integrity.manifest_entry(shape, rows, (got[k] for k in range(n_chunks)))
    arrays.update({k: v for k, v in sums.items() if k.startswith("teacher/")})
    group.attrs[_integrity.MANIFEST] = {"arrays": arrays}


def write_dataset(
    url,
    tokens,
    targets=None,
    lengths=None,
    *,
    chunk_samples: int | None = None,
    shard_samples: int | None = None,
    attrs: dict | None = None,
    teacher=None,
    overwrite: bool = False,
    storage_options: dict | None = None,
) -> Dataset:
    """Write arrays (numpy, or dask with any chunking) as a dataset group and return it opened.

    Parameters
    ----------
    url : str, path-like or Location
        Where to write the group.
    tokens : (N, T, d) float
    targets : (N, d_out) or (N, T, d_out) float, optional
    lengths : (N,) int, optional
    chunk_samples, shard_samples : int, optional
        Samples per Zarr chunk (default ~4 MB) and per shard (default unsharded).
    attrs : dict, optional
        Free-form group attributes.
    teacher : (V, Q), optional
        Ground-truth heads stored under ``teacher/``.
    overwrite : bool
        Replace an existing store at ``url``.
    storage_options : dict, optional
        fsspec options for URLs.

    Returns
    -------
    Dataset
        The written dataset, opened.

    Writes go slab by slab aligned to the store's chunks and shards (:func:`write_unit`), whatever the input's
    chunking, into a temporary store renamed on success.

    Raises
    ------
    DatasetError
        Bad shapes or dtypes (:func:`check_arrays`, the checks :func:`open_dataset` applies), non-finite values
        or lengths outside ``[1, T]`` (naming the first bad sample); nothing is written then.
    OutputExistsError
        ``url`` exists and ``overwrite`` is False.

    Examples
    --------
    >>> import numpy as np
    >>> ds = write_dataset("tiny.zarr", np.ones((4, 3, 2)), np.ones((4, 2)), overwrite=True)  # doctest: +SKIP
    """
    loc = resolve(url, storage_options)
    N, T, d, d_out, causal = check_arrays(tokens, targets, lengths)
    with atomic_output(loc, overwrite) as tmp:
        g = create_dataset(
            tmp, N, T, d, d_out, causal=causal, lengths=lengths is not None, chunk_samples=chunk_samples,
            shard_samples=shard_samples, attrs=attrs,
        )
        chunk = write_unit(g)
        step = chunk * max(1, int(64e6 // (8 * T * d * chunk)))  # whole chunks and shards, ~64 MB per slab
        sums = {}
        for a in range(0, N, step):
            b = min(N, a + step)
            tok = np.asarray(tokens[a:b], dtype=np.float64)
            y = None if targets is None else np.asarray(targets[a:b], dtype=np.float64)
            lens = None if lengths is None else np.asarray(lengths[a:b])
            check_values("tokens", tok, a)
            if y is not None:
                check_values("targets", y, a)
            if lens is not None:
                check_lengths(lens, a, T)
            write_block(g, a, tok, y, lens, sums)
        if teacher is not None:
            write_teacher(g, *teacher, sums=sums)
        finish_dataset(g, sums)
    return open_dataset(loc)


def write_teacher(group, V, Q, sums: dict | None = None) -> None:
    """Store ground-truth heads ``V`` (H, d_out, d) and ``Q`` (H, d, d) under ``teacher/`` (their checksums
    into ``sums`` for the manifest, :func:`finish_dataset`)."""
    t = group.create_group("teacher", attributes={"description": "ground-truth MHLA heads of the generator"})
    V, Q = np.asarray(V, np.float64), np.asarray(Q, np.float64)
    t.create_array("V", data=V, dimension_names=("head", "output", "embed"), compressors=_integrity.compressors(),
                   attributes={"description": "teacher value/output matrices V_h"})
    t.create_array("Q", data=Q, dimension_names=("head", "embed", "embed_2"), compressors=_integrity.compressors(),
                   attributes={"description": "teacher fused key-query matrices Q_h"})
    if sums is not None:
        for name, a in (("teacher/V", V), ("teacher/Q", Q)):
            sums[name] = _integrity.manifest_entry(a.shape, max(1, a.shape[0]), [_integrity.crc32c(a)])
