"""Mean squared error of a model on a dataset by a pass over the data, in process or on a Dask cluster:
one task per row group, summed by the fixed-order tree of :mod:`.reduction`."""
from __future__ import annotations

import numpy as np

from ..data._dataset import Dataset, check_dataset_argument, open_dataset
from ..display._progress import as_reporter
from ..errors import ParameterError
from ..model import residual_sums
from ..store._location import with_retries
from ..store._outputs import reading
from .partition import row_groups
from .reduction import check_reachable, run_trees, tree_reduce

__all__ = ["evaluate", "group_errors"]


def group_errors(dataset, start: int, stop: int, coef) -> np.ndarray:
    """``[sum of squared residuals, sum y^2, count of target entries]`` of samples ``[start, stop)``."""
    tot = np.zeros(3)
    for tok, lens, y in dataset.read_chunks(start, stop):
        tot += residual_sums(coef, tok, y, lens, dataset.causal)
    return tot


def _groups(dataset, samples) -> list[tuple[int, int]]:
    """The row groups of samples ``[start, stop)``: the dataset's own groups up to ``stop``
    (:func:`~.partition.row_groups` of its first ``stop`` samples), cut at ``start``."""
    if samples is None:
        return row_groups(dataset)
    start, stop = (int(x) for x in samples)
    if not 0 <= start < stop <= dataset.n_samples:
        raise ParameterError(f"samples [{start}, {stop}) is not a non-empty range of the {dataset.n_samples}"
                             f" samples of {dataset.url}")
    return [(max(a, start), b) for a, b in row_groups(dataset.first(stop)) if b > start]


def _sum(*parts):
    return np.sum(parts, axis=0)


def evaluate(model, dataset, client=None, progress=False, *, samples=None) -> dict:
    """Mean squared error of a model on a dataset, by a pass over the data (distributed when ``client``).

    Parameters
    ----------
    model : MHLAModel
    dataset : Dataset, str or path-like
        With targets, and the model's ``d`` and ``d_out`` (a path or URL is opened: :func:`scaleattn.open_dataset`).
    client : distributed.Client, optional
        Cluster to run on; None computes in this process.
    progress : bool or Reporter
        A bar counted in samples.
    samples : (int, int), optional
        Only samples ``[start, stop)`` (a fit's held-out validation samples); default all.

    Returns
    -------
    dict
        ``mse`` (mean over rows and outputs), ``target_mean_square``, ``relative_mse``, ``n_rows``.

    Raises
    ------
    ParameterError
        ``dataset`` is no dataset (arrays: one line pointing to :class:`scaleattn.MHLARegressor`), the dataset has
        no targets or other dimensions than the model, or ``samples`` is not a non-empty range
        of its samples.
    UnsupportedError
        The dataset lives in this process's memory and the workers of ``client`` in other processes.
    OutputInUseError
        Another run is replacing the dataset (:func:`scaleattn.store._outputs.reading`).
    DatasetError
        Bad values in the dataset.

    See Also
    --------
    scaleattn.fit : measures the training MSE this way (``exact_mse=True``).

    Examples
    --------
    >>> import scaleattn
    >>> from scaleattn.generate import generate_mhla
    >>> ds = generate_mhla("_doc_eval.zarr", d=2, heads=1, length=20, samples=64, causal=True, overwrite=True)
    >>> res = scaleattn.fit(ds)
    >>> bool(scaleattn.evaluate(res.model, ds)["relative_mse"] < 1e-20)
    True
    """
    check_dataset_argument(dataset, "evaluate")
    dataset = dataset if isinstance(dataset, Dataset) else open_dataset(dataset)
    model.check_dataset(dataset)
    check_reachable(client, [("dataset", dataset.store)])
    groups = _groups(dataset, samples)
    coef = np.asarray(model.coef)
    bar = as_reporter(progress).bar("evaluate", sum(b - a for a, b in groups), "samples", steps=len(groups))
    with reading(dataset.store, "dataset"), bar as advance:  # no other run replaces the dataset meanwhile
        if client is None:
            parts = []
            for a, b in groups:
                parts.append(group_errors(dataset, a, b, coef))
                advance(b - a, steps=1)
            tot = tree_reduce(parts, _sum)
        else:
            cf = client.scatter(coef, broadcast=True)
            tag = f"{dataset.fingerprint}-{cf.key}"
            futs = [client.submit(with_retries, group_errors, dataset, a, b, cf, key=f"evaluate-{a}-{b}-{tag}")
                    for a, b in groups]
            weights = {f.key: b - a for f, (a, b) in zip(futs, groups)}
            (tot,) = run_trees(client, [futs], _sum, advance=lambda w: advance(w, steps=1), weights=weights)
    sse, yy, count = tot
    mse, ms = sse / max(count, 1), yy / max(count, 1)
    return {"mse": mse, "target_mean_square": ms, "relative_mse": mse / ms if ms > 0 else float("nan"),
            "n_rows": int(count // max(model.d_out, 1))}
