"""The same array code on CuPy: statistics, features and a fit agree with numpy (skipped without a GPU)."""
import numpy as np
import pytest

from scaleattn._backend import have_cupy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_cupy(), reason="needs CuPy and a CUDA GPU")]


def test_statistics_on_gpu_equal_cpu():
    import cupy

    from scaleattn.generate import make_mhla
    from scaleattn.statistics import statistics_from_arrays

    D = make_mhla(d=4, heads=2, length=20, samples=200, causal=True, variable_lengths=True, seed=0)
    cpu = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"])
    gpu = statistics_from_arrays(cupy.asarray(D["tokens"]), cupy.asarray(D["targets"]), cupy.asarray(D["lengths"]))
    assert gpu.gram_compact.dtype == cupy.float64  # never TF32/FP16 for statistics
    g = gpu.to_numpy()
    assert np.abs(g.gram_compact - cpu.gram_compact).max() <= 1e-12 * np.abs(cpu.gram_compact).max()
    assert np.abs(g.moments - cpu.moments).max() <= 1e-12 * np.abs(cpu.moments).max()
    assert g.n_rows == cpu.n_rows and g.yy == pytest.approx(cpu.yy, rel=1e-12)


def test_group_statistics_device_gpu(tmp_path):
    from scaleattn.distributed.build import compute_statistics
    from scaleattn.generate import generate_mhla

    ds = generate_mhla(tmp_path / "d.zarr", d=3, heads=1, length=30, samples=120, causal=True, seed=1)
    cpu = compute_statistics(ds, device="cpu")
    gpu = compute_statistics(ds, device="gpu")
    assert isinstance(gpu.gram_compact, np.ndarray)  # returned on the host
    assert np.abs(gpu.gram_compact - cpu.gram_compact).max() <= 1e-12 * np.abs(cpu.gram_compact).max()


def test_model_predict_on_gpu():
    import cupy

    from scaleattn.estimator import MHLARegressor
    from scaleattn.generate import make_mhla

    D = make_mhla(d=2, heads=1, length=10, samples=64, seed=2)
    est = MHLARegressor().fit(D["tokens"], D["targets"])
    p = est.model_.predict(cupy.asarray(D["tokens"]))
    assert isinstance(p, cupy.ndarray)
    assert np.allclose(cupy.asnumpy(p), est.predict(D["tokens"]), rtol=1e-12, atol=1e-15)
