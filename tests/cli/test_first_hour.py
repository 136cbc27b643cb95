"""What a new user meets in the first hour, through the real command: --quiet keeps the result on stdout,
something is on screen before the cluster starts (and nothing when the input is bad), integer tokens are
converted, CSV errors name the column, install hints follow how scaleattn was installed, --resume of a finished
run says there is nothing to resume, the live bars count rows and row groups (resumed ones named)."""
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from scaleattn.display._progress import ConsoleReporter, NotebookReporter, as_reporter

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quiet_hides_stderr_and_keeps_the_result(causal_ds, tmp_path, cli):
    r = cli("fit", causal_ds.url, "--out", tmp_path / "q", "--local", "--quiet", "--no-plots")
    assert r.stderr == "" and "certificate: IDENTIFIABLE" in r.stdout
    assert f"wrote {tmp_path / 'q'}/report.json" in r.stdout
    r = cli("fit", causal_ds.url, "--out", tmp_path / "qj", "--local", "--quiet", "--json", "--no-plots")
    assert r.stderr == "" and json.loads(r.stdout)["identifiable"] is True
    help_text = re.sub(r"\s+", " ", cli("fit", "--help").stdout)
    assert "--quiet nothing on stderr but errors and warnings" in help_text and "still printed on stdout" in help_text


