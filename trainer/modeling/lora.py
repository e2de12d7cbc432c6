"""LoRA reward models: low-rank adapters on the decoder's linear layers, base weights frozen.

A targeted projection ``W`` (our kernels are (in, out)) computes ``x W + (x A) B * alpha / rank``
with ``A`` (in, rank) initialised as PEFT does (Kaiming-uniform) and ``B`` (rank, out) zeros, so
training starts from the base model exactly. The adapters (Flax's ``nnx.LoRAParam``) and the score head are
the only trainable parameters (``trainable_filter``): the base weights get no gradient and no
optimizer state. Target names are Hugging Face / PEFT's (``q_proj`` ... ``down_proj``), or
``all-linear``. ``merge`` folds the adapters into the kernels for a plain checkpoint.

``dropout``: as PEFT's ``lora_dropout``, the adapter's input is dropped (``(drop(x) A) B``) while
training only: the train step opens ``dropout_key(key)`` (a key from the run's seed and step, so
a resumed run draws the same masks), each decoder layer folds in its number (``layer_key``) and
each projection its target's index; outside it, as in eval and export, there is no dropout. The
backward pass keeps each mask (a byte an element) and recomputes the dropped input from it
(``jax.checkpoint``): kept, the dropped input would be one more float activation per adapted
projection.
Flax's ``nnx.LoRA`` module is not used: it has no ``alpha / rank`` scale and no input dropout,
both of which PEFT's adapters (and their exported weights) have; ``nnx.Dropout`` would carry its
RNG state in the model (in every checkpoint) where a key from the seed and step suffices.
``base_dtype`` is how the frozen matrices (kernels, embeddings, experts; not norms, biases or
the score head) are held (``base_storage``): float32; bfloat16 (half their memory, upcast where
used); int8 or nf4 codes with a float32 scale per block of ``base_block_size`` weights
(``trainer.modeling.quant``, dequantised where used: QLoRA with nf4). A checkpoint's tensors are
stored so as they are read (``convert.load_reward_model``'s ``store``), a preset's once it is
built; eval and export see the same weights, since the stored form is a function of the base.

A mixture of experts' experts (``llama.Experts``: each projection stacked over the experts,
(E, in, out)) get one adapter per expert, stacked alike: ``NAME_lora_A`` (E, in, rank) and
``NAME_lora_B`` (E, rank, out), applied to each token copy with its expert's pair
(``expert_delta``, grouped as the experts are); ``merge`` folds each into its expert.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from rmflow.schemas.train_config import LORA_TARGETS as TARGETS
from rmflow.schemas.train_config import LoraConfig
from rmflow.trainer.modeling import quant

__all__ = ["TARGETS", "LoraConfig", "adapters", "apply", "base_storage", "delta", "current_key", "dropout_key", "keep_mask",
           "layer_key", "lora_linears",
           "merge", "strip", "trainable_filter"]

_DROPOUT_KEYS: list = []  # the key of the train step being traced (innermost last)


def current_key():
    """The dropout key of the train step being traced, or None (no dropout)."""
    return _DROPOUT_KEYS[-1] if _DROPOUT_KEYS else None


def layer_key(key, index):
    """Decoder layer ``index``'s dropout key (``index`` an int or a traced int32): ``key`` with
    the layer's number folded in, so each layer draws its own masks whether the layers run in a
    loop or a scan; None without ``key``. Layers take it as an argument (``run_layers``)."""
    return None if key is None else jax.random.fold_in(key, index)


@contextlib.contextmanager
def dropout_key(key):
    """Adapter dropout on, with ``key``, for the forward passes traced inside; ``None``: off."""
    _DROPOUT_KEYS.append(key)
    try:
        yield
    finally:
        _DROPOUT_KEYS.pop()


def modules(model: nnx.Module):
    """(path, module) of every module in ``model``, itself last (``nnx.iter_modules``, which not
    every Flax release this project supports has; ``Module.iter_modules`` is deprecated)."""
    return ((path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module))


def lora_linears(model: nnx.Module, targets: tuple[str, ...]):
    """(name, module) of every targeted projection."""
    for path, module in modules(model):
        if path and str(path[-1]) in targets and isinstance(module, nnx.Linear):
            yield ".".join(map(str, path)), module


EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")


def lora_experts(model: nnx.Module, targets: tuple[str, ...]):
    """(path, experts module, projection) of every targeted projection of every mixture of experts."""
    for path, module in modules(model):
        if path and str(path[-1]) == "experts" and hasattr(module, "gate_proj") and not isinstance(module, nnx.List):
            for name in EXPERT_TARGETS:
                if name in targets:
                    yield ".".join(map(str, path)), module, name


def apply(model: nnx.Module, cfg: LoraConfig, *, seed: int = 0) -> int:
    """Add adapters to the targeted projections, in place; returns how many were added."""
    key = jax.random.key(seed + 7919)
    n = 0
    for _, experts, name in lora_experts(model, cfg.target_modules):
        e, n_in, n_out = quant.shape(getattr(experts, name))
        key, sub = jax.random.split(key)
        bound = 1.0 / math.sqrt(n_in)  # as each expert's nn.Linear would be initialised
        setattr(experts, f"{name}_lora_A",
                nnx.LoRAParam(jax.random.uniform(sub, (e, n_in, cfg.rank), jnp.float32, -bound, bound)))
        setattr(experts, f"{name}_lora_B", nnx.LoRAParam(jnp.zeros((e, cfg.rank, n_out), jnp.float32)))
        experts.lora_scale, experts.lora_dropout = cfg.scale, cfg.dropout
        n += 1
    for name, linear in lora_linears(model, cfg.target_modules):
        n_in, n_out = quant.shape(linear.kernel)
        key, sub = jax.random.split(key)
        bound = 1.0 / math.sqrt(n_in)  # Kaiming-uniform with a=sqrt(5), as PEFT's nn.Linear init
        linear.lora_A = nnx.LoRAParam(jax.random.uniform(sub, (n_in, cfg.rank), jnp.float32, -bound, bound))
        linear.lora_B = nnx.LoRAParam(jnp.zeros((cfg.rank, n_out), jnp.float32))
        linear.lora_scale = cfg.scale
        linear.lora_dropout = cfg.dropout
        linear.lora_index = TARGETS.index(name.rsplit(".", 1)[-1])  # each adapter of a layer draws its own mask
        n += 1
    store_base(model, cfg)
    share_frozen(model)
    return n


def held_once(frozen) -> dict[tuple, nnx.Variable]:
    """A model's frozen state (``nnx.State``) by path, as its arrays are held: without the other
    members' copies of member 0's frozen weights (``share_frozen``), which abstract shapes cannot
    show."""
    return {path: var for path, var in nnx.to_flat_state(frozen)
            if not (len(path) > 1 and path[0] == "members" and path[1] != 0)}


def share_frozen(model: nnx.Module) -> None:
    """An ensemble's members' own top layers (``decoder.MemberLayers``) under LoRA: each frozen
    weight held once, member 0's array in every member. The copies are equal (the base's layers)
    and never trained, so N LoRA members keep one frozen base; each member's adapters are its own."""
    members = getattr(model, "members", None)
    if not members:
        return
    first = list(modules(members[0]))
    for member in list(members)[1:]:
        for (_, source), (_, module) in zip(first, modules(member), strict=True):
            for name, var in list(vars(module).items()):
                if type(var) is nnx.Param:
                    var.set_value(getattr(source, name).get_value())


