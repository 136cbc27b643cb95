"""The array code on a CUDA GPU: CuPy (and torch CUDA tensors) take the array API path of ``tests/test_array_api.py``
and must agree with numpy and with an independent dense computation. Skipped without a GPU (``.ci/gpu-check`` runs
them on one). CuPy refuses implicit conversion to numpy, so a kernel that would copy to the host fails here."""
import numpy as np
import pytest

from scaleattn._backend import device_of, have_cupy, to_numpy
from scaleattn.features import n_pairs, pair_products, phi, predict_rows, row_targets, token_features
from scaleattn.generate import make_mhla
from scaleattn.statistics._container import statistics_from_arrays
from scaleattn.statistics._kernel import gram_update

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_cupy(), reason="needs CuPy and a CUDA GPU")]
NAMES = ("Q", "K1", "K2", "V1", "V2")


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@pytest.fixture(params=["cupy", "torch"])
def put(request):
    """Host array -> the backend's array on GPU 0."""
    if request.param == "cupy":
        import cupy

        return cupy.asarray
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("torch with CUDA is not installed")
    return lambda a: torch.asarray(a, device="cuda")


def same(a, ref, like, rtol):
    """``a`` is on ``like``'s device, float64 unless ``ref`` is not, and equals ``ref`` to ``rtol`` of its largest
    entry."""
    assert type(a) is type(like) and device_of(a) == device_of(like)
    got = to_numpy(a)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert np.abs(got - ref).max() <= rtol * np.abs(ref).max()


def data(d=4, causal=True, seed=0, samples=200, length=20):
    return make_mhla(d=d, heads=2, length=length, samples=samples, causal=causal, variable_lengths=causal, seed=seed)


@pytest.mark.parametrize("causal", [False, True])
def test_features_on_gpu(put, causal):
    D = data(causal=causal)
    lens = D["lengths"] if causal else None
    s_ref, x_ref = token_features(D["tokens"], lens, causal)
    tok = put(D["tokens"])
    s, x = token_features(tok, None if lens is None else put(lens), causal)
    same(s, s_ref, tok, 1e-14)
    same(x, x_ref, tok, 1e-14)
    same(row_targets(put(D["targets"]), None if lens is None else put(lens), causal),
         row_targets(D["targets"], lens, causal), tok, 0.0)
    sh, xh = to_numpy(s), to_numpy(x)  # products of the device's own s, x: the same bits (s itself is a sum)
    I, J = np.triu_indices(sh.shape[1])
    same(pair_products(s), sh[:, I] * sh[:, J], tok, 0.0)
    same(phi(s, x), (sh[:, :, None] * xh[:, None, :]).reshape(sh.shape[0], -1), tok, 0.0)


