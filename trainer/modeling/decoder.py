"""The decoder every supported family builds (``config.FAMILIES``: Llama, Mistral, Qwen 2 and 3,
OLMo 2, Phi-3, Gemma 2 and 3, Qwen3-MoE, Mixtral; what differs is in the family's table entry),
with a score head, in Flax NNX.

Attribute names mirror Hugging Face's (``model.layers.0.self_attn.q_proj``, ``score``), so
weight conversion is a name map (``trainer.modeling.convert``). Attention takes per-token
segment ids, positions and branch ids (``trainer.modeling.attention``): tokens attend only to
earlier tokens of the same segment, so several pairs packed into one row never see each
other, and a pair packed as one prompt followed by both replies scores each reply as if it
were a sequence of its own. Segment 0 is padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from rmflow.schemas.heads import member_reward
from rmflow.trainer.modeling import lora, quant
from rmflow.trainer.modeling.attention import (
    attention,
    attention_at,
    dense_mask,
    resolve_attention,
    split_tokens,
    takes_dense_mask,
)
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.parallel.mesh import BATCH_AXES

INIT_STD = 0.02  # Hugging Face's initializer_range default


def _linear(cfg: ModelConfig, dtype, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(INIT_STD), rngs=rngs)


def _proj(linear: nnx.Linear, x: jax.Array) -> jax.Array:
    """A projection (its kernel quantised or not: ``trainer.modeling.quant``), plus its LoRA
    adapter when it has one (``trainer.modeling.lora``)."""
    return quant.project(linear, x) + lora.delta(linear, x)


class RMSNorm(nnx.Module):
    """RMSNorm in float32; the weight applied after the cast to the compute dtype (Llama, Qwen,
    Phi-3), or with ``weight_in_float32`` before it (OLMo 2, Gemma): one rounding instead of two.
    ``offset``: the weight w is applied as (offset + w) (Gemma: 1, its weights stored as w, zero
    at initialisation)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, weight_in_float32: bool = False,
                 offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, jnp.float32))
        self.eps, self.dtype, self.weight_in_float32, self.offset = eps, dtype, weight_in_float32, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...] + self.offset if self.offset else self.weight[...]
        if self.weight_in_float32:
            return (w * y).astype(self.dtype)
        return w.astype(self.dtype) * y.astype(self.dtype)


def _norm(cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
    """An RMSNorm of ``dim`` as the family normalises (``cfg.norm_weight_in_float32``, ``cfg.norm_offset``)."""
    return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype, weight_in_float32=cfg.norm_weight_in_float32,
                   offset=cfg.norm_offset)


def rope_inv_freq(cfg: ModelConfig) -> jnp.ndarray:
    """Inverse frequencies, with the checkpoint's RoPE scaling (as transformers computes them)."""
    dim = cfg.rotary_dim  # the dimensions rotated (all, or the first part: partial_rotary_factor)
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    p = dict(cfg.rope_params)
    if cfg.rope_type == "linear":
        inv = inv / p["factor"]
    elif cfg.rope_type == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = jnp.where(medium, smoothed, scaled)
    elif cfg.rope_type == "longrope":  # within the original context: the short factors (config._longrope)
        inv = inv / jnp.asarray(cfg.rope_short_factor, jnp.float32)
    return inv


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are scaled by (LongRoPE's attention factor; 1 otherwise)."""
    return float(dict(cfg.rope_params).get("attention_factor", 1.0)) if cfg.rope_type == "longrope" else 1.0


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, dtype, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, D/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if scale == 1.0:
        return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def _rotate_half(x: jax.Array) -> jax.Array:
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-b, a], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on the first ``cos.shape[-1]`` dimensions of each head (all of them, or a part:
    ``ModelConfig.partial_rotary_factor``); the rest pass unchanged."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos[:, :, None, :] + _rotate_half(x) * sin[:, :, None, :]
    head, rest = x[..., :rot], x[..., rot:]
    return jnp.concatenate([head * cos[:, :, None, :] + _rotate_half(head) * sin[:, :, None, :], rest], axis=-1)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["segment_ids", "positions", "branch_ids", "mask", "window_masks"],
                   meta_fields=["implementation", "window", "windows"])
