"""`rmflow eval`: a model (a run directory or an exported checkpoint) on shards or raw files.

Raw preference files in any layout `rmflow preprocess` reads are preprocessed in-process by
that same pipeline (into a temporary folder, with the model's tokenizer and no eval split),
never by a second implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from rmflow.eval.ensemble import ensemble_pairs
from rmflow.eval.figures import pair_metrics, process_metrics
from rmflow.eval.probes import pair_probes
from rmflow.eval.reports import rewardbench_v2_markdown, write_eval, write_process_report, write_report
from rmflow.eval.rewardbench import TIES, best_of_n_credit, ties_score, v1_scores, v2_scores
from rmflow.handlers import handler
from rmflow.schemas import jsontext
from rmflow.schemas.config import (
    RAW_INPUT_OPTIONS,
    SCORED_BY_WEIGHTS,
    EvalConfig,
    PreprocessConfig,
)
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.heads import head_of
from rmflow.schemas.kinds import kind_of_record
from rmflow.schemas.manifest import MANIFEST_FILE
from rmflow.schemas.outputs import check_replaceable, output_lock, staged_output
from rmflow.schemas.record import decode
from rmflow.trainer import storage
from rmflow.trainer.inference import (
    LoadedModel,
    load_model,
    require_tokenizer,
    write_normalization,
)
from rmflow.trainer.model_setup import check_model_fits, check_tokenizer, read_manifest


class EvalError(RmflowError):
    """An evaluation cannot run or found nothing to evaluate; the message says why and what to do.
    (Errors about the model or the shards themselves come from the trainer as TrainError.)"""

INPUT_ERRORS = "input_errors.jsonl"
EVAL_FOLDER = "eval folder"  # schemas.outputs.OUTPUT_SIGNATURES' name of what eval writes
Writer = Callable[[dict[str, Any], str], Any]  # (metrics, eval folder): writes eval.json, report.md, plots


def load_records(cfg: EvalConfig, loaded: LoadedModel, output: str, raw_options: dict[str, Any]
                 ) -> tuple[list, dict[str, Any] | None, bool]:
    """(records, summary of the raw-input preprocessing or None, whether their labels are weighted
    sums of attribute ratings). Shards are checked against the model's tokenizer and vocabulary;
    raw inputs are preprocessed with the model's tokenizer, and what that set aside is written to
    ``output``/input_errors.jsonl; when nothing was usable, beside ``cfg.output`` (the folder
    ``output`` is staged for), which keeps its earlier eval."""
    data, split, model, tokenizer = list(cfg.data), cfg.split, loaded.model, loaded.tokenizer_dir
    input_summary = None
    if len(data) == 1 and storage.is_remote(data[0]) and storage.has_manifest(data[0]):
        data = [storage.stage_shards(data[0])]
    if len(data) == 1 and os.path.exists(os.path.join(data[0], MANIFEST_FILE)):
        folder = data[0]
        manifest = read_manifest(folder)
        check_tokenizer(manifest, tokenizer, f"the model {cfg.model}")
        check_model_fits(manifest, model.config)
    else:
        return _prepare_raw(cfg, loaded, output, raw_options)
    splits = list(manifest.splits) if split == "all" else [split]
    paths = [os.path.join(folder, s.file) for name in splits if name in manifest.splits
             for s in manifest.splits[name].shards]
    source = grain.sources.ArrayRecordDataSource(paths) if paths else []
    records = [decode(source[i]) for i in range(len(source))]
    if not records:
        raise EvalError(f"nothing to evaluate in split {split!r} of {folder}: it holds no records")
    return records, input_summary, manifest.scored_by_weights


def _prepare_raw(cfg: EvalConfig, loaded: LoadedModel, output: str, raw_options: dict[str, Any]
                 ) -> tuple[list, dict[str, Any], bool]:
    """Raw files preprocessed in this process with the model's tokenizer (``rendering.prepare``:
    the job's steps, no Beam); what that set aside goes to ``output``/input_errors.jsonl, or, when
    nothing was usable, beside the eval's output (``cfg.output``), which keeps its earlier eval."""
    from rmflow.rendering.accounting import PreprocessError
    from rmflow.rendering.prepare import local_record_tokenizer, prepare

    folder = require_tokenizer(cfg.model, loaded.tokenizer_dir, "evaluating raw files")
    raw = PreprocessConfig(inputs=tuple(cfg.data), output=os.path.join(output, "shards"), tokenizer=folder,
                           max_length=loaded.model.config.max_position_embeddings, eval_fraction=0.0,
                           max_bad_fraction=1.0, max_responses=0, step_separator=loaded.step_separator, **raw_options)
    kept = os.path.join(output, INPUT_ERRORS)
    try:
        prepared = prepare(raw, local_record_tokenizer(folder, loaded.step_separator, raw.format), errors_file=kept)
    except PreprocessError as e:  # e.g. no usable pair: keep the reasons where the user can read them
        where = write_input_errors(e.dead, failed_errors_path(cfg.output)) if e.dead else None
        raise EvalError(e.reason + (f"; every record set aside and its reason: {where}" if where else "")) from e
    write_input_errors(prepared.dead, kept)
    counts = prepared.stats["counts"]
    weighted = bool(counts["scored_by_weights"]) or any(x in SCORED_BY_WEIGHTS for x in prepared.layouts)
    return prepared.records, {"counts": counts, "not_scored": prepared.stats["dead_letters"],
                              "left_out": left_out(counts)}, weighted


