"""Checkpoints of a statistics build: every finished (row group, tile) partial in one Zarr store (DESIGN §6).

Layout of a checkpoint group (Zarr v3, format v2, every array with the crc32c codec)::

    gram_compact  float64 (groups, m(m+1)/2, d(d+1)/2)  chunks (1, tile rows, d(d+1)/2): one chunk per partial
    moments       float64 (groups, psi, d_out)          chunks (1, psi, d_out)    written by tile 0 (if d_out > 0)
    yy            float64 (groups,)                     chunks (1,)               written by tile 0
    n_rows        int64   (groups, tiles)               chunks (1, 1)
    source        int64   (groups, tiles)               chunks (1, 1)   digest of the input rows the partial read
    checksum      int64   (groups, tiles)               chunks (1, 1)   digest of the partial itself (and source)
    run           int64   (groups, tiles)               chunks (1, 1)   token of the build that wrote it
    done          bool    (groups, tiles)               chunks (1, 1)   set AFTER the partial is written

A missing chunk key is not proof of "not done" (zarr skips chunks equal to the fill value, so an all-zero
partial has no key); only ``done`` says what is finished, and a done partial is reused only when its
``source`` is the digest of the input rows as they are now (the storage signatures of the dataset chunks it
read, and their manifest checksums: :func:`scaleattn.distributed.build.row_bindings`) and it passes its own
``checksum`` and expected row count. Anything else is recomputed. The attributes fix the dataset fingerprint,
the row-group and tile boundaries, the scaleattn version and the format version; a store that disagrees on any
of them (or a v1 checkpoint, whose partials cannot be verified) is refused with a
:class:`~scaleattn.errors.CheckpointError`, never mixed in. The attribute ``kernel`` names the statistics kernel
that built the partials (:func:`scaleattn.statistics._kernel.kernel_name`; a checkpoint without it was built by
``"numpy"``, the only kernel then), ``kernel_revision`` its arithmetic
(:data:`scaleattn.statistics._kernel.KERNEL_REVISIONS`;
none: revision 1): a resume with the other kernel, or another revision of it, is refused too, since its partials
would differ from a fresh build's in the last bits. Workers write their own partials (the client never
holds them all), after checking that the store they opened is the one the client created (its ``uid``);
every write covers exactly one chunk of each array. Layer L3.
"""
from __future__ import annotations

import dataclasses
import uuid

import numpy as np

from .._version import __version__
from ..data._checks import here
from ..errors import CheckpointError
from ..features import n_features, n_pairs
from ..statistics._container import Statistics
from ..statistics._kernel import KERNEL_REVISIONS, kernel_name
from ..store import _bounds, _formats, _integrity
from ..store._location import Location
from ..store._outputs import writing

__all__ = ["Checkpoint", "partial_checksum"]

FORMAT, FORMAT_VERSION = _formats.CHECKPOINT
#: how to start over from a checkpoint that is never reused, in the Python API's words (:mod:`scaleattn.errors`):
#: :func:`~scaleattn.distributed.build.compute_statistics` has no ``overwrite``, a fit with ``resume`` keeps it
_START_OVER = "start over (remove it, or fit with `overwrite=True` instead of `resume=True`)"


