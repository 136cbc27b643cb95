"""The run directory of a fit: its one writer (:func:`write_run`, :func:`write_files`) and its one
reader (:func:`read_run`). See docs/report.md.

Layout::

    RUN/report.json     every number of the fit (strict JSON)
    RUN/model.zarr      coefficients and heads (:class:`~scaleattn.model.MHLAModel`)
    RUN/stats.zarr      sufficient statistics (:class:`~scaleattn.statistics._container.Statistics`), mergeable
    RUN/spectrum.zarr   eigenvalues of Lambda_D and of the Jacobi-scaled Gram (eigh path only: psi <= 2,000
                        or a singular Gram)
    RUN/*.png           plots (:mod:`scaleattn.plot`)
"""
from __future__ import annotations

import hashlib
import os
import uuid

import numpy as np

from .errors import FormatError, InputNotFoundError, IntegrityError, ParameterError, StorageError, UnsafeOutputError
from .features import n_features
from .linalg._solver import certify
from .linalg._spectrum import LARGE_PSI
from .model import MHLAModel
from .statistics._container import Statistics
from .store import _formats, _integrity
from .store._location import (
    Location,
    check_kind,
    check_path,
    check_storage_options,
    did_you_mean,
    resolve,
    settle_writes,
)
from .store._outputs import RUN, atomic_output, is_scaleattn_plot

__all__ = ["write_run", "write_files", "read_run", "save_spectrum", "load_spectrum", "report_digest",
           "spectrum_not_kept", "REPORT", "MODEL", "STATS", "SPECTRUM", "RUN_ATTR", "SPECTRUM_RECOMPUTE_PSI"]

REPORT, MODEL, STATS, SPECTRUM = "report.json", "model.zarr", "stats.zarr", "spectrum.zarr"
#: the attribute of each store of a run holding :func:`report_digest` of its report.json
RUN_ATTR = "run"
#: psi up to which :func:`read_run` recomputes the whole spectrum (two eigh of psi x psi, ~20 s on one core at
#: psi = 4,000) for a run without spectrum.zarr; ``full_spectrum`` (``plot --full-spectrum``) at any psi
SPECTRUM_RECOMPUTE_PSI = 4_000


def report_digest(text: bytes) -> str:
    """sha256 of a run's report.json bytes (16 hex digits): what binds the run's stores to that report."""
    return hashlib.sha256(text).hexdigest()[:16]


def save_spectrum(certificate, loc: Location, attrs=None) -> None:
    """Write a certificate's spectra as a Zarr v3 group (a run's ``spectrum.zarr``): arrays ``eigenvalues``
    (eigenvalues of ``Lambda_D``) and ``eigenvalues_scaled`` (Jacobi-scaled Gram), both (psi,) float64
    ascending with dimension ``eigenvalue``; the certificate summary in the attributes.

    Raises :class:`~scaleattn.errors.ParameterError` when the certificate has no spectrum of ``Lambda_D``
    (the Cholesky path keeps only the extreme eigenvalues). ``attrs``: further attributes (a run's binding to
    its report)."""
    if certificate.eigenvalues is None:
        raise ParameterError("certificate has no eigenvalues of Lambda_D")
    g = loc.open_group("w")
    sums = {}
    _integrity.create_checked(g, "eigenvalues", np.asarray(certificate.eigenvalues, np.float64), sums,
                              dimension_names=("eigenvalue",),
                              attributes={"description": "eigenvalues of Lambda_D = G/N, ascending",
                                          "units": "(units of features)^2"})
    _integrity.create_checked(g, "eigenvalues_scaled", np.asarray(certificate.spectrum_scaled, np.float64), sums,
                              dimension_names=("eigenvalue",),
                              attributes={"description": "eigenvalues of the Jacobi-scaled Gram D^-1/2 G D^-1/2,"
                                                         " ascending; the rank counts those above cutoff_rtol * max",
                                          "units": "1"})
    meta = {**certificate.summary(), **(attrs or {}), **_formats.stamp(_formats.SPECTRUM),
            "description": "eigenvalues of the certificate's matrices [Yau et al. 2025, Lemma 2.3]"}
    g.attrs.update({**meta, _integrity.MANIFEST: _integrity.small_manifest(sums, meta)})


def load_spectrum(loc: Location) -> tuple[np.ndarray, np.ndarray]:
    """``(eigenvalues, eigenvalues_scaled)`` of a ``spectrum.zarr`` written by :func:`save_spectrum`."""
    return _read_spectrum(loc)[1:]


