"""The losses, with metrics kept as exact sums: Bradley-Terry with margin and reward centering
(outcome reward models), and per-step cross-entropy over 2 classes (process reward models).

Rewards are (B,) float32. A (B, 1) array where (B,) is expected is refused, not broadcast:
``r_c (B,1) - r_r (B,)`` would silently give a (B, B) matrix, a known bug elsewhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rmflow.schemas.metrics import STEP_THRESHOLD, incorrect_class
from rmflow.schemas.train_config import RANKING_LOSSES

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


# --------------------------------------------------------------------------- K responses per prompt

RANKING_SUM_KEYS = ("prompts", "responses", "pairs", "loss_sum", "rank_loss_sum", "center_sum", "correct", "ties",
                    "best_sum", "ranked_prompts", "tau_sum", "tau_prompts", "reward_sum", "reward_sq_sum")


def listwise_loss(rewards, scores, group, center_coef: float = 0.0, ranking: str = "bradley-terry", margins=None):
    """The ranking loss of each prompt's K responses, averaged over prompts.

    ``rewards``, ``scores`` (R, S) and ``group`` (R, S): the record of each slot within its row
    (1, 2, ...; 0: a padding slot), a record's slots contiguous. Per prompt:

    * ``bradley-terry``: the mean of -log σ(r_i - r_j - (m_i - m_j)) over every pair whose scores
      differ (s_i > s_j); pairs of equal scores are skipped. ``margins`` (R, S), default 0: a
      record trained with margins from its scores holds them here. At K = 2 it is the pairs' loss.
    * ``plackett-luce``: the negative log-likelihood of the ranking the scores give, each response
      drawn from those scored no higher (tied responses share their place, Breslow's rule), as the
      mean over the responses that outrank another (margins do not apply).

    plus ``center_coef`` (2·mean r)², the pairs' (r_c + r_r)² at K = 2. Returns the scalar loss
    and the metric sums (``RANKING_SUM_KEYS``): pairs ordered right (strict) and tied, best-of-K
    credit (the top reward on a best-scored response, shared among a tied top), Kendall's tau-b
    over the prompts where rewards and scores both vary.
    """
    if rewards.shape != scores.shape or scores.shape != group.shape or rewards.ndim != 2 or (
            margins is not None and margins.shape != scores.shape):
        raise ValueError(f"listwise_loss wants rewards, scores and group of one shape (R, S); got {rewards.shape}, "
                         f"{scores.shape}, {group.shape}")
    if ranking not in RANKING_LOSSES:
        raise ValueError(f"ranking loss {ranking!r}: use one of {RANKING_LOSSES}")
    r, s, rec = rewards.astype(jnp.float32), scores.astype(jnp.float32), _Slots.of(group)
    ds, dr = s[:, :, None] - s[:, None, :], r[:, :, None] - r[:, None, :]
    better = rec.same & (ds > 0)  # i outranks j
    n_pairs = rec.per_record(_f(better).sum(-1))
    rank = _rank_loss(ranking, rec, r, better, ds, dr, n_pairs, margins)
    mean = rec.per_record(jnp.where(rec.real, r, 0.0)) / jnp.maximum(rec.size, 1.0)
    prompts = rec.at_leaders(jnp.ones_like(r))
    rank_sum, center_sum = rec.at_leaders(rank), rec.at_leaders((2.0 * mean) ** 2)
    loss = (rank_sum + center_coef * center_sum) / jnp.maximum(prompts, 1.0)
    ranked = n_pairs > 0  # a record with something to rank (one kept for its ratings alone: not)
    tau, has_tau = _kendall_tau(rec, ds, dr)
    sums = {
        "prompts": prompts,
        "responses": _f(rec.real).sum(),
        "pairs": _f(better).sum(),
        "loss_sum": rank_sum + center_coef * center_sum,
        "rank_loss_sum": rank_sum,
        "center_sum": center_sum,
        "correct": _f(better & (dr > 0)).sum(),
        "ties": _f(better & (dr == 0)).sum(),
        "best_sum": rec.at_leaders(jnp.where(ranked, _best_of_k(rec, r, s), 0.0)),
        "ranked_prompts": rec.at_leaders(_f(ranked)),
        "tau_sum": rec.at_leaders(tau),
        "tau_prompts": rec.at_leaders(_f(has_tau)),
        "reward_sum": jnp.where(rec.real, r, 0.0).sum(),
        "reward_sq_sum": jnp.where(rec.real, r * r, 0.0).sum(),
    }
    return loss, sums


def _f(m: jax.Array) -> jax.Array:
    return m.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Slots:
    """The records of a batch's (R, S) slots: ``same`` (R, S, S) slots i and j share a record,
    ``real`` slots that hold a response, ``leader`` each record's first slot, ``size`` (R, S)
    each slot's record's size."""

    same: jax.Array
    real: jax.Array
    leader: jax.Array

    @classmethod
    def of(cls, group: jax.Array) -> _Slots:
        real = group > 0
        same = (group[:, :, None] == group[:, None, :]) & real[:, :, None]
        return cls(same, real, real & (group != jnp.pad(group, ((0, 0), (1, 0)))[:, :-1]))

    def per_record(self, x: jax.Array) -> jax.Array:
        """(R, S) per-slot values -> each slot's record's total."""
        return jnp.einsum("rij,rj->ri", self.same.astype(jnp.float32), x)

    def at_leaders(self, x: jax.Array) -> jax.Array:
        """(R, S) record totals -> summed over records."""
        return jnp.where(self.leader, x, 0.0).sum()

    @property
    def size(self) -> jax.Array:
        return self.per_record(_f(self.real))


def _rank_loss(ranking: str, rec: _Slots, r, better, ds, dr, n_pairs, margins) -> jax.Array:
    """Each slot's record's ranking loss (R, S)."""
    if ranking == "bradley-terry":
        m = jnp.zeros_like(r) if margins is None else margins.astype(jnp.float32)
        dm = m[:, :, None] - m[:, None, :]
        terms = jnp.where(better, -jax.nn.log_sigmoid(dr - dm), 0.0).sum(-1)  # (R, S): i's pairs with those below
        return rec.per_record(terms) / jnp.maximum(n_pairs, 1.0)
    below = rec.same & (ds >= 0)  # i is drawn from the responses scored no higher than it
    lse = jax.nn.logsumexp(jnp.where(below, r[:, None, :], -1e30), axis=-1)  # finite: padding has no gradient
    drawn = better.any(-1)  # a response that outranks another (the lowest-scored are not drawn)
    return rec.per_record(jnp.where(drawn, lse - r, 0.0)) / jnp.maximum(rec.per_record(_f(drawn)), 1.0)


def _best_of_k(rec: _Slots, r, s) -> jax.Array:
    """Best-of-K credit per record: the share of its top-reward responses that are best-scored."""
    top_r = jnp.where(rec.same, r[:, None, :], -jnp.inf).max(-1)
    top_s = jnp.where(rec.same, s[:, None, :], -jnp.inf).max(-1)
    is_top, is_best = rec.real & (r == top_r), rec.real & (s == top_s)
    return rec.per_record(_f(is_top & is_best)) / jnp.maximum(rec.per_record(_f(is_top)), 1.0)


def _kendall_tau(rec: _Slots, ds, dr) -> tuple[jax.Array, jax.Array]:
    """Kendall's tau-b per record, and where it is defined (rewards and scores both vary): over
    the unordered pairs of a record (each counted twice here, halved out)."""
    size = rec.size
    concordant = rec.per_record(jnp.where(rec.same, jnp.sign(ds) * jnp.sign(dr), 0.0).sum(-1))
    n0 = size * (size - 1)
    tied_s = rec.per_record(_f(rec.same & (ds == 0)).sum(-1)) - size  # ordered pairs i != j of equal score
    tied_r = rec.per_record(_f(rec.same & (dr == 0)).sum(-1)) - size
    denom = jnp.sqrt(jnp.maximum((n0 - tied_s) * (n0 - tied_r), 0.0))
    has_tau = denom > 0
    return jnp.where(has_tau, concordant / jnp.where(has_tau, denom, 1.0), 0.0), has_tau


def ranking_metrics_of_sums(sums: dict[str, float]) -> dict[str, float]:
    """Window metrics of K responses per prompt from exact sums: loss, pairwise accuracy (strict
    >) and ties over every pair whose scores differ, best-of-K accuracy, Kendall's tau-b, rewards."""
    n = sums["prompts"]
    if not n:
        return {"prompts": 0}
    pairs, k = sums["pairs"], max(sums["responses"], 1.0)
    mean_r = sums["reward_sum"] / k
    return {
        "prompts": int(n),
        "responses": int(sums["responses"]),
        "pairs": int(pairs),
        "loss": sums["loss_sum"] / n,
        "rank_loss": sums["rank_loss_sum"] / n,
        "center": sums["center_sum"] / n,
        # figures over pairs of different scores, or prompts that rank: absent over none (never 0)
        **({"accuracy": sums["correct"] / pairs, "ties": sums["ties"] / pairs,
            "best_of_k_accuracy": sums["best_sum"] / sums["ranked_prompts"]} if pairs else {}),
        **({"kendall_tau": sums["tau_sum"] / sums["tau_prompts"]} if sums["tau_prompts"] else {}),
        "reward_mean": mean_r,
        "reward_std": max(sums["reward_sq_sum"] / k - mean_r**2, 0.0) ** 0.5,
    }


# Sums of the attribute regression: ``mse_sum`` (per prompt, the mean over its responses and
# attributes of the squared error) is a scalar; ``attr_se_sum`` is (N,), one per attribute, over
# every response (the count is the ranking sums' ``responses``). Pearson's r comes from centred
# moments (``MOMENT_KEYS``), merged by ``merge_sums``, never from raw ones: raw sums of squares in
# float32 cancel to noise when the outputs vary little against their mean.
_F32_EPS = float(np.finfo(np.float32).eps)
MOMENT_KEYS = ("attr_n", "attr_pred_mean", "attr_label_mean", "attr_pred_m2", "attr_label_m2", "attr_cross_m2")
REGRESSION_SUM_KEYS = ("mse_sum", "attr_se_sum", *MOMENT_KEYS)


def merge_sums(a: dict[str, Any], b: dict[str, Any], keys) -> dict[str, Any]:
    """``a`` and ``b``'s metric statistics together: the sums of ``keys`` added, and where they
    hold ``MOMENT_KEYS`` the centred moments merged (Chan et al.'s pairwise update: the means'
    difference corrects the second moments, so no large squares cancel). All zeros is the
    identity. Written in operators alone, so it merges jax arrays on the device (a step's
    micro-batches) and numpy float64 on the host (steps, batches, sets) alike."""
    out = {k: a[k] + b[k] for k in keys if k not in MOMENT_KEYS}
    if MOMENT_KEYS[0] in keys:
        na, nb = a["attr_n"], b["attr_n"]
        n = na + nb
        share = nb / (n + (n == 0))  # b's share of the merged count (0 for none)
        weight = na * share  # na * nb / n
        dp = b["attr_pred_mean"] - a["attr_pred_mean"]
        dy = b["attr_label_mean"] - a["attr_label_mean"]
        out.update(attr_n=n, attr_pred_mean=a["attr_pred_mean"] + dp * share,
                   attr_label_mean=a["attr_label_mean"] + dy * share,
                   attr_pred_m2=a["attr_pred_m2"] + b["attr_pred_m2"] + dp * dp * weight,
                   attr_label_m2=a["attr_label_m2"] + b["attr_label_m2"] + dy * dy * weight,
                   attr_cross_m2=a["attr_cross_m2"] + b["attr_cross_m2"] + dp * dy * weight)
    return out


def regression_sums(outputs, labels, group) -> dict[str, jax.Array]:
    """An attribute head's outputs (R, S, N) against the ratings (R, S, N) of the responses in
    slots whose ``group`` (R, S) is > 0 (padding: 0): the squared-error objective summed over
    prompts (each prompt's mean over its responses and attributes, so a prompt counts once
    whatever its K), the per-attribute squared error summed, and the outputs' and ratings'
    means and centred second moments over the batch (``REGRESSION_SUM_KEYS``; merged with
    other batches' by ``merge_sums``)."""
    if outputs.shape != labels.shape or outputs.shape[:2] != group.shape or outputs.ndim != 3:
        raise ValueError(f"regression_sums wants outputs and labels (R, S, N) and group (R, S); got {outputs.shape}, "
                         f"{labels.shape}, {group.shape}")
    p, y = outputs.astype(jnp.float32), labels.astype(jnp.float32)
    real = group > 0
    same = (group[:, :, None] == group[:, None, :]) & real[:, :, None]
    size = same.astype(jnp.float32).sum(-1)  # (R, S): the responses of each slot's record
    se = (p - y) ** 2
    w = real.astype(jnp.float32)[..., None]  # (R, S, 1)
    n_attr = max(p.shape[-1], 1)
    per_slot = jnp.where(real, se.sum(-1) / n_attr / jnp.maximum(size, 1.0), 0.0)

    def over(x):  # (R, S, N) -> (N,) over real slots
        return (x * w).sum((0, 1))

    n = jnp.maximum(w.sum(), 1.0)
    mean_p, mean_y = over(p) / n, over(y) / n
    dp, dy = p - mean_p, y - mean_y
    # A second pass corrects the means' rounding (it grows with the batch), so that values that do
    # not vary keep no spread: m2 = sum(d^2) - sum(d)^2 / n, sum(d) ~ 0.
    cp, cy = over(dp), over(dy)
    return {"mse_sum": per_slot.sum(), "attr_se_sum": over(se), "attr_n": jnp.broadcast_to(w.sum(), mean_p.shape),
            "attr_pred_mean": mean_p + cp / n, "attr_label_mean": mean_y + cy / n,
            "attr_pred_m2": jnp.maximum(over(dp * dp) - cp * cp / n, 0.0),
            "attr_label_m2": jnp.maximum(over(dy * dy) - cy * cy / n, 0.0),
            "attr_cross_m2": over(dp * dy) - cp * cy / n}


def regression_metrics_of_sums(sums: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    """The ranking metrics (``ranking_metrics_of_sums``, of the reward: the outputs' weighted
    sum), ``mse`` (the regression term per prompt), and per attribute ``NAME_rmse`` and
    ``NAME_pearson`` (nan where outputs or ratings do not vary)."""
    out = ranking_metrics_of_sums(sums)
    if not sums["prompts"]:
        return out
    n = max(float(sums["responses"]), 1.0)
    vec = {k: np.broadcast_to(np.asarray(sums[k], np.float64), (len(names),)) for k in REGRESSION_SUM_KEYS[1:]}
    out["mse"] = float(sums["mse_sum"]) / float(sums["prompts"])

    def varies(m2, mean):  # a spread above float32's resolution at the mean (rounding is no variation)
        return m2 > n * (4 * _F32_EPS * abs(mean)) ** 2 and m2 > 0

    for j, name in enumerate(names):
        var_p, var_y, cov = (vec[k][j] for k in ("attr_pred_m2", "attr_label_m2", "attr_cross_m2"))
        out[f"{name}_rmse"] = math.sqrt(max(vec["attr_se_sum"][j] / n, 0.0))
        out[f"{name}_pearson"] = (float(cov / math.sqrt(var_p * var_y)) if varies(var_p, vec["attr_pred_mean"][j])
                                  and varies(var_y, vec["attr_label_mean"][j]) else float("nan"))
    return out
