"""The head search and its lower bounds (DESIGN §2, §5; scaleattn.heads._search).

Independent references: the Jacobian of ``(V, Q) -> c`` by central differences of ``coef_from_heads`` (exact for
a bilinear map) and its rank by ``numpy.linalg.matrix_rank``; a plain nonlinear least-squares fit
(``scipy.optimize.least_squares``) of ``c(V, Q) = c``; predictions straight from the heads (``mhla_forward``)
against the coefficients' (``predict_rows``) on inputs of other lengths; data-pass MSEs and ``numpy.linalg.lstsq``
on the explicit features.
"""
import time

import numpy as np
import pytest
from scipy.optimize import least_squares
from threadpoolctl import threadpool_limits

from scaleattn.features import n_features, phi, predict_rows, row_targets, token_features
from scaleattn.generate import make_mhla, mhla_forward
from scaleattn.heads._algebra import coef_from_heads, svd_heads
from scaleattn.heads._bounds import (
    KIND_EVERY_C,
    KIND_GENERIC,
    flattening_bound,
    generic_heads_bound,
    image_dimension,
    naive_dimension,
)
from scaleattn.heads._fit import fit_heads
from scaleattn.heads._search import loss_vs_heads, search_heads
from scaleattn.linalg._solver import solve
from scaleattn.model import model_from_statistics
from scaleattn.statistics._container import statistics_from_arrays

TIMINGS = {}


