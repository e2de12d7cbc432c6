"""Where one train step's time and memory go: the tiny preset on real packed HH-RLHF batches.

Times (median of --repeat runs, after compilation) of the loader producing a batch, the copy
to the device, the whole jitted train step, and, compiled alone on the same shapes: the
forward and backward pass of the model, of the attention alone (all layers), of the MLPs
alone (all layers), and the optimizer update. Also XLA's memory analysis of the step.

    .venv/bin/python benchmarks/profile_step.py [--shards DIR] [--packing pack] [--attention auto] [--repeat 7]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import DEMO_TOKENIZER as TOKENIZER
from bench_common import SHARED_DATA as DATA
from flax import nnx
from rmflow.schemas.train_config import OptimizerConfig
from rmflow.trainer.batching import stack_micro_batches
from rmflow.trainer.data import make_loader
from rmflow.trainer.modeling.attention import attention
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.step import Trainer


def timed(fn, repeat: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="shards to read (default: preprocess ../shared/data at --max-length)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--packing", default="pack", choices=("none", "bucket", "pack"))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--attention", default="auto", choices=("auto", "xla", "blockwise"))
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    shards = a.shards
    if not shards:
        from rmflow.pipelines.preprocess import run as preprocess
        from rmflow.schemas.config import PreprocessConfig

        shards = str(pathlib.Path(tmp.name) / "shards")
        preprocess(PreprocessConfig(inputs=(str(DATA / "hh_*.jsonl.gz"),), output=shards, tokenizer=str(TOKENIZER),
                                    max_length=a.max_length))
    paths = sorted(str(p) for p in pathlib.Path(shards).glob("train-*.array_record"))
    it = iter(make_loader(paths, batch_size=a.batch_size, max_length=a.max_length, seed=0, num_epochs=None,
                          packing=a.packing, shard_by_process=False))
    host = next(it)
    loader_s = timed(lambda: next(it)["input_ids"], a.repeat)
    stacked = stack_micro_batches([host])
    h2d_s = timed(lambda: jax.device_put(stacked), a.repeat)
    batch = jax.device_put(stacked)

    import json

    vocab = json.loads((pathlib.Path(shards) / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    model = RewardTransformer(ModelConfig.tiny(vocab_size=vocab), rngs=nnx.Rngs(0), attention=a.attention)
    trainer = Trainer(model, OptimizerConfig(learning_rate=1e-4), total_steps=1000)
    compiled = trainer.lower(trainer.init_state, batch).compile()
    memory = compiled.memory_analysis()
    state = [trainer.init_state]

    def step():
        state[0], m = compiled(state[0], batch, trainer.frozen, trainer.others, trainer.hyper)
        return m

    step_s = timed(step, a.repeat)
    params = state[0].params
    mb = {k: v[0] for k, v in batch.items()}
    grad = jax.jit(jax.grad(lambda p: trainer._objective(p, mb, trainer.frozen)[0]))
    model_s = timed(lambda: grad(params), a.repeat)

    cfg = model.config
    t = mb["input_ids"].shape[1]
    rows = mb["input_ids"].shape[0]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(rows, t, cfg.num_attention_heads, cfg.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(rows, t, cfg.num_key_value_heads, cfg.head_dim)), jnp.float32)
    impl = model.model.attention

    def attn_loss(q, k, v):
        return attention(q, k, v, mb["segment_ids"], mb["positions"], mb["branch_ids"], implementation=impl,
                         window=cfg.sliding_window).sum()

    attn = jax.jit(jax.grad(attn_loss, argnums=(0, 1, 2)))
    attn_s = timed(lambda: attn(q, kv, kv), a.repeat) * cfg.num_hidden_layers
    mlp = RewardTransformer(cfg, rngs=nnx.Rngs(1)).model.layers[0].mlp  # the first model's arrays went to the step
    x = jnp.asarray(rng.normal(size=(rows, t, cfg.hidden_size)), jnp.float32)
    mlp_graph, mlp_params = nnx.split(mlp)
    mlp_grad = jax.jit(jax.grad(lambda p, x: nnx.merge(mlp_graph, p)(x).sum(), argnums=(0, 1)))
    mlp_s = timed(lambda: mlp_grad(mlp_params, x), a.repeat) * cfg.num_hidden_layers
    grads = jax.tree.map(jnp.ones_like, params)
    update = jax.jit(lambda g, o, p: trainer.tx.update(g, o, p))
    opt_s = timed(lambda: update(grads, state[0].opt_state, params), a.repeat)

    real = int(host["real_tokens"])
    print(f"tiny preset, packing={a.packing} ({impl} attention), {a.batch_size} pairs, batch {mb['input_ids'].shape}, "
          f"{real:,} real tokens, {int(host['computed_tokens']):,} computed; median of {a.repeat}")
    print("| part | ms | share of the step |\n| --- | ---: | ---: |")
    for name, s in (("loader: one batch (host)", loader_s), ("host to device", h2d_s), ("whole train step", step_s),
                    ("model forward + backward", model_s), (f"  attention, {cfg.num_hidden_layers} layers", attn_s),
                    (f"  MLPs, {cfg.num_hidden_layers} layers", mlp_s), ("optimizer update (AdamW)", opt_s)):
        print(f"| {name} | {s * 1e3:,.1f} | {s / step_s:.0%} |")
    print(f"XLA memory analysis of the step: temporaries {memory.temp_size_in_bytes / 2**20:,.0f} MiB, "
          f"arguments {memory.argument_size_in_bytes / 2**20:,.0f} MiB (state donated: outputs alias them)")


if __name__ == "__main__":
    main()
