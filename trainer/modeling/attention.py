"""Attention over packed rows: who may attend to whom (the rules: ``trainer.modeling.masking``),
and the ways to compute it.

Each token carries a segment id (0 = padding), a position and a branch id. A query attends
to a key when both are in the same segment, the key comes no later (by index and by
position), the key is within the sliding window (by position), and the key's branch is 0 (the
shared prefix) or the query's own branch. Branches let one packed unit hold a prompt once and
both replies after it: the rejected reply (branch 2) sees the prompt (branch 0) but not the
chosen reply (branch 1), with positions continuing from the prompt, which gives exactly the
hidden states of two separate sequences. With every branch id 0 this is plain causal
attention within segments.

Implementations (``ATTENTION``):

* ``xla``: the reference. ``jax.nn.dot_product_attention`` with a dense (B, 1, T, T) mask;
  materialises (B, H, T, T) scores. Used for parity tests.
* ``blockwise``: flash attention in pure JAX with a custom VJP. Queries go in blocks; each
  block visits only key blocks from the start of its earliest segment up to itself (dynamic
  loop bounds), skips those holding only other branches' tokens (the other responses of a
  packed prompt: ``_visited_blocks``), keeps a running softmax, and the backward pass recomputes scores block by
  block from the saved log-sum-exp. Memory is O(T) besides one block of scores, and the work
  is proportional to the tokens each query may see, not to T squared. The default on CPU.
* ``pallas``: fused flash attention as Pallas kernels (``trainer.modeling.pallas_attention``):
  Triton on NVIDIA GPUs, forward and backward, the mask computed per block from the ids, the
  blocks it empties skipped; on CPU it runs in Pallas's interpret mode (for tests only).
* ``cudnn``: cuDNN's fused flash attention (``jax.nn.dot_product_attention(implementation=
  "cudnn")``) with the mask, on NVIDIA GPUs in bfloat16/float16. The default on GPU for rows
  of one sequence when the compute dtype allows it (``resolve_attention``); packed rows get
  ``pallas``.

Segments must be contiguous runs of tokens (every rmflow loader builds them so).

Under a mesh with a ``context`` axis (``mesh.context``: long rows split over devices along their
tokens), every implementation but ``xla`` runs as ``context_attention``: blockwise, each device's
queries against the keys and values gathered from the whole row. ``xla``, the reference, is left
to the compiler's partitioner.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from rmflow.schemas.options import ConfigError
from rmflow.schemas.train_config import ATTENTION  # one list: the config validates against it
from rmflow.trainer.modeling.masking import (  # noqa: F401 - the rules, imported from here too
    allowed,
    cap_gradient,
    capped_scores,
    dense_mask,
)

BLOCK = 128
_NEG = -1e30


def resolve_attention(name: str, dtype, backend: str | None = None, packed: bool = False, devices: int = 1,
                      softcap: bool = False) -> str:
    """``auto`` -> the implementation for this backend, compute dtype, row layout (``packed``:
    rows of several units, as ``packing: pack`` builds them) and number of devices the rows are
    split over. On one GPU, packed rows take the Pallas kernels (they skip the blocks the mask
    empties, where cuDNN would take a dense mask over the whole row); over several GPUs they are
    not chosen: they have no partitioning rule, so XLA would give every device all the rows. One
    sequence a row takes cuDNN on GPUs in 16-bit types, unless the model soft-caps its logits
    (``softcap``: Gemma 2), which cuDNN cannot: then Pallas on one GPU. Blockwise elsewhere."""
    if name not in ATTENTION:
        raise ValueError(f"attention {name!r}: use one of {ATTENTION}")
    if name == "cudnn" and softcap:
        raise ConfigError("attention cudnn cannot soft-cap the logits, which this model does (attn_logit_softcapping): "
                          "use auto, pallas, blockwise or xla")
    if name != "auto":
        return name
    backend = backend or jax.default_backend()
    sixteen = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if backend == "gpu" and devices == 1 and packed:
        return "pallas"
    if backend == "gpu" and sixteen and not softcap:
        return "cudnn"
    if backend == "gpu" and devices == 1 and softcap:
        return "pallas"
    return "blockwise"


def takes_dense_mask(implementation: str) -> bool:
    """Whether an implementation takes the dense (B, 1, T, T) mask (built once for all layers);
    under a ``context`` axis only ``xla`` does (the others run as ``context_attention``)."""
    return implementation == "xla" or (implementation == "cudnn" and context_size() == 1)


def attention(q, k, v, segment_ids, positions, branch_ids, *, implementation: str, window: int | None = None,
              mask: jax.Array | None = None, block: int | None = None, scale: float | None = None,
              softcap: float | None = None) -> jax.Array:
    """q (B, T, N, D), k/v (B, T, K, D) with N a multiple of K -> (B, T, N, D). ``scale``: the
    query-key products' (default D^-0.5); ``softcap``: the logits soft-capped (``capped_scores``,
    Gemma 2), which cuDNN's kernel cannot do (``resolve_attention`` never picks it then)."""
    scale = scale or q.shape[-1] ** -0.5
    if implementation != "xla" and context_size() > 1:  # a row split over devices: blockwise over them
        return context_attention(q, k, v, segment_ids, positions, branch_ids, window=window, block=block or BLOCK,
                                 scale=scale, softcap=softcap)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, segment_ids, positions, branch_ids, window=window, block=block or BLOCK,
                                   scale=scale, softcap=softcap)
    if implementation == "pallas":
        from rmflow.trainer.modeling.pallas_attention import BLOCK as PALLAS_BLOCK
        from rmflow.trainer.modeling.pallas_attention import pallas_attention

        return pallas_attention(q, k, v, segment_ids, positions, branch_ids, window=window,
                                block=block or PALLAS_BLOCK, scale=scale, softcap=softcap)
    if mask is None:
        mask = dense_mask(segment_ids, positions, branch_ids, window)
    if implementation == "cudnn":
        if softcap:
            raise ConfigError("attention cudnn cannot soft-cap the logits (attn_logit_softcapping): use pallas, "
                              "blockwise or xla")
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")
    if implementation == "xla":
        if softcap:  # the reference, written out: jax.nn's takes no cap
            return _dense_capped(q, k, v, mask, scale, softcap)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
    raise ValueError(f"attention implementation {implementation!r}: use one of {ATTENTION[1:]}")


