"""Evaluation reports: ``eval.json`` (the metrics and the config that produced them), ``report.md``
and PNG plots, for each reward model kind and benchmark mode; and the rows of the summary
table ``rmflow eval`` prints. Rendering only: the numbers come from ``rmflow.eval.figures``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from rmflow.eval.ensemble import markdown_lines as ensemble_lines
from rmflow.eval.probes import probe_lines
from rmflow.schemas import jsontext
from rmflow.schemas.kinds import ModelKind
from rmflow.schemas.outputs import EVAL_FILE, REPORT_FILE


def write_eval(output: str, metrics: dict[str, Any], config: dict[str, Any], markdown: str,
               plots: Sequence[str] = ()) -> list[str]:
    """An eval folder's files: eval.json (every figure and the config), report.md (``markdown``)
    beside the ``plots`` already saved there; returns the files written."""
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, EVAL_FILE), "w") as f:
        jsontext.dump({"metrics": metrics, "config": config}, f, indent=2, sort_keys=True)
    with open(os.path.join(output, REPORT_FILE), "w") as f:
        f.write(markdown)
    return [EVAL_FILE, REPORT_FILE, *plots]


def write_report(metrics: dict[str, Any], rc: np.ndarray, rr: np.ndarray, output: str,
                 config: dict[str, Any]) -> list[str]:
    """An outcome reward model's eval: eval.json, report.md and PNG plots."""
    os.makedirs(output, exist_ok=True)
    plots = _plots(metrics, rc, rr, output)
    return write_eval(output, metrics, config, report_markdown(metrics, plots, config), plots)


def report_markdown(m: dict[str, Any], plots: Sequence[str] = (), config: dict[str, Any] | None = None) -> str:
    lines = ["# Reward model evaluation", "", *_source_lines(m, config or {}), *input_lines(m)]
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
    length = next((p for p in m.get("probes", []) if p["name"] == "length-controlled accuracy"), None)
    if length and length.get("bins"):
        lines += ["", "## Accuracy by length difference", "", "| chosen minus rejected reply (tokens) | pairs | "
                  "accuracy | 95% interval |", "| --- | ---: | ---: | ---: |"]
        for b in length["bins"]:
            lo, hi = b["chosen_minus_rejected_tokens"]
            span = f"under {hi}" if lo is None else f"{lo} or more" if hi is None else f"{lo} to {hi - 1}"
            lines.append(f"| {span} | {b['pairs']:,} | {b['accuracy']:.4f} | {b['accuracy_ci95'][0]:.4f} – "
                         f"{b['accuracy_ci95'][1]:.4f} |")
    if m.get("ensemble"):
        lines += ensemble_lines(m["ensemble"])
    if m.get("probes"):
        lines += ["", "## Sanity probes", "", *(f"* {x}" for x in probe_lines(m["probes"]))]
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


def input_lines(m: dict[str, Any]) -> list[str]:
    """What a report says of its raw inputs (``m["input"]``, from their in-process preprocessing:
    what was read, what was not evaluated and why) and of how their labels were made (the
    attribute weights a layout's scores are the weighted sum of)."""
    lines = []
    summary = m.get("input")
    if summary:
        read = summary["counts"].get("records_read", 0)
        left = summary.get("left_out", [])
        lines.append(f"Raw inputs: {read:,} records read" + ("; not evaluated: " + "; ".join(
            f"{x['count']:,} {x['why']}" for x in left) + " (each with its reason in input_errors.jsonl)" if left
            else "; every one evaluated") + ".  ")
    weights = m.get("label_weights")
    if weights:
        lines.append(f"Labels: each response's score is the weighted sum of its attribute ratings, "
                     f"{weights['weights']} ({weights['from']}).  ")
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


