"""The run directory `rmflow train` writes, and everything read back from it.

A run is self-contained where it matters: besides its config (with absolute paths) it keeps
the tokenizer it trained with (``tokenizer/``, copied from the shards), the shards' manifest
(``data_manifest.json``: pad id, tokenizer hash, vocabulary) and the base checkpoint's
``config.json`` (``base_config.json``), so scoring, evaluating and exporting a run need neither
the shard folder nor the base model, and read nothing through a path relative to the caller.

    RUN/config.json          TrainConfig (absolute local paths)
    RUN/model_config.json    the architecture
    RUN/data_manifest.json   the shards' manifest
    RUN/base_config.json     the base checkpoint's config.json (absent for the tiny preset)
    RUN/tokenizer/           the shards' tokenizer files
    RUN/mixture.json         a mixture's sets: names, folders, weights, sizes, manifest hashes
    RUN/eval_data/NAME/      raw eval_data files as shards (made before the run by rmflow.eval.sets)
    RUN/checkpoints/         Orbax checkpoints
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Any

from rmflow.schemas import jsontext
from rmflow.schemas.config import ConfigError
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.manifest import (
    MANIFEST_FILE,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    Manifest,
    ManifestError,
    tokenizer_sha256,
    vocabulary_sha256,
)
from rmflow.schemas.outputs import is_output_of
from rmflow.schemas.sources import DataSource
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.modeling.config import ModelConfig, ModelConfigError

CONFIG = "config.json"
MODEL_CONFIG = "model_config.json"
DATA_MANIFEST = "data_manifest.json"
MIXTURE = "mixture.json"
EVAL_DATA = "eval_data"  # raw eval_data files, preprocessed before the run (rmflow.eval.sets)
CONFIG_HISTORY = "config_history.jsonl"  # every config the run has trained under, from which step
METRICS_FILE = "metrics.jsonl"  # the metric history: one record per logging or eval step, rewritten on resume

BASE_CONFIG = "base_config.json"
CHECKPOINTS = "checkpoints"
RUN_DIRECTORY = "run directory"  # schemas.outputs.OUTPUT_SIGNATURES' name of what train writes (MODEL_CONFIG)


class RunDirError(RmflowError):
    """A run directory is missing or unreadable; the message says which file and what to do."""


def is_run_dir(path: str) -> bool:
    """Written by `rmflow train` (even one that has no checkpoint yet)."""
    return os.path.isdir(path) and is_output_of(RUN_DIRECTORY, set(os.listdir(path)))


def tokenizer_files(folder: str) -> dict[str, bytes]:
    files = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = f.read()
    return files


def tokenizer_fingerprint(folder: str, *, with_template: bool = True) -> str | None:
    """The hash the manifest records for a tokenizer folder (``with_template=False``: its
    vocabulary hash), or None when it has no tokenizer.json."""
    files = tokenizer_files(folder)
    if "tokenizer.json" not in files:
        return None
    return tokenizer_sha256(files) if with_template else vocabulary_sha256(files)


def write_run_files(run_dir: str, cfg: TrainConfig, model_config: ModelConfig, base_folder: str | None,
                    data_dir: str | None = None) -> None:
    """Everything a run needs besides its checkpoints; called once the run's checks passed.
    ``data_dir``: where the shards are read (a local copy of remote ones); default ``cfg.data.train``."""
    data_dir = data_dir or cfg.data.train
    os.makedirs(run_dir, exist_ok=True)
    _write_json(os.path.join(run_dir, MODEL_CONFIG), dataclasses.asdict(model_config))
    shutil.copyfile(os.path.join(data_dir, MANIFEST_FILE), os.path.join(run_dir, DATA_MANIFEST))
    tok_src, tok_dst = os.path.join(data_dir, TOKENIZER_DIR), os.path.join(run_dir, TOKENIZER_DIR)
    if os.path.isdir(tok_src):
        shutil.copytree(tok_src, tok_dst, dirs_exist_ok=True)
    if base_folder is not None:
        shutil.copyfile(os.path.join(base_folder, "config.json"), os.path.join(run_dir, BASE_CONFIG))
    with open(os.path.join(run_dir, CONFIG), "w") as f:  # last: its presence means the rest is there
        f.write(cfg.to_json())


def manifest_sha256(data_dir: str, name: str = MANIFEST_FILE) -> str:
    """The identity of a data set: its manifest file's bytes, hashed (a run keeps a copy: ``DATA_MANIFEST``)."""
    with open(os.path.join(data_dir, name), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def data_manifest_sha256(run_dir: str) -> str | None:
    """The sha256 of the manifest of the data a run trained on (the copy the run keeps), or None
    for a run without that copy."""
    return manifest_sha256(run_dir, DATA_MANIFEST) if os.path.exists(os.path.join(run_dir, DATA_MANIFEST)) else None


def write_mixture(run_dir: str, sources: tuple[DataSource, ...], local: tuple[DataSource, ...],
                  train_units: list[int], drawn: int) -> None:
    """``mixture.json``: what the run mixes. ``share``: the weight normalised; ``passes``: how many
    times the run's planned steps go over each set's train split (above 1: it repeats)."""
    total = sum(s.weight for s in sources)
    sets = [{"name": s.name, "path": s.path, "weight": s.weight, "share": s.weight / total, "train": n,
             "passes": drawn * s.weight / total / n, "manifest_sha256": manifest_sha256(loc.path)}
            for s, loc, n in zip(sources, local, train_units)]
    _write_json(os.path.join(run_dir, MIXTURE), {"sets": sets, "planned_draws": drawn})


def _mixture_identity(sets) -> list[tuple[str, float, str]]:
    total = sum(s["weight"] for s in sets)
    return [(s["name"], round(s["weight"] / total, 12), s["manifest_sha256"]) for s in sets]


def resume_changes(run_dir: str, cfg: TrainConfig, sources: tuple[DataSource, ...]) -> dict[str, tuple[Any, Any]]:
    """What a resumed run would change: {option: (stored, new)} for every option that alters the
    run's trajectory (``TrainConfig.resume_changes``), and ``data.train`` when the shards differ from those the run began with: another
    manifest, or for a mixture other sets, names or proportions (``sources``: the sets as read,
    local copies of remote ones). Another path to identical shards is no change."""
    try:
        stored = _read_json(run_dir, CONFIG)
    except RunDirError:
        return {}
    changes = cfg.resume_changes(stored)
    before, new = TrainConfig.from_dict(stored).data.train, cfg.data.train
    if os.path.exists(os.path.join(run_dir, MIXTURE)) or len(sources) > 1:
        before = _mixture_identity(_read_json(run_dir, MIXTURE)["sets"]) \
            if os.path.exists(os.path.join(run_dir, MIXTURE)) else None
        now = _mixture_identity([{"name": s.name, "weight": s.weight, "manifest_sha256": manifest_sha256(s.path)}
                                 for s in sources]) if len(sources) > 1 else None
        if before != now:
            changes["data.train"] = (before, f"{new} (other sets or weights)")
        return changes
    old_manifest = os.path.join(run_dir, DATA_MANIFEST)
    if os.path.exists(old_manifest):
        with open(old_manifest, "rb") as a, open(os.path.join(sources[0].path, MANIFEST_FILE), "rb") as b:
            if a.read() != b.read():
                changes["data.train"] = (before, f"{new} (other shards)")
    return changes


def record_config(run_dir: str, cfg: TrainConfig, from_step: int, changed: dict[str, tuple[Any, Any]] | None = None
                  ) -> None:
    """Append the config a run trains under from ``from_step`` to its history (never rewritten)."""
    entry = {"from_step": from_step, "config": json.loads(cfg.to_json())}
    if changed:
        entry["changed"] = {k: {"before": a, "after": b} for k, (a, b) in changed.items()}
    with open(os.path.join(run_dir, CONFIG_HISTORY), "a") as f:
        f.write(jsontext.dumps(entry, sort_keys=True) + "\n")


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What a run directory says about itself (not its parameters)."""

    path: str
    config: TrainConfig
    model_config: ModelConfig
    manifest: Manifest
    tokenizer_dir: str | None  # None: the tokenizer is not available
    base_config: dict[str, Any] | None

    @property
    def pad_id(self) -> int:
        return self.manifest.tokenizer.pad_token_id or 0


def read_run(run_dir: str) -> RunFiles:
    if not os.path.isdir(run_dir):
        raise RunDirError(f"{run_dir} does not exist: give a run directory written by `rmflow train`")
    if not is_run_dir(run_dir):
        raise RunDirError(f"{run_dir} is not an rmflow run directory (no {MODEL_CONFIG}): give the --output "
                          "folder of `rmflow train`")
    raw_cfg = _read_json(run_dir, CONFIG)
    try:
        cfg = TrainConfig.from_dict(raw_cfg)
    except ConfigError as e:
        raise RunDirError(f"{os.path.join(run_dir, CONFIG)}: {e}") from e
    model_config = _model_config(run_dir, _read_json(run_dir, MODEL_CONFIG))
    tokenizer_dir = os.path.join(run_dir, TOKENIZER_DIR)
    text = _read_text(run_dir, DATA_MANIFEST)
    try:
        manifest = Manifest.from_json(text)
    except ManifestError as e:
        raise RunDirError(f"{run_dir}: cannot read its data manifest: {e}") from e
    base = json.loads(_read_text(run_dir, BASE_CONFIG)) if os.path.exists(os.path.join(run_dir, BASE_CONFIG)) \
        else None
    return RunFiles(run_dir, cfg, model_config, manifest,
                    tokenizer_dir if os.path.isdir(tokenizer_dir) else None, base)


def _model_config(run_dir: str, raw: dict[str, Any]) -> ModelConfig:
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in raw]
    unknown = sorted(set(raw) - set(fields))
    if missing or unknown:
        raise RunDirError(
            f"{os.path.join(run_dir, MODEL_CONFIG)} does not describe a model this rmflow builds "
            f"(missing {missing}, unknown {unknown}): it was written by another rmflow version; retrain, or "
            "export it with the version that trained it")
    try:
        return ModelConfig(**{**raw, "rope_params": tuple(tuple(p) for p in raw.get("rope_params", ())),
                              "rope_short_factor": tuple(raw.get("rope_short_factor", ()))})
    except (ModelConfigError, TypeError, ValueError) as e:
        raise RunDirError(f"{os.path.join(run_dir, MODEL_CONFIG)}: {e}") from e


def _read_text(folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise RunDirError(f"cannot read {path}: {e.strerror or e}") from e


def _read_json(folder: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(_read_text(folder, name))
    except ValueError as e:
        raise RunDirError(f"{os.path.join(folder, name)} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise RunDirError(f"{os.path.join(folder, name)} is not a JSON object")
    return value


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        jsontext.dump(value, f, indent=2)


def read_history(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_history(path: str, history: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        f.writelines(jsontext.dumps(h, sort_keys=True) + "\n" for h in history)


def append_history(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(jsontext.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
