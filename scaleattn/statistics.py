"""Sufficient statistics of MHLA least squares: compact Gram, B, yy, N (DESIGN §3).

``G = sum phi phi^T`` (kept compact as ``Tc``), ``B = sum phi y^T``, ``yy = sum ||y||^2`` and the row count
``N`` determine every least-squares quantity ([Y25] Alg. 1 needs only these). They form a commutative
monoid: add across chunks, files and machines; save, load and merge them. ``G`` does not depend on the
targets, so one ``Tc`` serves any number of target sets (and the certificate needs nothing else).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import _storage
from ._backend import get_xp, to_numpy
from .features import compact_factors, expand_compact_gram, n_features, n_pairs, row_targets, token_features

FORMAT = "scaleattn-statistics"
FORMAT_VERSION = 1
#: feature rows per GEMM block: big enough for an efficient GEMM, small enough that u stays in memory
BLOCK_ROWS = 1024


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
    """

    gram_compact: np.ndarray
    moments: np.ndarray
    yy: float
    n_rows: int
    d: int

    @classmethod
    def zeros(cls, d: int, d_out: int = 0, xp=np) -> "Statistics":
        m = n_pairs(d)
        return cls(xp.zeros((m * (m + 1) // 2, d * (d + 1) // 2)), xp.zeros((n_features(d), d_out)), 0.0, 0, d)

    @property
    def d_out(self) -> int:
        return int(self.moments.shape[1])

    @property
    def psi(self) -> int:
        return n_features(self.d)

    def __add__(self, other: "Statistics") -> "Statistics":
        if (self.d, self.d_out) != (other.d, other.d_out):
            raise ValueError(f"cannot add statistics of (d, d_out) = {(self.d, self.d_out)} and {(other.d, other.d_out)}")
        return Statistics(self.gram_compact + other.gram_compact, self.moments + other.moments,
                          self.yy + other.yy, self.n_rows + other.n_rows, self.d)

    def gram(self):
        """The feature Gram ``G = sum phi phi^T`` (psi, psi), expanded from the compact form."""
        return expand_compact_gram(self.gram_compact, self.d)

    def second_moment(self):
        """``Lambda_D = G / N`` (psi, psi): the uncentred second moment of the features ([Y25] Lemma 2.3)."""
        return self.gram() / max(self.n_rows, 1)

    def sse(self, coef, gram=None) -> float:
        """Sum of squared residuals of ``coef`` (psi, d_out): ``yy - 2 tr(c^T B) + tr(c^T G c)``, no data pass.

        Its round-off floor is about ``eps * yy``; use a data pass (``evaluate``) for errors far below it.
        """
        G = self.gram() if gram is None else gram
        c = np.asarray(coef)
        return float(self.yy - 2 * np.sum(c * self.moments) + np.sum(c * (G @ c)))

    @property
    def target_mean_square(self) -> float:
        """Mean of ``y^2`` over rows and outputs."""
        return self.yy / max(self.n_rows * self.d_out, 1)

    def to_numpy(self) -> "Statistics":
        return Statistics(to_numpy(self.gram_compact), to_numpy(self.moments), float(self.yy), int(self.n_rows), self.d)

    # ---- storage -------------------------------------------------------------------------------------
    def save(self, url, overwrite: bool = False, storage_options=None, attrs=None) -> None:
        """Write to a Zarr v3 group (atomically): arrays ``gram_compact``, ``moments``; ``yy``, ``n_rows``, ``d``
        in the attributes. Reload with :meth:`load`; merge with ``+``."""
        s = self.to_numpy()
        with _storage.atomic_output(url, overwrite, storage_options) as tmp:
            g = _storage.open_group(tmp, "w", storage_options)
            g.attrs.update({**(attrs or {}), "format": FORMAT, "format_version": FORMAT_VERSION,
                            "yy": float(s.yy), "n_rows": int(s.n_rows), "d": int(s.d), "d_out": s.d_out})
            g.create_array("gram_compact", data=s.gram_compact, dimension_names=("vech_pair", "vech_token"),
                           attributes={"description": "compact Gram sum_i vech(s s^T) vech(x x^T)^T", "units": "1"})
            g.create_array("moments", data=s.moments, dimension_names=("feature", "output"),
                           attributes={"description": "B = sum_i phi_i y_i^T"})

    @classmethod
    def load(cls, url, storage_options=None) -> "Statistics":
        """Read statistics written by :meth:`save`.

        Raises ``ValueError`` if the store is not a statistics group of a supported version.
        """
        g = _storage.open_group(url, "r", storage_options)
        a = dict(g.attrs)
        if a.get("format") != FORMAT or a.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{url}: not a scaleattn statistics store (format {a.get('format')!r} v{a.get('format_version')})")
        return cls(np.asarray(g["gram_compact"][...]), np.asarray(g["moments"][...]), float(a["yy"]),
                   int(a["n_rows"]), int(a["d"]))


def accumulate(stats: Statistics, tokens, targets=None, lengths=None, causal: bool = False,
               block_rows: int = BLOCK_ROWS) -> Statistics:
    """Add a block of samples to ``stats`` in place (and return it).

    Parameters
    ----------
    tokens : array (n, T, d) float; targets : (n, d_out) or (n, T, d_out), optional; lengths : (n,) int, optional
        numpy or cupy (the statistics' arrays must live on the same device).
    causal : bool
        Prefix mode (DESIGN §1): every valid position is a row.

    Rows are processed ``block_rows`` at a time: ``Tc += u^T v`` (one GEMM, DESIGN §3), ``B += s^T (x (x) y)``.
    """
    xp = get_xp(tokens)
    n, T, d = tokens.shape
    per = T if causal else 1
    step = max(1, block_rows // per)
    u_buf = None
    for a in range(0, n, step):
        b = min(n, a + step)
        lens = None if lengths is None else lengths[a:b]
        s, x = token_features(tokens[a:b], lens, causal)
        if u_buf is None or u_buf.shape[0] < s.shape[0]:
            u_buf = xp.empty((max(s.shape[0], step * per if causal else step), stats.gram_compact.shape[0]))
        u, v = compact_factors(s, x, u_buf)
        stats.gram_compact += u.T @ v
        if targets is not None:
            y = row_targets(targets[a:b], lens, causal)
            xy = (x[:, :, None] * y[:, None, :]).reshape(x.shape[0], -1)
            stats.moments += (s.T @ xy).reshape(stats.moments.shape)
            stats.yy += float((y * y).sum())
        stats.n_rows += int(s.shape[0])
    return stats


def statistics_from_arrays(tokens, targets=None, lengths=None, causal=None, block_rows=BLOCK_ROWS) -> Statistics:
    """Statistics of in-memory arrays (numpy or cupy), no Dask. ``causal`` defaults to ``targets.ndim == 3``."""
    if causal is None:
        causal = targets is not None and targets.ndim == 3
    xp = get_xp(tokens)
    d_out = 0 if targets is None else targets.shape[-1]
    stats = Statistics.zeros(tokens.shape[-1], d_out, xp)
    return accumulate(stats, tokens, targets, lengths, causal, block_rows)


# ---- distributed build ----------------------------------------------------------------------------------
def row_groups(dataset, group_samples: int | None = None) -> list[tuple[int, int]]:
    """Split samples into contiguous groups of whole Zarr chunks (one Dask task each).

    The split depends only on the dataset (never on the number of workers), so the reduction tree and the
    statistics are bit-identical across worker counts, retries and resumes (DESIGN §6). By default about
    32 MB of tokens per group, and at least 8 groups when the dataset has 8 chunks.
    """
    N, chunk = dataset.n_samples, dataset.chunk_samples
    if group_samples is None:
        bytes_per_chunk = 8 * chunk * dataset.length * dataset.d
        per = max(1, int(32e6 // bytes_per_chunk))
        per = min(per, max(1, math.ceil(dataset.n_chunks / 8)))
        group_samples = per * chunk
    group_samples = max(chunk, (int(group_samples) // chunk) * chunk)
    return [(a, min(N, a + group_samples)) for a in range(0, N, group_samples)]


def group_statistics(dataset, start: int, stop: int, targets: bool = True, device: str = "auto") -> Statistics:
    """Statistics of samples ``[start, stop)`` of a dataset, streamed chunk by chunk (one Dask task).

    ``device``: ``"cpu"``, ``"gpu"`` (CuPy) or ``"auto"`` (GPU when this worker has one). Returned on the host.
    Raises :class:`~scaleattn.dataset.DatasetError` on bad values (naming the array and the sample).
    """
    xp = _device_module(device)
    stats = Statistics.zeros(dataset.d, dataset.d_out if targets else 0, xp)
    for a in range(start, stop, dataset.chunk_samples):
        b = min(stop, a + dataset.chunk_samples)
        tok, lens, y = dataset.read(a, b, targets=targets)
        if xp is not np:
            tok, lens, y = (None if t is None else xp.asarray(t) for t in (tok, lens, y))
        accumulate(stats, tok, y, lens, dataset.causal)
    return stats.to_numpy()


def _device_module(device):
    if device == "cpu":
        return np
    from ._backend import have_cupy

    if device == "gpu" or (device == "auto" and have_cupy()):
        import cupy

        return cupy
    return np


def _add_all(*parts: Statistics) -> Statistics:
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def tree_reduce(parts: list, combine, split_every: int = 8):
    """Reduce ``parts`` by combining ``split_every`` neighbours at a time, level by level, in a fixed order
    (so floating-point results do not depend on which worker finished first)."""
    if not parts:
        raise ValueError("nothing to reduce")
    split_every = max(2, int(split_every))
    while len(parts) > 1:
        parts = [combine(*parts[i : i + split_every]) if len(parts[i : i + split_every]) > 1 else parts[i]
                 for i in range(0, len(parts), split_every)]
    return parts[0]


def compute_statistics(dataset, client=None, *, targets: bool = True, group_samples: int | None = None,
                       split_every: int = 8, device: str = "auto", progress: bool = False) -> Statistics:
    """Build the statistics of a dataset on a Dask cluster by tree reduction (DESIGN §6).

    Each task streams one row group (:func:`row_groups`) and accumulates locally; partials are combined by
    :func:`tree_reduce` on the workers; only the final statistics come back to the client.

    Parameters
    ----------
    dataset : Dataset
        From :func:`scaleattn.dataset.open_dataset`.
    client : distributed.Client, optional
        Without one the groups are processed in this process (same tree, same bits).
    targets : bool
        False builds only the Gram (enough for the certificate).
    progress : bool
        Show a progress bar driven by this job's futures.
    """
    groups = row_groups(dataset, group_samples)
    if client is None:
        from .cluster import progress_bar

        parts = []
        with progress_bar(len(groups), "statistics", progress) as advance:
            for a, b in groups:
                parts.append(group_statistics(dataset, a, b, targets, device))
                advance()
        return tree_reduce(parts, _add_all, split_every)
    from .cluster import wait_with_progress

    tag = f"{dataset.fingerprint}-{int(targets)}"
    futs = [client.submit(group_statistics, dataset, a, b, targets, device, key=f"stats-group-{tag}-{a}-{b}",
                          retries=3) for a, b in groups]
    root = tree_reduce(futs, lambda *p: client.submit(_add_all, *p, retries=3), split_every)
    wait_with_progress(futs, "statistics", progress)
    return root.result() if hasattr(root, "result") else root