@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """What every layer's attention needs besides its activations (a pytree; the
    implementation and window are static). A model whose layers attend over different windows
    (Gemma 2's local and global layers) has each one's dense mask in ``window_masks`` (by
    ``windows``); a layer takes its own with ``for_window``."""

    segment_ids: jax.Array
    positions: jax.Array
    branch_ids: jax.Array
    implementation: str
    window: int | None
    mask: jax.Array | None = None
    window_masks: tuple | None = None
    windows: tuple = ()

    def for_window(self, window: int | None) -> AttentionContext:
        if window == self.window:
            return self
        mask = self.window_masks[self.windows.index(window)] if self.window_masks is not None else None
        return dataclasses.replace(self, window=window, mask=mask)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = _linear(cfg, dtype, h, self.n_heads * hd, cfg.qkv_bias, rngs)
        self.k_proj = _linear(cfg, dtype, h, self.n_kv * hd, cfg.qkv_bias, rngs)
        self.v_proj = _linear(cfg, dtype, h, self.n_kv * hd, cfg.qkv_bias, rngs)
        self.o_proj = _linear(cfg, dtype, self.n_heads * hd, h, cfg.o_bias, rngs)
        self.scale, self.softcap = cfg.attention_scale, cfg.attn_logit_softcapping
        # q/k RMSNorm (``cfg.qk_norm_over``): over each head's vector (Qwen3) or over the whole
        # projection, before it is cut into heads (OLMo 2)
        self.qk_norm = cfg.qk_norm and cfg.qk_norm_over
        if self.qk_norm:
            whole = self.qk_norm == "projection"
            self.q_norm = _norm(cfg, self.n_heads * hd if whole else hd, dtype)
            self.k_norm = _norm(cfg, self.n_kv * hd if whole else hd, dtype)

    def _qk(self, xq, xk):
        """Queries from ``xq`` and keys from ``xk``, cut into heads and normalised, before RoPE."""
        (b, s, _), t = xq.shape, xk.shape[1]
        q, k = _proj(self.q_proj, xq), _proj(self.k_proj, xk)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(b, s, self.n_heads, self.head_dim), k.reshape(b, t, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def __call__(self, x, cos, sin, ctx: AttentionContext):
        b, t, _ = x.shape
        q, k = self._qk(x, x)
        v = _proj(self.v_proj, x).reshape(b, t, self.n_kv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, ctx.segment_ids, ctx.positions, ctx.branch_ids, implementation=ctx.implementation,
                        window=ctx.window, mask=ctx.mask, scale=self.scale, softcap=self.softcap)
        return _proj(self.o_proj, out.reshape(b, t, self.n_heads * self.head_dim))

    def at(self, x, index, cos, sin, ctx: AttentionContext):
        """The outputs at the tokens ``index`` (B, S) only: keys and values from every token,
        queries from those tokens (``attention_at``), (B, S, H)."""
        b, t, _ = x.shape
        s = index.shape[1]
        take = lambda a: jnp.take_along_axis(a, index[..., None], axis=1)  # noqa: E731
        q, k = self._qk(take(x), x)
        v = _proj(self.v_proj, x).reshape(b, t, self.n_kv, self.head_dim)
        q, k = apply_rope(q, take(cos), take(sin)), apply_rope(k, cos, sin)
        out = attention_at(q, k, v, index, ctx.segment_ids, ctx.positions, ctx.branch_ids, window=ctx.window,
                           scale=self.scale, softcap=self.softcap)
        return _proj(self.o_proj, out.reshape(b, s, self.n_heads * self.head_dim))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, dtype, h, i, cfg.mlp_bias, rngs)
        self.up_proj = _linear(cfg, dtype, h, i, cfg.mlp_bias, rngs)
        self.down_proj = _linear(cfg, dtype, i, h, cfg.mlp_bias, rngs)
        self.hidden_act = cfg.hidden_act

    def __call__(self, x):
        gate = _proj(self.gate_proj, x)
        gate = nnx.silu(gate) if self.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
        return _proj(self.down_proj, gate * _proj(self.up_proj, x))


