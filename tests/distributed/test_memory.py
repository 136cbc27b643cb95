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
    assert e32["gram_bytes"] == 8 * 16_896**2 and e32["solver_bytes"] > 2 * e32["gram_bytes"]
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
