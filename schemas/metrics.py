"""What a reported metric means, defined once from exact counts: the training logs (window sums,
``trainer.loss``) and ``rmflow eval`` (a whole set, ``rmflow.eval.figures``) compute theirs here,
so a figure logged while training and the same figure in eval.json cannot drift apart.

* A pair is right when the chosen reply's reward is strictly greater (a tie is not right); so
  is each pair of a prompt's K responses whose labelled scores differ, the better-scored one
  taking the chosen reply's place. Reward ties are counted apart.
* A process model predicts a step incorrect when its P(correct) is below ``STEP_THRESHOLD``; the
  incorrect steps are the positive class of precision, recall and F1 (the steps a process
  reward model exists to find).
"""

from __future__ import annotations

import numpy as np

STEP_THRESHOLD = 0.5  # a step is predicted incorrect when P(correct) is below this


def ratio(part: float, whole: float) -> float:
    """``part / whole``, 0 for an empty whole."""
    return part / whole if whole else 0.0


def f1(a: float, b: float) -> float:
    """The harmonic mean of two rates (0 when both are 0)."""
    return ratio(2 * a * b, a + b)


def incorrect_class(true_incorrect: float, false_incorrect: float, missed_incorrect: float) -> dict[str, float]:
    """Precision, recall and F1 of the "incorrect" class from its confusion counts: steps rightly
    predicted incorrect, wrongly predicted incorrect, and incorrect steps predicted correct."""
    precision = ratio(true_incorrect, true_incorrect + false_incorrect)
    recall = ratio(true_incorrect, true_incorrect + missed_incorrect)
    return {"incorrect_precision": precision, "incorrect_recall": recall, "incorrect_f1": f1(precision, recall)}


def first_error(incorrect: np.ndarray) -> int:
    """Index of a solution's first incorrect step (the first True), -1 when none: the label
    ProcessBench scores, and what scoring answers for a solution."""
    hit = np.flatnonzero(incorrect)
    return int(hit[0]) if hit.size else -1
