"""`rmflow train`'s config: a tree of typed sections (data, model, optimizer, lora, mesh,
checkpoint, logging) under a few run-wide options. Written to RUN/config.json; its options are
the YAML keys (nested, or dotted as in ``--set optimizer.learning_rate=1e-4``), the command's
flags and the docs' reference (``rmflow.schemas.options``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rmflow.schemas.attributes import parse_weights
from rmflow.schemas.options import Config, ConfigError, leaves, option, section
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

DTYPES = ("float32", "bfloat16")
BASE_DTYPES = (*DTYPES, "int8", "nf4")  # a LoRA run's frozen base: also quantised (trainer.modeling.quant)
SCHEDULES = ("linear", "cosine")
MOMENTS = ("float32", "bfloat16", "int8")  # AdamW's moment storage (``trainer.moments``)
PACKING = ("auto", "none", "bucket", "pack", "fixed")
PACKED = ("pack", "fixed")  # the modes whose rows hold several units (attention with branches and segments)
SCAN_LAYERS = ("auto", "on", "off")
ATTENTION = ("auto", "xla", "blockwise", "cudnn", "pallas")
DISTRIBUTED = ("auto", "on", "off")
REPORT_TO = ("tensorboard", "wandb")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


RANKING_LOSSES = ("bradley-terry", "plackett-luce")  # K responses per prompt (trainer.loss.listwise_loss)
REGRESSION = "regression"  # an attribute head fitted to the ratings (trainer.loss.regression_sums)
# The objectives of K responses per prompt: a ranking loss, the regression, or a ranking loss plus it.
OBJECTIVES = (*RANKING_LOSSES, REGRESSION, *(f"{r}+{REGRESSION}" for r in RANKING_LOSSES))


def fits_ratings(objective: str) -> bool:
    """Whether an objective (one of ``OBJECTIVES``) trains an attribute head on the ratings: the
    one place its name is read for it."""
    return REGRESSION in objective.split("+")


def ranking_loss(objective: str) -> str:
    """The ranking loss an objective names (``RANKING_LOSSES``), "" for regression alone."""
    return "" if objective == REGRESSION else objective.partition("+")[0]


def check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} {value!r}: must be an integer >= {minimum}")


def _one_of(value: Any, name: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} {value!r}: use one of {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class DataConfig(Config):
    """What the run trains and evaluates on, and how records become batch rows."""

    SCALAR_FORM = "train"
    UNKNOWN_HINT = "a mixture of shard sets goes under data.train (YAML: data: {train: {folder: weight}})"

    train: str | dict = option("", "Shard directory written by `rmflow preprocess` (holds manifest.json), or a weighted "
                                   "mixture of several: folder=weight,folder=weight (YAML: {folder: weight} or "
                                   "{name: {path, weight}}); every set needs the same tokenizer and chat template. "
                                   "YAML `data: FOLDER` sets this alone.", flags=("--data",),
                               required=True, resume_free=True)
    eval: dict | None = option(None, "Named eval sets, each evaluated at every eval and logged as eval/NAME/...: "
                                     "{name: shard folder or raw files in any layout preprocess reads} (raw files "
                                     "are preprocessed with the data's tokenizer into RUN/eval_data/NAME); as a "
                                     "flag: name=path,name=path.", resume_free=True)
    max_length: int = option(0, "Longest sequence (a prompt and one reply, in tokens) the run accepts; its batch rows "
                                "are built for it, and a longer record stops the run. 0 = the shards' max_length "
                                "(preprocess --max-length).")
    packing: str = option("auto", "How pairs become rows: fixed (each pair's prompt once and both replies, packed "
                                  "into one row per device of one fixed length, row_tokens, filled from the stream: "
                                  "one compiled step a run, a step holding batch_size pairs on average), pack (the "
                                  "same units, exactly batch_size pairs a step, the rows as long as they need, "
                                  "rounded to a handful of lengths), bucket (one sequence a row, pairs of similar "
                                  "length batched together), none (one sequence a row, shuffled, padded to a power of "
                                  "two), or auto: fixed on CPU and on one GPU, bucket over several GPUs (the pallas "
                                  "kernels are not partitioned yet) and on TPU (whose splash attention cannot "
                                  "express the shared prompt).")
    row_tokens: int = option(0, "Tokens of each row in packing fixed; 0 = chosen from the data: the rows of a step "
                                "hold batch_size records of the data's mean length (sampled at the start), and a row "
                                "never less than the longest record the shards can hold.")
    workers: int = option(0, "Grain worker processes decoding records; 0 = in the training process.", resume_free=True)

    def __post_init__(self) -> None:
        self._check_types()
        try:
            object.__setattr__(self, "train", canonical_data(parse_data(self.train)) if self.train else "")
            object.__setattr__(self, "eval", {k: list(v) for k, v in parse_eval_data(self.eval).items()} or None)
        except SourceError as e:
            raise ConfigError(str(e)) from e
        check_int(self.max_length, "max_length", 0)
        check_int(self.workers, "workers", 0)
        check_int(self.row_tokens, "row_tokens", 0)
        _one_of(self.packing, "packing", PACKING)

    def max_length_over(self, shards: int) -> int:
        """The run's max_length over shards preprocessed at ``shards``: the config's, else theirs
        (the one place a run's length limit is resolved: training and its named eval sets)."""
        return self.max_length or shards

    @property
    def sources(self) -> tuple[DataSource, ...]:
        """The training data's shard sets: one, or the sets of a mixture with their weights."""
        return parse_data(self.train)


@dataclasses.dataclass(frozen=True)
class BaseModelConfig(Config):
    """The base model (a checkpoint or a preset) and how it computes: its architecture comes from
    the checkpoint (``rmflow.trainer.modeling.config.ModelConfig``)."""

    SCALAR_FORM = "path"

    path: str = option("", "Hugging Face checkpoint folder or hub id (*ForCausalLM or *ForSequenceClassification), "
                           "or a random-init Llama preset: " + ", ".join(map(describe, MODEL_PRESETS)) + ". YAML "
                           "`model: PATH` sets this alone.", flags=("--model",), required=True)
    dtype: str = option("float32", "Compute dtype: float32 or bfloat16 (parameters and loss stay float32).")
    gradient_checkpointing: bool = option(False, "Recompute each layer's activations in the backward pass.",
                                          resume_free=True)
    scan_layers: str = option("auto", "Decoder layers: on (one scanned layer: the layers' weights stacked at call "
                                      "time, one layer in the compiled program), off (unrolled: a copy per layer), "
                                      "or auto: on with LoRA and for eval, scoring and serving, off for full "
                                      "fine-tuning (where the stacking's extra weight and gradient copies cost more "
                                      "than the scan saves on CPU).", resume_free=True)
    attention: str = option("auto", "Attention implementation: auto (blockwise on CPU and TPU; on GPUs pallas for "
                                    "packed rows on one GPU, cudnn for one sequence a row in bfloat16, else "
                                    "blockwise), xla (dense reference), blockwise (memory-efficient, pure JAX), "
                                    "cudnn (fused flash attention, NVIDIA GPUs, bfloat16) or pallas (fused kernels "
                                    "for packed rows, Triton on NVIDIA GPUs; CPU runs it in interpret mode, for "
                                    "tests only).", resume_free=True)

    def __post_init__(self) -> None:
        self._check_types()
        _one_of(self.dtype, "dtype", DTYPES)
        _one_of(self.scan_layers, "scan_layers", SCAN_LAYERS)
        _one_of(self.attention, "attention", ATTENTION)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Config):
    """AdamW with a linear warmup, then linear or cosine decay; the optax transformation is
    built from it by ``rmflow.trainer.optimizer.make_optimizer``."""

    learning_rate: float = option(1e-5, "Peak learning rate.")
    learning_rate_end: float = option(0.0, "Learning rate at the last step.")
    warmup_steps: int = option(0, "Steps of linear warmup from 0 to learning_rate.")
    schedule: str = option("linear", "Decay after warmup: linear or cosine.")
    weight_decay: float = option(0.0, "AdamW weight decay (never applied to norm weights and biases).")
    max_grad_norm: float = option(1.0, "Clip gradients to this global norm; 0 = no clipping.")
    adam_b1: float = option(0.9, "AdamW beta1.")
    adam_b2: float = option(0.999, "AdamW beta2.")
    adam_eps: float = option(1e-8, "AdamW epsilon.")
    moments: str = option("float32", "Storage of AdamW's two moments: float32 (8 bytes a trained parameter), "
                          "bfloat16 (4; stochastic rounding) or int8 (2.03; blocks of 256 with a float32 scale, "
                          "square-root companded, stochastic rounding); arrays under 4,096 elements keep float32.")
    offload: bool = option(False, "Keep the optimizer state in host memory between steps (moved to the device "
                           "for the update, then back): device memory freed for the state's size, a transfer of "
                           "it each way a step.", resume_free=True)

    def __post_init__(self) -> None:
        self._check_types()
        check_int(self.warmup_steps, "warmup_steps", 0)
        if not 0.0 < self.learning_rate <= 1.0 or not 0.0 <= self.learning_rate_end <= self.learning_rate:
            raise ConfigError(f"learning_rate {self.learning_rate}, learning_rate_end {self.learning_rate_end}: the "
                              "peak must be in (0, 1] and the end in [0, peak]")
        _one_of(self.schedule, "schedule", SCHEDULES)
        _one_of(self.moments, "moments", MOMENTS)
        for name in ("weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} {getattr(self, name)}: must be >= 0")
        for name in ("adam_b1", "adam_b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} {getattr(self, name)}: must be in [0, 1) (AdamW's decay rate of a moment)")
        if self.adam_eps <= 0:
            raise ConfigError(f"adam_eps {self.adam_eps}: must be > 0")


