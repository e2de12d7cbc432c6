"""Sanity probes: checks an outcome model's eval runs beside its figures, each a pass/fail line
(in report.md, in eval.json's ``probes``, and printed by `rmflow eval`), so that a broken model
or a broken scoring path fails loudly instead of reporting a plausible number.

* ``better than chance`` (pairs): the accuracy's 95% interval lies above 0.5. Entirely below it,
  the model prefers the rejected replies (labels swapped in its training data, or in these);
  around it, the model shows no preference (an untrained or reinitialised head, too little
  training, or too few pairs to tell: the line says how many).
* ``swapped labels`` (pairs): the pairs scored again with chosen and rejected exchanged (packed
  afresh, each side elsewhere in its row) give every pair the opposite verdict, so the accuracy
  is 1 - accuracy - tie rate; a reward read from a side's place, not its reply, breaks it.
* ``reward at the last token``: a conversation's score is the same alone in its row, padded to
  at least twice its length, and packed twice over beside others (at an offset in its row); and
  it moves when its final token is dropped. A score read from padding, or from a fixed position,
  fails it.
* ``length-controlled accuracy`` (pairs): pairs binned by how much longer the chosen reply is
  than the rejected one; the mean of the accuracy where the chosen reply is longer and where it
  is shorter, so that a model which only prefers longer (or shorter) replies scores 0.5. Fails
  at 0.5 or below.
* ``style and substance`` (K responses in RM-Bench's layout: three chosen then three rejected,
  each group concise, detailed plain, detailed markdown; over the prompts that kept all six): the 3 x 3 table of how often a chosen
  response of one style beats a rejected one of another; hard (the chosen response plainer than
  the rejected one), normal (same style) and easy accuracy. Fails when hard accuracy is below 0.5:
  the model prefers style to substance.

The pure figures here take scores and lengths; ``pair_probes`` and ``sequence_probe`` score
what they need through the model's own scorers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rmflow.eval.figures import wilson_interval

CHANCE = 0.5
# A score is "the same" across placements within this share of the scores' spread (float
# rounding differs between programs), and "moved" by a dropped token beyond it.
SAME_SCORE = 1e-3
MOVED_SHARE = 0.9  # the share of probed conversations whose score must move without its final token
PROBED_SEQUENCES = 32  # conversations the last-token probe scores, taken evenly from those it can double
# length bins: chosen reply minus rejected reply, in tokens
LENGTH_EDGES = (-64, -8, 8, 64)
STYLES = ("concise", "detailed_plain", "detailed_markdown")  # RM-Bench's order in each group of three


def probe(name: str, passed: bool, line: str, **details: Any) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "line": line, **details}


def chance_probe(accuracy: float, pairs: int) -> dict[str, Any]:
    lo, hi = wilson_interval(int(round(accuracy * pairs)), pairs)
    figures = f"accuracy {accuracy:.4f}, 95% interval {lo:.4f}-{hi:.4f} over {pairs:,} pairs"
    if lo > CHANCE:
        return probe("better than chance", True, f"{figures}: above chance")
    if hi < CHANCE:
        return probe("better than chance", False, f"{figures}: below chance, the model prefers the rejected replies "
                     "(chosen and rejected swapped in its training data, or in these?)")
    return probe("better than chance", False, f"{figures}: not distinguishable from chance (an untrained or "
                 "reinitialised score head, too little training" + (", or too few pairs to tell" if pairs < 400 else "")
                 + ")")


def swapped_probe(d: np.ndarray, d_swapped: np.ndarray, scale: float) -> dict[str, Any]:
    """``d``: r_chosen - r_rejected of each pair; ``d_swapped``: the same with the sides exchanged."""
    tol = SAME_SCORE * scale
    accuracy, ties = float((d > 0).mean()), float((d == 0).mean())
    swapped = float((d_swapped > 0).mean())
    wrong = int(((np.sign(d_swapped) != -np.sign(d)) & (np.abs(d) > tol)).sum())
    line = (f"accuracy with chosen and rejected exchanged {swapped:.4f}, against 1 - {accuracy:.4f} - ties {ties:.4f}"
            f" = {1 - accuracy - ties:.4f}")
    if wrong:
        return probe("swapped labels", False, f"{line}: {wrong:,} pairs keep their verdict when their sides are "
                     "exchanged (a reward read from a side's place, not its reply)", pairs_kept=wrong)
    return probe("swapped labels", True, line)


def last_token_probe(alone: np.ndarray, padded: np.ndarray, packed: np.ndarray, shorter: np.ndarray,
                     scale: float) -> dict[str, Any]:
    """Scores of the same conversations alone, padded to twice their length, each of two copies in
    one packed row ((n, 2)), and without their final token."""
    tol = SAME_SCORE * scale + 1e-6 * float(np.abs(alone).max())  # float32 rounding of large scores
    off = max(float(np.abs(padded - alone).max()), float(np.abs(packed - alone[:, None]).max()))
    moved = float((np.abs(shorter - alone) > tol).mean())
    line = (f"{len(alone)} conversations: largest change padded or packed {off:.1e} (tolerance {tol:.1e}); moved by "
            f"dropping the final token: {moved:.0%}")
    if off > tol:
        return probe("reward at the last token", False, f"{line}: the score depends on padding or placement",
                     largest_change=off)
    if moved < MOVED_SHARE:
        return probe("reward at the last token", False, f"{line}: the score barely depends on the final token (read "
                     "at a fixed position?)", moved=moved)
    return probe("reward at the last token", True, line, largest_change=off, moved=moved)


def length_bins(d: np.ndarray, len_diff: np.ndarray) -> list[dict[str, Any]]:
    edges = (-np.inf, *LENGTH_EDGES, np.inf)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (len_diff >= lo) & (len_diff < hi) if np.isfinite(lo) else len_diff < hi
        if sel.any():
            n, right = int(sel.sum()), int((d[sel] > 0).sum())
            out.append({"chosen_minus_rejected_tokens": [None if not np.isfinite(lo) else int(lo),
                                                         None if not np.isfinite(hi) else int(hi)],
                        "pairs": n, "accuracy": right / n, "accuracy_ci95": list(wilson_interval(right, n))})
    return out


def length_probe(d: np.ndarray, len_diff: np.ndarray) -> dict[str, Any]:
    longer, shorter = len_diff > 0, len_diff < 0
    bins = length_bins(d, len_diff)
    if not longer.any() or not shorter.any():
        return probe("length-controlled accuracy", True, "every chosen reply is " + ("longer" if longer.any() else
                     "shorter" if shorter.any() else "as long as") + " than its rejected one: nothing to control for",
                     bins=bins, controlled=None)
    acc_longer, acc_shorter = float((d[longer] > 0).mean()), float((d[shorter] > 0).mean())
    controlled = (acc_longer + acc_shorter) / 2
    line = (f"{controlled:.4f} (chosen longer: {acc_longer:.4f} over {int(longer.sum()):,} pairs; chosen shorter: "
            f"{acc_shorter:.4f} over {int(shorter.sum()):,})")
    details = {"bins": bins, "controlled": controlled, "chosen_longer": acc_longer, "chosen_shorter": acc_shorter}
    if controlled <= CHANCE:
        return probe("length-controlled accuracy", False, f"{line}: no better than chance once length is controlled "
                     "for (what accuracy it has comes from preferring longer or shorter replies)", **details)
    return probe("length-controlled accuracy", True, line, **details)


def style_substance(rewards: Sequence[np.ndarray]) -> dict[str, Any] | None:
    """RM-Bench's table over the prompts of six rewards (three chosen, three rejected, each in
    ``STYLES`` order): ``table[i][j]`` is how often the chosen response of style i beats the
    rejected one of style j; hard, normal and easy the means above, on and below the diagonal."""
    six = np.asarray([r for r in rewards if len(r) == 6], np.float64)
    if not len(six):
        return None
    chosen, rejected = six[:, :3], six[:, 3:]
    table = (chosen[:, :, None] > rejected[:, None, :]).mean(0)
    upper, lower = np.triu_indices(3, 1), np.tril_indices(3, -1)
    return {"prompts": len(six), "styles": list(STYLES), "table": table.tolist(),
            "hard": float(table[upper].mean()), "normal": float(np.diag(table).mean()),
            "easy": float(table[lower].mean())}


def style_probe(rewards: Sequence[np.ndarray]) -> dict[str, Any] | None:
    t = style_substance(rewards)
    if t is None:
        return None
    line = f"hard {t['hard']:.4f}, normal {t['normal']:.4f}, easy {t['easy']:.4f} over {t['prompts']:,} prompts"
    if t["hard"] < CHANCE:
        return probe("style and substance", False, f"{line}: a plainer correct response loses to a more styled wrong "
                     "one (the model prefers style to substance)", **t)
    return probe("style and substance", True, line, **t)


def rm_bench_whole(record) -> bool:
    """A record in RM-Bench's layout with all six of its responses: three chosen of one score, then
    three rejected of a lower one (a record that lost one, too long say, no longer says which
    style each holds)."""
    s = record.scores
    return record.k == 6 and len(set(s[:3].tolist())) == len(set(s[3:].tolist())) == 1 and s[0] > s[3]


# --------------------------------------------------------------------------- scoring what the probes need


def sequence_probe(rm, sequences: Sequence[np.ndarray], scale: float) -> dict[str, Any]:
    """``last_token_probe`` over up to ``PROBED_SEQUENCES`` of ``sequences`` (each the tokens up
    to its reward's), scored through ``rm``'s scorers (``RewardModel``): one a row in the shapes
    of the set, padded to twice their length, twice over in one packed row, and without their
    final token."""
    from rmflow.trainer.inference import PackedScorer, PackedShapes

    pool = [np.asarray(s, np.int32) for s in sequences if 2 <= len(s) and 2 * len(s) <= rm.positions]
    step = max(1, len(pool) // PROBED_SEQUENCES)
    seqs = pool[::step][:PROBED_SEQUENCES]
    if not seqs:
        return probe("reward at the last token", True, "no conversation short enough to probe at twice its length")
    alone = rm.score_ids(seqs, deterministic=True)
    longest = 2 * max(map(len, seqs))  # every one padded to at least twice its length, in one program
    padded = rm.scorer(rm.shapes(deterministic=True)).run_padded(seqs, longest)
    rows = PackedShapes(rm.positions, token_budget=4 * longest, row_length=longest)
    got = PackedScorer(rm.model, rows, pad_id=rm.pad_id).run_items([s for s in seqs for _ in range(2)])
    packed = np.asarray([r for r, _ in got], np.float64).reshape(len(seqs), 2)
    shorter = rm.score_ids([s[:-1] for s in seqs], deterministic=True)
    return last_token_probe(alone, padded, packed, shorter, scale)


def pair_probes(rm, records, rc: np.ndarray, rr: np.ndarray, *, batch_size: int) -> list[dict[str, Any]]:
    """Every probe of a pair eval: ``records`` (PairRecords) and their rewards ``rc``, ``rr``."""
    import dataclasses

    d = np.asarray(rc, np.float64) - np.asarray(rr, np.float64)
    scale = float(np.concatenate([rc, rr]).std()) or 1.0
    swapped = [dataclasses.replace(r, chosen_ids=r.rejected_ids, rejected_ids=r.chosen_ids,
                                   chosen_last=r.rejected_last, rejected_last=r.chosen_last) for r in records]
    sc, sr = rm.score_records(swapped, batch_size=batch_size)
    len_diff = np.asarray([(r.chosen_last - r.rejected_last) for r in records], np.float64)
    seqs = [r.chosen_ids[: r.chosen_last + 1] for r in records]
    return [chance_probe(float((d > 0).mean()), len(d)),
            swapped_probe(d, np.asarray(sc, np.float64) - np.asarray(sr, np.float64), scale),
            sequence_probe(rm, seqs, scale),
            length_probe(d, len_diff)]


def response_probes(rm, records, rewards: Sequence[np.ndarray]) -> list[dict[str, Any]]:
    """The probes of a K-response eval: the last-token probe on the first response of each prompt,
    and, over the records in RM-Bench's layout (``rm_bench_whole``), style and substance."""
    scale = float(np.concatenate(list(rewards)).std()) or 1.0
    seqs = [np.concatenate([r.prompt_ids, r.responses[0]])[: r.lasts[0] + 1] for r in records]
    out = [sequence_probe(rm, seqs, scale)]
    whole = [r for rec, r in zip(records, rewards) if rm_bench_whole(rec)]
    if whole:
        out.append(style_probe(whole))
    return out


def probe_lines(probes: Sequence[dict[str, Any]]) -> list[str]:
    """Each probe as the line a report and `rmflow eval` show: PASS or FAIL, its name, its figures."""
    return [f"{'PASS' if p['passed'] else 'FAIL'} {p['name']}: {p['line']}" for p in probes]
