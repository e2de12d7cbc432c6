"""The preprocessing's accounting: every record read is written or counted under exactly one
reason, and the statistics a job reports are computed from those counts.

Beam-free: the preprocess job's last step (``pipelines.finalize``) and the in-process
preparation of raw files (``rendering.prepare``: eval, named eval sets) share it, so both count
alike.
"""

from __future__ import annotations

import collections
import math
import os
from typing import Any

from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.kinds import OUTCOME, kind_named
from rmflow.schemas.manifest import ERRORS_FILE
from rmflow.schemas.record import PairRecord

PERCENTILES = (50, 90, 95, 99)


class PreprocessError(RmflowError, RuntimeError):
    """The job cannot start or did not produce a usable output; the message says why. ``reason``
    is the message without where to look; ``errors_file`` the records set aside, when there are;
    ``dead`` those records themselves, when preprocessed in process (``rendering.prepare``)."""

    def __init__(self, message: str, *, reason: str | None = None, errors_file: str | None = None):
        super().__init__(message)
        self.reason = reason or message
        self.errors_file = errors_file
        self.dead: list[dict] | None = None


# Why a read record was not written: (stats count, dead-letter category, what it means). Every read
# record is written or counted under exactly one of these; the summaries read this table.
NOT_WRITTEN = (
    ("dropped_too_long", "too_long", "too long"),
    ("ties", "tie", "ties (chosen == rejected, or equal scores when asked)"),
    ("weak_labels", "weak_label", "weak labels (score gap under --min-score-gap)"),
    ("duplicates", "duplicate", "duplicates"),
    ("unranked", "unranked", "unranked (one response: nothing to rank; --attributes keeps them, to fit their "
                             "ratings)"),
    ("contaminated", "contaminated", "contaminated (share an n-gram with an evaluation prompt)"),
    ("errors", "error", "errors"),
)


# What the job counts besides what it writes or drops (the noted entries' (category, code); code
# None: any): (stats key, category, code, what the summary says).
NOTED_COUNTS = (
    ("contaminated_marked", "contaminated", None, "written, marked contaminated (contamination.jsonl)"),
    ("pairs_from_responses", "made", None, "pairs made beyond one a prompt (--pairs-from, K responses)"),
    ("rows_grouped", "grouped", None, "rows read into their prompt's record (a response a row)"),
    ("responses_capped", "merged", "capped_response", "responses past --max-responses, left out"),
    ("responses_too_long", "merged", "long_response", "responses too long for max_length with their prompt, left "
                                                      "out"),
    ("responses_contradicted", "merged", "contradicting_response", "responses scored two ways (the same text), "
                                                                   "left out"),
    ("responses_empty", "merged", "empty_response", "empty responses left out of their prompt's record"),
    ("responses_merged", "merged", "duplicate_response", "responses given twice with one score, kept once"),
    ("score_ties_kept", "tie", None, "kept with equal scores (--drop-score-ties drops them)"),
    ("unranked_kept", "unranked_kept", None, "written with nothing to rank (one response, or all of one score), "
                                             "for their attribute ratings"),
    ("scored_by_weights", "weighted", None, "scored by the weighted sum of their responses' attribute ratings "
                                            "(--attribute-weights)"),
)


def gather(items: list) -> dict[str, Any]:
    """The exact per-file, per-reason and per-shard counts gathered in the pipeline."""
    summary: dict[str, Any] = {"files": {}, "layouts": {}, "dead": [], "shards": [], "marked": [], "dead_by_file": []}
    for item, value in items:
        if item == "file":
            summary["files"][value[0]] = value[1]
            summary["layouts"][value[0]] = value[2]
        elif item == "dead":
            (category, code), (n, (source, line, reason)) = value
            summary[item].append({"category": category, "code": code, "count": n,
                                  "example": {"source": source, "line": line, "reason": reason}})
        elif item == "marked":
            (category, code), n = value
            summary[item].append({"category": category, "code": code, "count": n})
        elif item in ("dead_by_file", "made_by_file"):
            (source, category), n = value
            summary.setdefault(item, []).append({"source": source, "category": category, "count": n})
        else:
            summary["shards"].append(value)
    for item in ("dead", "marked"):
        summary[item].sort(key=lambda d: (d["category"], d["code"]))
    summary["dead_by_file"].sort(key=lambda d: (d["source"], d["category"]))
    summary["shards"].sort(key=lambda s: s["file"])
    return summary


