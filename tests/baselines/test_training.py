"""AdamW baselines vs the closed-form fit: small sizes, independent references."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from scaleattn import baselines as B  # noqa: E402
from scaleattn.data._writer import write_dataset  # noqa: E402
from scaleattn.generate import make_mhla  # noqa: E402


@pytest.mark.slow
def test_adamw_decreases_loss_and_never_beats_the_fit():
    # noisy data: the fit's floor is ~noise^2, which AdamW can approach but (same function class) never pass
    tr = make_mhla(2, 1, 20, 96, causal=True, noise=0.02, seed=0)
    va = make_mhla(2, 1, 20, 32, causal=True, noise=0.02, teacher=(tr["V"], tr["Q"]), seed=[0, 1])
    cf = B.fit_closed_form(tr, va)
    assert cf["train_mse"] == pytest.approx(4e-4, rel=0.2)  # noise^2
    for m in (1, 4):
        r = B.train_adamw("mhla", tr, va, heads=m, epochs=8, lr=1e-2, batch_size=16, seed=m)
        assert len(r.train_mse) == len(r.val_mse) == len(r.wall_s) == 9
        excess = np.array(r.train_mse) - cf["train_mse"]
        assert excess[-1] < 0.5 * excess[0] and r.val_mse[-1] < r.val_mse[0]
        assert np.all(np.diff(r.wall_s) > 0)
        assert min(r.train_mse) >= cf["train_mse"] * (1 - 1e-9)
        # c(Theta) of the trained model evaluated through the cubic features gives the same loss
        assert B.coef_mse(r.model.coef(), tr) == pytest.approx(r.train_mse[-1], rel=1e-9)


def test_fit_at_float64_floor_on_realizable_data():
    tr = make_mhla(2, 1, 100, 64, causal=True, seed=1)
    cf = B.fit_closed_form(tr)
    ms = float(np.mean(tr["targets"] ** 2))
    assert cf["train_mse"] < 1e-25 * ms
    assert cf["certificate"].identifiable


@pytest.mark.slow
def test_softmax_transformer_trains_with_padding():
    D = make_mhla(2, 1, 8, 64, causal=False, variable_lengths=True, seed=2)
    r = B.train_adamw("full", D, epochs=6, lr=3e-3, batch_size=16, width=16, heads=2)
    assert r.train_mse[-1] < r.train_mse[0]
    Dc = make_mhla(2, 1, 8, 32, causal=True, seed=2)
    rc = B.train_adamw("full", Dc, epochs=3, lr=3e-3, batch_size=16, width=16, heads=2)
    assert rc.train_mse[-1] < rc.train_mse[0]
    # causal outputs must not see the future: changing the last token leaves earlier outputs unchanged
    z = torch.as_tensor(Dc["tokens"][:2]).clone()
    with torch.no_grad():
        a = rc.model(z)
        z[:, -1] += 1.0
        b = rc.model(z)
    np.testing.assert_allclose(a[:, :-1].numpy(), b[:, :-1].numpy(), atol=1e-12)


def test_zarr_dataset_gives_the_same_run_as_arrays(tmp_path):
    D = make_mhla(2, 1, 10, 24, causal=True, seed=4)
    url = str(tmp_path / "d.zarr")
    write_dataset(url, D["tokens"], D["targets"], chunk_samples=8)
    a = B.train_adamw("mhla", D, heads=2, epochs=2, batch_size=8)
    b = B.train_adamw("mhla", url, heads=2, epochs=2, batch_size=8)
    assert a.train_mse == b.train_mse
