"""The last step of the preprocess job, inside the pipeline: it runs once, after every shard and
the errors file are written, reconciles the counts, writes ``manifest.json``, ``stats.json``,
``config.json`` and the tokenizer files, publishes the staging folder as the output and writes
``COMPLETED`` last. So a job launched and left alone (a scheduled Dataflow run, a Flex Template)
produces a complete, correct output by itself, and a failed one publishes nothing: a failed
check writes ``_FAILED.json`` (the reason) into the staging folder, raises, and the job fails.

Retries are safe: a step that finds the output already complete, its staging gone, does nothing.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from rmflow.pipelines import io as rio
from rmflow.pipelines.publication import publish as publish_output
from rmflow.pipelines.publication import published, refuse
from rmflow.rendering.accounting import (  # noqa: F401 - the job's accounting, re-exported for its callers
    NOT_WRITTEN,
    NOTED_COUNTS,
    PreprocessError,
    check_quality,
    gather,
    length_stats,
    per_file,
    summarize,
)
from rmflow.schemas import jsontext
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.manifest import (
    CONFIG_FILE,
    MANIFEST_FILE,
    STATS_FILE,
    InputFile,
    Manifest,
    ShardInfo,
    SplitInfo,
    TokenizerInfo,
)

SUMMARY_FILE = "_summary.json"
SHARD_FOLDER = "shard folder"  # schemas.outputs.OUTPUT_SIGNATURES' name of what preprocess writes


@dataclasses.dataclass(frozen=True)
class Finalization:
    """Everything the last step needs, fixed when the job is planned (picklable: it travels to
    the worker that runs the step)."""

    cfg: PreprocessConfig
    staging: str
    output: str
    files: tuple[tuple[str, int], ...]
    splits: tuple[str, ...]
    tokenizer: TokenizerInfo
    started: float  # epoch seconds, when the job was planned
    skipped: tuple[tuple[str, str], ...] = ()  # (path, why): files the inputs' folders hold that are not inputs
    eval_counts: tuple[tuple[str, dict[str, int]], ...] = ()  # --decontaminate: each file's items and n-grams


def finalize(items: list, fin: Finalization, *_after: Any) -> dict[str, Any]:
    """Reconcile, write the manifest and statistics, publish (with the tokenizer's files as used,
    which the launcher staged: ``make_plan``); returns the statistics. ``_after``: side inputs (the
    errors file's name) that make this step wait for their writers."""
    out, staging = fin.output.rstrip("/"), fin.staging
    earlier = published(out, staging, STATS_FILE)
    if earlier is not None:
        return earlier
    summary = gather(items)
    rio.write_bytes(f"{staging}/{SUMMARY_FILE}", jsontext.dumps(summary, sort_keys=True).encode())
    stats = None
    try:
        stats = summarize(summary, fin.cfg, time.time() - fin.started)
        stats["skipped_inputs"] = [{"path": path, "why": why} for path, why in fin.skipped]
        if fin.eval_counts:  # what the records were checked against
            stats["decontaminated_against"] = {path: dict(c) for path, c in fin.eval_counts}
        check_quality(stats, fin.cfg, staging)
    except PreprocessError as e:
        refuse(staging, {"error": str(e), "reason": e.reason, "errors_file": e.errors_file,
                         "counts": stats["counts"] if stats else None}, e)
    manifest = Manifest(
        kind=stats["kind"],
        tokenizer=fin.tokenizer,
        max_length=fin.cfg.max_length,
        length_policy=fin.cfg.length_policy,
        splits={
            split: SplitInfo(
                records=sum(s["records"] for s in summary["shards"] if s["split"] == split),
                shards=tuple(ShardInfo(s["file"], s["records"]) for s in summary["shards"] if s["split"] == split),
            )
            for split in fin.splits
        },
        inputs=tuple(InputFile(path, size) for path, size in fin.files),
        config=json.loads(fin.cfg.to_json()),
        layouts=tuple(sorted({x for x in summary["layouts"].values() if x})),
        weighted_scores=bool(stats["counts"]["scored_by_weights"]),
    )
    for name, text in ((MANIFEST_FILE, manifest.to_json()), (STATS_FILE, jsontext.dumps(stats, indent=2) + "\n"),
                       (CONFIG_FILE, fin.cfg.to_json())):
        rio.write_bytes(f"{staging}/{name}", text.encode())
    publish_output(staging, out, SHARD_FOLDER, drop=(SUMMARY_FILE,))
    return stats


