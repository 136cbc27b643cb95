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


def test_estimator_refuses_bad_values_and_lengths_naming_the_sample():
    """The estimator checks its arrays as a dataset's reads do (NaN/Inf, magnitudes whose cubic features overflow,
    lengths outside 1..T), in fit and in predict, with one DatasetError naming the array and the sample."""
    import pytest

    from scaleattn.errors import DatasetError

    D = make_mhla(d=2, heads=1, length=6, samples=12, causal=True, variable_lengths=True, seed=3)
    est = MHLARegressor().fit(D["tokens"], D["targets"], D["lengths"])
    for value, message in ((np.nan, "tokens: sample 7 contains NaN or Inf"), (-np.inf, "tokens: sample 7 contains"),
                           (3e38, "tokens: sample 7 has a value of magnitude 3.0e\\+38")):
        bad = D["tokens"].copy()
        bad[7, 0, 1] = value
        with pytest.raises(DatasetError, match=message):
            MHLARegressor().fit(bad, D["targets"], D["lengths"])
        with pytest.raises(DatasetError, match=message):
            est.predict(bad, D["lengths"])
    y = D["targets"].copy()
    y[2, 1, 0] = 1e101
    with pytest.raises(DatasetError, match="targets: sample 2 has a value of magnitude 1.0e\\+101"):
        MHLARegressor().fit(D["tokens"], y, D["lengths"])
    for length in (0, 7, -1):
        lens = D["lengths"].copy()
        lens[9] = length
        with pytest.raises(DatasetError, match=f"lengths: sample 9 has length {length}, expected 1 <= length <= T = 6"):
            MHLARegressor().fit(D["tokens"], D["targets"], lens)
        with pytest.raises(DatasetError, match=f"lengths: sample 9 has length {length}"):
            est.predict(D["tokens"], lens)
    with pytest.raises(DatasetError, match="tokens: expected an array of a float"):
        est.predict(D["tokens"] > 0, D["lengths"])
