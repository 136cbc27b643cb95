"""The notebooks under notebooks/ run top to bottom (nbclient, kernel python3, small sizes) and are committed
executed, in order, without error outputs. Each notebook asserts its own results in its cells (an assert that
fails is an error output); the test also checks the printed text and the HTML cards it must show."""
import importlib.util
import json
import os

import pytest

NB_DIR = os.path.join(os.path.dirname(__file__), "..", "notebooks")
NOTEBOOKS = ["quickstart", "identifiability", "real_data", "scaling", "baselines"]
#: optional packages a notebook needs (the notebook is skipped, saying so, without them)
NEEDS = {"baselines": ["torch"], "real_data": ["sklearn"]}
CELL_TIMEOUT_S = 300
#: text each notebook must print when it runs correctly (values that could be wrong, not just "no error")
EXPECT = {
    "quickstart": ["verdict: IDENTIFIABLE, minimal heads: 2", "certificate: IDENTIFIABLE", "spectrum.png"],
    "identifiability": ["Gaussian keys    lambda_min 0.0", "ambiguous dimension 12  identifiable False"],
    "real_data": ["N=1797 T=7 d=8 d_out=8", "rank 217", "test MSE  MHLA"],
    "scaling": ["d=8 N=  4000 psi= 288", "compact / dense Gram memory at d = 64: 0.25"],
    "baselines": ["notebook compute:"],
}
#: HTML each notebook must render: the cards of its results (scaleattn.display._text) and the live progress lines
HTML = {
    "quickstart": ['class="scaleattn-fit"', 'data-verdict="identifiable"', 'class="scaleattn-spectrum"',
                   'class="scaleattn-progress" data-name="statistics"', "rows/s", "16/16 groups",
                   'scaleattn-card scaleattn-model', 'scaleattn-card scaleattn-statistics'],
    "identifiability": ['data-verdict="not-identifiable"', "largest dropped"],
    "real_data": ['class="scaleattn-fit"', 'data-verdict="not-identifiable"', "scaleattn-witness"],
    "scaling": [],
    "baselines": [],
}


def _needs(name):
    missing = [m for m in NEEDS.get(name, []) if importlib.util.find_spec(m) is None]
    if missing:
        extras = sorted({"torch" if m == "torch" else "data" for m in missing})
        pytest.skip(f"{name}.ipynb needs {', '.join(missing)} (pip install -e '.[{','.join(extras)}]')")


def _joined(v):
    return "".join(v) if isinstance(v, list) else v  # the .ipynb JSON may split strings into lists of lines


def _read(path) -> dict:
    """A notebook file as plain JSON (nbformat 4), strings joined: nbformat itself takes 5 s to import here,
    and only the slow test that runs the notebooks needs it."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    assert nb["nbformat"] == 4, f"{path}: nbformat {nb['nbformat']}"
    for c in nb["cells"]:
        c["source"] = _joined(c["source"])
        for o in c.get("outputs", []):
            if "text" in o:
                o["text"] = _joined(o["text"])
            o["data"] = {k: _joined(v) for k, v in o.get("data", {}).items()}
    return nb


def _text(nb) -> str:
    out = []
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") or o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def _html(nb) -> str:
    return "\n".join(o.get("data", {}).get("text/html", "") for c in nb["cells"] for o in c.get("outputs", []))


def _errors(nb):
    return [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb["cells"])
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def _check_outputs(name, nb, what):
    assert not _errors(nb), f"{name}: {_errors(nb)}"
    text, html = _text(nb), _html(nb)
    for s in EXPECT[name]:
        assert s in text, f"{name}: {what} outputs lack {s!r}"
    for s in HTML[name]:
        assert s in html, f"{name}: {what} outputs lack the HTML {s!r}"


def test_every_notebook_is_listed():
    assert sorted(NOTEBOOKS) == sorted(f[:-6] for f in os.listdir(NB_DIR) if f.endswith(".ipynb"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_executed_without_errors(name):
    nb = _read(os.path.join(NB_DIR, f"{name}.ipynb"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), "stale or partial run"
    _check_outputs(name, nb, "committed")
    assert any("assert " in c["source"] for c in code), f"{name}: the notebook must assert its results"
    if any("Figure" in c["source"] or "figs[" in c["source"] for c in code):
        pngs = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        assert pngs, f"{name}: figures were not rendered"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _needs(name)
    nb = nbformat.read(os.path.join(NB_DIR, f"{name}.ipynb"), as_version=4)
    nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, tmp_path / "executed.ipynb")  # checked as the committed ones are: the same JSON reader
    _check_outputs(name, _read(tmp_path / "executed.ipynb"), "fresh")