def base_storage(cfg: LoraConfig):
    """How the frozen base holds a weight, as a function of its dotted name and value: a matrix
    outside the score head in ``cfg.base_dtype`` (int8 and nf4: ``quant.quantize`` on the host;
    a traced value, as in a model built abstractly, gets ``quant.placeholder``'s shapes), anything
    else as float32. A weight already so held is returned as it is."""
    kind = cfg.base_dtype

    def store(name: str, value):
        if isinstance(value, quant.Quantized):
            return value
        if name.startswith("score.") or value.ndim < 2 or kind == "float32":
            return jnp.asarray(value, jnp.float32)
        if kind == "bfloat16":
            return jnp.asarray(value, jnp.bfloat16)
        axis = quant.block_axis(name, value.ndim)
        if isinstance(value, jax.core.Tracer):
            return quant.placeholder(kind, tuple(value.shape), axis=axis, block=cfg.base_block_size)
        return quant.quantize(np.asarray(value), kind, axis=axis, block=cfg.base_block_size)

    return store


def store_base(model: nnx.Module, cfg: LoraConfig) -> None:
    """Every parameter of ``model`` as ``base_storage`` holds it, in place."""
    if cfg.base_dtype == "float32":
        return
    store = base_storage(cfg)
    for path, module in modules(model):
        for name, var in list(vars(module).items()):
            if type(var) is nnx.Param:
                value = var.get_value()
                stored = store(".".join(map(str, (*path, name))), value)
                if stored is not value:
                    setattr(module, name, nnx.Param(stored))


def delta(linear: nnx.Linear, x: jax.Array) -> jax.Array:
    """The adapter's contribution to a projection's output, or 0 without adapters."""
    if not hasattr(linear, "lora_A"):
        return 0.0
    a = linear.lora_A[...].astype(x.dtype)
    b = linear.lora_B[...].astype(x.dtype)
    rate = getattr(linear, "lora_dropout", 0.0)
    key = current_key()
    if rate and key is not None:
        return _dropped_delta(x, a, b, jax.random.fold_in(key, linear.lora_index), rate, linear.lora_scale)
    return ((x @ a) @ b) * jnp.asarray(linear.lora_scale, x.dtype)


