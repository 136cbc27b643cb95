"""A streaming fit (``solver="stream"``) keeps its first sweep and every data pass in a pass journal
(scaleattn.distributed.journal) and continues from it after Ctrl-C, a failure or a kill: the resumed fit reads
back what the journal holds for the very products it asks for and is bit-identical to a fit never interrupted;
a journal of another fit is refused, a damaged or half-written entry recomputed, never mixed in."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

import numpy as np
import pytest
import zarr

import scaleattn
from scaleattn.distributed.journal import PassJournal
from scaleattn.errors import CheckpointError, OutputExistsError
from scaleattn.generate import generate_mhla
from scaleattn.linalg._stream import StreamOperator

from .conftest import FIT, error_line, expect, popen_cli, run_cli, run_main

STREAM = ["--solver", "stream"]


def _data(path, d=4, samples=60, causal=True, seed=2, **kw):
    """Realizable MHLA data with more rows than features (the streaming CG, not the dual), several row groups."""
    return generate_mhla(str(path), d=d, heads=2, length=6, samples=samples, causal=causal, chunk_samples=20,
                         seed=seed, noise=0.05, **kw)


def _comparable(report: dict) -> str:
    """A report's numbers, without what differs between an interrupted and a whole run (times, where the run
    is, what was resumed)."""
    drop = {"timings", "seconds", "checkpoint", "command"}
    r = {k: v for k, v in report.items() if k not in drop}
    r["solver_path"] = {k: v for k, v in r["solver_path"].items()
                        if k not in ("sweep_resumed", "passes_resumed", "passes_computed")}
    return json.dumps(r, sort_keys=True, default=str)


def _same_fit(a, b) -> None:
    assert np.array_equal(a.solution.coef, b.solution.coef)
    assert a.solution.sse == b.solution.sse
    assert np.array_equal(a.solution.backward_error, b.solution.backward_error)
    assert np.array_equal(a.model.coef, b.model.coef)
    ca, cb = a.certificate, b.certificate
    assert (ca.rank, ca.lambda_min, ca.lambda_max, ca.verdict) == (cb.rank, cb.lambda_min, cb.lambda_max, cb.verdict)
    assert _comparable(a.report) == _comparable(b.report)


class _Stop:
    """``StreamOperator.map_groups`` that raises ``exc`` at its ``at``-th call (0: the first sweep) and counts the
    calls: the passes computed, not read back."""

    def __init__(self, monkeypatch, at=None, exc=KeyboardInterrupt):
        self.calls, self.at, self.exc = 0, at, exc
        real = StreamOperator.map_groups

        def map_groups(op, *args, **kwargs):
            if self.at is not None and self.calls == self.at:
                raise self.exc("injected")
            self.calls += 1
            return real(op, *args, **kwargs)

        monkeypatch.setattr(StreamOperator, "map_groups", map_groups)


def _reference(tmp_path, ds, **kw):
    return scaleattn.fit(ds, tmp_path / "ref", solver="stream", overwrite=True, **kw)


@pytest.mark.parametrize("case", [
    dict(at=5, exc=KeyboardInterrupt, d=4, causal=True),
    dict(at=1, exc=RuntimeError, d=4, causal=True),  # right after the sweep
    dict(at=14, exc=KeyboardInterrupt, d=3, causal=False, samples=200),  # last-token rows
])
def test_interrupted_fit_resumes_bit_identically(tmp_path, monkeypatch, case):
    """Stopped at pass k (Ctrl-C or a failure), the journal keeps the sweep and the k - 1 passes done; the resumed
    fit reads them back (it computes only the rest: counted) and equals an uninterrupted fit bit for bit."""
    ds = _data(tmp_path / "d.zarr", d=case["d"], causal=case["causal"], samples=case.get("samples", 60))
    ref = _reference(tmp_path, ds)
    total = ref.report["solver_path"]["passes_computed"]
    assert total > case["at"] + 3 and not (tmp_path / "ref.checkpoint.zarr").exists()  # removed once written

    stop = _Stop(monkeypatch, case["at"], case["exc"])
    with pytest.raises(case["exc"]) as e:
        scaleattn.fit(ds, tmp_path / "run", solver="stream")
    ck = tmp_path / "run.checkpoint.zarr"
    done = case["at"] - 1
    assert ck.exists() and not (tmp_path / "run").exists()
    assert f"keeps the first sweep and {done} data pass" in e.value.scaleattn_hint
    assert "`resume=True`" in e.value.scaleattn_hint

    stop.at, stop.calls = None, 0
    res = scaleattn.fit(ds, tmp_path / "run", solver="stream", resume=True, keep_checkpoint=True)
    sp = res.report["solver_path"]
    assert (sp["sweep_resumed"], sp["passes_resumed"], sp["passes_computed"]) == (True, done, total - done)
    assert stop.calls == total - done  # the sweep and the passes read back read no data
    _same_fit(res, ref)
    assert res.report["checkpoint"] == str(ck) and ck.exists()

    # all of it in the journal now: a second resume computes nothing
    stop.calls = 0
    again = scaleattn.fit(ds, tmp_path / "again", solver="stream", resume=True, checkpoint=ck)
    assert stop.calls == 0 and again.report["solver_path"]["passes_resumed"] == total
    _same_fit(again, ref)
    assert not ck.exists()  # removed after success without keep_checkpoint


def test_interrupted_in_the_sweep_keeps_nothing(tmp_path, monkeypatch):
    """Ctrl-C in the first sweep: nothing worth resuming, the new journal is removed and the hint says so."""
    ds = _data(tmp_path / "d.zarr")
    _Stop(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt) as e:
        scaleattn.fit(ds, tmp_path / "run", solver="stream")
    assert "no checkpoint was kept" in e.value.scaleattn_hint
    assert sorted(os.listdir(tmp_path)) == ["d.zarr"]


def test_data_changed_mid_fit_says_to_start_over(tmp_path, monkeypatch):
    """A resumed fit whose data changed under it (an IntegrityError of a live pass): the journal is kept, and the
    hint says a resume would be refused and to start over once nothing writes to the input."""
    from scaleattn.errors import IntegrityError

    ds = _data(tmp_path / "d.zarr")
    stop = _Stop(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        scaleattn.fit(ds, tmp_path / "run", solver="stream")
    stop.calls, stop.at, stop.exc = 0, 2, IntegrityError
    with pytest.raises(IntegrityError) as e:
        scaleattn.fit(ds, tmp_path / "run", solver="stream", resume=True)
    assert "run again with `overwrite=True` instead of `resume=True`" in e.value.scaleattn_hint
    assert (tmp_path / "run.checkpoint.zarr").exists()


def test_cli_interrupt_line_says_how_to_continue(tmp_path, monkeypatch, capsys):
    """``scaleattn fit --solver stream`` stopped by Ctrl-C: exit 130 and the line names the checkpoint, what it
    keeps and --resume; the same command with --resume finishes and removes it."""
    _data(tmp_path / "d.zarr")
    stop = _Stop(monkeypatch, 4)
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *STREAM, *FIT], capsys, cwd=tmp_path)
    assert rc == 130
    expect(err.strip().splitlines()[-1], r"scaleattn fit: interrupted; the checkpoint \S*run\.checkpoint\.zarr"
                                         r" keeps the first sweep and 3 data passes: repeat the fit with --resume to"
                                         r" continue")
    stop.at = None
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *STREAM, *FIT, "--resume"], capsys, cwd=tmp_path)
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == ["d.zarr", "run"]


def test_existing_journal_needs_resume_or_overwrite(tmp_path, monkeypatch, capsys):
    """A fresh fit over a journal is refused (exit 2, names --resume and --overwrite); --overwrite starts over."""
    ds = _data(tmp_path / "d.zarr")
    _Stop(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        scaleattn.fit(ds, tmp_path / "run", solver="stream")
    with pytest.raises(OutputExistsError, match="resume=True"):
        scaleattn.fit(ds, tmp_path / "run", solver="stream")
    monkeypatch.undo()
    res = scaleattn.fit(ds, tmp_path / "run", solver="stream", overwrite=True, keep_checkpoint=True)
    sp = res.report["solver_path"]
    assert (sp["sweep_resumed"], sp["passes_resumed"]) == (False, 0)
    _same_fit(res, _reference(tmp_path, ds))


def _journal(tmp_path, ds, name="ck.zarr"):
    """A complete journal of ``ds`` (a fit that kept it) and the fit."""
    ck = tmp_path / name
    res = scaleattn.fit(ds, tmp_path / "first", solver="stream", checkpoint=ck, keep_checkpoint=True,
                        overwrite=True)
    return ck, res


def test_journal_of_another_fit_is_refused(tmp_path, capsys):
    """Another dataset (same shapes), another d, a statistics build's checkpoint or a journal where a Gram fit
    resumes: refused with one line naming what differs, the store left as it was."""
    ds = _data(tmp_path / "d.zarr")
    ck, _ = _journal(tmp_path, ds)
    other = _data(tmp_path / "e.zarr", seed=9)
    with pytest.raises(CheckpointError, match="different fit .*dataset_fingerprint"):
        scaleattn.fit(other, tmp_path / "x", solver="stream", checkpoint=ck, resume=True)
    small = _data(tmp_path / "f.zarr", d=3, samples=80)
    with pytest.raises(CheckpointError, match="different fit"):
        scaleattn.fit(small, tmp_path / "x", solver="stream", checkpoint=ck, resume=True)
    with pytest.raises(CheckpointError, match=r"pass journal of a streaming fit .*`solver='stream'`"):
        scaleattn.fit(ds, tmp_path / "x", solver="eigh", checkpoint=ck, resume=True)
    assert ck.exists() and PassJournal.open  # untouched
    gram = tmp_path / "gram.zarr"
    scaleattn.fit(ds, tmp_path / "g", solver="eigh", checkpoint=gram, keep_checkpoint=True)
    with pytest.raises(CheckpointError, match="statistics build of a fit by the Gram route"):
        scaleattn.fit(ds, tmp_path / "x", solver="stream", checkpoint=gram, resume=True)
    rc, err = run_main(["fit", "d.zarr", "--out", "x", "--checkpoint", "gram.zarr", "--resume", *STREAM, *FIT],
                       capsys, cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), r"checkpoint \S*gram\.zarr' holds the statistics build .*--solver")
    assert not (tmp_path / "x").exists()


def test_changed_rows_refuse_the_journal(tmp_path):
    """The journal is bound to the rows as stored: a dataset rewritten in place (same fingerprint-level shapes,
    other chunks) is refused, never resumed on stale passes."""
    ds = _data(tmp_path / "d.zarr")
    ck, _ = _journal(tmp_path, ds)
    g = zarr.open_group(str(tmp_path / "d.zarr"), mode="r+")
    tok = g["tokens"]
    tok[0:1] = tok[0:1] * 1.0  # the same values written again: a new chunk object (size, time)
    with pytest.raises(CheckpointError, match=r"different fit \(the dataset.s rows changed since\) \(rows:"):
        scaleattn.fit(str(tmp_path / "d.zarr"), tmp_path / "x", solver="stream", checkpoint=ck, resume=True)


def _entries(ck):
    return sorted(n for n in os.listdir(ck / "passes") if n.isdigit())


@pytest.mark.parametrize("damage", ["flip", "undone", "truncated_meta", "sweep"])
def test_damaged_or_half_written_entries_are_recomputed(tmp_path, damage):
    """An entry that fails its crc32c, one without the attributes that mark it done (a kill mid-write), one whose
    metadata was cut short, and a damaged sweep: from there on the passes are computed again and the answer is
    bit-identical to an uninterrupted fit."""
    ds = _data(tmp_path / "d.zarr")
    ck, ref = _journal(tmp_path, ds)
    names = _entries(ck)
    k = 4
    target = ck / "passes" / names[k]
    if damage == "flip":
        chunk = next(p for p in target.rglob("*") if p.is_file() and p.name != "zarr.json")
        b = bytearray(chunk.read_bytes())
        b[len(b) // 2] ^= 0x10
        chunk.write_bytes(bytes(b))
    elif damage == "undone":
        meta = json.loads((target / "zarr.json").read_text())
        meta["attributes"] = {}
        (target / "zarr.json").write_text(json.dumps(meta))
    elif damage == "truncated_meta":
        text = (target / "zarr.json").read_text()
        (target / "zarr.json").write_text(text[: len(text) // 2])
    else:
        chunk = next(p for p in (ck / "sweep" / "A").rglob("*") if p.is_file() and p.name != "zarr.json")
        chunk.write_bytes(chunk.read_bytes()[:-3] + b"xyz")
    res = scaleattn.fit(ds, tmp_path / "run", solver="stream", checkpoint=ck, resume=True, keep_checkpoint=True)
    sp = res.report["solver_path"]
    if damage == "sweep":
        assert sp["sweep_resumed"] is False and sp["passes_resumed"] == len(names)  # the passes still match
    else:
        assert sp["sweep_resumed"] is True and sp["passes_resumed"] == k
        assert sp["passes_computed"] == len(names) - k
    _same_fit(res, ref)
    assert _entries(ck) == names  # rewritten whole


def test_other_options_take_another_path_from_the_pass_they_differ(tmp_path):
    """The journal keys each pass by its input, not its position: resumed with another cutoff (another rank, other
    passes), the passes asked for the same input are read back, the rest computed, and the fit equals a fresh one
    with that cutoff."""
    ds = _data(tmp_path / "d.zarr")
    ck, _ = _journal(tmp_path, ds)
    n = len(_entries(ck))
    res = scaleattn.fit(ds, tmp_path / "run", solver="stream", checkpoint=ck, resume=True, cutoff_rtol=0.1,
                        keep_checkpoint=True)
    ref = scaleattn.fit(ds, tmp_path / "ref", solver="stream", cutoff_rtol=0.1)
    _same_fit(res, ref)
    sp = res.report["solver_path"]
    assert 0 < sp["passes_resumed"] < n and sp["passes_computed"] > 0
    assert len(_entries(ck)) == sp["passes_resumed"] + sp["passes_computed"]  # the other path's entries dropped


@pytest.mark.slow
@pytest.mark.parametrize("stopped_on", ["process", "cluster"])
def test_journal_moves_between_process_and_cluster(tmp_path, monkeypatch, stopped_on):
    """A fit stopped by Ctrl-C in its 6th pass, in this process or on a Dask cluster, resumed the other way: the
    client kept the journal (the workers only compute), and the answer is the uninterrupted in-process fit's."""
    from distributed import Client, LocalCluster

    from scaleattn.distributed.stream import DistributedStreamOperator

    ds = _data(tmp_path / "d.zarr")
    ref = _reference(tmp_path, ds)
    calls = [0]
    real = DistributedStreamOperator._pass

    def _pass(op, *args):  # (0: the first sweep)
        if calls[0] == 6:
            raise KeyboardInterrupt("injected")
        calls[0] += 1
        return real(op, *args)

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        if stopped_on == "process":
            _Stop(monkeypatch, 6)
            with pytest.raises(KeyboardInterrupt):
                scaleattn.fit(ds, tmp_path / "run", solver="stream")
            monkeypatch.undo()
            res = scaleattn.fit(ds, tmp_path / "run", solver="stream", resume=True, client=client)
            assert res.report["solver_path"]["cluster"]["workers"] == 2
        else:
            monkeypatch.setattr(DistributedStreamOperator, "_pass", _pass)
            with pytest.raises(KeyboardInterrupt) as e:
                scaleattn.fit(ds, tmp_path / "run", solver="stream", client=client)
            assert "keeps the first sweep and 5 data passes" in e.value.scaleattn_hint
            monkeypatch.undo()
    if stopped_on == "cluster":
        res = scaleattn.fit(ds, tmp_path / "run", solver="stream", resume=True)
    assert res.report["solver_path"]["passes_resumed"] == 5
    assert np.array_equal(res.solution.coef, ref.solution.coef) and res.solution.sse == ref.solution.sse
    assert res.certificate.lambda_min == ref.certificate.lambda_min


