"""Array backend: one code path for numpy and cupy.

The array module is taken from the input (``get_xp``), so the same function runs on the host or on a GPU
worker without branches. Statistics are always accumulated in float64 (DESIGN §3): never TF32/FP16.
"""
from __future__ import annotations

import numpy as np


def get_xp(*arrays):
    """Return the array module (``numpy`` or ``cupy``) of the given arrays.

    Raises
    ------
    TypeError
        If the arrays mix host (numpy) and device (cupy) memory.
    """
    mods = {type(a).__module__.split(".")[0] for a in arrays if a is not None and hasattr(a, "shape")}
    if "cupy" in mods:
        if len(mods - {"cupy"}) and any(isinstance(a, np.ndarray) for a in arrays):
            raise TypeError("cannot mix numpy and cupy arrays; move all inputs to one device")
        import cupy

        return cupy
    return np


def to_numpy(a):
    """Copy a numpy or cupy array to host memory as a numpy array (no copy for numpy input)."""
    if hasattr(a, "get") and type(a).__module__.split(".")[0] == "cupy":
        return a.get()
    return np.asarray(a)


def have_cupy() -> bool:
    """True when cupy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError, missing driver
        return False