@pytest.mark.slow
def test_a_line_before_the_cluster_starts_and_none_on_bad_input(causal_ds, tmp_path, cli):
    p = subprocess.Popen([sys.executable, "-m", "scaleattn.cli", "fit", causal_ds.url, "--out", "c", "--workers",
                          "1", "--no-plots"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stamped = [(time.perf_counter(), ln.rstrip("\n")) for ln in p.stdout]
    assert p.wait(timeout=300) == 0
    lines = [ln for _, ln in stamped]
    assert lines[0] == "starting a local Dask cluster (1 worker) ...", lines
    assert re.match(r"dask: 1 worker ready in [\d.]+ s, dashboard http://127\.0\.0\.1:\d+/status", lines[1]), lines
    # the first line comes before the cluster's start-up, which the second line reports
    start_s = float(re.search(r"ready in ([\d.]+) s", lines[1]).group(1))
    assert stamped[1][0] - stamped[0][0] >= 0.5 * start_s, stamped[:2]
    names = [ln.split(" ")[0] for ln in lines]
    for phase in ("statistics", "solve", "heads", "evaluate", "write"):
        assert phase in names, lines
    assert any(ln.startswith("command ") and "cluster start" in ln for ln in lines), lines
    bad = cli("fit", causal_ds.url, "--out", tmp_path / "c2", "--heads", "zero", rc=2)
    assert "starting" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_integer_tokens_are_converted_and_csv_errors_name_the_column(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    rng = np.random.default_rng(0)
    np.savez("ints.npz", tokens=rng.integers(-3, 4, (40, 5, 2)), targets=rng.integers(0, 5, (40, 2)))
    assert cli("import", "ints.zarr", "--npz", "ints.npz").stdout.startswith("wrote ints.zarr: N=40 T=5 d=2")
    from scaleattn import open_dataset

    tok, _, y = open_dataset("ints.zarr").read(0, 40)
    assert tok.dtype == np.float64 and y.dtype == np.float64
    assert np.array_equal(tok, np.load("ints.npz")["tokens"])
    assert json.loads(cli("fit", "ints.zarr", "--out", "r", "--local", "--json", "--no-plots").stdout)["n_rows"] == 40
    Path("s.csv").write_text("a,b,c\n" + "\n".join(f"{i},{i * 2},{i % 3}" for i in range(40)))
    r = cli("import", "s.zarr", "--csv", "s.csv", "--columns", "a", "z", rc=2)
    # (no "see --help" tail: the line itself lists the columns the file has)
    assert r.stderr.strip() == "scaleattn import: error: s.csv: no column 'z' in the header (columns: a, b, c)"
    r = cli("import", "s.zarr", "--csv", "s.csv", "--columns", "a,c", rc=2)  # a comma list, as in other tools
    assert "no column 'a,c' in the header" in r.stderr
    assert r.stderr.strip().endswith("name each column apart: --columns a c")
    Path("t.csv").write_text("a,b\n1,2\n3,x\n")
    r = cli("import", "t.zarr", "--csv", "t.csv", "--length", "1", rc=2)
    assert "line 3, column 'b': 'x' is not a number" in r.stderr


def test_install_hints_follow_the_installation(monkeypatch):
    from scaleattn import errors

    hint = errors.install_hint("gpu", "cupy")
    assert hint.startswith("pip install")
    # every hint in the package goes through install_hint: no hard-coded `pip install` outside errors.py
    for path in (ROOT / "scaleattn").rglob("*.py"):
        if path.name != "errors.py":
            assert "pip install" not in path.read_text(), f"{path}: use scaleattn.errors.install_hint"

    class Dist:
        def __init__(self, text):
            self.text = text

        def read_text(self, name):
            return self.text

    from importlib import metadata

    checkout = json.dumps({"url": "file:///src/scaleattn", "dir_info": {"editable": True}})
    monkeypatch.setattr(metadata, "distributions", lambda name: [Dist(checkout)])
    assert errors.install_hint("gpu", "cupy") == "pip install -e '/src/scaleattn[gpu]'"
    monkeypatch.setattr(metadata, "distributions", lambda name: [Dist(None)])
    assert errors.install_hint("gpu", "cupy") == "pip install 'scaleattn[gpu]'"
    monkeypatch.setattr(metadata, "distributions", lambda name: [])
    assert errors.install_hint("gpu", "cupy") == "pip install cupy"
    monkeypatch.setattr(metadata, "distributions", lambda name: [Dist(checkout)])
    import fsspec.core

    def no_s3fs(url, **kw):  # what fsspec raises for s3:// without s3fs
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_s3fs)
    from scaleattn.store._location import fs_for

    with pytest.raises(errors.MissingDependencyError, match=r"s3://b/x.zarr needs s3fs: pip install -e '/src/"):
        fs_for("s3://b/x.zarr")


@pytest.mark.slow
def test_resume_of_a_finished_run_says_nothing_to_resume(causal_ds, tmp_path, cli):
    cli("fit", causal_ds.url, "--out", tmp_path / "done", "--local", "--quiet", "--no-plots")
    r = cli("fit", causal_ds.url, "--out", tmp_path / "done", "--local", "--resume", rc=2)
    assert "nothing to resume" in r.stderr and "done.checkpoint.zarr" in r.stderr


def test_resume_without_a_checkpoint_says_it_starts_from_the_first_group(causal_ds, tmp_path, cli):
    """--resume where no fit was interrupted silently did a whole fit: now one note says so."""
    r = cli("fit", causal_ds.url, "--out", tmp_path / "new", "--local", "--resume", "--no-plots", "--quiet")
    note = f"scaleattn fit: note: no checkpoint for {tmp_path / 'new'} yet: starting from the beginning"
    assert r.stderr.splitlines() == [note] and (tmp_path / "new" / "report.json").exists()
    r = cli("fit", causal_ds.url, "--out", tmp_path / "plain", "--local", "--no-plots", "--quiet")
    assert "note:" not in r.stderr


@pytest.mark.slow
def test_resumed_groups_are_shown_as_such(causal_groups_ds, tmp_path, cli_process):
    args = ("fit", causal_groups_ds.url, "--out", tmp_path / "res", "--local", "--no-plots")
    cli_process(*args, rc=75, extra_env={"SCALEATTN_TEST_STOP_AFTER_GROUPS": "3"})  # dies after 3 of 16 groups
    r = cli_process(*args, "--resume")
    assert "statistics: 3 of 16 row groups resumed from the checkpoint" in r.stderr
    assert re.search(r"statistics  640/640 rows  [\d,]+ rows/s after the first group  16/16 groups", r.stderr), r.stderr


def test_reporters_count_rows_rate_and_groups(monkeypatch):
    buf = io.StringIO()
    with ConsoleReporter(file=buf).bar("statistics", 800, done=200, steps=8, steps_done=2) as advance:
        for _ in range(6):
            advance(100, steps=1)
    text = buf.getvalue()  # not a terminal: the final state once, one plain line
    assert re.fullmatch(r"statistics  800/800 rows  [\d,]+ rows/s after the first group  8/8 groups"
                        r"  \d+:\d\d:\d\d elapsed\n", text), text
    shown = []

    class Handle:
        def update(self, bundle, raw):
            shown.append(bundle)

    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda bundle, raw, display_id: shown.append(bundle) or Handle())
    rep = NotebookReporter(interval=0.0)
    with rep.bar("evaluate", 64, "samples", steps=2) as advance:
        advance(32, steps=1)
        advance(32, steps=1)
    first, last = shown[0]["text/plain"], shown[-1]["text/plain"]
    assert first.startswith("evaluate  0/64 samples") and "0/2 groups" in first and "left" in first
    assert re.match(r"evaluate  64/64 samples  [\d,]+ samples/s after the first group  2/2 groups"
                    r"  \d+:\d\d:\d\d elapsed$", last), last
    assert 'class="scaleattn-progress" data-name="evaluate" data-done="64"' in shown[-1]["text/html"]
    assert type(as_reporter(True)) is ConsoleReporter  # outside a kernel
