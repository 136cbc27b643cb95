"""The array code on a non-numpy array API namespace: every GPU code path, run in CI without a GPU.

``array_api_strict`` arrays have only the standard's functions and methods (no ``.reshape``, ``einsum``,
``out=``, out-of-bounds slices, implicit flat indexing), refuse to mix devices, and on a second simulated device
(``Device("device1")``) refuse any conversion to numpy (``np.asarray`` raises, as for a GPU array). An explicit
copy to the host (``to_numpy``'s DLPack) is refused too while a kernel runs (:func:`no_host_copies`): on a GPU
it would be a silent transfer. Each kernel runs on both devices and must return arrays on its input's device that
agree with the numpy path (exactly where the arithmetic is the same, else to 1e-14 relative) and with an
independent dense numpy computation. The solver node works on the host: what goes there (``certify``,
``Statistics.to_numpy``) says so (:func:`host_allowed`).
"""
import contextlib

import array_api_strict as xs  # a test dependency: a missing one fails here, it does not skip the file
import numpy as np
import pytest

from scaleattn._backend import array_module, get_xp, on_accelerator, to_numpy
from scaleattn.errors import DeviceMismatchError
from scaleattn.features import (
    coef_distance,
    expand_compact_gram,
    n_pairs,
    pair_products,
    phi,
    predict_rows,
    row_targets,
    token_features,
    vech,
)
from scaleattn.generate import make_mhla
from scaleattn.statistics._container import statistics_from_arrays
from scaleattn.statistics._kernel import gram_update
from scaleattn.tensor import (
    TensorWeights,
    attention,
    attention_grad,
    logit_bound,
    poly_attention,
    poly_attention_grad,
    weight_grad,
)

DEVICES = [xs.Device("CPU_DEVICE"), xs.Device("device1")]
NAMES = ("Q", "K1", "K2", "V1", "V2")


_FROM_DLPACK = np.from_dlpack


@pytest.fixture(autouse=True)
def no_host_copies(monkeypatch):
    """Code under test may not copy a strict array to numpy explicitly either (``to_numpy`` on an array API array
    other than CuPy's and torch's goes through ``np.from_dlpack``); the tests' own comparisons use :func:`host`."""
    def refuse(a, *args, **kwargs):
        if isinstance(a, xs._array_object.Array):
            raise AssertionError(f"a device array was copied to the host (np.from_dlpack) on {a.device}")
        return _FROM_DLPACK(a, *args, **kwargs)

    monkeypatch.setattr(np, "from_dlpack", refuse)


@contextlib.contextmanager
def host_allowed():
    """The steps that run on the host by design (the solver node); refused again after the block."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(np, "from_dlpack", _FROM_DLPACK)
        yield


def host(a):
    """The test's own copy of an array to numpy."""
    return _FROM_DLPACK(a) if isinstance(a, xs._array_object.Array) else to_numpy(a)


@pytest.fixture(params=DEVICES, ids=["cpu_device", "device1"])
def dev(request):
    return request.param


def put(a, dev):
    return xs.asarray(a, device=dev)


def same(a, ref, dev, rtol=0.0):
    """``a`` is a strict array on ``dev``, float64, equal to the numpy ``ref`` (to ``rtol`` of its largest entry)."""
    assert isinstance(a, xs._array_object.Array) and a.device == dev
    got = host(a)
    assert got.shape == ref.shape
    if rtol == 0.0:
        np.testing.assert_array_equal(got, ref)
    else:
        assert np.abs(got - ref).max() <= rtol * np.abs(ref).max()


def data(d=3, causal=True, seed=1):
    return make_mhla(d=d, heads=2, length=9, samples=14, causal=causal, variable_lengths=True, seed=seed)


# ---- the strict namespace catches what a GPU would -----------------------------------------------------------
def test_implicit_numpy_conversion_raises_on_a_second_device():
    """A kernel that converts to numpy implicitly fails here: the test below would catch it in any kernel."""
    def bad_kernel(x):  # the bug this file guards against: numpy applied to a device array
        return np.asarray(x) * 2.0

    x = put(np.ones((2, 3)), xs.Device("device1"))
    with pytest.raises(RuntimeError, match="NumPy"):
        bad_kernel(x)
    with pytest.raises(RuntimeError, match="NumPy"):
        np.add(np.ones(3), x)  # silent host arithmetic with a numpy operand
    with pytest.raises(AttributeError):
        x.reshape(3, 2)  # numpy-only methods do not exist


def test_device_mixing_raises(dev):
    other = DEVICES[1] if dev == DEVICES[0] else DEVICES[0]
    a, b = put(np.ones((2, 3)), dev), put(np.ones((2, 3)), other)
    with pytest.raises(DeviceMismatchError, match="different devices"):
        get_xp(a, b)
    with pytest.raises(DeviceMismatchError, match="cannot mix"):
        get_xp(np.ones(3), a)
    assert issubclass(DeviceMismatchError, TypeError)  # what the numpy/CuPy check raised before
    D = data()
    with pytest.raises(DeviceMismatchError):
        token_features(put(D["tokens"], dev), put(D["lengths"], other), causal=True)
    s, x = token_features(put(D["tokens"], dev))
    with pytest.raises(DeviceMismatchError):
        gram_update(xs.zeros((n_pairs(n_pairs(3)), n_pairs(3)), device=other), s, x)
    with pytest.raises(DeviceMismatchError):
        statistics_from_arrays(put(D["tokens"], dev), put(D["targets"], other))
    args = [put(np.ones((4, 2)), dev) for _ in NAMES]
    args[2] = put(np.ones((4, 2)), other)
    with pytest.raises(DeviceMismatchError):
        attention(*args)


