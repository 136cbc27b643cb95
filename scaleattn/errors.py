"""Every error scaleattn raises on purpose, under one base class.

:class:`ScaleattnError` is the base: a ``ValueError``, so code that caught ``ValueError`` before keeps working.
Each subclass also derives from the builtin it refines where that helps callers (``FileExistsError``,
``MemoryError``, ``ImportError``, ...), as zarr-python's ``zarr.errors`` does. The CLI maps any
:class:`ScaleattnError` to exit code 2 with its one-line message; anything else is a bug (exit 1).

Messages name the problem and where it is (the array and sample, the option, the path), in one line. A message
names a parameter as the Python API spells it, as ``NAME must ...`` at its start, or anywhere in backticks,
```NAME``` or ```NAME=VALUE``` (``pass `overwrite=True` to replace it``), never as a command-line option
(``--overwrite``), which a Python caller cannot pass: the command line prints these as its options (``--NAME``,
``--NAME VALUE``, a flag alone: ``--overwrite``; :func:`scaleattn.cli._typed`). A whole command in backticks
(```scaleattn plot RUN_DIR```) is advice to run that command, from a shell.
"""
from __future__ import annotations

__all__ = [
    "ScaleattnError", "ParameterError", "UnsupportedError", "DatasetError", "StorageError", "FormatError",
    "OutputExistsError",
    "InputNotFoundError", "CheckpointError", "InsufficientMemoryError", "MissingDependencyError", "ClusterError",
    "SubmitError", "IntegrityError", "UnsafeOutputError", "OutputInUseError", "DeviceMismatchError", "with_hint",
    "hint_of", "Note", "NotFittedError",
]


class ScaleattnError(ValueError):
    """Base of every error scaleattn raises on purpose: bad input, a refusal, an unreachable store.

    The CLI prints ``scaleattn COMMAND: error: MESSAGE`` and exits with code 2; a usage error (:attr:`usage`: a
    bad or missing option, :class:`ParameterError`) adds ``(see scaleattn COMMAND --help)``, where the help can
    help; a refusal of data or outputs says what to do in its message instead.

    Examples
    --------
    >>> from scaleattn.errors import ParameterError, ScaleattnError
    >>> issubclass(ParameterError, ScaleattnError) and issubclass(ScaleattnError, ValueError)
    True
    """

    #: whether the error is in how the command was called (its options), so that its help can help
    usage = False


class Note(UserWarning):
    """Not a problem, but something the user would otherwise miss, issued with :func:`warnings.warn`: e.g. a
    plot not drawn and why. The CLI prints ``scaleattn COMMAND: note: MESSAGE``."""


class ParameterError(ScaleattnError):
    """A parameter is out of range, not finite, of the wrong type, or not one of the allowed choices."""

    usage = True


class DeviceMismatchError(ParameterError, TypeError):
    """Arrays of one call live in different array libraries (numpy and CuPy, say) or on different devices; the
    message names both. Also a ``TypeError``, which the backend raised for numpy/CuPy mixing before."""


class UnsupportedError(ParameterError, NotImplementedError):
    """A valid combination of options that this path does not offer (a documented limit, with the way round it
    in the message): our error, exit 2 from the CLI, not a bug."""


class DatasetError(ScaleattnError):
    """A dataset is malformed; the message names the array and, where it applies, the first bad sample.

    Examples
    --------
    >>> import numpy as np, scaleattn
    >>> bad = np.ones((3, 4, 2)); bad[1, 0, 0] = np.nan
    >>> try:
    ...     scaleattn.write_dataset("_doc_bad.zarr", bad, np.ones((3, 2)), overwrite=True)
    ... except scaleattn.DatasetError as e:
    ...     print(e)
    tokens: sample 1 contains NaN or Inf
    """


class IntegrityError(DatasetError):
    """Stored data are missing, damaged, or not the data the run was started on (absent chunks, a failed
    checksum, a store changed since it was checked); the message names the array and the sample range."""


class StorageError(ScaleattnError, OSError):
    """A store cannot be reached or refuses access (endpoint, credentials, permissions).

    The message names the URL, the underlying error and where the endpoint and credentials come from.
    ``transient`` is True when the cause was a dropped connection or a timeout, which the retry policy
    (:func:`scaleattn.store._location.with_retries`) retries; refused credentials or permissions are not."""

    def __init__(self, *args, transient: bool = False):
        super().__init__(*args)
        self.transient = bool(transient)

    def __reduce__(self):
        # its own, so that a worker's StorageError reaches the client as itself: distributed pickles task errors
        # through tblib, which rebuilds a class with its own __init__ and the builtin __reduce__ by
        # ``cls.__new__(cls)``, unsafe for two builtin bases (ValueError, OSError): "Exception: StorageError(...)"
        return type(self), self.args, self.__dict__


