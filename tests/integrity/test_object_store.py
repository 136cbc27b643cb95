"""The integrity rules on an object store (issue 14, classes 1, 2, 4, 5): a real S3 server (moto on
127.0.0.1), the CLI as a subprocess. Outputs are compared with inputs by prefix, absent chunk objects are
found by listing, locks are objects created exclusively."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from .conftest import FIT, dataset, error_line, expect, run_cli, same_stats  # noqa: E402

pytestmark = pytest.mark.slow
BUCKET, KEY, SECRET = "integrity", "testing-key", "testing-secret"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
        opts = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint},
                "skip_instance_cache": True, "use_listings_cache": False}
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir(BUCKET)
        tmp = tmp_path_factory.mktemp("s3")
        dataset(tmp / "d.zarr")
        fs.put(str(tmp / "d.zarr"), f"{BUCKET}/d.zarr", recursive=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1",
                   AWS_ENDPOINT_URL=endpoint, AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
                   NO_PROXY="127.0.0.1,localhost")
        yield {"fs": fs, "opts": opts, "tmp": tmp, "env": env}
    finally:
        server.stop()


def _objects(fs, prefix):
    return {p: fs.info(p).get("ETag") for p in fs.find(f"{BUCKET}/{prefix}")}


def test_outputs_inside_or_over_an_s3_dataset_are_refused(s3):
    fs = s3["fs"]
    before = _objects(fs, "d.zarr")
    for out, how in ((f"s3://{BUCKET}/d.zarr", "is"), (f"s3://{BUCKET}/d.zarr/", "is"),
                     (f"s3://{BUCKET}/x/../d.zarr", "is"), (f"s3://{BUCKET}/d.zarr/run", "lies inside"),
                     (f"s3://{BUCKET}", "contains")):
        r = run_cli(["fit", f"s3://{BUCKET}/d.zarr", "--out", out, "--overwrite", *FIT], env=s3["env"], cwd=s3["tmp"])
        assert r.returncode == 2, r.stderr
        expect(error_line(r.stderr), rf"--out s3://{BUCKET}\S* {how} the input dataset s3://{BUCKET}/d\.zarr")
    assert _objects(fs, "d.zarr") == before


def test_an_absent_chunk_object_is_refused_and_a_run_holds_its_s3_lock(s3):
    fs = s3["fs"]
    fs.copy(f"{BUCKET}/d.zarr", f"{BUCKET}/gap.zarr", recursive=True)
    fs.rm(f"{BUCKET}/gap.zarr/tokens/c/1/0/0")
    r = run_cli(["fit", f"s3://{BUCKET}/gap.zarr", "--out", f"s3://{BUCKET}/run", *FIT], env=s3["env"])
    assert r.returncode == 2
    expect(error_line(r.stderr), r"tokens: chunks of samples \[8, 16\) .* are missing from s3://")
    assert not fs.exists(f"{BUCKET}/run") and not fs.exists(f"{BUCKET}/run.checkpoint.zarr")
    fs.pipe(f"{BUCKET}/.run.lock", json.dumps({"host": "elsewhere", "pid": 7, "started": 0, "locked_at": 0}).encode())
    r = run_cli(["fit", f"s3://{BUCKET}/d.zarr", "--out", f"s3://{BUCKET}/run", *FIT], env=s3["env"])
    assert r.returncode == 2
    expect(error_line(r.stderr), rf"--out s3://{BUCKET}/run is in use by the scaleattn run of pid 7 on host"
                                 rf" elsewhere.*remove s3://{BUCKET}/\.run\.lock")
    fs.rm(f"{BUCKET}/.run.lock")
    r = run_cli(["fit", f"s3://{BUCKET}/d.zarr", "--out", f"s3://{BUCKET}/run", *FIT], env=s3["env"])
    assert r.returncode == 0, r.stderr
    assert not fs.exists(f"{BUCKET}/.run.lock")
    from scaleattn.statistics import Statistics

    local = s3["tmp"] / "local"
    assert run_cli(["fit", str(s3["tmp"] / "d.zarr"), "--out", local, *FIT]).returncode == 0
    same_stats(Statistics.load(f"s3://{BUCKET}/run/stats.zarr", s3["opts"]), Statistics.load(str(local / "stats.zarr")))
