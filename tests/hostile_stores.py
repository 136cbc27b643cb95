"""Crafting stores that decompress hugely, for the tests of :mod:`scaleattn.store._bounds` (and measuring what a
reader allocates on them, in a subprocess).

Every crafted chunk is built without holding its decompressed bytes: a zstd frame of run-length blocks
(RFC 8878: a 3-byte block header and one byte per 128 KiB of zeros) with or without its content size, a blosc
frame's header claiming any size, a gzip member deflating zeros in pieces.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zlib

import google_crc32c

BLOCK = 128 << 10  # zstd's largest block


def zstd_zeros(n: int, *, content_size: bool = True) -> bytes:
    """A zstd frame of ``n`` zero bytes (RLE blocks: about 4 bytes per 128 KiB), declaring ``n`` in its header
    (8-byte Frame_Content_Size, single segment) or not (a streaming frame with a 128 KiB window)."""
    out = bytearray((0xFD2FB528).to_bytes(4, "little"))
    if content_size:
        out += bytes([0xE0]) + n.to_bytes(8, "little")  # FCS flag 3 (8 bytes), single segment
    else:
        out += bytes([0x00, 0x38])  # no FCS, window descriptor: 2^17 bytes
    left = n
    while True:
        size = min(left, BLOCK)
        left -= size
        header = (1 if left == 0 else 0) | (1 << 1) | (size << 3)  # last flag, block type RLE, size
        out += header.to_bytes(3, "little") + b"\x00"
        if left == 0:
            return bytes(out)


def blosc_claiming(n: int) -> bytes:
    """A blosc frame's 16-byte header claiming ``n`` decompressed bytes (and a few bytes after it)."""
    return bytes([2, 1, 0x01, 8]) + n.to_bytes(4, "little") + n.to_bytes(4, "little") + (32).to_bytes(4, "little") \
        + bytes(16)


def gzip_zeros(n: int) -> bytes:
    """A gzip member of ``n`` zero bytes, deflated 16 MiB at a time."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    piece = bytes(min(n, 16 << 20))
    out, left = [], n
    while left:
        k = min(left, len(piece))
        out.append(c.compress(piece[:k]))
        left -= k
    out.append(c.flush())
    return b"".join(out)


def with_crc32c(data: bytes) -> bytes:
    """``data`` followed by its crc32c, as zarr's crc32c codec stores a chunk."""
    return data + google_crc32c.value(data).to_bytes(4, "little")


def array_meta(store, name: str) -> dict:
    return json.loads((pathlib.Path(store) / name / "zarr.json").read_text())


def set_array(store, name: str, *, shape=None, chunks=None, codecs=None) -> None:
    """Edit array ``name``'s zarr.json: its shape, its chunk shape, its codecs (as given)."""
    p = pathlib.Path(store) / name / "zarr.json"
    m = json.loads(p.read_text())
    if shape is not None:
        m["shape"] = list(shape)
    if chunks is not None:
        m["chunk_grid"]["configuration"]["chunk_shape"] = list(chunks)
    if codecs is not None:
        m["codecs"] = codecs
    p.write_text(json.dumps(m))


def set_attrs(store, group: str = "", **changes) -> None:
    """Edit attributes of the group at ``store/group``: ``changes`` (a key set to None is removed). With a v3
    manifest recording the attributes, the record is edited too (what an attacker does)."""
    p = pathlib.Path(store) / group / "zarr.json"
    m = json.loads(p.read_text())
    attrs = m["attributes"]
    for k, v in changes.items():
        for target in (attrs, (attrs.get("manifest") or {}).get("attrs")):
            if target is None or (k not in target and target is not attrs):
                continue
            if v is None:
                target.pop(k, None)
            else:
                target[k] = v
    p.write_text(json.dumps(m))


def set_manifest_shape(store, name: str, shape) -> None:
    """Make the store's manifest record ``shape`` for array ``name`` (its checksum is then wrong, which a reader
    only finds after decompressing: the point)."""
    p = pathlib.Path(store) / "zarr.json"
    m = json.loads(p.read_text())
    entry = m["attributes"]["manifest"]["arrays"][name]
    entry["shape"] = list(shape)
    entry["rows"] = max(1, int(shape[0]))
    p.write_text(json.dumps(m))


def one_chunk(store, name: str, data: bytes) -> None:
    """Replace every stored chunk of array ``name`` by one chunk ``c/0/0/...`` holding ``data``."""
    root = pathlib.Path(store) / name
    shutil.rmtree(root / "c", ignore_errors=True)
    ndim = len(array_meta(store, name)["shape"])
    p = root / "c" / pathlib.Path(*["0"] * ndim)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)


def bomb(store, name: str, shape, *, chunks=None, frame=None, crc: bool = True) -> int:
    """Make array ``name`` declare ``shape`` (float64) in one chunk of ``chunks`` (default: the shape) holding
    ``frame`` (default: a zstd frame of as many zeros as the chunk holds). Returns the chunk's bytes."""
    chunks = tuple(chunks or shape)
    set_array(store, name, shape=shape, chunks=chunks)
    n = 8 * math.prod(chunks)
    data = zstd_zeros(n) if frame is None else frame
    one_chunk(store, name, with_crc32c(data) if crc else data)
    return n


PROBE = """
import resource, sys, json
sys.path.insert(0, {root!r})
import numpy, zarr, scaleattn, scaleattn.cli
{imports}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {{"refused": None}}
try:
{body}
except scaleattn.errors.ScaleattnError as e:
    out["refused"] = f"{{type(e).__name__}}: {{e}}"
except SystemExit as e:
    out["exit"] = e.code
out["base_mb"] = base / 1024
out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("PROBE" + json.dumps(out))
"""


def probe(body: str, imports: str = "", timeout: float = 120, root: str | None = None) -> dict:
    """Run ``body`` (Python, may use the package) in a fresh interpreter with this tree first on the path:
    ``{"refused": message or None, "exit": code of a SystemExit, "base_mb", "peak_mb"}``: the peak RSS before
    and after ``body`` (ru_maxrss), the interpreter and imports included in both. ``root``: another tree to
    import the package from (to measure another version)."""
    root = root or str(pathlib.Path(__file__).resolve().parents[1])
    code = PROBE.format(root=root, imports=imports, body=textwrap.indent(textwrap.dedent(body).strip(), "    "))
    env = {**os.environ, "PYTHONPATH": root}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("PROBE")), None)
    assert line is not None, f"probe died (rc {r.returncode}): {r.stderr[-2000:]}"
    return {**json.loads(line[5:]), "stderr": r.stderr}


def cli_probe(*args: str, timeout: float = 120) -> dict:
    """:func:`probe` of ``scaleattn ARGS`` run in-process (its exit code in ``exit``, its stderr captured)."""
    body = f"out['exit'] = scaleattn.cli.main({list(args)!r})"
    return probe(body, imports="import scaleattn.cli.commands, dask, dask.array", timeout=timeout)