def _read_spectrum(loc: Location):
    """``(attributes, eigenvalues, eigenvalues_scaled)`` of a spectrum store, checked
    (:func:`scaleattn.store._integrity.read_store`; both arrays (psi,))."""
    def shapes(a, declared):  # (before any chunk is read)
        ev, ws = declared["eigenvalues"], declared["eigenvalues_scaled"]
        if len(ev) != 1 or ev != ws or ("psi" in a and a["psi"] != ev[0]):
            raise IntegrityError(f"{loc.url}: eigenvalues {ev} and eigenvalues_scaled {ws} are not two spectra of"
                                 f" psi = {a.get('psi', '?')} values: the store was edited")
        return declared

    a, arrays = _integrity.read_store(loc, _integrity.open_store(loc, "spectrum"), _formats.SPECTRUM, "spectrum",
                                      ("eigenvalues", "eigenvalues_scaled"), shapes=shapes)
    return a, arrays["eigenvalues"], arrays["eigenvalues_scaled"]


def write_run(result, out, overwrite: bool = False, files: dict | None = None) -> list[str]:
    """Write a fit's run directory at ``out`` (a path, URL or Location): ``report.json``, ``model.zarr``,
    ``stats.zarr``, ``spectrum.zarr`` when the certificate has the whole spectrum, and ``files`` (name ->
    bytes, e.g. the PNG plots), all or nothing (:func:`~scaleattn.store._outputs.atomic_output`).

    ``result`` is a :class:`~scaleattn.pipeline.FitResult` (``model``, ``statistics``, ``certificate``,
    ``report``). Returns the names written, in that order. Raises :class:`~scaleattn.errors.OutputExistsError`
    when ``out`` exists and not ``overwrite``.
    """
    out = resolve(out)
    # krylov on a cluster: Tc never gathered; the streaming paths make no statistics (DESIGN §4b)
    on_workers = result.statistics is None or getattr(result.statistics, "operator", None) is not None
    names = [REPORT, MODEL] + ([] if on_workers else [STATS])
    text = _formats.dumps(result.report).encode()
    bind = {RUN_ATTR: report_digest(text)}  # each store names the report it belongs to (checked by read_run)
    with atomic_output(out, overwrite, RUN) as tmp:
        if not tmp.is_remote:
            os.makedirs(tmp.url, exist_ok=True)
        result.model.save(tmp.join(MODEL), attrs=bind)
        if not on_workers:
            result.statistics.save(tmp.join(STATS), attrs={"dataset": result.report.get("dataset", ""), **bind})
        if result.certificate.eigenvalues is not None:
            save_spectrum(result.certificate, tmp.join(SPECTRUM), attrs=bind)
            names.append(SPECTRUM)
        tmp.join(REPORT).write_bytes(text)
        write_files(tmp, files or {})
    return names + list(files or {})


def write_files(out, files: dict) -> list[str]:
    """Write ``files`` (name -> bytes) into the directory ``out`` (a path, URL or Location), creating it;
    returns the paths written. Used for plots redrawn into a run directory or elsewhere.

    All or nothing: locally every file goes to a temporary next to it first; once all are written, each old file
    is moved aside and the new one renamed into place, and a failure on the way puts the old files back and
    removes a directory this call created. On an object store (no rename; each object appears whole) the
    objects this call created are removed when it fails or is interrupted.

    Raises
    ------
    UnsafeOutputError
        A target exists and is not a plain file (a directory, say).
    StorageError
        The directory cannot be written (permissions, a full disk).
    """
    out = resolve(out)
    targets = [out.join(name) for name in files]
    if out.is_remote:
        _check_replaceable_files(targets)
        created = []
        try:
            for loc, data in zip(targets, files.values()):
                new = not loc.exists()
                loc.write_bytes(data)
                if new:
                    created.append(loc)
        except BaseException:
            settle_writes()  # a put still in flight lands before the removal, not after it
            for loc in created:
                loc.remove()
            raise
        return [loc.url for loc in targets]
    clash = [loc.url for loc in targets if os.path.lexists(loc.url) and not os.path.isfile(loc.url)]
    if clash:
        raise UnsafeOutputError(f"{clash[0]} exists and is not a file: not replaced (choose another `out`)")
    _check_replaceable_files(targets)
    made = not os.path.isdir(out.url)
    token = uuid.uuid4().hex[:8]
    tmps = [f"{loc.url}.{token}.partial" for loc in targets]
    moved = []  # (target, its old file moved aside) in the order replaced
    try:
        os.makedirs(out.url, exist_ok=True)
        for tmp, data in zip(tmps, files.values()):
            with open(tmp, "wb") as f:
                f.write(data)
        for tmp, loc in zip(tmps, targets):
            aside = f"{loc.url}.{token}.old" if os.path.exists(loc.url) else None
            if aside:
                os.replace(loc.url, aside)
            moved.append((loc.url, aside))
            os.replace(tmp, loc.url)
    except BaseException as e:
        for url, aside in reversed(moved):  # put back what was there
            if aside:
                os.replace(aside, url)
            elif os.path.exists(url):
                os.remove(url)
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
        if made and os.path.isdir(out.url) and not os.listdir(out.url):
            os.rmdir(out.url)
        if isinstance(e, OSError) and not isinstance(e, StorageError):
            where = f" ({e.filename})" if e.filename else ""
            raise StorageError(f"cannot write the files into {out.url}: {e.strerror or e}{where}; no file there was"
                               " replaced or added") from e
        raise
    for _, aside in moved:
        if aside:
            os.remove(aside)
    return [loc.url for loc in targets]


