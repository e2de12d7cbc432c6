"""`rmflow preprocess`: raw preference files to ArrayRecord shards plus a manifest.

``run(cfg)`` plans the job (inputs, tokenizer, shard counts), builds the Beam graph with
``build``, runs it on any runner (a test pipeline may be passed in), then reconciles the
counts, writes ``manifest.json``, ``stats.json`` and ``config.json``, publishes the
staging folder atomically and writes ``COMPLETED`` last.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import time
import warnings
from typing import Any

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from pipelines import io as rio
from pipelines.staging import OWNER_FILE, clean_leftovers, new_staging
from pipelines.tokenize import TokenizerAssets, load_tokenizer_assets, tokenizer_info
from pipelines.transforms import (
    NAMESPACE,
    ApplyChatTemplate,
    ApplyLengthPolicy,
    DropDuplicates,
    NormalizePairs,
    ReadPreferenceData,
    SplitTrainEval,
    Tokenize,
    WriteErrors,
    WriteShards,
    WriteSummary,
    shared_pair_tokenizer,
)
from schemas.config import PreprocessConfig
from schemas.errors import RmflowError, RmflowWarning
from schemas.manifest import (
    COMPLETED_FILE,
    CONFIG_FILE,
    ERRORS_FILE,
    MANIFEST_FILE,
    STATS_FILE,
    TOKENIZER_DIR,
    InputFile,
    Manifest,
    ShardInfo,
    SplitInfo,
)

SUMMARY_FILE = "_summary.json"
BYTES_PER_SHARD = 256 << 20  # raw input bytes per train shard when --num-shards is 0 (auto)
PERCENTILES = (50, 90, 95, 99)


class PreprocessError(RmflowError, RuntimeError):
    """The job cannot start or did not produce a usable output; the message says why."""


@dataclasses.dataclass(frozen=True)
class PreprocessResult:
    output: str
    manifest: Manifest
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Plan:
    files: list[tuple[str, int]]
    assets: TokenizerAssets
    shard_counts: dict[str, int]
    staging: str


def plan_shards(cfg: PreprocessConfig, input_bytes: int) -> dict[str, int]:
    train = cfg.num_shards or max(1, math.ceil(input_bytes / BYTES_PER_SHARD))
    counts = {"train": train}
    if cfg.eval_fraction > 0:
        counts["eval"] = max(1, math.ceil(train * cfg.eval_fraction))
    return counts


def make_plan(cfg: PreprocessConfig) -> Plan:
    out = cfg.output.rstrip("/")
    if "://" not in out and os.path.isfile(out):
        raise PreprocessError(f"--output {out} is a file; give a folder for the shards")
    if rio.exists(out) and not cfg.overwrite:
        raise PreprocessError(f"output {out} already exists: choose another --output or pass --overwrite")
    if rio.exists(out) and not _is_shard_folder(out):  # --overwrite deletes it: only ever our own output
        raise PreprocessError(f"--overwrite would delete {out}, which is not an rmflow shard folder (no "
                              f"{MANIFEST_FILE}, {COMPLETED_FILE} or {SUMMARY_FILE}): choose another --output")
    try:
        files = rio.expand_inputs(cfg.inputs)
    except rio.InputError as e:
        raise PreprocessError(str(e)) from e
    assets = load_tokenizer_assets(cfg.tokenizer, cfg.chat_template)
    report_leftovers(out)
    return Plan(files, assets, plan_shards(cfg, sum(s for _, s in files)), new_staging(out))


def _is_shard_folder(path: str) -> bool:
    """Written by `rmflow preprocess` (complete, or failed after its counts were gathered), or empty."""
    if "://" not in path and os.path.isdir(path) and not os.listdir(path):
        return True
    return any(rio.exists(f"{path}/{name}") for name in (MANIFEST_FILE, COMPLETED_FILE, SUMMARY_FILE))


def report_leftovers(output: str) -> None:
    """Remove what interrupted runs of this output left behind; name what cannot be removed safely."""
    removed, kept = clean_leftovers(output)
    if removed:
        warnings.warn(f"removed {len(removed)} staging folder(s) left by interrupted runs of {output}: "
                      + ", ".join(removed), RmflowWarning, stacklevel=3)
    if kept:
        warnings.warn(f"{len(kept)} staging folder(s) of other runs of {output} exist: {', '.join(kept)}. Delete "
                      "them once no job writes there (they may belong to a job still running)",
                      RmflowWarning, stacklevel=3)


# Ways to give remote workers the rmflow code; one is needed on any non-local runner.
CODE_STAGING_OPTIONS = ("extra_packages", "setup_file", "requirements_file", "sdk_container_image")
LOCAL_RUNNERS = ("directrunner", "direct", "fnapirunner")


def pipeline_options(cfg: PreprocessConfig) -> PipelineOptions:
    opts = PipelineOptions(list(cfg.beam_args))
    std = opts.view_as(StandardOptions)
    std.runner = std.runner or cfg.runner
    if std.runner.lower() not in LOCAL_RUNNERS and not any(opts.get_all_options().get(k) for k in CODE_STAGING_OPTIONS):
        raise PreprocessError(
            f"runner {std.runner} runs on remote workers, which need rmflow installed: build a wheel with "
            "`pip wheel --no-deps -w dist .` and pass `--extra_package dist/rmflow-<version>-py3-none-any.whl` "
            "(or pass --sdk_container_image with an image that has rmflow)"
        )
    if cfg.num_workers > 1:
        direct = opts.view_as(DirectOptions)
        direct.direct_num_workers = cfg.num_workers
        direct.direct_running_mode = "multi_processing"
    return opts


def make_pipeline(cfg: PreprocessConfig) -> beam.Pipeline:
    """A pipeline for the configured runner. "DirectRunner" runs Beam's portable FnApiRunner
    directly: Beam's DirectRunner would first try Prism, which downloads a binary."""
    opts = pipeline_options(cfg)
    runner = opts.view_as(StandardOptions).runner
    if runner.lower() in LOCAL_RUNNERS:
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return beam.Pipeline(runner=FnApiRunner(), options=opts)
    return beam.Pipeline(options=opts)


