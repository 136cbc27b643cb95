"""The pass journal of a streaming fit: its first sweep and every data pass, kept so that an interrupted fit
continues where it stopped, bit-identical to a fit that never stopped (DESIGN §4b, §6).

The streaming solver is deterministic: the same rows in the same row groups and blocks give the same bits for
every pass, in this process and on any number of workers (:mod:`scaleattn.linalg._passes`), and its driver (CG,
the eigenvalue runs, the probabilistic bound) asks for the same products in the same order when given the same
answers. So the client records what each pass was given and what it gave: the first sweep's sums, and for every
pass ``G W`` (and the residual's pass) a digest of its input block ``W`` and its output. A resumed fit runs the
same driver from the start; the sweep, and each pass whose input has the digest of the journal's next entry, is
read back instead of computed (no data read); from the first pass that differs (another ``cutoff_rtol`` takes
another path at some pass) or once the journal ends, passes are computed and appended, and the entries after
the divergence are dropped. No entry is ever taken for its position alone: what it answers is the very
product asked for. The workers only compute passes; the journal lives where the client writes.

Layout of a journal (Zarr v3, every array with the crc32c codec)::

    sweep/diag      float64 (m, d)        diag G                      (m = d(d+1)/2)
    sweep/A         float64 (m, m)        K-FAC factor S^T S
    sweep/B         float64 (d, d)        K-FAC factor X^T X
    sweep/moments   float64 (m, d d_out)  Phi^T Y                     (only with targets)
    sweep/yy        float64 (1,)          sum of y^2
    sweep/rows      int64   (1,)          rows
    passes/000000   float64 (m, d k)      the output of pass 0 (G W, psi x k), or (1,): the residual's sum of squares
    passes/000001   ...

The sweep group's ``checksum`` (of its values) and an entry's ``kind``, ``source`` (the digest of its input) and
``checksum`` (of its output, shape and source) are attributes written *after* the values: a journal killed mid-
write leaves an entry without them, or with values that do not match them, and such an entry is not done: it is
computed again and overwritten, as is one that fails its crc32c. The group's attributes fix the format and
version, the scaleattn version, the dataset's fingerprint, the digest of the rows as stored
(:func:`scaleattn.data._checks.row_bindings` of every row group), ``d``, ``d_out``, the row groups and the rows per
block: a journal that differs in any of them (or one of the statistics build, or not a journal at all) is refused
with a :class:`~scaleattn.errors.CheckpointError`, never mixed in. The solver's options are not among them: they
change which products are asked for, never what a product is.

Size: one pass holds ``psi k`` floats, k the columns of that pass (the outputs plus the eigenvalue runs' few):
about 6 MB a pass at d = 64, d_out = 1, 17 MB at d = 44, d_out = 44; a fit of 60 passes keeps 0.4-1 GB until it
is written. Layer L3.
"""
from __future__ import annotations

import uuid

import numpy as np

from .._version import __version__
from ..data._checks import row_bindings
from ..errors import CheckpointError
from ..features import n_features, n_pairs
from ..store import _bounds, _formats, _integrity
from ..store._location import Location
from ..store._outputs import writing
from .checkpoint import _START_OVER, first_difference, stored_attrs

__all__ = ["PassJournal", "input_digest", "FORMAT", "FORMAT_VERSION"]

FORMAT, FORMAT_VERSION = _formats.JOURNAL
#: the sweep's arrays in :meth:`PassJournal.record_sweep`'s order (the tuple of
#: :func:`scaleattn.linalg._passes.group_sweep`)
_SWEEP = ("diag", "A", "B", "moments", "yy", "rows")


def input_digest(kind: str, W) -> int:
    """Digest of a pass's input: its kind (``"gw"``, ``"sse"``), the block's shape and its float64 values."""
    a = np.ascontiguousarray(np.asarray(W), dtype="<f8")
    head = kind.encode() + np.asarray(a.shape, dtype="<i8").tobytes()
    return _integrity.digest64(head + a.tobytes())


