"""A training run's named eval sets (``data.eval``) given as raw files: preprocessed, before the
run, into ``RUN/eval_data/NAME`` with the training data's own tokenizer (its chat template as
used), max_length, length policy and step separator, all in one split; shard folders are used
as they are. `rmflow train` and `rmflow run` call this; the trainer reads only shard folders.

Bad records are handled as `rmflow eval` handles them in raw files: each is set aside with its
reason in the set's errors file (``RUN/eval_data/NAME/errors.jsonl``), said in a warning, and
the set is evaluated on the rest; a set with nothing usable stops the run before it starts, its
reasons kept beside it (``RUN/eval_data/NAME.errors.jsonl``), no staging folder left behind.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import warnings

from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.kinds import OUTCOME, PROCESS, RESPONSES
from rmflow.schemas.manifest import ERRORS_FILE, TOKENIZER_DIR
from rmflow.schemas.train_config import TrainConfig, fits_ratings
from rmflow.trainer import storage
from rmflow.trainer.errors import TrainError
from rmflow.trainer.model_setup import check_output, read_manifest
from rmflow.trainer.plan import other_kind
from rmflow.trainer.rundir import EVAL_DATA


def preprocess_eval_sets(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with every raw ``data.eval`` set replaced by its shard folder (``RUN/eval_data/NAME``;
    for a remote run, a local cache folder). The bad records of each are counted in that folder's
    errors file, as `rmflow preprocess` counts them."""
    raw = {name: paths for name, paths in (cfg.data.eval or {}).items() if not storage.is_shard_folder(paths)}
    if not raw:
        return cfg
    if not storage.is_remote(cfg.output):
        check_output(cfg.output)  # the sets go inside the run's folder: never into a folder of other files
    from rmflow.pipelines.preprocess import PreprocessError
    from rmflow.pipelines.preprocess import run as preprocess
    from rmflow.pipelines.staging import SUFFIX as STAGING_SUFFIX

    data = storage.stage_shards(cfg.sources[0].path)
    ratings = fits_ratings(cfg.objective)
    manifest = read_manifest(data)
    root = storage.cache_dir(cfg.output, EVAL_DATA) if storage.is_remote(cfg.output) \
        else os.path.join(cfg.output, EVAL_DATA)
    evals = dict(cfg.data.eval)
    as_pairs = {name: _holds_k_responses(name, paths, manifest) for name, paths in raw.items()}  # before any is written
    for name, paths in raw.items():
        folder = os.path.join(root, name)
        kept = folder + "." + ERRORS_FILE  # a failed set's reasons (an earlier run's are stale now)
        if os.path.exists(kept):
            os.remove(kept)
        if as_pairs[name]:
            warnings.warn(f"data.eval {name!r} holds K responses per prompt and this run trains on preference pairs: "
                          "it is evaluated as every two of a prompt's responses whose scores differ (--pairs-from "
                          "expand), whose accuracy is the ranking's pairwise accuracy; `rmflow eval` of the trained "
                          "model on it gives best-of-K and Kendall's tau too", RmflowWarning, stacklevel=2)
        try:
            result = preprocess(PreprocessConfig(
                inputs=tuple(paths), output=folder, tokenizer=os.path.join(data, TOKENIZER_DIR),
                max_length=cfg.data.max_length_over(manifest.max_length), length_policy=manifest.length_policy,
                step_separator=manifest.step_separator, eval_fraction=0.0,
                max_bad_fraction=1.0, overwrite=True, **({"pairs_from": "expand"} if as_pairs[name] else {}),
                # a regression head's ratings, as the training shards keep them, and the weights their scores came from
                **({"attributes": manifest.config["attributes"]} if manifest.attributes and ratings else {}),
                **({"attribute_weights": manifest.config["attribute_weights"]}
                   if manifest.config.get("attribute_weights") else {})))
        except PreprocessError as e:
            for staging in glob.glob(glob.escape(folder) + STAGING_SUFFIX + "*"):
                if os.path.exists(os.path.join(staging, ERRORS_FILE)):
                    shutil.copy(os.path.join(staging, ERRORS_FILE), kept)
                shutil.rmtree(staging, ignore_errors=True)
            where = f"; every record and its reason: {kept}" if os.path.exists(kept) else ""
            raise TrainError(f"data.eval {name!r} ({', '.join(paths)}): {e.reason or e}{where}") from e
        if result.manifest.kind != manifest.kind:  # a layout the files' first records did not show
            shutil.rmtree(folder, ignore_errors=True)
            raise TrainError(other_kind(name, result.manifest.kind, manifest.kind))
        counts = result.stats["counts"]
        if counts["errors"]:
            warnings.warn(f"data.eval {name!r}: {counts['errors']} of {counts['records_read']} records cannot be "
                          f"used (each with its reason in {os.path.join(folder, ERRORS_FILE)}); evaluating on the "
                          f"{counts['pairs_written']} others", RmflowWarning, stacklevel=2)
        evals[name] = [folder]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval=evals))


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
