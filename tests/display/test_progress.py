"""Progress of long steps: rich bars counted in rows on stderr in a captured CLI run with a real LocalCluster,
driven by the job's own client and futures, never default_client(); phases named; --json and --quiet keep stderr
clean."""
import json

import pytest
from distributed import Client, LocalCluster, default_client

import scaleattn.distributed.cluster as cluster
from scaleattn.display._progress import ConsoleReporter
from scaleattn.distributed.build import compute_statistics


@pytest.mark.slow
def test_cli_fit_shows_dashboard_and_bars(causal_ds, tmp_path, cli):
    r = cli("fit", causal_ds.url, "--out", tmp_path / "run", "--workers", "1", "--no-plots")
    out, err = r.stdout, r.stderr
    assert "dashboard http://127.0.0.1:" in err  # the link is printed when the cluster starts
    lines = err.splitlines()
    assert any(ln.startswith("statistics") and "960/960 rows" in ln and "rows/s" in ln for ln in lines), err
    assert any(ln.startswith("evaluate") and "96/96 samples" in ln for ln in lines), err
    assert any(ln.startswith("solve (psi 6): done in") for ln in lines), err
    assert any(ln.startswith("heads (svd): done in") for ln in lines), err
    assert any(ln.startswith("write ") for ln in lines), err
    assert "rows/s" not in out and "certificate: IDENTIFIABLE" in out  # bars on stderr, summary on stdout


@pytest.mark.slow
def test_cli_json_and_quiet_are_clean(causal_ds, tmp_path, cli):
    r = cli("fit", causal_ds.url, "--out", tmp_path / "a", "--local", "--json", "--no-plots")
    assert json.loads(r.stdout)["n_rows"] == 960 and "statistics" not in r.stderr
    r = cli("fit", causal_ds.url, "--out", tmp_path / "b", "--local", "--quiet", "--no-plots")
    assert r.stderr == "" and "certificate: IDENTIFIABLE" in r.stdout  # --quiet silences stderr; the result stays


@pytest.fixture(scope="module")
def two_clients():
    """The job's client (a real process LocalCluster via connect) and, created after it, another client that
    is the default one."""
    with cluster.connect(workers=1, quiet=True) as job:
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as lc, Client(lc) as other:
            assert default_client() is other and default_client() is not job
            yield job, other


def _n_prefixes(client):
    return client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.task_prefixes))


@pytest.mark.slow
def test_progress_uses_the_job_client_not_the_default(causal_ds, two_clients, capfd):
    job, other = two_clients
    before = _n_prefixes(other)
    st = compute_statistics(causal_ds, job, progress=True)
    assert st.n_rows == 960
    err = capfd.readouterr().err
    assert "960/960 rows" in err and "statistics" in err
    assert _n_prefixes(job) > 0 and _n_prefixes(other) == before  # nothing ran on the default client


def test_console_reporter_prints_final_state_when_not_a_terminal(capsys):
    import io

    buf = io.StringIO()
    rep = ConsoleReporter(file=buf)
    with rep.bar("statistics", 1000, note="2 of 4 row groups resumed from the checkpoint", done=500) as advance:
        advance(500)
    with rep.phase("solve"):
        pass
    text = buf.getvalue()
    assert "1,000/1,000 rows" in text and "resumed from the checkpoint" in text and "solve: done in" in text


def test_a_live_bar_says_what_it_waits_for_before_the_first_group(monkeypatch):
    """The first run after an install compiles kernels (up to ~40 s) before any group is done: a live bar that has
    seen nothing of this run for PENDING_S says it waits for the first group (it sat at 0 rows with no rate), and goes
    back to the rate once a group is done; a bar whose rows were all resumed never says it."""
    import io
    import time

    from rich.console import Console

    import scaleattn.display._progress as progress

    monkeypatch.setattr(progress, "PENDING_S", 0.3)
    rep = ConsoleReporter(file=io.StringIO())
    rep.console = Console(file=io.StringIO(), force_terminal=True, width=250)
    with rep.bar("statistics", 1000, steps=4, wait_reason="the first run after an install compiles the kernels,"
                 " <= 40 s") as advance:
        time.sleep(0.2)
        early = rep.console.file.getvalue()
        time.sleep(0.5)
        waiting = rep.console.file.getvalue()
        advance(500, steps=1)
        time.sleep(0.3)
    after = rep.console.file.getvalue()[len(waiting):]
    assert "waiting for" not in early and "0/1,000 rows" in early
    assert "statistics: waiting for the first group (the first run after an install compiles the kernels" in waiting
    assert "waiting for" not in after and "rows/s incl. start-up" in after  # one group: its rate has the wait
    rep.console = Console(file=io.StringIO(), force_terminal=True, width=250)
    with rep.bar("statistics", 1000, steps=4, done=1000, steps_done=4):
        time.sleep(0.5)
    assert "waiting for" not in rep.console.file.getvalue()


