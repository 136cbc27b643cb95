"""The commands end to end: generate -> fit -> evaluate -> certify (as real processes on a real LocalCluster, and
in this process), import, compare, --version and --help, both solver paths at d = 16."""
import json

import numpy as np
import pytest

from scaleattn.data._dataset import open_dataset
from scaleattn.features import phi, token_features
from scaleattn.model import MHLAModel


@pytest.mark.slow
def test_generate_fit_evaluate_round_trip(tmp_path, cli_process):
    data, fresh, out = tmp_path / "data.zarr", tmp_path / "fresh.zarr", tmp_path / "run1"
    cli_process("generate", "mhla", data, "--d", 2, "--heads", 1, "--length", 100, "--samples", 512, "--causal",
                "--seed", 0)
    cli_process("generate", "mhla", fresh, "--d", 2, "--heads", 1, "--length", 50, "--samples", 64, "--causal",
                "--seed", 0)
    p = cli_process("fit", data, "--out", out, "--workers", 2)
    assert "certificate: IDENTIFIABLE" in p.stdout and "dashboard http://127.0.0.1" in p.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["n_rows"] == 51200 and rep["psi"] == 6 and rep["identifiable"] is True
    assert rep["train_mse"] / rep["target_mean_square"] <= 1e-20
    # same seed -> same teacher: the model is exact on a fresh dataset from it
    ev = json.loads(cli_process("evaluate", out / "model.zarr", fresh, "--json", "--workers", 2).stdout)
    assert ev["relative_mse"] <= 1e-20 and ev["n_rows"] == 64 * 50
    cert = json.loads(cli_process("certify", data, "--json", "--local").stdout)
    assert cert["identifiable"] and cert["lambda_min"] == pytest.approx(rep["lambda_min"], rel=1e-10)
    again = cli_process("fit", data, "--out", out, "--local", rc=2)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_fit_evaluate_certify_in_process(cli, last_token_ds, tmp_path):
    """The same round trip in this process on realizable last-token data: an exact fit, evaluate agreeing with
    it, and the certificate's spectrum equal to a dense eigvalsh of G / N computed here from the features."""
    url, out = last_token_ds.url, tmp_path / "run"
    rep = json.loads(cli("fit", url, "--out", out, "--local", "--json", "--no-plots").stdout)
    assert rep["n_rows"] == 64 and rep["psi"] == 6 and rep["identifiable"] is True
    assert rep["train_mse"] / rep["target_mean_square"] <= 1e-20
    ev = json.loads(cli("evaluate", out / "model.zarr", url, "--local", "--json").stdout)
    assert ev["relative_mse"] <= 1e-20 and ev["n_rows"] == 64
    cert = json.loads(cli("certify", url, "--local", "--json").stdout)
    tok, _, _ = last_token_ds.read(0, 64)
    P = phi(*token_features(tok))
    lam = np.linalg.eigvalsh(P.T @ P / len(P))
    assert cert["identifiable"] and cert["lambda_min"] == pytest.approx(rep["lambda_min"], rel=1e-10)
    assert cert["lambda_min"] == pytest.approx(lam[0], rel=1e-6)
    assert cert["lambda_max"] == pytest.approx(lam[-1], rel=1e-8)
    assert "already exists" in cli("fit", url, "--out", out, "--local", rc=2).stderr


def test_version_and_help(cli):
    assert cli("--version").stdout.startswith("scaleattn ")
    for cmd in ("fit", "generate", "import", "certify", "evaluate", "bench"):
        assert "usage" in cli(cmd, "--help").stdout


def test_python_dash_m_scaleattn_runs_the_command():
    """``python -m scaleattn`` ran nothing (the package had no __main__ module): the way to reach the command
    of this interpreter's install when the console script on PATH is another's."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "scaleattn", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("scaleattn "), p.stderr
    p = subprocess.run([sys.executable, "-m", "scaleattn", "fit"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("scaleattn fit: error: "), p.stderr


def test_compare_help_names_every_exit_code(cli):
    """Incompatible models exit 2 (bad input, as everywhere in this CLI) while the help said 'exit 0 same, 1
    different' only."""
    import re

    for argv in (["--help"], ["compare", "--help"]):
        text = re.sub(r"\s+", " ", cli(*argv).stdout)
        assert "exit 0 same, 1 different, 2 when they cannot be compared" in text, argv


