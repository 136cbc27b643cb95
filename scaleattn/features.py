"""Cubic features of multi-head linear attention and the compact Gram factors.

A one-layer MHLA model is linear in ``phi(Z) = vech(S) (x) x`` with ``S = Z^T Z`` and ``x`` the last token
([Y25] §2.1, Algorithm 2, Corollary 2.4; DESIGN §2). Feature ``(P, l)`` with ``P = (j, k)``, ``j <= k``, is
flattened P-major: index ``P * d + l``. ``m = d(d+1)/2`` and ``psi = m * d``.

The compact Gram (DESIGN §3) uses ``u = vech(s s^T)`` and ``v = vech(x x^T)``: ``Tc = sum_i u_i v_i^T`` holds
every distinct entry of ``G = sum_i phi_i phi_i^T`` once per symmetry class, 4x fewer multiply-adds than
``phi^T phi``. All functions take numpy arrays or any array API array (CuPy, torch, ...) and return arrays of the
same namespace on the same device, written against the array API standard (:mod:`scaleattn._backend`). Layer L1.
"""
from __future__ import annotations

import functools

import array_api_compat
import numpy as np

from ._backend import as_float64, device_of, from_host, get_xp, is_numpy, on_device
from .errors import ParameterError

__all__ = ["n_pairs", "n_features", "triu_index", "vech", "token_features", "row_targets", "phi",
           "pair_products", "compact_factors", "expand_compact_gram", "predict_rows", "coef_distance"]


def n_pairs(d: int) -> int:
    """``m = d(d+1)/2``: entries of the upper triangle (``vech``) of a d x d symmetric matrix (DESIGN §2).

    Parameters
    ----------
    d : int
        Side of the matrix (the token dimension).

    Returns
    -------
    int
        ``d (d + 1) // 2``.

    Examples
    --------
    >>> n_pairs(2), n_pairs(4), n_pairs(8)
    (3, 10, 36)
    """
    return d * (d + 1) // 2


def n_features(d: int) -> int:
    """``psi = d^2 (d+1) / 2``: number of cubic MHLA features ([Y25] §2.1: 6, 40, 288 for d = 2, 4, 8).

    Parameters
    ----------
    d : int
        Token dimension.

    Returns
    -------
    int
        ``n_pairs(d) * d``: the length of ``phi(Z)`` and the rows of the coefficients (DESIGN §2).

    Examples
    --------
    >>> n_features(2), n_features(4), n_features(8)
    (6, 40, 288)
    """
    return n_pairs(d) * d


