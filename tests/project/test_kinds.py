"""The reward model kind is decided in one table (schemas/kinds.py): every per-kind table of the
other packages covers every kind, the lookups round-trip, and no module decides the kind by
comparing names or head widths itself. Likewise the model presets (schemas/presets.py): no module
compares ``--model`` with a preset's name."""

import ast
import dataclasses
import pathlib

import numpy as np
import pytest
from rmflow.schemas.config import EVAL_MODES
from rmflow.schemas.kinds import (
    KINDS,
    OUTCOME,
    PROCESS,
    UnknownKind,
    kind_named,
    kind_of_head,
    kind_of_record,
)
from rmflow.schemas.presets import MODEL_PRESETS
from rmflow.schemas.record import PairRecord, StepRecord

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "rendering", "pipelines", "trainer", "rmflow")


def _per_kind_tables():
    from rmflow.trainer.inference import RECORD_SCORING, SCORING_CORES
    from rmflow.trainer.objective import OBJECTIVES

    from rmflow.handlers import HANDLERS

    return {"trainer.objective.OBJECTIVES": OBJECTIVES, "rmflow.handlers.HANDLERS": HANDLERS,
            "trainer.inference.SCORING_CORES": SCORING_CORES, "trainer.inference.RECORD_SCORING": RECORD_SCORING}


def test_every_per_kind_table_covers_exactly_the_kinds():
    from rmflow.trainer.objective import OBJECTIVES

    for name, table in _per_kind_tables().items():
        keys = {o.kind.name for o in table.values()} if table is OBJECTIVES else set(table)
        assert keys == set(KINDS), f"{name} has {sorted(table)}, the kinds are {sorted(KINDS)}"
    from rmflow.trainer.modeling.config import ScoreHead

    for name, objective in OBJECTIVES.items():  # a kind's objectives: one per objective it takes
        assert objective.name == name
        # the kind's own head, or (regression) an attribute head
        assert objective.fits(ScoreHead(objective.kind.head.outputs)) != objective.regression
        assert objective.fits(ScoreHead(2, ("a", "b"), (1.0, 0.5))) == objective.regression


def test_every_kind_s_handlers_resolve_and_agree():
    """Each kind's handler set (rmflow.handlers) names a part of each capability that exists, and
    its server response reads fields its scorer writes."""
    from rmflow.handlers import HANDLERS, PARTS, handler
    from rmflow.scoring.scorers import Scorer
    from rmflow.server.protocol import Native

    for name in HANDLERS:
        parts = {part: handler(name, part) for part in PARTS}
        assert callable(parts["evaluate"]) and callable(parts["summary"]), name
        assert isinstance(parts["scorer"], Scorer) and isinstance(parts["protocol"], Native), name
        assert set(parts["protocol"].columns.values()) <= set(parts["scorer"].fields), name


def test_lookups_round_trip_and_refuse_what_no_kind_is():
    for kind in KINDS.values():
        assert kind_named(kind.name) is kind and kind_of_head(kind.head.outputs) is kind.model
        assert set(kind.eval_modes) <= set(EVAL_MODES), kind.name
    pair = PairRecord(np.array([1, 2]), np.array([1, 3]), 1, 1, 1, "0" * 32)
    steps = StepRecord(np.array([1, 2, 3]), np.array([1, 2]), np.array([1, 0], np.uint8), 1, "0" * 32)
    assert kind_of_record(pair) is OUTCOME and kind_of_record(steps) is PROCESS
    assert set(pair.stat_lengths()) >= set(OUTCOME.lengths) and set(steps.stat_lengths()) >= set(PROCESS.lengths)
    with pytest.raises(UnknownKind, match="unknown reward model kind 'regression'; rmflow knows outcome, process"):
        kind_named("regression")
    with pytest.raises(UnknownKind, match="a score head of 3 outputs is no reward model kind"):
        kind_of_head(3)
    with pytest.raises(UnknownKind, match="dict is the record of no reward model kind"):
        kind_of_record({})


def test_export_head_reads_back_as_its_kind():
    """An export's config.json names the head of its kind, and reading it back gives that kind (a
    kind that trains another kind's model exports as that kind: ``ModelKind.model``)."""
    from rmflow.trainer.export import hf_config
    from rmflow.trainer.modeling.config import ModelConfig, head_kind, hf_num_labels

    for kind in (k for k in KINDS.values() if k.model is k):
        cfg = hf_config(ModelConfig.tiny(vocab_size=64, num_labels=kind.head.outputs), None, 0, kind)
        assert cfg["architectures"][0].endswith(kind.head.hf_head) and head_kind(cfg) is kind
        assert hf_num_labels(cfg) == kind.head.outputs and len(cfg["id2label"]) == kind.head.outputs
        assert {v: int(k) for k, v in cfg["id2label"].items()} == cfg["label2id"]
    assert head_kind({"architectures": ["LlamaForCausalLM"]}) is None