@pytest.mark.slow
def test_import_digits_and_npz(cli, tmp_path):
    p = cli("import", tmp_path / "digits.zarr", "--builtin", "digits")
    assert "N=1797" in p.stdout
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", tokens=rng.standard_normal((20, 5, 2)), targets=rng.standard_normal((20, 2)))
    cli("import", tmp_path / "a.zarr", "--npz", tmp_path / "a.npz")
    rep = json.loads(cli("fit", tmp_path / "a.zarr", "--out", tmp_path / "r", "--local", "--json", "--no-plots").stdout)
    assert rep["n_rows"] == 20 and rep["train_mse"] > 0
    x = np.cumsum(rng.standard_normal((300, 3)), axis=0)
    (tmp_path / "s.csv").write_text("a,b,c\n" + "\n".join(",".join(f"{v:.6f}" for v in r) for r in x))
    p = cli("import", tmp_path / "s.zarr", "--csv", tmp_path / "s.csv", "--length", 10)
    assert "N=290" in p.stdout and "d=3" in p.stdout


@pytest.mark.slow
def test_solver_paths_agree_at_d16(cli, tmp_path):
    """d = 16 (psi = 2,176) takes the Cholesky + Lanczos path by default; --solver eigh gives the whole spectrum.
    Both certificates must agree with a dense eigvalsh of G / N computed here from the features."""
    data = tmp_path / "d16.zarr"
    cli("generate", "mhla", data, "--d", 16, "--heads", 1, "--length", 4, "--samples", 3000, "--seed", 1)
    chol = json.loads(cli("certify", data, "--json", "--local").stdout)
    eigh = json.loads(cli("certify", data, "--json", "--local", "--solver", "eigh").stdout)
    tok, _, _ = open_dataset(data).read(0, 3000)
    P = phi(*token_features(tok))
    lam = np.linalg.eigvalsh(P.T @ P / len(P))
    # eigh is exact to round-off; the Cholesky path proves the verdict and takes a few steps for the extreme
    # eigenvalues: its intervals (lambda_min: proved lower end, Rayleigh-quotient upper end; lambda_max: Ritz value,
    # Gershgorin bound) hold the dense values, with its estimates inside them
    for cert in (chol, eigh):
        assert cert["psi"] == 2176 and cert["identifiable"]
    assert eigh["lambda_max"] == pytest.approx(lam[-1], rel=1e-8)
    assert eigh["lambda_min"] == pytest.approx(lam[0], rel=1e-6)
    assert chol["certificate_proof"]["factorisations"] == 1
    for key, truth in (("lambda_min", lam[0]), ("lambda_max", lam[-1])):
        lo, hi = chol[f"{key}_interval"]
        assert lo <= truth * (1 + 1e-9) and truth * (1 - 1e-9) <= hi and lo <= chol[key] <= hi, key
        assert chol[key] == pytest.approx(truth, rel=0.5), key


def test_compare_answers_as_diff_does_and_a_bug_says_so(cli, tmp_path, monkeypatch):
    """``compare`` exits 0 (same function), 1 (different), 2 (cannot compare). A bug exits 1 in every command (the
    exit codes are fixed by ARCHITECTURE), so its stderr line is what tells it from "different"; ``--debug`` keeps
    the error's code (it raised: Python's 1 for bad input too)."""
    from scaleattn.heads import _algebra as heads
    from scaleattn.heads._algebra import coef_from_heads

    V, Q = np.ones((1, 1, 2)), np.eye(2)[None]
    a, b, c = (tmp_path / n for n in ("a.zarr", "b.zarr", "c.zarr"))
    MHLAModel(coef_from_heads(V, Q), V, Q, d=2).save(str(a))
    MHLAModel(coef_from_heads(2 * V, Q), 2 * V, Q, d=2).save(str(b))
    MHLAModel(coef_from_heads(V[:, :, :1], Q[:, :1, :1]), V[:, :, :1], Q[:, :1, :1], d=1).save(str(c))
    assert cli("compare", a, a).stdout.splitlines()[-1] == "EQUIVALENT: same function on every input"
    assert cli("compare", a, b, rc=1).stdout.splitlines()[-1] == "DIFFERENT functions"
    assert "(d, d_out) = (2, 1) and (1, 1)" in cli("compare", a, c, rc=2).stderr
    assert cli("--debug", "compare", a, c, rc=2).stderr.startswith("Traceback")

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(heads, "compare_models", broken)
    err = cli("compare", a, b, rc=1).stderr
    assert err.startswith("scaleattn compare: internal error (this is a bug") and "ZeroDivisionError" in err, err
    err = cli("compare", a, b, "--debug", rc=1).stderr
    assert err.startswith("Traceback") and err.strip().endswith("ZeroDivisionError: float division by zero"), err