def write_input_errors(dead: list[dict[str, Any]], dest: str) -> str:
    """The records a raw input's preprocessing set aside, one JSON line each, as errors.jsonl has them."""
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    with open(dest, "w") as f:
        f.writelines(jsontext.dumps(d, sort_keys=True) + "\n" for d in dead)
    return dest


def left_out(counts: dict[str, int]) -> list[dict[str, Any]]:
    """What a raw input's preprocessing did not pass on to the eval, by reason, in words: records
    not written (``NOT_WRITTEN``) and responses left out of their records."""
    from rmflow.rendering.accounting import NOT_WRITTEN, NOTED_COUNTS

    out = [{"count": counts[key], "why": f"records {what}"} for key, _, what in NOT_WRITTEN if counts.get(key)]
    return out + [{"count": counts[key], "why": what} for key, category, _, what in NOTED_COUNTS
                  if category == "merged" and counts.get(key)]


def failed_errors_path(output: str) -> str:
    """Where a raw-file eval that found nothing usable keeps the reasons: beside the output folder,
    which keeps the earlier eval it holds (an eval folder is replaced only by a finished eval)."""
    return os.path.abspath(output.rstrip("/")) + "." + INPUT_ERRORS


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate ``cfg.model`` on ``cfg.data``. The output folder is locked while the eval runs,
    written in a staging folder and swapped in whole."""
    output = cfg.output
    # never a folder of other files, nor one holding the model or the data: the eval replaces it whole
    check_replaceable(output, EVAL_FOLDER, inputs=(cfg.model, *cfg.data))
    with output_lock(output, "rmflow eval"):
        with contextlib.suppress(FileNotFoundError):  # a failed earlier eval's reasons: this eval's replace them
            os.remove(failed_errors_path(output))
        with staged_output(output, EVAL_FOLDER) as staging:
            return _run_eval(cfg, staging)


def check_raw_options(cfg: EvalConfig) -> None:
    """The raw-file options (``RAW_INPUT_OPTIONS``) act only on raw files, ``--split`` only on
    shards: given for the other, they would do nothing (and eval.json would record them as if
    applied), so they are refused."""
    shards = storage.is_shard_folder(list(cfg.data))
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    if shards:
        given = [n for n in RAW_INPUT_OPTIONS if getattr(cfg, n) != defaults[n]]
        if given and cfg.mode != "rewardbench-v2":
            raise EvalError(f"{', '.join('--' + n.replace('_', '-') for n in given)}: applies to raw files; "
                            f"{cfg.data[0]} is a shard folder, preprocessed already: drop it")
    elif cfg.split != defaults["split"]:
        raise EvalError(f"--split {cfg.split}: applies to shards; raw files are read whole: drop it")


DEFAULT_LABEL_WEIGHTS = "helpfulness=1"  # a raw file's attribute weights when neither it nor the model names any


def label_weights(cfg: EvalConfig, loaded: LoadedModel) -> tuple[str, str]:
    """(the attribute weights that score raw records rated by attributes, where they come from):
    --attribute-weights; else the model's own, an attribute head's or those its training data was
    scored by; else ``DEFAULT_LABEL_WEIGHTS``."""
    if cfg.attribute_weights.strip():
        return cfg.attribute_weights, "--attribute-weights"
    config = loaded.model.config
    own = head_of(config).label_weights(config)
    if own:
        return own, "the model's attribute head"
    if loaded.label_weights:
        return loaded.label_weights, "those the model's training data was scored by"
    return DEFAULT_LABEL_WEIGHTS, "the default: give --attribute-weights for others"


def _run_eval(cfg: EvalConfig, staging: str) -> dict[str, Any]:
    if cfg.normalize and storage.is_remote(cfg.model):
        raise EvalError("--normalize stores reward_normalization.json in the model folder: give a local copy "
                         f"of {cfg.model}")
    loaded = load_model(cfg.model, cfg.step, cfg.reward)
    kind = loaded.kind
    if cfg.mode not in kind.eval_modes or (cfg.normalize and not kind.head.per_conversation):
        asked = f"--mode {cfg.mode}" + (" and --normalize" if cfg.normalize and not kind.head.per_conversation else "")
        raise EvalError(f"{asked} do not apply to {cfg.model}, {kind.description}: its modes are "
                        f"{', '.join(kind.eval_modes)}" + ("" if kind.head.per_conversation else ", without --normalize"))
    check_raw_options(cfg)
    input_summary, weights = None, None
    if cfg.mode == "rewardbench-v2":
        metrics, write = run_rewardbench_v2(cfg, loaded)
    else:
        weights = label_weights(cfg, loaded)
        records, input_summary, weighted = load_records(
            cfg, loaded, staging, {**cfg.raw_input_options(), "attribute_weights": weights[0]})
        found = kind_of_record(records[0])
        if found.model is not kind:
            raise EvalError(f"{cfg.data[0]} holds {found.data}, which {found.model.description} scores; {cfg.model} "
                            f"is {kind.description}: evaluate it on {kind.data}")
        if cfg.mode not in found.record_modes:
            raise EvalError(f"--mode {cfg.mode} does not evaluate {found.data}, which {', '.join(cfg.data)} holds: "
                            f"use --mode {' or '.join(found.record_modes)}")
        if weighted:  # its labels are weighted sums of ratings: which weights, said
            weights = (weights[0] if input_summary is not None else
                       read_manifest(cfg.data[0]).config.get("attribute_weights") or DEFAULT_LABEL_WEIGHTS,
                       weights[1] if input_summary is not None else "the shards' preprocessing")
        else:
            weights = None
        metrics, write = handler(found.name, "evaluate")(cfg, loaded, records)  # by what the records are
    metrics = {"kind": kind.name, **metrics}
    if input_summary is not None:
        metrics["input"] = input_summary
    if weights is not None:
        metrics["label_weights"] = {"weights": weights[0], "from": weights[1]}
    write(metrics, staging)
    return metrics


def _subsets(records) -> list[str] | None:
    """Each record's subset; failing that its source file, when the records come from several."""
    subsets = [r.subset for r in records]
    if any(s is None for s in subsets):
        sources = [r.source for r in records]
        subsets = sources if len(set(sources)) > 1 else None
    return subsets


