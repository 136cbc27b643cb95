"""Writing outputs safely: never into an input, never over a foreign directory, never two runs at
once, never over what another run reads, never where it would not last, all or nothing.

- :func:`check_output_location`: the one check of where any output may go, before anything is written: a
  local path or a store that keeps what is written after this process exits (:data:`PERSISTENT`: not
  ``memory://``, HTTP, archives or chained cache URLs), not the root of a bucket, not inside a Zarr store.
- :func:`check_disjoint`: an output, checkpoint or temporary that is, contains or lies inside an input store
  (after resolving ``.``, ``..``, trailing slashes and symlinks; URLs by prefix) is refused.
- :func:`owner_of` / :func:`check_replaceable`: ``--overwrite`` replaces only what scaleattn wrote: a Zarr
  store whose ``format`` starts with ``scaleattn-``, or a run directory (report.json, the run's stores, plots).
- :func:`hold` (one run per output) and :func:`reading` / :func:`check_unread` (no store replaced or deleted
  while another run reads it): the locks of :mod:`scaleattn.store._locks`, re-exported here.
- :func:`atomic_output`: a temporary next to the output, renamed on success; temporaries left by a killed run
  are removed by the next run that holds the lock.
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import re
import uuid

from ..errors import OutputExistsError, UnsafeOutputError, UnsupportedError
from . import _formats
from ._location import Location, fs_for, protocols, remove, settle_writes
from ._locks import (
    _read_json,
    _refused,
    check_unread,
    file_system_refusal,
    hold,
    is_store,
    lock_location,
    reading,
    store_holding,
)
from ._names import check_output_name

__all__ = ["check_disjoint", "check_companions", "check_outside_stores", "check_output_location", "PERSISTENT",
           "relation", "owner_of", "check_replaceable", "RUN", "hold", "atomic_output", "clean_leftovers",
           "is_scaleattn_plot", "is_run_directory", "lock_location", "companions", "is_temporary_of", "reading",
           "check_unread", "writing", "NOTHING_WRITTEN"]

#: what an output the file system refused left: nothing (outputs are written all or nothing)
NOTHING_WRITTEN = "nothing of it was written (outputs are written all or nothing)"


# ---- outputs never touch inputs ----------------------------------------------------------------------
def _key(loc: Location) -> tuple[str, str]:
    """(scheme, normalised path): symlinks resolved for local paths, ``.``/``..``/``//``/trailing ``/`` for URLs."""
    if not loc.is_remote:
        return "file", os.path.realpath(loc.url)
    scheme, _, rest = loc.url.partition("://")
    scheme = {"s3a": "s3", "s3n": "s3", "gcs": "gs"}.get(scheme, scheme)
    return scheme, posixpath.normpath("/" + rest).rstrip("/") or "/"


def _inside(a: str, b: str, sep: str) -> bool:
    return a != b and a.startswith(b.rstrip(sep) + sep)


