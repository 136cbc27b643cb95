"""Real data: the built-in digits dataset imports with its shape and fits with a real error and a failed
certificate. Imports of files: values the features cannot hold, and errors that name the file."""
import re

import pytest

from scaleattn.pipeline import fit


@pytest.mark.slow
def test_real_digits_dataset(tmp_path):
    from scaleattn.importers import load_digits_dataset

    ds = load_digits_dataset(tmp_path / "digits.zarr")
    res = fit(ds)
    assert ds.n_samples == 1797 and ds.d == 8 and ds.d_out == 8
    # real data: a real error (about 0.10 of mean y^2) and a failed certificate: the first pixel column of
    # the digits is almost always blank, so some cubic features never vary
    assert 0.05 < res.report["relative_train_mse"] < 0.2
    assert res.report["psi"] == 288 and not res.report["identifiable"] and 150 < res.report["rank"] < 288


def _csv(path, big):
    rows = [f"{2 * i + 1},{2 * i + 2}" for i in range(11)]
    rows[1] = f"3,{big}"  # line 3 of the file (after the header)
    path.write_text("a,b\n" + "\n".join(rows) + "\n")
    return path


def test_csv_with_huge_values_is_standardised_without_overflow(tmp_path):
    """std of a column holding 1e200 overflowed to inf and the whole column became 0 (rc 0, a RuntimeWarning)."""
    import warnings

    import numpy as np

    from scaleattn.importers import import_csv

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (column 'a', 1, 3, ..., 21, is warned of as a time index)
        ds = import_csv(tmp_path / "c.zarr", _csv(tmp_path / "s.csv", "1e200"), length=4)
    tok, _, y = ds.read(0, ds.n_samples)
    assert np.isfinite(tok).all() and np.ptp(tok[:, :, 1]) > 1  # the column kept (z-scores), not zeroed
    np.testing.assert_allclose(tok[0, 1, 1], np.sqrt(10), rtol=1e-12)  # 1e200 among 10 small: z = sqrt(n - 1)


