"""The layer contract of the package (ARCHITECTURE.md), checked on the source: every import of a scaleattn module,
at module or function level, points to a module earlier in the contract; no cycles; no module over 500 lines;
lazy imports of siblings only in the CLI and the benchmarks; compat shims imported by nobody; ``__all__`` in
every public module. A new module must be placed in ``CONTRACT`` (one line: which layer it belongs to)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "scaleattn"

#: the total order of the package: a module may import only modules listed before it
CONTRACT = [
    # L0: no scaleattn imports above L0
    "_version", "errors", "_params", "_backend", "_storage", "_names", "_formats", "_integrity", "_locks", "_outputs",
    "report", "report_html", "progress", "_testing",
    "_startup",  # imported first by the package root: the scaleattn command's Ctrl-C while the package imports
    # tensor attention: L0 only
    "tensor._common", "tensor.exact", "tensor.bounds", "tensor.poly", "tensor.weights", "tensor",
    # L1: features and datasets
    "features", "datacheck", "dataset", "dataset_writer",
    # L2: pure computation, arrays in, arrays out
    "_jit",  # numba's options and the host's full vector width, for the compiled kernels
    "_kernel_compiled", "kernel", "statistics",
    "_gram_compiled",  # the compiled product of the Gram operator (numba)
    "gram_operator", "lanczos",  # the matrix-free Gram operator and its eigenvalue estimates
    "dense",  # the blocked Cholesky and block Krylov extreme eigenvalues of the dense path (needs lanczos)
    "spectrum", "krylov",  # the dense spectra and factor (needs dense); the krylov solver (needs spectrum)
    "certificate", "solver", "heads", "head_fit", "head_bounds",
    "head_search", "model",
    "qr",  # the QR certificate's local algebra (needs certificate and solver)
    # L3: Dask
    "distributed", "distributed.reduction", "distributed.partition", "distributed.checkpoint",
    "distributed.memory", "distributed.build", "distributed.operator", "distributed.evaluate", "distributed.tsqr",
    "distributed.reach",  # is an address a Dask scheduler that answers (the check before the client connects)
    "distributed.cluster",
    # L4: runs, text, the main job, front doors for data
    "run", "_figures", "plot", "preflight", "pipeline", "estimator", "importers", "generate",
    # L5: command line, Kubernetes, benchmarks, baselines; compat shims of old import paths
    "submit.manifest", "submit.follow", "submit.command", "submit",
    "baselines.models", "baselines.training", "baselines.paper", "baselines",
    "bench", "bench.workers", "bench.build", "bench.solve", "bench.core", "bench.tensor", "bench.krylov", "bench.gpu",
    "bench.adamw",
    "cli.parser", "cli.commands", "cli", "cli.__main__", "__main__",
    "job", "cluster", "memory",
]
SHIMS = {"job", "cluster", "memory"}
L0 = set(CONTRACT[:CONTRACT.index("_startup") + 1])
LAZY_OK = ("cli", "bench")  # (cli.*, bench.* too)  # CLI start-up time; benchmarks import what each suite needs


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
            targets = [".".join(base + [a.name]) for a in node.names] + [".".join(base)]
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
    rank = {m: i for i, m in enumerate(CONTRACT)}
    bad = [f"{m}:{line} imports {t}" for m, es in EDGES.items() for t, line, _ in es if rank[t] >= rank[m]]
    assert bad == []


def test_tensor_uses_layer_zero_only():
    bad = [f"{m} imports {t}" for m, es in EDGES.items() if m.startswith("tensor")
           for t, _, _ in es if not (t in L0 or t.startswith("tensor"))]
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


def test_compat_shims_are_imported_by_nobody():
    bad = [f"{m} imports the shim {t}" for m, es in EDGES.items() for t, _, _ in es if t in SHIMS]
    assert bad == []


@pytest.mark.parametrize("name", sorted(m for m in MODS if m))
def test_module_size_and_all(name):
    path = MODS[name]
    lines = path.read_text().count("\n")
    assert lines <= 500, f"{name}: {lines} lines (split it along its seams)"
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


def test_every_dotted_name_resolves_and_none_names_a_shim():
    """A name moved by a refactor leaves no stale reference (``scaleattn.statistics._blas_controller`` after the
    kernel moved out crashed ``scaleattn bench``): every ``scaleattn.x.y`` written in code, docs or notebooks
    imports, and none goes through a deprecated shim (except the shims and their own test)."""
    shim_files = {f"scaleattn/{s}.py" for s in SHIMS}
    stale, via_shim = [], []
    for name, files in sorted(_dotted_names().items()):
        if name.endswith((".py", ".md", ".zarr", ".json", ".yaml", ".ipynb")):
            continue
        if not _resolves(name):
            stale.append(f"{name} in {sorted(files)}")
        elif name.split(".")[1] in SHIMS and files - shim_files:
            via_shim.append(f"{name} in {sorted(files - shim_files)}")
    assert not stale, "names that do not resolve:\n" + "\n".join(stale)
    assert not via_shim, "names through a deprecated shim:\n" + "\n".join(via_shim)
