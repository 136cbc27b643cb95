"""Every kind of bad input through the CLI: one clear line naming the array (and the first bad sample where it
applies), exit code 2, no output or temporary left behind, and the input byte-identical.

Each case runs twice: in this process (``scaleattn.cli.main``, fast, no cluster cases) and as a real process
(slow). The real processes run concurrently in one module fixture (each is a ~2 s Python start-up, mostly
waiting), then one parametrised test per case checks its result.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import zarr

from tests.helpers import run_cli, run_cli_process

N, T, D, D_OUT = 6, 4, 2, 2


def _rng():
    return np.random.default_rng(0)


def good(causal=False, lengths=False):
    rng = _rng()
    tok = rng.standard_normal((N, T, D))
    y = rng.standard_normal((N, T, D_OUT) if causal else (N, D_OUT))
    lens = np.full(N, T, dtype=np.int64) if lengths else None
    return tok, y, lens


def raw(path, tokens=None, targets=None, lengths=None, chunk=2, extra=None):
    """A Zarr v3 group written directly with zarr (no scaleattn validation), chunked along samples."""
    g = zarr.open_group(str(path), mode="w", zarr_format=3)
    g.attrs.update({"format": "scaleattn-dataset", "format_version": 1})
    arrays = {"tokens": tokens, "targets": targets, "lengths": lengths, **(extra or {})}
    for name, a in arrays.items():
        if a is None:
            continue
        chunks = (max(1, min(chunk, a.shape[0])),) + a.shape[1:] if a.ndim else ()
        if a.dtype == object:  # variable-length strings: zarr v3's stand-in for object arrays
            arr = g.create_array(name, shape=a.shape, chunks=chunks, dtype=str)
            arr[...] = a.astype(str)
        else:
            g.create_array(name, data=a, chunks=chunks)
    return g


def with_(a, index, value):
    a = a.copy()
    a[index] = value
    return a


class _Evil:
    """Unpickling this creates the file ``path``: proof that a code path unpickled a user file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@dataclasses.dataclass
class Case:
    id: str
    build: object  # (case_dir) -> argv after "scaleattn"; input at case_dir/"in.zarr" (or another file)
    expect: str  # regex the error line must match
    cluster: bool = False  # starts an embedded Dask cluster


def fit(*extra, data="in.zarr"):
    return ["fit", data, "--out", "out", "--local", "--quiet", *extra]


def store(**kw):
    def build(d):
        raw(d / "in.zarr", **kw)
        return fit()

    return build


def _tok():
    return good()[0]


def _y(causal=False):
    return good(causal)[1]


def corrupt(rel, content: bytes):
    def build(d):
        tok, y, _ = good()
        raw(d / "in.zarr", tokens=tok, targets=y)
        (d / "in.zarr" / rel).write_bytes(content)
        return fit()

    return build


def _stale_consolidated(d):
    """The group's consolidated metadata (which zarr reads in place of the arrays') says 6 samples, the tokens'
    own zarr.json 4 (shrunk after consolidating): the fit read 6 samples, chunks beyond the array's shape."""
    tok, y, _ = good()
    raw(d / "in.zarr", tokens=tok, targets=y)
    zarr.consolidate_metadata(str(d / "in.zarr"))
    meta = json.loads((d / "in.zarr" / "tokens" / "zarr.json").read_text())
    meta["shape"][0] = 4
    (d / "in.zarr" / "tokens" / "zarr.json").write_text(json.dumps(meta))
    return fit()


def _consolidated_before_lengths(d):
    """Variable lengths written after consolidating: zarr's listing (the copy) has no 'lengths', the group does;
    it was refused as 'corrupt Zarr metadata ... (not a readable array)', a readable array."""
    tok, y, _ = good()
    raw(d / "in.zarr", tokens=tok, targets=y)
    zarr.consolidate_metadata(str(d / "in.zarr"))
    zarr.open_group(str(d / "in.zarr"), mode="r+", use_consolidated=False).create_array(
        "lengths", data=np.full(tok.shape[0], tok.shape[1], dtype=np.int64))
    return fit()


def _not_a_group(d):
    (d / "in.zarr").mkdir()
    (d / "in.zarr" / "notes.txt").write_text("not zarr")
    return fit()


