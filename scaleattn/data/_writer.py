"""Writing MHLA datasets (after :mod:`scaleattn.data._dataset`): create a group with the layout of DESIGN §7,
write it in blocks aligned to its chunks and shards with the crc32c codec and a manifest of what it holds, or
write whole arrays atomically (:func:`write_dataset`)."""
from __future__ import annotations

import math
import uuid

import numpy as np

from ..errors import ParameterError
from ..store import _formats, _integrity
from ..store._location import Location, check_path, check_storage_options, resolve
from ..store._outputs import atomic_output
from ._checks import check_arrays, check_lengths, check_values
from ._dataset import DIMS, FORMAT, FORMAT_VERSION, Dataset, open_dataset

__all__ = ["create_dataset", "write_dataset", "write_block", "write_unit", "write_teacher", "finish_dataset",
           "default_chunk_samples"]


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
    Both are clamped to ``n_samples`` (the shard to the largest multiple of the chunk not above it).
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
    # never larger than the samples: a chunk (shard) beyond the array is refused by the store bounds
    # (scaleattn.store._bounds) and zarr would allocate it whole when writing its part
    chunk = min(chunk, max(1, int(n_samples)))
    if shard_samples is not None:
        shard_samples = min(int(shard_samples), max(chunk, int(n_samples) // chunk * chunk))

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
    targets : (N, d_out), (N,) or (N, T, d_out) float, optional
        ``(N,)`` (one output, as scikit-learn's ``y``) is stored as ``(N, 1)``.
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
    check_path(url, "write_dataset", "as `url` the output store's path or URL (the arrays come after it)")
    check_storage_options(storage_options, url)  # (fsspec's options reach URLs only)
    loc = resolve(url, storage_options)
    if getattr(targets, "ndim", None) == 1:  # one output per sample, as scikit-learn's y: stored (N, 1)
        targets = targets[:, None]
    N, T, d, d_out, causal = check_arrays(tokens, targets, lengths)
    with atomic_output(loc, overwrite, _formats.DATASET[0]) as tmp:
        g = create_dataset(
            tmp, N, T, d, d_out, causal=causal, lengths=lengths is not None, chunk_samples=chunk_samples,
            shard_samples=shard_samples, attrs=attrs,
        )
        chunk = write_unit(g)
        step = chunk * max(1, int(64e6 // (8 * T * d * chunk)))  # whole chunks and shards, ~64 MB per slab
        sums = {}
        for a in range(0, N, step):
            b = min(N, a + step)
            tok, y = np.asarray(tokens[a:b]), None if targets is None else np.asarray(targets[a:b])
            lens = None if lengths is None else np.asarray(lengths[a:b])
            check_values("tokens", tok, a)  # (before the conversion: integers beyond 2^53 would be rounded by it)
            if y is not None:
                check_values("targets", y, a)
            tok, y = tok.astype(np.float64, copy=False), None if y is None else y.astype(np.float64, copy=False)
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
