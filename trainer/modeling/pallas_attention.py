"""Fused attention for packed rows, as Pallas kernels: forward and backward, one program per
(row, query head, block), with the mask computed per block from the segment ids, positions and
branch ids (``masking.allowed``, the rules every implementation shares).

On NVIDIA GPUs Pallas lowers the kernels through Triton; elsewhere (CPU) they run in Pallas's
interpret mode, which executes the same kernel code with plain JAX operations: slow, for
testing the kernel's logic only.

Blocks a program never visits, because the mask empties them:

* the forward pass and dq: query block ``i`` visits key blocks from the one where its earliest
  segment starts up to itself (a later key is never attended, an earlier segment never seen);
* dk and dv: key block ``j`` visits query blocks from itself up to the one where its latest
  segment ends.

So the work follows the tokens each query may see, as in the pure-JAX ``blockwise`` kernel,
with no (T, T) scores or mask in memory. Grouped-query attention: each query head reads its
key/value head; dk and dv are computed per query head and summed over each group. Padding
queries (segment 0) attend to nothing: their outputs are zeros and they are never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from rmflow.trainer.modeling.masking import allowed, cap_gradient, capped_scores

# The block size and Triton's launch settings (warps per program, software-pipelining depth) for
# every kernel: the fastest combination ``benchmarks/gpu.py``'s kernel part measured on Hopper
# (docs/benchmarks.md).
BLOCK = 64
NUM_WARPS = 4
NUM_STAGES = 3
_NEG = -1e30


def pallas_attention(q, k, v, segment_ids, positions, branch_ids, *, window: int | None = None,
                     block: int = BLOCK, interpret: bool | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, scale: float | None = None,
                     softcap: float | None = None) -> jax.Array:
    """q (B, T, N, D), k/v (B, T, K, D) -> (B, T, N, D); ``interpret``: None = on CPU only;
    ``num_warps`` and ``num_stages``: Triton's settings (None: ``NUM_WARPS``, ``NUM_STAGES``);
    ``scale`` (default D^-0.5) and ``softcap`` (``capped_scores``) as ``attention`` takes them."""
    b, t, n, d = q.shape
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    block = min(block, max(16, 1 << (t - 1).bit_length()))  # no block longer than the padded row
    pad = -t % block
    if pad:  # whole blocks; segment 0 (padding) attends to nothing and is attended by nothing
        widen = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        q, k, v, segment_ids, positions, branch_ids = map(widen, (q, k, v, segment_ids, positions, branch_ids))
    meta = tuple(a.astype(jnp.int32) for a in (segment_ids, positions, branch_ids))
    launch = (num_warps or NUM_WARPS, num_stages or NUM_STAGES)
    out = _attention(q, k, v, *meta, window, block, interpret, launch, (scale or d**-0.5, softcap))
    return out[:, :t]


def segment_bounds(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(B, T) each: the index of the first and of the last token of each token's segment
    (segments are contiguous runs); for padding (segment 0), the token itself."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    differs = segment_ids[:, 1:] != segment_ids[:, :-1]
    edge = jnp.ones_like(segment_ids[:, :1], bool)
    first = jax.lax.cummax(jnp.where(jnp.concatenate([edge, differs], 1), idx, 0), axis=1)
    last = jax.lax.cummin(jnp.where(jnp.concatenate([differs, edge], 1), idx, t), axis=1, reverse=True)
    real = segment_ids > 0
    return jnp.where(real, first, idx), jnp.where(real, last, idx)


# --------------------------------------------------------------------------- kernels


def _mask(seg_q, pos_q, br_q, idx_q, seg_k, pos_k, br_k, idx_k, window):
    return allowed(seg_q, pos_q, br_q, idx_q, seg_k, pos_k, br_k, idx_k, window) & (seg_q > 0)[:, None]


def _iota(start, block):
    return start + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)


def _forward_kernel(q_ref, k_ref, v_ref, sq_ref, pq_ref, bq_ref, first_ref, sk_ref, pk_ref, bk_ref, o_ref, lse_ref,
                    *, block, scale, window, softcap):
    i = pl.program_id(2)
    q = q_ref[...]
    meta_q = (sq_ref[...], pq_ref[...], bq_ref[...], _iota(i * block, block))
    d = q.shape[-1]

    def visit(j, carry):
        m, denom, acc = carry
        keys = pl.ds(pl.multiple_of(j * block, block), block)
        ok = _mask(*meta_q, sk_ref[keys], pk_ref[keys], bk_ref[keys], _iota(j * block, block), window)
        s = jnp.where(ok, capped_scores(jnp.dot(q, k_ref[keys, :].T, preferred_element_type=jnp.float32) * scale,
                                        softcap), _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[keys, :], preferred_element_type=jnp.float32)
        return m_new, corr * denom + p.sum(axis=1), corr[:, None] * acc + pv

    init = (jnp.full((block,), _NEG, jnp.float32), jnp.zeros((block,), jnp.float32),
            jnp.zeros((block, d), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(jnp.min(first_ref[...]) // block, i + 1, visit, init)
    seen = denom > 0
    o_ref[...] = (acc / jnp.where(seen, denom, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)


def _dkdv_kernel(q_ref, do_ref, lse_ref, delta_ref, sq_ref, pq_ref, bq_ref, k_ref, v_ref, sk_ref, pk_ref, bk_ref,
                 last_ref, dk_ref, dv_ref, *, block, scale, window, softcap):
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    meta_k = (sk_ref[...], pk_ref[...], bk_ref[...], _iota(j * block, block))

    def visit(i, carry):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * block, block), block)
        q, do = q_ref[rows, :], do_ref[rows, :]
        ok = _mask(sq_ref[rows], pq_ref[rows], bq_ref[rows], _iota(i * block, block), *meta_k, window)
        s = capped_scores(jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale, softcap)
        p = jnp.where(ok, jnp.exp(s - lse_ref[rows][:, None]), 0.0)
        dv = dv + jnp.dot(p.astype(do.dtype).T, do, preferred_element_type=jnp.float32)
        dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[rows][:, None]) * cap_gradient(s, softcap, ok) * scale
        return dk + jnp.dot(ds.astype(q.dtype).T, q, preferred_element_type=jnp.float32), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(j, jnp.max(last_ref[...]) // block + 1, visit, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, do_ref, lse_ref, delta_ref, sq_ref, pq_ref, bq_ref, first_ref, k_ref, v_ref, sk_ref, pk_ref,
               bk_ref, dq_ref, *, block, scale, window, softcap):
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    meta_q = (sq_ref[...], pq_ref[...], bq_ref[...], _iota(i * block, block))

    def visit(j, dq):
        keys = pl.ds(pl.multiple_of(j * block, block), block)
        k = k_ref[keys, :]
        ok = _mask(*meta_q, sk_ref[keys], pk_ref[keys], bk_ref[keys], _iota(j * block, block), window)
        s = capped_scores(jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale, softcap)
        p = jnp.where(ok, jnp.exp(s - lse), 0.0)
        dp = jnp.dot(do, v_ref[keys, :].T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta) * cap_gradient(s, softcap, ok) * scale
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = jax.lax.fori_loop(jnp.min(first_ref[...]) // block, i + 1, visit, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


# --------------------------------------------------------------------------- pallas_call wrappers


def _specs(t, d, block, groups):
    """BlockSpecs over the grid (row b, query head h, block i): one block of a (B, T, H, D)
    array, the whole row of one head (read by dynamic slices in the loops), and the same for
    (B, T) metadata and (B, N, T) per-query statistics."""
    return {
        "block": pl.BlockSpec((None, block, None, d), lambda b, h, i: (b, i, h, 0)),
        "row": pl.BlockSpec((None, t, None, d), lambda b, h, i: (b, 0, h, 0)),
        "kv_block": pl.BlockSpec((None, block, None, d), lambda b, h, i: (b, i, h // groups, 0)),
        "kv_row": pl.BlockSpec((None, t, None, d), lambda b, h, i: (b, 0, h // groups, 0)),
        "meta_block": pl.BlockSpec((None, block), lambda b, h, i: (b, i)),
        "meta_row": pl.BlockSpec((None, t), lambda b, h, i: (b, 0)),
        "stat_block": pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i)),
        "stat_row": pl.BlockSpec((None, None, t), lambda b, h, i: (b, h, 0)),
    }


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, launch):
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        extra["compiler_params"] = plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, **extra)


def _forward(q, k, v, seg, pos, br, window, block, interpret, launch, logits):
    b, t, n, d = q.shape
    sp = _specs(t, d, block, n // k.shape[2])
    first, _ = segment_bounds(seg)
    kernel = functools.partial(_forward_kernel, block=block, scale=logits[0], window=window, softcap=logits[1])
    out, lse = _call(
        kernel, (b, n, t // block),
        [sp["block"], sp["kv_row"], sp["kv_row"], sp["meta_block"], sp["meta_block"], sp["meta_block"],
         sp["meta_block"], sp["meta_row"], sp["meta_row"], sp["meta_row"]],
        [sp["block"], sp["stat_block"]],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)], interpret, launch,
    )(q, k, v, seg, pos, br, first, seg, pos, br)
    return out, lse


# ``logits``: (scale, softcap), static: how a query-key product becomes a score
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _attention(q, k, v, seg, pos, br, window, block, interpret, launch, logits):
    return _forward(q, k, v, seg, pos, br, window, block, interpret, launch, logits)[0]


def _attention_fwd(q, k, v, seg, pos, br, window, block, interpret, launch, logits):
    out, lse = _forward(q, k, v, seg, pos, br, window, block, interpret, launch, logits)
    return out, (q, k, v, seg, pos, br, out, lse)


def _attention_bwd(window, block, interpret, launch, logits, res, dout):
    q, k, v, seg, pos, br, out, lse = res
    b, t, n, d = q.shape
    kh = k.shape[2]
    groups = n // kh
    sp = _specs(t, d, block, groups)
    first, last = segment_bounds(seg)
    delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    dout = dout.astype(q.dtype)
    kw = dict(block=block, scale=logits[0], window=window, softcap=logits[1])
    # dk, dv per query head (grid over key blocks), then summed over each KV head's group
    dk, dv = _call(
        functools.partial(_dkdv_kernel, **kw), (b, n, t // block),
        [sp["row"], sp["row"], sp["stat_row"], sp["stat_row"], sp["meta_row"], sp["meta_row"], sp["meta_row"],
         sp["kv_block"], sp["kv_block"], sp["meta_block"], sp["meta_block"], sp["meta_block"], sp["meta_block"]],
        [sp["block"], sp["block"]],
        [jax.ShapeDtypeStruct((b, t, n, d), jnp.float32)] * 2, interpret, launch,
    )(q, dout, lse, delta, seg, pos, br, k, v, seg, pos, br, last)
    dq = _call(
        functools.partial(_dq_kernel, **kw), (b, n, t // block),
        [sp["block"], sp["block"], sp["stat_block"], sp["stat_block"], sp["meta_block"], sp["meta_block"],
         sp["meta_block"], sp["meta_block"], sp["kv_row"], sp["kv_row"], sp["meta_row"], sp["meta_row"],
         sp["meta_row"]],
        sp["block"], jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, launch,
    )(q, dout, lse, delta, seg, pos, br, first, k, v, seg, pos, br)
    dk = dk.reshape(b, t, kh, groups, d).sum(3).astype(k.dtype)
    dv = dv.reshape(b, t, kh, groups, d).sum(3).astype(v.dtype)
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