def _an_array(d):
    zarr.create_array(str(d / "in.zarr"), shape=(N, T, D), dtype="f8")
    return fit()


def _a_file(d):
    (d / "in.zarr").write_bytes(b"\x93NUMPY garbage")
    return fit()


def _missing(d):
    return fit()


def _out_exists(d):
    tok, y, _ = good()
    raw(d / "in.zarr", tokens=tok, targets=y)
    (d / "out").mkdir()
    (d / "out" / "keep.txt").write_text("precious")
    return fit()


def _out_exists_before_cluster(d):
    """Must fail on the existing output before trying to reach the (dead) scheduler."""
    _out_exists(d)
    return ["fit", "in.zarr", "--out", "out", "--quiet", "--scheduler", "tcp://127.0.0.1:9"]


def _tls_partial(d):
    tok, y, _ = good()
    raw(d / "in.zarr", tokens=tok, targets=y)
    (d / "cert.pem").write_text("x")
    return ["fit", "in.zarr", "--out", "out", "--quiet", "--tls-cert", "cert.pem", "--workers", "1"]


def _tls_missing_file(d):
    tok, y, _ = good()
    raw(d / "in.zarr", tokens=tok, targets=y)
    return ["fit", "in.zarr", "--out", "out", "--quiet", "--workers", "1",
            "--tls-ca-file", "ca.pem", "--tls-cert", "cert.pem", "--tls-key", "key.pem"]


def _nan_on_cluster(d):
    """Through a real embedded cluster: the worker's DatasetError reaches the client with its message."""
    raw(d / "in.zarr", tokens=with_(_tok(), (5, 2, 1), np.nan), targets=_y())
    return ["fit", "in.zarr", "--out", "out", "--quiet", "--workers", "1"]


def _evaluate_d_out(d):
    from scaleattn.heads._algebra import coef_from_heads
    from scaleattn.model import MHLAModel

    rng = _rng()
    V, Q = rng.standard_normal((1, 2, 2)), rng.standard_normal((1, 2, 2))
    MHLAModel(coef_from_heads(V, Q), V, Q, 2, False).save(str(d / "model.zarr"))
    raw(d / "in.zarr", tokens=_tok(), targets=_rng().standard_normal((N, 3)))
    return ["evaluate", "model.zarr", "in.zarr", "--local", "--quiet"]


def _plot_d_out(d):
    import scaleattn

    raw(d / "train.zarr", tokens=_tok(), targets=_y())
    scaleattn.fit(str(d / "train.zarr"), str(d / "run"), plots=False)
    raw(d / "in.zarr", tokens=_tok(), targets=_rng().standard_normal((N, 3)))
    return ["plot", "run", "--dataset", "in.zarr"]


def _model_as_dataset(d):
    from scaleattn.heads._algebra import coef_from_heads
    from scaleattn.model import MHLAModel

    rng = _rng()
    V, Q = rng.standard_normal((1, 2, 2)), rng.standard_normal((1, 2, 2))
    MHLAModel(coef_from_heads(V, Q), V, Q, 2, False).save(str(d / "model.zarr"))
    return ["fit", "model.zarr", "--out", "out", "--local", "--quiet"]


def _certify_empty(d):
    raw(d / "in.zarr", tokens=np.zeros((0, T, D)))
    return ["certify", "in.zarr", "--local", "--quiet"]


def _too_big(d):
    rng = _rng()
    raw(d / "in.zarr", tokens=rng.standard_normal((4, 3, 200)), targets=rng.standard_normal((4, 200)))
    return fit()


def npz(**arrays):
    def build(d):
        np.savez(d / "in.npz", **arrays)
        return ["import", "out", "--npz", "in.npz"]

    return build


def _npz_pickle(d):
    """An object array whose unpickling would create ``pwned``: import must refuse it without unpickling."""
    evil = np.empty(1, dtype=object)
    evil[0] = _Evil(str(d / "pwned"))
    with open(d / "in.npz", "wb") as f:  # np.savez pickles object arrays
        np.savez(f, tokens=_tok(), targets=evil)
    return ["import", "out", "--npz", "in.npz"]


