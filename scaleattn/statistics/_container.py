"""Sufficient statistics of MHLA least squares: compact Gram, B, yy, N (DESIGN §3).

``G = sum phi phi^T`` (kept compact as ``Tc``), ``B = sum phi y^T``, ``yy = sum ||y||^2`` and the row count
``N`` determine every least-squares quantity ([Y25] Alg. 1 needs only these). They form a commutative
monoid: add across chunks, files and machines; save, load and merge them. ``G`` does not depend on the
targets, so one ``Tc`` serves any number of target sets (and the certificate needs nothing else).
Layer L2: the container, the block loop over samples (:func:`accumulate`) and save/load; the Gram kernel
itself is :mod:`scaleattn.statistics._kernel`, the distributed build :mod:`scaleattn.distributed.build`.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import array_api_compat
import numpy as np

from .._backend import device_of, get_xp, is_numpy, on_accelerator, on_device, to_numpy
from ..data._checks import MAX_TARGET, MAX_TOKEN, check_arrays, check_lengths, check_underflow
from ..display import _html as _html
from ..errors import DatasetError, IntegrityError, ParameterError
from ..features import (
    n_features,
    n_pairs,
    row_targets,
    token_features,
)
from ..store import _formats, _integrity
from ..store._location import check_kind, check_path, check_storage_options, resolve
from ..store._outputs import atomic_output
from . import _compiled as _kernel_compiled
from ._kernel import BLAS_MIN_D, expand_gram, fused_update, gram_update, kernel_name

__all__ = ["Statistics", "accumulate", "statistics_from_arrays", "block_samples", "block_bytes_per_sample",
           "BLOCK_BYTES", "DEVICE_BLOCK_BYTES"]

FORMAT, FORMAT_VERSION = _formats.STATISTICS
#: bytes of features per block of :func:`accumulate` (:func:`block_bytes_per_sample`): large blocks amortise the
#: kernel's per-call work, small ones bound memory (32 MB: about 7,000 causal rows at d = 16)
BLOCK_BYTES = 32e6
#: the same on a device (CuPy, torch): a device pays ~10 us per launch, and the kernel launches one multiply per
#: pair row and one matmul per panel of each block (``scaleattn.statistics._kernel._gram_update_xp``): large
#: blocks let the matmuls dominate
DEVICE_BLOCK_BYTES = 1e9


@dataclasses.dataclass
class Statistics:
    """Sufficient statistics of a dataset (float64).

    Attributes
    ----------
    gram_compact : array (m(m+1)/2, d(d+1)/2)
        ``Tc = sum_i vech(s_i s_i^T) vech(x_i x_i^T)^T`` with ``m = d(d+1)/2`` (DESIGN §3).
    moments : array (psi, d_out)
        ``B = sum_i phi_i y_i^T``; ``d_out = 0`` when built without targets.
    yy : float
        ``sum_i ||y_i||^2``.
    n_rows : int
        Number of rows (samples, or prefixes in causal mode).
    d : int
        Token dimension.

    Raises
    ------
    ParameterError
        Adding statistics of different ``(d, d_out)``.

    See Also
    --------
    statistics_from_arrays : statistics of in-memory arrays.
    scaleattn.compute_statistics : statistics of a dataset, on a Dask cluster.
    scaleattn.solve, scaleattn.certify : what they are for.

    Notes
    -----
    ``G = sum_i phi_i phi_i^T`` is never stored: :meth:`gram` expands it from ``Tc`` (DESIGN §3,
    ``G[(P,l),(P',l')] = Tc[pair(P,P'), pair(l,l')]``). The training loss of any coefficients follows from the
    statistics alone (:meth:`sse`).

    Examples
    --------
    >>> import numpy as np, scaleattn
    >>> rng = np.random.default_rng(0)
    >>> tokens, targets = rng.standard_normal((100, 5, 2)), rng.standard_normal((100, 2))
    >>> a = scaleattn.statistics_from_arrays(tokens[:60], targets[:60])
    >>> b = scaleattn.statistics_from_arrays(tokens[60:], targets[60:])
    >>> both = scaleattn.statistics_from_arrays(tokens, targets)
    >>> bool(np.allclose((a + b).gram_compact, both.gram_compact)), (a + b).n_rows
    (True, 100)
    """

    gram_compact: np.ndarray
    moments: np.ndarray
    yy: float
    n_rows: int
    d: int

    @classmethod
    def zeros(cls, d: int, d_out: int = 0, xp=np, device=None) -> Statistics:
        """Empty (zero) float64 statistics in array namespace ``xp`` (numpy by default) on ``device``."""
        m = n_pairs(d)
        kw = {} if device is None else {"device": device}
        return cls(xp.zeros((m * (m + 1) // 2, d * (d + 1) // 2), dtype=xp.float64, **kw),
                   xp.zeros((n_features(d), d_out), dtype=xp.float64, **kw), 0.0, 0, d)

    @property
    def d_out(self) -> int:
        return int(self.moments.shape[1])

    @property
    def psi(self) -> int:
        return n_features(self.d)

    def __add__(self, other: Statistics) -> Statistics:
        if not isinstance(other, Statistics):
            return NotImplemented
        if (self.d, self.d_out) != (other.d, other.d_out):
            raise ParameterError(f"cannot add statistics of (d, d_out) = {(self.d, self.d_out)} and"
                                 f" {(other.d, other.d_out)}")
        if tuple(self.gram_compact.shape) != tuple(other.gram_compact.shape):  # a column tile and the whole Tc
            raise ParameterError(f"cannot add statistics whose compact Grams are {tuple(self.gram_compact.shape)} and"
                                 f" {tuple(other.gram_compact.shape)} (a column tile, accumulate(cols=), adds only"
                                 " to the same tile)")
        get_xp(self.gram_compact, other.gram_compact, self.moments, other.moments)  # DeviceMismatchError if mixed
        return Statistics(self.gram_compact + other.gram_compact, self.moments + other.moments,
                          self.yy + other.yy, self.n_rows + other.n_rows, self.d)

    def gram(self, out=None):
        """The feature Gram ``G = sum phi phi^T`` (psi, psi), expanded from the compact form
        (:func:`scaleattn.statistics._kernel.expand_gram`: compiled on numpy, the array-API gather elsewhere), into a
        new array or into ``out`` (a C-contiguous (psi, psi) float64 numpy array)."""
        return expand_gram(self.gram_compact, self.d, out=out)

    def sse(self, coef, gram=None) -> float:
        """Sum of squared residuals of ``coef`` (psi, d_out): ``yy - 2 tr(c^T B) + tr(c^T G c)``, no data pass.

        Its round-off floor is :meth:`sse_floor` (``eps`` times ``yy`` plus ``||c||^2 ||G||``-sized terms, not
        ``eps * yy`` alone): large, cancelling coefficients of ill-conditioned data raise it far above
        ``eps * yy``. Use a data pass (``evaluate``) or a QR of the features for errors below it.
        """
        G = self.gram() if gram is None else gram
        c = self._coef(coef)
        xp = get_xp(self.moments, c)
        return float(self.yy - 2 * xp.sum(c * self.moments) + xp.sum(c * (G @ c)))

    def _coef(self, coef):
        """``coef`` in the statistics' namespace and on their device (host coefficients moved there)."""
        xp = get_xp(self.moments)
        return on_device(coef, xp, None if is_numpy(xp) else device_of(self.moments))

    def sse_floor(self, coef, gram=None) -> float:
        """Order of magnitude of the round-off in :meth:`sse` (DESIGN §3): ``eps * sum_a K_a^2`` with
        ``K_a = sqrt(yy) + sum_j |c_ja| sqrt(G_jj)``.

        ``G``, ``B`` and ``yy`` each carry relative round-off ``~ eps`` of the sums of absolute products they
        accumulate, and ``sum_i (|phi_i| . |c|)^2 <= (sum_j |c_j| sqrt(G_jj))^2`` (Cauchy-Schwarz), so the three
        terms of the formula are uncertain by ``eps (sqrt(yy) + sum_j |c_j| sqrt(G_jj))^2`` per output: about
        ``eps psi ||c||^2 ||G||`` for large coefficients, ``eps yy`` for small ones. Values of :meth:`sse`
        below this are round-off.

        Examples
        --------
        >>> import numpy as np, scaleattn
        >>> st = scaleattn.statistics_from_arrays(np.ones((4, 2, 2)), np.ones((4, 1)))
        >>> st.sse_floor(np.zeros((6, 1))) == 2.0**-52 * st.yy  # c = 0: eps * yy
        True
        """
        G = self.gram() if gram is None else gram
        # an array's diagonal, or the matrix-free operator's (krylov path)
        dg = get_xp(G).linalg.diagonal(G) if array_api_compat.is_array_api_obj(G) else G.diagonal()
        c = self._coef(coef)
        xp = get_xp(dg, c)
        k = math.sqrt(max(float(self.yy), 0.0)) + xp.sqrt(xp.clip(dg, min=0.0)) @ xp.abs(c)
        return float(np.finfo(np.float64).eps) * float(xp.sum(k * k))

    def check_usable(self) -> None:
        """Refuse empty statistics, and statistics that hold NaN or Inf (what the solver node checks before it
        solves or certifies).

        Statistics of in-memory arrays (:func:`statistics_from_arrays`) are built from the values as given, and
        NaN or Inf in the input, or magnitudes whose degree-6 products overflow float64, end up here; a dataset's
        reads refuse them earlier, naming the sample. Checks ``Tc`` (where it is held here), ``B`` and ``yy``:
        O(size of the statistics), not of the rows.

        Raises
        ------
        ParameterError
            No rows.
        DatasetError
            Naming the statistics that are not finite and what to do.
        """
        if self.n_rows == 0:
            raise ParameterError("no rows: the statistics are empty")
        bad = [name for name, a in (("the compact Gram Tc", self.gram_compact), ("the moments B", self.moments))
               if a is not None and not _finite(a)]
        if not math.isfinite(float(self.yy)):
            bad.append("sum y^2")
        if bad:
            raise DatasetError(f"statistics: {' and '.join(bad)} contain NaN or Inf: the input had NaN or Inf, or"
                               f" values so large that the cubic features overflow float64 (|tokens| <="
                               f" {MAX_TOKEN:.0e}, |targets| <= {MAX_TARGET:.0e}); scaleattn.data._checks.check_values"
                               " names the sample")

    @property
    def target_mean_square(self) -> float:
        """Mean of ``y^2`` over rows and outputs."""
        return self.yy / max(self.n_rows * self.d_out, 1)

    def __repr__(self) -> str:
        return (f"Statistics(n_rows={int(self.n_rows)}, d={self.d}, d_out={self.d_out}, psi={self.psi},"
                f" yy={float(self.yy):.6g})")

    def _repr_html_(self) -> str:
        """The statistics card in Jupyter (:func:`scaleattn.display._html.statistics_html`)."""
        return _html.safe_html(lambda: _html.statistics_html({
            "n_rows": int(self.n_rows), "d": self.d, "d_out": self.d_out, "psi": self.psi,
            "target_mean_square": float(self.target_mean_square),
            "nbytes": 8 * int(math.prod(self.gram_compact.shape) + math.prod(self.moments.shape)),  # float64
            "gram_shape": tuple(int(n) for n in self.gram_compact.shape)}), lambda: repr(self))

    def to_numpy(self) -> Statistics:
        return Statistics(to_numpy(self.gram_compact), to_numpy(self.moments), float(self.yy), int(self.n_rows), self.d)

    def release(self) -> None:
        """Free memory held elsewhere for these statistics: nothing here (statistics held on a cluster's workers
        free their tiles, :class:`~scaleattn.distributed.operator.RemoteStatistics`)."""

    # ---- storage -------------------------------------------------------------------------------------
    def save(self, url, overwrite: bool = False, storage_options=None, attrs=None) -> None:
        """Write to a Zarr v3 group (atomically): arrays ``gram_compact``, ``moments``; ``yy``, ``n_rows``, ``d``
        in the attributes. Reload with :meth:`load`; merge with ``+``.

        ``url`` is a path, URL or :class:`~scaleattn.store._location.Location`; an existing store is refused
        (:class:`~scaleattn.errors.OutputExistsError`) unless ``overwrite``."""
        s = self.to_numpy()
        check_storage_options(storage_options, url)  # (fsspec's options of a local path: ignored, so refused)
        with atomic_output(resolve(url, storage_options), overwrite, _formats.STATISTICS[0]) as tmp:
            g = tmp.open_group("w")
            sums = {}
            _integrity.create_checked(g, "gram_compact", s.gram_compact, sums,
                                      dimension_names=("vech_pair", "vech_token"),
                                      attributes={"description": "compact Gram sum_i vech(s s^T) vech(x x^T)^T",
                                                  "units": "1"})
            _integrity.create_checked(g, "moments", s.moments, sums, dimension_names=("feature", "output"),
                                      attributes={"description": "B = sum_i phi_i y_i^T"})
            meta = {**(attrs or {}), "format": FORMAT, "format_version": FORMAT_VERSION,
                    "yy": float(s.yy), "n_rows": int(s.n_rows), "d": int(s.d), "d_out": s.d_out}
            g.attrs.update({**meta, _integrity.MANIFEST: _integrity.small_manifest(sums, meta)})

    @classmethod
    def load(cls, url, storage_options=None) -> Statistics:
        """Read statistics written by :meth:`save`.

        Raises :class:`~scaleattn.errors.FormatError` if the store is not a statistics group of a supported
        version, its attributes have the wrong types or an array's metadata cannot be read,
        :class:`~scaleattn.errors.IntegrityError` if the store is not the one written (an array missing, damaged,
        with absent chunks or not matching the manifest; attributes edited or not matching the arrays:
        :func:`scaleattn.store._integrity.read_store`), :class:`~scaleattn.errors.ParameterError` if ``url`` is a
        file (or a path through one).
        """
        check_path(url, "Statistics.load", "a statistics store's path or URL (RUN/stats.zarr)")
        check_storage_options(storage_options, url)
        loc = resolve(url, storage_options)
        check_kind(loc, "statistics", "a statistics store (a Zarr directory)", directory=True)
        a, arrays = _integrity.read_store(loc, _integrity.open_store(loc, "statistics"), _formats.STATISTICS,
                                          "statistics", ("gram_compact", "moments"),
                                          shapes=functools.partial(_shapes, where=loc.url))
        gram, moments = arrays["gram_compact"], arrays["moments"]
        d = int(a["d"])
        return cls(gram, moments, float(a["yy"]), int(a["n_rows"]), d)


