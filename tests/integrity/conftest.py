"""Shared machinery of the integrity suite (issue 14): run the real CLI (in process with ``main`` for the fast
cases, as a subprocess where a cluster, a kill or a second process is needed), hash every file of the input
stores before and after, and compare results bit for bit with an uninterrupted fit."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from scaleattn.cli import main
from scaleattn.generate import generate_mhla
from scaleattn.statistics._container import Statistics

ROOT = Path(__file__).resolve().parents[2]


def tree_hash(root) -> dict:
    """{relative path: sha256} of every file under ``root`` (symlinks followed; a file hashes as itself)."""
    root = Path(root)
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    out = {}
    for dirpath, dirnames, files in os.walk(root, followlinks=True):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        for d in dirnames:
            out[str((Path(dirpath) / d).relative_to(root)) + "/"] = "dir"
    return out


class Inputs:
    """Hashes of input stores taken now, compared by :meth:`unchanged`."""

    def __init__(self, *paths):
        self.before = {str(p): tree_hash(p) for p in paths}

    def unchanged(self):
        for p, h in self.before.items():
            assert Path(p).exists(), f"input {p} was removed"
            assert tree_hash(p) == h, f"input {p} was changed"


def error_line(stderr: str) -> str:
    """The one ``scaleattn COMMAND: ...`` line of an error (exactly one, no traceback)."""
    assert "Traceback (most recent call last)" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("scaleattn ")]
    assert len(lines) == 1, stderr
    return lines[0]


def run_main(args, capsys, cwd=None) -> tuple[int, str]:
    """``scaleattn ARGS`` in this process: (exit code, stderr)."""
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        capsys.readouterr()
        rc = main([str(a) for a in args])
        return rc, capsys.readouterr().err
    finally:
        os.chdir(old)


def run_cli(args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """``python -m scaleattn.cli ARGS`` as a subprocess (this checkout first on the path)."""
    e = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
         "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([sys.executable, "-m", "scaleattn.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=e)


def popen_cli(args, cwd=None, env=None, session: bool = False) -> subprocess.Popen:
    """The CLI in a child process; ``session``: in a process group of its own, so that ``os.killpg`` reaches it and
    every process it starts, as a terminal's Ctrl-C does."""
    e = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
         "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "scaleattn.cli", *map(str, args)], cwd=cwd, env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint,
                            start_new_session=session)


def _default_sigint():
    """The child takes Ctrl-C (SIGINT) as a terminal would send it, even when this test run was started with
    SIGINT ignored (``nohup``, a background job of a non-interactive shell), which a child would inherit."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def dataset(path, samples=32, chunk=8, seed=1, causal=True, **kw):
    """A small dataset written by scaleattn (manifest, crc32c): d = 2, T = 6, 4 chunks, 16 row groups of 2 samples."""
    return generate_mhla(str(path), d=2, heads=1, length=6, samples=samples, causal=causal, chunk_samples=chunk,
                         seed=seed, **kw)


def foreign(path, tokens, targets=None, lengths=None, chunk=8, attrs=None, compressors="auto"):
    """A dataset written by zarr directly, as another tool would (no manifest, no crc32c, empty chunks skipped;
    ``compressors=None``: raw chunks, every one the same size whatever its values)."""
    g = zarr.open_group(str(path), mode="w", zarr_format=3)
    g.attrs.update(attrs or {})
    for name, a in (("tokens", tokens), ("targets", targets), ("lengths", lengths)):
        if a is not None:
            g.create_array(name, data=np.asarray(a), chunks=(chunk,) + np.shape(a)[1:], compressors=compressors)
    return g


def swap_chunk(src, dst, key="tokens/c/1/0/0"):
    """Put ``src``'s stored object ``key`` (the samples [8, 16) of tokens) into store ``dst``: of raw chunks, a
    store whose metadata, listing (keys and sizes) and first and last chunks are ``dst``'s, its values not."""
    data = (src / key).read_bytes()
    assert len(data) == (dst / key).stat().st_size and data != (dst / key).read_bytes()
    (dst / key).write_bytes(data)


def rows(seed=0, n=32, T=6, d=2, d_out=2, causal=True):
    rng = np.random.default_rng(seed)
    tok = rng.standard_normal((n, T, d))
    y = rng.standard_normal((n, T, d_out) if causal else (n, d_out))
    return tok, y


def same_stats(a: Statistics, b: Statistics) -> None:
    np.testing.assert_array_equal(a.gram_compact, b.gram_compact)
    np.testing.assert_array_equal(a.moments, b.moments)
    assert a.yy == b.yy and a.n_rows == b.n_rows


def stats_of(run) -> Statistics:
    return Statistics.load(str(Path(run) / "stats.zarr"))


def expect(line: str, pattern: str) -> None:
    assert re.search(pattern, line), f"{line!r} does not match {pattern!r}"


FIT = ["--local", "--quiet", "--no-plots", "--no-exact-mse"]


@pytest.fixture
def fit_args():
    return list(FIT)