def _check_replaceable_files(targets) -> None:
    """Refuse to replace an existing file that is not a plot scaleattn drew (a user's ``spectrum.png``)."""
    for loc in targets:
        if loc.exists() and not is_scaleattn_plot(loc):
            raise UnsafeOutputError(f"{loc.url} exists and is not a plot scaleattn drew: not replaced; move it or"
                                    " choose another `out`")


def spectrum_not_kept(psi, *, recompute: bool = True, stats_kept: bool = True, path_known: bool = True) -> str:
    """Why a run has no spectrum (no ``spectrum.zarr``, nothing recomputed), and what gives it, in one line.

    ``recompute``: whether :func:`read_run` (``scaleattn plot RUN_DIR``) recomputes it by default (psi up to
    :data:`SPECTRUM_RECOMPUTE_PSI`); ``stats_kept``: whether the run has a ``stats.zarr`` to recompute it from;
    ``path_known``: whether the fit's solver path is known to have kept no spectrum (a fit's own result), or only
    ``spectrum.zarr`` is seen to be missing (a run directory: the report does not say which path the fit took,
    and the file may have been removed since)."""
    extremes = "only the extreme eigenvalues (lambda_min, lambda_max in report.json)"
    if not path_known:
        why = (f"the run has no spectrum.zarr (a fit writes one when it computed the whole spectrum: eigh, by default"
               f" up to psi = {LARGE_PSI:,}; the Cholesky and krylov paths past that keep {extremes})")
    elif psi is not None and psi > LARGE_PSI:
        why = f"psi = {psi:,} > {LARGE_PSI:,}: the fit took the Cholesky or krylov path, which keeps {extremes}"
    else:
        why = f"the fit took the Cholesky or krylov path, which keeps {extremes}"
    if not stats_kept:
        stayed = " (the statistics stayed on the workers)" if path_known else ""
        return (f"{why}, and the run has no stats.zarr to recompute the spectrum from{stayed}; `scaleattn certify DATA"
                " --solver eigh` computes the whole spectrum")
    if recompute:
        return f"{why}; `scaleattn plot RUN_DIR` recomputes the whole spectrum from stats.zarr and draws it"
    return (f"{why}; recomputing the whole spectrum from stats.zarr (eigh, ~9 psi^3 flops: minutes) is only done"
            f" by default up to psi = {SPECTRUM_RECOMPUTE_PSI:,}: `scaleattn plot RUN_DIR --full-spectrum` does it")


