"""Logit bounds and the automatic degree of the polynomial path (DESIGN §8). Dense references
(tests/tensor/reference.py) are written independently of the package."""

import numpy as np

from scaleattn import tensor as T
from tests.tensor.reference import rand


def test_poly_auto_degree_and_bounds():
    rng = np.random.default_rng(11)
    n, d = 12, 3
    X = rand(rng, (n, d), scale=0.5)
    B = T.logit_bound(*X[:3])
    assert B >= T.logit_bound(*X[:3], method="exact") > 0
    info = {}
    out = T.poly_attention(*X, degree="auto", tol=1e-9, info=info)
    assert info["out_bound"] <= 1e-9
    assert np.abs(out - T.attention(*X)).max() <= 1e-9
    g = info["degree"]
    assert T.choose_degree(B, d, 1e-9, np.abs(X[3]).max() * np.abs(X[4]).max()) == g
