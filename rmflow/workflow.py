"""`rmflow run workflow.yaml`: preprocess, train, eval and (when asked) export, chained.

Each stage writes under the workflow's ``output`` folder (``shards/``, ``run/``, ``eval/``,
``export/``) and, when it completes, a marker ``<stage>.done.json`` holding its config hash.
The hash covers the stage's own config and the hashes of the stages before it. A stage whose
marker holds the current hash is skipped, so an interrupted workflow resumes where it stopped;
a changed config reruns that stage and every stage after it. An interrupted training run with
unchanged config resumes from its newest checkpoint.

Inputs changed in place count as a changed config: the preprocess hash covers the path, size
and modification time of every input file (local or gs://: listing metadata only, so it costs
the same for a terabyte as for a kilobyte; a content hash would read every byte), the content of
the tokenizer files and of the chat template; the train hash covers the same metadata of the
model checkpoint's files. A training run that a changed config replaces is not deleted: it is
moved to ``previous/run-<its hash>/`` (the newest one replaced is kept), and the log says what
changed.

    output: demo-output
    preprocess: {inputs: [data.jsonl.gz], tokenizer: path/to/tokenizer, max_length: 512}
    train: {model: tiny, max_steps: 40, batch_size: 8}
    eval: {split: eval}
    export: true        # or the options of `rmflow export`: {step: best, adapter: true, max_shard_gb: 1}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Any

from rmflow.schemas import jsontext
from rmflow.schemas.config import ConfigError, EvalConfig, ExportConfig, PreprocessConfig
from rmflow.schemas.kinds import kind_named
from rmflow.schemas.outputs import REPORT_FILE, WORKFLOW_FILE, check_replaceable, output_lock
from rmflow.schemas.paths import is_url
from rmflow.schemas.presets import is_preset
from rmflow.schemas.train_config import TrainConfig

STAGES = ("preprocess", "train", "eval", "export")
KNOWN_KEYS = {"output", *STAGES}
# The options a workflow sets itself: where each stage writes, and what train reads.
PREPROCESS_SET = ("output", "overwrite")
TRAIN_SET = ("data.train", "output")
# The workflow's eval takes every EvalConfig key but where its model and output go (the workflow's run
# and eval folders); data defaults to the workflow's shards.
EVAL_KEYS = {f.name for f in dataclasses.fields(EvalConfig)} - {"model", "output"}
# Its export: `true`, or a mapping of every ExportConfig key but the run and output (the workflow's).
EXPORT_KEYS = {f.name for f in dataclasses.fields(ExportConfig)} - {"run", "output"}


def _a(value: Any) -> str:
    """A YAML value's type, in words: 'a list [1, 2]'."""
    words = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(value), type(value).__name__)
    shown = repr(value)
    return f"{words} {shown if len(shown) <= 40 else shown[:37] + '...'}"


