"""Plots of a fit: checked through the matplotlib objects against independent numpy computations."""
import os
import re
import shutil

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

import scaleattn as sa
from scaleattn import generate, plot
from scaleattn.heads._algebra import coef_to_W


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
    fig = plot.spectrum_figure(cert.eigenvalues, cert.spectrum_scaled, rtol=cert.cutoff_rtol,
                               lambda_min=cert.lambda_min)
    ax, ax2 = fig.axes
    (lmin,) = _by_gid(ax, "lambda_min")
    assert "not identifiable" in lmin.get_label()
    (dropped,) = _by_gid(ax2, "dropped")  # x: those above the plot's floor; the others are the clipped run
    (clipped,) = _by_gid(ax2, "clipped")
    n_clipped = int(re.match(r"(\d+) of the values", clipped.get_label()).group(1))
    assert len(dropped.get_xdata()) + n_clipped == cert.ambiguous_dim == 12
    assert "below cutoff (12: ambiguous" in dropped.get_label()


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
    ax = fig.axes[0]  # one panel per output (d_out = 2, side by side)
    assert ax.get_xlabel() == "target y" and ax.get_ylabel() == "prediction ŷ"
    assert all(_by_gid(a, "identity") for a in fig.axes)
    # independent: the teacher's outputs on the same samples (realizable data: prediction = target)
    tok, _, y = ds.read(0, ds.n_samples)
    V, Q = ds.teacher()
    want = generate.mhla_forward(V, Q, tok, causal=True)
    pts = np.concatenate([c.get_offsets() for a in fig.axes for c in a.collections])
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
    (clipped,) = _by_gid(ax, "clipped")  # and said to be clipped there
    np.testing.assert_array_equal(clipped.get_xdata(), [3])
    assert clipped.get_ydata()[0] == ln.get_ydata()[2] and "1 of the MSE values below" in clipped.get_label()
    (heads,) = plot.head_spectrum_figure([1.0, 0.5, 0.0, 0.0], 2).axes
    np.testing.assert_array_equal(_by_gid(heads, "clipped")[0].get_xdata(), [3, 4])


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
    assert "nope: no such run directory" in cli("plot", tmp_path / "nope", rc=2).stderr
    os.makedirs(tmp_path / "empty")
    assert "no report.json" in cli("plot", tmp_path / "empty", rc=2).stderr
    # a typo: the closest name in the folder is suggested
    assert f"(did you mean {os.path.join(str(tmp_path), 'run')}?)" in cli("plot", tmp_path / "rnu", rc=2).stderr


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
    from scaleattn.run import save_spectrum
    from scaleattn.store._location import resolve

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


# ---- what the figures say (a user's report: clipped values, legends on the data, QR units, missing spectrum,
# hidden outputs, a minimal head count that looked like a lossy cut) --------------------------------------------
def _legends(fig):
    return list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]


def test_spectrum_says_which_values_are_clipped_at_the_floor():
    """lambda_min = 1.49e-66 was drawn at the axis floor with no sign that it lies far below it."""
    ev = np.array([1.0, 0.5, 1e-3, 1.49e-66, 0.0])
    ws = np.array([2.0, 1.0, 1e-2, 3e-40, -1e-30])
    fig = plot.spectrum_figure(ev, ws, rtol=1e-14, lambda_min=1.49e-66, identifiable=False)
    ax, ax2 = fig.axes
    floor = 1e-18  # 1e-18 of the largest value (1e-2 * rtol when that is lower)
    (line,) = [ln for ln in ax.get_lines() if ln.get_gid() is None]
    np.testing.assert_allclose(line.get_ydata(), [1.0, 0.5, 1e-3])  # no clipped value on the curve
    (clipped,) = _by_gid(ax, "clipped")
    np.testing.assert_array_equal(clipped.get_xdata(), [4, 5])
    np.testing.assert_allclose(clipped.get_ydata(), floor)
    assert "2 of the eigenvalues below 1e-18" in clipped.get_label() and "clipped" in clipped.get_label()
    (lmin,) = _by_gid(ax, "lambda_min")
    assert lmin.get_ydata()[0] == pytest.approx(floor)
    assert "1.49e-66" in lmin.get_label() and "below 1e-18: clipped" in lmin.get_label()
    assert "not identifiable" in lmin.get_label()
    assert [t for t in ax.texts if t.get_gid() == "lambda_min_clipped"]  # the arrow pointing down
    (clipped2,) = _by_gid(ax2, "clipped")
    np.testing.assert_array_equal(clipped2.get_xdata(), [4, 5])
    np.testing.assert_allclose(clipped2.get_ydata(), 2e-18)
    # nothing clipped: no clipped marks, lambda_min at its value
    fig = plot.spectrum_figure(ev[:3], ws[:3], rtol=1e-14)
    assert not _by_gid(fig.axes[0], "clipped") and not _by_gid(fig.axes[1], "clipped")
    assert "clipped" not in _by_gid(fig.axes[0], "lambda_min")[0].get_label()