class Experts(nnx.Module):
    """Every expert's gate, up and down projections, stacked on a leading expert axis: (E, H, I),
    (E, H, I), (E, I, H) (the checkpoint's per-expert tensors, ``modeling.convert.stack_experts``)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nnx.initializers.normal(INIT_STD)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, i), jnp.float32))
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, i), jnp.float32))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), jnp.float32))
        self.dtype, self.hidden_act = dtype, cfg.hidden_act

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """``x`` (M, H): token copies sorted by expert, ``group_sizes`` (E,) of them per expert ->
        (M, H), each through its expert: grouped matrix products (``jax.lax.ragged_dot``), no loop
        over the experts."""
        def grouped(a, w):
            return jax.lax.ragged_dot(a, w.astype(self.dtype), group_sizes, preferred_element_type=jnp.float32)

        def project(a, name):  # the experts' projection, plus its LoRA adapters when it has them
            return quant.with_weight(grouped, a, getattr(self, name)) + lora.expert_delta(self, name, a, group_sizes,
                                                                                           grouped)

        gate = project(x, "gate_proj")
        gate = nnx.silu(gate) if self.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
        return project((gate * project(x, "up_proj")).astype(self.dtype), "down_proj").astype(self.dtype)


class SparseMoE(nnx.Module):
    """A router over the experts (Qwen3-MoE's and Mixtral's sparse block, as ``mlp``): each token's
    router probabilities (softmax in float32), its ``num_experts_per_tok`` most probable experts,
    their weights (renormalised over the chosen with ``norm_topk_prob``), the token copies sorted
    by expert and computed by ``Experts`` as groups, then added back weighted."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.gate = _linear(cfg, dtype, cfg.hidden_size, cfg.num_experts, False, rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.top_k, self.norm_topk, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x`` (N, H) -> the router's probabilities (N, E) and each token's chosen experts'
        weights and indices, (N, k)."""
        probs = jax.nn.softmax(quant.project(self.gate, x).astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdims=True)
        return probs, weights, chosen

    def __call__(self, x: jax.Array, real: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x`` (B, T, H) and ``real`` (B, T) (not padding) -> the block's output and its router
        statistics over the real tokens (``router_loss``): per expert the times it was chosen and
        its probabilities' sum, then the tokens. Under a device mesh (``jax.set_mesh``, as the
        trainer traces a mixture of experts) whose batch axes split the rows, each shard routes
        and computes its own rows (``jax.shard_map``; the experts' weights gathered to it), so no
        device does another's expert work; the statistics are summed over the shards."""
        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
        if axes and x.shape[0] % math.prod(mesh.shape[a] for a in axes) == 0:
            graphdef, state = nnx.split(self)
            rows = jax.sharding.PartitionSpec(axes)

            def local(x, real, state):
                y, stats = nnx.merge(graphdef, state).route_and_compute(x, real)
                return y, jax.lax.psum(stats, axes)

            return jax.shard_map(local, in_specs=(rows, rows, jax.sharding.PartitionSpec()),
                                 out_specs=(rows, jax.sharding.PartitionSpec()), axis_names=set(axes),
                                 check_vma=False)(x, real, state)
        return self.route_and_compute(x, real)

    def route_and_compute(self, x: jax.Array, real: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``__call__`` over all of ``x``'s tokens at once."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, weights, chosen = self.route(x)
        w = real.reshape(-1).astype(jnp.float32)
        counts = (jax.nn.one_hot(chosen, self.num_experts, dtype=jnp.float32).sum(1) * w[:, None]).sum(0)
        stats = jnp.concatenate([counts, (probs * w[:, None]).sum(0), w.sum()[None]])
        flat = chosen.reshape(-1)  # (N * k,) each copy's expert
        order = jnp.argsort(flat, stable=True)
        token = order // self.top_k  # the token of each sorted copy
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        out = self.experts(x[token], sizes)  # (N * k, H), sorted by expert
        # each copy's weight rounded to the compute dtype, as transformers rounds the router's
        weight = weights.reshape(-1)[order][:, None].astype(x.dtype).astype(jnp.float32)
        weighted = out.astype(jnp.float32) * weight
        y = jnp.zeros(x.shape, jnp.float32).at[token].add(weighted)
        return y.astype(x.dtype).reshape(shape), stats


def router_loss(stats: jax.Array, num_experts: int) -> jax.Array:
    """The load-balancing auxiliary loss (Switch Transformer's, as transformers computes it for
    Qwen3-MoE and Mixtral) from the router statistics summed over the sparse layers: the experts'
    shares of the chosen slots times their mean probabilities, summed, times the expert count
    (1 · k at a perfect balance, k experts a token)."""
    counts, probs, rows = stats[:num_experts], stats[num_experts: 2 * num_experts], stats[-1]
    rows = jnp.maximum(rows, 1.0)
    return num_experts * jnp.sum((counts / rows) * (probs / rows))


class DecoderLayer(nnx.Module):
    """Attention then MLP, each added to the residual stream: normalised on the way in
    (``input_layernorm``, ``post_attention_layernorm``: Llama's names, the second being the MLP's
    input norm), or with ``cfg.post_norms`` on the way out (OLMo 2: ``post_attention_layernorm``,
    ``post_feedforward_layernorm``), or with ``cfg.sandwich_norms`` both (Gemma 2:
    ``input_layernorm``, ``post_attention_layernorm`` on the attention's output,
    ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``). ``window``: this layer's
    sliding window (``ModelConfig.layer_window``; a static attribute, so layers of different
    windows run unscanned, ``run_layers``)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, index: int = 0):
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.mlp = SparseMoE(cfg, dtype=dtype, rngs=rngs) if index in cfg.sparse_layers else MLP(cfg, dtype=dtype,
                                                                                                 rngs=rngs)
        self.post_norms, self.sandwich = cfg.post_norms, cfg.sandwich_norms
        self.window = cfg.layer_window(index)
        self.router_size = cfg.router_stats_size  # this layer's router statistics: zeros for a dense MLP
        self.rope = int(bool(cfg.sliding_rope_theta) and self.window is not None)  # its RoPE table (DecoderModel)
        if cfg.sandwich_norms:
            self.input_layernorm = _norm(cfg, cfg.hidden_size, dtype)
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size, dtype)
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size, dtype)
        elif cfg.post_norms:
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size, dtype)
        else:
            self.input_layernorm = _norm(cfg, cfg.hidden_size, dtype)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size, dtype)

    def _tables(self, cos, sin):
        """This layer's RoPE tables, of the model's one or two (Gemma 3: global, sliding)."""
        return (cos[self.rope], sin[self.rope]) if isinstance(cos, tuple) else (cos, sin)

    def _mlp(self, x, real):
        """The MLP's output and the router statistics (``SparseMoE``; zeros for a dense MLP)."""
        if isinstance(self.mlp, SparseMoE):
            return self.mlp(x, real)
        return self.mlp(x), jnp.zeros((self.router_size,), jnp.float32)

    def __call__(self, x, cos, sin, ctx):
        """The layer's output and its router statistics, (``router_stats_size``,)."""
        ctx = ctx.for_window(self.window)
        cos, sin = self._tables(cos, sin)
        real = ctx.segment_ids > 0
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
            y, stats = self._mlp(self.pre_feedforward_layernorm(x), real)
            return x + self.post_feedforward_layernorm(y), stats
        if self.post_norms:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, ctx))
            y, stats = self._mlp(x, real)
            return x + self.post_feedforward_layernorm(y), stats
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        y, stats = self._mlp(self.post_attention_layernorm(x), real)
        return x + y, stats

    def at(self, x, index, cos, sin, ctx):
        """The layer's outputs at the tokens ``index`` (B, S) only, (B, S, H): equal to
        ``self(x, ...)`` taken at ``index``, without the MLP, queries and output projection of the
        other tokens."""
        x_at = jnp.take_along_axis(x, index[..., None], axis=1)
        ctx = ctx.for_window(self.window)
        cos, sin = self._tables(cos, sin)
        real = jnp.take_along_axis(ctx.segment_ids, index, axis=1) > 0
        if self.sandwich:
            x_at = x_at + self.post_attention_layernorm(self.self_attn.at(self.input_layernorm(x), index, cos, sin, ctx))
            y, stats = self._mlp(self.pre_feedforward_layernorm(x_at), real)
            return x_at + self.post_feedforward_layernorm(y), stats
        if self.post_norms:
            x_at = x_at + self.post_attention_layernorm(self.self_attn.at(x, index, cos, sin, ctx))
            y, stats = self._mlp(x_at, real)
            return x_at + self.post_feedforward_layernorm(y), stats
        x_at = x_at + self.self_attn.at(self.input_layernorm(x), index, cos, sin, ctx)
        y, stats = self._mlp(self.post_attention_layernorm(x_at), real)
        return x_at + y, stats