@pytest.mark.slow
def test_cli_fit_minimal_witness_and_compare(cli, tmp_path):
    data, assoc = tmp_path / "d.zarr", tmp_path / "a.zarr"
    cli("generate", "mhla", data, "--d", "3", "--heads", "2", "--length", "20", "--samples", "60", "--causal")
    cli("generate", "assoc", assoc, "--pairs", "2", "--samples", "1024", "--orthogonal")
    r1, r2, r3 = (tmp_path / n for n in ("r1", "r2", "r3"))
    cli("fit", data, "--out", r1, "--heads", "minimal", "--local", "--quiet", "--no-plots")
    cli("fit", data, "--out", r2, "--heads", "svd", "--local", "--quiet", "--no-plots")
    cli("fit", assoc, "--out", r3, "--local", "--quiet", "--no-plots", "--ridge", "1e-9")
    rep1 = json.loads((r1 / "report.json").read_text())
    assert rep1["n_heads"] == 2 and [e["heads"] for e in rep1["loss_vs_heads"]] == [1, 2]
    assert rep1["loss_vs_heads"][-1]["train_mse_stats"] <= 1e-12 * rep1["target_mean_square"]
    assert "witness" not in rep1 and rep1["ridge"] == 0 and rep1["effective_dof"] == rep1["psi"]
    rep3 = json.loads((r3 / "report.json").read_text())
    assert not rep3["identifiable"] and rep3["ambiguous_dim"] > 0 and rep3["ridge"] == 1e-9
    assert rep3["effective_dof"] == pytest.approx(rep3["rank"], rel=1e-3)
    wit = rep3["witness"]
    assert np.asarray(wit["tokens"]).shape[1] == rep3["d"] and wit["prediction_difference"] > 0.1
    assert abs(wit["loss_a"] - wit["loss_b"]) <= 1e-10 * rep3["target_mean_square"]
    # minimal (2 heads) and svd (9 heads) fits compute the same function; the assoc model is another one
    out = json.loads(cli("compare", r1 / "model.zarr", r2 / "model.zarr", "--json").stdout)
    assert out["equivalent"] and (out["n_heads_a"], out["n_heads_b"]) == (2, 9)
    cli("compare", r1 / "model.zarr", r3 / "model.zarr", "--quiet", rc=2)  # d 3 vs 4: bad input
    cli("fit", data, "--out", tmp_path / "r4", "--heads", "1", "--local", "--quiet", "--no-plots")
    cli("compare", r1 / "model.zarr", tmp_path / "r4" / "model.zarr", "--quiet", rc=1)
    cli("compare", r1 / "model.zarr", tmp_path / "nothing.zarr", "--quiet", rc=2)


@pytest.mark.parametrize("command", [pytest.param("fit", marks=pytest.mark.slow), "generate"])
def test_an_interrupt_after_the_write_says_the_output_is_complete(cli, tmp_path, monkeypatch, causal_ds, command):
    """Ctrl-C after the output was committed (while the summary prints or the cluster closes) must not claim
    that nothing was written: the output is there, complete, and the message says so."""
    from scaleattn.cli import commands

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    out = str(tmp_path / "out")
    if command == "fit":
        monkeypatch.setattr(commands, "_emit", interrupted)
        r = cli("fit", causal_ds.url, "--out", out, "--local", "--no-plots", rc=130)
        assert MHLAModel.load(out + "/model.zarr").coef.shape[0] == 6
    else:
        monkeypatch.setattr(commands, "_wrote", interrupted)
        r = cli("generate", "mhla", out, "--d", "2", "--samples", "8", "--length", "4", rc=130)
        assert open_dataset(out).n_samples == 8
    assert f"interrupted after it wrote {out} in full" in r.stderr and "nothing was written" not in r.stderr


