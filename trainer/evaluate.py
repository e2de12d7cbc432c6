"""`rmflow eval`: score preference pairs with a reward model and report what a user needs.

``pair_metrics`` is a pure numpy core over per-pair rewards: pairwise accuracy (strict >,
ties apart), Bradley-Terry loss, margins, reward statistics, calibration of
sigmoid(r_c - r_r) as a preference probability (expected calibration error, Brier score),
a length-bias diagnostic and per-subset accuracy. ``score_pairs`` runs the model over
records; ``write_report`` writes eval.json, report.md and PNG plots.

Process reward models: ``score_steps`` gives P(correct) of every step, ``process_metrics`` the
step figures (accuracy, precision / recall / F1 of the "incorrect" class) and the solution
figures (the first wrong step found exactly; ProcessBench's F1 of the accuracies on solutions
with and without an error), ``write_process_report`` the report.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from schemas.config import SCORING_BATCH_SIZE
from schemas.record import PairRecord, StepRecord
from trainer.data import PackCollate, StepPackCollate
from trainer.data.steps import record_step_values
from trainer.modeling.llama import RewardModel
from trainer.objective import PROCESS
from trainer.step import DEVICE_KEYS, pair_rewards

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


def score_pairs(model: RewardModel, records: Sequence[PairRecord], *, batch_size: int = SCORING_BATCH_SIZE,
                max_length: int | None = None, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rewards of chosen and rejected for each record, in order: the records packed as in
    training (``PackCollate``, one row) and scored by the same ``pair_rewards``."""
    longest = max(max(len(r.chosen_ids), len(r.rejected_ids)) for r in records)
    collate = PackCollate(batch_size, max(max_length or 0, longest), pad_id)
    forward = jax.jit(lambda batch: pair_rewards(model, batch))
    rc, rr = [], []
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        b = collate(chunk)
        c, r = (np.asarray(x) for x in forward({k: b[k] for k in DEVICE_KEYS}))
        rc.append(c[b["pair_slot"]])
        rr.append(r[b["pair_slot"]])
    return np.concatenate(rc), np.concatenate(rr)


def score_sequences(model: RewardModel, sequences: Sequence[np.ndarray], *, batch_size: int = SCORING_BATCH_SIZE,
                    pad_id: int = 0, progress=None) -> np.ndarray:
    """The reward of each token sequence (at its last token), batched in length order to waste
    little padding; returned in the input order."""
    from trainer.data import bucket_length

    @jax.jit
    def forward(ids, pos, seg, idx):
        return model(ids, pos, seg, idx)

    order = np.argsort([len(s) for s in sequences], kind="stable")
    scores = np.zeros(len(sequences), np.float32)
    longest_allowed = max(len(s) for s in sequences)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        length = bucket_length(max(len(sequences[i]) for i in chunk), longest_allowed)
        ids = np.full((batch_size, length), pad_id, np.int32)
        seg = np.zeros_like(ids)
        last = np.zeros(batch_size, np.int32)
        for row, i in enumerate(chunk):
            n = len(sequences[i])
            ids[row, :n], seg[row, :n], last[row] = sequences[i], 1, n - 1
        pos = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape)
        scores[chunk] = np.asarray(forward(ids, pos, seg, last))[: len(chunk)]
        if progress:
            progress(len(chunk))
    return scores


def write_report(metrics: dict[str, Any], rc: np.ndarray, rr: np.ndarray, output: str,
                 config: dict[str, Any]) -> list[str]:
    """eval.json (all figures and the config), report.md and PNG plots; returns the files written."""
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "eval.json"), "w") as f:
        json.dump({"metrics": metrics, "config": config}, f, indent=2, sort_keys=True)
    plots = _plots(metrics, rc, rr, output)
    with open(os.path.join(output, "report.md"), "w") as f:
        f.write(report_markdown(metrics, plots, config))
    return ["eval.json", "report.md", *plots]


