"""K-FAC on the krylov path over the compact Gram: the partial traces read from ``Tc`` tile by tile against the ones
of the dense (Jacobi-scaled) Gram, the preconditioner against ``np.kron`` of them, and the solve with it against
min-norm least squares on the explicit features, with the same verdict as the dense path."""
from __future__ import annotations

import numpy as np
import pytest

from scaleattn.distributed.partition import tile_bounds
from scaleattn.errors import ParameterError
from scaleattn.features import n_pairs
from scaleattn.generate import make_mhla
from scaleattn.linalg import _solver as solver
from scaleattn.linalg._gram import GramOperator, partial_trace_factors, tile_partial_traces
from scaleattn.linalg._kfac import TraceKFAC
from scaleattn.linalg._krylov import krylov_solve, preconditioner_for
from scaleattn.linalg._spectrum import default_rtol
from scaleattn.statistics._container import statistics_from_arrays


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _dense_phi(tokens, causal=False):
    """Explicit features, independent of scaleattn.features: row (P, l) = vech(sum_t z z^T)_P x_l."""
    n, T, d = tokens.shape
    I, J = np.triu_indices(d)
    ends = range(1, T + 1) if causal else [T]
    rows = []
    for t in ends:
        S = np.einsum("ntj,ntk->njk", tokens[:, :t], tokens[:, :t])
        rows.append(np.einsum("rp,rl->rpl", S[:, I, J], tokens[:, t - 1]).reshape(n, -1))
    return np.concatenate(rows, axis=0)


def _scaled_traces(G, d):
    m = n_pairs(d)
    dg = np.diag(G)
    s = np.where(dg > 0, 1 / np.sqrt(np.where(dg > 0, dg, 1)), 0)
    G4 = (G * s[:, None] * s[None, :]).reshape(m, d, m, d)
    return np.einsum("plql->pq", G4), np.einsum("plpk->lk", G4), s


@pytest.mark.parametrize("d,causal", [(3, False), (4, True), (5, True)])
def test_partial_traces_from_tiles_match_the_dense_gram(d, causal):
    """A' = sum_l G[(P,l),(Q,l)] and B' = sum_P G[(P,l),(P,l')] (of G and of S G S) from any tiling of Tc: the
    per-tile partials add up to the einsum over the dense G (feature (P, l) at P d + l); TraceKFAC applies
    exactly the inverse of kron(A's, B's) / tr(Gs) (scaled) and S^-1 of it S^-1 (original coordinates)."""
    D = make_mhla(d=d, heads=2, length=7, samples=30, causal=causal, variable_lengths=True, seed=1)
    st = statistics_from_arrays(D["tokens"], D["targets"], D["lengths"], causal)
    G, m = st.gram(), n_pairs(d)
    G4 = G.reshape(m, d, m, d)
    A_ref, B_ref = np.einsum("plql->pq", G4), np.einsum("plpk->lk", G4)
    As_ref, Bs_ref, s = _scaled_traces(G, d)
    for rows in (1, 5, 10_000):
        for scale, (a_ref, b_ref) in ((None, (A_ref, B_ref)), (s, (As_ref, Bs_ref))):
            T = sum(tile_partial_traces(st.gram_compact[a:b], a, d, scale) for a, b in tile_bounds(d, tile_rows=rows))
            A, B = partial_trace_factors(T, d)
            assert A.shape == (m, m) and B.shape == (d, d)
            assert rel(A, a_ref) <= 1e-14 and rel(B, b_ref) <= 1e-14
    op = GramOperator.from_compact(st.gram_compact, d, tile_rows=4)
    A, B = op.partial_traces(s)
    assert rel(A, As_ref) <= 1e-14 and rel(B, Bs_ref) <= 1e-14
    M = preconditioner_for(op, "kfac")
    assert isinstance(M, TraceKFAC) and M.name == "kfac"
    Ms = np.kron(As_ref, Bs_ref) / st.psi  # tr(Gs) = psi (no all-zero features here)
    E = np.eye(st.psi)
    assert rel(M.apply_scaled(E), np.linalg.inv(Ms)) <= 1e-10
    assert rel(M.apply(E), np.linalg.inv(Ms / s[:, None] / s[None, :])) <= 1e-10
    L1, LT = M.half_inverse(E), M.half_inverse(E, transpose=True)  # M = L L^T
    assert rel(LT @ L1, M.apply(E)) <= 1e-10
    H = M.half(E)  # L itself: L L^T = M, L^-1 L = I
    assert rel(H @ H.T, np.linalg.inv(M.apply(E))) <= 1e-9 and rel(L1 @ H, E) <= 1e-10
    lo_s, lo = M.min_eigenvalues()
    assert 0 < lo_s <= np.linalg.eigvalsh(Ms)[0] * (1 + 1e-10)
    assert 0 < lo <= np.linalg.eigvalsh(Ms / s[:, None] / s[None, :])[0] * (1 + 1e-10)


def _kronecker_tc(d, seed=0):
    """A compact Gram whose G is exactly kron(A, B) (Tc = vech(A) vech(B)^T), A, B SPD of unequal diagonals."""
    rng = np.random.default_rng(seed)
    m = n_pairs(d)
    Fa, Fb = rng.standard_normal((m, m + 2)), rng.standard_normal((d, d + 2))
    A = (Fa @ Fa.T) * np.outer(np.geomspace(1, 30, m), np.geomspace(1, 30, m))
    B = (Fb @ Fb.T) * np.outer(np.geomspace(1, 100, d), np.geomspace(1, 100, d))
    Im, Jm = np.triu_indices(m)
    Id, Jd = np.triu_indices(d)
    return np.outer(A[Im, Jm], B[Id, Jd]), A, B


