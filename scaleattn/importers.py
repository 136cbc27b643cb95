"""Real data into datasets (layer L4): ``.npz`` / ``.npy`` arrays, time-series CSV cut into windows, and a
built-in real dataset (scikit-learn's digits). Synthetic tasks are :mod:`scaleattn.generate`.

Every argument is checked before anything is written; a bad file or argument raises one clear
:class:`~scaleattn.errors.DatasetError` or :class:`~scaleattn.errors.ParameterError` naming it.
"""
from __future__ import annotations

import contextlib
import csv
import os
import warnings
import zipfile
import zlib

import numpy as np

from ._params import integer
from .data._checks import MAX_TOKEN, check_values, is_real
from .data._writer import write_dataset
from .errors import (
    DatasetError,
    InputNotFoundError,
    IntegrityError,
    MissingDependencyError,
    ParameterError,
    hint_of,
    with_hint,
)
from .store._location import check_kind, check_path, check_storage_options, did_you_mean, resolve
from .store._names import check_output_name
from .store._outputs import check_companions, check_disjoint

__all__ = ["windows", "standardize", "import_arrays", "import_csv", "load_digits_dataset"]


def windows(series, length: int, horizon: int = 1, step: int = 1, causal: bool = False):
    """Cut a multivariate time series (time, d) into windows of ``length`` tokens.

    Last-token targets: the value ``horizon`` steps after each window, (N, d). Causal targets: every
    prefix predicts its next value, (N, T, d) (``horizon`` = 1). Raises :class:`~scaleattn.errors.ParameterError` for
    ``length``, ``horizon`` or ``step`` below 1, or another ``horizon`` with ``causal``, and
    :class:`~scaleattn.errors.DatasetError` for a series too short for one window.
    """
    length, horizon, step = integer("length", length, 1), integer("horizon", horizon, 1), integer("step", step, 1)
    if causal and horizon != 1:  # (it was ignored without a word)
        raise ParameterError(f"`horizon` must be 1 with `causal` (each prefix predicts the next value), got {horizon}")
    x = np.asarray(series, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    span = length + (1 if causal else horizon)
    starts = np.arange(0, x.shape[0] - span + 1, step)
    if starts.size == 0:
        ahead = "1 (causal: each prefix predicts the next value)" if causal else f"`horizon={horizon}`"
        raise DatasetError(f"series of {x.shape[0]} steps is too short for one window of `length={length}` + {ahead}")
    tokens = np.stack([x[s : s + length] for s in starts])
    if causal:
        targets = np.stack([x[s + 1 : s + length + 1] for s in starts])
    else:
        targets = np.stack([x[s + length + horizon - 1] for s in starts])
    return tokens, targets


def standardize(series, moments: bool = False):
    """Per-column z-score of a (time, d) series (constant columns are left centred).

    Each column is divided by its largest magnitude first: the z-score does not change, and columns with
    values up to float64's largest are standardised without overflow (``std`` of a column holding 1e200 is
    inf, which made the whole column 0). With ``moments``, also each column's mean and standard deviation in the
    series' units (what maps a standardised value back: ``value * std + mean``; finite, as the values are)."""
    x = np.asarray(series, dtype=np.float64)
    top = np.abs(x).max(axis=0) if x.size else np.ones(x.shape[1:])
    top = np.where(top > 0, top, 1.0)
    x = x / top
    mean, sd = x.mean(axis=0), x.std(axis=0)
    z = (x - mean) / np.where(sd > 0, sd, 1.0)
    if not moments:
        return z
    with np.errstate(over="ignore"):
        return z, mean * top, sd * top


def _real(name: str, a, path):
    """``a`` as float64; integers are converted, bool, complex, strings and objects refused."""
    if a is None:
        return None
    if not is_real(a):
        raise DatasetError(f"{name}: expected a float (or integer) dtype, got {a.dtype} in {path}")
    if a.ndim and np.issubdtype(a.dtype, np.integer):
        check_values(name, a, 0)  # (before the conversion: integers beyond 2^53 would be rounded by it)
    return a.astype(np.float64, copy=False)


def _use_columns(names, which: str) -> str:
    """``"; import only NAMES: `columns=a b`"`` (the CLI says ``--columns a b``), ``""`` when there are none."""
    import shlex

    return f"; import {which} only: `columns={' '.join(map(shlex.quote, names))}`" if names else ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


#: what ``import --npz`` and ``import --csv`` expect, for the messages
NPZ, CSV = "a .npz or .npy file", "a CSV file"


def _check_source(path, expected: str, role: str = "") -> None:
    """The source file exists and is a file (:func:`scaleattn.store._location.check_kind`; ``role`` names the
    option)."""
    check_path(path, "import", f"as `path` the input file's path ({expected})",
               "; arrays in memory: scaleattn.write_dataset(url, tokens, targets)")
    check_kind(path, role, expected, directory=False)
    if not os.path.isfile(path):
        raise InputNotFoundError(f"{path}: no such file{did_you_mean(path)}")


def _check_output(url, path, storage_options) -> None:
    """The output is not the input file, nor inside it, nor named so that its lock or temporaries would be; its
    name holds them (:func:`scaleattn.store._names.check_output_name`, before the file is read)."""
    check_path(url, "import", "as `url` the output store's path or URL")
    check_path(path, "import", "as `path` the input file's path")
    pairs = ([("output", resolve(url, storage_options))], [("file", resolve(path))])
    check_output_name(pairs[0][0][1], "output")
    check_storage_options(storage_options, url)  # (before the file is read; write_dataset's check comes late)
    check_disjoint(*pairs)
    check_companions(*pairs)


def import_arrays(url, path, *, tokens="tokens", targets="targets", lengths="lengths", overwrite=False,
                  storage_options=None):
    """Import a ``.npz`` (arrays named ``tokens``, ``targets``, optional ``lengths``) or a ``.npy`` of tokens.

    The file's kind comes from its content, not its name. Files are read with ``allow_pickle=False``: object
    arrays are refused, never unpickled. Integer tokens and targets are converted to float64.

    Raises
    ------
    InputNotFoundError
        ``path`` does not exist.
    ParameterError
        ``path`` is a directory, or a path through a file.
    DatasetError
        Not a NumPy file, a missing ``tokens`` array, pickled objects, non-real dtypes, wrong shapes or
        non-finite values (naming the array and the sample).
    """
    _check_source(path, NPZ)
    _check_output(url, path, storage_options)
    with open(path, "rb") as f:
        magic = f.read(6)
    if not (magic.startswith(b"PK\x03\x04") or magic == b"\x93NUMPY"):  # the kind comes from the content
        raise DatasetError(f"{path}: not a NumPy .npz or .npy file (it starts with {magic!r})")
    try:
        loaded = np.load(path, allow_pickle=False)
    except ValueError as e:  # object arrays need pickle, or not a NumPy file at all
        raise DatasetError(f"{path}: not a .npz/.npy readable without unpickling ({e})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise DatasetError(f"{path}: not a NumPy .npz or .npy file, or a damaged one ({e})") from None
    if isinstance(loaded, np.ndarray):
        tok, y, lens = loaded, None, None
    else:
        with loaded as f:
            if tokens not in f.files:
                raise DatasetError(f"{path}: missing array {tokens!r} (found {sorted(f.files)})")
            try:
                arrs = {k: f[k] for k in f.files}
            except ValueError as e:
                raise DatasetError(f"{path}: cannot read without unpickling ({e})") from None
            except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # a truncated or corrupted member
                raise DatasetError(f"{path}: a damaged .npz ({type(e).__name__}: {e})") from None
        tok, y, lens = arrs[tokens], arrs.get(targets), arrs.get(lengths)
    tok, y = _real("tokens", tok, path), _real("targets", y, path)
    if tok.ndim != 3:
        raise DatasetError(f"{path}: tokens: expected 3 dimensions (sample, position, embed), got shape {tok.shape}")
    attrs = {"description": f"imported from {os.path.basename(str(path))}"}
    with _naming(path):
        return write_dataset(url, tok, y, lens, attrs=attrs, overwrite=overwrite, storage_options=storage_options)


def import_csv(url, path, *, length: int, horizon: int = 1, step: int = 1, causal=False, columns=None,
               standardize_columns=True, overwrite=False, storage_options=None):
    """Import a CSV of a multivariate time series (header row, one column per variable) cut into windows
    (:func:`windows`), each column z-scored unless ``standardize_columns`` is False; the columns' means and
    standard deviations (in the CSV's units) are then kept in the dataset's attribute ``standardized``
    (``{"mean": [...], "std": [...]}``, one per column: ``value * std + mean`` maps a token or a prediction back).

    Raises
    ------
    InputNotFoundError
        ``path`` does not exist.
    DatasetError
        An empty or header-only file, one separated by ';' (or tabs), an unknown column, a non-numeric or missing
        value (naming the line and the column), a series too short for one window, a column constant in every
        window's tokens, or one whose standard deviation is below float64's normal range (z-scored).
    ParameterError
        ``length``, ``horizon`` or ``step`` below 1, a column named twice in ``columns``; ``path`` is a
        directory, or a path through a file.
    """
    length, horizon, step = integer("length", length, 1), integer("horizon", horizon, 1), integer("step", step, 1)
    if columns is not None:  # one name, or names stripped as the header's are (" b " is column b)
        columns = [c.strip() for c in ([columns] if isinstance(columns, str) else columns)]
    twice = next((c for i, c in enumerate(columns or ()) if c in columns[:i]), None)
    if twice is not None:  # (a column taken twice is two identical token coordinates: a singular fit)
        raise ParameterError(f"columns must name each column once, got {twice!r} twice")
    _check_source(path, CSV)
    _check_output(url, path, storage_options)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [(k, r) for k, r in enumerate(csv.reader(f), 1) if r]
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); a CSV file is expected") from None
    except csv.Error as e:  # a NUL byte, a field too large
        raise DatasetError(f"{path}: not a readable CSV file ({e})") from None
    if not rows:
        raise DatasetError(f"{path}: empty file (expected a header row and one row per time step)")
    header = [h.strip() for h in rows[0][1]]
    body = [r for _, r in rows[1:]]
    if not body:
        raise DatasetError(f"{path}: only a header row, no data")
    if len(header) == 1 and any(c in header[0] for c in ";\t|"):  # (one column 'a;b;c' named no delimiter)
        sep = next(c for c in ";\t|" if c in header[0])
        raise DatasetError(f"{path}: the header is one column {header[0]!r}: the file looks {sep!r}-separated, and"
                           " a CSV file's values are separated by commas; save it with commas")
    if all(_is_number(h) for h in header):
        raise DatasetError(f"{path}: the first row ({', '.join(header[:4])}{', ...' if len(header) > 4 else ''}) is"
                           " numbers: a header row naming the columns is expected")
    dup = next((h for i, h in enumerate(header) if h in header[:i]), None)
    if dup is not None:
        raise DatasetError(f"{path}: column {dup!r} appears twice in the header")
    for k, r in rows[1:]:
        if len(r) != len(header):
            raise DatasetError(f"{path}: line {k}: {len(r)} value{'s' if len(r) != 1 else ''} but the header has"
                               f" {len(header)} columns")
    unknown = [c for c in (columns or []) if c not in header]
    if unknown:
        raise DatasetError(f"{path}: no column {unknown[0]!r} in the header (columns: {', '.join(header)})")
    cols = list(range(len(header))) if columns is None else [header.index(c) for c in columns]
    x = np.empty((len(body), len(cols)))
    for i, (k, r) in enumerate(rows[1:]):
        for j, c in enumerate(cols):
            try:
                x[i, j] = float(r[c])
            except ValueError:
                numeric = [h for h, v in zip(header, body[0]) if h != header[c] and _is_number(v)]
                raise DatasetError(f"{path}: line {k}, column {header[c]!r}: {r[c]!r} is not a number"
                                   + _use_columns(numeric, "the numeric columns")) from None
    if not np.isfinite(x).all():
        i, j = np.argwhere(~np.isfinite(x))[0]
        raise DatasetError(f"{path}: line {rows[1 + i][0]}, column {header[cols[j]]!r}: NaN or Inf")
    with _naming(path):  # (a series too short for one window: said with the file)
        tok = windows(x, length, horizon, step, causal)[0]
    _check_varies(path, x, tok, [header[c] for c in cols])
    if columns is None:  # (columns the user named are kept as named)
        _warn_time_index(path, x, [header[c] for c in cols])
    if standardize_columns:  # the units are kept in the attributes: predictions map back (value * std + mean)
        x, mean, sd = standardize(x, moments=True)
        small = np.flatnonzero(sd < np.finfo(np.float64).tiny)
        if small.size:  # (a std of 0 or a subnormal one: `value * std + mean` would not give the values back)
            j = int(small[0])
            raise DatasetError(f"{path}: column {header[cols[j]]!r}: its standard deviation ({sd[j]:.1e}) is below"
                               f" float64's normal range ({np.finfo(np.float64).tiny:.1e}): the stored std could"
                               " not map values back; rescale the column")
        moments = {"mean": mean.tolist(), "std": sd.tolist()}  # (finite: |x| <= float64's largest)
    else:  # the values go in as they are: one whose cubic features overflow is refused by its line and column
        bad = np.abs(x) > MAX_TOKEN  # (windows too small as a whole are refused by the write, by sample)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise DatasetError(f"{path}: line {rows[1 + i][0]}, column {header[cols[j]]!r}: {x[i, j]:.1e} is beyond"
                               f" |value| <= {MAX_TOKEN:.0e}, where the cubic features fit in float64; rescale the"
                               " column (or standardise it)")
    tok, y = windows(x, length, horizon, step, causal)
    attrs = {"description": f"windows of {os.path.basename(str(path))}", "columns": [header[c] for c in cols],
             "window": {"length": length, "horizon": horizon, "step": step}}
    if standardize_columns:
        attrs["standardized"] = moments
    with _naming(path):
        return write_dataset(url, tok, y, attrs=attrs, overwrite=overwrite, storage_options=storage_options)


