"""The main job against DESIGN §9 reference values and independent computations: realizable fits at the float64
floor, certify without targets, the run directory and evaluation."""
import numpy as np
import pytest

import scaleattn
from scaleattn.data._writer import write_dataset
from scaleattn.distributed.evaluate import evaluate
from scaleattn.generate import generate_mhla, make_assoc, make_mhla
from scaleattn.heads._algebra import coef_from_heads
from scaleattn.model import MHLAModel
from scaleattn.pipeline import fit
from scaleattn.statistics._container import statistics_from_arrays


@pytest.mark.parametrize("d,N", [(2, 512), pytest.param(4, 2048, marks=pytest.mark.slow)])
def test_realizable_fit_reaches_float64_floor(rel_mse, tmp_path, d, N):
    ds = generate_mhla(tmp_path / "train.zarr", d=d, heads=1, length=100, samples=N, causal=True, seed=0)
    res = fit(ds)
    V, Q = ds.teacher()
    tok, _, y = ds.read(0, N)
    # independent check: predictions of the fitted HEADS vs the stored targets
    assert rel_mse(res.model.predict(tok, use_heads=True), y) <= 1e-20
    assert res.report["relative_train_mse"] <= 1e-20
    assert res.report["identifiable"] and res.report["rank"] == res.report["psi"]
    assert np.linalg.norm(res.model.coef - coef_from_heads(V, Q)) <= 1e-8
    fresh = make_mhla(d=d, heads=1, length=100, samples=64, causal=True, teacher=(V, Q), seed=99)
    assert rel_mse(res.model.predict(fresh["tokens"]), fresh["targets"]) <= 1e-20


def test_certify_dataset_needs_no_targets(tmp_path):
    D = make_assoc(2, 4096, seed=1)
    ds = write_dataset(tmp_path / "tok.zarr", D["tokens"])
    assert not ds.has_targets
    cert = scaleattn.certify_dataset(ds)
    direct = scaleattn.certify(statistics_from_arrays(D["tokens"]))
    assert cert.lambda_min == pytest.approx(direct.lambda_min, rel=1e-10)


@pytest.mark.slow
def test_fit_writes_run_and_evaluates(tmp_path, client):
    ds = generate_mhla(tmp_path / "d.zarr", d=2, heads=2, length=30, samples=200, noise=0.01, seed=1)
    res = fit(ds, tmp_path / "run", client=client)
    import json

    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    for key in ["n_rows", "d", "d_out", "psi", "rank", "lambda_min", "lambda_max", "identifiable", "train_mse",
                "target_mean_square", "n_heads", "seconds"]:
        assert key in rep
    m = MHLAModel.load(tmp_path / "run" / "model.zarr")
    assert np.array_equal(m.coef, res.model.coef) and m.V.shape == (rep["n_heads"], 2, 2)
    tok, _, y = ds.read(0, ds.n_samples)
    r = y - m.predict(tok)
    ev = evaluate(m, ds, client)
    assert ev["mse"] == pytest.approx(float((r * r).mean()), rel=1e-10)
    assert ev["mse"] > 0  # noisy data
    st = scaleattn.Statistics.load(tmp_path / "run" / "stats.zarr")
    assert st.n_rows == 200 and np.array_equal(st.gram_compact, res.statistics.gram_compact)
    with pytest.raises(FileExistsError):
        fit(ds, tmp_path / "run")



def _failed_solve(tmp_path, monkeypatch, capsys):
    """A CLI fit whose solve fails (injected: the fit's solve raises): (dataset, its stderr, the rerun command)."""
    from scaleattn.cli import main

    ds = generate_mhla(tmp_path / "d.zarr", d=2, heads=1, length=8, samples=24, causal=True, chunk_samples=8)
    monkeypatch.setattr("scaleattn.pipeline.SAY_KEPT_PSI", 0)  # said for large solves only: d = 2 here
    capsys.readouterr()

    def fails(*args, **kwargs):
        raise RuntimeError("injected solver failure")

    with monkeypatch.context() as m:
        m.setattr("scaleattn.pipeline.solve_validated", fails)
        assert main(["fit", ds.url, "--out", str(tmp_path / "run"), "--local", "--no-plots"]) == 1  # a bug's code
    err = capsys.readouterr().err
    return ds, err, err.rsplit("`", 2)[-2]  # the error line's hint: `scaleattn fit ... --resume`


def test_failed_solve_keeps_the_build_and_names_the_rerun_command(tmp_path, monkeypatch, capsys):
    """The finished build stays in the checkpoint; the fit says where before the solve starts (all a native crash
    leaves), and the error names the command that solves again."""
    import shlex

    _, err, command = _failed_solve(tmp_path, monkeypatch, capsys)
    ckpt = f"{tmp_path / 'run'}.checkpoint.zarr"
    assert "injected solver failure" in err and not (tmp_path / "run").exists()
    assert f"statistics of all 16 row groups are kept in {ckpt}" in err.splitlines()[-2]  # before the solve started
    assert shlex.split(command) == ["scaleattn", "fit", str(tmp_path / "d.zarr"), "--out", str(tmp_path / "run"),
                                    "--resume"]
    assert "keeps all row groups" in err.splitlines()[-1] and command in err.splitlines()[-1]
    assert (tmp_path / "run.checkpoint.zarr").exists()


@pytest.mark.slow
def test_rerun_command_of_a_failed_solve_recomputes_no_row_group(tmp_path, monkeypatch, capsys):
    """The rerun (``--resume`` after a complete build) takes every row group from the checkpoint and gives the
    fit of a clean run."""
    import json
    import shlex

    from scaleattn.cli import main

    ds, _, command = _failed_solve(tmp_path, monkeypatch, capsys)
    assert main([*shlex.split(command)[1:], "--local", "--no-plots", "--json"]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert (resumed["groups_computed"], resumed["groups_resumed"]) == (0, resumed["groups"]) and resumed["groups"] > 1
    assert not (tmp_path / "run.checkpoint.zarr").exists()  # removed once the fit is written
    clean = fit(ds, plots=False).report  # no checkpoint: built from scratch
    for k in ("lambda_min", "lambda_max", "rank", "train_mse", "lstsq_train_mse_stats", "n_rows"):
        assert resumed[k] == clean[k], k


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes need Python >= 3.11")
def test_an_interrupted_fit_in_python_shows_what_it_kept_in_its_traceback(causal_groups_ds, tmp_path):
    """Ctrl-C in a notebook cell (the kernel's stop button) during the build: the traceback said only
    ``KeyboardInterrupt`` (the kept checkpoint was a hint the CLI alone printed); it now ends with it as a note,
    and ``resume=True`` continues."""
    import contextlib
    import traceback

    from scaleattn.display._progress import Reporter

    class StopAfterOneGroup(Reporter):
        @contextlib.contextmanager
        def bar(self, name, total, *args, **kwargs):
            def advance(n=1, steps=0):
                if name == "statistics" and steps:
                    raise KeyboardInterrupt
            yield advance

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt) as info:
        fit(causal_groups_ds, out, progress=StopAfterOneGroup(), plots=False)
    shown = "".join(traceback.format_exception(info.value))
    assert "run.checkpoint.zarr keeps 1 of 16 row groups" in shown, shown
    res = fit(causal_groups_ds, out, resume=True, plots=False)
    assert res.report["groups_resumed"] == 1