def _layer_forward(layer: DecoderLayer, x, cos, sin, ctx):
    return layer(split_tokens(x), cos, sin, ctx)


def _layer_at(layer: DecoderLayer, x, index, cos, sin, ctx):
    return layer.at(x, index, cos, sin, ctx)


def _apply_layer(graphdef, x, index, state, fn, key, *args):
    """``fn`` on the layer ``(graphdef, state)`` as layer number ``index``, its adapter dropout
    (if ``key``) drawn from ``lora.layer_key(key, index)``."""
    with lora.dropout_key(lora.layer_key(key, index)):
        return fn(nnx.merge(graphdef, state), x, *args)


# Recomputed in the backward pass. The dropout key is an argument: jax.checkpoint (and nnx.remat)
# reuse a function's trace across calls, so a key read from the context inside would be stale.
_apply_layer_remat = jax.checkpoint(_apply_layer, static_argnums=(0, 4), prevent_cse=False)


def apply_layer(layer, index, fn, x, *args, remat: bool):
    """``fn(layer, x, *args)`` as layer number ``index``; ``remat``: recomputed in the backward pass."""
    graphdef, state = nnx.split(layer)
    call = _apply_layer_remat if remat else _apply_layer
    return call(graphdef, x, index, state, fn, lora.current_key(), *args)


