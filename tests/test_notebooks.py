"""The notebooks under notebooks/ run top to bottom (nbclient, kernel python3, small sizes) and are committed
executed, in order, without error outputs."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NB_DIR = os.path.join(os.path.dirname(__file__), "..", "notebooks")
NOTEBOOKS = ["quickstart", "identifiability", "real_data", "scaling"]
CELL_TIMEOUT_S = 180
#: text each notebook must print when it runs correctly (values that could be wrong, not just "no error")
EXPECT = {
    "quickstart": ["certificate: IDENTIFIABLE", "minimal heads: 2", "spectrum.png"],
    "identifiability": ["Gaussian keys    lambda_min 0.0", "ambiguous dimension 12  identifiable False"],
    "real_data": ["N=1797 T=7 d=8 d_out=8", "test MSE  MHLA"],
    "scaling": ["d=6 N= 1000 psi= 126"],
}


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") or o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def _errors(nb):
    return [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb.cells)
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_executed_without_errors(name):
    nb = nbformat.read(os.path.join(NB_DIR, f"{name}.ipynb"), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and [c.execution_count for c in code] == list(range(1, len(code) + 1)), "stale or partial run"
    assert not _errors(nb)
    text = _text(nb)
    for s in EXPECT[name]:
        assert s in text, f"{name}: committed outputs lack {s!r}"
    if any("Figure" in (c.source) or "figs[" in c.source for c in code):
        pngs = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        assert pngs, f"{name}: figures were not rendered"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path):
    nb = nbformat.read(os.path.join(NB_DIR, f"{name}.ipynb"), as_version=4)
    nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert not _errors(nb)
    text = _text(nb)
    for s in EXPECT[name]:
        assert s in text, f"{name}: output lacks {s!r}"
