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