KIND_CONSTANTS = {name.upper() for name in KINDS}  # schemas.kinds.OUTCOME, PROCESS ...
# Each kind's record at each stage: canonical (rendering.formats), tokenized (rendering.tokenize), shard.
RECORD_TYPES = ("CanonicalPair", "CanonicalSteps", "CanonicalResponses", "TokenizedPair", "TokenizedSteps",
                "TokenizedResponses", "PairRecord", "StepRecord", "ResponsesRecord")


def _kind_metric(name) -> bool:
    """Whether ``name`` is a metric (train, eval or a named set's) that only some kinds log: its
    presence in a record says which kind logged it."""
    from rmflow.trainer.objective import OBJECTIVES

    if not isinstance(name, str):
        return False
    logged = [set(o.metric_names) | set(o.kind.headline) for o in OBJECTIVES.values()]
    counts = {o.count_key for o in OBJECTIVES.values()}  # "pairs", "steps": input fields' names too
    own = set().union(*logged) - set.intersection(*logged) - counts
    return name.removeprefix("eval_").rsplit("/", 1)[-1] in own


def _kind_decisions(path: pathlib.Path) -> list[str]:
    """Comparisons that decide a kind outside the table: ``x == "process"`` (any kind's name),
    ``num_labels == 2`` (a head width), ``isinstance(x, StepRecord)`` (a kind's record type),
    ``"step_accuracy" in record`` (a metric only one kind logs)."""
    names = set(KINDS)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Constant) and p.value in names for p in parts):
                found.append(f"{where}:{node.lineno}: compares with a kind's name")
            if any(isinstance(p, ast.Attribute) and p.attr == "name" and isinstance(p.value, ast.Name)
                   and p.value.id in KIND_CONSTANTS for p in parts):
                found.append(f"{where}:{node.lineno}: compares with a kind's name")
            if any(isinstance(p, ast.Constant) and p.value in MODEL_PRESETS for p in parts):
                found.append(f"{where}:{node.lineno}: compares with a preset's name (use schemas.presets.is_preset)")
            if any(isinstance(p, ast.Attribute) and p.attr == "num_labels" for p in parts) \
                    and any(isinstance(p, ast.Constant) and isinstance(p.value, int) for p in parts):
                found.append(f"{where}:{node.lineno}: compares num_labels with a number")
            if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and isinstance(node.left, ast.Constant) \
                    and _kind_metric(node.left.value):
                found.append(f"{where}:{node.lineno}: decides the kind by a metric's name ({node.left.value!r})")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            types = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(getattr(t, "id", getattr(t, "attr", None)) in RECORD_TYPES for t in types):
                found.append(f"{where}:{node.lineno}: decides the kind by a record type")
    return found


def test_no_module_decides_the_kind_itself():
    allowed = {ROOT / "schemas" / "kinds.py", ROOT / "schemas" / "record.py",  # the table; the codec's own types
               ROOT / "schemas" / "presets.py",
               # each kind's canonical record, and the renderer of each (the rendering stage's per-kind recipe)
               ROOT / "rendering" / "formats.py", ROOT / "rendering" / "tokenize.py"}
    found = [hit for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py")) if path not in allowed
             for hit in _kind_decisions(path)]
    assert not found, "decide these by a field of schemas.kinds.ModelKind (or a per-kind table):\n" + "\n".join(found)


def test_the_scan_finds_what_it_forbids(tmp_path):
    """The scan above is able to fail."""
    probe = tmp_path / "probe.py"
    probe.write_text('def f(m, rec):\n    if m.kind == "process" or m.config.num_labels == 2:\n        return 1\n'
                     '    if m.model != "tiny":\n        return 2\n'
                     '    if "eval_step_accuracy" in rec or "loss" in rec:\n        return 3\n'
                     '    if m.kind == PROCESS.name:\n        return 4\n'
                     '    return isinstance(rec, (int, StepRecord))\n')
    assert len(_kind_decisions(probe)) == 6  # "loss" is every kind's: not a decision


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_builds_and_is_named_in_the_help(name):
    from rmflow.schemas.train_config import BaseModelConfig, TrainConfig
    from rmflow.trainer.modeling.config import ModelConfig

    cfg = ModelConfig.preset(name, vocab_size=100, num_labels=2)
    assert (cfg.vocab_size, cfg.num_labels, cfg.hidden_size) == (100, 2, MODEL_PRESETS[name]["hidden_size"])
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    from rmflow.schemas.options import help_for

    assert name in help_for(BaseModelConfig, "path")
    assert TrainConfig(data="d", model=name, output="o").with_absolute_paths().model.path == name


