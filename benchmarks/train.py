"""Train the tiny preset on the shared HH-RLHF data for a fixed number of steps.

Prints real (non-pad) tokens/s, the padding fraction, the Grain loader alone (batches/s)
against the train step time, peak memory, and the final eval accuracy beside the length-only
baseline ("the longer reply wins") on the same eval pairs.

    .venv/bin/python benchmarks/train.py [--steps 30] [--batch-size 8] [--max-length 1024] [--packing pack]
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import resource
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import grain
import jax
import numpy as np
from bench_common import DEMO_TOKENIZER as TOKENIZER
from bench_common import SHARED_DATA as DATA
from rmflow.pipelines.preprocess import run as preprocess
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.record import decode
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.data import make_loader
from rmflow.trainer.train import run as train


def length_baseline(shards: pathlib.Path) -> tuple[float, int]:
    """Accuracy of 'the longer reply (in tokens) wins' on the eval split; ties count as wrong."""
    paths = sorted(str(p) for p in shards.glob("eval-*.array_record"))
    source = grain.sources.ArrayRecordDataSource(paths)
    wins = 0
    for i in range(len(source)):
        r = decode(source[i])
        wins += (len(r.chosen_ids) - r.prompt_len) > (len(r.rejected_ids) - r.prompt_len)
    return wins / len(source), len(source)


def loader_alone(shards: pathlib.Path, batch_size: int, max_length: int, n: int, packing: str) -> float:
    paths = sorted(str(p) for p in shards.glob("train-*.array_record"))
    it = iter(make_loader(paths, batch_size=batch_size, max_length=max_length, seed=0, num_epochs=None,
                          packing=packing))
    next(it)
    start = time.perf_counter()
    for _ in range(n):
        next(it)
    return n / (time.perf_counter() - start)


def current_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class RssSampler:
    """The peak resident memory over an interval (ru_maxrss would include preprocessing's peak)."""

    def __init__(self):
        import threading

        self.peak, self.done = current_rss_mib(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(0.02):
            self.peak = max(self.peak, current_rss_mib())

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return self.peak


def main() -> None:
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--packing", default="pack", choices=("none", "bucket", "pack"))
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on all linear layers (0: full fine-tuning)")
    ap.add_argument("--lora-base-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="LoRA: the frozen base weights' storage")
    ap.add_argument("--model", default="tiny", help="tiny, or a Hugging Face checkpoint folder (its own tokenizer "
                    "preprocesses the data)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = pathlib.Path(tmp) / "shards"
        preprocess(PreprocessConfig(inputs=(str(DATA / "hh_*.jsonl.gz"),), output=str(shards),
                                    tokenizer=str(TOKENIZER) if args.model == "tiny" else args.model,
                                    max_length=args.max_length))
        loader_bps = loader_alone(shards, args.batch_size, args.max_length, 200, args.packing)
        step_times: list[float] = []
        last = [time.perf_counter()]

        def on_log(rec):
            now = time.perf_counter()
            step_times.append(now - last[0])
            last[0] = now

        cfg = TrainConfig(data={"train": str(shards), "packing": args.packing}, model=args.model,
                          output=str(pathlib.Path(tmp) / "run"), max_steps=args.steps, batch_size=args.batch_size,
                          optimizer={"learning_rate": 3e-4, "warmup_steps": max(args.steps // 10, 1)},
                          logging={"steps": 1}, seed=0,
                          lora={"rank": args.lora, "alpha": 2 * args.lora, "base_dtype": args.lora_base_dtype}
                          if args.lora else None)
        rss_before = current_rss_mib()
        sampler = RssSampler()
        start = time.perf_counter()
        result = train(cfg, on_log=on_log)
        wall = time.perf_counter() - start
        rss_peak_train = sampler.stop()
        baseline, n_eval = length_baseline(shards)
    hist = result.history
    steady = hist[len(hist) // 2:-1] or hist  # past the first compilations, before the final eval
    # steady state: past the first compilations, before the final eval; steps that compiled a new
    # shape (several times the median) are left out
    tail = step_times[len(step_times) // 2:-1] or step_times
    step_s = float(np.median(tail))
    final = hist[-1]
    peak_host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stats = jax.devices()[0].memory_stats() or {}
    print(f"\n{args.model}, packing={args.packing}, {args.steps} steps of {args.batch_size} pairs, "
          f"max_length {args.max_length}, "
          f"device {jax.devices()[0].device_kind}, {wall:.0f} s in all")
    print(f"real tokens/s (steady state, median)  {np.median([h['tokens_per_second'] for h in steady]):,.0f}")
    print(f"padding fraction                      {np.mean([h['padding_fraction'] for h in hist]):.3f}")
    print(f"train step time (median, steady)      {step_s:.3f} s  = {1 / step_s:.2f} steps/s")
    print(f"Grain loader alone                    {loader_bps:,.1f} batches/s  "
          f"({loader_bps * step_s:,.0f}x what the step consumes)")
    print(f"peak host memory                      {peak_host:,.0f} MiB"
          + (f"; peak device memory {stats['peak_bytes_in_use'] / 2**20:,.0f} MiB" if "peak_bytes_in_use" in stats else ""))
    state_mib = sum(x.nbytes for x in jax.tree.leaves(result.state)) / 2**20
    trainable = sum(x.size for x in jax.tree.leaves(result.state.params))
    print(f"trainable parameters                  {trainable:,} ({f'LoRA rank {args.lora}, base {args.lora_base_dtype}' if args.lora else 'full'})")
    print(f"train state (params trained + AdamW)  {state_mib:,.1f} MiB")
    if args.lora:
        frozen_mib = sum(x.nbytes for x in jax.tree.leaves(result.trainer.frozen)) / 2**20
        print(f"frozen base weights                   {frozen_mib:,.1f} MiB")
    print(f"host memory before training           {rss_before:,.0f} MiB (after preprocessing)")
    print(f"peak host memory while training       {rss_peak_train:,.0f} MiB (VmRSS sampled every 20 ms)")
    print(f"final eval accuracy                   {final['eval_accuracy']:.4f} on {final['eval_pairs']} pairs")
    print(f"length-only baseline                  {baseline:.4f} on {n_eval} pairs (longer reply wins)")


if __name__ == "__main__":
    main()
