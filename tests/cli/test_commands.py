"""generate -> fit -> evaluate -> certify through real subprocesses and a real LocalCluster."""
import json
import subprocess
import sys

import numpy as np
import pytest

from scaleattn.cli import main


def run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "scaleattn.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}")
    return p


def test_generate_fit_evaluate_round_trip(tmp_path):
    data, fresh, out = tmp_path / "data.zarr", tmp_path / "fresh.zarr", tmp_path / "run1"
    run("generate", "mhla", data, "--d", 2, "--heads", 1, "--length", 100, "--samples", 512, "--causal", "--seed", 0)
    run("generate", "mhla", fresh, "--d", 2, "--heads", 1, "--length", 50, "--samples", 64, "--causal", "--seed", 0)
    p = run("fit", data, "--out", out, "--workers", 2)
    assert "certificate: IDENTIFIABLE" in p.stdout and "dashboard http://127.0.0.1" in p.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["n_rows"] == 51200 and rep["psi"] == 6 and rep["identifiable"] is True
    assert rep["train_mse"] / rep["target_mean_square"] <= 1e-20
    # same seed -> same teacher: the model is exact on a fresh dataset from it
    ev = json.loads(run("evaluate", out / "model.zarr", fresh, "--json", "--workers", 2).stdout)
    assert ev["relative_mse"] <= 1e-20 and ev["n_rows"] == 64 * 50
    cert = json.loads(run("certify", data, "--json", "--local").stdout)
    assert cert["identifiable"] and cert["lambda_min"] == pytest.approx(rep["lambda_min"], rel=1e-10)
    again = run("fit", data, "--out", out, "--local", check=False)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_version_and_help():
    assert run("--version").stdout.startswith("scaleattn ")
    for cmd in ("fit", "generate", "import", "certify", "evaluate", "bench"):
        assert "usage" in run(cmd, "--help").stdout


def test_import_digits_and_npz(tmp_path):
    import numpy as np

    p = run("import", tmp_path / "digits.zarr", "--builtin", "digits")
    assert "N=1797" in p.stdout
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", tokens=rng.standard_normal((20, 5, 2)), targets=rng.standard_normal((20, 2)))
    run("import", tmp_path / "a.zarr", "--npz", tmp_path / "a.npz")
    rep = json.loads(run("fit", tmp_path / "a.zarr", "--out", tmp_path / "r", "--local", "--json").stdout)
    assert rep["n_rows"] == 20 and rep["train_mse"] > 0
    x = np.cumsum(rng.standard_normal((300, 3)), axis=0)
    (tmp_path / "s.csv").write_text("a,b,c\n" + "\n".join(",".join(f"{v:.6f}" for v in r) for r in x))
    p = run("import", tmp_path / "s.zarr", "--csv", tmp_path / "s.csv", "--length", 10)
    assert "N=290" in p.stdout and "d=3" in p.stdout


def test_solver_paths_agree_at_d16(tmp_path):
    """d = 16 (psi = 2,176) takes the Cholesky + Lanczos path by default; --solver eigh gives the whole spectrum.
    Both certificates must agree with a dense eigvalsh of G / N computed here from the features."""
    import numpy as np

    from scaleattn.dataset import open_dataset
    from scaleattn.features import phi, token_features

    data = tmp_path / "d16.zarr"
    run("generate", "mhla", data, "--d", 16, "--heads", 1, "--length", 4, "--samples", 3000, "--seed", 1)
    chol = json.loads(run("certify", data, "--json", "--local").stdout)
    eigh = json.loads(run("certify", data, "--json", "--local", "--solver", "eigh").stdout)
    tok, _, _ = open_dataset(data).read(0, 3000)
    P = phi(*token_features(tok))
    lam = np.linalg.eigvalsh(P.T @ P / len(P))
    for cert in (chol, eigh):
        assert cert["psi"] == 2176 and cert["identifiable"]
        assert cert["lambda_max"] == pytest.approx(lam[-1], rel=1e-8)
        assert cert["lambda_min"] == pytest.approx(lam[0], rel=1e-6)


def test_cli_fit_minimal_witness_and_compare(tmp_path, capsys):
    data, assoc = str(tmp_path / "d.zarr"), str(tmp_path / "a.zarr")
    assert main(["generate", "mhla", data, "--d", "3", "--heads", "2", "--length", "20", "--samples", "60",
                 "--causal"]) == 0
    assert main(["generate", "assoc", assoc, "--pairs", "2", "--samples", "1024", "--orthogonal"]) == 0
    r1, r2, r3 = (str(tmp_path / n) for n in ("r1", "r2", "r3"))
    assert main(["fit", data, "--out", r1, "--heads", "minimal", "--local", "--quiet", "--no-plots"]) == 0
    assert main(["fit", data, "--out", r2, "--heads", "svd", "--local", "--quiet", "--no-plots"]) == 0
    assert main(["fit", assoc, "--out", r3, "--local", "--quiet", "--no-plots", "--ridge", "1e-9"]) == 0
    rep1 = json.load(open(f"{r1}/report.json"))
    assert rep1["n_heads"] == 2 and [e["heads"] for e in rep1["loss_vs_heads"]] == [1, 2]
    assert rep1["loss_vs_heads"][-1]["train_mse_stats"] <= 1e-12 * rep1["target_mean_square"]
    assert "witness" not in rep1 and rep1["ridge"] == 0 and rep1["effective_dof"] == rep1["psi"]
    rep3 = json.load(open(f"{r3}/report.json"))
    assert not rep3["identifiable"] and rep3["ambiguous_dim"] > 0 and rep3["ridge"] == 1e-9
    assert rep3["effective_dof"] == pytest.approx(rep3["rank"], rel=1e-3)
    wit = rep3["witness"]
    assert np.asarray(wit["tokens"]).shape[1] == rep3["d"] and wit["prediction_difference"] > 0.1
    assert abs(wit["loss_a"] - wit["loss_b"]) <= 1e-10 * rep3["target_mean_square"]
    capsys.readouterr()
    # minimal (2 heads) and svd (9 heads) fits compute the same function; the assoc model is another one
    assert main(["compare", f"{r1}/model.zarr", f"{r2}/model.zarr", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equivalent"] and (out["n_heads_a"], out["n_heads_b"]) == (2, 9)
    assert main(["compare", f"{r1}/model.zarr", f"{r3}/model.zarr", "--quiet"]) == 2  # d 3 vs 4: bad input
    assert main(["fit", data, "--out", str(tmp_path / "r4"), "--heads", "1", "--local", "--quiet", "--no-plots"]) == 0
    assert main(["compare", f"{r1}/model.zarr", str(tmp_path / "r4/model.zarr"), "--quiet"]) == 1
    assert main(["compare", f"{r1}/model.zarr", str(tmp_path / "nothing.zarr"), "--quiet"]) == 2
