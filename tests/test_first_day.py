"""Small things a first day meets: a lambda_min at round-off is printed as 0 within round-off (with the
resolution, checked against eigvalsh of the explicit features' second moment), a CSV's time-index column kept as a
feature is warned of in one line, a Zarr store written by xarray is fitted as it is."""
import warnings

import numpy as np
import pytest

import scaleattn
from scaleattn.display._html import certificate_html
from scaleattn.display._text import certificate_summary, fit_summary
from scaleattn.features import phi, token_features
from scaleattn.generate import make_assoc, make_mhla
from scaleattn.importers import import_csv


def _second_moment(tok):
    s, x = token_features(tok)
    P = phi(np.asarray(s), np.asarray(x))
    return np.linalg.eigvalsh(P.T @ P / P.shape[0])


@pytest.mark.parametrize("certificate", ["gram", "qr"])
def test_lambda_min_at_round_off_is_printed_as_zero(tmp_path, certificate):
    data = make_assoc(2, 300, orthogonal=True, seed=1)  # keys and values orthonormal: not identifiable
    ds = scaleattn.write_dataset(tmp_path / "a.zarr", data["tokens"], data["targets"])
    s = scaleattn.certify_dataset(ds, certificate=certificate).summary()
    lam = _second_moment(data["tokens"])
    assert s["rank"] < s["psi"] and abs(s["lambda_min"]) < 1e-12 * lam[-1]
    np.testing.assert_allclose(s["lambda_max"], lam[-1], rtol=1e-10)
    rel = s["psi"] * np.finfo(np.float64).eps
    res = (rel * rel if certificate == "qr" else rel) * lam[-1]
    text = certificate_summary(s)
    assert f"lambda_min 0 within round-off (resolution {res:.2g})" in text, text
    assert "within round-off" in certificate_html(s)
    assert f"lambda_min {s['lambda_min']:.4g}  lambda_max" not in text


def test_lambda_min_of_an_identifiable_fit_is_its_value(tmp_path):
    d = make_mhla(d=2, length=8, samples=60, seed=2)
    res = scaleattn.fit(scaleattn.write_dataset(tmp_path / "m.zarr", d["tokens"], d["targets"]))
    lam = _second_moment(d["tokens"])
    np.testing.assert_allclose(res.report["lambda_min"], lam[0], rtol=1e-6)
    assert f"lambda_min {lam[0]:.4g}" in fit_summary(res.report) and "round-off" not in fit_summary(res.report)


def _csv(path, index, rows=40):
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        f.write("t,a,b\n")
        for i in range(rows):
            f.write(f"{index(i)},{rng.standard_normal():.5f},{rng.standard_normal():.5f}\n")


@pytest.mark.parametrize("index, verb", [(lambda i: i, "rises"), (lambda i: 1.7e9 - 60.5 * i * i, "falls")])
def test_csv_time_index_column_is_warned_of(tmp_path, index, verb):
    _csv(tmp_path / "s.csv", index)
    with pytest.warns(UserWarning) as w:
        import_csv(tmp_path / "s.zarr", tmp_path / "s.csv", length=4)
    said = [str(x.message) for x in w if "time index" in str(x.message)]
    assert len(said) == 1 and f"column 't' {verb} on every line" in said[0] and "`columns=a b`" in said[0]
    with warnings.catch_warnings():  # named columns, or no such column: nothing said
        warnings.simplefilter("error")
        import_csv(tmp_path / "n.zarr", tmp_path / "s.csv", length=4, columns=["t", "a", "b"])
        _csv(tmp_path / "r.csv", lambda i: (i * 7) % 5)
        import_csv(tmp_path / "r.zarr", tmp_path / "r.csv", length=4)


def test_cli_says_how_to_drop_the_time_index(tmp_path, cli):
    _csv(tmp_path / "s.csv", lambda i: i)
    r = cli("import", tmp_path / "s.zarr", "--csv", tmp_path / "s.csv", "--length", "4")
    line = [ln for ln in r.stderr.splitlines() if "time index" in ln]
    assert len(line) == 1 and line[0].startswith("scaleattn import: warning:") and line[0].endswith("--columns a b")


def test_a_zarr_store_written_by_xarray_is_fitted_as_is(tmp_path):
    xr = pytest.importorskip("xarray")
    d = make_mhla(d=2, heads=1, length=10, samples=40, seed=5)
    xr.Dataset({"tokens": (("sample", "position", "embed"), d["tokens"]),
                "targets": (("sample", "output"), d["targets"])}).to_zarr(tmp_path / "x.zarr", zarr_format=3,
                                                                           consolidated=False)
    res = scaleattn.fit(tmp_path / "x.zarr")
    s, x = token_features(d["tokens"])
    P = phi(np.asarray(s), np.asarray(x))
    np.testing.assert_allclose(res.model.coef, np.linalg.lstsq(P, d["targets"], rcond=None)[0], rtol=1e-6,
                               atol=1e-9)
    assert res.certificate.identifiable and res.report["n_samples"] == 40


@pytest.mark.parametrize("d_out, name", [(1, "x.zarr"), (2, "data.zarr"), (2, "fresh-tokens-of-the-teacher.zarr"),
                                         (20, "d.zarr")])
def test_prediction_titles_break_between_phrases(d_out, name):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from scaleattn.plot import predictions_figure

    y = np.random.default_rng(0).standard_normal((1900, d_out))
    fig = predictions_figure(y, y + 0.01, dataset=name, training=d_out != 2, total_rows=51_200, samples=(19, 512))
    lines = fig.get_suptitle().split("\n")
    for line in lines:  # parentheses open and close on one line; the legend of the dashed line is whole
        assert line.count("(") == line.count(")"), lines
    assert any(ln.endswith("dashed: y = ŷ") for ln in lines) and "\u00a0" not in fig.get_suptitle(), lines
    if d_out == 2:
        assert any(ln.startswith("first 19 of 512 samples (1,900 of 51,200 rows), MSE") for ln in lines), lines
    fig.canvas = FigureCanvasAgg(fig)
    fig.draw(fig.canvas.get_renderer())
    box, inside = fig._suptitle.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and box.y1 <= inside.y1, (box, inside)
