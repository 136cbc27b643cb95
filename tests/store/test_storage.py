"""Storage: transient store errors retried, bad data failing at once; and object storage over the real S3
protocol: a moto server on 127.0.0.1, a dataset uploaded to it, `scaleattn fit / evaluate / certify` run as real
processes against s3:// (workers included), an interrupted fit resumed from its s3 checkpoint, and the results
compared bit for bit with a local-disk fit."""
import json
import urllib.request

import numpy as np
import pytest

from scaleattn.distributed.build import compute_statistics
from scaleattn.distributed.evaluate import evaluate
from scaleattn.linalg._solver import certify
from scaleattn.model import MHLAModel
from scaleattn.pipeline import fit
from scaleattn.statistics._container import Statistics
from tests.helpers import assert_same_stats, free_port, moto_s3, run_cli_process, s3_env

BUCKET = "scaleattn-test"


def _cli(args, **env):
    return run_cli_process(*args, rc=None, env=s3_env(**env))


@pytest.fixture(scope="module")
def s3(tmp_path_factory, causal_groups_ds):
    """A moto S3 server with one bucket holding a dataset uploaded from local disk, and the local-disk fit."""
    with moto_s3(BUCKET) as (endpoint, opts, fs):
        tmp = tmp_path_factory.mktemp("s3")
        ds = causal_groups_ds
        fs.put(ds.url, f"{BUCKET}/d.zarr", recursive=True)  # the same bytes on both sides
        local = fit(ds, str(tmp / "run"), plots=False)  # in-process, no Dask: same reduction tree, same bits
        yield {"endpoint": endpoint, "opts": opts, "fs": fs, "local": local, "local_ds": ds, "tmp": tmp}


def _url(path: str) -> str:
    return f"s3://{BUCKET}/{path}"


def _same_run(s3, run_url: str, local):
    """Statistics and model written under ``run_url`` equal the local fit's bit for bit."""
    assert_same_stats(Statistics.load(run_url + "/stats.zarr", s3["opts"]), local.statistics)
    m = MHLAModel.load(run_url + "/model.zarr", s3["opts"])
    for name in ("coef", "V", "Q"):
        assert np.array_equal(getattr(m, name), getattr(local.model, name)), name


@pytest.mark.slow
def test_fit_from_s3_to_s3_on_workers_is_bit_identical_to_local(s3):
    # the endpoint comes only from --storage-option: the 2 worker processes must receive it to read anything
    r = _cli(["fit", _url("d.zarr"), "--out", _url("run1"), "--storage-option", f"endpoint_url={s3['endpoint']}",
              "--workers", "2", "--json"])
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    _same_run(s3, _url("run1"), s3["local"])
    fs = s3["fs"]
    with fs.open(f"{BUCKET}/run1/report.json") as f:
        assert json.load(f)["lambda_min"] == report["lambda_min"] == s3["local"].report["lambda_min"]
    assert report["train_mse"] < 1e-25 and report["identifiable"]  # realizable data, DESIGN §9
    assert report["dataset"] == _url("d.zarr")
    names = set(fs.ls(f"{BUCKET}/run1", detail=False))
    assert {f"{BUCKET}/run1/{n}" for n in ("report.json", "model.zarr", "stats.zarr", "spectrum.png")} <= names
    assert not fs.exists(f"{BUCKET}/run1.checkpoint.zarr")  # removed after success


@pytest.mark.slow
def test_evaluate_and_certify_from_s3_with_the_endpoint_from_the_environment(s3):
    # AWS_ENDPOINT_URL alone (botocore >= 1.31 reads it; workers inherit the environment of the embedded cluster)
    local = s3["local"]
    local.model.save(str(s3["tmp"] / "model.zarr"))
    s3["fs"].put(str(s3["tmp"] / "model.zarr"), f"{BUCKET}/model.zarr", recursive=True)
    r = _cli(["evaluate", _url("model.zarr"), _url("d.zarr"), "--workers", "1", "--json"],
             AWS_ENDPOINT_URL=s3["endpoint"])
    assert r.returncode == 0, r.stderr
    ev, want = json.loads(r.stdout), evaluate(local.model, s3["local_ds"])
    assert ev["n_rows"] == want["n_rows"] == 640
    assert ev["target_mean_square"] == pytest.approx(want["target_mean_square"], rel=1e-14)
    assert ev["mse"] == pytest.approx(want["mse"], rel=1e-6, abs=1e-32)
    r = _cli(["certify", _url("d.zarr"), "--local", "--json"], AWS_ENDPOINT_URL_S3=s3["endpoint"])
    assert r.returncode == 0, r.stderr
    cert, want = json.loads(r.stdout), certify(compute_statistics(s3["local_ds"], targets=False)).summary()
    keys = ("lambda_min", "lambda_max", "rank")
    assert [cert[k] for k in keys] == [want[k] for k in keys]
    assert cert["identifiable"] is True