def build(p: beam.Pipeline, cfg: PreprocessConfig, plan: Plan) -> None:
    """The preprocess graph: read, normalize, [dedup], template, tokenize, length, split, write."""
    read = p | "Read" >> ReadPreferenceData([f for f, _ in plan.files], cfg.format)
    norm = read["main"] | "NormalizePairs" >> NormalizePairs(cfg.margin_from_scores)
    pairs, dead = norm["main"], [read["dead"], norm["dead"]]
    if cfg.dedup:
        dedup = pairs | "DropDuplicates" >> DropDuplicates()
        pairs = dedup["main"]
        dead.append(dedup["dead"])
    rendered = pairs | "ApplyChatTemplate" >> ApplyChatTemplate(plan.assets, cfg.batch_size)
    tokenized = rendered["main"] | "Tokenize" >> Tokenize(plan.assets)
    fitted = tokenized["main"] | "LengthPolicy" >> ApplyLengthPolicy(cfg.max_length, cfg.length_policy)
    dead += [rendered["dead"], tokenized["dead"], fitted["dead"]]
    shards = (
        fitted["main"]
        | "Split" >> SplitTrainEval(cfg.eval_fraction, cfg.split_seed, plan.shard_counts)
        | "WriteShards" >> WriteShards(plan.staging, plan.shard_counts)
    )
    all_dead = dead | "AllDeadLetters" >> beam.Flatten()
    all_dead | "WriteErrors" >> WriteErrors(f"{plan.staging}/{ERRORS_FILE}")
    (read["files"], all_dead, shards) | "Summary" >> WriteSummary(f"{plan.staging}/{SUMMARY_FILE}")


def run(cfg: PreprocessConfig, pipeline: beam.Pipeline | None = None) -> PreprocessResult:
    """Run the whole stage; raises PreprocessError when it fails (nothing is published then)."""
    start = time.perf_counter()
    cfg = cfg.with_absolute_paths()  # the config written with the shards names the same files from anywhere
    p = pipeline if pipeline is not None else make_pipeline(cfg)  # validates the runner options first
    plan = make_plan(cfg)
    core = shared_pair_tokenizer(plan.assets)  # kept referenced: in-process workers reuse it
    tok = core.tok
    build(p, cfg, plan)
    result = p.run()
    state = result.wait_until_finish()
    if state is not None and str(state).upper().split(".")[-1] not in ("DONE", "UNKNOWN"):
        raise PreprocessError(f"the Beam job ended in state {state}; staging left at {plan.staging}")
    seconds = time.perf_counter() - start

    summary = json.loads(rio.read_bytes(f"{plan.staging}/{SUMMARY_FILE}"))
    stats = summarize(summary, cfg, seconds)
    stats["counters"] = beam_counters(result)
    _check_quality(stats, cfg, plan.staging)
    manifest = Manifest(
        tokenizer=tokenizer_info(plan.assets, tok),
        max_length=cfg.max_length,
        length_policy=cfg.length_policy,
        splits={
            split: SplitInfo(
                pairs=sum(s["pairs"] for s in summary["shards"] if s["split"] == split),
                shards=tuple(ShardInfo(s["file"], s["pairs"]) for s in summary["shards"] if s["split"] == split),
            )
            for split in plan.shard_counts
        },
        inputs=tuple(InputFile(path, size) for path, size in plan.files),
        config=json.loads(cfg.to_json()),
    )
    for name, text in ((MANIFEST_FILE, manifest.to_json()), (STATS_FILE, json.dumps(stats, indent=2) + "\n"),
                       (CONFIG_FILE, cfg.to_json())):
        rio.write_bytes(f"{plan.staging}/{name}", text.encode())
    for name, data in plan.assets.files_as_used().items():  # export ships these with the model
        rio.write_bytes(f"{plan.staging}/{TOKENIZER_DIR}/{name}", data)
    from apache_beam.io.filesystems import FileSystems

    FileSystems.delete([f"{plan.staging}/{SUMMARY_FILE}", f"{plan.staging}/{OWNER_FILE}"])
    out = cfg.output.rstrip("/")
    if rio.exists(out):  # --overwrite was given (make_plan refused otherwise)
        rio.delete_tree(out)
    rio.publish(plan.staging, out)
    rio.write_bytes(f"{out}/{COMPLETED_FILE}", b"")
    return PreprocessResult(out, manifest, stats)