def test_legends_never_cover_the_axes(run):
    """The cutoff line ran through the legend text of the right panel: every legend lies outside every axes."""
    ds, res, _ = run
    data = generate.make_assoc(pairs=2, samples=512, orthogonal=True, seed=0)
    cert = sa.certify(sa.statistics_from_arrays(data["tokens"], data["targets"]))
    figs = dict(plot.run_figures(res))
    figs["dropped"] = plot.spectrum_figure(cert.eigenvalues, cert.spectrum_scaled, rtol=cert.cutoff_rtol)
    figs["loss"] = plot.loss_vs_heads_figure([{"heads": 1, "train_mse_stats": 0.1},
                                              {"heads": 2, "train_mse_stats": 0.0}], 0.5)
    for name, fig in figs.items():
        fig.draw_without_rendering()
        renderer = fig._get_renderer()
        legends = _legends(fig)
        assert legends or name == "predictions", name
        for leg in legends:
            box = leg.get_window_extent(renderer)
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent(renderer)), (name, ax.get_title())


def test_qr_cutoff_is_labelled_as_the_cli_states_it(causal_ds, tmp_path):
    """After a QR decision the panel said `1.0e-24 x max` (of the scaled Gram) while the CLI said
    `1.0e-12 x sigma_max of R`: the label gives both, and the axis says it shows sigma^2 of R."""
    import math

    from scaleattn.display._text import _cutoff

    out = str(tmp_path / "qr")
    res = sa.fit(causal_ds, out, certificate="qr", plots=False)
    assert res.report["certificate_method"] == "qr"
    cli_number = re.search(r"cutoff (\S+) x sigma_max of R", _cutoff(res.report)).group(1)
    for fig in (plot.run_figures(res)["spectrum"], plot.run_figures(out)["spectrum"]):
        ax2 = fig.axes[1]
        (cut,) = _by_gid(ax2, "cutoff")
        assert f"({cli_number} x $\\sigma_{{\\max}}$ of R)$^2$" in cut.get_label()
        assert f"{res.report['cutoff_rtol']:.1e} x max" in cut.get_label()
        assert cli_number == f"{math.sqrt(res.report['cutoff_rtol']):.1e}"
        assert "R" in ax2.get_ylabel() and "QR" in ax2.get_title()
    gram = plot.run_figures(sa.fit(causal_ds, certificate="gram"))["spectrum"].axes[1]
    assert "R" not in _by_gid(gram, "cutoff")[0].get_label() and "Jacobi" in gram.get_title()


@pytest.mark.slow
def test_spectrum_of_a_run_past_the_eigh_path(causal_ds, tmp_path, monkeypatch, cli):
    """psi > 2,000 (here: the switch moved below psi = 6): the fit keeps no spectrum.zarr and `plot` wrote no
    spectrum.png, silently. Now plot recomputes it (eigh) when affordable, and says why not otherwise."""
    import scaleattn.linalg._spectrum
    import scaleattn.run
    from scaleattn.errors import Note

    monkeypatch.setattr(scaleattn.linalg._spectrum, "LARGE_PSI", 3)
    out = str(tmp_path / "run")
    with pytest.warns(Note, match=r"no spectrum\.png: .*Cholesky .*`scaleattn plot RUN_DIR` recomputes"):
        res = sa.fit(causal_ds, out)
    assert res.certificate.eigenvalues is None
    assert "spectrum.zarr" not in os.listdir(out) and "spectrum.png" not in os.listdir(out)
    fig = plot.run_figures(out)["spectrum"]  # recomputed from stats.zarr, the whole spectrum
    lam = np.linalg.eigvalsh(res.statistics.gram() / res.statistics.n_rows)
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_gid() is None]
    np.testing.assert_allclose(line.get_ydata(), lam[::-1], rtol=1e-10)
    r = cli("plot", out, "--out", tmp_path / "png")
    assert "spectrum.png" in os.listdir(tmp_path / "png") and "note" not in r.stderr
    monkeypatch.setattr(scaleattn.run, "SPECTRUM_RECOMPUTE_PSI", 5)  # past what plot recomputes by default
    r = cli("plot", out, "--out", tmp_path / "png2")
    (line,) = r.stderr.strip().splitlines()
    assert re.match(r"scaleattn plot: note: no spectrum\.png: .* up to psi = 5: `scaleattn plot RUN_DIR"
                    r" --full-spectrum` does it$", line)
    assert sorted(os.listdir(tmp_path / "png2")) == ["heads.png", "predictions.png"]
    cli("plot", out, "--out", tmp_path / "png3", "--full-spectrum")
    assert "spectrum.png" in os.listdir(tmp_path / "png3")


