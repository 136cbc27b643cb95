"""Held-out evaluation: test data of the same teacher on new tokens (``teacher_seed``), and a fit's validation
split (the last samples, left out of the statistics, their MSE reported next to the training MSE), checked
against dense least squares on explicit features of the training samples alone."""
import json

import numpy as np
import pytest

import scaleattn
from scaleattn.display._html import fit_html
from scaleattn.errors import ParameterError
from scaleattn.features import phi, row_targets, token_features
from scaleattn.generate import generate_mhla, make_teacher, mhla_forward
from scaleattn.pipeline import validation_split


def _features(tok, lens, y, causal):
    s, x = token_features(tok, lens, causal)
    return phi(np.asarray(s), np.asarray(x)), np.asarray(row_targets(y, lens, causal))


def test_teacher_seed_keeps_the_teacher_and_draws_new_tokens(tmp_path):
    train = generate_mhla(tmp_path / "a.zarr", d=2, heads=2, length=12, samples=30, seed=5)
    fresh = generate_mhla(tmp_path / "b.zarr", d=2, heads=2, length=6, samples=30, seed=6, teacher_seed=5)
    again = generate_mhla(tmp_path / "c.zarr", d=2, heads=2, length=12, samples=30, seed=5, teacher_seed=5)
    V, Q = make_teacher(2, 2, None, 5)
    for ds in (train, fresh, again):
        np.testing.assert_array_equal(ds.teacher()[0], V)
        np.testing.assert_array_equal(ds.teacher()[1], Q)
    tok, _, y = fresh.read(0, 30)
    np.testing.assert_allclose(y, mhla_forward(V, Q, tok), rtol=1e-12, atol=1e-15)
    # the same seed redraws the same stream: a shorter dataset's sequence is the start of the longer one's, scaled
    same_seed = generate_mhla(tmp_path / "d.zarr", d=2, heads=2, length=6, samples=30, seed=5).read(0, 30)[0]
    big = train.read(0, 30)[0]
    np.testing.assert_allclose(same_seed[0], big[0, :6] * np.sqrt(12 / 6), rtol=1e-12)
    # new tokens: no fresh sequence is a rescaled piece of a training one
    ratio = tok[:, :, 0] / big[:, :6, 0]
    assert np.abs(ratio - np.sqrt(2)).min() > 1e-6
    # teacher_seed equal to seed: the very bits of seed alone
    np.testing.assert_array_equal(again.read(0, 30)[0], big)
    np.testing.assert_array_equal(again.read(0, 30)[2], train.read(0, 30)[2])
    assert "teacher_seed" not in train.attrs["generator"] and fresh.attrs["generator"]["teacher_seed"] == 5
    with pytest.raises(ParameterError, match="teacher_seed"):
        generate_mhla(tmp_path / "e.zarr", d=2, samples=4, teacher_seed=-1)


@pytest.mark.parametrize("causal, fraction, n, held", [(False, 0.25, 40, 10), (True, 0.3, 23, 7)])
def test_validation_holds_out_the_last_samples(tmp_path, causal, fraction, n, held):
    """The model is dense lstsq on the first samples alone; validation_mse is its MSE on the rest."""
    ds = generate_mhla(tmp_path / "v.zarr", d=2, heads=2, length=5, samples=n, noise=0.3, causal=causal, seed=1,
                       chunk_samples=6, variable_lengths=causal)  # chunks that the split cuts
    res = scaleattn.fit(ds, validation=fraction)
    r = res.report
    assert (r["validation_samples"], r["train_samples"], r["n_samples"]) == (held, n - held, n)
    tok, lens, y = ds.read(0, n)
    P, Y = _features(tok[: n - held], None if lens is None else lens[: n - held], y[: n - held], causal)
    coef = np.linalg.lstsq(P, Y, rcond=None)[0]
    assert r["n_rows"] == P.shape[0]
    np.testing.assert_allclose(res.model.coef, coef, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(r["train_mse"], np.mean((P @ coef - Y) ** 2), rtol=1e-9)
    Pv, Yv = _features(tok[n - held:], None if lens is None else lens[n - held:], y[n - held:], causal)
    want = np.mean((Pv @ coef - Yv) ** 2)
    np.testing.assert_allclose(r["validation_mse"], want, rtol=1e-7)
    np.testing.assert_allclose(r["relative_validation_mse"], want / np.mean(Yv ** 2), rtol=1e-7)
    assert r["validation_mse"] > r["train_mse"]  # noisy targets: the held-out error is the larger
    text = res.summary()
    assert f"the last {held} of {n} samples, held out of the fit" in text and "validation MSE" in text
    card = fit_html(r)
    assert "validation MSE" in card and f"the last {held} of {n} samples" in card
    assert "validation" in repr(res)
    plain = scaleattn.fit(ds).report  # without: every sample fitted, no validation keys
    assert plain["n_rows"] > r["n_rows"] and not any(k.startswith("validation") for k in plain)


def test_validation_fraction_is_checked():
    assert validation_split(64, 0.2) == 13 and validation_split(10, 0.7) == 7 and validation_split(5, 0.0) == 0
    # any fraction above 0 holds out a sample (ceil): the float rounding never silently takes it to none
    assert validation_split(512, 1e-12) == validation_split(10**6, 1e-7) == 1
    with pytest.raises(ParameterError, match="holds out every one"):
        validation_split(3, 0.9)
    for bad in (1.0, -0.1, float("nan"), "0.2"):
        with pytest.raises(ParameterError, match="validation"):
            scaleattn.fit("nowhere.zarr", validation=bad)


@pytest.mark.slow
def test_cli_validation_in_report_and_summary(tmp_path, cli):
    data = tmp_path / "d.zarr"
    cli("generate", "mhla", data, "--samples", "50", "--length", "8", "--noise", "0.1")
    r = cli("fit", data, "--out", tmp_path / "run", "--local", "--quiet", "--no-plots", "--validation", "0.2")
    assert "validation MSE" in r.stdout and "the last 10 of 50 samples" in r.stdout
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rep["validation_samples"] == 10 and rep["n_rows"] == 40 and rep["validation_mse"] > 0
    bad = cli("fit", data, "--out", tmp_path / "run2", "--local", "--validation", "0.999", rc=2)
    assert "--validation 0.999 of 50 samples holds out every one" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "run2").exists()
    fresh = tmp_path / "f.zarr"
    cli("generate", "mhla", fresh, "--samples", "20", "--length", "8", "--seed", "1", "--teacher-seed", "0")
    from scaleattn import open_dataset
    np.testing.assert_array_equal(open_dataset(fresh).teacher()[0], open_dataset(data).teacher()[0])


@pytest.mark.slow
def test_validation_on_a_cluster_matches_the_in_process_fit(tmp_path, client):
    ds = generate_mhla(tmp_path / "c.zarr", d=2, heads=1, length=6, samples=45, noise=0.2, seed=4, chunk_samples=7)
    here = scaleattn.fit(ds, validation=0.3).report
    there = scaleattn.fit(ds, client=client, validation=0.3).report
    assert there["validation_samples"] == here["validation_samples"] == 14
    np.testing.assert_allclose(there["validation_mse"], here["validation_mse"], rtol=1e-10)
    np.testing.assert_allclose(there["train_mse"], here["train_mse"], rtol=1e-10)
