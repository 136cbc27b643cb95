"""Every error line of the command line has one format, ``PROG: error: MESSAGE``, ending ``(see PROG --help)`` where
the help can help (a usage error: a bad or missing option), with one PROG per command (``scaleattn generate mhla``
for its usage and its value errors alike), exit code 2, names the option as typed, and leaves nothing behind.
Each case is refused before any data are read: no fit runs here."""
from __future__ import annotations

import re

import pytest


def _line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("argv, line", [
    # an option of the commands before the command: where it belongs, not "did you mean --local?"
    (["--local", "fit", "{ds}", "--out", "{out}"],
     "scaleattn: error: --local is an option of the commands (fit, certify, evaluate): put it after the command:"
     " scaleattn fit --local ... (see scaleattn --help)"),
    (["--seed", "3", "generate", "mhla", "{out}"],
     "scaleattn: error: --seed is an option of the commands (generate mhla, generate assoc): put it after the"
     " command: scaleattn generate mhla --seed ... (see scaleattn --help)"),
    # the same one level down: generate's, not "did you mean --seed?"
    (["generate", "--seed=3", "mhla", "{out}"],
     "scaleattn generate: error: --seed is an option of the commands (generate mhla, generate assoc): put it after"
     " the command: scaleattn generate mhla --seed=3 ... (see scaleattn generate --help)"),
    (["--local"],
     "scaleattn: error: --local is an option of the commands (fit, certify, evaluate): put it after the command:"
     " scaleattn COMMAND --local ... (see scaleattn --help)"),
    # an unknown option is named, not "the following arguments are required: COMMAND"
    (["--bogus"], "scaleattn: error: unrecognized arguments: --bogus (did you mean --gpus, an option of the commands"
                  " (fit, certify, evaluate, submit)? put it after the command) (see scaleattn --help)"),
    (["--zzzz"], "scaleattn: error: unrecognized arguments: --zzzz (see scaleattn --help)"),
    # a typo of a command's option before it: the commands' options are matched too ("did you mean --help?")
    (["--hedas", "fit", "{ds}", "--out", "{out}"],
     "scaleattn: error: unrecognized arguments: --hedas (did you mean --heads, an option of the commands (generate"
     " mhla, fit)? put it after the command) (see scaleattn --help)"),
    (["generate", "--sed", "3", "mhla", "{out}"],
     "scaleattn generate: error: unrecognized arguments: --sed (did you mean --seed, an option of the commands"
     " (generate mhla, generate assoc)? put it after the command) (see scaleattn generate --help)"),
    (["--verison", "fit", "{ds}", "--out", "{out}"],
     "scaleattn: error: unrecognized arguments: --verison (did you mean --version?) (see scaleattn --help)"),
])
def test_an_option_before_the_command_is_named(causal_ds, tmp_path, cli, argv, line):
    out = tmp_path / "out"
    r = cli(*[a.format(ds=causal_ds.url, out=out) for a in argv], rc=2)
    assert _line(r) == line
    assert not out.exists()