def _agnostic(d, d_out, samples=None, seed=0):
    """Causal data whose targets are no MHLA model: a nonlinear function of the attention features plus noise."""
    rng = np.random.default_rng([seed, d, d_out])
    T = 12
    n = samples or max(120, 3 * n_features(d) // T + 60)
    z = rng.standard_normal((n, T, d)) / np.sqrt(T)
    R = rng.standard_normal((d_out, d * d))
    S = np.cumsum(np.einsum("ntj,ntk->ntjk", z, z), axis=1)
    y = np.tanh(np.einsum("ntjk,ntl->ntjl", S, z).reshape(n, T, d * d) @ R.T) + 0.1 * rng.standard_normal((n, T, d_out))
    return z, y


def _fit(z, y):
    st = statistics_from_arrays(z, y)
    return st, solve(st)


def _jac_fd(V, Q):
    """d vec c / d (vec V, vec Q) by central differences of coef_from_heads (exact: the map is bilinear)."""
    x = np.concatenate([V.ravel(), Q.ravel()])
    nv = V.size

    def c(x):
        return coef_from_heads(x[:nv].reshape(V.shape), x[nv:].reshape(Q.shape)).ravel()

    cols = []
    for k in range(x.size):
        e = np.zeros_like(x)
        e[k] = 1.0
        cols.append((c(x + e) - c(x - e)) / 2)
    return np.stack(cols, axis=1)


def _p_batch(W, d, d_out):
    """c = p(W) for a batch W (n, d_out*d, d*d), straight from DESIGN §2: c[(j,k), l, a] = W[a,j,k,l] + W[a,k,j,l]
    (j < k), W[a,j,j,l] (j = k); returns (psi * d_out, n)."""
    I, J = np.triu_indices(d)
    W5 = W.reshape(-1, d_out, d, d, d)
    c = W5[:, :, I, J, :] + np.where(I != J, 1.0, 0.0)[None, None, :, None] * W5[:, :, J, I, :]  # (n, a, P, l)
    return c.transpose(2, 3, 1, 0).reshape(-1, W.shape[0])


def _lsq_heads(c, d, H, starts, max_nfev=400):
    """Independent nonlinear least squares of c(V, Q) = c (scipy trf with the exact Jacobian of the bilinear map,
    built from the definition of p): the smallest relative residual over the starts (SVD heads, then random)."""
    d_out = c.shape[1]
    nv = H * d_out * d
    ref = np.linalg.norm(c)
    eye_v, eye_q = np.eye(d_out * d), np.eye(d * d)

    def split(x):
        return x[:nv].reshape(H, d_out * d), x[nv:].reshape(H, d * d)

    def fun(x):
        A, B = split(x)
        return _p_batch((A.T @ B)[None], d, d_out)[:, 0] / ref - c.ravel() / ref

    def jac(x):
        A, B = split(x)  # W = sum_h A_h B_h^T: dW/dA[h, r] = e_r B_h^T, dW/dB[h, s] = A_h e_s^T
        WA = np.einsum("rR,hs->hrRs", eye_v, B).reshape(-1, d_out * d, d * d)
        WB = np.einsum("hr,sS->hsrS", A, eye_q).reshape(-1, d_out * d, d * d)
        return np.hstack([_p_batch(WA, d, d_out), _p_batch(WB, d, d_out)]) / ref

    sv = svd_heads(c, d)
    best = np.inf
    with threadpool_limits(limits=1, user_api="blas"):  # small SVDs: threads only contend
        for i in range(starts):
            x0 = (np.concatenate([sv.V[:H].ravel(), sv.Q[:H].ravel()]) if i == 0
                  else np.random.default_rng(i).standard_normal(H * (d_out * d + d * d)))
            r = least_squares(fun, x0, jac=jac, method="trf", xtol=1e-15, ftol=1e-15, gtol=1e-15,
                              max_nfev=max_nfev)
            best = min(best, float(np.linalg.norm(r.fun)))
            if best <= 1e-12:
                break
    return best


def _forward_matches(h, coef, d, lengths=(5, 23)):
    """Max relative gap between the heads' forward pass and the coefficients' predictions on fresh inputs."""
    rng = np.random.default_rng(7)
    worst = 0.0
    for T in lengths:
        z = rng.standard_normal((20, T, d)) / np.sqrt(T)
        for causal in (False, True):
            s, x = token_features(z, causal=causal)
            ref = predict_rows(coef, s, x)
            got = mhla_forward(h.V, h.Q, z, causal=causal).reshape(ref.shape)
            worst = max(worst, float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
    return worst


# ---- the dimension count -----------------------------------------------------------------------------------
@pytest.mark.parametrize("d,d_out,H", [(2, 2, 1), (3, 3, 2), (3, 3, 4), (3, 1, 2), (4, 2, 3), (4, 1, 3)])
def test_image_dimension_is_the_rank_of_the_difference_jacobian(d, d_out, H):
    rng = np.random.default_rng([d, d_out, H])
    V, Q = rng.standard_normal((H, d_out, d)), rng.standard_normal((H, d, d))
    J = _jac_fd(V, Q)
    assert J.shape == (n_features(d) * d_out, H * (d_out * d + d * d))
    assert np.linalg.matrix_rank(J) == image_dimension(d, d_out, H)


def test_image_dimension_matches_the_naive_count_except_d_out_1():
    """d_out >= 2: the image of rank-H matrices under p has the naive dimension min(H(a+b-H), psi d_out);
    d_out = 1 loses d H (H-1)/2 (the pair symmetries Q_g += v_h u^T, Q_h -= v_g u^T)."""
    for d in (2, 3, 4):
        for d_out in (1, 2, 3):
            full = n_features(d) * d_out
            for H in range(1, min(d_out * d, d * d) + 1):
                got = image_dimension(d, d_out, H)
                if d_out >= 2:
                    assert got == naive_dimension(d, d_out, H), (d, d_out, H)
                else:
                    assert got == min(H * (d + d * d - H) - d * H * (H - 1) // 2, full), (d, H)


@pytest.mark.parametrize("d,d_out,bound", [(2, 2, 2), (3, 1, 3), (3, 2, 3), (3, 3, 4), (4, 4, 7), (5, 1, 5),
                                           (5, 3, 7), (6, 6, 13)])
def test_generic_bound_is_the_first_full_dimensional_head_count(d, d_out, bound):
    assert generic_heads_bound(d, d_out) == bound
    full = n_features(d) * d_out
    assert image_dimension(d, d_out, bound) == full  # H heads reach an open set of coefficients ...
    # ... and H - 1 reach a null set: by the count, or (d_out = 1) by the Jacobian at two random points
    assert naive_dimension(d, d_out, bound - 1) < full or max(
        image_dimension(d, d_out, bound - 1, seed=s) for s in (0, 1)) < full


# ---- the flattening bound (every c) ----------------------------------------------------------------------
def test_flattening_bound_holds_for_every_model_and_is_tight_for_few_heads():
    rng = np.random.default_rng(3)
    for d, d_out in ((3, 3), (4, 2), (5, 3), (4, 1)):
        for H in range(1, min(d_out * d, d * d) + 1):
            V, Q = rng.standard_normal((H, d_out, d)), rng.standard_normal((H, d, d))
            c = coef_from_heads(V, Q)
            b = flattening_bound(c, d)
            assert b <= H  # a valid bound: these H heads reproduce c exactly
            # tight up to the generic rank of the flattenings: min(H, d_out, d) via M_w, ceil(min(2H, d) / 2) via N
            assert b == max(min(H, d_out, d), (min(2 * H, d) + 1) // 2)
            # heads within the tolerance keep it: a perturbation of relative size tol / 2 does not lower it
            e = rng.standard_normal(c.shape)
            assert flattening_bound(c + 0.5e-10 * np.linalg.norm(c) * e / np.linalg.norm(e), d) <= H
    assert flattening_bound(np.zeros((18, 3)), 3) == 0


# ---- minimal heads on agnostic data: the search meets the dimension count ------------------------------
@pytest.mark.parametrize("d,d_out,expected", [(3, 3, 4), (5, 3, 7), (4, 4, 7), (4, 3, 6), (3, 1, 3), (5, 1, 5)])
@pytest.mark.slow
def test_minimal_heads_meet_the_bound_on_agnostic_data(d, d_out, expected):
    z, y = _agnostic(d, d_out)
    st, sol = _fit(z, y)
    assert sol.certificate.identifiable
    t = time.perf_counter()
    h = search_heads(st, sol.coef, "minimal")
    TIMINGS[(d, d_out)] = time.perf_counter() - t
    assert h.n_heads == expected == h.lower_bound == generic_heads_bound(d, d_out)
    assert h.lower_bound_kind == KIND_GENERIC and h.exact and h.meets_bound and not h.budget_exhausted
    assert h.residual <= 1e-10 and h.bound_every_c <= expected
    # the forward pass of the heads is the fitted function, on inputs of other lengths
    assert _forward_matches(h, sol.coef, d) <= 1e-11
    # the curve: every count from 1, non-increasing, lossy below the bound, the least-squares loss at it
    ks, losses = [k for k, _ in h.curve], np.array([v for _, v in h.curve])
    assert ks == list(range(1, expected + 1))
    assert np.all(np.diff(losses) <= 1e-12 * st.yy) and np.all(losses >= sol.sse - 1e-12 * st.yy)
    assert losses[-1] == pytest.approx(sol.sse, rel=1e-9) and losses[-2] > sol.sse * (1 + 1e-6)
    # an independent nonlinear least-squares fit agrees: exact at the bound (from the SVD heads), not below it
    if expected < min(d_out * d, d * d):  # at the maximum the SVD heads are exact anyway
        assert _lsq_heads(sol.coef, d, expected, 4) <= 1e-10
    assert _lsq_heads(sol.coef, d, expected - 1, 2, max_nfev=100) >= 1e-4


@pytest.mark.slow
def test_real_models_can_need_one_head_more_than_the_count():
    """(d, d_out) = (3, 2): 3 heads have exactly psi d_out = 36 free dimensions, so generic c have finitely many
    3-head models over C, and on an open set of c none of them is real: these data need 4 (the dimension count
    is a bound, not the answer). Independent nonlinear least squares from 8 starts agrees."""
    z, y = _agnostic(3, 2)
    st, sol = _fit(z, y)
    h = search_heads(st, sol.coef, "minimal")
    assert naive_dimension(3, 2, 3) == n_features(3) * 2
    assert h.n_heads == 4 and h.exact and h.lower_bound == 3 and h.lower_bound_kind == KIND_GENERIC
    assert not h.meets_bound and _forward_matches(h, sol.coef, 3) <= 1e-11
    r = {"n_heads": 4, "heads_method": "minimal", "heads_residual": h.residual, **_report_keys(h, st)}
    assert "fewest found; bound 3 (dimension count (generic data))" in _line(r)
    assert _lsq_heads(sol.coef, 3, 3, 8, max_nfev=1000) >= 1e-5  # the best 3-head fit stays ~2e-4 away
    h3 = search_heads(st, sol.coef, 3)
    # heads=3: the lowest training loss, so no closer in coefficients than the best coefficient fit (~1.9e-4)
    assert not h3.exact and h3.residual >= 1.9e-4 and h3.loss_gap > 0


# ---- tight counts, H (a + b - H) = psi d_out: finitely many models over C, real ones for some data ------------
def _tight(d_max):
    """(d, d_out, H) with H (d_out d + d^2 - H) = psi d_out and H < min(d_out d, d^2), psi = d^2 (d + 1) / 2:
    solved for d_out, d_out d (psi / d - H) = H (d^2 - H), which needs H < psi / d, so the list is complete."""
    out = []
    for d in range(1, d_max + 1):
        half = d * (d + 1) // 2
        for H in range(1, half):
            num, den = H * (d * d - H), d * (half - H)
            if num % den == 0 and H < min(num // den * d, d * d):
                out.append((d, num // den, H))
    return sorted(out)


#: data on which the search used to stop one head above a tight count that its own ``heads=H`` (or more starts)
#: reaches exactly
TIGHT_MISSED = {(4, 2): (11, 22), (4, 8): (7,), (5, 6): (8,)}


def test_tight_counts_are_the_dimension_count():
    tight = _tight(8)
    assert tight == [(2, 2, 2), (3, 2, 3), (4, 2, 4), (4, 8, 8), (5, 2, 5), (5, 6, 10), (6, 2, 6), (6, 18, 18),
                     (7, 2, 7), (7, 5, 14), (7, 12, 21), (8, 2, 8), (8, 10, 24), (8, 32, 32)]
    for d in range(1, 9):  # a brute-force scan of d_out finds the same
        scan = [(d, o, H) for o in range(1, 200) for H in range(1, min(o * d, d * d))
                if H * (o * d + d * d - H) == n_features(d) * o]
        assert scan == [t for t in tight if t[0] == d]
    for d, d_out, H in tight:
        if n_features(d) * d_out <= 500:  # the Jacobian check: the image is full-dimensional at H, not below
            assert generic_heads_bound(d, d_out) == H
            assert image_dimension(d, d_out, H) == n_features(d) * d_out


@pytest.mark.slow
@pytest.mark.parametrize("d,d_out,H", [t for t in _tight(6) if n_features(t[0]) * t[1] <= 500])
def test_minimal_heads_at_a_tight_count_stop_above_it_only_when_no_model_is_found(d, d_out, H):
    """At a tight count the search meets the bound ("minimal: yes") where an exact H-head model exists; it returns
    H + 1 only where independent least squares from 8 starts and its own ``heads=H`` find none (d = 3, d_out = 2,
    seed 0: no real 3-head model). The seeds of TIGHT_MISSED used to give H + 1 with an H-head model found by
    ``heads=H`` or by more starts."""
    missed = TIGHT_MISSED.get((d, d_out), ())
    for seed in (0, 1, 2, *missed):
        z, y = _agnostic(d, d_out, seed=seed)
        st, sol = _fit(z, y)
        h = search_heads(st, sol.coef, "minimal", budget=None)  # no budget: the same result on a loaded machine
        assert h.exact and h.lower_bound == H  # (2, 2): both bounds are 2
        assert h.n_heads in (H, H + 1) and _forward_matches(h, sol.coef, d) <= 1e-10
        r = {"n_heads": h.n_heads, "heads_method": h.method, "heads_residual": h.residual, **_report_keys(h, st)}
        if h.n_heads == H:
            assert h.meets_bound and f"minimal: yes, meets the bound {H} (" in _line(r)
        else:
            assert seed not in missed and not h.meets_bound and f"fewest found; bound {H}" in _line(r)
            assert _lsq_heads(sol.coef, d, H, 8, max_nfev=1000) >= 1e-6
            assert not search_heads(st, sol.coef, H, budget=None).exact
        if seed in missed:  # heads=H finds the model too (it used to return a lossy one on some of these)
            hH = search_heads(st, sol.coef, H, budget=None)
            assert hH.n_heads == H and hH.exact and hH.residual <= 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("d,d_out,heads", [(4, 2, 3), (4, 2, 4), (5, 2, 4), (4, 8, 6), (4, 8, 8), (5, 6, 9)])
def test_teachers_between_the_flattening_and_the_tight_count_are_found(d, d_out, heads):
    """Teachers with more heads than min(d, d_out) (the flattening bound cannot tell) up to the tight count: the
    search returns the teacher's count or fewer, exactly, on several teachers."""
    for seed in range(3):
        D = make_mhla(d=d, heads=heads, d_out=d_out, length=20, samples=max(100, n_features(d)), causal=True,
                      seed=100 * seed + d + heads)
        st = statistics_from_arrays(D["tokens"], D["targets"])
        sol = solve(st)
        h = search_heads(st, sol.coef, "minimal", budget=None)
        assert h.exact and h.n_heads <= heads
        assert np.linalg.norm(coef_from_heads(h.V, h.Q) - coef_from_heads(D["V"], D["Q"])) <= 1e-9 * np.linalg.norm(
            sol.coef)


@pytest.mark.slow
@pytest.mark.parametrize("d,d_out,expected", [(6, 6, 13), (8, 3, 12), (8, 8, 22)])
def test_minimal_heads_meet_the_bound_at_larger_d(d, d_out, expected):
    z, y = _agnostic(d, d_out)
    st, sol = _fit(z, y)
    t = time.perf_counter()
    h = search_heads(st, sol.coef, "minimal", budget=None)
    TIMINGS[(d, d_out)] = time.perf_counter() - t
    assert h.n_heads == expected == h.lower_bound and h.meets_bound and h.lower_bound_kind == KIND_GENERIC
    assert _forward_matches(h, sol.coef, d) <= 1e-10
    losses = [v for _, v in h.curve]
    assert [k for k, _ in h.curve] == list(range(1, expected + 1)) and np.all(np.diff(losses) <= 1e-12 * st.yy)


# ---- teachers: exactly their head count ---------------------------------------------------------------
@pytest.mark.parametrize("d,d_out,H,kind", [(3, 3, 3, KIND_EVERY_C), (4, 4, 4, KIND_EVERY_C),
                                            (5, 3, 2, KIND_EVERY_C), (4, 4, 5, None), (5, 3, 4, None)])
def test_teacher_heads_recovered_exactly(d, d_out, H, kind):
    D = make_mhla(d=d, heads=H, d_out=d_out, length=20, samples=max(100, n_features(d)), causal=True, seed=d + H)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    sol = solve(st)
    h = search_heads(st, sol.coef, "minimal")
    assert h.n_heads == H and h.exact
    assert np.linalg.norm(coef_from_heads(h.V, h.Q) - coef_from_heads(D["V"], D["Q"])) <= 1e-9 * np.linalg.norm(
        sol.coef)
    # fewer heads than the dimension count: the coefficients are not generic, the every-c bound is reported
    assert h.lower_bound_kind == KIND_EVERY_C and h.lower_bound == min(H, d, d_out)
    assert h.meets_bound == (kind is not None)  # H <= min(d, d_out): the flattening proves H is minimal
    r = {"n_heads": h.n_heads, "heads_method": h.method, "heads_residual": h.residual, **_report_keys(h, st)}
    assert ("minimal: yes, meets the bound" in _line(r)) == h.meets_bound


def _report_keys(h, st):
    from scaleattn.pipeline import _heads_search_report

    return _heads_search_report(h, st.n_rows * st.d_out)


# ---- heads=H: exact when H heads suffice, else the best lossy model and how far it is -------------------
def test_heads_h_exact_when_enough_else_lossy_with_its_gap():
    d, d_out = 3, 3
    z, y = _agnostic(d, d_out, seed=1)
    st, sol = _fit(z, y)
    h4 = search_heads(st, sol.coef, 4)
    assert h4.n_heads == 4 and h4.exact and h4.method == "best-4" and h4.residual <= 1e-10
    h6 = search_heads(st, sol.coef, 6)  # at most 6: the fewest exact
    assert h6.n_heads == 4 and h6.exact
    h3 = search_heads(st, sol.coef, 3)
    assert h3.n_heads == 3 and not h3.exact and h3.residual > 1e-3 and not h3.meets_bound
    assert h3.lower_bound == 4 and h3.lower_bound_kind == KIND_GENERIC
    # its loss gap is the data-pass MSE difference to numpy's least squares on the explicit features
    s, x = token_features(z, causal=True)
    F, Y = phi(s, x), row_targets(y, causal=True)
    c_ls = np.linalg.lstsq(F, Y, rcond=None)[0]
    mse_ls = np.mean((F @ c_ls - Y) ** 2)
    mse_h3 = np.mean((mhla_forward(h3.V, h3.Q, z, causal=True).reshape(Y.shape) - Y) ** 2)
    n_out = Y.size
    assert h3.loss_gap / n_out == pytest.approx(mse_h3 - mse_ls, rel=1e-6)
    assert h3.sse / n_out == pytest.approx(mse_h3, rel=1e-9)
    # no worse than the naive model (the paper's heads truncated to 3) or than independent least squares on the loss
    sv = svd_heads(sol.coef, d)
    assert mse_h3 <= np.mean((mhla_forward(sv.V[:3], sv.Q[:3], z, causal=True).reshape(Y.shape) - Y) ** 2)
    assert h3.curve[-1] == (3, h3.sse) and [k for k, _ in h3.curve] == [1, 2, 3]
    # the report keys and the summary line
    model, sol2, h = model_from_statistics(st, True, 3)
    assert not np.allclose(model.coef, sol2.coef) and h.n_heads == 3
    r = {"n_heads": 3, "heads_method": "best-3", "heads_residual": h3.residual, **_report_keys(h3, st)}
    assert "lossy: no exact 3-head model found (exact needs >= 4: dimension count (generic data))" in _line(r)
    r4 = {"n_heads": 4, "heads_method": "best-4", "heads_residual": h4.residual, **_report_keys(h4, st)}
    assert "minimal: yes, meets the bound 4 (dimension count (generic data))" in _line(r4)


@pytest.mark.slow
def test_with_a_ridge_the_search_measures_the_ridge_objective(causal_ds, tmp_path):
    """After a ridge fit the loss of the curve and of the gap is what the fit minimised, ||F c - Y||^2 +
    ridge sum_j (F^T F)_jj ||c_j||^2 on the explicit features: every H-head model is at or above the ridge fit's
    value, the curve ends at the returned model's, and ``sse`` stays the heads' own sum of squares. With the plain
    training loss the 1-head model of a 1-head teacher fitted with a ridge was below the returned model (the
    curve never reached the fit it was drawn for)."""
    import scaleattn
    from scaleattn.plot import loss_vs_heads_figure
    from scaleattn.run import read_run
    from scaleattn.store._formats import loss_curve

    d, d_out, lam = 3, 3, 1e-3
    z, y = _agnostic(d, d_out, seed=1)
    st = statistics_from_arrays(z, y)
    sol = solve(st, ridge=lam)
    s, x = token_features(z, causal=True)
    F, Y = phi(s, x), row_targets(y, causal=True)
    dg = np.einsum("ij,ij->j", F, F)

    def objective(c):
        return float(np.sum((F @ c - Y) ** 2) + lam * np.sum(dg[:, None] * c**2))

    J = objective(sol.coef)
    assert sol.objective(st.gram()) == pytest.approx(J, rel=1e-9)
    for H in (2, 3, 4):
        h = search_heads(st, sol.coef, H, ridge=lam)
        c = coef_from_heads(h.V, h.Q)
        values = [v for _, v in h.curve]
        assert h.ridge == lam and values == sorted(values, reverse=True)
        assert min(values) >= J * (1 - 1e-9)  # nothing beats what the ridge fit minimised
        assert values[-1] == pytest.approx(objective(c), rel=1e-8)
        assert h.loss_gap == pytest.approx(objective(c) - J, rel=1e-6, abs=1e-9 * J)
        assert h.sse == pytest.approx(float(np.sum((F @ c - Y) ** 2)), rel=1e-9)
    assert h.exact and values[-1] == pytest.approx(J, rel=1e-8)  # 4 heads reproduce the ridge coefficients
    # the fit's report: the curve's entries and the objective it reaches, read back and labelled as such
    with threadpool_limits(limits=1):
        scaleattn.fit(causal_ds, tmp_path / "run", heads=2, ridge=1e-4)
    r = read_run(tmp_path / "run")["report"]  # (its validation knows the entries' key)
    assert (tmp_path / "run" / "loss_vs_heads.png").is_file()
    assert loss_vs_heads_figure(r["loss_vs_heads"]).axes[0].get_ylabel() == "train MSE + ridge penalty"
    what, points = loss_curve(r["loss_vs_heads"])
    assert what == "train MSE + ridge penalty" and len(points) == 2
    assert points[-1][1] == pytest.approx(r["train_objective_stats"], rel=1e-8)
    assert min(v for _, v in points) >= r["train_objective_stats"] * (1 - 1e-9) > r["lstsq_train_mse_stats"]
    assert "loss vs heads (train MSE + ridge penalty, from the statistics): " in scaleattn.display._text.fit_summary(r)
    plain = scaleattn.fit(causal_ds, heads=2, plots=False).report
    assert "train_objective_stats" not in plain and loss_curve(plain["loss_vs_heads"])[0] == "train MSE"


def test_summary_labels_say_which_loss_and_which_coefficients(causal_groups_ds):
    """A user's report: `||c - c_teacher||` was the fit's distance in one run and the H-head model's in another,
    `train MSE +x` after a ridge fit was the gap in the ridge objective, and `loss vs heads (train MSE)` under the
    measured train MSE line came from the statistics: each label now names what it is, checked against the
    numbers computed here."""
    import scaleattn
    from scaleattn.display._text import fit_summary
    from scaleattn.heads._algebra import coef_distance

    V, Q = causal_groups_ds.teacher()  # a 2-head teacher: 1 head cannot reproduce the fit
    teacher = coef_from_heads(V, Q)
    lossy = scaleattn.fit(causal_groups_ds, heads=1, plots=False, exact_mse=False)
    r = lossy.report
    assert not r["heads_exact"]
    heads_d, fit_d = coef_distance(lossy.model.coef, teacher), coef_distance(lossy.solution.coef, teacher)
    assert r["teacher_coef_distance"] == pytest.approx(heads_d, rel=1e-9) and heads_d > 1e3 * fit_d
    text = fit_summary(r)
    assert f"||c_H - c_teacher|| (the 1-head model) = {heads_d:.3g}" in text
    assert f"train MSE +{r['heads_loss_gap']:.3g}" in text
    exact = scaleattn.fit(causal_groups_ds, heads="minimal", plots=False, exact_mse=False).report
    assert f"||c - c_teacher|| = {exact['teacher_coef_distance']:.3g}" in fit_summary(exact)
    assert "loss vs heads (train MSE, from the statistics): 1:" in fit_summary(exact)
    assert exact["teacher_coef_distance"] < 1e-8  # the fit's own coefficients (the heads reproduce them)
    ridge = scaleattn.fit(causal_groups_ds, heads=1, ridge=1e-3, plots=False, exact_mse=False).report
    gap = ridge["heads_loss_gap"]  # what the summary prints: the objective's gap, not the MSE's
    assert gap == pytest.approx(ridge["loss_vs_heads"][-1]["train_objective_stats"] - ridge["train_objective_stats"],
                                rel=1e-6)
    assert f"ridge objective +{gap:.3g}" in fit_summary(ridge) and "train MSE +" not in fit_summary(ridge)


def _line(r):
    from scaleattn.display._text import heads_line as _heads_line

    return _heads_line(r)


def test_fewest_found_line_and_svd_line():
    D = make_mhla(d=4, heads=5, length=20, samples=100, causal=True, seed=9)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    sol = solve(st)
    h = search_heads(st, sol.coef, "minimal")
    r = {"n_heads": h.n_heads, "heads_method": h.method, "heads_residual": h.residual, **_report_keys(h, st)}
    assert h.n_heads == 5 and "fewest found; bound 4 (flattening rank (every c))" in _line(r)
    s = search_heads(st, sol.coef, "svd")
    rs = {"n_heads": s.n_heads, "heads_method": "svd", "heads_residual": s.residual, **_report_keys(s, st)}
    assert s.n_heads == 16 and s.lower_bound == 4
    assert "bound 4 (flattening rank (every c); --heads minimal for the fewest)" in _line(rs)


# ---- progress and the flat loss curve (noisy data: "minimal" is the generic bound) ------------------------
def _noisy_teacher():
    """A 2-head teacher at d = d_out = 3 with target noise: "minimal" gives the generic bound 4, 2 heads nearly do."""
    D = make_mhla(d=3, heads=2, length=20, samples=400, causal=True, noise=0.01, seed=0)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    s, x = token_features(D["tokens"], None, True)
    P, Y = phi(s, x), row_targets(D["targets"], None, True)
    return st, solve(st).coef, P, Y, float(np.mean((P @ np.linalg.lstsq(P, Y, rcond=None)[0] - Y) ** 2))


def test_the_search_says_the_head_count_it_tries_and_the_best_losses_so_far():
    """--heads minimal on noisy d = 8 data ran 45 s with no sign of what it tried: the search tells ``progress``
    the head count, the step and the best losses so far (the exact model's is the least-squares MSE: numpy lstsq
    on the explicit features)."""
    st, coef, P, Y, mse_ref = _noisy_teacher()
    msgs = []
    h = search_heads(st, coef, "minimal", progress=msgs.append)
    assert h.n_heads == 4 and msgs[0] == "trying 4 heads (exact fit, start 1 of 4)"
    assert {int(m.split()[1]) for m in msgs} == {1, 2, 3, 4}  # the bound, then the curve and a bisection below it
    assert all(f"so far: exact with 4 heads, train MSE {mse_ref:.4g}" in m for m in msgs[1:])
    two = next(m for m in msgs if m.startswith("trying 2 heads (loss curve)"))
    assert two.endswith(f", 1 head train MSE {h.curve[0][1] / Y.size:.4g}")  # the loss curve's lowest so far
    assert search_heads(st, coef, "minimal").curve == h.curve  # listening changes nothing


def test_a_flat_loss_curve_names_the_fewest_heads_within_the_relative_gap():
    """The curve of the 4 heads flattens at the teacher's 2: ``fewer_within`` names 2 with its relative gap,
    and ``--heads 2`` does reach it (its MSE on the explicit features against numpy lstsq's)."""
    from scaleattn.display._text import fit_summary
    from scaleattn.heads._algebra import FEWER_HEADS_RTOL

    st, coef, P, Y, mse_ref = _noisy_teacher()
    h = search_heads(st, coef, "minimal")
    few = h.fewer_within()
    assert h.n_heads == 4 and few["heads"] == 2 and few["rtol"] == FEWER_HEADS_RTOL
    h2 = search_heads(st, coef, 2)
    gap2 = (np.mean((P @ coef_from_heads(h2.V, h2.Q) - Y) ** 2) - mse_ref) / mse_ref
    assert not h2.exact and 0 < gap2 <= few["relative_gap"] * (1 + 1e-6) and few["relative_gap"] <= FEWER_HEADS_RTOL
    assert (h.curve[0][1] - h.curve[-1][1]) / h.curve[-1][1] > FEWER_HEADS_RTOL  # 1 head is far off: not named
    assert h.fewer_within(floor=h.curve[-1][1]) is None  # a loss at its round-off: relative gaps mean nothing
    assert h.fewer_within(rtol=few["relative_gap"] / 2)["heads"] == 3
    keys = _report_keys(h, st)
    r = {"n_rows": st.n_rows, "n_samples": 400, "length": 20, "causal": True, "d": 3, "d_out": 3, "psi": 18,
         "rank": 18, "cutoff_rtol": 1e-14, "lambda_min": 1.0, "lambda_max": 1.0, "identifiable": True,
         "ambiguous_dim": 0, "train_mse": mse_ref, "relative_train_mse": 0.1, "target_mean_square": 1.0,
         "n_heads": 4, "heads_method": "minimal", "heads_residual": h.residual, "seconds": 0.0, **keys,
         "loss_vs_heads": [{"heads": k, "train_mse_stats": v / Y.size} for k, v in h.curve]}
    assert keys["heads_fewer_within"] == few
    want = f"fewer heads: 2 heads come within {100 * few['relative_gap']:.2g} % of the train MSE of these 4 (--heads 2)"
    assert want in fit_summary(r).splitlines()
    assert "fewer heads:" not in fit_summary({**r, "heads_fewer_within": None})


def test_the_fit_card_names_the_fewest_heads_within_the_relative_gap():
    """The notebook card of a fit left out the summary's ``fewer heads: ...`` hint."""
    from scaleattn.display._html import fit_html

    st, coef, P, Y, mse_ref = _noisy_teacher()
    h = search_heads(st, coef, "minimal")
    few = h.fewer_within()
    r = {"n_rows": st.n_rows, "n_samples": 400, "length": 20, "causal": True, "d": 3, "d_out": 3, "psi": 18,
         "rank": 18, "cutoff_rtol": 1e-14, "lambda_min": 1.0, "lambda_max": 1.0, "identifiable": True,
         "ambiguous_dim": 0, "train_mse": mse_ref, "relative_train_mse": 0.1, "target_mean_square": 1.0,
         "n_heads": 4, "heads_method": "minimal", "heads_residual": h.residual, "seconds": 0.0,
         **_report_keys(h, st), "loss_vs_heads": [{"heads": k, "train_mse_stats": v / Y.size} for k, v in h.curve]}
    card = fit_html(r)
    want = (f"fewer heads: 2 heads come within {100 * few['relative_gap']:.2g} % of the train MSE of these 4"
            " (<code>heads=2</code>)")
    assert want in card, card
    assert "fewer heads:" not in fit_html({**r, "heads_fewer_within": None})


# ---- budget, determinism, loss_vs_heads, fit_heads ---------------------------------------------------------
def test_budget_runs_out_and_says_so():
    z, y = _agnostic(5, 3, seed=2)
    st, sol = _fit(z, y)
    h = search_heads(st, sol.coef, "minimal", budget=1e-4)
    assert h.budget_exhausted and h.exact  # out of time before any search: the paper's heads, still exact
    assert h.n_heads == 15 and not h.meets_bound and h.seconds < 5
    r = {"n_heads": h.n_heads, "heads_method": h.method, "heads_residual": h.residual, **_report_keys(h, st)}
    assert "search budget ran out" in _line(r)
    h2 = search_heads(st, sol.coef, 3, budget=1e-4)
    assert h2.budget_exhausted and h2.n_heads == 3 and not h2.exact and h2.loss_gap > 0
    with pytest.raises(ValueError, match="budget"):
        search_heads(st, sol.coef, "minimal", budget=0)
    with pytest.raises(ValueError, match="heads"):
        search_heads(st, sol.coef, "fewest")


def test_search_is_deterministic():
    z, y = _agnostic(4, 2, seed=3)
    st, sol = _fit(z, y)
    a, b = search_heads(st, sol.coef, "minimal"), search_heads(st, sol.coef, "minimal")
    assert a.n_heads == b.n_heads == 4 and np.array_equal(a.V, b.V) and np.array_equal(a.Q, b.Q)
    assert a.curve == b.curve


def test_loss_vs_heads_from_the_statistics_alone():
    D = make_mhla(d=3, heads=2, length=20, samples=150, causal=True, noise=0.2, seed=11)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    models = loss_vs_heads(st, 4)  # no coefficients passed: G^+ B from the statistics
    sol = solve(st)
    losses = [m.sse for m in models]
    assert [m.n_heads for m in models] == [1, 2, 3, 4]
    assert np.all(np.diff(losses) <= 1e-12 * st.yy) and losses[-1] == pytest.approx(sol.sse, rel=1e-9)
    n_out = st.n_rows * st.d_out
    for m in models[:2]:
        r = mhla_forward(m.V, m.Q, D["tokens"], causal=True) - D["targets"]
        assert m.sse / n_out == pytest.approx(float(np.mean(r * r)), rel=1e-8)


def test_fit_heads_coefficients_and_loss():
    rng = np.random.default_rng(5)
    c = rng.standard_normal((n_features(4), 2))  # generic coefficients, d = 4, d_out = 2: 4 heads
    assert generic_heads_bound(4, 2) == 4
    h = fit_heads(c, 4, 4)
    assert h.exact and h.residual <= 1e-10 and _forward_matches(h, c, 4) <= 1e-11
    assert not fit_heads(c, 4, 3).exact
    with pytest.raises(ValueError, match="heads"):
        fit_heads(c, 4, 9)


def test_fit_heads_from_a_given_start_and_on_the_loss():
    D = make_mhla(d=3, heads=2, d_out=2, length=20, samples=120, causal=True, noise=0.1, seed=4)
    st = statistics_from_arrays(D["tokens"], D["targets"])
    sol = solve(st)
    G = st.gram()
    h = fit_heads(sol.coef, 3, 3, Q0=D["Q"][[0, 1, 1]] + 0.1, starts=1)  # only the given Q (V eliminated)
    assert h.exact and h.n_heads == 3 and _forward_matches(h, sol.coef, 3) <= 1e-11
    hl = fit_heads(sol.coef, 3, 2, gram=G, starts=3)  # the training loss: better than the teacher's 2 heads
    gap = st.sse(coef_from_heads(hl.V, hl.Q), G) - sol.sse
    assert 0 <= gap <= st.sse(coef_from_heads(D["V"], D["Q"]), G) - sol.sse