def _entry_checksum(kind: str, source: int, out) -> int:
    """Digest of an entry's output (shape and values), kind and input digest."""
    a = np.ascontiguousarray(out, dtype="<f8")
    head = kind.encode() + np.int64(source).tobytes() + np.asarray(a.shape, dtype="<i8").tobytes()
    return _integrity.digest64(head + a.tobytes())


def _sweep_checksum(values: dict) -> int:
    """Digest of the sweep's arrays, in order, with their shapes."""
    parts = []
    for name in _SWEEP:
        a = np.ascontiguousarray(values[name])
        little = a.astype(a.dtype.newbyteorder("<"))
        parts += [name.encode(), np.asarray(a.shape, dtype="<i8").tobytes(), little.tobytes()]
    return _integrity.digest64(b"".join(parts))


def _layout(dataset, groups, targets: bool, block_rows: int) -> dict:
    """The attributes a journal must match to be reused (JSON-compatible)."""
    groups = [[int(a), int(b)] for a, b in groups]
    rows = _integrity.signature_digest(*map(str, row_bindings(dataset, groups, targets)))
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "scaleattn_version": __version__,
            "dataset_fingerprint": dataset.fingerprint, "rows": rows, "d": int(dataset.d),
            "d_out": int(dataset.d_out) if targets else 0, "groups": groups, "block_rows": int(block_rows)}


