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
