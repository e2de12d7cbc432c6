"""`rmflow eval --mode responses`: a reward model on raw files of K rated or ranked responses per
prompt (every multi-response layout ``rmflow preprocess`` reads), or on multi-response shards
(``eval_records``, any mode): each response scored with its prompt, then per prompt how the rewards order the responses against their labels (pairwise
accuracy over every scored pair, best-of-K accuracy, Kendall's tau, Spearman's rho), overall and
per subset, beside the same figures for the length-only baseline (reward = the response's tokens).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from rmflow.eval.metrics import ranking_metrics
from rmflow.eval.reports import ranking_plot, write_eval
from rmflow.schemas import jsontext
from rmflow.schemas.config import MULTI_FORMATS, ROW_FORMATS, EvalConfig, parse_weights
from rmflow.schemas.errors import RmflowError
from rmflow.trainer.inference import LoadedModel, require_tokenizer, score_sequences, write_normalization


class ResponsesEvalError(RmflowError):
    """A file given to ``--mode responses`` holds a record that is not K scored responses."""


def read_prompts(paths: list[str], fmt: str, weights: dict[str, float]) -> tuple[list, dict[str, Any]]:
    """Every record of ``paths`` as CanonicalResponses (a response-a-row layout's rows grouped by
    their prompt), and those that cannot be one: {"count", "reasons": {code: n}, "first": where
    and why}, as preprocessing counts them. A file of another layout is a one-line error."""
    from rmflow.pipelines.io import expand_inputs, iter_records
    from rmflow.rendering.formats import BadRecord, detect_format
    from rmflow.rendering.responses import group_rows, read_responses, read_row

    out, rows, skipped = [], {}, {"count": 0, "reasons": {}, "first": None}

    def skip(where: str, e: Exception) -> None:
        code = getattr(e, "code", "bad_record")
        skipped["count"] += 1
        skipped["reasons"][code] = skipped["reasons"].get(code, 0) + 1
        skipped["first"] = skipped["first"] or f"{where}: {getattr(e, 'message', e)}"

    for path, _ in expand_inputs(tuple(paths)):
        for line, raw, problem in iter_records(path):
            try:
                if problem:
                    raise BadRecord("bad_encoding", problem)
                record = jsontext.loads(raw)
                if not isinstance(record, dict):
                    raise BadRecord("not_an_object", f"a JSON {type(record).__name__}, not an object")
                layout = detect_format(record) if fmt == "auto" else fmt
                if layout not in MULTI_FORMATS:
                    raise ResponsesEvalError(f"{path}:{line}: a {layout} record, not K scored responses: --mode "
                                             f"responses reads {', '.join(MULTI_FORMATS)}")
                if layout in ROW_FORMATS:
                    row = read_row(record, source=path, line=line, weights=weights)
                    rows.setdefault(row.key, []).append(row)
                else:
                    out.append(read_responses(record, layout, source=path, line=line))
            except (BadRecord, ValueError, TypeError, AttributeError, OverflowError, RecursionError) as e:
                skip(f"{path}:{line}", e)
    for group in rows.values():
        first = min(group, key=lambda r: (r.source, r.line))
        try:
            out.append(read_responses(group_rows(group), "responses", source=first.source, line=first.line))
        except BadRecord as e:
            skip(f"{first.source}:{first.line}", e)
    if not out:
        raise ResponsesEvalError(f"{', '.join(paths)}: no record holds K scored responses"
                                 + (f" ({skipped['count']} bad; the first, {skipped['first']})" if skipped["count"]
                                    else ""))
    return out, skipped


def run_responses(cfg: EvalConfig, loaded: LoadedModel) -> tuple[dict[str, Any], Callable]:
    from transformers import AutoTokenizer

    from rmflow.rendering.formats import BadRecord
    from rmflow.rendering.tokenize import RecordTokenizer

    prompts, skipped = read_prompts(list(cfg.data), cfg.format, parse_weights(cfg.attribute_weights))
    tok = AutoTokenizer.from_pretrained(require_tokenizer(cfg.model, loaded.tokenizer_dir, "--mode responses"))
    renderer = RecordTokenizer(tok, loaded.step_separator)  # as preprocessing renders: message text is text
    positions = loaded.model.config.max_position_embeddings
    seqs, spans = [], []
    for p in prompts:
        start = len(seqs)
        for response in p.responses:
            try:
                ids = renderer.encode_conversation(p.prompt + response)
            except BadRecord as e:
                raise ResponsesEvalError(f"{p.source}:{p.line}: {e.message}") from e
            if len(ids) > positions:
                raise ResponsesEvalError(f"{p.source}:{p.line}: a response of {len(ids):,} tokens with its prompt, "
                                         f"past the model's {positions:,} positions: drop it or use a model with more")
            seqs.append(ids)
        spans.append((start, len(seqs)))
    rewards = score_sequences(loaded.model, seqs, batch_size=cfg.batch_size, pad_id=loaded.pad_id)
    return _ranked(cfg, loaded, prompts, rewards, [len(s) for s in seqs], spans, skipped)


def eval_records(cfg: EvalConfig, loaded: LoadedModel, records) -> tuple[dict[str, Any], Callable]:
    """The multi-response kind's evaluator: shards of ``ResponsesRecord`` (or raw files read into
    them), each response's reward that of its own conversation with its prompt (the prompt
    computed once, ``score_responses``), ranked as ``run_responses`` ranks them."""
    from rmflow.trainer.inference import score_responses_outputs

    rewards, outputs = score_responses_outputs(loaded.model, records, pad_id=loaded.pad_id)  # each prompt once
    rewards = np.concatenate(rewards)
    lengths = [r.lasts[i] + 1 for r in records for i in range(r.k)]
    spans = np.cumsum([0] + [r.k for r in records])
    metrics, write = _ranked(cfg, loaded, records, rewards, lengths, list(zip(spans[:-1], spans[1:])),
                             {"count": 0, "reasons": {}, "first": None})
    names = loaded.model.config.attributes
    if names and records and data_attributes(cfg) == names:  # an attribute head against the ratings it learned
        metrics["ranking"]["attributes"] = attribute_metrics(np.concatenate(outputs),
                                                             np.concatenate([r.attributes for r in records]), names)
    return metrics, write


def data_attributes(cfg: EvalConfig) -> tuple[str, ...]:
    """The attribute ratings the evaluated shards keep, by name (their manifest's); () for raw files."""
    from rmflow.trainer import storage
    from rmflow.trainer.setup import read_manifest

    if len(cfg.data) != 1 or not storage.is_shard_folder([cfg.data[0]]):
        return ()
    return read_manifest(cfg.data[0]).attributes


def attribute_metrics(outputs: np.ndarray, ratings: np.ndarray, names: tuple[str, ...]) -> dict[str, dict]:
    """Per attribute, the head's outputs (n, N) against the ratings (n, N): RMSE and Pearson's r
    (nan where either does not vary)."""
    out = {}
    for j, name in enumerate(names):
        p, y = outputs[:, j].astype(np.float64), ratings[:, j].astype(np.float64)
        varies = p.std() > 0 and y.std() > 0
        out[name] = {"rmse": float(np.sqrt(np.mean((p - y) ** 2))),
                     "pearson": float(np.corrcoef(p, y)[0, 1]) if varies else float("nan")}
    return out


def _ranked(cfg: EvalConfig, loaded: LoadedModel, prompts, rewards, lengths, spans, skipped
            ) -> tuple[dict[str, Any], Callable]:
    lengths = np.asarray(lengths, np.float64)
    by = [(rewards[a:b], lengths[a:b], np.asarray(p.scores)) for p, (a, b) in zip(prompts, spans)]
    subsets = [p.subset or "all" for p in prompts]

    def figures(keep: list[bool]) -> dict[str, Any]:
        chosen = [x for x, k in zip(by, keep) if k]
        return {**ranking_metrics([r for r, _, _ in chosen], [s for _, _, s in chosen]),
                "length_baseline": ranking_metrics([n for _, n, _ in chosen], [s for _, _, s in chosen])}

    ranking = {**figures([True] * len(by)), "responses": len(rewards), "skipped": skipped,
               "subsets": {name: figures([s == name for s in subsets])
                           for name in sorted(set(subsets))} if len(set(subsets)) > 1 else {}}
    # the headline an outcome model's eval reports (``ModelKind.headline``): its pairs, here every
    # two responses of a prompt whose scores differ
    metrics = {"accuracy": ranking["pair_accuracy"], "pairs": ranking["scored_pairs"], "ranking": ranking}
    config = {**cfg.to_dict(), "model_description": loaded.description}

    def write(m: dict[str, Any], out: str) -> None:
        os.makedirs(out, exist_ok=True)
        plot = ranking_plot([r for r, _, _ in by], [s for _, _, s in by], out)
        write_eval(out, m, config, markdown(m, loaded.description, list(cfg.data)) + f"\n![rewards by label rank]({plot})\n",
                   [plot])
        if cfg.normalize:  # stored with the model, so scores can be standardised at inference
            write_normalization(cfg.model, {"mean": float(np.mean(rewards)), "std": float(np.std(rewards)),
                                            "responses": len(rewards), "data": list(cfg.data), "split": cfg.split})

    return metrics, write


def markdown(m: dict[str, Any], model: str, data: list[str]) -> str:
    r = m["ranking"]
    lines = ["# K responses per prompt", "", f"Model: {model}.  ", f"Data: {', '.join(data)}.  ",
             f"{r['prompts']:,} prompts, {r['responses']:,} responses, {r['scored_pairs']:,} pairs whose labels "
             "differ." + (f" {r['skipped']['count']:,} records skipped ("
                          + ", ".join(f"{k} x{v}" for k, v in sorted(r["skipped"]["reasons"].items()))
                          + f"; the first, {r['skipped']['first']})." if r["skipped"]["count"] else ""),
             "", "| | model | length-only baseline |", "| --- | ---: | ---: |"]
    for key, label in (("pair_accuracy", "pairwise accuracy"), ("best_of_k_accuracy", "best-of-K accuracy"),
                       ("kendall_tau", "Kendall's tau"), ("spearman", "Spearman's rho")):
        lines.append(f"| {label} | {r[key]:.4f} | {r['length_baseline'][key]:.4f} |")
    if r["subsets"]:
        lines += ["", "| subset | prompts | pairwise accuracy | best-of-K | length baseline (pairwise) |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {v['prompts']:,} | {v['pair_accuracy']:.4f} | {v['best_of_k_accuracy']:.4f} | "
                  f"{v['length_baseline']['pair_accuracy']:.4f} |" for k, v in r["subsets"].items()]
    if r.get("attributes"):  # an attribute head's outputs against the ratings
        lines += ["", "| attribute | RMSE | Pearson's r |", "| --- | ---: | ---: |"]
        lines += [f"| {k} | {v['rmse']:.4f} | {v['pearson']:.4f} |" for k, v in r["attributes"].items()]
    return "\n".join(lines) + "\n"
