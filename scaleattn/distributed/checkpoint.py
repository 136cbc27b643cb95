"""Checkpoints of a statistics build: every finished (row group, tile) partial in one Zarr store (DESIGN §6).

Layout of a checkpoint group (Zarr v3)::

    gram_compact  float64 (groups, m(m+1)/2, d(d+1)/2)  chunks (1, tile rows, d(d+1)/2): one chunk per partial
    moments       float64 (groups, psi, d_out)          chunks (1, psi, d_out)    written by tile 0 (if d_out > 0)
    yy            float64 (groups,)                     chunks (1,)               written by tile 0
    n_rows        int64   (groups, tiles)               chunks (1, 1)
    done          bool    (groups, tiles)               chunks (1, 1)             set AFTER the partial is written

A missing chunk key is not proof of "not done" (zarr skips chunks equal to the fill value, so an all-zero
partial has no key); only ``done`` says what is finished. The attributes fix the dataset fingerprint (N, T, d,
d_out, chunking, dataset uid), the row-group and tile boundaries, the scaleattn version and the format version;
a store that disagrees on any of them is refused with a :class:`~scaleattn.errors.CheckpointError`, never mixed
in. Workers write their own partials (the client never holds them all); every write covers exactly one chunk of
each array. Layer L3.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import _formats
from .._storage import Location
from .._version import __version__
from ..errors import CheckpointError
from ..features import n_features, n_pairs
from ..statistics import Statistics

__all__ = ["Checkpoint"]

FORMAT, FORMAT_VERSION = _formats.CHECKPOINT


def _layout(dataset, groups, tiles, targets: bool) -> dict:
    """The attributes a checkpoint must match to be reused (JSON-compatible)."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "scaleattn_version": __version__,
            "dataset_fingerprint": dataset.fingerprint, "d": int(dataset.d),
            "d_out": int(dataset.d_out) if targets else 0,
            "groups": [[int(a), int(b)] for a, b in groups], "tiles": [[int(a), int(b)] for a, b in tiles]}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Handle on a checkpoint store (cheap to pickle to Dask workers).

    Attributes: ``store`` (:class:`~scaleattn._storage.Location`), ``groups`` (sample ranges), ``tiles`` (row
    ranges of ``Tc``), ``d``, ``d_out`` (0 for a Gram-only build).
    """

    store: Location
    groups: tuple
    tiles: tuple
    d: int
    d_out: int

    @property
    def url(self) -> str:
        return self.store.url

    @classmethod
    def open(cls, store: Location, dataset, groups, tiles, targets: bool = True) -> Checkpoint:
        """Open the checkpoint at ``store`` for this build, creating it when absent.

        ``groups`` from :func:`scaleattn.distributed.build.row_groups`, ``tiles`` from
        :func:`scaleattn.distributed.build.tile_bounds` (equal widths except the last, so each partial is one
        chunk).

        Raises
        ------
        CheckpointError
            The store exists but was made from another dataset, chunking, grouping, tiling or version, or is
            not a checkpoint at all (the message names the first field that differs).
        """
        url = store.url
        want = _layout(dataset, groups, tiles, targets)
        ck = cls(store, tuple(map(tuple, want["groups"])), tuple(map(tuple, want["tiles"])), want["d"],
                 want["d_out"])
        if store.exists():
            try:
                have = dict(store.open_group("r").attrs)
            except Exception as e:  # not a zarr group
                raise CheckpointError(f"checkpoint {url!r} is not a scaleattn checkpoint ({e}); remove it or start over"
                                 " with --overwrite") from None
            for k, v in want.items():
                if have.get(k) != v:
                    shown = (lambda x: x if len(repr(x)) < 80 else repr(x)[:77] + "...")
                    raise CheckpointError(
                        f"checkpoint {url!r} was made by a different build ({k}: stored {shown(have.get(k))!r}, this "
                        f"job {shown(v)!r}); it is never mixed in: remove it, or start over with --overwrite")
            return ck
        ck._create(want)
        return ck

    def _create(self, attrs: dict) -> None:
        m = n_pairs(self.d)
        mm, nv = m * (m + 1) // 2, self.d * (self.d + 1) // 2
        ng, nt = len(self.groups), len(self.tiles)
        tile_rows = self.tiles[0][1] - self.tiles[0][0]
        if any(b - a != tile_rows for a, b in self.tiles[:-1]):
            raise CheckpointError("checkpoint tiles must have equal widths (except the last) to align with chunks")
        g = self.store.open_group("w")
        g.create_array("gram_compact", shape=(ng, mm, nv), chunks=(1, tile_rows, nv), dtype="float64",
                       fill_value=0.0, dimension_names=("group", "vech_pair", "vech_token"))
        if self.d_out:
            g.create_array("moments", shape=(ng, n_features(self.d), self.d_out),
                           chunks=(1, n_features(self.d), self.d_out),
                           dtype="float64", fill_value=0.0, dimension_names=("group", "feature", "output"))
        g.create_array("yy", shape=(ng,), chunks=(1,), dtype="float64", fill_value=0.0, dimension_names=("group",))
        g.create_array("n_rows", shape=(ng, nt), chunks=(1, 1), dtype="int64", fill_value=0,
                       dimension_names=("group", "tile"))
        g.create_array("done", shape=(ng, nt), chunks=(1, 1), dtype="bool", fill_value=False,
                       dimension_names=("group", "tile"))
        # the layout attributes last: a creation cut short has none and is refused, never resumed
        g.attrs.update({**attrs, "description": "partial statistics of a scaleattn build, one chunk per (group, tile)"})

    def _group(self, mode: str = "r"):
        return self.store.open_group(mode)

    def done_mask(self) -> np.ndarray:
        """(groups, tiles) bool: True where the partial is complete in the store."""
        return np.asarray(self._group()["done"][...], dtype=bool)

    def is_done(self, gi: int, ti: int) -> bool:
        return bool(self._group()["done"][gi, ti])

    def write(self, gi: int, ti: int, part) -> None:
        """Store the partial :class:`~scaleattn.statistics.Statistics` of group ``gi``, tile ``ti`` (host arrays),
        then mark it done. Each array write covers exactly one chunk."""
        g = self._group("r+")
        c0, c1 = self.tiles[ti]
        g["gram_compact"][gi : gi + 1, c0:c1, :] = np.asarray(part.gram_compact)[None]
        if ti == 0:
            if self.d_out:
                g["moments"][gi : gi + 1] = np.asarray(part.moments)[None]
            g["yy"][gi : gi + 1] = np.array([part.yy], dtype=np.float64)
        g["n_rows"][gi : gi + 1, ti : ti + 1] = np.array([[part.n_rows]], dtype=np.int64)
        g["done"][gi : gi + 1, ti : ti + 1] = np.ones((1, 1), dtype=bool)

    def read(self, gi: int, ti: int):
        """The stored partial of group ``gi``, tile ``ti`` (bit-identical to what :meth:`write` got).

        Raises :class:`~scaleattn.errors.CheckpointError` if it is not marked done."""
        g = self._group()
        if not bool(g["done"][gi, ti]):
            raise CheckpointError(f"checkpoint {self.url!r}: group {gi} tile {ti} is not done")
        c0, c1 = self.tiles[ti]
        gram = np.asarray(g["gram_compact"][gi, c0:c1, :])
        d_out = self.d_out if ti == 0 else 0
        moments = np.asarray(g["moments"][gi]) if (ti == 0 and self.d_out) else np.zeros((n_features(self.d), d_out))
        yy = float(g["yy"][gi]) if ti == 0 else 0.0
        return Statistics(gram, moments, yy, int(g["n_rows"][gi, ti]), self.d)
