"""The compiled product of the Gram operator (:mod:`scaleattn.linalg._gram_compiled`) against the dense ``G @ X``
(``expand_compact_gram``, an independent expansion) and against the numpy path: any d (1 to 16), any k (vector,
1, 2, 7), tiles that cut segments, causal and last-token data with variable lengths, any thread count; the
``SCALEATTN_KERNEL`` switch."""
from __future__ import annotations

import numpy as np
import pytest

import scaleattn.linalg._gram as go
import scaleattn.statistics._kernel as kernel
from scaleattn.distributed.partition import tile_bounds
from scaleattn.features import expand_compact_gram
from scaleattn.linalg import _gram_compiled
from scaleattn.statistics._container import statistics_from_arrays


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _stats(d, causal, n=30, T=6, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.standard_normal((n, T, d))
    lengths = rng.integers(1, T + 1, n)
    tokens[np.arange(T)[None, :] >= lengths[:, None]] = 0.0  # padding is zero by format
    return statistics_from_arrays(tokens, None, lengths, causal)


def _numpy_product(Tc, d, X, tile_rows):
    """The numpy path (``_apply_segments``: np.take expansion + BLAS) over the same tiling."""
    Y = np.zeros(X.reshape(X.shape[0], -1).shape)
    for a, b in tile_bounds(d, tile_rows=tile_rows):
        go._apply_segments(Tc[a:b], go.tile_segments(d, a, b), d, X.reshape(X.shape[0], -1), Y)
    return Y.reshape(X.shape)


@pytest.mark.parametrize("d", [1, 2, 3, 4, 8, pytest.param(16, marks=pytest.mark.slow)])  # d = 16: 8 s each
@pytest.mark.parametrize("causal", [True, False])
def test_compiled_product_matches_dense_and_numpy(d, causal, monkeypatch):
    monkeypatch.setattr(kernel, "KERNEL", "numba")
    st = _stats(d, causal, n=8 if d == 16 else 30, seed=d)
    Tc = st.gram_compact
    G = expand_compact_gram(Tc, d)
    rng = np.random.default_rng(d)
    for k in (None, 1, 2, 7):
        X = rng.standard_normal(st.psi if k is None else (st.psi, k))
        ref = G @ X
        op = go.GramOperator.from_compact(Tc, d)
        assert (op @ X).shape == X.shape
        assert rel(op @ X, ref) <= 1e-13, k
        for rows in (1, 5, 7, 1000):  # tiles that start and end inside segments
            part = sum(go.tile_matmat(Tc[a:b], a, d, X) for a, b in tile_bounds(d, tile_rows=rows))
            assert rel(part, ref) <= 1e-13, (k, rows)
            assert rel(part, _numpy_product(Tc, d, X, rows)) <= 1e-13, (k, rows)
        out = np.ones_like(X)
        assert go.tile_matmat(Tc, 0, d, X, out=out) is out and rel(out - 1.0, ref) <= 1e-13


def test_kernel_alone_on_a_subset_of_rows():
    """Any row range's partial is its rows of Tc expanded (zeros elsewhere), straight from the kernel."""
    d = 4
    st = _stats(d, True, seed=3)
    Tc = st.gram_compact
    X = np.random.default_rng(0).standard_normal((st.psi, 3))
    c0, c1 = 13, 41  # cuts the first segments (m = 10 rows each at first)
    Tsub = np.zeros_like(Tc)
    Tsub[c0:c1] = Tc[c0:c1]
    XT = _gram_compiled.padded(X, d)
    YT = np.zeros_like(XT)
    _gram_compiled.apply_segments(Tc[c0:c1], go.tile_segments(d, c0, c1), d, XT, YT)
    assert np.array_equal(_gram_compiled.unpadded(XT, d), X)
    assert rel(_gram_compiled.unpadded(YT, d), expand_compact_gram(Tsub, d) @ X) <= 1e-13
    _gram_compiled.apply_segments(Tc[c0:c0], (), d, XT, YT)  # no segments: nothing to do


@pytest.mark.parametrize("k", [1, 7])
def test_compiled_operator_any_thread_count(k, monkeypatch):
    monkeypatch.setattr(kernel, "KERNEL", "numba")
    monkeypatch.setattr(go, "MIN_THREAD_ENTRIES", 0)  # several groups at this size
    d = 8
    st = _stats(d, True, seed=5)
    X = np.random.default_rng(2).standard_normal((st.psi, k))
    ref = expand_compact_gram(st.gram_compact, d) @ X
    one = go.GramOperator.from_compact(st.gram_compact, d, tile_rows=50, threads=1) @ X
    assert rel(one, ref) <= 1e-13
    for threads in (2, 3):
        op = go.GramOperator.from_compact(st.gram_compact, d, tile_rows=50, threads=threads)
        assert len(op._groups) == threads
        Y = op @ X
        assert rel(Y, one) <= 1e-13
        assert np.array_equal(op @ X, Y)  # the same bits on every call (fixed order of the groups' sums)


def test_switch_selects_the_numpy_path(monkeypatch):
    d = 4
    st = _stats(d, False, seed=7)
    X = np.random.default_rng(3).standard_normal((st.psi, 2))
    numpy_bits = _numpy_product(st.gram_compact, d, X, st.gram_compact.shape[0])
    monkeypatch.setattr(kernel, "KERNEL", None)
    monkeypatch.setenv("SCALEATTN_KERNEL", "numpy")
    assert np.array_equal(go.GramOperator.from_compact(st.gram_compact, d) @ X, numpy_bits)
    assert np.array_equal(go.tile_matmat(st.gram_compact, 0, d, X), numpy_bits)
    monkeypatch.setenv("SCALEATTN_KERNEL", "numba")
    Y = go.GramOperator.from_compact(st.gram_compact, d) @ X
    assert not np.array_equal(Y, numpy_bits) and rel(Y, numpy_bits) <= 1e-13  # the compiled kernel ran
    monkeypatch.setenv("SCALEATTN_KERNEL", "fortran")
    with pytest.raises(ValueError, match="SCALEATTN_KERNEL"):
        go.GramOperator.from_compact(st.gram_compact, d) @ X
