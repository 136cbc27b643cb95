"""Statistics (DESIGN §3): the compact Gram, moments and y^T y against dense numpy features; independent of
block sizes and of d_out; add, save, load, merge; the loss from the statistics against residuals."""
import numpy as np
import pytest

from scaleattn.features import phi, row_targets, token_features
from scaleattn.generate import make_mhla
from scaleattn.statistics._container import Statistics, statistics_from_arrays


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
    import scaleattn.statistics._kernel

    monkeypatch.setattr(scaleattn.statistics._kernel, "KERNEL", kernel)
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
    from scaleattn.statistics._container import BLOCK_BYTES, block_bytes_per_sample, block_samples

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
    from scaleattn.errors import DatasetError
    from scaleattn.linalg._solver import certify

    rng = np.random.default_rng(0)
    z, y = rng.standard_normal((200, 5, 2)), rng.standard_normal((200, 2))
    with pytest.raises(DatasetError, match=r"tokens: sample 0 has values of magnitude at most \d\.\de-60: its degree-6"
                                           r" features near the underflow of float64 .*multiply them by 1e60"):
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
                                           r" nears the underflow of float64 .*multiply them by 1e20\d"):
        statistics_from_arrays(z, y * 1e-200)
    y[:5] = 0.0
    st = statistics_from_arrays(z, y * 1e-90)
    assert st.target_mean_square > 0 and np.isfinite(st.target_mean_square)


def test_dataset_reads_refuse_tokens_whose_gram_underflows(tmp_path):
    import zarr

    from scaleattn.data._dataset import open_dataset
    from scaleattn.errors import DatasetError

    g = zarr.open_group(str(tmp_path / "t.zarr"), mode="w")  # another tool's store: read unchecked before
    g.create_array("tokens", data=np.full((8, 3, 2), 1e-60))
    g.create_array("targets", data=np.ones((8, 2)))
    with pytest.raises(DatasetError, match=r"tokens: sample 0 has values of magnitude at most 1\.0e-60"):
        open_dataset(str(tmp_path / "t.zarr")).read(0, 8)


def _small(seed=0, n=3, T=4, d=2):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, T, d)), rng.standard_normal((n, 1))


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
@pytest.mark.parametrize("lengths, sample", [([4, 0, 4], 1), ([4, 5, 4], 1), ([4, 4, 9], 2), ([-1, 4, 4], 0)])
def test_lengths_outside_one_to_T_are_refused_naming_the_sample(lengths, sample, kernel, monkeypatch):
    """A length past T made the numpy kernel read the next sample's tokens, the numba one clamp; 0 counted an
    empty sample as a row (n_rows, yy): every kernel refuses them, naming the sample."""
    import scaleattn.statistics._kernel
    from scaleattn.errors import DatasetError

    monkeypatch.setattr(scaleattn.statistics._kernel, "KERNEL", kernel)
    tok, y = _small()
    with pytest.raises(DatasetError, match=rf"lengths: sample {sample} has length {lengths[sample]}"):
        statistics_from_arrays(tok, y, np.array(lengths))
    from scaleattn.statistics._container import accumulate

    with pytest.raises(DatasetError, match=rf"sample {sample}"):  # (accumulate checks the same on its own)
        accumulate(Statistics.zeros(2, 1), tok, y, np.array(lengths))


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_padding_is_ignored_on_every_kernel(causal, kernel, monkeypatch):
    """Padding is ignored: a NaN there (a 0/1 mask multiplied it into NaN on the numpy path) leaves the statistics
    equal to those of the same data with zero padding, and equal to the dense rows."""
    import scaleattn.statistics._kernel

    monkeypatch.setattr(scaleattn.statistics._kernel, "KERNEL", kernel)
    tok, _ = _small(1)
    lens = np.array([4, 2, 3])
    y = np.random.default_rng(2).standard_normal((3, 4, 1) if causal else (3, 1))
    clean = tok.copy()
    for i, n in enumerate(lens):
        clean[i, n:] = 0.0
    dirty = clean.copy()
    dirty[1, 3, 0], dirty[2, 3, 1] = np.nan, np.inf
    st = statistics_from_arrays(dirty, y, lens, causal=causal)
    P = dense_rows(clean, lens, causal)
    G = P.T @ P
    assert np.isfinite(st.gram_compact).all() and np.isfinite(st.moments).all()
    assert np.abs(st.gram() - G).max() <= 1e-13 * np.abs(G).max()
    assert st.n_rows == P.shape[0]


def test_adding_statistics_refuses_tiles_and_mixed_namespaces():
    """A column tile (accumulate(cols=)) broadcast into every row of a whole Tc when added; statistics of two
    array libraries were converted silently one way and failed with a bare TypeError the other."""
    from scaleattn.errors import DeviceMismatchError, ParameterError
    from scaleattn.statistics._container import accumulate

    tok, y = _small()
    full = statistics_from_arrays(tok, y)
    tile = Statistics.zeros(2, 1)
    tile.gram_compact = np.zeros((1, 3))
    accumulate(tile, tok, y, cols=slice(0, 1))
    assert np.allclose(tile.gram_compact, full.gram_compact[:1], rtol=1e-14)
    with pytest.raises(ParameterError, match="compact Grams are"):
        full + tile
    strict = pytest.importorskip("array_api_strict")
    other = statistics_from_arrays(strict.asarray(tok), strict.asarray(y))
    for a, b in ((full, other), (other, full)):
        with pytest.raises(DeviceMismatchError):
            a + b


@pytest.mark.parametrize("case", ["causal-2d", "last-3d", "wrong-dout", "wrong-d"])
def test_accumulate_refuses_blocks_that_do_not_fit_the_statistics(case):
    from scaleattn.errors import DatasetError, ParameterError
    from scaleattn.statistics._container import accumulate

    tok, y = _small()
    stats, causal, targets, err = Statistics.zeros(2, 1), False, y, DatasetError
    if case == "causal-2d":
        causal = True
    elif case == "last-3d":
        targets = np.zeros((3, 4, 1))
    elif case == "wrong-dout":
        targets = np.zeros((3, 2))
    else:
        stats, err = Statistics.zeros(3, 1), ParameterError
    with pytest.raises(err):
        accumulate(stats, tok, targets, causal=causal)
    if case in ("causal-2d", "last-3d"):
        with pytest.raises(DatasetError, match="causal"):
            statistics_from_arrays(tok, targets, causal=causal)


def test_nested_lists_are_read_as_arrays():
    tok, y = _small()
    a, b = statistics_from_arrays(tok.tolist(), y.tolist()), statistics_from_arrays(tok, y)
    assert a.n_rows == b.n_rows == 3
    assert np.array_equal(a.gram_compact, b.gram_compact)
