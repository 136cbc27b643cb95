"""MHLAModel predictions: from the heads and from the coefficients alike; causal outputs with padding equal the
teacher's forward pass."""
import numpy as np
import pytest

from scaleattn.estimator import MHLARegressor
from scaleattn.generate import make_mhla, mhla_forward


def test_heads_predict_like_coefficients():
    D = make_mhla(d=3, heads=2, length=20, samples=300, d_out=2, noise=0.05, seed=4)
    est = MHLARegressor().fit(D["tokens"], D["targets"])
    a = est.model_.predict(D["tokens"])
    b = est.model_.predict(D["tokens"], use_heads=True)
    assert np.abs(a - b).max() <= 1e-10 * np.abs(a).max()
    assert est.n_heads_ == min(2 * 3, 3 * 3)


def test_causal_predict_shapes_and_padding():
    D = make_mhla(d=2, heads=1, length=8, samples=10, causal=True, variable_lengths=True, seed=7)
    est = MHLARegressor().fit(D["tokens"], D["targets"], D["lengths"])
    p = est.predict(D["tokens"], D["lengths"])
    assert p.shape == D["targets"].shape
    assert np.allclose(p, mhla_forward(D["V"], D["Q"], D["tokens"], D["lengths"], causal=True), atol=1e-12)


def test_estimator_refuses_bad_values_and_lengths_naming_the_sample():
    """The estimator checks its arrays as a dataset's reads do (NaN/Inf, magnitudes whose cubic features overflow,
    lengths outside 1..T), in fit and in predict, with one DatasetError naming the array and the sample."""
    import pytest

    from scaleattn.errors import DatasetError

    D = make_mhla(d=2, heads=1, length=6, samples=12, causal=True, variable_lengths=True, seed=3)
    est = MHLARegressor().fit(D["tokens"], D["targets"], D["lengths"])
    for value, message in ((np.nan, "tokens: sample 7 contains NaN or Inf"), (-np.inf, "tokens: sample 7 contains"),
                           (3e38, "tokens: sample 7 has a value of magnitude 3.0e\\+38")):
        bad = D["tokens"].copy()
        bad[7, 0, 1] = value
        with pytest.raises(DatasetError, match=message):
            MHLARegressor().fit(bad, D["targets"], D["lengths"])
        with pytest.raises(DatasetError, match=message):
            est.predict(bad, D["lengths"])
    y = D["targets"].copy()
    y[2, 1, 0] = 1e101
    with pytest.raises(DatasetError, match="targets: sample 2 has a value of magnitude 1.0e\\+101"):
        MHLARegressor().fit(D["tokens"], y, D["lengths"])
    for length in (0, 7, -1):
        lens = D["lengths"].copy()
        lens[9] = length
        with pytest.raises(DatasetError, match=f"lengths: sample 9 has length {length}, expected 1 <= length <= T = 6"):
            MHLARegressor().fit(D["tokens"], D["targets"], lens)
        with pytest.raises(DatasetError, match=f"lengths: sample 9 has length {length}"):
            est.predict(D["tokens"], lens)
    with pytest.raises(DatasetError, match="tokens: expected an array of a float"):
        est.predict(D["tokens"] > 0, D["lengths"])


