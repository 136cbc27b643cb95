"""The run directory of a fit (layer L4): its one writer (:func:`write_run`, :func:`write_files`) and its one
reader (:func:`read_run`). See docs/report.md.

Layout::

    RUN/report.json     every number of the fit (strict JSON)
    RUN/model.zarr      coefficients and heads (:class:`~scaleattn.model.MHLAModel`)
    RUN/stats.zarr      sufficient statistics (:class:`~scaleattn.statistics.Statistics`), mergeable
    RUN/spectrum.zarr   eigenvalues of Lambda_D and of the Jacobi-scaled Gram (eigh path only)
    RUN/*.png           plots (:mod:`scaleattn.plot`)
"""
from __future__ import annotations

import json
import os
import uuid

import numpy as np

from . import _formats, _integrity
from ._outputs import RUN, atomic_output, is_scaleattn_plot
from ._storage import Location, check_kind, resolve, settle_writes
from .certificate import certify
from .errors import InputNotFoundError, ParameterError, StorageError, UnsafeOutputError
from .model import MHLAModel
from .statistics import Statistics

__all__ = ["write_run", "write_files", "read_run", "save_spectrum", "load_spectrum", "REPORT", "MODEL", "STATS",
           "SPECTRUM"]

REPORT, MODEL, STATS, SPECTRUM = "report.json", "model.zarr", "stats.zarr", "spectrum.zarr"


def save_spectrum(certificate, loc: Location) -> None:
    """Write a certificate's spectra as a Zarr v3 group (a run's ``spectrum.zarr``): arrays ``eigenvalues``
    (eigenvalues of ``Lambda_D``) and ``eigenvalues_scaled`` (Jacobi-scaled Gram), both (psi,) float64
    ascending with dimension ``eigenvalue``; the certificate summary in the attributes.

    Raises :class:`~scaleattn.errors.ParameterError` when the certificate has no spectrum of ``Lambda_D``
    (the Cholesky path keeps only the extreme eigenvalues)."""
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
    g.attrs.update({**certificate.summary(), **_formats.stamp(_formats.SPECTRUM), _integrity.MANIFEST: {"arrays": sums},
                    "description": "eigenvalues of the certificate's matrices [Yau et al. 2025, Lemma 2.3]"})


def load_spectrum(loc: Location) -> tuple[np.ndarray, np.ndarray]:
    """``(eigenvalues, eigenvalues_scaled)`` of a ``spectrum.zarr`` written by :func:`save_spectrum`."""
    g = loc.open_group("r")
    _formats.check_format(dict(g.attrs), _formats.SPECTRUM, loc.url, "spectrum")
    return _integrity.read_checked(g, "eigenvalues", loc.url), _integrity.read_checked(g, "eigenvalues_scaled", loc.url)


def write_run(result, out, overwrite: bool = False, files: dict | None = None) -> list[str]:
    """Write a fit's run directory at ``out`` (a path, URL or Location): ``report.json``, ``model.zarr``,
    ``stats.zarr``, ``spectrum.zarr`` when the certificate has the whole spectrum, and ``files`` (name ->
    bytes, e.g. the PNG plots), all or nothing (:func:`~scaleattn._outputs.atomic_output`).

    ``result`` is a :class:`~scaleattn.pipeline.FitResult` (``model``, ``statistics``, ``certificate``,
    ``report``). Returns the names written, in that order. Raises :class:`~scaleattn.errors.OutputExistsError`
    when ``out`` exists and not ``overwrite``.
    """
    out = resolve(out)
    on_workers = getattr(result.statistics, "operator", None) is not None  # krylov on a cluster: Tc never gathered
    names = [REPORT, MODEL] + ([] if on_workers else [STATS])
    with atomic_output(out, overwrite, RUN) as tmp:
        if not tmp.is_remote:
            os.makedirs(tmp.url, exist_ok=True)
        result.model.save(tmp.join(MODEL))
        if not on_workers:
            result.statistics.save(tmp.join(STATS), attrs={"dataset": result.report.get("dataset", "")})
        if result.certificate.eigenvalues is not None:
            save_spectrum(result.certificate, tmp.join(SPECTRUM))
            names.append(SPECTRUM)
        tmp.join(REPORT).write_bytes(_formats.dumps(result.report).encode())
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
        raise UnsafeOutputError(f"{clash[0]} exists and is not a file: not replaced (choose another --out)")
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
            raise StorageError(f"cannot write the files into {out.url}: {e}") from e
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
                                    " choose another --out")


def read_run(run, storage_options=None) -> dict:
    """Read a run directory: ``dict(report, eigenvalues, eigenvalues_scaled, model)``.

    The spectra come from ``spectrum.zarr``, or are recomputed from ``stats.zarr`` when it is missing (runs
    of the Cholesky path); ``model`` is None when ``model.zarr`` is missing.

    Raises
    ------
    InputNotFoundError
        ``report.json`` is missing (not a run directory written by ``scaleattn fit``).
    ParameterError
        ``run`` is a file, or a path through a file.
    """
    run = resolve(run, storage_options)
    check_kind(run, "run", "a run directory", directory=True)
    rp = run.join(REPORT)
    if not rp.exists():
        raise InputNotFoundError(f"{run.url}: no report.json (not a run directory written by `scaleattn fit`)")
    report = json.loads(rp.read_text())
    sp = run.join(SPECTRUM)
    if sp.exists():
        ev, ws = load_spectrum(sp)
    else:
        cert = certify(Statistics.load(run.join(STATS)), report.get("cutoff_rtol"))
        ev, ws = cert.eigenvalues, cert.spectrum_scaled
    mp = run.join(MODEL)
    model = MHLAModel.load(mp) if mp.exists() else None
    return {"report": report, "eigenvalues": ev, "eigenvalues_scaled": ws, "model": model}
