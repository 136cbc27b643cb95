"""Statistics (DESIGN §3): the compact Gram, moments and y^T y against dense numpy features; independent of
block sizes and of d_out; add, save, load, merge; the loss from the statistics against residuals."""
import numpy as np
import pytest

from scaleattn.features import phi, row_targets, token_features
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


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
@pytest.mark.parametrize("causal", [False, True])
def test_compact_gram_equals_dense_with_variable_lengths(causal, kernel, monkeypatch):
    import scaleattn.kernel

    monkeypatch.setattr(scaleattn.kernel, "KERNEL", kernel)
    D = make_mhla(d=3, heads=2, length=9, samples=37, causal=causal, variable_lengths=True, seed=3)
    st = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"], block_rows=50)
    P = dense_rows(D["tokens"], D["lengths"], causal)
    y = row_targets(D["targets"], D["lengths"], causal)
    G = P.T @ P
    assert st.n_rows == P.shape[0]
    assert np.abs(st.gram() - G).max() <= 1e-12 * np.abs(G).max()
    assert np.allclose(st.moments, P.T @ y, rtol=1e-12, atol=1e-15 * np.abs(P.T @ y).max())
    assert st.yy == pytest.approx(float((y * y).sum()), rel=1e-13)


def _dense_reference(D):
    s, x = token_features(D["tokens"], None, True)
    f = phi(s, x)
    y = row_targets(D["targets"], None, True)
    return f.T @ f, f.T @ y, s, x


def test_statistics_do_not_depend_on_block_or_panel_sizes(noisy_causal_arrays):
    D = noisy_causal_arrays
    G_ref, B_ref, _, _ = _dense_reference(D)
    base = statistics_from_arrays(D["tokens"], D["targets"])
    assert np.allclose(base.gram(), G_ref, rtol=1e-12, atol=1e-12 * np.abs(G_ref).max())
    assert np.allclose(base.moments, B_ref, rtol=1e-12, atol=1e-12 * np.abs(B_ref).max())
    scale = np.abs(base.gram_compact).max()
    for block_rows in (1, 7, 100, 5000):
        st = statistics_from_arrays(D["tokens"], D["targets"], block_rows=block_rows)
        assert np.abs(st.gram_compact - base.gram_compact).max() <= 1e-12 * scale
        assert np.abs(st.moments - base.moments).max() <= 1e-12 * np.abs(base.moments).max()
        assert st.n_rows == base.n_rows and st.yy == pytest.approx(base.yy, rel=1e-12)


def test_block_size_ignores_targets_and_counts_tokens():
    """Tc's bits do not depend on d_out (block boundaries come from d and T only), and a non-causal block is
    sized by its tokens, not only its feature rows."""
    from scaleattn.statistics import BLOCK_BYTES, block_bytes_per_sample, block_samples

    assert block_samples(4, 256, False) * block_bytes_per_sample(4, 256, False) <= BLOCK_BYTES
    assert block_samples(4, 256, False) < block_samples(4, 1, False)
    D = make_mhla(d=3, heads=1, length=6, samples=3000, causal=True, seed=5)
    y8 = np.concatenate([D["targets"]] * 3, axis=-1)[..., :8]
    a = statistics_from_arrays(D["tokens"], D["targets"])
    b = statistics_from_arrays(D["tokens"], y8)
    c = statistics_from_arrays(D["tokens"], None, causal=True)
    assert np.array_equal(a.gram_compact, b.gram_compact) and np.array_equal(a.gram_compact, c.gram_compact)


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


@pytest.mark.parametrize("where,value,named", [("tokens", np.nan, "the compact Gram Tc and the moments B"),
                                               ("tokens", 1e200, "the compact Gram Tc and the moments B"),
                                               ("targets", np.inf, "the moments B and sum y\\^2")])
def test_solver_node_refuses_non_finite_statistics(where, value, named):
    """Statistics of in-memory arrays are built from the values as given: NaN, Inf or an overflow in them is
    refused by solve and certify in one DatasetError (it was LinAlgError: "Eigenvalues did not converge")."""
    import scaleattn
    from scaleattn.errors import DatasetError

    D = make_mhla(d=2, heads=1, length=5, samples=40, seed=1)
    D[where] = D[where].copy()
    D[where][6, 0] = value
    with np.errstate(all="ignore"):
        st = statistics_from_arrays(D["tokens"], D["targets"])
    for call in (scaleattn.solve, scaleattn.certify):
        with pytest.raises(DatasetError, match=f"statistics: {named} contain NaN or Inf"):
            call(st)


def test_tokens_whose_gram_underflows_are_refused_not_certified():
    """|tokens| ~ 1e-60: the degree-6 Gram underflowed to 0 and a realizable dataset read "not identifiable",
    rank 0, margin nan. Refused, naming the sample and the factor; 1e-30 still certifies; all-zero samples pass."""
    from scaleattn.certificate import certify
    from scaleattn.errors import DatasetError

    rng = np.random.default_rng(0)
    z, y = rng.standard_normal((200, 5, 2)), rng.standard_normal((200, 2))
    with pytest.raises(DatasetError, match=r"tokens: sample 0 has values of magnitude at most \d\.\de-60: its degree-6"
                                           r" features underflow float64 .*multiply them by 1e60"):
        statistics_from_arrays(z * 1e-60, y)
    assert certify(statistics_from_arrays(z * 1e-30, y)).verdict == "identifiable"
    z[:5] = 0.0
    z[5:] *= 1e-20
    assert certify(statistics_from_arrays(z, y)).verdict == "identifiable"


def test_targets_whose_squares_underflow_are_refused_not_fitted():
    """|targets| ~ 1e-200: y^2 underflowed to 0 and a fit reported "train MSE 0 (relative nan)" and a flattening
    rank bound of 0 heads. Refused, naming the sample and the factor; 1e-90 still fits; all-zero samples pass."""
    from scaleattn.errors import DatasetError

    rng = np.random.default_rng(0)
    z, y = rng.standard_normal((200, 5, 2)), rng.standard_normal((200, 2))
    with pytest.raises(DatasetError, match=r"targets: sample 0 has values of magnitude at most \d\.\de-20\d: its square"
                                           r" underflows float64 .*multiply them by 1e20\d"):
        statistics_from_arrays(z, y * 1e-200)
    y[:5] = 0.0
    st = statistics_from_arrays(z, y * 1e-90)
    assert st.target_mean_square > 0 and np.isfinite(st.target_mean_square)


def test_dataset_reads_refuse_tokens_whose_gram_underflows(tmp_path):
    import zarr

    from scaleattn.dataset import open_dataset
    from scaleattn.errors import DatasetError

    g = zarr.open_group(str(tmp_path / "t.zarr"), mode="w")  # another tool's store: read unchecked before
    g.create_array("tokens", data=np.full((8, 3, 2), 1e-60))
    g.create_array("targets", data=np.ones((8, 2)))
    with pytest.raises(DatasetError, match=r"tokens: sample 0 has values of magnitude at most 1\.0e-60"):
        open_dataset(str(tmp_path / "t.zarr")).read(0, 8)
