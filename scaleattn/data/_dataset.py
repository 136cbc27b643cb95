"""MHLA datasets as Zarr v3 groups (DESIGN §7): open, validate, read row blocks (writing them is
:mod:`scaleattn.data._writer`).

Layout of a dataset group::

    tokens   float (N, T, d)        dims ("sample", "position", "embed"), chunked along N
    lengths  int   (N,)             optional; 1 <= lengths <= T, padding positions are zero and ignored
    targets  float (N, d_out)       last-token data, dims ("sample", "output")
             float (N, T, d_out)    causal (prefix) data, dims ("sample", "position", "output")
    teacher/V (H, d_out, d), teacher/Q (H, d, d)   optional ground truth of generated data

Group attributes: ``format = "scaleattn-dataset"``, ``format_version``, ``causal``, ``uid``, the
``manifest`` (shape and per-chunk crc32c of every array, :mod:`scaleattn.store._integrity`) and free-form metadata.
Arrays are written with the crc32c codec and every chunk stored. Reads check values, and the manifest where
there is one; opening checks that every chunk is stored (:mod:`scaleattn.data._checks`). Input stores are only
ever opened read-only. Layer L1.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import threading

import numpy as np

from .. import _testing
from ..errors import DatasetError, IntegrityError, StorageError
from ..store import _bounds, _formats, _integrity
from ..store._location import (
    Location,
    access_error,
    check_kind,
    check_path,
    check_storage_options,
    did_you_mean,
    resolve,
)
from ._checks import (
    ARRAYS,
    check_arrays,
    check_attrs,
    check_chunks,
    check_consolidated,
    check_lengths,
    check_objects,
    check_values,
    chunk_absent,
    fingerprint,
    here,
    object_digests,
    verify_identity,
)

__all__ = ["Dataset", "DatasetError", "open_dataset", "check_dataset_argument", "check_arrays", "DIMS", "ChunkCache",
           "CUT_CHUNKS"]

FORMAT, FORMAT_VERSION = _formats.DATASET
DIMS = {
    "tokens": ("sample", "position", "embed"),
    "lengths": ("sample",),
    "targets": ("sample", "output"),
    "targets_causal": ("sample", "position", "output"),
}


def _damaged_chunk(arr, lo: int, hi: int, start: int, stop: int) -> tuple[int, int]:
    """The samples ``[a, b)`` of the first chunk of ``arr`` in ``[lo, hi)`` that fails its checksum (read chunk by
    chunk after a read of the whole range failed), or ``(start, stop)`` when none is found alone."""
    c = max(1, int(arr.chunks[0]))
    n = int(arr.shape[0])
    for k in range(lo // c, -(-hi // c)):
        a, b = k * c, min(n, (k + 1) * c)
        try:
            np.asarray(arr[a:b])
        except Exception as e:
            if _integrity.checksum_failure(e):
                return a, b
    return start, stop


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
        it sees this same content (:func:`scaleattn.data._checks.verify_identity`).
    fill_absent : bool
        Absent chunks of a store without manifest read as the fill value (the user said so); otherwise they
        are refused when the dataset is opened.
    objects : tuple
        A store without manifest (written by another tool, no checksums): the signatures (size and modification
        time, or ETag) of the objects holding each block of samples as listed when it was opened
        (:func:`scaleattn.data._checks.object_digests`); every read checks the objects it read against them
        (:func:`scaleattn.data._checks.check_objects`), on the client and on every worker. Empty for stores
        scaleattn wrote (their manifest checksums bind every read to the values written).

    Raises
    ------
    DatasetError
        From :meth:`read`: a value that is not finite or a length outside ``[1, T]`` (naming the array and the
        first bad sample); :class:`~scaleattn.errors.IntegrityError` when a chunk cannot be read.

    See Also
    --------
    open_dataset : makes the handle (validating the structure).
    write_dataset : writes arrays as a dataset.

    Examples
    --------
    >>> import numpy as np, scaleattn
    >>> ds = scaleattn.write_dataset("_doc_ds.zarr", np.ones((4, 3, 2)), np.ones((4, 2)), overwrite=True)
    >>> ds.n_samples, ds.length, ds.d, ds.d_out, ds.causal
    (4, 3, 2, 2, False)
    >>> tokens, lengths, targets = ds.read(0, 2)
    >>> tokens.shape, lengths, targets.shape
    ((2, 3, 2), None, (2, 2))
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
    objects: tuple = ()

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
        """The Zarr group, opened read-only (cached per process), after checking at each open that it is
        the store the handle was made from (:func:`scaleattn.data._checks.verify_identity`: a worker that sees
        another file at this path, or a store changed since, is refused naming the worker).

        Raises
        ------
        IntegrityError
            The store here is not the one checked, or cannot be opened here (naming the worker).
        """
        frozen = _freeze(self.storage_options)
        if frozen is not None:
            return _open_verified(self.url, frozen, self.fingerprint)
        return _open_and_verify(self.store, self.fingerprint)  # (options that are not JSON: opened each time)

    def manifest(self) -> dict | None:
        """The manifest of a store scaleattn wrote (shapes and per-chunk checksums), None for other stores."""
        return self.group().attrs.get(_integrity.MANIFEST)

    def read(self, start: int, stop: int, targets: bool = True, check: bool = True):
        """Read samples ``[start, stop)``: ``(tokens, lengths, targets)`` as numpy arrays.

        ``lengths`` / ``targets`` are None when absent (or not requested). With ``check``, values are
        validated and a :class:`DatasetError` names the array and the first bad (global) sample index; every
        value returned is checked against the manifest (a range that cuts a chunk reads and checks it whole; an
        :class:`IntegrityError` names the array and the sample range of a chunk that is missing, changed or
        damaged).
        """
        tok = self._rows("tokens", start, stop, check)
        lens = self._rows("lengths", start, stop, check) if self.has_lengths else None
        y = self._rows("targets", start, stop, check) if (targets and self.has_targets) else None
        if check:
            check_values("tokens", tok, start)
            if lens is not None:
                check_lengths(lens, start, self.length)
            if y is not None:
                check_values("targets", y, start)
        return tok, lens, y

    def read_lengths(self, start: int, stop: int) -> np.ndarray:
        """The lengths of samples ``[start, stop)`` (int64; T for a dataset without lengths), checked as
        :meth:`read` checks them (manifest, ``1 <= length <= T``; raises as it does)."""
        if not self.has_lengths:
            return np.full(stop - start, self.length, dtype=np.int64)
        lens = self._rows("lengths", start, stop, True)
        check_lengths(lens, start, self.length)
        return lens.astype(np.int64, copy=False)

    def _rows(self, name: str, start: int, stop: int, check: bool) -> np.ndarray:
        """Samples ``[start, stop)`` of array ``name``, checked against the manifest (with ``check``; a range that
        cuts a checksum block is widened to whole blocks, read and checked, then sliced), or against the objects
        listed at opening (a store without manifest); a damaged, missing, changed or unreadable chunk is one error
        naming the array and the samples."""
        g = self.group()
        manifest = self.manifest()
        entry = manifest["arrays"][name] if check and manifest is not None else None
        lo, hi = start, stop
        if entry is not None:  # whole checksum blocks: a range that cuts one is read whole, never half-verified
            r = int(entry["rows"])
            lo, hi = start // r * r, min(-(-stop // r) * r, int(entry["shape"][0]))
        try:
            _testing.before_read(self.url)
            arr = g[name]  # (opening an array reads its metadata: once per read)
            if arr.metadata.zarr_format == 2:  # (v3 chunks are bounded by their codecs: scaleattn.store._bounds)
                c = int(arr.chunks[0])
                keys = [k for i in range(lo // c, -(-hi // c)) for k in _integrity.block_keys(arr, i)]
                _bounds.check_v2_chunks(self.store, arr, name, keys)
            values = np.asarray(arr[lo:hi])
        except Exception as e:  # a corrupt or missing chunk: zarr raises codec-specific types
            access = access_error(self.url, e)
            if access is not None:  # the store is unreachable, not the data bad: keep it resumable
                raise access from None
            if _integrity.checksum_failure(e):  # name the damaged chunk's samples, not the whole range read
                a, b = _damaged_chunk(g[name], lo, hi, start, stop)
                raise IntegrityError(f"{name}: samples [{a}, {b}) of {self.url} are damaged: a stored"
                                     " chunk fails its crc32c checksum") from None
            raise IntegrityError(
                f"{name}: cannot read samples [{start}, {stop}) of {self.url} ({type(e).__name__}: {e})"
            ) from None
        if entry is not None:
            _integrity.verify_rows(entry, name, values, lo, self.url,
                                   missing=functools.partial(chunk_absent, self.store, arr))
            values = values[start - lo : stop - lo]
        if self.objects:  # after the read: a rewrite before or while it ran changed the signatures too
            check_objects(self.store, arr, name, self.objects, start, stop)
        return values

    def read_chunks(self, start: int, stop: int, targets: bool = True, reuse=None):
        """Samples ``[start, stop)`` chunk by chunk: yields ``(tokens, lengths, targets)`` (numpy, as
        :meth:`read`) of each Zarr chunk's part of the range, in order.

        A chunk only partly in the range (a row group's bound cuts it, DESIGN §6) is read whole, so that its
        manifest checksum is checked as for any other chunk, and sliced: never half-verified. With ``reuse`` (a
        token, e.g. one per statistics build) and a manifest, such a cut chunk, once read and checked, is kept
        in this process (:data:`CUT_CHUNKS`, keyed by the store, its fingerprint, ``reuse``, the chunk and
        ``targets``; a few chunks, bounded bytes, thread-safe) and the next range of the same ``reuse`` that
        cuts it slices the kept arrays instead of reading, decompressing and checking it again; what it yields
        of a kept chunk are copies (the kept arrays are read-only and never handed out). Without ``reuse``
        every chunk is read; a store without a manifest is always read (its values are all its reads check).
        Raises as :meth:`read`.
        """
        c = self.chunk_samples
        keep = reuse is not None and self.manifest() is not None
        for k in range(start // c, math.ceil(stop / c)):
            a, b = k * c, min(self.n_samples, (k + 1) * c)
            lo, hi = max(start, a), min(stop, b)
            if (lo, hi) == (a, b):
                yield self.read(a, b, targets=targets)
                continue
            if not keep:
                yield tuple(None if t is None else t[lo - a : hi - a] for t in self.read(a, b, targets=targets))
                continue
            key = (self.url, _freeze(self.storage_options), self.fingerprint, reuse, k, bool(targets))
            arrays = CUT_CHUNKS.get(key)
            if arrays is None:
                arrays = CUT_CHUNKS.put(key, self.read(a, b, targets=targets))
            yield tuple(None if t is None else np.array(t[lo - a : hi - a]) for t in arrays)

    def teacher(self):
        """Ground-truth heads ``(V (H, d_out, d), Q (H, d, d))`` of a generated dataset, or None."""
        g = self.group()
        try:
            t = g["teacher"]
        except KeyError:
            return None
        arrays = (self.manifest() or {}).get("arrays", {})
        # (from the metadata, before any chunk is read)
        check_teacher(self.store, t, self.d, self.d_out, arrays, self.attrs.get("generator"))
        V, Q = np.asarray(t["V"][...]), np.asarray(t["Q"][...])
        for name, a in (("teacher/V", V), ("teacher/Q", Q)):
            if name in arrays:
                _integrity.verify_whole(arrays[name], name, a, self.url)
        return V, Q

    @property
    def attrs(self) -> dict:
        return dict(self.group().attrs)

    def first(self, n: int) -> Dataset:
        """The first ``n`` samples, as a dataset: the same store, fingerprint and checks, but ``n_samples = n``,
        so that row groups, statistics and evaluations stop at sample ``n`` (a fit's training part when the last
        samples are held out for validation, :func:`scaleattn.fit`'s ``validation``). A chunk that ``n`` cuts
        is read whole and checked, as any chunk a range cuts (:meth:`read_chunks`).

        Raises :class:`ValueError` unless ``1 <= n <= n_samples``.

        Examples
        --------
        >>> import numpy as np, scaleattn
        >>> ds = scaleattn.write_dataset("_doc_first.zarr", np.ones((5, 3, 2)), np.ones((5, 2)), overwrite=True)
        >>> ds.first(3).n_samples, ds.first(3).read(0, 3)[0].shape
        (3, (3, 3, 2))
        """
        if not 1 <= int(n) <= self.n_samples:
            raise ValueError(f"first({n}): a dataset of {self.n_samples} samples")
        return dataclasses.replace(self, n_samples=int(n))


def check_teacher(loc: Location, t, d: int, d_out: int, manifest_arrays: dict, generator=None) -> None:
    """The teacher heads ``t`` of a generated dataset are two float arrays ``V (H, d_out, d)``, ``Q (H, d, d)``
    (``H`` the ``heads`` of the ``generator`` attribute, when it says) of the shapes its manifest records,
    chunked and compressed within bounds, declaring no more than their chunks can hold
    (:mod:`scaleattn.store._bounds`): checked from the metadata, before any chunk is read."""
    try:
        V, Q = t["V"], t["Q"]
    except KeyError as e:
        raise IntegrityError(f"{loc.url}: the teacher group has no array {e}") from None
    H = int(V.shape[0]) if V.ndim == 3 else -1
    heads = generator.get("heads") if isinstance(generator, dict) else None
    if isinstance(heads, int) and not isinstance(heads, bool):
        H = heads
    stored = 0
    for name, arr, shape in (("teacher/V", V, (H, d_out, d)), ("teacher/Q", Q, (H, d, d))):
        entry = manifest_arrays.get(name)
        if entry is not None and list(arr.shape) != entry["shape"]:
            raise IntegrityError(f"{name}: shape {tuple(arr.shape)} in the metadata of {loc.url} differs from the"
                                 f" shape {tuple(entry['shape'])} written (manifest): the zarr.json was edited")
        _bounds.check_array(arr, name, loc.url, shape=shape)
        if arr.dtype.kind != "f":
            raise DatasetError(f"{name} in {loc.url}: data type {arr.dtype}, the teacher's heads are floats")
        listed = _integrity.list_chunks(loc, name)
        _bounds.check_v2_chunks(loc, arr, name, listed)
        held = _integrity.stored_bytes(listed)
        stored = None if stored is None or held is None else stored + held
    _bounds.check_ratio(f"the teacher of {loc.url}", 8 * (math.prod(V.shape) + math.prod(Q.shape)), stored)


class ChunkCache:
    """The chunks that row-group bounds cut, as read and checked (:meth:`Dataset.read_chunks` with ``reuse``):
    at most ``entries`` chunks and ``max_bytes`` in all, the least recently used dropped first; a chunk larger
    than ``max_bytes`` is not kept. Thread-safe (a worker's threads share it); ``hits`` / ``misses`` count the
    look-ups (the benchmark reports them)."""

    def __init__(self, entries: int, max_bytes: float):
        self.entries, self.max_bytes = int(entries), float(max_bytes)
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, key):
        with self._lock:
            arrays = self._items.get(key)
            if arrays is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return arrays

    def put(self, key, arrays: tuple) -> tuple:
        """Keep ``arrays`` (made read-only) under ``key``; returns them."""
        n = sum(int(t.nbytes) for t in arrays if t is not None)
        for t in arrays:
            if t is not None:
                t.setflags(write=False)
        with self._lock:
            if n <= self.max_bytes and key not in self._items:
                self._items[key] = arrays
                self._bytes += n
                while len(self._items) > self.entries or self._bytes > self.max_bytes:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= sum(int(t.nbytes) for t in old if t is not None)
        return arrays

    def forget(self, reuse) -> None:
        """Drop the chunks kept for ``reuse`` (a build that finished)."""
        with self._lock:
            for key in [k for k in self._items if k[3] == reuse]:
                old = self._items.pop(key)
                self._bytes -= sum(int(t.nbytes) for t in old if t is not None)


#: this process's cut chunks (:meth:`Dataset.read_chunks`): groups run in order, so the next group of a process
#: (in process the next one, on a worker of two usually the next but one) starts in the chunk the last one cut;
#: two entries for a worker's second thread (or a tile's task without targets)
CUT_CHUNKS = ChunkCache(entries=2, max_bytes=256 * 2**20)


def _freeze(opts):
    """Hashable form of fsspec options (nested dicts such as s3fs ``client_kwargs`` included), None if not JSON."""
    try:
        return json.dumps(opts or {}, sort_keys=True)
    except TypeError:
        return None


@functools.lru_cache(maxsize=16)
def _open_verified(url, frozen_opts, fp):
    """:func:`_open_and_verify`, cached per process by URL, options and fingerprint: the check and the group it
    vouches for are one cache entry, so a group evicted and opened again is checked again."""
    return _open_and_verify(Location(url, json.loads(frozen_opts) or None), fp)


def _open_and_verify(loc: Location, fp: str):
    """The group at ``loc`` opened read-only, checked to have fingerprint ``fp`` (unless empty)."""
    try:
        g = loc.open_group("r")
    except Exception as e:
        access = access_error(loc.url, e)
        if access is not None:
            raise access from None
        raise IntegrityError(f"{here()}: cannot open the dataset {loc.url} ({type(e).__name__}: {e}): the workers"
                             " must see the same store as the client (a shared file system or an object store"
                             " URL)") from None
    if fp:
        verify_identity(fp, fingerprint(loc, g), loc.url)
    return g


#: what a dataset entry says to a caller who passed arrays (:func:`check_dataset_argument`)
ARRAYS_INSTEAD = ("; for arrays in memory use scaleattn.MHLARegressor().fit(tokens, targets), or write them as a"
                  " dataset first (scaleattn.write_dataset(path, tokens, targets), or `scaleattn import`)")


def check_dataset_argument(value, entry: str) -> None:
    """Refuse, in one line, a ``dataset`` that is neither a :class:`Dataset` nor a store's path or URL (arrays, a
    tuple of them, a dict), naming ``entry`` and pointing to what takes arrays
    (:func:`scaleattn.store._location.check_path`).

    Raises
    ------
    ParameterError
        E.g. ``fit takes a dataset (a Zarr store's path or URL, or a Dataset), not a numpy.ndarray of shape
        (512, 100, 2); for arrays in memory use scaleattn.MHLARegressor()...``.
    """
    if not isinstance(value, Dataset):
        check_path(value, entry, "a dataset (a Zarr store's path or URL, or a Dataset)", ARRAYS_INSTEAD)


def open_dataset(url: str, storage_options: dict | None = None, *, fill_absent_chunks: bool = False) -> Dataset:
    """Open and validate the structure of a dataset group (shapes, dtypes, metadata, attributes, that every
    chunk is stored; values are checked when rows are read).

    Parameters
    ----------
    url : str, path-like or Location
        Local path or fsspec URL (``s3://bucket/data.zarr``) of a Zarr v3 group; local paths are made absolute.
    storage_options : dict or list of "KEY=VALUE", optional
        fsspec options (endpoint, credentials) for URLs (:func:`scaleattn._params.parse_storage_options`).
    fill_absent_chunks : bool
        For stores written by other tools (no manifest): absent chunks mean the fill value (for writers that
        skip empty chunks). By default they are refused. Stores scaleattn wrote are always complete.

    Returns
    -------
    Dataset

    Raises
    ------
    ParameterError
        A file, or a path through a file, where the store (a directory) goes.
    DatasetError
        Not a Zarr group, corrupt metadata, missing ``tokens``, wrong number of dimensions, non-float dtype,
        mismatched sample counts, T or d_out mismatch, an empty dataset, an attribute of the wrong type.
    IntegrityError
        Absent chunks (naming the array and the sample range), a shape that differs from the manifest.
    StorageError
        The store cannot be reached.

    See Also
    --------
    write_dataset, scaleattn.generate.generate_mhla, scaleattn.importers.import_arrays : ways to make one.

    Examples
    --------
    >>> ds = open_dataset("data.zarr")  # doctest: +SKIP
    >>> ds.n_samples, ds.length, ds.d, ds.d_out  # doctest: +SKIP
    (512, 100, 2, 2)
    """
    check_dataset_argument(url, "open_dataset")
    check_storage_options(storage_options, url)  # (fsspec's options of a local path: ignored, so refused)
    loc = resolve(url, storage_options)
    url = loc.url
    check_kind(loc, "dataset", "a Zarr store (a directory)", directory=True)  # a file: say so, not "not a group"
    if not loc.exists():
        raise DatasetError(f"{url}: no such dataset{did_you_mean(url)}")
    try:
        g = loc.open_group("r")
    except StorageError:  # (already one line naming the entry: a FIFO or a broken link in the store)
        raise
    except Exception as e:  # zarr raises several types for a non-group / corrupt metadata
        if loc.join("report.json").exists():  # (a run directory given where its dataset goes)
            raise DatasetError(f"{url}: a run directory, not a dataset (its report names the dataset it"
                               " fitted)") from None
        raise DatasetError(f"{url}: not a readable Zarr group ({type(e).__name__}: {e})") from None
    try:
        names = set(g.array_keys())
    except Exception as e:
        raise DatasetError(f"{url}: corrupt Zarr metadata ({type(e).__name__}: {e})") from None
    present = [n for n in ARRAYS if n in names]
    check_consolidated(loc, g, present)  # the arrays and shapes zarr reads are the group's own, before any use
    for name in ("tokens", "lengths", "targets"):  # zarr skips members whose metadata it cannot parse
        if name not in names and loc.join(f"{name}/zarr.json").exists():
            raise DatasetError(f"{name}: corrupt Zarr metadata in {url} (not a readable array)")
    if "tokens" not in names:
        fmt = g.attrs.get("format")  # another store of scaleattn's given where a dataset goes: say which
        kind = fmt[len(_formats.PREFIX):] if isinstance(fmt, str) and fmt.startswith(_formats.PREFIX) and \
            fmt != FORMAT else None
        raise DatasetError(f"{url}: a {kind} store, not a dataset" if kind else
                           f"{url}: missing array 'tokens' (found: {sorted(names) or 'none'})")

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
    manifest = attrs.get(_integrity.MANIFEST)
    listings = check_chunks(loc, g, present, manifest, bool(fill_absent_chunks))
    chunk = int(tok.chunks[0])
    ds = Dataset(loc, N, T, d, d_out, causal, has_lengths, chunk, fingerprint(loc, g), bool(fill_absent_chunks),
                 () if manifest is not None else object_digests(loc, g, listings))
    ds.teacher()  # small: checked now rather than after the build
    return ds
