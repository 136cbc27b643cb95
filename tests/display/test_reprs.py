"""Rich HTML reprs in Jupyter: FitResult, Certificate, Statistics and MHLAModel render cards through
scaleattn.display._text (pure functions of dicts and arrays) that show the verdict with lambda_min, rank and margin,
the spectrum thumbnail, the heads and the files written; a _repr_html_ never raises; the heads plot marks the
fewest heads known to suffice."""
import html
import re

import numpy as np
import pytest

import scaleattn as sa
from scaleattn.display import _html as report_html
from scaleattn.display import _text as report
from scaleattn.generate import generate_mhla, make_assoc


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    d = tmp_path_factory.mktemp("reprs")
    ds = generate_mhla(str(d / "data.zarr"), d=2, heads=1, length=20, samples=64, causal=True, seed=0)
    return sa.fit(ds, str(d / "run"), plots=False)


@pytest.fixture(scope="module")
def ambiguous():
    data = make_assoc(pairs=2, samples=512, orthogonal=True, seed=0)
    return sa.certify(sa.statistics_from_arrays(data["tokens"], data["targets"]))


def _rows(card: str) -> dict:
    """``{label: text}`` of a card's table rows."""
    rows = re.findall(r"<th[^>]*>(.*?)</th><td[^>]*>(.*?)</td>", card)
    return {html.unescape(k): html.unescape(re.sub(r"<[^>]+>", "", v)) for k, v in rows}


def test_fit_card_shows_verdict_spectrum_heads_and_files(fitted):
    card = fitted._repr_html_()
    assert card.startswith('<div class="scaleattn-fit"')
    assert 'data-verdict="identifiable"' in card and "IDENTIFIABLE" in card
    rows = _rows(card)
    r = fitted.report
    assert rows["lambda_min"].startswith(f"{r['lambda_min']:.4g}")
    assert rows["rank"] == f"{r['rank']} of psi = {r['psi']}"
    kept = r["smallest_kept_relative"] / r["cutoff_rtol"]  # the Gram decided: eigenvalues, cutoff cutoff_rtol
    assert r["largest_dropped_relative"] is None and r["margin"] == pytest.approx(kept)
    assert rows["margin"] == f"{r['margin']:.3g}x (smallest kept {kept:.2g} x the cutoff)"
    assert rows["decided by"] == "the float64 Gram"
    assert rows["heads"] == "4 (svd)" and rows["teacher heads"] == "1"
    assert rows["lower bound"].startswith(f"{r['heads_lower_bound']} (")
    assert "fewer heads suffice: 1 computes the same function" in card
    assert card.count("<circle") == r["psi"]  # one dot per eigenvalue of the thumbnail
    assert rows["wrote"].startswith(fitted.out)
    assert "report.json, model.zarr, stats.zarr, spectrum.zarr" in rows["wrote"]
    assert fitted.files == ["report.json", "model.zarr", "stats.zarr", "spectrum.zarr"]
    assert "statistics" in rows["wall time"] and "solve" in rows["wall time"] and "heads" in rows["wall time"]


def test_not_identifiable_certificate_card_is_red_with_dropped_margin(ambiguous):
    assert ambiguous.verdict == "not identifiable"
    card = ambiguous._repr_html_()
    assert 'data-verdict="not-identifiable"' in card and "#c62828" in card
    assert f"{ambiguous.ambiguous_dim} feature direction(s)" in card
    s = ambiguous.summary()
    w = np.sort(np.asarray(ambiguous.spectrum_scaled))
    cut = s["cutoff_rtol"] * w[-1]
    kept, dropped = w[w > cut].min() / cut, np.abs(w[w <= cut]).max() / cut  # in cutoffs, from the spectrum
    assert _rows(card)["margin"] == f"{s['margin']:.3g}x (smallest kept {kept:.2g} x the cutoff; largest dropped" \
        f" {dropped:.2g} x)"
    assert s["margin"] == pytest.approx(min(kept, 1 / dropped))
    # the thumbnail draws the dropped eigenvalues in red: as many red dots as ambiguous directions
    assert card.count('fill="#c62828"/>') == ambiguous.ambiguous_dim


def test_a_verdict_not_settled_is_amber():
    s = {"verdict": "not settled", "identifiable": False, "rank": 5, "psi": 6, "ambiguous_dim": 1,
         "lambda_min": 1e-9, "lambda_max": 1.0, "cutoff_rtol": 1e-13, "condition_number": 1e12, "n_rows": 100,
         "margin": 3.0, "smallest_kept_relative": 3e-13, "largest_dropped_relative": None, "settle_factor": 10.0,
         "certificate_method": "gram"}
    card = report_html.certificate_html(s)
    assert 'data-verdict="not-settled"' in card and "#b26a00" in card and "NOT SETTLED" in card
    assert _rows(card)["margin"] == "3x (smallest kept 3 x the cutoff)"


def test_statistics_and_model_cards(fitted):
    st = _rows(fitted.statistics._repr_html_())
    assert st["rows N"] == f"{fitted.statistics.n_rows:,}" and st["psi"] == "6"
    m = _rows(fitted.model._repr_html_())
    assert m["heads"] == "4 (svd)" and m["d, d_out, psi"] == "2, 2, 6"
    assert m["||coef||_F"] == f"{np.linalg.norm(fitted.model.coef):.4g}"
    assert repr(fitted.model) == "MHLAModel(d=2, d_out=2, n_heads=4, causal=True, heads_method='svd')"
    assert repr(fitted.certificate).startswith("Certificate(identifiable (gram, margin ")


