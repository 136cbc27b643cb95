"""What an output's name may be, checked before anything is written, for every output: a legal but long name
(250 characters) failed half-way with "File name too long" naming an internal ``.NAME.partial-XXXXXXXX``
temporary or lock; a newline in a path was accepted and broke every later line naming it in two."""
from __future__ import annotations

import os

import numpy as np
import pytest

from scaleattn.errors import UnsafeOutputError
from scaleattn.store._location import resolve
from scaleattn.store._names import ADDED, COMPANIONS, check_output_name, name_max, one_line

from .conftest import FIT, Inputs, dataset, error_line, expect, run_main
from .test_output_places import _argvs


@pytest.fixture
def inputs(tmp_path, capsys):
    dataset(tmp_path / "d.zarr")
    tok = np.random.default_rng(0).standard_normal((4, 3, 2))
    np.savez(tmp_path / "a.npz", tokens=tok, targets=tok[:, -1])
    rc, err = run_main(["fit", "d.zarr", "--out", "run0", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    return Inputs(tmp_path / "d.zarr", tmp_path / "run0", tmp_path / "a.npz")


def _refused_everywhere(tmp_path, capsys, inputs, name, pattern):
    listing = sorted(os.listdir(tmp_path))
    for role, argv in _argvs(name):
        rc, err = run_main(argv, capsys, cwd=tmp_path)
        assert rc == 2, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
        expect(error_line(err), rf"{role} \S+: {pattern}")
        assert sorted(os.listdir(tmp_path)) == listing, argv  # no lock, temporary or folder left
    inputs.unchanged()


def test_a_name_too_long_for_the_lock_and_temporaries_is_refused_up_front(tmp_path, capsys, inputs):
    limit = name_max(resolve(str(tmp_path / "x")))
    name = "a" * (limit - 5)
    _refused_everywhere(tmp_path, capsys, inputs, name,
                        rf"the name is {limit - 5} bytes long, {ADDED - 5} too many: scaleattn keeps names up to"
                        rf" {ADDED} bytes longer next to it .* choose a name of at most {limit - ADDED} bytes")


def test_the_longest_name_allowed_is_written_with_all_its_companions(tmp_path, capsys):
    limit = name_max(resolve(str(tmp_path / "x")))
    name = "b" * (limit - ADDED)
    assert all(len(c.format(name)) <= limit for c in COMPANIONS)
    rc, err = run_main(["generate", "mhla", name, "--samples", "4", "--length", "3"], capsys, cwd=tmp_path)
    assert rc == 0, err
    rc, err = run_main(["generate", "mhla", name, "--samples", "4", "--length", "3", "--overwrite"], capsys,
                       cwd=tmp_path)
    assert rc == 0, err


def test_the_default_checkpoint_is_named_as_such(tmp_path, capsys, inputs):
    """``--out`` fits, ``OUT.checkpoint.zarr`` (16 more) does not: said of the checkpoint, the way round named."""
    limit = name_max(resolve(str(tmp_path / "x")))
    rc, err = run_main(["fit", "d.zarr", "--out", "c" * (limit - ADDED - 1), *FIT], capsys, cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), r"the default --checkpoint \S+\.checkpoint\.zarr: the name is \d+ bytes long, 15 too many")
    # (its name follows --out's: it advised 'a name of at most 223 bytes', which --out already was)
    assert error_line(err).endswith(f"choose an --out name of at most {limit - ADDED - 16} bytes, or --checkpoint"
                                    " PATH"), err


def test_library_writers_check_the_name_too(tmp_path):
    from scaleattn.model import MHLAModel

    model = MHLAModel(np.zeros((6, 2)), np.zeros((1, 2, 2)), np.zeros((1, 2, 2)), 2)
    with pytest.raises(UnsafeOutputError, match=r"output \S+: the name is 250 bytes long"):
        model.save(str(tmp_path / ("m" * 250)))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name", ["x\ny.zarr", "x\ty", "x\x1b[31my", "x\ry", "x\u2028y"])
def test_control_characters_in_an_output_path_are_refused_in_one_line(tmp_path, capsys, inputs, name):
    _refused_everywhere(tmp_path, capsys, inputs, name, r"the path holds the control character \\")


def test_an_input_path_with_a_newline_is_named_in_one_line(tmp_path, capsys):
    rc, err = run_main(["fit", "no\nsuch.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    expect(error_line(err), r"no\\nsuch\.zarr")


def test_one_line_and_the_check():
    assert one_line("a\nb\x00c\u2028") == "a\\nb\\x00c\\u2028" and one_line("plain é") == "plain é"
    with pytest.raises(UnsafeOutputError, match=r"--out s3://b/x\\ny: the path holds the control character \\n"):
        check_output_name(resolve("s3://b/x\ny"), "--out")
    check_output_name(resolve("s3://b/" + "k" * (255 - ADDED)), "--out")


@pytest.mark.parametrize("prefix", ["s3://bucket/", "gs://bucket/runs/2026/", "simplecache::s3://bucket/a/"])
def test_object_stores_limit_the_whole_key_not_the_name(prefix):
    """S3, GCS and Azure keys have no folders: a name may be longer than a file system's 255 bytes, as long as the
    whole key (its prefix, the name with the companions' ``ADDED`` bytes, the keys inside) stays within 1,024."""
    from scaleattn.store._names import INNER, KEY_MAX

    parent = prefix.split("::")[-1].split("://", 1)[1].partition("/")[2].rstrip("/")
    longest = KEY_MAX - INNER - len(parent) - bool(parent) - ADDED  # (bytes; ASCII names)
    assert longest > 255
    check_output_name(resolve(prefix + "n" * longest))
    with pytest.raises(UnsafeOutputError, match=rf"the name is {longest + 1} bytes long, 1 too many: .* the object"
                                                rf" store's keys take at most {KEY_MAX} bytes.* choose a name of at"
                                                rf" most {longest} bytes"):
        check_output_name(resolve(prefix + "n" * (longest + 1)))
    # another URL keeps the usual 255 bytes a name (HDFS's default limit of a path component)
    with pytest.raises(UnsafeOutputError, match=r"the file system takes at most 255"):
        check_output_name(resolve("hdfs://host/data/" + "n" * 240))


def test_an_object_store_folder_that_leaves_no_room_says_so():
    """A key prefix so long that no name fits said 'choose a name of at most -17 bytes'."""
    with pytest.raises(UnsafeOutputError, match=r"its folder's prefix leaves no room for a name: choose a shorter"
                                                r" folder \(at most \d+ bytes\)$") as e:
        check_output_name(resolve("s3://b/" + "a" * 880 + "/run"), "--out")
    assert "at most -" not in str(e.value)
    # the default checkpoint (OUT.checkpoint.zarr, 16 bytes more) of an out that fits there: no negative advice
    from scaleattn.preflight import _check_default_checkpoint_name

    with pytest.raises(UnsafeOutputError, match=r"choose a shorter folder for `out`, or `checkpoint=PATH`$") as e:
        _check_default_checkpoint_name(resolve("s3://b/" + "a" * 850 + "/r.checkpoint.zarr"))
    assert "at most -" not in str(e.value)
