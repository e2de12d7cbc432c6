"""LoRA on a quantised base: the frozen base in bfloat16 against int8 and nf4 (QLoRA's), each
training the same adapters on the same HH-RLHF batches.

Printed for each setting: the frozen base's bytes per weight (its matrices' codes and scales, or
their bfloat16 arrays), held-out accuracy after the same steps and its difference from the
bfloat16 base's (the same eval pairs), the mean training loss over the last 20 steps, and the
median step time against bfloat16's. ``--model`` is ``tiny`` (the preset, random weights) or a
Hugging Face checkpoint folder (SmolLM2-135M: ``python ../shared/tools/export_smollm2_hf.py
/tmp/smollm2-135m``), whose own tokenizer preprocesses the data. ``--repeat N`` alternates the
order (forward, then backward) so a slow hour on a shared machine favours none; medians and spread.

    .venv/bin/python benchmarks/quantized_base.py [--model tiny|FOLDER] [--steps 200] [--batch-size 8]
        [--max-length 512] [--rank 16] [--learning-rate 1e-3] [--eval-fraction 0.2] [--repeat 1]
        [--settings bfloat16,int8,nf4]
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

import numpy as np
from bench_common import DEMO_TOKENIZER
from bench_common import SHARED_DATA as DATA
from flax import nnx
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.modeling import quant
from rmflow.trainer.train import run as train

TAIL = 20  # steps the final loss is averaged over


def base_bytes(frozen) -> float:
    """Bytes a weight of the frozen base's matrices (norms and other vectors left out)."""
    matrices = [v for _, v in nnx.to_flat_state(frozen) if len(quant.shape(v)) >= 2]
    return quant.nbytes([v.get_value() for v in matrices]) / sum(int(np.prod(quant.shape(v))) for v in matrices)


def one(shards: pathlib.Path, out: pathlib.Path, kind: str, a) -> dict:
    stamps: list[float] = []
    cfg = TrainConfig(data={"train": str(shards), "packing": "fixed"}, model=a.model, output=str(out),
                      max_steps=a.steps, batch_size=a.batch_size, seed=0, logging={"steps": 1, "report_to": ()},
                      optimizer={"learning_rate": a.learning_rate, "warmup_steps": max(a.steps // 10, 1)},
                      lora={"rank": a.rank, "alpha": 2 * a.rank, "target_modules": "all-linear", "base_dtype": kind})
    result = train(cfg, on_log=lambda rec: stamps.append(time.perf_counter()))
    hist = result.history
    gaps = [b - a_ for a_, b in zip(stamps, stamps[1:])][len(stamps) // 4:-1]  # past compiling, before the eval
    return {"bytes": base_bytes(result.trainer.frozen), "accuracy": hist[-1]["eval_accuracy"],
            "pairs": hist[-1]["eval_pairs"], "loss": statistics.fmean(h["loss"] for h in hist[-TAIL:]),
            "step_s": statistics.median(gaps)}


def main() -> None:
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, or a Hugging Face checkpoint folder")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--eval-fraction", type=float, default=0.2, help="held-out share of the pairs")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--settings", default="bfloat16,int8,nf4", help="base_dtype values; the first is the reference")
    a = ap.parse_args()
    settings = [s for s in a.settings.split(",") if s]
    tokenizer = DEMO_TOKENIZER if a.model == "tiny" else a.model
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        shards = pathlib.Path(tmp) / "shards"
        preprocess(PreprocessConfig(inputs=(str(DATA / "hh_*.jsonl.gz"),), output=str(shards),
                                    tokenizer=str(tokenizer), max_length=a.max_length,
                                    eval_fraction=a.eval_fraction))
        for rep in range(a.repeat):
            for s in settings if rep % 2 == 0 else settings[::-1]:
                runs[s].append(one(shards, pathlib.Path(tmp) / f"{s}-{rep}", s, a))
                r = runs[s][-1]
                print(f"  repeat {rep + 1}: {s}: base {r['bytes']:.3f} bytes/weight, accuracy {r['accuracy']:.4f}, "
                      f"loss {r['loss']:.4f}, step {1000 * r['step_s']:.0f} ms", flush=True)
    ref = {k: statistics.median(r[k] for r in runs[settings[0]]) for k in ("accuracy", "step_s")}
    import jax

    print(f"\n{a.model}, LoRA rank {a.rank} all-linear, {a.steps} steps of {a.batch_size} pairs (packing fixed), "
          f"max_length {a.max_length}, learning rate {a.learning_rate:g}, {jax.devices()[0].device_kind}; median of "
          f"{a.repeat} run(s) (min..max); reference: {settings[0]}")
    head = ("base_dtype", "base bytes / weight", "eval accuracy", "vs reference (points)", f"loss, last {TAIL} steps",
            "step ms", "spread", "vs reference")
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for s, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("bytes", "accuracy", "loss", "step_s")}
        lo, hi = min(r["step_s"] for r in rs), max(r["step_s"] for r in rs)
        print(f"| {s} | {med['bytes']:.3f} | {med['accuracy']:.4f} ({rs[0]['pairs']}) "
              f"| {100 * (med['accuracy'] - ref['accuracy']):+.2f} | {med['loss']:.4f} | {1000 * med['step_s']:.0f} "
              f"| {1000 * lo:.0f}..{1000 * hi:.0f} | {med['step_s'] / ref['step_s']:.2f}x |")
    if "nf4" in runs:
        nf4 = runs["nf4"]
        per = statistics.median(r["bytes"] for r in nf4)
        gap = 100 * abs(statistics.median(r["accuracy"] for r in nf4) - ref["accuracy"])
        print(f"nf4: base {per:.3f} bytes/weight ({'met' if per <= 0.6 else 'MISSED'}: goal <= 0.6); held-out "
              f"accuracy {gap:.2f} points from {settings[0]}'s ({'met' if gap <= 1 else 'MISSED'}: goal <= 1)")


if __name__ == "__main__":
    main()
