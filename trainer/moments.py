"""AdamW's moments stored in less memory: float32 (optax's own AdamW), bfloat16, or int8 in blocks.

Each step decodes a parameter's two moments to float32, updates them and computes the update in
float32 as AdamW does, then stores them back in the chosen format (``optimizer.moments``):

- ``bfloat16``: 2 bytes a moment. Stored by stochastic rounding: a moment moves by ``1 - b2``
  (0.1%) of itself a step, less than bfloat16's spacing (0.4-0.8%), so rounding to the nearest
  value would freeze the second moment; rounding up with the probability of the distance keeps
  each stored value equal to the float32 one in expectation.
- ``int8``: 1 byte a moment plus a float32 scale a block of ``BLOCK`` values along the last axis
  (the block's largest magnitude; a shorter axis is one block), as 8-bit optimizers store them. The codes are square-root
  companded (a code ``k`` means ``(k / levels)**2`` of the scale): most of a block's values are
  far below its largest, and companding gives them the finer levels. The first moment is signed
  (codes -127..127). The second is stored as its square root, the quantity the update divides
  by, with zero left out of its levels (code ``k`` means ``((k + 1) / 256)**2``): a moment
  decoded as zero would turn the next update into ``m / eps``. Rounding is stochastic here too,
  unbiased in the moment itself (the average an exponential moving average keeps).

The rounding noise is a hash of the element's index, the step and the moment's place in the
tree: no random state to store, and a resumed run draws what the uninterrupted run drew. Arrays
of fewer than ``SMALL`` elements keep float32 moments, as bitsandbytes' 8-bit optimizers do (their
share of memory is nil and they move the most per step), and so do, in int8, vectors and arrays
whose last axis is shorter than a block (``stored_dtype``).
A compact moment keeps its parameter's shape (int8 codes) or its leading dimensions (block
scales), so the parameter's sharding rule shards it too (``trainer.parallel.rules``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from optax._src import numerics
from rmflow.schemas.train_config import MOMENTS

BLOCK = 256  # values sharing one int8 scale, along the last axis (a shorter axis: the whole axis)
MIN_BLOCK = 16  # a last axis shorter than this keeps float32 moments under int8
SMALL = 4096  # arrays with fewer elements keep float32 moments
_SIGNED = 127  # first-moment code magnitudes 0..127
_UNSIGNED = 256  # second-moment codes 0..255 mean levels 1/256 .. 256/256 (zero left out)


class Int8Moment(NamedTuple):
    """A moment in int8 blocks: ``codes`` (the parameter's shape; int8 for the first moment,
    uint8 for the second) and ``block_scales`` (float32, the leading dimensions and one per
    block of the last)."""

    codes: jax.Array
    block_scales: jax.Array


def is_compact(x: Any) -> bool:
    return isinstance(x, Int8Moment)


def stored_dtype(moments: str, shape: tuple[int, ...]) -> str:
    """How a moment of an array of ``shape`` is stored under ``moments``: float32 for arrays of
    fewer than ``SMALL`` elements, and in int8 for vectors and arrays whose last axis is shorter
    than ``MIN_BLOCK`` (a norm's weight, the score head, a LoRA adapter's rank axis: a float32
    scale for so few values would cost more than it saves)."""
    if moments not in MOMENTS:
        raise ValueError(f"moments {moments!r}: use one of {', '.join(MOMENTS)}")
    if math.prod(shape) < SMALL or (moments == "int8" and (len(shape) < 2 or shape[-1] < MIN_BLOCK)):
        return "float32"
    return moments


def _block(last: int) -> int:
    """Values a scale covers along a last axis of ``last``: ``BLOCK``, or the whole axis when it
    is shorter (no padding)."""
    return min(BLOCK, last)


def _blocks(x: jax.Array) -> jax.Array:
    """``x`` (2-D or more) with its last axis padded with zeros to whole blocks, as
    ``[..., blocks, block]``."""
    last = x.shape[-1]
    block = _block(last)
    pad = -last % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + ((last + pad) // block, block))


def _unblock(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    flat = x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))[..., :shape[-1]]
    return flat.reshape(shape)


def _uniform(shape: tuple[int, ...], step: jax.Array, salt: int) -> jax.Array:
    """Uniform noise in [0, 1) for each element of an array of ``shape``: a hash (lowbias32) of
    the element's index, the step and ``salt``, so the same step of any run draws the same."""
    size = 1
    for d in shape:
        size *= d
    h = lax.iota(jnp.uint32, size).reshape(shape) * jnp.uint32(0x9E3779B1)
    h = h ^ (step.astype(jnp.uint32) * jnp.uint32(0x85EBCA77) + jnp.uint32((salt * 0xC2B2AE3D) & 0xFFFFFFFF))
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def _round_bf16(x: jax.Array, u: jax.Array) -> jax.Array:
    """``x`` (float32) in bfloat16, rounded up in magnitude with probability of the distance."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + (u * 65536.0).astype(jnp.uint32)) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)


def _stochastic_level(r: jax.Array, u: jax.Array, levels: int, first: int, power: int = 1) -> jax.Array:
    """The code of ``r`` in [0, 1] among the companded levels ``((k + first) / levels)**2``,
    ``k = 0 .. levels - first``: one of the two levels around it, the upper with the probability
    that keeps ``r ** power`` unbiased (``power`` 2: the second moment, stored as its root, is
    what the average keeps); below the lowest level, the lowest."""
    top = levels - first
    k = jnp.clip(jnp.floor(jnp.sqrt(r) * levels) - first, 0, top)
    lo = jnp.square((k + first) / levels) ** power
    hi = jnp.square((jnp.minimum(k + 1, top) + first) / levels) ** power
    p = jnp.where(hi > lo, (r ** power - lo) / jnp.where(hi > lo, hi - lo, 1.0), 0.0)
    return jnp.minimum(k + (u < p), top)


def encode_first(x: jax.Array, u: jax.Array) -> Int8Moment:
    """A first moment (signed) in int8 blocks; ``u``: uniform noise of ``x``'s shape."""
    xb, ub = _blocks(x), _blocks(u)
    scale = jnp.max(jnp.abs(xb), axis=-1)
    r = jnp.abs(xb) / jnp.where(scale > 0, scale, 1.0)[..., None]
    k = _stochastic_level(r, ub, _SIGNED, 0)
    codes = (jnp.sign(xb) * k).astype(jnp.int8)
    return Int8Moment(_unblock(codes, x.shape), scale)


