"""How a build is cut into tasks (layer L3; DESIGN §6): row groups of whole Zarr chunks, and column tiles of the
compact Gram. Both depend only on the dataset and the tile size, never on the workers, so the reduction tree
and the statistics' bits are the same for any cluster, retry or resume.
"""
from __future__ import annotations

import math

from ..features import n_pairs

__all__ = ["row_groups", "tile_bounds", "MAX_TILE_BYTES", "TILED_MAX_GROUPS"]

#: the compact Gram is split into column tiles when it is larger than this (bytes, DESIGN §6)
MAX_TILE_BYTES = 256e6
#: default cap on the number of row groups when tiled: parallelism then comes from the tiles, and the number
#: of partials (and of checkpointed bytes) stays groups x |Tc| instead of chunks x |Tc|
TILED_MAX_GROUPS = 16


def row_groups(dataset, group_samples: int | None = None, max_groups: int | None = None) -> list[tuple[int, int]]:
    """Split samples into contiguous groups of whole Zarr chunks (one Dask task each).

    The split depends only on the dataset (never on the number of workers), so the reduction tree and the
    statistics are bit-identical across worker counts, retries and resumes (DESIGN §6). By default about
    32 MB of tokens per group, and at least 8 groups when the dataset has 8 chunks; ``max_groups`` enlarges
    the default groups so that there are at most that many.
    """
    N, chunk = dataset.n_samples, dataset.chunk_samples
    if group_samples is None:
        bytes_per_chunk = 8 * chunk * dataset.length * dataset.d
        per = max(1, int(32e6 // bytes_per_chunk))
        per = min(per, max(1, math.ceil(dataset.n_chunks / 8)))
        if max_groups:
            per = max(per, math.ceil(dataset.n_chunks / max_groups))
        group_samples = per * chunk
    group_samples = max(chunk, (int(group_samples) // chunk) * chunk)
    return [(a, min(N, a + group_samples)) for a in range(0, N, group_samples)]


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
