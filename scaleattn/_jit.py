"""How the compiled kernels are compiled (below :mod:`scaleattn.statistics._compiled` and
:mod:`scaleattn.linalg._gram_compiled`): numba's options and the host's full vector width, in one place.

numba is imported lazily, by :func:`njit_module` (it costs 0.5 s at start-up, as much as the rest of the
package).
"""
from __future__ import annotations

__all__ = ["NJIT_OPTS", "njit_module", "wide_vectors"]


#: numba options of every compiled kernel: no GIL (our own threads run them), the on-disk cache, and of fastmath
#: only reassociation and contraction (FMA); no ``parallel`` (its thread pool is not safe under Dask's threads)
NJIT_OPTS = {"nogil": True, "cache": True, "fastmath": {"reassoc", "contract"}}


def wide_vectors() -> int:
    """Let LLVM vectorise our loops at the host's full width, 512 bits on AVX-512 hosts; returns the width (bits)
    numba's JIT target uses (read from the target itself).

    LLVM's tuning for Intel's AVX-512 server cores (Skylake-X to Emerald Rapids: ``prefer-256-bit``) vectorises
    at 256 bits, half of what their FMA units take and of what OpenBLAS's kernels (the floor's GEMM rate) use.
    The micro-kernel is FMA-bound, so the preference halves its rate (measured on one Emerald Rapids core, 4 x 4
    blocks: 37.6 GFLOP/s at 256 bits, 64.5 at 512; the DGEMM 64.9). numba's own host features (its
    ``NUMBA_ENABLE_AVX`` applied) with ``-prefer-256-bit`` go to ``numba.config.CPU_FEATURES``, read when numba
    first creates its JIT target, so they hold for other numba code of this process too. Left as they are when
    the user chose the CPU (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``), turned AVX off, or numba compiled
    something before us: the width then depends on that (and so do the last bits of the statistics).

    Examples
    --------
    >>> wide_vectors() in (128, 256, 512)
    True
    """
    from numba.core import codegen, config, registry

    if (config.CPU_FEATURES is None and config.CPU_NAME is None and config.ENABLE_AVX
            and "_toplevel_target_context" not in vars(registry.cpu_target)):
        host = codegen.get_host_cpu_features()  # "" where LLVM cannot tell
        if "+avx512f" in host.split(","):
            config.CPU_FEATURES = host + ",-prefer-256-bit"
    features = registry.cpu_target.target_context.codegen().magic_tuple()[2].split(",")
    if "+avx512f" in features and "-prefer-256-bit" in features:
        return 512
    return 256 if "+avx" in features or "+avx2" in features else 128


def njit_module(namespace: dict, helpers, kernels) -> tuple:
    """Compile a module's kernels with :data:`NJIT_OPTS` (numba imported here) at the host's full vector width
    (:func:`wide_vectors`): each of ``helpers`` is replaced in ``namespace`` (the kernels resolve them from
    their globals when compiled); the ``kernels``, compiled, are returned in order."""
    import numba

    wide_vectors()
    for name in helpers:
        namespace[name] = numba.njit(**NJIT_OPTS)(namespace[name])
    return tuple(numba.njit(**NJIT_OPTS)(namespace[name]) for name in kernels)
