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
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_common import load_test_helper
from flax import nnx
from rmflow.schemas.record import PairRecord
from rmflow.schemas.train_config import LoraConfig, OptimizerConfig
from rmflow.trainer.batching import stack_micro_batches
from rmflow.trainer.data import Collate, PackCollate
from rmflow.trainer.modeling import lora as lora_module
from rmflow.trainer.modeling.attention import allowed, attention
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.step import Trainer

packed_layout = load_test_helper("layouts").packed_layout

CONFIGS = {
    "SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "Qwen2.5-0.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    # the sizes users train (random weights; Llama 3's RoPE scaling left out: it does not change the speed)
    "Qwen2.5-1.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "Llama-3.2-3B": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=131072),
    "Llama-3.1-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         max_position_embeddings=131072),
}


PARITY_CASES = (("blockwise", "float32", None), ("blockwise", "float32", 300), ("cudnn", "bfloat16", None),
                ("pallas", "float32", None), ("pallas", "float32", 300), ("pallas", "bfloat16", None),
                ("blockwise", "bfloat16", None))


def check_parity(t: int = 2048, cases=PARITY_CASES, longest: int = 300, emit=None) -> list[dict]:
    """Each (implementation, dtype, window[, head_dim, softcap]) against the dense reference on
    packed rows of ``t`` tokens (units of 16 to ``longest`` tokens; 8 query and 2 KV heads of 64
    unless the case names its head size, and the logits soft-capped where it names a cap, as
    Gemma 2 does): the largest output difference and the largest gradient difference relative to
    the reference's largest gradient (q, k, v). One row each, also handed to ``emit`` as it is
    measured; ``error`` where the device does not support it."""
    emit = emit or (lambda row: None)
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 means float32 (GPUs default to TF32)
    rng = np.random.default_rng(0)
    b, n, k = 2, 8, 2
    seg, pos, br = packed_layout(rng, b, t, (16, longest))
    inputs = {}  # head size -> (q, k, v), drawn once each
    real = seg[:, :, None, None] > 0
    rows = []
    for impl, dtype_name, window, *shape in cases:
        d, softcap = shape if shape else (64, None)
        dtype = jnp.dtype(dtype_name)
        window = min(window, longest) if window else None
        if d not in inputs:
            inputs[d] = [rng.normal(size=(b, t, h, d)).astype(np.float32) for h in (n, k, k)]
        args = [jnp.asarray(x, dtype) for x in inputs[d]]
        extra = {"head_dim": d, "softcap": softcap} if shape else {}

        def loss(q, k, v, impl=impl, window=window, softcap=softcap):
            o = attention(q, k, v, seg, pos, br, implementation=impl, window=window, softcap=softcap)
            return jnp.where(real, o, 0).astype(jnp.float32).sum(), o

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        ref = jax.jit(jax.value_and_grad(lambda q, k, v, w=window: loss(q, k, v, "xla", w), argnums=(0, 1, 2),
                                         has_aux=True))
        try:
            (_, o), g = f(*args)
        except Exception as e:  # noqa: BLE001 - report what the device does not support
            print(f"parity {impl} {jnp.dtype(dtype).name} window={window} head_dim={d} softcap={softcap}: not available "
                  f"here: {type(e).__name__}: {str(e)[:300]}")
            rows.append({"attention": impl, "dtype": dtype_name, "window": window, **extra,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
            emit(rows[-1])
            continue
        (_, o_ref), g_ref = ref(*args)
        diff = lambda a, r: float(jnp.max(jnp.abs(jnp.where(real, a, 0).astype(jnp.float32)  # noqa: E731
                                                  - jnp.where(real, r, 0).astype(jnp.float32))))
        grads = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)))
                       / jnp.max(jnp.abs(r.astype(jnp.float32)))) for a, r in zip(g, g_ref)]
        print(f"parity {impl:9s} {jnp.dtype(dtype).name:8s} window={window} head_dim={d} softcap={softcap}: "
              f"max |out - ref| {diff(o, o_ref):.2e}, "
              f"max |grad - ref| / max |ref| (q, k, v) {', '.join(f'{x:.2e}' for x in grads)}")
        rows.append({"attention": impl, "dtype": dtype_name, "window": window, **extra, "out_max_abs": diff(o, o_ref),
                     "grad_max_rel": max(grads)})
        emit(rows[-1])
    jax.config.update("jax_default_matmul_precision", None)
    return rows


