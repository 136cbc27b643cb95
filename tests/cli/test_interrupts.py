"""Ctrl-C and SIGTERM while the embedded Dask cluster starts: one line, exit 130 / 143, no traceback (from the job
or from a worker process still importing), no worker process left running and nothing written. Ctrl-C while the
command imports the package, parses its options or exits: one line and 130 as well."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _live(pgid: int) -> list[str]:
    """The processes of the job's group still running (zombies left to an init that does not reap aside)."""
    ps = ["ps", "-ww", "-o", "pid=,stat=,args=", "-g", str(pgid)]
    out = subprocess.run(ps, capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.split()[1][0] != "Z"]


@pytest.mark.slow
@pytest.mark.parametrize("signum, rc, says", [(signal.SIGINT, 130, "interrupted"),
                                              (signal.SIGTERM, 143, "stopped by SIGTERM")])
@pytest.mark.parametrize("when", ["starting", "importing"])
def test_a_signal_to_the_whole_job_while_its_cluster_starts_is_one_line(causal_ds, tmp_path, signum, rc, says,
                                                                         when):
    """As a terminal's Ctrl-C (or a pod's SIGTERM to every process): the worker processes, still importing, took
    it and printed KeyboardInterrupt tracebacks, and the job's own interrupt left a half-started cluster whose
    atexit close failed (``AssertionError: Status.init``)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "scaleattn.cli", "fit", causal_ds.url, "--out", "run", "--workers",
                          "2", "--no-plots"], cwd=tmp_path, env=env, text=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (not inherited ignored)
    try:
        first = p.stderr.readline()
        assert first.startswith("starting a local Dask cluster"), first
        deadline = time.monotonic() + 60
        while when == "importing" and not any("spawn_main" in ln for ln in _live(p.pid)):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        time.sleep(0.3 if when == "importing" else 0)  # a worker process imports distributed (1-2 s)
        os.killpg(p.pid, signum)
        err = first + p.stderr.read()
        assert p.wait(timeout=120) == rc, err
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "Traceback" not in err and "Error" not in err and "KeyboardInterrupt" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"scaleattn fit: {says}"), err
    assert [ln for ln in lines if ln.startswith("scaleattn fit:")] == lines[-1:], err  # that line, once
    time.sleep(0.5)
    assert _live(p.pid) == [], _live(p.pid)  # the workers were stopped with the job
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no output, no checkpoint, no temporary


STARTING = "scaleattn: interrupted while starting; nothing was done"


def _interrupted_at(where: str, argv: list[str], tmp_path, times: int = 1,
                    may_not_reach: bool = False) -> tuple[int, str, str]:
    """Run ``argv`` (a real process: its own interpreter and signal handlers) with the hook
    ``SCALEATTN_TEST_PAUSE`` (tests/inject/scaleattn_hooks.py) pausing it at ``where``, send it Ctrl-C there
    (``times`` times, 0.3 s apart, as an impatient user): (exit code, stdout, stderr). With ``may_not_reach`` a
    process that ends without reaching ``where`` is not a failure (the code and output are returned as they are)."""
    marker = tmp_path / f"paused-{where}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "SCALEATTN_TEST_PAUSE": f"{where}:{marker}"}
    p = subprocess.Popen(argv, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (not inherited ignored)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            if may_not_reach and p.poll() is not None:
                break
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
        else:
            for k in range(times):
                time.sleep(0.3 if k else 0)
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, err


def _program(how: str, tmp_path) -> list[str]:
    """The ``scaleattn`` program as ``how`` starts it: ``python -m ...``, or the console script pip writes for
    [project.scripts] (the interpreter runs it by its path)."""
    if how != "console script":
        return [sys.executable, *how.split()]
    script = tmp_path / "bin" / "scaleattn"
    script.parent.mkdir()
    script.write_text("import sys\nfrom scaleattn.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n")
    return [sys.executable, str(script)]


@pytest.mark.parametrize("how", ["-m scaleattn", "-m scaleattn.cli", "console script"])
def test_ctrl_c_while_the_command_imports_is_one_line(tmp_path, how):
    """``import scaleattn`` (numpy, zarr, dask: a second or more) comes before ``main`` can catch anything: Ctrl-C
    there printed a traceback through the import machinery (and the process died of the signal)."""
    argv = _program(how, tmp_path)
    rc, out, err = _interrupted_at("import", [*argv, "generate", "mhla", "d.zarr"], tmp_path)
    assert (rc, out, err) == (130, "", STARTING + "\n")
    assert sorted(os.listdir(tmp_path)) == (["bin"] if how == "console script" else []) + ["paused-import"]


def test_ctrl_c_while_a_program_imports_scaleattn_is_python_s_own(tmp_path):
    """Only the command's process turns Ctrl-C into its line: a program that imports scaleattn keeps Python's
    KeyboardInterrupt (its traceback, the death by the signal)."""
    rc, _, err = _interrupted_at("import", [sys.executable, "-c", "import scaleattn"], tmp_path)
    assert rc == -signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), err


def test_ctrl_c_as_the_command_exits_is_one_line(tmp_path):
    """After ``main`` returned the interpreter still closes clients and joins threads; Ctrl-C there printed an
    ``Exception ignored`` traceback. The command's output is out, complete, and the line says it had ended."""
    rc, out, err = _interrupted_at("exit", [sys.executable, "-m", "scaleattn", "generate", "mhla", "d.zarr",
                                            "--samples", "8", "--length", "3"], tmp_path)
    assert (rc, out, err) == (130, "wrote d.zarr: N=8 T=3 d=2 d_out=2 causal=False\n",
                              "scaleattn generate mhla: interrupted while exiting (the command had ended)\n")


