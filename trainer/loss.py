"""The losses, with metrics kept as exact sums: Bradley-Terry with margin and reward centering
(outcome reward models), and per-step cross-entropy over 2 classes (process reward models).

Rewards are (B,) float32. A (B, 1) array where (B,) is expected is refused, not broadcast:
``r_c (B,1) - r_r (B,)`` would silently give a (B, B) matrix, a known bug elsewhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from rmflow.schemas.metrics import STEP_THRESHOLD, incorrect_class

# Sums a step reports; windows add them up and divide once (never a mean of means).
SUM_KEYS = ("pairs", "loss_sum", "bt_loss_sum", "center_sum", "correct", "ties", "margin_sum",
            "chosen_sum", "rejected_sum", "reward_sq_sum")


def _check(name: str, x: jax.Array, like: jax.Array) -> None:
    if x.ndim != 1 or x.shape != like.shape:
        raise ValueError(f"{name} must have shape {like.shape} (one value per pair), got {x.shape}")


def pairwise_loss(r_chosen, r_rejected, margin, weight, center_coef: float = 0.0):
    """Mean over real pairs of -log σ(r_c - r_r - margin) + c · (r_c + r_r)².

    ``weight`` is 1 for a real pair and 0 for a batch-filling one. Returns the scalar loss and
    the step's metric sums (``SUM_KEYS``).
    """
    _check("r_chosen", r_chosen, r_chosen)
    for name, x in (("r_rejected", r_rejected), ("margin", margin), ("weight", weight)):
        _check(name, x, r_chosen)
    r_c, r_r = r_chosen.astype(jnp.float32), r_rejected.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    bt = -jax.nn.log_sigmoid(r_c - r_r - margin.astype(jnp.float32))
    center = (r_c + r_r) ** 2
    bt_mean = (w * bt).sum() / n
    center_mean = (w * center).sum() / n
    loss = bt_mean + center_coef * center_mean
    sums = {
        "pairs": w.sum(),
        "loss_sum": loss * w.sum(),
        "bt_loss_sum": (w * bt).sum(),
        "center_sum": (w * center).sum(),
        "correct": (w * (r_c > r_r)).sum(),
        "ties": (w * (r_c == r_r)).sum(),
        "margin_sum": (w * (r_c - r_r)).sum(),
        "chosen_sum": (w * r_c).sum(),
        "rejected_sum": (w * r_r).sum(),
        "reward_sq_sum": (w * (r_c**2 + r_r**2)).sum(),
    }
    return loss, sums


def pair_metrics_of_sums(sums: dict[str, float]) -> dict[str, float]:
    """Window metrics from exact sums: loss, accuracy (strict >), tie rate, rewards."""
    n = sums["pairs"]
    if not n:
        return {"pairs": 0}
    mean_r = (sums["chosen_sum"] + sums["rejected_sum"]) / (2 * n)
    return {
        "pairs": int(n),
        "loss": sums["loss_sum"] / n,
        "bt_loss": sums["bt_loss_sum"] / n,
        "center": sums["center_sum"] / n,
        "accuracy": sums["correct"] / n,
        "ties": sums["ties"] / n,
        "margin": sums["margin_sum"] / n,
        "reward_chosen": sums["chosen_sum"] / n,
        "reward_rejected": sums["rejected_sum"] / n,
        "reward_std": max(sums["reward_sq_sum"] / (2 * n) - mean_r**2, 0.0) ** 0.5,
    }


# --------------------------------------------------------------------------- process reward models

STEP_SUM_KEYS = ("steps", "loss_sum", "correct", "true_incorrect", "false_incorrect", "missed_incorrect",
                 "p_correct_sum")


def step_loss(logits, labels, weight):
    """Mean over labelled steps of the cross-entropy of the 2 class logits (0: incorrect, 1:
    correct), as TRL's PRMTrainer and Axolotl train process reward models.

    ``logits`` (R, S, 2), ``labels`` (R, S) in {0, 1}, ``weight`` (R, S): 1 for a real step, 0 for
    a padding slot. A step is predicted incorrect when P(correct) < ``STEP_THRESHOLD``. Returns the scalar loss
    and the metric sums (``STEP_SUM_KEYS``): with "incorrect" as the positive class,
    true/false/missed incorrect are true positives, false positives and false negatives.
    """
    if logits.ndim != 3 or logits.shape[-1] != 2 or logits.shape[:2] != labels.shape or labels.shape != weight.shape:
        raise ValueError(f"step_loss wants logits (R, S, 2) and labels, weight (R, S); got {logits.shape}, "
                         f"{labels.shape}, {weight.shape}")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    y = labels.astype(jnp.int32)
    ce = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    w = weight.astype(jnp.float32)
    n = w.sum()
    predicted_incorrect = logp[..., 1] < math.log(STEP_THRESHOLD)
    truly_incorrect = y == 0
    loss = (w * ce).sum() / jnp.maximum(n, 1.0)
    sums = {
        "steps": n,
        "loss_sum": (w * ce).sum(),
        "correct": (w * (predicted_incorrect == truly_incorrect)).sum(),
        "true_incorrect": (w * (predicted_incorrect & truly_incorrect)).sum(),
        "false_incorrect": (w * (predicted_incorrect & ~truly_incorrect)).sum(),
        "missed_incorrect": (w * (~predicted_incorrect & truly_incorrect)).sum(),
        "p_correct_sum": (w * jnp.exp(logp[..., 1])).sum(),
    }
    return loss, sums


def step_metrics_of_sums(sums: dict[str, float]) -> dict[str, float]:
    """Window metrics of a process reward model from exact sums: loss, step accuracy, and
    precision / recall / F1 of the "incorrect" class (the steps a PRM exists to find)."""
    n = sums["steps"]
    if not n:
        return {"steps": 0}
    return {
        "steps": int(n),
        "loss": sums["loss_sum"] / n,
        "step_accuracy": sums["correct"] / n,
        **incorrect_class(sums["true_incorrect"], sums["false_incorrect"], sums["missed_incorrect"]),
        "mean_p_correct": sums["p_correct_sum"] / n,
    }