def front_door(loaded: LoadedModel):
    """The loaded model as every consumer scores it (``rmflow.RewardModel``): eval's
    scores are the API's, the server's and ``rmflow score``'s. Shards need no tokenizer."""
    from rmflow.scoring.api import RewardModel

    return RewardModel(loaded, tokenizer=None, normalization=loaded.normalization)


def eval_pairs(cfg: EvalConfig, loaded: LoadedModel, records) -> tuple[dict[str, Any], Writer]:
    if cfg.mode == "rewardbench-v1":
        unlabeled = sum(r.subset is None for r in records)
        if unlabeled:
            raise EvalError(f"rewardbench-v1 needs a 'subset' on every pair; {unlabeled:,} of {len(records):,} pairs "
                             "have none (RewardBench rows carry it: keep the column when converting)")
    rm = front_door(loaded)
    rc, rr = rm.score_records(records, batch_size=cfg.batch_size)
    metrics = pair_metrics(
        rc, rr, margin=np.array([r.margin or 0.0 for r in records]),
        len_chosen=np.array([len(r.chosen_ids) - r.prompt_len for r in records]),
        len_rejected=np.array([len(r.rejected_ids) - r.prompt_len for r in records]),
        subsets=_subsets(records),
    )
    if cfg.mode == "rewardbench-v1":
        metrics["rewardbench_v1"] = v1_scores(metrics["subsets"])
    metrics["probes"] = pair_probes(rm, records, rc, rr, batch_size=cfg.batch_size)
    if loaded.model.config.members:  # an ensemble: its members against their reward
        metrics["ensemble"] = ensemble_pairs(rm, records, rc, rr, cfg.batch_size)
    config = {**cfg.to_dict(), "model_description": loaded.description}

    def write(m: dict[str, Any], output: str) -> None:
        write_report(m, rc, rr, output, config)
        if cfg.normalize:  # stored with the model, so scores can be standardised at inference
            both = np.concatenate([rc, rr])
            write_normalization(cfg.model, {"mean": float(both.mean()), "std": float(both.std()), "pairs": len(records),
                                            "data": list(cfg.data), "split": cfg.split,
                                            **({"member_std": m["ensemble"]["reward_std_mean"],
                                                "reward": loaded.model.config.member_reward}
                                               if "ensemble" in m else {})})
    return metrics, write