def summarize(summary: dict[str, Any], cfg: PreprocessConfig, seconds: float) -> dict[str, Any]:
    """Counts that reconcile exactly, dead letters by reason, length histograms, throughput."""
    read = sum(summary["files"].values())
    written, lengths = _written(summary["shards"])
    kind = _one_kind(summary["shards"])
    counts = _counts(summary, read, written)
    if kind.counts_steps:  # every written solution's steps, and how many of them are labelled incorrect
        for name, field in (("steps_written", "steps"), ("incorrect_steps", "incorrect")):
            counts[name] = sum(k * n for split in lengths.values() for k, n in split.get(field, {}).items())
        for split in lengths.values():
            split.pop("incorrect", None)  # a count, not a length
    tokens = sum(n * length for split in lengths.values() for f in ("chosen", "rejected", "sequence", "tokens")
                 for length, n in split.get(f, {}).items())
    return {
        "kind": kind.name,
        "counts": counts,
        "reconciles": True,
        "dead_letters": summary["dead"],
        "records_per_file": summary["files"],
        "per_file": per_file(summary, kind.record is PairRecord),
        # dropped, or with decontaminate_mark_only found and written (counts.contaminated_marked)
        "contaminated_by_eval_file": {d["code"].split(":", 1)[1]: d["count"]
                                      for d in summary["dead"] + summary["marked"]
                                      if d["category"] == "contaminated"},
        "lengths": {split: {f: length_stats(h, cfg.max_length) for f, h in fields.items()}
                    for split, fields in sorted(lengths.items())},
        "tokens_written": tokens,
        "seconds": round(seconds, 3),
        "pairs_per_second": round(read / seconds, 1) if seconds else None,
        "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
    }


def _written(shards: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, dict[str, collections.Counter]]]:
    """Records written per split, and per split each length field's histogram."""
    written = {split: 0 for split in ("train", "eval")}
    lengths: dict[str, dict[str, collections.Counter]] = {}
    for s in shards:
        written[s["split"]] += s["records"]
        per_split = lengths.setdefault(s["split"], {})
        for field, hist in s["lengths"].items():
            per_split.setdefault(field, collections.Counter()).update({int(k): v for k, v in hist.items()})
    return written, lengths


def _one_kind(shards: list[dict[str, Any]]):
    """The kind of the records written: one, or the inputs are refused for mixing kinds."""
    kinds = collections.Counter()
    for s in shards:
        kinds.update(s.get("kinds", {}))
    if len(kinds) > 1:
        mixed = [kind_named(k) for k in sorted(kinds)]
        raise PreprocessError(
            "the inputs mix " + " and ".join(f"{k.data} ({kinds[k.name]:,} written)" for k in mixed)
            + ": " + " and ".join(k.description for k in mixed)
            + " train on different data; preprocess them into separate outputs")
    return kind_named(next(iter(kinds), OUTCOME.name))


def _counts(summary: dict[str, Any], read: int, written: dict[str, int]) -> dict[str, int]:
    """Every record read written or counted under one reason (NOT_WRITTEN), what was noted
    (NOTED_COUNTS); checked to reconcile exactly."""
    by_category = collections.Counter()
    for d in summary["dead"]:
        by_category[d["category"]] += d["count"]
    counts = {
        "records_read": read,
        "pairs_written": sum(written.values()),
        "pairs_written_train": written["train"],
        "pairs_written_eval": written["eval"],
        **{key: by_category[category] for key, category, _ in NOT_WRITTEN},
        **{key: sum(d["count"] for d in summary["marked"] if d["category"] == category and code in (None, d["code"]))
           for key, category, code, _ in NOTED_COUNTS},
        "prompt_truncated": sum(s.get("truncated", 0) for s in summary["shards"]),  # written, prompt cut
        # written, with special-token text in a message (kept as text, never as control tokens)
        "special_token_text": sum(s.get("special_text", 0) for s in summary["shards"]),
    }
    accounted = counts["pairs_written"] + sum(counts[key] for key, _, _ in NOT_WRITTEN)
    if accounted != read + counts["pairs_from_responses"] - counts["rows_grouped"]:
        raise PreprocessError(f"internal error: {read} records read ({counts['rows_grouped']} rows grouped into their "
                              f"prompts' records, {counts['pairs_from_responses']} more pairs made of responses) but "
                              f"{accounted} accounted for ({counts})")
    return counts