def keep_mask(key, shape: tuple[int, ...], rate: float) -> tuple[jax.Array, float]:
    """Inverted dropout's keep mask for ``shape`` and the kept inputs' scale. Each element draws
    16 random bits, two from each 32-bit word the generator makes (``jax.random.bernoulli``
    makes a word an element and converts it to a float; two 16-bit draws a word and an integer
    compare avoid both). The rate
    is applied as a multiple of 1/65536 (0.05: 3277/65536, 5e-6 off) and the scale is the
    applied rate's, so the dropped input stays unbiased."""
    cut = min(max(round(rate * 65536), 1), 65535)
    *lead, d = shape
    words = jax.random.bits(key, (*lead, -(-d // 2)), jnp.uint32)
    halves = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(*lead, -1)[..., :d]
    return halves >= cut, 65536 / (65536 - cut)


def _dropped_delta_fn(x, a, b, key, rate: float, scale: float):
    keep, kept_scale = keep_mask(key, x.shape, rate)
    keep = checkpoint_name(keep, "lora_dropout_keep")
    dropped = jnp.where(keep, x * jnp.asarray(kept_scale, x.dtype), 0.0).astype(x.dtype)
    return ((dropped @ a) @ b) * jnp.asarray(scale, x.dtype)


# ``((drop(x) A) B) scale``. The backward pass keeps the mask (one byte an element) and recomputes
# the dropped input from it and ``x`` (which the layer holds anyway): keeping the dropped input
# would add a float activation per adapted projection; recomputing the mask from the key would
# draw its random bits twice.
_dropped_delta = jax.checkpoint(_dropped_delta_fn, static_argnums=(4, 5),
                                policy=jax.checkpoint_policies.save_only_these_names("lora_dropout_keep"))


def trainable_filter(cfg: LoraConfig | None):
    """What the optimizer trains: everything, or with LoRA the adapters and the score head."""
    if cfg is None:
        return nnx.Param
    return nnx.Any(nnx.LoRAParam, nnx.All(nnx.Param, nnx.PathContains("score")))


def expert_delta(experts: nnx.Module, name: str, x: jax.Array, group_sizes: jax.Array, grouped) -> jax.Array:
    """The adapters' contribution to projection ``name`` of token copies ``x`` (M, in) sorted by
    expert (``grouped``: a grouped product with per-expert matrices), or 0 without adapters."""
    if not hasattr(experts, f"{name}_lora_A"):
        return 0.0
    a = getattr(experts, f"{name}_lora_A")[...].astype(x.dtype)
    b = getattr(experts, f"{name}_lora_B")[...].astype(x.dtype)
    key, rate = current_key(), experts.lora_dropout
    if rate and key is not None:
        keep, kept_scale = keep_mask(jax.random.fold_in(key, TARGETS.index(name)), x.shape, rate)
        x = jnp.where(keep, x * jnp.asarray(kept_scale, x.dtype), 0.0).astype(x.dtype)
    return grouped(grouped(x, a).astype(x.dtype), b) * jnp.asarray(experts.lora_scale, jnp.float32)


def _drop_expert_adapter(experts: nnx.Module, name: str) -> None:
    delattr(experts, f"{name}_lora_A")
    delattr(experts, f"{name}_lora_B")


def merge(model: nnx.Module) -> int:
    """Fold every adapter into its kernel (W + A B scale) and drop the adapters, in place."""
    n = 0
    for _, experts, name in lora_experts(model, EXPERT_TARGETS):
        if hasattr(experts, f"{name}_lora_A"):
            a, b = getattr(experts, f"{name}_lora_A")[...], getattr(experts, f"{name}_lora_B")[...]
            w = quant.value(getattr(experts, name)).astype(jnp.float32) + jnp.einsum("eir,ero->eio", a, b) * experts.lora_scale
            setattr(experts, name, nnx.Param(w))
            _drop_expert_adapter(experts, name)
            n += 1
    for _, linear in lora_linears(model, TARGETS):
        if hasattr(linear, "lora_A"):
            w = quant.value(linear.kernel).astype(jnp.float32) + (linear.lora_A[...] @ linear.lora_B[...]) * linear.lora_scale
            linear.kernel = nnx.Param(w)  # float32, whatever the frozen base was kept in
            del linear.lora_A, linear.lora_B, linear.lora_scale, linear.lora_dropout, linear.lora_index
            n += 1
    return n


def strip(model: nnx.Module) -> int:
    """Remove every adapter without merging it (the base model), in place."""
    n = 0
    for _, experts, name in lora_experts(model, EXPERT_TARGETS):
        if hasattr(experts, f"{name}_lora_A"):
            _drop_expert_adapter(experts, name)
            n += 1
    for _, linear in lora_linears(model, TARGETS):
        if hasattr(linear, "lora_A"):
            del linear.lora_A, linear.lora_B, linear.lora_scale, linear.lora_dropout, linear.lora_index
            n += 1
    return n


def adapters(model: nnx.Module) -> dict[str, tuple[jax.Array, jax.Array]]:
    """name -> (A, B) of every adapter."""
    out = {name: (lin.lora_A[...], lin.lora_B[...]) for name, lin in lora_linears(model, TARGETS)
           if hasattr(lin, "lora_A")}
    return out | {f"{path}.{name}": (getattr(ex, f"{name}_lora_A")[...], getattr(ex, f"{name}_lora_B")[...])
                  for path, ex, name in lora_experts(model, EXPERT_TARGETS) if hasattr(ex, f"{name}_lora_A")}
