"""A training run's named eval sets (``data.eval``) given as raw files: preprocessed in this
process (``rendering.prepare``: the preprocess job's steps, no Beam), before the run, into
``RUN/eval_data/NAME`` with the training data's own tokenizer (its chat template as used),
max_length, length policy and step separator, all in one split; shard folders are used as they
are. `rmflow train` and `rmflow run` call this; the trainer reads only shard folders.

Bad records are handled as `rmflow eval` handles them in raw files: each is set aside with its
reason in the set's errors file (``RUN/eval_data/NAME/errors.jsonl``), said in a warning, and
the set is evaluated on the rest; a set with nothing usable stops the run before it starts, its
reasons kept beside it (``RUN/eval_data/NAME.errors.jsonl``), no staging folder left behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings

from rmflow.schemas import jsontext
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.kinds import OUTCOME, PROCESS, RESPONSES
from rmflow.schemas.manifest import (
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
    TokenizerInfo,
)
from rmflow.schemas.train_config import TrainConfig, fits_ratings
from rmflow.trainer import storage
from rmflow.trainer.errors import TrainError
from rmflow.trainer.model_setup import check_output, read_manifest
from rmflow.trainer.plan import other_kind
from rmflow.trainer.rundir import EVAL_DATA


def preprocess_eval_sets(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with every raw ``data.eval`` set replaced by its shard folder (``RUN/eval_data/NAME``;
    for a remote run, a local cache folder), preprocessed in this process (``rendering.prepare``:
    the preprocess job's steps, no Beam). The bad records of each are counted in that folder's
    errors file, as `rmflow preprocess` counts them."""
    raw = {name: paths for name, paths in (cfg.data.eval or {}).items() if not storage.is_shard_folder(paths)}
    if not raw:
        return cfg
    if not storage.is_remote(cfg.output):
        check_output(cfg.output)  # the sets go inside the run's folder: never into a folder of other files
    data = storage.stage_shards(cfg.sources[0].path)
    manifest = read_manifest(data)
    root = storage.cache_dir(cfg.output, EVAL_DATA) if storage.is_remote(cfg.output) \
        else os.path.join(cfg.output, EVAL_DATA)
    evals = dict(cfg.data.eval)
    as_pairs = {name: _holds_k_responses(name, paths, manifest) for name, paths in raw.items()}  # before any is written
    for name, paths in raw.items():
        folder = os.path.join(root, name)
        if as_pairs[name]:
            warnings.warn(f"data.eval {name!r} holds K responses per prompt and this run trains on preference pairs: "
                          "it is evaluated as every two of a prompt's responses whose scores differ (--pairs-from "
                          "expand), whose accuracy is the ranking's pairwise accuracy; `rmflow eval` of the trained "
                          "model on it gives best-of-K and Kendall's tau too", RmflowWarning, stacklevel=2)
        pcfg = _set_config(cfg, paths, folder, data, manifest, as_pairs[name])
        prepared = _prepare_set(name, pcfg, manifest, folder + "." + ERRORS_FILE)
        write_shard_folder(folder, prepared, pcfg, dataclasses.replace(manifest.tokenizer, name=pcfg.tokenizer))
        counts = prepared.stats["counts"]
        if counts["errors"]:
            warnings.warn(f"data.eval {name!r}: {counts['errors']} of {counts['records_read']} records cannot be "
                          f"used (each with its reason in {os.path.join(folder, ERRORS_FILE)}); evaluating on the "
                          f"{counts['pairs_written']} others", RmflowWarning, stacklevel=2)
        evals[name] = [folder]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval=evals))


def _set_config(cfg: TrainConfig, paths: list[str], folder: str, data: str, manifest, as_pairs: bool
                ) -> PreprocessConfig:
    """How a raw eval set is preprocessed: as the training shards were (their tokenizer as used,
    the run's max_length, their length policy and step separator), all of it one split; K
    responses as pairs in a pairs run; a regression head's ratings and the weights their scores
    came from, as the training shards keep them."""
    return PreprocessConfig(
        inputs=tuple(paths), output=folder, tokenizer=os.path.join(data, TOKENIZER_DIR),
        max_length=cfg.data.max_length_over(manifest.max_length), length_policy=manifest.length_policy,
        step_separator=manifest.step_separator, eval_fraction=0.0, max_bad_fraction=1.0, overwrite=True,
        **({"pairs_from": "expand"} if as_pairs else {}),
        **({"attributes": manifest.config["attributes"]} if manifest.attributes and fits_ratings(cfg.objective) else {}),
        **({"attribute_weights": manifest.config["attribute_weights"]}
           if manifest.config.get("attribute_weights") else {}))