def _generate_exists(d):
    (d / "out").mkdir()
    (d / "out" / "keep.txt").write_text("precious")
    return ["generate", "mhla", "out", "--samples", "4", "--length", "3"]


CASES = [
    # NaN / Inf, naming the array and the first bad (global) sample
    Case("nan-tokens", store(tokens=with_(_tok(), (3, 1, 0), np.nan), targets=_y()), r"tokens: sample 3 .*NaN or Inf"),
    Case("inf-tokens", store(tokens=with_(_tok(), (4,), np.inf), targets=_y()), r"tokens: sample 4 .*NaN or Inf"),
    Case("nan-targets", store(tokens=_tok(), targets=with_(_y(), (2, 1), np.nan)), r"targets: sample 2 .*NaN or Inf"),
    Case("inf-targets-causal", store(tokens=_tok(), targets=with_(_y(True), (5, 2, 0), -np.inf)),
         r"targets: sample 5 .*NaN or Inf"),
    Case("nan-on-cluster", _nan_on_cluster, r"tokens: sample 5 .*NaN or Inf", cluster=True),
    # number of dimensions
    Case("tokens-2d", store(tokens=_tok()[:, 0], targets=_y()), r"tokens: expected 3 dimensions.*\(6, 2\)"),
    Case("tokens-4d", store(tokens=_tok()[..., None], targets=_y()), r"tokens: expected 3 dimensions"),
    Case("targets-1d", store(tokens=_tok(), targets=_y()[:, 0]), r"targets: expected \(sample, output\)"),
    Case("targets-4d", store(tokens=_tok(), targets=_y(True)[..., None]), r"targets: expected \(sample, output\)"),
    Case("lengths-2d", store(tokens=_tok(), targets=_y(), lengths=np.full((N, 1), T)),
         r"lengths: expected shape \(6,\)"),
    # mismatched N, T, d_out
    Case("targets-N", store(tokens=_tok(), targets=np.zeros((N + 1, D_OUT))), r"targets: 7 samples but tokens has 6"),
    Case("lengths-N", store(tokens=_tok(), targets=_y(), lengths=np.full(N - 1, T)), r"lengths: expected shape \(6,\)"),
    Case("targets-T", store(tokens=_tok(), targets=np.zeros((N, T + 1, D_OUT))),
         r"targets: 5 positions but tokens has T = 4"),
    Case("targets-d_out-0", store(tokens=_tok(), targets=np.zeros((N, 0))), r"targets: d_out = 0"),
    Case("evaluate-d_out", _evaluate_d_out, r"model has \(d, d_out\) = \(2, 2\) but .*in\.zarr has \(2, 3\)"),
    # plot --dataset of another d_out: "y and y_hat: expected equal non-empty shapes" (of another d: "tokens:
    # expected shape (n, T, 2)"), naming neither the model nor the dataset
    Case("plot-d_out", _plot_d_out, r"model has \(d, d_out\) = \(2, 2\) but .*in\.zarr has \(2, 3\)"),
    # lengths out of range
    Case("lengths-0", store(tokens=_tok(), targets=_y(), lengths=with_(np.full(N, T), 3, 0)),
         r"lengths: sample 3 has length 0, expected 1 <= length <= T = 4"),
    Case("lengths-gt-T", store(tokens=_tok(), targets=_y(), lengths=with_(np.full(N, T), 5, T + 1)),
         r"lengths: sample 5 has length 5"),
    # dtypes
    Case("tokens-bool", store(tokens=np.ones((N, T, D), bool), targets=_y()),
         r"tokens: expected a float \(or integer\) dtype, got bool"),
    Case("tokens-complex", store(tokens=_tok() + 1j, targets=_y()),
         r"tokens: expected a float \(or integer\) dtype, got complex128"),
    Case("tokens-object", store(tokens=_tok().astype(object), targets=_y()),
         r"tokens: expected a float \(or integer\) dtype"),
    Case("targets-complex", store(tokens=_tok(), targets=_y() * 1j),
         r"targets: expected a float \(or integer\) dtype, got complex"),
    Case("lengths-float", store(tokens=_tok(), targets=_y(), lengths=np.full(N, float(T))),
         r"lengths: expected an integer dtype, got float64"),
    # empty / missing
    Case("empty-N0", store(tokens=np.zeros((0, T, D)), targets=np.zeros((0, D_OUT))), r"tokens: empty dataset"),
    Case("empty-d0", store(tokens=np.zeros((N, T, 0)), targets=_y()), r"tokens: empty dataset"),
    Case("certify-empty", _certify_empty, r"tokens: empty dataset"),
    Case("missing-tokens", store(targets=_y()), r"missing array 'tokens'"),
    Case("a-model-as-dataset", _model_as_dataset, r"model\.zarr: a model store, not a dataset"),
    Case("tokens-int-beyond-2^53", store(tokens=with_(np.ones((N, T, D), np.int64), 4, 2**53 + 1), targets=_y()),
         r"tokens: sample 4 holds the integer 9007199254740993, beyond 2\^53"),
    Case("targets-uint-beyond-2^53", store(tokens=_tok(), targets=with_(np.ones((N, D_OUT), np.uint64), 2, 2**60)),
         r"targets: sample 2 holds the integer 1152921504606846976, beyond 2\^53"),
    Case("missing-targets", store(tokens=_tok()), r"has no 'targets' array"),
    Case("missing-store", _missing, r"in\.zarr: no such dataset"),
    # not a Zarr group, corrupt metadata and data
    Case("not-a-group", _not_a_group, r"in\.zarr: not a readable Zarr group"),
    Case("an-array", _an_array, r"in\.zarr: not a readable Zarr group"),
    Case("a-file", _a_file, r"dataset \S*in\.zarr: is a file, expected a Zarr store \(a directory\)"),
    Case("corrupt-group-json", corrupt("zarr.json", b"garbage{"), r"in\.zarr: not a readable Zarr group"),
    Case("binary-group-json", corrupt("zarr.json", b"\xff\xfe\x00\x01"), r"in\.zarr: not a readable Zarr group"),
    Case("corrupt-tokens-json", corrupt("tokens/zarr.json", b"garbage{"), r"corrupt Zarr metadata"),
    Case("incomplete-tokens-json", corrupt("tokens/zarr.json", b'{"zarr_format": 3, "node_type": "array"}'),
         r"tokens: corrupt Zarr metadata"),
    Case("incomplete-targets-json", corrupt("targets/zarr.json", b'{"zarr_format": 3, "node_type": "array"}'),
         r"targets: corrupt Zarr metadata"),
    Case("stale-consolidated", _stale_consolidated,
         r"tokens: the consolidated metadata of \S*in\.zarr differs from the array's own \(shape \(6, 4, 2\) there,"
         r" \(4, 4, 2\) in its own\): the copy is stale"),
    Case("consolidated-before-lengths", _consolidated_before_lengths,
         r"lengths: the consolidated metadata of \S*in\.zarr does not list the array, which the group holds: the"
         r" copy is stale \(the array was added after zarr\.consolidate_metadata\)"),
    Case("corrupt-chunk", corrupt("tokens/c/1/0/0", b"xx"), r"tokens: cannot read samples \[2, 4\)"),
    # outputs
    Case("out-exists", _out_exists, r"output '.*out' already exists \(pass --overwrite"),
    Case("out-exists-before-cluster", _out_exists_before_cluster, r"output '.*out' already exists"),
    Case("generate-out-exists", _generate_exists, r"output '.*out' already exists"),
    # cluster options
    Case("tls-partial", _tls_partial, r"TLS needs all of .*missing --tls-ca-file, --tls-key"),
    Case("tls-missing-file", _tls_missing_file, r"--tls-ca-file: no such file 'ca\.pem'"),
    # d too large for memory: refused from the size estimate before any work (a 32 TB compact Gram)
    Case("d-too-large", _too_big, r"d = 200 .*needs .*GiB.* available"),
    # import: user files are never unpickled; the same validation as stores
    Case("import-pickle", _npz_pickle, r"in\.npz: cannot read without unpickling"),
    Case("import-nan", npz(tokens=_tok(), targets=with_(_y(), (4, 0), np.nan)), r"targets: sample 4 .*NaN or Inf"),
    Case("import-lengths", npz(tokens=_tok(), targets=_y(), lengths=with_(np.full(N, T), 2, T + 1)),
         r"lengths: sample 2 has length 5"),
    Case("import-targets-complex", npz(tokens=_tok(), targets=_y() * 1j),
         r"targets: expected a float \(or integer\) dtype"),
    Case("import-targets-T", npz(tokens=_tok(), targets=np.zeros((N, T - 1, 1))),
         r"targets: 3 positions but tokens has T = 4"),
    Case("import-missing-tokens", npz(targets=_y()), r"in\.npz: missing array 'tokens'"),
    Case("import-empty", npz(tokens=np.zeros((0, T, D))), r"tokens: empty dataset"),
]