def run_layers(layers, fn, x, *args, scan: bool, remat: bool, collect: bool = False):
    """``x`` through ``layers`` in order, ``fn(layer, x, *args)`` each (a layer's output and its
    router statistics); returns the output and the statistics summed over the layers, with
    ``collect`` also every layer's output, stacked (L, ...).

    ``scan``: one ``jax.lax.scan`` over the layers' parameters, stacked at call time, so the
    compiled program holds the layer once and a deep model compiles in about the time of a
    shallow one. The parameters stay one module per layer (conversion, export, LoRA, sharding
    rules and checkpoints see no stacked axis); stacking costs one copy of the layers' weights a
    forward pass. Layers of different structure (graphdefs) run in a Python loop instead, as
    does everything with ``scan=False``. ``remat``: each layer's activations are recomputed in
    the backward pass. LoRA's adapter dropout draws per layer from the layer's number
    (``lora.layer_key``), so both paths draw the same masks."""
    layers = list(layers)
    graphdef = nnx.graphdef(layers[0]) if layers else None
    total = jnp.zeros((layers[0].router_size if layers else 0,), jnp.float32)
    if not (scan and len(layers) > 1 and all(nnx.graphdef(layer) == graphdef for layer in layers[1:])):
        outs = []
        for i, layer in enumerate(layers):
            x, stats = apply_layer(layer, i, fn, x, *args, remat=remat)
            total = total + stats
            outs.append(x)
        return (x, jnp.stack(outs), total) if collect else (x, total)
    call, key = (_apply_layer_remat if remat else _apply_layer), lora.current_key()

    def body(carry, xs):
        h, acc = carry
        i, state = xs
        h, stats = call(graphdef, h, i, state, fn, key, *args)
        return (h, acc + stats), (h if collect else None)

    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[nnx.state(layer) for layer in layers])
    (x, total), outs = jax.lax.scan(body, (x, total), (jnp.arange(len(layers), dtype=jnp.int32), stacked))
    return (x, outs, total) if collect else (x, total)


def _summed(a: jax.Array, b: jax.Array) -> jax.Array:
    """Two router statistics added; one of no layers (size 0) adds nothing."""
    return a if not b.size else b if not a.size else a + b


MEMBER_KEYS = 1 << 20  # member m's adapter dropout draws from layer_key(key, MEMBER_KEYS + m): apart from any layer's


