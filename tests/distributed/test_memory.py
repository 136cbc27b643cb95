"""The memory estimate of a fit (DESIGN §4): Gram and solver bytes per path, sizes parsed, and a fit refused
with the size of machine it needs before anything is built or written."""
import pytest

from scaleattn.distributed.memory import InsufficientMemoryError, check_fit_memory, fit_memory, parse_bytes


def test_memory_estimate_and_refusal():
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("2e9") == 2e9 and parse_bytes(5) == 5
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")
    e32 = fit_memory(32, 32)
    assert e32["psi"] == 16_896 and e32["path"] == "cholesky"
    # one psi x psi array past 4,096 features (G factored in place), two up to it (the shared G and a copy)
    assert e32["gram_bytes"] == 8 * 16_896**2 and e32["gram_bytes"] < e32["solver_bytes"] < 2 * e32["gram_bytes"]
    assert e32["gram_arrays"] == 1 and fit_memory(16, 16)["gram_arrays"] == 2
    assert fit_memory(32, 32, solver="eigh")["solver_bytes"] > e32["solver_bytes"]
    assert fit_memory(16, 16)["solver_bytes"] < 1e9  # d = 16 fits anywhere
    # psi = 133,120 (d = 64): 142 GB per Gram; refused with the size of machine it needs
    with pytest.raises(InsufficientMemoryError, match=r"needs \d+\.\d GiB on the solver node.*has 24\.0 GiB"):
        check_fit_memory(64, 64, memory_limit="24GiB")
    with pytest.raises(MemoryError, match="at least"):
        check_fit_memory(32, 32, memory_limit=2**30)
    assert check_fit_memory(8, 8, memory_limit="1GiB")["available_bytes"] == 2**30


def test_fit_refuses_before_building(tmp_path, monkeypatch):
    from scaleattn.generate import generate_mhla
    from scaleattn.pipeline import fit

    ds = generate_mhla(str(tmp_path / "d.zarr"), d=4, samples=8, length=5)
    monkeypatch.setenv("SCALEATTN_MEMORY_LIMIT", "10kB")
    with pytest.raises(InsufficientMemoryError, match="GiB available"):
        fit(ds, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_worker_config_keeps_a_block_of_heap():
    """The embedded cluster's workers keep the heap of a block of features (the nanny's 64 KiB trim threshold
    gave every block's 5 MB arrays back to the OS, page-faulted again on the next block) and mmap the partials."""
    from scaleattn.distributed.memory import MMAP_THRESHOLD, TRIM_THRESHOLD, release_large_buffers, worker_config
    from scaleattn.statistics._container import BLOCK_BYTES

    cfg = worker_config()
    env = {k.rsplit(".", 1)[1]: int(v) for k, v in cfg.items() if ".pre-spawn-environ." in k}
    assert env == {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": TRIM_THRESHOLD}
    assert cfg["distributed.worker.profile.interval"] == "100ms"  # Dask's 10 ms sampling costs a worker ~9%
    # the cluster's own event-loop checks and memory polls, slower than Dask's 20 ms / 100 ms, but set
    assert cfg["distributed.admin.tick.interval"] == "500ms"
    assert cfg["distributed.worker.memory.monitor-interval"] == "500ms"
    assert 5e6 < MMAP_THRESHOLD < 10e6 and TRIM_THRESHOLD >= BLOCK_BYTES / 2 > 65536
    release_large_buffers()  # (a no-op without glibc; never raises)


@pytest.mark.slow
def test_embedded_workers_start_with_the_thresholds():
    """In a fresh process, as a user starts one (earlier clusters of this test session may leave the nanny's
    environment in ``os.environ``)."""
    import json
    import os
    import subprocess
    import sys

    from scaleattn.distributed.memory import MMAP_THRESHOLD, TRIM_THRESHOLD

    code = ("import json, os\nfrom scaleattn.distributed.cluster import connect\n"
            "if __name__ == '__main__':\n"
            "    with connect(workers=1, quiet=True) as c:\n"
            "        import dask\n"
            "        print(json.dumps(next(iter(c.run(lambda: {**{k: os.environ.get(k) for k in"
            " ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_')},"
            " 'profile': dask.config.get('distributed.worker.profile.interval'),"
            " 'tick': dask.config.get('distributed.admin.tick.interval')}).values()))))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
                   "profile": "100ms", "tick": "500ms"}
