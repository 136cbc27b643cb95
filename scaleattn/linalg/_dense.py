"""Dense symmetric positive definite algebra at the GEMM rate (DESIGN §4): a blocked Cholesky whose
LAPACK calls stay on small diagonal blocks, and the extreme eigenvalues of operators built from a dense Gram or
its factor by block Krylov (Rayleigh-Ritz), so that every pass over the psi x psi array serves a block of
vectors.

Why blocked. OpenBLAS's threaded ``dpotrf`` with its AVX-512 (SkylakeX) kernels dies with SIGSEGV inside its
own threaded ``dsyrk`` at psi = 16,896 (d = 32; OpenBLAS issues 1413 and 1643 show the same code path failing
on large orders), while the same call with one thread, or with the Haswell kernels, works. Its GEMM is the best
exercised routine of the library. :func:`blocked_cholesky` is the left-looking block algorithm ([GVL13]
Alg. 4.2.2 by blocks): per block column of width ``nb`` one GEMM ``A[j:, J] -= L[j:, :j] L[J, :j]^T``, one
LAPACK ``dpotrf`` of the ``nb x nb`` diagonal block and one ``dtrsm`` of the panel below it, all in place on the
array (scipy's BLAS and LAPACK called on views with their leading dimension: no copy, no buffer). All
``psi^3 / 3`` flops but the small diagonal blocks' are GEMM flops; ``dsyrk`` and a large ``dpotrf`` are never
called. The factor is the same as LAPACK's to round-off (both are backward stable; blocking changes only the
order of the sums).

Why block Krylov. The certificate needs the largest eigenvalues of ``Gs``, ``G``, ``Gs^-1`` and ``G^-1``
(:func:`scaleattn.linalg._spectrum.cholesky_factor`). One product with a psi x psi array reads psi^2 doubles from
memory, whatever the number of vectors up to a few dozen: single-vector Lanczos (ARPACK) pays a whole pass per
vector, and its passes were 7x the factorisation's time at d = 24. :func:`largest_eigenvalues` runs several
operators of the form ``diag(s) M diag(s)`` on one shared ``M`` side by side, ``block`` vectors each, one
product ``M [s_1 X_1, s_2 X_2, ...]`` per step; the Ritz values of the block Krylov space converge with the gap
to the ``block + 1``-th eigenvalue instead of the second ([GVL13] §10.3.6), in a handful of steps.

References
----------
[GVL13] G. H. Golub, C. F. Van Loan, "Matrix Computations", 4th ed. (2013), §4.2.9, §10.3.
[P98] B. N. Parlett, "The Symmetric Eigenvalue Problem", SIAM (1998), Thm 4.5.1 (the residual bound).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from .._backend import device_of, get_xp
from ._gram import _blas_controller, blas_single_thread
from ._lanczos import EPS, EigenEstimate

__all__ = ["blocked_cholesky", "cholesky", "gemm", "symmetric_product", "row_gram", "largest_eigenvalues",
           "CHOLESKY_BLOCK", "NARROW", "POTRF_MAX", "ROW_GRAM_BLOCK"]

#: width of the diagonal blocks :func:`blocked_cholesky` hands to LAPACK: far below the orders at which OpenBLAS's
#: threaded dpotrf fails (16,896 and up), wide enough that the GEMM updates run at their full rate. Measured at
#: psi = 7,200 on 2 cores (Haswell kernels): 1.30-1.33x psi^3/3 at the DGEMM rate with 512, 1.37-1.45x with
#: 1,024, 1.46-1.63x with 2,048, scipy's one dpotrf 1.41x
CHOLESKY_BLOCK = 512


@functools.cache
def _routine(module: str, name: str):
    """A Fortran BLAS/LAPACK routine of scipy's own library, from the function pointers scipy exports for Cython
    (``scipy.linalg.cython_blas`` / ``cython_lapack``; numba reaches them the same way), as a ctypes function:
    called on views of an array in place, with their leading dimension, and no copies."""
    import importlib

    capsule = importlib.import_module(f"scipy.linalg.{module}").__pyx_capi__[name]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return ctypes.CFUNCTYPE(None)(api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule)))


def _i(v: int):
    return ctypes.byref(ctypes.c_int(int(v)))


def _d(v: float):
    return ctypes.byref(ctypes.c_double(float(v)))


def _at(a: np.ndarray, i: int, j: int):
    """Pointer to ``a[i, j]`` of a C-ordered float64 array (for Fortran, the block from there is transposed)."""
    return ctypes.c_void_p(a.ctypes.data + (i * a.shape[1] + j) * 8)


_C = {c: ctypes.c_char_p(c.encode()) for c in "NTLUR"}


def _gemm_tn(m: int, n: int, k: int, alpha: float, pa, pb, beta: float, pc, ld: int) -> None:
    """Fortran ``C := alpha A^T B + beta C`` (``A`` k x m, ``B`` k x n, ``C`` m x n, all with leading dim ld)."""
    _routine("cython_blas", "dgemm")(_C["T"], _C["N"], _i(m), _i(n), _i(k), _d(alpha), pa, _i(ld), pb, _i(ld),
                                      _d(beta), pc, _i(ld))


def _potrf_upper(L: np.ndarray, j: int, b: int) -> None:
    """LAPACK ``dpotrf`` in place on the diagonal block ``L[j:j+b, j:j+b]`` (its lower triangle in C order is the
    upper one of the Fortran view); LinAlgError naming the global leading minor, as scipy's message does."""
    info = ctypes.c_int(0)
    _routine("cython_lapack", "dpotrf")(_C["U"], _i(b), _at(L, j, j), _i(L.shape[1]), ctypes.byref(info))
    if info.value > 0:
        raise np.linalg.LinAlgError(f"{j + info.value}-th leading minor of the array is not positive definite")
    if info.value < 0:  # pragma: no cover - an argument error of ours
        raise ValueError(f"dpotrf: illegal value in argument {-info.value}")