GENERATE = ["generate", "mhla", "d.zarr", "--samples", "8", "--length", "3"]
WROTE = "wrote d.zarr: N=8 T=3 d=2 d_out=2 causal=False\n"
ENDED = "scaleattn generate mhla: interrupted while exiting (the command had ended)\n"


@pytest.mark.slow
@pytest.mark.parametrize("where, times", [("exit", 2), ("atexit", 1), ("atexit", 3)])
def test_ctrl_c_in_the_interpreter_s_exit_is_one_line(tmp_path, where, times):
    """The interpreter's exit handlers (distributed closing its clients) come after ``main``: Ctrl-C there, once or
    again and again, is the same one line and 130, the output complete."""
    rc, out, err = _interrupted_at(where, [sys.executable, "-m", "scaleattn", *GENERATE], tmp_path, times=times)
    assert (rc, out, err) == (130, WROTE, ENDED)
    assert sorted(os.listdir(tmp_path)) == ["d.zarr", f"paused-{where}"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["-m scaleattn.cli", "console script"])
def test_no_python_finalisation_follows_the_command(tmp_path, how):
    """Python's finalisation (module teardown: a second or less with numpy, dask and zarr loaded) runs with SIGINT
    reset to the system's default: a Ctrl-C there killed the process by the signal, no line (-2). The command ends
    the process once its exit handlers ran, so that finalisation is never reached: exit 0, nothing more said."""
    argv = _program(how, tmp_path)
    rc, out, err = _interrupted_at("finalize", [*argv, *GENERATE], tmp_path, may_not_reach=True)
    assert (rc, out, err) == (0, WROTE, ""), "finalisation reached" if (tmp_path / "paused-finalize").exists() else ""


