"""Eval figures against hand-computed values on a small fixture."""

import json
import math

import numpy as np
import pytest

from rmflow.eval.figures import calibration, pair_metrics
from rmflow.eval.reports import report_markdown, write_report

RC = np.array([2.0, 0.0, 1.0, 3.0])
RR = np.array([1.0, 0.0, 2.0, 0.0])  # margins 1, 0 (tie), -1, 3


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_accuracy_ties_loss_and_rewards_by_hand():
    m = pair_metrics(RC, RR, margin=np.array([0.5, 0, 0, 0]))
    assert m["accuracy"] == 0.5 and m["ties"] == 1 and m["tie_rate"] == 0.25  # strict >: the tie is not a win
    loss = (-math.log(sig(0.5)) - math.log(sig(0)) - math.log(sig(-1)) - math.log(sig(3))) / 4
    assert m["loss"] == pytest.approx(loss)
    assert m["margin_mean"] == pytest.approx(0.75)
    assert m["reward_chosen_mean"] == pytest.approx(1.5) and m["reward_rejected_std"] == pytest.approx(np.std(RR))
    brier = ((sig(1) - 1) ** 2 + (0.5 - 1) ** 2 + (sig(-1) - 1) ** 2 + (sig(3) - 1) ** 2) / 4
    assert m["calibration"]["brier"] == pytest.approx(brier)


def test_calibration_by_hand():
    # Confidences of the predicted winner: sig(1)=.731 (right), .5 (tie: half), sig(1)=.731 (wrong), sig(3)=.953 (right)
    m = pair_metrics(RC, RR)
    bins = {b["bin"]: b for b in m["calibration"]["bins"]}
    assert bins[0]["count"] == 1 and bins[0]["accuracy"] == 0.5  # [0.5, 0.55): the tie
    assert bins[4]["count"] == 2 and bins[4]["accuracy"] == 0.5  # [0.70, 0.75): one right, one wrong
    assert bins[9]["count"] == 1 and bins[9]["accuracy"] == 1.0
    ece = (abs(0.5 - 0.5) + 2 * abs(sig(1) - 0.5) + abs(sig(3) - 1)) / 4
    assert m["calibration"]["ece"] == pytest.approx(ece)
    perfect, _ = calibration(np.array([0.8] * 5), np.array([1, 1, 1, 1, 0.0]))
    assert perfect == pytest.approx(0.0)


def test_length_bias_and_subsets():
    m = pair_metrics(RC, RR, len_chosen=np.array([10, 5, 3, 8]), len_rejected=np.array([4, 5, 9, 2]),
                     subsets=["a", "a", "b", "b"])
    lb = m["length_bias"]
    assert lb["longer_wins_accuracy"] == 0.5 and lb["equal_length_pairs"] == 1
    rewards, lengths = np.r_[RC, RR], np.r_[[10, 5, 3, 8], [4, 5, 9, 2]]
    assert lb["reward_length_correlation"] == pytest.approx(np.corrcoef(rewards, lengths)[0, 1])
    assert m["subsets"] == {"a": {"pairs": 2, "accuracy": 0.5, "ties": 1}, "b": {"pairs": 2, "accuracy": 0.5, "ties": 0}}


def test_report_files(tmp_path):
    rng = np.random.default_rng(0)
    rc, rr = rng.normal(1, 1, 200), rng.normal(0, 1, 200)
    m = pair_metrics(rc, rr, len_chosen=rng.integers(1, 50, 200), len_rejected=rng.integers(1, 50, 200))
    files = write_report(m, rc, rr, str(tmp_path), {"model": "x"})
    assert files == ["eval.json", "report.md", "rewards.png", "margins.png", "calibration.png"]
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["config"] == {"model": "x"} and saved["metrics"]["pairs"] == 200
    for png in files[2:]:
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert f"{m['accuracy']:.4f}" in md and "![calibration.png](calibration.png)" in md
    assert report_markdown(m).startswith("# Reward model evaluation")


def test_shape_errors():
    with pytest.raises(ValueError, match="1-D"):
        pair_metrics(RC[:, None], RR)
    with pytest.raises(ValueError, match="no pairs"):
        pair_metrics(np.array([]), np.array([]))


def test_accuracy_interval_is_wilsons():
    from rmflow.eval.figures import wilson_interval

    lo, hi = wilson_interval(8, 10)  # textbook values: 0.490 - 0.943
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 5)[0] == 0.0 and wilson_interval(5, 5)[1] == 1.0
    m = pair_metrics(RC, RR)
    assert m["accuracy_ci95"] == list(wilson_interval(round(m["accuracy"] * m["pairs"]), m["pairs"]))


def test_report_names_model_and_data_and_plots_count_in_whole_pairs(tmp_path, monkeypatch):
    import matplotlib.ticker

    import rmflow.eval.reports as ev

    figures = {}
    real_save = ev._save
    monkeypatch.setattr(ev, "_save", lambda fig, out, name: figures.setdefault(name, fig) and real_save(fig, out, name))
    rng = np.random.default_rng(0)
    rc, rr = rng.normal(1, 1, 12), rng.normal(0, 1, 12)  # a small eval set
    m = pair_metrics(rc, rr)
    write_report(m, rc, rr, str(tmp_path), {"model": "runs/x", "model_description": "run /abs/runs/x, checkpoint "
                                            "step 40 (base: tiny)", "data": ["shards/"], "split": "eval"})
    md = (tmp_path / "report.md").read_text()
    assert "Model: run /abs/runs/x, checkpoint step 40" in md and "Data: shards/, split eval." in md
    lo, hi = m["accuracy_ci95"]
    assert f"{lo:.4f} – {hi:.4f}" in md
    for name in ("rewards.png", "margins.png"):
        (ax,) = figures[name].axes
        locator = ax.yaxis.get_major_locator()
        assert isinstance(locator, matplotlib.ticker.MaxNLocator) and locator._integer
    (ax,) = figures["calibration.png"].axes
    notes = [t.get_text() for t in ax.texts]
    used = [b for b in m["calibration"]["bins"] if b["count"]]
    assert notes == [f"n={b['count']}" for b in used] and sum(b["count"] for b in used) == 12