def decode_first(m: Int8Moment) -> jax.Array:
    k = _blocks(m.codes.astype(jnp.float32))
    return _unblock(jnp.sign(k) * jnp.square(k / _SIGNED) * m.block_scales[..., None], m.codes.shape)


def encode_second(v: jax.Array, u: jax.Array) -> Int8Moment:
    """A second moment (>= 0) in uint8 blocks of its square root, zero left out of the levels."""
    wb, ub = _blocks(jnp.sqrt(v)), _blocks(u)
    scale = jnp.max(wb, axis=-1)
    r = wb / jnp.where(scale > 0, scale, 1.0)[..., None]
    k = _stochastic_level(r, ub, _UNSIGNED, 1, power=2)
    return Int8Moment(_unblock(k.astype(jnp.uint8), v.shape), scale)


def decode_second(m: Int8Moment) -> jax.Array:
    k = _blocks(m.codes.astype(jnp.float32))
    w = jnp.square((k + 1) / _UNSIGNED) * m.block_scales[..., None]
    return _unblock(jnp.square(w), m.codes.shape)


def _zeros(p: jax.Array, moments: str, second: bool) -> Any:
    kind = stored_dtype(moments, p.shape)
    if kind == "float32":
        return jnp.zeros(p.shape, jnp.float32)
    if kind == "bfloat16":
        return jnp.zeros(p.shape, jnp.bfloat16)
    codes = jnp.zeros(p.shape, jnp.uint8 if second else jnp.int8)
    last = p.shape[-1]
    return Int8Moment(codes, jnp.zeros(p.shape[:-1] + (-(-last // _block(last)),), jnp.float32))


def _decode(m: Any, second: bool) -> jax.Array:
    if is_compact(m):
        return decode_second(m) if second else decode_first(m)
    return m.astype(jnp.float32)


def _encode(x: jax.Array, like: Any, u_of, second: bool) -> Any:
    if is_compact(like):
        return encode_second(x, u_of()) if second else encode_first(x, u_of())
    if like.dtype == jnp.bfloat16:
        return _round_bf16(x, u_of())
    return x


def scale_by_stored_adam(b1: float, b2: float, eps: Any, moments: str) -> optax.GradientTransformation:
    """optax.scale_by_adam with its moments stored as ``moments`` says (module docstring); the
    same state type (``optax.ScaleByAdamState``), its ``mu`` and ``nu`` trees holding arrays of
    the stored dtype or ``Int8Moment`` nodes."""
    stored_dtype(moments, (SMALL,))  # the name checked once, here

    def init_fn(params):
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                      mu=jax.tree.map(lambda p: _zeros(p, moments, False), params),
                                      nu=jax.tree.map(lambda p: _zeros(p, moments, True), params))

    def update_fn(updates, state, params=None):
        del params
        count = numerics.safe_increment(state.count)
        grads, treedef = jax.tree.flatten(updates)
        mus = treedef.flatten_up_to(state.mu)
        nus = treedef.flatten_up_to(state.nu)
        out, new_mu, new_nu = [], [], []
        for i, (g, m, v) in enumerate(zip(grads, mus, nus)):
            m32 = (1 - b1) * g + b1 * _decode(m, False)
            v32 = (1 - b2) * jnp.square(g) + b2 * _decode(v, True)
            m_hat = m32 / (1 - b1 ** count).astype(jnp.float32)
            v_hat = v32 / (1 - b2 ** count).astype(jnp.float32)
            out.append(m_hat / (jnp.sqrt(v_hat) + eps))
            new_mu.append(_encode(m32, m, lambda g=g, i=i: _uniform(g.shape, count, 2 * i), False))
            new_nu.append(_encode(v32, v, lambda g=g, i=i: _uniform(g.shape, count, 2 * i + 1), True))
        return (treedef.unflatten(out),
                optax.ScaleByAdamState(count=count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu)))

    return optax.GradientTransformation(init_fn, update_fn)


def state_bytes(opt_state: Any) -> int:
    """Bytes the optimizer state holds (its arrays' sizes; shapes suffice: ShapeDtypeStructs too)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt_state) if hasattr(x, "dtype"))