def per_file(summary: dict[str, Any], pairwise: bool = True) -> dict[str, dict[str, Any]]:
    """Each input file's records: read, pairs made beyond one a record (``made``: a prompt's K
    responses as several pairs), rows read into another row's record (``grouped``: a
    response-a-row layout), written, not written by reason (NOT_WRITTEN's keys), and
    the fraction of its written pairs whose chosen sequence is longer in tokens than the rejected
    one (the length bias a reward model trained on it may learn)."""
    key_of = {category: key for key, category, _ in NOT_WRITTEN}
    out = collections.defaultdict(lambda: {"read": 0, "made": 0, "grouped": 0, "written": 0,
                                           **dict.fromkeys(key_of.values(), 0)})
    for path, n in sorted(summary["files"].items()):
        out[path]["read"] = n
        out[path]["layout"] = summary.get("layouts", {}).get(path)
    for d in summary.get("made_by_file", []):  # pairs beyond one a record (K responses), rows grouped
        out[d["source"]][d["category"]] += d["count"]
    longer: collections.Counter = collections.Counter()
    for s in summary["shards"]:
        for source, (written, chosen_longer) in s.get("sources", {}).items():
            out[source]["written"] += written
            longer[source] += chosen_longer
    for d in summary.get("dead_by_file", []):
        out[d["source"]][key_of.get(d["category"], "errors")] += d["count"]
    for source, entry in out.items():
        entry["chosen_longer_fraction"] = round(longer[source] / entry["written"], 4) \
            if entry["written"] and pairwise else None
    return dict(out)


def length_stats(hist: collections.Counter, max_length: int) -> dict[str, Any]:
    n = sum(hist.values())
    if not n:
        return {"count": 0}
    values = sorted(hist)
    out: dict[str, Any] = {"count": n, "mean": round(sum(k * v for k, v in hist.items()) / n, 2),
                           "min": values[0], "max": values[-1]}
    for q in PERCENTILES:  # nearest-rank percentiles, exact
        rank, seen = math.ceil(q / 100 * n), 0
        for v in values:
            seen += hist[v]
            if seen >= rank:
                out[f"p{q}"] = v
                break
    width = max(1, math.ceil(max(max_length, values[-1] + 1) / 32))
    bins = collections.Counter()
    for v, c in hist.items():
        bins[v // width] += c
    out["histogram"] = {"bin_width": width, "counts": [bins[i] for i in range(max(bins) + 1)]}
    return out


def _example(letter: dict[str, Any]) -> str:
    """The first record of a reason, quoted: its message says what to do (--format, --max-length ...)."""
    ex = letter.get("example")
    if not ex:
        return ""
    return f"the first {letter['code']}, {os.path.basename(ex['source'])} line {ex['line']}: {ex['reason']}"


def check_quality(stats: dict[str, Any], cfg: PreprocessConfig, staging: str) -> None:
    counts = stats["counts"]
    errors = counts["errors"]
    # in the unit errors count in: records, the pairs made of K responses, less rows grouped into one
    read = counts["records_read"] + counts.get("pairs_from_responses", 0) - counts.get("rows_grouped", 0)
    errors_file = f"{staging}/{ERRORS_FILE}"
    if counts["records_read"] == 0:
        raise PreprocessError(f"the inputs hold no records; staging left at {staging}",
                              reason="the inputs hold no records")
    if errors / read > cfg.max_bad_fraction:
        top = sorted((d for d in stats["dead_letters"] if d["category"] == "error"),
                     key=lambda d: -d["count"])[:5]
        reasons = ", ".join(f"{d['code']} x{d['count']}" for d in top)
        reason = (f"{errors} of {read} records ({errors / read:.1%}) are bad, more than --max-bad-fraction "
                  f"{cfg.max_bad_fraction:.1%} (top reasons: {reasons}; {_example(top[0])})")
        raise PreprocessError(f"{reason}. Nothing was published; every bad record and its reason is in {errors_file}",
                              reason=reason, errors_file=errors_file)
    if counts["pairs_written"] == 0:
        top = sorted(stats["dead_letters"], key=lambda d: -d["count"])[:5]
        reason = f"no pair survived preprocessing (of {read} records: " + \
            ", ".join(f"{d['code']} x{d['count']}" for d in top) + (f"; {_example(top[0])})" if top else ")")
        raise PreprocessError(f"{reason}; see {errors_file}", reason=reason, errors_file=errors_file)
