"""A mistyped command, followed by options or not, is named with its did-you-mean; an option of other commands is
said to be theirs, never matched to a look-alike of the command's own (``certify --out`` is not ``--quiet``)."""
import pytest


@pytest.mark.parametrize("argv, typo, meant", [
    (["fitt", "data.zarr", "--out", "r1"], "fitt", "fit"),
    (["fitt", "data.zarr"], "fitt", "fit"),
    (["--debug", "certfy", "data.zarr", "--local", "--quiet"], "certfy", "certify"),
    (["evalute", "m.zarr", "d.zarr", "--storage-option", "a=b"], "evalute", "evaluate"),
    (["generate", "mhlaa", "x.zarr", "--d", "3", "--seed", "1"], "mhlaa", "mhla"),
])
def test_mistyped_command_with_options_is_named(cli, argv, typo, meant):
    r = cli(*argv, rc=2)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and f"invalid choice: '{typo}'" in line, line
    assert f"(did you mean '{meant}'?)" in line and "put it after the command" not in line, line


def test_misplaced_option_before_a_right_command_is_still_said(cli):
    line = cli("--local", "fit", "data.zarr", rc=2).stderr
    assert "--local is an option of the commands (fit, certify, evaluate): put it after the command" in line


@pytest.mark.parametrize("argv, want", [
    (["certify", "d.zarr", "--out", "r1"], "--out is an option of the commands (fit, plot, bench, submit), not of"
                                           " scaleattn certify"),
    (["certify", "d.zarr", "--outt", "r1"], "did you mean --out? --out is an option of the commands"),
    (["fit", "d.zarr", "--out", "r1", "--pairs", "2"], "--pairs is an option of the command (generate assoc), not"
                                                       " of scaleattn fit"),
    (["fit", "d.zarr", "--out", "r1", "--hedas", "2"], "(did you mean --heads?)"),
])
def test_an_option_of_other_commands_is_said_to_be_theirs(cli, argv, want):
    line = cli(*argv, rc=2).stderr
    assert want in line and "--quiet" not in line, line