def load_records(shards: pathlib.Path):
    import grain
    from rmflow.schemas.record import decode

    paths = sorted(str(p) for p in shards.glob("train-*.array_record"))
    source = grain.sources.ArrayRecordDataSource(paths)
    return [decode(source[i]) for i in range(len(source))]


def synthetic_pairs(pair_tokens: int, count: int, vocab_size: int, seed: int = 0) -> list[PairRecord]:
    """``count`` pairs of ``pair_tokens`` tokens each as a packed row holds them: a prompt of half
    (once), a chosen and a rejected reply of a quarter each; random token ids (speed and memory do
    not depend on the values)."""
    rng = np.random.default_rng(seed)
    prompt, reply = pair_tokens // 2, pair_tokens // 4
    out = []
    for i in range(count):
        ids = rng.integers(1, vocab_size, prompt + 2 * reply)
        chosen, rejected = np.concatenate([ids[:prompt], ids[prompt:prompt + reply]]), np.concatenate(
            [ids[:prompt], ids[prompt + reply:]])
        out.append(PairRecord(chosen_ids=chosen, rejected_ids=rejected, chosen_last=len(chosen) - 1,
                              rejected_last=len(rejected) - 1, prompt_len=prompt, pair_id=f"{i:032x}"))
    return out


def pair_attended(prompt: int, chosen: int, rejected: int) -> int:
    """Query-key pairs one packed pair attends (closed form of ``attended_pairs`` for a unit):
    the prompt causally, each reply token the whole prompt and its own branch up to itself."""
    causal = lambda n: n * (n + 1) // 2  # noqa: E731
    return causal(prompt) + sum(n * prompt + causal(n) for n in (chosen, rejected))


def synthetic_attended(pair_tokens: int):
    """``attended`` for batches of ``synthetic_pairs``: their pairs' closed form, no mask built."""
    prompt, reply = pair_tokens // 2, pair_tokens // 4
    return lambda batch: int(batch["computed_tokens"]) // (prompt + 2 * reply) * pair_attended(prompt, reply, reply)


def attended_pairs(batch) -> int:
    """Query-key pairs the mask allows, summed over rows (the attention's useful work)."""
    total = 0
    for r in range(batch["segment_ids"].shape[0]):
        seg, pos, br = (jnp.asarray(batch[k][r : r + 1]) for k in ("segment_ids", "positions", "branch_ids"))
        idx = jnp.arange(seg.shape[1])[None]
        ok = allowed(seg, pos, br, idx, seg, pos, br, idx, None) & (seg[:, :, None] > 0)
        total += int(ok.sum())
    return total