def read_run(run, storage_options=None, *, full_spectrum: bool = False) -> dict:
    """Read a run directory: ``dict(report, eigenvalues, eigenvalues_scaled, model, spectrum_method,
    spectrum_note)``.

    The spectra come from ``spectrum.zarr``, or are recomputed (eigh) from ``stats.zarr`` when it is missing
    (runs of the Cholesky and krylov paths, psi > 2,000) up to psi = :data:`SPECTRUM_RECOMPUTE_PSI`, at any psi
    with ``full_spectrum``; otherwise they are None and ``spectrum_note`` says why
    (:func:`spectrum_not_kept`). ``spectrum_method`` is ``"qr"`` when the spectra are squared singular values of
    a QR certificate's R (``spectrum.zarr`` of such a run), else ``"gram"``. ``model`` is None when
    ``model.zarr`` is missing. Every store present must belong to this ``report.json`` (the digest of the report
    it records; stores of format v3): a store copied from another run, or a report edited since, is refused.

    Raises
    ------
    InputNotFoundError
        ``report.json`` is missing (not a run directory written by ``scaleattn fit``).
    FormatError
        ``report.json`` is not JSON, or a value the plots use has the wrong type.
    IntegrityError
        A store does not belong to this report (or was written before runs bound their stores to it), or is
        not the store written (:func:`scaleattn.store._integrity.read_store`).
    ParameterError
        ``run`` is a file, or a path through a file.
    """
    check_path(run, "read_run", "a run directory's path or URL (written by fit)")
    check_storage_options(storage_options, run)  # (fsspec's options of a local path: ignored, so refused)
    run = resolve(run, storage_options)
    check_kind(run, "run", "a run directory", directory=True)
    rp = run.join(REPORT)
    if not run.exists():
        raise InputNotFoundError(f"{run.url}: no such run directory{did_you_mean(run.url)}")
    if not rp.exists():
        raise InputNotFoundError(f"{run.url}: no report.json (not a run directory written by `scaleattn fit`)")
    text = rp.read_bytes()
    report = _report_json(text, rp.url)
    digest = report_digest(text)
    sp, mp, st = run.join(SPECTRUM), run.join(MODEL), run.join(STATS)
    if st.exists():  # read only when the spectrum is recomputed from it (Tc can be large): else its attributes
        stats_attrs = _member_attrs(st, _formats.STATISTICS, "statistics")
        _check_member(stats_attrs, STATS, run, digest)
    ev = ws = note = None
    method = "gram"  # what the spectra are: eigenvalues of the Gram's, or (qr) squared singular values of R
    if sp.exists():
        attrs, ev, ws = _read_spectrum(sp)
        _check_member(attrs, SPECTRUM, run, digest)
        method = attrs.get("certificate_method", "gram")
    elif not st.exists():
        note = spectrum_not_kept(report.get("psi"), stats_kept=False, path_known=False)
    else:
        psi = n_features(int(stats_attrs["d"]))  # (from the attributes: Tc is loaded only to be used)
        if psi > SPECTRUM_RECOMPUTE_PSI and not full_spectrum:
            note = spectrum_not_kept(psi, recompute=False, path_known=False)
        else:  # the whole spectrum (eigh) whatever path the fit took (past psi = 2,000 it kept the extremes)
            cert = certify(Statistics.load(st), report.get("cutoff_rtol"), solver="eigh")
            ev, ws = cert.eigenvalues, cert.spectrum_scaled
    model = None
    if mp.exists():
        model = MHLAModel.load(mp)
        _check_member(_member_attrs(mp, _formats.MODEL, "model"), MODEL, run, digest)
    return {"report": report, "eigenvalues": ev, "eigenvalues_scaled": ws, "model": model,
            "spectrum_method": method, "spectrum_note": note}


def _member_attrs(loc: Location, kind, what: str) -> dict:
    """The checked attributes of a store of the run (:func:`scaleattn.store._integrity.store_attrs`)."""
    return _integrity.store_attrs(_integrity.open_store(loc, what), kind, what, loc.url)[0]


def _check_member(attrs: dict, name: str, run: Location, digest: str) -> None:
    """Refuse a store of the run that does not record this report.json (``RUN_ATTR``, bound by its manifest)."""
    have = attrs.get(RUN_ATTR)
    if have == digest:
        return
    if have is None:
        raise IntegrityError(f"{run.url}: {name} does not record which report.json it belongs to (a store from"
                             " elsewhere, or a run written before scaleattn bound them): its parts cannot be shown"
                             " to belong together; fit again")
    raise IntegrityError(f"{run.url}: {name} was written with another report.json than this one (copied from"
                         " another run, or report.json edited since): the run's parts do not belong together")


#: JSON types of the report values the plots use (None allowed for each)
_REPORT_TYPES = {"cutoff_rtol": float, "lambda_min": float, "identifiable": bool, "n_heads": int,
                 "target_mean_square": float, "d": int, "psi": int}


def _report_json(text: bytes, url: str) -> dict:
    """The report, parsed strictly, with the types of the values the plots use checked (one error line)."""
    try:
        report = _formats.loads(text)
    except ValueError as e:  # (UnicodeDecodeError too)
        raise FormatError(f"{url}: not valid JSON ({e}): the report is damaged") from None
    if not isinstance(report, dict):
        raise FormatError(f"{url}: not a run report (a JSON object expected, got {type(report).__name__})")
    _formats.check_types({k: v for k, v in report.items() if v is not None}, _REPORT_TYPES, url,
                         optional=tuple(_REPORT_TYPES))
    for key, item in (("head_singular_values", (int, float)), ("loss_vs_heads", dict)):
        v = report.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, item) and not isinstance(x, bool)
                                                               for x in v)):
            raise FormatError(f"{url}: {key!r} must be a list of {'numbers' if key[0] == 'h' else 'objects'}")
    rows = report.get("loss_vs_heads") or ()
    for row in rows:  # one loss per entry, the same in all (_formats.LOSS_KEYS)
        _formats.check_types(row, {"heads": int, _formats.entries_key(rows): float}, f"{url}: loss_vs_heads")
    for key in ("dataset", "dataset_fingerprint"):
        if not isinstance(report.get(key, ""), (str, type(None))):
            raise FormatError(f"{url}: {key!r} must be a string")
    return report