def blocked_cholesky(a, *, overwrite_a: bool = False, block: int = CHOLESKY_BLOCK) -> np.ndarray:
    """Lower Cholesky factor ``L`` of a symmetric positive definite ``a = L L^T``, by blocks (see the module notes).

    Parameters
    ----------
    a : array (n, n) float64
        Symmetric positive definite; only its lower triangle is read.
    overwrite_a : bool
        Factor in place when ``a`` is a C-contiguous writeable float64 array (its memory becomes ``L``); else a
        copy is made.
    block : int
        Width of the diagonal blocks given to LAPACK (default :data:`CHOLESKY_BLOCK`).

    Returns
    -------
    ndarray (n, n) float64
        ``L``, lower triangular (the strict upper triangle is 0), C-ordered.

    Raises
    ------
    numpy.linalg.LinAlgError
        ``a`` is not numerically positive definite (the message names the leading minor, as scipy's does).
    ValueError
        ``a`` is not square.

    Notes
    -----
    Left-looking by block columns ``J = [j, j + nb)`` ([GVL13] §4.2.9), in place on the lower triangle:
    ``A[j:, J] -= L[j:, :j] L[J, :j]^T`` (one DGEMM), ``L[J, J] = chol(A[J, J])`` (LAPACK on ``nb x nb``),
    ``L[j+nb:, J] = A[j+nb:, J] L[J, J]^-T`` (one DTRSM). The calls go to scipy's BLAS/LAPACK through the
    function pointers it exports for Cython, on views with their leading dimension: no copy, no buffer, and
    one BLAS thread pool (numpy and scipy wheels each bring an OpenBLAS; one's idle threads spin for a while
    after each call and slow the other's down several-fold when they alternate).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.random.default_rng(0).standard_normal((300, 200))
    >>> a = x.T @ x
    >>> L = blocked_cholesky(a, block=64)
    >>> bool(np.allclose(L @ L.T, a)), bool(np.allclose(L, np.linalg.cholesky(a)))
    (True, True)
    """
    a = np.asarray(a)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"blocked_cholesky needs a square matrix, got shape {a.shape}")
    n = a.shape[0]
    block = max(int(block), 1)
    inplace = overwrite_a and a.dtype == np.float64 and a.flags.c_contiguous and a.flags.writeable
    L = a if inplace else np.array(a, dtype=np.float64, order="C")
    for j in range(0, n, block):
        e = min(j + block, n)
        b = e - j
        if j:  # (Fortran view, transposed) A[J, j:] -= L[:j, J]^T L[:j, j:]
            _gemm_tn(b, n - j, j, -1.0, _at(L, j, 0), _at(L, j, 0), 1.0, _at(L, j, j), n)
        _potrf_upper(L, j, b)
        if e < n:  # (Fortran view) A[J, e:] := U_JJ^-T A[J, e:]
            _routine("cython_blas", "dtrsm")(_C["L"], _C["U"], _C["T"], _C["N"], _i(b), _i(n - e), _d(1.0),
                                             _at(L, j, j), _i(n), _at(L, e, j), _i(n))
        L[j:e, e:] = 0.0
        blk = L[j:e, j:e]
        blk[np.triu_indices(b, 1)] = 0.0
    return L