def test_csv_standardisation_is_said_and_reversible(tmp_path, cli):
    """The CSV import z-scored every column silently and kept no units: a fit's predictions could not be mapped
    back. The columns' means and stds are now in the attribute ``standardized`` (value * std + mean gives the
    file's values back), the CLI says so in a note, and ``--no-standardize`` keeps the file's units."""
    import numpy as np
    import zarr

    from scaleattn.data._dataset import open_dataset

    rng = np.random.default_rng(0)
    x = np.column_stack([10 + 3 * rng.standard_normal(40), 1e-3 * rng.standard_normal(40)])
    (tmp_path / "s.csv").write_text("a,b\n" + "".join(f"{a!r},{b!r}\n" for a, b in x.tolist()))
    err = cli("import", tmp_path / "z.zarr", "--csv", tmp_path / "s.csv", "--length", "4").stderr
    assert "scaleattn import: note: each column was z-scored" in err and "--no-standardize" in err, err
    m = zarr.open_group(str(tmp_path / "z.zarr"), mode="r").attrs["standardized"]
    np.testing.assert_allclose(m["mean"], x.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(m["std"], x.std(axis=0), rtol=1e-13)
    ds = open_dataset(tmp_path / "z.zarr")
    tok = ds.read(0, ds.n_samples)[0]
    np.testing.assert_allclose(tok[:, 0] * m["std"] + m["mean"], x[: ds.n_samples], rtol=1e-13)
    err = cli("import", tmp_path / "r.zarr", "--csv", tmp_path / "s.csv", "--length", "4", "--no-standardize").stderr
    assert "note" not in err, err
    raw = open_dataset(tmp_path / "r.zarr")
    np.testing.assert_array_equal(raw.read(0, raw.n_samples)[0][:, 0], x[: raw.n_samples])
    assert "standardized" not in dict(zarr.open_group(str(tmp_path / "r.zarr"), mode="r").attrs)


def test_unstandardised_csv_values_the_features_cannot_hold_are_refused(tmp_path):
    from scaleattn.errors import DatasetError
    from scaleattn.importers import import_csv

    with pytest.raises(DatasetError, match=r"s\.csv: line 3, column 'b': 1\.0e\+200 is beyond \|value\| <= 1e\+38"):
        import_csv(tmp_path / "c.zarr", _csv(tmp_path / "s.csv", "1e200"), length=4, standardize_columns=False)
    assert not (tmp_path / "c.zarr").exists()
    (tmp_path / "t.csv").write_text("a,b\n" + "".join(f"{i}e-60,{i + 1}e-60\n" for i in range(1, 12)))
    with pytest.raises(DatasetError, match=r"t\.csv: tokens: sample 0 has values of magnitude at most 3\.0e-60"):
        import_csv(tmp_path / "c.zarr", tmp_path / "t.csv", length=2, standardize_columns=False)


def test_npz_import_errors_name_the_file(tmp_path, capsys):
    import numpy as np

    from scaleattn.cli import main

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "tiny.npz", tokens=rng.standard_normal((20, 4, 2)) * 1e-60, targets=np.ones((20, 2)))
    tok = rng.standard_normal((20, 4, 2))
    tok[3, 1, 0] = np.nan
    np.savez(tmp_path / "nan.npz", tokens=tok, targets=np.ones((20, 2)))
    for name, what in (("tiny.npz", r"tokens: sample 0 has values of magnitude at most 1\.\de-60: its degree-6"
                                    r" features near the underflow of float64 .*multiply them by 1e60\)$"),
                       ("nan.npz", r"tokens: sample 3 contains NaN or Inf")):
        capsys.readouterr()
        assert main(["import", str(tmp_path / "out.zarr"), "--npz", str(tmp_path / name)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert re.match(rf"scaleattn import: error: \S*{name}: {what}", line), line
        assert not (tmp_path / "out.zarr").exists()


@pytest.mark.parametrize("raw", [False, True], ids=["z-scored", "no-standardize"])
def test_a_constant_csv_column_is_refused_naming_the_others(tmp_path, cli, raw):
    """A constant column became all zeros once z-scored (kept as is with --no-standardize): a token coordinate
    that never varies, so no fit of the dataset could be identifiable. Refused either way, naming the column and
    the --columns that leaves it out; nothing written."""
    (tmp_path / "s.csv").write_text("a,b,c\n" + "".join(f"{i},5,{i * i % 7}\n" for i in range(12)))
    r = cli("import", tmp_path / "z.zarr", "--csv", tmp_path / "s.csv", "--length", "3",
            *(["--no-standardize"] if raw else []), rc=2)
    assert r.stderr.strip().splitlines() == [
        f"scaleattn import: error: {tmp_path / 's.csv'}: column 'b' is constant (5 on every line): it carries nothing"
        " to learn from and makes the fit unidentifiable; import the others only: --columns a c"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv"]
    cli("import", tmp_path / "z.zarr", "--csv", tmp_path / "s.csv", "--length", "3", "--columns", "a", "c")


def test_a_non_numeric_csv_column_names_the_numeric_ones(tmp_path, cli):
    from scaleattn.errors import DatasetError
    from scaleattn.importers import import_csv

    (tmp_path / "s.csv").write_text("date,x,note,y\n" + "".join(f"2024-01-{i + 1:02},{i},n,{i % 3}\n"
                                                                    for i in range(9)))
    r = cli("import", tmp_path / "z.zarr", "--csv", tmp_path / "s.csv", "--length", "3", rc=2)
    assert r.stderr.strip().endswith("line 2, column 'date': '2024-01-01' is not a number; import the numeric columns"
                                     " only: --columns x y"), r.stderr
    with pytest.raises(DatasetError, match=r"is not a number; import the numeric columns only: `columns=x y`"):
        import_csv(tmp_path / "z.zarr", tmp_path / "s.csv", length=3)
    assert not (tmp_path / "z.zarr").exists()


@pytest.mark.parametrize("step", [1, 5], ids=["as-target", "skipped-by-step"])
def test_a_csv_column_constant_in_every_windows_tokens_is_refused(tmp_path, step):
    """A column varying only at a line the windows read as a target (the last line) or skip (``step``) passed
    the constant check, made on the series: every token held it at one value, and the fit was unidentifiable."""
    from scaleattn.errors import DatasetError
    from scaleattn.importers import import_csv

    a = ["1"] * 21
    a[20 if step == 1 else 7] = "2"  # (step 5, length 2: the windows' tokens are lines 0-1, 5-6, 10-11, 15-16)
    (tmp_path / "s.csv").write_text("a,b\n" + "".join(f"{v},{i * i % 7}\n" for i, v in enumerate(a)))
    with pytest.raises(DatasetError, match=r"s\.csv: column 'a' is constant \(1 in every window's tokens; it varies"
                                           r" only at lines read as targets or skipped by the step\).*`columns=b`"):
        import_csv(tmp_path / "z.zarr", tmp_path / "s.csv", length=2, step=step)
    assert not (tmp_path / "z.zarr").exists()


def test_csv_shape_problems_are_said_as_such(tmp_path, cli):
    """A ';'-separated file read as one column said its first value 'is not a number' (naming a column 'a;b');
    a one-line series was 'constant' in every column, and a short one was too short with no file named."""
    p = tmp_path / "s.csv"
    p.write_text("a;b\n1,5;2\n2,5;3\n")
    r = cli("import", tmp_path / "z.zarr", "--csv", p, "--length", "1", rc=2)
    assert r.stderr.strip() == (f"scaleattn import: error: {p}: the header is one column 'a;b': the file looks"
                                " ';'-separated, and a CSV file's values are separated by commas; save it with commas")
    p.write_text("a,b\n1,2\n")
    r = cli("import", tmp_path / "z.zarr", "--csv", p, "--length", "4", rc=2)
    assert r.stderr.strip() == (f"scaleattn import: error: {p}: series of 1 steps is too short for one window of"
                                " --length 4 + --horizon 1"), r.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["s.csv"]


def test_a_csv_column_whose_std_underflows_is_refused(tmp_path):
    """A column of 0 and 5e-324 was stored with std 0 (its std, 2.5e-324, is below float64's subnormals): the
    attribute ``standardized`` claimed a mapping back that gave 0 for every value."""
    from scaleattn.errors import DatasetError
    from scaleattn.importers import import_csv

    (tmp_path / "s.csv").write_text("a,b\n" + "".join(f"{5e-324 * (i % 2)!r},{i * i % 7}\n" for i in range(12)))
    with pytest.raises(DatasetError, match=r"column 'a': its standard deviation \(0\.0e\+00\) is below float64's"
                                           r" normal range"):
        import_csv(tmp_path / "z.zarr", tmp_path / "s.csv", length=2)
    assert not (tmp_path / "z.zarr").exists()


def test_csv_columns_are_named_as_the_header_is(tmp_path):
    """``--columns " b "`` was refused as unknown (the header's names are stripped, these were not), and the API's
    ``columns="b"`` was read as the columns 'b' letter by letter: one name is one column."""
    import numpy as np

    from scaleattn.importers import import_csv

    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 2))
    (tmp_path / "s.csv").write_text("a, b\n" + "".join(f"{p!r},{q!r}\n" for p, q in x.tolist()))
    for i, columns in enumerate([" b ", ["b "], "b"]):
        ds = import_csv(tmp_path / f"c{i}.zarr", tmp_path / "s.csv", length=3, columns=columns,
                        standardize_columns=False)
        tok = ds.read(0, ds.n_samples)[0]
        assert tok.shape[-1] == 1
        np.testing.assert_array_equal(tok[:, 0, 0], x[: ds.n_samples, 1])
