"""The memory plan (``rmflow train --plan``) against the memory a run's steps take, on this CPU.

For each setting, the plan is made first (no weight loaded), then the run trains ``--steps``
steps in the same process while a thread samples the process's resident memory every 5 ms.
The step's measured peak is what the run holds between steps (its state and batch, the plan's
own figures for them: they are counted from the arrays' shapes, and asserted equal to the
placed arrays' by the tests) plus the largest rise of resident memory within a step over the
level just before it (the temporaries and outputs XLA allocates for the step, returned after it),
over the steps after the first two (the first compiles). The plan's estimate is its total.

    .venv/bin/python benchmarks/memory_plan.py [--steps 12] [--model tiny|SmolLM2-135M|CHECKPOINT]
        [--max-length 512] [--settings full,int8,lora]

``--model SmolLM2-135M`` (or another name of ``device.CONFIGS``) trains a checkpoint of that
configuration with random weights, written by transformers first: memory depends on shapes only.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import statistics
import tempfile
import threading
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench_common import DEMO_TOKENIZER as TOKENIZER
from bench_common import SHARED_DATA as DATA
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.memory_plan import GIB, plan_memory
from rmflow.trainer.train import Run
from rmflow.trainer.train import run as train

SETTINGS = {"full": {}, "int8": {"optimizer": {"moments": "int8"}},
            "lora": {"lora": {"rank": 16, "alpha": 32, "target_modules": "all-linear"}}}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StepPeaks:
    """The largest rise of resident memory within each step over the lowest level since the
    previous step's end (sampled every 5 ms on a thread)."""

    def __init__(self):
        self.low = self.high = rss()
        self.rises: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        while not self.done.wait(0.005):
            now = rss()
            self.low, self.high = min(self.low, now), max(self.high, now)

    def step_ended(self):
        self.rises.append(self.high - self.low)
        self.low = self.high = rss()

    def stop(self):
        self.done.set()
        self.thread.join()


def one(shards: pathlib.Path, out: pathlib.Path, setting: str, a) -> dict:
    options = {"data": {"train": str(shards), "packing": "fixed"}, "model": a.model, "output": str(out),
               "max_steps": a.steps, "batch_size": a.batch_size, "seed": 0, "logging": {"steps": 1, "report_to": ()},
               "optimizer": {"learning_rate": 1e-4, "warmup_steps": 1, **SETTINGS[setting].get("optimizer", {})}}
    options.update({k: v for k, v in SETTINGS[setting].items() if k != "optimizer"})
    cfg = TrainConfig.from_dict(options)
    start = time.perf_counter()
    plan, _ = plan_memory(Run(cfg, abstract=True))
    plan_s = time.perf_counter() - start
    peaks = StepPeaks()
    train(cfg, on_log=lambda rec: peaks.step_ended())
    peaks.stop()
    held = plan.parameters + plan.frozen + plan.optimizer + plan.batch
    rise = max(peaks.rises[2:-1] or peaks.rises)  # past the first compiles, before the final evaluation
    return {"plan": plan.total, "measured": held + rise, "held": held, "temporaries": plan.temporaries + plan.outputs,
            "rise": rise, "plan_s": plan_s, "shape": plan.batch_shape}


def shaped_checkpoint(name: str, folder: pathlib.Path) -> str:
    """A Hugging Face checkpoint of ``device.CONFIGS[name]`` with random weights and the demo's
    tokenizer (SmolLM2's)."""
    import shutil

    import torch
    import transformers
    from device import CONFIGS

    config = dict(CONFIGS[name])
    torch.manual_seed(0)
    hf = transformers.AutoConfig.for_model(config.pop("model_type"), **config, num_labels=1, pad_token_id=0)
    transformers.AutoModelForSequenceClassification.from_config(hf).save_pretrained(folder)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, folder / f.name)
    return str(folder)


def main() -> None:
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--model", default="tiny", help="tiny, or a Hugging Face checkpoint folder (its own tokenizer "
                    "preprocesses the data)")
    ap.add_argument("--settings", default="full,int8,lora")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from device import CONFIGS

        if a.model in CONFIGS:
            a.model = shaped_checkpoint(a.model, pathlib.Path(tmp) / "model")
        shards = pathlib.Path(tmp) / "shards"
        preprocess(PreprocessConfig(inputs=(str(DATA / "hh_helpful_base_test_first2000.jsonl.gz"),), output=str(shards),
                                    tokenizer=str(TOKENIZER) if a.model == "tiny" else a.model, max_length=a.max_length))
        for s in [s for s in a.settings.split(",") if s]:
            r = one(shards, pathlib.Path(tmp) / s, s, a)
            rows.append((s, r))
            print(f"  {s}: plan {r['plan'] / GIB:.3f} GiB, measured {r['measured'] / GIB:.3f} GiB", flush=True)
    print(f"\n{pathlib.Path(a.model).name}, {a.batch_size} pairs a step (packing fixed), max_length {a.max_length}, CPU; measured = the "
          "state and batch held + the largest rise of resident memory within a step (steps 3 to the last but one)")
    head = ("training", "batch (micro x rows x tokens)", "plan GiB", "measured GiB", "plan / measured",
            "held GiB", "planned temporaries GiB", "measured rise GiB", "plan s")
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for s, r in rows:
        print(f"| {s} | {' x '.join(map(str, r['shape']))} | {r['plan'] / GIB:.3f} | {r['measured'] / GIB:.3f} "
              f"| {r['plan'] / r['measured']:.2f} | {r['held'] / GIB:.3f} | {r['temporaries'] / GIB:.3f} "
              f"| {r['rise'] / GIB:.3f} | {r['plan_s']:.1f} |")
    worst = max(abs(r["plan"] / r["measured"] - 1) for _, r in rows)
    print(f"largest difference: {100 * worst:.1f}% ({'met' if worst <= 0.15 else 'MISSED'}: goal within 15%)")
    print("median plan / measured:", f"{statistics.median(r['plan'] / r['measured'] for _, r in rows):.2f}")


if __name__ == "__main__":
    main()