def test_write_files_is_all_or_nothing(tmp_path):
    """A failure (or Ctrl-C) while the files are written leaves none of them and no temporaries."""
    from scaleattn.run import write_files

    class Unwritable:  # the second file fails to write
        pass

    with pytest.raises(TypeError):
        write_files(tmp_path / "plots", {"a.png": b"first", "b.png": Unwritable()})
    assert not (tmp_path / "plots").exists()  # the directory it made goes too
    assert sorted(p.rsplit("/", 1)[-1] for p in write_files(tmp_path / "plots", {"a.png": b"1", "b.png": b"2"})) \
        == ["a.png", "b.png"]
    assert (tmp_path / "plots" / "b.png").read_bytes() == b"2"


def test_write_files_puts_old_files_back_and_refuses_a_directory_in_the_way(tmp_path, monkeypatch):
    """A rename that fails midway restores the files already replaced; a target that is a directory is refused
    (exit 2 from the CLI, not 'this is a bug') before anything is written; a directory this call made goes."""
    import os

    from matplotlib.figure import Figure

    from scaleattn import run
    from scaleattn.errors import StorageError, UnsafeOutputError
    from scaleattn.plot import figure_pngs

    def png(text):  # a plot as scaleattn draws it (only such a file is ever replaced)
        fig = Figure(figsize=(1, 1))
        fig.text(0.5, 0.5, text)
        return figure_pngs({"x": fig})["x.png"]

    old_a, old_b = png("old a"), png("old b")
    d = tmp_path / "plots"
    run.write_files(d, {"a.png": old_a, "b.png": old_b})
    real = os.replace

    def fail_on_b(src, dst):
        if str(dst).endswith("b.png") and str(src).endswith(".partial"):
            raise PermissionError(13, "Permission denied", str(dst))
        return real(src, dst)

    monkeypatch.setattr(run.os, "replace", fail_on_b)
    with pytest.raises(StorageError, match="cannot write the files"):
        run.write_files(d, {"a.png": b"new a", "b.png": b"new b"})
    monkeypatch.setattr(run.os, "replace", real)
    assert sorted(p.name for p in d.iterdir()) == ["a.png", "b.png"]
    assert (d / "a.png").read_bytes() == old_a and (d / "b.png").read_bytes() == old_b
    (tmp_path / "clash" / "b.png").mkdir(parents=True)
    with pytest.raises(UnsafeOutputError, match="is not a file"):
        run.write_files(tmp_path / "clash", {"a.png": b"1", "b.png": b"2"})
    assert [p.name for p in (tmp_path / "clash").iterdir()] == ["b.png"]
    monkeypatch.setattr(run.os, "replace", fail_on_b)
    with pytest.raises(StorageError):
        run.write_files(tmp_path / "fresh" / "new", {"b.png": b"x"})
    assert not (tmp_path / "fresh" / "new").exists()


@pytest.mark.slow  # a whole CLI fit first: 3 s
def test_cli_plot_into_a_directory_in_the_way_exits_2(cli, tmp_path, causal_ds):
    out = tmp_path / "run"
    cli("fit", causal_ds.url, "--out", out, "--local", "--no-plots")
    (tmp_path / "pngs" / "heads.png").mkdir(parents=True)
    r = cli("plot", out, "--out", tmp_path / "pngs", rc=2)
    assert "is not a file" in r.stderr and "bug" not in r.stderr
    assert sorted(p.name for p in (tmp_path / "pngs").iterdir()) == ["heads.png"]


def _options(parser, path):
    import argparse

    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _options(sub, [*path, name])
        elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            yield " ".join(path), "/".join(a.option_strings) or a.dest, a


