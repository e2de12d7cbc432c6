"""What an ensemble's eval adds (a model with an ensemble head, ``schemas.heads.ENSEMBLE``): each
member's rewards, and figures of the members against the ensemble.

On pairs: each member's accuracy (its own chosen reward above its own rejected), their mean,
best and worst, against the accuracy of the members' mean and of the model's reward (its rule:
the mean, the minimum or a lower confidence bound); and how well three measures of doubt about a
pair predict that the model misorders it, each as an AUROC (0.5: it tells nothing; 1: every
misordered pair is doubted more than every right one): the members' disagreement (the standard
deviation of their margins), that disagreement against the mean margin (a small mean margin
among members that disagree: the verdict could flip), and, for comparison, the small mean margin
alone (what one model's own margin tells).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def member_outputs(rm, sequences: Sequence[np.ndarray], batch_size: int) -> np.ndarray:
    """The members' rewards of each sequence (each scored at its last token), (n, members)."""
    scorer = rm.scorer(rm.shapes(batch_size))
    out = np.zeros((len(sequences), rm.model_config.members), np.float64)
    for batch in scorer.shapes.plan([len(s) for s in sequences]):
        _, outputs = scorer.run_outputs([sequences[i] for i in batch])
        out[batch] = outputs
    return out


def auroc(score: np.ndarray, positive: np.ndarray) -> float | None:
    """P(score of a positive > score of a negative), ties half (Mann-Whitney U); None without both."""
    pos, neg = score[positive], score[~positive]
    if not len(pos) or not len(neg):
        return None
    ranks = np.empty(len(score))
    order = np.argsort(score, kind="stable")
    ranks[order] = np.arange(1, len(score) + 1)
    for value in np.unique(score):  # ties share their mean rank
        tied = score == value
        ranks[tied] = ranks[tied].mean()
    return float((ranks[positive].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def pair_figures(chosen: np.ndarray, rejected: np.ndarray, reward_correct: np.ndarray) -> dict[str, Any]:
    """``chosen``, ``rejected``: the members' rewards (n, members); ``reward_correct``: whether the
    model's reward (its rule) ranks each pair right."""
    margins = chosen - rejected
    each = (margins > 0).mean(0)
    spread = margins.std(1)
    wrong = ~np.asarray(reward_correct, bool)
    size = np.abs(margins.mean(1))
    return {"members": int(chosen.shape[1]), "member_accuracy": [float(x) for x in each],
            "member_accuracy_mean": float(each.mean()), "member_accuracy_best": float(each.max()),
            "member_accuracy_worst": float(each.min()),
            "mean_accuracy": float((margins.mean(1) > 0).mean()), "reward_accuracy": float(1 - wrong.mean()),
            "spread_auroc_misordered": auroc(spread, wrong),
            "flip_auroc_misordered": auroc(spread / np.maximum(size, 1e-12), wrong),
            "margin_auroc_misordered": auroc(-size, wrong),
            "spread_right": float(spread[~wrong].mean()) if (~wrong).any() else None,
            "spread_misordered": float(spread[wrong].mean()) if wrong.any() else None,
            "reward_std_mean": float(np.concatenate([chosen.std(1), rejected.std(1)]).mean())}


def ensemble_pairs(rm, records, rc: np.ndarray, rr: np.ndarray, batch_size: int) -> dict[str, Any]:
    """``pair_figures`` of pair records, their rewards ``rc``, ``rr`` (the model's rule)."""
    seqs = [r.chosen_ids[: r.chosen_last + 1] for r in records] + [r.rejected_ids[: r.rejected_last + 1]
                                                                    for r in records]
    out = member_outputs(rm, seqs, batch_size)
    return pair_figures(out[: len(records)], out[len(records):], np.asarray(rc) > np.asarray(rr))


def markdown_lines(e: dict[str, Any]) -> list[str]:
    def f(x) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    return ["", f"## Ensemble ({e['members']} members)", "", "| figure | value |", "| --- | ---: |",
            f"| accuracy of the model's reward | {f(e['reward_accuracy'])} |",
            f"| accuracy of the members' mean | {f(e['mean_accuracy'])} |",
            f"| members' accuracy: mean (worst - best) | {f(e['member_accuracy_mean'])} "
            f"({f(e['member_accuracy_worst'])} - {f(e['member_accuracy_best'])}) |",
            f"| AUROC of the members' disagreement for a misordered pair | {f(e['spread_auroc_misordered'])} |",
            f"| ... of their disagreement against the mean margin | {f(e.get('flip_auroc_misordered'))} |",
            f"| ... of a small mean margin alone | {f(e.get('margin_auroc_misordered'))} |",
            f"| disagreement (std of the members' margins): right pairs, misordered | {f(e['spread_right'])}, "
            f"{f(e['spread_misordered'])} |"]
