"""Who may attend to whom in a packed row: the rules every attention implementation shares
(``attention`` computes them densely or per block; ``pallas_attention`` per kernel block).
The rules themselves are in ``trainer.modeling.attention``'s module doc."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def allowed(seg_q, pos_q, br_q, idx_q, seg_k, pos_k, br_k, idx_k, window: int | None) -> jax.Array:
    """(..., Tq, Tk) boolean: may each query attend to each key (rules in the module doc). The
    query arrays are (..., Tq), the key arrays (..., Tk): rows (B, T) or one block's (T,)."""
    q = lambda a: a[..., :, None]  # noqa: E731
    k = lambda a: a[..., None, :]  # noqa: E731
    ok = (q(seg_q) == k(seg_k)) & (q(pos_q) >= k(pos_k)) & (q(idx_q) >= k(idx_k))
    ok &= (k(br_k) == 0) | (k(br_k) == q(br_q))
    if window is not None:
        ok &= (q(pos_q) - k(pos_k)) < window
    return ok


def dense_mask(segment_ids, positions, branch_ids, window: int | None) -> jax.Array:
    """(B, 1, T, T) mask for the reference implementation."""
    idx = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
    return allowed(segment_ids, positions, branch_ids, idx, segment_ids, positions, branch_ids, idx, window)[:, None]


def capped_scores(s: jax.Array, softcap: float | None) -> jax.Array:
    """Attention logits soft-capped as Gemma 2's are: ``softcap * tanh(s / softcap)`` (None: as
    they are). Every implementation caps before masking and the softmax."""
    return s if not softcap else softcap * jnp.tanh(s / softcap)


def cap_gradient(capped: jax.Array, softcap: float | None, ok: jax.Array):
    """d capped / d s at the allowed entries (1 - tanh², from the capped values), 0 elsewhere;
    1.0 without a cap. The blockwise and Pallas backward passes multiply the scores' gradient by it."""
    if not softcap:
        return 1.0
    t = capped / softcap
    return jnp.where(ok, 1.0 - t * t, 0.0)
