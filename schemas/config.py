"""Frozen, validated configuration of the preprocess stage.

The config is written into every output folder (``config.json`` and the manifest), so a
shard directory always says how it was made.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from rmflow.schemas.errors import RmflowError
from rmflow.schemas.paths import absolute, absolute_if_local
from rmflow.schemas.presets import MODEL_PRESETS, describe, is_preset
from rmflow.schemas.sources import (
    DataSource,
    SourceError,
    canonical_data,
    parse_data,
    parse_eval_data,
    with_paths,
)

# Raw layouts `rmflow preprocess` reads; "auto" detects one per file.
FORMATS = (
    "text",            # prompt / chosen / rejected strings
    "conversational",  # prompt messages + chosen / rejected assistant messages (TRL)
    "implicit",        # chosen / rejected full conversations; prompt = common prefix
    "hh-rlhf",         # "\n\nHuman: ... \n\nAssistant: ..." transcripts (Anthropic HH-RLHF)
    "axolotl",         # optional system, input, chosen, rejected (Axolotl Bradley-Terry)
    "ultrafeedback",   # chosen / rejected conversations + score_chosen / score_rejected
    "tokenized",       # chosen_ids / rejected_ids, already tokenized
    "stepwise",        # prompt, completions (steps), labels (one bool per step): process reward models (TRL)
    "processbench",    # problem, steps, label (index of the first wrong step, -1: none): ProcessBench
)
STEP_FORMATS = ("stepwise", "processbench")
LENGTH_POLICIES = ("drop", "truncate-prompt")
MAX_BAD_FRACTION = 0.05  # preprocess and score: the share of bad records a job accepts (counted, written aside)
SCORE_TRUNCATE = ("error", "left")  # a conversation longer than the model's positions: refused, or its start cut
DECONTAMINATE_METHODS = ("auto", "side-input", "join")
NEAR_DEDUP = ("off", "prompt", "pair")
# Preprocess options that act only with another: (option, what it needs, whether a config has it).
# Set without it, an option would pass silently and do nothing: refused instead.
PREPROCESS_NEEDS = (
    ("near_dedup_threshold", "--near-dedup prompt or pair", lambda c: c.near_dedup != "off"),
    ("decontaminate_ngram", "--decontaminate FILES", lambda c: bool(c.decontaminate)),
    ("decontaminate_replies", "--decontaminate FILES", lambda c: bool(c.decontaminate)),
    ("decontaminate_mark_only", "--decontaminate FILES", lambda c: bool(c.decontaminate)),
    ("decontaminate_method", "--decontaminate FILES", lambda c: bool(c.decontaminate)),
)
SCORE_OPTIONS = ("min_score_gap", "drop_score_ties", "margin_from_scores")  # act on layouts with scores only
SCORE_OUTPUT_FORMATS = ("jsonl", "parquet")
STEP_SEPARATOR = "\n"  # the default text after every step of a stepwise solution (process reward models)
SCORING_BATCH_SIZE = 16  # the default sequences per forward pass when scoring (eval, score, the API)


def _opt(default: Any, help: str) -> Any:
    """A config field with its help text: the CLI reads its option help from here."""
    return dataclasses.field(default=default, metadata={"help": help})


def help_for(cls: type, name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


_TYPE_WORDS = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}


class ConfigError(RmflowError, ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


class _Serializable:
    """to_dict / to_json / from_dict (refusing unknown keys) for the config dataclasses."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def _check_types(self) -> None:
        """Each field holds a value of its declared type (a YAML ``"no"`` where a bool belongs, a
        quoted number, a bool where a number belongs are refused); floats are finite; a whole
        float where an int belongs (``1e3`` from YAML) is taken as that int."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = str(f.type)
            if (value is None and "None" in kind) or "|" in kind.replace(" | None", ""):
                continue  # a union of value types (data, step) is checked by its own parser
            if kind.startswith("int"):
                if isinstance(value, float) and value.is_integer():
                    object.__setattr__(self, f.name, int(value))
                    continue
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif kind.startswith("float"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                if ok:
                    object.__setattr__(self, f.name, float(value))
            elif kind.startswith("bool"):
                ok = isinstance(value, bool)
            elif kind.startswith("str"):
                ok = isinstance(value, str)
            else:
                continue
            if not ok:
                raise ConfigError(f"{f.name} {value!r}: must be {_TYPE_WORDS.get(kind.split(' ')[0], kind)}"
                                  + (" (unquoted true or false)" if kind.startswith("bool") else ""))

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.__name__} keys {unknown}; known: {sorted(known)}")
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class PreprocessConfig(_Serializable):
    """Everything that determines the output of `rmflow preprocess`."""

    inputs: tuple[str, ...] = _opt(
        (), "Input files, globs or directories (JSONL, JSONL.gz, JSON arrays, Parquet; local or gs://)."
    )
    output: str = _opt("", "Output directory for shards and manifest (local or gs://).")
    tokenizer: str = _opt("", "Tokenizer: a local or gs:// Hugging Face tokenizer folder, or a hub id.")
    chat_template: str | None = _opt(None, "Jinja chat template file that replaces the tokenizer's own.")
    format: str = _opt("auto", "Input layout: auto (detected per file) or one of " + ", ".join(FORMATS) + ".")
    max_length: int = _opt(1024, "Longest allowed sequence (prompt + reply) in tokens, per side.")
    length_policy: str = _opt(
        "drop", "drop: drop pairs longer than max_length. truncate-prompt: cut the oldest prompt "
        "tokens (keeping the template's leading tokens and both replies whole); drop if the replies alone do not fit."
    )
    eval_fraction: float = _opt(0.05, "Fraction of pairs in the eval split, chosen by a hash of the pair's content.")
    split_seed: int = _opt(0, "Salt of the train/eval split hash.")
    dedup: bool = _opt(False, "Drop exact duplicate pairs (same prompt, chosen and rejected), keeping the first.")
    near_dedup: str = _opt("off", "Drop near-duplicates (MinHash over 5-word shingles, LSH): off, prompt (records "
                                  "whose prompts are near-duplicates) or pair (prompt and replies); the earliest "
                                  "record is kept and named in each drop's reason.")
    near_dedup_threshold: float = _opt(0.8, "Estimated Jaccard similarity of the shingles at which near_dedup "
                                            "counts two records as near-duplicates.")
    decontaminate: tuple[str, ...] = _opt(
        (), "Evaluation files or globs (any layout preprocess reads, or a prompt list): drop every record whose "
        "prompt shares an n-gram with one of their prompts (errors file reason: contaminated)."
    )
    decontaminate_ngram: int = _opt(
        13, "Words per n-gram for decontaminate (case, Unicode form, punctuation and whitespace ignored).")
    decontaminate_replies: bool = _opt(False, "Decontaminate checks the replies (or steps) too, not only the prompt.")
    decontaminate_mark_only: bool = _opt(
        False, "Keep contaminated records (they are written) and list them in contamination.jsonl instead of dropping them.")
    decontaminate_method: str = _opt(
        "auto", "How decontaminate finds overlaps: side-input (the evaluation n-grams held by every worker), join "
        "(a shuffle on n-gram hashes, for evaluation sets no worker could hold), or auto (join above 64 MiB of "
        "evaluation text). Both find the same records.")
    margin_from_scores: bool = _opt(
        False, "UltraFeedback layout: margin = score_chosen - score_rejected when a pair has no margin column."
    )
    min_score_gap: float = _opt(
        0.0, "Layouts with scores (UltraFeedback): drop pairs whose score_chosen - score_rejected is under this "
        "(errors file reason: weak_label); 0 keeps every pair.")
    drop_score_ties: bool = _opt(
        False, "Layouts with scores: drop pairs whose chosen and rejected scores are equal (reason: tie); without "
        "it they are kept and counted (stats: score_ties_kept).")
    max_bad_fraction: float = _opt(
        MAX_BAD_FRACTION, "Fail the job (publish nothing) when more than this fraction of records are malformed."
    )
    num_shards: int = _opt(0, "Train shards (eval gets a proportional count); 0 = one per 256 MiB of input.")
    overwrite: bool = _opt(False, "Replace an existing output directory.")
    num_workers: int = _opt(1, "Local worker processes for the DirectRunner.")
    runner: str = _opt("DirectRunner", "Beam runner, e.g. DirectRunner or DataflowRunner.")
    beam_args: tuple[str, ...] = _opt((), "Extra Beam pipeline options, passed through unchanged.")
    batch_size: int = _opt(128, "Pairs per tokenizer batch call.")
    step_separator: str = _opt(
        STEP_SEPARATOR, "Stepwise layouts (process reward models): text after every step; each step is scored at the "
        "last token of the step and its separator."
    )

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            object.__setattr__(self, "inputs", (self.inputs,))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "beam_args", tuple(self.beam_args))
        if isinstance(self.decontaminate, str):
            object.__setattr__(self, "decontaminate", (self.decontaminate,))
        object.__setattr__(self, "decontaminate", tuple(self.decontaminate))
        self._check_types()
        if not self.inputs or not all(isinstance(p, str) and p for p in self.inputs):
            raise ConfigError("inputs: give at least one input file, glob or directory (--input)")
        if not self.output:
            raise ConfigError("output: give an output directory (--output)")
        if not self.tokenizer:
            raise ConfigError("tokenizer: give a tokenizer directory or hub id (--tokenizer)")
        if self.format != "auto" and self.format not in FORMATS:
            raise ConfigError(f"format {self.format!r}: use 'auto' or one of {', '.join(FORMATS)}")
        if self.length_policy not in LENGTH_POLICIES:
            raise ConfigError(
                f"length_policy {self.length_policy!r}: use one of {', '.join(LENGTH_POLICIES)}"
            )
        _check_int(self.max_length, "max_length", 8)
        if not isinstance(self.step_separator, str) or not self.step_separator:
            raise ConfigError("step_separator: give a non-empty string (the default is a newline): without one, "
                              "a step's last token can merge with the next step's first")
        _check_int(self.num_shards, "num_shards", 0)
        _check_int(self.decontaminate_ngram, "decontaminate_ngram", 1)
        if self.near_dedup not in NEAR_DEDUP:
            raise ConfigError(f"near_dedup {self.near_dedup!r}: use one of {', '.join(NEAR_DEDUP)}")
        if not 0.0 < self.near_dedup_threshold <= 1.0:
            raise ConfigError(f"near_dedup_threshold {self.near_dedup_threshold}: must be in (0, 1]")
        if self.decontaminate_method not in DECONTAMINATE_METHODS:
            raise ConfigError(f"decontaminate_method {self.decontaminate_method!r}: use one of "
                              f"{', '.join(DECONTAMINATE_METHODS)}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, needs, active in PREPROCESS_NEEDS:
            if getattr(self, name) != defaults[name] and not active(self):
                raise ConfigError(f"{name}: does nothing without {needs}; add it, or drop {name}")
        _check_int(self.num_workers, "num_workers", 1)
        _check_int(self.batch_size, "batch_size", 1)
        _check_int(self.split_seed, "split_seed", 0)
        if self.min_score_gap < 0:
            raise ConfigError(f"min_score_gap {self.min_score_gap}: must be >= 0 (a score difference)")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction {self.eval_fraction}: must be in [0, 1)")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(f"max_bad_fraction {self.max_bad_fraction}: must be in [0, 1]")

    def with_absolute_paths(self) -> PreprocessConfig:
        """Local paths made absolute, so the config written with the shards names the same files from
        anywhere (globs and URLs are kept; a tokenizer hub id too)."""
        return dataclasses.replace(
            self, inputs=tuple(absolute(p) for p in self.inputs), output=absolute(self.output),
            decontaminate=tuple(absolute(p) for p in self.decontaminate),
            tokenizer=absolute_if_local(self.tokenizer), chat_template=absolute_if_local(self.chat_template))

    def output_affecting(self) -> dict[str, Any]:
        """The fields that change the shards' bytes (not where or how the job runs)."""
        d = self.to_dict()
        for key in ("output", "overwrite", "num_workers", "runner", "beam_args", "batch_size"):
            d.pop(key)
        return d