@pytest.mark.parametrize("cols,panels", [(None, {}), (slice(7, 40), {}), (None, dict(panel_rows=300, panel_cols=5))])
def test_gram_update_on_gpu(put, cols, panels):
    D = data(d=4)
    s_np, x_np = token_features(D["tokens"], D["lengths"], True)
    mm = n_pairs(n_pairs(4))
    c0, c1, _ = (slice(0, mm) if cols is None else cols).indices(mm)
    dense = pair_products(s_np)[:, c0:c1].T @ pair_products(x_np)  # u^T v, one dense product on the host
    s = put(s_np)
    gram = gram_update(put(np.zeros((c1 - c0, n_pairs(4)))), s, put(x_np), cols, **panels)
    same(gram, dense, s, 1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_statistics_on_gpu_equal_cpu_and_dense(put, causal):
    D = data(d=4, causal=causal)
    lens = D["lengths"] if causal else None
    cpu = statistics_from_arrays(D["tokens"], D["targets"], lens, causal=causal)
    tok = put(D["tokens"])
    gpu = statistics_from_arrays(tok, put(D["targets"]), None if lens is None else put(lens), causal=causal,
                                 block_rows=1500)  # several blocks
    same(gpu.gram_compact, cpu.gram_compact, tok, 1e-12)  # float64 on the device: never TF32/FP16
    same(gpu.moments, cpu.moments, tok, 1e-12)
    assert gpu.n_rows == cpu.n_rows and gpu.yy == pytest.approx(cpu.yy, rel=1e-12)
    s, x = token_features(D["tokens"], lens, causal)
    P, y = phi(s, x), row_targets(D["targets"], lens, causal)
    host = gpu.to_numpy()
    assert isinstance(host.gram_compact, np.ndarray)
    np.testing.assert_allclose(host.gram(), P.T @ P, rtol=0, atol=1e-12 * np.abs(P.T @ P).max())
    np.testing.assert_allclose(host.moments, P.T @ y, rtol=0, atol=1e-12 * np.abs(P.T @ y).max())


def test_float32_input_accumulates_in_float64(put):
    D = data(d=3)
    t32, y32 = D["tokens"].astype(np.float32), D["targets"].astype(np.float32)
    ref = statistics_from_arrays(t32, y32, D["lengths"])
    tok = put(t32)
    gpu = statistics_from_arrays(tok, put(y32), put(D["lengths"]))
    assert to_numpy(gpu.gram_compact).dtype == np.float64
    np.testing.assert_allclose(to_numpy(gpu.gram_compact), ref.gram_compact, rtol=0,
                               atol=1e-12 * np.abs(ref.gram_compact).max())


def test_sse_certificate_and_estimator_on_gpu(put):
    from scaleattn import certify
    from scaleattn.errors import DatasetError
    from scaleattn.estimator import MHLARegressor

    D = data(d=3, samples=120)
    ref = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"])
    tok, y, lens = put(D["tokens"]), put(D["targets"]), put(D["lengths"])
    st = statistics_from_arrays(tok, y, lens)
    coef = np.random.default_rng(7).standard_normal((ref.psi, ref.d_out))
    s, x = token_features(D["tokens"], D["lengths"], True)
    r = phi(s, x) @ coef - row_targets(D["targets"], D["lengths"], True)
    assert st.sse(put(coef)) == pytest.approx(float(np.sum(r * r)), rel=1e-10)
    exact = np.linalg.eigvalsh(ref.gram())[0] / ref.n_rows  # lambda_min, independently
    c = certify(st, solver="eigh")
    assert c.verdict == "identifiable" and c.lambda_min == pytest.approx(exact, rel=1e-9)
    est_ref = MHLARegressor().fit(D["tokens"], D["targets"], D["lengths"])
    est = MHLARegressor().fit(tok, y, lens)
    np.testing.assert_allclose(est.coef_, est_ref.coef_, rtol=0, atol=1e-10 * np.abs(est_ref.coef_).max())
    want = est_ref.predict(D["tokens"], D["lengths"])
    same(est.predict(tok, lens), want, tok, 1e-12)
    same(est.predict(tok, D["lengths"]), want, tok, 1e-12)  # host lengths moved to the device
    same(predict_rows(put(coef), put(s), put(x)), phi(s, x) @ coef, tok, 1e-13)
    for use_heads in (False, True):
        same(est.model_.predict(tok, lens, use_heads=use_heads),
             est_ref.model_.predict(D["tokens"], D["lengths"], use_heads=use_heads), tok, 1e-12)
    bad = D["tokens"].copy()
    bad[5, 2, 1] = np.nan
    with pytest.raises(DatasetError, match="tokens: sample 5 contains NaN"):
        est.predict(put(bad), lens)


@pytest.mark.parametrize("causal", [False, True])
def test_tensor_attention_on_gpu(put, causal):
    from scaleattn.tensor import attention, attention_grad, logit_bound, poly_attention, poly_attention_grad

    rng = np.random.default_rng(3)
    A = {k: 0.4 * rng.standard_normal((2, 40, 4)) for k in NAMES + ("E",)}
    G = {k: put(v) for k, v in A.items()}
    for fwd, grad, kw in ((attention, attention_grad, dict(causal=causal, block_size=(16, 8, 8))),  # several blocks
                          (poly_attention, poly_attention_grad, dict(causal=causal, degree=4, block_size=16))):
        same(fwd(*(G[k] for k in NAMES), **kw), fwd(*(A[k] for k in NAMES), **kw), G["Q"], 1e-13)
        loss, g = grad(*(G[k] for k in NAMES + ("E",)), **kw)
        loss_ref, g_ref = grad(*(A[k] for k in NAMES + ("E",)), **kw)
        assert loss == pytest.approx(loss_ref, rel=1e-13)
        for k in NAMES:
            same(g[k], g_ref[k], G["Q"], 1e-12)
    assert logit_bound(G["Q"], G["K1"], G["K2"]) == pytest.approx(logit_bound(A["Q"], A["K1"], A["K2"]), rel=1e-13)


def test_tensor_dense_reference_on_gpu(put):
    """The GPU forward against a dense softmax over all (j, k) pairs, computed on the host with einsum."""
    from scaleattn.tensor import attention

    rng = np.random.default_rng(4)
    Q, K1, K2, V1, V2 = (0.5 * rng.standard_normal((12, 3)) for _ in range(5))
    logits = np.einsum("it,jt,kt->ijk", Q, K1, K2) / 3
    P = np.exp(logits - logits.max(axis=(1, 2), keepdims=True))
    P /= P.sum(axis=(1, 2), keepdims=True)
    dense = np.einsum("ijk,jt,kt->it", P, V1, V2)
    out = attention(*(put(a) for a in (Q, K1, K2, V1, V2)))
    assert np.abs(to_numpy(out) - dense).max() <= 1e-13 * np.abs(dense).max()


def test_dataset_build_on_gpu_in_process_and_on_a_cluster(tmp_path):
    """``compute_statistics(device="gpu")`` from a Zarr store: in this process and on a Dask worker (threads, the
    same GPU); returned on the host, equal to the CPU build."""
    from distributed import Client, LocalCluster

    from scaleattn.distributed.build import compute_statistics
    from scaleattn.generate import generate_mhla

    ds = generate_mhla(tmp_path / "d.zarr", d=3, heads=1, length=30, samples=120, causal=True,
                       variable_lengths=True, seed=1)
    cpu = compute_statistics(ds, device="cpu")
    gpu = compute_statistics(ds, device="gpu", group_samples=50)
    assert isinstance(gpu.gram_compact, np.ndarray)  # returned on the host
    tol = 1e-12 * np.abs(cpu.gram_compact).max()
    assert np.abs(gpu.gram_compact - cpu.gram_compact).max() <= tol
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cl, \
            Client(cl) as client:
        remote = compute_statistics(ds, client=client, device="gpu", group_samples=50)
    np.testing.assert_array_equal(remote.gram_compact, gpu.gram_compact)  # the same tree: the same bits
    assert np.abs(remote.moments - cpu.moments).max() <= 1e-12 * np.abs(cpu.moments).max()
