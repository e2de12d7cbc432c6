"""The multi-response kind's evaluator (``eval_records``): a reward model on K rated or ranked
responses per prompt, from shards or raw files in any multi-response layout (preprocessed
in-process as `rmflow eval` preprocesses every raw file), in the default mode or ``--mode
responses``: each response scored with its prompt (the prompt computed once), then per prompt
how the rewards order the responses against their labels (pairwise accuracy over every scored
pair, best-of-K accuracy, Kendall's tau, Spearman's rho), overall and per subset, beside the same
figures for the length-only baseline (reward = the response's tokens).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from rmflow.eval.figures import ranking_metrics
from rmflow.eval.probes import probe_lines, response_probes
from rmflow.eval.reports import figure, input_lines, ranking_plot, write_eval
from rmflow.schemas.config import EvalConfig
from rmflow.trainer.inference import LoadedModel, write_normalization


def eval_records(cfg: EvalConfig, loaded: LoadedModel, records) -> tuple[dict[str, Any], Callable]:
    """The multi-response kind's evaluator: shards of ``ResponsesRecord`` (or raw files read into
    them), each response's reward that of its own conversation with its prompt (the prompt
    computed once, ``score_responses``), ranked against their labels."""
    from rmflow.eval.evaluation import front_door

    rm = front_door(loaded)
    per_record, outputs = rm.score_records(records)  # each prompt once
    rewards = np.concatenate(per_record)
    lengths = [r.lasts[i] + 1 for r in records for i in range(r.k)]
    spans = np.cumsum([0] + [r.k for r in records])
    member_std = float(np.concatenate(outputs).std(-1).mean()) if loaded.model.config.members else None
    metrics, write = _ranked(cfg, loaded, records, rewards, lengths, list(zip(spans[:-1], spans[1:])), member_std)
    metrics["probes"] = response_probes(rm, records, per_record)
    names = loaded.model.config.attributes
    if names and records and data_attributes(cfg) == names:  # an attribute head against the ratings it learned
        metrics["ranking"]["attributes"] = attribute_metrics(np.concatenate(outputs),
                                                             np.concatenate([r.attributes for r in records]), names)
    return metrics, write


def data_attributes(cfg: EvalConfig) -> tuple[str, ...]:
    """The attribute ratings the evaluated shards keep, by name (their manifest's); () for raw files."""
    from rmflow.trainer import storage
    from rmflow.trainer.model_setup import read_manifest

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


def _ranked(cfg: EvalConfig, loaded: LoadedModel, prompts, rewards, lengths, spans, member_std: float | None = None
            ) -> tuple[dict[str, Any], Callable]:
    lengths = np.asarray(lengths, np.float64)
    by = [(rewards[a:b], lengths[a:b], np.asarray(p.scores)) for p, (a, b) in zip(prompts, spans)]
    subsets = [p.subset or "all" for p in prompts]

    def figures(keep: list[bool]) -> dict[str, Any]:
        chosen = [x for x, k in zip(by, keep) if k]
        return {**ranking_metrics([r for r, _, _ in chosen], [s for _, _, s in chosen]),
                "length_baseline": ranking_metrics([n for _, n, _ in chosen], [s for _, _, s in chosen])}

    ranking = {**figures([True] * len(by)), "responses": len(rewards),
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
                                            "responses": len(rewards), "data": list(cfg.data), "split": cfg.split,
                                            **({"member_std": member_std, "reward": loaded.model.config.member_reward}
                                               if member_std is not None else {})})

    return metrics, write


def markdown(m: dict[str, Any], model: str, data: list[str]) -> str:
    r = m["ranking"]
    lines = ["# K responses per prompt", "", f"Model: {model}.  ", f"Data: {', '.join(data)}.  ",
             f"{r['prompts']:,} prompts, {r['responses']:,} responses, {r['scored_pairs']:,} pairs whose labels "
             "differ" + (f"; {r['prompts'] - r['ranked_prompts']:,} prompts with nothing to rank (one response, or all "
                         "of one score: kept for their attribute ratings)" if r["prompts"] > r["ranked_prompts"] else "")
             + ".", *input_lines(m), "", "| | model | length-only baseline |", "| --- | ---: | ---: |"]
    for key, label in (("pair_accuracy", "pairwise accuracy"), ("best_of_k_accuracy", "best-of-K accuracy"),
                       ("kendall_tau", "Kendall's tau"), ("spearman", "Spearman's rho")):
        lines.append(f"| {label} | {figure(r[key], 4)} | {figure(r['length_baseline'][key], 4)} |")
    if r["subsets"]:
        lines += ["", "| subset | prompts | pairwise accuracy | best-of-K | length baseline (pairwise) |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {v['prompts']:,} | {figure(v['pair_accuracy'], 4)} | {figure(v['best_of_k_accuracy'], 4)} | "
                  f"{figure(v['length_baseline']['pair_accuracy'], 4)} |" for k, v in r["subsets"].items()]
    if r.get("attributes"):  # an attribute head's outputs against the ratings
        lines += ["", "| attribute | RMSE | Pearson's r |", "| --- | ---: | ---: |"]
        lines += [f"| {k} | {figure(v['rmse'], 4)} | {figure(v['pearson'], 4)} |" for k, v in r["attributes"].items()]
    style = next((p for p in m.get("probes", []) if p["name"] == "style and substance"), None)
    if style:
        lines += ["", "## Style and substance (RM-Bench)", "", "| chosen \\ rejected | "
                  + " | ".join(style["styles"]) + " |", "| --- |" + " ---: |" * 3]
        lines += [f"| {name} | " + " | ".join(f"{x:.4f}" for x in row) + " |"
                  for name, row in zip(style["styles"], style["table"])]
    if m.get("probes"):
        lines += ["", "## Sanity probes", "", *(f"* {x}" for x in probe_lines(m["probes"]))]
    return "\n".join(lines) + "\n"