@dataclasses.dataclass(frozen=True)
class Workflow:
    output: str
    preprocess: PreprocessConfig
    train: TrainConfig
    eval: EvalConfig  # data: the workflow's shards unless the workflow names other data
    export: ExportConfig | None  # None: no export stage

    @classmethod
    def from_dict(cls, d: dict[str, Any], base_dir: str = ".") -> Workflow:
        unknown = sorted(set(d) - KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"unknown workflow keys {unknown}; known: {sorted(KNOWN_KEYS)}")
        problems = []  # every one at once, what is there before what is missing
        for key in ("preprocess", "train", "eval"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                problems.append(f"'{key}' must be a mapping of option: value, not {_a(d[key])}")
        if "output" in d and not isinstance(d["output"], str):
            problems.append(f"'output' must be a folder path, not {_a(d['output'])}")
        problems += [f"it needs '{key}'" for key in ("output", "preprocess", "train") if key not in d]
        if problems:
            raise ConfigError("workflow: " + "; ".join(problems))
        out = _path(d["output"], base_dir)
        pre = dict(d["preprocess"])
        pre["inputs"] = tuple(_path(p, base_dir) for p in ([pre["inputs"]] if isinstance(pre.get("inputs"), str)
                                                          else pre.get("inputs", ())))
        for key in ("tokenizer", "chat_template"):
            if pre.get(key) and os.path.exists(_path(pre[key], base_dir)):
                pre[key] = _path(pre[key], base_dir)
        for key in PREPROCESS_SET:
            if key in pre:
                raise ConfigError(f"preprocess.{key}: a workflow sets it (its shards go to OUTPUT/shards, replaced "
                                  "when the stage reruns); drop it")
        pre = PreprocessConfig.from_dict({**pre, "output": os.path.join(out, "shards"), "overwrite": True})
        spec = dict(d["train"])
        given = spec.get("data")
        if "data.train" in spec or not isinstance(given, (dict, type(None))) or "train" in (given or {}):
            raise ConfigError("train.data.train: a workflow trains on its preprocess stage's shards; to mix several "
                              "shard sets, run `rmflow train --data set=weight,...` (docs/training.md, Mixtures)")
        if "output" in spec:
            raise ConfigError("train.output: a workflow sets it (its run goes to OUTPUT/run); drop it")
        try:
            train = TrainConfig.from_dict({**spec, "data.train": pre.output, "output": os.path.join(out, "run")})
        except ConfigError as e:
            raise ConfigError(f"train: {e}") from e
        model = train.model.path
        if not is_preset(model) and os.path.exists(_path(model, base_dir)):  # relative to the workflow file
            train = dataclasses.replace(train, model=dataclasses.replace(train.model, path=_path(model, base_dir)))
        if train.data.eval:  # relative to the workflow file, as the inputs are
            evals = {k: [_path(p, base_dir) for p in v] for k, v in train.data.eval.items()}
            train = dataclasses.replace(train, data=dataclasses.replace(train.data, eval=evals))
        ev = dict(d.get("eval") or {})
        if set(ev) - EVAL_KEYS:
            raise ConfigError(f"unknown eval keys {sorted(set(ev) - EVAL_KEYS)}; known: {sorted(EVAL_KEYS)}")
        if ev.get("data"):
            ev["data"] = [_path(p, base_dir) for p in ([ev["data"]] if isinstance(ev["data"], str) else ev["data"])]
        if not ev.get("data"):  # none named: the workflow's shards
            ev.pop("data", None)
        ev = EvalConfig(**{"data": (pre.output,), **ev, "model": train.output, "output": os.path.join(out, "eval")})
        export = d.get("export", False)
        if not isinstance(export, (bool, dict)):
            raise ConfigError(f"workflow 'export' {export!r}: must be true or false (unquoted), or a mapping of export "
                              f"options ({', '.join(sorted(EXPORT_KEYS))})")
        if isinstance(export, dict) and set(export) - EXPORT_KEYS:
            raise ConfigError(f"unknown export keys {sorted(set(export) - EXPORT_KEYS)}; known: {sorted(EXPORT_KEYS)}")
        options = export if isinstance(export, dict) else {}
        export = ExportConfig(run=train.output, output=os.path.join(out, "export"), **options) \
            if export is not False else None
        return cls(out, pre, train, ev, export)

    @classmethod
    def load(cls, path: str) -> Workflow:
        spec = read_yaml_mapping(path, f"workflow {path}", "a mapping with output, preprocess, train ...")
        return cls.from_dict(spec, base_dir=os.path.dirname(os.path.abspath(path)))


def read_yaml_mapping(path: str, what: str, expected: str) -> dict[str, Any]:
    """A YAML file holding a mapping (empty: {}); a ConfigError naming ``what`` otherwise."""
    import yaml

    class Loader(yaml.SafeLoader):
        """YAML's safe loader, refusing a key a mapping gives twice (YAML's own rule; PyYAML keeps the
        last). Merge keys (``<<: *defaults``) work as in YAML: a key given beside them overrides
        the merged one."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice: give it once",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    try:
        with open(path) as f:
            value = yaml.load(f, Loader=Loader) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read {what}: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be {expected}")
    return value


def _path(p: str, base_dir: str) -> str:
    return p if is_url(p) or os.path.isabs(p) else os.path.normpath(os.path.join(base_dir, p))


def _hash(obj: Any, upstream: str = "") -> str:
    blob = jsontext.dumps(obj, sort_keys=True, default=str) + upstream
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _marker(wf: Workflow, stage: str) -> str:
    return os.path.join(wf.output, f"{stage}.done.json")


def _done(wf: Workflow, stage: str, h: str) -> bool:
    try:
        return jsontext.read(_marker(wf, stage))["hash"] == h
    except (OSError, ValueError, KeyError):
        return False


def _finish(wf: Workflow, stage: str, h: str, info: dict[str, Any]) -> None:
    with open(_marker(wf, stage), "w") as f:
        jsontext.dump({"hash": h, **info}, f, indent=2)


def run(wf: Workflow, log=print) -> dict[str, str]:
    """Run the stages that are not already done; returns each stage's status (ran, skipped, off). The
    workflow's folder is locked while it runs: a second `rmflow run` of it is refused."""
    with output_lock(wf.output, "rmflow run"):
        return _run(wf, log)


WORKFLOW_FOLDER = "workflow folder"  # schemas.outputs.OUTPUT_SIGNATURES' name of what `rmflow run` writes


def _run(wf: Workflow, log) -> dict[str, str]:
    # its stages replace their folders in it: never a user's
    check_replaceable(wf.output, WORKFLOW_FOLDER, option="the workflow's output", replaces=False)
    os.makedirs(wf.output, exist_ok=True)
    with open(os.path.join(wf.output, WORKFLOW_FILE), "w") as f:  # the folder is a workflow's from now on
        jsontext.dump({"stages": [s for s in STAGES if s != "export" or wf.export is not None]}, f)
    status: dict[str, str] = {}
    h_pre = _hash({**wf.preprocess.output_affecting(), "input_identity": preprocess_identity(wf.preprocess)})
    h_train = _hash({**wf.train.flat(), "model_identity": model_identity(wf.train.model.path)}, h_pre)
    options = {k: v for k, v in wf.eval.to_dict().items() if k not in ("model", "output", "data")}
    shards = wf.preprocess.output  # the workflow's own: in h_pre already (and not there yet when hashing)
    data = ["<the workflow's shards>" if p == shards else p for p in wf.eval.data]
    h_eval = _hash({**options, "data": data, "data_identity": eval_identity([p for p in wf.eval.data if p != shards])},
                   h_train)
    # An eval that normalizes writes the run's reward statistics, which the export carries: it follows that eval.
    h_export = _hash({"export": wf.export.to_dict() if wf.export else None}, h_eval if wf.eval.normalize else h_train)
    hashes = {"preprocess": h_pre, "train": h_train, "eval": h_eval, "export": h_export}
    for stage in STAGES:
        if stage == "export" and wf.export is None:
            status[stage] = "off"
            continue
        if _done(wf, stage, hashes[stage]):
            status[stage] = "skipped"
            log(f"{stage}: done already with this config, skipped")
            continue
        if os.path.exists(_marker(wf, stage)):
            os.remove(_marker(wf, stage))
        log(f"{stage}: running")
        info = _STAGE_RUNNERS[stage](wf, hashes, log)
        _finish(wf, stage, hashes[stage], info)
        status[stage] = "ran"
    return status


def file_identity(folder: str) -> list[tuple[str, int, float]]:
    """(path, size, modification time) of every file under a local folder (a model checkpoint)."""
    from apache_beam.io.filesystems import FileSystems

    query = folder.rstrip("/") + "/**"
    try:
        metas = FileSystems.match([query])[0].metadata_list
    except Exception:  # noqa: BLE001 - not listable: the stage itself reports it
        return []
    return sorted((m.path, m.size_in_bytes, m.last_updated_in_seconds) for m in metas)


def preprocess_identity(cfg: PreprocessConfig) -> dict[str, Any]:
    """What the shards depend on besides the config: the inputs' metadata, the tokenizer's files."""
    from rmflow.pipelines.io import InputError, list_inputs

    try:
        inputs = list_inputs(cfg.inputs)  # one listing per pattern, metadata only
    except InputError:
        inputs = []  # the stage reports the problem when it runs
    ident: dict[str, Any] = {"inputs": inputs}
    for key in ("tokenizer", "chat_template"):
        path = getattr(cfg, key)
        if path and os.path.exists(path):
            ident[key] = _content_hash(path)
    return ident


def eval_identity(data: list[str]) -> list[Any]:
    """What a held-out eval's result depends on besides its options: each shard folder's manifest,
    or the raw files' metadata (as for preprocess inputs)."""
    from rmflow.pipelines.io import InputError, list_inputs

    ident: list[Any] = []
    for path in data:
        manifest = os.path.join(path, "manifest.json")
        if os.path.isfile(manifest):
            ident.append(_content_hash(manifest))
            continue
        try:
            ident.append(list_inputs((path,)))
        except InputError:
            ident.append(path)  # the stage reports the problem when it runs
    return ident


def model_identity(model: str) -> list[tuple[str, int, float]] | None:
    return file_identity(model) if not is_preset(model) and os.path.isdir(model) else None


def _content_hash(path: str) -> str:
    h = hashlib.sha256()
    names = sorted(os.listdir(path)) if os.path.isdir(path) else [""]
    for name in names:
        full = os.path.join(path, name) if name else path
        if os.path.isfile(full):
            h.update(name.encode() + b"\0")
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def _run_preprocess(wf: Workflow, hashes, log) -> dict[str, Any]:
    from rmflow.pipelines.preprocess import run as preprocess

    result = preprocess(wf.preprocess)
    for line in summary_lines(result.stats, wf.preprocess.max_length):
        log(f"  {line}")
    return {"counts": result.stats["counts"]}


def summary_lines(stats: dict[str, Any], max_length: int) -> list[str]:
    """The preprocess counts in a few lines, with what was set aside and why."""
    c = stats["counts"]
    read = max(c["records_read"], 1)
    lines = [f"{c['records_read']:,} records read, {c['pairs_written']:,} pairs written "
             f"({c['pairs_written_train']:,} train / {c['pairs_written_eval']:,} eval)"]
    if stats.get("skipped_inputs"):
        from rmflow.pipelines.io import skipped_summary

        lines.append(skipped_summary(stats["skipped_inputs"]))
    from rmflow.rendering.accounting import NOT_WRITTEN

    for key, _, what in NOT_WRITTEN:
        what = f"longer than max_length {max_length}" if key == "dropped_too_long" else what
        if c.get(key):
            lines.append(f"not written: {c[key]:,} {what} ({c[key] / read:.1%})")
    return lines


def _run_train(wf: Workflow, hashes, log) -> dict[str, Any]:
    from rmflow.eval.reports import training_progress
    from rmflow.eval.sets import preprocess_eval_sets
    from rmflow.trainer.train import run as train

    started = os.path.join(wf.output, "train.started.json")
    resume = False
    if os.path.isdir(wf.train.output):
        try:
            old_hash = jsontext.read(started)["hash"]
        except (OSError, ValueError, KeyError):
            old_hash = "unknown"
        resume = old_hash == hashes["train"]
        if not resume:  # a run for another config or other shards: set it aside, start over
            _set_aside(wf, old_hash, log)
    with open(started, "w") as f:
        jsontext.dump({"hash": hashes["train"]}, f)
    kind = []  # the run's reward model kind, once its checks passed

    def on_log(r: dict[str, Any]) -> None:
        log(f"  step {r['step']}/{wf.train.max_steps or '?'}: {training_progress(kind[0], r)}")

    if resume:
        log("  resuming the interrupted run from its newest checkpoint")
    result = train(preprocess_eval_sets(wf.train), resume=resume, on_log=on_log,
                   on_start=lambda step, run_kind: kind.append(run_kind))
    return {"steps": result.total_steps, "final": result.history[-1] if result.history else {}}


def changed_keys(run_dir: str, cfg: TrainConfig) -> list[str]:
    """``option: old -> new`` for each train option that differs from the run's stored config.json
    (by its dotted name, whichever layout stored it)."""
    try:
        old = TrainConfig.from_dict(jsontext.read(os.path.join(run_dir, "config.json"))).flat()
    except (OSError, ValueError):  # ConfigError is a ValueError: a config this rmflow cannot read
        return []
    new = cfg.flat()

    def shown(value: Any) -> Any:  # as stored: tuples are lists there, not changes
        return json.loads(jsontext.dumps(value, default=str))

    return [f"{k}: {shown(old.get(k))!r} -> {shown(new[k])!r}" for k in sorted(new)
            if shown(old.get(k)) != shown(new[k])]


def _set_aside(wf: Workflow, old_hash: str, log) -> None:
    """Move the run a changed config replaces to previous/run-<hash> (the last one is kept) and say
    what changed."""
    from rmflow.trainer.checkpoints import existing_checkpoint

    run_dir = wf.train.output
    changes = changed_keys(run_dir, wf.train)
    reason = "; ".join(changes) if changes else "the shards or the model checkpoint changed"
    step = existing_checkpoint(run_dir)
    dest = os.path.join(wf.output, "previous", f"run-{old_hash}")
    if os.path.exists(os.path.join(wf.output, "previous")):
        shutil.rmtree(os.path.join(wf.output, "previous"))
    os.makedirs(os.path.dirname(dest))
    shutil.move(run_dir, dest)
    log(f"  train config changed ({reason}): the previous run "
        f"({'step ' + str(step) if step is not None else 'no checkpoint'}) is moved to {dest}, "
        "where it stays until another config change replaces it")


def _run_eval(wf: Workflow, hashes, log) -> dict[str, Any]:
    from rmflow.eval.evaluation import run_eval

    m = run_eval(wf.eval)
    report = os.path.join(wf.eval.output, REPORT_FILE)
    out = {k: m[k] for k in kind_named(m["kind"]).headline if k in m}
    for bench in ("rewardbench_v1", "rewardbench_v2"):
        if bench in m:
            out[f"{bench}_score"] = m[bench]["score"]
    return {**out, "report": report}


def _run_export(wf: Workflow, hashes, log) -> dict[str, Any]:
    from rmflow.trainer.export import export

    return {"path": export(wf.export)}  # an earlier export there is replaced whole


_STAGE_RUNNERS = {"preprocess": _run_preprocess, "train": _run_train, "eval": _run_eval, "export": _run_export}