def _same_local(a: str, b: str) -> bool:
    """Same directory or file reached another way (bind mount, hard link to a directory's inode)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def relation(out: Location, inp: Location) -> str | None:
    """``"is"``, ``"lies inside"``, ``"contains"`` or None: where ``out`` stands relative to ``inp``."""
    (s1, a), (s2, b) = _key(out), _key(inp)
    if s1 != s2:
        return None
    sep = os.sep if s1 == "file" else "/"
    if a == b or (s1 == "file" and _same_local(a, b)):
        return "is"
    if _inside(a, b, sep):
        return "lies inside"
    if _inside(b, a, sep):
        return "contains"
    if s1 == "file":  # reached through a bind mount: compare the existing ancestors by inode
        for x, y, what in ((a, b, "lies inside"), (b, a, "contains")):
            p = os.path.dirname(x)
            while p and p != os.path.dirname(p):
                if _same_local(p, y):
                    return what
                p = os.path.dirname(p)
    return None


def check_disjoint(outputs, inputs, *, kind: str = "input", contains_ok: bool = False) -> None:
    """Refuse any output that is, contains or lies inside an input, before anything is written or removed.

    Parameters
    ----------
    outputs, inputs : iterable of (role, Location or None)
        E.g. ``[("`out`", out), ("`checkpoint`", ckpt)]`` (parameters in backticks, :mod:`scaleattn.errors`) and
        ``[("dataset", ds.store)]``; None entries skipped.
    kind : str
        What the second list holds, for the message ("input", or "output" for two outputs of one run).
    contains_ok : bool
        Allow an output that contains an input (for outputs that only add files, never remove: plots).

    Raises
    ------
    UnsafeOutputError
        Naming the option, both paths and how they overlap.
    """
    ins = [(r, loc) for r, loc in inputs if loc is not None]
    for role, out in outputs:
        if out is None:
            continue
        for what, inp in ins:
            rel = relation(out, inp)
            if rel is not None and not (contains_ok and rel == "contains"):
                never = ("scaleattn never writes into or removes an input" if kind == "input" else
                         "each output of a run needs its own place")
                raise UnsafeOutputError(f"{role} {out.url} {rel} the {kind} {what} {inp.url}: {never}; choose a"
                                        " path outside it")


def companions(loc: Location) -> list[Location]:
    """What a run writes next to output ``loc`` besides it: its lock (temporaries are matched by name,
    :func:`is_temporary_of`)."""
    return [lock_location(loc)]


def is_temporary_of(path: Location, loc: Location) -> bool:
    """Whether ``path`` is named like a temporary of output ``loc`` (``.NAME.partial-*`` next to it)."""
    if path.is_remote != loc.is_remote:
        return False
    mod = posixpath if loc.is_remote else os.path
    (p1, n1), (p2, n2) = mod.split(path.url.rstrip("/")), mod.split(loc.url.rstrip("/"))
    return _key(Location(p1)) == _key(Location(p2)) and n1.startswith(f".{n2}.partial-")


def check_companions(outputs, inputs) -> None:
    """Refuse outputs whose lock or temporaries would be, or be removed as, an input (an input named
    ``.NAME.lock`` or ``.NAME.partial-...`` next to output NAME).

    Raises
    ------
    UnsafeOutputError
    """
    ins = [(r, loc) for r, loc in inputs if loc is not None]
    for role, out in outputs:
        if out is None:
            continue
        for what, inp in ins:
            if is_temporary_of(inp, out) or any(relation(c, inp) for c in companions(out)):
                raise UnsafeOutputError(f"{role} {out.url}: the input {what} {inp.url} is named like the lock or a"
                                        " temporary scaleattn keeps next to that output; choose another output path")


def check_outside_stores(loc: Location, role: str = "output", *, into: bool = False) -> None:
    """Refuse an output inside an existing Zarr store (any: a dataset, a model, another tool's), whether or not
    that store is an input of this command: nothing is ever written into a store from outside it. ``into``: the
    writer adds files into the directory ``loc`` itself (``plot --out``, ``bench --out``), which must then not be
    a Zarr store either.

    Raises
    ------
    UnsafeOutputError
        Naming the output and the store it is or lies inside.
    """
    if into and is_store(loc):
        raise UnsafeOutputError(f"{role} {loc.url} is a Zarr store: this command adds files into its `out`, and"
                                " nothing is written into a store from outside it; choose another directory")
    parent = store_holding(loc)
    if parent is not None:
        raise UnsafeOutputError(f"{role} {loc.url} lies inside the Zarr store {parent.url}: nothing is written"
                                " into a store from outside it; choose a path outside it")
    # a run directory holds one run's report, stores and plots: another output in it would pass for that run's
    # (and make it foreign to its own --overwrite)
    if into and is_run_directory(loc):
        raise UnsafeOutputError(f"{role} {loc.url} is a run directory: this command adds files into its `out`, and"
                                " a run directory holds only its own run's files; choose another directory")
    run = store_holding(loc, is_run_directory)
    if run is not None:
        raise UnsafeOutputError(f"{role} {loc.url} lies inside the run directory {run.url}, which holds only its"
                                " own run's files; choose a path outside it")


def is_run_directory(loc: Location) -> bool:
    """Whether ``loc`` is a run directory of ``scaleattn fit`` (its report.json names the scaleattn version)."""
    report = _read_json(loc.join(_formats.RUN_ENTRIES[0]))
    return isinstance(report, dict) and "scaleattn_version" in report


# ---- outputs outlive the command ----------------------------------------------------------------------
#: fsspec protocols of stores that keep what is written after this process exits: the only ones outputs go to
PERSISTENT = frozenset({"file", "local", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "webhdfs",
                        "arrow_hdfs", "sftp", "ssh", "ftp", "smb", "webdav", "oss", "oci", "dbfs"})
#: why known fsspec protocols cannot hold an output
_NOT_PERSISTENT = {
    "memory": "an in-memory file system, gone when this process exits (and never seen by Dask workers in other"
              " processes)",
    "http": "HTTP(S) URLs are read-only in fsspec", "https": "HTTP(S) URLs are read-only in fsspec",
    "zip": "an archive opened read-only", "tar": "an archive opened read-only",
    "libarchive": "an archive opened read-only",
    "github": "a read-only view of a git repository", "git": "a read-only view of a git repository",
    "gist": "a read-only view of a gist", "reference": "a read-only reference file system",
    "data": "a read-only data: URL",
    **{c: "a cache layer: writes stay in a local cache instead of the store behind it"
       for c in ("simplecache", "filecache", "blockcache", "cached")},
}


def check_output_location(loc: Location, role: str = "output", *, local_only: bool = False,
                          into: bool = False) -> None:
    """Where an output may go, checked before anything is written; every output passes here (a fit's
    ``--out`` and ``--checkpoint``, :func:`atomic_output` for ``generate``, ``import``, ``save`` and the run
    directory, ``plot --out``, ``bench --out``): a local path, or a URL of a store that keeps what is written
    after this process exits (:data:`PERSISTENT`); not a chained URL (``simplecache::s3://...``, whose writes
    go to a cache or archive layer), not the root of a bucket (the lock and temporaries go next to an output),
    not inside an existing Zarr store (:func:`check_outside_stores`; with ``into``, not one either: the writer
    adds files into ``loc``), not a symbolic link (a replaced output would be the link, its store left aside),
    not a name with control characters or too long for its lock and temporaries (:func:`check_output_name`).
    ``local_only``: the writer writes local files only (``bench``), any URL is refused.

    Raises
    ------
    UnsafeOutputError
        Naming ``role``, the URL and why, e.g. ``--out memory://x: an in-memory file system, gone when this
        process exits ...``.
    UnsupportedError
        A persistent URL where ``local_only``.
    ParameterError
        A protocol fsspec does not know.
    """
    check_output_name(loc, role)
    if loc.is_remote:
        chain = protocols(loc.url)
        if len(chain) > 1:
            why = f"a chained URL ({' over '.join(chain)}): writes go to its cache or archive layer, not reliably" \
                  " to the store behind it"
        elif chain[0] in PERSISTENT:
            why = None
        elif chain[0] in _NOT_PERSISTENT:
            why = _NOT_PERSISTENT[chain[0]]
        else:
            _known_protocol(loc)
            why = f"scaleattn cannot check that {chain[0]}:// keeps what is written after this process exits"
        if why:
            raise UnsafeOutputError(f"{role} {loc.url}: {why}; an output must outlive the command: give a local"
                                    " path or a persistent store (s3://BUCKET/PATH, gs://, az://, ...)")
        if "/" not in posixpath.normpath("/" + loc.url.split("://", 1)[1]).strip("/"):  # (s3://b/., s3://b/x/..)
            raise UnsafeOutputError(f"{role} {loc.url}: the root of a bucket or file system has no place next to it"
                                    " for the output's lock and temporaries; give a path inside it"
                                    f" ({loc.url.rstrip('/')}/NAME)")
        if local_only:
            raise UnsupportedError(f"{role} {loc.url}: this command writes its files to a local directory; give a"
                                   " path")
    elif os.path.islink(loc.url):
        raise UnsafeOutputError(f"{role} {loc.url} is a symbolic link (to {os.path.realpath(loc.url)}): an output is"
                                " written, and replaced, at its own path; give that path")
    check_outside_stores(loc, role, into=into)


def _known_protocol(loc: Location) -> None:
    """Raise fsspec's own error (as :class:`~scaleattn.errors.ParameterError`) for a protocol it does not know."""
    from fsspec.registry import known_implementations, registry

    proto = protocols(loc.url)[0]
    if proto not in known_implementations and proto not in registry:
        fs_for(loc.url, loc.storage_options)


# ---- --overwrite replaces only scaleattn's own outputs ------------------------------------------------
def _entries(loc: Location) -> list[str] | None:
    """Names directly under ``loc`` (None when it is a file)."""
    if not loc.is_remote:
        return sorted(os.listdir(loc.url)) if os.path.isdir(loc.url) else None
    fs, p = loc.fs()
    if fs.isfile(p):
        return None
    return sorted(posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))


