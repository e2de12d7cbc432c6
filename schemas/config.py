"""The commands' frozen, validated configs: preprocess, eval, export, score and serve here;
train's tree of sections in ``train_config`` (imported from here too).

Each config is written into its command's output (preprocess: ``config.json`` and the
manifest), so an output always says how it was made.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rmflow.schemas.attributes import attribute_names, parse_weights
from rmflow.schemas.options import Config, ConfigError, option
from rmflow.schemas.paths import absolute, absolute_if_local
from rmflow.schemas.train_config import check_int

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
    # K rated or ranked responses per prompt (rendering.responses), trained as pairs (pairs_from):
    "responses",       # prompt, responses, scores (higher is better) or ranks (1 is best)
    "rewardbench2",    # prompt, chosen (a list), rejected (a list): RewardBench 2, RM-Bench
    "nectar",          # prompt (HH transcript), answers [{answer, rank, model}]: Nectar
    "ultrafeedback-raw",  # instruction, completions [{response, fine-grained_score, annotations ...}]
    "helpsteer",       # one row per response: prompt, response, attributes (helpfulness ...): HelpSteer2
)
MULTI_FORMATS = ("responses", "rewardbench2", "nectar", "ultrafeedback-raw", "helpsteer")
ROW_FORMATS = ("helpsteer",)  # a response a row: the rows of one prompt are grouped (GroupByKey) into one record
# Layouts whose records preprocessing always scores by its attribute_weights (a regression head
# takes them as its reward's weights by default; other layouts' scores may come from elsewhere)
SCORED_BY_WEIGHTS = ("helpsteer",)
PAIRS_FROM = ("", "expand", "best-worst", "best-random")
WHOLE_GAP = ("min_score_gap acts on pairs: a multi-response record kept whole trains on every two responses whose "
             "scores differ; add --pairs-from expand to drop the pairs closer than the gap, or drop --min-score-gap")
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
SCORE_OUTPUT_FORMATS = ("jsonl", "parquet")
STEP_SEPARATOR = "\n"  # the default text after every step of a stepwise solution (process reward models)
SCORING_BATCH_SIZE = 16  # the default sequences per forward pass when scoring (eval, score, the API)


@dataclasses.dataclass(frozen=True)
class PreprocessConfig(Config):
    """Everything that determines the output of `rmflow preprocess`."""

    inputs: tuple[str, ...] = option(
        (), "Input files, globs or directories (JSONL, JSONL.gz, JSON arrays, Parquet; local or gs://).",
        flags=("--input", "-i"), required=True)
    output: str = option("", "Output directory for shards and manifest (local or gs://).", flags=("--output", "-o"),
                         required=True)
    tokenizer: str = option("", "Tokenizer: a local or gs:// Hugging Face tokenizer folder, or a hub id.",
                            required=True)
    chat_template: str | None = option(None, "Jinja chat template file that replaces the tokenizer's own.")
    format: str = option("auto", "Input layout: auto (detected per file) or one of " + ", ".join(FORMATS) + ".")
    max_length: int = option(1024, "Longest sequence (a prompt and one reply, in tokens) a record may hold; a longer "
                                   "one follows --length-policy. Recorded in the manifest: training's default.")
    length_policy: str = option(
        "drop", "drop: drop pairs longer than max_length. truncate-prompt: cut the oldest prompt "
        "tokens (keeping the template's leading tokens and both replies whole); drop if the replies alone do not fit."
    )
    eval_fraction: float = option(0.05, "Fraction of pairs in the eval split, chosen by a hash of the pair's content.")
    split_seed: int = option(0, "Salt of the train/eval split hash.")
    dedup: bool = option(False, "Drop exact duplicate pairs (same prompt, chosen and rejected), keeping the first.")
    near_dedup: str = option("off", "Drop near-duplicates (MinHash over 5-word shingles, LSH): off, prompt (records "
                                  "whose prompts are near-duplicates) or pair (prompt and replies); the earliest "
                                  "record is kept and named in each drop's reason.")
    near_dedup_threshold: float = option(0.8, "Estimated Jaccard similarity of the shingles at which near_dedup "
                                            "counts two records as near-duplicates.")
    decontaminate: tuple[str, ...] = option(
        (), "Evaluation files or globs (any layout preprocess reads, or a prompt list): drop every record whose "
        "prompt shares an n-gram with one of their prompts (errors file reason: contaminated)."
    )
    decontaminate_ngram: int = option(
        13, "Words per n-gram for decontaminate (case, Unicode form, punctuation and whitespace ignored).")
    decontaminate_replies: bool = option(False, "Decontaminate checks the replies (or steps) too, not only the prompt.")
    decontaminate_mark_only: bool = option(
        False, "Keep contaminated records (they are written) and list them in contamination.jsonl instead of dropping them.")
    decontaminate_method: str = option(
        "auto", "How decontaminate finds overlaps: side-input (the evaluation n-grams held by every worker), join "
        "(a shuffle on n-gram hashes, for evaluation sets no worker could hold), or auto (join above 64 MiB of "
        "evaluation text). Both find the same records.")
    margin_from_scores: bool = option(
        False, "UltraFeedback layout: margin = score_chosen - score_rejected when a pair has no margin column; "
        "multi-response layouts: each pair's margin is its responses' score difference (kept whole: in the "
        "bradley-terry ranking loss)."
    )
    min_score_gap: float = option(
        0.0, "Layouts with scores (UltraFeedback): drop pairs whose score_chosen - score_rejected is under this "
        "(errors file reason: weak_label); 0 keeps every pair.")
    drop_score_ties: bool = option(
        False, "Layouts with scores: drop pairs whose chosen and rejected scores are equal (reason: tie); without "
        "it they are kept and counted (stats: score_ties_kept).")
    max_bad_fraction: float = option(
        MAX_BAD_FRACTION, "Fail the job (publish nothing) when more than this fraction of records are malformed."
    )
    num_shards: int = option(0, "Train shards (eval gets a proportional count); 0 = one per 256 MiB of input.")
    overwrite: bool = option(False, "Replace an existing output directory.")
    num_workers: int = option(1, "Local worker processes for the DirectRunner.")
    runner: str = option("DirectRunner", "Beam runner, e.g. DirectRunner or DataflowRunner.")
    beam_args: tuple[str, ...] = option((), "Extra Beam pipeline options, passed through unchanged.")
    batch_size: int = option(128, "Records per tokenizer batch call.")
    pairs_from: str = option(
        "", "Multi-response layouts (K rated or ranked responses per prompt): empty (the default) keeps each prompt "
        "whole, one responses record (its prompt computed once in training, a listwise loss); expand makes every "
        "pair of responses whose scores differ, the better one chosen (each prompt computed once per pair); "
        "best-worst the best against the worst; best-random the best against one lower-scored response, picked by a "
        "hash of the record. Every pair of one prompt goes to one split, the split its record would go to.")
    max_responses: int = option(
        16, "Multi-response layouts: a prompt with more responses keeps this many (kept whole, or before its pairs "
        "are made), the best, the worst and the rest spread evenly over the ranking (stats: responses_capped); 0 "
        "keeps all.")
    attribute_weights: str = option(
        "helpfulness=1", "Layouts that rate each response on several attributes (helpsteer): the score that orders "
        "a prompt's responses, a weighted sum name=weight,name=weight (HelpSteer2's published weights: "
        "helpfulness=0.65,correctness=0.8,coherence=0.45,complexity=0.55,verbosity=-0.4).")
    attributes: str = option(
        "", "Multi-response layouts: per-response attribute ratings to keep in each record beside its score, "
        "name,name,... in this order (helpsteer's columns, ultrafeedback-raw's annotations, a responses record's "
        "'attributes' objects); a response without one makes its record a bad record (missing_attribute). Empty "
        "keeps none.")
    step_separator: str = option(
        STEP_SEPARATOR, "Stepwise layouts (process reward models): text after every step; each step is scored at the "
        "last token of the step and its separator."
    )

    def __post_init__(self) -> None:
        for name in ("inputs", "decontaminate", "beam_args"):  # one path given alone: a tuple of one
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        self._check_types()
        if not self.inputs or not all(isinstance(p, str) and p for p in self.inputs):
            raise ConfigError("inputs: give at least one input file, glob or directory (--input)")
        if not self.output:
            raise ConfigError("output: give an output directory (--output)")
        if not self.tokenizer:
            raise ConfigError("tokenizer: give a tokenizer directory or hub id (--tokenizer)")
        self._check_layout_options()
        self._check_ranges()

    def _check_layout_options(self) -> None:
        """The options that say how raw layouts are read: each valid, and none that another makes moot."""
        parse_weights(self.attribute_weights)  # refused here, not per record
        attribute_names(self.attributes)
        if self.pairs_from not in PAIRS_FROM:
            raise ConfigError(f"pairs_from {self.pairs_from!r}: use one of {', '.join(p for p in PAIRS_FROM if p)}")
        if self.attributes.strip() and self.pairs_from:
            raise ConfigError(f"attributes {self.attributes!r} are kept in multi-response records; the pairs "
                              f"--pairs-from {self.pairs_from} makes carry none: drop one of the two")
        if self.attributes.strip() and self.format in ("rewardbench2", "nectar"):
            raise ConfigError(f"attributes {self.attributes!r}: layout {self.format} carries no attribute ratings")
        if self.format in MULTI_FORMATS and not self.pairs_from and self.min_score_gap:
            raise ConfigError(WHOLE_GAP)
        check_int(self.max_responses, "max_responses", 0)
        if self.max_responses == 1:
            raise ConfigError("max_responses 1: a prompt needs 2 responses to rank; give 2 or more, or 0 for all")
        if self.format != "auto" and self.format not in FORMATS:
            raise ConfigError(f"format {self.format!r}: use 'auto' or one of {', '.join(FORMATS)}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, needs, active in PREPROCESS_NEEDS:
            if getattr(self, name) != defaults[name] and not active(self):
                raise ConfigError(f"{name}: does nothing without {needs}; add it, or drop {name}")

    def _check_ranges(self) -> None:
        if self.length_policy not in LENGTH_POLICIES:
            raise ConfigError(
                f"length_policy {self.length_policy!r}: use one of {', '.join(LENGTH_POLICIES)}"
            )
        check_int(self.max_length, "max_length", 8)
        if not isinstance(self.step_separator, str) or not self.step_separator:
            raise ConfigError("step_separator: give a non-empty string (the default is a newline): without one, "
                              "a step's last token can merge with the next step's first")
        check_int(self.num_shards, "num_shards", 0)
        check_int(self.decontaminate_ngram, "decontaminate_ngram", 1)
        if self.near_dedup not in NEAR_DEDUP:
            raise ConfigError(f"near_dedup {self.near_dedup!r}: use one of {', '.join(NEAR_DEDUP)}")
        if not 0.0 < self.near_dedup_threshold <= 1.0:
            raise ConfigError(f"near_dedup_threshold {self.near_dedup_threshold}: must be in (0, 1]")
        if self.decontaminate_method not in DECONTAMINATE_METHODS:
            raise ConfigError(f"decontaminate_method {self.decontaminate_method!r}: use one of "
                              f"{', '.join(DECONTAMINATE_METHODS)}")
        check_int(self.num_workers, "num_workers", 1)
        check_int(self.batch_size, "batch_size", 1)
        check_int(self.split_seed, "split_seed", 0)
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
        return {k: v for k, v in self.to_dict().items() if k not in WHERE_AND_HOW}


# The preprocess options that say where or how the job runs, not what the shards hold
WHERE_AND_HOW = ("output", "overwrite", "num_workers", "runner", "beam_args", "batch_size")


def checkpoint_step(value: Any) -> int | str | None:
    """A checkpoint step as given (an int, digits, or ``best``): an int, ``"best"`` or None."""
    if value is None or value == "best":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    check_int(value, "step", 0)
    return value


# PreprocessConfig fields that decide how a raw record becomes a pair (rendering.responses.normalize_all).
NORMALIZE_OPTIONS = ("margin_from_scores", "min_score_gap", "drop_score_ties", "pairs_from", "max_responses",
                     "attributes")
EVAL_MODES = ("pairs", "rewardbench-v1", "rewardbench-v2", "responses")
EVAL_SPLITS = ("eval", "train", "all")
# PreprocessConfig fields that `rmflow eval` takes for raw files (the tokenizer, max_length and
# step separator come from the model): their defaults and help are PreprocessConfig's.
RAW_INPUT_OPTIONS = ("format", "margin_from_scores", "pairs_from", "attribute_weights")
_PRE = {f.name: f for f in dataclasses.fields(PreprocessConfig)}


# EvalConfig's, ScoreConfig's and ServeConfig's --reward (one meaning, one text)
REWARD_HELP = ("An ensemble's reward (a run with ensemble.members): mean, min, or lcb:LAMBDA (the members' mean "
               "minus LAMBDA x their standard deviation); empty: the one it was trained with. Every answer also "
               "carries the members' rewards, their mean and std.")


@dataclasses.dataclass(frozen=True)
class EvalConfig(Config):
    """Everything that determines an `rmflow eval` (the CLI options and the workflow's eval keys)."""

    model: str = option("", "A run directory from `rmflow train` or an exported checkpoint folder (local or gs://).",
                        required=True)
    data: tuple[str, ...] = option((), "A shard directory, or raw files in any layout `rmflow preprocess` reads "
                                     "(preprocessed in-process with the model's tokenizer); for a process reward "
                                     "model, stepwise data. In a workflow: default, the workflow's shards.", required=True)
    output: str = option("", "Folder for eval.json, report.md and the plots (replaced as a whole).",
                         flags=("--output", "-o"), required=True)
    split: str = option("eval", "Shard split to evaluate: eval, train or all (raw files: all).")
    step: int | str | None = option(None, "Checkpoint step of a run directory to evaluate, or best (the run's "
                                        "metric_for_best ranks it first); default: the newest.")
    batch_size: int = option(SCORING_BATCH_SIZE, "Records per forward pass (a pair, a solution, a prompt with its K responses).")
    reward: str = option("", REWARD_HELP)
    normalize: bool = option(False, "Store the mean and std of the rewards on this data with the model "
                                  "(reward_normalization.json), to standardise scores.")
    mode: str = option("pairs", "pairs; rewardbench-v1 (subset accuracies, section scores weighted as RewardBench "
                              "does); rewardbench-v2 (best-of-4, 1/k credit for ties); responses (raw files of K "
                              "scored responses per prompt: pairwise and best-of-K accuracy, Kendall's tau, "
                              "Spearman's rho, beside the length-only baseline). Raw inputs are never truncated.")
    format: str = option(_PRE["format"].default, "Raw files: " + _PRE["format"].metadata["help"])
    margin_from_scores: bool = option(_PRE["margin_from_scores"].default,
                                    "Raw files: " + _PRE["margin_from_scores"].metadata["help"])
    pairs_from: str = option(_PRE["pairs_from"].default, "Raw files: " + _PRE["pairs_from"].metadata["help"])
    attribute_weights: str = option("", "Raw files rated on several attributes (helpsteer; a responses record "
                                        "rated only by 'attributes'): the weighted sum name=weight,... that "
                                        "scores each response, as preprocess's --attribute-weights; default: the "
                                        "model's own (an attribute head's, or those its training data was scored "
                                        "by), else helpfulness=1. eval.json and report.md say which.")

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            object.__setattr__(self, "data", (self.data,))
        object.__setattr__(self, "data", tuple(self.data))
        self._check_types()
        if self.split not in EVAL_SPLITS:
            raise ConfigError(f"split {self.split!r}: use one of {', '.join(EVAL_SPLITS)}")
        if self.mode not in EVAL_MODES:
            raise ConfigError(f"mode {self.mode!r}: use one of {', '.join(EVAL_MODES)}")
        check_int(self.batch_size, "batch_size", 1)
        object.__setattr__(self, "step", checkpoint_step(self.step))
        if self.format != "auto" and self.format not in FORMATS:
            raise ConfigError(f"format {self.format!r}: use 'auto' or one of {', '.join(FORMATS)}")
        if self.attribute_weights.strip():
            parse_weights(self.attribute_weights)
        # options that cannot act in a mode are refused, not ignored
        moot = {"responses": ("pairs_from", "margin_from_scores"),
                "rewardbench-v2": RAW_INPUT_OPTIONS}.get(self.mode, ())
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        given = [name for name in moot if getattr(self, name) != defaults[name]]
        if given:
            why = "ranks each prompt's K responses as given" if self.mode == "responses" else \
                "reads RewardBench 2 files as they are"
            raise ConfigError(f"{', '.join('--' + n.replace('_', '-') for n in given)}: --mode {self.mode} {why}, "
                              "so it would do nothing: drop it")

    def raw_input_options(self) -> dict[str, Any]:
        """The preprocessing options for raw files, as PreprocessConfig keywords."""
        return {name: getattr(self, name) for name in RAW_INPUT_OPTIONS}


@dataclasses.dataclass(frozen=True)
class ExportConfig(Config):
    """Everything that determines an `rmflow export` (the CLI options and the workflow's export keys)."""

    run: str = option("", "A run directory written by `rmflow train` (local or gs://).")
    output: str = option("", "Folder for the Hugging Face checkpoint (replaced as a whole).",
                         flags=("--output", "-o"), required=True)
    step: int | str | None = option(None, "Checkpoint step to export, or best (the run's metric_for_best ranks it "
                                        "first); default: the newest.")
    max_shard_gb: float = option(2.0, "Split the safetensors weights into files of at most this size.")
    adapter: bool = option(False, "LoRA runs: a PEFT adapter folder (loaded onto the base model by "
                                "peft.PeftModel.from_pretrained) instead of merged weights.")
    dtype: str = option("float32", "Type of the exported weights: float32, or bfloat16 (half the size; scores "
                                   "within bfloat16's rounding of rmflow's). A LoRA run's merged weights are "
                                   "computed in float32 first.")
    push_to_hub: str = option("", "Also upload the export to this Hugging Face Hub repository (owner/name; "
                                  "created if missing, private), with the token of HF_TOKEN or `hf auth login`.")

    def __post_init__(self) -> None:
        self._check_types()
        if self.push_to_hub and (self.push_to_hub.count("/") != 1 or not all(self.push_to_hub.split("/"))):
            raise ConfigError(f"push_to_hub {self.push_to_hub!r}: give a repository as owner/name")
        for name, what in (("run", "the run directory to export"), ("output", "the folder to export into")):
            if not getattr(self, name):
                raise ConfigError(f"export needs {name}: {what}")
        object.__setattr__(self, "step", checkpoint_step(self.step))
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype {self.dtype!r}: float32 or bfloat16")
        if self.max_shard_gb <= 0:
            raise ConfigError(f"max_shard_gb {self.max_shard_gb!r}: must be a size in GB above 0")

    @property
    def max_shard_bytes(self) -> int:
        return int(self.max_shard_gb * 2**30)


# ScoreConfig's and ServeConfig's --deterministic (one meaning, one text)
DETERMINISTIC_HELP = ("Score each conversation alone in its row, in the batch shape its own length sets: its score is "
                      "the same to the last bit whatever it is batched with, in every entry point that asks for it "
                      "(one set of batch shapes for all; each of K responses scored as its own conversation). The "
                      "default packed rows agree with it to float rounding.")


@dataclasses.dataclass(frozen=True)
class ScoreConfig(Config):
    """Everything that determines an `rmflow score` (its CLI options)."""

    model: str = option("", "A run directory from `rmflow train` or an exported checkpoint folder (local or gs://).",
                        required=True)
    step: int | str | None = option(None, "Checkpoint step of a run directory to score with, or best (the run's "
                                        "metric_for_best ranks it first); default: the newest.")
    input: str = option("", "One JSONL file of conversations (message lists, or objects with 'messages'; for a process "
                          "reward model, solutions: objects with 'prompt' and 'completions', the steps). With "
                          "--runner: files, folders or globs (JSONL, JSON, Parquet) of conversations, preference "
                          "pairs (both sides scored) or solutions.", flags=("--input", "-i"), required=True)
    output: str = option("", "One JSONL file: the input lines with their 'score' (a process model: 'step_scores', "
                           "P(step is correct), and 'first_error'). With --runner: a folder of sorted score shards, "
                           "errors.jsonl, summary.json and COMPLETED.", flags=("--output", "-o"), required=True)
    batch_size: int = option(SCORING_BATCH_SIZE, "Conversations per forward pass (sorted by length).")
    runner: str = option("", "Empty: score in this process. A Beam runner (DirectRunner, DataflowRunner ...): score as "
                           "a Beam job; further Beam options follow the command's own.")
    beam_args: tuple[str, ...] = option((), "Extra Beam pipeline options, passed through unchanged (with --runner).")
    num_shards: int = option(0, "With --runner: output shards; 0 = one per 256 MiB of input.")
    token_budget: int = option(16384, "With --runner: tokens per forward pass (rows x padded length).")
    group_by: str = option("", "With --runner: a field naming each prompt's group of candidates; writes best.jsonl "
                             "(the highest-scoring candidate of each group) and pairs.jsonl (best against worst).")
    overwrite: bool = option(False, "With --runner: replace an earlier scoring job's output folder.")
    output_format: str = option("jsonl", "With --runner: the score shards' format, jsonl or parquet (one schema "
                                       "for every shard; a field whose types differ between records is JSON "
                                       "text). best.jsonl, pairs.jsonl and errors.jsonl stay JSONL.")
    max_bad_fraction: float = option(MAX_BAD_FRACTION, "Exit 1 when more than this fraction of records cannot be "
                                                     "scored (at or under it: exit 0, each bad record counted and "
                                                     "written with its reason). With --runner, above it nothing is "
                                                     "published.")
    truncate: str = option("error", "A conversation longer than the model's positions: error (reported as a bad "
                                  "record) or left (its earliest tokens dropped, the reply scored kept whole).")
    deterministic: bool = option(False, DETERMINISTIC_HELP)
    reward: str = option("", REWARD_HELP)

    def __post_init__(self) -> None:
        object.__setattr__(self, "beam_args", tuple(self.beam_args))
        object.__setattr__(self, "step", checkpoint_step(self.step))
        self._check_types()
        check_int(self.batch_size, "batch_size", 1)
        check_int(self.num_shards, "num_shards", 0)
        check_int(self.token_budget, "token_budget", 1)
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
class ServeConfig(Config):
    """Everything that determines an `rmflow serve` (its CLI options)."""

    model: str = option("", "A run directory from `rmflow train` or an exported checkpoint folder (local or gs://).")
    step: int | str | None = option(None, "Checkpoint step of a run directory to serve, or best (the run's "
                                        "metric_for_best ranks it first); default: the newest.")
    host: str = option("127.0.0.1", "Address to listen on (0.0.0.0: every interface; then set an API key).")
    port: int = option(8000, "Port to listen on (0: any free port; the chosen one is printed).")
    api_key: str = option("", f"Bearer token every request must carry (Authorization: Bearer ...); default: the "
                            f"{SERVE_API_KEY_ENV} environment variable; none: no authentication.")
    max_length: int = option(0, "Longest sequence (a prompt and one reply, in tokens) the server scores; 0 = the "
                              "model's positions (all it can score). What each endpoint does with a longer one: "
                              "docs/scoring-serving.md.")
    startup_length: int = option(0, "Batch shapes up to this many tokens compile at start-up, longer ones when a "
                                  "request first needs them; 0 = the length the model was trained at (its "
                                  "training data's max_length, recorded in the run and its export), else "
                                  "--max-length. Fewer tokens, a faster start.")
    token_budget: int = option(16384, "Tokens per forward pass (rows x padded length): the dynamic batcher fills "
                                    "up to this, and each batch shape holds about this many.")
    max_batch_rows: int = option(64, "Sequences per forward pass at most.")
    max_wait_ms: float = option(5.0, "How long the batcher waits for more requests before running a batch that is "
                                   "not full.")
    max_queue: int = option(8192, "Sequences waiting at most; beyond it requests get 503 with Retry-After.")
    max_queue_wait_s: float = option(10.0, "Refuse a request (503 with Retry-After) when the work queued ahead of it "
                                         "would take longer than this at the throughput measured, so that clients "
                                         "retry rather than time out (RL clients often wait 30 s); 0: no bound "
                                         "but --max-queue.")
    max_request_items: int = option(2048, "Sequences (conversations, queries, solutions) in one request at most.")
    max_body_mb: float = option(64.0, "Largest request body, in MiB.")
    shutdown_timeout_s: float = option(30.0, "On SIGTERM: stop accepting, then wait at most this long for the "
                                           "requests in flight to finish.")
    response_units: bool = option(True, "Score a /v1/score 'responses' record (one prompt's K responses) with its "
                                        "prompt run once, in units of the prompt and up to 8 responses, whose "
                                        "shapes compile at start-up beside the conversations' (twice the "
                                        "compilation); off: each response runs as its own conversation, the "
                                        "prompt again each time.")
    normalize: bool = option(False, "/get_reward, /classify, /pooling and /v1/embeddings return scores "
                                  "standardised by the model's reward_normalization.json (`rmflow eval "
                                  "--normalize`), as OpenRLHF's --normalize_reward does.")
    deterministic: bool = option(False, DETERMINISTIC_HELP + " Its batches are then those of every deterministic "
                                        "entry point (at most 8 conversations and 16,384 tokens, whatever "
                                        "--max-batch-rows and --token-budget say), always full-size; "
                                        "--response-units is off.")
    monitor_window: int = option(2048, "Conversations the reward-hacking signals (drift from the model's held-out "
                                       "scores, score-length correlation, share over the trained length) are "
                                       "computed over, in /metrics and /v1/model; 0: off.")
    monitor_log_every: int = option(1000, "Log the signals every this many conversations scored (0: only when one "
                                          "crosses its threshold).")
    reward: str = option("", REWARD_HELP + " /get_reward, /classify, /pooling and /v1/embeddings return this "
                                           "reward alone.")

    def __post_init__(self) -> None:
        self._check_types()
        if not self.model:
            raise ConfigError("model: required (a run directory or an exported checkpoint)")
        object.__setattr__(self, "step", checkpoint_step(self.step))
        for name, minimum in (("port", 0), ("max_length", 0), ("startup_length", 0), ("token_budget", 1),
                              ("monitor_window", 0), ("monitor_log_every", 0),
                              ("max_batch_rows", 1), ("max_queue", 1), ("max_request_items", 1)):
            check_int(getattr(self, name), name, minimum)
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
