"""Every name ``scaleattn`` exports has a numpydoc docstring with its sections, and its examples run and print
what they say (doctest, in a fresh directory). So do the public names (``__all__``) of the modules in
``MODULES``, with Parameters, Returns and Examples (classes: Examples and Parameters or Attributes); Raises and
See Also are required only of the top-level names."""
import doctest
import importlib
import inspect

import pytest

import scaleattn

numpydoc = pytest.importorskip("numpydoc.docscrape", reason="numpydoc parses the docstrings")

NAMES = [n for n in scaleattn.__all__ if n != "__version__"]
#: modules whose public functions and classes are documented like the top level (constants such as
#: ``FEWER_HEADS_RTOL`` have no docstring of their own)
MODULES = ["scaleattn.tensor", "scaleattn.features", "scaleattn.heads._algebra"]
MODULE_NAMES = [f"{m}.{n}" for m in MODULES for n in importlib.import_module(m).__all__
                if callable(getattr(importlib.import_module(m), n))]


def _doc(obj):
    return numpydoc.ClassDoc(obj) if inspect.isclass(obj) else numpydoc.FunctionDoc(obj)


def _resolve(dotted):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _missing(doc, need):
    return [s for s in need if not doc[s] and not (s == "Returns" and doc["Yields"])]  # (a generator yields)


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
    missing = _missing(doc, need)
    assert not missing, f"{name}: missing numpydoc sections {missing}"


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_module_numpydoc_sections(name):
    obj = _resolve(name)
    doc = _doc(obj)
    if inspect.isclass(obj):
        need = ["Examples"]
        assert doc["Parameters"] or doc["Attributes"], f"{name}: no Parameters or Attributes section"
    else:
        need = ["Parameters", "Returns", "Examples"]
    missing = _missing(doc, need)
    assert not missing, f"{name}: missing numpydoc sections {missing}"


def _run_examples(name, obj):
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs = {**vars(inspect.getmodule(obj)), "scaleattn": scaleattn}  # as the module's own docstrings see it
    tests = [t for t in finder.find(obj, name, globs=globs) if t.examples]
    assert tests, f"{name}: no example"
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{name}: {runner.failures} example(s) printed something else"


@pytest.mark.parametrize("name", NAMES)
def test_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples write small stores next to them
    _run_examples(name, getattr(scaleattn, name))


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_module_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run_examples(name, _resolve(name))
