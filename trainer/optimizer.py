"""The optimizer: AdamW with a linear or cosine schedule after a linear warmup, built from the
train config's ``optimizer`` section and the run's planned steps; its numbers as the train
step's runtime arguments, and the gradient clipping the step applies."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rmflow.schemas.train_config import OptimizerConfig
from rmflow.trainer.moments import scale_by_stored_adam

# The optimizer's numbers passed to the compiled step. Adam's betas stay constants of the program:
# optax computes 1 - beta from them, which in float32 would round otherwise than from a Python float.
HYPER_KEYS = ("learning_rate", "learning_rate_end", "warmup_steps", "weight_decay", "adam_eps", "max_grad_norm")


def hyperparameters(c: OptimizerConfig, total_steps: int) -> dict[str, np.ndarray]:
    """The optimizer's numbers as the train step's runtime argument: runs that differ only in them
    (a learning-rate sweep, a resumed run given more steps) share one compiled program per shape.
    The schedule's derived constants are computed here in double precision, as optax computes
    them from Python floats, so the learning rate is optax's to the bit."""
    steps = ("warmup_steps", "total_steps")
    out = {k: np.asarray(getattr(c, k), np.int32 if k in steps else np.float32) for k in HYPER_KEYS}
    out["total_steps"] = np.asarray(total_steps, np.int32)
    alpha = c.learning_rate_end / c.learning_rate if c.learning_rate else 0.0
    out.update(lr_span=np.float32(c.learning_rate - c.learning_rate_end), cosine_alpha=np.float32(alpha),
               cosine_keep=np.float32(1 - alpha))
    return out


def learning_rate_at(step: jax.Array, hyper: dict[str, Any], schedule: str) -> jax.Array:
    """Linear warmup from 0 to learning_rate, then linear or cosine decay to learning_rate_end:
    optax's linear_schedule, cosine_decay_schedule and join_schedules, computed from arrays."""
    lr, warmup = hyper["learning_rate"], hyper["warmup_steps"]
    decay_steps = jnp.maximum(hyper["total_steps"] - warmup, 1)
    after = step - warmup
    if schedule == "cosine":
        count = jnp.minimum(after, decay_steps).astype(jnp.float32)
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * count / decay_steps.astype(jnp.float32)))
        decay = lr * (hyper["cosine_keep"] * cosine + hyper["cosine_alpha"])
    elif schedule == "linear":
        frac = 1 - jnp.clip(after, 0, decay_steps) / decay_steps
        decay = hyper["lr_span"] * frac + hyper["learning_rate_end"]
    else:
        raise ValueError(f"schedule {schedule!r}: use 'linear' or 'cosine'")
    warm = -lr * (1 - jnp.clip(step, 0, warmup) / jnp.maximum(warmup, 1)) + lr
    return jnp.where(step < warmup, warm, decay)


def learning_rate_schedule(c: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The schedule of ``c`` over ``total_steps`` as a function of the step."""
    hyper = hyperparameters(c, total_steps)
    return lambda step: learning_rate_at(jnp.asarray(step, jnp.int32), hyper, c.schedule)


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices and embeddings only: never on norm weights or biases. A mixture of
    experts' stacked expert matrices (``experts.gate_proj`` ...) and their adapters decay too."""
    def decays(path, _) -> bool:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if len(names) >= 2 and names[-2] == "experts":
            return True
        return bool(names) and names[-1] in ("kernel", "embedding", "lora_A", "lora_B")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(c: OptimizerConfig, total_steps: int = 0, hyper: dict[str, Any] | None = None
                   ) -> optax.GradientTransformation:
    """AdamW. Gradient clipping is not in this chain: the step applies it together with the
    division by the number of pairs, in one pass over the gradients (``clip_scale``). Inside the
    jitted step the numbers come from ``hyper`` (arrays; default: ``c``'s over ``total_steps``);
    what shapes the program comes from ``c``:
    the schedule, Adam's betas, whether there is weight decay at all, and how the moments are
    stored (``c.moments``). The state's layout is the same either way."""
    h = hyperparameters(c, total_steps) if hyper is None else hyper
    schedule = lambda step: learning_rate_at(step, h, c.schedule)  # noqa: E731
    decay = h["weight_decay"] if c.weight_decay else 0.0
    if c.moments == "float32":
        return optax.adamw(schedule, b1=c.adam_b1, b2=c.adam_b2, eps=h["adam_eps"], weight_decay=decay, mask=decay_mask)
    # optax.adamw's chain with the moments stored compactly (``trainer.moments``)
    return optax.chain(scale_by_stored_adam(c.adam_b1, c.adam_b2, h["adam_eps"], c.moments),
                       optax.add_decayed_weights(decay, decay_mask), optax.scale_by_learning_rate(schedule))


def clip_scale(summed_norm: jax.Array, pairs: jax.Array, max_norm) -> tuple[jax.Array, jax.Array]:
    """(factor, norm): the gradient of the summed objective times ``factor`` is the mean
    gradient, clipped to ``max_norm`` as optax.clip_by_global_norm does; ``norm`` is the mean
    gradient's norm before clipping. One multiply instead of a divide and a clip, so the step
    holds one gradient-sized temporary fewer."""
    n = jnp.maximum(pairs, 1.0)
    norm = summed_norm / n
    if isinstance(max_norm, (int, float)) and not max_norm:
        return 1.0 / n, norm
    return jnp.where(norm < max_norm, 1.0, max_norm / jnp.maximum(norm, 1e-30)) / n, norm
