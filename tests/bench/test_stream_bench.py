"""`scaleattn bench stream`'s command part: a real `scaleattn fit --solver stream` in a child process."""
import pytest

from scaleattn.bench import stream


@pytest.mark.slow
def test_cli_fit_reports_the_command_it_ran(tmp_path):
    r = stream.cli_fit(8, d_out=1, out_dir=str(tmp_path))
    assert "error" not in r, r.get("error")
    assert r["verdict"] == "identifiable" and r["identifiable_with_probability"] == pytest.approx(0.999)
    assert r["teacher_coef_relative"] < 1e-8  # realizable: the teacher's coefficients, to round-off
    assert r["passes"] >= r["cg_iterations"] > 0 and r["peak_rss_gib"] > 0
    assert list(tmp_path.iterdir()) == []  # the dataset and run directory are removed
    text = stream.markdown({"compare": [], "cli_fit": r})
    assert "--solver stream` at d = 8" in text and "relative" in text