@pytest.mark.slow
def test_interrupted_s3_fit_resumes_from_its_s3_checkpoint_bit_identical(s3):
    args = ["fit", _url("d.zarr"), "--out", _url("run2"), "--storage-option", f"endpoint_url={s3['endpoint']}",
            "--no-plots", "--quiet"]
    # the client dies after 3 of 16 groups, as a crash would (its workers die with it; slow tasks leave work undone)
    r = _cli(args + ["--workers", "1"], SCALEATTN_TEST_STOP_AFTER_GROUPS="3", SCALEATTN_TEST_TASK_DELAY="0.3")
    assert r.returncode == 75, r.stderr
    fs = s3["fs"]
    assert not fs.exists(f"{BUCKET}/run2") and fs.exists(f"{BUCKET}/run2.checkpoint.zarr")
    import zarr

    done = zarr.open_group(_url("run2.checkpoint.zarr"), mode="r", storage_options=s3["opts"])["done"][...]
    n_done = int(done.all(axis=1).sum())
    assert 3 <= n_done < 16  # the workers wrote their partials to s3 before the client died
    r = _cli(args + ["--local"])
    assert r.returncode == 2 and "--resume" in r.stderr
    r = _cli(args + ["--workers", "1", "--resume", "--json"])  # a new cluster picks up the s3 checkpoint
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["groups"], report["groups_resumed"], report["groups_computed"]) == (16, n_done, 16 - n_done)
    assert not fs.exists(f"{BUCKET}/run2.checkpoint.zarr")
    _same_run(s3, _url("run2"), s3["local"])


def _set_moto_auth(endpoint: str, count: str) -> None:
    """Turn moto's IAM authentication on ("0": unknown access keys are refused) or off ("inf")."""
    req = urllib.request.Request(endpoint + "/moto-api/reset-auth", data=count.encode(), method="POST",
                                 headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


def _assert_clear_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and all(w in r.stderr for w in words), r.stderr


@pytest.mark.slow
def test_bad_endpoint_bucket_and_credentials_exit_2_with_a_clear_message(s3):
    ep = f"endpoint_url={s3['endpoint']}"
    r = _cli(["certify", _url("d.zarr"), "--local", "--storage-option", f"endpoint_url=http://127.0.0.1:{free_port()}"],
             AWS_MAX_ATTEMPTS="1")  # nothing listens there; one attempt instead of botocore's retries
    _assert_clear_error(r, "cannot access the object store", "EndpointConnectionError", "endpoint_url")
    r = _cli(["fit", "s3://no-such-bucket/d.zarr", "--out", _url("x"), "--local", "--storage-option", ep])
    _assert_clear_error(r, "no such dataset")
    r = _cli(["certify", _url("d.zarr"), "--local", "--storage-option", ep], AWS_ACCESS_KEY_ID="",
             AWS_SECRET_ACCESS_KEY="")
    _assert_clear_error(r, "cannot access the object store", "NoCredentialsError", "AWS_ACCESS_KEY_ID")
    _set_moto_auth(s3["endpoint"], "0")  # from now on moto checks keys against its (empty) IAM: ours are unknown
    try:
        r = _cli(["fit", _url("d.zarr"), "--out", _url("x"), "--local", "--storage-option", ep])
    finally:
        _set_moto_auth(s3["endpoint"], "inf")
    _assert_clear_error(r, "cannot access the object store", "Forbidden", "AWS_SECRET_ACCESS_KEY")
    assert not s3["fs"].exists(f"{BUCKET}/x")


def test_a_storage_option_its_file_system_does_not_take_is_a_parameter_error(cli):
    """s3fs takes any keyword and passes it on to botocore's session at its first use: a misspelled option was a
    TypeError there, an internal error of the CLI. Nothing is reached: the session is made before any request."""
    from scaleattn.errors import ParameterError
    from scaleattn.store._location import exists

    with pytest.raises(ParameterError, match=r"s3://bucket/d\.zarr: the storage option 'connect_timeot' is not one"
                                             r" its file system takes \(TypeError: .*connect_timeot"):
        exists("s3://bucket/d.zarr", {"connect_timeot": 1})
    r = cli("certify", "s3://bucket/d.zarr", "--local", "--storage-option", "connect_timeot=1", rc=2)
    assert r.stderr.count("\n") == 1 and "the storage option 'connect_timeot' is not one" in r.stderr, r.stderr


def test_store_hiccups_are_retried_bad_data_fails_once():
    """Tasks retry transient store errors themselves (Dask retries are off), so bad data fails at once."""
    from scaleattn.data._dataset import DatasetError
    from scaleattn.store._location import StorageError, transient, with_retries

    calls = []

    def flaky(fail_times, exc):
        calls.append(1)
        if len(calls) <= fail_times:
            raise exc
        return "ok"

    assert with_retries(flaky, 2, ConnectionError("reset"), delay=0) == "ok" and len(calls) == 3
    for exc in (DatasetError("tokens: sample 3 contains NaN"), FileNotFoundError("x"), PermissionError("no"),
                StorageError("refused"), ValueError("bad")):
        calls.clear()
        with pytest.raises(type(exc)):
            with_retries(flaky, 5, exc, delay=0)
        assert len(calls) == 1, exc
        assert not transient(exc)
    calls.clear()
    with pytest.raises(TimeoutError):
        with_retries(flaky, 5, TimeoutError("slow"), attempts=3, delay=0)
    assert len(calls) == 3
