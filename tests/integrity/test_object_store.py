"""The integrity rules on an object store (issue 14, classes 1, 2, 4, 5): a real S3 server (moto on
127.0.0.1), the CLI as a subprocess. Outputs are compared with inputs by prefix, absent chunk objects are
found by listing, locks are objects created exclusively."""
from __future__ import annotations

import json

import pytest

from tests.helpers import moto_s3, s3_env  # moto_s3 skips without s3fs / moto: not imported at collection

from .conftest import FIT, dataset, error_line, expect, run_cli, same_stats

pytestmark = pytest.mark.slow
BUCKET = "integrity"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_s3(BUCKET) as (endpoint, opts, fs):
        tmp = tmp_path_factory.mktemp("s3")
        dataset(tmp / "d.zarr")
        fs.put(str(tmp / "d.zarr"), f"{BUCKET}/d.zarr", recursive=True)
        yield {"fs": fs, "opts": opts, "tmp": tmp, "env": s3_env(AWS_ENDPOINT_URL=endpoint)}


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
    from scaleattn.statistics._container import Statistics

    local = s3["tmp"] / "local"
    assert run_cli(["fit", str(s3["tmp"] / "d.zarr"), "--out", local, *FIT]).returncode == 0
    same_stats(Statistics.load(f"s3://{BUCKET}/run/stats.zarr", s3["opts"]), Statistics.load(str(local / "stats.zarr")))


def test_a_chunk_object_rewritten_after_opening_is_refused_with_the_listing_cache_on(s3, tmp_path):
    """A store of another tool on S3 opened with ordinary options (s3fs keeps the listing it took at opening):
    the check after each read must ask the server, not that listing, so a chunk object rewritten by another
    client (same size, new ETag) is one error naming the samples, in process and in a fresh handle's reads."""
    import numpy as np

    from scaleattn.data._dataset import open_dataset
    from scaleattn.errors import IntegrityError

    from .conftest import foreign, rows

    fs = s3["fs"]
    tok, y = rows(seed=1)
    foreign(tmp_path / "f.zarr", tok, y, compressors=None)
    foreign(tmp_path / "g.zarr", *rows(seed=2), compressors=None)
    fs.put(str(tmp_path / "f.zarr"), f"{BUCKET}/f.zarr", recursive=True)
    opts = {k: v for k, v in s3["opts"].items() if k not in ("skip_instance_cache", "use_listings_cache")}
    ds = open_dataset(f"s3://{BUCKET}/f.zarr", opts)
    np.testing.assert_array_equal(ds.read(0, 32)[0], tok)
    fs.put(str(tmp_path / "g.zarr" / "tokens/c/1/0/0"), f"{BUCKET}/f.zarr/tokens/c/1/0/0")
    with pytest.raises(IntegrityError, match=r"tokens: the stored chunks of samples \[8, 16\) of s3://integrity/f\.zarr"
                                             r" differ from those checked"):
        ds.read(8, 16)
    np.testing.assert_array_equal(ds.read(16, 32)[0], tok[16:])