def _is_scaleattn_store(loc: Location) -> str | None:
    attrs = (_read_json(loc.join("zarr.json")) or {}).get("attributes")
    fmt = attrs.get("format") if isinstance(attrs, dict) else None  # (a zarr.json edited by hand: any JSON)
    return fmt if isinstance(fmt, str) and fmt.startswith(_formats.PREFIX) else None


def _files(loc: Location) -> list[str]:
    """Every file under the directory ``loc``, as ``/``-separated paths relative to it (links are listed, never
    followed)."""
    if loc.is_remote:
        fs, p = loc.fs()
        base = p.rstrip("/") + "/"
        return [f[len(base):] for f in fs.find(p) if f.startswith(base)]
    out = []
    for root, dirs, files in os.walk(loc.url):
        rel = os.path.relpath(root, loc.url)
        for n in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            out.append(n if rel == "." else posixpath.join(*rel.split(os.sep), n))
    return out


def _stray(files) -> str | None:
    """The first of ``files`` (paths inside a Zarr v3 store) that is not part of the store: neither a node's
    ``zarr.json`` nor a chunk under an array's ``c/`` (a user's notes saved inside a run's model.zarr, say,
    which ``--overwrite`` would delete with it)."""
    nodes = {posixpath.dirname(f) for f in files if posixpath.basename(f) == "zarr.json"}
    for f in sorted(files):
        parts = f.split("/")
        if parts[-1] != "zarr.json" and not any(
                parts[i] == "c" and "/".join(parts[:i]) in nodes for i in range(len(parts) - 1)):
            return f
    return None


