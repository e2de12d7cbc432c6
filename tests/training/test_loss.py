import math

import jax.numpy as jnp
import numpy as np
import pytest
from rmflow.trainer.loss import SUM_KEYS, pair_metrics_of_sums, pairwise_loss, step_loss


def log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_loss_by_hand_with_margin_and_centering():
    rc, rr, m = [2.0, -1.0, 0.5], [1.0, 0.5, 0.5], [0.5, 0.0, 1.0]
    loss, sums = pairwise_loss(jnp.array(rc), jnp.array(rr), jnp.array(m), jnp.ones(3), center_coef=0.01)
    bt = [-log_sigmoid(c - r - g) for c, r, g in zip(rc, rr, m)]
    center = [(c + r) ** 2 for c, r in zip(rc, rr)]
    expected = sum(bt) / 3 + 0.01 * sum(center) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    # -log σ(0.5) = 0.474077, -log σ(-1.5) = 1.701413, -log σ(-1) = 1.313262; centering 9, 0.25, 1
    assert expected == pytest.approx((0.474077 + 1.701413 + 1.313262) / 3 + 0.01 * 10.25 / 3, rel=1e-5)
    m_ = pair_metrics_of_sums({k: float(v) for k, v in sums.items()})
    assert m_["accuracy"] == pytest.approx(1 / 3) and m_["ties"] == pytest.approx(1 / 3)  # strict >; ties apart
    assert m_["margin"] == pytest.approx((1.0 - 1.5 + 0.0) / 3)


def test_batch_filling_pairs_do_not_count():
    full, _ = pairwise_loss(jnp.array([1.0, 0.0]), jnp.array([0.0, 0.0]), jnp.zeros(2), jnp.ones(2))
    padded, sums = pairwise_loss(jnp.array([1.0, 0.0, 9.0]), jnp.array([0.0, 0.0, -9.0]), jnp.zeros(3),
                                 jnp.array([1.0, 1.0, 0.0]))
    assert float(padded) == pytest.approx(float(full)) and float(sums["pairs"]) == 2


@pytest.mark.parametrize("shape", [(4, 1), (1, 4), (4, 4)])
def test_a_column_of_rewards_is_refused_not_broadcast(shape):
    # r_c (B,1) - r_r (B,) would broadcast to (B,B) and train on the wrong objective.
    with pytest.raises(ValueError, match="one value per pair"):
        pairwise_loss(jnp.zeros(shape), jnp.zeros(4), jnp.zeros(4), jnp.ones(4))
    with pytest.raises(ValueError, match="one value per pair"):
        pairwise_loss(jnp.zeros(4), jnp.zeros(shape), jnp.zeros(4), jnp.ones(4))


def test_window_metrics_are_exact_counts_not_means_of_means():
    steps = [pairwise_loss(jnp.array(c), jnp.array(r), jnp.zeros(len(c)), jnp.ones(len(c)))[1]
             for c, r in (([1.0], [0.0]), ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0]))]
    window = {k: sum(float(s[k]) for s in steps) for k in SUM_KEYS}
    assert pair_metrics_of_sums(window)["accuracy"] == pytest.approx(1 / 4)  # a mean of means would say 1/2
    r = np.array([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    assert pair_metrics_of_sums(window)["reward_std"] == pytest.approx(r.std())


def test_a_figure_logged_while_training_equals_the_same_figure_in_eval():
    """The window metrics of training (sums) and rmflow eval (a whole set) compute the shared
    figures from one definition (``schemas.metrics``): on the same predictions they agree,
    ties and steps exactly at the threshold included."""
    from rmflow.trainer.loss import step_metrics_of_sums

    from rmflow.eval.figures import pair_metrics, process_metrics

    rng = np.random.default_rng(0)
    rc = rng.normal(size=64).astype(np.float32)
    rr = np.where(np.arange(64) % 8 == 0, rc, rng.normal(size=64)).astype(np.float32)  # some ties
    _, sums = pairwise_loss(jnp.asarray(rc), jnp.asarray(rr), jnp.zeros(64), jnp.ones(64))
    logged, evaluated = pair_metrics_of_sums({k: float(v) for k, v in sums.items()}), pair_metrics(rc, rr)
    assert logged["accuracy"] == pytest.approx(evaluated["accuracy"]) and evaluated["ties"] == 8
    assert logged["ties"] == pytest.approx(evaluated["tie_rate"])

    p = rng.uniform(size=(4, 16))
    p[0, :3] = 0.5  # exactly at the threshold: predicted correct by both
    labels = (rng.uniform(size=(4, 16)) > 0.4).astype(np.int32)
    logits = np.stack([np.zeros_like(p), np.log(p) - np.log1p(-p)], -1).astype(np.float32)  # P(correct) = p
    _, step_sums = step_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.ones((4, 16)))
    logged = step_metrics_of_sums({k: float(v) for k, v in step_sums.items()})
    evaluated = process_metrics(list(p), list(labels))
    for name in ("step_accuracy", "incorrect_precision", "incorrect_recall", "incorrect_f1"):
        assert logged[name] == pytest.approx(evaluated[name], abs=1e-6), name
