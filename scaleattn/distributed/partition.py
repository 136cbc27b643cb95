"""How a build is cut into tasks (DESIGN §6): row groups of equal work (feature rows), and column tiles
of the compact Gram. Both depend only on the dataset and the tile size, never on the workers, so the reduction
tree and the statistics' bits are the same for any cluster, retry or resume.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ParameterError
from ..features import n_pairs

__all__ = ["row_groups", "tile_bounds", "MAX_TILE_BYTES", "TILED_MAX_GROUPS", "MIN_GROUPS", "GROUP_BYTES",
           "SNAP_CHUNKS"]

#: the compact Gram is split into column tiles when it is larger than this (bytes, DESIGN §6)
MAX_TILE_BYTES = 256e6
#: default cap on the number of row groups when tiled: parallelism then comes from the tiles, and the number
#: of partials (and of checkpointed bytes) stays groups x |Tc| instead of chunks x |Tc|
TILED_MAX_GROUPS = 16
#: default number of row groups of a small dataset: 1, 2, 4, 8 or 16 workers get equal shares, any other number
#: of workers is within one group (1/16 of the work) of it; a dataset of fewer samples has one per sample
MIN_GROUPS = 16
#: above MIN_GROUPS x this many bytes of float64 tokens, groups of about this size (task and checkpoint grain)
GROUP_BYTES = 32e6
#: with at least this many Zarr chunks per group, group bounds move to the nearest chunk boundary (no chunk is
#: then read by two tasks; groups differ by at most one chunk, 1/SNAP_CHUNKS of their rows); with fewer, groups
#: cut chunks and the chunk at a cut is read (and decompressed, and checked) by both tasks
SNAP_CHUNKS = 8


def row_groups(dataset, group_samples: int | None = None, max_groups: int | None = None) -> list[tuple[int, int]]:
    """Split the samples into contiguous groups ``[a, b)`` of (nearly) equal feature rows, one Dask task each.

    The split depends only on the dataset (its shape, chunking and, for causal data with lengths, the lengths),
    never on the number of workers, so the reduction tree and the statistics are bit-identical across worker
    counts, retries and resumes (DESIGN §6); a checkpoint records it and refuses a build that splits otherwise.

    Parameters
    ----------
    dataset : Dataset
        From :func:`scaleattn.open_dataset`.
    group_samples : int, optional
        Exactly this many samples per group (the last one the remainder), chunks cut where they fall.
    max_groups : int, optional
        At most this many groups by default (a tiled build, ``TILED_MAX_GROUPS``).

    Returns
    -------
    list of (int, int)
        Consecutive sample ranges covering ``[0, N)`` once, none empty. By default ``n`` = max(``MIN_GROUPS``,
        float64 token bytes / ``GROUP_BYTES``) groups (at most ``max_groups``, at most one per sample) whose
        feature rows (T per causal sample, its length with lengths, 1 per last-token sample) differ from
        ``rows / n`` by less than one sample's rows; with ``SNAP_CHUNKS`` chunks per group or more, the bounds
        are moved to the nearest chunk boundary instead.

    Raises
    ------
    ParameterError
        ``group_samples`` below 1.
    """
    N, chunk = dataset.n_samples, dataset.chunk_samples
    if group_samples is not None:
        if int(group_samples) < 1:
            raise ParameterError(f"group_samples must be >= 1, got {group_samples}")
        gs = int(group_samples)
        return [(a, min(N, a + gs)) for a in range(0, N, gs)]
    n = max(MIN_GROUPS, math.ceil(8.0 * N * dataset.length * dataset.d / GROUP_BYTES))
    n = min(n, N, max_groups or n)
    if dataset.causal and dataset.has_lengths:
        bounds = _row_bounds(dataset, n)
    else:  # equal rows per sample: groups of floor or ceil(N / n) samples
        bounds = [(k * N) // n for k in range(1, n)]
    if dataset.n_chunks >= SNAP_CHUNKS * n:
        bounds = [min(N, chunk * round(b / chunk)) for b in bounds]
    edges = sorted({0, N, *bounds})
    return list(zip(edges[:-1], edges[1:]))


def _row_bounds(dataset, n: int) -> list[int]:
    """The ``n - 1`` inner bounds of ``n`` groups of nearly equal rows of a causal dataset with lengths: the
    sample before which the running row count is nearest to ``k * rows / n``. Reads the lengths chunk by chunk
    twice (their sums, then the chunks where a bound falls), checked as every read: memory of one chunk, whatever
    ``N``."""
    chunk, N = dataset.chunk_samples, dataset.n_samples
    sums = np.array([int(dataset.read_lengths(a, min(N, a + chunk)).sum()) for a in range(0, N, chunk)],
                    dtype=np.int64)
    before = np.concatenate([[0], np.cumsum(sums)])  # rows before each chunk
    total = int(before[-1])
    bounds, last, cum = [], -1, None
    for k in range(1, n):
        want = k * total / n
        c = min(int(np.searchsorted(before, want, side="right")) - 1, len(sums) - 1)
        a = c * chunk
        if c != last:  # bounds ascend: several falling in one chunk read it once
            cum = before[c] + np.concatenate([[0], np.cumsum(dataset.read_lengths(a, min(N, a + chunk)))])
            last = c
        i = int(np.argmin(np.abs(cum - want)))  # first of the nearest: deterministic
        bounds.append(a + i)
    return bounds


def tile_bounds(d: int, tile_rows: int | None = None,
                max_tile_bytes: float | None = MAX_TILE_BYTES) -> list[tuple[int, int]]:
    """Row ranges ``[c0, c1)`` of the compact Gram ``Tc`` (= column ranges of ``u = vech(s s^T)``), DESIGN §6.

    One tile ``[(0, m(m+1)/2)]`` while ``Tc`` fits in ``max_tile_bytes`` (None: never tile); otherwise tiles of
    ``tile_rows`` rows (default: as many as fit in ``max_tile_bytes``), all equal but the last. At d = 64
    (``Tc`` 36 GB) the default gives 141 tiles of 256 MB.
    """
    m = n_pairs(d)
    mm, nv = m * (m + 1) // 2, d * (d + 1) // 2
    if tile_rows is None:
        if max_tile_bytes is None or 8 * mm * nv <= max_tile_bytes:
            return [(0, mm)]
        tile_rows = int(max_tile_bytes // (8 * nv))
    tile_rows = max(1, min(int(tile_rows), mm))
    return [(c, min(mm, c + tile_rows)) for c in range(0, mm, tile_rows)]