def set_kernel(block: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """Set the packed-row kernels' block size and (Pallas) Triton launch settings for this
    process; returns the previous ones, to restore."""
    import rmflow.trainer.modeling.attention as A
    import rmflow.trainer.modeling.pallas_attention as PA

    before = {"block": PA.BLOCK, "blockwise_block": A.BLOCK, "num_warps": PA.NUM_WARPS, "num_stages": PA.NUM_STAGES}
    if block:
        A.BLOCK = PA.BLOCK = block
    PA.NUM_WARPS = num_warps or PA.NUM_WARPS
    PA.NUM_STAGES = num_stages or PA.NUM_STAGES
    return before


def restore_kernel(before: dict) -> None:
    import rmflow.trainer.modeling.attention as A
    import rmflow.trainer.modeling.pallas_attention as PA

    PA.BLOCK, A.BLOCK, PA.NUM_WARPS, PA.NUM_STAGES = (before["block"], before["blockwise_block"],
                                                      before["num_warps"], before["num_stages"])


def timed(fn, *args, repeat: int = 10) -> float:
    """Median seconds of ``fn(*args)`` over ``repeat`` calls, after two warm-up calls (the first
    compiles); each call waited for."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def attention_seconds(batch: dict, impl: str, heads: int, kv_heads: int, head_dim: int, dtype=jnp.bfloat16,
                      repeat: int = 10) -> float:
    """One layer's attention, forward and backward, on one batch's rows (random q, k, v in
    ``dtype``; the batch's segment, position and branch ids): median seconds."""
    seg, pos = jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"])
    br = jnp.asarray(batch.get("branch_ids", np.zeros_like(batch["segment_ids"])))
    b, t = seg.shape
    key = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(key[0], (b, t, heads, head_dim), dtype)
    k, v = (jax.random.normal(x, (b, t, kv_heads, head_dim), dtype) for x in key[1:3])
    cot = jax.random.normal(key[3], (b, t, heads, head_dim), dtype)

    @jax.jit
    def step(q, k, v):
        out, pull = jax.vjp(lambda q, k, v: attention(q, k, v, seg, pos, br, implementation=impl), q, k, v)
        return pull(cot)

    return timed(step, q, k, v, repeat=repeat)


def optimizer_seconds(trainer: Trainer, state) -> float:
    """The step's parameter update alone, as the step does it after the gradients (global norm,
    scaling, the optimizer's update, applied): median seconds. The parameters stand in for the
    gradients, which have their shapes and dtypes."""
    tx = trainer.program.optimizer(trainer.hyper)

    @jax.jit
    def update(params, opt_state):
        norm = optax.global_norm(params)
        grads = jax.tree.map(lambda g: g / norm, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return timed(update, state.params, state.opt_state)


def packed_batches(records, batch_size: int, steps: int, max_length: int, pool: int = 8):
    """``steps`` packed batches of ``batch_size`` pairs (pairs drawn in a seeded shuffle) that
    share one row length, the most common among ``pool * steps`` batches: one compilation, and
    rows as long as a run's usual ones (each batch's padding is measured, not chosen)."""
    order = np.random.default_rng(0).permutation(len(records))
    collate = PackCollate(batch_size, max_length, 0)
    count = min(pool * steps, len(records) // batch_size)
    batches = [collate([records[i] for i in order[j * batch_size : (j + 1) * batch_size]]) for j in range(count)]
    lengths = [b["input_ids"].shape[1] for b in batches]
    common = max(set(lengths), key=lambda n: (lengths.count(n), -n))
    return [b for b in batches if b["input_ids"].shape[1] == common][:steps]


def bucket_batches(records, batch_size: int, steps: int, max_length: int, packing: str = "bucket"):
    """As the bucket sampler batches: sorted by length within a window of 32 batches; the timed
    batches spread over the window's lengths (one compilation each)."""
    collate = Collate(batch_size, max_length, 0, lengths="pow2" if packing == "none" else "fine")
    window = sorted(records[: 32 * batch_size], key=lambda r: max(len(r.chosen_ids), len(r.rejected_ids)))
    every = max(len(window) // batch_size // steps, 1)
    return [collate(window[i * every * batch_size :][:batch_size]) for i in range(steps)]


def attention_for(packing: str, packed_attention: str) -> str:
    """The attention a configuration runs: the packed-row kernel for ``pack``, else cuDNN on a GPU
    (one sequence a row) or the blockwise kernel."""
    return packed_attention if packing == "pack" else "cudnn" if jax.default_backend() == "gpu" else "blockwise"


class Setup(typing.NamedTuple):
    """A configuration ready to step: its model config, trainer, first state, batches, attention
    implementation, non-embedding parameters and the model FLOPs a token costs per parameter."""

    cfg: ModelConfig
    trainer: Trainer
    state: object
    batches: list
    impl: str
    body: int
    flops_per_param: int


def set_up(name: str, records, packing: str, batch_size: int, steps: int, max_length: int,
           packed_attention: str, config: dict | None = None, scan: bool = True, remat: bool = False,
           lora: LoraConfig | None = None, optimizer: dict | None = None) -> Setup:
    """The model (random weights, bfloat16 compute, float32 parameters), its trainer and the
    batches of one configuration. ``remat``: each layer recomputed in the backward pass;
    ``lora``: adapters on a frozen base (its ``base_dtype``), only they and the score head
    trained; ``optimizer``: optimizer options over the defaults (``moments``, ``offload``). Model
    FLOPs a token: 6 x parameters, or 4 x with LoRA (a frozen base's weight gradients are never
    computed)."""
    cfg = ModelConfig(**(config or CONFIGS[name]))
    impl = attention_for(packing, packed_attention)
    model = RewardTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention=impl, scan_layers=scan,
                              remat=remat)
    trainable = nnx.Param
    if lora is not None:
        lora_module.apply(model, lora)
        trainable = lora_module.trainable_filter(lora)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    body = params - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    trainer = Trainer(model, OptimizerConfig(learning_rate=1e-5, **(optimizer or {})), total_steps=1000,
                      trainable=trainable)
    batches = (packed_batches(records, batch_size, steps, max_length) if packing == "pack"
               else bucket_batches(records, batch_size, steps, max_length, packing))
    return Setup(cfg, trainer, trainer.init_state, batches, impl, body, 4 if lora is not None else 6)


def compile_shapes(run: Setup) -> tuple[object, int, float]:
    """Each batch shape stepped once (compiled), so that what is timed after is steady state:
    the state after, the shapes and the seconds it took."""
    state, shapes, start = run.state, set(), time.perf_counter()
    for b in run.batches:
        if b["input_ids"].shape not in shapes:
            shapes.add(b["input_ids"].shape)
            state, _ = run.trainer.train_step(state, jax.device_put(stack_micro_batches([b])))
    jax.block_until_ready(state.params)
    return state, len(shapes), time.perf_counter() - start


def planned_step_bytes(run: Setup, state, batch) -> int | None:
    """What the memory plan (``trainer.memory_plan``) counts for a step on ``batch``, from the
    compiled step's memory analysis: its arguments, temporaries and outputs not written over its
    inputs (the frozen weights among the arguments); None where XLA gives no analysis."""
    t = run.trainer
    lowered = t._train_jit.lower(t.program, state, jax.device_put(stack_micro_batches([batch])), t.frozen, t.others,
                                 t.hyper)
    a = lowered.compile().memory_analysis()
    if a is None:
        return None
    return int(a.argument_size_in_bytes + a.temp_size_in_bytes + max(a.output_size_in_bytes - a.alias_size_in_bytes, 0))


def model_flops(run: Setup, attended: int, computed: int) -> float:
    """Model FLOPs of the batches: the parameters' (``flops_per_param`` x non-embedding
    parameters x computed tokens) and the attention's (12 x layers x attended query-key pairs x
    heads x head_dim). Recomputation (``remat``) is not counted: MFU measures useful work."""
    cfg = run.cfg
    return (run.flops_per_param * run.body * computed
            + 12 * cfg.num_hidden_layers * attended * cfg.num_attention_heads * cfg.head_dim)


def peak_device_bytes() -> int | None:
    """The device allocator's peak bytes in use in this process (None where it does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def throughput(name: str, records, packing: str, batch_size: int, steps: int, peak: float, block: int,
               packed_attention: str = "blockwise", max_length: int = 2048, config: dict | None = None,
               launch: tuple[int, int] | None = None, scan: bool = True, profile: bool = True,
               remat: bool = False, lora: LoraConfig | None = None, attended=None, optimizer: dict | None = None,
               plan: bool = False) -> dict:
    """Steady-state training throughput of one configuration (every shape compiled first); one
    row: real tokens/s, padding, model TFLOP/s, MFU over ``peak`` TFLOP/s, compilations, the
    device's peak memory and, with ``profile``, the shares of the step the attention takes (one
    layer's forward and backward timed alone on each batch's rows, times the layers) and the
    parameter update (``optimizer_seconds``). ``launch``: the Pallas kernels' (num_warps,
    num_stages); ``scan``: the layers as one scanned layer; ``remat`` and ``lora`` as
    ``set_up``; ``attended``: the batch's attended query-key pairs (default ``attended_pairs``,
    which builds each row's mask: give a closed form for long rows); ``optimizer``: options of the
    optimizer section over the defaults (``moments``, ``offload``); ``plan``: also what the memory
    plan counts for the widest batch's step (``planned_step_bytes``: one more compilation)."""
    attended = attended or attended_pairs
    impl = attention_for(packing, packed_attention)
    before = set_kernel(block if impl in ("blockwise", "pallas") else None, *(launch or (None, None)))
    try:
        run = set_up(name, records, packing, batch_size, steps, max_length, packed_attention, config, scan, remat,
                     lora, optimizer)
        cfg, batches = run.cfg, run.batches
        state, shapes, compile_s = compile_shapes(run)
        planned = planned_step_bytes(run, state, max(batches, key=lambda b: b["input_ids"].size)) if plan else None
        device_batches = [jax.device_put(stack_micro_batches([b])) for b in batches]
        start = time.perf_counter()
        for b in device_batches:
            state, m = run.trainer.train_step(state, b)
        jax.block_until_ready(m)
        seconds = time.perf_counter() - start
        attn = update = None
        if profile:
            per_shape = {}
            for b in batches:
                if b["input_ids"].shape not in per_shape:
                    per_shape[b["input_ids"].shape] = attention_seconds(b, impl, cfg.num_attention_heads,
                                                                        cfg.num_key_value_heads, cfg.head_dim)
            attn = sum(per_shape[b["input_ids"].shape] for b in batches) * cfg.num_hidden_layers
            update = optimizer_seconds(run.trainer, state) * len(batches)
        kernel = set_kernel()  # the settings the measured step used
    finally:
        restore_kernel(before)
    real = sum(int(b["real_tokens"]) for b in batches)
    computed = sum(int(b["computed_tokens"]) for b in batches)
    slots = sum(b["input_ids"].size for b in batches)
    flops = model_flops(run, sum(attended(b) for b in batches), computed)
    pallas = impl == "pallas"
    peak_bytes = peak_device_bytes()
    row = {"model": name, "packing": packing, "attention": impl,
           "block": kernel["block"] if pallas else kernel["blockwise_block"] if impl == "blockwise" else None,
           "num_warps": kernel["num_warps"] if pallas else None, "num_stages": kernel["num_stages"] if pallas else None,
           "scan_layers": scan, "pairs_per_step": batch_size, "rows": f"{batches[0]['input_ids'].shape[0]} x "
           f"{'/'.join(str(s) for s in sorted({b['input_ids'].shape[1] for b in batches}))}",
           "real_tokens_per_s": real / seconds,
           "padding": 1 - computed / slots, "computed_per_real": computed / real,
           "model_tflops": flops / seconds / 1e12, "mfu": flops / seconds / 1e12 / peak, "step_ms": 1e3 * seconds / len(batches),
           "attention_share": attn / seconds if attn is not None else None,
           "optimizer_share": update / seconds if update is not None else None,
           "shapes": shapes, "compile_s": compile_s,
           "peak_device_gib": peak_bytes / 2**30 if peak_bytes is not None else None,
           "planned_step_gib": planned / 2**30 if planned is not None else None}
    block_note = f" (block {row['block']})" if row["block"] else ""
    share = (f" attention {attn / seconds:.0%}, parameter update {update / seconds:.0%} of the step"
             if attn is not None else "")
    print(f"| {name} | {packing} | {impl}{block_note} | {batch_size} | {real / seconds:,.0f} | {row['padding']:.3f} "
          f"| {row['model_tflops']:,.1f} | {row['mfu']:.1%} | {shapes} in {compile_s:.0f} s |{share}", flush=True)
    return row


# What a kernel is, from its name (first match wins): the categories of the profile's table.
KERNEL_CATEGORIES = (("attention (Pallas)", ("_forward_kernel", "_dkdv_kernel", "_dq_kernel", "pallas")),
                     ("attention (cuDNN)", ("cudnn", "fmha", "flash")),
                     ("matrix products", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "matmul", "dot", "convolution")),
                     ("reductions", ("reduce", "scatter", "sort")),
                     ("copies", ("memcpy", "memset", "copy", "transpose", "dynamic-update-slice",
                                 "dynamic_update_slice")))


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "elementwise and other fusions")


