"""A trained reward model loaded with what scoring it needs: ``load_model`` reads a run directory
(its newest or a given checkpoint) or an exported checkpoint folder, local or remote, with its
tokenizer folder, pad id, step separator and kind; the reward normalisation file beside it."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rmflow.schemas import jsontext
from rmflow.schemas.config import STEP_SEPARATOR
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.heads import UnknownHead, member_reward
from rmflow.schemas.kinds import ModelKind, kind_named
from rmflow.schemas.manifest import RenderSpec
from rmflow.schemas.outputs import EXPORT_INFO
from rmflow.trainer import storage
from rmflow.trainer.checkpoints import load_trained_model
from rmflow.trainer.modeling.config import head_kind
from rmflow.trainer.modeling.convert import load_reward_model, read_raw_config
from rmflow.trainer.rundir import is_run_dir, tokenizer_fingerprint

NORMALIZATION_FILE = "reward_normalization.json"  # in a model folder: `rmflow eval --normalize`'s mean and std


def write_normalization(folder: str, stats: dict[str, Any]) -> None:
    """Store a reward model's score statistics (``mean``, ``std`` and what they were measured on)
    in its folder: rmflow's ``NORMALIZATION_FILE``, and, in a Hugging Face export, ``mean`` and
    ``std`` in its config.json too, where OpenRLHF's reward model reads them (its
    ``--normalize_reward``)."""
    with open(os.path.join(folder, NORMALIZATION_FILE), "w") as f:
        jsontext.dump(stats, f, indent=2)
    config = os.path.join(folder, "config.json")
    if os.path.exists(os.path.join(folder, EXPORT_INFO)) and os.path.exists(config):
        cfg = jsontext.read(config)
        cfg.update({"mean": float(stats["mean"]), "std": float(stats["std"])})
        with open(config, "w") as f:
            jsontext.dump(cfg, f, indent=2)



class ModelLoadError(RmflowError):
    """The path names no trained reward model rmflow can load; the message says what to give."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer_dir: str | None  # None: no tokenizer files (callers that need one say so)
    pad_id: int
    description: str  # which weights: the run and step, or the checkpoint folder
    folder: str = ""  # the local folder it was read from (a copy, for a remote one)
    render: RenderSpec | None = None  # how its training data was rendered, when its run or export says (RenderSpec)
    step: int | None = None  # the checkpoint step (a run's, or the one an export was made from)
    run: str | None = None  # the run directory the weights come from, when known
    trained_max_length: int | None = None  # its training data's max_length, when known (a run, an export)
    recorded_kind: str | None = None  # the kind its run or export recorded (None: a checkpoint rmflow did not make)
    label_weights: str | None = None  # the attribute weights its training data's scores were the weighted sums of

    def identity(self) -> dict[str, Any]:
        """What a scorer reports with its scores: the weights (run and step), the kind and the
        tokenizer's fingerprint (the same hash the manifest keeps, chat template included); an
        ensemble's reward rule too."""
        rule = {"reward": self.model.config.member_reward} if self.model.config.members else {}
        return {"description": self.description, "run": self.run, "step": self.step, "kind": self.kind.name,
                "tokenizer_hash": tokenizer_fingerprint(self.tokenizer_dir) if self.tokenizer_dir else None, **rule}

    @property
    def step_separator(self) -> str:
        """A process model's: the text after every step, as in its training data."""
        return self.render.step_separator if self.render else STEP_SEPARATOR

    @property
    def normalization(self) -> dict[str, Any] | None:
        """The mean and std `rmflow eval --normalize` stored with the model, or None; None too for
        an ensemble scoring by another reward rule than the one the figures were taken of."""
        path = os.path.join(self.folder, NORMALIZATION_FILE)
        if not os.path.exists(path):
            return None
        stats = jsontext.read(path)
        if self.model.config.members and stats.get("reward", "mean") != self.model.config.member_reward:
            return None
        return stats

    @property
    def kind(self) -> ModelKind:
        """Its reward model kind (``schemas.kinds``): the one its run or export recorded; for a
        checkpoint rmflow did not make, the one its Hugging Face head is exported as (its only
        identity there)."""
        return kind_named(self.recorded_kind) if self.recorded_kind else self.model.config.kind



