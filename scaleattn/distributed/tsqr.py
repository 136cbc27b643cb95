"""Tall-skinny QR of the features over the row groups, in process or on a Dask cluster (DESIGN §4, §6).

The second data pass a certificate takes when the Gram cannot settle it (:func:`scaleattn.linalg._qr.needs_qr`): one
task per row group (the same groups as the statistics build, :func:`~.partition.row_groups`) folds its rows
``[phi | y]`` into an R factor (:func:`scaleattn.linalg._qr.accumulate_r`), and R factors are combined by the
fixed-order tree of :mod:`.reduction` (stack two R's and re-factor, :func:`scaleattn.linalg._qr.merge_factors`), so
the result is the same for any worker count, completion order or retry. Tasks run on the CPU (LAPACK's
Householder QR); memory per task: one block of rows (``QR_BLOCK_BYTES``) and ``split_every + 1`` R's.
"""
from __future__ import annotations

from ..display._progress import as_reporter
from ..errors import InsufficientMemoryError
from ..features import n_features
from ..linalg._qr import QR_BLOCK_BYTES, QRFactor, accumulate_r, merge_factors
from ..store._location import with_retries
from .memory import GIB, available_memory, small_workers
from .partition import TILED_MAX_GROUPS, row_groups, tile_bounds
from .reduction import SPLIT_EVERY, TreeReducer, check_reachable, run_trees

__all__ = ["compute_r", "group_r", "qr_memory", "check_qr_memory"]


def group_r(dataset, start: int, stop: int, targets: bool = True) -> QRFactor:
    """R factor of the rows ``[phi | y]`` of samples ``[start, stop)`` (``targets=False``: ``phi`` only), streamed
    chunk by chunk (one Dask task; DESIGN §6). Raises :class:`~scaleattn.errors.DatasetError` on bad values.

    Examples
    --------
    >>> import numpy as np, scaleattn
    >>> ds = scaleattn.write_dataset("_doc_gr.zarr", np.ones((8, 3, 2)), np.ones((8, 1)), overwrite=True)
    >>> group_r(ds, 0, 4).n_rows, group_r(ds, 0, 4, targets=False).d_out
    (4, 0)
    """
    f = QRFactor.zeros(dataset.d, dataset.d_out if targets else 0)
    for tok, lens, y in dataset.read_chunks(start, stop, targets=targets):
        f = accumulate_r(f, tok, y, lens, dataset.causal)
    return f


def qr_memory(d: int, d_out: int, split_every: int = SPLIT_EVERY) -> dict:
    """Estimated peak bytes of the QR pass: ``worker_bytes`` (a block of rows three times: its features, the
    stack under R and LAPACK's work on it; the R's a task combines, stacked) and ``solver_bytes`` (the final R,
    the scaled copy of R11 and its SVD factors U and V: about ``p^2 + 3 psi^2`` floats, counted as 4).
    Independent of the number of rows.

    Examples
    --------
    >>> est = qr_memory(12, 1)  # psi = 936: the largest that certificate="auto" factors
    >>> est["psi"], round(est["solver_bytes"] / 2**20)
    (936, 33)
    """
    psi = n_features(d)
    p = psi + d_out
    r = 8.0 * p * p
    return {"psi": psi, "r_bytes": r, "worker_bytes": 3 * QR_BLOCK_BYTES + 2 * (split_every + 1) * r,
            "solver_bytes": r + 8.0 * 4 * psi * psi}


def check_qr_memory(d: int, d_out: int, client=None, memory_limit=None) -> dict:
    """Refuse a QR pass that cannot fit (this process, and every worker with a memory limit); return
    :func:`qr_memory`'s estimate. ``memory_limit`` as :func:`~.memory.available_memory`.

    Raises
    ------
    InsufficientMemoryError
        With the memory needed, the memory there is, and what to do.

    Examples
    --------
    >>> check_qr_memory(4, 1, memory_limit="1GiB")["psi"]
    40
    """
    est = qr_memory(d, d_out)
    have = available_memory(memory_limit)
    if est["solver_bytes"] > have:
        raise InsufficientMemoryError(
            f"the QR certificate at d = {d} (psi = {est['psi']:,}) needs {est['solver_bytes'] / GIB:.1f} GiB on the"
            f" solver node; this machine has {have / GIB:.1f} GiB available. Use `certificate='gram'` or a machine"
            f" with at least {1.25 * est['solver_bytes'] / GIB:.0f} GiB.")
    if client is not None:
        small, n_workers = small_workers(client, est["worker_bytes"])
        if small:
            raise InsufficientMemoryError(
                f"the QR certificate at d = {d} needs {est['worker_bytes'] / GIB:.2f} GiB per worker; {len(small)} of"
                f" {n_workers} workers have only {min(small) / GIB:.2f} GiB. Use `certificate='gram'` or larger"
                " workers.")
    return est


def compute_r(dataset, client=None, *, targets: bool = True, group_samples: int | None = None,
              split_every: int = SPLIT_EVERY, progress=False) -> QRFactor:
    """R factor of the features ``[Phi | Y]`` of a dataset by tall-skinny QR over its row groups (DESIGN §6).

    Parameters
    ----------
    dataset : Dataset
    client : distributed.Client, optional
        Without one the same tasks and tree run in this process.
    targets : bool
        False factors ``Phi`` only (enough for the certificate).
    group_samples : int, optional
        Samples per row group; default the statistics build's grouping.
    split_every : int
        R factors combined per reduction task.
    progress : bool or Reporter
        A bar ("qr") in samples.

    Returns
    -------
    QRFactor
        ``R`` (psi + d_out square) and the row count.

    Raises
    ------
    DatasetError
        Bad values in the dataset (naming the array and the sample).

    See Also
    --------
    scaleattn.linalg._qr.solve_from_r, scaleattn.linalg._qr.certificate_from_r : what the factor is for.

    Examples
    --------
    >>> import scaleattn
    >>> from scaleattn.generate import generate_mhla
    >>> ds = generate_mhla("_doc_tsqr.zarr", d=2, heads=1, length=10, samples=64, causal=True, overwrite=True)
    >>> f = compute_r(ds)
    >>> f.R.shape, f.n_rows
    ((8, 8), 640)
    """
    check_reachable(client, [("dataset", dataset.store)])
    tiled = len(tile_bounds(dataset.d)) > 1  # the statistics build's row groups, tiled or not
    groups = row_groups(dataset, group_samples, TILED_MAX_GROUPS if tiled else None)
    with as_reporter(progress).bar("qr", dataset.n_samples, "samples", steps=len(groups)) as advance:
        if client is None:
            red = TreeReducer(merge_factors, split_every)
            for a, b in groups:
                red.add(group_r(dataset, a, b, targets))
                advance(b - a, steps=1)
            return red.result()
        futs = [client.submit(with_retries, group_r, dataset, a, b, targets,
                              key=f"qr-part-{dataset.fingerprint}-{int(targets)}-{a}-{b}") for a, b in groups]
        weights = {f.key: b - a for f, (a, b) in zip(futs, groups)}
        (root,) = run_trees(client, [futs], merge_factors, split_every, advance=lambda w: advance(w, steps=1),
                            weights=weights)
        return root