@pytest.mark.parametrize("argv, line", [
    # one prefix per command: the value errors of generate mhla as its usage errors
    (["generate", "mhla", "{out}", "--d", "0"],
     "scaleattn generate mhla: error: --d must be >= 1, got 0 (see scaleattn generate mhla --help)"),
    # the (see ... --help) tail on the errors the commands raise, as on argparse's
    (["fit", "{ds}", "--out", "{out}", "--local", "--storage-option", "foo"],
     "scaleattn fit: error: --storage-option expects KEY=VALUE, got 'foo' (see scaleattn fit --help)"),
    # cluster options with --local were ignored without a word
    (["fit", "{ds}", "--out", "{out}", "--local", "--workers", "2"],
     "scaleattn fit: error: --local runs in this process without Dask: it cannot be combined with --workers (cluster"
     " option): drop it or --local (see scaleattn fit --help)"),
    (["certify", "{ds}", "--local", "--threads-per-worker", "1", "--tls-cert", "c.pem", "--scheduler-timeout", "5"],
     "scaleattn certify: error: --local runs in this process without Dask: it cannot be combined with"
     " --scheduler-timeout, --threads-per-worker, --tls-cert (cluster options): drop them or --local"
     " (see scaleattn certify --help)"),
    # the library's messages name Python parameters in backticks: the command line names its options
    (["fit", "{ds}", "--out", "{out}", "--local", "--solver", "krylov", "--ridge", "1"],
     "scaleattn fit: error: --ridge > 0 needs a dense solver (its effective degrees of freedom need the whole"
     " spectrum): use --solver auto, --solver cholesky or --solver eigh, or --ridge 0 with --solver krylov"
     " (see scaleattn fit --help)"),
    (["generate", "assoc", "{out}", "--pairs", "3", "--dim", "2", "--orthogonal"],
     "scaleattn generate assoc: error: orthogonal keys need --pairs <= --dim, got --pairs 3, --dim 2"
     " (see scaleattn generate assoc --help)"),
    (["submit", "s3://b/d.zarr", "--out", "s3://b/r", "--image", "r.io/x", "--dry-run", "--worker-timeout", "0"],
     "scaleattn submit: error: --worker-timeout must be >= 1, got 0 (see scaleattn submit --help)"),
    # the Python API's names (`dataset`, `out`, `image=`, `registry=`) said as the command line's
    (["submit", "/d.zarr", "--out", "s3://b/r", "--image", "r.io/x", "--dry-run"],
     "scaleattn submit: error: DATASET must be an object-storage URL (s3://BUCKET/PATH): the pods cannot see local"
     " paths, got '/d.zarr' (see scaleattn submit --help)"),
    (["submit", "s3://b/d.zarr", "--out", "s3:///r", "--image", "r.io/x", "--dry-run"],
     "scaleattn submit: error: --out must name a bucket: 's3:///r' (see scaleattn submit --help)"),
    (["submit", "s3://b/d.zarr", "--out", "s3://b/d.zarr/r", "--image", "r.io/x", "--dry-run"],
     "scaleattn submit: error: --out s3://b/d.zarr/r lies inside the dataset 's3://b/d.zarr': scaleattn never writes"
     " into or removes an input; choose a path outside it (see scaleattn submit --help)"),
])
def test_every_error_line_has_one_format(causal_ds, tmp_path, cli, argv, line):
    out = tmp_path / "out"
    r = cli(*[a.format(ds=causal_ds.url, out=out) for a in argv], rc=2)
    assert _line(r) == line
    assert not out.exists()


def test_too_many_workers_names_both_options(causal_ds, tmp_path, cli):
    r = cli("fit", causal_ds.url, "--out", tmp_path / "out", "--workers", "100000", rc=2)
    assert re.fullmatch(r"scaleattn fit: error: --workers 100000 x --threads-per-worker 1: at most \d+ worker threads"
                        r" on this machine .*; to use more, join a cluster with --scheduler"
                        r" \(see scaleattn fit --help\)", _line(r)), r.stderr
    assert not (tmp_path / "out").exists()


FIT = ["fit", "{ds}", "--out", "{out}", "--local", "--quiet"]


