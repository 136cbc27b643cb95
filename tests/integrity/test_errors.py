"""Class 8 of issue 14: errors are one clear line, before work, leaving nothing behind; Ctrl-C says what was
kept and how to continue; store reads are retried on transient errors; temporaries of killed runs are
cleaned. Through the real CLI."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import time

import numpy as np
import pytest
import zarr

from scaleattn import _testing
from scaleattn.store import _location as _storage

from .conftest import (
    FIT,
    Inputs,
    dataset,
    error_line,
    expect,
    foreign,
    popen_cli,
    rows,
    run_cli,
    run_main,
    same_stats,
    stats_of,
    tree_hash,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    b = tmp_path_factory.mktemp("errors")
    dataset(b / "d.zarr")
    tok, y = rows()
    big = tok.copy()
    big[3, 1, 0] = 1e60
    foreign(b / "big-tokens.zarr", big, y)
    yb = y.copy()
    yb[30, 2, 1] = -1e200
    foreign(b / "big-targets.zarr", tok, yb)
    ys = y.copy()
    ys[11] *= 1e-200  # (its square underflows to zero: a fit said "train MSE 0 (relative nan)", bound 0 heads)
    foreign(b / "tiny-targets.zarr", tok, ys)
    np.savez(b / "tiny-targets.npz", tokens=tok, targets=y * 1e-160)
    (b / "empty.csv").write_text("")
    (b / "afile").write_text("a file where an output's folder would go\n")
    (b / "header.csv").write_text("a,b\n")
    (b / "series.csv").write_text("a,b\n" + "".join(f"{i % 5},{i % 3}\n" for i in range(30)))
    with open(b / "arrays.npy", "wb") as f:  # an .npz under an .npy name
        np.savez(f, tokens=tok[:, :, :], targets=y[:, -1])
    np.savez(b / "arrays.npz", tokens=tok, targets=y[:, -1])
    whole = (b / "arrays.npz").read_bytes()
    (b / "truncated.npz").write_bytes(whole[: len(whole) * 8 // 10])
    flipped = bytearray(whole)
    flipped[200] ^= 0xFF  # inside the first member's data: its CRC no longer matches
    (b / "crc.npz").write_bytes(bytes(flipped))
    (b / "binary.csv").write_bytes(bytes(range(256)) * 10)
    (b / "nul.csv").write_bytes(b"a,b\n1,2\x00\n3,4\n")
    (b / "long.csv").write_text("a,b\n1,2\n3,4,5,6,7\n5,6\n7,8\n9,10\n")
    (b / "short.csv").write_text("a,b\n1,2\n3\n5,6\n7,8\n9,10\n")
    (b / "noheader.csv").write_text("".join(f"{i},{i % 3}\n" for i in range(30)))
    (b / "dupheader.csv").write_text("a,a\n" + "".join(f"{i},{i % 3}\n" for i in range(30)))
    g = zarr.open_group(str(b / "times.zarr"), mode="w", zarr_format=2)
    g.create_array("tokens", data=(tok * 1e9).astype("m8[ns]"), chunks=(8, 6, 2))
    g.create_array("targets", data=y, chunks=(8, 6, 2))
    return b


FIT_D = ["fit", "d.zarr", "--out", "run"]
CASES = [
    # refused before any work: (id, argv, pattern)
    ("ridge-negative", FIT_D + ["--ridge", "-1", *FIT], r"--ridge must be in \[0, 1e\+12\], got -1"),
    ("ridge-nan", FIT_D + ["--ridge", "nan", *FIT], r"--ridge must be finite, got nan"),
    ("rtol-above-1", FIT_D + ["--rtol", "2", *FIT], r"--cutoff-rtol must be in \(0, 1\), got 2"),
    ("rtol-zero", FIT_D + ["--cutoff-rtol", "0", *FIT], r"--cutoff-rtol must be in \(0, 1\), got 0"),
    ("rtol-negative-certify", ["certify", "d.zarr", "--rtol=-1e-3", "--local"], r"--cutoff-rtol must be in \(0, 1\)"),
    ("device-gpu-without-cupy", FIT_D + ["--device", "gpu", *FIT],
     r"error: --device gpu needs CuPy and a CUDA GPU: pip install .*\[gpu\]"),  # (the option, not the keyword)
    ("workers-absurd", FIT_D + ["--workers", "100000", "--quiet", "--no-plots"],
     r"--workers 100000 x --threads-per-worker 1: at most \d+ worker threads on this machine \(4 per core"),
    ("threads-absurd", FIT_D + ["--workers", "1", "--threads-per-worker", "5000", "--quiet"],
     r"--threads-per-worker 5000: at most \d+ worker threads"),
    ("workers-absurd-certify", ["certify", "d.zarr", "--workers", "100000", "--quiet"], r"--workers 100000 x"),
    ("workers-absurd-evaluate", ["evaluate", "nomodel.zarr", "d.zarr", "--workers", "100000", "--quiet"],
     r"--workers 100000 x"),  # (the options before the inputs, as fit and certify)
    ("overflow-tokens", ["fit", "big-tokens.zarr", "--out", "run", *FIT],
     r"tokens: sample 3 has a value of magnitude 1\.0e\+60: its cubic features overflow float64"),
    ("overflow-targets", ["fit", "big-targets.zarr", "--out", "run", *FIT],
     r"targets: sample 30 has a value of magnitude 1\.0e\+200: its square and its products with the cubic features"
     r" \(the moments\) overflow float64 \(\|targets\| <= 1e\+100 is accepted\)"),  # (targets have no features)
    ("underflow-targets", ["fit", "tiny-targets.zarr", "--out", "run", *FIT],
     r"targets: sample 11 has values of magnitude at most \d\.\de-20\d: its square nears the underflow of float64"
     r" \(a sample that is not all zero needs a \|target\| >= 1e-100\); rescale the targets"
     r" \(multiply them by 1e20\d\)"),
    ("underflow-targets-import", ["import", "o.zarr", "--npz", "tiny-targets.npz"],
     r"tiny-targets\.npz: targets: sample \d+ has values of magnitude at most .*: its square nears the underflow"
     r" of float64"),
    ("overflow-certify", ["certify", "big-tokens.zarr", "--local", "--quiet"], r"tokens: sample 3 .*overflow"),
    # import and generate name every bad argument
    ("csv-empty", ["import", "o.zarr", "--csv", "empty.csv"], r"empty\.csv: empty file"),
    ("csv-header-only", ["import", "o.zarr", "--csv", "header.csv"], r"header\.csv: only a header row, no data"),
    ("csv-step-0", ["import", "o.zarr", "--csv", "series.csv", "--step", "0"], r"step must be >= 1, got 0"),
    ("csv-length-negative", ["import", "o.zarr", "--csv", "series.csv", "--length", "-3"],
     r"--length must be >= 1, got -3"),
    ("csv-horizon-0", ["import", "o.zarr", "--csv", "series.csv", "--horizon", "0"], r"horizon must be >= 1, got 0"),
    ("csv-too-short", ["import", "o.zarr", "--csv", "series.csv", "--length", "40"],
     r"series of 30 steps is too short"),
    ("csv-unknown-column", ["import", "o.zarr", "--csv", "series.csv", "--columns", "zz"], r"no column 'zz'"),
    ("npz-missing", ["import", "o.zarr", "--npz", "nope.npz"], r"nope\.npz: no such file"),
    ("npz-not-numpy", ["import", "o.zarr", "--npz", "series.csv"], r"series\.csv: not a NumPy \.npz or \.npy file"),
    ("npz-truncated", ["import", "o.zarr", "--npz", "truncated.npz"], r"truncated\.npz: .*a damaged one"),
    ("npz-bad-crc", ["import", "o.zarr", "--npz", "crc.npz"], r"crc\.npz: a damaged \.npz \(BadZipFile: Bad CRC"),
    ("csv-not-utf8", ["import", "o.zarr", "--csv", "binary.csv"], r"binary\.csv: not UTF-8 text \(byte 128"),
    ("csv-nul", ["import", "o.zarr", "--csv", "nul.csv"], r"nul\.csv: (not a readable CSV file|line 2)"),
    ("csv-extra-values", ["import", "o.zarr", "--csv", "long.csv", "--length", "2"],
     r"long\.csv: line 3: 5 values but the header has 2 columns"),
    ("csv-missing-value", ["import", "o.zarr", "--csv", "short.csv", "--length", "2"],
     r"short\.csv: line 3: 1 value but the header has 2 columns"),
    ("csv-no-header", ["import", "o.zarr", "--csv", "noheader.csv"],
     r"noheader\.csv: the first row \(0, 0\) is numbers"),
    ("csv-duplicate-column", ["import", "o.zarr", "--csv", "dupheader.csv"], r"column 'a' appears twice"),
    ("timedelta-tokens", ["fit", "times.zarr", "--out", "run", *FIT], r"tokens: expected a float .*timedelta64"),
    ("timedelta-certify", ["certify", "times.zarr", "--local", "--quiet"], r"tokens: expected a float .*timedelta64"),
    ("url-unknown-protocol", FIT_D[:3] + ["xyz://bucket/run", *FIT], r"Protocol not known: xyz"),
    ("noise-nan", ["generate", "mhla", "o.zarr", "--noise", "nan"], r"--noise must be finite, got nan"),
    ("noise-negative", ["generate", "mhla", "o.zarr", "--noise", "-1"], r"--noise must be in \[0, 1e\+99\], got -1"),
    ("d-out-0", ["generate", "mhla", "o.zarr", "--d-out", "0"], r"--d-out must be >= 1, got 0"),
    ("samples-0", ["generate", "mhla", "o.zarr", "--samples", "0"], r"--samples must be >= 1, got 0"),
    ("length-negative", ["generate", "mhla", "o.zarr", "--length", "-5"], r"--length must be >= 1, got -5"),
    ("heads-0", ["generate", "mhla", "o.zarr", "--heads", "0"], r"--heads must be >= 1, got 0"),
    ("chunk-0", ["generate", "mhla", "o.zarr", "--chunk-samples", "0"], r"--chunk-samples must be >= 1, got 0"),
    ("assoc-pairs-0", ["generate", "assoc", "o.zarr", "--pairs", "0"], r"--pairs must be >= 1, got 0"),
    ("submit-gpus-negative", ["submit", "s3://b/d.zarr", "--out", "s3://b/r", "--dry-run", "--image", "r.io/x",
                              "--gpus=-1"],
     r"^scaleattn submit: error: --gpus must be >= 0, got -1 \(see scaleattn submit --help\)$"),
    ("submit-fit-args-quote", ["submit", "s3://b/d.zarr", "--out", "s3://b/r", "--dry-run", "--image", "r.io/x",
                               "--fit-args", '"open'], r"^scaleattn submit: error: --fit-args: No closing quotation"),
    ("assoc-orthogonal", ["generate", "assoc", "o.zarr", "--pairs", "3", "--dim", "2", "--orthogonal"],
     r"orthogonal keys need --pairs <= --dim"),
    # an output the file system refuses is the user's problem (exit 2), not a bug: a file where a folder goes, a
    # place where nothing can be created
    ("out-under-a-file", FIT_D[:3] + ["afile/run", *FIT], r"cannot write --out .*afile/run: (File exists|Not a dir)"),
    ("generate-under-a-file", ["generate", "mhla", "afile/o.zarr"], r"cannot write output .*afile/o\.zarr: "),
    ("import-under-a-file", ["import", "afile/o.zarr", "--npz", "arrays.npz"], r"cannot write output .*afile/o\.zarr"),
    ("out-in-proc", FIT_D[:3] + ["/proc/scaleattn-run", *FIT], r"cannot write --out /proc/scaleattn-run: "),
    ("bench-out-under-a-file", ["bench", "--quick", "--out", "afile/b"], r"cannot write --out afile/b: Not a dir"),
]


@pytest.mark.parametrize("case, argv, pattern", CASES, ids=[c[0] for c in CASES])
def test_refused_before_any_work(case, argv, pattern, base, tmp_path, capsys):
    w = tmp_path / "w"
    import shutil

    shutil.copytree(base, w)
    names = sorted(os.listdir(w))
    inputs = Inputs(*(w / n for n in names))
    t0 = time.monotonic()
    rc, err = run_main(argv, capsys, cwd=w)
    assert rc == 2, err
    expect(error_line(err), pattern)
    assert time.monotonic() - t0 < 30  # no cluster was started, nothing was built
    inputs.unchanged()
    assert sorted(os.listdir(w)) == names


def test_an_npz_named_npy_is_read_by_its_content(base, tmp_path, capsys):
    """Not an error: import reads the file's kind from its content, so the two imports hold the same data."""
    for src, out in (("arrays.npy", "a.zarr"), ("arrays.npz", "b.zarr")):
        rc, err = run_main(["import", str(tmp_path / out), "--npz", str(base / src)], capsys)
        assert rc == 0, err
    a, b = (zarr.open_group(str(tmp_path / n), mode="r") for n in ("a.zarr", "b.zarr"))
    np.testing.assert_array_equal(a["tokens"][...], b["tokens"][...])