def device_kernels(xplane: str) -> list[tuple[str, str, float, float]]:
    """The kernels a ``jax.profiler`` trace recorded, as (name, HLO op, start ns, duration ns):
    the GPU planes' stream lines, or on CPU the host's XLA operations (events with an HLO op)."""
    from jax._src.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    gpu = [pl for pl in data.planes if pl.name.startswith("/device:GPU")]
    out = []
    for plane in gpu or [pl for pl in data.planes if pl.name.startswith("/host:CPU")]:
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.startswith("Stream")] or lines
        for line in streams:
            for e in line.events:
                stats = dict((k, v) for k, v in e.stats)
                if gpu or "hlo_op" in stats:
                    out.append((e.name, str(stats.get("hlo_op", "")), float(e.start_ns), float(e.duration_ns)))
    return out


def busy_ns(kernels) -> float:
    """Time at least one kernel ran (the union of their intervals)."""
    total, end = 0.0, -1.0
    for _, _, start, dur in sorted(kernels, key=lambda k: k[2]):
        if start + dur > end:
            total += start + dur - max(start, end)
            end = start + dur
    return total


def profile_table(kernels, steps: int, step_s: float, top: int = 20) -> list[dict]:
    """Where a steady step's time goes: the device's busy time against the wall time of the
    traced steps (``step_s`` each), by category of kernel and by kernel (the ``top`` longest),
    per step."""
    per_step = 1e-6 / steps  # ns over the traced steps -> ms a step
    step_ms = 1e3 * step_s
    rows = [{"summary": "device busy", "step_ms": step_ms, "busy_ms": busy_ns(kernels) * per_step,
             "idle_ms": step_ms - busy_ns(kernels) * per_step, "kernels_per_step": len(kernels) / steps}]
    by_cat: dict[str, list] = {}
    by_name: dict[tuple[str, str], list] = {}
    for k in kernels:
        by_cat.setdefault(kernel_category(k[0] + " " + k[1]), []).append(k[3])
        by_name.setdefault((k[0], k[1]), []).append(k[3])
    for cat, durs in sorted(by_cat.items(), key=lambda kv: -sum(kv[1])):
        rows.append({"category": cat, "ms_per_step": sum(durs) * per_step, "share_of_step": sum(durs) * per_step /
                     step_ms, "kernels_per_step": len(durs) / steps})
    for (name, op), durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        rows.append({"kernel": name[:90], "hlo_op": op[:40], "category": kernel_category(name + " " + op),
                     "ms_per_step": sum(durs) * per_step, "calls_per_step": len(durs) / steps,
                     "share_of_step": sum(durs) * per_step / step_ms})
    return rows