def test_host_copies_are_caught(dev):
    """The guard above: a kernel that copies explicitly to the host and back fails the tests."""
    def round_trip(x):
        return xs.asarray(to_numpy(x) * 2.0, device=x.device)

    with pytest.raises(AssertionError, match="copied to the host"):
        round_trip(put(np.ones(3), dev))


def test_backend_helpers(dev):
    a = put(np.arange(6.0).reshape(2, 3), dev)
    assert get_xp(a, None, 2.0) is xs
    with host_allowed():
        np.testing.assert_array_equal(to_numpy(a), np.arange(6.0).reshape(2, 3))  # explicit copy (DLPack)
    assert array_module("cpu") is np and get_xp(np.ones(2)) is np
    # the simulated second device stands for an accelerator (device-sized blocks and panels), the CPU device not
    assert on_accelerator(a) == (dev == DEVICES[1]) and not on_accelerator(np.ones(2))


def test_kernel_choice_by_namespace():
    """numpy itself and array_api_compat's wrapper of it (what ``get_xp`` returns on numpy < 2.1) get the compiled
    kernel; any other namespace the array path."""
    import array_api_compat

    from scaleattn.statistics._kernel import kernel_name

    wrapper = array_api_compat.array_namespace(np.empty(0))
    assert wrapper is not np
    assert kernel_name(np, "numba") == kernel_name(wrapper, "numba") == "numba"
    assert kernel_name(xs, "numba") == "numpy"


# ---- features --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_token_features_and_targets(dev, causal, with_lengths):
    D = data(causal=causal)
    lens = D["lengths"] if with_lengths else None
    s_ref, x_ref = token_features(D["tokens"], lens, causal)
    s, x = token_features(put(D["tokens"], dev), None if lens is None else put(lens, dev), causal)
    same(s, s_ref, dev)
    same(x, x_ref, dev)
    if with_lengths:  # host lengths are moved to the tokens' device
        s2, _ = token_features(put(D["tokens"], dev), lens, causal)
        same(s2, s_ref, dev)
    same(row_targets(put(D["targets"], dev), None if lens is None else put(lens, dev), causal),
         row_targets(D["targets"], lens, causal), dev)
    if not causal and not with_lengths:  # against the definition: vech(Z^T Z) and the last token
        Z = D["tokens"]
        same(s, vech(np.einsum("ntd,nte->nde", Z, Z)), dev, rtol=1e-14)
        same(x, Z[:, -1], dev)


def test_token_features_float32_input_is_float64(dev):
    D = data()
    s, x = token_features(put(D["tokens"].astype(np.float32), dev), put(D["lengths"], dev), True)
    assert s.dtype == xs.float64 and x.dtype == xs.float64
    same(s, token_features(D["tokens"].astype(np.float32), D["lengths"], True)[0], dev)


def test_pair_products_vech_phi(dev):
    rng = np.random.default_rng(2)
    S = rng.standard_normal((7, 6))
    I, J = np.triu_indices(6)
    dense = S[:, I] * S[:, J]  # u = vech(s s^T), independently
    same(pair_products(put(S, dev)), dense, dev)
    same(pair_products(put(S, dev), slice(4, 13)), dense[:, 4:13], dev)
    buf = xs.zeros((9, 20), dtype=xs.float64, device=dev)
    same(pair_products(put(S, dev), slice(3, 11), out=buf), dense[:, 3:11], dev)
    M = rng.standard_normal((5, 4, 4))
    I4, J4 = np.triu_indices(4)
    same(vech(put(M, dev)), M[:, I4, J4], dev)
    X = rng.standard_normal((7, 3))
    same(phi(put(S, dev), put(X, dev)), (S[:, :, None] * X[:, None, :]).reshape(7, -1), dev)


# ---- the Gram kernel and the statistics -----------------------------------------------------------------------
@pytest.mark.parametrize("cols", [None, slice(5, 19)])
def test_gram_update(dev, cols):
    D = data(d=3)
    s_np, x_np = token_features(D["tokens"], D["lengths"], True)
    mm, dd = n_pairs(n_pairs(3)), n_pairs(3)
    c0, c1, _ = (slice(0, mm) if cols is None else cols).indices(mm)
    ref = gram_update(np.zeros((c1 - c0, dd)), s_np, x_np, cols, panel_rows=16, panel_cols=4)
    dense = pair_products(s_np)[:, c0:c1].T @ pair_products(x_np)  # u^T v, one GEMM
    s, x = put(s_np, dev), put(x_np, dev)
    gram = xs.zeros((c1 - c0, dd), dtype=xs.float64, device=dev)
    out = gram_update(gram, s, x, cols, panel_rows=16, panel_cols=4)  # several row and column panels
    assert out is gram
    same(gram, ref, dev, rtol=1e-14)
    same(gram, dense, dev, rtol=1e-14)


