"""Scale and speed (issue 3): the blocked Gram kernel, the large-psi solver path and the memory estimate."""
import numpy as np
import pytest

from scaleattn import solver
from scaleattn.certificate import certify
from scaleattn.distributed.memory import InsufficientMemoryError, check_fit_memory, fit_memory, parse_bytes
from scaleattn.features import compact_factors, phi, row_targets, token_features
from scaleattn.generate import make_mhla
from scaleattn.kernel import gram_update
from scaleattn.statistics import statistics_from_arrays


@pytest.fixture(scope="module")
def data():
    return make_mhla(d=4, heads=2, length=12, samples=60, causal=True, noise=0.05, seed=3)


def _dense_reference(D):
    s, x = token_features(D["tokens"], None, True)
    f = phi(s, x)
    y = row_targets(D["targets"], None, True)
    return f.T @ f, f.T @ y, s, x


def test_statistics_do_not_depend_on_block_or_panel_sizes(data):
    G_ref, B_ref, _, _ = _dense_reference(data)
    base = statistics_from_arrays(data["tokens"], data["targets"])
    assert np.allclose(base.gram(), G_ref, rtol=1e-12, atol=1e-12 * np.abs(G_ref).max())
    assert np.allclose(base.moments, B_ref, rtol=1e-12, atol=1e-12 * np.abs(B_ref).max())
    scale = np.abs(base.gram_compact).max()
    for block_rows in (1, 7, 100, 5000):
        st = statistics_from_arrays(data["tokens"], data["targets"], block_rows=block_rows)
        assert np.abs(st.gram_compact - base.gram_compact).max() <= 1e-12 * scale
        assert np.abs(st.moments - base.moments).max() <= 1e-12 * np.abs(base.moments).max()
        assert st.n_rows == base.n_rows and st.yy == pytest.approx(base.yy, rel=1e-12)


@pytest.mark.parametrize("panel_rows,panel_cols,threads", [(1, 1, 1), (5, 7, 2), (64, 13, 3), (4096, 4096, 1)])
def test_gram_kernel_matches_dense_product(panel_rows, panel_cols, threads):
    rng = np.random.default_rng(0)
    s, x = rng.standard_normal((70, 10)), rng.standard_normal((70, 4))
    u, v = compact_factors(s, x)
    ref = u.T @ v
    out = gram_update(np.zeros_like(ref), s, x, threads=threads, panel_rows=panel_rows, panel_cols=panel_cols)
    assert np.allclose(out, ref, rtol=1e-13, atol=1e-13 * np.abs(ref).max())
    # a column tile (DESIGN §6) accumulates the same rows of Tc, on top of what is there
    tile = gram_update(np.ones((20, ref.shape[1])), s, x, slice(17, 37), threads=threads, panel_rows=panel_rows,
                       panel_cols=panel_cols)
    assert np.allclose(tile - 1, ref[17:37], rtol=1e-13, atol=1e-13 * np.abs(ref).max())
    with pytest.raises(ValueError, match="rows"):
        gram_update(np.zeros((5, ref.shape[1])), s, x, slice(0, 6))


@pytest.fixture
def threaded(monkeypatch):
    """Let the kernel use threads even on the tests' small inputs."""
    import scaleattn.kernel as st

    monkeypatch.setattr(st, "MIN_THREAD_MACS", 0)


def test_kernel_threads_give_identical_bits(data, threaded):
    from threadpoolctl import threadpool_limits

    s, x = token_features(data["tokens"], None, True)
    a = gram_update(np.zeros((55, 10)), s, x, threads=1, panel_rows=16, panel_cols=8)
    for threads in (2, 3, 8):
        b = gram_update(np.zeros((55, 10)), s, x, threads=threads, panel_rows=16, panel_cols=8)
        assert np.array_equal(a, b), threads
    # the whole build: the same bits for any BLAS thread count (every BLAS call runs on one thread)
    ref = statistics_from_arrays(data["tokens"], data["targets"], block_rows=100)
    for n in (1, 2):
        with threadpool_limits(n):
            st = statistics_from_arrays(data["tokens"], data["targets"], block_rows=100)
        assert np.array_equal(st.gram_compact, ref.gram_compact) and np.array_equal(st.moments, ref.moments), n


def test_non_causal_token_gram_matches_definition():
    D = make_mhla(d=3, heads=1, length=9, samples=11, variable_lengths=True, seed=2)
    s, x = token_features(D["tokens"], D["lengths"], False)
    for i in range(11):
        z = D["tokens"][i, : D["lengths"][i]]
        S = z.T @ z
        assert np.allclose(s[i], S[np.triu_indices(3)], rtol=1e-14, atol=1e-15)
        assert np.array_equal(x[i], z[-1])


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_large_psi_path_agrees_with_eigh_path(data, ridge):
    st = statistics_from_arrays(data["tokens"], data["targets"])
    a = solver.solve(st, ridge=ridge)  # psi = 40: eigh
    b = solver.solve(st, ridge=ridge, large_psi=10)  # forced: Cholesky + Lanczos
    assert a.certificate.eigenvalues is not None and b.certificate.eigenvalues is None
    assert np.abs(b.coef - a.coef).max() <= 1e-10 * np.abs(a.coef).max()
    ca, cb = a.certificate, b.certificate
    assert cb.identifiable and cb.rank == ca.rank == st.psi
    for k in ("lambda_min", "lambda_max", "lambda_min_scaled", "condition_number"):
        assert getattr(cb, k) == pytest.approx(getattr(ca, k), rel=1e-8), k
    assert b.sse == pytest.approx(a.sse, rel=1e-9)
    assert b.effective_dof == pytest.approx(a.effective_dof, rel=1e-10)
    cc = certify(st, solver="cholesky")
    assert cc.lambda_min == pytest.approx(ca.lambda_min, rel=1e-8)


