"""Every ``from rmflow... import name`` in the benchmarks and deploy scripts names something that
exists: those scripts run outside the suite (on a GPU machine, in a Dataflow image), where a
renamed or moved name would fail only when someone runs them."""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for folder in ("benchmarks", "deploy") for p in (ROOT / folder).rglob("*.py"))


def _imports(path: pathlib.Path) -> list[tuple[int, str, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rmflow":
            out += [(node.lineno, node.module, alias.name) for alias in node.names if alias.name != "*"]
    return out


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_script_s_rmflow_imports_exist(path):
    missing = []
    for line, module, name in _imports(path):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] == "rmflow":
                missing.append(f"{path.name}:{line}: no module {module}")
            continue  # an optional dependency this environment lacks (airflow): its own test covers it
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)


def _path_edits(source: str) -> list[int]:
    """Lines that change the import path (``sys.path.insert``/``append``, ``sys.path = ...``)."""
    tree = ast.parse(source)
    calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in ("insert", "append", "extend") and ast.unparse(n.func.value) == "sys.path"]
    return calls + [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and any(ast.unparse(t) == "sys.path" for t in n.targets)]


def test_no_benchmark_edits_the_import_path():
    """The scripts run by path and import each other by name (their folder is first on the path);
    rmflow is the installed one. The one exception puts the GPU machine's installed wheels first:
    ``gpu.install_wheels``. The scan sees what it forbids."""
    found = {str(p.relative_to(ROOT)): _path_edits(p.read_text()) for p in (ROOT / "benchmarks").glob("*.py")}
    allowed = {"benchmarks/gpu.py": 1}
    assert {k: v for k, v in found.items() if len(v) > allowed.get(k, 0)} == {}
    assert _path_edits("import sys\nsys.path.insert(0, 'x')\nsys.path = []\n") == [2, 3]
