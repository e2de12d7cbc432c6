"""Evaluation metrics: pure numpy over scores and labels, each metric named once.

Outcome reward models (``pair_metrics``, over per-pair rewards): pairwise accuracy (strict >,
ties apart) with its Wilson interval, Bradley-Terry loss, margins, reward statistics,
calibration of sigmoid(r_c - r_r) as a preference probability (expected calibration error,
Brier score), a length-bias diagnostic and per-subset accuracy.

Process reward models (``process_metrics``, over P(correct) per step): step accuracy,
precision / recall / F1 of the "incorrect" class, the first wrong step found exactly, and
ProcessBench's F1 of the accuracies on solutions with and without an error. A step is judged
incorrect below ``STEP_THRESHOLD``; ``first_error`` is where a solution first goes wrong. The
figures the training logs share with eval are defined in ``schemas.metrics``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rmflow.schemas.metrics import STEP_THRESHOLD, f1, first_error, incorrect_class

ECE_BINS = 10


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: sound for small n and for accuracies near 0 or 1,
    where the normal approximation is not."""
    if n == 0:
        return 0.0, 1.0
    phat = successes / n
    denom = 1 + z * z / n
    centre = (phat + z * z / (2 * n)) / denom
    half = z * np.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / denom
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def calibration(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS,
                lo: float = 0.5) -> tuple[float, list[dict[str, float]]]:
    """Expected calibration error: the count-weighted gap between mean confidence and accuracy
    in equal-width confidence bins over [lo, 1]."""
    edges = np.linspace(lo, 1.0, bins + 1)
    which = np.clip(np.digitize(confidence, edges[1:-1]), 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        sel = which == b
        if not sel.any():
            continue
        conf, acc = float(confidence[sel].mean()), float(correct[sel].mean())
        ece += sel.mean() * abs(conf - acc)
        table.append({"bin": b, "lo": float(edges[b]), "hi": float(edges[b + 1]), "count": int(sel.sum()),
                      "confidence": conf, "accuracy": acc})
    return float(ece), table


def pair_metrics(
    r_chosen: np.ndarray,
    r_rejected: np.ndarray,
    *,
    margin: np.ndarray | None = None,
    len_chosen: np.ndarray | None = None,
    len_rejected: np.ndarray | None = None,
    subsets: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every figure from exact counts over the pairs given."""
    rc, rr = np.asarray(r_chosen, np.float64), np.asarray(r_rejected, np.float64)
    if rc.ndim != 1 or rc.shape != rr.shape:
        raise ValueError(f"rewards must be two 1-D arrays of one length, got {rc.shape} and {rr.shape}")
    n = len(rc)
    if n == 0:
        raise ValueError("no pairs to evaluate")
    m = np.zeros(n) if margin is None else np.asarray(margin, np.float64)
    d = rc - rr
    p = 1.0 / (1.0 + np.exp(-d))  # the model's probability that chosen is preferred
    # Calibration of the predicted winner: confidence max(p, 1-p), right when it is the chosen
    # reply (a tie is half right).
    ece, table = calibration(np.maximum(p, 1.0 - p), np.where(d > 0, 1.0, np.where(d == 0, 0.5, 0.0)))
    both = np.concatenate([rc, rr])
    out: dict[str, Any] = {
        "pairs": n,
        "accuracy": float((d > 0).sum() / n),
        "accuracy_ci95": list(wilson_interval(int((d > 0).sum()), n)),
        "ties": int((d == 0).sum()),
        "tie_rate": float((d == 0).sum() / n),
        "loss": float(-_log_sigmoid(d - m).mean()),
        "margin_mean": float(d.mean()),
        "margin_std": float(d.std()),
        "reward_chosen_mean": float(rc.mean()), "reward_chosen_std": float(rc.std()),
        "reward_rejected_mean": float(rr.mean()), "reward_rejected_std": float(rr.std()),
        "reward_mean": float(both.mean()), "reward_std": float(both.std()),
        "calibration": {"ece": ece, "brier": float(((p - 1.0) ** 2).mean()), "bins": table},
    }
    if len_chosen is not None and len_rejected is not None:
        lc, lr = np.asarray(len_chosen, np.float64), np.asarray(len_rejected, np.float64)
        lengths = np.concatenate([lc, lr])
        corr = float(np.corrcoef(both, lengths)[0, 1]) if both.std() and lengths.std() else 0.0
        out["length_bias"] = {
            "longer_wins_accuracy": float((lc > lr).sum() / n),
            "equal_length_pairs": int((lc == lr).sum()),
            "reward_length_correlation": corr,
            "chosen_longer_fraction": float((lc > lr).mean()),
        }
    if subsets is not None:
        per: dict[str, dict[str, Any]] = {}
        names = np.asarray(list(subsets), dtype=object)
        for name in sorted(set(names.tolist())):
            sel = names == name
            per[name] = {"pairs": int(sel.sum()), "accuracy": float((d[sel] > 0).sum() / sel.sum()),
                         "ties": int((d[sel] == 0).sum())}
        out["subsets"] = per
    return out


def _first_error_figures(pred: np.ndarray, true: np.ndarray) -> dict[str, Any]:
    erroneous, clean = true >= 0, true < 0
    acc_err = float((pred[erroneous] == true[erroneous]).mean()) if erroneous.any() else None
    acc_ok = float((pred[clean] == -1).mean()) if clean.any() else None
    return {
        "solutions": int(len(true)), "with_error": int(erroneous.sum()), "all_correct": int(clean.sum()),
        "first_error_accuracy": float((pred == true).mean()),
        "accuracy_with_error": acc_err, "accuracy_all_correct": acc_ok,
        "processbench_f1": f1(acc_err, acc_ok) if acc_err is not None and acc_ok is not None else None,
    }


def process_metrics(p_correct: Sequence[np.ndarray], labels: Sequence[np.ndarray], *,
                    subsets: Sequence[str] | None = None, threshold: float = STEP_THRESHOLD) -> dict[str, Any]:
    """Every figure from exact counts. Steps: accuracy, cross-entropy, precision / recall / F1 of
    the "incorrect" class (positive = a wrong step). Solutions: a solution's predicted first error
    is its first step with P(correct) < threshold (-1: none); ``first_error_accuracy`` is how often
    it equals the labelled first error; ProcessBench's ``processbench_f1`` is the harmonic mean of
    that accuracy on solutions with an error and on those without."""
    if len(p_correct) != len(labels) or not len(labels):
        raise ValueError(f"{len(p_correct)} score arrays for {len(labels)} solutions")
    p = np.concatenate([np.asarray(x, np.float64) for x in p_correct])
    y = np.concatenate([np.asarray(x) for x in labels]).astype(bool)  # True: correct step
    pred_wrong, wrong = p < threshold, ~y
    tp, fp, fn = int((pred_wrong & wrong).sum()), int((pred_wrong & ~wrong).sum()), int((~pred_wrong & wrong).sum())
    eps = 1e-12
    pred_first = np.array([first_error(np.asarray(x) < threshold) for x in p_correct])
    true_first = np.array([first_error(np.asarray(x) == 0) for x in labels])
    out: dict[str, Any] = {
        "threshold": threshold,
        "steps": int(len(y)), "incorrect_steps": int(wrong.sum()),
        "step_accuracy": float((pred_wrong == wrong).mean()),
        "step_accuracy_ci95": list(wilson_interval(int((pred_wrong == wrong).sum()), len(y))),
        "loss": float(-np.where(y, np.log(np.maximum(p, eps)), np.log(np.maximum(1 - p, eps))).mean()),
        **incorrect_class(tp, fp, fn),
        "confusion": {"true_incorrect": tp, "false_incorrect": fp, "missed_incorrect": fn,
                      "true_correct": int((~pred_wrong & ~wrong).sum())},
        "mean_p_correct": {"correct_steps": float(p[y].mean()) if y.any() else None,
                           "incorrect_steps": float(p[wrong].mean()) if wrong.any() else None},
        **_first_error_figures(pred_first, true_first),
    }
    if subsets is not None:
        names = np.asarray(list(subsets), dtype=object)
        out["subsets"] = {name: _first_error_figures(pred_first[names == name], true_first[names == name])
                          for name in sorted(set(names.tolist()))}
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), as Spearman's rho takes them."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for value in np.unique(x):
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def kendall_tau_b(a: np.ndarray, b: np.ndarray) -> float | None:
    """Kendall's tau-b of two score vectors (ties corrected); None when either is constant."""
    da, db = np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :])
    upper = np.triu_indices(len(a), 1)
    da, db = da[upper], db[upper]
    denom = np.sqrt(np.count_nonzero(da) * np.count_nonzero(db))
    return float((da * db).sum() / denom) if denom else None


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def ranking_metrics(rewards: Sequence[np.ndarray], scores: Sequence[np.ndarray]) -> dict[str, Any]:
    """How well each prompt's rewards order its K responses against their labelled scores:
    pairwise accuracy over every pair whose scores differ, right when the better-scored response's
    reward is strictly greater (``schemas.metrics``: a reward tie is not right; ties are counted
    apart), from exact counts; best-of-K accuracy (the top reward is on a best-scored response; a top shared with
    other responses earns its share, as RewardBench 2 credits ties); Kendall's tau-b and
    Spearman's rho, averaged over the prompts where both vary."""
    correct = total = ties = 0.0
    best, taus, rhos = [], [], []
    for r, s in zip(rewards, scores):
        r, s = np.asarray(r, np.float64), np.asarray(s, np.float64)
        ds, dr = s[:, None] - s[None, :], r[:, None] - r[None, :]
        pairs = ds > 0
        total += pairs.sum()
        correct += (dr[pairs] > 0).sum()
        ties += (dr[pairs] == 0).sum()
        if pairs.any():  # a prompt with something to rank (one kept for its ratings alone has not)
            top = r == r.max()
            best.append(float((top & (s == s.max())).sum() / top.sum()))
        for fn, out in ((kendall_tau_b, taus), (spearman, rhos)):
            value = fn(r, s)
            if value is not None:
                out.append(value)
    return {"prompts": len(rewards), "ranked_prompts": len(best), "scored_pairs": int(total),
            "pair_accuracy": correct / total if total else float("nan"),
            "ties": int(ties), "tie_rate": ties / total if total else float("nan"),
            "best_of_k_accuracy": float(np.mean(best)) if best else float("nan"),
            "kendall_tau": float(np.mean(taus)) if taus else float("nan"),
            "spearman": float(np.mean(rhos)) if rhos else float("nan")}
