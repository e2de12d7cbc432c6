"""An ensemble of score heads (``ensemble.members``), or of members with their own top layers
(``--layers``: ``ensemble.layers``), against one reward model, trained the same way on the same
HH-RLHF pairs (``--lora RANK``: both LoRA runs; with ``--layers`` the model's layer count, N
LoRA members over every layer of one frozen base).

Printed: training cost (median step time past compiling, and the whole run's wall time, as
ratios against the single model's, the two alternated ``--repeat`` times); on the held-out HH
pairs, the single model's accuracy, each member's, the members' mean's, and how well the
members' disagreement predicts a misordered pair (AUROC); the ensemble's spread (the members'
std of a reward) on data unlike the training data (LLMBar's instruction-following pairs) against
the held-out HH pairs; and best-of-K on Nectar (7 ranked replies a prompt, GPT-4's ranks as the
truth): the mean rank of the reply each reward picks (1 = best), the single model's against the
ensemble's mean, minimum and lower confidence bound (mean - 1 std).

    .venv/bin/python benchmarks/ensemble.py [--steps 300] [--batch-size 8] [--members 4] [--repeat 1] [--bootstrap]
        [--layers 0] [--lora 0] [--single-seeds 1]
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
from bench_common import DEMO_TOKENIZER
from bench_common import SHARED_DATA as DATA
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import EvalConfig, PreprocessConfig
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train

from rmflow.eval.evaluation import run_eval


def trained(shards: pathlib.Path, out: pathlib.Path, members: int, a, seed: int = 0) -> dict:
    stamps: list[float] = []
    cfg = TrainConfig(data={"train": str(shards), "packing": "fixed"}, model="tiny", output=str(out),
                      max_steps=a.steps, batch_size=a.batch_size, seed=seed, logging={"steps": 1, "report_to": ()},
                      center_rewards_coefficient=a.center,
                      optimizer={"learning_rate": a.learning_rate, "warmup_steps": max(a.steps // 10, 1)},
                      ensemble={"members": members, "bootstrap": bool(members and a.bootstrap),
                                "layers": a.layers if members else 0},
                      lora={"rank": a.lora} if a.lora else None)
    start = time.perf_counter()
    train(cfg, on_log=lambda rec: stamps.append(time.perf_counter()))
    gaps = [b - a_ for a_, b in zip(stamps, stamps[1:])][len(stamps) // 4:-1]  # past compiling, before the eval
    return {"wall_s": time.perf_counter() - start, "step_s": statistics.median(gaps), "run": str(out)}


def nectar() -> list[tuple[str, list[str], np.ndarray]]:
    out = []
    with gzip.open(DATA / "multi_response" / "nectar_sample_dev.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            out.append((r["prompt"], r["responses"], np.asarray(r["ranks"], np.float64)))
    return out


def best_of_k(rm, prompts) -> tuple[float, float]:
    """(mean GPT-4 rank of the reply the model's reward picks, share of prompts where it picks rank 1)."""
    from rmflow.rendering.formats import parse_hh_transcript

    from rmflow.scoring.errors import BadConversation

    picked = []
    for prompt, replies, ranks in prompts:
        turns = [{"role": r, "content": c} for r, c, *_ in parse_hh_transcript(prompt + " x", "prompt")][:-1]
        seqs, kept = [], []
        for reply, rank in zip(replies, ranks):
            try:  # a reply that cannot be scored (empty, say) cannot be picked
                seqs.append(rm.encode(turns + [{"role": "assistant", "content": reply}], truncate="left"))
                kept.append(rank)
            except BadConversation:
                continue
        picked.append(kept[int(np.argmax(rm.score_ids(seqs)))])
    return float(np.mean(picked)), float(np.mean(np.asarray(picked) == 1))


def main() -> None:
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--eval-fraction", type=float, default=0.2, help="held-out share of the pairs")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--bootstrap", action="store_true", help="each member its own resample (ensemble.bootstrap)")
    ap.add_argument("--center", type=float, default=0.01, help="center_rewards_coefficient, both runs")
    ap.add_argument("--layers", type=int, default=0, help="the members' own top layers (ensemble.layers)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA of this rank, both runs (0: full fine-tuning)")
    ap.add_argument("--single-seeds", type=int, default=1,
                    help="also train single models of seeds 1 .. N-1: how much one model's figures vary by seed")
    a = ap.parse_args()
    from rmflow import RewardModel

    runs: dict[int, list[dict]] = {0: [], a.members: []}
    with tempfile.TemporaryDirectory() as tmp:
        shards = pathlib.Path(tmp) / "shards"
        preprocess(PreprocessConfig(inputs=(str(DATA / "hh_*.jsonl.gz"),), output=str(shards),
                                    tokenizer=str(DEMO_TOKENIZER), max_length=a.max_length,
                                    eval_fraction=a.eval_fraction))
        for rep in range(a.repeat):
            for members in (0, a.members) if rep % 2 == 0 else (a.members, 0):
                runs[members].append(trained(shards, pathlib.Path(tmp) / f"m{members}-{rep}", members, a))
                r = runs[members][-1]
                print(f"  repeat {rep + 1}: members {members}: step {1000 * r['step_s']:.0f} ms, run "
                      f"{r['wall_s']:.0f} s", flush=True)
        single, ens = runs[0][0]["run"], runs[a.members][0]["run"]
        step = {m: statistics.median(r["step_s"] for r in rs) for m, rs in runs.items()}
        wall = {m: statistics.median(r["wall_s"] for r in rs) for m, rs in runs.items()}
        print(f"\ntiny preset, {a.steps} steps of {a.batch_size} HH-RLHF pairs, learning rate {a.learning_rate:g}, "
              f"center_rewards_coefficient {a.center:g}{f', LoRA rank {a.lora}' if a.lora else ''}; {a.members} "
              f"{f'members with their own top {a.layers} layers' if a.layers else 'heads'}"
              f"{' (bootstrap)' if a.bootstrap else ''} against one; median of {a.repeat}")
        print(f"training cost: step {step[a.members] / step[0]:.2f}x ({1000 * step[a.members]:.0f} against "
              f"{1000 * step[0]:.0f} ms), whole run {wall[a.members] / wall[0]:.2f}x ({wall[a.members]:.0f} against "
              f"{wall[0]:.0f} s)")
        one = run_eval(EvalConfig(model=single, data=(str(shards),), output=f"{tmp}/eval-single"))
        hh = run_eval(EvalConfig(model=ens, data=(str(shards),), output=f"{tmp}/eval-ens"))
        e = hh["ensemble"]
        print(f"held-out HH-RLHF ({hh['pairs']} pairs): single model {one['accuracy']:.4f}; members' mean "
              f"{e['mean_accuracy']:.4f}; members {', '.join(f'{x:.4f}' for x in e['member_accuracy'])} (mean "
              f"{e['member_accuracy_mean']:.4f}); AUROC for a misordered pair: disagreement "
              f"{e['spread_auroc_misordered']:.3f} (std of the margins: right {e['spread_right']:.4f}, misordered "
              f"{e['spread_misordered']:.4f}), disagreement against the mean margin {e['flip_auroc_misordered']:.3f}, "
              f"a small mean margin alone {e['margin_auroc_misordered']:.3f}")
        llmbar = run_eval(EvalConfig(model=ens, data=(str(DATA / "llmbar_rewardbench_v1.jsonl.gz"),),
                                     output=f"{tmp}/eval-llmbar"))
        print(f"spread (members' std of a reward): held-out HH {e['reward_std_mean']:.4f}, LLMBar "
              f"({llmbar['pairs']} pairs) {llmbar['ensemble']['reward_std_mean']:.4f} "
              f"({llmbar['ensemble']['reward_std_mean'] / e['reward_std_mean']:.2f}x); LLMBar accuracy: members' "
              f"mean {llmbar['ensemble']['mean_accuracy']:.4f}")
        prompts = nectar()
        rows = [("single model", RewardModel.load(single))]
        rows += [(f"ensemble, {rule}", RewardModel.load(ens, reward=rule)) for rule in ("mean", "min", "lcb:1")]
        for name, rm in rows:
            rank, top = best_of_k(rm, prompts)
            print(f"best-of-7 on Nectar ({len(prompts)} prompts), {name}: mean rank of the pick {rank:.3f}, "
                  f"picks rank 1 on {top:.1%}")
        for seed in range(1, a.single_seeds):
            other = trained(shards, pathlib.Path(tmp) / f"seed{seed}", 0, a, seed=seed)["run"]
            accuracy = run_eval(EvalConfig(model=other, data=(str(shards),), output=f"{tmp}/eval-seed{seed}"))
            rank, top = best_of_k(RewardModel.load(other), prompts)
            print(f"single model, seed {seed}: held-out accuracy {accuracy['accuracy']:.4f}; best-of-7 on Nectar: "
                  f"mean rank of the pick {rank:.3f}, picks rank 1 on {top:.1%}", flush=True)


if __name__ == "__main__":
    main()