# --------------------------------------------------------------------------- statistics


def summarize(summary: dict[str, Any], cfg: PreprocessConfig, seconds: float) -> dict[str, Any]:
    """Counts that reconcile exactly, dead letters by reason, length histograms, throughput."""
    read = sum(summary["files"].values())
    by_category = collections.Counter()
    for d in summary["dead"]:
        by_category[d["category"]] += d["count"]
    written = {split: 0 for split in ("train", "eval")}
    lengths: dict[str, dict[str, collections.Counter]] = {}
    for s in summary["shards"]:
        written[s["split"]] += s["pairs"]
        per_split = lengths.setdefault(s["split"], {})
        for field, hist in s["lengths"].items():
            per_split.setdefault(field, collections.Counter()).update({int(k): v for k, v in hist.items()})
    counts = {
        "records_read": read,
        "pairs_written": sum(written.values()),
        "pairs_written_train": written["train"],
        "pairs_written_eval": written["eval"],
        "dropped_too_long": by_category["too_long"],
        "ties": by_category["tie"],
        "duplicates": by_category["duplicate"],
        "errors": by_category["error"],
    }
    accounted = sum(counts[k] for k in ("pairs_written", "dropped_too_long", "ties", "duplicates", "errors"))
    if accounted != read:
        raise PreprocessError(f"internal error: {read} records read but {accounted} accounted for ({counts})")
    tokens = sum(n * length for split in lengths.values() for f in ("chosen", "rejected")
                 for length, n in split.get(f, {}).items())
    return {
        "counts": counts,
        "reconciles": True,
        "dead_letters": summary["dead"],
        "records_per_file": summary["files"],
        "lengths": {split: {f: length_stats(h, cfg.max_length) for f, h in fields.items()}
                    for split, fields in sorted(lengths.items())},
        "tokens_written": tokens,
        "seconds": round(seconds, 3),
        "pairs_per_second": round(read / seconds, 1) if seconds else None,
        "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
    }


def beam_counters(result: Any) -> dict[str, int]:
    """The job's counters in the rmflow namespace (monitoring; the exact counts are above)."""
    try:
        found = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]
    except Exception:  # noqa: BLE001 - a runner without metrics support
        return {}
    return {c.key.metric.name: c.committed if c.committed is not None else c.attempted
            for c in sorted(found, key=lambda c: c.key.metric.name)}


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


def _check_quality(stats: dict[str, Any], cfg: PreprocessConfig, staging: str) -> None:
    counts = stats["counts"]
    read, errors = counts["records_read"], counts["errors"]
    if read == 0:
        raise PreprocessError(f"the inputs hold no records; staging left at {staging}")
    if errors / read > cfg.max_bad_fraction:
        top = sorted((d for d in stats["dead_letters"] if d["category"] == "error"),
                     key=lambda d: -d["count"])[:5]
        reasons = ", ".join(f"{d['code']} x{d['count']}" for d in top)
        raise PreprocessError(
            f"{errors} of {read} records ({errors / read:.1%}) are bad, more than --max-bad-fraction "
            f"{cfg.max_bad_fraction:.1%} (top reasons: {reasons}). Nothing was published; every bad "
            f"record and its reason is in {staging}/{ERRORS_FILE}"
        )
    if counts["pairs_written"] == 0:
        raise PreprocessError(f"no pair survived preprocessing; see {staging}/{ERRORS_FILE}")