def _shapes(a: dict, declared: dict, where: str) -> dict:
    """The shapes of a statistics store's arrays its attributes imply (``d``; ``d_out``, or in stores without
    it, the moments' declared width), checked before any chunk is read."""
    _formats.check_types(a, {"yy": float, "n_rows": int, "d": int, "d_out": int}, where, optional=("d_out",))
    d = a["d"]
    mom = declared["moments"]
    d_out = a.get("d_out", mom[1] if len(mom) == 2 else -1)
    if d < 1:
        raise IntegrityError(f"{where}: attribute 'd' is {d}: the store was edited")
    if len(mom) == 2 and d_out != mom[1]:
        raise IntegrityError(f"{where}: attribute 'd_out' is {d_out} but the moments hold {mom[1]}: the store was"
                             " edited")
    m = n_pairs(d)
    want = {"gram_compact": (m * (m + 1) // 2, d * (d + 1) // 2), "moments": (n_features(d), d_out)}
    for name, shape in declared.items():
        if shape != want[name]:
            raise IntegrityError(f"{name} in {where}: shape {shape}, but d = {d} in the attributes means"
                                 f" {want[name]}: the store was edited")
    return want


def block_bytes_per_sample(d: int, T: int, causal: bool) -> float:
    """Peak bytes :func:`accumulate` holds per sample of a block: the float64 token copy and mask (2 T d), the
    row features s, s^T, v, x (and, causal, the pair products and their cumsum: per row 4 m + m + d), and the
    moments' x (x) y for up to d targets. Independent of ``d_out`` so that ``Tc``'s bits are too."""
    m = n_pairs(d)  # = d(d+1)/2, also the width of v
    rows = T if causal else 1
    return 8.0 * (2 * T * d + rows * (5 * m + d + d * d))


def block_samples(d: int, T: int, causal: bool, block_rows: int | None = None, device: bool = False) -> int:
    """Samples per block of :func:`accumulate`: ``block_rows`` feature rows if given, else about ``BLOCK_BYTES``
    (``DEVICE_BLOCK_BYTES`` for arrays on an accelerator: ``device``, :func:`scaleattn._backend.on_accelerator`)."""
    if block_rows is not None:
        return max(1, int(block_rows) // (T if causal else 1))
    return max(1, int((DEVICE_BLOCK_BYTES if device else BLOCK_BYTES) // block_bytes_per_sample(d, T, causal)))


def accumulate(stats: Statistics, tokens, targets=None, lengths=None, causal: bool = False,
               block_rows: int | None = None, cols: slice | None = None, kernel: str | None = None) -> Statistics:
    """Add a block of samples to ``stats`` in place (and return it).

    Parameters
    ----------
    tokens : array (n, T, d) float; targets : (n, d_out) or (n, T, d_out), optional; lengths : (n,) int, optional
        numpy or any array API arrays (CuPy, torch, ...) of the statistics' namespace and device
        (:class:`~scaleattn.errors.DeviceMismatchError` otherwise); ``lengths`` may also be a host array.
    causal : bool
        Prefix mode (DESIGN §1): every valid position is a row.
    block_rows : int, optional
        Feature rows formed at a time (default: about ``BLOCK_BYTES`` of features, ``DEVICE_BLOCK_BYTES`` on an
        accelerator, :func:`block_samples`); the result does not depend on it beyond round-off.
    cols : slice, optional
        Column tile of ``u`` (= rows of ``Tc``, DESIGN §6): ``stats.gram_compact`` then holds only those rows.
    kernel : {"numba", "numpy"}, optional
        :func:`scaleattn.statistics._kernel.kernel_name` (default ``$SCALEATTN_KERNEL``, else numba; numpy for CuPy).
        Both give the same sums to round-off (1e-14); each is deterministic, whatever the thread count.

    Raises
    ------
    DatasetError
        ``targets`` whose shape does not fit ``causal`` and ``stats.d_out``; ``lengths`` of the wrong shape or
        outside ``1 <= length <= T`` (``0 <= length`` when causal), naming the first such sample.
    ParameterError
        ``tokens`` of another ``d`` than ``stats``.
    ValueError
        ``stats.gram_compact`` without the rows of ``cols`` (the kernel's check).
    DeviceMismatchError
        Arrays of another namespace or device than ``stats``.

    Per block: ``Tc += u^T v`` by :func:`gram_update` (DESIGN §3) and, in the same threads,
    ``B += s^T (x (x) y)``; with the numba kernel below ``BLAS_MIN_D`` all of it (features included) in one
    fused pass over the block's tokens (:func:`scaleattn.statistics._kernel.fused_update`, blocks of ``BLOCK_BYTES`` of
    float64 tokens and targets). Memory: about ``BLOCK_BYTES`` beyond the statistics, whatever ``n`` (on an
    accelerator ``DEVICE_BLOCK_BYTES`` and a ``scaleattn.statistics._kernel.DEVICE_PANEL_BYTES`` panel).
    """
    xp = get_xp(stats.gram_compact, tokens, targets)  # one namespace and device, or DeviceMismatchError
    n, T, d = tokens.shape
    _check_block(stats, tokens, targets, lengths, causal)
    kern = kernel_name(xp, kernel)
    if kern == "numba" and d < BLAS_MIN_D and is_numpy(xp):  # one fused compiled pass per block (bits: shapes only)
        # no feature buffers per block (tokens and targets are read in place): a block is BLOCK_BYTES of float64
        # tokens and targets (last-token targets are one row per sample: twice the samples of a causal block)
        d_out = 0 if targets is None else targets.shape[-1]
        step = max(1, int(BLOCK_BYTES // (8 * (T * d + (T if causal else 1) * d_out))))
        step = step if block_rows is None else block_samples(d, T, causal, block_rows)
        for a in range(0, n, step):
            b = min(n, a + step)
            yy, rows = fused_update(stats.gram_compact, stats.moments, tokens[a:b, ...],
                                    None if targets is None else targets[a:b, ...],
                                    None if lengths is None else lengths[a:b, ...], causal, cols)
            stats.yy += yy
            stats.n_rows += rows
        return stats
    step = block_samples(d, T, causal, block_rows, device=on_accelerator(tokens))
    for a in range(0, n, step):
        b = min(n, a + step)
        lens = None if lengths is None else lengths[a:b, ...]
        if kern == "numba":  # feature-major s, x (F-ordered views): the compiled panels stream their rows
            sT, xT = _kernel_compiled.features_t(tokens[a:b, ...], lens, causal)
            s, x = sT.T, xT.T
        else:
            s, x = token_features(tokens[a:b, ...], lens, causal)
        extra, yy, parts = [], 0.0, []
        if targets is not None:
            y = row_targets(targets[a:b, ...], lens, causal)
            macs = s.shape[1] * x.shape[1] * y.shape[1]
            if kern == "numba":  # row pieces summed apart, added in piece order (bits independent of threads)
                pieces = _kernel_compiled.row_pieces(s.shape[0], 1)
                parts = [stats.moments] if len(pieces) == 1 else [stats.moments * 0 for _ in pieces]
                extra += [((hi - lo) * macs, functools.partial(_kernel_compiled.moments_panel, part, sT, xT, y,
                                                               (lo, hi))) for (lo, hi), part in zip(pieces, parts)]
            else:
                extra.append((s.shape[0] * macs, functools.partial(_moments_update, stats.moments, s, x, y)))
            yy = float(xp.sum(y * y))
        gram_update(stats.gram_compact, s, x, cols, extra=extra, kernel=kern)
        for part in parts if len(parts) > 1 else ():
            stats.moments += part
        stats.yy += yy
        stats.n_rows += int(s.shape[0])
    return stats


def _check_block(stats: Statistics, tokens, targets, lengths, causal: bool) -> None:
    """What :func:`accumulate` needs of a block beyond its namespace: ``d`` and ``d_out`` of ``stats``, targets
    whose shape fits ``causal``, lengths in ``1 <= length <= T`` (0 too when causal: no rows; the kernels would
    read past a sample, or count an empty one as a last-token row); one :class:`DatasetError` /
    :class:`ParameterError` line (the kernels check ``Tc``'s rows against ``cols`` themselves)."""
    n, T, d = tokens.shape
    if d != stats.d:
        raise ParameterError(f"tokens: d = {d} but the statistics are for d = {stats.d}")
    if targets is not None:
        want = (n, T, stats.d_out) if causal else (n, stats.d_out)
        if tuple(targets.shape) != want:
            kind = "(sample, position, output)" if causal else "(sample, output)"
            raise DatasetError(f"targets: shape {tuple(targets.shape)}, expected {want}: {kind} for"
                               f" causal={causal} and d_out = {stats.d_out}")
    if lengths is not None:
        if tuple(lengths.shape) != (n,):
            raise DatasetError(f"lengths: expected shape ({n},) to match tokens, got {tuple(lengths.shape)}")
        check_lengths(lengths, 0, T, low=0 if causal else 1)


def _finite(a) -> bool:
    """No NaN or Inf in ``a``: its max and min (the standard's ``max``/``min`` propagate NaN), two passes and no
    temporary (``isfinite`` would allocate a boolean copy: 485 MB for ``Tc`` at d = 44)."""
    if not math.prod(a.shape):
        return True
    xp = get_xp(a)
    return math.isfinite(float(xp.max(a))) and math.isfinite(float(xp.min(a)))


def _moments_update(moments, s, x, y) -> None:
    """``B += s^T (x (x) y)`` in place: ``phi^T y`` without forming ``phi = s (x) x`` ([Y25] Alg. 1, DESIGN §3)."""
    xp = get_xp(moments, s, x, y)
    xy = xp.reshape(x[:, :, None] * y[:, None, :], (x.shape[0], x.shape[1] * y.shape[1]))  # (0 rows: no -1)
    moments += xp.reshape(s.T @ xy, moments.shape)





def statistics_from_arrays(tokens, targets=None, lengths=None, causal=None, block_rows=None) -> Statistics:
    """Sufficient statistics of in-memory arrays (numpy, CuPy or any array API arrays) in this process, no Dask
    (DESIGN §3).

    Parameters
    ----------
    tokens : array (n, T, d), float
        Token-major sequences (positions at or past ``lengths`` are padding, ignored even if NaN); nested lists
        are read with ``numpy.asarray``.
    targets : array (n, d_out) or (n, T, d_out), float, optional
        Last-token or per-prefix targets; without them only the Gram is built (enough for the certificate).
    lengths : array (n,), int, optional
        Valid length of each sequence, ``1 <= lengths <= T`` (causal: 0 too, a sequence of no rows).
    causal : bool, optional
        Prefix mode; default ``targets.ndim == 3`` (with targets, it must agree with their shape).
    block_rows : int, optional
        Feature rows formed at a time (memory; the result does not depend on it beyond round-off).

    Returns
    -------
    Statistics
        In the arrays' namespace, on their device, float64 whatever the input dtype.

    Raises
    ------
    DatasetError
        Shapes or dtypes that are not a dataset's (:func:`scaleattn.data._checks.check_arrays`), ``causal`` that
        contradicts the targets' shape, a length outside ``1 <= length <= T`` (causal: ``0 <=``), naming the sample;
        tokens so small that the features underflow float64, targets so small that their squares do
        (:func:`scaleattn.data._checks.check_underflow`).

    See Also
    --------
    scaleattn.compute_statistics : the same for a Zarr dataset, on a cluster.

    Examples
    --------
    >>> from scaleattn.generate import make_mhla
    >>> data = make_mhla(d=2, heads=1, length=10, samples=50, causal=True)
    >>> st = statistics_from_arrays(data["tokens"], data["targets"])
    >>> st.n_rows, st.psi, st.gram_compact.shape
    (500, 6, (6, 3))
    """
    tokens, targets, lengths = (a if a is None or array_api_compat.is_array_api_obj(a) else np.asarray(a)
                                for a in (tokens, targets, lengths))  # (nested lists, as the estimator takes)
    check_arrays(tokens, targets, lengths)
    if causal is not None and targets is not None and bool(causal) != (targets.ndim == 3):
        raise DatasetError(f"targets: shape {tuple(targets.shape)} with causal={bool(causal)}: causal targets are"
                           " (sample, position, output), last-token ones (sample, output)")
    check_underflow(tokens)  # (a Gram underflowed to zero looks like all-zero data: refused here, not after)
    if targets is not None:
        check_underflow(targets, name="targets")  # (y^2 underflowed to zero: an MSE of 0, relative nan)
    if causal is None:
        causal = targets is not None and targets.ndim == 3
    xp = get_xp(tokens, targets)
    d_out = 0 if targets is None else targets.shape[-1]
    stats = Statistics.zeros(tokens.shape[-1], d_out, xp, None if is_numpy(xp) else device_of(tokens))
    return accumulate(stats, tokens, targets, lengths, causal, block_rows)