def _until(cond, timeout=30.0):  # (polls: a timer thread's line, however loaded the machine)
    import time

    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


def test_a_log_says_once_what_it_waits_for(monkeypatch):
    """Not a terminal (a pipe, a log): nothing showed until the bar's end (~12 s of a first compile); now the wait
    prints one line, once, and no bar."""
    import io

    import scaleattn.display._progress as progress

    monkeypatch.setattr(progress, "PENDING_S", 0.0)
    for reason, said in (("kernels compile", " (kernels compile)"), ("", "")):  # the reason only when one is known
        buf = io.StringIO()
        rep = ConsoleReporter(file=buf)
        with rep.bar("statistics", 1000, steps=4, wait_reason=reason) as advance:
            _until(lambda b=buf: "waiting" in b.getvalue())
            advance(1000, steps=4)
        lines = buf.getvalue().splitlines()
        assert lines[0] == f"statistics: waiting for the first group{said}"
        assert len(lines) == 2 and lines[1].startswith("statistics  1,000/1,000 rows")


def test_the_live_bar_stays_within_the_terminal_width(monkeypatch):
    """At 120 columns the wait's text wrapped the bar over 3 lines."""
    import io
    import re

    from rich.console import Console

    import scaleattn.display._progress as progress

    monkeypatch.setattr(progress, "PENDING_S", 0.0)
    for width in (120, 100):
        rep = ConsoleReporter(file=io.StringIO())
        rep.console = Console(file=io.StringIO(), force_terminal=True, width=width)
        with rep.bar("statistics", 5_120_000, steps=512) as advance:
            _until(lambda rep=rep: "compiles" in rep.console.file.getvalue())
            advance(10_000, steps=1)
            advance(10_000, steps=1)  # a rate after the first group, labelled so
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", rep.console.file.getvalue())
        frames = [f for f in re.split(r"[\r\n]+", text) if f.strip()]
        assert any("waiting for the first group" in f and "0/512 groups" in f for f in frames), frames
        assert max(len(f) for f in frames) <= width, [f for f in frames if len(f) > width]
        assert any("rows/s after the first" in f for f in frames), frames  # the rate says what it is


def test_the_rate_counts_from_the_first_finished_group(monkeypatch):
    """The wait before the first group (a first compile) is not in the rate: 255 rows/s shown at first, 3,789 at
    the end of a run whose groups ran at more."""
    import scaleattn.display._progress as progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    st = progress._BarState("statistics", 4000, "rows", 0, 4, "groups", 0)
    now[0] = 10.0  # the first group after a 10 s compile
    st.advance(1000, steps=1)
    assert st.rate_text() == "100 rows/s incl. start-up"
    now[0] = 13.0
    st.advance(3000, steps=3)
    assert st.rate() == 1000.0 and st.left() == 0.0
    # said to be so: 4,000 rows in 13 s elapsed read as 308 rows/s, not 1,000
    assert st.rate_text() == "1,000 rows/s after the first group"
    assert st.text(final=True) == ("statistics  4,000/4,000 rows  1,000 rows/s after the first group  4/4 groups"
                                   "  0:00:13 elapsed")


def test_a_phase_says_what_it_does_now_and_then(monkeypatch):
    """--heads minimal ran 45 s in the heads phase: a log showed nothing until its end, a terminal a bare spinner.
    A phase yields ``note(text)``: a log gets the latest note every NOTE_EVERY_S (with the time elapsed), a
    terminal's spinner shows it, the silent reporter ignores it."""
    import io
    import time

    from rich.console import Console

    import scaleattn.display._progress as progress

    monkeypatch.setattr(progress, "NOTE_EVERY_S", 0.05)
    buf = io.StringIO()
    rep = ConsoleReporter(file=buf)
    with rep.phase("heads", "minimal") as note:
        note("trying 22 heads (exact fit, start 1 of 4)")
        _until(lambda: "trying 22" in buf.getvalue())
        note("trying 3 heads (loss curve)")
        _until(lambda: "trying 3 heads" in buf.getvalue())
    lines = buf.getvalue().splitlines()
    assert lines[0] == "heads (minimal): 0:00:00 elapsed, trying 22 heads (exact fit, start 1 of 4)", lines
    assert any(ln.endswith("elapsed, trying 3 heads (loss curve)") for ln in lines)
    assert lines[-1].startswith("heads (minimal): done in") and len(lines) <= 20  # now and then, not per note
    rep.console = Console(file=io.StringIO(), force_terminal=True, width=250)
    with rep.phase("heads", "minimal") as note:
        note("trying 7 heads (loss curve)")
        time.sleep(0.3)
    assert "heads\x1b[0m (minimal) ... trying 7 heads (loss curve)" in rep.console.file.getvalue()
    with progress.Reporter().phase("heads") as note:
        note("ignored")
    shown = []
    monkeypatch.setattr(progress.NotebookReporter, "_show", staticmethod(lambda t, h, handle=None: shown.append(t)))
    with progress.NotebookReporter(interval=0.0).phase("heads", "minimal") as note:
        note("trying 4 heads (bisection)")
    assert shown[1] == "heads (minimal) ... trying 4 heads (bisection)"
    assert shown[-1].startswith("heads (minimal): done")