@pytest.mark.parametrize("argv, says", [
    # finite values that overflowed later (an internal error and RuntimeWarnings), refused up front
    ([*FIT, "--ridge", "1e308"], "--ridge must be in [0, 1e+12], got 1e+308"),
    ([*FIT, "--ridge", "-1e-300"], "--ridge must be in [0, 1e+12], got -1e-300"),
    ([*FIT, "--ridge", "nan"], "--ridge must be finite, got nan"),
    ([*FIT, "--ridge", "-inf"], "--ridge must be finite, got -inf"),
    ([*FIT, "--cutoff-rtol", "1e308"], "--cutoff-rtol must be in (0, 1), got 1e+308"),
    ([*FIT, "--rtol", "0"], "--cutoff-rtol must be in (0, 1), got 0"),
    (["generate", "mhla", "{out}", "--noise", "1e200"], "--noise must be in [0, 1e+99], got 1e+200"),
    (["generate", "mhla", "{out}", "--noise", "inf"], "--noise must be finite, got inf"),
    (["compare", "{out}", "{out}", "--rtol", "-1"], "--rtol must be > 0, got -1"),
    # durations: finite but absurd ones were handed to Dask's, asyncio's and the OS's timers
    ([*FIT, "--heads-budget", "1e308"],
     "argument --heads-budget: must be at most 2592000 seconds (30 days), got 1e308"),
    (["fit", "{ds}", "--out", "{out}", "--scheduler-timeout", "1e308"],
     "argument --scheduler-timeout: must be at most 2592000 seconds (30 days), got 1e308"),
    (["evaluate", "{out}", "{ds}", "--worker-timeout", "2592001"],
     "argument --worker-timeout: must be at most 2592000 seconds (30 days), got 2592001"),
    (["submit", "s3://b/d.zarr", "--out", "s3://b/r", "--image", "r.io/x", "--dry-run", "--scheduler-timeout",
      "100000000000"], "--scheduler-timeout must be <= 2592000, got 100000000000"),
])
def test_float_options_out_of_range_are_refused_up_front(causal_ds, tmp_path, cli, argv, says):
    out = tmp_path / "out"
    r = cli(*[a.format(ds=causal_ds.url, out=out) for a in argv], rc=2)
    line = _line(r)
    assert says in line and line.endswith("--help)") and "Warning" not in r.stderr, r.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, names", [
    (["generate", "mhla", "{out}", "--d", "100000000"], "--d 100000000"),
    (["generate", "mhla", "{out}", "--heads", "100000000000000"], "--heads 100000000000000"),
    (["generate", "mhla", "{out}", "--d-out", "100000000000000"], "--d-out 100000000000000"),
    (["generate", "mhla", "{out}", "--length", "100000000000000"], "--length 100000000000000"),
    (["generate", "mhla", "{out}", "--samples", "10000000000", "--chunk-samples", "10000000000"],
     "10,000,000,000 samples"),
    (["generate", "assoc", "{out}", "--samples", "100000000000000"], "--samples 100000000000000"),
    (["generate", "assoc", "{out}", "--pairs", "3", "--dim", "1000000", "--orthogonal"], "--dim 1000000"),
])
def test_sizes_that_cannot_fit_in_memory_are_refused_saying_how_much(tmp_path, cli, argv, names):
    """A MemoryError from numpy was an internal error, after the output had been opened."""
    out = tmp_path / "out.zarr"
    r = cli(*[a.format(out=out) for a in argv], rc=2)
    line = _line(r)
    prog = " ".join(argv[:2])
    assert re.fullmatch(rf"scaleattn {prog}: error: .* need [\d,.]+ GiB of memory at once; this machine has [\d,.]+"
                        rf" GiB available: use smaller sizes", line), line  # (no help tail: a refusal)
    assert names in line, line
    assert not list(tmp_path.iterdir())


def test_a_memory_error_anywhere_is_one_line_naming_the_step(tmp_path, cli, monkeypatch):
    """Sizes no check foresaw: the step that ran out, exit code 2, not an internal error."""
    from scaleattn import generate

    def teacher(*a, **k):
        raise MemoryError("Unable to allocate 9.0 TiB for an array")

    monkeypatch.setattr(generate, "make_teacher", teacher)
    r = cli("generate", "mhla", tmp_path / "x.zarr", rc=2)
    assert _line(r) == ("scaleattn generate mhla: error: out of memory in scaleattn.generate.generate_mhla: Unable to"
                        " allocate 9.0 TiB for an array: use smaller sizes or a machine with more memory; nothing was"
                        " written (outputs are written all or nothing)")
    assert not list(tmp_path.iterdir())


def test_only_usage_errors_point_to_the_help(tmp_path, cli):
    """A refusal of data or outputs that says what to do ended '(see scaleattn fit --help)' too, where the help
    cannot help; a usage error (a bad option) keeps the tail."""
    out = tmp_path / "out.zarr"
    cli("generate", "mhla", out, "--samples", "8", "--length", "4")
    line = _line(cli("generate", "mhla", out, "--samples", "8", "--length", "4", rc=2))
    assert line.endswith("already exists (pass --overwrite to replace it)"), line
    line = _line(cli("generate", "mhla", tmp_path / "x.zarr", "--d", "0", rc=2))
    assert line.endswith("(see scaleattn generate mhla --help)"), line


