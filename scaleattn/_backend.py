"""Array backend: one code path for numpy, CuPy and any Python array API library.

The namespace is taken from the inputs (:func:`get_xp`), so the same function runs on the host or on a GPU
worker without branches. Plain numpy input gets numpy itself (its threaded BLAS paths and exact bits stay as they
are); any other array (CuPy, torch, ``array_api_strict``) gets its standard namespace from
``array_api_compat.array_namespace``, as scikit-learn does for its GPU support, and the array code then uses only
functions of the array API standard (https://data-apis.org/array-api/). New arrays are made on the inputs' device
(:func:`device_of`), host-side index tables are moved there explicitly (:func:`from_host`), and nothing is converted
to numpy implicitly: ``tests/test_array_api.py`` runs every kernel on ``array_api_strict`` arrays on a simulated
second device, where any such conversion raises. :func:`array_module` picks the namespace for a ``device`` name.
Statistics are always accumulated in float64 (DESIGN §3): never TF32/FP16.
"""
from __future__ import annotations

import os

import array_api_compat
import numpy as np

from .errors import DeviceMismatchError, MissingDependencyError, ParameterError

__all__ = ["get_xp", "is_numpy", "numpy_or_cupy", "device_of", "on_accelerator", "from_host", "on_device",
           "as_float64", "contiguous", "to_numpy", "vector_norm", "have_cupy", "array_module", "check_device",
           "DEVICES"]

#: the devices a statistics build can run on (``--device``)
DEVICES = ("auto", "cpu", "gpu")

#: the namespace of plain numpy input: numpy itself where it has the standard's names (numpy >= 2.1), else
#: array_api_compat's thin wrapper of it (same arrays, same arithmetic)
_NUMPY = np if hasattr(np, "cumulative_sum") else array_api_compat.array_namespace(np.empty(0))


def _is_foreign(a) -> bool:
    """An in-memory array of an array API library other than numpy (numpy arrays and scalars, lists, zarr and
    dask arrays and other host array-likes are read with ``np.asarray`` as before)."""
    return (not isinstance(a, (np.ndarray, np.generic)) and array_api_compat.is_array_api_obj(a)
            and not array_api_compat.is_dask_array(a))


def get_xp(*arrays):
    """The array namespace of the given arrays: numpy for numpy input, else ``array_api_compat.array_namespace``.

    ``None`` and objects without a ``shape`` (Python scalars, lists) are ignored; numpy scalars too.

    Returns
    -------
    module
        ``numpy`` (all inputs numpy or host array-likes), or the array API namespace of the others (for CuPy
        ``array_api_compat.cupy``, which also holds every CuPy function).

    Raises
    ------
    DeviceMismatchError
        (a ``TypeError``) The arrays mix libraries (numpy with CuPy, say) or devices; move all inputs to one
        device first.

    Examples
    --------
    >>> import numpy as np
    >>> get_xp(np.ones(2), None, 3.0) is np
    True
    """
    arrs = [a for a in arrays if a is not None and hasattr(a, "shape") and not isinstance(a, np.generic)]
    foreign = [a for a in arrs if _is_foreign(a)]
    if not foreign:
        return _NUMPY
    if len(foreign) != len(arrs):
        other = next(a for a in arrs if not _is_foreign(a))
        raise DeviceMismatchError(f"cannot mix {type(other).__module__}.{type(other).__name__} and "
                                  f"{type(foreign[0]).__module__}.{type(foreign[0]).__name__} arrays; move all "
                                  "inputs to one device")
    try:
        xp = array_api_compat.array_namespace(*foreign)
    except TypeError as e:
        raise DeviceMismatchError(f"arrays of different libraries in one call ({e}); move all inputs to one "
                                  "device") from None
    devs = [device_of(a) for a in foreign]
    for dv in devs[1:]:
        if dv != devs[0]:
            raise DeviceMismatchError(f"arrays on different devices ({devs[0]!r} and {dv!r}) in one call; move all "
                                      "inputs to one device")
    return xp


def is_numpy(xp) -> bool:
    """True for numpy's namespace (numpy itself or array_api_compat's wrapper): the host fast paths apply."""
    return xp is np or array_api_compat.is_numpy_namespace(xp)


def numpy_or_cupy(a) -> bool:
    """True for numpy and CuPy arrays (host array-likes included): the libraries the matrix-free operator and the
    krylov solver are written for (:mod:`scaleattn.linalg._gram`: ``take(out=)``, methods outside the standard);
    other namespaces (torch, array-api-strict) reach them through the host (:func:`to_numpy`)."""
    return not _is_foreign(a) or array_api_compat.is_cupy_array(a)


