"""The matrix-free Gram operator on a cluster (DESIGN §3, §4, §6): the compact-Gram tiles stay on the
workers that built them, and no node holds ``Tc`` or ``G``.

:func:`remote_statistics` runs the statistics build (:func:`scaleattn.distributed.build.compute_statistics`)
but leaves the root of every column tile of ``Tc`` on the worker that computed it (persisted futures); the
client receives only ``B`` (psi x d_out), ``yy`` and the row count. :class:`DistributedGramOperator` is the
operator the krylov solver (:mod:`scaleattn.linalg._krylov`) runs on: each product ``G X`` sends ``X`` (psi x k) once to
every worker that holds tiles, each of those workers applies its tiles (:func:`scaleattn.linalg._gram.tile_matmat`,
one psi x k partial per worker, whatever its number of tiles), and the partials are added by the fixed-order
tree of :mod:`.reduction`; the sum comes back to the client. Traffic per product is therefore
``2 x 8 psi k`` bytes per worker (``X`` out, one partial back into the tree), never a tile; the operator counts
it (:attr:`DistributedGramOperator.traffic`).

The preconditioner's inputs come back once: the diagonal of ``G`` (psi) and, for block-Jacobi, the token-diagonal
columns of ``Tc`` (m(m+1)/2 x d, a fraction 2 / (d + 1) of ``Tc``), or, for K-FAC, the partial traces of the
scaled ``G`` (one m(m+1)/2 + d(d+1)/2 vector per worker, tree-summed), all assembled from per-tile partials.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._backend import check_device
from ..errors import ParameterError
from ..features import n_features, n_pairs
from ..linalg._gram import (
    GramOperator,
    partial_trace_factors,
    tile_diagonal,
    tile_matmat,
    tile_partial_traces,
    tile_token_columns,
)
from ..statistics._container import Statistics
from .build import Build, build_statistics
from .reduction import SPLIT_EVERY, check_reachable, submit_tree

__all__ = ["DistributedGramOperator", "RemoteStatistics", "remote_statistics", "remote_build", "persisted_tiles"]


def _worker_matmat(d: int, c0s: tuple, X, *tiles) -> np.ndarray:
    """One worker's partial ``G X``: the sum of :func:`tile_matmat` over the tiles it holds (a Dask task)."""
    Y = np.zeros_like(np.asarray(X, np.float64))
    for c0, t in zip(c0s, tiles):
        tile_matmat(t.gram_compact, c0, d, X, out=Y)
    return Y


def _worker_diagonal(d: int, c0s: tuple, *tiles) -> np.ndarray:
    D = np.zeros(n_features(d))
    for c0, t in zip(c0s, tiles):
        tile_diagonal(t.gram_compact, c0, d, out=D)
    return D


