"""Every place that lists the bench suites names the same ones as :data:`scaleattn.bench.SUITES` (the CLI's
top-level help once left out krylov and solve, the README's short list solve)."""
import importlib
import re
from pathlib import Path

from scaleattn.bench import SUITES, VERSUS

ROOT = Path(__file__).resolve().parents[2]


def test_every_suite_has_a_run():
    for module, _ in (*SUITES.values(), *VERSUS.values()):
        assert callable(importlib.import_module(module).run), module


def test_the_cli_help_names_every_suite(cli):
    top = re.sub(r"\s+", " ", cli("--help").stdout)
    bench = re.sub(r"\s+", " ", cli("bench", "--help").stdout)
    for name in SUITES:
        assert re.search(rf"\b{name}\b", top.split("bench", 1)[1]), name
        assert f"{name}:" in bench, name
    assert "--vs adamw" in top


def test_the_docs_list_every_suite():
    readme = (ROOT / "README.md").read_text()
    lists = re.findall(r"scaleattn bench \[([a-z|]+)\]", readme)
    assert lists and all(lst.split("|") == list(SUITES) for lst in lists), lists
    perf = (ROOT / "docs" / "performance.md").read_text().split("```")[1]  # the commands at the top
    named = set(re.findall(r"^scaleattn bench ([a-z]+)", perf, re.M))
    assert named == set(SUITES) - {next(iter(SUITES))}  # (the default one runs as `scaleattn bench`)