def test_kfac_is_exact_on_a_kronecker_gram_and_a_wrong_ordering_is_caught():
    """On G = A (x) B the traces give M = G: CG converges in a step or two (verdict, coefficients = solve(G, b));
    the same factors with the pair coordinates in another order (what a wrong vech map reading Tc would give)
    leave many more iterations (26 against 2); and the dense np.kron check fails for them."""
    d = 5
    Tc, A, B = _kronecker_tc(d)
    op = GramOperator.from_compact(Tc, d, tile_rows=7)
    G = np.kron(A, B)
    assert rel(op @ np.eye(op.psi), G) <= 1e-14  # the construction is what it says
    b = np.random.default_rng(1).standard_normal((op.psi, 2))
    good = preconditioner_for(op, "kfac")
    assert rel(good.apply(G), np.eye(op.psi)) <= 1e-9
    sol = krylov_solve(op, b, rtol=default_rtol(op.psi), preconditioner=good)
    assert sol.iterations <= 3 and sol.converged.all() and sol.spectrum.rank == op.psi
    assert rel(sol.coef, np.linalg.solve(G, b)) <= 1e-9
    As, Bs = op.partial_traces(good.scale)
    perm = np.random.default_rng(2).permutation(n_pairs(d))
    wrong = TraceKFAC(As[perm][:, perm], Bs, op.diagonal())
    assert rel(wrong.apply(G), np.eye(op.psi)) > 0.1
    bad = krylov_solve(op, b, rtol=default_rtol(op.psi), preconditioner=wrong)
    assert bad.iterations >= 5 * max(sol.iterations, 2)


def _solve_both(tok, y, causal=False):
    st = statistics_from_arrays(tok, y, None, causal)
    return st, solver.solve(st, solver="eigh"), solver.solve(st, solver="krylov", krylov={"preconditioner": "kfac"})


@pytest.mark.parametrize("case", ["causal", "scaled-x100", "plane", "zero-coordinate"])
def test_krylov_with_kfac_matches_dense_lstsq_and_verdict(case):
    """The krylov solve with K-FAC: min-norm least squares on the explicit features to 1e-9, the dense path's
    rank and verdict, whether the Gram is well posed, badly scaled (one token coordinate x100) or singular."""
    rng = np.random.default_rng(3)
    causal = case == "causal"
    if case in ("causal", "scaled-x100"):
        D = make_mhla(d=4, heads=2, length=10 if causal else 6, samples=40 if causal else 300, causal=causal, seed=0)
        tok, y = D["tokens"].copy(), D["targets"]
        if case == "scaled-x100":
            tok[..., 0] *= 100
    else:
        tok = rng.standard_normal((300, 5, 3))
        if case == "plane":
            tok[..., 2] = tok[..., 0] - 2 * tok[..., 1]
        else:
            tok[..., 1] = 0.0
        y = rng.standard_normal((300, 2))
    st, dense, kf = _solve_both(tok, y, causal)
    P = _dense_phi(tok, causal)
    Y = np.concatenate([y[:, t] for t in range(y.shape[1])], axis=0) if causal else y
    c_ref = np.linalg.lstsq(P, Y, rcond=1e-10)[0]
    assert kf.rank == dense.rank == np.linalg.matrix_rank(P, tol=1e-10 * np.linalg.norm(P, 2))
    assert kf.certificate.verdict == dense.certificate.verdict
    assert kf.certificate.identifiable == (case in ("causal", "scaled-x100"))
    assert rel(kf.coef, c_ref) <= 1e-9 and rel(kf.coef, dense.coef) <= 1e-9


def test_unknown_preconditioner_is_refused():
    rng = np.random.default_rng(0)
    st = statistics_from_arrays(rng.standard_normal((40, 4, 2)), rng.standard_normal((40, 1)))
    with pytest.raises(ParameterError, match="block-jacobi, kfac"):
        solver.solve(st, solver="krylov", krylov={"preconditioner": "kfca"})


def test_partial_traces_take_the_array_api():
    """The tile partials are array-API code: a strict array gives the numpy values (the scaled traces)."""
    xs = pytest.importorskip("array_api_strict")
    st = statistics_from_arrays(np.random.default_rng(0).standard_normal((50, 4, 3)))
    s = 1 / np.sqrt(np.diag(st.gram()))
    A, B = partial_trace_factors(tile_partial_traces(xs.asarray(st.gram_compact[3:]), 3, 3, xs.asarray(s)), 3)
    A_ref, B_ref, _ = _scaled_traces(st.gram(), 3)
    A0, B0 = partial_trace_factors(tile_partial_traces(st.gram_compact[3:], 3, 3, s), 3)
    assert isinstance(A, xs._array_object.Array) and A.shape == (6, 6) and B.shape == (3, 3)
    assert np.array_equal(np.asarray(A), A0) and np.array_equal(np.asarray(B), B0)
    A1, B1 = partial_trace_factors(tile_partial_traces(st.gram_compact[:3], 0, 3, s), 3)
    assert rel(A0 + A1, A_ref) <= 1e-14 and rel(B0 + B1, B_ref) <= 1e-14
