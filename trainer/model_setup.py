"""Setting a run up: reading and checking the shards' manifest against the model (tokenizer,
vocabulary, positions), building the model, planning the steps (the jitted trainer:
``trainer.step.make_trainer``).

Training (``trainer.train``) and inference (``trainer.inference``) both start here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.manifest import COMPLETED_FILE, MANIFEST_FILE, TOKENIZER_DIR, Manifest, ManifestError
from rmflow.schemas.outputs import check_replaceable
from rmflow.schemas.presets import is_preset
from rmflow.schemas.train_config import PACKED, TrainConfig
from rmflow.trainer import storage
from rmflow.trainer.errors import TrainError
from rmflow.trainer.modeling import lora
from rmflow.trainer.modeling.attention import resolve_attention
from rmflow.trainer.modeling.config import ModelConfig, ScoreHead
from rmflow.trainer.modeling.convert import is_ensemble_export, load_reward_model, read_config, resolve
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.objective import Objective
from rmflow.trainer.rundir import EVAL_DATA, RUN_DIRECTORY, tokenizer_fingerprint


def check_output(output: str) -> None:
    """The run directory must be a folder: a new one, an empty one (but for the run's own eval sets,
    preprocessed first), or an earlier run (``schemas.outputs.check_replaceable``)."""
    check_replaceable(output, RUN_DIRECTORY, ignore=frozenset({EVAL_DATA}), replaces=False)  # written into


def read_manifest(data: str) -> Manifest:
    if not os.path.exists(data):
        raise TrainError(f"{data} does not exist: give a shard folder written by `rmflow preprocess`")
    if not os.path.exists(os.path.join(data, COMPLETED_FILE)):
        raise TrainError(f"{data} has no COMPLETED marker: `rmflow preprocess` did not finish writing it")
    try:
        with open(os.path.join(data, MANIFEST_FILE)) as f:
            return Manifest.from_json(f.read())
    except (OSError, ManifestError) as e:
        raise TrainError(f"cannot read the manifest of {data}: {e}") from e


# What every set of a mixture must share, and what to do when one differs: the model reads all
# their records as one stream.
SAME_PREPROCESSING = (
    ("tokenizer and chat template", lambda m: m.tokenizer.sha256,
     "preprocess every set with the same --tokenizer and --chat-template"),
    ("kind of records", lambda m: m.kind,
     "a run trains on one kind: preprocess the K-response sets with --pairs-from expand (or best-worst) to train "
     "on them as pairs"),
    ("step separator", lambda m: m.step_separator, "preprocess every set with the same --step-separator"),
    ("record version", lambda m: m.record_version, "preprocess the older sets again with this rmflow"),
)


def check_same_preprocessing(sources, manifests: list[Manifest], subject: str = "the sets of the mixture were") -> None:
    """The sets of a mixture were made alike (``SAME_PREPROCESSING``); one line names each difference
    and what to do about it."""
    problems = []
    for what, get, advice in SAME_PREPROCESSING:
        values = [get(m) for m in manifests]
        if len(set(map(str, values))) > 1:
            shown = ", ".join(f"{s.name}: {str(v)[:12] if what.startswith('tokenizer') else v!r}"
                              for s, v in zip(sources, values))
            problems.append(f"{what} differ ({shown}): {advice}")
    if problems:
        raise TrainError(f"{subject} not preprocessed alike: " + "; ".join(problems))


def build_model(cfg: TrainConfig, manifest: Manifest, objective: Objective, packing: str | None = None,
                devices: int = 1, shards: str | None = None, *, abstract: bool = False) -> RewardTransformer:
    """The model, checked against the shards (``manifest``, of the folder ``shards``): token ids
    must fit and the tokenizer must match; its score head the one ``objective`` trains
    (``trainer.objective.for_config``); with LoRA adapters added when the config asks; its
    attention the one for the rows of ``packing`` (resolved) over ``devices``. ``abstract``: its
    variables shapes and dtypes only, no weight drawn or read (``base_model``)."""
    vocab = manifest.tokenizer.vocab_size
    head = objective.model_head
    preset = ModelConfig.preset(cfg.model.path, vocab_size=vocab, **dataclasses.asdict(head)) \
        if is_preset(cfg.model.path) else None
    if preset is None:
        folder = resolve(cfg.model.path, weights=not abstract)
        if is_ensemble_export(folder):
            raise TrainError(f"model.path {cfg.model.path} is an ensemble exported one checkpoint per member: train "
                             "from one member's folder (member-0 ...) or the base model, or resume the ensemble's "
                             "run (--resume)")
        model_config, _ = read_config(folder)  # an unsupported or incomplete config.json fails first
        check_tokenizer(manifest, folder, "the model", with_template=False, shards=shards)
        check_model_fits(manifest, model_config)  # before any weight is read
    model = base_model(cfg, preset, head=head, packing=packing, devices=devices, abstract=abstract)
    check_model_fits(manifest, model.config)
    return model


def base_model(cfg: TrainConfig, preset_config: ModelConfig | None = None, head: ScoreHead = ScoreHead(),
               packing: str | None = None, devices: int = 1, *, abstract: bool = False) -> RewardTransformer:
    """The run's initial model: a preset (seeded) or the checkpoint, plus LoRA adapters;
    ``head``: the score head's (2 outputs for a process reward model; an attribute head's names and weights); ``packing`` (resolved)
    and ``devices``: the rows the model will run on (training's packing, split over the mesh), for
    which ``attention: auto`` is resolved (None: one sequence a row, as scoring has them).
    ``abstract``: the same model's variables as shapes and dtypes (``nnx.eval_shape``), the
    checkpoint's architecture read from its config alone: what a memory plan compiles against."""
    dtype = jnp.bfloat16 if cfg.model.dtype == "bfloat16" else jnp.float32
    arch = preset_config if is_preset(cfg.model.path) else read_config(resolve(cfg.model.path, weights=not abstract))[0]
    attention = resolve_attention(cfg.model.attention, dtype, jax.default_backend(), packed=packing in PACKED,
                                  softcap=bool(arch.attn_logit_softcapping),
                                  devices=devices)
    if abstract:
        def build():
            model = RewardTransformer(arch if is_preset(cfg.model.path) else arch.with_head(head), dtype=dtype,
                                      remat=cfg.model.gradient_checkpointing, rngs=nnx.Rngs(cfg.seed),
                                      attention=attention, scan_layers=cfg.scans_layers())
            if cfg.lora is not None:
                lora.apply(model, cfg.lora, seed=cfg.seed)
            return model

        return nnx.eval_shape(build)
    if is_preset(cfg.model.path):
        model = RewardTransformer(preset_config, dtype=dtype, remat=cfg.model.gradient_checkpointing,
                                  rngs=nnx.Rngs(cfg.seed),
                                  attention=attention, scan_layers=cfg.scans_layers())
    else:
        model = load_reward_model(resolve(cfg.model.path), dtype=dtype, remat=cfg.model.gradient_checkpointing,
                                  seed=cfg.seed, attention=attention, head=head,
                                  scan_layers=cfg.scans_layers(),
                                  store=lora.base_storage(cfg.lora) if cfg.lora is not None else None)
    if cfg.lora is not None:
        lora.apply(model, cfg.lora, seed=cfg.seed)
    return model


def check_tokenizer(manifest: Manifest, folder: str | None, what: str, *, with_template: bool = True,
                    shards: str | None = None) -> None:
    """The shards must come from the tokenizer in ``folder``: as used, chat template included (a
    trained run, an export), or ``with_template=False`` its vocabulary only (a base model, whose
    template the shards may have replaced with --chat-template): files of other bytes that map
    text to ids alike pass (``rendering.tokenize.text_to_ids_difference`` against the shards' own
    tokenizer, in ``shards``), else the refusal says how they differ. A folder without tokenizer
    files gets a warning (the check cannot run), never silence."""
    if not with_template and manifest.tokenizer.vocabulary_sha256 is None:
        with_template = True  # shards made before the vocabulary hash: the whole tokenizer, as then
    sha = tokenizer_fingerprint(folder, with_template=with_template) if folder else None
    if sha is None:
        warnings.warn(f"{what} ({folder}) has no tokenizer files, so rmflow cannot check that the shards "
                      f"({manifest.tokenizer.name}) were made with its tokenizer; make sure they were",
                      RmflowWarning, stacklevel=2)
        return
    try:
        manifest.check_compatible(**{"tokenizer_sha256" if with_template else "vocabulary_sha256": sha})
    except ManifestError as e:
        how = ""
        used = os.path.join(shards, TOKENIZER_DIR) if shards else None
        if not with_template and used and os.path.isdir(used):
            from rmflow.rendering.tokenize import text_to_ids_difference

            how = text_to_ids_difference(used, folder)
            if how is None:  # the same ids from other bytes (a tokenizer saved again): the same tokenizer
                return
            how = f" ({how})"
        raise TrainError(f"{e}{how}. Preprocess with {what}'s tokenizer (--tokenizer {folder}).") from e


def check_model_fits(manifest: Manifest, model_config: ModelConfig) -> None:
    """The shards' token ids and sequence lengths are within what the model has embeddings for:
    an id past the vocabulary or a position past max_position_embeddings would be computed on
    (rotary positions extrapolate) without a word, giving numbers the model was never made for."""
    if model_config.vocab_size < manifest.tokenizer.vocab_size:
        raise TrainError(f"the shards' tokenizer has {manifest.tokenizer.vocab_size} tokens, the model's embedding "
                         f"only {model_config.vocab_size}: they do not belong together")
    if manifest.max_length > model_config.max_position_embeddings:
        raise TrainError(f"the shards allow sequences of {manifest.max_length:,} tokens, past the model's "
                         f"{model_config.max_position_embeddings:,} positions ({model_config.positions_field}): "
                         f"preprocess again with --max-length {model_config.max_position_embeddings} or less")


def shard_paths(data: str, manifest: Manifest, split: str) -> list[str]:
    info = manifest.splits.get(split)
    return [os.path.join(data, s.file) for s in info.shards] if info and info.records else []


def planned_steps(cfg: TrainConfig) -> int:
    """The run's optimizer steps, from the config and the shards' manifest (staged if remote)."""
    return plan_steps(cfg, sum(read_manifest(storage.stage_shards(s.path)).splits["train"].records
                               for s in cfg.sources))


def plan_steps(cfg: TrainConfig, train_pairs: int) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    micro = math.ceil(train_pairs * cfg.num_epochs / cfg.batch_size)
    return max(micro // cfg.grad_accum, 1)


def evaluates_at(cfg: TrainConfig, step: int, total_steps: int) -> bool:
    """Whether a run of ``total_steps`` steps evaluates after ``step``: every ``eval_steps`` and at its end."""
    return bool(cfg.eval_steps and step % cfg.eval_steps == 0) or step == total_steps