@dataclasses.dataclass(frozen=True)
class LoraConfig(Config):
    """Low-rank adapters: the base weights frozen, the adapters and the score head trained."""

    rank: int = option(8, "Rank of each adapter.")
    alpha: float = option(16.0, "Scale numerator: an adapter's output is multiplied by alpha / rank.")
    dropout: float = option(0.0, "Dropout on the adapters' input, in [0, 1).")
    target_modules: tuple[str, ...] = option(LORA_TARGETS, "Projections that get adapters, named as in PEFT ("
                                             + ", ".join(LORA_TARGETS) + "), or all-linear.")
    base_dtype: str = option("float32", "Storage of the frozen base's matrices (kernels, embeddings): float32, "
                                        "bfloat16, int8 or nf4 (4-bit NormalFloat, QLoRA's); int8 and nf4 with a "
                                        "float32 scale per block, quantised as the checkpoint is read.")
    base_block_size: int = option(64, "Weights per scale of an int8 or nf4 base, along a kernel's input axis "
                                      "(an embedding's hidden axis); 0 = the whole axis (a scale per output "
                                      "channel). Even.")

    def __post_init__(self) -> None:
        targets = self.target_modules
        if targets in ("all-linear", ["all-linear"], ("all-linear",)):
            targets = LORA_TARGETS
        object.__setattr__(self, "target_modules", targets)
        self._check_types()
        bad = [t for t in self.target_modules if t not in LORA_TARGETS]
        if bad or not self.target_modules:
            raise ConfigError(f"target_modules {bad or list(self.target_modules)}: use names from "
                              f"{list(LORA_TARGETS)} or all-linear")
        check_int(self.rank, "rank", 1)
        if self.alpha <= 0:
            raise ConfigError(f"alpha {self.alpha!r}: a positive number")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout {self.dropout!r}: a number in [0, 1)")
        _one_of(self.base_dtype, "base_dtype", BASE_DTYPES)
        check_int(self.base_block_size, "base_block_size", 0)
        if self.base_block_size % 2:
            raise ConfigError(f"base_block_size {self.base_block_size}: an even number (two nf4 codes a byte), "
                              "or 0 for the whole axis")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class MeshConfig(Config):
    """The devices: how they split the batch and the parameters, and which processes join."""

    data: int = option(-1, "Data axis: devices that split the batch and hold whole replicas of the parameters; "
                           "-1 = the devices left by the other axes.", resume_free=True)
    fsdp: int = option(1, "FSDP axis: devices that split the batch and shard the parameters and optimizer state "
                          "(FSDP / ZeRO-3); -1 = the devices left.", resume_free=True)
    tensor: int = option(1, "Tensor axis: devices that shard attention heads and MLP columns within each layer; "
                            "-1 = the devices left.", resume_free=True)
    expert: int = option(1, "Expert axis: devices that split the batch and shard a mixture of experts' experts "
                            "(each holds 1/n of them); -1 = the devices left.", resume_free=True)
    context: int = option(1, "Context axis: devices that split each row's tokens (long pairs): each holds its "
                             "share of the activations, and attention gathers the row's keys and values; "
                             "-1 = the devices left.", resume_free=True)
    distributed: str = option("auto", "Several processes (hosts): auto = join when a coordinator is named "
                                      "(coordinator_address or JAX_COORDINATOR_ADDRESS), on = always call "
                                      "jax.distributed.initialize (TPU VM slices, SLURM, MPI find the rest), off.",
                              resume_free=True)
    coordinator_address: str = option("", "host:port of process 0, for distributed runs (or "
                                          "JAX_COORDINATOR_ADDRESS); each process sets JAX_PROCESS_ID.",
                                      resume_free=True)
    num_processes: int = option(0, "Processes in a distributed run; 0 = JAX_NUM_PROCESSES or the cluster's own "
                                   "count.", resume_free=True)

    def __post_init__(self) -> None:
        self._check_types()
        if any(v == 0 or v < -1 for v in self.shape) or self.shape.count(-1) > 1:
            raise ConfigError(f"data, fsdp, tensor, expert, context = {self.shape}: positive sizes, at most one -1")
        _one_of(self.distributed, "distributed", DISTRIBUTED)
        check_int(self.num_processes, "num_processes", 0)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.data, self.fsdp, self.tensor, self.expert, self.context)


