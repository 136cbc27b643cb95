"""The two statistics kernels (numba and numpy, :mod:`scaleattn.statistics._kernel`): the same Tc, B and yy to 1e-14
relative at d = 2, 3, 4, 8 (and on the BLAS side of ``BLAS_MIN_D``), causal or not, variable lengths, column
tiles, d_out = 0, 1, 3; each deterministic and bit-identical for any thread count; the switch and its errors."""
import numpy as np
import pytest

import scaleattn.statistics._compiled as kc
import scaleattn.statistics._kernel as kernel
from scaleattn.errors import ParameterError
from scaleattn.features import n_pairs
from scaleattn.statistics._container import Statistics, accumulate


def _data(d, causal, d_out, n=41, T=7, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.standard_normal((n, T, d))
    lengths = rng.integers(1, T + 1, n)
    tokens[np.arange(T)[None, :] >= lengths[:, None]] = 0.0  # padding is zero by format
    targets = None
    if d_out:
        targets = rng.standard_normal((n, T, d_out) if causal else (n, d_out))
    return tokens, targets, lengths


def _build(kern, tokens, targets, lengths, causal, cols=None, block_rows=None):
    d = tokens.shape[-1]
    st = Statistics.zeros(d, 0 if targets is None else targets.shape[-1])
    if cols is not None:
        st.gram_compact = np.zeros((cols.stop - cols.start, d * (d + 1) // 2))
    return accumulate(st, tokens, targets, lengths, causal, block_rows=block_rows, cols=cols, kernel=kern)


def _rel(a, b):
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


@pytest.mark.parametrize("d", [2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_out", [0, 1, 3])
def test_kernels_agree(d, causal, d_out):
    tokens, targets, lengths = _data(d, causal, d_out, seed=d)
    a = _build("numba", tokens, targets, lengths, causal, block_rows=37)
    b = _build("numpy", tokens, targets, lengths, causal, block_rows=37)
    assert a.n_rows == b.n_rows == (lengths.sum() if causal else len(lengths))
    assert _rel(a.gram_compact, b.gram_compact) <= 1e-14
    if d_out:
        assert _rel(a.moments, b.moments) <= 1e-14 and a.yy == pytest.approx(b.yy, rel=1e-14)
    mm = n_pairs(n_pairs(d))
    cols = slice(mm // 3, mm // 3 + max(1, mm // 2))  # a column tile (DESIGN §6), not panel-aligned
    ta = _build("numba", tokens, targets, lengths, causal, cols=cols)
    tb = _build("numpy", tokens, targets, lengths, causal, cols=cols)
    assert _rel(ta.gram_compact, tb.gram_compact) <= 1e-14
    assert _rel(ta.gram_compact, a.gram_compact[cols]) <= 1e-14


def test_kernels_agree_where_numba_uses_blas():
    d = kernel.BLAS_MIN_D
    tokens, targets, lengths = _data(d, True, 2, n=3, T=4)
    a = _build("numba", tokens, targets, lengths, True)
    b = _build("numpy", tokens, targets, lengths, True)
    assert _rel(a.gram_compact, b.gram_compact) <= 1e-14 and _rel(a.moments, b.moments) <= 1e-14


def test_compiled_u_panels_give_the_blas_kernels_bits():
    """From ``BLAS_MIN_D`` on, the numba kernel forms the ``u`` panels compiled (:func:`kc.u_panel`) for the same
    BLAS GEMMs: the same products as :func:`pair_products`, so ``Tc`` is bit-identical to the numpy kernel's on
    the same ``s``, ``x`` (panels and tiles not aligned to the pairs, several row panels, 1 and 3 threads), and
    both match a dense ``u^T v``."""
    from scaleattn.features import pair_products

    rng = np.random.default_rng(5)
    s, x = rng.standard_normal((300, 14)), rng.standard_normal((300, kernel.BLAS_MIN_D))
    mm, nv = n_pairs(14), n_pairs(kernel.BLAS_MIN_D)
    out = np.empty((40, 100))
    kc.u_panel(out, np.ascontiguousarray(s.T), *kc.pair_columns(14, 17, 57), 150)
    assert np.array_equal(out.T, pair_products(s[150:250], slice(17, 57)))
    ref = pair_products(s).T @ pair_products(x)
    for cols in (None, slice(13, 90)):
        w = mm if cols is None else cols.stop - cols.start
        kw = dict(cols=cols, panel_rows=128, panel_cols=23)
        a = kernel.gram_update(np.zeros((w, nv)), s, x, kernel="numpy", threads=1, **kw)
        assert _rel(a, ref[cols or slice(None)]) <= 1e-14
        for threads in (1, 3):
            b = kernel.gram_update(np.zeros((w, nv)), s, x, kernel="numba", threads=threads, **kw)
            assert np.array_equal(a, b), (cols, threads)


@pytest.mark.parametrize("kern", ["numba", "numpy"])
def test_each_kernel_is_deterministic_for_any_thread_count(kern, monkeypatch):
    from threadpoolctl import threadpool_limits

    monkeypatch.setattr(kernel, "MIN_THREAD_MACS", 0)
    monkeypatch.setattr(kc, "MIN_PIECE_ROWS", 64)  # several row pieces at this size
    monkeypatch.setattr(kc, "PANEL_COLS", 8)  # several panels at d = 4
    tokens, targets, lengths = _data(4, True, 2, n=200, T=9)
    ref = _build(kern, tokens, targets, lengths, True)
    for n in (1, 2):
        with threadpool_limits(n):
            st = _build(kern, tokens, targets, lengths, True)
        assert np.array_equal(st.gram_compact, ref.gram_compact) and np.array_equal(st.moments, ref.moments), n
    s, x = kc.features_t(tokens, lengths, True)
    one = kernel.gram_update(np.zeros((55, 10)), s.T, x.T, threads=1, kernel=kern)
    for threads in (2, 3):
        assert np.array_equal(kernel.gram_update(np.zeros((55, 10)), s.T, x.T, threads=threads, kernel=kern), one)


def test_row_pieces_cover_the_rows_and_depend_on_shapes_only():
    for rows in (0, 1, 8191, 20000, 10**6):
        for panels in (1, 3, 4, 100):
            p = kc.row_pieces(rows, panels)
            assert p[0][0] == 0 and p[-1][1] == rows and all(a[1] == b[0] for a, b in zip(p, p[1:]))
            assert len(p) == 1 or panels < kc.MIN_PANELS


def test_kernel_switch(monkeypatch):
    monkeypatch.delenv("SCALEATTN_KERNEL", raising=False)
    assert kernel.kernel_name() == "numba"
    monkeypatch.setenv("SCALEATTN_KERNEL", "numpy")
    assert kernel.kernel_name() == "numpy"
    monkeypatch.setattr(kernel, "KERNEL", "numba")
    assert kernel.kernel_name() == "numba" and kernel.kernel_name(kernel="numpy") == "numpy"
    monkeypatch.setenv("SCALEATTN_KERNEL", "fortran")
    monkeypatch.setattr(kernel, "KERNEL", None)
    with pytest.raises(ParameterError, match="fortran"):
        kernel.kernel_name()
    cupy_like = type("cupy", (), {})  # CuPy (any module but numpy) always takes the array path
    assert kernel.kernel_name(cupy_like, "numba") == "numpy"


def test_compiled_features_match_numpy_features():
    from scaleattn.features import token_features

    for causal in (False, True):
        tokens, _, lengths = _data(3, causal, 0)
        sT, xT = kc.features_t(tokens.astype(np.float32), lengths, causal)
        s, x = token_features(tokens.astype(np.float32), lengths, causal)
        assert np.array_equal(xT.T, x) and _rel(sT.T, s) <= 1e-15


@pytest.mark.parametrize("causal", [False, True])
def test_fused_pass_pieces_are_deterministic_and_agree(causal, monkeypatch):
    """The fused pass (:func:`scaleattn.statistics._kernel.fused_update`) in several sample pieces: the same bits on
    1, 2 and
    3 threads, and the numpy kernel's sums to 1e-14 (NaN in one sample stays in the entries it reaches)."""
    monkeypatch.setattr(kernel, "MIN_THREAD_MACS", 0)
    monkeypatch.setattr(kc, "PIECE_MACS", 1000)  # many pieces at this size
    tokens, targets, lengths = _data(4, causal, 2, n=120, T=9, seed=3)
    assert len(kc.sample_pieces(lengths if causal else np.ones(120), 640, 800)) > 8
    ref = _build("numba", tokens, targets, lengths, causal)
    for threads in (1, 2, 3):
        st = Statistics.zeros(4, 2)
        yy, rows = kernel.fused_update(st.gram_compact, st.moments, tokens, targets, lengths, causal, threads=threads)
        assert np.array_equal(st.gram_compact, ref.gram_compact) and np.array_equal(st.moments, ref.moments)
        assert yy == ref.yy and rows == ref.n_rows
    b = _build("numpy", tokens, targets, lengths, causal)
    assert _rel(ref.gram_compact, b.gram_compact) <= 1e-14 and _rel(ref.moments, b.moments) <= 1e-14
    assert np.array_equal(_build("numba", tokens, None, lengths, causal).gram_compact, ref.gram_compact)
    cols = slice(7, 30)  # a tile has the bits of the full build's rows
    assert np.array_equal(_build("numba", tokens, targets, lengths, causal, cols=cols).gram_compact,
                          ref.gram_compact[cols])
    bad = tokens.copy()
    bad[5, 0, 1] = np.nan
    nan_a, nan_b = _build("numba", bad, targets, lengths, causal), _build("numpy", bad, targets, lengths, causal)
    assert np.isnan(nan_a.gram_compact).any()
    assert np.array_equal(np.isnan(nan_a.gram_compact), np.isnan(nan_b.gram_compact))
    assert np.array_equal(np.isnan(nan_a.moments), np.isnan(nan_b.moments))


def test_sample_pieces_cover_the_samples_in_order():
    for n, rows in ((1, 5), (7, 3), (1000, 100)):
        p = kc.sample_pieces(np.full(n, rows), 10**6, 8)
        assert p[0][0] == 0 and p[-1][1] == n and all(a[1] == b[0] and a[0] < a[1] for a, b in zip(p, p[1:]))
        assert len(p) <= kc.MAX_SAMPLE_PIECES
    p = kc.sample_pieces(np.full(1000, 100), 550, 8)  # 1000 x 100 x 550 / PIECE_MACS = 2.75 -> 2 pieces
    big = kc.sample_pieces(np.full(10_000, 100), 550, 8)  # 27.5 -> 28: a multiple of 4 (equal thread shares)
    assert len(p) == 2 and len(big) == 28
    ones, tokens = np.ones(10_000, dtype=np.int64), np.full(10_000, 100)  # last-token rows: their tokens count
    assert len(kc.sample_pieces(ones, 550, 8)) == 1  # 5.5e6 multiply-adds: one piece
    last = kc.sample_pieces(ones, 550, 8, tokens, 70)  # + 7e7 for the tokens: 3.8 -> 4 (3 would idle a thread)
    assert len(last) == 4 and [b - a for a, b in last] == [2500] * 4


@pytest.mark.parametrize("causal", [False, True])
def test_fused_pass_reads_any_layout_and_float32_in_place(causal):
    """Position-major tokens and targets (an einsum's layout: staged by the pass, more samples than
    ``STAGE_SAMPLES``) and float32 ones (converted as read) give the bits of C-ordered float64 input, and the
    numpy kernel's sums to 1e-14."""
    n = 2 * kc.STAGE_SAMPLES + 11
    tokens, targets, lengths = _data(3, causal, 2, n=n, T=9, seed=5)
    ref = _build("numba", tokens, targets, lengths, causal)
    pm = lambda a: np.ascontiguousarray(np.swapaxes(a, 0, 1)).swapaxes(0, 1) if a.ndim == 3 else a.T.copy().T
    assert kc._position_major(pm(tokens)) and not kc._position_major(tokens)
    for tok, tg in ((pm(tokens), pm(targets)), (pm(tokens), targets), (tokens, pm(targets))):
        got = _build("numba", tok, tg, lengths, causal)
        assert np.array_equal(got.gram_compact, ref.gram_compact) and np.array_equal(got.moments, ref.moments)
        assert got.yy == ref.yy
    t32, y32 = tokens.astype(np.float32), targets.astype(np.float32)
    a = _build("numba", t32, y32, lengths, causal)
    b = _build("numba", t32.astype(np.float64), y32.astype(np.float64), lengths, causal)
    assert np.array_equal(a.gram_compact, b.gram_compact) and np.array_equal(a.moments, b.moments)
    assert np.array_equal(_build("numba", pm(t32), pm(y32), lengths, causal).gram_compact, a.gram_compact)
    c = _build("numpy", pm(tokens), pm(targets), lengths, causal)
    assert _rel(ref.gram_compact, c.gram_compact) <= 1e-14 and _rel(ref.moments, c.moments) <= 1e-14




@pytest.mark.parametrize("d", [1, 2, 3, 5, 8])
def test_expand_gram_compiled_numpy_and_gather_are_the_same_copy(d, monkeypatch):
    """The compiled expansion, the numpy row-group one and the array-API gather (strict arrays) give the same
    bits, and the definition ``G[(P,l),(P',l')] = Tc[pair(P,P'), pair(l,l')]`` entry by entry (the compiled one
    at every psi here: below EXPAND_COMPILED_MIN_PSI a fit takes the gather)."""
    import array_api_strict as xs

    monkeypatch.setattr(kernel, "EXPAND_COMPILED_MIN_PSI", 0)
    from scaleattn._backend import to_numpy
    from scaleattn.features import expand_compact_gram, triu_index

    m = n_pairs(d)
    Tc = np.random.default_rng(d).standard_normal((n_pairs(m), n_pairs(d)))
    _, _, pp = triu_index(m)
    _, _, lp = triu_index(d)
    ref = np.array([[Tc[pp[P, Q], lp[l, k]] for Q in range(m) for k in range(d)] for P in range(m) for l in range(d)])
    gather = to_numpy(expand_compact_gram(xs.asarray(Tc), d))
    np.testing.assert_array_equal(gather, ref)
    np.testing.assert_array_equal(expand_compact_gram(Tc, d), ref)
    for threads in (1, 3):
        G = kernel.expand_gram(Tc, d, threads=threads, kernel="numba")
        assert G.flags.c_contiguous
        np.testing.assert_array_equal(G, ref)
    np.testing.assert_array_equal(kernel.expand_gram(Tc, d, kernel="numpy"), ref)
    np.testing.assert_array_equal(kernel.expand_gram(np.asfortranarray(Tc), d, threads=2), ref)


@pytest.mark.parametrize("min_psi", [0, None])
def test_expand_gram_into_a_given_array(min_psi, monkeypatch):
    """``out=``: the same bits into the caller's array (what the Cholesky path factors in place), on both kernels
    and both sides of EXPAND_COMPILED_MIN_PSI; an array of the wrong shape, dtype or order is refused."""
    if min_psi is not None:
        monkeypatch.setattr(kernel, "EXPAND_COMPILED_MIN_PSI", min_psi)
    d = 4
    Tc = np.random.default_rng(7).standard_normal((n_pairs(n_pairs(d)), n_pairs(d)))
    ref = kernel.expand_gram(Tc, d)
    for k in ("numba", "numpy"):
        out = np.full_like(ref, np.nan)
        assert kernel.expand_gram(Tc, d, kernel=k, out=out) is out
        np.testing.assert_array_equal(out, ref)
    for bad in (np.empty((ref.shape[0], ref.shape[0] + 1)), np.empty(ref.shape, np.float32), np.asfortranarray(ref)):
        with pytest.raises(ParameterError, match="out must be"):
            kernel.expand_gram(Tc, d, out=bad)


_WIDTH_CHILD = r"""
import json, sys
import numpy as np
import scaleattn.statistics._compiled as kc
from scaleattn._jit import wide_vectors
kc.tc_panel(np.zeros((8, 10)), np.ones((10, 40)), np.ones((4, 40)), 0, 8)  # compiles the panel and micro-kernel
asm = "".join(kc.compiled()[1].inspect_asm().values())
import numba
print(json.dumps({"width": wide_vectors(), "zmm": "zmm" in asm, "features": numba.config.CPU_FEATURES}))
"""


@pytest.mark.slow
def test_compiled_kernels_use_the_hosts_full_vector_width(tmp_path):
    """On an AVX-512 host numba compiles our kernels at 512 bits (LLVM's prefer-256-bit tuning of Intel's server
    cores lifted: the micro-kernel is FMA-bound), and its machine code uses zmm registers; a user's own
    ``NUMBA_CPU_FEATURES`` is kept as given. Each in a fresh process (the setting is read once per process)."""
    import json
    import os
    import subprocess
    import sys

    import llvmlite.binding as ll

    host = ll.get_host_cpu_features()
    # a cache of its own: numba shows no machine code of functions loaded from its cache
    mine = ("NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME", "NUMBA_ENABLE_AVX")  # a user's choices of numba's target
    env = {k: v for k, v in os.environ.items() if k not in mine} | {"NUMBA_CACHE_DIR": str(tmp_path)}
    out = json.loads(subprocess.run([sys.executable, "-c", _WIDTH_CHILD], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    if host.get("avx512f"):
        assert out["width"] == 512 and out["zmm"] and out["features"].endswith(",-prefer-256-bit")
    else:
        assert out["width"] in (128, 256) and not out["zmm"] and out["features"] is None
    own = host.flatten()  # the user's choice: kept, whatever it means for the width
    out = json.loads(subprocess.run([sys.executable, "-c", _WIDTH_CHILD], env={**env, "NUMBA_CPU_FEATURES": own},
                                    capture_output=True, text=True, check=True).stdout)
    assert out["features"] == own
    if host.get("avx512f"):
        assert out["width"] == 256


_BLOCK_CHILD = r"""
import sys
import numpy as np
import scaleattn.statistics._compiled as kc
if sys.argv[1] != "host":
    kc.wide_vectors = lambda: int(sys.argv[1])  # the block width only: numba's vector width stays the host's
from scaleattn.statistics._container import Statistics, accumulate
rng = np.random.default_rng(3)
out = {}
for d, causal in ((4, True), (4, False), (6, True), (9, True)):
    z = rng.standard_normal((40, 30, d))
    y = rng.standard_normal((40, 30, 3) if causal else (40, 3))
    lens = rng.integers(1, 31, 40)
    st = accumulate(Statistics.zeros(d, 3), z, y, lens, causal, kernel="numba")
    out[f"{d}{causal}g"], out[f"{d}{causal}m"] = st.gram_compact, st.moments
    sT, xT = kc.features_t(z, lens, causal)
    tc = np.zeros((kc.n_pairs(kc.n_pairs(d)), kc.n_pairs(d)))
    kc.tc_panel(tc, sT, xT, 0, tc.shape[0])
    out[f"{d}{causal}t"] = tc
np.savez(sys.argv[2], block=kc._J_BLOCK, **out)
"""


@pytest.mark.slow
def test_micro_kernel_blocks_of_either_width_agree(tmp_path):
    """The micro-kernel's register block is 4 x 4 where the host has 32 vector registers and 4 x 2 where it has
    16 (:data:`scaleattn.statistics._compiled._J_BLOCK`): the block changes which sums share registers, so both agree
    with each other and with the numpy kernel to 1e-14. Not the same bits everywhere: LLVM's vectoriser may
    interleave the 4 x 2 block's reduction in two (it did on a Zen 4 core at 512 bits, not on Zen 3 or Emerald
    Rapids), which reorders the sums. Each width in a fresh process with a numba cache of its own (the width is a
    compile-time constant, not part of numba's cache key)."""
    import os
    import subprocess
    import sys

    import llvmlite.binding as ll

    mine = ("NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME", "NUMBA_ENABLE_AVX")  # a user's choices of numba's target
    wide = bool(ll.get_host_cpu_features().get("avx512f"))
    res = {}
    for width in ("host", "256" if wide else "512"):  # the host's own block, then the other one
        env = {**{k: v for k, v in os.environ.items() if k not in mine}, "NUMBA_CACHE_DIR": str(tmp_path / width)}
        subprocess.run([sys.executable, "-c", _BLOCK_CHILD, width, str(tmp_path / f"{width}.npz")], env=env,
                       check=True)
        res[width] = np.load(tmp_path / f"{width}.npz")
    host, other = res.values()
    assert (int(host["block"]), int(other["block"])) == ((4, 2) if wide else (2, 4))
    for key in sorted(set(host.files) - {"block"}):
        scale = abs(host[key]).max()
        assert scale > 0, key
        np.testing.assert_allclose(other[key], host[key], rtol=0, atol=1e-14 * scale, err_msg=key)
    rng = np.random.default_rng(3)  # the numpy kernel on the same data (the child's first draws)
    z, y, lens = rng.standard_normal((40, 30, 4)), rng.standard_normal((40, 30, 3)), rng.integers(1, 31, 40)
    ref = accumulate(Statistics.zeros(4, 3), z, y, lens, True, kernel="numpy")
    for key, want in (("4Trueg", ref.gram_compact), ("4Truem", ref.moments)):
        np.testing.assert_allclose(host[key], want, rtol=0, atol=1e-14 * abs(want).max())