def test_large_psi_path_falls_back_to_eigh_when_not_identifiable():
    D = make_mhla(d=3, heads=1, length=6, samples=8, seed=1)  # 8 rows < psi = 18: rank deficient
    st = statistics_from_arrays(D["tokens"], D["targets"])
    a, b = solver.solve(st), solver.solve(st, solver="cholesky")
    assert b.rank == a.rank < st.psi and b.null_basis.shape[1] == st.psi - a.rank
    assert np.allclose(b.coef, a.coef, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="solver must be one of"):
        solver.solve(st, solver="qr")
    with pytest.warns(DeprecationWarning, match="method= is deprecated"):  # the old keyword still works
        c = solver.solve(st, method="cholesky")
    assert np.array_equal(c.coef, b.coef)


def test_memory_estimate_and_refusal():
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("2e9") == 2e9 and parse_bytes(5) == 5
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")
    e32 = fit_memory(32, 32)
    assert e32["psi"] == 16_896 and e32["path"] == "cholesky"
    assert e32["gram_bytes"] == 8 * 16_896**2 and e32["solver_bytes"] > 2 * e32["gram_bytes"]
    assert fit_memory(32, 32, solver="eigh")["solver_bytes"] > e32["solver_bytes"]
    assert fit_memory(16, 16)["solver_bytes"] < 1e9  # d = 16 fits anywhere
    # psi = 133,120 (d = 64): 142 GB per Gram; refused with the size of machine it needs
    with pytest.raises(InsufficientMemoryError, match=r"needs \d+\.\d GiB on the solver node.*has 24\.0 GiB"):
        check_fit_memory(64, 64, memory_limit="24GiB")
    with pytest.raises(MemoryError, match="at least"):
        check_fit_memory(32, 32, memory_limit=2**30)
    assert check_fit_memory(8, 8, memory_limit="1GiB")["available_bytes"] == 2**30


def test_fit_refuses_before_building(tmp_path, monkeypatch):
    from scaleattn.generate import generate_mhla
    from scaleattn.pipeline import fit

    ds = generate_mhla(str(tmp_path / "d.zarr"), d=4, samples=8, length=5)
    monkeypatch.setenv("SCALEATTN_MEMORY_LIMIT", "10kB")
    with pytest.raises(InsufficientMemoryError, match="GiB available"):
        fit(ds, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("threads", [2, 3])
def test_kernel_propagates_errors_and_survives_nesting(threaded, threads):
    """A failing job raises in the caller (no thread left writing); a kernel called from a kernel thread (an
    ``extra`` job) neither deadlocks on the shared pool nor changes the bits."""
    import threading

    rng = np.random.default_rng(1)
    s, x = rng.standard_normal((3000, 36)), rng.standard_normal((3000, 8))
    u, v = compact_factors(s, x)
    ref = u.T @ v

    def boom():
        raise RuntimeError("boom")

    g = np.zeros_like(ref)
    with pytest.raises(RuntimeError, match="boom"):
        gram_update(g, s, x, threads=threads, panel_rows=64, panel_cols=16, extra=[(10**9, boom)])
    snapshot = g.copy()
    threading.Event().wait(0.2)
    assert np.array_equal(g, snapshot)  # nothing still writes after the raise

    inner = []
    outer = np.zeros_like(ref)
    job = lambda: inner.append(gram_update(np.zeros_like(ref), s, x, threads=2, panel_rows=64, panel_cols=16))
    t = threading.Thread(target=gram_update, args=(outer, s, x),
                         kwargs=dict(threads=threads, panel_rows=64, panel_cols=16, extra=[(10**8, job)] * 3))
    t.start()
    t.join(60)
    assert not t.is_alive(), "nested kernel calls deadlocked"
    assert len(inner) == 3 and all(np.array_equal(i, inner[0]) for i in inner)
    assert np.allclose(outer, ref, rtol=1e-13, atol=1e-13 * np.abs(ref).max())
    assert np.array_equal(outer, gram_update(np.zeros_like(ref), s, x, threads=1, panel_rows=64, panel_cols=16))


def test_concurrent_callers_keep_the_blas_setting(data, threaded):
    """Builds from several user threads at once: each is correct, and the process's BLAS thread count is
    what it was before (the kernel's thread limit is taken and restored one call at a time)."""
    import threading

    from scaleattn.kernel import _blas_threads

    before = _blas_threads()
    ref = statistics_from_arrays(data["tokens"], data["targets"], block_rows=100)
    out = [None] * 4

    def build(i):
        out[i] = statistics_from_arrays(data["tokens"], data["targets"], block_rows=100)

    ts = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(np.array_equal(o.gram_compact, ref.gram_compact) for o in out)
    assert _blas_threads() == before


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