@dataclasses.dataclass(frozen=True)
class EnsembleConfig(Config):
    """An ensemble trained in one run: members on one backbone (Zhang et al., 2024), whose spread
    says how sure the reward is and whose conservative reward resists over-optimisation (Coste et
    al., 2024)."""

    members: int = option(0, "Score heads on one backbone, each its own randomly drawn head trained with the loss "
                             "on every pair (or prompt): an ensemble of N >= 2 members at the cost of one model; "
                             "scores come with the members' rewards, their mean and spread. 0 = one reward head. "
                             "Pairs and K responses per prompt (not the regression objectives, not process models).")
    reward: str = option("mean", "An ensemble's reward: mean, min, or lcb:LAMBDA (the mean minus LAMBDA x the "
                                 "members' standard deviation); what eval, score and serve give unless they are "
                                 "asked for another (--reward).")
    bootstrap: bool = option(False, "Each member weighs each pair by its own Poisson(1) draw, fixed for the run: its "
                                    "own bootstrap resample of the pairs (more diverse members). Pairs only.")
    layers: int = option(0, "The top this many decoder layers are each member's own: copies of the base's, trained "
                            "apart (with LoRA: each its own adapters); the layers below are shared and run once a "
                            "step. 0: the members share every layer (score heads only); the model's layer count: "
                            "N members over one embedding. Costs the layers' compute and parameters once per member.")

    def __post_init__(self) -> None:
        from rmflow.schemas.heads import UnknownHead, member_reward

        self._check_types()
        check_int(self.members, "members", 0)
        if self.members == 1:
            raise ConfigError("ensemble.members 1: an ensemble has 2 or more members (0: none)")
        try:
            member_reward(self.reward)
        except UnknownHead as e:
            raise ConfigError(f"ensemble.reward: {e}") from None
        check_int(self.layers, "layers", 0)
        if not self.members and (self.reward != "mean" or self.bootstrap or self.layers):
            given = "bootstrap" if self.bootstrap else "layers" if self.layers else "reward"
            raise ConfigError(f"ensemble.{given}: applies to an ensemble's members; give ensemble.members too")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Config):
    """When the run saves, and which checkpoints it keeps."""

    save_steps: int = option(0, "Save a checkpoint every this many steps; 0 = only at the end.", resume_free=True)
    keep_newest: int = option(2, "The newest checkpoints kept, besides the best ones (keep_best).", resume_free=True)
    metric_for_best: str = option("", "Metric that ranks checkpoints, e.g. eval_accuracy or eval/NAME/accuracy "
                                      "(lower is better for names ending in loss or mse, e.g. eval_mse and "
                                      "eval_NAME_rmse, higher for the others); the keep_best best checkpoints "
                                      "survive pruning, and export and eval take --step best. Every save must then "
                                      "be at an eval step.", resume_free=True)
    keep_best: int = option(1, "With metric_for_best: the best checkpoints kept besides the keep_newest newest.",
                            resume_free=True)

    def __post_init__(self) -> None:
        self._check_types()
        check_int(self.save_steps, "save_steps", 0)
        check_int(self.keep_newest, "keep_newest", 1)
        check_int(self.keep_best, "keep_best", 1)


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Config):
    """Where and how often metrics go (metrics.jsonl always)."""

    steps: int = option(10, "Steps per metrics window (metrics.jsonl, TensorBoard, progress bar).", resume_free=True)
    report_to: tuple[str, ...] = option(("tensorboard",), "Where metrics go besides metrics.jsonl: tensorboard, "
                                        "wandb (Weights & Biases; the wandb extra), both, or none "
                                        "(comma-separated as a flag).", resume_free=True)
    wandb_project: str = option("rmflow", "Weights & Biases project (WANDB_PROJECT wins when set).",
                                resume_free=True)

    def __post_init__(self) -> None:
        reporters = (self.report_to,) if isinstance(self.report_to, str) else tuple(self.report_to or ())
        object.__setattr__(self, "report_to", tuple(r for r in reporters if r != "none"))
        self._check_types()
        check_int(self.steps, "steps", 1)
        bad = [r for r in self.report_to if r not in REPORT_TO]
        if bad:
            raise ConfigError(f"report_to {bad}: use any of {REPORT_TO} (or none)")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Config):
    """Everything that determines a `rmflow train` run (written to RUN/config.json)."""

    data: DataConfig = section(DataConfig, "The training and eval data.")
    model: BaseModelConfig = section(BaseModelConfig, "The base model and how it computes.")
    output: str = option("", "Run directory: config, metrics.jsonl, TensorBoard events, checkpoints.",
                         flags=("--output", "-o"), required=True, resume_free=True)
    max_steps: int = option(0, "Optimizer steps to run; 0 = num_epochs over the train split.")
    num_epochs: int = option(1, "Passes over the train split when max_steps is 0.")
    batch_size: int = option(32, "Records per micro-batch (pairs, solutions, or prompts with their K responses, by the "
                                 "data's kind), over all devices (a multiple of the device count), in every "
                                 "packing mode.")
    grad_accum: int = option(1, "Micro-batches per optimizer step.")
    center_rewards_coefficient: float = option(
        0.0, "Weight of the reward-centering term mean((r_chosen + r_rejected)^2) (Eisenstein et al. 2023); with K "
        "responses per prompt, (2 * the mean of the prompt's rewards)^2, the same at K = 2.")
    router_aux_loss_coefficient: float = option(
        -1.0, "Mixture-of-experts models (Qwen3-MoE, Mixtral): weight of the router's load-balancing loss (Switch "
        "Transformer's, as transformers computes it), logged as router_aux_loss; -1 = the checkpoint's "
        "router_aux_loss_coef, 0 = off. Other models have no router.")
    objective: str = option(
        RANKING_LOSSES[0], "K responses per prompt (shards of kind multi-response): bradley-terry (the mean of the pairs' "
        "loss over every two responses whose scores differ), plackett-luce (the likelihood of the whole ranking, "
        "ties sharing a place), regression (a score head of one output per attribute the records keep, fitted to "
        "the ratings by mean squared error; the reward is the outputs' weighted sum, attribute_weights), or "
        "bradley-terry+regression / plackett-luce+regression (both losses added). Pairs train with bradley-terry.")
    attribute_weights: str = option(
        "", "The regression objectives: the reward as a weighted sum of the attribute outputs, name=weight,... over "
        "the attributes the records keep (an attribute left out weighs 0); empty: the weights preprocessing ordered "
        "the responses by (its attribute_weights).")
    seed: int = option(0, "Seed of the data order and of the score head's initialisation.")
    eval_steps: int = option(0, "Evaluate on the eval split every this many steps; 0 = only at the end.",
                             resume_free=True)
    compile_ahead: int = option(-1, "Steps the loader reads ahead, so that a batch shape not seen yet compiles in the "
                                    "background while training goes on (the evaluations' shapes too); 0 = compile "
                                    "when the batch arrives; "
                                    "-1 = 8 on GPU and TPU (the device computes while the host compiles), 0 on CPU "
                                    "(the compiler and the step share the cores). Single-process runs only "
                                    "(several processes agree on each step's shape first).", resume_free=True)
    compilation_cache: str = option("auto", "Persistent compilation cache, so a rerun or a resumed run compiles "
                                            "nothing compiled before: auto (RMFLOW_COMPILATION_CACHE, else "
                                            "JAX_COMPILATION_CACHE_DIR, else ~/.cache/rmflow/jax), off, or a folder.",
                                    resume_free=True)
    optimizer: OptimizerConfig = section(OptimizerConfig, "AdamW and its learning-rate schedule.")
    lora: LoraConfig | None = section(LoraConfig, "LoRA (absent, null or {}: full fine-tuning). As a flag or --set, "
                                                  "any lora.* option turns it on; --set lora=none turns it off.",
                                      optional=True)
    mesh: MeshConfig = section(MeshConfig, "The device mesh and the processes of a distributed run.")
    ensemble: EnsembleConfig = section(EnsembleConfig, "An ensemble of score heads trained in one run.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpoints: when they are saved, which are kept.")
    logging: LoggingConfig = section(LoggingConfig, "Metrics: how often, and where besides metrics.jsonl.")

    def __post_init__(self) -> None:
        self._check_types()
        for name, what in (("data", self.data.train), ("model", self.model.path), ("output", self.output)):
            if not what:
                raise ConfigError(f"{name}: required (--{name})")
        for name, minimum in (("max_steps", 0), ("num_epochs", 1), ("batch_size", 1), ("grad_accum", 1),
                              ("seed", 0), ("eval_steps", 0), ("compile_ahead", -1)):
            check_int(getattr(self, name), name, minimum)
        _one_of(self.objective, "objective", OBJECTIVES)
        if self.attribute_weights.strip():
            if not fits_ratings(self.objective):
                raise ConfigError(f"attribute_weights {self.attribute_weights!r} weigh a regression head's outputs: "
                                  f"objective {self.objective} trains none (use regression or "
                                  f"{RANKING_LOSSES[0]}+{REGRESSION})")
            parse_weights(self.attribute_weights)
        if self.router_aux_loss_coefficient < 0 and self.router_aux_loss_coefficient != -1:
            raise ConfigError(f"router_aux_loss_coefficient {self.router_aux_loss_coefficient}: -1 (the model's), 0 "
                              "(off) or a positive weight")
        if self.center_rewards_coefficient < 0:
            raise ConfigError(f"center_rewards_coefficient {self.center_rewards_coefficient}: must be >= 0")
        save, metric = self.checkpoint.save_steps, self.checkpoint.metric_for_best
        if metric and save and (not self.eval_steps or save % self.eval_steps):
            raise ConfigError(f"checkpoint.metric_for_best {metric!r} ranks checkpoints by their eval: "
                              f"checkpoint.save_steps {save} must be a multiple of eval_steps {self.eval_steps} "
                              "(and eval_steps > 0)")
        warmup = self.optimizer.warmup_steps
        if self.max_steps and warmup >= self.max_steps:
            raise ConfigError(f"optimizer.warmup_steps {warmup} >= max_steps {self.max_steps}: the learning rate "
                              "would never reach its peak; use fewer warmup steps")

    def scans_layers(self, training: bool = True) -> bool:
        """Whether the decoder layers run as one scanned layer (``model.scan_layers``), in training
        or, with ``training=False``, when the run's model scores (eval, score, serve)."""
        if self.model.scan_layers != "auto":
            return self.model.scan_layers == "on"
        return not training or self.lora is not None

    @property
    def sources(self) -> tuple[DataSource, ...]:
        return self.data.sources

    def with_absolute_paths(self) -> TrainConfig:
        """Local paths made absolute (the run stores them; a hub id or a preset name stays as it is)."""
        path = self.model.path
        path = path if is_preset(path) else absolute_if_local(path)
        train = canonical_data(with_paths(self.sources, absolute))
        evals = {k: [absolute(p) for p in v] for k, v in (self.data.eval or {}).items()} or None
        return dataclasses.replace(self, data=dataclasses.replace(self.data, train=train, eval=evals),
                                   output=absolute(self.output), model=dataclasses.replace(self.model, path=path))

    def resume_changes(self, stored: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """{option: (stored, new)} for every option whose change alters the run's trajectory or
        that a checkpoint cannot continue under (``RESUME_FIXED``); ``lora``'s adapters count as one
        option, its base's storage (``LORA_BASE_STORAGE``) as options of their own."""
        free = {leaf.path for leaf in leaves(TrainConfig) if leaf.resume_free} - set(RESUME_FIXED)
        before, now = _lora_as_one(TrainConfig.from_dict(stored).flat()), _lora_as_one(self.flat())
        return {k: (before.get(k), now[k]) for k in sorted(now) if k not in free and before.get(k) != now[k]
                and (k in before or k not in LORA_BASE_STORAGE)}  # LoRA turned on: "lora" says it


# How a LoRA run's frozen base is held: it changes the trajectory, not the adapters' shapes (a
# checkpoint holds the adapters and the head; the base is stored again from its source).
LORA_BASE_STORAGE = ("lora.base_dtype", "lora.base_block_size")


def _lora_as_one(flat: dict[str, Any]) -> dict[str, Any]:
    adapters = {k.partition(".")[2]: v for k, v in flat.items()
                if k.startswith("lora.") and k not in LORA_BASE_STORAGE} or None
    if adapters is not None:  # the same projections in another order are the same adapters
        adapters["target_modules"] = sorted(adapters["target_modules"])
    return ({k: v for k, v in flat.items() if not k.startswith("lora")} | {"lora": adapters}
            | {k: flat[k] for k in LORA_BASE_STORAGE if k in flat and adapters is not None})


# Options a checkpoint cannot continue under, and why (even with --allow-config-change).
RESUME_FIXED = {
    "model.path": "the checkpoint's parameters have other shapes",
    "optimizer.moments": "the checkpoint's optimizer state is stored in another format",
    "lora": "the checkpoint's parameters have other shapes",
    "ensemble.layers": "the checkpoint's parameters have other shapes (each member's own layers)",
    "data.workers": "the loader's saved position is kept per worker process (the batches are the same with any "
                    "count)",
}