def device_of(a):
    """The device of array ``a`` (``array_api_compat.device``; ``"cpu"`` for numpy)."""
    return array_api_compat.device(a)


def on_accelerator(a) -> bool:
    """True for an array in an accelerator's memory: CuPy's, or another array API library's on a device that is not
    the CPU (torch ``cuda``, a JAX GPU, ``array_api_strict``'s simulated second device). The device paths size
    their blocks and panels for launches, not caches, only there (a torch CPU tensor keeps the host's sizes).

    Examples
    --------
    >>> import numpy as np
    >>> on_accelerator(np.ones(2))
    False
    """
    if not _is_foreign(a):
        return False
    if array_api_compat.is_cupy_array(a):
        return True
    dev = device_of(a)
    return "cpu" not in str(getattr(dev, "type", dev)).lower()


def from_host(a, xp, device=None):
    """A host (numpy) array or Python sequence, moved explicitly into namespace ``xp`` on ``device``.

    For index tables built on the host (:func:`~scaleattn.features.triu_index`) and host parameters (a model's
    coefficients). numpy input to numpy: no copy."""
    if is_numpy(xp):
        return np.asarray(a)
    return xp.asarray(a, device=device)


def on_device(a, xp, device=None):
    """``a`` in namespace ``xp`` on ``device``: an array of another array API library than numpy stays as it is
    when it is already there (:class:`~scaleattn.errors.DeviceMismatchError` when it is in another library or on
    another device); a host array (numpy, a list) is moved there explicitly (:func:`from_host`).

    For arguments that may come from the host alongside device data (``lengths``, a model's coefficients)."""
    if not _is_foreign(a):
        return from_host(a, xp, device)
    other = get_xp(a)
    if other is not xp or (device is not None and device_of(a) != device):
        raise DeviceMismatchError(f"an array of {other.__name__} on {device_of(a)!r} where {xp.__name__} on "
                                  f"{device!r} was expected; move all inputs to one device")
    return a


def as_float64(a, xp):
    """``a`` as float64 in its own namespace (no copy when it already is); numpy and host array-likes through
    ``np.asarray``."""
    if is_numpy(xp):
        return np.asarray(a, dtype=np.float64)
    return xp.astype(a, xp.float64, copy=False)


def contiguous(a, xp):
    """``a`` C-contiguous on numpy (for BLAS and cache-friendly slicing); other namespaces unchanged (the standard
    has no memory layout)."""
    return np.ascontiguousarray(a) if is_numpy(xp) else a


def to_numpy(a):
    """Copy an array of any supported library to host memory as a numpy array (no copy for numpy input).

    CuPy through ``.get()``, torch through ``.cpu()``, any other array API array through DLPack."""
    if isinstance(a, (np.ndarray, np.generic)) or not _is_foreign(a):
        return np.asarray(a)
    if array_api_compat.is_cupy_array(a):
        return a.get()
    if array_api_compat.is_torch_array(a):
        return a.detach().cpu().numpy()
    return np.from_dlpack(a)


def vector_norm(a, xp, axis=None):
    """The 2-norm of ``a`` (all of it, or along ``axis``) in its namespace: ``linalg.norm`` where the library has it
    (numpy, CuPy: their bits, a 1-d norm by ``sqrt(dot)``), else the standard's ``linalg.vector_norm``."""
    norm = getattr(xp.linalg, "norm", None)
    return norm(a, axis=axis) if norm is not None else xp.linalg.vector_norm(a, axis=axis)


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
        raise MissingDependencyError.for_extra("`device='gpu'`", "gpu", "CuPy and a CUDA GPU")
    return device


def array_module(device: str = "auto"):
    """The array namespace for ``device`` (validated by :func:`check_device`): numpy, or CuPy's array API
    namespace (``array_api_compat.cupy``, which also holds every CuPy function).

    ``"auto"`` picks the GPU only where one is assigned to this process (``CUDA_VISIBLE_DEVICES``, as
    dask-cuda sets per worker), so CPU workers never pile onto GPU 0; ``"gpu"`` requires one.
    """
    check_device(device, need_gpu_here=device == "gpu")
    if device == "cpu":
        return _NUMPY
    if device == "gpu" or (os.environ.get("CUDA_VISIBLE_DEVICES") and have_cupy()):
        import cupy

        return array_api_compat.array_namespace(cupy.empty(0))
    return _NUMPY
