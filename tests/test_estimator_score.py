"""MHLARegressor.score is scikit-learn's R^2 (``r2_score`` with its defaults), checked against sklearn itself:
multi-output targets average the outputs' scores uniformly (not pooled), 1-D targets score as one output, and a
constant target scores 0.0 (or 1.0 when predicted exactly), never -inf."""
import numpy as np
import pytest

from scaleattn import MHLARegressor

metrics = pytest.importorskip("sklearn.metrics")


def _data(seed, n=60, t=6, d=3, d_out=2):
    rng = np.random.default_rng(seed)
    tokens = rng.standard_normal((n, t, d))
    scale = np.array([1.0, 30.0])[:d_out]  # outputs of very different spread: pooling and averaging differ
    targets = rng.standard_normal((n, d_out)) * scale
    return tokens, targets


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_output_score_is_the_uniform_average(seed):
    tokens, targets = _data(seed)
    est = MHLARegressor().fit(tokens[:40], targets[:40])
    pred = est.predict(tokens[40:])
    want = metrics.r2_score(targets[40:], pred)
    assert est.score(tokens[40:], targets[40:]) == pytest.approx(want, rel=1e-12, abs=1e-12)
    pooled = 1 - ((targets[40:] - pred) ** 2).sum() / ((targets[40:] - targets[40:].mean(0)) ** 2).sum()
    assert abs(pooled - want) > 1e-3  # the data tell the two apart


def test_one_d_targets_and_a_constant_target():
    tokens, targets = _data(2, d_out=1)
    y = targets[:, 0]
    est = MHLARegressor().fit(tokens[:40], y[:40])
    assert est.score(tokens[40:], y[40:]) == pytest.approx(metrics.r2_score(y[40:], est.predict(tokens[40:])),
                                                           rel=1e-12, abs=1e-12)
    const = np.full(20, 3.0)
    got = est.score(tokens[40:], const)
    assert np.isfinite(got) and got == metrics.r2_score(const, est.predict(tokens[40:])) == 0.0