def _tree_hash(root: Path) -> dict:
    """{relative path: sha256} of every file under ``root`` (a file hashes as itself)."""
    root = Path(root)
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    out = {}
    for dirpath, dirnames, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        for dname in dirnames:
            out[str((Path(dirpath) / dname).relative_to(root)) + "/"] = "dir"
    return out


def _run(case: Case, d: Path) -> dict:
    argv = case.build(d)
    before = _tree_hash(d)
    p = run_cli_process(*argv, rc=None, cwd=d, extra_env={"PYTHONWARNINGS": "ignore"}, timeout=120)
    return {"argv": argv, "rc": p.returncode, "stderr": p.stderr, "stdout": p.stdout, "before": before,
            "after": _tree_hash(d)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad")
    dirs = {}
    for c in CASES:
        dirs[c.id] = base / c.id
        dirs[c.id].mkdir()
    with ThreadPoolExecutor(max_workers=6) as pool:  # in-process cases; those starting a cluster run alone after
        futs = {c.id: pool.submit(_run, c, dirs[c.id]) for c in CASES if not c.cluster}
        out = {k: f.result() for k, f in futs.items()}
    out.update({c.id: _run(c, dirs[c.id]) for c in CASES if c.cluster})
    return out


def _check(case: Case, r: dict) -> None:
    err = r["stderr"]
    assert r["rc"] == 2, f"{r['argv']}: exit {r['rc']}\n{err}"
    assert "Traceback (most recent call last)" not in err, err  # (workers' own logs may quote theirs)
    lines = [ln for ln in err.splitlines() if ln.startswith("scaleattn ")]
    assert len(lines) == 1, err
    assert re.search(case.expect, lines[0]), f"{lines[0]!r} does not match {case.expect!r}"
    # nothing written: the output is absent (or untouched when it existed), no temporaries, inputs unchanged
    changed = {k.split("/")[0] for k, _ in set(r["after"].items()) ^ set(r["before"].items())}
    assert not changed, f"files were created, changed or removed: {changed}"
    if "out/" not in r["before"]:
        assert "out/" not in r["after"]
    assert "pwned" not in r["after"]


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input(case, results):
    _check(case, results[case.id])


@pytest.mark.filterwarnings("ignore")  # as the processes run with PYTHONWARNINGS=ignore
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES if not c.cluster])
def test_bad_input_in_process(case, tmp_path, monkeypatch, capfd):
    argv = case.build(tmp_path)
    before = _tree_hash(tmp_path)
    monkeypatch.chdir(tmp_path)
    p = run_cli(capfd, *argv, rc=None)
    _check(case, {"argv": argv, "rc": p.returncode, "stderr": p.stderr, "stdout": p.stdout, "before": before,
                  "after": _tree_hash(tmp_path)})


def test_fixture_really_is_a_pickle(tmp_path):
    """The import-pickle case is meaningful: loading it with allow_pickle=True does run the payload."""
    _npz_pickle(tmp_path)
    with np.load(tmp_path / "in.npz", allow_pickle=True) as f:
        f["targets"]
    assert (tmp_path / "pwned").exists()


def test_no_code_path_unpickles_user_files():
    """No module loads pickles, and every np.load refuses them (stores never hold object data)."""
    src = Path(__file__).resolve().parents[2] / "scaleattn"
    for py in src.rglob("*.py"):
        text = py.read_text()
        assert not re.search(r"\bpickle\.loads?\(|cloudpickle\.loads?\(|allow_pickle\s*=\s*True|pd\.read_pickle",
                             text), py
        for call in re.findall(r"np\.load\([^)]*\)", text):
            assert "allow_pickle=False" in call, (py, call)
