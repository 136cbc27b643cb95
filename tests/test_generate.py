"""Synthetic datasets: the stored targets are the stored teacher's forward pass; lengths and chunks as asked."""
import numpy as np

from scaleattn.data._dataset import open_dataset
from scaleattn.generate import generate_mhla, mhla_forward


def test_dataset_roundtrip_and_teacher(tmp_path):
    ds = generate_mhla(tmp_path / "g.zarr", d=3, heads=2, length=7, samples=50, variable_lengths=True,
                       causal=True, seed=3, chunk_samples=8)
    tok, lens, y = ds.read(0, 50)
    V, Q = ds.teacher()
    assert V.shape == (2, 3, 3) and Q.shape == (2, 3, 3)
    assert np.allclose(y, mhla_forward(V, Q, tok, lens, causal=True), rtol=1e-12, atol=1e-15)
    assert (lens >= 1).all() and (lens <= 7).all()
    assert open_dataset(tmp_path / "g.zarr").chunk_samples == 8


def test_causal_teacher_in_blocks_of_sequences(monkeypatch):
    """The causal forward pass holds the prefix Grams of a few sequences at a time, with the same answer as the
    features' (phi . p(Theta), an independent formula)."""
    import scaleattn.generate as gen
    from scaleattn.features import phi, token_features
    from scaleattn.heads import coef_from_heads

    rng = np.random.default_rng(5)
    V, Q = gen.make_teacher(3, 2, 2, 0)
    tok = rng.standard_normal((9, 6, 3))
    lens = rng.integers(1, 7, 9)
    monkeypatch.setattr(gen, "FORWARD_BYTES", 8 * 6 * 9 * 2)  # two sequences per block
    y = gen.mhla_forward(V, Q, tok, lens, causal=True)
    s, x = token_features(tok, lens, causal=True)
    ref = phi(s, x) @ coef_from_heads(V, Q)
    keep = np.arange(6)[None, :] < lens[:, None]
    assert np.allclose(y[keep], ref, rtol=1e-12, atol=1e-14)
    assert np.all(y[~keep] == 0)