@pytest.mark.parametrize("panel_bytes", [1, 8 * 7 * 40, None])
def test_gram_update_device_panels(dev, monkeypatch, panel_bytes):
    """Panels of ``DEVICE_PANEL_BYTES`` (one column, 7 of 55, all) on the accelerator and the host's panels on the
    CPU device, a column tile cutting pair rows, and no rows at all: ``u^T v`` of the dense pair products."""
    import scaleattn.statistics._kernel as kernel

    if panel_bytes is not None:
        monkeypatch.setattr(kernel, "DEVICE_PANEL_BYTES", panel_bytes)
    s_np, x_np = token_features(data(d=4)["tokens"], None, False)  # 14 rows; m = 10, so 55 pair products
    s_np = np.concatenate([s_np] * 3)  # 42 rows
    x_np = np.concatenate([x_np] * 3)
    for cols in (None, slice(12, 49)):
        c0, c1, _ = (slice(0, 55) if cols is None else cols).indices(55)
        dense = pair_products(s_np)[:, c0:c1].T @ pair_products(x_np)
        got = gram_update(xs.zeros((c1 - c0, 10), dtype=xs.float64, device=dev), put(s_np, dev), put(x_np, dev), cols)
        same(got, dense, dev, rtol=1e-14)
    empty = gram_update(xs.zeros((55, 10), dtype=xs.float64, device=dev), put(s_np[:0], dev), put(x_np[:0], dev))
    same(empty, np.zeros((55, 10)), dev)