class FormatError(ScaleattnError):
    """A store is not a scaleattn store of the expected kind or format version."""


class UnsafeOutputError(ScaleattnError):
    """An output, checkpoint or ``--overwrite`` target would write into or remove an input store, or a
    directory scaleattn did not write, or go where it would not outlive the command (``memory://``, HTTP, an
    archive, a cache layer); refused before anything is written or removed."""


class OutputInUseError(ScaleattnError):
    """Another scaleattn run holds the lock of an output or checkpoint, reads a store that would be replaced or
    deleted, or is replacing a store that would be read; the message names it (host, pid, start)."""


class OutputExistsError(ScaleattnError, FileExistsError):
    """An output (run directory, dataset, checkpoint) exists and may not be replaced."""


class InputNotFoundError(ScaleattnError, FileNotFoundError):
    """An input (dataset, model, run directory, file) does not exist."""


class CheckpointError(ScaleattnError):
    """A checkpoint belongs to another build, is damaged, or cannot be used as asked."""


class InsufficientMemoryError(ScaleattnError, MemoryError):
    """The work cannot fit in the memory available (checked before it starts)."""


class MissingDependencyError(ScaleattnError, ImportError):
    """An optional package is needed; the message gives the install command (:func:`install_hint`)."""

    @classmethod
    def for_extra(cls, what: str, extra: str, packages: str) -> MissingDependencyError:
        """``"{what} needs {packages}: {install command}"`` for the optional extra ``extra``."""
        return cls(f"{what} needs {packages}: {install_hint(extra, packages)}")


def install_hint(extra: str, packages: str) -> str:
    """The command that installs the optional ``extra`` the way this scaleattn was installed.

    From a checkout (an editable or local-directory install) that is ``pip install -e '/path/to/checkout[extra]'``;
    from a package index ``pip install 'scaleattn[extra]'``; when scaleattn is not installed at all (run from a
    source tree), ``pip install PACKAGES``.

    Examples
    --------
    >>> install_hint("gpu", "cupy").startswith("pip install")
    True
    """
    import json
    from importlib import metadata

    dists = list(metadata.distributions(name="scaleattn"))  # a checkout's egg-info can shadow the installed one
    if not dists:
        return f"pip install {packages}"
    try:
        info = next((json.loads(t) for t in (d.read_text("direct_url.json") for d in dists) if t), {})
    except ValueError:
        info = {}
    url = info.get("url", "")
    if url.startswith("file://") and "dir_info" in info:  # installed from a checkout
        editable = "-e " if info["dir_info"].get("editable") else ""
        return f"pip install {editable}'{url[len('file://'):]}{f'[{extra}]' if extra else ''}'"
    return f"pip install 'scaleattn{f'[{extra}]' if extra else ''}'"


class NotFittedError(ScaleattnError, AttributeError):
    """An estimator's method that needs a fitted model (``predict``, ``score``) called before ``fit``; also an
    ``AttributeError``, as scikit-learn's ``NotFittedError`` is (:class:`scaleattn.MHLARegressor` raises one that
    is scikit-learn's too when scikit-learn is installed)."""


class ClusterError(ScaleattnError, RuntimeError):
    """The Dask cluster could not be reached, or has no workers, within the configured time."""


class SubmitError(ScaleattnError, RuntimeError):
    """A Kubernetes job could not be sent or followed (no cluster reachable, operator missing, ...)."""


def with_hint(exc: BaseException, hint: str) -> BaseException:
    """Attach a one-line ``hint`` (what was kept and how to continue) to ``exc``; the CLI prints it after the
    message, and a traceback (a notebook's, Python >= 3.11) shows it as a note: an interrupted ``fit`` in a
    cell said nothing of the checkpoint it kept. Returns ``exc``."""
    old = getattr(exc, "scaleattn_hint", None)
    exc.scaleattn_hint = f"{old}; {hint}" if old else hint
    if hasattr(exc, "add_note"):
        exc.add_note(hint)
    return exc


def hint_of(exc: BaseException) -> str | None:
    """The hint attached by :func:`with_hint`, or None."""
    return getattr(exc, "scaleattn_hint", None)
