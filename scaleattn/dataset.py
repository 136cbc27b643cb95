"""MHLA datasets as Zarr v3 groups (DESIGN §7): open, validate, read row blocks, write.

Layout of a dataset group::

    tokens   float (N, T, d)        dims ("sample", "position", "embed"), chunked along N
    lengths  int   (N,)             optional; 1 <= lengths <= T, padding positions are zero and ignored
    targets  float (N, d_out)       last-token data, dims ("sample", "output")
             float (N, T, d_out)    causal (prefix) data, dims ("sample", "position", "output")
    teacher/V (H, d_out, d), teacher/Q (H, d, d)   optional ground truth of generated data

Group attributes: ``format = "scaleattn-dataset"``, ``format_version``, ``causal`` and free-form metadata.
Input stores are only ever opened read-only. Layer L1.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import uuid

import numpy as np

from . import _formats
from ._storage import Location, access_error, atomic_output, resolve
from .errors import DatasetError, IntegrityError, ParameterError

__all__ = ["Dataset", "DatasetError", "open_dataset", "create_dataset", "write_dataset", "write_block",
           "write_unit", "write_teacher", "check_arrays", "default_chunk_samples", "DIMS"]

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
        Shapes, chunking and the store's uid (identifies the content the checkpoints and task keys refer to).

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
        """The Zarr group, opened read-only (cached per process)."""
        frozen = _freeze(self.storage_options)
        if frozen is None:  # options that are not plain data (objects): open without the cache
            return self.store.open_group("r")
        return _open_cached(self.url, frozen, self.fingerprint)  # a store overwritten in place gets a new uid

    def read(self, start: int, stop: int, targets: bool = True, check: bool = True):
        """Read samples ``[start, stop)``: ``(tokens, lengths, targets)`` as numpy arrays.

        ``lengths`` / ``targets`` are None when absent (or not requested). With ``check``, values are
        validated and a :class:`DatasetError` names the array and the first bad (global) sample index.
        """
        g = self.group()

        def get(name):
            try:
                return np.asarray(g[name][start:stop])
            except Exception as e:  # a corrupt or missing chunk: zarr raises codec-specific types
                access = access_error(self.url, e)
                if access is not None:  # the store is unreachable, not the data bad: keep it resumable
                    raise access from None
                raise IntegrityError(
                    f"{name}: cannot read samples [{start}, {stop}) of {self.url} ({type(e).__name__}: {e})"
                ) from None

        tok = get("tokens")
        lens = get("lengths") if self.has_lengths else None
        y = get("targets") if (targets and self.has_targets) else None
        if check:
            _check_values("tokens", tok, start)
            if lens is not None:
                _check_lengths(lens, start, self.length)
            if y is not None:
                _check_values("targets", y, start)
        return tok, lens, y

    def teacher(self):
        """Ground-truth heads ``(V (H, d_out, d), Q (H, d, d))`` of a generated dataset, or None."""
        g = self.group()
        try:
            t = g["teacher"]
            return np.asarray(t["V"][...]), np.asarray(t["Q"][...])
        except KeyError:
            return None

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


def _check_values(name, a, start):
    if a.ndim == 0 or a.shape[0] == 0:
        return
    ok = np.isfinite(a).reshape(a.shape[0], -1).all(axis=1)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise DatasetError(f"{name}: sample {start + i} contains NaN or Inf")


def _check_lengths(lens, start, T):
    bad = np.flatnonzero((lens < 1) | (lens > T))
    if bad.size:
        i = int(bad[0])
        raise DatasetError(f"lengths: sample {start + i} has length {int(lens[i])}, expected 1 <= length <= T = {T}")


def _is_real(dtype) -> bool:
    """Real numbers: floating point or integer (read as float64); bool, complex, string and object refused."""
    try:
        return np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)
    except TypeError:  # dtypes numpy cannot classify (zarr string / bytes types)
        return False


def check_arrays(tokens, targets=None, lengths=None) -> tuple[int, int, int, int, bool]:
    """Check shapes and dtypes of dataset arrays (anything with ``shape``/``ndim``/``dtype``: zarr, numpy,
    dask) against the layout of DESIGN §7; values are not read. Returns ``(N, T, d, d_out, causal)``.

    Raises
    ------
    DatasetError
        Wrong number of dimensions, a ``tokens``/``targets`` dtype that is not real numbers (bool, complex,
        string, object; integers are read as float64), a non-integer ``lengths``, mismatched sample counts, a
        ``targets`` T or d_out of 0 / mismatch,
        an empty dataset.
    """
    if tokens.ndim != 3:
        raise DatasetError(f"tokens: expected 3 dimensions (sample, position, embed), got shape {tokens.shape}")
    if not _is_real(tokens.dtype):
        raise DatasetError(f"tokens: expected a float (or integer) dtype, got {tokens.dtype}")
    N, T, d = (int(n) for n in tokens.shape)
    if N == 0 or T == 0 or d == 0:
        raise DatasetError(f"tokens: empty dataset (shape {tokens.shape})")
    if lengths is not None:
        if lengths.ndim != 1 or lengths.shape[0] != N:
            raise DatasetError(f"lengths: expected shape ({N},) to match tokens, got {lengths.shape}")
        try:
            is_int = np.issubdtype(lengths.dtype, np.integer)
        except TypeError:
            is_int = False
        if not is_int:
            raise DatasetError(f"lengths: expected an integer dtype, got {lengths.dtype}")
    d_out, causal = 0, False
    if targets is not None:
        if not _is_real(targets.dtype):
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


def open_dataset(url: str, storage_options: dict | None = None) -> Dataset:
    """Open and validate the structure of a dataset group (shapes, dtypes, metadata; values are checked
    when rows are read).

    Parameters
    ----------
    url : str, path-like or Location
        Local path or fsspec URL (``s3://bucket/data.zarr``) of a Zarr v3 group; local paths are made absolute.
    storage_options : dict or list of "KEY=VALUE", optional
        fsspec options (endpoint, credentials) for URLs (:func:`scaleattn._storage.parse_storage_options`).

    Returns
    -------
    Dataset

    Raises
    ------
    DatasetError
        Not a Zarr group, corrupt metadata, missing ``tokens``, wrong number of dimensions, non-float dtype,
        mismatched sample counts, T or d_out mismatch, an empty dataset.
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
    if d_out == 0:
        causal = bool(g.attrs.get("causal", False))
    chunk = int(tok.chunks[0])
    fp = f"{N}x{T}x{d}:{d_out}:{int(causal)}:{int(has_lengths)}:{chunk}:{g.attrs.get('uid', '')}"
    return Dataset(loc, N, T, d, d_out, causal, has_lengths, chunk, fp)


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
    Write it with :func:`write_block` in slabs aligned to chunks and shards. Use through :func:`write_dataset`
    or the generators, which wrap it in an atomic output. Raises :class:`ParameterError` for a bad chunk or
    shard size.
    """
    loc = resolve(loc)
    chunk = int(chunk_samples or default_chunk_samples(length, d))
    if chunk < 1:
        raise ParameterError(f"chunk_samples must be >= 1, got {chunk_samples}")
    if shard_samples is not None and (shard_samples < chunk or shard_samples % chunk):
        raise ParameterError(f"shard_samples = {shard_samples} must be a multiple of chunk_samples = {chunk}")

    def layout(shape):  # chunks (and shards) along the sample axis only
        kw = {"chunks": (chunk,) + tuple(shape[1:])}
        if shard_samples is not None:
            kw["shards"] = (int(shard_samples),) + tuple(shape[1:])
        return kw

    g = loc.open_group("w")
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "causal": bool(causal), "uid": uuid.uuid4().hex}
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


def write_block(group, start: int, tokens, targets=None, lengths=None) -> None:
    """Write samples ``[start, start + len(tokens))``; ``start`` and ``len(tokens)`` must be multiples of
    :func:`write_unit` (the last block may end at N), so every write covers whole chunks and shards and no two
    writers share one: misaligned writes lose data. Raises ``ValueError`` otherwise."""
    chunk = write_unit(group)
    n = len(tokens)
    if start % chunk or (n % chunk and start + n != group["tokens"].shape[0]):
        raise ValueError(f"write_block: rows [{start}, {start + n}) are not aligned to chunks/shards of {chunk}")
    group["tokens"][start : start + n] = np.asarray(tokens, dtype=np.float64)
    if lengths is not None:
        group["lengths"][start : start + n] = np.asarray(lengths, dtype=np.int64)
    if targets is not None:
        group["targets"][start : start + n] = np.asarray(targets, dtype=np.float64)


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

    See Also
    --------
    open_dataset : open an existing dataset.
    scaleattn.importers.import_arrays : the same from a ``.npz`` file.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> ds = write_dataset("_doc_tiny.zarr", rng.standard_normal((8, 5, 2)), rng.standard_normal((8, 2)),
    ...                    overwrite=True)
    >>> ds.n_samples, ds.d_out
    (8, 2)
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
        for a in range(0, N, step):
            b = min(N, a + step)
            tok = np.asarray(tokens[a:b], dtype=np.float64)
            y = None if targets is None else np.asarray(targets[a:b], dtype=np.float64)
            lens = None if lengths is None else np.asarray(lengths[a:b])
            _check_values("tokens", tok, a)
            if y is not None:
                _check_values("targets", y, a)
            if lens is not None:
                _check_lengths(lens, a, T)
            write_block(g, a, tok, y, lens)
        if teacher is not None:
            write_teacher(g, *teacher)
    return open_dataset(loc)


def write_teacher(group, V, Q) -> None:
    """Store ground-truth heads ``V`` (H, d_out, d) and ``Q`` (H, d, d) under ``teacher/``."""
    t = group.create_group("teacher", attributes={"description": "ground-truth MHLA heads of the generator"})
    t.create_array("V", data=np.asarray(V, np.float64), dimension_names=("head", "output", "embed"),
                   attributes={"description": "teacher value/output matrices V_h"})
    t.create_array("Q", data=np.asarray(Q, np.float64), dimension_names=("head", "embed", "embed_2"),
                   attributes={"description": "teacher fused key-query matrices Q_h"})
