"""The torch models of the baselines: MHLA with the teacher's heads is DESIGN §1 (padding, causal, fused), two
layers match numpy, mismatched models are refused."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from scaleattn import baselines as B  # noqa: E402
from scaleattn.generate import make_mhla, mhla_forward  # noqa: E402
from scaleattn.heads._algebra import coef_from_heads  # noqa: E402


def _set_heads(model, V, Q):
    with torch.no_grad():
        model.V[0].copy_(torch.as_tensor(V))
        model.Q[0].copy_(torch.as_tensor(Q))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_mhla_forward_is_design_s1(causal, fused):
    # teacher heads loaded into the torch model reproduce the numpy teacher (DESIGN §1, no 1/n) with padding
    D = make_mhla(3, 2, 9, 12, d_out=2, causal=causal, variable_lengths=True, seed=3)
    m = B.MHLA(3, 2, heads=2, causal=causal, fused=fused)
    _set_heads(m, D["V"], D["Q"])
    with torch.no_grad():
        y = m(torch.as_tensor(D["tokens"]), torch.as_tensor(D["lengths"])).numpy()
    np.testing.assert_allclose(y, D["targets"], rtol=0, atol=1e-13)
    np.testing.assert_allclose(m.coef(), coef_from_heads(D["V"], D["Q"]), atol=1e-15)
    assert B.model_mse(m, D) < 1e-28 and B.coef_mse(m.coef(), D) < 1e-28


def test_two_layer_forward_matches_numpy():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((4, 6, 3)) / 3
    m = B.MHLA(3, 1, heads=2, layers=2, causal=True, seed=1)
    V0, Q0, V1, Q1 = (p.detach().numpy() for p in (m.V[0], m.Q[0], m.V[1], m.Q[1]))
    z1 = z + mhla_forward(V0, Q0, z, causal=True)  # residual first layer
    ref = mhla_forward(V1, Q1, z1, causal=True)
    with torch.no_grad():
        np.testing.assert_allclose(m(torch.as_tensor(z)).numpy(), ref, atol=1e-14)
    with pytest.raises(ValueError, match="one-layer"):
        m.coef()


def test_mismatched_model_is_refused():
    D = make_mhla(2, 1, 8, 8, causal=True, seed=0)
    with pytest.raises(ValueError, match="causal"):
        B.train_adamw(B.MHLA(2, 2, causal=False), D, epochs=1)
    with pytest.raises(ValueError, match="kind"):
        B.make_model("rnn", 2)