@pytest.mark.slow
def test_the_exit_code_of_a_failed_command_survives_its_exit(tmp_path):
    """The process ends with the command's own code (here 2, a refusal; argparse's usage error 2; --version 0)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    (tmp_path / "d.zarr").mkdir()
    for argv, rc, says in [(GENERATE, 2, "scaleattn generate mhla: error: "),
                           (["fit"], 2, "scaleattn fit: error: the following arguments are required"),
                           (["--version"], 0, "")]:
        p = subprocess.run([sys.executable, "-m", "scaleattn", *argv], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout=120)
        assert p.returncode == rc and p.stderr.startswith(says), (argv, p.returncode, p.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("where, times", [("report", 1), ("teardown", 1), ("teardown", 2), ("exit", 1)])
def test_ctrl_c_after_a_fit_s_report_is_one_line(causal_ds, tmp_path, where, times):
    """After the report is printed, while the embedded cluster stops (Ctrl-C twice: the second one during the
    clean-up of the first), as ``main`` returns: 130, one line that says the run was written in full, and it was."""
    rc, out, err = _interrupted_at(where, [sys.executable, "-m", "scaleattn", "fit", causal_ds.url, "--out", "run",
                                           "--workers", "1", "--no-plots"], tmp_path, times=times)
    assert rc == 130 and "wrote run/report.json" in out, (rc, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("scaleattn fit:")]
    said = ("interrupted while exiting (the command had ended)" if where == "exit"
            else "interrupted after it wrote run in full")
    assert lines == [f"scaleattn fit: {said}"] and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path / "run"))[:2] == ["model.zarr", "report.json"]


_RUNS_THE_COMMAND_AND_GOES_ON = r"""
import runpy, signal, sys
sys.argv = ["scaleattn", "generate", "mhla", "d.zarr", "--samples", "8", "--length", "3"]
try:
    runpy.run_module("scaleattn", run_name="__main__")  # as IPython's %run -m scaleattn does
except SystemExit as e:
    print("the command returned", e.code)
try:
    signal.raise_signal(signal.SIGINT)  # the program's own Ctrl-C, later on
except KeyboardInterrupt:
    print("the program's KeyboardInterrupt")
"""


def test_a_program_that_runs_the_command_in_its_process_keeps_its_ctrl_c(tmp_path):
    """``main`` hands the interpreter's exit to a handler that ends the process with 130 on Ctrl-C only in the
    ``scaleattn`` program: a program that runs the command in its own process and goes on (IPython's ``%run -m
    scaleattn``, ``runpy``) was ended by its next Ctrl-C, "interrupted while exiting (the command had ended)"."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", _RUNS_THE_COMMAND_AND_GOES_ON], cwd=tmp_path, env=env, text=True,
                       capture_output=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (not inherited ignored)
    assert (p.returncode, p.stdout.splitlines()[1:]) == (0, ["the command returned 0",
                                                             "the program's KeyboardInterrupt"]), p.stderr


def test_ctrl_c_while_the_options_are_parsed_or_the_command_sets_up_is_one_line(tmp_path, capsys, monkeypatch):
    """``main``'s own steps around the command (parsing the options, which imports every command's module,
    enabling faulthandler) were outside its Ctrl-C handling: a traceback."""
    import scaleattn.cli as command_line

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(command_line, "parse", interrupted)
    assert command_line.main(["generate", "mhla", str(tmp_path / "d.zarr")]) == 130
    assert capsys.readouterr().err == STARTING + "\n"
    monkeypatch.undo()
    monkeypatch.setattr(command_line, "_enable_faulthandler", interrupted)
    assert command_line.main(["generate", "mhla", str(tmp_path / "d.zarr")]) == 130
    assert capsys.readouterr().err == ("scaleattn generate mhla: interrupted; nothing was written (outputs are"
                                       " written all or nothing)\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("orig_argv, command", [
    (["/venv/bin/python", "/venv/bin/scaleattn", "fit"], True),  # the console script, run by its shebang
    (["python3", "-s", "/usr/local/bin/scaleattn"], True),
    (["python", "-m", "scaleattn", "fit"], True),
    (["python", "-X", "importtime", "-m", "scaleattn.cli"], True),
    (["python", "-Bm", "scaleattn"], True),
    (["python", "-mscaleattn.cli"], True),
    (["python", "--check-hash-based-pycs", "never", "-m", "scaleattn"], True),  # (a long option with a value)
    (["python", "-m", "scaleattn.bench"], False),
    (["python", "-m", "pytest", "tests"], False),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()", "--multiprocessing-fork"],
     False),  # a Dask worker of the command: sys.argv is the command's there, the interpreter's line is not
    (["python", "run.py", "-m", "scaleattn"], False),
    (["python", "/home/me/scaleattn.py"], False),
    (["python"], False),
])
def test_only_the_command_s_own_process_is_the_command(orig_argv, command):
    from scaleattn._startup import is_the_command

    assert is_the_command(orig_argv) is command