def test_dual_path_keeps_no_journal(tmp_path):
    """Fewer rows than features: the dual reads the rows once (no passes), keeps no journal and ignores
    keep_checkpoint."""
    ds = _data(tmp_path / "d.zarr", d=4, samples=5)
    res = scaleattn.fit(ds, tmp_path / "run", solver="stream", keep_checkpoint=True)
    assert res.report["solver_path"]["path"] == "dual" and res.report["checkpoint"] is None
    assert sorted(os.listdir(tmp_path)) == ["d.zarr", "run"]
    # a journal left at its checkpoint is refused as any checkpoint is, and removed by overwrite (start over)
    _journal(tmp_path, _data(tmp_path / "e.zarr"), name="other.checkpoint.zarr")
    with pytest.raises(OutputExistsError, match="resume=True"):
        scaleattn.fit(ds, tmp_path / "other", solver="stream")
    scaleattn.fit(ds, tmp_path / "other", solver="stream", overwrite=True)
    assert not (tmp_path / "other.checkpoint.zarr").exists() and (tmp_path / "other").exists()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["after", "mid"])
def test_sigkilled_fit_resumes_bit_identically(tmp_path, where):
    """``scaleattn fit --solver stream`` SIGKILLed (no cleanup, its lock left) after its 6th pass, or while writing
    it (values written, not marked done): the same command with --resume takes over the lock, reads back the
    passes done and writes the run of an uninterrupted fit."""
    _data(tmp_path / "d.zarr")
    args = ["fit", "d.zarr", "--out", "run", *STREAM, *FIT]
    r = run_cli(args, cwd=tmp_path, env={"SCALEATTN_TEST_KILL_AFTER_PASSES": "6" + (":mid" if where == "mid" else "")})
    assert r.returncode == -9, r.stderr
    assert (tmp_path / "run.checkpoint.zarr").exists() and not (tmp_path / "run").exists()
    r = run_cli(args + ["--resume", "--json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["solver_path"]["passes_resumed"] == (6 if where == "after" else 5)
    shutil.copytree(tmp_path / "d.zarr", tmp_path / "copy.zarr")
    r = run_cli(["fit", "copy.zarr", "--out", "ref", *STREAM, *FIT, "--json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ref = json.loads(r.stdout)
    for key in ("dataset", "dataset_fingerprint"):
        rep.pop(key), ref.pop(key)
    assert _comparable(rep) == _comparable(ref)
    a, b = zarr.open_group(str(tmp_path / "run" / "model.zarr")), zarr.open_group(str(tmp_path / "ref" / "model.zarr"))
    assert np.array_equal(a["coef"][...], b["coef"][...])
    assert sorted(os.listdir(tmp_path)) == ["copy.zarr", "d.zarr", "ref", "run"]


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGKILL", "SIGTERM"])
def test_signalled_from_outside_mid_fit_resumes_bit_identically(tmp_path, signame):
    """A signal from outside at whatever point the fit is (a pass being computed or written): SIGKILL leaves the
    journal as it was (an entry cut short is recomputed), SIGTERM ends with exit 143 and the line saying what the
    journal keeps and --resume; the resumed fit reads back at least the entries seen done and writes the run of
    an uninterrupted fit."""
    _data(tmp_path / "d.zarr", d=8, samples=500, seed=4)
    args = ["fit", "d.zarr", "--out", "run", *STREAM, *FIT]
    proc = popen_cli(args, cwd=tmp_path)
    passes = tmp_path / "run.checkpoint.zarr" / "passes"
    seen = 0
    try:
        while proc.poll() is None and seen < 12:
            time.sleep(0.01)
            seen = len(_entries(tmp_path / "run.checkpoint.zarr")) if passes.exists() else 0
        assert proc.poll() is None, "the fit ended before it could be stopped"
        proc.send_signal(getattr(signal, signame))
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    if signame == "SIGKILL":
        assert proc.returncode == -9
    else:
        assert proc.returncode == 143, err
        expect(err.strip().splitlines()[-1], r"stopped by SIGTERM; the checkpoint \S*run\.checkpoint\.zarr keeps the"
                                             r" first sweep and \d+ data passes: .*--resume to continue")
    r = run_cli(args + ["--resume", "--json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["solver_path"]["passes_resumed"] >= seen - 1 >= 11
    r = run_cli(["fit", "d.zarr", "--out", "ref", *STREAM, *FIT, "--json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _comparable(rep) == _comparable(json.loads(r.stdout))
    a, b = zarr.open_group(str(tmp_path / "run" / "model.zarr")), zarr.open_group(str(tmp_path / "ref" / "model.zarr"))
    assert np.array_equal(a["coef"][...], b["coef"][...])