def checkpoint_step(value: Any) -> int | str | None:
    """A checkpoint step as given (an int, digits, or ``best``): an int, ``"best"`` or None."""
    if value is None or value == "best":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    _check_int(value, "step", 0)
    return value


def _check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} {value!r}: must be an integer >= {minimum}")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    base_dtype: str = "float32"  # the frozen base weights' storage: float32 or bfloat16

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> LoraConfig | None:
        if not d:
            return None
        unknown = sorted(set(d) - set(LORA_KEYS))
        if unknown:
            raise ConfigError(f"lora: unknown keys {unknown}; known: {list(LORA_KEYS)}")
        targets = d.get("target_modules", "all-linear")
        targets = LORA_TARGETS if targets in ("all-linear", ["all-linear"], ("all-linear",)) else \
            tuple([targets] if isinstance(targets, str) else targets)
        bad = [t for t in targets if t not in LORA_TARGETS]
        if bad or not targets:
            raise ConfigError(f"lora target_modules {bad or targets}: use names from {list(LORA_TARGETS)} or all-linear")
        rank, alpha, dropout = d.get("rank", cls.rank), d.get("alpha", cls.alpha), d.get("dropout", cls.dropout)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"lora rank {rank!r}: a positive integer")
        if not isinstance(alpha, (int, float)) or alpha <= 0:
            raise ConfigError(f"lora alpha {alpha!r}: a positive number")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ConfigError(f"lora dropout {dropout!r}: a number in [0, 1)")
        base_dtype = d.get("base_dtype", cls.base_dtype)
        if base_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"lora base_dtype {base_dtype!r}: float32 or bfloat16")
        return cls(rank, float(alpha), float(dropout), targets, base_dtype)


