"""One train step's compilation, memory and speed, for a model shape and layer mode.

Lowers and compiles the train step (random weights: time and memory do not depend on them) for
``--rows`` rows of ``--length`` tokens, prints trace-and-lower and compile seconds with XLA's
memory analysis (temporaries, arguments), then times ``--steps`` steps (median).

    .venv/bin/python benchmarks/compile_step.py --shape smollm2 --layers scan|unrolled [--lora-dropout 0.05]
        [--num-layers 30] [--rows 2] [--length 1024] [--steps 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from device import CONFIGS
from flax import nnx
from rmflow.schemas.train_config import OptimizerConfig
from rmflow.trainer.modeling import lora
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.step import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--layers", default="scan", choices=("scan", "unrolled"))
    ap.add_argument("--num-layers", type=int, default=0, help="0: the shape's own")
    ap.add_argument("--lora-dropout", type=float, default=None, help="LoRA rank 16 on all linear layers, this dropout")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    cfg = ModelConfig(**CONFIGS["SmolLM2-135M"]) if a.shape == "smollm2" else ModelConfig.tiny(vocab_size=49152)
    if a.num_layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=a.num_layers)
    model = RewardTransformer(cfg, rngs=nnx.Rngs(0), scan_layers=a.layers == "scan")
    lcfg = None if a.lora_dropout is None else lora.LoraConfig(rank=16, alpha=32, dropout=a.lora_dropout)
    if lcfg:
        lora.apply(model, lcfg)
    trainer = Trainer(model, OptimizerConfig(learning_rate=1e-5), total_steps=100,
                      trainable=lora.trainable_filter(lcfg))
    r, t = a.rows, a.length
    batch = {"input_ids": jnp.ones((1, r, t), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (1, r, t)),
             "segment_ids": jnp.ones((1, r, t), jnp.int32), "branch_ids": jnp.zeros((1, r, t), jnp.int32),
             "reward_index": jnp.asarray([[[t - 1, t - 2]] * r], jnp.int32),
             "margin": jnp.zeros((1, r), jnp.float32), "weight": jnp.ones((1, r), jnp.float32)}
    t0 = time.perf_counter()
    lowered = trainer.lower(trainer.init_state, batch)
    t1 = time.perf_counter()
    step = lowered.compile()
    t2 = time.perf_counter()
    mem = step.memory_analysis()
    state, times = trainer.init_state, []
    for _ in range(a.steps):
        s = time.perf_counter()
        state, metrics = step(state, batch, trainer.frozen, trainer.others, trainer.hyper)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - s)
    print(f"{a.shape} ({cfg.num_hidden_layers} layers), {a.layers}, lora dropout {a.lora_dropout}: trace and lower "
          f"{t1 - t0:.1f} s, compile {t2 - t1:.1f} s, temporaries {mem.temp_size_in_bytes / 2**20:,.0f} MiB, "
          f"arguments {mem.argument_size_in_bytes / 2**20:,.0f} MiB, step {statistics.median(times) * 1e3:,.0f} ms "
          f"(median of {a.steps})")


if __name__ == "__main__":
    main()