def ranking_plot(rewards: Sequence[np.ndarray], scores: Sequence[np.ndarray], output: str) -> str:
    """A box plot of each response's reward less its prompt's mean, by the rank of its label within
    its prompt (1: the best-labelled; equal labels share a rank): a model that ranks as the labels
    do climbs from right to left. Saved as ``ranking.png``; returns its name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_rank: dict[int, list[float]] = {}
    for r, s in zip(rewards, scores):
        r, s = np.asarray(r, np.float64), np.asarray(s, np.float64)
        levels = np.unique(s)[::-1]
        for reward, score in zip(r - r.mean(), s):
            by_rank.setdefault(int(np.searchsorted(-levels, -score)) + 1, []).append(float(reward))
    ranks = sorted(by_rank)[:10]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([by_rank[k] for k in ranks], showfliers=False)
    ax.set_xticks(range(1, len(ranks) + 1), [str(k) for k in ranks])
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set(xlabel="label rank within the prompt (1: best)", ylabel="reward - the prompt's mean reward",
           title="Rewards by label rank")
    return _save(fig, output, "ranking.png")


def write_process_report(metrics: dict[str, Any], p_correct: Sequence[np.ndarray], labels: Sequence[np.ndarray],
                         output: str, config: dict[str, Any]) -> list[str]:
    """A process reward model's eval: eval.json, report.md and a plot of P(correct) for correct and
    incorrect steps."""
    os.makedirs(output, exist_ok=True)
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
    return write_eval(output, metrics, config, process_report_markdown(metrics, plots, config), plots)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def process_report_markdown(m: dict[str, Any], plots: Sequence[str] = (), config: dict[str, Any] | None = None) -> str:
    lines = ["# Process reward model evaluation", "", *_source_lines(m, config or {}), *input_lines(m)]
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

def rewardbench_v2_markdown(m: dict[str, Any], model: str = "", data: list[str] = ()) -> str:
    rb = m["rewardbench_v2"]
    lines = ["# RewardBench 2 (best-of-n, 1/k credit for ties)", ""]
    if model:
        lines.append(f"Model: {model}.  ")
    if data:
        lines.append(f"Data: {', '.join(data)}.  ")
    lines += [f"{m['examples']:,} examples of {m['completions_per_example']} completions. Score: {rb['score']:.2f}"]
    skipped = m.get("skipped") or {}
    if skipped.get("count"):  # the score is over what could be scored: said, never hidden
        lines += ["", f"{skipped['count']:,} records skipped, so the score is not over the whole benchmark ("
                  + ", ".join(f"{k} x{v}" for k, v in sorted(skipped["reasons"].items()))
                  + f"; the first, {skipped['first']})."]
    lines += ["", "| subset | examples | accuracy |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v['examples']:,} | {v['accuracy']:.4f} |" for k, v in rb["subsets"].items()]
    ties = rb["subsets"].get("Ties", {}).get("ties")
    if ties:
        lines += ["", "Ties (RewardBench 2's rule: 0.3 tied accuracy + 0.3 ref accuracy + 0.2 correctness preferred "
                  "+ 0.2 correctness preferred (hard) + 0.01 margin score):", ""]
        lines += [f"* {k.replace('_', ' ')}: {v:.4f}" for k, v in ties.items() if isinstance(v, float)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the summary `rmflow eval` prints


def pair_summary(m: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    if "rewardbench_v2" in m:
        skipped = (m.get("skipped") or {}).get("count", 0)
        return (f"rmflow eval: RewardBench 2, {m['examples']:,} examples"
                + (f", {skipped:,} records skipped (report.md says why)" if skipped else ""),
                [("RewardBench 2 score", f"{m['rewardbench_v2']['score']:.2f}")])
    if "ranking" in m:
        r = m["ranking"]
        left = sum(x["count"] for x in m.get("input", {}).get("left_out", []))
        skipped = f", {left:,} records or responses not evaluated (report.md says why)" if left else ""
        return (f"rmflow eval: {r['prompts']:,} prompts, {r['responses']:,} responses{skipped}",
                [(label, f"{figure(r[key], 4)} (length-only: {figure(r['length_baseline'][key], 4)})")
                 for key, label in (("pair_accuracy", "pairwise accuracy"), ("best_of_k_accuracy", "best-of-K accuracy"),
                                    ("kendall_tau", "Kendall's tau"), ("spearman", "Spearman's rho"))])
    lo, hi = m["accuracy_ci95"]
    rows = [("accuracy", f"{m['accuracy']:.4f}"), ("  95% interval", f"{lo:.4f} – {hi:.4f}"),
            ("ties", f"{m['ties']:,}"), ("loss", f"{m['loss']:.4f}"),
            ("mean margin", f"{m['margin_mean']:.4f}"), ("ECE", f"{m['calibration']['ece']:.4f}"),
            ("Brier", f"{m['calibration']['brier']:.4f}")]
    if "length_bias" in m:
        rows.append(("longer-reply baseline", f"{m['length_bias']['longer_wins_accuracy']:.4f}"))
    if "ensemble" in m:
        e = m["ensemble"]
        rows += [("members' accuracy (mean)", figure(e["member_accuracy_mean"], 4)),
                 ("members' mean: accuracy", figure(e["mean_accuracy"], 4)),
                 ("disagreement AUROC (misordered)", figure(e["spread_auroc_misordered"], 4))]
    if "rewardbench_v1" in m:
        rb = m["rewardbench_v1"]
        if rb["complete"]:
            rows.append(("RewardBench v1 score", f"{rb['score']:.2f}"))
        else:
            rows.append(("RewardBench v1 score", f"incomplete: {rb['subsets_covered']} of {rb['subsets_total']} subsets"))
            for section, value in rb["sections"].items():
                rows.append((f"  {section} (subsets present only)", f"{value:.2f}"))
    return f"rmflow eval: {m['pairs']:,} pairs", rows


def process_summary(m: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    rows = [("step accuracy", _fmt(m["step_accuracy"])), ("step cross-entropy", _fmt(m["loss"])),
            ("incorrect steps: precision", _fmt(m["incorrect_precision"])),
            ("incorrect steps: recall", _fmt(m["incorrect_recall"])), ("incorrect steps: F1", _fmt(m["incorrect_f1"])),
            ("first wrong step found", _fmt(m["first_error_accuracy"])),
            ("  solutions with an error", _fmt(m["accuracy_with_error"])),
            ("  solutions without", _fmt(m["accuracy_all_correct"])),
            ("ProcessBench F1", _fmt(m["processbench_f1"]))]
    return f"rmflow eval (process reward model): {m['solutions']:,} solutions, {m['steps']:,} steps", rows



def eval_summary(m: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    """The title and rows of the table `rmflow eval` prints for an eval's metrics."""
    from rmflow.handlers import handler

    return handler(m["kind"], "summary")(m)