#: a column that rises (or falls) on every one of at least this many lines is taken for a time index
TIME_INDEX_MIN_ROWS = 8


def _warn_time_index(path, x, names) -> None:
    """Warn, in one line, of a column that rises (or falls) on every line (0, 1, 2, ...; a numeric timestamp) kept
    as a feature among others: most likely the series' time index, which a model then learns from (and, past the
    training range, extrapolates in) as if it were a measured variable; the line says how to leave it out."""
    if x.shape[0] < TIME_INDEX_MIN_ROWS or x.shape[1] < 2:
        return
    dx = np.diff(x, axis=0)
    monotone = np.flatnonzero((dx > 0).all(axis=0) | (dx < 0).all(axis=0))
    if monotone.size and monotone.size < x.shape[1]:
        j = int(monotone[0])
        warnings.warn(f"{path}: column {names[j]!r} {'rises' if dx[0, j] > 0 else 'falls'} on every line"
                      f" ({x[0, j]:g}, {x[1, j]:g}, ..., {x[-1, j]:g}): a time index? It is kept as a feature, so"
                      " the model learns from the position in time itself"
                      + _use_columns([n for k, n in enumerate(names) if k not in monotone], "the others"),
                      stacklevel=3)


def _check_varies(path, x, tok, names) -> None:
    """Refuse a column that takes one value in every window's tokens (0 once z-scored, or constant as is): a
    token coordinate that never varies, so no fit could be identifiable. Checked on the tokens, not the series:
    a column varying only at lines the windows read as targets (or skip with ``step``) is as constant."""
    flat = np.flatnonzero(tok.max(axis=(0, 1)) == tok.min(axis=(0, 1)))  # (not np.ptp: it overflows at 1e308)
    if not flat.size:
        return
    j = int(flat[0])
    where = ("on every line" if x[:, j].min() == x[:, j].max() else
             "in every window's tokens; it varies only at lines read as targets or skipped by the step")
    raise DatasetError(f"{path}: column {names[j]!r} is constant ({tok[0, 0, j]:g} {where}): it carries nothing to"
                       " learn from and makes the fit unidentifiable"
                       + _use_columns([n for k, n in enumerate(names) if k not in flat], "the others"))


@contextlib.contextmanager
def _naming(path):
    """A bad value found while writing (an array and a sample) is named with the file it came from."""
    try:
        yield
    except IntegrityError:  # (the output's, not the file's)
        raise
    except DatasetError as e:
        if str(e).startswith(str(path)):
            raise
        named = DatasetError(f"{path}: {e}")
        if hint_of(e):
            with_hint(named, hint_of(e))
        raise named from None


def load_digits_dataset(url, *, overwrite=False, storage_options=None):
    """scikit-learn's handwritten digits (1,797 images of 8x8) as sequences of the first 7 pixel rows
    (d = 8, scaled to [0, 1]) predicting the 8th row (d_out = 8): a real, non-realizable regression.

    Raises :class:`~scaleattn.errors.MissingDependencyError` without scikit-learn (the ``data`` extra)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise MissingDependencyError.for_extra("the built-in digits dataset", "data", "scikit-learn") from None
    img = load_digits().images / 16.0  # (1797, 8, 8)
    attrs = {"description": "sklearn digits: rows 0-6 of each 8x8 image predict row 7",
             "source": "sklearn.datasets.load_digits"}
    return write_dataset(url, img[:, :7], img[:, 7], attrs=attrs, overwrite=overwrite, storage_options=storage_options)