#: up to this order :func:`cholesky` hands the whole array to LAPACK ``dpotrf`` (in place, on the transposed
#: view), above it to :func:`blocked_cholesky`. Measured on 2 cores at psi = 7,200 (d = 24): dpotrf 1.05 s against
#: 2.0 s blocked with 2 threads (1.94 / 2.5 s with one). OpenBLAS 0.3.30's threaded dpotrf (AVX-512 kernels) dies
#: with SIGSEGV at psi = 16,896 (d = 32) and ran at 9,126, 11,368 and 13,000 (2 threads, random SPD matrices).
#: On one BLAS thread dpotrf runs at any order (d = 32: 27.2 s against 30.2 s blocked, Intel Xeon AVX-512, 0.3.31)
POTRF_MAX = 13_000


def _blas_threads() -> int:
    """The BLAS thread count now (the most of the loaded libraries'; 1 inside :func:`blas_single_thread`)."""
    return max((lib.num_threads for lib in _blas_controller().lib_controllers), default=1)


def cholesky(a, *, overwrite_a: bool = False) -> np.ndarray:
    """Lower Cholesky factor ``L`` (C-ordered, strict upper triangle 0) of a symmetric positive definite ``a``:
    LAPACK ``dpotrf`` on the Fortran view of ``a``'s memory up to :data:`POTRF_MAX` or on one BLAS thread (its
    unthreaded code ran at every order tried: 16,896 takes 0.77x the blocked time), :func:`blocked_cholesky`
    above on several threads (same arguments, result and errors as :func:`blocked_cholesky`).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.random.default_rng(0).standard_normal((300, 200))
    >>> bool(np.allclose(cholesky(x.T @ x), np.linalg.cholesky(x.T @ x)))
    True
    """
    a = np.asarray(a)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"cholesky needs a square matrix, got shape {a.shape}")
    if a.shape[0] > POTRF_MAX and _blas_threads() > 1:  # (one thread: dpotrf is safe at any order, and faster)
        return blocked_cholesky(a, overwrite_a=overwrite_a)
    from scipy.linalg import lapack

    inplace = overwrite_a and a.dtype == np.float64 and a.flags.c_contiguous and a.flags.writeable
    L = a if inplace else np.array(a, dtype=np.float64, order="C")
    # the C array's lower triangle is the Fortran view's upper one: dpotrf("U") there gives U = L^T in place
    # (clean: the other triangle zeroed, as the products with L need)
    _, info = lapack.dpotrf(L.T, lower=0, clean=1, overwrite_a=1)
    if info > 0:
        raise np.linalg.LinAlgError(f"{info}-th leading minor of the array is not positive definite")
    if info < 0:  # pragma: no cover - an argument error of ours
        raise ValueError(f"dpotrf: illegal value in argument {-info}")
    return L


