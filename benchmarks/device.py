"""Attention parity and training throughput on an accelerator (written for one NVIDIA GPU).

1. Parity on the device: the blockwise (flash, pure JAX) attention, cuDNN's fused attention and
   the Pallas kernels (Triton) against the dense reference, on packed rows with shared prompts
   (float32 for blockwise, bfloat16 for cuDNN, which supports only 16-bit types, both for Pallas).
2. Throughput in bfloat16 for two real configurations with random weights (speed does not
   depend on the values): SmolLM2-135M (Llama, 30 layers, hidden 576) and Qwen2.5-0.5B (24
   layers, hidden 896, vocabulary 151,936), on real HH-RLHF pairs preprocessed at max_length
   2048, packed (blockwise attention) and padded (one sequence a row, cuDNN attention). Prints
   real tokens/s and model-FLOPs utilisation: 6 x (non-embedding parameters) x computed tokens
   plus 12 x layers x (query-key pairs attended) x heads x head_dim, per second, over the
   GPU's dense bfloat16 peak (--peak-tflops, 989 for an H100 SXM).

    python benchmarks/device.py --shards SHARDS [--batch-size 32] [--steps 10] [--peak-tflops 989]
        [--modes pack,bucket] [--packed-attention blockwise,pallas] [--blocks 64,128]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from rmflow.trainer.data import Collate, PackCollate  # noqa: E402
from rmflow.trainer.modeling.attention import allowed, attention  # noqa: E402
from rmflow.trainer.modeling.config import ModelConfig  # noqa: E402
from rmflow.trainer.modeling.llama import RewardTransformer  # noqa: E402
from rmflow.trainer.step import OptimConfig, Trainer, stack_micro_batches  # noqa: E402

from tests.layouts import packed_layout  # noqa: E402

CONFIGS = {
    "SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "Qwen2.5-0.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True,
                         max_position_embeddings=32768),
}


PARITY_CASES = (("blockwise", "float32", None), ("blockwise", "float32", 300), ("cudnn", "bfloat16", None),
                ("pallas", "float32", None), ("pallas", "float32", 300), ("pallas", "bfloat16", None),
                ("blockwise", "bfloat16", None))


def check_parity(t: int = 2048, cases=PARITY_CASES, longest: int = 300) -> list[dict]:
    """Each (implementation, dtype, window) against the dense reference on packed rows of ``t``
    tokens (units of 16 to ``longest`` tokens): the largest output difference and the largest
    gradient difference relative to the reference's largest gradient (q, k, v). One row each;
    ``error`` where the device does not support it."""
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 means float32 (GPUs default to TF32)
    rng = np.random.default_rng(0)
    b, n, k, d = 2, 8, 2, 64
    seg, pos, br = packed_layout(rng, b, t, (16, longest))
    q = rng.normal(size=(b, t, n, d)).astype(np.float32)
    kv = [rng.normal(size=(b, t, k, d)).astype(np.float32) for _ in range(2)]
    real = seg[:, :, None, None] > 0
    rows = []
    for impl, dtype_name, window in cases:
        dtype = jnp.dtype(dtype_name)
        window = min(window, longest) if window else None
        args = [jnp.asarray(x, dtype) for x in (q, *kv)]

        def loss(q, k, v, impl=impl, window=window):
            o = attention(q, k, v, seg, pos, br, implementation=impl, window=window)
            return jnp.where(real, o, 0).astype(jnp.float32).sum(), o

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        ref = jax.jit(jax.value_and_grad(lambda q, k, v, w=window: loss(q, k, v, "xla", w), argnums=(0, 1, 2),
                                         has_aux=True))
        try:
            (_, o), g = f(*args)
        except Exception as e:  # noqa: BLE001 - report what the device does not support
            print(f"parity {impl} {jnp.dtype(dtype).name}: not available here: {type(e).__name__}: {str(e)[:300]}")
            rows.append({"attention": impl, "dtype": dtype_name, "window": window,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        (_, o_ref), g_ref = ref(*args)
        diff = lambda a, r: float(jnp.max(jnp.abs(jnp.where(real, a, 0).astype(jnp.float32)  # noqa: E731
                                                  - jnp.where(real, r, 0).astype(jnp.float32))))
        grads = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)))
                       / jnp.max(jnp.abs(r.astype(jnp.float32)))) for a, r in zip(g, g_ref)]
        print(f"parity {impl:9s} {jnp.dtype(dtype).name:8s} window={window}: max |out - ref| {diff(o, o_ref):.2e}, "
              f"max |grad - ref| / max |ref| (q, k, v) {', '.join(f'{x:.2e}' for x in grads)}")
        rows.append({"attention": impl, "dtype": dtype_name, "window": window, "out_max_abs": diff(o, o_ref),
                     "grad_max_rel": max(grads)})
    jax.config.update("jax_default_matmul_precision", None)
    return rows


def load_records(shards: pathlib.Path):
    import grain
    from rmflow.schemas.record import decode

    paths = sorted(str(p) for p in shards.glob("train-*.array_record"))
    source = grain.sources.ArrayRecordDataSource(paths)
    return [decode(source[i]) for i in range(len(source))]


def attended_pairs(batch) -> int:
    """Query-key pairs the mask allows, summed over rows (the attention's useful work)."""
    total = 0
    for r in range(batch["segment_ids"].shape[0]):
        seg, pos, br = (jnp.asarray(batch[k][r : r + 1]) for k in ("segment_ids", "positions", "branch_ids"))
        idx = jnp.arange(seg.shape[1])[None]
        ok = allowed(seg, pos, br, idx, seg, pos, br, idx, None) & (seg[:, :, None] > 0)
        total += int(ok.sum())
    return total


def throughput(name: str, records, packing: str, batch_size: int, steps: int, peak: float, block: int,
               packed_attention: str = "blockwise", max_length: int = 2048, config: dict | None = None) -> dict:
    """Steady-state training throughput of one configuration (every shape compiled first); one
    row: real tokens/s, padding, model TFLOP/s, MFU over ``peak`` TFLOP/s, compilations."""
    cfg = ModelConfig(**(config or CONFIGS[name]))
    impl = packed_attention if packing == "pack" else "cudnn" if jax.default_backend() == "gpu" else "blockwise"
    model = RewardTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention=impl)
    if impl in ("blockwise", "pallas") and block:
        import rmflow.trainer.modeling.attention as A
        import rmflow.trainer.modeling.pallas_attention as PA

        A.BLOCK = PA.BLOCK = block
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    body = params - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    trainer = Trainer(model, OptimConfig(learning_rate=1e-5, total_steps=1000))
    collate = (PackCollate(batch_size, max_length, 0) if packing == "pack"
               else Collate(batch_size, max_length, 0, lengths="pow2" if packing == "none" else "fine"))
    if packing == "bucket":  # as the bucket sampler does: sorted by length within a window of 32 batches
        window = sorted(records[: 32 * batch_size], key=lambda r: max(len(r.chosen_ids), len(r.rejected_ids)))
        every = max(len(window) // batch_size // steps, 1)  # the timed batches spread over the window's lengths
        records = [r for i in range(steps) for r in window[i * every * batch_size :][:batch_size]]
    batches = [collate(records[i * batch_size : (i + 1) * batch_size]) for i in range(steps)]
    state = trainer.init_state
    compile_start = time.perf_counter()
    shapes = set()
    for b in batches:  # compile every shape first: timings below are steady state
        if b["input_ids"].shape not in shapes:
            shapes.add(b["input_ids"].shape)
            state, m = trainer.train_step(state, jax.device_put(stack_micro_batches([b])))
    jax.block_until_ready(state.params)
    compile_s = time.perf_counter() - compile_start
    device_batches = [jax.device_put(stack_micro_batches([b])) for b in batches]
    start = time.perf_counter()
    for b in device_batches:
        state, m = trainer.train_step(state, b)
    jax.block_until_ready(m)
    seconds = time.perf_counter() - start
    real = sum(int(b["real_tokens"]) for b in batches)
    computed = sum(int(b["computed_tokens"]) for b in batches)
    slots = sum(b["input_ids"].size for b in batches)
    pairs = sum(attended_pairs(b) for b in batches)
    flops = 6 * body * computed + 12 * cfg.num_hidden_layers * pairs * cfg.num_attention_heads * cfg.head_dim
    row = {"model": name, "packing": packing, "attention": impl, "block": block if impl in ("blockwise", "pallas") else None,
           "pairs_per_step": batch_size, "real_tokens_per_s": real / seconds, "padding": 1 - computed / slots,
           "model_tflops": flops / seconds / 1e12, "mfu": flops / seconds / 1e12 / peak, "shapes": len(shapes),
           "compile_s": compile_s}
    print(f"| {name} | {packing} | {impl}{f' (block {block})' if row['block'] else ''} | {batch_size} "
          f"| {real / seconds:,.0f} | {1 - computed / slots:.3f} | {flops / seconds / 1e12:,.1f} "
          f"| {flops / seconds / 1e12 / peak:.1%} | {len(shapes)} in {compile_s:.0f} s |", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--models", default=",".join(CONFIGS))
    ap.add_argument("--modes", default="pack,none")
    ap.add_argument("--blocks", default="512", help="attention block sizes to try for packed rows")
    ap.add_argument("--packed-attention", default="blockwise,pallas", help="implementations for packed rows")
    ap.add_argument("--skip-parity", action="store_true")
    a = ap.parse_args()
    print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}")
    if not a.skip_parity:
        check_parity()
    records = load_records(pathlib.Path(a.shards))
    print("| model | packing | attention | pairs/step | real tokens/s | padding | model TFLOP/s | MFU | compiles |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in a.models.split(","):
        for packing in a.modes.split(","):
            for impl in (a.packed_attention.split(",") if packing == "pack" else ["auto"]):
                for block in ([int(x) for x in a.blocks.split(",")] if packing == "pack" else [0]):
                    throughput(name, records, packing, a.batch_size, a.steps, a.peak_tflops, block, impl)


if __name__ == "__main__":
    main()
