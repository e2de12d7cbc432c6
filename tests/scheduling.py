"""How ``make test`` (``pytest -n 2 --dist loadscope``) spreads the tests over its workers.

* Tests that share a module-scoped fixture (a preprocessed dataset, a trained run), directly or
  through other fixtures of their file, form one unit that runs on one worker, so the fixture is
  built once per run; the file's other tests are units of their own. Fixtures used by a common
  test join their groups (union-find), so no module fixture is ever built twice.
* A worker asks for work when it runs low; it gets the unit that should start first: units
  holding a test marked ``@pytest.mark.slow`` (about 20 s or more on 2 cores), then larger
  groups, then the rest in file order. The longest tests then never start last, leaving one
  worker busy while the other waits.

The controller sees node ids only, not collected items, so both come from reading the test
files' source (``ast``): fixtures, their arguments and the ``slow`` marks.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable, Iterable


def _is_fixture(decorator: ast.expr) -> tuple[bool, str]:
    """Whether a decorator is ``pytest.fixture`` (bare or called), and its scope."""
    call = decorator if isinstance(decorator, ast.Call) else None
    target = call.func if call else decorator
    if not (isinstance(target, ast.Attribute) and target.attr == "fixture"):
        return False, ""
    scope = "function"
    for kw in call.keywords if call else ():
        if kw.arg == "scope" and isinstance(kw.value, ast.Constant):
            scope = kw.value.value
    return True, scope


def _is_slow(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "slow"
            and isinstance(target.value, ast.Attribute) and target.value.attr == "mark")


class _Groups:
    """Union-find over a file's module-scoped fixture names."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, names: Iterable[str]) -> None:
        roots = sorted({self.find(n) for n in names})
        for r in roots[1:]:
            self.parent[r] = roots[0]


def _fixtures(tree: ast.Module, load: Callable[[str], str | None] | None, seen: set[str]
              ) -> dict[str, tuple[str, list[str]]]:
    """``{name: (scope, argument names)}`` of the fixtures a test file defines, and of those it
    imports from other test modules (``from tests.test_x import data``: pytest then gives the
    file a module-scoped instance of its own, so it counts as the file's)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and load and node.module and node.module.startswith("tests.") \
                and node.module not in seen:
            source = load(node.module)
            if source is not None:
                theirs = _fixtures(ast.parse(source), load, seen | {node.module})
                imported = {a.asname or a.name: a.name for a in node.names}
                for local, name in imported.items():
                    if name in theirs:
                        out[local] = theirs[name]
                for name, fixture in theirs.items():  # what an imported fixture itself asks for
                    out.setdefault(name, fixture)
    for fn in tree.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in fn.decorator_list:
                is_fixture, scope = _is_fixture(d)
                if is_fixture:
                    out[fn.name] = (scope, [a.arg for a in fn.args.args])
    return out


def plan_module(source: str, load: Callable[[str], str | None] | None = None) -> tuple[dict[str, str], set[str]]:
    """For a test file's source: ``{test name: group}`` for the tests that need a module-scoped
    fixture of the file (tests with the same group share one), and the names of the tests
    marked slow. ``load(module)`` gives another test module's source (``tests.test_x``), for
    fixtures the file imports."""
    tree = ast.parse(source)
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    fixtures = _fixtures(tree, load, set())

    def module_fixtures(names: Iterable[str], seen: set[str]) -> set[str]:
        out: set[str] = set()
        for name in names:
            if name in seen or name not in fixtures:
                continue  # a conftest fixture (session-scoped) or already visited
            seen.add(name)
            scope, args = fixtures[name]
            if scope == "module":
                out.add(name)
            out |= module_fixtures(args, seen)
        return out

    groups, needs, slow = _Groups(), {}, set()
    for fn in functions:
        if not fn.name.startswith("test_"):
            continue
        if any(_is_slow(d) for d in fn.decorator_list):
            slow.add(fn.name)
        used = module_fixtures([a.arg for a in fn.args.args], set())
        if used:
            groups.union(used)
            needs[fn.name] = used
    return {name: groups.find(next(iter(used))) for name, used in needs.items()}, slow


class Plan:
    """The scheduling facts of a test tree, read once from its files."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self._modules: dict[str, tuple[dict[str, str], set[str]]] = {}

    def _module(self, module: str) -> tuple[dict[str, str], set[str]]:
        if module not in self._modules:
            path = self.root / module
            self._modules[module] = (plan_module(path.read_text(), self._source) if path.suffix == ".py" and path.exists()
                                     else ({}, set()))
        return self._modules[module]

    def _source(self, module: str) -> str | None:
        path = self.root / (module.replace(".", "/") + ".py")
        return path.read_text() if path.exists() else None

    @staticmethod
    def _split(nodeid: str) -> tuple[str, str]:
        module, _, rest = nodeid.partition("::")
        return module, rest.split("[", 1)[0].split("::")[-1]

    def scope(self, nodeid: str) -> str:
        """The unit a test belongs to: its module's fixture group, or the test itself."""
        module, name = self._split(nodeid)
        group = self._module(module)[0].get(name)
        return f"{module}::<fixture {group}>" if group else nodeid

    def is_slow(self, nodeid: str) -> bool:
        module, name = self._split(nodeid)
        return name in self._module(module)[1]

    def priority(self, unit: dict[str, bool]) -> tuple[int, int]:
        """Smaller starts first: a unit with a slow test, then larger units."""
        return (0 if any(self.is_slow(n) for n in unit) else 1, -len(unit))


def make_scheduler(config, log, root: pathlib.Path):
    """xdist's LoadScopeScheduling with this module's units and order."""
    from xdist.scheduler import LoadScopeScheduling

    plan = Plan(root)

    class FixtureGroupsSlowFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return plan.scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=lambda scope: plan.priority(self.workqueue[scope]))
            self.workqueue.move_to_end(first, last=False)  # xdist hands out the queue's first unit
            super()._assign_work_unit(node)

    return FixtureGroupsSlowFirst(config, log)
