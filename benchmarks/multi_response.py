"""What each way of learning from K responses per prompt buys: one model, seed and number of steps
trained listwise on whole prompts (``listwise``: Bradley-Terry over every pair of a prompt;
``plackett-luce``: the whole ranking) or on the pairs of each ``--pairs-from`` mode, each
evaluated with ``rmflow eval --mode responses`` on the same held-out prompts, beside the
length-only baseline.

The held-out prompts are a hash-chosen share of the file (``--eval-share``), written to a raw
file of their own; the training prompts are preprocessed once per mode. Every mode trains the
same number of steps (``--steps`` of ``--batch-size`` pairs, or of prompts listwise), so ``expand``,
with about K²/4 pairs a prompt, sees each prompt's responses in more combinations, not more steps,
and a listwise step sees ``--batch-size`` prompts with all their responses.

    .venv/bin/python benchmarks/multi_response.py [--data ../shared/data/multi_response/rmbench_dev.jsonl.gz]
        [--model tiny] [--steps 60] [--batch-size 8] [--max-length 512]
        [--modes listwise,plackett-luce,expand,best-worst,best-random]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import pathlib
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench_common import DEMO_TOKENIZER as TOKENIZER
from bench_common import REPO
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import EvalConfig, PreprocessConfig
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train

from rmflow.eval.evaluation import run_eval

DATA = REPO.parent / "shared" / "data" / "multi_response" / "rmbench_dev.jsonl.gz"
FIGURES = ("pair_accuracy", "best_of_k_accuracy", "kendall_tau", "spearman")
LISTWISE = {"listwise": "bradley-terry", "plackett-luce": "plackett-luce"}  # whole prompts, by ranking loss


def split_file(path: pathlib.Path, out: pathlib.Path, share: float) -> tuple[pathlib.Path, pathlib.Path, int]:
    """(train file, held-out file, held-out prompts): each line's prompt hashed into one side."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        lines = [line for line in f if line.strip()]
    held = [x for x in lines if _unit(json.loads(x).get("prompt", x)) < share]
    kept = [x for x in lines if _unit(json.loads(x).get("prompt", x)) >= share]
    (out / "train.jsonl").write_text("".join(kept))
    (out / "heldout.jsonl").write_text("".join(held))
    return out / "train.jsonl", out / "heldout.jsonl", len(held)


def _unit(value) -> float:
    digest = hashlib.blake2b(json.dumps(value).encode(), digest_size=8).hexdigest()
    return int(digest, 16) / 2**64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokenizer", default=str(TOKENIZER))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--learning-rate", type=float, default=3e-4)
    ap.add_argument("--eval-share", type=float, default=0.2)
    ap.add_argument("--modes", default=",".join(LISTWISE) + ",expand,best-worst,best-random")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rmflow-multi-") as tmp:
        tmp = pathlib.Path(tmp)
        train_file, heldout, n_held = split_file(pathlib.Path(a.data), tmp, a.eval_share)
        for mode in a.modes.split(","):
            start = time.perf_counter()
            shards = tmp / f"shards-{mode}"
            stats = preprocess(PreprocessConfig(inputs=(str(train_file),), output=str(shards), tokenizer=a.tokenizer,
                                                max_length=a.max_length, eval_fraction=0.0,
                                                pairs_from="" if mode in LISTWISE else mode, num_shards=1)).stats
            run = tmp / f"run-{mode}"
            train(TrainConfig.from_dict({"data": str(shards), "model": a.model, "output": str(run),
                                         "max_steps": a.steps, "batch_size": a.batch_size, "seed": 0,
                                         "objective": LISTWISE.get(mode, "bradley-terry"),
                                         "optimizer": {"learning_rate": a.learning_rate,
                                                       "warmup_steps": max(a.steps // 10, 1)},
                                         "logging": {"report_to": []}, "compilation_cache": "off"}))
            r = run_eval(EvalConfig(model=str(run), data=(str(heldout),), output=str(tmp / f"eval-{mode}"),
                                    mode="responses"))["ranking"]
            rows.append({"mode": mode, "pairs": stats["counts"]["pairs_written"], **{k: r[k] for k in FIGURES},
                         "seconds": time.perf_counter() - start, "baseline": {k: r["length_baseline"][k]
                                                                               for k in FIGURES}})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{a.data}: {n_held} held-out prompts; {a.model}, {a.steps} steps of {a.batch_size} pairs, seed 0\n")
    print("| trained on | records (pairs, or prompts listwise) | pairwise | best-of-K | Kendall's tau | Spearman | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['pairs']:,} | " + " | ".join(f"{r[k]:.3f}" for k in FIGURES)
              + f" | {r['seconds']:.0f} |")
    b = rows[0]["baseline"]
    print("| length only | - | " + " | ".join(f"{b[k]:.3f}" for k in FIGURES) + " | - |")


if __name__ == "__main__":
    main()