def test_statistics_of_blocks_without_rows(dev):
    """A causal block whose samples all have length 0 adds nothing (the moments' reshape of 0 rows too)."""
    D = data(d=3)
    lens = D["lengths"].copy()
    lens[:5] = 0
    ref = statistics_from_arrays(D["tokens"], D["targets"], lens, block_rows=9)
    st = statistics_from_arrays(put(D["tokens"], dev), put(D["targets"], dev), put(lens, dev), block_rows=9)
    assert st.n_rows == ref.n_rows == int(lens.sum())
    same(st.gram_compact, ref.gram_compact, dev, rtol=1e-14)
    same(st.moments, ref.moments, dev, rtol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_statistics_accumulation(dev, causal):
    D = data(d=3, causal=causal)
    ref = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"], block_rows=40)
    st = statistics_from_arrays(put(D["tokens"], dev), put(D["targets"], dev), put(D["lengths"], dev),
                                block_rows=40)  # several blocks
    assert st.gram_compact.dtype == xs.float64 and st.moments.dtype == xs.float64  # always float64
    same(st.gram_compact, ref.gram_compact, dev, rtol=1e-14)
    same(st.moments, ref.moments, dev, rtol=1e-14)
    assert st.yy == pytest.approx(ref.yy, rel=1e-14) and st.n_rows == ref.n_rows
    # against the dense features: G = phi^T phi, B = phi^T y
    s, x = token_features(D["tokens"], D["lengths"], causal)
    P, y = phi(s, x), row_targets(D["targets"], D["lengths"], causal)
    same(expand_compact_gram(st.gram_compact, 3), P.T @ P, dev, rtol=1e-13)
    same(st.moments, P.T @ y, dev, rtol=1e-13)
    with host_allowed():
        on_host = st.to_numpy()
    assert isinstance(on_host.gram_compact, np.ndarray) and (on_host + ref).n_rows == 2 * ref.n_rows


def test_statistics_float32_input(dev):
    D = data(d=2)
    t32, y32 = D["tokens"].astype(np.float32), D["targets"].astype(np.float32)
    st = statistics_from_arrays(put(t32, dev), put(y32, dev), put(D["lengths"], dev))
    ref = statistics_from_arrays(t32, y32, D["lengths"])
    assert st.gram_compact.dtype == xs.float64
    same(st.gram_compact, ref.gram_compact, dev, rtol=1e-14)


@pytest.mark.parametrize("cols", [None, (3, 9)])
def test_dask_task_moves_chunks_to_the_device(tmp_path, monkeypatch, cols):
    """A statistics task of the Dask build (``group_statistics``) with the worker's namespace replaced by the strict
    one (CuPy on a GPU worker): the chunks it reads go to the device, the partial is built there in float64 (also
    a column tile), and equals the host task's."""
    import scaleattn.distributed.build as build
    from scaleattn.generate import generate_mhla
    from scaleattn.statistics._container import Statistics

    ds = generate_mhla(str(tmp_path / "d.zarr"), d=3, heads=1, length=10, samples=40, causal=True,
                       variable_lengths=True, seed=1)
    ref = build.group_statistics(ds, 0, 40, device="cpu", cols=cols)
    monkeypatch.setattr(build, "array_module", lambda device="auto": xs)
    monkeypatch.setattr(Statistics, "to_numpy", lambda self: self)  # keep the partial on the device to check it
    st = build.group_statistics(ds, 0, 40, device="cpu", cols=cols)
    for a, b in ((st.gram_compact, ref.gram_compact), (st.moments, ref.moments)):
        assert a.dtype == xs.float64
        same(a, b, xs.Device("CPU_DEVICE"), rtol=1e-14)
    assert st.n_rows == ref.n_rows and st.yy == pytest.approx(ref.yy, rel=1e-14)


def test_sse_on_the_device(dev):
    """``Statistics.sse`` and ``sse_floor`` of device statistics (host or device coefficients) against the numpy
    statistics and a dense residual."""
    D = data(d=3)
    ref = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"])
    st = statistics_from_arrays(put(D["tokens"], dev), put(D["targets"], dev), put(D["lengths"], dev))
    coef = np.random.default_rng(7).standard_normal((ref.psi, ref.d_out))
    s, x = token_features(D["tokens"], D["lengths"], True)
    r = phi(s, x) @ coef - row_targets(D["targets"], D["lengths"], True)
    for c in (coef, put(coef, dev)):
        assert st.sse(c) == pytest.approx(ref.sse(coef), rel=1e-12)
        assert st.sse(c) == pytest.approx(float(np.sum(r * r)), rel=1e-10)
        assert st.sse_floor(c) == pytest.approx(ref.sse_floor(coef), rel=1e-13)


def test_certify_device_statistics(dev):
    """The certificate of device statistics on every solver path (the solver node works on the host)."""
    from scaleattn import certify

    D = data(d=3)
    ref_st = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"])
    st = statistics_from_arrays(put(D["tokens"], dev), put(D["targets"], dev), put(D["lengths"], dev))
    exact = np.linalg.eigvalsh(ref_st.gram())[0] / ref_st.n_rows  # lambda_min of Lambda_D, independently
    for solver, rtol in (("eigh", 1e-9), ("cholesky", 1e-5), ("krylov", 1e-2)):  # each path's own accuracy
        with host_allowed():
            c = certify(st, solver=solver)
        c_ref = certify(ref_st, solver=solver)
        assert c.verdict == c_ref.verdict == "identifiable"
        assert c.lambda_min == pytest.approx(c_ref.lambda_min, rel=1e-12)
        assert c.lambda_min == pytest.approx(exact, rel=rtol)


def test_expand_compact_gram(dev):
    rng = np.random.default_rng(3)
    Tc = rng.standard_normal((n_pairs(n_pairs(3)), n_pairs(3)))
    same(expand_compact_gram(put(Tc, dev), 3), expand_compact_gram(Tc, 3), dev)


# ---- prediction ------------------------------------------------------------------------------------------------
def test_predict_rows_and_model_predict(dev):
    from scaleattn.estimator import MHLARegressor

    D = data(d=3, causal=True)
    rng = np.random.default_rng(4)
    s_np, x_np = token_features(D["tokens"], D["lengths"], True)
    coef = rng.standard_normal((n_pairs(3) * 3, 2))
    ref = phi(s_np, x_np) @ coef  # independent: the dense features
    got = predict_rows(put(coef, dev), put(s_np, dev), put(x_np, dev))
    same(got, predict_rows(coef, s_np, x_np), dev, rtol=1e-14)
    same(got, ref, dev, rtol=1e-14)
    assert coef_distance(put(coef, dev), put(coef + 1.0, dev)) == pytest.approx(np.sqrt(coef.size), rel=1e-14)
    model = MHLARegressor().fit(D["tokens"], D["targets"], lengths=D["lengths"]).model_
    for use_heads in (False, True):
        p = model.predict(put(D["tokens"], dev), put(D["lengths"], dev), use_heads=use_heads)
        same(p, model.predict(D["tokens"], D["lengths"], use_heads=use_heads), dev, rtol=1e-13)


def test_estimator_on_the_device(dev):
    """``MHLARegressor`` on device arrays: statistics built on the device, the solve on the host, predictions in
    the tokens' namespace and on their device, equal to the numpy estimator's; bad values and lengths refused on
    the device, naming the sample."""
    from scaleattn.errors import DatasetError
    from scaleattn.estimator import MHLARegressor

    D = data(d=3, causal=True)
    ref = MHLARegressor().fit(D["tokens"], D["targets"], D["lengths"])
    with host_allowed():
        est = MHLARegressor().fit(put(D["tokens"], dev), put(D["targets"], dev), put(D["lengths"], dev))
    np.testing.assert_allclose(est.coef_, ref.coef_, rtol=0, atol=1e-10 * np.abs(ref.coef_).max())
    want = ref.predict(D["tokens"], D["lengths"])
    same(est.predict(put(D["tokens"], dev), put(D["lengths"], dev)), want, dev, rtol=1e-12)
    same(est.predict(put(D["tokens"], dev), D["lengths"]), want, dev, rtol=1e-12)  # host lengths moved there
    assert est.score(put(D["tokens"], dev), put(D["targets"], dev), put(D["lengths"], dev)) == pytest.approx(
        ref.score(D["tokens"], D["targets"], D["lengths"]), abs=1e-12)
    bad = D["tokens"].copy()
    bad[5, 2, 1] = np.nan
    with pytest.raises(DatasetError, match="tokens: sample 5 contains NaN"):
        est.predict(put(bad, dev), put(D["lengths"], dev))
    bad[5, 2, 1] = 1e200
    with pytest.raises(DatasetError, match="tokens: sample 5 has a value of magnitude 1.0e"):
        MHLARegressor().fit(put(bad, dev), put(D["targets"], dev), put(D["lengths"], dev))
    lens = D["lengths"].copy()
    lens[4] = D["tokens"].shape[1] + 1
    with pytest.raises(DatasetError, match="lengths: sample 4 has length 10"):
        est.predict(put(D["tokens"], dev), put(lens, dev))


# ---- tensor attention ------------------------------------------------------------------------------------------
def tensor_inputs(seed=0, shape=(2, 9, 3)):
    rng = np.random.default_rng(seed)
    return {k: 0.5 * rng.standard_normal(shape) for k in NAMES + ("E",)}


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (3, 4))])
def test_tensor_attention_exact(dev, causal, window):
    A = tensor_inputs()
    S = {k: put(v, dev) for k, v in A.items()}
    kw = dict(causal=causal, window=window, block_size=(4, 3, 5))  # several blocks, partial masks
    same(attention(*(S[k] for k in NAMES), **kw), attention(*(A[k] for k in NAMES), **kw), dev, rtol=1e-14)
    loss, g = attention_grad(*(S[k] for k in NAMES + ("E",)), **kw)
    loss_ref, g_ref = attention_grad(*(A[k] for k in NAMES + ("E",)), **kw)
    assert loss == pytest.approx(loss_ref, rel=1e-14)
    for k in NAMES:
        same(g[k], g_ref[k], dev, rtol=1e-14)