def _worker_traces(d: int, c0s: tuple, scale, *tiles) -> np.ndarray:
    """One worker's partial of the (scaled) partial traces of ``G``: :func:`tile_partial_traces` over its tiles."""
    m = n_pairs(d)
    T = np.zeros(m * (m + 1) // 2 + d * (d + 1) // 2)
    for c0, t in zip(c0s, tiles):
        tile_partial_traces(t.gram_compact, c0, d, scale, out=T)
    return T


def _tile_columns(d: int, c0: int, tile) -> np.ndarray:
    return tile_token_columns(tile.gram_compact, c0, d)


def _small_parts(tile) -> tuple:
    """What the client needs of the statistics besides ``Tc``: ``(B, yy, n_rows)`` (tile 0 carries them)."""
    return np.asarray(tile.moments), float(tile.yy), int(tile.n_rows)


def _rows(tile) -> int:
    return int(tile.n_rows)


def _add(*parts):
    out = parts[0] + parts[1] if len(parts) > 1 else parts[0]
    for p in parts[2:]:
        out += p
    return out


class DistributedGramOperator(GramOperator):
    """``G`` (psi x psi, never formed) from compact-Gram tiles held on the workers as futures (DESIGN §3, §6).

    Parameters
    ----------
    client : distributed.Client
    d : int
        Token dimension.
    tiles : sequence of (int, Future)
        ``(c0, future of a Statistics whose gram_compact is rows [c0, c1) of Tc)`` partitioning ``Tc``.
    split_every : int
        Partials combined per reduction task.

    Attributes
    ----------
    passes, products : int
        As :class:`~scaleattn.linalg._gram.GramOperator`.
    traffic : list of dict
        Per product: ``workers``, ``bytes_out`` (``X`` sent to the workers), ``bytes_back`` (the partials into
        the tree and the sum to the client).

    See Also
    --------
    remote_statistics : builds the tiles and this operator.

    Examples
    --------
    >>> from distributed import Client, LocalCluster  # doctest: +SKIP
    >>> op = remote_statistics(dataset, Client(LocalCluster(n_workers=2))).operator  # doctest: +SKIP
    >>> op @ X  # G X, psi x k on the client  # doctest: +SKIP
    """

    def __init__(self, client, d: int, tiles, split_every: int = SPLIT_EVERY):
        self.client, self.d, self.psi, self.split_every = client, int(d), n_features(int(d)), int(split_every)
        self.tiles = sorted(((int(c0), f) for c0, f in tiles), key=lambda cf: cf[0])
        self.xp, self.threads, self.products, self.passes, self.traffic = np, 1, 0, 0, []
        who = client.who_has([f for _, f in self.tiles])
        self.by_worker: dict[str, list[tuple[int, object]]] = {}
        for c0, f in self.tiles:
            holders = sorted(who.get(f.key, ()))
            if not holders:
                raise ParameterError(f"the compact-Gram tile at row {c0} is held by no worker (lost?)")
            self.by_worker.setdefault(holders[0], []).append((c0, f))

    def _map(self, func, *args):
        """One task per worker holding tiles, run there on its own tiles; the partials' tree sum (a future).
        The placement is soft: when a worker is lost, Dask rebuilds its tiles elsewhere and the task follows."""
        parts = [self.client.submit(func, self.d, tuple(c0 for c0, _ in ts), *args, *[f for _, f in ts],
                                    workers=[w], allow_other_workers=True, pure=False)
                 for w, ts in sorted(self.by_worker.items())]
        root, combines = submit_tree(self.client, parts, _add, self.split_every)
        return root, parts, combines

    def release(self) -> None:
        """Drop the tiles from the cluster (cancel their futures); later products are refused."""
        futures = [f for _, f in self.tiles]
        self.tiles, self.by_worker = [], {}
        if futures:
            self.client.cancel(futures)

    def matmat(self, X):
        X = np.asarray(X, np.float64)
        if not self.tiles:
            raise ParameterError("the compact-Gram tiles of this operator were released from the cluster")
        if X.shape[0] != self.psi:
            raise ParameterError(f"X has {X.shape[0]} rows, expected psi = {self.psi} for d = {self.d}")
        vec = X.ndim == 1
        X2 = np.ascontiguousarray(X.reshape(self.psi, -1))
        workers = sorted(self.by_worker)
        xf = self.client.scatter(X2, workers=workers, broadcast=True, hash=False)
        root, _, _ = self._map(_worker_matmat, xf)
        Y = root.result()
        nb = 8 * X2.size
        self.traffic.append({"workers": len(workers), "bytes_out": nb * len(workers),
                             "bytes_back": nb * len(workers)})  # n - 1 partials into the tree, the sum out
        self.products += X2.shape[1]
        self.passes += 1
        return Y.reshape(self.psi) if vec else Y

    __matmul__ = matmat

    def traffic_summary(self) -> dict:
        """Products so far, workers, and bytes per product: out (``X`` to each worker), back (the partials)."""
        t = self.traffic
        return {"products": len(t), "workers": len(self.by_worker), "tiles": len(self.tiles),
                "bytes_out_per_pass": max((x["bytes_out"] for x in t), default=0),
                "bytes_back_per_pass": max((x["bytes_back"] for x in t), default=0)}

    def diagonal(self):
        if not hasattr(self, "_diag"):
            self._diag = self._map(_worker_diagonal)[0].result()
        return self._diag

    def partial_traces(self, scale=None):
        """``(A', B')`` of :meth:`GramOperator.partial_traces`: one small partial per worker, tree-summed."""
        if not self.tiles:
            raise ParameterError("the compact-Gram tiles of this operator were released from the cluster")
        sf = None if scale is None else self.client.scatter(np.asarray(scale, np.float64), broadcast=True, hash=False,
                                                            workers=sorted(self.by_worker))
        return partial_trace_factors(self._map(_worker_traces, sf)[0].result(), self.d)

    def token_columns(self):
        futs = [self.client.submit(_tile_columns, self.d, c0, f, pure=False) for c0, f in self.tiles]
        return np.concatenate(self.client.gather(futs), axis=0)


class RemoteStatistics(Statistics):
    """:class:`~scaleattn.statistics._container.Statistics` whose compact Gram stays on the workers: ``moments``, ``yy``
    and ``n_rows`` are here, ``Tc`` only through :attr:`operator` (products, diagonal, token columns).

    Attributes
    ----------
    operator : DistributedGramOperator

    See Also
    --------
    remote_statistics : makes one.

    Examples
    --------
    >>> stats = remote_statistics(dataset, client)  # doctest: +SKIP
    >>> scaleattn.solve(stats, solver="krylov")  # doctest: +SKIP
    """

    def __init__(self, operator: DistributedGramOperator, moments, yy: float, n_rows: int):
        super().__init__(None, moments, float(yy), int(n_rows), operator.d)
        self.operator = operator

    def gram(self):
        raise ParameterError("the compact Gram of these statistics is held on the workers (solver='krylov' on a"
                             " cluster): only products G @ X are available (use heads='svd' or H, not 'minimal')")

    def to_numpy(self) -> RemoteStatistics:
        return self

    def release(self) -> None:
        """Free the workers' memory: drop the tiles of ``Tc`` (a fit does so when it ends, failed or not)."""
        self.operator.release()

    def __add__(self, other):
        raise ParameterError("statistics held on the workers cannot be added on the client")

    def save(self, *args, **kwargs):
        raise ParameterError("statistics held on the workers are not saved (stats.zarr would gather Tc)")

    def _repr_html_(self) -> str:
        return repr(self)


def persisted_tiles(client, tiles, roots) -> tuple[list, tuple]:
    """``[(c0, future)]`` of a persisted build and ``(B, yy, n_rows)`` from tile 0; refuses tiles that disagree
    on the row count (as :func:`scaleattn.distributed.build.compute_statistics` does)."""
    rows = set(client.gather([client.submit(_rows, r, pure=False) for r in roots]))
    if len(rows) != 1:
        raise RuntimeError(f"tiles disagree on the row count: {sorted(rows)}")
    return [(c0, r) for (c0, _), r in zip(tiles, roots)], client.submit(_small_parts, roots[0]).result()


def remote_statistics(dataset, client, *, targets: bool = True, max_tile_bytes: float | None = None,
                      **kwargs) -> RemoteStatistics:
    """Build the statistics on the cluster with every tile of ``Tc`` left on the worker that computed it.

    ``max_tile_bytes`` (default: ``Tc`` in at least 4 tiles, at most 256 MB each; it depends only on d, never on
    the workers) sets the tiling; ``kwargs`` go to :func:`~scaleattn.distributed.build.build_statistics`.
    Returns :class:`RemoteStatistics`; the client holds ``B`` (psi x d_out), never ``Tc``.
    """
    check_device(kwargs.get("device", "auto"))
    check_reachable(client, [("dataset", dataset.store)])
    return remote_build(dataset, client, targets=targets, max_tile_bytes=max_tile_bytes, **kwargs).statistics


def remote_build(dataset, client, *, targets: bool = True, max_tile_bytes: float | None = None, **kwargs) -> Build:
    """:func:`remote_statistics` for a caller that validated its parameters, with the build's counts: a
    :class:`~scaleattn.distributed.build.Build` whose ``statistics`` are the :class:`RemoteStatistics`."""
    if client is None:
        raise ParameterError("remote_statistics needs a Dask client (without one, compute_statistics)")
    m = n_pairs(dataset.d)
    tc = 8.0 * (m * (m + 1) // 2) * m
    if max_tile_bytes is None:
        max_tile_bytes = min(256e6, max(tc / 4, 8.0 * m))
    build = build_statistics(dataset, client, targets=targets, max_tile_bytes=max_tile_bytes, persist=True,
                             **kwargs)
    futs, (B, yy, n) = persisted_tiles(client, *build.statistics)
    return dataclasses.replace(build, statistics=RemoteStatistics(DistributedGramOperator(client, dataset.d, futs),
                                                                  B, yy, n))
