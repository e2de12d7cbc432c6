"""How ``make test`` spreads tests over workers (``tests/scheduling.py``): tests sharing a module
fixture stay one unit (so no trained run is built twice), the rest are spread one by one, the
slow ones first. Checked on a made-up file and against pytest's own view of the real tests."""

import pathlib
import textwrap

from tests.scheduling import Plan, plan_module

REPO = pathlib.Path(__file__).resolve().parents[2]

SOURCE = textwrap.dedent('''
    import pytest

    @pytest.fixture(scope="module")
    def data(tmp_path_factory): ...

    @pytest.fixture(scope="module")
    def run(data): ...

    @pytest.fixture(scope="module")
    def other(): ...

    @pytest.fixture
    def scored(run, tmp_path): ...

    @pytest.fixture()
    def plain(tmp_path): ...

    def test_data(data): ...
    def test_scored(scored): ...
    def test_other(other): ...
    def test_both(other, plain): ...
    @pytest.mark.slow
    @pytest.mark.parametrize("x", [1, 2])
    def test_alone(plain, x): ...
    def helper(data): ...
''')


def test_tests_sharing_a_module_fixture_form_one_group_and_slow_tests_are_known():
    groups, slow = plan_module(SOURCE)
    assert set(groups) == {"test_data", "test_scored", "test_other", "test_both"}
    assert groups["test_data"] == groups["test_scored"]  # through scored -> run -> data
    assert groups["test_other"] == groups["test_both"] != groups["test_data"]
    assert slow == {"test_alone"}


def test_a_module_fixture_imported_from_another_test_file_groups_its_users():
    other = textwrap.dedent('''
        import pytest

        @pytest.fixture(scope="module")
        def shards(tmp_path_factory): ...

        @pytest.fixture(scope="module")
        def trained(shards): ...
    ''')
    source = textwrap.dedent('''
        from tests.test_other import trained as run  # noqa: F401

        def test_a(run): ...
        def test_b(run, tmp_path): ...
        def test_c(tmp_path): ...
    ''')
    groups, _ = plan_module(source, {"tests.test_other": other}.get)
    assert set(groups) == {"test_a", "test_b"} and groups["test_a"] == groups["test_b"]
    assert plan_module(source)[0] == {}  # unread, the import is invisible: why the loader is passed


def test_units_match_the_fixtures_pytest_resolves(request):
    """Every module-scoped fixture that pytest resolves for the collected tests is used by one
    unit only (else two workers could each build it), and a test using none is its own unit."""
    plan = Plan(REPO)
    units_of: dict[tuple[str, str], set[str]] = {}
    checked = 0
    for item in request.session.items:
        defs = item._fixtureinfo.name2fixturedefs
        module_fixtures = {n for n in item.fixturenames if n in defs and defs[n][-1].scope == "module"}
        unit = plan.scope(item.nodeid)
        if not module_fixtures:
            assert unit == item.nodeid, item.nodeid
        for name in module_fixtures:
            units_of.setdefault((item.nodeid.split("::")[0], name), set()).add(unit)
            checked += 1
    assert all(len(units) == 1 for units in units_of.values()), {k: v for k, v in units_of.items() if len(v) > 1}
    if len(request.session.items) > 100:  # the whole suite collected: its trained-run fixtures were seen
        assert checked and ("tests/training/test_process.py", "process_run") in units_of


def test_slow_units_start_first_then_larger_groups():
    plan = Plan(REPO)
    slow = "tests/workflow/test_workflow.py::test_the_embedded_demo_runs_without_torch_and_shows_its_summary"
    assert plan.is_slow(slow)
    queue = {"a": {"tests/training/test_loss.py::test_x": False},
             "b": {"tests/training/test_loss.py::test_y": False, "tests/training/test_loss.py::test_z": False},
             "c": {slow: False}}
    assert sorted(queue, key=lambda k: plan.priority(queue[k])) == ["c", "b", "a"]