def test_tensor_attention_dense_reference(dev):
    """The strict forward against a dense numpy softmax over all (j, k) pairs (independent of the streaming)."""
    A = tensor_inputs(shape=(5, 2))
    Q, K1, K2, V1, V2 = (A[k] for k in NAMES)
    logits = np.einsum("it,jt,kt->ijk", Q, K1, K2) / 2
    P = np.exp(logits - logits.max(axis=(1, 2), keepdims=True))
    P /= P.sum(axis=(1, 2), keepdims=True)
    dense = np.einsum("ijk,jt,kt->it", P, V1, V2)
    same(attention(*(put(A[k], dev) for k in NAMES)), dense, dev, rtol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_tensor_poly_path(dev, causal):
    A = tensor_inputs(seed=5)
    S = {k: put(v, dev) for k, v in A.items()}
    kw = dict(causal=causal, degree=4, block_size=4)
    info = {}
    same(poly_attention(*(S[k] for k in NAMES), info=info, **kw), poly_attention(*(A[k] for k in NAMES), **kw),
         dev, rtol=1e-14)
    assert info["path"] == "poly"
    loss, g = poly_attention_grad(*(S[k] for k in NAMES + ("E",)), **kw)
    loss_ref, g_ref = poly_attention_grad(*(A[k] for k in NAMES + ("E",)), **kw)
    assert loss == pytest.approx(loss_ref, rel=1e-14)
    for k in NAMES:
        same(g[k], g_ref[k], dev, rtol=1e-14)
    for method in ("cheap", "exact"):
        assert logit_bound(S["Q"], S["K1"], S["K2"], method=method) == pytest.approx(
            logit_bound(A["Q"], A["K1"], A["K2"], method=method), rel=1e-14)


@pytest.mark.parametrize("path,causal", [("exact", False), ("exact", True), ("poly", False), ("poly", True)])
def test_tensor_weight_gradients(dev, path, causal):
    """The weight and X gradients ([C25] parameters; the exact and poly backward with their grad_X terms)."""
    rng = np.random.default_rng(6)
    A = [0.5 * rng.standard_normal((2, 7, 3)) for _ in range(5)]
    E = rng.standard_normal((2, 7, 2))
    W = TensorWeights.random(3, 2, seed=1)
    kw = dict(causal=causal, path=path, degree=4) if path == "poly" else dict(causal=causal, path=path)
    loss, g = weight_grad(*(put(a, dev) for a in A), W, put(E, dev), **kw)  # host weights, device data
    loss_ref, g_ref = weight_grad(*A, W, E, **kw)
    assert loss == pytest.approx(loss_ref, rel=1e-14)
    assert set(g) == set(g_ref)
    for k in g:
        same(g[k], g_ref[k], dev, rtol=1e-13)


def test_tensor_float32_output_dtype(dev):
    A = tensor_inputs()
    out = attention(*(put(A[k].astype(np.float32), dev) for k in NAMES))
    assert out.dtype == xs.float32 and out.device == dev


# ---- torch tensors (CPU) through array_api_compat ----------------------------------------------------------------
@pytest.mark.slow  # importing torch takes ~2 s; the kernels themselves run in ~0.3 s
def test_torch_tensors_take_the_same_path():
    torch = pytest.importorskip("torch")
    D = data(d=3)
    ref = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"])
    st = statistics_from_arrays(*(torch.asarray(D[k]) for k in ("tokens", "targets", "lengths")))
    assert isinstance(st.gram_compact, torch.Tensor) and st.gram_compact.dtype == torch.float64
    assert not on_accelerator(st.gram_compact)  # a CPU tensor keeps the host's block and panel sizes
    g = to_numpy(st.gram_compact)
    assert np.abs(g - ref.gram_compact).max() <= 1e-14 * np.abs(ref.gram_compact).max()
    A = tensor_inputs()
    out = attention(*(torch.asarray(A[k]) for k in NAMES), causal=True)
    ref_o = attention(*(A[k] for k in NAMES), causal=True)
    assert np.abs(to_numpy(out) - ref_o).max() <= 1e-14 * np.abs(ref_o).max()


# ---- the streaming path: passes over device rows, K-FAC, the krylov driver, the dual -----------------------------
@contextlib.contextmanager
def host_copies():
    """Like :func:`host_allowed`, recording the shape of every device array copied to the host: the streaming path
    may copy per-column numbers and projected problems every pass, but psi-sized arrays only a fixed number of
    times per solve (its results, the per-feature flags, the small dense eigenproblem's eigenvalues)."""
    shapes = []

    def record(a, *args, **kwargs):
        if isinstance(a, xs._array_object.Array):
            shapes.append(tuple(a.shape))
        return _FROM_DLPACK(a, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(np, "from_dlpack", record)
        yield shapes


def check_copies(shapes, psi, n_rows, most=10):
    """No copy has the rows' length; a copy with an axis of psi or more is one of at most ``most`` (a fit on
    singular data: the coefficients, the null basis, the per-feature flags, diag G and three products ``G n`` of
    the host's min-norm step, the dense null eigenproblem's eigenvalues and residuals: 9)."""
    assert all(n_rows not in s for s in shapes), shapes
    big = [s for s in shapes if max(s, default=0) >= psi]
    assert len(big) <= most, big


def stream_data(case, seed=11):
    """Tokens, targets, lengths, causal: d = 4 (psi 40, so LOBPCG and the preconditioned Lanczos run, not the
    small dense eigenproblem), several blocks of rows."""
    rng = np.random.default_rng(seed)
    if case == "causal lengths":
        return rng.standard_normal((70, 6, 4)), rng.standard_normal((70, 6, 2)), rng.integers(1, 7, 70), True
    if case == "last token":
        return rng.standard_normal((130, 5, 4)), rng.standard_normal((130, 1)), rng.integers(1, 6, 130), False
    Q = np.linalg.qr(rng.standard_normal((4, 4)))[0][:, :3]  # tokens in a 3-dim subspace: G singular
    return rng.standard_normal((60, 6, 3)) @ Q.T, rng.standard_normal((60, 6, 2)), None, True


def explicit(tok, y, lens, causal):
    s, x = token_features(tok, lens, causal)
    return phi(s, x), row_targets(y, lens, causal)


def rel(a, b):
    return float(np.abs(a - b).max()) / float(np.abs(b).max())


@pytest.mark.parametrize("causal", [False, True])
def test_stream_operator_sweep_and_matmat(dev, causal):
    """The first sweep (diag G, the K-FAC sums, the moments) and a pass ``G W`` on device rows: on the rows' device,
    equal to the numpy operator's and to the dense ``phi^T phi W`` of the explicit features."""
    from scaleattn.linalg._stream import StreamOperator, rows_from_arrays

    tok, y, lens, _ = stream_data("causal lengths")
    yc = y if causal else y[:, -1]
    F, Y = explicit(tok, yc, lens, causal)
    s, x = token_features(tok, lens, causal)
    src = rows_from_arrays(put(tok, dev), put(yc, dev), put(lens, dev), causal, block_rows=40)  # several blocks
    op, ref = StreamOperator(src), StreamOperator(rows_from_arrays(tok, yc, lens, causal, block_rows=40))
    assert op.n_rows == ref.n_rows == F.shape[0]
    for got, want, dense in ((op.diagonal(), ref.diagonal(), np.sum(F * F, axis=0)), (op.A, ref.A, s.T @ s),
                             (op.B, ref.B, x.T @ x), (op.moments, ref.moments, F.T @ Y)):
        same(got, want, dev, rtol=1e-14)
        same(got, dense, dev, rtol=1e-13)
    assert op.yy == pytest.approx(float(np.sum(Y * Y)), rel=1e-13)
    W = np.random.default_rng(5).standard_normal((F.shape[1], 3))
    same(op.matmat(put(W, dev)), ref.matmat(W), dev, rtol=1e-14)
    same(op @ put(W, dev), F.T @ (F @ W), dev, rtol=1e-13)
    same(op.matmat(W), F.T @ (F @ W), dev, rtol=1e-13)  # a host block is moved to the rows' device
    assert op.passes == 3
    assert op.residual_sse(W[:, :2]) == pytest.approx(float(np.sum((Y - F @ W[:, :2]) ** 2)), rel=1e-12)


def test_kfac_and_jacobi_on_the_device(dev):
    """K-FAC from device factors: ``M^-1`` against the inverse of the dense ``kron(A, B) / N``, its scaled form, its
    halves (``L L^T = M``) and its eigenvalue bound against numpy's; Jacobi against ``1 / diag``."""
    from scaleattn.linalg._stream import KFAC, Jacobi

    s, x = token_features(np.random.default_rng(2).standard_normal((300, 4, 3)))
    F = phi(s, x)
    A, B, dg, N = s.T @ s, x.T @ x, np.sum(F * F, axis=0), 300
    M, Mr = KFAC(put(A, dev), put(B, dev), put(dg, dev), N), KFAC(A, B, dg, N)
    Mdense = np.kron(A, B) / N
    R = np.random.default_rng(3).standard_normal((F.shape[1], 2))
    same(M.apply(put(R, dev)), np.linalg.inv(Mdense) @ R, dev, rtol=1e-10)
    same(M.apply(put(R, dev)), Mr.apply(R), dev, rtol=1e-14)
    same(M.apply_scaled(put(R, dev)), np.sqrt(dg)[:, None] * (np.linalg.inv(Mdense) @ (np.sqrt(dg)[:, None] * R)),
         dev, rtol=1e-10)
    L = host(M.half(put(np.eye(F.shape[1]), dev)))
    np.testing.assert_allclose(L @ L.T, Mdense, rtol=0, atol=1e-10 * np.abs(Mdense).max())
    same(M.half_inverse(put(L @ R, dev)), R, dev, rtol=1e-10)
    same(M.half_inverse(put(R, dev), transpose=True), np.linalg.solve(L.T, R), dev, rtol=1e-10)
    low_s, low = M.min_eigenvalues()
    assert (low_s, low) == pytest.approx(Mr.min_eigenvalues(), rel=1e-12)
    assert 0 < low <= np.linalg.eigvalsh(Mdense)[0] * (1 + 1e-12)
    J = Jacobi(put(dg, dev), N)
    same(J.apply(put(R, dev)), R / dg[:, None], dev, rtol=1e-14)
    same(J.half(J.half_inverse(put(R, dev))), R, dev, rtol=1e-14)


def test_trace_kfac_on_the_device(dev):
    """The krylov path's K-FAC from partial traces, on device factors: exact on a Kronecker Gram (``M^-1 G = I``)."""
    from scaleattn.linalg._kfac import TraceKFAC

    rng = np.random.default_rng(0)
    G = np.kron(np.cov(rng.standard_normal((3, 9))), np.cov(rng.standard_normal((2, 9))))
    s = 1 / np.sqrt(np.diag(G))
    G4 = (G * s[:, None] * s[None, :]).reshape(3, 2, 3, 2)
    At, Bt = np.einsum("plql->pq", G4), np.einsum("plpk->lk", G4)
    M = TraceKFAC(put(At, dev), put(Bt, dev), put(np.diag(G), dev))
    same(M.apply(put(G, dev)), np.eye(6), dev, rtol=1e-12)
    same(M.apply(put(G, dev)), TraceKFAC(At, Bt, np.diag(G)).apply(G), dev, rtol=1e-14)


@pytest.mark.parametrize("case", ["causal lengths", "last token", "rank-deficient"])
def test_stream_solve_on_the_device(dev, case):
    """``stream_solve`` on device rows (fit and certificate): numpy coefficients equal to the numpy path's and to
    lstsq on the explicit features (min-norm on singular data), the same verdict, rank and eigenvalues; the vectors
    stay on the device (only a fixed number of psi-sized copies, whatever the passes)."""
    from scaleattn.linalg._stream import rows_from_arrays, stream_solve

    tok, y, lens, causal = stream_data(case)
    F, Y = explicit(tok, y, lens, causal)
    ref = stream_solve(rows_from_arrays(tok, y, lens, causal, block_rows=64))
    with host_copies() as shapes:
        sol = stream_solve(rows_from_arrays(put(tok, dev), put(y, dev), None if lens is None else put(lens, dev),
                                            causal, block_rows=64))
    assert isinstance(sol.coef, np.ndarray) and isinstance(sol.null_basis, np.ndarray)  # a host-side solution
    assert sol.passes > 20 and sol.converged.all()
    check_copies(shapes, F.shape[1], F.shape[0])
    assert rel(sol.coef, ref.coef) <= 1e-12
    assert rel(sol.coef, np.linalg.lstsq(F, Y, rcond=None)[0]) <= 1e-8
    rank = np.linalg.matrix_rank(F)
    c, c_ref = sol.certificate, ref.certificate
    assert sol.rank == ref.rank == rank and c.verdict == c_ref.verdict
    assert c.verdict == ("identifiable" if rank == F.shape[1] else "not identifiable")
    assert sol.sse == pytest.approx(float(np.sum((Y - F @ sol.coef) ** 2)), rel=1e-9)
    lam = np.linalg.eigvalsh(F.T @ F / F.shape[0])
    assert c.lambda_max == pytest.approx(c_ref.lambda_max, rel=1e-10)
    assert c.lambda_max == pytest.approx(lam[-1], rel=1e-6)
    if rank == F.shape[1]:  # the interval holds the truth (the runs end with the solve: its width depends on when)
        lo, hi = c.estimates["lambda_min"]["lower"], c.estimates["lambda_min"]["upper"]
        assert lo * (1 - 1e-9) <= lam[0] <= hi * (1 + 1e-9) and hi <= 1.1 * lam[0]
        kw = c.estimates["lambda_min_lower_probabilistic"]
        assert 0 < kw["lower"] <= lam[0]
    else:
        assert np.abs(F @ sol.null_basis).max() <= 1e-6 * np.abs(F).max()
    if case == "causal lengths":  # (the certificate alone on the two others: this test's time)
        return
    with host_copies() as shapes:
        cert = stream_solve(rows_from_arrays(put(tok, dev), None, None if lens is None else put(lens, dev), causal,
                                             block_rows=64), certify_only=True)
    check_copies(shapes, F.shape[1], F.shape[0], most=3)
    assert cert.verdict == c.verdict and cert.rank == rank


def test_stream_solve_jacobi_on_the_device(dev):
    """The diagonal preconditioner in K-FAC's interface on device rows: lstsq's answer, copies as K-FAC's."""
    from scaleattn.linalg._stream import rows_from_arrays, stream_solve

    tok, y, lens, causal = stream_data("causal lengths", seed=4)
    F, Y = explicit(tok, y, lens, causal)
    with host_copies() as shapes:
        sol = stream_solve(rows_from_arrays(put(tok, dev), put(y, dev), put(lens, dev), causal),
                           preconditioner="jacobi")
    check_copies(shapes, F.shape[1], F.shape[0])
    assert sol.certificate.estimates["preconditioner"] == "jacobi"
    assert rel(sol.coef, np.linalg.lstsq(F, Y, rcond=None)[0]) <= 1e-8


def test_dual_solve_on_the_device(dev):
    """Fewer rows than features: the dual on device rows equals the numpy dual and the min-norm lstsq; the witness
    is a null direction; the certificate alone says not identifiable with rank N."""
    from scaleattn.linalg._stream import dual_solve, rows_from_arrays

    rng = np.random.default_rng(6)
    tok, y, lens = rng.standard_normal((20, 5, 4)), rng.standard_normal((20, 5, 2)), rng.integers(1, 3, 20)
    F, Y = explicit(tok, y, lens, True)
    assert F.shape[0] < F.shape[1]
    ref = dual_solve(rows_from_arrays(tok, y, lens, True))
    with host_copies() as shapes:
        sol = dual_solve(rows_from_arrays(put(tok, dev), put(y, dev), put(lens, dev), True))
        cert = dual_solve(rows_from_arrays(put(tok, dev), None, put(lens, dev), True), certify_only=True)
    check_copies(shapes, F.shape[1], F.shape[0] + 1, most=2)
    assert isinstance(sol.coef, np.ndarray)
    assert rel(sol.coef, ref.coef) <= 1e-10
    assert rel(sol.coef, np.linalg.lstsq(F, Y, rcond=None)[0]) <= 1e-8
    assert sol.rank == cert.rank == np.linalg.matrix_rank(F) == F.shape[0]
    assert sol.certificate.verdict == cert.verdict == "not identifiable"
    assert np.abs(F @ sol.null_basis).max() <= 1e-8 * np.abs(F).max() and np.linalg.norm(sol.null_basis) == \
        pytest.approx(1.0)


def test_kw_lower_bound_on_the_device(dev):
    """The probabilistic lower bound's own Lanczos run on device rows: the numpy run's numbers, below the true
    lambda_min(G); its basis stays on the device (only the tridiagonal's numbers cross)."""
    from scaleattn.linalg._stream import KFAC, StreamOperator, kw_lower_bound, rows_from_arrays

    tok, y, lens, causal = stream_data("causal lengths")
    F, _ = explicit(tok, y, lens, causal)
    op = StreamOperator(rows_from_arrays(put(tok, dev), None, put(lens, dev), causal))
    ref_op = StreamOperator(rows_from_arrays(tok, None, lens, causal))
    with host_copies() as shapes:
        kw = kw_lower_bound(op, KFAC(op.A, op.B, op.diagonal(), op.n_rows), maxiter=40)
    ref = kw_lower_bound(ref_op, KFAC(ref_op.A, ref_op.B, ref_op.diagonal(), ref_op.n_rows), maxiter=40)
    assert shapes == []
    assert kw["steps"] == ref["steps"] and kw["lower"] == pytest.approx(ref["lower"], rel=1e-9)
    assert 0 < kw["lower"] <= np.linalg.eigvalsh(F.T @ F)[0] and not kw["rigorous"]


@pytest.mark.parametrize("samples", [80, 12])  # the stream path, and the dual (fewer rows than features)
def test_estimator_stream_solver_on_the_device(dev, samples):
    """``MHLARegressor(solver="stream")`` on device arrays: the numpy estimator's coefficients and path; predictions
    on the device."""
    from scaleattn.estimator import MHLARegressor

    rng = np.random.default_rng(8)
    tok, y, lens = rng.standard_normal((samples, 6, 3)), rng.standard_normal((samples, 6, 2)), None
    causal = samples > 20
    if not causal:
        y = y[:, -1]
    else:
        lens = rng.integers(1, 7, samples)
    ref = MHLARegressor(solver="stream").fit(tok, y, lens)  # causal: targets (n, T, d_out)
    with host_copies() as shapes:
        est = MHLARegressor(solver="stream").fit(put(tok, dev), put(y, dev), None if lens is None else put(lens, dev))
    F, Y = explicit(tok, y, lens, causal)
    check_copies(shapes, F.shape[1], F.shape[0])
    assert tok.shape[0] not in [n for s in shapes for n in s]  # nor one per sample (the lengths are summed there)
    assert est.path_["path"] == ref.path_["path"] == ("stream" if causal else "dual")
    assert rel(est.coef_, ref.coef_) <= 1e-10
    assert rel(est.coef_, np.linalg.lstsq(F, Y, rcond=None)[0]) <= 1e-8
    same(est.predict(put(tok, dev), None if lens is None else put(lens, dev)), ref.predict(tok, lens), dev,
         rtol=1e-9)
