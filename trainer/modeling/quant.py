"""A frozen base in fewer bits (LoRA's ``base_dtype: int8 | nf4``): each weight matrix held as
codes with a float32 scale per block, and dequantised where it is used.

A block is ``block`` consecutive elements along one axis (the whole axis with ``block`` 0: a
scale per output channel). Kernels, (in, out), and a mixture's experts, (E, in, out), are
blocked along their input axis, as bitsandbytes blocks a PyTorch ``Linear`` weight (out, in)
along its contiguous input axis; embeddings, (vocab, hidden), along the hidden axis, so a token's
row dequantises from its own codes and scales (``embed``). An axis that is not a multiple of the
block is padded with zeros to one, and the padding cut off when dequantised.

- ``int8``: the block's absolute maximum maps to 127, codes rounded to the nearest integer
  (1 byte a weight plus 4 / block).
- ``nf4``: QLoRA's 4-bit NormalFloat (Dettmers et al. 2023: 16 levels at the quantiles of a
  normal distribution, 0 exact, scaled by the block's absolute maximum), each weight its nearest
  level, two codes a byte (0.5 byte a weight plus 4 / block). No double quantisation of the
  scales: at blocks of 64 they add 0.0625 byte a weight.

Quantisation runs in numpy on the host (``quantize``), a tensor at a time as a checkpoint is read
(``trainer.modeling.convert.load_reward_model``'s ``store``), so the full-precision model is
never in memory at once, and the same weights give the same codes on every backend. A projection
dequantises its kernel inside ``jax.checkpoint`` (``project``): the backward pass dequantises it
again instead of keeping the full-precision matrix from the forward pass, which would hold a
full-precision copy of every layer's weights until the gradient is computed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("int8", "nf4")

# QLoRA's NormalFloat4 levels (bitsandbytes' table), ascending; 0 exact.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)
_NF4_EDGES = (NF4[1:] + NF4[:-1]) / 2  # a value at an edge takes the lower level


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "block_scales"],
                   meta_fields=["kind", "shape", "axis", "block"])
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight of ``shape`` as codes (uint8: two nf4 codes a byte; int8) and a float32 scale
    per block of ``block`` along ``axis``; both keep the weight's axis order (the blocked axis
    shortened), so the weight's sharding rule shards them too (``parallel.rules``)."""

    codes: jax.Array
    block_scales: jax.Array
    kind: str
    shape: tuple[int, ...]
    axis: int
    block: int

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)  # what it dequantises to

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def block_axis(name: str, ndim: int) -> int:
    """The axis a weight is blocked along: an embedding's last (hidden), a kernel's input axis."""
    return ndim - 1 if name.endswith("embedding") else ndim - 2


def _block_len(block: int, n: int) -> int:
    """Elements a block: ``block``, or the whole axis (``block`` 0, or an axis shorter than it),
    made even (two nf4 codes a byte)."""
    b = n if block <= 0 else min(block, n)
    return b + b % 2


