"""Row rounding (``lengths_per_doubling``) against what a compilation costs, on this machine.

1. For one epoch of a shard set's train batches in the run's own loader order (``pack``, one
   row, seed 0), each rounding's distinct row lengths (the train programs a run compiles) and
   padding, and the rounding ``lengths_per_doubling`` picks for that many steps on a CPU and on
   an accelerator.
2. The CPU side of ``ACCELERATOR_COMPILE_COST``: one packed train step of a preset, compiled and
   timed here (compile seconds, step seconds, and compile over step: the steps a compilation
   costs). The accelerator side is the GPU check's (``benchmarks/gpu.py``, docs/benchmarks.md).

    .venv/bin/python benchmarks/gpu.py prepare .gpu/inputs --no-wheels   # the shards: HH-RLHF + UltraFeedback, 2048
    .venv/bin/python benchmarks/rounding.py .gpu/inputs/train [--batch-size 16] [--preset micro] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def shapes_by_rounding(shards: str, batch_size: int) -> dict:
    from rmflow.trainer.data import LoaderSpec, lengths_per_doubling, make_loader
    from rmflow.trainer.data.collate import FINEST
    from rmflow.trainer.model_setup import read_manifest, shard_paths
    from rmflow.trainer.objective import objective_for

    manifest = read_manifest(shards)
    paths = shard_paths(shards, manifest, "train")
    steps = -(-manifest.splits["train"].records // batch_size)
    out = {"steps": steps, "cpu picks": lengths_per_doubling(steps, "cpu"),
           "accelerator picks": lengths_per_doubling(steps, "gpu")}
    g = 1
    while g <= FINEST:
        loader = make_loader(paths, LoaderSpec(batch_size=batch_size, max_length=manifest.max_length, seed=0,
                                               num_epochs=1, pad_id=manifest.tokenizer.pad_token_id or 0,
                                               packing="pack", objective=objective_for(manifest.kind),
                                               per_doubling=g))
        lengths, computed = [], 0
        for batch in loader:
            lengths.append(batch["input_ids"].shape[1])
            computed += int(batch["computed_tokens"])
        out[g] = {"row lengths": len(set(lengths)), "padding": 1 - computed / sum(lengths)}
        g *= 2
    return out


def compile_and_step(shards: str, preset: str, batch_size: int, steps: int) -> dict:
    import jax
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.batching import stack_micro_batches
    from rmflow.trainer.data import LoaderSpec, make_loader
    from rmflow.trainer.model_setup import build_model, read_manifest, shard_paths
    from rmflow.trainer.objective import for_config
    from rmflow.trainer.step import make_trainer

    manifest = read_manifest(shards)
    cfg = TrainConfig(data={"train": shards, "packing": "pack"}, model=preset, output="unwritten",
                      batch_size=batch_size, max_steps=steps + 1,
                      optimizer={"warmup_steps": 0})  # the trainer's settings only: nothing is written
    objective = for_config(cfg, manifest)
    trainer = make_trainer(cfg, build_model(cfg, manifest, objective, "pack", 1), steps + 1, objective)
    loader = make_loader(shard_paths(shards, manifest, "train"), LoaderSpec(
        batch_size=batch_size, max_length=manifest.max_length, seed=0, num_epochs=1, packing="pack",
        objective=objective, pad_id=manifest.tokenizer.pad_token_id or 0, per_doubling=1))
    first = next(iter(loader))  # one shape, compiled once, then timed
    batch = {k: jax.numpy.asarray(v) for k, v in stack_micro_batches([first], trainer.objective).items()}
    state = trainer.init_state
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        state, m = trainer.train_step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:])
    return {"preset": preset, "row": batch["input_ids"].shape, "compile_s": times[0] - step, "step_s": step,
            "steps a compilation costs": (times[0] - step) / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--preset", default="micro")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    rounding = shapes_by_rounding(a.shards, a.batch_size)
    print(f"one epoch: {rounding.pop('steps')} steps of {a.batch_size}; lengths_per_doubling picks "
          f"{rounding.pop('cpu picks')} on a CPU, {rounding.pop('accelerator picks')} on an accelerator")
    for g, r in rounding.items():
        print(f"  {g} per doubling: {r['row lengths']} row lengths, padding {r['padding']:.3f}")
    c = compile_and_step(a.shards, a.preset, a.batch_size, a.steps)
    print(f"{c['preset']} on this machine ({c['row']}): compile {c['compile_s']:.2f} s, step {c['step_s']:.3f} s, "
          f"a compilation = {c['steps a compilation costs']:.0f} steps")


if __name__ == "__main__":
    main()
