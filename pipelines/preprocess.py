"""`rmflow preprocess`: raw preference files to ArrayRecord shards plus a manifest.

``run(cfg)`` plans the job (inputs, tokenizer, shard counts), builds the Beam graph with
``build`` and runs it on any runner (a test pipeline may be passed in). The graph's last step
(``pipelines.finalize``) reconciles the counts, writes ``manifest.json``, ``stats.json`` and
``config.json``, publishes the staging folder (atomically on local disk) and writes
``COMPLETED`` last, inside the job: no launcher has to stay alive for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings
from typing import Any

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions
from rmflow.pipelines import io as rio
from rmflow.pipelines.decontaminate import CONTAMINATION_FILE, Decontaminate, eval_file_counts, use_join
from rmflow.pipelines.finalize import (
    SHARD_FOLDER,
    Finalization,
    PreprocessError,
)
from rmflow.pipelines.near_dedup import DropNearDuplicates
from rmflow.pipelines.publication import FAILED_FILE
from rmflow.pipelines.runner import is_local, launched, new_pipeline, runner_options
from rmflow.pipelines.staging import clean_leftovers, new_staging
from rmflow.pipelines.tokenizer_files import load_tokenizer_assets, write_tokenizer_files
from rmflow.pipelines.transforms import (
    NAMESPACE,
    ApplyChatTemplate,
    ApplyLengthPolicy,
    DropDuplicates,
    Finalize,
    NormalizePairs,
    ReadPreferenceData,
    SplitTrainEval,
    Tokenize,
    TokenizerFiles,
    WriteErrors,
    WriteShards,
    shared_record_tokenizer,
)
from rmflow.rendering.formats import BadRecord
from rmflow.rendering.prepare import (  # noqa: F401 - the layout checks, re-exported for the Beam stage
    LAYOUT_OPTIONS,
    check_pairs_from,
    check_score_options,
    first_layout,
    warn_unused_options,
)
from rmflow.rendering.tokenize import TokenizerAssets, build_tokenizer, tokenizer_info
from rmflow.schemas.config import (
    NORMALIZE_OPTIONS,
    PreprocessConfig,
    parse_weights,
)
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.manifest import (
    ERRORS_FILE,
    MANIFEST_FILE,
    STATS_FILE,
    TOKENIZER_DIR,
    Manifest,
)
from rmflow.schemas.options import command_flags
from rmflow.schemas.outputs import output_lock
from rmflow.schemas.paths import is_url

BYTES_PER_SHARD = 256 << 20  # raw input bytes per train shard when --num-shards is 0 (auto)


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
    skipped: tuple[tuple[str, str], ...] = ()  # (path, why) of files in the input folders that are not inputs
    eval_files: tuple[str, ...] = ()  # the evaluation files to decontaminate against
    decontaminate_join: bool = False  # find overlaps by a join, not a side input (decontaminate.use_join)
    eval_counts: tuple[tuple[str, dict[str, int]], ...] = ()  # each evaluation file's items and n-grams


def plan_shards(cfg: PreprocessConfig, input_bytes: int) -> dict[str, int]:
    train = cfg.num_shards or max(1, math.ceil(input_bytes / BYTES_PER_SHARD))
    counts = {"train": train}
    if cfg.eval_fraction > 0:
        counts["eval"] = max(1, math.ceil(train * cfg.eval_fraction))
    return counts


def make_plan(cfg: PreprocessConfig) -> Plan:
    out = cfg.output.rstrip("/")
    # --overwrite deletes it: only ever our own output, never holding what the job reads
    rio.check_replaceable(out, SHARD_FOLDER, PreprocessError,
                          inputs=(*cfg.inputs, *cfg.decontaminate, *((cfg.chat_template,) if cfg.chat_template else ()),
                                  cfg.tokenizer))
    if rio.exists(out) and not cfg.overwrite and rio.folder_names(out):
        raise PreprocessError(f"output {out} already exists: choose another --output or pass --overwrite")
    skipped: list[tuple[str, str]] = []
    try:
        files = rio.expand_inputs(cfg.inputs, skipped)
    except rio.InputError as e:
        raise PreprocessError(str(e)) from e
    try:
        eval_listed = sorted(set(rio.expand_inputs(cfg.decontaminate)))
        eval_counts = tuple((path, eval_file_counts(path, cfg.decontaminate_ngram)) for path, _ in eval_listed)
    except rio.InputError as e:
        raise PreprocessError(f"--decontaminate: {e}") from e
    except BadRecord as e:
        raise PreprocessError(f"--decontaminate: {e.message}") from e
    check_score_options(cfg, [path for path, _ in files], rio.BEAM)
    check_pairs_from(cfg, [path for path, _ in files], rio.BEAM)
    assets = load_tokenizer_assets(cfg.tokenizer, cfg.chat_template)
    if not assets.has_chat_template and cfg.format != "tokenized":  # now, not after every record failed
        raise PreprocessError(f"tokenizer {cfg.tokenizer} has no chat template, which renders conversations into "
                              "text: pass one with --chat-template FILE (a Jinja template; pre-tokenized data "
                              "needs none: --format tokenized)")
    report_leftovers(out)
    staging = new_staging(out)
    try:  # The tokenizer as used, where the workers read it (TokenizerFiles) and export finds it with the shards.
        write_tokenizer_files(assets, f"{staging}/{TOKENIZER_DIR}")
    except BaseException:  # a stop (or a failure) from here on leaves no staging folder behind
        rio.delete_tree(staging)
        raise
    return Plan(files, assets, plan_shards(cfg, sum(s for _, s in files)), staging, tuple(skipped),
                tuple(f for f, _ in eval_listed), use_join(cfg.decontaminate_method, eval_listed), eval_counts)


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


def pipeline_options(cfg: PreprocessConfig) -> PipelineOptions:
    opts = runner_options(cfg.beam_args, cfg.runner, command_flags(PreprocessConfig), "preprocess")
    std = opts.view_as(StandardOptions)
    if not is_local(std.runner) and not any(opts.get_all_options().get(k) for k in CODE_STAGING_OPTIONS):
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
    """A pipeline for the configured runner (``pipelines.runner.new_pipeline``)."""
    return new_pipeline(pipeline_options(cfg))


def build(p: beam.Pipeline, cfg: PreprocessConfig, plan: Plan, fin: Finalization | None = None) -> None:
    """The preprocess graph: read, normalize, [decontaminate], [dedup], [near dedup], template, tokenize, length, split, write,
    and the last step that reconciles, writes the manifest and publishes (``finalize``)."""
    fin = fin or finalization(cfg, plan)
    read = p | "Read" >> ReadPreferenceData([f for f, _ in plan.files], cfg.format)
    norm = read["main"] | "NormalizePairs" >> NormalizePairs({k: getattr(cfg, k) for k in NORMALIZE_OPTIONS},
                                                             parse_weights(cfg.attribute_weights))
    pairs, dead = norm["main"], [read["dead"], norm["dead"]]
    marked = None  # with decontaminate_mark_only: the records found contaminated and kept
    if cfg.decontaminate:
        clean = pairs | "Decontaminate" >> Decontaminate(plan.eval_files, cfg.decontaminate_ngram,
                                                         cfg.decontaminate_replies, cfg.decontaminate_mark_only,
                                                         join=plan.decontaminate_join)
        pairs = clean["main"]
        dead.append(clean["dead"])
        if cfg.decontaminate_mark_only:
            marked = clean["marked"]
    if cfg.dedup:
        dedup = pairs | "DropDuplicates" >> DropDuplicates()
        pairs = dedup["main"]
        dead.append(dedup["dead"])
    if cfg.near_dedup != "off":
        near = pairs | "DropNearDuplicates" >> DropNearDuplicates(cfg.near_dedup, cfg.near_dedup_threshold)
        pairs = near["main"]
        dead.append(near["dead"])
    tokenizer = p | "TokenizerFiles" >> TokenizerFiles(f"{plan.staging}/{TOKENIZER_DIR}", plan.assets.name)
    rendered = pairs | "ApplyChatTemplate" >> ApplyChatTemplate(tokenizer, cfg.batch_size, cfg.step_separator)
    tokenized = rendered["main"] | "Tokenize" >> Tokenize(tokenizer, cfg.step_separator, cfg.max_length, cfg.length_policy)
    fitted = tokenized["main"] | "LengthPolicy" >> ApplyLengthPolicy(cfg.max_length, cfg.length_policy,
                                                                     rio.source_names([f for f, _ in plan.files]))
    dead += [rendered["dead"], tokenized["dead"], fitted["dead"]]
    shards = (
        fitted["main"]
        | "Split" >> SplitTrainEval(cfg.eval_fraction, cfg.split_seed, plan.shard_counts)
        | "WriteShards" >> WriteShards(plan.staging, plan.shard_counts)
    )
    all_dead = dead | "AllDeadLetters" >> beam.Flatten()
    after = all_dead | "WriteErrors" >> WriteErrors(f"{plan.staging}/{ERRORS_FILE}")
    noted = (norm["noted"], fitted["noted"]) | "Noted" >> beam.Flatten()
    if marked is None:
        marked = noted
    else:
        listed = marked | "WriteContamination" >> WriteErrors(f"{plan.staging}/{CONTAMINATION_FILE}")
        after = (after, listed) | "Written" >> beam.Flatten()
        marked = (marked, noted) | "AllNoted" >> beam.Flatten()
    (read["files"], all_dead, shards, marked) | "Finalize" >> Finalize(fin, after)


def finalization(cfg: PreprocessConfig, plan: Plan, started: float | None = None, tok: Any = None) -> Finalization:
    tok = tok if tok is not None else build_tokenizer(plan.assets)
    return Finalization(cfg=cfg, staging=plan.staging, output=cfg.output.rstrip("/"), files=tuple(plan.files),
                        splits=tuple(plan.shard_counts), tokenizer=tokenizer_info(plan.assets, tok),
                        started=time.time() if started is None else started, skipped=plan.skipped,
                        eval_counts=plan.eval_counts)


def run(cfg: PreprocessConfig, pipeline: beam.Pipeline | None = None, *, wait: bool = True) -> PreprocessResult | None:
    """Run the whole stage. The job finalises itself (``finalize``: reconcile, manifest, publish,
    COMPLETED); here the launcher only waits and reads the result back, so with ``wait=False``
    (a Dataflow job left to run) the output still appears complete, or not at all. Raises
    PreprocessError when the job fails (nothing is published then)."""
    started = time.time()
    cfg = cfg.with_absolute_paths()  # the config written with the shards names the same files from anywhere
    p = pipeline if pipeline is not None else make_pipeline(cfg)  # validates the runner options first
    # A local output is locked while the launcher waits for the job (a detached or remote job: not).
    with launched(p), output_lock(cfg.output, "rmflow preprocess") if wait else contextlib.nullcontext():
        return _run(cfg, p, started, wait)


def _run(cfg: PreprocessConfig, p, started: float, wait: bool) -> PreprocessResult | None:
    plan = make_plan(cfg)
    try:
        core = shared_record_tokenizer(plan.assets, cfg.step_separator)  # kept referenced: workers reuse it
        fin = finalization(cfg, plan, started, core.tok)
        build(p, cfg, plan, fin)
        result = p.run()
        if not wait:
            return None
        state = result.wait_until_finish()
    except BaseException as e:  # noqa: BLE001 - the pipeline's own exception, wrapped by the runner
        if _interrupted(e):  # Ctrl-C or SIGTERM reached a worker thread: an interruption, not a failure
            if wait and not is_url(plan.staging):  # ours alone: the output's lock is held
                rio.delete_tree(plan.staging)
            raise KeyboardInterrupt from e
        if not isinstance(e, Exception):
            raise
        raise job_failure(plan.staging, e) from e
    if state is not None and str(state).upper().split(".")[-1] not in ("DONE", "UNKNOWN"):
        raise job_failure(plan.staging, f"the Beam job ended in state {state}")
    out = fin.output
    stats = json.loads(rio.read_bytes(f"{out}/{STATS_FILE}"))
    stats["counters"] = beam_counters(result)  # monitoring only; the exact counts are in stats
    manifest = Manifest.from_json(rio.read_bytes(f"{out}/{MANIFEST_FILE}").decode())
    warn_unused_options(cfg, stats, manifest.layouts)
    return PreprocessResult(out, manifest, stats)


def _interrupted(e: BaseException) -> bool:
    """Whether a KeyboardInterrupt caused ``e`` (the runner re-raises a worker's as its own error)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt) or "KeyboardInterrupt" in str(e)[:2000]:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def job_failure(staging: str, cause: Any) -> PreprocessError:
    """The reason the job failed: the finalisation's own (``_FAILED.json``) when a check refused
    the output, else the runner's error."""
    try:
        failure = json.loads(rio.read_bytes(f"{staging}/{FAILED_FILE}"))
        return PreprocessError(failure["error"], reason=failure.get("reason"), errors_file=failure.get("errors_file"))
    except Exception:  # noqa: BLE001 - no failure record: the job itself broke
        return PreprocessError(f"the Beam job failed ({cause}); nothing was published; staging left at {staging}")


def beam_counters(result: Any) -> dict[str, int]:
    """The job's counters in the rmflow namespace (monitoring; the exact counts are above)."""
    try:
        found = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]
    except Exception:  # noqa: BLE001 - a runner without metrics support
        return {}
    return {c.key.metric.name: c.committed if c.committed is not None else c.attempted
            for c in sorted(found, key=lambda c: c.key.metric.name)}