def test_a_run_missing_its_spectrum_is_not_said_to_have_taken_another_path(run, tmp_path, cli):
    """An eigh-path run (psi = 6) whose spectrum.zarr and stats.zarr were removed: the note said "the fit took the
    Cholesky or krylov path", which the report cannot tell and which is false here; it says what is missing."""
    import shutil

    _, _, out = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    for store in ("spectrum.zarr", "stats.zarr"):
        shutil.rmtree(copy / store)
    r = cli("plot", copy, "--out", tmp_path / "png")
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("scaleattn plot: note: no spectrum.png: the run has no spectrum.zarr (") and \
        "took the Cholesky" not in line and "stayed on the workers" not in line and "no stats.zarr" in line, line
    assert sorted(os.listdir(tmp_path / "png")) == ["heads.png", "predictions.png"]


def test_predictions_show_every_output_and_say_which_rows(run, tmp_path):
    """Output 0 was hidden under output 1, and the title `2,000 rows, MSE ...` named neither the sample nor the
    dataset: one panel per output, `all/first n of N rows`, and training or not."""
    ds, res, out = run
    fig = plot.run_figures(res)["predictions"]
    assert len(fig.axes) == res.report["d_out"] == 2
    tok, _, y = ds.read(0, ds.n_samples)
    for a, ax in enumerate(fig.axes):
        (pts,) = [c.get_offsets() for c in ax.collections]
        np.testing.assert_allclose(np.sort(pts[:, 0]), np.sort(y[..., a].ravel()), atol=1e-12)
        assert ax.get_title().startswith(f"output {a}: MSE")
    title = fig.get_suptitle()
    assert f"{os.path.basename(ds.url)} (the training data)" in title
    assert f"all {ds.n_samples:,} samples ({res.report['n_rows']:,} rows)" in title  # causal: a row per prefix
    # another copy of the data: not the training data, even with the same values
    shutil.copytree(ds.url, tmp_path / "fresh.zarr")
    held = plot.run_figures(out, dataset=str(tmp_path / "fresh.zarr"))["predictions"].get_suptitle()
    assert "fresh.zarr (not the training data)" in held
    # a sample of the rows says so
    rng = np.random.default_rng(0)
    yy = rng.standard_normal((50, 3))
    fig = plot.predictions_figure(yy, yy + 0.1, total_rows=5000, dataset="d.zarr", training=True)
    assert "first 50 of 5,000 rows" in fig.get_suptitle() and len(fig.axes) == 3
    many = plot.predictions_figure(rng.standard_normal((20, 40)), rng.standard_normal((20, 40)))
    assert len(many.axes) == 1 and "40 outputs pooled" in many.get_suptitle()
    assert len(many.axes[0].collections) == 40


@pytest.mark.slow
def test_predictions_of_a_dataset_regenerated_since_the_fit_are_not_the_training_data(tmp_path, cli):
    """`plot RUN` drew the report's dataset path as it is now: regenerated since the fit, its predictions were
    titled "the training data" next to the report's training numbers. The report's fingerprint tells them apart:
    skipped with a warning by default, drawn as held-out data with --dataset."""
    data, run = tmp_path / "d.zarr", tmp_path / "run"
    generate.generate_mhla(str(data), d=2, heads=1, length=4, samples=16, seed=0)
    cli("fit", data, "--out", run, "--local", "--quiet", "--no-plots")
    cli("plot", run, "--out", tmp_path / "same")
    assert "predictions.png" in os.listdir(tmp_path / "same")  # unchanged: drawn
    generate.generate_mhla(str(data), d=2, heads=1, length=4, samples=16, seed=1, overwrite=True)
    r = cli("plot", run, "--out", tmp_path / "p1")
    (line,) = r.stderr.strip().splitlines()
    assert re.fullmatch(r"scaleattn plot: warning: predictions plot skipped: \S*d\.zarr changed since the fit"
                        r" \(another dataset is stored there now\); pass --dataset .*", line), line
    assert "predictions.png" not in os.listdir(tmp_path / "p1")
    fig = plot.run_figures(str(run), dataset=str(data))["predictions"]
    assert "d.zarr (not the training data)" in fig.get_suptitle()


