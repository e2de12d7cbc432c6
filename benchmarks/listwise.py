"""One epoch of K responses per prompt, three ways, back to back in one run: rmflow listwise (each
prompt once with its K responses, ``pack``), rmflow on the same data expanded to every pair whose
scores differ (``--pairs-from expand``, ``pack``), and TRL's RewardTrainer on those expanded pairs.

The same prompts of the RM-Bench dev file (K = 6: 3 chosen, 3 rejected, so 9 pairs a prompt) are
preprocessed twice with the SmolLM2 tokenizer, once kept whole and once expanded, with the same
split seed: a prompt is held out by its content, so both hold out the same prompts and the
held-out pairwise accuracy is over the same pairs. The same tiny Llama (built once with
transformers, score head included) starts every run; the same learning rate, warmup, schedule
and clipping; each runs one epoch of its data, and a listwise step holds as many pairs as a pair
run's step on average (``--batch-size`` pairs; ``--listwise-batch-size`` prompts, by default the
batch size times the prompts per pair, at least 1), so all three take about as many optimizer
steps. Each trainer runs in a process of its own (``benchmarks/vs_trl.py``'s
children). Printed per run: the wall time of the epoch (data loading and compilations included,
the final held-out evaluation not), real tokens (every conversation a trainer of pairs would
compute, prompt counted each time), the tokens the model actually ran, peak memory, held-out
pairwise accuracy; then the ratios against the listwise run. ``--repeat`` alternates the three
and reports medians and spreads.

    .venv/bin/python benchmarks/listwise.py [--prompts 150] [--batch-size 4] [--max-length 1024]
        [--listwise-batch-size N] [--objective bradley-terry] [--repeat 1] [--runs NAME,...]

Needs the `bench` extra (trl, torch CPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pathlib
import statistics
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import vs_trl
from bench_common import DEMO_TOKENIZER as TOKENIZER
from bench_common import REPO

DATA = REPO.parent / "shared" / "data" / "multi_response" / "rmbench_dev.jsonl.gz"


def prepare(work: pathlib.Path, data: pathlib.Path, prompts: int, max_length: int, tokenizer: str) -> dict:
    import torch
    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.schemas.config import PreprocessConfig
    from transformers import LlamaConfig, LlamaForSequenceClassification

    with gzip.open(data, "rt") if data.suffix == ".gz" else open(data) as f:
        lines = [x for x in f if x.strip()][:prompts]
    src = work / "data.jsonl"
    src.write_text("".join(lines))
    stats = {}
    for name, pairs_from in (("whole", ""), ("pairs", "expand")):
        stats[name] = preprocess(PreprocessConfig(inputs=(str(src),), output=str(work / name), tokenizer=tokenizer,
                                                  max_length=max_length, eval_fraction=0.2, pairs_from=pairs_from,
                                                  num_shards=1)).stats
    tok = json.loads((work / "whole" / "manifest.json").read_text())["tokenizer"]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok["vocab_size"], num_labels=1, pad_token_id=tok["pad_token_id"],
                         eos_token_id=tok["eos_token_id"], tie_word_embeddings=False, **vs_trl.TINY)
    LlamaForSequenceClassification(config).save_pretrained(work / "model")
    for f in (work / "whole" / "tokenizer").iterdir():
        (work / "model" / f.name).write_bytes(f.read_bytes())
    return {name: s["counts"] for name, s in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--tokenizer", default=str(TOKENIZER))
    ap.add_argument("--prompts", type=int, default=150, help="the file's first prompts (0: all)")
    ap.add_argument("--batch-size", type=int, default=8, help="pairs a step")
    ap.add_argument("--listwise-batch-size", type=int, default=0, help="prompts a listwise step (0: as many pairs "
                    "as --batch-size on average)")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--objective", default="bradley-terry")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--runs", default="", help="run only these, comma-separated (of: rmflow listwise, rmflow "
                                                "expanded pairs, TRL expanded pairs); default all three")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rmflow-listwise-") as tmp:
        work = pathlib.Path(tmp)
        counts = prepare(work, pathlib.Path(a.data), a.prompts or 10**9, a.max_length, a.tokenizer)
        train_pairs, train_prompts = counts["pairs"]["pairs_written_train"], counts["whole"]["pairs_written_train"]
        listwise_batch = a.listwise_batch_size or max(1, round(a.batch_size * train_prompts / train_pairs))
        common = {"model": str(work / "model"), "batch": a.batch_size, "lr": a.learning_rate, "center": 0.0,
                  "max_length": a.max_length, "cache": "off", "mode": "pack"}
        pair_steps = math.ceil(train_pairs / a.batch_size)
        runs = {
            "rmflow listwise": ("rmflow", {**common, "shards": str(work / "whole"), "steps": 0, "batch": listwise_batch,
                                           "warmup": max(1, math.ceil(train_prompts / listwise_batch) // 10),
                                           "objective": a.objective, "work": str(work / "listwise")}),
            "rmflow expanded pairs": ("rmflow", {**common, "shards": str(work / "pairs"), "steps": 0,
                                                 "warmup": max(1, pair_steps // 10), "work": str(work / "pairs-rm")}),
            "TRL expanded pairs": ("trl", {**common, "shards": str(work / "pairs"), "steps": pair_steps,
                                           "warmup": max(1, pair_steps // 10), "trl_order": "own",
                                           "work": str(work / "trl")}),
        }
        if a.runs:
            runs = {name: runs[name] for name in (x.strip() for x in a.runs.split(","))}
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for rep in range(a.repeat):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))  # alternate, as the machine drifts
            for name in order:
                kind, args = runs[name]
                args = {**args, "work": os.path.join(args["work"], f"rep-{rep}")}  # a run's own folders
                os.makedirs(args["work"], exist_ok=True)
                out, launched = vs_trl.launch(kind, args)
                steps = out["steps"]
                real = sum(s["real"] for s in steps)
                ran = sum(s["real"] * s.get("computed_fraction", 1.0) for s in steps)
                results[name].append({"wall": out["wall"], "real": real, "ran": ran, "peak_mib": out["peak_mib"],
                                      "accuracy": out["eval_accuracy"], "eval_pairs": out["eval_pairs"],
                                      "steps": len(steps)})
                print(json.dumps({"run": name, "rep": rep, **results[name][-1]}), flush=True)
    print(f"\n{a.data}: {f'the first {a.prompts}' if a.prompts else 'all its'} prompts; "
          f"{counts['whole']['pairs_written_train']} train prompts "
          f"({train_pairs} pairs expanded), {counts['whole']['pairs_written_eval']} held out; tiny Llama, SmolLM2 "
          f"tokenizer, {a.batch_size} pairs or {listwise_batch} prompts a step, max_length {a.max_length}, "
          f"{a.objective}, one epoch; "
          f"median of {a.repeat} (spread min-max)\n")
    head = ("run", "steps", "epoch s", "spread", "listwise faster by", "real tokens", "tokens run", "peak MiB",
            "held-out pairwise accuracy")
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    base = statistics.median(r["wall"] for r in results.get("rmflow listwise") or next(iter(results.values())))
    for name, rs in results.items():
        wall = statistics.median(r["wall"] for r in rs)
        r0 = rs[0]
        print(f"| {name} | {r0['steps']} | {wall:.1f} | {min(r['wall'] for r in rs):.1f}-{max(r['wall'] for r in rs):.1f}"
              f" | {wall / base:.2f}x | {r0['real']:,} | {r0['ran']:,.0f} | "
              f"{statistics.median(r['peak_mib'] for r in rs):,.0f} | "
              f"{statistics.median(r['accuracy'] for r in rs):.3f} ({r0['eval_pairs']:,} pairs) |")


if __name__ == "__main__":
    main()