class DecoderModel(nnx.Module):
    """The transformer body (Hugging Face's ``model.`` prefix). ``scan_layers``: the layers run
    as one scanned layer (``run_layers``). An ensemble with ``cfg.member_layers`` holds the layers
    below its members' own (``MemberLayers``) here: ``num_hidden_layers - member_layers``."""

    def __init__(self, cfg: ModelConfig, *, dtype, remat: bool = False, rngs: nnx.Rngs, attention: str = "auto",
                 scan_layers: bool = True):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=jnp.float32,
                                      embedding_init=nnx.initializers.normal(INIT_STD), rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs, index=i)
                                for i in range(cfg.num_hidden_layers - cfg.member_layers)])
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.embed_scale else None  # Gemma: embeddings times sqrt(hidden)
        self.windows = tuple(dict.fromkeys(cfg.layer_window(i) for i in range(cfg.num_hidden_layers)))
        self.norm = _norm(cfg, cfg.hidden_size, dtype)
        self.set_rope_tables(cfg)
        self.rope_scale = rope_attention_factor(cfg)
        self.sliding_window, self.dtype = cfg.sliding_window, dtype
        self.attention = resolve_attention(attention, dtype, softcap=bool(cfg.attn_logit_softcapping))
        self.remat, self.scan_layers = remat, scan_layers


    def set_rope_tables(self, cfg: ModelConfig) -> None:
        """The RoPE tables, constants computed from the configuration (not parameters): the global
        layers', and Gemma 3's sliding layers' own (default RoPE, their own base)."""
        self.inv_freq = nnx.Variable(rope_inv_freq(cfg))
        self.sliding_inv_freq = nnx.Variable(rope_inv_freq(dataclasses.replace(
            cfg, rope_type="default", rope_params=(), rope_theta=cfg.sliding_rope_theta))) \
            if cfg.sliding_rope_theta else None
    def __call__(self, input_ids, positions, segment_ids, branch_ids=None):
        """Hidden states before the final norm, (B, T, H)."""
        x, cos, sin, ctx = self._inputs(input_ids, positions, segment_ids, branch_ids, len(self.layers))
        return self._run(self.layers, _layer_forward, x, cos, sin, ctx)[0]

    def _run(self, layers, fn, x, *args, collect: bool = False):
        return run_layers(layers, fn, x, *args, scan=self.scan_layers, remat=self.remat, collect=collect)

    def _inputs(self, input_ids, positions, segment_ids, branch_ids, full_layers: int):
        """Embeddings, RoPE tables and the attention context (with the dense mask, built once,
        when ``full_layers`` layers run over every token with a mask-taking implementation)."""
        x = split_tokens(quant.embed(self.embed_tokens, input_ids))
        if self.embed_scale is not None:  # the scale rounded to the compute dtype, as transformers does
            x = x * jnp.asarray(self.embed_scale, x.dtype)
        cos, sin = rope_cos_sin(positions, self.inv_freq[...], self.dtype, self.rope_scale)
        if self.sliding_inv_freq is not None:  # (the global layers', the sliding layers')
            local = rope_cos_sin(positions, self.sliding_inv_freq[...], self.dtype)
            cos, sin = (cos, local[0]), (sin, local[1])
        if branch_ids is None:
            branch_ids = jnp.zeros_like(segment_ids)
        ctx = AttentionContext(segment_ids, positions, branch_ids, self.attention, self.sliding_window)
        if takes_dense_mask(self.attention) and full_layers:
            masks = tuple(dense_mask(segment_ids, positions, branch_ids, w) for w in self.windows)
            ctx = dataclasses.replace(ctx, mask=dense_mask(segment_ids, positions, branch_ids, self.sliding_window),
                                      window_masks=masks if len(masks) > 1 else None, windows=self.windows)
        return x, cos, sin, ctx

    def hidden_states(self, input_ids, positions, segment_ids, branch_ids=None) -> list[jax.Array]:
        """The embeddings and each layer's output (for per-layer parity checks)."""
        x, cos, sin, ctx = self._inputs(input_ids, positions, segment_ids, branch_ids, len(self.layers))
        _, outs, _ = self._run(self.layers, _layer_forward, x, cos, sin, ctx, collect=True)
        return [x, *outs]

    def hidden_at(self, input_ids, positions, segment_ids, index, branch_ids=None, *, with_router: bool = False):
        """Hidden states before the final norm at the tokens ``index`` (B, S), (B, S, H). Every
        layer but the last runs over all tokens; the last one only at ``index`` (its outputs
        elsewhere feed nothing), which gives the same values for a fraction of its work.
        ``with_router``: also the router statistics summed over every layer but the last, for the
        load-balancing loss (``router_loss``): the last layer routes the reward tokens only."""
        x, cos, sin, ctx = self._inputs(input_ids, positions, segment_ids, branch_ids, len(self.layers) - 1)
        x, stats = self._run(self.layers[:-1], _layer_forward, x, cos, sin, ctx)
        x, _ = apply_layer(self.layers[-1], len(self.layers) - 1, _layer_at, x, index, cos, sin, ctx,
                           remat=self.remat)
        return (x, stats) if with_router else x

    def members_at(self, input_ids, positions, segment_ids, index, tops, branch_ids=None):
        """An ensemble's hidden states before the final norm at the tokens ``index`` (B, S), one
        per member, (B, S, N, H), and the router statistics: the layers here run once over all
        tokens, then each member's own ``tops`` (``MemberLayers.layers``), the last of them only at
        ``index``. A member's adapter dropout draws its own masks (``MEMBER_KEYS``). The statistics
        are the shared layers' plus the mean of the members' (each a model's worth of routing)."""
        first = len(self.layers)
        depth = first + len(tops[0])
        x, cos, sin, ctx = self._inputs(input_ids, positions, segment_ids, branch_ids, depth - 1)
        x, stats = self._run(self.layers, _layer_forward, x, cos, sin, ctx)
        key = lora.current_key()
        outs, member_stats = [], jnp.zeros((0,), jnp.float32)
        for m, layers in enumerate(tops):
            with lora.dropout_key(lora.layer_key(key, MEMBER_KEYS + m)):
                y, s = self._run(layers[:-1], _layer_forward, x, cos, sin, ctx)
                y, _ = apply_layer(layers[-1], len(layers) - 1, _layer_at, y, index, cos, sin, ctx, remat=self.remat)
            outs.append(y)
            member_stats = _summed(member_stats, s / len(tops))
        return jnp.stack(outs, axis=-2), _summed(stats, member_stats)