def is_scaleattn_plot(loc: Location) -> bool:
    """Whether ``loc`` is a PNG file scaleattn drew: a plain file whose ``Software`` text starts with
    :data:`scaleattn.store._formats.PLOT_SOFTWARE` (read by Pillow, matplotlib's image library, from the chunks before
    the image data). A user's ``spectrum.png`` is not, whoever drew it."""
    from PIL import Image

    try:
        if loc.is_remote:
            fs, p = loc.fs()
            f = fs.open(p, "rb") if fs.isfile(p) else None
        else:
            f = open(loc.url, "rb") if os.path.isfile(loc.url) and not os.path.islink(loc.url) else None
        if f is None:
            return False
        with f, Image.open(f) as im:
            return str(im.info.get("Software", "")).startswith(_formats.PLOT_SOFTWARE)
    except Exception:  # not an image, unreadable: not ours
        return False


def _companion_of_run_entry(n: str) -> bool:
    """Whether ``n`` is a lock or reader's marker (or one being made) of a run directory's member."""
    m = re.fullmatch(r"\.(.+?)(?:\.read-[0-9a-f]{12})?\.(?:partial-)?lock", n)
    return m is not None and (m.group(1) in _formats.RUN_ENTRIES or m.group(1).endswith(".png"))


def _not_run_member(loc: Location, n: str) -> str | None:
    """Why the entry ``n`` of ``loc`` is not something a run directory holds (None when it is): report.json (a
    file), the run's stores (scaleattn stores of their kind, :data:`scaleattn.store._formats.RUN_STORES`, holding
    nothing else), plots scaleattn drew, and the locks and
    readers' markers of these."""
    sub = loc.join(n)
    if n == _formats.RUN_ENTRIES[0]:
        return None if _entries(sub) is None else f"its {n} is not a file"
    if n in _formats.RUN_STORES:
        if _entries(sub) is None or not (fmt := _is_scaleattn_store(sub)):
            return f"its {n} is not a store scaleattn wrote"
        if fmt != _formats.RUN_STORES[n]:  # (a dataset copied in as stats.zarr is no run's: never deleted with it)
            return f"its {n} is {_kind_name(fmt)}, not {_kind_name(_formats.RUN_STORES[n])}"
        stray = _stray(_files(sub))
        return f"its {n} holds {stray!r}, which is not part of a Zarr store" if stray else None
    if re.fullmatch(r".+\.png(?:\.[0-9a-f]{8}\.(?:partial|old))?", n):  # (or a killed replot's copy of one)
        return None if is_scaleattn_plot(sub) else f"it holds {n!r}, which is not a plot scaleattn drew"
    return None if _companion_of_run_entry(n) else f"it holds {n!r}, which scaleattn did not write"


