"""Options that cross layers arrive where they are used, and parameters are checked once at the public entry,
before any work: each test is a bug the old threading of options caused (the memory check ignored --solver,
certify had no memory check, plots and baselines dropped storage options, an unknown device ran on CPU, combine
tasks carried Dask retries, the Gram was expanded several times per fit, the report chose its loss by array
identity)."""
import numpy as np
import pytest

import scaleattn
from scaleattn.cli import main
from scaleattn.distributed.build import compute_statistics
from scaleattn.distributed.memory import fit_memory
from scaleattn.errors import InsufficientMemoryError, ParameterError
from scaleattn.generate import generate_mhla


@pytest.fixture(scope="module")
def d16(tmp_path_factory):
    """d = 16 (psi = 2,176): the eigh path needs ~5 psi^2 doubles, the Cholesky path ~2."""
    return generate_mhla(str(tmp_path_factory.mktemp("d16") / "d.zarr"), d=16, heads=1, length=4, samples=700,
                         d_out=1, causal=True, seed=0)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return generate_mhla(str(tmp_path_factory.mktemp("small") / "d.zarr"), d=3, heads=2, length=8, samples=64,
                         causal=True, seed=1, chunk_samples=16)


def _between(ds):
    """A memory limit between what an in-process fit needs on the Cholesky path (solver, a task's features and
    one chunk) and what the eigh path's solver alone needs."""
    from scaleattn.distributed.memory import chunk_bytes

    chol, eigh = (fit_memory(ds.d, ds.d_out, solver=s) for s in ("cholesky", "eigh"))
    lo = chol["solver_bytes"] + chol["worker_bytes"] + chunk_bytes(ds)
    assert lo < eigh["solver_bytes"]
    return str(int((lo + eigh["solver_bytes"]) / 2))