LORA_KEYS = tuple(f.name for f in dataclasses.fields(LoraConfig))  # the keys of TrainConfig.lora


DTYPES = ("float32", "bfloat16")
SCHEDULES = ("linear", "cosine")
PACKING = ("auto", "none", "bucket", "pack")
SCAN_LAYERS = ("auto", "on", "off")
ATTENTION = ("auto", "xla", "blockwise", "cudnn", "pallas")
DISTRIBUTED = ("auto", "on", "off")
REPORT_TO = ("tensorboard", "wandb")


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Serializable):
    """Everything that determines a `rmflow train` run (written to RUN_DIR/config.json)."""

    data: str | dict = _opt("", "Shard directory written by `rmflow preprocess` (holds manifest.json), or a "
                                "weighted mixture of several: folder=weight,folder=weight (YAML: {folder: weight} or "
                                "{name: {path, weight}}); every set needs the same tokenizer and chat template.")
    model: str = _opt("", "Hugging Face checkpoint folder or hub id (*ForCausalLM or *ForSequenceClassification), "
                          "or a random-init Llama preset: " + ", ".join(map(describe, MODEL_PRESETS)) + ".")
    output: str = _opt("", "Run directory: config, metrics.jsonl, TensorBoard events, checkpoints.")
    max_steps: int = _opt(0, "Optimizer steps to run; 0 = num_epochs over the train split.")
    num_epochs: int = _opt(1, "Passes over the train split when max_steps is 0.")
    batch_size: int = _opt(32, "Pairs per micro-batch, over all devices (a multiple of the device count), "
                               "in every packing mode.")
    grad_accum: int = _opt(1, "Micro-batches per optimizer step.")
    learning_rate: float = _opt(1e-5, "Peak learning rate (AdamW).")
    learning_rate_end: float = _opt(0.0, "Learning rate at the last step.")
    warmup_steps: int = _opt(0, "Steps of linear warmup from 0 to learning_rate.")
    lr_schedule: str = _opt("linear", "Decay after warmup: linear or cosine.")
    weight_decay: float = _opt(0.0, "AdamW weight decay (never applied to norm weights and biases).")
    max_grad_norm: float = _opt(1.0, "Clip gradients to this global norm; 0 = no clipping.")
    adam_b1: float = _opt(0.9, "AdamW beta1.")
    adam_b2: float = _opt(0.999, "AdamW beta2.")
    adam_eps: float = _opt(1e-8, "AdamW epsilon.")
    center_rewards_coefficient: float = _opt(
        0.0, "Weight of the reward-centering term mean((r_chosen + r_rejected)^2) (Eisenstein et al. 2023).")
    max_length: int = _opt(0, "Longest sequence; 0 = the shards' max_length.")
    dtype: str = _opt("float32", "Compute dtype: float32 or bfloat16 (parameters and loss stay float32).")
    gradient_checkpointing: bool = _opt(False, "Recompute each layer's activations in the backward pass.")
    scan_layers: str = _opt("auto", "Decoder layers: on (one scanned layer: the layers' weights stacked at "
                                    "call time, one layer in the compiled program), off (unrolled: a copy per "
                                    "layer), or auto: on with LoRA and for eval, scoring and serving, off for full "
                                    "fine-tuning (where the stacking's extra weight and gradient copies cost more "
                                    "than the scan saves, measured on CPU).")
    packing: str = _opt("auto", "How pairs become rows: pack (each pair's prompt once and both replies, packed into "
                                "one row per device, no padding between pairs), bucket (one sequence a row, pairs "
                                "of similar length batched together), none (one sequence a row, shuffled, padded "
                                "to a power of two), or auto: pack on CPU and on one GPU, bucket over several GPUs "
                                "(the pallas kernels are not partitioned yet) and on TPU (whose splash attention "
                                "cannot express the shared prompt).")
    attention: str = _opt("auto", "Attention implementation: auto (blockwise on CPU and TPU; on GPUs pallas for "
                                  "packed rows on one GPU, cudnn for one sequence a row in bfloat16, else "
                                  "blockwise), xla (dense reference), "
                                  "blockwise (memory-efficient, pure JAX), "
                                  "cudnn (fused flash attention, NVIDIA GPUs, bfloat16) or pallas (fused kernels "
                                  "for packed rows, Triton on NVIDIA GPUs; CPU runs it in interpret mode, for "
                                  "tests only).")
    mesh_data: int = _opt(-1, "Device mesh, data axis: devices that split the batch and hold whole replicas "
                              "of the parameters; -1 = the devices left by the other two axes.")
    mesh_fsdp: int = _opt(1, "Device mesh, fsdp axis: devices that split the batch and shard the parameters and "
                             "optimizer state (FSDP / ZeRO-3); -1 = the devices left.")
    mesh_tensor: int = _opt(1, "Device mesh, tensor axis: devices that shard attention heads and MLP columns "
                               "within each layer; -1 = the devices left.")
    distributed: str = _opt("auto", "Several processes (hosts): auto = join when a coordinator is named "
                                    "(coordinator_address or JAX_COORDINATOR_ADDRESS), on = always call "
                                    "jax.distributed.initialize (TPU VM slices, SLURM, MPI find the rest), off.")
    coordinator_address: str = _opt("", "host:port of process 0, for distributed runs (or JAX_COORDINATOR_ADDRESS); "
                                        "each process sets JAX_PROCESS_ID.")
    num_processes: int = _opt(0, "Processes in a distributed run; 0 = JAX_NUM_PROCESSES or the cluster's own count.")
    report_to: tuple[str, ...] = _opt(("tensorboard",), "Where metrics go besides metrics.jsonl (always): "
                                      "tensorboard, wandb (Weights & Biases; the wandb extra), both, or none "
                                      "(comma-separated with --set).")
    wandb_project: str = _opt("rmflow", "Weights & Biases project (WANDB_PROJECT wins when set).")
    lora: dict | None = _opt(None, "LoRA: {rank, alpha, dropout, target_modules} (target names as in PEFT: q_proj "
                                   "... down_proj, or all-linear); the base weights are frozen, the adapters and "
                                   "the score head trained. --set lora.rank=16 sets one key.")
    seed: int = _opt(0, "Seed of the data order and of the score head's initialisation.")
    logging_steps: int = _opt(10, "Steps per metrics window (metrics.jsonl, TensorBoard, progress bar).")
    eval_steps: int = _opt(0, "Evaluate on the eval split every this many steps; 0 = only at the end.")
    save_steps: int = _opt(0, "Save a checkpoint every this many steps; 0 = only at the end.")
    save_total_limit: int = _opt(2, "Checkpoints to keep (the newest), besides the best ones (keep_best).")
    eval_data: dict | None = _opt(None, "Named eval sets, each evaluated at every eval and logged as eval/NAME/...: "
                                        "{name: shard folder or raw files in any layout preprocess reads} (raw "
                                        "files are preprocessed with the data's tokenizer into RUN/eval_data/NAME); "
                                        "--set eval_data=name=path,name=path.")
    metric_for_best: str = _opt("", "Metric that ranks checkpoints, e.g. eval_accuracy or eval/NAME/accuracy "
                                    "(lower is better for names ending in loss, higher for the others); the "
                                    "keep_best best checkpoints survive pruning, and export and eval take --step "
                                    "best. Every save must then be at an eval step.")
    keep_best: int = _opt(1, "With metric_for_best: the best checkpoints kept besides the newest save_total_limit.")
    loader_workers: int = _opt(0, "Grain worker processes decoding records; 0 = in the training process.")
    compile_ahead: int = _opt(-1, "Steps the loader reads ahead, so that a batch shape not seen yet compiles in a "
                                  "background thread while training goes on; 0 = compile when the batch arrives; "
                                  "-1 = 8 on GPU and TPU (the device computes while the host compiles), 0 on CPU "
                                  "(measured no faster on 2 cores: the compiler and the step share the cores). "
                                  "Single-process runs only (several processes agree on each step's shape first).")
    compilation_cache: str = _opt("auto", "Persistent compilation cache, so a rerun or a resumed run compiles "
                                          "nothing compiled before: auto (RMFLOW_COMPILATION_CACHE, else "
                                          "JAX_COMPILATION_CACHE_DIR, else ~/.cache/rmflow/jax), off, or a folder.")

    def __post_init__(self) -> None:
        self._check_types()
        try:
            object.__setattr__(self, "data", canonical_data(parse_data(self.data)))
        except SourceError as e:
            raise ConfigError(str(e)) from e
        try:
            object.__setattr__(self, "eval_data", {k: list(v) for k, v in parse_eval_data(self.eval_data).items()}
                               or None)
        except SourceError as e:
            raise ConfigError(str(e)) from e
        if self.metric_for_best and self.save_steps and (
                not self.eval_steps or self.save_steps % self.eval_steps):
            raise ConfigError(f"metric_for_best {self.metric_for_best!r} ranks checkpoints by their eval: save_steps "
                              f"{self.save_steps} must be a multiple of eval_steps {self.eval_steps} (and eval_steps > 0)")
        for name in ("data", "model", "output"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: required (--{name})")
        for name, minimum in (("max_steps", 0), ("num_epochs", 1), ("batch_size", 1), ("grad_accum", 1),
                              ("warmup_steps", 0), ("max_length", 0), ("seed", 0), ("logging_steps", 1),
                              ("eval_steps", 0), ("save_steps", 0), ("save_total_limit", 1), ("keep_best", 1),
                              ("loader_workers", 0), ("compile_ahead", -1)):
            _check_int(getattr(self, name), name, minimum)
        sizes = (self.mesh_data, self.mesh_fsdp, self.mesh_tensor)
        if any(isinstance(v, bool) or not isinstance(v, int) or v == 0 or v < -1 for v in sizes) \
                or sizes.count(-1) > 1:
            raise ConfigError(f"mesh_data, mesh_fsdp, mesh_tensor = {sizes}: positive sizes, at most one -1")
        if self.learning_rate <= 0 or self.learning_rate_end < 0:
            raise ConfigError("learning_rate must be > 0 and learning_rate_end >= 0")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: use one of {DTYPES}")
        if self.packing not in PACKING:
            raise ConfigError(f"packing {self.packing!r}: use one of {PACKING}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention {self.attention!r}: use one of {ATTENTION}")
        if self.scan_layers not in SCAN_LAYERS:
            raise ConfigError(f"scan_layers {self.scan_layers!r}: use one of {SCAN_LAYERS}")
        reporters = (self.report_to,) if isinstance(self.report_to, str) else tuple(self.report_to or ())
        object.__setattr__(self, "report_to", tuple(r for r in reporters if r != "none"))
        bad = [r for r in self.report_to if r not in REPORT_TO]
        if bad:
            raise ConfigError(f"report_to {bad}: use any of {REPORT_TO} (or none)")
        if self.lora is not None and not isinstance(self.lora, dict):
            raise ConfigError("lora: a mapping {rank, alpha, dropout, target_modules}")
        lcfg = LoraConfig.from_dict(self.lora)  # validates
        object.__setattr__(self, "_lora", lcfg)  # parsed once (not a field: the YAML form is the mapping)
        if lcfg is not None:
            object.__setattr__(self, "lora", dataclasses.asdict(lcfg) | {"target_modules": list(lcfg.target_modules)})
        if self.distributed not in DISTRIBUTED:
            raise ConfigError(f"distributed {self.distributed!r}: use one of {DISTRIBUTED}")
        _check_int(self.num_processes, "num_processes", 0)
        if self.lr_schedule not in SCHEDULES:
            raise ConfigError(f"lr_schedule {self.lr_schedule!r}: use one of {SCHEDULES}")
        for name in ("weight_decay", "max_grad_norm", "center_rewards_coefficient"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        for name in ("adam_b1", "adam_b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} {getattr(self, name)}: must be in [0, 1) (AdamW's decay rate of a moment)")
        if self.adam_eps <= 0:
            raise ConfigError(f"adam_eps {self.adam_eps}: must be > 0")
        if self.learning_rate > 1.0 or self.learning_rate_end > self.learning_rate:
            raise ConfigError(f"learning_rate {self.learning_rate}, learning_rate_end {self.learning_rate_end}: the "
                              "peak must be in (0, 1] and the end at most the peak")
        if self.max_steps and self.warmup_steps >= self.max_steps:
            raise ConfigError(f"warmup_steps {self.warmup_steps} >= max_steps {self.max_steps}: the learning rate "
                              "would never reach its peak; use fewer warmup steps")

    @property
    def lora_config(self) -> LoraConfig | None:
        return self._lora

    def scans_layers(self, training: bool = True) -> bool:
        """Whether the decoder layers run as one scanned layer (``scan_layers``), in training or,
        with ``training=False``, when the run's model scores (eval, score, serve)."""
        if self.scan_layers != "auto":
            return self.scan_layers == "on"
        return not training or self._lora is not None

    @property
    def sources(self) -> tuple[DataSource, ...]:
        """The training data's shard sets: one, or the sets of a mixture with their weights."""
        return parse_data(self.data)

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.mesh_data, self.mesh_fsdp, self.mesh_tensor)

    def with_absolute_paths(self) -> TrainConfig:
        """Local paths made absolute (the run stores them; a hub id or a preset name stays as it is)."""
        model = self.model if is_preset(self.model) else absolute_if_local(self.model)
        data = canonical_data(with_paths(self.sources, absolute))
        evals = {k: [absolute(p) for p in v] for k, v in (self.eval_data or {}).items()} or None
        return dataclasses.replace(self, data=data, eval_data=evals, output=absolute(self.output), model=model)

    def with_overrides(self, pairs: list[str]) -> TrainConfig:
        """Apply ``key=value`` strings, each parsed as its field's type."""
        types = {f.name: f.type for f in dataclasses.fields(self)}
        data = dataclasses.asdict(self)
        for pair in pairs:
            key, sep, text = pair.partition("=")
            if sep and key.startswith("lora."):  # one key of the lora mapping
                sub = key.split(".", 1)[1]
                value: Any = text
                if sub == "rank":
                    value = _parse(text, "int", key)
                elif sub in ("alpha", "dropout"):
                    value = _parse(text, "float", key)
                elif sub == "target_modules":
                    value = [p.strip() for p in text.split(",") if p.strip()]
                data["lora"] = {**(data.get("lora") or {}), sub: value}
                continue
            if not sep or key not in types:
                raise ConfigError(f"--set {pair!r}: use key=value with a key from {sorted(types)}")
            data[key] = _parse(text, types[key], key)
        return TrainConfig.from_dict(data)


def _parse(text: str, type_name: str, key: str) -> Any:
    try:
        if type_name == "int":
            return int(text)
        if type_name == "float":
            return float(text)
        if type_name.startswith("tuple[str"):
            return tuple(p.strip() for p in text.split(",") if p.strip())
        if type_name == "bool":
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return lowered in ("true", "1", "yes")
    except ValueError as e:
        raise ConfigError(f"--set {key}={text}: not a valid {type_name}") from e
    return text


# PreprocessConfig fields that decide how a raw record becomes a pair (rendering.formats.normalize).
NORMALIZE_OPTIONS = ("margin_from_scores", "min_score_gap", "drop_score_ties")
EVAL_MODES = ("pairs", "rewardbench-v1", "rewardbench-v2")
EVAL_SPLITS = ("eval", "train", "all")
# PreprocessConfig fields that `rmflow eval` takes for raw files (the tokenizer, max_length and
# step separator come from the model): their defaults and help are PreprocessConfig's.
RAW_INPUT_OPTIONS = ("format", "margin_from_scores")
_PRE = {f.name: f for f in dataclasses.fields(PreprocessConfig)}


@dataclasses.dataclass(frozen=True)
class EvalConfig(_Serializable):
    """Everything that determines an `rmflow eval` (the CLI options and the workflow's eval keys)."""

    model: str = _opt("", "A run directory from `rmflow train` or an exported checkpoint folder (local or gs://).")
    data: tuple[str, ...] = _opt((), "A shard directory, or raw files in any layout `rmflow preprocess` reads "
                                     "(preprocessed in-process with the model's tokenizer); for a process reward "
                                     "model, stepwise data. In a workflow: default, the workflow's shards.")
    output: str = _opt("", "Folder for eval.json, report.md and the plots (replaced as a whole).")
    split: str = _opt("eval", "Shard split to evaluate: eval, train or all (raw files: all).")
    step: int | str | None = _opt(None, "Checkpoint step of a run directory to evaluate, or best (the run's "
                                        "metric_for_best ranks it first); default: the newest.")
    batch_size: int = _opt(SCORING_BATCH_SIZE, "Pairs per forward pass.")
    normalize: bool = _opt(False, "Store the mean and std of the rewards on this data with the model "
                                  "(reward_normalization.json), to standardise scores.")
    mode: str = _opt("pairs", "pairs; rewardbench-v1 (subset accuracies, section scores weighted as RewardBench "
                              "does); rewardbench-v2 (best-of-4, 1/k credit for ties). Raw inputs are never "
                              "truncated.")
    format: str = _opt(_PRE["format"].default, "Raw files: " + _PRE["format"].metadata["help"])
    margin_from_scores: bool = _opt(_PRE["margin_from_scores"].default,
                                    "Raw files: " + _PRE["margin_from_scores"].metadata["help"])

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            object.__setattr__(self, "data", (self.data,))
        object.__setattr__(self, "data", tuple(self.data))
        self._check_types()
        if self.split not in EVAL_SPLITS:
            raise ConfigError(f"split {self.split!r}: use one of {', '.join(EVAL_SPLITS)}")
        if self.mode not in EVAL_MODES:
            raise ConfigError(f"mode {self.mode!r}: use one of {', '.join(EVAL_MODES)}")
        _check_int(self.batch_size, "batch_size", 1)
        object.__setattr__(self, "step", checkpoint_step(self.step))
        if self.format != "auto" and self.format not in FORMATS:
            raise ConfigError(f"format {self.format!r}: use 'auto' or one of {', '.join(FORMATS)}")

    def raw_input_options(self) -> dict[str, Any]:
        """The preprocessing options for raw files, as PreprocessConfig keywords."""
        return {name: getattr(self, name) for name in RAW_INPUT_OPTIONS}


@dataclasses.dataclass(frozen=True)
class ExportConfig(_Serializable):
    """Everything that determines an `rmflow export` (the CLI options and the workflow's export keys)."""

    run: str = _opt("", "A run directory written by `rmflow train` (local or gs://).")
    output: str = _opt("", "Folder for the Hugging Face checkpoint (replaced as a whole).")
    step: int | str | None = _opt(None, "Checkpoint step to export, or best (the run's metric_for_best ranks it "
                                        "first); default: the newest.")
    max_shard_gb: float = _opt(2.0, "Split the safetensors weights into files of at most this size.")
    adapter: bool = _opt(False, "LoRA runs: a PEFT adapter folder (loaded onto the base model by "
                                "peft.PeftModel.from_pretrained) instead of merged weights.")

    def __post_init__(self) -> None:
        self._check_types()
        for name, what in (("run", "the run directory to export"), ("output", "the folder to export into")):
            if not getattr(self, name):
                raise ConfigError(f"export needs {name}: {what}")
        object.__setattr__(self, "step", checkpoint_step(self.step))
        if self.max_shard_gb <= 0:
            raise ConfigError(f"max_shard_gb {self.max_shard_gb!r}: must be a size in GB above 0")

    @property
    def max_shard_bytes(self) -> int:
        return int(self.max_shard_gb * 2**30)


@dataclasses.dataclass(frozen=True)
class ScoreConfig(_Serializable):
    """Everything that determines an `rmflow score` (its CLI options)."""

    model: str = _opt("", "A run directory from `rmflow train` or an exported checkpoint folder (local or gs://).")
    step: int | str | None = _opt(None, "Checkpoint step of a run directory to score with, or best (the run's "
                                        "metric_for_best ranks it first); default: the newest.")
    input: str = _opt("", "One JSONL file of conversations (message lists, or objects with 'messages'; for a process "
                          "reward model, solutions: objects with 'prompt' and 'completions', the steps). With "
                          "--runner: files, folders or globs (JSONL, JSON, Parquet) of conversations, preference "
                          "pairs (both sides scored) or solutions.")
    output: str = _opt("", "One JSONL file: the input lines with their 'score' (a process model: 'step_scores', "
                           "P(step is correct), and 'first_error'). With --runner: a folder of sorted score shards, "
                           "errors.jsonl, summary.json and COMPLETED.")
    batch_size: int = _opt(SCORING_BATCH_SIZE, "Conversations per forward pass (sorted by length).")
    runner: str = _opt("", "Empty: score in this process. A Beam runner (DirectRunner, DataflowRunner ...): score as "
                           "a Beam job; further Beam options follow the command's own.")
    beam_args: tuple[str, ...] = _opt((), "Extra Beam pipeline options, passed through unchanged (with --runner).")
    num_shards: int = _opt(0, "With --runner: output shards; 0 = one per 256 MiB of input.")
    token_budget: int = _opt(16384, "With --runner: tokens per forward pass (rows x padded length).")
    group_by: str = _opt("", "With --runner: a field naming each prompt's group of candidates; writes best.jsonl "
                             "(the highest-scoring candidate of each group) and pairs.jsonl (best against worst).")
    overwrite: bool = _opt(False, "With --runner: replace an earlier scoring job's output folder.")
    output_format: str = _opt("jsonl", "With --runner: the score shards' format, jsonl or parquet (one schema "
                                       "for every shard; a field whose types differ between records is JSON "
                                       "text). best.jsonl, pairs.jsonl and errors.jsonl stay JSONL.")
    max_bad_fraction: float = _opt(MAX_BAD_FRACTION, "Exit 1 when more than this fraction of records cannot be "
                                                     "scored (at or under it: exit 0, each bad record counted and "
                                                     "written with its reason). With --runner, above it nothing is "
                                                     "published.")
    truncate: str = _opt("error", "A conversation longer than the model's positions: error (reported as a bad "
                                  "record) or left (its earliest tokens dropped, the reply scored kept whole).")

    def __post_init__(self) -> None:
        object.__setattr__(self, "beam_args", tuple(self.beam_args))
        object.__setattr__(self, "step", checkpoint_step(self.step))
        self._check_types()
        _check_int(self.batch_size, "batch_size", 1)
        _check_int(self.num_shards, "num_shards", 0)
        _check_int(self.token_budget, "token_budget", 1)
        if self.output_format not in SCORE_OUTPUT_FORMATS:
            raise ConfigError(f"output_format {self.output_format!r}: use one of {', '.join(SCORE_OUTPUT_FORMATS)}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(f"max_bad_fraction {self.max_bad_fraction}: must be in [0, 1]")
        if self.truncate not in SCORE_TRUNCATE:
            raise ConfigError(f"truncate {self.truncate!r}: use one of {', '.join(SCORE_TRUNCATE)}")
        if not self.runner:
            used = [n for n in ("beam_args", "num_shards", "group_by", "overwrite") if getattr(self, n)]
            if self.output_format != "jsonl":
                used.append("output_format")
            if used:
                raise ConfigError(f"{', '.join(used)}: only with --runner (a Beam job)")


SERVE_API_KEY_ENV = "RMFLOW_API_KEY"  # the bearer token `rmflow serve` requires when --api-key is not given


@dataclasses.dataclass(frozen=True)
class ServeConfig(_Serializable):
    """Everything that determines an `rmflow serve` (its CLI options)."""

    model: str = _opt("", "A run directory from `rmflow train` or an exported checkpoint folder (local or gs://).")
    step: int | str | None = _opt(None, "Checkpoint step of a run directory to serve, or best (the run's "
                                        "metric_for_best ranks it first); default: the newest.")
    host: str = _opt("127.0.0.1", "Address to listen on (0.0.0.0: every interface; then set an API key).")
    port: int = _opt(8000, "Port to listen on (0: any free port; the chosen one is printed).")
    api_key: str = _opt("", f"Bearer token every request must carry (Authorization: Bearer ...); default: the "
                            f"{SERVE_API_KEY_ENV} environment variable; none: no authentication.")
    max_length: int = _opt(0, "Longest sequence scored, in tokens; 0 = the length the model was trained at (its "
                              "training data's max_length, recorded in the run and its export), else the model's "
                              "positions. Every batch shape up to it compiles at start-up: fewer tokens, a faster "
                              "start.")
    token_budget: int = _opt(16384, "Tokens per forward pass (rows x padded length): the dynamic batcher fills "
                                    "up to this, and each batch shape holds about this many.")
    max_batch_rows: int = _opt(64, "Sequences per forward pass at most.")
    max_wait_ms: float = _opt(5.0, "How long the batcher waits for more requests before running a batch that is "
                                   "not full.")
    max_queue: int = _opt(8192, "Sequences waiting at most; beyond it requests get 503 with Retry-After.")
    max_queue_wait_s: float = _opt(10.0, "Refuse a request (503 with Retry-After) when the work queued ahead of it "
                                         "would take longer than this at the throughput measured, so that clients "
                                         "retry rather than time out (RL clients often wait 30 s); 0: no bound "
                                         "but --max-queue.")
    max_request_items: int = _opt(2048, "Sequences (conversations, queries, solutions) in one request at most.")
    max_body_mb: float = _opt(64.0, "Largest request body, in MiB.")
    shutdown_timeout_s: float = _opt(30.0, "On SIGTERM: stop accepting, then wait at most this long for the "
                                           "requests in flight to finish.")
    normalize: bool = _opt(False, "/get_reward and /classify return scores standardised by the model's "
                                  "reward_normalization.json (`rmflow eval --normalize`), as OpenRLHF's "
                                  "--normalize_reward does.")

    def __post_init__(self) -> None:
        self._check_types()
        if not self.model:
            raise ConfigError("model: required (a run directory or an exported checkpoint)")
        object.__setattr__(self, "step", checkpoint_step(self.step))
        for name, minimum in (("port", 0), ("max_length", 0), ("token_budget", 1), ("max_batch_rows", 1),
                              ("max_queue", 1), ("max_request_items", 1)):
            _check_int(getattr(self, name), name, minimum)
        if self.port > 65535:
            raise ConfigError(f"port {self.port}: at most 65535")
        for name in ("max_wait_ms", "max_body_mb", "shutdown_timeout_s", "max_queue_wait_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} {getattr(self, name)}: must be >= 0")
        if self.max_request_items > self.max_queue:
            raise ConfigError(f"max_request_items {self.max_request_items} > max_queue {self.max_queue}: a request "
                              "that big could never be queued")

    def resolved_api_key(self) -> str:
        return self.api_key or os.environ.get(SERVE_API_KEY_ENV, "")
