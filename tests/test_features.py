"""Cubic features against dense, loop-by-loop numpy (DESIGN §2): counts, compact factors and their column
slices, token Grams, predictions."""
import numpy as np

from scaleattn.features import (
    compact_factors,
    expand_compact_gram,
    n_features,
    phi,
    predict_rows,
    token_features,
)
from scaleattn.generate import make_mhla


def test_feature_count_matches_paper():
    assert [n_features(d) for d in (2, 4, 8, 16, 32, 64)] == [6, 40, 288, 2176, 16896, 133120]


def test_compact_factor_shapes_and_expansion():
    rng = np.random.default_rng(0)
    d = 4
    s, x = token_features(rng.standard_normal((5, 3, d)))
    u, v = compact_factors(s, x)
    m = d * (d + 1) // 2
    assert u.shape == (5, m * (m + 1) // 2) and v.shape == (5, d * (d + 1) // 2)
    P = phi(s, x)
    assert np.allclose(expand_compact_gram(u.T @ v, d), P.T @ P, rtol=1e-13)


def test_predict_rows_equals_phi_dot_coef():
    rng = np.random.default_rng(1)
    s, x = token_features(rng.standard_normal((6, 4, 3)), causal=True)
    c = rng.standard_normal((n_features(3), 2))
    assert np.allclose(predict_rows(c, s, x), phi(s, x) @ c, rtol=1e-13)


def test_compact_factors_cols_are_the_columns_of_u():
    rng = np.random.default_rng(0)
    s, x = rng.normal(size=(7, 10)), rng.normal(size=(7, 4))  # m = 10: u has 55 columns
    u, v = compact_factors(s, x)
    # u = vech(s s^T) computed independently
    I, J = np.triu_indices(10)
    np.testing.assert_array_equal(u, s[:, I] * s[:, J])
    for c0, c1 in [(0, 55), (0, 1), (3, 17), (9, 10), (10, 11), (54, 55), (20, 20), (40, 55)]:
        ut, vt = compact_factors(s, x, cols=slice(c0, c1))
        assert ut.shape == (7, c1 - c0)
        np.testing.assert_array_equal(ut, u[:, c0:c1])
        np.testing.assert_array_equal(vt, v)
    buf = np.full((9, 55), np.nan)
    ut, _ = compact_factors(s, x, buf, cols=slice(12, 30))
    np.testing.assert_array_equal(ut, u[:, 12:30])


def test_non_causal_token_gram_matches_definition():
    D = make_mhla(d=3, heads=1, length=9, samples=11, variable_lengths=True, seed=2)
    s, x = token_features(D["tokens"], D["lengths"], False)
    for i in range(11):
        z = D["tokens"][i, : D["lengths"][i]]
        S = z.T @ z
        assert np.allclose(s[i], S[np.triu_indices(3)], rtol=1e-14, atol=1e-15)
        assert np.array_equal(x[i], z[-1])


def test_coef_distance_refuses_different_shapes():
    """Broadcasting (6, 1) against (6, 2) gave 0, which the docs read as "the same function"."""
    import pytest

    from scaleattn.errors import ParameterError
    from scaleattn.features import coef_distance

    with pytest.raises(ParameterError, match="differ"):
        coef_distance(np.ones((6, 1)), np.ones((6, 2)))
    assert coef_distance(np.zeros((6, 1)), np.ones((6, 1))) == pytest.approx(6 ** 0.5, rel=1e-15)
