"""The compact-Gram kernel (DESIGN §3, §6): any panel sizes and threads give the dense product, the same bits
for any thread count, errors raised in the caller, nested calls without deadlock, BLAS settings kept."""
import numpy as np
import pytest

from scaleattn.features import compact_factors, token_features
from scaleattn.statistics._container import statistics_from_arrays
from scaleattn.statistics._kernel import gram_update


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
    import scaleattn.statistics._kernel as st

    monkeypatch.setattr(st, "MIN_THREAD_MACS", 0)


def test_kernel_threads_give_identical_bits(noisy_causal_arrays, threaded):
    from threadpoolctl import threadpool_limits

    D = noisy_causal_arrays
    s, x = token_features(D["tokens"], None, True)
    a = gram_update(np.zeros((55, 10)), s, x, threads=1, panel_rows=16, panel_cols=8)
    for threads in (2, 3, 8):
        b = gram_update(np.zeros((55, 10)), s, x, threads=threads, panel_rows=16, panel_cols=8)
        assert np.array_equal(a, b), threads
    # the whole build: the same bits for any BLAS thread count (every BLAS call runs on one thread)
    ref = statistics_from_arrays(D["tokens"], D["targets"], block_rows=100)
    for n in (1, 2):
        with threadpool_limits(n):
            st = statistics_from_arrays(D["tokens"], D["targets"], block_rows=100)
        assert np.array_equal(st.gram_compact, ref.gram_compact) and np.array_equal(st.moments, ref.moments), n


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


def test_concurrent_callers_keep_the_blas_setting(noisy_causal_arrays, threaded):
    """Builds from several user threads at once: each is correct, and the process's BLAS thread count is
    what it was before (the kernel's thread limit is taken and restored one call at a time)."""
    import threading

    from scaleattn.statistics._kernel import _blas_threads

    D = noisy_causal_arrays
    before = _blas_threads()
    ref = statistics_from_arrays(D["tokens"], D["targets"], block_rows=100)
    out = [None] * 4

    def build(i):
        out[i] = statistics_from_arrays(D["tokens"], D["targets"], block_rows=100)

    ts = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(np.array_equal(o.gram_compact, ref.gram_compact) for o in out)
    assert _blas_threads() == before