def test_the_python_api_keeps_naming_its_parameters(tmp_path):
    """The backticked names are the Python parameters there; only the command line turns them into options."""
    from scaleattn.errors import ParameterError
    from scaleattn.generate import generate_assoc

    with pytest.raises(ParameterError, match=r"^orthogonal keys need `pairs` <= `dim`, got `pairs=3`, `dim=2`$"):
        generate_assoc(tmp_path / "x.zarr", 3, 10, dim=2, orthogonal=True)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("made, api, command_line", [
    ("run", "output {out!r} already exists (pass `overwrite=True` to replace it)",
     "output {out!r} already exists (pass --overwrite to replace it)"),
    ("run.checkpoint.zarr", "checkpoint {ckpt!r} of an unfinished fit exists: pass `resume=True` to continue it, or"
                            " `overwrite=True` to start over",
     "checkpoint {ckpt!r} of an unfinished fit exists: pass --resume to continue it, or --overwrite to start over"),
], ids=["run", "checkpoint"])
def test_a_refusal_says_the_python_keyword_in_python_and_the_option_on_the_command_line(causal_ds, tmp_path, cli,
                                                                                         made, api, command_line):
    """``scaleattn.fit(...)`` in a notebook told its caller to pass ``--overwrite`` or ``--resume``, options a
    Python call cannot take: one message, the API's keyword in Python, the option on the command line."""
    from scaleattn import fit
    from scaleattn.errors import OutputExistsError

    (tmp_path / made).mkdir()
    names = dict(out=str(tmp_path / "run"), ckpt=str(tmp_path / "run.checkpoint.zarr"))
    with pytest.raises(OutputExistsError) as e:
        fit(causal_ds, tmp_path / "run", plots=False)
    assert str(e.value) == api.format(**names)
    line = _line(cli("fit", causal_ds.url, "--out", tmp_path / "run", "--local", rc=2))
    assert line == "scaleattn fit: error: " + command_line.format(**names)
    assert sorted(p.name for p in tmp_path.iterdir()) == [made]


@pytest.mark.parametrize("quoted, typed", [
    ("pass `resume=True` to continue", "pass --resume to continue"),  # a flag: its value is how Python sets it
    ("pass `fill_absent_chunks=True`", "pass --absent-chunks-are-fill"),  # an option named otherwise
    ("`solver='krylov'` (2.5 GiB)", "--solver krylov (2.5 GiB)"),
    ("or `checkpoint=PATH`", "or --checkpoint PATH"),
    ("the default `checkpoint` /x", "the default --checkpoint /x"),
    ("`storage_options={'endpoint_url': 'http://HOST:PORT'}`", "--storage-option endpoint_url=http://HOST:PORT"),
    ("`storage_options={'key': ..., 'secret': ...}`", "--storage-option key=... --storage-option secret=..."),
    ("needs `security` (or the dask config)", "needs --tls-ca-file, --tls-cert and --tls-key (or the dask config)"),
    ("(missing `ca_file`, `key`)", "(missing --tls-ca-file, --tls-key)"),
    ("in this process (`client=None`)", "in this process (--local)"),
    ("`pairs` <= `dim`", "`pairs` <= `dim`"),  # not options of fit: as they are
    # values an option cannot say stay Python's: a flag set otherwise than by giving it (it read --overwrite), None
    ("unless `overwrite=False`", "unless `overwrite=False`"),
    ("`checkpoint=None` keeps none", "`checkpoint=None` keeps none"),
    ("`storage_options={}`", "`storage_options={}`"),  # (it read as nothing at all)
    ("`out='my run'`", "--out 'my run'"),  # a value as a shell takes it
])
def test_the_command_line_says_each_python_keyword_as_its_option(quoted, typed):
    import argparse

    from scaleattn.cli import _typed

    assert _typed(quoted, argparse.Namespace(command="fit")) == typed


def test_hints_and_warnings_name_the_options_too(cli, monkeypatch):
    """What was kept and how to continue (a hint), and a warning, are the library's words as well."""
    import warnings

    from scaleattn import cli as command_line
    from scaleattn.errors import CheckpointError, Note, with_hint

    def refused(args):
        warnings.warn("no `checkpoint` given", Note, stacklevel=1)
        raise with_hint(CheckpointError("refused"), "run again with `overwrite=True` instead of `resume=True`")

    def interrupted(args):
        raise with_hint(KeyboardInterrupt(), "the checkpoint c keeps 3 of 16 row groups: repeat the fit with"
                                             " `resume=True` to continue")

    monkeypatch.setitem(command_line.COMMANDS, "fit", refused)
    assert cli("fit", "d.zarr", "--out", "run", rc=2).stderr.splitlines() == [
        "scaleattn fit: note: no --checkpoint given",
        "scaleattn fit: error: refused; run again with --overwrite instead of --resume"]
    monkeypatch.setitem(command_line.COMMANDS, "fit", interrupted)
    assert cli("fit", "d.zarr", "--out", "run", rc=130).stderr.splitlines() == [
        "scaleattn fit: interrupted; the checkpoint c keeps 3 of 16 row groups: repeat the fit with --resume"
        " to continue"]