def _prepare_set(name: str, pcfg: PreprocessConfig, manifest, kept: str):
    """The set's records, prepared in this process; a set with nothing usable, or of another kind
    than the training data, stops the run (its reasons kept in ``kept``, beside its folder)."""
    from rmflow.eval.evaluation import write_input_errors
    from rmflow.rendering.accounting import PreprocessError
    from rmflow.rendering.prepare import local_record_tokenizer, prepare

    if os.path.exists(kept):  # an earlier run's reasons are stale now
        os.remove(kept)
    try:
        tokenizer = local_record_tokenizer(pcfg.tokenizer, pcfg.step_separator, pcfg.format)
        prepared = prepare(pcfg, tokenizer, errors_file=kept)
    except PreprocessError as e:
        if e.dead:
            write_input_errors(e.dead, kept)
        where = f"; every record and its reason: {kept}" if os.path.exists(kept) else ""
        raise TrainError(f"data.eval {name!r} ({', '.join(pcfg.inputs)}): {e.reason or e}{where}") from e
    if prepared.stats["kind"] != manifest.kind:  # a layout the files' first records did not show
        raise TrainError(other_kind(name, prepared.stats["kind"], manifest.kind))
    return prepared


def write_shard_folder(folder: str, prepared, pcfg: PreprocessConfig, tokenizer: TokenizerInfo) -> Manifest:
    """``prepared``'s records written as `rmflow preprocess` writes a shard folder of one split (one
    ArrayRecord shard, the manifest, statistics, config, errors file and the tokenizer's files as
    used), in a staging folder renamed into place, ``COMPLETED`` in it; an earlier ``folder`` is
    replaced whole. Local folders only (a remote run's sets live in a local cache)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from rmflow.schemas.record import encode

    staging = f"{folder}.writing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    shard = "train-00000-of-00001.array_record"
    writer = ArrayRecordWriter(os.path.join(staging, shard), "group_size:1")
    for record in prepared.records:
        writer.write(encode(record))
    writer.close()
    shutil.copytree(pcfg.tokenizer, os.path.join(staging, TOKENIZER_DIR))
    n = len(prepared.records)
    manifest = Manifest(kind=prepared.stats["kind"], tokenizer=tokenizer, max_length=pcfg.max_length,
                        length_policy=pcfg.length_policy, splits={"train": SplitInfo(n, (ShardInfo(shard, n),))},
                        inputs=tuple(InputFile(path, size) for path, size in prepared.inputs),
                        config=json.loads(pcfg.to_json()), layouts=prepared.layouts,
                        weighted_scores=bool(prepared.stats["counts"]["scored_by_weights"]))
    for name, text in ((MANIFEST_FILE, manifest.to_json()), (STATS_FILE, jsontext.dumps(prepared.stats, indent=2) + "\n"),
                       (CONFIG_FILE, pcfg.to_json()),
                       (ERRORS_FILE, "".join(jsontext.dumps(d, sort_keys=True) + "\n" for d in prepared.dead)),
                       (COMPLETED_FILE, "")):
        with open(os.path.join(staging, name), "w", encoding="utf-8") as f:
            f.write(text)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(staging, folder)
    return manifest


def _holds_k_responses(name: str, paths: list[str], training) -> bool:
    """Whether raw eval set ``name`` is K responses per prompt to evaluate as pairs in a pairs run
    (its files' first records tell); a pairs set in a K-response run is refused here, before
    anything is written."""
    from rmflow.rendering.files import expand_inputs
    from rmflow.rendering.prepare import first_layout
    from rmflow.schemas.config import MULTI_FORMATS, STEP_FORMATS

    layouts = {first_layout(path) for path, _ in expand_inputs(tuple(paths))} - {None}
    if not layouts:
        return False
    kind = RESPONSES.name if layouts <= set(MULTI_FORMATS) else PROCESS.name if layouts <= set(STEP_FORMATS) else \
        OUTCOME.name if not layouts & {*MULTI_FORMATS, *STEP_FORMATS} else None
    if kind is None or kind == training.kind:
        return False
    if (kind, training.kind) == (RESPONSES.name, OUTCOME.name):
        return True
    raise TrainError(other_kind(name, kind, training.kind))