def eval_process(cfg: EvalConfig, loaded: LoadedModel, records) -> tuple[dict[str, Any], Writer]:
    p_correct = front_door(loaded).score_records(records, batch_size=cfg.batch_size)
    labels = [r.step_labels for r in records]
    metrics = process_metrics(p_correct, labels, subsets=_subsets(records))
    config = {"model": cfg.model, "model_description": loaded.description, "data": list(cfg.data),
              "split": cfg.split, "batch_size": cfg.batch_size, "mode": "process"}
    return metrics, lambda m, output: write_process_report(m, p_correct, labels, output, config)



def run_rewardbench_v2(cfg: EvalConfig, loaded: LoadedModel) -> tuple[dict[str, Any], Writer]:
    """RewardBench 2 layout: prompt, chosen (list), rejected (list), subset. Best-of-n with tie credit."""
    from transformers import AutoTokenizer

    from rmflow.rendering.files import expand_inputs, iter_records
    from rmflow.rendering.tokenize import RecordTokenizer

    data = list(cfg.data)
    tok = AutoTokenizer.from_pretrained(require_tokenizer(cfg.model, loaded.tokenizer_dir, "rewardbench-v2"))
    read = _Rb2Records(RecordTokenizer(tok, loaded.step_separator),  # as preprocessing renders: message text is text
                       loaded.model.config.max_position_embeddings)
    for path, _ in expand_inputs(tuple(data)):
        for line, raw, problem in iter_records(path):
            read.add(f"{path}:{line}", raw, problem)
    seqs, examples, ties, skipped = read.seqs, read.examples, read.ties, read.skipped
    if not seqs:
        raise EvalError(f"rewardbench-v2: no record of {', '.join(data)} can be scored ({skipped['count']} skipped; "
                        f"the first, {skipped['first']})")
    scores = np.asarray(front_door(loaded).score_ids(seqs, batch_size=cfg.batch_size))
    k = max((n for _, n, _ in examples), default=0)
    if any(n != k for _, n, _ in examples):
        raise EvalError("rewardbench-v2: every example outside the Ties subset needs the same number of completions")
    chosen = np.array([scores[s] for s, _, _ in examples])
    rejected = np.array([scores[s + 1 : s + n] for s, n, _ in examples]).reshape(len(examples), max(k - 1, 0))
    credits = best_of_n_credit(chosen, rejected) if examples else np.zeros(0)
    tie_scores = None
    if ties:
        try:
            tie_scores = {**ties_score([(i, c, scores[s : s + n]) for i, c, s, n in ties]), "examples": len(ties)}
        except ValueError as e:
            raise EvalError(f"rewardbench-v2: {e}") from e
    metrics = {"examples": len(examples) + len(ties), "completions_per_example": k, "skipped": skipped,
               "rewardbench_v2": v2_scores(credits, [sub for _, _, sub in examples], tie_scores)}
    return metrics, lambda m, out: write_eval(out, m, {**cfg.to_dict(), "model_description": loaded.description},
                                              rewardbench_v2_markdown(m, loaded.description, data))


