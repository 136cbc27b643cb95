"""Every name ``scaleattn`` exports has a numpydoc docstring with its sections, and its examples run and print
what they say (doctest, in a fresh directory)."""
import doctest
import inspect

import pytest

import scaleattn

numpydoc = pytest.importorskip("numpydoc.docscrape", reason="numpydoc parses the docstrings")

NAMES = [n for n in scaleattn.__all__ if n != "__version__"]


def _doc(obj):
    return numpydoc.ClassDoc(obj) if inspect.isclass(obj) else numpydoc.FunctionDoc(obj)


@pytest.mark.parametrize("name", NAMES)
def test_numpydoc_sections(name):
    obj = getattr(scaleattn, name)
    doc = _doc(obj)
    if inspect.isclass(obj) and issubclass(obj, Exception):
        need = ["Examples"]
    elif inspect.isclass(obj):
        need = ["See Also", "Examples"]
        assert doc["Parameters"] or doc["Attributes"], f"{name}: no Parameters or Attributes section"
    else:
        need = ["Parameters", "Returns", "Raises", "See Also", "Examples"]
    missing = [s for s in need if not doc[s] and not (s == "Returns" and doc["Yields"])]  # (a generator yields)
    assert not missing, f"{name}: missing numpydoc sections {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples write small stores next to them
    obj = getattr(scaleattn, name)
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs = {**vars(inspect.getmodule(obj)), "scaleattn": scaleattn}  # as the module's own docstrings see it
    tests = [t for t in finder.find(obj, name, globs=globs) if t.examples]
    assert tests, f"{name}: no example"
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{name}: {runner.failures} example(s) printed something else"