@pytest.mark.slow
def test_memory_check_follows_the_solver_for_fit_and_certify(d16, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SCALEATTN_MEMORY_LIMIT", _between(d16))
    assert main(["fit", d16.url, "--out", str(tmp_path / "e"), "--local", "--solver", "eigh", "--no-plots"]) == 2
    assert "eigh solver" in capsys.readouterr().err and not (tmp_path / "e").exists()
    assert main(["certify", d16.url, "--local", "--solver", "eigh"]) == 2
    assert "a certificate with d = 16" in capsys.readouterr().err
    rc = main(["fit", d16.url, "--out", str(tmp_path / "c"), "--local", "--solver", "cholesky", "--no-plots", "--json"])
    assert rc == 0 and (tmp_path / "c" / "report.json").exists()


def _spy(seen, small):
    def spy(url, storage_options=None):
        seen.append((url, storage_options))
        return small
    return spy


OPTS = {"client_kwargs": {"endpoint_url": "http://example:9000"}}


def test_plots_keep_storage_options(small, monkeypatch):
    """The dataset path and its storage options reach ``open_dataset`` (they used to be dropped)."""
    from scaleattn import plot

    seen = []
    monkeypatch.setattr(plot, "open_dataset", _spy(seen, small))
    res = scaleattn.fit(small, heads="svd")
    y, yhat = plot.sample_predictions(res.model, "s3://bucket/d.zarr", storage_options=OPTS)
    assert seen[-1] == ("s3://bucket/d.zarr", OPTS) and y.shape == yhat.shape


def test_baselines_keep_storage_options(small, monkeypatch):
    """As for the plots, in the baselines' loader (the baselines need PyTorch: skipped without it)."""
    pytest.importorskip("torch")
    from scaleattn.baselines import training

    seen = []
    monkeypatch.setattr(training, "open_dataset", _spy(seen, small))
    arrays = training.load_arrays("s3://bucket/d.zarr", storage_options=OPTS)
    assert seen[-1] == ("s3://bucket/d.zarr", OPTS) and arrays["tokens"].shape == (64, 8, 3)


@pytest.mark.parametrize("call", [
    lambda ds: compute_statistics(ds, device="cuda"),
    lambda ds: scaleattn.fit(ds, device="GPU"),
    lambda ds: scaleattn.certify_dataset(ds, device="tpu"),
])
def test_unknown_device_is_refused_not_run_on_cpu(small, call):
    with pytest.raises(ParameterError, match="device must be one of 'auto', 'cpu', 'gpu'"):
        call(small)


@pytest.mark.parametrize("kwargs,match", [
    ({"ridge": -1.0}, r"ridge must be in \[0, 1e\+12\]"), ({"ridge": float("nan")}, "ridge must be finite"),
    ({"cutoff_rtol": 0.0}, r"cutoff_rtol must be in \(0, 1\)"), ({"cutoff_rtol": 1.5}, r"cutoff_rtol must be in"),
    ({"solver": "lu"}, "solver must be one of"), ({"heads": 0}, "heads must be >= 1"),
    ({"heads": "many"}, "heads must be 'svd', 'minimal'"),
    ({"heads_budget": 1e308}, r"heads_budget must be in \(0, 2\.592e\+06\]"),
])
def test_fit_parameters_checked_before_any_work(small, tmp_path, kwargs, match):
    with pytest.raises(ParameterError, match=match):
        scaleattn.fit(small, tmp_path / "run", **kwargs)
    assert not any(tmp_path.iterdir())  # no run directory, no checkpoint


@pytest.mark.parametrize("kwargs", [{"scheduler_timeout": 1e308}, {"worker_timeout": -1.0},
                                    {"scheduler_timeout": float("nan")}])
def test_connect_refuses_durations_out_of_range_before_connecting(kwargs):
    """They were handed on to Dask's, asyncio's and the OS's timers unchecked."""
    with pytest.raises(ParameterError, match=f"{next(iter(kwargs))} must be"):
        with scaleattn.connect("tcp://127.0.0.1:9", quiet=True, **kwargs):
            pass


def test_the_unreleased_names_are_gone(small):
    """rtol= and method= were names of an unreleased API: refused like any unknown keyword, nothing built."""
    new = scaleattn.fit(small, cutoff_rtol=1e-10)
    assert new.report["cutoff_rtol"] == 1e-10
    for call in (lambda: scaleattn.fit(small, rtol=1e-10), lambda: scaleattn.certify_dataset(small, rtol=1e-10),
                 lambda: scaleattn.solve(new.statistics, rtol=1e-10),
                 lambda: scaleattn.certify(new.statistics, method="eigh")):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            call()
    assert "rtol" not in scaleattn.MHLARegressor().get_params()
    with pytest.raises(TypeError):
        scaleattn.MHLARegressor(rtol=1e-10)


@pytest.mark.slow
def test_combine_tasks_have_no_dask_retries(small, client, monkeypatch):
    calls = []
    real = client.submit

    def spy(func, *args, **kwargs):
        calls.append((getattr(func, "__name__", str(func)), kwargs.get("retries")))
        return real(func, *args, **kwargs)

    monkeypatch.setattr(client, "submit", spy)
    st = compute_statistics(small, client)
    ref = compute_statistics(small)
    assert np.array_equal(st.gram_compact, ref.gram_compact)
    names = [n for n, _ in calls]
    assert "_add_all" in names and "_partial" in names
    assert all(r is None for _, r in calls), calls  # leaves retry their own store reads; sums never retry


def test_gram_is_expanded_once_per_fit(tmp_path, monkeypatch):
    from scaleattn.statistics import _container as statistics

    # not identifiable (fewer rows than features): the solve, the minimal-head search and the witness all need G
    ds = generate_mhla(str(tmp_path / "d.zarr"), d=3, heads=1, length=1, samples=10, seed=2)
    count = [0]
    real = statistics.expand_gram

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(statistics, "expand_gram", counting)
    res = scaleattn.fit(ds, heads="minimal", exact_mse=False)
    assert not res.certificate.identifiable and "witness" in res.report
    assert count[0] == 1


def test_report_loss_is_the_saved_models(tmp_path):
    """heads=1 on a 2-head teacher: the saved model is the lossy 1-head model and the report says its loss."""
    ds = generate_mhla(str(tmp_path / "d.zarr"), d=3, heads=2, length=10, samples=128, causal=True, seed=3)
    lossy = scaleattn.fit(ds, heads=1).report
    exact = scaleattn.fit(ds, heads="minimal").report
    assert lossy["n_heads"] == 1 and lossy["heads_residual"] > 1e-6
    assert lossy["train_mse_stats"] == lossy["heads_train_mse_stats"] > 1e3 * lossy["lstsq_train_mse_stats"]
    assert lossy["train_mse"] == pytest.approx(lossy["train_mse_stats"], rel=1e-6)  # the data pass agrees
    assert exact["train_mse_stats"] == exact["lstsq_train_mse_stats"]


def test_cli_maps_our_errors_to_2_and_bugs_to_1(small, monkeypatch, capsys):
    import scaleattn.pipeline as pipeline

    assert main(["fit", small.url, "--out", "/nonexistent-dir/x", "--local", "--ridge", "-1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1

    def broken(*a, **k):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(pipeline, "solve_validated", broken)  # a bug inside the fit (the solve step)
    assert main(["fit", small.url, "--out", str(small.url) + "-run", "--local", "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "internal error (this is a bug" in err and "ZeroDivisionError" in err and "Traceback" not in err


def test_insufficient_memory_is_ours():
    from scaleattn.distributed.memory import check_fit_memory

    with pytest.raises(InsufficientMemoryError) as e:
        check_fit_memory(64, 1, memory_limit="1GiB")
    assert isinstance(e.value, scaleattn.ScaleattnError) and isinstance(e.value, MemoryError)
