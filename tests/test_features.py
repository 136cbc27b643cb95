"""Features and statistics against dense, loop-by-loop numpy (DESIGN §2-3)."""
import numpy as np
import pytest

from scaleattn.features import (
    compact_factors,
    expand_compact_gram,
    n_features,
    phi,
    predict_rows,
    row_targets,
    token_features,
)
from scaleattn.generate import make_mhla
from scaleattn.statistics import Statistics, statistics_from_arrays


def dense_rows(tokens, lengths, causal):
    """phi rows by an explicit loop over samples and prefixes (independent of the vectorised code)."""
    n, T, d = tokens.shape
    I, J = np.triu_indices(d)
    rows = []
    for i in range(n):
        L = T if lengths is None else lengths[i]
        ts = range(L) if causal else [L - 1]
        for t in ts:
            Z = tokens[i, : t + 1]
            S = Z.T @ Z
            rows.append(np.kron(S[I, J], Z[t]))
    return np.array(rows)


@pytest.mark.parametrize("causal", [False, True])
def test_compact_gram_equals_dense_with_variable_lengths(causal):
    D = make_mhla(d=3, heads=2, length=9, samples=37, causal=causal, variable_lengths=True, seed=3)
    st = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"], block_rows=50)
    P = dense_rows(D["tokens"], D["lengths"], causal)
    y = row_targets(D["targets"], D["lengths"], causal)
    G = P.T @ P
    assert st.n_rows == P.shape[0]
    assert np.abs(st.gram() - G).max() <= 1e-12 * np.abs(G).max()
    assert np.allclose(st.moments, P.T @ y, rtol=1e-12, atol=1e-15 * np.abs(P.T @ y).max())
    assert st.yy == pytest.approx(float((y * y).sum()), rel=1e-13)


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


def test_statistics_add_save_load_merge(tmp_path):
    D = make_mhla(d=2, heads=1, length=5, samples=40, causal=True, seed=0)
    whole = statistics_from_arrays(D["tokens"], D["targets"])
    a = statistics_from_arrays(D["tokens"][:13], D["targets"][:13])
    b = statistics_from_arrays(D["tokens"][13:], D["targets"][13:])
    a.save(tmp_path / "a.zarr")
    merged = Statistics.load(tmp_path / "a.zarr") + b
    assert merged.n_rows == whole.n_rows == 200
    assert np.allclose(merged.gram_compact, whole.gram_compact, rtol=1e-13)
    assert np.allclose(merged.moments, whole.moments, rtol=1e-13)
    assert merged.yy == pytest.approx(whole.yy, rel=1e-14)
    with pytest.raises(ValueError, match="cannot add"):
        whole + statistics_from_arrays(D["tokens"][:, :, :1])


def test_loss_from_statistics_matches_residuals():
    D = make_mhla(d=2, heads=2, length=6, samples=30, noise=0.1, seed=2)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    c = np.random.default_rng(0).standard_normal((6, 2))
    s, x = token_features(D["tokens"])
    r = D["targets"] - phi(s, x) @ c
    assert st.sse(c) == pytest.approx(float((r * r).sum()), rel=1e-10)
