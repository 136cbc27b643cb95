"""Crafted stores are refused from their metadata, before a chunk is decompressed (:mod:`scaleattn.store._bounds`):
a store of a few KB whose chunk of zeros expands to gigabytes, whose declared shape disagrees with its attributes,
whose chunks are larger than the array, whose codec hides its size, or whose attributes declare a huge d
consistently. Every reader the package has: models, statistics, spectra, checkpoints, datasets (and their
teachers), run directories (plot), the evaluate and compare commands. A refusal is one line, exit 2, and (measured
in a subprocess) no large allocation."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import zarr

from scaleattn.distributed.checkpoint import Checkpoint
from scaleattn.errors import CheckpointError, FormatError, IntegrityError, ScaleattnError
from scaleattn.features import n_features, n_pairs
from scaleattn.heads._algebra import coef_from_heads
from scaleattn.model import MHLAModel
from scaleattn.run import load_spectrum
from scaleattn.statistics._container import Statistics
from scaleattn.store import _bounds
from scaleattn.store._location import resolve

from .. import hostile_stores as h
from .conftest import dataset, error_line, expect, foreign, run_main

GB2 = 2 << 30  # what the crafted chunks of the subprocess cases declare
MB64 = 64 << 20  # (in process: a reader that still decompressed would allocate this, not take the machine)


def _model(d=2, d_out=2, H=2, seed=0) -> MHLAModel:
    rng = np.random.default_rng(seed)
    V, Q = rng.standard_normal((H, d_out, d)), rng.standard_normal((H, d, d))
    return MHLAModel(coef_from_heads(V, Q), V, Q, d, True)


def _stats(d=2, d_out=2) -> Statistics:
    rng = np.random.default_rng(1)
    m = n_pairs(d)
    return Statistics(rng.standard_normal((m * (m + 1) // 2, d * (d + 1) // 2)),
                      rng.standard_normal((n_features(d), d_out)), 3.0, 10, d)


# ---- the codecs: bounded by the chunk's declared bytes --------------------------------------------------------

def test_zstd_frame_header_sizes_match_real_frames():
    from numcodecs import Zstd

    for n in (0, 1, 255, 256, 257, 65791, 65792, 1 << 20, 3_000_001):
        frame = Zstd(level=1).encode(np.zeros(n, dtype=np.uint8))
        assert _bounds.zstd_content_size(frame) == n
        assert _bounds.zstd_content_size(h.zstd_zeros(n or 1)) == (n or 1)
    assert _bounds.zstd_content_size(h.zstd_zeros(100, content_size=False)) is None
    assert _bounds.zstd_content_size(b"not zstd at all") is None
    # the crafted frames decode to what they say (so the refusals below are of real bombs)
    assert Zstd().decode(h.zstd_zeros(300_000)) == bytes(300_000)


@pytest.mark.parametrize("codec, frame, why", [
    ("zstd", lambda n: h.zstd_zeros(n * 64), "would decompress to"),
    ("zstd", lambda n: h.zstd_zeros(n, content_size=False), "no frame header declaring its size"),
    ("blosc", lambda n: h.blosc_claiming(1 << 31), "would decompress to 2,147,483,648"),
    ("gzip", lambda n: h.gzip_zeros(n * 64), "inflates past"),
])
def test_a_chunk_decompressing_past_its_declared_bytes_is_refused(tmp_path, codec, frame, why):
    shape = (4096, 16)  # one float64 chunk: 512 KiB declared
    g = zarr.open_group(str(tmp_path / "x.zarr"), mode="w")
    comp = {"zstd": zarr.codecs.ZstdCodec(), "blosc": zarr.codecs.BloscCodec(), "gzip": zarr.codecs.GzipCodec()}
    g.create_array("a", data=np.ones(shape), compressors=comp[codec])
    arr = zarr.open_group(str(tmp_path / "x.zarr"), mode="r")["a"]
    np.testing.assert_array_equal(arr[...], 1.0)  # the bounded decoders read what zarr wrote
    h.one_chunk(tmp_path / "x.zarr", "a", frame(8 * 4096 * 16))
    arr = zarr.open_group(str(tmp_path / "x.zarr"), mode="r")["a"]
    with pytest.raises(_bounds.DecompressionBoundError, match=why):
        arr[...]


def test_the_bounds_write_what_zarr_writes_and_survive_a_configuration_reset(tmp_path):
    zarr.config.refresh()  # (another library resetting zarr's configuration: the next open installs them again)
    p = tmp_path / "m.zarr"
    _model().save(p)
    assert [c["name"] for c in h.array_meta(p, "coef")["codecs"]] == ["bytes", "zstd", "crc32c"]
    with zarr.config.set({"codecs.zstd": "zarr.codecs.zstd.ZstdCodec"}):  # plain zarr reads what was written
        np.testing.assert_array_equal(zarr.open_group(str(p), mode="r")["coef"][...], MHLAModel.load(p).coef)
    h.bomb(p, "coef", (6, 2), frame=h.zstd_zeros(MB64))
    zarr.config.refresh()
    with pytest.raises(FormatError, match="zstd chunk would decompress to 67,108,864 bytes"):
        MHLAModel.load(p)


# ---- small stores: model, statistics, spectrum -----------------------------------------------------------------

def _crafted_model(tmp_path, variant: str, big: int):
    """A model store crafted as ``variant``; ``big``: the bytes its bomb declares."""
    p = tmp_path / "m.zarr"
    _model().save(p)
    rows = big // 16
    if variant == "shape":  # coef declares many rows (the manifest edited to agree), d = 2 says 6
        h.bomb(p, "coef", (rows, 2))
        h.set_manifest_shape(p, "coef", (rows, 2))
    elif variant == "heads":  # V and Q declare many heads; n_heads = 2 says otherwise
        h.bomb(p, "Q", (big // 32, 2, 2))
        h.set_manifest_shape(p, "Q", (big // 32, 2, 2))
    elif variant == "chunks":  # the shape is right, its one chunk is huge
        h.bomb(p, "coef", (6, 2), chunks=(rows, 2))
    elif variant == "frame":  # the shape and chunks are right, the zstd frame inside expands
        h.bomb(p, "coef", (6, 2), frame=h.zstd_zeros(big))
    elif variant == "codec":  # the codecs edited to gzip, whose size a reader cannot know before inflating
        meta = h.array_meta(p, "coef")
        h.set_array(p, "coef", codecs=[meta["codecs"][0], {"name": "gzip", "configuration": {"level": 1}}])
        h.one_chunk(p, "coef", h.gzip_zeros(min(big, MB64)))  # (gzip's ratio is at most ~1,000)
    elif variant == "consistent-d":  # d edited everywhere (attributes, the manifest's record, every shape)
        d = 2
        while 8 * n_features(d) * 2 < big:
            d += 1
        h.set_attrs(p, d=d)
        for name, shape in (("coef", (n_features(d), 2)), ("V", (2, 2, d)), ("Q", (2, d, d))):
            h.bomb(p, name, shape)
            h.set_manifest_shape(p, name, shape)
    return p


MODEL_VARIANTS = ["shape", "heads", "chunks", "frame", "codec", "consistent-d"]


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_crafted_model_stores_are_refused_before_decompressing(tmp_path, variant):
    p = _crafted_model(tmp_path, variant, MB64)
    with pytest.raises((FormatError, IntegrityError)) as e:
        MHLAModel.load(p)
    assert "checksum" not in str(e.value)  # (what the reader said after decompressing, before the bounds)
    expect(str(e.value), {"shape": r"coef .*shape \(4194304, 2\), but d = 2 .* means \(6, 2\)",
                          "heads": r"n_heads' is 2 but the arrays hold 2097152|Q .*shape",
                          "chunks": r"coef .*chunks of shape \(4194304, 2\) hold 67,108,864 bytes, more than",
                          "frame": r"coef .*zstd chunk would decompress to 67,108,864 bytes",
                          "codec": r"coef .*codec 'gzip'",
                          "consistent-d": r"declare [\d,]+ bytes but its chunks hold [\d,]+ bytes"}[variant])


def _crafted_stats(tmp_path, variant: str, big: int):
    p = tmp_path / "s.zarr"
    _stats().save(p)
    if variant == "shape":
        h.bomb(p, "gram_compact", (big // 24, 3))
        h.set_manifest_shape(p, "gram_compact", (big // 24, 3))
    elif variant == "d_out":  # the moments declare many outputs, and the attribute agrees (the manifest too)
        h.set_attrs(p, d_out=big // 48)
        h.bomb(p, "moments", (6, big // 48))
        h.set_manifest_shape(p, "moments", (6, big // 48))
    elif variant == "chunks":
        h.bomb(p, "moments", (6, 2), chunks=(big // 16, 2))
    elif variant == "frame":
        h.bomb(p, "gram_compact", (6, 3), frame=h.zstd_zeros(big))
    elif variant == "streaming-frame":
        h.bomb(p, "gram_compact", (6, 3), frame=h.zstd_zeros(big, content_size=False))
    return p


STATS_VARIANTS = ["shape", "d_out", "chunks", "frame", "streaming-frame"]


@pytest.mark.parametrize("variant", STATS_VARIANTS)
def test_crafted_statistics_stores_are_refused_before_decompressing(tmp_path, variant):
    p = _crafted_stats(tmp_path, variant, MB64)
    with pytest.raises((FormatError, IntegrityError)) as e:
        Statistics.load(p)
    assert "checksum" not in str(e.value)
    expect(str(e.value), {"shape": r"gram_compact .*shape \(2796202, 3\), but d = 2 .* means \(6, 3\)",
                          "d_out": r"declare [\d,]+ bytes but its chunks hold",
                          "chunks": r"moments .*chunks of shape",
                          "frame": r"zstd chunk would decompress",
                          "streaming-frame": r"no frame header declaring its size"}[variant])


@pytest.mark.parametrize("variant", ["psi", "unequal", "frame"])
def test_crafted_spectrum_stores_are_refused_before_decompressing(tmp_path, variant):
    from scaleattn.linalg import certify

    cert = certify(_stats(), solver="eigh")
    from scaleattn.run import save_spectrum

    p = tmp_path / "sp.zarr"
    save_spectrum(cert, resolve(p))
    psi = n_features(2)
    if variant == "psi":  # both spectra declare many values, the manifest agrees; psi = 6 says otherwise
        for name in ("eigenvalues", "eigenvalues_scaled"):
            h.bomb(p, name, (MB64 // 8,))
            h.set_manifest_shape(p, name, (MB64 // 8,))
    elif variant == "unequal":
        h.bomb(p, "eigenvalues", (MB64 // 8,))
        h.set_manifest_shape(p, "eigenvalues", (MB64 // 8,))
    else:
        h.bomb(p, "eigenvalues", (psi,), frame=h.zstd_zeros(MB64))
    with pytest.raises((FormatError, IntegrityError)) as e:
        load_spectrum(resolve(p))
    assert "checksum" not in str(e.value)
    expect(str(e.value), r"not two spectra of psi = 6|zstd chunk would decompress")


# ---- checkpoints -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["shape", "chunks", "frame", "dtype"])
def test_crafted_checkpoints_are_refused_before_decompressing(tmp_path, variant):
    from scaleattn.distributed.partition import row_groups, tile_bounds

    ds = dataset(tmp_path / "d.zarr")
    groups, tiles = row_groups(ds, 8), tile_bounds(n_pairs(2) * (n_pairs(2) + 1) // 2, 2)
    ck = tmp_path / "ck.zarr"
    Checkpoint.open(resolve(ck), ds, groups, tiles)
    n = len(groups)
    if variant == "shape":
        h.bomb(ck, "gram_compact", (n, MB64 // 24, 3), chunks=(1, 2, 3))
    elif variant == "chunks":
        h.bomb(ck, "moments", (n, 6, 2), chunks=(1, MB64 // 16, 2))
    elif variant == "dtype":
        h.set_array(ck, "n_rows", codecs=None)
        meta = h.array_meta(ck, "n_rows")
        meta["data_type"] = "float64"
        (ck / "n_rows" / "zarr.json").write_text(__import__("json").dumps(meta))
    else:  # the metadata is right; a done partial's chunk expands (read by `verified`)
        opened = Checkpoint.open(resolve(ck), ds, groups, tiles)
        g = zarr.open_group(str(ck), mode="r+")
        g["done"][0, 0] = True
        h.one_chunk(ck, "gram_compact", h.with_crc32c(h.zstd_zeros(MB64)))
        with pytest.raises(FormatError, match="zstd chunk would decompress to 67,108,864"):
            opened.verified(0, 0)
        return
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(resolve(ck), ds, groups, tiles)
    expect(str(e.value), {"shape": r"gram_compact .*shape .*attributes mean", "chunks": r"moments .*chunks of shape",
                          "dtype": r"n_rows .*data type float64"}[variant])


# ---- datasets ----------------------------------------------------------------------------------------------------

def _crafted_dataset(tmp_path, variant: str, big: int):
    p = tmp_path / "d.zarr"
    dataset(p, samples=32, chunk=8)
    if variant == "chunks":  # tokens in one chunk far larger than the array
        h.bomb(p, "tokens", (32, 6, 2), chunks=(big // 96, 6, 2))
    elif variant == "frame":  # right metadata, one chunk's zstd frame expands
        meta = h.array_meta(p, "tokens")
        (p / "tokens/c/1/0/0").write_bytes(h.with_crc32c(h.zstd_zeros(big)))
        assert meta["shape"] == [32, 6, 2]
    elif variant == "blosc":  # codecs edited to blosc, a chunk's header claims 2 GB
        meta = h.array_meta(p, "tokens")
        h.set_array(p, "tokens", codecs=[meta["codecs"][0], {"name": "blosc", "configuration": {
            "cname": "lz4", "clevel": 5, "shuffle": "noshuffle", "typesize": 8, "blocksize": 0}}])
        for k in range(4):  # (every chunk: the first read decides)
            (p / f"tokens/c/{k}/0/0").write_bytes(h.blosc_claiming(1 << 31))
    elif variant == "gzip":
        meta = h.array_meta(p, "tokens")
        h.set_array(p, "tokens", codecs=[meta["codecs"][0], {"name": "gzip", "configuration": {"level": 1}}])
        for k in range(4):
            (p / f"tokens/c/{k}/0/0").write_bytes(h.gzip_zeros(big))
    elif variant == "lz4":  # a codec whose output is not bounded here
        meta = h.array_meta(p, "tokens")
        h.set_array(p, "tokens", codecs=[meta["codecs"][0], {"name": "numcodecs.lz4",
                                                             "configuration": {"acceleration": 1}}])
    elif variant == "teacher":  # the generated dataset's teacher heads declare many heads (manifest agreeing)
        for name in ("teacher/V", "teacher/Q"):
            shape = (big // 64, 2, 2)
            h.bomb(p, name, shape)
            h.set_manifest_shape(p, name, shape)
    elif variant in ("v2-frame", "v2-gzip"):  # another tool's zarr v2 store, whose decoders get no chunk size
        from numcodecs import GZip, Zstd

        shutil.rmtree(p)
        g = zarr.open_group(str(p), mode="w", zarr_format=2)
        for name in ("tokens", "targets"):
            g.create_array(name, data=np.ones((32, 6, 2)), chunks=(8, 6, 2),
                           compressors=Zstd() if variant == "v2-frame" else GZip())
        (p / "tokens" / "1.0.0").write_bytes(h.zstd_zeros(big) if variant == "v2-frame" else h.gzip_zeros(big))
    elif variant == "grid":  # another tool's store: 10^12 samples in chunks of 1 (the grid, not the data, is huge)
        foreign(p, np.ones((4, 6, 2)), np.ones((4, 6, 2)), chunk=1)
        h.set_array(p, "tokens", shape=(10**12, 6, 2))
        h.set_array(p, "targets", shape=(10**12, 6, 2))
    return p


DATASET_VARIANTS = ["chunks", "frame", "blosc", "gzip", "lz4", "teacher", "grid", "v2-frame", "v2-gzip"]
DATASET_MESSAGES = {"chunks": r"tokens .*chunks of shape \(699050, 6, 2\) hold 67,108,800 bytes",
                    "frame": r"tokens: cannot read samples \[0, 32\) .*zstd chunk would decompress to 67,108,864",
                    "blosc": r"tokens: cannot read samples \[0, 32\) .*blosc chunk would decompress to 2,147,483,648",
                    "gzip": r"tokens: cannot read samples \[0, 32\) .*gzip chunk inflates past",
                    "lz4": r"tokens .*codec 'numcodecs.lz4' decompresses without a bound",
                    "teacher": r"teacher/V .*shape \(1048576, 2, 2\) .* attributes mean \(1, 2, 2\)",
                    "grid": r"tokens in .*implies 1,000,000,000,000 chunks, the store holds 4",
                    "v2-frame": r"tokens: cannot read samples .*the zstd chunk '1.0.0' would decompress to 67,108,864",
                    "v2-gzip": r"tokens in .*zarr v2 compressor 'gzip' not read"}


@pytest.mark.parametrize("variant", DATASET_VARIANTS)
def test_crafted_datasets_are_refused_before_decompressing(tmp_path, variant):
    from scaleattn.data._dataset import open_dataset

    p = _crafted_dataset(tmp_path, variant, MB64)
    with pytest.raises(ScaleattnError) as e:
        ds = open_dataset(str(p))
        ds.read(0, ds.n_samples)
    expect(str(e.value), DATASET_MESSAGES[variant])


# ---- the commands: one line, exit 2, and no large allocation (measured in a fresh interpreter) -------------------

def _run_dir(tmp_path, capsys):
    dataset(tmp_path / "d.zarr")
    rc, err = run_main(["fit", tmp_path / "d.zarr", "--out", tmp_path / "run", "--local", "--quiet", "--no-plots",
                        "--no-exact-mse"], capsys)
    assert rc == 0, err
    return tmp_path / "run"


def _limit(r: dict) -> None:
    grew = r["peak_mb"] - r["base_mb"]
    assert grew < 100, f"the reader grew by {grew:.0f} MB before refusing: {r['refused']}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_model_readers_refuse_gigabyte_bombs_without_allocating(tmp_path, variant):
    p = _crafted_model(tmp_path, variant, GB2)
    assert sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) < 300_000  # a store of KB
    r = h.probe(f"scaleattn.model.MHLAModel.load({str(p)!r})", imports="import scaleattn.model")
    assert r["refused"] and "checksum" not in r["refused"], r
    _limit(r)


@pytest.mark.slow
@pytest.mark.parametrize("variant", STATS_VARIANTS)
def test_statistics_readers_refuse_gigabyte_bombs_without_allocating(tmp_path, variant):
    p = _crafted_stats(tmp_path, variant, GB2)
    r = h.probe(f"scaleattn.Statistics.load({str(p)!r})")
    assert r["refused"] and "checksum" not in r["refused"], r
    _limit(r)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["evaluate", "compare"])
@pytest.mark.parametrize("variant", ["shape", "frame", "consistent-d"])
def test_evaluate_and_compare_refuse_a_crafted_model_in_one_line(tmp_path, command, variant):
    dataset(tmp_path / "d.zarr")
    data = tmp_path / "d.zarr"
    good = tmp_path / "good.zarr"
    _model().save(good)
    p = _crafted_model(tmp_path, variant, GB2)
    args = [command, p, data] if command == "evaluate" else [command, good, p]
    r = h.cli_probe(*map(str, args))
    assert r["exit"] == 2 or r.get("refused"), r
    line = error_line(r["stderr"])
    expect(line, rf"scaleattn {command}: error: .*{p.name}")
    assert "checksum" not in line
    _limit(r)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["frame", "blosc", "teacher", "chunks", "v2-frame"])
def test_evaluate_refuses_a_crafted_dataset_in_one_line(tmp_path, variant):
    good = tmp_path / "good.zarr"
    _model().save(good)
    p = _crafted_dataset(tmp_path, variant, GB2)
    r = h.cli_probe("evaluate", str(good), str(p))
    assert r["exit"] == 2, r
    expect(error_line(r["stderr"]), DATASET_MESSAGES[variant].replace("67,108,864", "2,147,483,648")
           .replace(r"\[0, 32\)", r"\[\d+, \d+\)")
           .replace("699050", "22369621").replace("67,108,800", "2,147,483,616").replace("1048576", "33554432"))
    _limit(r)


@pytest.mark.slow
@pytest.mark.parametrize("store, variant", [("stats.zarr", "frame"), ("model.zarr", "chunks"),
                                            ("spectrum.zarr", "frame")])
def test_plot_of_a_run_with_a_crafted_store_refuses_without_allocating(tmp_path, capsys, store, variant):
    run = _run_dir(tmp_path, capsys)
    p = run / store
    first = {"stats.zarr": "gram_compact", "model.zarr": "coef", "spectrum.zarr": "eigenvalues"}[store]
    shape = zarr.open_group(str(p), mode="r")[first].shape
    if variant == "frame":
        h.bomb(p, first, shape, frame=h.zstd_zeros(GB2))
    else:
        h.bomb(p, first, shape, chunks=(GB2 // 8 // int(np.prod(shape[1:])),) + tuple(shape[1:]))
    if store == "stats.zarr":
        shutil.rmtree(run / "spectrum.zarr")  # so that plot recomputes the spectrum from the statistics
    r = h.cli_probe("plot", str(run))
    assert r["exit"] == 2, r
    expect(error_line(r["stderr"]), rf"scaleattn plot: error: .*{first}.*(zstd chunk would decompress|chunks of"
                                    " shape)")
    _limit(r)


@pytest.mark.parametrize("fmt", ["v2", "v3", "v3-own"])
@pytest.mark.parametrize("argv", [["certify", "--local"],
                                  ["fit", "--solver", "stream", "--out", "run", "--local", "--quiet", "--no-plots"]],
                         ids=["certify", "fit-stream"])
def test_a_chunk_dimension_of_zero_is_one_line(tmp_path, capsys, fmt, argv):
    """A chunk size of 0 in the metadata (zarr divides by it) is refused where the bounds check chunk shapes:
    one line, exit 2, naming the array and the chunk shape; not a ZeroDivisionError."""
    import json

    p = tmp_path / "z0.zarr"
    if fmt == "v2":
        g = zarr.open_group(str(p), mode="w", zarr_format=2)
        for name in ("tokens", "targets"):
            g.create_array(name, data=np.ones((32, 6, 2)), chunks=(8, 6, 2), compressors=None)
        za = p / "tokens" / ".zarray"
        m = json.loads(za.read_text())
        m["chunks"] = [0, 5, 3]
        za.write_text(json.dumps(m))
        shape = r"\(0, 5, 3\)"
    else:
        (dataset if fmt == "v3-own" else lambda q: foreign(q, np.ones((32, 6, 2)), np.ones((32, 6, 2))))(p)
        h.set_array(p, "tokens", chunks=(0, 6, 2))
        shape = r"\(0, 6, 2\)"
    rc, err = run_main([argv[0], p, *argv[1:]], capsys, cwd=tmp_path)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    expect(error_line(err), rf"tokens in .*z0.zarr: chunks of shape {shape} .*every dimension of a chunk must be >= 1")
