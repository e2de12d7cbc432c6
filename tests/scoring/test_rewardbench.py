import numpy as np
import pytest

from rmflow.eval.rewardbench import best_of_n_credit, v1_scores, v2_scores


def test_v1_sections_weight_subsets_by_rewardbench_counts():
    subsets = {"alpacaeval-easy": {"accuracy": 1.0, "pairs": 100}, "mt-bench-easy": {"accuracy": 0.5, "pairs": 28},
               "math-prm": {"accuracy": 0.25, "pairs": 447}, "hep-go": {"accuracy": 1.0, "pairs": 164},
               "my-own": {"accuracy": 0.5, "pairs": 10}}
    out = v1_scores(subsets)
    assert out["sections"]["Chat"] == pytest.approx(100 * (1.0 * 100 + 0.5 * 28) / 128)
    # math-prm counts 984 (upweighted from 447), hep-go 164
    assert out["sections"]["Reasoning"] == pytest.approx(100 * (0.25 * 984 + 1.0 * 164) / (984 + 164))
    # Two sections of four, 4 subsets of 23: no headline score, a partial one flagged as such.
    assert out["complete"] is False and out["score"] is None
    assert out["partial_score"] == pytest.approx((out["sections"]["Chat"] + out["sections"]["Reasoning"]) / 2)
    assert out["subsets_covered"] == 4 and out["subsets_total"] == 23 and "donotanswer" in out["missing_subsets"]
    assert out["other_subsets"] == {"subsets": ["my-own"], "pairs": 10, "accuracy": 50.0}


def test_v1_headline_score_only_when_every_subset_is_present():
    from rmflow.eval.rewardbench import V1_EXAMPLE_COUNTS, V1_SECTIONS

    subsets = {n: {"accuracy": 0.5, "pairs": 10} for n in V1_EXAMPLE_COUNTS}
    out = v1_scores(subsets)
    assert out["complete"] and out["score"] == pytest.approx(50.0) and out["missing_subsets"] == []
    del subsets[V1_SECTIONS["Safety"][0]]
    out = v1_scores(subsets)
    assert not out["complete"] and out["score"] is None and out["missing_subsets"] == [V1_SECTIONS["Safety"][0]]


def test_v2_best_of_four_with_tie_credit():
    chosen = np.array([3.0, 2.0, 2.0, 1.0, 5.0])
    rejected = np.array([[1, 2, 0], [2, 0, 0], [2, 2, 1], [4, 0, 0], [5, 5, 5]], float)
    credit = best_of_n_credit(chosen, rejected)
    assert credit.tolist() == [1.0, 0.5, pytest.approx(1 / 3), 0.0, 0.25]
    out = v2_scores(credit, ["a", "a", "b", "b", "b"])
    assert out["subsets"]["a"]["accuracy"] == 0.75
    assert out["subsets"]["b"]["accuracy"] == pytest.approx((1 / 3 + 0 + 0.25) / 3)
    assert out["score"] == pytest.approx(100 * (0.75 + (1 / 3 + 0.25) / 3) / 2)
    with pytest.raises(ValueError):
        best_of_n_credit(chosen, rejected[:, 0])


def test_v2_ties_subset_scores_as_rewardbench_2_code_does():
    """A hand-worked case of RewardBench 2's Ties rule (allenai/reward-bench process_single_model):
    ref prompts have one correct answer, tied ones several; prompt pairs are matched by number."""
    from rmflow.eval.rewardbench import ties_score

    items = [("ref:1", 1, [3, 1, 2]),      # gap 3 - 2 = 1: right
             ("tied:1", 2, [5, 4, 1, 2]),  # gap 4 - 2 = 2, spread 5 - 4 = 1: right
             ("ref:2", 1, [1, 2]),         # gap -1: wrong
             ("tied:2", 3, [3, 3, 3, 0]),  # gap 3, spread 0: right
             ("tied:3", 2, [1, 0, 2])]     # gap -1: wrong; no ref twin, so in the accuracies only
    out = ties_score([(i, n, np.array(s, float)) for i, n, s in items])
    assert out["tied_accuracy"] == pytest.approx(2 / 3) and out["ref_accuracy"] == 0.5
    assert out["prompt_pairs"] == 2
    assert out["correctness_preferred"] == 1.0  # gap_tied > spread: 2 > 1, 3 > 0
    assert out["correctness_preferred_hard"] == 0.0  # min(gap_ref, gap_tied) > spread: 1 > 1, -1 > 0
    assert out["correctness_margin_score"] == pytest.approx(-0.5)  # tanh(1/1 - 1) = 0, tanh(-1/0 - 1) = -1
    assert out["score"] == pytest.approx(0.3 * 2 / 3 + 0.3 * 0.5 + 0.2 * 1.0 + 0.2 * 0.0 + 0.01 * -0.5)  # 0.545
    v2 = v2_scores(np.array([1.0, 0.0]), ["Focus", "Focus"], {**out, "examples": 5})
    assert v2["subsets"]["Ties"]["accuracy"] == out["score"] and v2["subsets"]["Ties"]["examples"] == 5
    assert v2["score"] == pytest.approx(100 * (0.5 + out["score"]) / 2)  # the mean over the subsets
    with pytest.raises(ValueError, match="ref:N or tied:N"):
        ties_score([("x:1", 1, np.array([1.0, 0.0]))])