def test_integers_float64_cannot_hold_are_refused_and_a_loaded_model_checks_its_tokens(tmp_path):
    """int64 tokens beyond 2^53 would be rounded by the conversion to float64 (2^53 + 1 read as 2^53): refused
    naming the sample, by the estimator, a dataset's reads and the importer, while 2^53 itself passes; and a
    model, loaded or fitted, refuses NaN tokens and bad lengths in predict as the estimator does (it returned
    NaN predictions)."""
    import pytest
    import zarr

    from scaleattn.cli import main
    from scaleattn.errors import DatasetError
    from scaleattn.model import MHLAModel

    D = make_mhla(d=2, heads=1, length=6, samples=12, causal=False, seed=3)
    tok = np.round(D["tokens"] * 1000).astype(np.int64)
    tok[4, 2, 1] = 2**53 + 1
    message = r"tokens: sample 4 holds the integer 9007199254740993, beyond 2\^53"
    with pytest.raises(DatasetError, match=message):
        MHLARegressor().fit(tok, D["targets"])
    g = zarr.open_group(str(tmp_path / "ints.zarr"), mode="w", zarr_format=3)
    g.create_array("tokens", data=tok, chunks=(4, 6, 2))
    g.create_array("targets", data=D["targets"], chunks=(4, 2))
    assert main(["fit", str(tmp_path / "ints.zarr"), "--out", str(tmp_path / "r"), "--local", "--quiet"]) == 2
    np.savez(tmp_path / "ints.npz", tokens=tok, targets=D["targets"])
    assert main(["import", str(tmp_path / "i.zarr"), "--npz", str(tmp_path / "ints.npz")]) == 2
    assert not (tmp_path / "r").exists() and not (tmp_path / "i.zarr").exists()
    tok[4, 2, 1] = -(2**53)
    MHLARegressor().fit(tok, D["targets"])  # exact in float64: accepted

    est = MHLARegressor().fit(D["tokens"], D["targets"])
    est.model_.save(str(tmp_path / "m.zarr"))
    model = MHLAModel.load(str(tmp_path / "m.zarr"))
    bad = D["tokens"].copy()
    bad[5, 1, 0] = np.nan
    with pytest.raises(DatasetError, match="tokens: sample 5 contains NaN or Inf"):
        model.predict(bad)
    with pytest.raises(DatasetError, match="lengths: sample 2 has length 7"):
        model.predict(D["tokens"], np.r_[6, 6, 7, np.full(9, 6)])
    assert np.array_equal(model.predict(D["tokens"]), est.predict(D["tokens"]))


@pytest.mark.parametrize("method", ["predict", "score"])
def test_methods_of_an_unfitted_regressor_say_so(method):
    """predict before fit raised a bare AttributeError ('no attribute model_')."""
    from scaleattn.errors import NotFittedError, ScaleattnError

    tok = np.ones((2, 3, 2))
    args = (tok,) if method == "predict" else (tok, np.ones((2, 2)))
    with pytest.raises(NotFittedError, match=rf"not fitted yet: call fit\(tokens, targets\) before {method}\(\)") as e:
        getattr(MHLARegressor(), method)(*args)
    assert isinstance(e.value, (ScaleattnError, AttributeError))
    sklearn = pytest.importorskip("sklearn.exceptions")
    assert isinstance(e.value, sklearn.NotFittedError)
    assert not MHLARegressor().__sklearn_is_fitted__()


def test_the_regressor_works_in_scikit_learn_model_selection():
    """``cross_val_score(MHLARegressor(), X, y)`` raised AttributeError 'no attribute __sklearn_tags__' with
    scikit-learn >= 1.7 (the estimator is duck-typed, not a ``BaseEstimator``), and so did ``GridSearchCV``."""
    model_selection = pytest.importorskip("sklearn.model_selection")
    from sklearn.base import clone, is_regressor

    D = make_mhla(d=2, heads=1, length=12, samples=120, seed=0)
    X, y = D["tokens"], D["targets"]
    assert is_regressor(MHLARegressor())
    scores = model_selection.cross_val_score(MHLARegressor(), X, y, cv=3)
    assert scores.shape == (3,) and np.all(scores > 1 - 1e-9), scores  # realizable: R^2 = 1 on every fold
    grid = model_selection.GridSearchCV(MHLARegressor(), {"ridge": [0.0, 1e-3]}, cv=2).fit(X, y)
    assert grid.best_params_ == {"ridge": 0.0} and grid.best_estimator_.n_heads_ >= 1
    assert clone(MHLARegressor(heads="minimal")).heads == "minimal"