def test_every_option_has_help_naming_its_default():
    """``--help`` shows every option with what it means and, where it has a value by default, that default
    (the README promises it)."""
    import argparse

    from scaleattn.cli.parser import build_parser

    bad = []
    for where, name, a in _options(build_parser(), ["scaleattn"]):
        if not a.help or a.help == argparse.SUPPRESS:
            bad.append(f"{where} {name}: no help")
        elif a.default not in (None, False, argparse.SUPPRESS) and not isinstance(a, argparse._StoreConstAction) \
                and "default" not in a.help:
            bad.append(f"{where} {name}: default {a.default!r} not named in its help")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_sigterm_after_the_write_says_the_output_is_complete(cli, tmp_path, monkeypatch, causal_ds):
    from scaleattn.cli import Terminated, commands

    def terminated(*a, **k):
        raise Terminated

    monkeypatch.setattr(commands, "_emit", terminated)
    out = str(tmp_path / "out")
    r = cli("fit", causal_ds.url, "--out", out, "--local", "--no-plots", rc=143)
    assert f"stopped by SIGTERM after it wrote {out} in full" in r.stderr and "--resume" not in r.stderr


@pytest.mark.slow
def test_the_command_clock_starts_with_the_command_not_with_a_shell_it_replaced(causal_ds, tmp_path):
    """'command X s until this report' counts from when the process began importing scaleattn: a shell that runs
    the command last becomes it (exec, same process and start time), so the process's start counted the shell's
    earlier work too (a fit after `sleep 15` reported 18 s against 1.6 s of wall time). Never less than the
    command's own time, never more than the whole run."""
    import json
    import subprocess
    import time

    argv = f"scaleattn fit {causal_ds.url} --out {tmp_path / 'run'} --local --no-plots --json"
    t = time.perf_counter()
    p = subprocess.run(["bash", "-c", f"sleep 3 && exec {argv}"], capture_output=True, text=True)
    outside = time.perf_counter() - t
    assert p.returncode == 0, p.stderr
    seconds = json.loads(p.stdout)["command"]["seconds"]
    assert 0.2 < seconds < outside - 2.5, (seconds, outside)


_HANGING_CLEANUP = r"""
import os, signal, sys, time
import scaleattn.cli as cli
cli.TERM_CLEANUP_S = 1.0

def fit(args):  # SIGTERM mid-command, then a clean-up that never ends (a client waiting on a dead scheduler)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    finally:
        time.sleep(60)

cli.COMMANDS["fit"] = fit
sys.argv = ["scaleattn", "fit", "data.zarr", "--out", "run"]
sys.exit(cli.main())
"""