def test_heads_plot_says_minimal_heads_are_exact_not_a_cut(causal_ds):
    """`--heads minimal` kept 1 head next to 4 clearly non-zero singular values of W: it looked like a lossy cut."""
    res = sa.fit(causal_ds, heads="minimal")
    r = res.report
    assert r["n_heads"] == 1 and r["heads_exact"]
    (ax,) = plot.run_figures(res)["heads"].axes
    (nh,) = _by_gid(ax, "n_heads")
    s = np.asarray(r["head_singular_values"])
    rank = int((s > 1e-12 * s[0]).sum())
    assert rank == 4
    label = nh.get_label()
    assert "heads kept: 1 (minimal): exact, it computes the fitted function" in label
    assert f"train MSE {r['train_mse']:.3g}" in label and f"heads residual {r['heads_residual']:.1e}" in label
    assert f"the SVD of W has rank {rank}" in label and "not a cut of the SVD" in label
    lossy = plot.head_spectrum_figure(s, 2, method="best-2", exact=False, train_mse=0.5)
    (nh,) = _by_gid(lossy.axes[0], "n_heads")
    assert "not exact, they compute another function than the fit" in nh.get_label()
    assert "fewer heads than the rank 4 of W" in nh.get_label() and "train MSE 0.5" in nh.get_label()
    svd = plot.head_spectrum_figure(s, 4, method="svd", exact=True)  # all of the SVD: nothing to explain
    assert _by_gid(svd.axes[0], "n_heads")[0].get_label() == "heads kept: 4 (svd)"


@pytest.mark.parametrize("d_out", [1, 2, 20])
def test_predictions_title_stays_inside_the_figure(d_out):
    """The title (dataset name, rows drawn, MSE) is wrapped to the figure: drawn, its box lies inside the
    figure's (a one-line rows line ran off both edges of the 2-output figure)."""
    rng = np.random.default_rng(0)
    y = rng.standard_normal((50, d_out))
    fig = plot.predictions_figure(y, y + 1e-3, dataset="a-rather-long-dataset-name-from-a-real-project.zarr",
                                  training=False, total_rows=51_200)
    fig.canvas = FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    box, inside = fig._suptitle.get_window_extent(renderer), fig.bbox
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and box.y1 <= inside.y1, (box, inside)
    assert "first 50 of 51,200 rows" in fig._suptitle.get_text().replace("\n", " ")


# ---- a user's report: 22 head counts ran their labels together, a narrow loss range read 8.1x10^0, 70 clipped
# eigenvalues merged into a band under the lambda_min line, "first 1,992 of 3,600 rows" of 300 causal samples -----
def _visible_labels(fig, axis):
    fig.canvas = FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    ax = fig.axes[0]
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    ticks = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels(which="both")
    return [(t.get_text(), t.get_window_extent(renderer)) for t in ticks
            if t.get_text() and lo <= t.get_position()[0 if axis == "x" else 1] <= hi], ax


def test_loss_vs_heads_ticks_are_thinned_integers():
    rows = [{"heads": h, "train_mse_stats": 0.1 / h ** 2} for h in range(1, 23)]  # --heads minimal at d = 8
    labels, _ = _visible_labels(plot.loss_vs_heads_figure(rows, 0.2), "x")
    assert 3 <= len(labels) <= 12, [t for t, _ in labels]
    assert all(re.fullmatch(r"\d+", t) for t, _ in labels), [t for t, _ in labels]
    boxes = sorted((b for _, b in labels), key=lambda b: b.x0)
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), "tick labels overlap"


def _number(text):
    return float(re.fullmatch(r"\$\\mathdefault\{([0-9.]+)\}\$", text).group(1))  # a plain number, nothing else


