"""Shared validation and layout of tensor-attention inputs (DESIGN §8): the five arrays, the logit scale, the
causal / window masks, and the (batch, n, d) float64 layout every kernel works on. The kernels are written against
the array API standard (numpy, CuPy, torch, ``array_api_strict``): new arrays are made on the inputs' device by the
helpers here."""
from __future__ import annotations

import math

import numpy as np

from .._backend import as_float64, contiguous, device_of, get_xp, is_numpy
from ..errors import ParameterError

_NAMES = ("Q", "K1", "K2", "V1", "V2")
_BLOCK_ELEMS = 1 << 20  # elements of one (bq, bj, bk) logit block per batch slab: ~8 MB in float64


def _validate(arrays):
    """Check a dict name -> array: same shape (..., n, d), real float dtype, finite. Return (xp, arrays, dtype).

    Arrays of any array API library (numpy, CuPy, torch, ...), all in one namespace and on one device
    (:class:`~scaleattn.errors.DeviceMismatchError` otherwise); non-arrays (lists) are read with numpy."""
    xp = get_xp(*[a for a in arrays.values() if hasattr(a, "shape")])
    out, shape, first = {}, None, None
    for name, a in arrays.items():
        if a is None:
            raise TypeError(f"{name} is required (got None)")
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            try:
                a = np.asarray(a) if is_numpy(xp) else xp.asarray(a, device=_device(arrays))
            except Exception as exc:  # ragged lists, strings, ...
                raise TypeError(f"{name} must be an array of floats, got {type(a).__name__}") from exc
        if not _is_real_float(a, xp):
            raise TypeError(f"{name} must have a real floating dtype (float32 or float64), got {a.dtype}")
        if a.ndim < 2:
            raise ParameterError(f"{name} must have shape (..., n, d), got shape {tuple(a.shape)}")
        if shape is None:
            shape, first = tuple(a.shape), name
            if shape[-1] == 0 or shape[-2] == 0:
                raise ParameterError(f"{name} must have n >= 1 and d >= 1, got shape {shape}")
        elif tuple(a.shape) != shape:
            raise ParameterError(f"{name} has shape {tuple(a.shape)}, expected {shape} (the shape of {first})")
        if not bool(xp.all(xp.isfinite(a))):
            raise ParameterError(f"{name} contains non-finite values (nan or inf)")
        out[name] = a
    dtype = xp.result_type(*[a.dtype for a in out.values()])
    return xp, out, dtype


def _device(arrays):
    """The device of the first array among the values of ``arrays`` (None when there is none)."""
    return next((device_of(a) for a in arrays.values() if hasattr(a, "shape")), None)


def _is_real_float(a, xp) -> bool:
    if is_numpy(xp):
        return a.dtype.kind == "f"
    return bool(xp.isdtype(a.dtype, "real floating"))


def _scale(scale, d):
    """s = 1/d ([C25], default), 1/sqrt(d) for ``"sqrt"``, or the given finite float."""
    if scale is None or (isinstance(scale, str) and scale in ("1/d", "paper")):
        return 1.0 / d
    if isinstance(scale, str):
        if scale in ("sqrt", "1/sqrt(d)"):
            return 1.0 / math.sqrt(d)
        raise ParameterError(f"scale must be None, 'sqrt' or a float, got {scale!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be None, 'sqrt' or a float, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ParameterError(f"scale must be finite, got {scale}")
    return float(scale)


def _window(window, causal):
    """Return (masked, w1, w2); w = None means unbounded. A window implies the causal mask."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is None:
        return bool(causal), None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ParameterError(f"window must be None or a pair (w1, w2) of positive ints, got {window!r}")
    ws = []
    for name, w in zip(("w1", "w2"), window):
        if w is None:
            ws.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
            raise ParameterError(f"window {name} must be a positive int or None, got {w!r}")
        ws.append(int(w))
    return True, ws[0], ws[1]


def _flat(a, xp, B, n, d):
    """(..., n, d) -> float64 (B, n, d) (C-contiguous on numpy)."""
    return contiguous(xp.reshape(as_float64(a, xp), (B, n, d)), xp)


def _cast(a, dtype, xp):
    """``a`` in the inputs' common float ``dtype`` (no copy when it already is)."""
    return xp.astype(a, dtype, copy=False)


def _empty(shape, xp, like):
    """A new float64 array of ``shape`` on the device of ``like`` (``xp.empty``)."""
    return xp.empty(shape, dtype=xp.float64, device=device_of(like))


def _zeros(shape, xp, like):
    """Zeros, float64, of ``shape`` on the device of ``like``."""
    return xp.zeros(shape, dtype=xp.float64, device=device_of(like))


def _full(shape, value, xp, like):
    """``value`` everywhere, float64, ``shape``, on the device of ``like``."""
    return xp.full(shape, value, dtype=xp.float64, device=device_of(like))



def _prepare(arrays, scale, causal, window):
    xp, arrs, dtype = _validate(arrays)
    shape = arrs["Q"].shape
    n, d = shape[-2], shape[-1]
    B = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
    s = _scale(scale, d)
    masked, w1, w2 = _window(window, causal)
    flat = {k: _flat(v, xp, B, n, d) for k, v in arrs.items()}
    return xp, flat, dtype, shape, (B, n, d), s, (masked, w1, w2)