def report_markdown(m: dict[str, Any], plots: Sequence[str] = (), config: dict[str, Any] | None = None) -> str:
    lines = ["# Reward model evaluation", "", *_source_lines(m, config or {})]
    lo, hi = m["accuracy_ci95"]
    lines += [f"{m['pairs']:,} pairs.", "", "| figure | value |", "| --- | ---: |"]
    rows = [("accuracy (chosen scored strictly higher)", f"{m['accuracy']:.4f}"),
            ("accuracy, 95% confidence interval (Wilson)", f"{lo:.4f} – {hi:.4f}"),
            ("ties (equal rewards)", f"{m['ties']:,}"),
            ("loss (-log σ(r_c - r_r - margin))", f"{m['loss']:.4f}"),
            ("mean margin r_c - r_r", f"{m['margin_mean']:.4f}"),
            ("chosen reward mean ± std", f"{m['reward_chosen_mean']:.4f} ± {m['reward_chosen_std']:.4f}"),
            ("rejected reward mean ± std", f"{m['reward_rejected_mean']:.4f} ± {m['reward_rejected_std']:.4f}"),
            ("expected calibration error", f"{m['calibration']['ece']:.4f}"),
            ("Brier score", f"{m['calibration']['brier']:.4f}")]
    if "length_bias" in m:
        lb = m["length_bias"]
        rows += [("baseline: the longer reply wins", f"{lb['longer_wins_accuracy']:.4f}"),
                 ("correlation of reward with reply length", f"{lb['reward_length_correlation']:.4f}")]
    lines += [f"| {a} | {b} |" for a, b in rows]
    if m.get("subsets"):
        lines += ["", "## Per subset", "", "| subset | pairs | accuracy |", "| --- | ---: | ---: |"]
        lines += [f"| {k} | {v['pairs']:,} | {v['accuracy']:.4f} |" for k, v in m["subsets"].items()]
    if m.get("rewardbench_v1"):
        lines += ["", *rewardbench_v1_lines(m["rewardbench_v1"])]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _source_lines(m: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The report's "Model: ... Data: ..." lines."""
    lines = []
    if config.get("model_description"):
        lines.append(f"Model: {config['model_description']}.  ")
    if config.get("data"):
        split = f", split {config['split']}" if config.get("split") and not m.get("input") else ""
        lines.append(f"Data: {', '.join(map(str, config['data']))}{split}.  ")
    return lines


def rewardbench_v1_lines(rb: dict[str, Any]) -> list[str]:
    if rb["complete"]:
        head = [f"## RewardBench v1: score {rb['score']:.2f}"]
    else:
        head = ["## RewardBench v1: incomplete, no overall score",
                "", f"The data covers {rb['subsets_covered']} of {rb['subsets_total']} RewardBench v1 subsets "
                f"(missing: {', '.join(rb['missing_subsets'])}). Section scores below cover only the subsets "
                "present; their mean over the sections present, "
                + (f"{rb['partial_score']:.2f}, " if rb["partial_score"] is not None else "")
                + "is not comparable with published RewardBench scores."]
    lines = [*head, "", "| section | score |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.2f} |" for k, v in rb["sections"].items()]
    if rb.get("other_subsets"):
        o = rb["other_subsets"]
        lines += ["", f"Subsets outside RewardBench v1 ({', '.join(o['subsets'])}): {o['pairs']:,} pairs, "
                  f"accuracy {o['accuracy']:.2f}%, not in any section."]
    return lines


def _plots(m: dict[str, Any], rc: np.ndarray, rr: np.ndarray, output: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.histogram_bin_edges(np.concatenate([rc, rr]), bins=40)
    ax.hist(rc, bins=bins, alpha=0.6, label="chosen", color="tab:green")
    ax.hist(rr, bins=bins, alpha=0.6, label="rejected", color="tab:red")
    ax.set(xlabel="reward", ylabel="replies", title="Rewards of chosen and rejected replies")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: whole numbers
    ax.legend()
    files.append(_save(fig, output, "rewards.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(rc - rr, bins=40, color="tab:blue")
    ax.axvline(0, color="black", linewidth=1)
    ax.set(xlabel="margin r_chosen - r_rejected", ylabel="pairs",
           title=f"Margins (accuracy {m['accuracy']:.3f}: right of the line)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    files.append(_save(fig, output, "margins.png"))
    fig, ax = plt.subplots(figsize=(5, 5))
    table = m["calibration"]["bins"]
    ax.plot([0.5, 1], [0.5, 1], color="grey", linestyle="--", label="perfect calibration")
    table = [b for b in table if b["count"]]
    ax.plot([b["confidence"] for b in table], [b["accuracy"] for b in table], marker="o", label="model")
    for b in table:  # how many pairs each point stands on
        ax.annotate(f"n={b['count']:,}", (b["confidence"], b["accuracy"]), textcoords="offset points",
                    xytext=(0, 7), ha="center", fontsize=7)
    ax.set(xlabel="confidence in the predicted winner, max(p, 1-p)", ylabel="accuracy",
           title=f"Calibration (ECE {m['calibration']['ece']:.3f})", xlim=(0.5, 1), ylim=(0, 1.02))
    ax.legend()
    files.append(_save(fig, output, "calibration.png"))
    return files


def _save(fig, output: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(output, name), dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name


# --------------------------------------------------------------------------- process reward models

STEP_THRESHOLD = 0.5  # a step is predicted incorrect when P(correct) is below this


def score_steps(model: RewardModel, records: Sequence[StepRecord], *, batch_size: int = SCORING_BATCH_SIZE,
                max_length: int | None = None, pad_id: int = 0) -> list[np.ndarray]:
    """P(correct) of each step of each record, in order: the records packed as in training
    (``StepPackCollate``, one row) and scored by the model's step logits."""
    longest = max(len(r.input_ids) for r in records)
    collate = StepPackCollate(batch_size, max(max_length or 0, longest), pad_id)
    forward = jax.jit(lambda b: jax.nn.softmax(model.logits(b["input_ids"], b["positions"], b["segment_ids"],
                                                            b["reward_index"], b["branch_ids"]), axis=-1)[..., 1])
    out: list[np.ndarray] = []
    for i in range(0, len(records), batch_size):
        b = collate(records[i : i + batch_size])
        p = np.asarray(forward({k: b[k] for k in PROCESS.device_keys}))
        out += record_step_values(p, b["record_steps"])
    return out


def first_error(incorrect: np.ndarray) -> int:
    """Index of the first True (an incorrect step), -1 when none."""
    hit = np.flatnonzero(incorrect)
    return int(hit[0]) if hit.size else -1


def _f1(a: float, b: float) -> float:
    return 2 * a * b / (a + b) if a + b else 0.0


def _first_error_figures(pred: np.ndarray, true: np.ndarray) -> dict[str, Any]:
    erroneous, clean = true >= 0, true < 0
    acc_err = float((pred[erroneous] == true[erroneous]).mean()) if erroneous.any() else None
    acc_ok = float((pred[clean] == -1).mean()) if clean.any() else None
    return {
        "solutions": int(len(true)), "with_error": int(erroneous.sum()), "all_correct": int(clean.sum()),
        "first_error_accuracy": float((pred == true).mean()),
        "accuracy_with_error": acc_err, "accuracy_all_correct": acc_ok,
        "processbench_f1": _f1(acc_err, acc_ok) if acc_err is not None and acc_ok is not None else None,
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
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    eps = 1e-12
    pred_first = np.array([first_error(np.asarray(x) < threshold) for x in p_correct])
    true_first = np.array([first_error(np.asarray(x) == 0) for x in labels])
    out: dict[str, Any] = {
        "kind": "process",
        "threshold": threshold,
        "steps": int(len(y)), "incorrect_steps": int(wrong.sum()),
        "step_accuracy": float((pred_wrong == wrong).mean()),
        "step_accuracy_ci95": list(wilson_interval(int((pred_wrong == wrong).sum()), len(y))),
        "loss": float(-np.where(y, np.log(np.maximum(p, eps)), np.log(np.maximum(1 - p, eps))).mean()),
        "incorrect_precision": precision, "incorrect_recall": recall, "incorrect_f1": _f1(precision, recall),
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


def write_process_report(metrics: dict[str, Any], p_correct: Sequence[np.ndarray], labels: Sequence[np.ndarray],
                         output: str, config: dict[str, Any]) -> list[str]:
    """eval.json, report.md and a plot of P(correct) for correct and incorrect steps."""
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "eval.json"), "w") as f:
        json.dump({"metrics": metrics, "config": config}, f, indent=2, sort_keys=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = np.concatenate([np.asarray(x) for x in p_correct])
    y = np.concatenate([np.asarray(x) for x in labels]).astype(bool)
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.linspace(0, 1, 41)
    ax.hist(p[y], bins=bins, alpha=0.6, label="correct steps", color="tab:green")
    ax.hist(p[~y], bins=bins, alpha=0.6, label="incorrect steps", color="tab:red")
    ax.axvline(metrics["threshold"], color="black", linewidth=1)
    ax.set(xlabel="P(step is correct)", ylabel="steps", title="Step scores by label", yscale="log")
    ax.legend()
    plots = [_save(fig, output, "step_scores.png")]
    with open(os.path.join(output, "report.md"), "w") as f:
        f.write(process_report_markdown(metrics, plots, config))
    return ["eval.json", "report.md", *plots]


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def process_report_markdown(m: dict[str, Any], plots: Sequence[str] = (), config: dict[str, Any] | None = None) -> str:
    lines = ["# Process reward model evaluation", "", *_source_lines(m, config or {})]
    lo, hi = m["step_accuracy_ci95"]
    lines += [f"{m['solutions']:,} solutions ({m['with_error']:,} with a wrong step), {m['steps']:,} labelled steps "
              f"({m['incorrect_steps']:,} incorrect). A step is predicted incorrect when P(correct) < "
              f"{m['threshold']}.", "", "| figure | value |", "| --- | ---: |"]
    rows = [("step accuracy", f"{m['step_accuracy']:.4f}"), ("step accuracy, 95% interval (Wilson)", f"{lo:.4f} – {hi:.4f}"),
            ("step cross-entropy", f"{m['loss']:.4f}"),
            ("incorrect steps: precision", f"{m['incorrect_precision']:.4f}"),
            ("incorrect steps: recall", f"{m['incorrect_recall']:.4f}"),
            ("incorrect steps: F1", f"{m['incorrect_f1']:.4f}"),
            ("first wrong step found exactly (all solutions)", f"{m['first_error_accuracy']:.4f}"),
            ("  on solutions with an error", _fmt(m["accuracy_with_error"])),
            ("  on solutions without one (none flagged)", _fmt(m["accuracy_all_correct"])),
            ("ProcessBench F1 (harmonic mean of the two)", _fmt(m["processbench_f1"]))]
    lines += [f"| {a} | {b} |" for a, b in rows]
    if m.get("subsets"):
        lines += ["", "## Per subset", "", "| subset | solutions | with error | first error found | ProcessBench F1 |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {v['solutions']:,} | {v['with_error']:,} | {v['first_error_accuracy']:.4f} | "
                  f"{_fmt(v['processbench_f1'])} |" for k, v in m["subsets"].items()]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"