def profile_steps(name: str, records, batch_size: int, steps: int, max_length: int, peak: float, block: int,
                  packed_attention: str, trace_dir: pathlib.Path, config: dict | None = None,
                  launch: tuple[int, int] | None = None, scan: bool = True) -> list[dict]:
    """A steady packed step profiled: every shape compiled, then ``steps`` steps timed back to
    back (the wall a step takes in training, and the host's time to dispatch one, each step then
    waited for), then the same steps under ``jax.profiler.trace``; rows of ``profile_table``
    after one summary row (the step, dispatch, real tokens/s and MFU)."""
    before = set_kernel(block if packed_attention in ("blockwise", "pallas") else None, *(launch or (None, None)))
    try:
        run = set_up(name, records, "pack", batch_size, steps, max_length, packed_attention, config, scan)
        state, _, compile_s = compile_shapes(run)
        device_batches = [jax.device_put(stack_micro_batches([b])) for b in run.batches]
        dispatch = []
        for b in device_batches:
            start = time.perf_counter()
            state, m = run.trainer.train_step(state, b)
            dispatch.append(time.perf_counter() - start)
            jax.block_until_ready(m)
        start = time.perf_counter()
        for b in device_batches:
            state, m = run.trainer.train_step(state, b)
        jax.block_until_ready(m)
        step_s = (time.perf_counter() - start) / len(device_batches)
        trace_dir.mkdir(parents=True, exist_ok=True)
        with jax.profiler.trace(str(trace_dir)):
            start = time.perf_counter()
            for b in device_batches:
                state, m = run.trainer.train_step(state, b)
            jax.block_until_ready(m)
            traced_s = (time.perf_counter() - start) / len(device_batches)
    finally:
        restore_kernel(before)
    xplane = max(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    real = sum(int(b["real_tokens"]) for b in run.batches) / len(run.batches)
    computed = sum(int(b["computed_tokens"]) for b in run.batches)
    flops = model_flops(run, sum(attended_pairs(b) for b in run.batches), computed) / len(run.batches)
    head = {"summary": "step", "model": name, "scan_layers": scan, "pairs_per_step": batch_size,
            "rows": f"{run.batches[0]['input_ids'].shape[0]} x {run.batches[0]['input_ids'].shape[1]}",
            "step_ms": 1e3 * step_s, "dispatch_ms": 1e3 * float(np.median(dispatch)),
            "real_tokens_per_s": real / step_s, "mfu": flops / step_s / 1e12 / peak, "compile_s": compile_s,
            "traced_step_ms": 1e3 * traced_s, "trace_mib": xplane.stat().st_size / 2**20}
    return [head, *profile_table(device_kernels(str(xplane)), len(device_batches), traced_s)]


def kernel_sweep(records, batch_size: int, max_length: int, heads: tuple[int, int, int], configs,
                 steps: int = 2, repeat: int = 10, emit=None) -> list[dict]:
    """Each packed-row attention configuration, forward and backward of one layer, on ``steps``
    packed batches of real pairs (as ``throughput`` draws them), heads = (query heads, KV heads,
    head dim): median milliseconds and attention TFLOP/s (12 x attended query-key pairs x heads
    x head_dim a layer, as the MFU counts it). ``configs``: (implementation, block, num_warps,
    num_stages); a configuration the device refuses is reported with its error. Each row is also
    handed to ``emit`` as it is measured."""
    emit = emit or (lambda row: None)
    n, kh, d = heads
    batches = packed_batches(records, batch_size, steps, max_length)
    pairs = sum(attended_pairs(b) for b in batches)
    rows = []
    for impl, block, warps, stages in configs:
        before = set_kernel(block, warps, stages)
        try:
            seconds = sum(attention_seconds(b, impl, n, kh, d, repeat=repeat) for b in batches)
        except Exception as e:  # noqa: BLE001 - report what the device does not support
            rows.append({"attention": impl, "block": block, "num_warps": warps, "num_stages": stages,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
            emit(rows[-1])
            continue
        finally:
            restore_kernel(before)
        rows.append({"attention": impl, "block": block, "num_warps": warps, "num_stages": stages,
                     "rows": f"{len(batches)} x {batches[0]['input_ids'].shape}", "ms": 1e3 * seconds / len(batches),
                     "attention_tflops": 12 * pairs * n * d / seconds / 1e12})
        emit(rows[-1])
        print(f"kernel {impl} block {block} warps {warps} stages {stages}: {rows[-1]['ms']:.2f} ms a batch, "
              f"{rows[-1]['attention_tflops']:.1f} TFLOP/s", flush=True)
    return rows


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