def test_sigterm_leaves_within_its_deadline_even_when_the_clean_up_hangs():
    """A pod gets SIGTERM, then SIGKILL after its grace (30 s): the command's own stop (143, the line naming
    --resume) must come first, also when its clean-up waits on a scheduler that is already gone."""
    import subprocess
    import sys
    import time

    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _HANGING_CLEANUP], capture_output=True, text=True, timeout=50)
    assert p.returncode == 143 and time.perf_counter() - t < 20, (p.returncode, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("scaleattn fit: stopped by SIGTERM") and "--resume" in last


def test_the_sigterm_line_says_what_was_kept():
    """The last line after SIGTERM claims a checkpoint only when one was kept (it said "finished row groups are in
    the checkpoint" also when none existed); the same words as after Ctrl-C."""
    import argparse

    from scaleattn.cli import Terminated, _stopped_line
    from scaleattn.errors import with_hint

    fit = argparse.Namespace(command="fit")
    kept = with_hint(Terminated(), "the checkpoint /x.ckpt keeps 3 of 16 row groups: run the same command with"
                                   " --resume to continue")
    assert _stopped_line(fit, kept) == ("scaleattn fit: stopped by SIGTERM; the checkpoint /x.ckpt keeps 3 of 16 row"
                                        " groups: run the same command with --resume to continue")
    none = with_hint(Terminated(), "no checkpoint was kept")
    assert _stopped_line(fit, none) == "scaleattn fit: stopped by SIGTERM; no checkpoint was kept"
    assert "no row group was finished" in _stopped_line(fit, Terminated())
    assert "if one was kept" in _stopped_line(fit)  # the deadline's line: the exception is not at hand
    assert _stopped_line(argparse.Namespace(command="generate"), Terminated()).endswith("nothing was written"
                                                                                        " (outputs are written all"
                                                                                        " or nothing)")
    done = argparse.Namespace(command="fit", written="run")
    assert _stopped_line(done, kept) == "scaleattn fit: stopped by SIGTERM after it wrote run in full"


def test_an_unknown_option_is_reported_by_its_command_with_the_closest_one(capsys):
    """A typo after the command is reported by that command, with the nearest of its options (it got the top-level
    usage, which lists no option of the command), in one line that names its --help, exit code 2; ``--debug`` is
    taken after the command too."""
    from scaleattn.cli.parser import parse

    for argv, command, hint in ((["fit", "d.zarr", "--out", "r", "--hedas", "minimal"], "fit", "--heads"),
                                (["generate", "mhla", "x.zarr", "--sampels", "3"], "generate mhla", "--samples"),
                                (["certify", "d.zarr", "--nope"], "certify", None)):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"scaleattn {command}: error: unrecognized arguments: {argv[-2] if hint else argv[-1]}")
        assert err.endswith(f"(did you mean {hint}?) (see scaleattn {command} --help)\n") if hint else (
            "did you mean" not in err), err
    assert parse(["fit", "d.zarr", "--out", "r", "--debug"]).debug is True
    assert parse(["--debug", "fit", "d.zarr", "--out", "r"]).debug is True
    assert parse(["fit", "d.zarr", "--out", "r"]).debug is False


@pytest.mark.parametrize("argv, line", [
    (["fit", "{ds}", "--out", "{out}", "--local", "--cutoff-rtol", "2"],
     "scaleattn fit: error: --cutoff-rtol must be in (0, 1), got 2 (see scaleattn fit --help)"),
    (["fit", "{ds}", "--out", "{out}", "--local", "--heads", "0"],
     "scaleattn fit: error: --heads must be >= 1, got 0 (see scaleattn fit --help)"),
    (["fit", "{ds}", "--out", "{out}", "--local", "--ridge", "-1"],
     "scaleattn fit: error: --ridge must be in [0, 1e+12], got -1 (see scaleattn fit --help)"),
    (["generate", "mhla", "{out}", "--d", "0"],
     "scaleattn generate mhla: error: --d must be >= 1, got 0 (see scaleattn generate mhla --help)"),
])
def test_a_parameter_error_names_the_option_as_typed(causal_ds, tmp_path, cli, argv, line):
    """The library's parameter checks name Python parameters (``cutoff_rtol``); from the command line the same
    check names the option the user typed (``--cutoff-rtol``), in one line, exit code 2, nothing written."""
    out = tmp_path / "out"
    r = cli(*[a.format(ds=causal_ds.url, out=out) for a in argv], rc=2)
    assert r.stderr.strip() == line, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("argv, line", [
    (["generate", "mhla", "{out}", "--seed", "-1"],
     "scaleattn generate mhla: error: argument --seed: must be >= 0, got -1 (see scaleattn generate mhla --help)"),
    (["generate", "assoc", "{out}", "--seed=-3"],
     "scaleattn generate assoc: error: argument --seed: must be >= 0, got -3 (see scaleattn generate assoc --help)"),
    (["submit", "s3://b/d.zarr", "--out", "s3://b/r", "--image", "r.io/x", "--timeout", "0"],
     "scaleattn submit: error: argument --timeout: must be a finite number > 0, got 0 (see scaleattn submit --help)"),
])
def test_values_numpy_or_the_follower_would_reject_are_refused_by_the_parser(tmp_path, cli, argv, line):
    """A negative seed reached numpy's generator (a bare ValueError: "internal error", exit 1); submit's --timeout
    took 0, -1 or NaN. Both are refused as the command line's other values are: one line, exit 2, nothing written."""
    out = tmp_path / "out"
    r = cli(*[a.format(out=out) for a in argv], rc=2)
    assert r.stderr.strip() == line, r.stderr
    assert not out.exists()
