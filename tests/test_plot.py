"""Plots of a fit: checked through the matplotlib objects against independent numpy computations."""
import os
import re
import shutil

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

import scaleattn as sa
from scaleattn import generate, plot
from scaleattn.heads import coef_to_W


@pytest.fixture(scope="module")
def run(tmp_path_factory, causal_ds):
    """A small realizable causal fit written to a run directory (in-process, no cluster)."""
    tmp = tmp_path_factory.mktemp("plots")
    ds = causal_ds
    res = sa.fit(ds, str(tmp / "run"))
    return ds, res, str(tmp / "run")


def _by_gid(ax, gid):
    return [a for a in ax.get_children() if a.get_gid() == gid]


def test_fit_writes_pngs_and_spectrum(run):
    ds, res, out = run
    for name in ("spectrum.png", "heads.png", "predictions.png"):
        p = os.path.join(out, name)
        assert os.path.getsize(p) > 1000
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert len(res.report.get("loss_vs_heads", [])) < 2  # svd heads: one point, no curve to draw
    assert not os.path.exists(os.path.join(out, "loss_vs_heads.png"))


def test_spectrum_figure_marks_lambda_min(run):
    ds, res, _ = run
    # independent: dense eigenvalues of Lambda_D = G / N from the statistics
    lam = np.linalg.eigvalsh(res.statistics.gram() / res.statistics.n_rows)
    np.testing.assert_allclose(np.sort(res.certificate.eigenvalues), lam, rtol=1e-10, atol=1e-18)
    fig = plot.run_figures(res)["spectrum"]
    ax, ax2 = fig.axes
    assert ax.get_xlabel() == "eigenvalue index (descending)"
    assert "Lambda_D" in ax.get_ylabel() and ax.get_yscale() == "log"
    (line,) = [ln for ln in ax.get_lines() if ln.get_gid() is None]
    np.testing.assert_allclose(line.get_ydata(), lam[::-1], rtol=1e-10)
    (lmin,) = _by_gid(ax, "lambda_min")
    assert lmin.get_ydata()[0] == pytest.approx(lam[0], rel=1e-8)
    assert "lambda_{\\min}" in lmin.get_label() and f"{lam[0]:.3g}" in lmin.get_label()
    (lmax,) = _by_gid(ax, "lambda_max")
    assert lmax.get_ydata()[0] == pytest.approx(lam[-1], rel=1e-10)
    # right panel: cutoff = rtol * max of the Jacobi-scaled spectrum, recomputed here
    G = res.statistics.gram()
    dinv = 1 / np.sqrt(np.diag(G))
    ws = np.linalg.eigvalsh(G * dinv[:, None] * dinv[None, :])
    (cut,) = _by_gid(ax2, "cutoff")
    assert cut.get_ydata()[0] == pytest.approx(res.report["cutoff_rtol"] * ws[-1], rel=1e-8)
    assert "Jacobi" in ax2.get_title() and ax2.get_xlabel()
    assert not _by_gid(ax2, "dropped")  # identifiable: nothing below the cutoff


def test_spectrum_not_identifiable_marks_dropped():
    data = generate.make_assoc(pairs=2, samples=512, orthogonal=True, seed=0)
    cert = sa.certify(sa.statistics_from_arrays(data["tokens"], data["targets"]))
    assert not cert.identifiable
    fig = plot.spectrum_figure(cert.eigenvalues, cert.spectrum_scaled, rtol=cert.rtol, lambda_min=cert.lambda_min)
    ax, ax2 = fig.axes
    (lmin,) = _by_gid(ax, "lambda_min")
    assert "not identifiable" in lmin.get_label()
    (dropped,) = _by_gid(ax2, "dropped")
    assert len(dropped.get_xdata()) == cert.ambiguous_dim == 12


def test_head_spectrum_is_svd_of_W(run):
    ds, res, _ = run
    s = np.linalg.svd(coef_to_W(res.solution.coef, ds.d), compute_uv=False)
    fig = plot.run_figures(res)["heads"]
    (ax,) = fig.axes
    assert ax.get_xlabel() == "index r" and ax.get_ylabel() == "singular value of W"
    (ln,) = [x for x in ax.get_lines() if x.get_gid() is None]
    np.testing.assert_allclose(ln.get_ydata(), s, rtol=1e-10)
    (nh,) = _by_gid(ax, "n_heads")
    assert nh.get_xdata()[0] == res.report["n_heads"] + 0.5


def test_predictions_against_targets(run):
    ds, res, _ = run
    fig = plot.run_figures(res)["predictions"]
    (ax,) = fig.axes
    assert ax.get_xlabel() == "target y" and ax.get_ylabel() == "prediction ŷ"
    assert _by_gid(ax, "identity")
    # independent: the teacher's outputs on the same samples (realizable data: prediction = target)
    tok, _, y = ds.read(0, ds.n_samples)
    V, Q = ds.teacher()
    want = generate.mhla_forward(V, Q, tok, causal=True)
    pts = np.concatenate([c.get_offsets() for c in ax.collections])
    assert pts.shape[0] == want.size  # 96 sequences x 10 prefixes x 2 outputs <= PREDICTION_POINTS rows
    np.testing.assert_allclose(np.sort(pts[:, 0]), np.sort(y.ravel()), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.sort(pts[:, 1]), np.sort(want.ravel()), rtol=0, atol=1e-10)