def _notebook_lines(monkeypatch):
    """The plain-text twin of every state a NotebookReporter shows (first display and updates), in order."""
    import scaleattn.display._progress as progress

    shown = []
    monkeypatch.setattr(progress.NotebookReporter, "_show",
                        staticmethod(lambda t, h, handle=None: shown.append((t, h)) or "handle"))
    return shown


def test_a_notebook_bar_moves_and_says_what_it_waits_for(monkeypatch):
    """A notebook's bar was redrawn only when a group finished: through a 90 s first compile the cell showed
    ``0/5,120 rows  0/16 groups  0:00:00 elapsed`` and nothing else."""
    import scaleattn.display._progress as progress

    monkeypatch.setattr(progress, "PENDING_S", 0.0)
    monkeypatch.setattr(progress, "TICK_S", 0.01)
    shown = _notebook_lines(monkeypatch)
    with progress.NotebookReporter(interval=0.0).bar("statistics", 1000, steps=4,
                                                     wait_reason="compiles kernels") as advance:
        _until(lambda: len(shown) > 2)
        advance(1000, steps=4)
    waiting = [t for t, _ in shown[1:-1] if "waiting for the first group" in t]
    assert waiting and "compiles kernels" in waiting[0] and waiting[0].endswith("left"), shown
    assert "waiting" not in shown[-1][0] and shown[-1][0].startswith("statistics  1,000/1,000 rows")


def test_an_interrupted_notebook_cell_does_not_look_like_it_still_runs(monkeypatch):
    """Ctrl-C (the kernel's stop button) in a fit left ``evaluate 512/4,096 samples ... 0:00:01 left`` and
    ``solve ...`` in the saved cell, as if the work went on."""
    import scaleattn.display._progress as progress

    shown = _notebook_lines(monkeypatch)
    rep = progress.NotebookReporter(interval=0.0)
    with pytest.raises(KeyboardInterrupt):
        with rep.bar("evaluate", 4096, "samples", steps=16) as advance:
            advance(512, steps=2)
            raise KeyboardInterrupt
    text, html = shown[-1]
    assert "512/4,096 samples" in text and text.endswith("elapsed  interrupted") and "left" not in text, text
    assert "interrupted" in html and 'data-done="512"' in html
    with pytest.raises(ValueError):
        with rep.phase("solve", "psi 40"):
            raise ValueError("bad")
    assert shown[-1][0].startswith("solve (psi 40): stopped by ValueError after ")
    with pytest.raises(KeyboardInterrupt):
        with rep.phase("heads", "minimal"):
            raise KeyboardInterrupt
    assert shown[-1][0].startswith("heads (minimal): interrupted after ")


def test_the_compile_reason_is_said_only_when_the_kernels_cache_is_cold(tmp_path, monkeypatch):
    """Every run, long after the first, said it waited because "the first run after an install compiles
    kernels": the reason now comes from numba's cache files (an index of this numba version, newer than the
    source), and the build passes it to its bar only when they are missing or stale."""
    import importlib.metadata
    import os
    import pickle

    from scaleattn.distributed import build
    from scaleattn.statistics import _compiled

    src = tmp_path / "_compiled.py"
    src.write_text("# the kernels")
    monkeypatch.setattr(_compiled, "__file__", str(src))
    assert not _compiled.kernels_cached()  # no cache at all: a fresh install
    assert build._wait_reason("numba").startswith("the first run after an install compiles the kernels")
    assert build._wait_reason("numpy") == ""  # nothing to compile
    (tmp_path / "__pycache__").mkdir()
    index = tmp_path / "__pycache__" / f"_compiled._piece-315.py{os.sys.version_info[0]}{os.sys.version_info[1]}.nbi"
    for version, index_newer, cached in (("0.0.1", True, False), (importlib.metadata.version("numba"), False, False),
                                         (importlib.metadata.version("numba"), True, True)):
        with open(index, "wb") as f:
            pickle.dump(version, f)
            f.write(pickle.dumps(((0, 0), {})))
        t = os.stat(src).st_mtime
        os.utime(index, (t + 10, t + 10) if index_newer else (t - 10, t - 10))
        assert _compiled.kernels_cached() is cached, (version, index_newer)
        assert (build._wait_reason("numba") == "") is cached
