"""AdamW's state in less memory: float32 moments against bfloat16 and int8 ones, and the state
offloaded to host memory, each training the tiny preset on the same HH-RLHF batches.

Printed for each setting: the optimizer state's bytes per trained parameter (its arrays' sizes),
the mean training loss over the last 30 steps and its difference from float32 AdamW's (all runs
see the same batches in the same order), held-out accuracy, and the median step time against
float32's. ``--repeat N`` runs every setting N times, the order alternating (forward, then
backward, ...) so a slow hour on a shared machine favours none; medians and spread. On a CPU
host memory is device memory: offloading is checked there for its results, not its savings.

    .venv/bin/python benchmarks/optimizer_state.py [--steps 300] [--batch-size 8] [--max-length 512] [--repeat 1]
        [--learning-rate 3e-4] [--settings float32,bfloat16,int8,int8+offload]
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax
from bench_common import DEMO_TOKENIZER as TOKENIZER
from bench_common import SHARED_DATA as DATA
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.moments import state_bytes
from rmflow.trainer.train import run as train

TAIL = 30  # steps the final loss is averaged over


def one(shards: pathlib.Path, out: pathlib.Path, setting: str, a) -> dict:
    moments, _, offload = setting.partition("+")
    stamps: list[float] = []
    cfg = TrainConfig(data={"train": str(shards), "packing": "fixed"}, model="tiny", output=str(out),
                      max_steps=a.steps, batch_size=a.batch_size, seed=0, logging={"steps": 1, "report_to": ()},
                      optimizer={"learning_rate": a.learning_rate, "warmup_steps": max(a.steps // 10, 1), "moments": moments,
                                 "offload": offload == "offload"})
    result = train(cfg, on_log=lambda rec: stamps.append(time.perf_counter()))
    hist = result.history
    trained = sum(x.size for x in jax.tree.leaves(result.state.params))
    gaps = [b - a_ for a_, b in zip(stamps, stamps[1:])][len(stamps) // 4:-1]  # past compiling, before the eval
    return {"bytes": state_bytes(result.state.opt_state) / trained, "loss": statistics.fmean(h["loss"] for h in hist[-TAIL:]),
            "accuracy": hist[-1]["eval_accuracy"], "pairs": hist[-1]["eval_pairs"], "step_s": statistics.median(gaps)}


def main() -> None:
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--learning-rate", type=float, default=3e-4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--settings", default="float32,bfloat16,int8,int8+offload",
                    help="moments (float32, bfloat16, int8), each optionally +offload")
    a = ap.parse_args()
    settings = [s for s in a.settings.split(",") if s]
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        shards = pathlib.Path(tmp) / "shards"
        preprocess(PreprocessConfig(inputs=(str(DATA / "hh_*.jsonl.gz"),), output=str(shards), tokenizer=str(TOKENIZER),
                                    max_length=a.max_length))
        for rep in range(a.repeat):
            for s in settings if rep % 2 == 0 else settings[::-1]:
                runs[s].append(one(shards, pathlib.Path(tmp) / f"{s}-{rep}", s, a))
                r = runs[s][-1]
                print(f"  repeat {rep + 1}: {s}: {r['bytes']:.2f} bytes/param, loss {r['loss']:.5f}, "
                      f"accuracy {r['accuracy']:.3f}, step {1000 * r['step_s']:.0f} ms", flush=True)
    ref = {k: statistics.median(r[k] for r in runs[settings[0]]) for k in ("loss", "step_s")}
    print(f"\ntiny preset, {a.steps} steps of {a.batch_size} pairs (packing fixed), max_length {a.max_length}, "
          f"learning rate {a.learning_rate:g}, "
          f"{jax.devices()[0].device_kind}; median of {a.repeat} run(s) (min..max); reference: {settings[0]}")
    head = ("moments", "state bytes / param", f"loss, last {TAIL} steps", "vs reference", "eval accuracy",
            "step ms", "spread", "vs reference")
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for s, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("bytes", "loss", "accuracy", "step_s")}
        lo, hi = min(r["step_s"] for r in rs), max(r["step_s"] for r in rs)
        print(f"| {s} | {med['bytes']:.2f} | {med['loss']:.5f} | {100 * (med['loss'] / ref['loss'] - 1):+.3f}% "
              f"| {med['accuracy']:.3f} ({rs[0]['pairs']}) | {1000 * med['step_s']:.0f} | {1000 * lo:.0f}..{1000 * hi:.0f} "
              f"| {med['step_s'] / ref['step_s']:.2f}x |")
    for s, rs in runs.items():
        if s.startswith("int8"):
            med_bytes = statistics.median(r["bytes"] for r in rs)
            diff = abs(statistics.median(r["loss"] for r in rs) / ref["loss"] - 1)
            print(f"{s}: state {med_bytes:.2f} bytes/param ({'met' if med_bytes <= 2.5 else 'MISSED'}: goal <= 2.5); "
                  f"final loss {100 * diff:.3f}% from {settings[0]}'s ({'met' if diff <= 0.01 else 'MISSED'}: goal <= 1%)")


if __name__ == "__main__":
    main()