def test_report_json_is_strict(tmp_path, capsys):
    """A fit whose relative MSE is undefined (all targets zero) writes null, never NaN, in report.json."""
    tok, y = rows()
    foreign(tmp_path / "z.zarr", tok, np.zeros_like(y))
    rc, err = run_main(["fit", "z.zarr", "--out", "run", "--absent-chunks-are-fill", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    text = (tmp_path / "run" / "report.json").read_text()

    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    rep = json.loads(text, parse_constant=refuse)
    assert rep["relative_train_mse"] is None and not any(
        isinstance(v, float) and not math.isfinite(v) for v in rep.values())


@pytest.mark.slow
def test_transient_read_errors_are_retried_with_the_same_bits(tmp_path, capsys, monkeypatch):
    dataset(tmp_path / "d.zarr")
    rc, err = run_main(["fit", "d.zarr", "--out", "ref", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    monkeypatch.setenv("SCALEATTN_TEST_READ_FAILURES", "2")
    monkeypatch.setattr(_testing, "_reads", [0])
    monkeypatch.setattr(_storage, "RETRY_DELAY", 0.05)  # the same policy, shorter waits
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    assert _testing._reads[0] == 2  # two failures, retried with backoff
    same_stats(stats_of(tmp_path / "run"), stats_of(tmp_path / "ref"))


def test_a_store_that_keeps_failing_is_a_local_file_error_and_leaves_no_checkpoint(tmp_path, capsys, monkeypatch):
    dataset(tmp_path / "d.zarr")
    monkeypatch.setenv("SCALEATTN_TEST_READ_FAILURES", "1000")
    monkeypatch.setattr(_testing, "_reads", [0])
    monkeypatch.setattr(_storage, "RETRY_DELAY", 0.05)
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 2
    line = error_line(err)
    expect(line, r"\S*d\.zarr: cannot read or write it on the local file system \(ConnectionError: injected")
    assert "object store" not in line
    expect(line, r"; no checkpoint was kept$")  # (a refusal of the data: no help tail)
    assert _testing._reads[0] == 3  # the retry policy: three attempts in all
    assert sorted(os.listdir(tmp_path)) == ["d.zarr"]


def test_a_chunk_larger_than_memory_is_refused_before_the_build(tmp_path, capsys, monkeypatch):
    g = zarr.open_group(str(tmp_path / "huge.zarr"), mode="w", zarr_format=3)
    n, T = 2560, 1000
    g.create_array("tokens", shape=(n, T, 2), chunks=(n, T, 2), dtype="f8", fill_value=0.0)[...] = 0.5
    g.create_array("targets", shape=(n, 2), chunks=(n, 2), dtype="f8")[...] = 1.0
    monkeypatch.setenv("SCALEATTN_MEMORY_LIMIT", "70MB")
    rc, err = run_main(["fit", "huge.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), r"one chunk of the dataset takes 0\.\d\d GiB to read .* Rewrite the dataset with smaller"
                            r" chunks")
    assert sorted(os.listdir(tmp_path)) == ["huge.zarr"]


@pytest.mark.slow
def test_leftover_temporaries_of_a_killed_run_are_cleaned(tmp_path, capsys):
    dataset(tmp_path / "d.zarr")
    for name in (".run.partial-0badc0de", ".run.partial-0badc0de.old", ".g.zarr.partial-12345678"):
        (tmp_path / name).mkdir()  # half-written temporaries (not whole outputs: never restored)
        (tmp_path / name / "zarr.json").write_text("{}")
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    rc, err = run_main(["generate", "mhla", "g.zarr", "--samples", "4", "--length", "3"], capsys, cwd=tmp_path)
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == ["d.zarr", "g.zarr", "run"]


def test_user_entries_named_like_temporaries_are_kept(tmp_path, capsys):
    """Only what a run writes, under the exact names it gives its temporaries, is cleaned: a user's file or
    folder next to the output with such a name (even the exact pattern) stays, contents and all."""
    dataset(tmp_path / "d.zarr")
    mine = {".run.partial-mine/thesis.txt", ".run.partial-notes.txt", ".run.partial-1234abcd/notes.txt",
            ".run.partial-1234abcd.old/model.zarr/README.txt"}
    for rel in mine:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("the user's own")
    before = tree_hash(tmp_path)
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    after = tree_hash(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("run")} == before


def test_a_lost_output_moved_aside_by_a_killed_run_is_restored(tmp_path, capsys):
    """Killed between moving the old output aside and putting the new one in place: the next run puts the
    old one back before anything else, so neither copy is lost."""
    dataset(tmp_path / "d.zarr")
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    os.rename(tmp_path / "run", tmp_path / ".run.partial-0badc0de.old")
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 2 and "already exists" in error_line(err)  # the old output is back, and kept
    assert sorted(os.listdir(tmp_path)) == ["d.zarr", "run"]


def test_an_interrupted_removal_leaves_a_smaller_store_never_a_foreign_one(tmp_path, capsys, monkeypatch):
    """A fit with --overwrite removes the old checkpoint first: Ctrl-C during that removal (shutil.rmtree, in the
    directory's own order) left it without its zarr.json, and every later run refused it as "not written by
    scaleattn" (remove it yourself). Wherever the removal stops, what is left is a store scaleattn wrote, which
    the next --overwrite replaces."""
    import shutil

    from scaleattn.store._location import Location
    from scaleattn.store._outputs import owner_of

    dataset(tmp_path / "d.zarr")
    rc, err = run_main(["fit", "d.zarr", "--out", "run", "--keep-checkpoint", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    ck, copy = tmp_path / "run.checkpoint.zarr", tmp_path / "copy.zarr"
    n = sum(len(files) for _, _, files in os.walk(ck))

    def interrupted_removal(path, k):
        """``remove(path)`` stopped by Ctrl-C as it would delete its file number k + 1."""
        calls = []

        def stopping(real):
            def call(p, *args, **kwargs):
                calls.append(p)
                if len(calls) > k:
                    raise KeyboardInterrupt
                return real(p, *args, **kwargs)
            return call

        with monkeypatch.context() as m:
            m.setattr(os, "remove", stopping(os.remove))
            m.setattr(os, "unlink", stopping(os.unlink))
            with pytest.raises(KeyboardInterrupt):
                _storage.remove(str(path))

    for k in range(0, n, max(1, n // 16)):  # (a removal takes 0.1-0.5 s: 16 places it stops at)
        shutil.copytree(ck, copy)
        interrupted_removal(copy, k)
        assert owner_of(Location(str(copy))) == (True, "scaleattn-checkpoint"), (k, sorted(os.walk(copy)))
        shutil.rmtree(copy)
    interrupted_removal(ck, n // 2)
    rc, err = run_main(["fit", "d.zarr", "--out", "run", "--overwrite", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == ["d.zarr", "run"]


def _wait_done(ck, k, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if int(zarr.open_group(str(ck), mode="r")["done"][...].all(axis=1).sum()) >= k:
                return
        except Exception:  # not created yet
            pass
        time.sleep(0.1)
    raise AssertionError("the fit did not get that far")


@pytest.mark.slow
def test_ctrl_c_says_what_was_kept_and_resume_is_bit_identical(tmp_path):
    dataset(tmp_path / "d.zarr")
    assert run_cli(["fit", "d.zarr", "--out", "ref", *FIT], cwd=tmp_path).returncode == 0
    args = ["fit", "d.zarr", "--out", "run", *FIT]
    p = popen_cli(args, cwd=tmp_path, env={"SCALEATTN_TEST_TASK_DELAY": "1"})
    _wait_done(tmp_path / "run.checkpoint.zarr", 1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130
    line = error_line(err)  # (how many groups got done before the signal is the machine's speed; what is said true)
    expect(line, r"fit: interrupted; the checkpoint \S*run\.checkpoint\.zarr keeps \d+ of 16 row groups:"
                 r" repeat the fit with --resume to continue$")
    kept = int(re.search(r"keeps (\d+) of", line).group(1))
    done = int(zarr.open_group(str(tmp_path / "run.checkpoint.zarr"), mode="r")["done"][...].all(axis=1).sum())
    assert 1 <= kept == done < 16
    r = run_cli(args + ["--resume"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    same_stats(stats_of(tmp_path / "run"), stats_of(tmp_path / "ref"))
    assert sorted(os.listdir(tmp_path)) == ["d.zarr", "ref", "run"]


@pytest.mark.slow
def test_ctrl_c_to_the_whole_job_with_dask_workers_is_one_line(tmp_path):
    """A terminal's Ctrl-C goes to every process of the job: the embedded cluster's workers ignore it (they
    printed a KeyboardInterrupt traceback each), the job keeps its checkpoint and says so in one line."""
    dataset(tmp_path / "d.zarr")
    args = ["fit", "d.zarr", "--out", "run", "--workers", "2", "--quiet", "--no-plots", "--no-exact-mse"]
    p = popen_cli(args, cwd=tmp_path, env={"SCALEATTN_TEST_TASK_DELAY": "1"}, session=True)
    _wait_done(tmp_path / "run.checkpoint.zarr", 1)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    expect(error_line(err), r"fit: interrupted; the checkpoint \S*run\.checkpoint\.zarr keeps \d+ of 16 row groups:"
                            r" repeat the fit with --resume to continue$")
    assert run_cli(args + ["--resume"], cwd=tmp_path).returncode == 0


@pytest.mark.slow
def test_ctrl_c_before_the_first_group_leaves_nothing(tmp_path):
    dataset(tmp_path / "d.zarr")
    p = popen_cli(["fit", "d.zarr", "--out", "run", *FIT], cwd=tmp_path, env={"SCALEATTN_TEST_TASK_DELAY": "30"})
    deadline = time.monotonic() + 60
    while not (tmp_path / "run.checkpoint.zarr").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130
    expect(error_line(err), r"fit: interrupted; no checkpoint was kept$")
    assert sorted(os.listdir(tmp_path)) == ["d.zarr"]


def test_writes_in_flight_when_an_output_fails_land_before_its_removal(tmp_path):
    """Ctrl-C (or any error) stops the caller waiting for a zarr write, not the write: its puts go on on zarr's
    I/O thread. The failed output's temporary is removed after them, so nothing comes back after the removal
    (an interrupted generate left 4-110 MB hidden temporaries)."""
    import asyncio

    from zarr.core.sync import _get_loop

    from scaleattn.store._location import Location
    from scaleattn.store._outputs import atomic_output

    async def late_put(path):  # a chunk's put still running when the caller gives up
        await asyncio.sleep(0.5)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"chunk")

    with pytest.raises(KeyboardInterrupt):
        with atomic_output(Location(str(tmp_path / "out.zarr"))) as tmp:
            asyncio.run_coroutine_threadsafe(late_put(os.path.join(tmp.url, "tokens", "c", "0")), _get_loop())
            raise KeyboardInterrupt
    time.sleep(0.8)  # (without the wait for the put, it lands now)
    assert os.listdir(tmp_path) == []


def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(tmp_path):
    """A full or read-only file system while an output is written, or a refused permission on the output's own
    path, is the output's StorageError naming it; the temporary is removed. Any other OSError of the block (an
    input that cannot be read, a missing path inside the output: a bug) is raised as it is."""
    import errno

    from scaleattn.errors import StorageError
    from scaleattn.store._location import Location
    from scaleattn.store._outputs import atomic_output

    out = Location(str(tmp_path / "o.zarr"))
    with pytest.raises(StorageError, match=r"cannot write output .*o\.zarr: No space left on device"):
        with atomic_output(out) as tmp:
            os.makedirs(tmp.url)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert os.listdir(tmp_path) == []
    with pytest.raises(StorageError, match=r"cannot write output .*o\.zarr: Permission denied \(.*partial"):
        with atomic_output(out) as tmp:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.path.join(tmp.url, "c/0"))
    for e in (PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "input.zarr" / "0.0")),
              FileNotFoundError(errno.ENOENT, "gone", None)):
        with pytest.raises(type(e)) as got, atomic_output(out) as tmp:
            if e.filename is None:
                e.filename = os.path.join(tmp.url, "sub", "x")  # inside the output: a bug of the writer, not a refusal
            raise e
        assert type(got.value) is type(e)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("where", ["dataset chunk", "dataset metadata", "report.json", "model chunk"])
def test_a_fifo_in_an_input_is_refused_not_waited_on(where, tmp_path, capsys):
    """A FIFO (or socket, device) where a file is read blocks the read for ever: refused up front, naming it
    (a subprocess with a deadline, so that a regression fails instead of hanging the suite)."""
    dataset(tmp_path / "d.zarr")
    if where in ("report.json", "model chunk"):
        rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
        assert rc == 0, err
    target = {"dataset chunk": "d.zarr/tokens/c/0/0/0", "dataset metadata": "d.zarr/targets/zarr.json",
              "report.json": "run/report.json", "model chunk": "run/model.zarr/coef/c/0/0"}[where]
    os.remove(tmp_path / target)
    os.mkfifo(tmp_path / target)
    argv = {"report.json": ["plot", "run"], "model chunk": ["evaluate", "run/model.zarr", "d.zarr", "--local"]}.get(
        where, ["fit", "d.zarr", "--out", "new", *FIT])
    p = run_cli(argv, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    expect(error_line(p.stderr), re.escape(str(tmp_path / target)) + r": not a regular file \(a FIFO")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("link", ["dangling", "loop"])
@pytest.mark.parametrize("where", ["dataset chunk", "model chunk"])
def test_a_broken_link_in_an_input_is_one_line_naming_it(where, link, tmp_path, capsys):
    """A symbolic link in a store that leads nowhere was called "not a regular file (a FIFO, socket or device)",
    inside "not a readable Zarr group (StorageError: ...)"; one that loops was an OSError in that wrapper."""
    dataset(tmp_path / "d.zarr")
    if where == "model chunk":
        rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
        assert rc == 0, err
    target = {"dataset chunk": "d.zarr/tokens/c/0/0/0", "model chunk": "run/model.zarr/coef/c/0/0"}[where]
    os.remove(tmp_path / target)
    os.symlink("gone" if link == "dangling" else os.path.basename(target), tmp_path / target)
    argv = ["evaluate", "run/model.zarr", "d.zarr", *FIT[:2]] if where == "model chunk" else \
        ["fit", "d.zarr", "--out", "new", *FIT]
    rc, err = run_main(argv, capsys, cwd=tmp_path)
    assert rc == 2, err
    expect(error_line(err), re.escape(str(tmp_path / target)) + r": a symbolic link to \S+, which does not exist or"
                            r" loops back: scaleattn reads only regular files")
    assert "readable" not in err and not (tmp_path / "new").exists()
