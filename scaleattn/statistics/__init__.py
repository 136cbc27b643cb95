"""Sufficient statistics of the least-squares fit: the compact Gram matrix, the moments ``B = phi^T y``,
``sum y^2`` and the row count (:class:`Statistics`), accumulated block by block by the kernels (numpy / array
API, or compiled with numba) and merged by ``+``. DESIGN §3 (the compact Gram), §4 (the statistics)."""
from ._container import Statistics, accumulate, statistics_from_arrays

__all__ = ["Statistics", "accumulate", "statistics_from_arrays"]
