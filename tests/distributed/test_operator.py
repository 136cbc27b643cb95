"""The cluster-side Gram operator (scaleattn.distributed.operator): tiles of Tc persisted on the workers that built
them, products as one task per worker plus a tree sum, O(psi k) bytes per worker per product; a krylov fit whose
client may not hold Tc succeeds, the dense path is refused."""
from __future__ import annotations

import time

import numpy as np
import pytest

from scaleattn.distributed.build import compute_statistics
from scaleattn.distributed.memory import fit_memory
from scaleattn.distributed.operator import DistributedGramOperator, RemoteStatistics, remote_statistics
from scaleattn.errors import InsufficientMemoryError, ParameterError
from scaleattn.generate import generate_mhla
from scaleattn.linalg._krylov import krylov_solve
from scaleattn.linalg._spectrum import default_rtol


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
def test_operator_on_workers_matches_the_dense_product(client, tmp_path):
    ds = generate_mhla(tmp_path / "d.zarr", d=6, heads=2, length=12, samples=80, causal=True, seed=0)
    st = compute_statistics(ds)
    rs = remote_statistics(ds, client)
    op = rs.operator
    assert isinstance(rs, RemoteStatistics) and isinstance(op, DistributedGramOperator)
    # every tile on one holder; which workers hold them is Dask's choice (a busy worker may hold none)
    n = len(op.by_worker)
    assert len(op.tiles) >= 4 and 1 <= n <= 2 and sum(len(ts) for ts in op.by_worker.values()) == len(op.tiles)
    assert np.array_equal(rs.moments, st.moments) and rs.n_rows == st.n_rows and rs.yy == st.yy
    X = np.random.default_rng(0).standard_normal((st.psi, 3))
    assert rel(op @ X, st.gram() @ X) <= 1e-13
    assert rel(op.diagonal(), np.diag(st.gram())) <= 1e-15
    t = op.traffic[-1]
    assert t["workers"] == n and t["bytes_out"] == n * 8 * st.psi * 3  # psi x k per worker, never a tile
    with pytest.raises(ParameterError, match="held on the workers"):
        rs.gram()
    # K-FAC's factors (the partial traces of S G S): one small partial per worker, tree-summed; the einsum of G
    dg = np.diag(st.gram())
    s = 1 / np.sqrt(dg)
    G4 = (st.gram() * s[:, None] * s[None, :]).reshape(21, 6, 21, 6)
    A, B = op.partial_traces(s)
    assert rel(A, np.einsum("plql->pq", G4)) <= 1e-13 and rel(B, np.einsum("plpk->lk", G4)) <= 1e-13
    A0, B0 = op.partial_traces()
    G4 = st.gram().reshape(21, 6, 21, 6)
    assert rel(A0, np.einsum("plql->pq", G4)) <= 1e-13 and rel(B0, np.einsum("plpk->lk", G4)) <= 1e-13
    sol = krylov_solve(op, st.moments, rtol=default_rtol(st.psi), preconditioner="kfac")
    assert sol.preconditioner == "kfac"
    assert rel(sol.coef, np.linalg.lstsq(st.gram(), st.moments, rcond=None)[0]) <= 1e-9
    keys = {f.key for _, f in op.tiles}
    rs.release()  # what a fit does as it ends: the workers' memory is freed
    deadline = time.monotonic() + 10
    while keys & set(client.who_has()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not keys & set(client.who_has()), "tiles still held on the workers after release()"
    with pytest.raises(ParameterError, match="released"):
        op @ X


@pytest.mark.slow
def test_cluster_krylov_fit_with_less_client_memory_than_tc(client, tmp_path, monkeypatch):
    """Issue's done-criterion: the client's memory limit is below the size of Tc; krylov on the 2-worker
    cluster fits (Tc stays on the workers), the dense path is refused before the build."""
    from scaleattn.pipeline import fit

    d = 24  # (the smallest d whose client-side krylov vectors take less than Tc)
    e = fit_memory(d, 1, remote=True)
    tc, need = e["compact_bytes"], e["paths"]["krylov"]
    assert need < tc < e["paths"]["cholesky"]
    monkeypatch.setenv("SCALEATTN_MEMORY_LIMIT", str(int((need + tc) / 2)))
    ds = generate_mhla(tmp_path / "d.zarr", d=d, heads=2, length=100, samples=120, causal=True, d_out=1, seed=0)
    with pytest.raises(InsufficientMemoryError, match="cholesky solver"):
        fit(ds, client=client, solver="cholesky", plots=False, exact_mse=False)
    with pytest.raises(ParameterError, match="`heads='svd'`"):  # the loss-weighted head fits need the dense G
        fit(ds, client=client, solver="krylov", heads="minimal", plots=False)
    # (auto would stream here: the cost model predicts the passes over the tokens ~5x cheaper than the Tc krylov)
    res = fit(ds, client=client, solver="krylov", plots=False)
    r = res.report
    assert isinstance(res.statistics, RemoteStatistics) and not res.statistics.operator.tiles  # released
    assert r["estimates"]["solver"] == "krylov" and 1 <= r["estimates"]["traffic"]["workers"] <= 2
    assert r["identifiable"] and r["rank"] == res.statistics.psi and r["relative_train_mse"] <= 1e-20
    per_pass = r["estimates"]["traffic"]["bytes_out_per_pass"] + r["estimates"]["traffic"]["bytes_back_per_pass"]
    assert per_pass <= 4 * 8 * res.statistics.psi * 10 < tc  # O(psi k) per worker, far below Tc
