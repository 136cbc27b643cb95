"""The layer contract of the package (ARCHITECTURE.md), checked on the source: the root's entries (modules and
folders) in one order, and a short order of the modules inside each folder; every import of a scaleattn module,
at module or function level, points to an entry earlier in the order (or, inside a folder, to a module earlier in
the folder's order); no cycles; lazy imports of siblings only in the CLI and the benchmarks; ``__all__`` in every
public module; a module past ~1,000 lines says in its docstring why it is one idea. A new module must be placed in
``ORDER`` (one line: where it belongs)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "scaleattn"

#: the root's entries, bottom up: an entry may import only entries listed before it. A folder lists its modules
#: bottom up (its face, ``__init__``, last: it re-exports them); a module of a folder may import the modules of
#: its folder listed before it.
ORDER = [
    # base: no scaleattn imports but these
    ("_version", []), ("errors", []), ("_params", []), ("_backend", []),
    ("_testing", []),  # the two fault injections an injected callback cannot reach (Dask workers, the store read)
    ("_startup", []),  # imported first by the package root: the scaleattn command's Ctrl-C while the package imports
    ("_jit", []),  # numba's options and the host's full vector width, for the compiled kernels
    ("_tree", []),  # the fixed-order tree reduction: the cluster's and the in-process sums (same bits)
    # tensor attention: base only
    ("tensor", ["_common", "exact", "bounds", "poly", "weights"]),
    ("store", ["_formats", "_bounds", "_location", "_names", "_integrity", "_locks", "_outputs"]),
    ("display", ["_text", "_html", "_progress", "_figures"]),
    ("features", []),
    ("data", ["_checks", "_dataset", "_writer"]),
    ("statistics", ["_compiled", "_kernel", "_container"]),
    ("linalg", ["_gram_compiled", "_kfac", "_gram", "_lanczos", "_dense", "_spectrum", "_certificate", "_krylov",
                "_passes", "_stream", "_solver", "_qr"]),
    ("heads", ["_algebra", "_fit", "_bounds", "_search"]),
    ("model", []),
    ("distributed", ["reduction", "partition", "checkpoint", "journal", "memory", "build", "operator", "stream",
                     "evaluate", "tsqr", "cluster"]),
    ("run", []), ("preflight", []), ("plot", []), ("pipeline", []),
    ("estimator", []), ("importers", []), ("generate", []),
    ("submit", ["manifest", "follow", "command"]),
    ("baselines", ["models", "training", "paper"]),
    ("bench", ["workers", "build", "solve", "core", "certified", "tensor", "krylov", "stream", "gpu", "adamw"]),
    ("cli", ["parser", "commands", "__main__"]),  # (__main__ runs the face: after it)
    ("__main__", []),
]
ENTRY = {name: i for i, (name, _) in enumerate(ORDER)}
INNER = {f"{name}.{m}": j for name, mods in ORDER for j, m in enumerate(mods)}
CONTRACT = [m for name, mods in ORDER for m in ([name] if not mods else [f"{name}.{x}" for x in mods] + [name])]
BASE = {name for name, _ in ORDER[:ENTRY["tensor"]]}
LAZY_OK = ("cli", "bench")  # (cli.*, bench.* too)  # CLI start-up time; benchmarks import what each suite needs


def _allowed(m: str, t: str) -> bool:
    """May module ``m`` import module ``t``?"""
    em, et = ENTRY[m.split(".")[0]], ENTRY[t.split(".")[0]]
    if em != et:
        return et < em
    if "." not in m:  # a folder's face imports its own modules
        return "." in t
    if m.endswith(".__main__"):  # ``python -m scaleattn.cli`` runs the face
        return True
    return "." in t and INNER[t] < INNER[m]


def _modules():
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: pathlib.Path, mods) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import of a scaleattn module."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    funcs = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("scaleattn.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("scaleattn"):
                    continue
                base = (node.module or "").split(".")[1:]
            else:
                base = (pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg) + (
                    node.module.split(".") if node.module else [])
            named = [".".join(base + [a.name]) for a in node.names]
            # ``from . import _x``: the modules named, not the folder's face
            targets = named if all(t in mods for t in named) else named + [".".join(base)]
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.append((t, node.lineno, id(node) in funcs))
    return found


MODS = _modules()
EDGES = {m: _imports(m, p, MODS) for m, p in MODS.items() if m}


def test_every_module_is_placed_in_the_contract():
    assert sorted(set(MODS) - set(CONTRACT) - {""}) == [], "add new modules to CONTRACT (say which layer)"
    assert sorted(set(CONTRACT) - set(MODS)) == [], "CONTRACT lists modules that do not exist"


def test_imports_point_down_the_layers():
    bad = [f"{m}:{line} imports {t}" for m, es in EDGES.items() for t, line, _ in es if not _allowed(m, t)]
    assert bad == []


def test_the_root_shows_the_layers():
    """``ls scaleattn`` shows the layers: about 20 entries, folders for the subsystems."""
    entries = [p.name for p in ROOT.iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 32, sorted(entries)


def test_tensor_uses_layer_zero_only():
    bad = [f"{m} imports {t}" for m, es in EDGES.items() if m.startswith("tensor")
           for t, _, _ in es if not (t in BASE or t.startswith("tensor"))]
    assert bad == []


def test_no_cycles():
    # with a total order and only downward edges there can be none; checked directly all the same
    seen, stack = {}, []

    def visit(m):
        seen[m] = 1
        stack.append(m)
        for t, _, _ in EDGES.get(m, []):
            if seen.get(t) == 1:
                pytest.fail(f"import cycle: {' -> '.join(stack[stack.index(t):] + [t])}")
            if t not in seen:
                visit(t)
        seen[m] = 2
        stack.pop()

    for m in EDGES:
        if m not in seen:
            visit(m)


def test_lazy_sibling_imports_only_in_cli_and_bench():
    bad = [f"{m}:{line} imports {t} inside a function" for m, es in EDGES.items()
           if not m.startswith(LAZY_OK) for t, line, lazy in es if lazy]
    assert bad == []


@pytest.mark.parametrize("name", sorted(m for m in MODS if m))
def test_module_size_and_all(name):
    path = MODS[name]
    text = path.read_text()
    lines = text.count("\n")
    if lines > 1000:  # one idea at its natural size; past ~1,000 lines the docstring says why it is one idea
        assert "one idea" in (ast.get_docstring(ast.parse(text)) or ""), f"{name}: {lines} lines, no word on why"
    public = not any(part.startswith("_") for part in name.split(".")) and name not in ("bench",)
    if public:
        assert "__all__" in path.read_text(), f"{name}: public module without __all__"


def _dotted_names():
    """Every dotted ``scaleattn.x.y`` name written in the package, the tests, the docs and the notebooks (code,
    docstrings, prose), with the files that write it."""
    import re

    repo = ROOT.parent
    files = [*ROOT.rglob("*.py"), *(repo / "tests").rglob("*.py"), *(repo / "docs").glob("*.md"),
             repo / "README.md", *(repo / "notebooks").glob("*.ipynb")]
    names: dict[str, set[str]] = {}
    for f in files:
        if f.resolve() == pathlib.Path(__file__).resolve():  # (its docstrings quote stale names as examples)
            continue
        for m in re.finditer(r"\bscaleattn(?:\.[A-Za-z_]\w*)+", f.read_text()):
            names.setdefault(m.group(0), set()).add(str(f.relative_to(repo)))
    return names


def _resolves(name: str) -> bool:
    import importlib
    import importlib.util

    from scaleattn.errors import MissingDependencyError

    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except MissingDependencyError:  # it exists, but its attributes need an optional package not installed
            return True
        except ImportError:
            continue
        for p in parts[i:]:
            if not hasattr(obj, p):
                return False
            obj = getattr(obj, p)
        return True
    return False


def test_every_dotted_name_resolves():
    """A name moved by a refactor leaves no stale reference (``scaleattn.statistics._blas_controller`` after the
    kernel moved out crashed ``scaleattn bench``): every ``scaleattn.x.y`` written in code, docs or notebooks
    imports."""
    stale = [f"{name} in {sorted(files)}" for name, files in sorted(_dotted_names().items())
             if not name.endswith((".py", ".md", ".zarr", ".json", ".yaml", ".ipynb")) and not _resolves(name)]
    assert not stale, "names that do not resolve:\n" + "\n".join(stale)