def test_library_messages_name_python_keywords_not_command_line_options():
    """The class of the bug above: a string of the library (outside the command line's own modules) that names an
    option ``--NAME`` reaches a Python caller as it is. Parameters go in backticks as Python spells them
    (:mod:`scaleattn.errors`), which the command line turns into its options; a whole command (```scaleattn plot
    RUN_DIR --full-spectrum```) is advice to run it from a shell."""
    import ast
    import pathlib

    import scaleattn

    root = pathlib.Path(scaleattn.__file__).parent
    own = ("cli", "bench", "submit/command.py")  # the command line's own modules: options are their words
    # the summaries the command line prints (not errors; FitResult.summary() shows them too)
    shared = ("display/_text.py",)
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in own or rel.as_posix() in own or rel.as_posix() in shared:
            continue
        tree = ast.parse(path.read_text())
        skip = {id(n.body[0].value) for n in ast.walk(tree)  # docstrings
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)}
        skip |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}  # (seen whole)
        skip |= {id(x) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "rerun_command"
                 for x in ast.walk(f)}  # the words of a whole command line
        # the manifest's builders write `scaleattn fit` command lines for the pods: there, only errors are checked
        raised = (x for r in ast.walk(tree) if isinstance(r, ast.Raise) for x in ast.walk(r))
        for node in raised if rel.parts[0] == "submit" else ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if re.search(r"(?<![\w-])--[a-z]", re.sub(r"`scaleattn [^`]*`", "", text)):
                bad.append(f"{rel}:{node.lineno}: {text[:90]!r}")
    assert bad == []


@pytest.mark.parametrize("argv, line", [
    # the CSV options were ignored without a word with --npz or --builtin, --horizon with --causal
    (["import", "{out}", "--builtin", "digits", "--length", "5"],
     "scaleattn import: error: --length is an option of a --csv import (a series cut into windows): not used with"
     " --builtin (see scaleattn import --help)"),
    (["import", "{out}", "--npz", "{csv}", "--step", "2", "--causal"],
     "scaleattn import: error: --step, --causal are options of a --csv import (a series cut into windows): not used"
     " with --npz (see scaleattn import --help)"),
    (["import", "{out}", "--csv", "{csv}", "--causal", "--horizon", "3"],
     "scaleattn import: error: --horizon must be 1 with --causal (each prefix predicts the next value), got 3"
     " (see scaleattn import --help)"),
    (["import", "{out}", "--csv", "{csv}", "--length", "100000000000000"],
     "scaleattn import: error: {csv}: series of 40 steps is too short for one window of --length 100000000000000 +"
     " --horizon 1"),  # (the data's refusal, naming the file: no help tail)
    # a column taken twice was imported as two identical token coordinates (a fit that cannot be identifiable)
    (["import", "{out}", "--csv", "{csv}", "--columns", "a", "b", "a"],
     "scaleattn import: error: --columns must name each column once, got 'a' twice (see scaleattn import --help)"),
])
def test_import_names_the_csv_options(tmp_path, cli, argv, line):
    csv = tmp_path / "s.csv"
    csv.write_text("a,b\n" + "\n".join(f"{i},{i % 3}" for i in range(40)))
    out = tmp_path / "out.zarr"
    r = cli(*[a.format(out=out, csv=csv) for a in argv], rc=2)
    assert _line(r) == line.format(csv=csv)
    assert not out.exists()


def test_a_warning_is_one_line_of_the_command(tmp_path, capsys):
    """A warning prints as ``PROG: warning: MESSAGE``, one line (Python's format added the warning code's file,
    line and source line, ``return write_files(...)`` after "predictions plot skipped")."""
    import shutil

    from scaleattn.cli import main
    from scaleattn.generate import generate_mhla

    generate_mhla(str(tmp_path / "d.zarr"), d=2, heads=1, length=4, samples=16, causal=True, seed=0)
    assert main(["fit", str(tmp_path / "d.zarr"), "--out", str(tmp_path / "run"), "--local", "--quiet",
                 "--no-plots"]) == 0
    shutil.rmtree(tmp_path / "d.zarr")  # the run's dataset gone: its predictions plot is skipped with a warning
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "plots")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"scaleattn plot: warning: predictions plot skipped: \S*d\.zarr: no such"
                                          r" dataset", err[0]), err