BARE_HEAD_SEED = 0  # a base model's fresh score head (``load_reward_model``'s default seed)


def use_member_reward(model, rule: str, where: str) -> None:
    """Make an ensemble ``model`` give the reward ``rule`` names over its members
    (``schemas.heads.MEMBER_REWARDS``; empty: the one it was trained with); raises
    ModelLoadError for a model that is no ensemble, or a rule that is none."""
    if not rule:
        return
    if not model.config.members:
        raise ModelLoadError(f"--reward {rule}: a rule over an ensemble's members; {where} has one reward head")
    try:
        member_reward(rule)
    except UnknownHead as e:
        raise ModelLoadError(f"--reward: {e}") from None
    model.config = dataclasses.replace(model.config, member_reward=rule)


def load_model(path: str, step: int | str | None = None, reward: str = "") -> LoadedModel:
    """A run directory (its newest checkpoint, or ``step``) or a checkpoint folder, local or
    remote (copied down first): an export, any ``*ForSequenceClassification`` reward model, or a
    base model (a causal LM), which gets a fresh score head seeded with ``BARE_HEAD_SEED``, so
    the untrained baseline is scored, evaluated and served like any model. ``reward``: an
    ensemble's reward rule, if not the one it was trained with (``use_member_reward``)."""
    loaded = _load_model(path, step)
    use_member_reward(loaded.model, reward, path)
    return loaded


def _load_model(path: str, step: int | str | None = None) -> LoadedModel:
    path = storage.stage_run(path)
    if is_run_dir(path):
        model, run, step = load_trained_model(path, step)
        return LoadedModel(model, run.tokenizer_dir, run.pad_id,
                           f"run {os.path.abspath(path)}, checkpoint step {step} (base: {run.config.model.path})", path,
                           run.manifest.render, step, os.path.abspath(path),
                           run.manifest.max_length, run.manifest.model_kind, run.manifest.label_weights)
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path} does not exist: give a run directory (`rmflow train --output`) or an "
                             "exported checkpoint folder")
    if step is not None:
        raise ModelLoadError(f"{path} is an exported checkpoint (one set of weights): --step applies to run directories")
    model = load_reward_model(path, seed=BARE_HEAD_SEED)
    raw = read_raw_config(path)
    pad = raw.get("pad_token_id") or 0
    description = f"checkpoint {os.path.abspath(path)}"
    if head_kind(raw) is None:  # a base model, scored as it is: the untrained baseline
        description += f" (a base model with a fresh score head, seeded with {BARE_HEAD_SEED}: untrained)"
    info = os.path.join(path, EXPORT_INFO)
    render, exported = None, {}
    if os.path.exists(info):
        exported = jsontext.read(info)
        description += f" (exported from run {exported.get('run')}, step {exported.get('step')})"
        render = exported_render(exported)
    loaded = LoadedModel(model, path if tokenizer_fingerprint(path) else None, pad, description, path, render,
                         exported.get("step"), exported.get("run"), exported.get("max_length"), exported.get("kind"),
                         exported.get("label_weights"))
    if loaded.kind != model.config.kind:
        raise ModelLoadError(f"{path}: {EXPORT_INFO} says it is {loaded.kind.description}; its config.json has "
                             f"{model.config.num_labels} output(s), {model.config.kind.description}")
    return loaded



def exported_render(exported: dict[str, Any]) -> RenderSpec:
    """The ``RenderSpec`` an export's info records; from an export made before it was written
    there, the same from the fields it had (the tokenizer's hash, the step separator)."""
    if "render" in exported:
        return RenderSpec.from_dict(exported["render"])
    return RenderSpec(exported.get("tokenizer_sha256", ""), None, None, exported.get("step_separator", STEP_SEPARATOR))


def require_tokenizer(model_path: str, tokenizer: str | None, why: str) -> str:
    if tokenizer is None:
        raise ModelLoadError(f"{model_path} has no tokenizer files (tokenizer.json ...), which {why} needs: copy "
                             "the tokenizer the model was trained with into it")
    return tokenizer
