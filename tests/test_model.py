"""MHLAModel predictions: from the heads and from the coefficients alike; causal outputs with padding equal the
teacher's forward pass."""
import numpy as np

from scaleattn.estimator import MHLARegressor
from scaleattn.generate import make_mhla, mhla_forward


def test_heads_predict_like_coefficients():
    D = make_mhla(d=3, heads=2, length=20, samples=300, d_out=2, noise=0.05, seed=4)
    est = MHLARegressor().fit(D["tokens"], D["targets"])
    a = est.model_.predict(D["tokens"])
    b = est.model_.predict(D["tokens"], use_heads=True)
    assert np.abs(a - b).max() <= 1e-10 * np.abs(a).max()
    assert est.n_heads_ == min(2 * 3, 3 * 3)


def test_causal_predict_shapes_and_padding():
    D = make_mhla(d=2, heads=1, length=8, samples=10, causal=True, variable_lengths=True, seed=7)
    est = MHLARegressor().fit(D["tokens"], D["targets"], D["lengths"])
    p = est.predict(D["tokens"], D["lengths"])
    assert p.shape == D["targets"].shape
    assert np.allclose(p, mhla_forward(D["V"], D["Q"], D["tokens"], D["lengths"], causal=True), atol=1e-12)