def storage_shapes(kind: str, shape: tuple[int, ...], axis: int, block: int) -> tuple[tuple, tuple]:
    """The codes' and scales' shapes of a weight of ``shape``."""
    n = shape[axis]
    b = _block_len(block, n)
    blocks = -(-n // b)
    codes = list(shape)
    codes[axis] = blocks * b // (2 if kind == "nf4" else 1)
    scales = list(shape)
    scales[axis] = blocks
    return tuple(codes), tuple(scales)


CHUNK = 1 << 22  # weights quantised at a time: a tensor's temporaries stay a few times this, not its size


def quantize(w: np.ndarray, kind: str, *, axis: int, block: int) -> Quantized:
    """``w`` (numpy, any float dtype) as ``kind`` codes and block scales, computed on the host a
    chunk of ``CHUNK`` weights at a time (along the first axis not blocked)."""
    if kind not in KINDS:
        raise ValueError(f"quantisation {kind!r}: one of {', '.join(KINDS)}")
    shape = tuple(w.shape)
    x = np.moveaxis(w, axis, -1)  # a view
    n = x.shape[-1]
    b = _block_len(block, n)
    blocks = -(-n // b)
    codes = np.empty((*x.shape[:-1], blocks * b // (2 if kind == "nf4" else 1)), np.uint8 if kind == "nf4" else np.int8)
    scales = np.empty((*x.shape[:-1], blocks), np.float32)
    rows = max(1, CHUNK // max(math.prod(x.shape[1:]), 1)) if x.ndim > 1 else 1
    for start in range(0, x.shape[0] if x.ndim > 1 else 1, rows):
        part = slice(start, start + rows) if x.ndim > 1 else slice(None)
        codes[part], scales[part] = _quantize_chunk(np.asarray(x[part], np.float32), kind, b, blocks)
    return Quantized(jnp.asarray(np.moveaxis(codes, -1, axis)), jnp.asarray(np.moveaxis(scales, -1, axis)),
                     kind, shape, axis, block)


def _quantize_chunk(x: np.ndarray, kind: str, b: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of ``x`` (float32, blocked along its last axis)."""
    n = x.shape[-1]
    if blocks * b != n:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], blocks * b - n), np.float32)], axis=-1)
    x = x.reshape(*x.shape[:-1], blocks, b)
    absmax = np.abs(x).max(axis=-1)
    x = x / np.where(absmax > 0, absmax, np.float32(1.0))[..., None]
    if kind == "int8":
        return np.rint(x * np.float32(127)).astype(np.int8).reshape(*x.shape[:-2], blocks * b), absmax / np.float32(127)
    levels = np.zeros(x.shape, np.uint8)
    for edge in _NF4_EDGES:  # the level: how many edges lie below the value (one at an edge: the lower)
        levels += x > edge
    pairs = levels.reshape(*x.shape[:-2], blocks * b // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), absmax


def placeholder(kind: str, shape: tuple[int, ...], *, axis: int, block: int) -> Quantized:
    """A ``Quantized`` of zeros with the shapes and dtypes ``quantize`` gives: for models built
    abstractly (``nnx.eval_shape``: a memory plan), where only the shapes count."""
    codes, scales = storage_shapes(kind, shape, axis, block)
    return Quantized(jnp.zeros(codes, jnp.uint8 if kind == "nf4" else jnp.int8), jnp.zeros(scales, jnp.float32),
                     kind, tuple(shape), axis, block)


def dequantize(q: Quantized) -> jax.Array:
    """The float32 weight ``q`` holds."""
    codes = jnp.moveaxis(q.codes, q.axis, -1)
    if q.kind == "nf4":
        levels = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
        values = jnp.asarray(NF4)[levels]
    else:
        values = codes.astype(jnp.float32)
    scales = jnp.moveaxis(q.block_scales, q.axis, -1)
    blocks = scales.shape[-1]
    w = (values.reshape(*values.shape[:-1], blocks, -1) * scales[..., None]).reshape(*values.shape[:-1], -1)
    return jnp.moveaxis(w[..., : q.shape[q.axis]], -1, q.axis)


def value(var) -> jax.Array:
    """A weight variable's array: its own, or the one its codes hold."""
    v = var.get_value()
    return dequantize(v) if isinstance(v, Quantized) else v


def is_quantized(var) -> bool:
    return isinstance(var.get_value(), Quantized)


def shape(var) -> tuple[int, ...]:
    """A weight variable's shape, quantised or not."""
    return tuple(var.get_value().shape)


def nbytes(tree) -> int:
    """Bytes of every array in ``tree`` (codes and scales for a quantised weight)."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


_nothing_saved = jax.checkpoint_policies.nothing_saveable


def with_weight(fn, x: jax.Array, var, *args):
    """``fn(x, weight, *args)`` with ``var``'s weight; a quantised weight is dequantised inside
    ``jax.checkpoint``, so the backward pass dequantises it again rather than keeping it."""
    v = var.get_value()
    if not isinstance(v, Quantized):
        return fn(x, v, *args)
    return jax.checkpoint(lambda x, q, *a: fn(x, dequantize(q), *a), policy=_nothing_saved)(x, v, *args)


def _linear(x, kernel, bias, dtype, precision):
    """``nnx.Linear``'s computation: ``x`` and the weights promoted to ``dtype``, x @ kernel + bias."""
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    return y if bias is None else y + bias.astype(dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def project(linear, x: jax.Array) -> jax.Array:
    """An ``nnx.Linear``'s output, its kernel quantised or not."""
    if not is_quantized(linear.kernel):
        return linear(x)
    bias = linear.bias[...] if linear.bias is not None else None
    dtype = linear.dtype or jnp.result_type(x, jnp.float32)
    return with_weight(lambda x, w: _linear(x, w, bias, dtype, linear.precision), x, linear.kernel)


def embed(embedding, ids: jax.Array) -> jax.Array:
    """An ``nnx.Embed``'s rows for ``ids``; a quantised table dequantises only those rows."""
    v = embedding.embedding.get_value()
    if not isinstance(v, Quantized):
        return embedding(ids)
    take = lambda a: jnp.take(a, ids, axis=0)  # noqa: E731 - as nnx.Embed takes (an id past the table: NaN)
    rows = Quantized(take(v.codes), take(v.block_scales), v.kind, (*ids.shape, v.shape[-1]), ids.ndim, v.block)
    return dequantize(rows).astype(embedding.dtype or jnp.float32)