def test_loss_vs_heads_narrow_range_reads_as_plain_numbers():
    rows = [{"heads": h, "train_mse_stats": v} for h, v in enumerate([8.1, 8.09, 8.085, 8.08], 1)]
    labels, ax = _visible_labels(plot.loss_vs_heads_figure(rows), "y")
    texts = [t for t, _ in labels]
    assert ax.get_yscale() == "linear" and len(texts) >= 3 and not any("times" in t for t in texts), texts
    values = [_number(t) for t in texts]  # each label is the value at its tick, no offset or multiplier
    assert all(8.07 <= v <= 8.11 for v in values) and not ax.yaxis.get_offset_text().get_text(), texts
    (ln,) = [x for x in ax.get_lines() if x.get_gid() is None]
    np.testing.assert_allclose(ln.get_ydata(), [8.1, 8.09, 8.085, 8.08])
    # a decade or more (here with mean y^2), or a value at the floor: log, as before
    assert plot.loss_vs_heads_figure(rows, 81.0).axes[0].get_yscale() == "log"
    zero = [{"heads": 1, "train_mse_stats": 8.1}, {"heads": 2, "train_mse_stats": 0.0}]
    assert plot.loss_vs_heads_figure(zero).axes[0].get_yscale() == "log"


def test_a_run_of_clipped_values_is_one_mark_with_its_count():
    """70 eigenvalues at the floor: one segment with its count, not 70 markers; on the right no x drawn on the
    clipped marks; the lambda_min line stops where the clipped run begins."""
    ev = np.concatenate([np.geomspace(1.0, 1e-6, 30), np.zeros(70)])
    ws = np.concatenate([np.geomspace(1.0, 1e-3, 25), np.geomspace(1e-14, 1e-16, 5), np.zeros(70)])
    fig = plot.spectrum_figure(ev, ws, rtol=1e-12, lambda_min=0.0, identifiable=False)
    ax, ax2 = fig.axes
    floor = 1e-18
    for a, first in ((ax, 31), (ax2, 31)):
        (clipped,) = _by_gid(a, "clipped")
        np.testing.assert_array_equal(clipped.get_xdata(), [first, 100])  # from the first to the last clipped
        np.testing.assert_allclose(clipped.get_ydata(), floor)
        (count,) = [t for t in a.texts if t.get_gid() == "clipped_count"]
        assert count.get_text() == "70 clipped"
        assert "70 of the" in clipped.get_label()
    (dropped,) = _by_gid(ax2, "dropped")  # the 5 below the cutoff but above the floor; the 70 are the segment
    np.testing.assert_array_equal(dropped.get_xdata(), np.arange(26, 31))
    assert np.all(dropped.get_ydata() > floor) and "below cutoff (75: ambiguous" in dropped.get_label()
    (lmin,) = _by_gid(ax, "lambda_min")
    assert np.max(lmin.get_xdata()) < 31 and lmin.get_ydata()[0] == pytest.approx(floor)
    # drawn: the count lies below the floor, inside the axes, clear of the cutoff line
    fig.canvas = FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    (count,) = [t for t in ax2.texts if t.get_gid() == "clipped_count"]
    box = count.get_window_extent(renderer)
    floor_px = ax2.transData.transform((50, floor))[1]
    (cut,) = _by_gid(ax2, "cutoff")
    assert box.y1 < floor_px < ax2.transData.transform((50, cut.get_ydata()[0]))[1]
    assert box.y0 >= ax2.get_window_extent(renderer).y0


def test_predictions_of_causal_data_count_samples_and_rows():
    y = np.zeros((1992, 2))
    fig = plot.predictions_figure(y, y, total_rows=3600, samples=(166, 300))
    assert "first 166 of 300 samples (1,992 of 3,600 rows)" in fig.get_suptitle().replace("\n", " ")
    fig = plot.predictions_figure(y[:300], y[:300], total_rows=300, samples=(300, 300))
    assert "all 300 samples, MSE" in fig.get_suptitle().replace("\n", " ")  # a row per sample: said once


def test_predictions_samples_drawn_match_the_rows(causal_ds, run):
    _, res, _ = run
    n = plot.samples_drawn(causal_ds, max_points=25)  # 2 samples of 10 prefixes
    y, _ = plot.sample_predictions(res.model, causal_ds, max_points=25)
    assert n == 2 and y.shape[0] == n * causal_ds.length