def test_repr_html_never_raises(fitted):
    broken = sa.FitResult(fitted.model, fitted.statistics, fitted.solution, fitted.heads, {"dataset": "<x>"})
    out = broken._repr_html_()  # the report lacks every key: the card cannot be drawn
    assert out.startswith("<pre>") and "&lt;x&gt;" in out  # escaped text instead
    cert = sa.Certificate(10, 6, 6, float("nan"), 1.0, 2.0, 0.5, 3.0, np.array([np.nan] * 6))
    out = cert._repr_html_()  # a NaN cutoff and spectrum: the card is drawn, without a thumbnail
    assert "scaleattn-verdict" in out and "<svg" not in out and 'data-verdict="not-settled"' in out
    assert report_html.safe_html(lambda: 1 / 0, lambda: 1 / 0) == "<pre>(no text representation)</pre>"
    assert report_html.safe_html(lambda: 1 / 0, lambda: 1 / 0, lambda: "a<b") == "<pre>a&lt;b</pre>"


def test_spectrum_svg_and_minimal_heads():
    svg = report_html.spectrum_svg(np.r_[np.zeros(3), np.logspace(-6, 0, 1000)], 1e-12, max_points=50)
    assert svg.count("<circle") <= 53 and svg.count('fill="#c62828"') >= 1  # subsampled, the dropped kept
    assert report_html.spectrum_svg([]) == ""
    assert report.minimal_heads({"n_heads": 2, "heads_method": "minimal", "heads_exact": True}) == {
        "count": 2, "exact": True, "source": "head search"}
    assert report.minimal_heads({"n_heads": 3, "heads_method": "best-3", "heads_exact": False}) is None
    assert report.minimal_heads({"n_heads": 3, "heads_method": "best-3", "heads_residual": 1e-3}) is None  # old
    assert not report.fewer_heads_suffice({"n_heads": 2, "heads_method": "minimal", "heads_exact": True,
                                           "teacher_heads": 2})


def test_heads_plot_marks_the_fewest_heads(fitted, tmp_path):
    from scaleattn import plot

    figs = plot.run_figures(fitted)
    (ax,) = figs["heads"].axes
    gids = {ln.get_gid(): ln for ln in ax.get_lines()}
    assert gids["minimal_heads"].get_xdata()[0] == 1.5  # the teacher's 1 head, left of the 4 svd heads
    legends = figs["heads"].legends  # (below the axes: they never cover the data)
    assert any("fewer heads suffice" in t.get_text() for lg in legends for t in lg.get_texts())
    ds = generate_mhla(str(tmp_path / "d.zarr"), d=2, heads=1, length=20, samples=64, causal=True, seed=0)
    res = sa.fit(ds, heads="minimal")
    (ax,) = plot.run_figures(res, ds)["heads"].axes
    assert "minimal_heads" not in {ln.get_gid() for ln in ax.get_lines()}  # 1 minimal head kept: nothing fewer


def test_summary_shows_phases_and_the_command_time(fitted):
    text = report.fit_summary(fitted.report, {"seconds": 12.5, "cluster": 4.0, "write": 2.0})
    lines = text.splitlines()
    assert lines[-2].startswith(f"wall time {fitted.report['seconds']:.2f} s (statistics ")
    assert lines[-1] == "command 12.50 s until this report (cluster start 4.00 s, write 2.00 s)"
    assert "fewer heads suffice: the teacher's 1 head computes the fitted function" in text
    t = fitted.report["timings"]
    assert t["solve_and_heads"] == pytest.approx(t["solve"] + t["heads"])


def test_all_zero_features_or_targets_print_no_nan():
    """All-zero tokens (no cutoff: the margin is undefined) and all-zero targets (no relative error) printed
    'margin nanx' and 'relative nan' in the summary (report.json held null): both read n/a."""
    rng = np.random.default_rng(0)
    est = sa.MHLARegressor().fit(np.zeros((8, 3, 2)), rng.standard_normal((8, 2)))
    line = report.verdict(est.certificate_.summary())
    assert "nan" not in line and line.endswith("margin n/a]"), line
    text = report.evaluation_summary({"mse": 0.0, "relative_mse": float("nan"), "target_mean_square": 0.0,
                                      "n_rows": 8})
    assert "relative n/a" in text and "nan" not in text, text


def test_the_qr_hint_is_not_offered_where_no_statistics_build_exists():
    """A streamed fit (no statistics, no QR to follow) is not told to try ``--certificate qr``, which that path
    refuses; a Gram-path fit still is."""
    from scaleattn.display._text import verdict

    r = {"verdict": "not settled", "certificate_method": "gram", "margin": 0.5, "settle_factor": 10.0,
         "ambiguous_dim": 0, "psi": 6, "rank": 6}
    assert "--certificate qr" in verdict(r)
    streamed = dict(r, solver_path={"path": "stream", "reason": "asked", "statistics_written": False})
    assert "--certificate qr" not in verdict(streamed)