class MemberLayers(nnx.Module):
    """An ensemble member's own top layers (``ModelConfig.member_layers``): decoder layers
    ``first`` up to the model's last, numbered as the base's (their windows and experts are those
    layers'), trained apart from the other members' copies."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, first: int):
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs, index=i)
                                for i in range(first, cfg.num_hidden_layers)])


def _copied(module: nnx.Module) -> nnx.Module:
    """A copy of ``module`` whose arrays are its own (``nnx.clone`` shares them: a train step
    that donates its parameters cannot take one buffer twice)."""
    out = nnx.clone(module)
    nnx.update(out, jax.tree.map(jnp.copy, nnx.state(out)))
    return out


def score_layer(cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, init_std: float | None = None) -> nnx.Linear:
    """A fresh score head: hidden size to the head's outputs (with a bias where the head has one),
    float32 parameters, its kernel drawn with standard deviation ``init_std`` (default
    1/sqrt(hidden + 1))."""
    std = init_std if init_std is not None else 1.0 / math.sqrt(cfg.hidden_size + 1)
    return nnx.Linear(cfg.hidden_size, cfg.num_labels, use_bias=cfg.kind.head.bias, dtype=dtype,
                      param_dtype=jnp.float32, kernel_init=nnx.initializers.normal(std), rngs=rngs)


class RewardTransformer(nnx.Module):
    """Decoder + ``score`` head, shaped by the reward model kind of ``cfg.num_labels``
    (``schemas.kinds``): a reward per sequence, or for a process reward model (Hugging Face's
    ``*ForTokenClassification`` head, with bias) the two class logits (incorrect, correct) of
    each scored step, or for an attribute head (``cfg.attributes``) one output per attribute, the
    reward their weighted sum.

    ``reward_index`` holds the explicit index of each sequence's reward token (each step's end),
    (B,) or (B, K) for K per row; scores come back in float32 with the same shape: the reward,
    or for a process model the log-odds that the step is correct (logit 1 - logit 0).
    ``attention`` picks the implementation (``trainer.modeling.attention.ATTENTION``);
    ``scan_layers`` runs the layer stack as one scanned layer (``run_layers``).
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, remat: bool = False, rngs: nnx.Rngs,
                 score_init_std: float | None = None, attention: str = "auto", scan_layers: bool = True):
        self.config = cfg
        self.model = DecoderModel(cfg, dtype=dtype, remat=remat, rngs=rngs, attention=attention,
                                  scan_layers=scan_layers)
        self.score = score_layer(cfg, dtype=dtype, rngs=rngs, init_std=score_init_std)
        # an ensemble's members' own top layers: one draw, copied (each its own arrays), as a
        # checkpoint's layers are; ``lora.share_frozen`` makes the frozen copies of a LoRA run one
        first = cfg.num_hidden_layers - cfg.member_layers
        member = MemberLayers(cfg, dtype=dtype, rngs=rngs, first=first) if cfg.member_layers else None
        self.members = nnx.List([member] + [_copied(member) for _ in range(cfg.members - 1)]) if member else None

    def hidden_at(self, input_ids, positions, segment_ids, reward_index, branch_ids=None, *,
                  with_router: bool = False):
        """Final-norm hidden states at the reward tokens, (B, [K,] H); an ensemble with its own
        top layers, one per member, (B, [K,] N, H) (``with_router``: and the router statistics,
        ``DecoderModel.hidden_at``)."""
        idx = reward_index if reward_index.ndim == 2 else reward_index[:, None]
        if self.members is not None:
            g, stats = self.model.members_at(input_ids, positions, segment_ids, idx,
                                             [m.layers for m in self.members], branch_ids)
        else:
            g, stats = self.model.hidden_at(input_ids, positions, segment_ids, idx, branch_ids, with_router=True)
        g = self.model.norm(g)  # (B, K, [N,] H)
        g = g if reward_index.ndim == 2 else g[:, 0]
        return (g, stats) if with_router else g

    def logits(self, input_ids, positions, segment_ids, reward_index, branch_ids=None, *, with_router: bool = False):
        """The score head's outputs at the reward tokens, (B, [K,] num_labels), float32
        (``with_router``: and the router statistics); an ensemble with its own top layers reads
        member m's output from member m's hidden state."""
        g, stats = self.hidden_at(input_ids, positions, segment_ids, reward_index, branch_ids, with_router=True)
        if self.members is None:
            out = self.score(g)
        else:  # (..., N, H) x (H, N) -> (..., N): each member's column on its own hidden state
            dtype = self.score.dtype or g.dtype
            out = jnp.einsum("...nh,hn->...n", g.astype(dtype), self.score.kernel[...].astype(dtype))
            if self.score.bias is not None:
                out = out + self.score.bias[...].astype(dtype)
        out = out.astype(jnp.float32)
        return (out, stats) if with_router else out

    def reward_of(self, logits: jax.Array) -> jax.Array:
        """The score head's outputs (..., num_labels) -> the reward (...): the output; a process
        model's log-odds; an attribute head's weighted sum (``attribute_weights``); an ensemble's
        rule over its members (``member_reward``: their mean, minimum, or mean minus lambda x std)."""
        if self.config.attributes:
            return jnp.sum(logits * jnp.asarray(self.config.attribute_weights, logits.dtype), axis=-1)
        if self.config.members:
            rule, lam = member_reward(self.config.member_reward)
            if rule == "min":
                return jnp.min(logits, axis=-1)
            mean = jnp.mean(logits, axis=-1)
            return mean if rule == "mean" else mean - lam * jnp.std(logits, axis=-1)
        return logits[..., 0] if logits.shape[-1] == 1 else logits[..., 1] - logits[..., 0]

    def __call__(self, input_ids, positions, segment_ids, reward_index, branch_ids=None):
        return self.reward_of(self.logits(input_ids, positions, segment_ids, reward_index, branch_ids))
