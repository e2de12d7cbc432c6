"""The scoring forwards, jitted once per process (the model's structure static, its weights an
argument): every shape a process traces is reused by any model of the same architecture."""

from __future__ import annotations

import functools

import jax
from flax import nnx
from rmflow.trainer.objective import pair_rewards


# The scoring forwards, jitted once per process: the model's structure (its nnx GraphDef, hashable and
# equal for two loads of one architecture) is a static argument and its parameters an ordinary one,
# so the compiled program holds no weights, and a model loaded again (a Beam worker's next DoFn, a
# second job in one process, the API after eval) or another checkpoint of the same run reuses
# every shape already traced and compiled in this process.
@functools.partial(jax.jit, static_argnums=0)
def _rewards(graphdef: nnx.GraphDef, state: nnx.State, ids, pos, seg, idx) -> jax.Array:
    return nnx.merge(graphdef, state)(ids, pos, seg, idx)


@functools.partial(jax.jit, static_argnums=0)
def _rewards_and_outputs(graphdef: nnx.GraphDef, state: nnx.State, ids, pos, seg, idx, branches=None
                         ) -> tuple[jax.Array, jax.Array]:
    """The rewards and the score head's outputs (an attribute head's: one per attribute)."""
    model = nnx.merge(graphdef, state)
    outputs = model.logits(ids, pos, seg, idx, branches)
    return model.reward_of(outputs), outputs


@functools.partial(jax.jit, static_argnums=0)
def _step_probabilities(graphdef: nnx.GraphDef, state: nnx.State, ids, pos, seg, idx, branches=None) -> jax.Array:
    logits = nnx.merge(graphdef, state).logits(ids, pos, seg, idx, branches)
    return jax.nn.softmax(logits, axis=-1)[..., 1]


@functools.partial(jax.jit, static_argnums=0)
def _packed_pair_rewards(graphdef: nnx.GraphDef, state: nnx.State, batch: dict) -> tuple[jax.Array, jax.Array]:
    return pair_rewards(nnx.merge(graphdef, state), batch)