def owner_of(loc: Location) -> tuple[bool, str]:
    """``(ours, what)`` for an existing output: a scaleattn store (``what`` its format) holding nothing but its
    Zarr metadata and chunks, a run directory (:func:`_not_run_member`), an empty directory; otherwise
    ``(False, reason)`` naming what scaleattn did not write."""
    fmt = _is_scaleattn_store(loc)
    if fmt:
        stray = _stray(_files(loc))
        return (False, f"it holds {stray!r}, which is not part of a Zarr store") if stray else (True, fmt)
    names = _entries(loc)
    if names is None:
        return False, "it is a file"
    if not names:
        return True, "an empty directory"
    for n in names:
        if (why := _not_run_member(loc, n)) is not None:
            return False, why
    if ("report.json" in names and is_run_directory(loc)) or any(n.endswith(".zarr") for n in names):
        return True, "a run directory"
    return False, "it is not a scaleattn store or run directory"


def check_replaceable(loc: Location, role: str = "output", kind: str | None = None) -> None:
    """Refuse to replace (``--overwrite``) an existing ``loc`` that scaleattn did not write, or (with ``kind``: a
    store format such as ``"scaleattn-model"``, or :data:`RUN`) one of another kind: a dataset given as a
    checkpoint or a model where a run directory goes is never deleted; nor one another run reads
    (:func:`check_unread`).

    Raises
    ------
    UnsafeOutputError
        Naming the path and what is there.
    OutputInUseError
        Another live scaleattn run reads it (naming its pid and host).
    """
    if not loc.exists():
        return
    ours, what = owner_of(loc)
    if not ours:
        raise UnsafeOutputError(f"{role} {loc.url} exists and was not written by scaleattn ({what}): `overwrite=True`"
                                " replaces only scaleattn's own outputs; remove it yourself or choose another path")
    if kind is not None and what not in (kind, "an empty directory"):
        raise UnsafeOutputError(f"{role} {loc.url} is {_kind_name(what)}, not {_kind_name(kind)}:"
                                " `overwrite=True` replaces only an output of the same kind; remove it yourself or"
                                " choose another path")
    check_unread(loc, role)


#: the kind of a run directory for :func:`check_replaceable` (store kinds are their ``format``)
RUN = "a run directory"


def _kind_name(what: str) -> str:
    return f"a {what[len(_formats.PREFIX):]} store" if what.startswith(_formats.PREFIX) else what


# ---- all or nothing -----------------------------------------------------------------------------------
def _temporaries(loc: Location) -> tuple[str, str]:
    parent, name = os.path.split(loc.url)
    return parent, f".{name}.partial-"


def _written_here(loc: Location) -> bool:
    """Whether the temporary ``loc`` holds only what a run writes, perhaps half of it: a directory whose files
    are Zarr metadata and chunks, or a run directory's report.json, plots and their ``write_files``
    temporaries. A user's file or folder that merely has a temporary's name is never removed."""
    if _entries(loc) is None:
        return False  # atomic_output's temporaries are directories
    files = _files(loc)
    run = [f for f in files if "/" not in f and (f == _formats.RUN_ENTRIES[0] or ".png" in f)]
    return _stray([f for f in files if f not in run]) is None