def _layout(dataset, groups, tiles, targets: bool) -> dict:
    """The attributes a checkpoint must match to be reused (JSON-compatible)."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "scaleattn_version": __version__,
            "dataset_fingerprint": dataset.fingerprint, "d": int(dataset.d),
            "d_out": int(dataset.d_out) if targets else 0,
            "groups": [[int(a), int(b)] for a, b in groups], "tiles": [[int(a), int(b)] for a, b in tiles]}


def stored_attrs(store: Location) -> dict:
    """The attributes of the checkpoint store at ``store`` (a build's or a pass journal's), to check before it is
    reused; a :class:`~scaleattn.errors.CheckpointError` where it is not a Zarr group at all."""
    try:
        return dict(store.open_group("r").attrs)
    except Exception as e:  # not a zarr group
        raise CheckpointError(f"checkpoint {store.url!r} is not a scaleattn checkpoint ({e}); remove it yourself or"
                              " choose another `checkpoint` path") from None


def first_difference(have: dict, want: dict) -> tuple | None:
    """The first attribute of ``want`` that the stored ``have`` does not match: ``(name, stored, wanted)``, each
    value cut to 80 characters for a message; None when all match."""
    def shown(x):
        return x if len(repr(x)) < 80 else repr(x)[:77] + "..."

    for k, v in want.items():
        if have.get(k) != v:
            return k, shown(have.get(k)), shown(v)
    return None


def partial_checksum(part, source: int, with_moments: bool) -> int:
    """Digest of a partial's values (tile of ``Tc``; ``B`` and ``yy`` for tile 0), its row count and ``source``."""
    parts = [np.ascontiguousarray(part.gram_compact, dtype="<f8").tobytes()]
    if with_moments:
        parts += [np.ascontiguousarray(part.moments, dtype="<f8").tobytes(), np.float64(part.yy).tobytes()]
    parts += [np.int64(part.n_rows).tobytes(), np.int64(source).tobytes()]
    return _integrity.digest64(b"".join(parts))


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Handle on a checkpoint store (cheap to pickle to Dask workers).

    Attributes: ``store`` (:class:`~scaleattn.store._location.Location`), ``groups`` (sample ranges), ``tiles`` (row
    ranges of ``Tc``), ``d``, ``d_out`` (0 for a Gram-only build), ``uid`` (of the store, checked by workers),
    ``run`` (token of the build using the handle, recorded with each partial it writes), ``kernel`` (the
    statistics kernel of the partials, :func:`scaleattn.statistics._kernel.kernel_name`; the workers build with it).
    """

    store: Location
    groups: tuple
    tiles: tuple
    d: int
    d_out: int
    uid: str = ""
    run: int = 0
    kernel: str = "numpy"

    @property
    def url(self) -> str:
        return self.store.url

    @classmethod
    def open(cls, store: Location, dataset, groups, tiles, targets: bool = True,
             kernel: str | None = None) -> Checkpoint:
        """Open the checkpoint at ``store`` for this build, creating it when absent.

        ``groups`` from :func:`scaleattn.distributed.build.row_groups`, ``tiles`` from
        :func:`scaleattn.distributed.build.tile_bounds` (equal widths except the last, so each partial is one
        chunk). ``kernel``: the statistics kernel of this build (default
        :func:`scaleattn.statistics._kernel.kernel_name`),
        recorded in a new store and checked against an existing one.

        Raises
        ------
        CheckpointError
            The store exists but was made from another dataset, chunking, grouping, tiling or version, by an
            older scaleattn (format v1), its creation was cut short, or it is not a checkpoint at all (the
            message names the first field that differs); or it was built by the other statistics kernel, or by
            another revision of this one.
        """
        url = store.url
        kernel = kernel_name(kernel=kernel)
        want = _layout(dataset, groups, tiles, targets)
        args = (store, tuple(map(tuple, want["groups"])), tuple(map(tuple, want["tiles"])), want["d"], want["d_out"])
        if store.exists():
            have = stored_attrs(store)
            if have.get("format") == _formats.JOURNAL[0]:
                raise CheckpointError(
                    f"checkpoint {url!r} is the pass journal of a streaming fit (`solver='stream'`), not a statistics"
                    f" build: resume it with `solver='stream'`, or {_START_OVER}")
            if have.get("format") == FORMAT and have.get("format_version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"checkpoint {url!r} was written by an older scaleattn (format v{have.get('format_version')},"
                    f" this one writes v{FORMAT_VERSION}): its partials are not bound to the rows they came from and"
                    f" cannot be verified, so it is never reused; {_START_OVER}")
            if have.get("format") == FORMAT and "groups" not in have:
                raise CheckpointError(f"checkpoint {url!r} is incomplete (its creation was cut short); {_START_OVER}")
            differs = first_difference(have, want)
            if differs is not None:
                k, stored, ours = differs
                raise CheckpointError(
                    f"checkpoint {url!r} was made by a different build ({k}: stored {stored!r}, this "
                    f"job {ours!r}); it is never mixed in; {_START_OVER}")
            built = have.get("kernel", "numpy")  # before the attribute, numpy was the only kernel
            if built != kernel:
                raise CheckpointError(
                    f"checkpoint {url!r} was built by the {built!r} statistics kernel, this build uses {kernel!r}: "
                    f"resume with SCALEATTN_KERNEL={built}, or {_START_OVER}")
            revision = have.get("kernel_revision", 1)  # before the attribute, every kernel was at revision 1
            if revision != KERNEL_REVISIONS[kernel]:
                raise CheckpointError(
                    f"checkpoint {url!r} was built by revision {revision} of the {kernel!r} statistics kernel (another"
                    f" scaleattn), this one has revision {KERNEL_REVISIONS[kernel]}: their partials differ in the last"
                    f" bits and are never mixed; resume with the scaleattn that made it, or {_START_OVER}")
            ck = cls(*args, uid=str(have.get("uid", "")), kernel=kernel)
            ck._check_arrays()
            return ck
        ck = cls(*args, uid=uuid.uuid4().hex, kernel=kernel)
        ck._create({**want, "kernel": kernel, "kernel_revision": KERNEL_REVISIONS[kernel]})
        return ck

    def _create(self, attrs: dict) -> None:
        with writing(self.store, "the checkpoint"):  # a full disk, a quota, a read-only place: one line, exit 2
            self._create_arrays(attrs)

    def _create_arrays(self, attrs: dict) -> None:
        m = n_pairs(self.d)
        mm, nv = m * (m + 1) // 2, self.d * (self.d + 1) // 2
        ng, nt = len(self.groups), len(self.tiles)
        tile_rows = self.tiles[0][1] - self.tiles[0][0]
        if any(b - a != tile_rows for a, b in self.tiles[:-1]):
            raise CheckpointError("checkpoint tiles must have equal widths (except the last) to align with chunks")
        g = self.store.open_group("w")
        # the format first (so that --overwrite recognises a creation cut short as ours), the layout last (so
        # that such a store is refused, never resumed)
        g.attrs.update({**_formats.stamp(_formats.CHECKPOINT), "uid": self.uid})
        kw = {"compressors": _integrity.compressors()}
        g.create_array("gram_compact", shape=(ng, mm, nv), chunks=(1, tile_rows, nv), dtype="float64",
                       fill_value=0.0, dimension_names=("group", "vech_pair", "vech_token"), **kw)
        if self.d_out:
            g.create_array("moments", shape=(ng, n_features(self.d), self.d_out),
                           chunks=(1, n_features(self.d), self.d_out),
                           dtype="float64", fill_value=0.0, dimension_names=("group", "feature", "output"), **kw)
        g.create_array("yy", shape=(ng,), chunks=(1,), dtype="float64", fill_value=0.0, dimension_names=("group",),
                       **kw)
        for name, dtype, fill in (("n_rows", "int64", 0), ("source", "int64", 0), ("checksum", "int64", 0),
                                  ("run", "int64", 0), ("done", "bool", False)):
            g.create_array(name, shape=(ng, nt), chunks=(1, 1), dtype=dtype, fill_value=fill,
                           dimension_names=("group", "tile"), **kw)
        g.attrs.update({**attrs, "uid": self.uid,
                        "description": "partial statistics of a scaleattn build, one chunk per (group, tile)"})

    def _layout_arrays(self) -> dict:
        """name -> (shape, chunks, dtype) of every array :meth:`_create` writes."""
        m, ng, nt = n_pairs(self.d), len(self.groups), len(self.tiles)
        mm, nv = m * (m + 1) // 2, self.d * (self.d + 1) // 2
        tile_rows = self.tiles[0][1] - self.tiles[0][0]
        out = {"gram_compact": ((ng, mm, nv), (1, tile_rows, nv), "float64"), "yy": ((ng,), (1,), "float64")}
        if self.d_out:
            out["moments"] = ((ng, n_features(self.d), self.d_out), (1, n_features(self.d), self.d_out), "float64")
        for name, dtype in (("n_rows", "int64"), ("source", "int64"), ("checksum", "int64"), ("run", "int64"),
                            ("done", "bool")):
            out[name] = ((ng, nt), (1, 1), dtype)
        return out

    def _check_arrays(self) -> None:
        """The arrays of an existing checkpoint have the shapes, chunks, data types and codecs :meth:`_create`
        writes for this build (its attributes already match): checked from their metadata before any chunk
        is read, so that an edited or crafted store is refused, never decompressed (:mod:`scaleattn.store._bounds`).

        Raises :class:`~scaleattn.errors.CheckpointError` naming the array."""
        g = self._group()
        for name, (shape, chunks, dtype) in self._layout_arrays().items():
            try:
                arr = g[name]
                _bounds.check_array(arr, name, self.url, shape=shape, dtype=dtype, codecs=_integrity.SMALL_CODECS)
                have = tuple(int(n) for n in arr.chunks)
            except KeyError:
                raise CheckpointError(f"checkpoint {self.url!r}: array {name!r} is missing; {_START_OVER}") from None
            except CheckpointError:
                raise
            except Exception as e:  # (a FormatError or IntegrityError of the bounds, or zarr's on a damaged zarr.json)
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CheckpointError(f"checkpoint {self.url!r}: {why}; {_START_OVER}") from None
            if have != chunks:
                raise CheckpointError(f"checkpoint {self.url!r}: {name} is stored in chunks of {have}, this build"
                                      f" writes {chunks} (its metadata was edited); {_START_OVER}")

    def _group(self, mode: str = "r"):
        """The store's group, after checking that it is the one the client created (its ``uid``)."""
        g = self.store.open_group(mode) if self.store.exists() else None
        if self.uid:
            uid = None if g is None else g.attrs.get("uid")
            if uid != self.uid:
                raise CheckpointError(f"{here()}: the checkpoint {self.url} here is not the one the client created"
                                      f" ({'absent' if g is None else f'uid {uid!r}'}): the workers must see the same"
                                      " store as the client (a shared file system or an object store URL)")
        return g

    def done_mask(self) -> np.ndarray:
        """(groups, tiles) bool: True where the partial is complete in the store."""
        return np.asarray(self._group()["done"][...], dtype=bool)

    def reusable(self, sources) -> np.ndarray:
        """(groups, tiles) bool: done, and bound to the input rows ``sources[gi]`` (as they are now)."""
        g = self._group()
        done = np.asarray(g["done"][...], dtype=bool)
        return done & (np.asarray(g["source"][...]) == np.asarray(sources, dtype=np.int64)[:, None])

    def is_done(self, gi: int, ti: int) -> bool:
        return bool(self._group()["done"][gi, ti])

    def write(self, gi: int, ti: int, part, source: int = 0) -> None:
        """Store the partial :class:`~scaleattn.statistics._container.Statistics` of group ``gi``, tile ``ti`` (host
        arrays), bound to its input rows' digest ``source``, with its checksum, then mark it done. Each array write
        covers exactly one chunk."""
        with writing(self.store, "the checkpoint"):  # (on a worker: the client raises the same StorageError)
            self._write(gi, ti, part, source)

    def _write(self, gi: int, ti: int, part, source: int) -> None:
        g = self._group("r+")
        c0, c1 = self.tiles[ti]
        g["gram_compact"][gi : gi + 1, c0:c1, :] = np.asarray(part.gram_compact)[None]
        if ti == 0:
            if self.d_out:
                g["moments"][gi : gi + 1] = np.asarray(part.moments)[None]
            g["yy"][gi : gi + 1] = np.array([part.yy], dtype=np.float64)
        one = (slice(gi, gi + 1), slice(ti, ti + 1))
        g["n_rows"][one] = np.array([[part.n_rows]], dtype=np.int64)
        g["source"][one] = np.array([[source]], dtype=np.int64)
        g["checksum"][one] = np.array([[partial_checksum(part, source, ti == 0 and self.d_out > 0)]], dtype=np.int64)
        g["run"][one] = np.array([[self.run]], dtype=np.int64)
        g["done"][one] = np.ones((1, 1), dtype=bool)

    def written_by(self, run: int) -> np.ndarray:
        """(groups, tiles) bool: the partials build ``run`` wrote (computed, not reused)."""
        return np.asarray(self._group()["run"][...]) == run

    def forget(self, gi: int, ti: int) -> None:
        """Mark the partial of group ``gi``, tile ``ti`` not done (before it is recomputed)."""
        with writing(self.store, "the checkpoint"):
            self._group("r+")["done"][gi : gi + 1, ti : ti + 1] = np.zeros((1, 1), dtype=bool)

    def read(self, gi: int, ti: int):
        """The stored partial of group ``gi``, tile ``ti`` (bit-identical to what :meth:`write` got), unchecked.

        Raises :class:`~scaleattn.errors.CheckpointError` if it is not marked done."""
        part, why = self.verified(gi, ti)
        if part is None:
            raise CheckpointError(f"checkpoint {self.url!r}: group {gi} tile {ti} {why}")
        return part

    def verified(self, gi: int, ti: int, source: int | None = None, rows: int | None = None):
        """``(partial, "")`` when group ``gi``, tile ``ti`` is done and, with ``source`` (and ``rows``), bound to
        that digest of its input rows, with its row count and checksum intact; else ``(None, why)``: ``why`` is
        ``"is not done"``, ``"is stale (its input rows changed)"`` or ``"is damaged (...)"``."""
        g = self._group()
        if not bool(g["done"][gi, ti]):
            return None, "is not done"
        c0, c1 = self.tiles[ti]
        try:
            gram = np.asarray(g["gram_compact"][gi, c0:c1, :])
            d_out = self.d_out if ti == 0 else 0
            moments = (np.asarray(g["moments"][gi]) if (ti == 0 and self.d_out)
                       else np.zeros((n_features(self.d), d_out)))
            yy = float(g["yy"][gi]) if ti == 0 else 0.0
            part = Statistics(gram, moments, yy, int(g["n_rows"][gi, ti]), self.d)
            stored_source, stored_sum = int(g["source"][gi, ti]), int(g["checksum"][gi, ti])
        except ValueError as e:  # a chunk failing its crc32c
            if not _integrity.checksum_failure(e):
                raise
            return None, "is damaged (a chunk fails its crc32c checksum)"
        if source is None:
            return part, ""
        if stored_source != source:
            return None, "is stale (its input rows changed)"
        if rows is not None and part.n_rows != rows:
            return None, f"is damaged ({part.n_rows} rows stored, {rows} expected)"
        if stored_sum != partial_checksum(part, stored_source, ti == 0 and self.d_out > 0):
            return None, "is damaged (its values do not match its checksum)"
        return part, ""