def test_loss_vs_heads_panel_when_present():
    assert plot.loss_vs_heads_figure(None) is None
    assert plot.loss_vs_heads_figure([{"heads": 4, "train_mse_stats": 0.0}]) is None
    rows = [{"heads": 3, "train_mse_stats": 0.0}, {"heads": 1, "train_mse_stats": 0.2},
            {"heads": 2, "train_mse_stats": 0.01}]
    fig = plot.loss_vs_heads_figure(rows, target_mean_square=0.5)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "number of heads H" and ax.get_ylabel() == "train MSE"
    (ln,) = [x for x in ax.get_lines() if x.get_gid() is None]
    np.testing.assert_array_equal(ln.get_xdata(), [1, 2, 3])
    np.testing.assert_allclose(ln.get_ydata()[:2], [0.2, 0.01])
    assert 0 < ln.get_ydata()[2] < 1e-15  # zero drawn at the log floor
    assert _by_gid(ax, "mean_square")


@pytest.mark.slow
def test_cli_plot_run_dir_and_recompute_without_spectrum(run, tmp_path, cli):
    ds, res, out = run
    copy = str(tmp_path / "run")
    shutil.copytree(out, copy)
    shutil.rmtree(os.path.join(copy, "spectrum.zarr"))  # older runs: recomputed from stats.zarr
    cli("plot", copy, "--out", tmp_path / "png")
    assert sorted(os.listdir(tmp_path / "png")) == ["heads.png", "predictions.png", "spectrum.png"]
    view = plot.load_run(copy)
    np.testing.assert_allclose(view["eigenvalues"], res.certificate.eigenvalues, rtol=1e-10, atol=1e-18)
    assert "no report.json" in cli("plot", tmp_path / "nope", rc=2).stderr


@pytest.mark.slow
def test_cli_fit_no_plots(run, tmp_path, cli):
    ds, _, _ = run
    cli("fit", ds.url, "--out", tmp_path / "r", "--local", "--no-plots", "--quiet")
    files = sorted(os.listdir(tmp_path / "r"))
    assert not [f for f in files if f.endswith(".png")] and "spectrum.zarr" in files


def _one_error(r) -> str:
    (line,) = r.stderr.strip().splitlines()
    return line


@pytest.mark.slow
def test_cli_plot_refuses_parts_that_do_not_belong_together(run, tmp_path, cli):
    """A spectrum.zarr from elsewhere, or report.json edited since the fit (d, psi), was drawn silently."""
    from scaleattn._storage import resolve
    from scaleattn.run import save_spectrum

    ds, res, out = run
    mixed, edited = str(tmp_path / "mixed"), str(tmp_path / "edited")
    shutil.copytree(out, mixed)
    shutil.rmtree(os.path.join(mixed, "spectrum.zarr"))
    save_spectrum(res.certificate, resolve(os.path.join(mixed, "spectrum.zarr")))  # not bound to this report
    assert re.match(r"scaleattn plot: error: \S+mixed: spectrum\.zarr does not record which report\.json it belongs"
                    r" to", _one_error(cli("plot", mixed, "--out", tmp_path / "png", rc=2)))
    shutil.copytree(out, edited)
    p = os.path.join(edited, "report.json")
    with open(p) as f:
        text = f.read()
    with open(p, "w") as f:
        f.write(text.replace('"psi": 6', '"psi": 7'))
    assert re.match(r"scaleattn plot: error: \S+edited: \S+\.zarr was written with another report\.json than this"
                    r" one", _one_error(cli("plot", edited, "--out", tmp_path / "png", rc=2)))
    assert not os.path.exists(tmp_path / "png")


@pytest.mark.parametrize("text, pattern", [
    ("{bad", r"report\.json: not valid JSON \(Expecting property name"),
    ('{"lambda_min": "abc"}', r"report\.json: attribute 'lambda_min' must be a number, got 'abc'"),
    ('{"loss_vs_heads": [{"heads": "2", "train_mse_stats": 1.0}]}', r"loss_vs_heads: attribute 'heads' must be an"),
    ("[1, 2]", r"report\.json: not a run report"),
    ("[" * 100_000, r"report\.json: not valid JSON \(nested too deep to be read\)"),  # (a RecursionError: a "bug")
], ids=["not-json", "lambda_min", "loss_vs_heads", "list", "nested"])
def test_cli_plot_damaged_report_is_one_line_exit_2(tmp_path, cli, text, pattern):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text(text)
    assert re.search(pattern, _one_error(cli("plot", tmp_path / "r", rc=2)))