def _dense_capped(q, k, v, mask, scale: float, softcap: float) -> jax.Array:
    """The dense reference with soft-capped logits: (B, 1, T, T) ``mask``, float32 scores."""
    b, t, n, d = q.shape
    kh = k.shape[2]
    scores = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kh, n // kh, d), k,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, :, None], capped_scores(scores, softcap), _NEG)
    p = jax.nn.softmax(scores, axis=-1)
    p = jnp.where(mask[:, :, None].any(-1, keepdims=True), p, 0.0)  # a query that sees nothing: zeros
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, d).astype(q.dtype)


def attention_at(q, k, v, query_index, segment_ids, positions, branch_ids, *, window: int | None = None,
                 scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Queries at a few tokens of each row only, against every key: q (B, S, N, D) for the tokens
    ``query_index`` (B, S), k/v (B, T, K, D) -> (B, S, N, D), by the same rules as ``attention``.
    Dense over the keys: S is small (the reward tokens), so the scores are (B, N, S, T)."""
    b, s, n, d = q.shape
    t, kh = k.shape[1], k.shape[2]
    at = lambda a: jnp.take_along_axis(a, query_index, axis=1)  # noqa: E731
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    ok = allowed(at(segment_ids), at(positions), at(branch_ids), query_index, segment_ids, positions, branch_ids,
                 idx, window)[:, None, None]  # (B, 1, 1, S, T)
    scores = jnp.einsum("bskgd,btkd->bkgst", q.reshape(b, s, kh, n // kh, d), k,
                        preferred_element_type=jnp.float32) * (scale or d**-0.5)
    p = jax.nn.softmax(jnp.where(ok, capped_scores(scores, softcap), _NEG), axis=-1)
    out = jnp.einsum("bkgst,btkd->bskgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, n, d).astype(q.dtype)


# --------------------------------------------------------------------------- blockwise


def blockwise_attention(q, k, v, segment_ids, positions, branch_ids, *, window: int | None = None,
                        block: int = BLOCK, scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Flash attention in pure JAX (see the module doc). Padding queries get zeros."""
    b, t, n, d = q.shape
    block = min(block, t)
    pad = -t % block
    if pad:  # padded to whole blocks with segment 0, which nothing attends to
        q, k, v, segment_ids, positions, branch_ids = _pad_tokens(pad, q, k, v, segment_ids, positions, branch_ids)
    out = _flash(q, k, v, segment_ids.astype(jnp.int32), positions.astype(jnp.int32),
                 branch_ids.astype(jnp.int32), jnp.int32(0), window, block, (scale, softcap))
    return out[:, :t]


def _pad_tokens(pad: int, *arrays):
    """Each (B, T, ...) array with ``pad`` more tokens of zeros (segment 0: padding)."""
    return tuple(jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in arrays)


# --------------------------------------------------------------------------- context parallelism

CONTEXT = "context"  # the mesh axis that splits a row's tokens (``trainer.parallel.mesh``)


def context_size() -> int:
    """Devices of the ``context`` axis of the mesh being traced under (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get(CONTEXT, 1)


def split_tokens(x: jax.Array) -> jax.Array:
    """``x`` (B, T, ...) held split along its tokens over the ``context`` axis, when the mesh has
    one (the hidden states between layers: each device keeps its share of the row)."""
    if context_size() == 1:
        return x
    P = jax.sharding.PartitionSpec
    return jax.lax.with_sharding_constraint(x, P(P.UNCONSTRAINED, CONTEXT, *(P.UNCONSTRAINED,) * (x.ndim - 2)))


def context_attention(q, k, v, segment_ids, positions, branch_ids, *, window: int | None = None,
                      block: int = BLOCK, scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Blockwise attention with each row's tokens split over the mesh's ``context`` axis: each
    device holds the queries, keys and values of its consecutive share of the tokens, gathers
    every device's keys and values (``all_gather``: the row's K/V, small beside its activations
    under grouped-query attention) and attends its queries to them by the same rules (the ids
    are whole on every device, so branch masks, windows and packed segments hold across the
    split); the backward pass gathers them again rather than keep the whole row's, and sums each
    device's key and value gradients back to their owner (``_context_flash``). Devices hold
    consecutive shares, so the later ones, whose queries see more keys, do more of the work. The
    row is padded to whole blocks on every device.
    The batch axes that divide the rows split them as well (``jax.shard_map``); the other axes
    (``tensor``: the heads) stay with the compiler."""
    from rmflow.trainer.parallel.mesh import BATCH_AXES

    mesh = jax.sharding.get_abstract_mesh()
    c = mesh.shape[CONTEXT]
    b, t = segment_ids.shape
    block = min(block, -(-t // c))
    local = -(-t // (c * block)) * block
    pad = local * c - t
    seg, pos, br = (a.astype(jnp.int32) for a in (segment_ids, positions, branch_ids))
    if pad:
        q, k, v, seg, pos, br = _pad_tokens(pad, q, k, v, seg, pos, br)
    batch = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    if batch and b % math.prod(mesh.shape[a] for a in batch):
        batch = ()  # rows that do not divide: each context group computes them all
    P = jax.sharding.PartitionSpec
    rows, ids = P(batch or None, CONTEXT), P(batch or None, None)

    def shard(q, k, v, seg, pos, br):
        offset = jax.lax.axis_index(CONTEXT).astype(jnp.int32) * local
        return _context_flash(q, k, v, seg, pos, br, offset, window, block, (scale, softcap))

    out = jax.shard_map(shard, in_specs=(rows, rows, rows, ids, ids, ids), out_specs=rows,
                        axis_names={*batch, CONTEXT}, check_vma=False)(q, k, v, seg, pos, br)
    return out[:, :t]


def _first_key_block(segment_ids, block: int) -> jax.Array:
    """(T // block,): for each query block, the first key block any of its queries may see,
    the block where its earliest segment starts (padding queries see nothing)."""
    b, t = segment_ids.shape
    idx = jnp.arange(t, dtype=jnp.int32)
    change = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(change, idx, 0), axis=1)
    first = jnp.where(segment_ids > 0, start // block, idx // block)
    return first.reshape(b, t // block, block).min(axis=(0, 2))


def _visited_blocks(segment_ids, branch_ids, block: int) -> jax.Array:
    """(T // block, T // block) boolean: may query block i see anything of key block j, as far as
    the blocks' branches tell (a block the mask empties may still be marked: it is then computed
    and masked). A query sees the keys of branch 0 and of its own branch; each block's branches
    1..30 are kept as bits (a higher branch counts as every branch). Computed once per call, before
    the loops, so that skipping a block needs no reduction over rows (split over devices) inside them.
    Branch ids are >= 0, as every collation writes them."""
    b, t = segment_ids.shape
    real = _blocks(segment_ids, block) > 0  # (nb, B, block)
    br = _blocks(branch_ids, block)
    bit = jnp.where(br >= 31, jnp.int32(-1), jnp.left_shift(jnp.int32(1), jnp.clip(br, 0, 30)))
    bits = jax.lax.reduce(jnp.where(real & (br > 0), bit, 0), jnp.int32(0), jax.lax.bitwise_or, (2,))  # (nb, B)
    prompt = (real & (br == 0)).any(-1)  # (nb, B): a key block holding shared-prefix tokens
    queries = real.any(-1)
    shared = (bits[:, None] & bits[None, :]) != 0  # (nb_q, nb_k, B)
    return ((prompt[None, :] | shared) & queries[:, None]).any(-1)


def _blocks(x, block):  # (B, T, ...) -> (T // block, B, block, ...)
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)


def _heads_major(x, block):
    """(B, T, K, G, D) -> (T // block, B, K, G * block, D): each block's rows per KV head, so every
    block product is a plain batched matmul over (B, K) (no transpose inside the loops)."""
    b, t, kh, g, d = x.shape
    return x.reshape(b, t // block, block, kh, g, d).transpose(1, 0, 3, 4, 2, 5).reshape(t // block, b, kh,
                                                                                        g * block, d)


def _tokens_major(x, groups):
    """Inverse of ``_heads_major``: (nb, B, K, G * block, D) -> (B, T, K * G, D)."""
    nb, b, kh, rows, d = x.shape
    block = rows // groups
    return x.reshape(nb, b, kh, groups, block, d).transpose(1, 0, 4, 2, 3, 5).reshape(b, nb * block,
                                                                                    kh * groups, d)


class _Layout:
    """Blocked views of one call's inputs: q as (nbq, B, K, G * Qb, D) for GQA (G query heads per
    KV head), k and v as (nb, B, K, Kb, D). The queries are the row's tokens from ``offset`` (a
    multiple of the block; 0 and as many as the keys but under context parallelism), the ids
    the whole row's: local query block i is the row's block ``i + self.first_query``."""

    def __init__(self, q, k, v, seg, pos, br, offset, block, logits=(None, None)):
        b, tq, n, d = q.shape
        t, kh = k.shape[1], k.shape[2]
        self.groups, self.block = n // kh, block
        self.scale, self.softcap = logits[0] or d**-0.5, logits[1]
        self.q = _heads_major(q.reshape(b, tq, kh, n // kh, d), block)
        self.k = _heads_major(k[:, :, :, None], block)
        self.v = _heads_major(v[:, :, :, None], block)
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
        self.meta = tuple(_blocks(a, block) for a in (seg, pos, br, idx))
        self.first_query = offset // block
        self.first = _first_key_block(seg, block)
        self.visit = _visited_blocks(seg, br, block)

    def row_block(self, i):
        """The row's block of local query block ``i``."""
        return i + self.first_query

    def mask(self, i, j, window):
        """(B, 1, 1, Qb, Kb): may each query of local block i attend to each key of block j."""
        g = self.row_block(i)
        return allowed(*(m[g] for m in self.meta), *(m[j] for m in self.meta), window)[:, None, None]

    def scores(self, i, j, qi, ok):
        """Scaled float32 scores of query block i against key block j, (B, K, G, Qb, Kb), masked by ``ok``."""
        s = jnp.einsum("bkrd,bksd->bkrs", qi, self.k[j], preferred_element_type=jnp.float32) * self.scale
        b, kh, _, kb = s.shape
        s = capped_scores(s.reshape(b, kh, self.groups, self.block, kb), self.softcap)
        return jnp.where(ok, s, _NEG)

    def rows(self, x):  # (B, K, G, Qb, ...) -> (B, K, G * Qb, ...)
        return x.reshape(x.shape[0], x.shape[1], self.groups * self.block, *x.shape[4:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q, k, v, seg, pos, br, offset, window, block, logits):
    return _flash_fwd(q, k, v, seg, pos, br, offset, window, block, logits)[0]


def _flash_fwd(q, k, v, seg, pos, br, offset, window, block, logits):
    lay = _Layout(q, k, v, seg, pos, br, offset, block, logits)
    nb = lay.q.shape[0]

    def query_block(i):
        qi = lay.q[i]
        b, kh, _, d = qi.shape
        g, qb = lay.groups, lay.block
        init = (jnp.full((b, kh, g, qb), _NEG, jnp.float32), jnp.zeros((b, kh, g, qb), jnp.float32),
                jnp.zeros((b, kh, g * qb, d), jnp.float32))

        def visit(j, ok, carry):
            m, denom, acc = carry
            s = lay.scores(i, j, qi, ok)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("bkrs,bksd->bkrd", lay.rows(p).astype(lay.v.dtype), lay.v[j],
                            preferred_element_type=jnp.float32)
            return m_new, corr * denom + p.sum(-1), lay.rows(corr)[..., None] * acc + pv

        def step(j, carry):  # a key block of other branches only (another response's) is skipped
            return jax.lax.cond(lay.visit[g, j], lambda c: visit(j, lay.mask(i, j, window), c), lambda c: c, carry)

        g = lay.row_block(i)
        m, denom, acc = jax.lax.fori_loop(lay.first[g], g + 1, step, init)
        seen = lay.rows(denom > 0)
        out = acc / jnp.where(seen, lay.rows(denom), 1.0)[..., None]
        lse = jnp.where(seen, lay.rows(m) + jnp.log(jnp.where(seen, lay.rows(denom), 1.0)), 0.0)
        return out, lse

    out, lse = jax.lax.map(query_block, jnp.arange(nb))  # (nb, B, K, G * Qb, D), (nb, B, K, G * Qb)
    out = _tokens_major(out, lay.groups).astype(q.dtype)
    return out, (q, k, v, seg, pos, br, offset, out, lse)


def _flash_bwd(window, block, logits, res, dout):
    q, k, v, seg, pos, br, offset, out, lse = res
    dq, dk, dv = _flash_grads(q, k, v, seg, pos, br, offset, out, lse, dout, window, block, logits)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


def _flash_grads(q, k, v, seg, pos, br, offset, out, lse, dout, window, block, logits):
    """The gradients of q, k and v in float32 (k and v the whole row's)."""
    lay = _Layout(q, k, v, seg, pos, br, offset, block, logits)
    b, t, n, d = q.shape
    kh = k.shape[2]
    do = _heads_major(dout.reshape(b, t, kh, n // kh, d).astype(jnp.float32), block)  # (nb, B, K, G * Qb, D)
    delta = (dout.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)  # (B, T, N)
    delta = _heads_major(delta.reshape(b, t, kh, n // kh, 1), block)[..., 0]  # (nb, B, K, G * Qb)

    def query_block(carry, i):
        dk, dv = carry
        qi, doi = lay.q[i], do[i]
        lse_i = lse[i].reshape(b, kh, lay.groups, lay.block)[..., None]
        delta_i = delta[i][..., None]

        def visit(j, ok, inner):
            dq_i, dk, dv = inner
            s = lay.scores(i, j, qi, ok)
            p = lay.rows(jnp.where(ok, jnp.exp(s - lse_i), 0.0))  # (B, K, G * Qb, Kb)
            dv_j = jnp.einsum("bkrs,bkrd->bksd", p, doi)
            dp = jnp.einsum("bkrd,bksd->bkrs", doi, lay.v[j], preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i) * lay.scale
            if lay.softcap:  # through the cap: times 1 - tanh²
                ds = ds * lay.rows(cap_gradient(s, lay.softcap, ok))
            dq_i = dq_i + jnp.einsum("bkrs,bksd->bkrd", ds, lay.k[j], preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("bkrs,bkrd->bksd", ds, qi, preferred_element_type=jnp.float32)
            return dq_i, dk.at[j].add(dk_j), dv.at[j].add(dv_j)

        def step(j, inner):
            return jax.lax.cond(lay.visit[g, j], lambda c: visit(j, lay.mask(i, j, window), c), lambda c: c, inner)

        g = lay.row_block(i)
        dq_i = jnp.zeros(qi.shape, jnp.float32)
        dq_i, dk, dv = jax.lax.fori_loop(lay.first[g], g + 1, step, (dq_i, dk, dv))
        return (dk, dv), dq_i

    zeros = jnp.zeros(lay.k.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), jnp.arange(lay.q.shape[0]))
    return _tokens_major(dq, lay.groups), _tokens_major(dk, 1), _tokens_major(dv, 1)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _gather(a):
    """(B, t, ...) on each ``context`` device -> (B, t x devices, ...): the whole row, in order.
    Gathered as float32 (XLA:CPU cannot compile a bfloat16 all-gather here), which the values
    of a 16-bit type survive exactly."""
    return jax.lax.all_gather(a.astype(jnp.float32), CONTEXT, axis=1, tiled=True).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _context_flash(q, k, v, seg, pos, br, offset, window, block, logits):
    """``_flash`` of a device's queries, keys and values against the whole row's keys and values
    (gathered over ``context``). The backward pass keeps the device's own keys and values only
    and gathers them again; each device's key and value gradients (float32) are summed back to
    their owner (a reduce-scatter) and rounded to their type once, as one device's are."""
    return _flash_fwd(q, _gather(k), _gather(v), seg, pos, br, offset, window, block, logits)[0]


def _context_flash_fwd(q, k, v, seg, pos, br, offset, window, block, logits):
    out, res = _flash_fwd(q, _gather(k), _gather(v), seg, pos, br, offset, window, block, logits)
    return out, (q, k, v, seg, pos, br, offset, out, res[-1])


def _context_flash_bwd(window, block, logits, res, dout):
    q, k, v, seg, pos, br, offset, out, lse = res
    dq, dk, dv = _flash_grads(q, _gather(k), _gather(v), seg, pos, br, offset, out, lse, dout, window, block, logits)
    dk, dv = (jax.lax.psum_scatter(g, CONTEXT, scatter_dimension=1, tiled=True) for g in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_context_flash.defvjp(_context_flash_fwd, _context_flash_bwd)