def triangular_product(L: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``L^T x`` for a C-ordered lower triangular ``L`` (BLAS ``dtrmm`` on its triangle only: half the memory
    traffic of a GEMM with the whole array); ``x`` (n, k) float64."""
    from scipy.linalg import blas

    return blas.dtrmm(1.0, L.T, np.asfortranarray(x, dtype=np.float64), lower=0)


#: at most this many columns, :func:`gemm` hands ``a`` to BLAS as Fortran's ``A`` operand (the one OpenBLAS packs
#: in blocks down its columns), not as ``B``. Measured at psi = 7,200 on 2 cores: ``gemm(G, X, trans=True)`` (``A``
#: untransposed; ``G X`` for the symmetric Gram) with 32 columns 81 ms against 96 ms the other way (16: 65 / 78,
#: 64: 136 / 156; ``trans=False``, ``A`` transposed, 94 ms), and ``Q^T C`` / ``Q^T y`` against a 304 x 7,200
#: basis on one thread 2x / 3.7x faster. Wider products (the square GEMM of the measured rate) keep the other
#: orientation
NARROW = 256


def gemm(a: np.ndarray, x: np.ndarray, trans: bool = False) -> np.ndarray:
    """``a @ x`` (or ``a.T @ x``) for 2-D float64 arrays through scipy's BLAS, the library of the factor and its
    solves: one thread pool for the whole dense path (see :func:`blocked_cholesky`).

    ``a`` (r, c) is used as C-ordered (copied if it is not); ``x`` (c or r, k) may be C- or Fortran-ordered. The
    result (r or c, k) is Fortran-ordered when ``k <= NARROW`` (``a`` is then BLAS's ``A`` operand, see
    :data:`NARROW`), else C-ordered.

    Examples
    --------
    >>> import numpy as np
    >>> a, x = np.arange(6.0).reshape(2, 3), np.ones((2, 1))
    >>> gemm(a, x, trans=True).ravel().tolist()
    [3.0, 5.0, 7.0]
    """
    a = np.ascontiguousarray(a, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    r, c = a.shape
    k = x.shape[1]
    if x.shape[0] != (r if trans else c):
        raise ValueError(f"gemm: shapes {a.shape}{'^T' if trans else ''} and {x.shape} do not match")
    rows = c if trans else r
    dgemm = _routine("cython_blas", "dgemm")
    if k <= NARROW:  # Fortran: y (rows x k) = op(a_F) op(x'), a_F = a^T (c x r); x' = x (F order) or x^T (C)
        if not x.flags.f_contiguous:
            x = np.ascontiguousarray(x)
        y = np.zeros((rows, k), order="F")
        if y.size and x.shape[0]:
            fx = x.flags.f_contiguous
            dgemm(_C["N" if trans else "T"], _C["N" if fx else "T"], _i(rows), _i(k), _i(x.shape[0]), _d(1.0),
                  _at(a, 0, 0), _i(c), ctypes.c_void_p(x.ctypes.data), _i(x.shape[0] if fx else k), _d(0.0),
                  ctypes.c_void_p(y.ctypes.data), _i(rows))
        return y
    x = np.ascontiguousarray(x)
    y = np.zeros((rows, k))
    if y.size and x.shape[0]:  # Fortran views are the transposes: y^T = x^T a^T (or x^T a)
        dgemm(_C["N"], _C["T" if trans else "N"], _i(k), _i(rows), _i(x.shape[0]), _d(1.0), _at(x, 0, 0), _i(k),
              _at(a, 0, 0), _i(c), _d(0.0), _at(y, 0, 0), _i(k))
    return y


#: rows per GEMM of :func:`row_gram`: at most this many rows of ``A A^T`` per product, so that no product is the
#: square ``A @ A.T`` numpy hands to ``dsyrk`` (its threaded form dies at N = 20,000, k = 528: see the module notes)
ROW_GRAM_BLOCK = 4096


def row_gram(a, block: int = ROW_GRAM_BLOCK):
    """``A A^T`` (the Gram matrix of ``A``'s rows) by blocks of rows, each one GEMM, never the library's ``dsyrk``.

    numpy computes ``a @ a.T`` by ``dsyrk``, and OpenBLAS 0.3.31's threaded ``dsyrk`` (AVX-512 kernels, 2 threads)
    dies with SIGSEGV on this project's machines for ``a`` of 20,000 x 528 (the dual's kernel at d = 32) and
    18,000 x 16,896, while 16,000 x 528, 20,000 x 100 and every GEMM tried worked (the module notes). The blocks
    cost twice ``dsyrk``'s flops (both triangles), at the GEMM rate on every thread.

    Parameters
    ----------
    a : array (n, k) float64
        numpy or any array-API array (its own namespace multiplies).
    block : int
        Rows of the result per product (default :data:`ROW_GRAM_BLOCK`); one product when ``n <= block``.

    Returns
    -------
    array (n, n) float64
        ``a a^T``, symmetric to round-off (the blocks' sums may differ in the last bit across the diagonal).

    Examples
    --------
    >>> import numpy as np
    >>> a = np.random.default_rng(0).standard_normal((50, 7))
    >>> bool(np.allclose(row_gram(a, block=16), a @ a.T))
    True
    """
    xp = get_xp(a)
    n = a.shape[0]
    block = max(int(block), 1)
    if n <= block:  # (a small product: dsyrk is safe there, and half the flops)
        return xp.matmul(a, a.T)
    at = a.T
    g = xp.empty((n, n), dtype=a.dtype, device=device_of(a))
    for i in range(0, n, block):
        e = min(i + block, n)  # (the array API leaves a stop past the end unspecified)
        g[i:e, ...] = xp.matmul(a[i:e, ...], at)
    return g


def symmetric_product(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``a @ x`` for a symmetric ``a`` (the Gram): computed as ``a.T @ x``, the orientation of :func:`gemm` that
    streams ``a`` fastest for narrow ``x`` (see :data:`NARROW`).

    Examples
    --------
    >>> import numpy as np
    >>> a = np.array([[2.0, 1.0], [1.0, 3.0]])
    >>> symmetric_product(a, np.ones((2, 1))).ravel().tolist()
    [3.0, 4.0]
    """
    return gemm(a, x, trans=True)


def largest_eigenvalues(matmat, n: int, scales, *, block: int = 8, rtol: float = 1e-10, maxiter: int = 40,
                        seed: int = 0, vectors: list | None = None, ritz: int = 0,
                        first_product=None) -> list[EigenEstimate]:
    """Largest eigenvalue of each ``A_i = diag(s_i) M diag(s_i)`` (``M`` symmetric PSD) by block Krylov with
    Rayleigh-Ritz, all of them sharing one product with ``M`` per step.

    Parameters
    ----------
    matmat : callable
        ``matmat(X) -> M @ X`` for X (n, k) float64 (a GEMM with a dense Gram, or a solve with its factor).
    n : int
        Order of ``M``.
    scales : list of (array (n,) or None)
        One operator per entry (None: ``M`` itself).
    block : int
        Vectors per operator and step (the basis grows by ``block`` each step).
    rtol : float or list of float
        (One, or one per operator.) An operator's run stops when the error estimate ``residual^2 / gap`` of its
        top Ritz value (``gap`` to the next Ritz value, [P98] §11.7), or the residual ``||A u - theta u||``
        itself, is at most ``rtol * theta``. The interval reported is the rigorous one, ``theta <= lambda_max <= theta +
        residual`` ([P98] Thm 4.5.1). The residual is formed from the stored basis and its products (two passes
        over them) only at steps where its block Krylov stand-in ``||W y_V||`` (``W`` the next block before its
        QR, ``y_V`` the Ritz vector's last block) meets the rule; the formed one alone decides and is reported.
    maxiter : int
        Steps (products) at most; a run that did not meet ``rtol`` by then says ``converged=False``.
    seed : int
        Seed of the random start blocks (reruns give the same numbers).
    vectors : list, optional
        Receives per operator its ``ritz`` top Ritz vectors (n, ritz), in that operator's coordinates (for a
        Rayleigh-Ritz step of the caller's, :func:`scaleattn.linalg._spectrum.cholesky_factor`).
    ritz : int
        How many (default 0: none).
    first_product : callable, optional
        Used instead of ``matmat`` for the first step (a pass over ``M`` that computes more besides, such as
        :func:`scaleattn.linalg._spectrum.gershgorin_scaled`'s bound).

    Returns
    -------
    list of EigenEstimate
        Per operator: the top Ritz value (a lower bound on lambda_max), its residual, the interval
        ``[value, value + residual]``, whether it converged, and the products it took.

    Examples
    --------
    >>> import numpy as np
    >>> M = np.diag(np.arange(1.0, 201.0))
    >>> top, = largest_eigenvalues(lambda X: M @ X, 200, [None], block=4)
    >>> round(top.value, 6), top.converged
    (200.0, True)
    """
    rng = np.random.default_rng(seed)
    k = max(1, min(int(block), n))
    rtols = [float(r) for r in (rtol if np.ndim(rtol) else [rtol] * len(scales))]
    with blas_single_thread():
        runs = [_Run(n, s, rng.standard_normal((n, k)), min(n, k * maxiter)) for s in scales]
    steps = 0
    while steps < maxiter:
        live = [r for r in runs if not r.done]
        if not live:
            break
        X = np.concatenate([r.request() for r in live], axis=1)
        Y = (first_product if steps == 0 and first_product is not None else matmat)(X)  # the one pass: all threads
        steps += 1
        c = 0
        with blas_single_thread():  # the runs' own work is on (n, k) and (m, m) blocks: threads would only contend
            for r in live:
                w = r.V.shape[1]
                r.receive(Y[:, c: c + w], rtols[runs.index(r)], steps)
                c += w
    if vectors is not None:
        vectors.extend(r.ritz_vectors(ritz) for r in runs)
    return [r.estimate() for r in runs]


def _norm(v: np.ndarray) -> float:
    return float(np.sqrt(np.sum(v * v)))  # no BLAS call (see gemm)


class _Run:
    """One operator's block Krylov basis ``Q`` (n, m), ``A Q`` and the projection ``H = Q^T A Q``; every dense
    operation on them goes to scipy's library (:func:`gemm`, ``scipy.linalg``), as the products do."""

    def __init__(self, n: int, scale, X, capacity: int):
        import scipy.linalg

        self.scale = scale
        self._Q = np.empty((capacity, n))  # rows: the basis vectors (a C-ordered block grows without copies)
        self._AQ = np.empty((capacity, n))
        self.m = 0
        self.H = np.empty((0, 0))
        self.V = np.ascontiguousarray(scipy.linalg.qr(X, mode="economic")[0])
        self.theta, self.res, self.done, self.converged, self.steps = 0.0, float("inf"), False, False, 0
        self.y = np.zeros((0, 1))

    def request(self) -> np.ndarray:
        return self.V if self.scale is None else self.scale[:, None] * self.V

    def receive(self, Y: np.ndarray, rtol: float, steps: int) -> None:
        import scipy.linalg

        AV = Y if self.scale is None else self.scale[:, None] * Y
        V, m, k = self.V, self.m, self.V.shape[1]
        self._Q[m: m + k] = V.T
        self._AQ[m: m + k] = AV.T
        self.m = m = m + k
        Q = self._Q[:m]  # (m, n): Q^T
        C = gemm(Q, AV)  # (m, k) = Q^T A V
        H = np.empty((m, m))
        H[: m - k, : m - k] = self.H
        H[:, m - k:] = C
        H[m - k:, :] = C.T
        H[m - k:, m - k:] = (C[m - k:] + C[m - k:].T) / 2
        self.H = H
        self.steps = steps
        # the top two Ritz values and the top vector only: a third of a full eigh's work on the (m, m) projection
        w, U = scipy.linalg.eigh(H, subset_by_index=[max(m - 2, 0), m - 1], driver="evr", check_finite=False)
        self.y = np.ascontiguousarray(U[:, -1:])
        self.theta = float(w[-1])
        top = max(abs(self.theta), 1e-300)
        gap = float(w[-1] - w[-2]) if w.size > 1 else top
        W = AV - gemm(Q, C, trans=True)  # next block: A V against the basis, twice
        W -= gemm(Q, gemm(Q, W), trans=True)
        # A Q y - theta Q y = (I - Q Q^T) A V y_V = W y_V while A (earlier blocks) lies in span Q (block Krylov):
        # a cheap stand-in for the residual; the explicit one (two passes over the basis) is computed only once
        # that says the run has converged, and it alone decides and is reported
        self.res = None
        if self._converged(_norm(gemm(W, self.y[m - k:])), gap, rtol, top):
            self.converged = self._converged(self.residual(), gap, rtol, top)
            if self.converged:
                self.done = True
                return
        Vn, R = scipy.linalg.qr(W, mode="economic", check_finite=False)
        keep = np.abs(np.diag(R)) > 1e3 * EPS * max(top, float(np.abs(AV).max()))
        if not keep.any() or m + keep.sum() > min(self._Q.shape):
            self.done = True  # the basis spans an invariant subspace (or all it may hold): stop here
            self.converged = self._converged(self.residual(), gap, rtol, top) or not keep.any()
            return
        self.V = np.ascontiguousarray(Vn[:, keep])

    @staticmethod
    def _converged(res: float, gap: float, rtol: float, top: float) -> bool:
        # the Ritz value's error is about res^2 / gap ([P98] §11.7; the gap to the next Ritz value): converged
        # when that is rtol of it, or when the residual itself is (the rigorous bound, any gap)
        return res * min(res / max(gap, res, 1e-300), 1.0) <= rtol * top

    def residual(self) -> float:
        """``||A u - theta u||`` of the top Ritz vector ``u = Q y``, from the stored ``A Q`` and ``Q``."""
        if self.res is None:  # (inf before the first product)
            Q, AQ = self._Q[: self.m], self._AQ[: self.m]
            self.res = _norm(gemm(AQ, self.y, trans=True) - self.theta * gemm(Q, self.y, trans=True))
        return self.res

    def ritz_vectors(self, k: int) -> np.ndarray:
        """The top ``k`` Ritz vectors (n, k) of the basis (a full eigh of the small projection)."""
        import scipy.linalg

        m = self.m
        if not m or k <= 0:
            return np.zeros((self._Q.shape[1], 0))
        w, U = scipy.linalg.eigh(self.H, check_finite=False)
        return gemm(self._Q[:m], np.ascontiguousarray(U[:, -min(k, m):]), trans=True)

    def estimate(self) -> EigenEstimate:
        res = self.residual()
        return EigenEstimate(self.theta, res, self.theta, self.theta + res, bool(self.converged), self.steps)