def test_a_training_record_is_shown_by_the_run_s_kind():
    """The progress line of a run training shows the headline accuracy of the run's kind, told by
    the run (``on_start``), not guessed from which metrics a record happens to hold."""
    from rmflow.eval.reports import training_progress, training_result

    rec = {"step": 3, "loss": 0.5, "accuracy": 0.75, "step_accuracy": 0.25, "tokens_per_second": 1234.0}
    assert training_progress(OUTCOME, rec) == "loss 0.5000, accuracy 0.750, 1,234 tokens/s"
    evaluated = {**rec, "eval_loss": 0.7, "eval_step_accuracy": 0.125}
    assert training_progress(PROCESS, evaluated) == \
        "loss 0.5000, step accuracy 0.250, eval step accuracy 0.125, 1,234 tokens/s"
    # a figure over nothing (no pair whose labels differ) is shown as such, never as 0 or nan
    assert training_progress(OUTCOME, {**evaluated, "accuracy": float("nan")}) == \
        "loss 0.5000, accuracy n/a, eval accuracy n/a, 1,234 tokens/s"
    assert training_result(OUTCOME, [rec]) == "no eval split"
    assert training_result(OUTCOME, [evaluated]) == "eval accuracy n/a (no pairs whose labels differ)"
    assert training_result(PROCESS, [evaluated]) == "eval step accuracy 0.1250"


# What scores, serves, exports and describes a trained model: it asks the model's head
# (``schemas.heads``) what varies by head, and never tests a model's attributes itself.
HEAD_USERS = ("rmflow/server", "rmflow/scoring", "rmflow/eval/evaluation.py", "trainer/export.py",
              "trainer/model_card.py", "trainer/inference", "trainer/modeling/convert.py",
              "trainer/modeling/config.py", "trainer/step.py")


def _head_branches(path: pathlib.Path) -> list[ast.expr]:
    """Conditions (if, a conditional expression, a comprehension's filter) that test a model's
    ``attributes``: the attribute head decided outside its strategy."""
    tree = ast.parse(path.read_text())
    tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    tests += [cond for n in ast.walk(tree) if isinstance(n, ast.comprehension) for cond in n.ifs]
    return [t for t in tests if any(isinstance(x, ast.Attribute) and x.attr == "attributes" for x in ast.walk(t))]


def test_no_branch_on_the_attribute_head_outside_its_strategy():
    files = [p for user in HEAD_USERS for p in ((ROOT / user).rglob("*.py") if (ROOT / user).is_dir()
                                                 else [ROOT / user])]
    found = [f"{path.relative_to(ROOT)}:{t.lineno}" for path in files for t in _head_branches(path)]
    assert len(files) > 10 and not found, "decides by a model's attributes; ask the model's head " \
                                          "(schemas.heads.head_of) instead:\n" + "\n".join(found)


def test_the_head_scan_finds_what_it_forbids(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(rm, xs):\n    if rm.attributes:\n        return 1\n"
                     "    y = 2 if rm.model.config.attributes else 3\n    return [x for x in xs if x.attributes]\n")
    assert len(_head_branches(probe)) == 3


def test_every_head_is_complete_and_its_model_kind_known():
    from rmflow.schemas.heads import HEADS, head_of

    for head in HEADS.values():
        assert kind_named(head.kind).model is kind_named(head.kind)  # a model kind, not a data kind's
        assert head.hf_head and head.peft_task and head.api
    assert head_of({"num_labels": 1}).name == "reward" and head_of({"num_labels": 2}).name == "step-classes"
    assert head_of({"num_labels": 3, "attributes": ("a", "b", "c")}).name == "attributes"


def _objective_lookups(path: pathlib.Path) -> list[int]:
    """Lines that resolve an objective from a name (``objective_for``, ``OBJECTIVES[...]``)."""
    tree = ast.parse(path.read_text())
    calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", getattr(n.func, "attr", "")) == "objective_for"]
    return calls + [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                    and getattr(n.value, "id", "") == "OBJECTIVES"]


def test_a_run_s_objective_is_built_once_and_passed_as_an_object():
    """The objective is resolved from the config in one place (``trainer.objective.for_config``);
    the model builder, the loader and the step take the object, never a name to look up again."""
    home = ROOT / "trainer" / "objective.py"
    found = [f"{p.relative_to(ROOT)}:{line}" for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
             if p != home for line in _objective_lookups(p)]
    assert not found, "resolves an objective by name again; take the run's Objective instead:\n" + "\n".join(found)
    assert _objective_lookups(home)  # the scan sees the one place that does it
    import inspect

    from rmflow.trainer.data.loader import LoaderSpec
    from rmflow.trainer.model_setup import build_model
    from rmflow.trainer.step import StepProgram

    assert "objective" in inspect.signature(build_model).parameters
    assert {"objective"} <= {f.name for f in dataclasses.fields(LoaderSpec)} & {f.name for f in dataclasses.fields(StepProgram)}