@functools.lru_cache(maxsize=64)
def triu_index(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-major upper-triangle indices of an n x n matrix (the order of ``vech``, DESIGN §2).

    Parameters
    ----------
    n : int
        Side of the matrix.

    Returns
    -------
    I, J : ndarray (n(n+1)/2,), int64
        Row and column of each vech position, ``I <= J``.
    pos : ndarray (n, n), int64
        Maps ``(i, j)`` and ``(j, i)`` to the vech position of ``(min, max)``. All three are cached (shared
        between calls): do not modify them.

    See Also
    --------
    vech : the upper triangle in this order.

    Examples
    --------
    >>> I, J, pos = triu_index(3)
    >>> I.tolist(), J.tolist(), pos[2, 1].item()
    ([0, 0, 0, 1, 1, 2], [0, 1, 2, 1, 2, 2], 4)
    """
    I, J = np.triu_indices(n)
    pos = np.empty((n, n), dtype=np.int64)
    pos[I, J] = np.arange(I.size)
    pos[J, I] = np.arange(I.size)
    return I, J, pos


def _host_index(a, xp, like):
    """A host index table (numpy int64) in namespace ``xp`` on the device of array ``like``."""
    return from_host(a, xp, device_of(like))


def vech(a, n: int | None = None):
    """Upper triangle, row-major, of the trailing (n, n) axes of ``a``: shape (..., n(n+1)/2) (DESIGN §2).

    Parameters
    ----------
    a : array (..., n, n)
        Any dtype; numpy or any array API array (the result is in its namespace, on its device).
    n : int, optional
        Side of the trailing axes; default ``a.shape[-1]``.

    Returns
    -------
    array (..., n(n+1)/2), dtype of ``a``
        Entries ``a[..., i, j]``, ``i <= j``, in the order of :func:`triu_index`.

    Examples
    --------
    >>> import numpy as np
    >>> vech(np.arange(9.0).reshape(3, 3))
    array([0., 1., 2., 4., 5., 8.])
    """
    n = a.shape[-1] if n is None else n
    xp = get_xp(a)
    I, J, _ = triu_index(n)
    flat = xp.reshape(a, tuple(a.shape[:-2]) + (n * n,))  # one take along the flattened (n, n) axes
    return xp.take(flat, _host_index(I * n + J, xp, a), axis=flat.ndim - 1)


def token_features(tokens, lengths=None, causal: bool = False):
    """Per-row token Gram ``s = vech(S)`` and query token ``x`` of MHLA samples ([Y25] Def. 2.1, DESIGN §1).

    Parameters
    ----------
    tokens : array (n, T, d), float
        Token-major sequences; positions at or past ``lengths[i]`` are padding (ignored). Any array API array
        (numpy, CuPy, torch, ...); the outputs are in its namespace, on its device.
    lengths : array (n,), int, optional
        Valid length of each sequence, ``1 <= lengths <= T``. Default: all ``T``. Same namespace and device as
        ``tokens``, or a host (numpy) array, which is moved to the tokens' device.
    causal : bool
        ``False``: one row per sequence, ``S = sum_t z_t z_t^T`` over the valid tokens, ``x`` the last valid
        token. ``True`` (prefix mode): one row per valid position t, ``S_t = sum_{s<=t} z_s z_s^T``, ``x = z_t``
        (cumulative sums, O(T d^2) per sequence); rows are ordered sequence-major.

    Returns
    -------
    s : array (rows, m), float64
        ``vech(S)`` of each row, ``m = d(d+1)/2``; ``rows = n`` (last-token) or ``sum(lengths)`` (causal).
    x : array (rows, d), float64
        The query token of each row.

    Raises
    ------
    DeviceMismatchError
        ``lengths`` an array of another library than numpy that is not in the tokens' namespace and device.

    See Also
    --------
    phi : the cubic features of these rows.
    compact_factors : the compact Gram factors of these rows.

    Examples
    --------
    >>> import numpy as np
    >>> tokens = np.arange(12.0).reshape(2, 3, 2)  # 2 sequences of 3 tokens in R^2
    >>> s, x = token_features(tokens)
    >>> s.shape, bool(np.allclose(s[1], vech(tokens[1].T @ tokens[1]))), x[1]
    ((2, 3), True, array([10., 11.]))
    >>> s, x = token_features(tokens, lengths=np.array([3, 2]), causal=True)
    >>> s.shape, x[-1]  # 3 + 2 prefixes; the last one ends at token 1 of sequence 1
    ((5, 3), array([8., 9.]))
    """
    xp = get_xp(tokens)
    dev = device_of(tokens)
    z = as_float64(tokens, xp)
    n, T, d = z.shape
    if lengths is not None:
        lengths = _lengths(lengths, xp, tokens)
        valid = xp.arange(T, device=dev)[None, :] < lengths[:, None]  # (n, T)
        # padding is zero by format; enforced by where, not by a 0/1 product (NaN * 0 = NaN: padding is ignored)
        z = xp.where(valid[..., None], z, xp.asarray(0.0, dtype=xp.float64, device=dev))
    if not causal:  # S = Z^T Z per sample as a batched matmul: no (n, T, m) temporary
        s = vech(xp.matmul(xp.permute_dims(z, (0, 2, 1)), z))
        last = (lengths - 1) if lengths is not None else xp.full(n, T - 1, dtype=xp.int64, device=dev)
        x = xp.take(xp.reshape(z, (n * T, d)), xp.arange(n, dtype=xp.int64, device=dev) * T + last, axis=0)
        return s, x
    s = xp.cumulative_sum(xp.reshape(pair_products(xp.reshape(z, (n * T, d))), (n, T, -1)), axis=1)  # (n, T, m)
    if lengths is None:
        return xp.reshape(s, (n * T, -1)), xp.reshape(z, (n * T, d))
    return s[valid], z[valid]


def _lengths(lengths, xp, like):
    """``lengths`` as int64 in ``xp`` on the device of ``like`` (a host array is moved there; an array on another
    device raises :class:`~scaleattn.errors.DeviceMismatchError`)."""
    return xp.astype(on_device(lengths, xp, device_of(like)), xp.int64, copy=False)


def row_targets(targets, lengths=None, causal: bool = False):
    """Targets aligned with the rows of :func:`token_features`: (rows, d_out) float64.

    ``targets`` is (n, d_out) for last-token data or (n, T, d_out) for causal data (any array API array;
    ``lengths`` as in :func:`token_features`).

    Parameters
    ----------
    targets : array (n, d_out) or (n, T, d_out), float
        Last-token targets, or per-prefix targets when ``causal``.
    lengths : array (n,), int, optional
        Valid length of each sequence (causal only; ignored otherwise).
    causal : bool
        Prefix mode: keep the targets of the valid positions, sequence-major.

    Returns
    -------
    array (rows, d_out), float64
        In the namespace and on the device of ``targets``.

    Raises
    ------
    DeviceMismatchError
        As :func:`token_features`, for ``lengths``.

    Examples
    --------
    >>> import numpy as np
    >>> row_targets(np.ones((2, 3, 1)), lengths=np.array([3, 2]), causal=True).shape
    (5, 1)
    """
    xp = get_xp(targets)
    y = as_float64(targets, xp)
    if not causal:
        return y
    n, T, _ = y.shape
    if lengths is None:
        return xp.reshape(y, (n * T, -1))
    valid = xp.arange(T, device=device_of(targets))[None, :] < _lengths(lengths, xp, targets)[:, None]
    return y[valid]


def phi(s, x):
    """Dense cubic features ``phi = vech(S) (x) x`` ([Y25] H(Z), DESIGN §2): (rows, psi), P-major.

    Used for prediction checks and the naive baselines; the statistics never form it.

    Parameters
    ----------
    s : array (rows, m), float
        ``vech(S)`` of each row (:func:`token_features`).
    x : array (rows, d), float
        Query token of each row; same namespace and device as ``s``.

    Returns
    -------
    array (rows, m * d), dtype of ``s * x``
        ``phi[i, P * d + l] = s[i, P] * x[i, l]``.

    Examples
    --------
    >>> import numpy as np
    >>> phi(np.array([[1.0, 2.0, 3.0]]), np.array([[1.0, 10.0]]))
    array([[ 1., 10.,  2., 20.,  3., 30.]])
    """
    xp = get_xp(s, x)
    return xp.reshape(s[:, :, None] * x[:, None, :], (s.shape[0], -1))


@functools.lru_cache(maxsize=64)
def _pair_offsets(m: int) -> np.ndarray:
    """``off[p]`` = first column of ``u = vech(s s^T)`` holding pair ``(p, q >= p)``; ``off[m] = m(m+1)/2``."""
    return np.concatenate([[0], np.cumsum(np.arange(m, 0, -1))]).astype(np.int64)


def pair_products(s, cols: slice | None = None, out=None):
    """Columns ``cols`` of ``u = vech(s s^T)``: (rows, width) float64, ``u[:, (p, q)] = s_p * s_q`` (q >= p).

    ``cols`` is a step-1 slice of the m(m+1)/2 axis (default all). ``out`` (rows', >= width), rows' >= rows,
    receives the result (pass a C-contiguous (rows, width) buffer to get a contiguous ``u``); no index
    temporaries are made: one multiply per pair row ``p`` that meets ``cols`` (DESIGN §3, §6 column tiles).
    numpy and CuPy multiply into ``out`` in place; other namespaces (the standard has no ``out=``) assign each
    product into its columns, the same values (one more pass over ``u``: 1.2x slower on a GPU, measured).

    Parameters
    ----------
    s : array (rows, m), float64
        Rows of a vector (``vech(S)``, or a token ``x``).
    cols : slice, optional
        Step-1 slice of the ``m(m+1)/2`` columns of ``u``; default all.
    out : array (rows', >= width), float64, optional
        Buffer for the result, same namespace and device as ``s``.

    Returns
    -------
    array (rows, width), float64
        ``u`` (a view of ``out`` when given).

    Examples
    --------
    >>> import numpy as np
    >>> s = np.array([[1.0, 2.0, 3.0]])
    >>> pair_products(s), bool(np.array_equal(pair_products(s), vech(s[:, :, None] * s[:, None, :])))
    (array([[1., 2., 3., 4., 6., 9.]]), True)
    >>> pair_products(s, cols=slice(3, 5))
    array([[4., 6.]])
    """
    xp = get_xp(s)
    rows, m = s.shape
    off = _pair_offsets(m)
    c0, c1, _ = (slice(0, int(off[m])) if cols is None else cols).indices(int(off[m]))
    width = max(c1 - c0, 0)
    u = xp.empty((rows, width), dtype=xp.float64, device=device_of(s)) if out is None else out[:rows, :width]
    # ufuncs with out= (CuPy's namespace holds CuPy's own multiply)
    mul = np.multiply if is_numpy(xp) else xp.multiply if array_api_compat.is_cupy_namespace(xp) else None
    p = max(int(np.searchsorted(off, c0, side="right")) - 1, 0)
    while p < m and off[p] < c1:  # u[:, (p, q>=p)] = s_p * s_q, clipped to columns [c0, c1)
        lo, hi = max(int(off[p]), c0), min(int(off[p + 1]), c1)
        q0 = p + lo - int(off[p])
        if mul is not None:
            mul(s[:, p : p + 1], s[:, q0 : q0 + hi - lo], out=u[:, lo - c0 : hi - c0])
        else:
            u[:, lo - c0 : hi - c0] = s[:, p : p + 1] * s[:, q0 : q0 + hi - lo]
        p += 1
    return u


def compact_factors(s, x, out_u=None, cols: slice | None = None):
    """Compact Gram factors ``u = vech(s s^T)`` (rows, m(m+1)/2) and ``v = vech(x x^T)`` (rows, d(d+1)/2).

    ``Tc = u^T v`` (DESIGN §3). ``u`` is built slice by slice into ``out_u`` (or a new buffer) so that no
    (rows, m(m+1)/2) index temporaries are made. ``cols`` (a step-1 slice of the m(m+1)/2 axis) builds only
    those columns of ``u``, shape (rows, cols width): the factor of one column tile of ``Tc`` (DESIGN §6).
    See :func:`pair_products`.

    Parameters
    ----------
    s : array (rows, m), float64
        ``vech(S)`` of each row (:func:`token_features`).
    x : array (rows, d), float64
        Query token of each row.
    out_u : array (rows', >= width), float64, optional
        Buffer for ``u``.
    cols : slice, optional
        Columns of ``u`` to build; default all.

    Returns
    -------
    u : array (rows, m(m+1)/2 or the width of ``cols``), float64
    v : array (rows, d(d+1)/2), float64

    See Also
    --------
    expand_compact_gram : ``G`` from ``Tc = u^T v``.

    Examples
    --------
    >>> import numpy as np
    >>> u, v = compact_factors(*token_features(np.ones((5, 4, 2))))
    >>> u.shape, v.shape
    ((5, 6), (5, 3))
    """
    return pair_products(s, cols, out_u), pair_products(x)


def expand_compact_gram(gram_compact, d: int):
    """Expand the compact Gram ``Tc`` (m(m+1)/2, d(d+1)/2) to the full feature Gram ``G`` (psi, psi).

    ``G[(P,l),(P',l')] = Tc[vech(P,P'), vech(l,l')]`` (DESIGN §3). Done once, on the solver node. In the
    namespace and on the device of ``gram_compact`` (integer-array indexing, array API 2024.12). On numpy, row
    group by row group (``np.take`` on small indices into the rows of a preallocated ``G``): the 4-D gather makes
    psi^2-element index arrays and ran at 0.3 GB/s at d = 32. The same values (a copy); the compiled copy is
    :func:`scaleattn.statistics._kernel.expand_gram`.

    Parameters
    ----------
    gram_compact : array (m(m+1)/2, d(d+1)/2), float
        The compact Gram ``Tc`` (``gram_compact`` of :class:`scaleattn.Statistics`).
    d : int
        Token dimension (``m = d(d+1)/2``).

    Returns
    -------
    array (psi, psi), float64
        ``G = sum_i phi_i phi_i^T``, symmetric; numpy in, numpy out (a new array).

    See Also
    --------
    compact_factors : the factors of ``Tc``.

    Examples
    --------
    >>> import numpy as np
    >>> s, x = token_features(np.random.default_rng(0).standard_normal((5, 4, 2)))
    >>> u, v = compact_factors(s, x)
    >>> G = expand_compact_gram(u.T @ v, d=2)
    >>> G.shape, bool(np.allclose(G, phi(s, x).T @ phi(s, x)))
    ((6, 6), True)
    """
    xp = get_xp(gram_compact)
    m = n_pairs(d)
    _, _, ppos = triu_index(m)
    _, _, lpos = triu_index(d)
    if is_numpy(xp):
        tc = np.asarray(gram_compact, dtype=np.float64)
        G = np.empty((m * d, m * d))
        for P in range(m):
            rows = np.take(tc, ppos[P], axis=0)  # (m, d(d+1)/2): the Tc rows of row group P
            for l in range(d):  # row (P, l) viewed as (m, d): [Q, k] = rows[Q, lpos[l, k]]
                np.take(rows, lpos[l], axis=1, out=G[P * d + l].reshape(m, d), mode="clip")
        return G
    ppos, lpos = _host_index(ppos, xp, gram_compact), _host_index(lpos, xp, gram_compact)
    psi = m * d
    G = gram_compact[ppos[:, None, :, None], lpos[None, :, None, :]]
    return xp.reshape(G, (psi, psi))


def predict_rows(coef, s, x):
    """Predictions ``y_hat = phi @ coef`` of rows without forming ``phi``: (rows, d_out).

    ``coef`` (psi, d_out) is viewed as (m, d, d_out): ``y_hat[i, a] = sum_{P,l} s[i,P] coef[P,l,a] x[i,l]``
    (two matmuls; all three in one namespace, on one device).

    Parameters
    ----------
    coef : array (psi, d_out), float
        Coefficients (DESIGN §2).
    s : array (rows, m), float
        ``vech(S)`` of each row (:func:`token_features`).
    x : array (rows, d), float
        Query token of each row.

    Returns
    -------
    array (rows, d_out)
        Predictions, in the arrays' namespace and common dtype.

    Raises
    ------
    DeviceMismatchError
        The three arrays are of different libraries or on different devices.

    Examples
    --------
    >>> import numpy as np
    >>> s, x = token_features(np.random.default_rng(0).standard_normal((5, 4, 2)))
    >>> coef = np.arange(12.0).reshape(6, 2)
    >>> bool(np.allclose(predict_rows(coef, s, x), phi(s, x) @ coef))
    True
    """
    xp = get_xp(coef, s, x)
    m, d = s.shape[1], x.shape[1]
    c = xp.reshape(coef, (m, -1))
    t = xp.reshape(xp.matmul(s, c), (s.shape[0], d, -1))  # (rows, d, d_out)
    return xp.matmul(x[:, None, :], t)[:, 0, :]


def coef_distance(coef_a, coef_b) -> float:
    """``||c - c'||_F``, the paper's distance between two models' coefficients ([Y25] eq. 15; DESIGN §2).

    Parameters
    ----------
    coef_a, coef_b : array (psi, d_out) float
        Coefficients of two models (numpy, or any array API arrays of one namespace and device; same shape).

    Returns
    -------
    float
        The Frobenius norm of the difference; 0 exactly when the two compute the same function
        ([Y25] Cor. 2.4).

    Raises
    ------
    ParameterError
        Shapes that differ (broadcasting would compare models of different ``psi`` or ``d_out``).

    See Also
    --------
    scaleattn.compare_models : the same for two models' heads, with a verdict.

    Examples
    --------
    >>> import numpy as np
    >>> coef_distance(np.zeros((6, 1)), np.ones((6, 1)))  # doctest: +ELLIPSIS
    2.449...
    """
    xp = get_xp(coef_a, coef_b)
    if tuple(coef_a.shape) != tuple(coef_b.shape):
        raise ParameterError(f"coef_distance: shapes {tuple(coef_a.shape)} and {tuple(coef_b.shape)} differ"
                             " (coefficients of models of different d or d_out)")
    return float(xp.linalg.vector_norm(as_float64(coef_a, xp) - as_float64(coef_b, xp)))