def clean_leftovers(loc: Location, protect=()) -> list[str]:
    """Remove the temporaries a killed run left next to local output ``loc`` (``.NAME.partial-`` and 8 hex digits,
    holding only what a run writes: :func:`_written_here`), restoring the previous output when a run died between
    moving it aside and putting the new one in place; never anything in ``protect`` (input Locations). Call only
    while holding the lock of ``loc`` (:func:`hold`). Returns the paths removed."""
    if loc.is_remote:
        return []
    parent, prefix = _temporaries(loc)
    ours = re.compile(re.escape(prefix) + r"[0-9a-f]{8}(?:\.old)?")  # the names atomic_output gives them
    try:
        names = sorted(n for n in os.listdir(parent) if ours.fullmatch(n) and not any(
            relation(Location(os.path.join(parent, n)), p) for p in protect)
            and _written_here(Location(os.path.join(parent, n))))
    except FileNotFoundError:
        return []
    asides = [n for n in names if n.endswith(".old") and owner_of(Location(os.path.join(parent, n)))[0]]
    if asides and not os.path.exists(loc.url):  # the previous output, moved aside by a run killed just then
        os.replace(os.path.join(parent, asides[-1]), loc.url)
        names.remove(asides[-1])
    for n in names:
        remove(os.path.join(parent, n))
    return [os.path.join(parent, n) for n in names]


@contextlib.contextmanager
def atomic_output(loc: Location, overwrite: bool = False, kind: str | None = None):
    """Yield a temporary :class:`Location` next to ``loc`` that becomes ``loc`` only if the block succeeds.

    A failure leaves nothing behind: neither a half-written store nor the temporary. An existing ``loc`` is
    refused (:class:`~scaleattn.errors.OutputExistsError`) unless ``overwrite``, and even then when scaleattn
    did not write it or it is of another ``kind`` than the new one (:func:`check_replaceable`;
    :class:`~scaleattn.errors.UnsafeOutputError`) or while another run reads it (:func:`check_unread`, checked
    again just before the old output is moved aside), as is a place that would not keep it or one inside a Zarr
    store (:func:`check_output_location`); locally it is replaced only after the new output is complete. The
    lock of ``loc`` is held throughout (:func:`hold`), and temporaries of a killed run are removed first.
    Object stores cannot rename: there ``overwrite`` deletes the old output first, and the new one is written
    in place and removed on failure.
    """
    check_output_location(loc)
    with hold(loc):
        clean_leftovers(loc)
        if loc.exists():
            if not overwrite:
                raise OutputExistsError(f"output {loc.url!r} already exists (pass `overwrite=True` to replace it)")
            check_replaceable(loc, kind=kind)
        if loc.is_remote:
            loc.remove()
            try:
                yield loc
            except BaseException:
                settle_writes()  # the puts still in flight land before the removal, not after it
                loc.remove()
                raise
            return
        url = loc.url
        parent, prefix = _temporaries(loc)
        tmp = os.path.join(parent, f"{prefix}{uuid.uuid4().hex[:8]}")
        aside = f"{tmp}.old"
        try:
            os.makedirs(parent, exist_ok=True)
            try:
                yield Location(tmp, loc.storage_options)
            except BaseException:
                settle_writes()  # the puts still in flight land before the removal below, not after it
                raise
            if os.path.exists(url):  # move the old output aside first: a crash now loses neither copy
                check_unread(loc)  # again: a reader may have started meanwhile (from now on one is refused)
                os.replace(url, aside)
            os.replace(tmp, url)
        except OSError as e:  # disk full, read-only, ...: the output's problem, not a bug (nothing is left)
            if (err := _refused(e, loc, "output", inside=tmp, kept=NOTHING_WRITTEN)) is None:
                raise
            raise err from e
        finally:
            remove(tmp)
            remove(aside)


@contextlib.contextmanager
def writing(loc: Location, role: str, kept: str = ""):
    """Writes to ``loc`` (a store written in place: a checkpoint) in the block: the file system's refusal, a full
    disk, a quota, a read-only file system (also from a ``write()``, which names no path) or a refused permission
    on a path inside ``loc``, becomes a :class:`~scaleattn.errors.StorageError` naming ``loc`` (the CLI's one
    line, exit 2), ending with ``kept``; any other error is raised as it is.

    Raises
    ------
    StorageError
        ``cannot write ROLE URL: No space left on device``.
    """
    try:
        yield
    except OSError as e:
        unnamed = not e.filename  # (a write() names no path: in this block, it was one of loc's)
        if loc.is_remote or (err := _refused(e, loc, role, inside=loc.url, kept=kept, always=unnamed
                                             and file_system_refusal(e) is not None)) is None:
            raise
        raise err from e

