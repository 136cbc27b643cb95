"""Input validation of the tensor API: shapes, dtypes, finiteness and options, each naming the argument (DESIGN §8).
Dense references (tests/tensor/reference.py) are written independently of the package."""

import numpy as np
import pytest

from scaleattn import tensor as T
from tests.tensor.reference import rand


def test_validation():
    rng = np.random.default_rng(13)
    X = rand(rng, (5, 3))
    bad = list(X)
    bad[2] = rng.normal(size=(5, 4))
    with pytest.raises(ValueError, match="K2"):
        T.attention(*bad)
    bad = list(X)
    bad[3] = np.ones((5, 3), dtype=np.int64)
    with pytest.raises(TypeError, match="V1"):
        T.attention(*bad)
    bad = list(X)
    bad[4] = X[4].copy()
    bad[4][1, 1] = np.nan
    with pytest.raises(ValueError, match="V2"):
        T.attention(*bad)
    with pytest.raises(ValueError, match="Q"):
        T.attention(np.ones(3), *X[1:])
    with pytest.raises(ValueError, match="E"):
        T.attention_grad(*X, np.ones((4, 3)))
    with pytest.raises(ValueError, match="window"):
        T.attention(*X, window=(0, 2))
    with pytest.raises(ValueError, match="scale"):
        T.attention(*X, scale="bogus")
    with pytest.raises(ValueError, match="degree"):
        T.poly_attention(*X, degree=0)
    with pytest.raises(ValueError, match="path"):
        T.weight_grad(*X, T.TensorWeights.random(3, 3), X[0], path="fast")
