"""The stages meet only through schemas and the rendering contract: pipelines never imports jax,
trainer never imports apache_beam or pipelines, rendering imports neither stage, Beam nor JAX,
schemas imports only the standard library, numpy and pyarrow."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "rendering": {"apache_beam", "jax", "jaxlib", "flax", "optax", "grain", "orbax", "pipelines", "trainer", "rmflow"},
    "pipelines": {"jax", "jaxlib", "flax", "optax", "grain", "orbax", "trainer"},
    "trainer": {"apache_beam", "pipelines"},
    "schemas": {"apache_beam", "jax", "flax", "optax", "grain", "transformers", "pipelines", "trainer", "rmflow"},
}
SCHEMAS_ALLOWED_THIRD_PARTY = {"numpy", "pyarrow", "schemas"}


STAGES = ("schemas", "rendering", "pipelines", "trainer")  # repository folders, installed as rmflow.<folder>


def _root(module: str) -> str:
    """What an imported module belongs to: a stage folder (``rmflow.trainer.x`` -> ``trainer``),
    the rmflow package's own modules (``rmflow``), or a third-party distribution's top name."""
    parts = module.split(".")
    if parts[0] == "rmflow":
        return parts[1] if len(parts) > 1 and parts[1] in STAGES else "rmflow"
    return parts[0]


def imported_roots(path: pathlib.Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {_root(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(_root(node.module))
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_source_imports_respect_the_boundary(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    for f in files:
        bad = imported_roots(f) & FORBIDDEN[package]
        assert not bad, f"{f.relative_to(REPO)} imports {sorted(bad)}"


def test_schemas_uses_only_stdlib_numpy_pyarrow():
    for f in sorted((REPO / "schemas").rglob("*.py")):
        third_party = {r for r in imported_roots(f) if r not in sys.stdlib_module_names}
        assert third_party <= SCHEMAS_ALLOWED_THIRD_PARTY, f"{f.name} imports {third_party}"


def _modules(package: str) -> list[str]:
    """The import names of a folder's modules (the stage folders install under ``rmflow.``)."""
    prefix = "rmflow." if package in STAGES else ""
    return sorted(prefix + ".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                  for f in (REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_transitive_imports_respect_the_boundary(package):
    """Every module of the package imported (not only its __init__): none loads a forbidden one."""
    modules = _modules(package)
    forbidden = sorted(FORBIDDEN[package] - {"pipelines", "trainer", "rmflow"}) + \
        [f"rmflow.{p}" for p in sorted(FORBIDDEN[package] & {"pipelines", "trainer"})] + \
        (["rmflow.cli", "rmflow.eval", "rmflow.scoring", "rmflow.server"] if "rmflow" in FORBIDDEN[package] else [])
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"bad = [f for f in {forbidden!r} if f in sys.modules]\n"
            "print(bad); sys.exit(int(bool(bad)))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"importing {package}'s modules loads {r.stdout.strip()} {r.stderr[-2000:]}"
    assert len(modules) > 3


def test_scoring_loads_no_beam_nothing_of_the_beam_stage_and_nothing_of_eval():
    """A reward model loaded to score (the API, ``rmflow serve``, an RL loop) renders and
    tokenizes through ``rendering``, the contract both stages share: no module of the Beam
    stage and no Beam, which a training or serving host does not install, and nothing of
    ``rmflow.eval`` (scoring is what eval uses, not the reverse)."""
    modules = ["rmflow.scoring.api", "rmflow.scoring.scorers", "rmflow.server.app", "rmflow.server.protocol",
               "rmflow.trainer.inference", "rmflow.trainer.export"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'apache_beam' or m.startswith(('rmflow.pipelines', 'rmflow.eval')))\n"
            "print(bad[:5]); sys.exit(int(bool(bad)))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"scoring's modules load the Beam stage: {r.stdout.strip()} {r.stderr[-2000:]}"


def _import_graph() -> dict[str, set[str]]:
    """Each of rmflow's own modules -> the own modules it imports, counting imports deferred into
    functions."""
    own = ("schemas", "rendering", "pipelines", "trainer", "rmflow")
    modules = {m for p in own for m in _modules(p)}
    graph: dict[str, set[str]] = {}
    for m in modules:
        parts = m.split(".")
        folder = parts[1:] if len(parts) > 1 and parts[1] in STAGES else parts  # rmflow.trainer.x: trainer/x.py
        path = REPO.joinpath(*folder).with_suffix(".py")
        if not path.exists():
            path = REPO.joinpath(*folder, "__init__.py")
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):  # deferred imports too
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != m:
                    deps.add(name)
        graph[m] = deps
    return graph