class _Rb2Records:
    """RewardBench 2 records encoded as scored: ``seqs`` every completion's tokens; ``examples``
    (first sequence, completions, subset) of best-of-n records; ``ties`` (id, correct, first
    sequence, completions) of the Ties subset; ``skipped`` what cannot be scored, by reason."""

    def __init__(self, renderer, positions: int):
        self.renderer, self.positions = renderer, positions
        self.seqs: list = []
        self.examples: list[tuple[int, int, str]] = []
        self.ties: list[tuple[str, int, int, int]] = []
        self.skipped: dict[str, Any] = {"count": 0, "reasons": {}, "first": None}

    def skip(self, where: str, code: str, message: str) -> None:
        self.skipped["count"] += 1
        self.skipped["reasons"][code] = self.skipped["reasons"].get(code, 0) + 1
        self.skipped["first"] = self.skipped["first"] or f"{where}: {message}"

    def add(self, where: str, raw: str, problem: str | None) -> None:
        try:
            rec = jsontext.loads(raw) if not problem else None
        except (ValueError, RecursionError) as e:
            return self.skip(where, "bad_json", f"not valid JSON text: {e}")
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) \
                or not _text_list(rec.get("chosen")) or not _text_list(rec.get("rejected")):
            return self.skip(where, "not_rewardbench2", "not a RewardBench 2 record (prompt, chosen list, rejected list, "
                             "of strings)" + (f": {problem}" if problem else ""))
        is_ties = rec.get("subset") == TIES
        if is_ties and (not isinstance(rec.get("id"), str) or rec.get("num_correct") != len(rec["chosen"])):
            return self.skip(where, "bad_ties_record", "a Ties record needs its id (ref:N or tied:N) and num_correct "
                             "(its number of chosen answers), as RewardBench 2 has them")
        # best-of-n scores the first chosen answer against the rejected ones; Ties scores every answer
        completions = (list(rec["chosen"]) if is_ties else list(rec["chosen"])[:1]) + list(rec["rejected"])
        encoded = []
        for text in completions:  # the first that cannot be scored skips the record, once
            ids = self._encoded(where, rec["prompt"], text)
            if ids is None:
                return None
            encoded.append(ids)
        start = len(self.seqs)
        self.seqs += encoded
        if is_ties:
            self.ties.append((rec["id"], len(rec["chosen"]), start, len(completions)))
        else:
            self.examples.append((start, len(completions), str(rec.get("subset", "all"))))
        return None

    def _encoded(self, where: str, prompt: str, text: str):
        """A completion's tokens with its prompt, or None (skipped, with why)."""
        from rmflow.rendering.formats import BadRecord

        if len(prompt) + len(text) > self.positions * self.renderer.longest_token:  # before tokenizing it
            return self.skip(where, "too_long", f"a completion of {len(text):,} characters with its prompt, more than "
                             f"the model's {self.positions:,} positions ever hold")
        try:
            ids = self.renderer.encode_conversation((("user", prompt), ("assistant", text)))
        except BadRecord as e:
            return self.skip(where, e.code, e.message)
        if len(ids) > self.positions:
            return self.skip(where, "too_long", f"a completion of {len(ids):,} tokens, past the model's "
                             f"{self.positions:,} positions: a score there is a number the model was never made for")
        return ids


def _text_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


