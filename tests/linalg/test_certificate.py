"""The identifiability certificate and its witness (DESIGN §5): lambda_min of associative-memory data, and two
models with equal training loss but different predictions when the data do not identify the model."""
import numpy as np

import scaleattn
from scaleattn.features import phi, token_features
from scaleattn.generate import make_assoc
from scaleattn.heads._algebra import compare_models, svd_heads
from scaleattn.linalg._certificate import ambiguity_witness
from scaleattn.model import MHLAModel
from scaleattn.statistics._container import statistics_from_arrays
from tests.helpers import solve_arrays


def test_associative_memory_certificate():
    cert = scaleattn.certify(statistics_from_arrays(make_assoc(2, 2**14, seed=0)["tokens"]))
    assert 0.06 <= cert.lambda_min <= 0.075 and cert.identifiable
    orth = scaleattn.certify(statistics_from_arrays(make_assoc(2, 2**14, orthogonal=True, seed=0)["tokens"]))
    assert not orth.identifiable and orth.ambiguous_dim > 0 and orth.lambda_min < 1e-12


def test_witness_orthogonal_associative_memory():
    D = make_assoc(2, 2048, orthogonal=True, seed=0)
    st, sol = solve_arrays(D)
    cert = sol.certificate
    assert not cert.identifiable and cert.ambiguous_dim == sol.null_basis.shape[1] > 0
    w = ambiguity_witness(sol, st)
    s, x = token_features(D["tokens"])
    F = phi(s, x)
    ya, yb = F @ w.coef_a, F @ w.coef_b
    ms = float(np.mean(D["targets"] ** 2))
    mse_a, mse_b = np.mean((ya - D["targets"]) ** 2), np.mean((yb - D["targets"]) ** 2)
    # equal training loss: on the data (independent pass) and as reported, relative to the target scale
    assert abs(mse_a - mse_b) <= 1e-10 * max(mse_a, mse_b, ms)
    r = w.summary()
    assert r["loss_relative_difference"] <= 1e-10 and abs(r["loss_a"] - r["loss_b"]) <= 1e-10 * ms
    assert np.max(np.abs(ya - yb)) <= 1e-10 * np.sqrt(ms)  # same predictions on every training sample
    # different predictions on the witness input, recomputed from the full W = p^-1(c) by a dense sum
    tok = np.asarray(r["tokens"])
    S, xl = tok.T @ tok, tok[-1]

    def dense(c):
        h = svd_heads(c, st.d)
        return np.einsum("haj,jk,hkl,l->a", h.V, S, h.Q, xl)

    pa, pb = dense(w.coef_a), dense(w.coef_b)
    assert np.allclose(pa, r["prediction_a"], atol=1e-12) and np.allclose(pb, r["prediction_b"], atol=1e-12)
    assert np.linalg.norm(pa - pb) >= 0.1 * np.sqrt(ms)
    # two models built from the witness really are different functions
    ma = MHLAModel(w.coef_a, *_vq(w.coef_a, st.d), st.d)
    mb = MHLAModel(w.coef_b, *_vq(w.coef_b, st.d), st.d)
    assert not compare_models(ma, mb)["equivalent"]
    # identifiable data (unit-norm Gaussian keys): no witness
    D2 = make_assoc(2, 2048, seed=1)
    st2, sol2 = solve_arrays(D2)
    assert sol2.certificate.identifiable and ambiguity_witness(sol2, st2) is None


def _vq(c, d):
    h = svd_heads(c, d)
    return h.V, h.Q