# What loads and scores a trained model (the one inference path) and what uses it.
INFERENCE = ("rmflow.trainer.inference", "rmflow.trainer.export", "rmflow.scoring.api", "rmflow.scoring.scorers", "rmflow.eval.evaluation")
TRAINING_LOOP = ("rmflow.trainer.train", "rmflow.trainer.window", "rmflow.trainer.data.lookahead",
                 "rmflow.trainer.loggers", "rmflow.trainer.step", "rmflow.trainer.optimizer")


def test_inference_imports_nothing_of_the_training_loop():
    """Loading and scoring a trained model builds no optimizer and no train step: a model read
    back for eval, scoring or serving holds its parameters alone (``load_trained_model``)."""
    graph = _import_graph()
    for start in INFERENCE:
        seen, todo = {start}, [start]
        while todo:
            for d in graph[todo.pop()] - seen:
                seen.add(d)
                todo.append(d)
        assert not seen & set(TRAINING_LOOP), f"{start} imports {sorted(seen & set(TRAINING_LOOP))}"


def test_no_import_cycle_between_modules():
    """The imports between rmflow's own modules form no cycle, counting those deferred into
    functions (a deferral hides a cycle from Python, not from a reader)."""
    graph = _import_graph()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph[m]:
            if state.get(d) == 1:
                cycle = path[path.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


SOURCES = ("schemas", "rendering", "pipelines", "trainer", "rmflow")


def _found_outside(home: pathlib.Path, found) -> dict[str, list[int]]:
    """The lines of every source module but ``home`` whose syntax tree has a node ``found`` says yes to."""
    hits = {}
    for package in SOURCES:
        for f in sorted((REPO / package).rglob("*.py")):
            if f != home:
                lines = [node.lineno for node in ast.walk(ast.parse(f.read_text(), str(f))) if found(node)]
                if lines:
                    hits[str(f.relative_to(REPO))] = lines
    return hits


def test_one_home_decides_whether_a_path_is_a_url():
    """Whether a string is a URL (read through a filesystem library) or an OS path is decided in
    ``schemas.paths`` alone: an inline ``"://" in`` elsewhere could drift from it."""
    hits = _found_outside(REPO / "schemas" / "paths.py", lambda node: isinstance(node, ast.Compare)
                          and isinstance(node.left, ast.Constant) and node.left.value == "://")
    assert not hits, f"{hits}: use schemas.paths.is_url / is_remote"


def test_every_json_text_is_written_by_one_writer_and_every_json_file_read_by_one_reader():
    """Every JSON text rmflow writes goes through ``schemas.jsontext.dumps`` / ``dump``: a value
    that is not a finite number is written as null, never as NaN, which strict readers refuse;
    every JSON file it reads, through ``jsontext.read``: one that is not JSON is one line."""
    hits = _found_outside(REPO / "schemas" / "jsontext.py", lambda node: isinstance(node, ast.Attribute)
                          and node.attr in ("dump", "dumps") and isinstance(node.value, ast.Name)
                          and node.value.id == "json")
    assert not hits, f"{hits}: write JSON with rmflow.schemas.jsontext.dumps / dump"
    hits = _found_outside(REPO / "schemas" / "jsontext.py", lambda node: isinstance(node, ast.Attribute)
                          and node.attr == "load" and isinstance(node.value, ast.Name) and node.value.id == "json")
    assert not hits, f"{hits}: read a JSON file with rmflow.schemas.jsontext.read (one line when it is not JSON)"


def test_one_publication_step_for_every_beam_job():
    """Preprocess and batch scoring publish through ``pipelines.publication`` alone: no other
    module moves a staging folder to an output or writes an output's COMPLETED marker."""
    home = REPO / "pipelines" / "publication.py"
    for package in ("pipelines", "rmflow"):
        for f in sorted((REPO / package).rglob("*.py")):
            text = f.read_text()
            if f != home:
                assert "rio.publish(" not in text and 'COMPLETED_FILE}", b""' not in text, \
                    f"{f.relative_to(REPO)}: publish through rmflow.pipelines.publication"


def test_one_home_handles_the_signals_that_stop_a_process():
    """Signal handlers are installed (main thread only, restored after) in ``schemas.stops``
    alone, whatever the policy: a command unwinding, the training loop stopping at a step
    boundary. A handler installed elsewhere could skip the restore, the main-thread check, or the
    stop note that keeps a stopped process from publishing."""
    hits = _found_outside(REPO / "schemas" / "stops.py", lambda node: isinstance(node, ast.Call)
                          and isinstance(node.func, ast.Attribute)
                          and node.func.attr in ("signal", "set_wakeup_fd", "siginterrupt")
                          and isinstance(node.func.value, ast.Name) and node.func.value.id == "signal")
    assert not hits, f"{hits}: handle signals through rmflow.schemas.stops"


def test_importing_any_module_changes_nothing_in_the_process():
    """No import-time side effects: importing every module of every package leaves the
    environment (XLA_FLAGS above all: an import must not decide the backend's flags) as it was.
    The entry points that start JAX apply rmflow's settings (``trainer.backend.configure_xla``)."""
    modules = [m for p in ("schemas", "rendering", "pipelines", "trainer", "rmflow") for m in _modules(p)
               if m != "rmflow.__main__"]
    libraries = ["jax", "flax", "optax", "grain", "orbax.checkpoint", "tensorboardX", "transformers", "apache_beam",
                 "starlette", "uvicorn"]  # what they set themselves on import is theirs
    code = ("import importlib, os, sys\n"
            f"for m in {libraries!r}: importlib.import_module(m)\n"
            "before = dict(os.environ)\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
            "print(changed); sys.exit(int(bool(changed)))")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RMFLOW_XLA_DEFAULTS")}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"importing rmflow's modules changes the environment: {r.stdout.strip()} " \
                              f"{r.stderr[-2000:]}"


# What scores a model outside rmflow.scoring and the inference package itself: it goes through the
# one front door (rmflow.scoring.RewardModel), never the inference cores' free functions.
SCORING_FREE_FUNCTIONS = {"score_pairs", "score_steps", "score_sequences", "score_responses",
                          "score_responses_outputs", "score_groups", "RECORD_SCORING", "SCORING_CORES"}
FRONT_DOOR_USERS = ("rmflow/eval", "rmflow/server", "rmflow/workflow.py", "rmflow/cli.py", "rmflow/scoring/grpo.py",
                    "rmflow/scoring/batch.py", "rmflow/scoring/scorers.py")


def _free_scoring_imports(path: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rmflow.trainer.inference"):
            found += [f"{path.relative_to(root)}:{node.lineno} {a.name}" for a in node.names
                      if a.name in SCORING_FREE_FUNCTIONS]
    return found


def test_every_consumer_scores_through_the_front_door():
    """Eval, the server, batch scoring and GRPO's reward function score through
    ``rmflow.scoring.RewardModel`` (``score_records``, ``score_ids``, the scorers), so their
    scores are one path's."""
    files = [p for user in FRONT_DOOR_USERS for p in ((REPO / user).rglob("*.py") if (REPO / user).is_dir()
                                                       else [REPO / user]) if p.is_file()]
    found = [hit for p in files for hit in _free_scoring_imports(p)]
    assert len(files) > 10 and not found, "score through rmflow.scoring.RewardModel instead:\n" + "\n".join(found)


def test_the_front_door_scan_finds_what_it_forbids(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from rmflow.trainer.inference import score_pairs, load_model\n"
                     "from rmflow.trainer.inference.units import score_groups\n")
    assert [h.split()[-1] for h in _free_scoring_imports(probe, tmp_path)] == ["score_pairs", "score_groups"]
