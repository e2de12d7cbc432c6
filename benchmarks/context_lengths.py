"""The longest pair that fits, per model size and per device count of the ``context`` axis.

For each model (the real configurations, random weights: ``device.CONFIGS``) and each context
size, the train step on one packed row of a pair (its prompt half the tokens, each reply a
quarter) is compiled abstractly (no weight made) for a mesh of that many fake CPU devices at two
row lengths, and the memory the plan counts a device (``trainer.memory_plan``: the step's
arguments, XLA's temporaries and its outputs not written over its inputs) is fitted as a line in
the row's tokens; the longest row whose planned step stays under each ``--device-gib`` is where
that line meets it (a pair is at most the model's positions). XLA:CPU's memory analysis stands
in for a GPU's here (the GPU check's ``optimizer`` part measures one such step on a GPU): the
figures are a plan, not a measured peak.

    .venv/bin/python benchmarks/context_lengths.py [--models Qwen2.5-1.5B:full,Llama-3.1-8B:lora16-nf4]
        [--contexts 1,2,4,8] [--lengths 8192,16384] [--device-gib 24,80]
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from device import CONFIGS
from flax import nnx
from rmflow.schemas.record import PairRecord
from rmflow.schemas.train_config import LoraConfig, OptimizerConfig
from rmflow.trainer.batching import stack_micro_batches
from rmflow.trainer.data import PackCollate
from rmflow.trainer.memory_plan import shard_bytes
from rmflow.trainer.modeling import lora as lora_module
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.parallel import make_mesh
from rmflow.trainer.step import Trainer

GIB = 2 ** 30


def row(tokens: int) -> dict[str, np.ndarray]:
    """One packed row of one pair: a prompt of half the tokens, each reply a quarter."""
    p = np.full(tokens // 2, 5, np.int32)
    c, r = np.r_[p, np.full(tokens // 4, 6, np.int32)], np.r_[p, np.full(tokens // 4, 7, np.int32)]
    record = PairRecord(c, r, len(c) - 1, len(r) - 1, len(p), "0" * 32, "s")
    return {k: np.asarray(v) for k, v in PackCollate(1, tokens)([record]).items()}


def planned_gib(name: str, setting: str, context: int, tokens: int) -> float:
    """The planned memory of a device (GiB) for a step on one row of ``tokens`` over ``context`` devices."""
    cfg = ModelConfig(**CONFIGS[name])
    adapters = None
    if setting.startswith("lora"):
        rank, _, base = setting[4:].partition("-")
        adapters = LoraConfig(rank=int(rank), alpha=2.0 * int(rank), target_modules="all-linear",
                              base_dtype=base or "bfloat16")

    def build():
        model = RewardTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention="blockwise", remat=True)
        if adapters is not None:
            lora_module.apply(model, adapters)
        return model

    model = nnx.eval_shape(build)
    trainer = Trainer(model, OptimizerConfig(learning_rate=1e-5), total_steps=10,
                      trainable=lora_module.trainable_filter(adapters))
    state = trainer.use_mesh(make_mesh((1, 1, 1, 1, context), jax.devices()[:context]))
    host = stack_micro_batches([row(tokens)])
    batch, compiled = trainer.compile_train(host)
    a = compiled.memory_analysis()
    total = (shard_bytes(state) + shard_bytes((trainer.frozen, trainer.others)) + shard_bytes(batch)
             + a.temp_size_in_bytes + max(a.output_size_in_bytes - a.alias_size_in_bytes, 0))
    return total / GIB


def longest_pair(lo: float, hi: float, short: int, long_: int, limit: float, positions: int) -> str:
    """Where the line through (short, lo) and (long_, hi) meets ``limit`` GiB, in tokens (rounded
    down to 1,024), capped at the model's positions; "none" when even ``short`` does not fit."""
    slope = (hi - lo) / (long_ - short)
    longest = short + (limit - lo) / slope if slope > 0 else float("inf")
    if longest < 1024 or lo > limit and longest < short:
        return "none"
    return f"{int(longest // 1024) * 1024:,}" if longest < positions else f"all {positions:,}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="Qwen2.5-1.5B:full,Llama-3.1-8B:lora16-nf4",
                    help="NAME:full or NAME:loraR[-BASE_DTYPE], comma-separated (device.CONFIGS' names)")
    ap.add_argument("--contexts", default="1,2,4,8")
    ap.add_argument("--lengths", default="8192,16384", help="two row lengths the line is fitted through")
    ap.add_argument("--device-gib", default="24,80", help="device memories (GiB), each a column")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    short, long_ = (int(x) for x in a.lengths.split(","))
    limits = [float(x) for x in a.device_gib.split(",")]
    print(f"planned memory a device (GiB, XLA:CPU's analysis), bfloat16 compute, layers recomputed; the longest "
          f"pair is where the line through {short:,} and {long_:,} tokens meets the device's memory")
    print(f"| model | training | context devices | GiB at {short:,} | GiB at {long_:,} | "
          + " | ".join(f"longest pair, {g:g} GiB" for g in limits) + " |")
    print("|" + " --- |" * (5 + len(limits)))
    for spec in a.models.split(","):
        name, setting = spec.split(":")
        for c in contexts:
            lo, hi = planned_gib(name, setting, c, short), planned_gib(name, setting, c, long_)
            said = [longest_pair(lo, hi, short, long_, g, CONFIGS[name]["max_position_embeddings"]) for g in limits]
            print(f"| {name} | {setting} | {c} | {lo:.2f} | {hi:.2f} | " + " | ".join(said) + " |", flush=True)


if __name__ == "__main__":
    main()
