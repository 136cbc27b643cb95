"""Targets of one output given as (N,), as scikit-learn users pass ``y``: MHLARegressor fits them as (N, 1) and
predicts (N,); ``write_dataset`` and ``scaleattn import --npz`` store them as (N, 1). Checked against dense
least squares on the explicit features."""
import numpy as np
import pytest

import scaleattn
from scaleattn.features import phi, token_features
from scaleattn.generate import make_mhla


@pytest.fixture(scope="module")
def one_output():
    d = make_mhla(d=2, heads=2, length=6, samples=80, d_out=1, noise=0.05, seed=4)
    return d["tokens"], d["targets"][:, 0]


def _lstsq(tok, y):
    s, x = token_features(tok)
    P = phi(np.asarray(s), np.asarray(x))
    return P, np.linalg.lstsq(P, y, rcond=None)[0]


def test_estimator_takes_1d_targets_and_predicts_1d(one_output):
    tok, y = one_output
    est = scaleattn.MHLARegressor().fit(tok, y)
    P, coef = _lstsq(tok, y)
    pred = est.predict(tok)
    assert pred.shape == (80,)
    np.testing.assert_allclose(pred, P @ coef, rtol=1e-8, atol=1e-12)
    resid = y - P @ coef
    np.testing.assert_allclose(est.score(tok, y), 1 - resid @ resid / np.sum((y - y.mean()) ** 2), rtol=1e-10)
    two_d = scaleattn.MHLARegressor().fit(tok, y[:, None])  # (N, 1) stays (N, 1)
    assert two_d.predict(tok).shape == (80, 1)
    np.testing.assert_array_equal(two_d.coef_, est.coef_)


def test_scikit_learn_cross_validation_with_1d_targets(one_output):
    model_selection = pytest.importorskip("sklearn.model_selection")
    tok, y = one_output
    scores = model_selection.cross_val_score(scaleattn.MHLARegressor(), tok, y, cv=2)
    assert scores.shape == (2,) and np.all(scores > 0.5)


def test_write_dataset_and_import_store_1d_targets_as_one_column(one_output, tmp_path, cli):
    tok, y = one_output
    ds = scaleattn.write_dataset(tmp_path / "w.zarr", tok, y)
    assert ds.d_out == 1 and ds.read(0, 80)[2].shape == (80, 1)
    np.savez(tmp_path / "one.npz", tokens=tok, targets=y)
    r = cli("import", tmp_path / "i.zarr", "--npz", tmp_path / "one.npz")
    assert "N=80 T=6 d=2 d_out=1 causal=False" in r.stdout
    res = scaleattn.fit(tmp_path / "i.zarr")
    np.testing.assert_allclose(res.model.coef[:, 0], _lstsq(tok, y)[1], rtol=1e-7, atol=1e-10)
