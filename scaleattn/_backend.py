"""Array backend (layer L0): one code path for numpy and cupy.

The array module is taken from the input (``get_xp``), so the same function runs on the host or on a GPU
worker without branches; :func:`array_module` picks it for a ``device`` name. Statistics are always
accumulated in float64 (DESIGN §3): never TF32/FP16.
"""
from __future__ import annotations

import os

import numpy as np

from .errors import MissingDependencyError, ParameterError

__all__ = ["get_xp", "to_numpy", "have_cupy", "array_module", "check_device", "DEVICES"]

#: the devices a statistics build can run on (``--device``)
DEVICES = ("auto", "cpu", "gpu")


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


def check_device(device: str, *, need_gpu_here: bool = False) -> str:
    """``device`` if it is one of :data:`DEVICES` (else :class:`ParameterError`). With ``need_gpu_here``,
    ``"gpu"`` also needs CuPy and a CUDA device in this process (:class:`MissingDependencyError` otherwise,
    with the install command)."""
    if not isinstance(device, str) or device not in DEVICES:
        raise ParameterError(f"device must be one of {', '.join(map(repr, DEVICES))}, got {device!r}")
    if device == "gpu" and need_gpu_here and not have_cupy():
        raise MissingDependencyError.for_extra("device='gpu'", "gpu", "CuPy and a CUDA GPU")
    return device


def array_module(device: str = "auto"):
    """numpy or cupy for ``device`` (validated by :func:`check_device`).

    ``"auto"`` picks the GPU only where one is assigned to this process (``CUDA_VISIBLE_DEVICES``, as
    dask-cuda sets per worker), so CPU workers never pile onto GPU 0; ``"gpu"`` requires one.
    """
    check_device(device, need_gpu_here=device == "gpu")
    if device == "cpu":
        return np
    if device == "gpu" or (os.environ.get("CUDA_VISIBLE_DEVICES") and have_cupy()):
        import cupy

        return cupy
    return np