@pytest.mark.parametrize("argv, line", [
    (["fit", "{ds}", "--outt", "{out}"],
     "scaleattn fit: error: unrecognized arguments: --outt {out} (did you mean --out?) (see scaleattn fit --help)"),
    (["import", "{out}", "--cvs", "s.csv"],
     "scaleattn import: error: unrecognized arguments: --cvs s.csv (did you mean --csv?) (see scaleattn import"
     " --help)"),
    (["fit", "{ds}"], "scaleattn fit: error: the following arguments are required: --out (see scaleattn fit --help)"),
])
def test_a_misspelled_required_option_gets_its_suggestion(causal_ds, tmp_path, cli, argv, line):
    """A misspelled required option (``--outt``) was said as "the following arguments are required: --out", not
    as the unknown option it is, with its "did you mean"."""
    out = tmp_path / "out"
    r = cli(*[a.format(ds=causal_ds.url, out=out) for a in argv], rc=2)
    assert _line(r) == line.format(out=out)


@pytest.mark.slow
@pytest.mark.parametrize("sink", ["closed", "full"])
def test_a_result_that_standard_output_cannot_take_is_not_an_internal_error(causal_ds, tmp_path, sink):
    """``scaleattn fit ... | head`` (the reader leaves before the JSON) printed "internal error ... BrokenPipeError"
    and exited 1; ``> /dev/full`` the same with OSError. The first exits 141 (128 + SIGPIPE, as a shell reports a
    tool SIGPIPE ended) without a line, the second with one error line and 2; the run's files are written."""
    import os
    import subprocess
    import sys

    if sink == "full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    argv = [sys.executable, "-m", "scaleattn.cli", "fit", causal_ds.url, "--out", str(tmp_path / "run"), "--local",
            "--quiet", "--no-plots", "--json"]
    if sink == "closed":
        r, w = os.pipe()
        os.close(r)  # no reader: the first write fails with EPIPE
        p = subprocess.run(argv, stdout=w, stderr=subprocess.PIPE, text=True, timeout=300)
        os.close(w)
        assert p.returncode == 141 and p.stderr == "", p.stderr
    else:
        with open("/dev/full", "w") as full:
            p = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        assert p.returncode == 2
        assert _line(p) == ("scaleattn fit: error: cannot write the result to standard output: No space left on"
                            " device")
    assert (tmp_path / "run" / "report.json").exists()


@pytest.mark.parametrize("argv, line", [
    (["fitt"], "scaleattn: error: argument COMMAND: invalid choice: 'fitt' (choose from 'generate', 'import', 'fit',"
               " 'certify', 'compare', 'evaluate', 'plot', 'bench', 'submit') (did you mean 'fit'?) (see scaleattn"
               " --help)"),
    (["generate", "mhlaa", "{out}"], "scaleattn generate: error: argument TASK: invalid choice: 'mhlaa' (choose from"
                                     " 'mhla', 'assoc') (did you mean 'mhla'?) (see scaleattn generate --help)"),
    (["fit", "{ds}", "--out", "{out}", "--device", "gpx"],
     "scaleattn fit: error: argument --device: invalid choice: 'gpx' (choose from 'auto', 'cpu', 'gpu') (did you"
     " mean 'gpu'?) (see scaleattn fit --help)"),
])
def test_a_mistyped_command_or_choice_gets_its_suggestion(causal_ds, tmp_path, cli, argv, line):
    """A mistyped option had its "did you mean"; a mistyped command, task or option value now too."""
    out = tmp_path / "out"
    r = cli(*[a.format(ds=causal_ds.url, out=out) for a in argv], rc=2)
    assert _line(r) == line
    assert not out.exists()


def test_the_suggestion_reads_both_argparse_spellings_of_the_choices():
    """Python 3.12.8+ and 3.13 print the choices without quotes: the did-you-mean must not depend on them."""
    from scaleattn.cli.parser import _suggestion

    for choices in ("'generate', 'fit', 'certify'", "generate, fit, certify"):
        message = f"argument COMMAND: invalid choice: 'fitt' (choose from {choices})"
        assert _suggestion(message) == " (did you mean 'fit'?)"
    assert _suggestion("argument COMMAND: invalid choice: 'zzzz' (choose from generate, fit)") == ""