def figure(value: Any, digits: int) -> str:
    """A metric as a report shows it: "n/a" where it is absent or not a number (a figure over nothing)."""
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def training_progress(kind: ModelKind, rec: dict[str, Any]) -> str:
    """A training metrics record as users follow it while the run trains (`rmflow train`'s
    progress bar, a workflow's log): the loss, the kind's headline accuracy (train and, in a
    record that has eval metrics, eval; "n/a" over no pair whose labels differ) and the throughput."""
    acc = kind.headline[0]
    label = acc.replace("_", " ")
    text = f"loss {figure(rec.get('loss'), 4)}, {label} {figure(rec.get(acc), 3)}"
    if "eval_loss" in rec:  # a record of a step that evaluated the eval split
        text += f", eval {label} {figure(rec.get(f'eval_{acc}'), 3)}"
    return text + f", {rec.get('tokens_per_second', 0):,.0f} tokens/s"


def training_result(kind: ModelKind, history: list[dict[str, Any]]) -> str:
    """What a finished run's last evaluation says, in a few words: its headline accuracy, "no
    eval split" when the run had none, "n/a" over no pair whose labels differ."""
    evals = [r for r in history if "eval_loss" in r]
    label = kind.headline[0].replace("_", " ")
    if not evals:
        return "no eval split"
    value = evals[-1].get(f"eval_{kind.headline[0]}")
    return f"eval {label} {figure(value, 4)}" + ("" if value is not None else
                                                 f" (no {kind.units} whose labels differ)")