class PassJournal:
    """The pass journal at ``store`` for one streaming fit, read back and written by its client (DESIGN §4b, §6).

    Made by :meth:`open`; handed to :class:`scaleattn.linalg._stream.StreamOperator` (or
    :class:`scaleattn.distributed.stream.DistributedStreamOperator`) as ``journal``, which asks :meth:`sweep` and
    :meth:`replay` before computing and tells :meth:`record_sweep` and :meth:`record` after. Host (numpy) arrays.

    Attributes
    ----------
    store : Location
    sweep_resumed : bool
        The first sweep was read back.
    resumed, computed : int
        Passes read back, passes computed and appended (by this run).

    Examples
    --------
    >>> import numpy as np, scaleattn
    >>> from scaleattn.distributed.partition import row_groups
    >>> from scaleattn.store._location import resolve
    >>> ds = scaleattn.write_dataset("_doc_journal.zarr", np.ones((8, 3, 2)), np.ones((8, 2)), overwrite=True)
    >>> store = resolve("_doc_journal_ck.zarr")
    >>> store.remove()
    >>> j = PassJournal.open(store, ds, row_groups(ds), block_rows=2048)
    >>> W = np.arange(6.0).reshape(3, 2)  # a pass's input (m, d k): d = 2, k = 1
    >>> j.record("gw", W, 2 * W)
    >>> again = PassJournal.open(store, ds, row_groups(ds), block_rows=2048)  # a resumed fit
    >>> again.replay("gw", W)[0], again.replay("gw", W) is None  # the next entry was this very pass; then none
    (array([0., 2.]), True)
    """

    def __init__(self, store: Location, d: int, d_out: int):
        self.store, self.d, self.d_out = store, int(d), int(d_out)
        self.m, self.psi = n_pairs(self.d), n_features(self.d)
        self.sweep_resumed, self.resumed, self.computed = False, 0, 0
        self._next, self._live = 0, False

    @property
    def url(self) -> str:
        return self.store.url

    @classmethod
    def open(cls, store: Location, dataset, groups, *, targets: bool = True, block_rows: int) -> PassJournal:
        """Open the journal at ``store`` for a streaming fit of ``dataset`` in row ``groups`` (the fit's
        :func:`scaleattn.distributed.partition.row_groups`), blocks of ``block_rows`` rows, creating it when
        absent.

        Raises
        ------
        CheckpointError
            The store exists but is not a pass journal (a statistics build's checkpoint: named as such), was
            made by another scaleattn or format, from another dataset (or the rows changed since), with another
            ``d``, ``d_out``, grouping or block size (the message names the first field that differs), or its
            creation was cut short.
        """
        url = store.url
        want = _layout(dataset, groups, targets, block_rows)
        journal = cls(store, want["d"], want["d_out"])
        if not store.exists():
            journal._create(want)
            return journal
        have = stored_attrs(store)
        if have.get("format") == _formats.CHECKPOINT[0]:
            raise CheckpointError(f"checkpoint {url!r} holds the statistics build of a fit by the Gram route, not"
                                  " the pass journal of a streaming fit: resume it with that fit's `solver`, or"
                                  f" {_START_OVER}")
        if have.get("format") == FORMAT and have.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {url!r} is a pass journal of format v{have.get('format_version')}, this"
                                  f" scaleattn reads v{FORMAT_VERSION}; {_START_OVER}")
        if have.get("format") == FORMAT and "groups" not in have:
            raise CheckpointError(f"checkpoint {url!r} is incomplete (its creation was cut short); {_START_OVER}")
        differs = first_difference(have, want)
        if differs is not None:
            k, stored, ours = differs
            why = " (the dataset's rows changed since)" if k == "rows" else ""
            raise CheckpointError(f"checkpoint {url!r} was made by a different fit{why} ({k}: stored"
                                  f" {stored!r}, this fit {ours!r}); it is never mixed in;"
                                  f" {_START_OVER}")
        return journal

    def _create(self, attrs: dict) -> None:
        with writing(self.store, "the checkpoint"):  # a full disk, a quota, a read-only place: one line, exit 2
            g = self.store.open_group("w")
            # the format first (so that --overwrite recognises a creation cut short as ours), the layout last (so
            # that such a store is refused, never resumed)
            g.attrs.update({**_formats.stamp(_formats.JOURNAL), "uid": uuid.uuid4().hex})
            g.create_group("passes")
            g.attrs.update({**attrs, "description": "the first sweep and the data passes of a streaming scaleattn"
                                                    " fit, one array per pass"})

    def _group(self, mode: str = "r"):
        return self.store.open_group(mode)

    def _shapes(self) -> dict:
        """The sweep's arrays: name -> (shape, dtype)."""
        m, d = self.m, self.d
        out = {"diag": ((m, d), "float64"), "A": ((m, m), "float64"), "B": ((d, d), "float64"),
               "yy": ((1,), "float64"), "rows": ((1,), "int64")}
        if self.d_out:
            out["moments"] = ((m, d * self.d_out), "float64")
        return out

    def _array(self, g, name: str, data) -> None:
        """Write ``data`` as array ``name`` of group ``g``, one chunk, crc32c (its attributes come later)."""
        data = np.ascontiguousarray(data)
        arr = g.create_array(name, shape=data.shape, chunks=data.shape, dtype=data.dtype, fill_value=0,
                             compressors=_integrity.compressors(), config={"write_empty_chunks": True},
                             overwrite=True)
        arr[...] = data

    def _read(self, g, name: str, shape, dtype):
        """Array ``name`` of ``g`` checked from its metadata (shape, dtype, codecs), then read (crc32c checked)."""
        arr = g[name]
        _bounds.check_array(arr, name, self.url, shape=shape, dtype=dtype, codecs=_integrity.SMALL_CODECS)
        return arr, np.asarray(arr[...])

    # ---- the first sweep ----------------------------------------------------------------------------------------
    def sweep(self):
        """The first sweep's sums (:func:`scaleattn.linalg._passes.group_sweep`'s tuple over all groups) as
        recorded, or None when there is none whose checksum verifies (then it is computed and recorded)."""
        try:
            g = self._group()["sweep"]
            done = g.attrs.get("checksum")
            if done is None:
                return None
            values = {name: self._read(g, name, shape, dtype)[1] for name, (shape, dtype) in self._shapes().items()}
        except Exception:  # absent, cut short, damaged (a crc32c failure), crafted: computed again
            return None
        if not self.d_out:
            values["moments"] = np.zeros((self.m, 0))
        if int(done) != _sweep_checksum(values):
            return None
        self.sweep_resumed = True
        return (values["diag"], values["A"], values["B"], values["moments"], float(values["yy"][0]),
                int(values["rows"][0]))

    def record_sweep(self, total) -> None:
        """Keep the first sweep's sums ``total`` (host arrays), its checksum written last."""
        values = dict(zip(_SWEEP, total))
        values["moments"] = np.asarray(values["moments"], dtype=np.float64).reshape(self.m, self.d * self.d_out)
        values["yy"] = np.array([values["yy"]], dtype=np.float64)
        values["rows"] = np.array([values["rows"]], dtype=np.int64)
        values = {k: np.ascontiguousarray(v) for k, v in values.items()}
        with writing(self.store, "the checkpoint"):
            root = self._group("r+")
            g = root.create_group("sweep", overwrite=True)
            for name in self._shapes():
                self._array(g, name, values[name])
            g.attrs.update({"checksum": _sweep_checksum(values)})

    # ---- the passes ---------------------------------------------------------------------------------------------
    def replay(self, kind: str, W):
        """The output of the pass ``kind`` (``"gw"``: ``G W`` as (m, d k) for ``W`` (m, d k); ``"sse"``: the
        residual's sum of squares as (1,)) when the journal's next entry is that very pass, done and intact; else
        None, and from then on every pass is computed (:meth:`record`)."""
        if self._live:
            return None
        source = input_digest(kind, W)
        out = self._entry(self._next, kind, source, self._shape(kind, W))
        if out is None:
            self._live = True
            self._drop_from(self._next)
            return None
        self._next += 1
        self.resumed += 1
        return out

    def record(self, kind: str, W, out) -> None:
        """Append the pass ``kind`` of input ``W`` and output ``out`` (host values) as the next entry: the
        values first, then the attributes that make it done."""
        self._live = True
        source = input_digest(kind, W)
        out = np.ascontiguousarray(np.asarray(out, dtype=np.float64).reshape(self._shape(kind, W)))
        name = f"{self._next:06d}"
        with writing(self.store, "the checkpoint"):
            g = self._group("r+")["passes"]
            self._write_values(g, name, out)
            self._mark_done(g, name, {"kind": kind, "source": source, "checksum": _entry_checksum(kind, source, out)})
        self._next += 1
        self.computed += 1

    def _write_values(self, g, name: str, out) -> None:
        self._array(g, name, out)

    def _mark_done(self, g, name: str, attrs: dict) -> None:
        g[name].attrs.update(attrs)

    def _shape(self, kind: str, W) -> tuple:
        return (1,) if kind == "sse" else (self.m, int(np.asarray(W).shape[1]))

    def _entry(self, i: int, kind: str, source: int, shape):
        """Entry ``i``'s output when it is done, of ``kind`` and input ``source``, and intact; else None."""
        try:
            g = self._group()["passes"]
            arr = g[f"{i:06d}"]
            attrs = dict(arr.attrs)
            if attrs.get("kind") != kind or attrs.get("source") != source or "checksum" not in attrs:
                return None
            out = self._read(g, f"{i:06d}", shape, "float64")[1]
        except Exception:  # absent, cut short, damaged (crc32c), crafted
            return None
        if int(attrs["checksum"]) != _entry_checksum(kind, source, out):
            return None
        return out

    def _drop_from(self, i: int) -> None:
        """Remove the entries from ``i`` on (another path from here: they answer products no longer asked for)."""
        try:
            g = self._group("r+")["passes"]
            names = [n for n in g.array_keys() if n.isdigit() and int(n) >= i]
        except Exception:
            return
        with writing(self.store, "the checkpoint"):
            for n in names:
                del g[n]

    def entries(self) -> int:
        """Passes done in the store (counted from the first, up to the first not done); for the resume hint."""
        try:
            g = self._group()["passes"]
            names = set(g.array_keys())
        except Exception:
            return 0
        n = 0
        while f"{n:06d}" in names and "checksum" in g[f"{n:06d}"].attrs:
            n += 1
        return n

    def has_sweep(self) -> bool:
        """Whether the store holds a finished first sweep."""
        try:
            return "checksum" in self._group()["sweep"].attrs
        except Exception:
            return False

    def held(self) -> str:
        """What the journal keeps, in words (the resume hint)."""
        if not self.has_sweep():
            return "nothing"
        n = self.entries()
        return f"the first sweep and {n} data pass{'es' if n != 1 else ''}"
