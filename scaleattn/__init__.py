"""scaleattn: learn attention layers with guarantees instead of gradient descent.

Multi-head linear attention is linear in cubic features of its input, so its globally best fit is a
least-squares problem [Yau et al., NeurIPS 2025, arXiv:2410.10101]. scaleattn streams the features from Zarr
datasets through Dask workers into sufficient statistics, solves on one node, certifies identifiability
and recovers the heads. ``scaleattn.tensor`` has tensor attention [Cao et al., arXiv:2405.16411].

The package's folders are its layers, bottom up (tests/test_architecture.py enforces the order): the base
modules (``errors``, ``_params``, ``_backend``), ``store/`` (locations, formats, integrity, locks, safe
outputs), ``display/`` (report text, HTML cards, progress), ``features``, ``data/`` (datasets), ``statistics/``
(the compact Gram and its kernels), ``linalg/`` (solver and certificate), ``heads/``, ``model``,
``distributed/`` (Dask), then the jobs (``run``, ``preflight``, ``plot``, ``pipeline``, ``estimator``,
``importers``, ``generate``) and the front doors (``cli/``, ``submit/``, ``bench/``, ``baselines/``);
``tensor/`` uses the base only.
"""
from . import _startup  # noqa: F401  (first: the scaleattn command's Ctrl-C while the rest imports)
from ._version import __version__
from .data import Dataset, open_dataset, write_dataset
from .distributed.build import compute_statistics
from .distributed.cluster import connect
from .distributed.evaluate import evaluate
from .errors import DatasetError, ScaleattnError
from .estimator import MHLARegressor
from .features import coef_distance
from .heads import Heads, coef_from_heads, compare_models, search_heads, svd_heads
from .linalg import Certificate, Solution, certify, solve
from .model import MHLAModel
from .pipeline import FitResult, certify_dataset, fit
from .statistics import Statistics, statistics_from_arrays

__all__ = [
    "Dataset", "DatasetError", "ScaleattnError", "open_dataset", "write_dataset", "Statistics",
    "compute_statistics", "connect", "statistics_from_arrays", "Certificate", "Solution", "certify", "solve", "Heads",
    "coef_distance", "coef_from_heads", "compare_models", "search_heads", "svd_heads", "MHLAModel",
    "MHLARegressor", "evaluate", "FitResult", "certify_dataset", "fit", "__version__",
]
