"""scaleattn: learn attention layers with guarantees instead of gradient descent.

Multi-head linear attention is linear in cubic features of its input, so its globally best fit is a
least-squares problem [Yau et al., NeurIPS 2025, arXiv:2410.10101]. scaleattn streams the features from Zarr
datasets through Dask workers into sufficient statistics, solves on one node, certifies identifiability
and recovers the heads. ``scaleattn.tensor`` has tensor attention [Cao et al., arXiv:2405.16411].
"""
__version__ = "0.1.0"

from .dataset import Dataset, DatasetError, open_dataset, write_dataset  # noqa: E402
from .statistics import Statistics, compute_statistics, statistics_from_arrays  # noqa: E402
from .solver import Certificate, Solution, certify, solve  # noqa: E402
from .heads import Heads, coef_distance, coef_from_heads, compare_models, svd_heads  # noqa: E402
from .head_search import search_heads  # noqa: E402
from .model import MHLAModel, MHLARegressor, evaluate  # noqa: E402
from .job import FitResult, certify_dataset, fit  # noqa: E402

__all__ = [
    "Dataset", "DatasetError", "open_dataset", "write_dataset", "Statistics", "compute_statistics",
    "statistics_from_arrays", "Certificate", "Solution", "certify", "solve", "Heads", "coef_distance",
    "coef_from_heads", "compare_models", "search_heads", "svd_heads", "MHLAModel", "MHLARegressor", "evaluate",
    "FitResult", "certify_dataset", "fit", "__version__",
]
