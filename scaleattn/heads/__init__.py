"""Heads ``(V_h, Q_h)`` of a fitted model: the algebra between heads and coefficients and the paper's SVD heads
(``_algebra``), the fit of H heads to given coefficients (``_fit``), lower bounds on the number of heads
(``_bounds``), and the search for the fewest heads that compute the fitted function (``_search``).
[Y25] Alg. 1, DESIGN §6."""
from ._algebra import Heads, coef_from_heads, compare_models, svd_heads
from ._search import loss_vs_heads, search_heads

__all__ = ["Heads", "coef_from_heads", "compare_models", "svd_heads", "search_heads", "loss_vs_heads"]
