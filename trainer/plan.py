"""A run planned before any device work: its data, the checks it must pass, its steps, how its
loaders round rows and when it evaluates.

``plan_run`` reads the shards' manifests and refuses, in one line each, what cannot train (sets
preprocessed differently, a split with nothing in it, eval sets that are training data, a batch
that does not split over the mesh, a warmup as long as the run, a ``metric_for_best`` no eval
logs). It needs the mesh's shape only as numbers (its axes' sizes, the processes) and the
backend's name: a plan is made and tested without a device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Mapping

import numpy as np
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.kinds import OUTCOME, RESPONSES, kind_named
from rmflow.schemas.manifest import MANIFEST_FILE, Manifest, ManifestError
from rmflow.schemas.sources import DataSource
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.data import count_records, lengths_per_doubling, resolve_packing
from rmflow.trainer.data.rows import RowShape, row_shape_for, target_tokens
from rmflow.trainer.errors import TrainError
from rmflow.trainer.model_setup import (
    check_same_preprocessing,
    evaluates_at,
    plan_steps,
    read_manifest,
    shard_paths,
)
from rmflow.trainer.objective import Objective, for_config
from rmflow.trainer.parallel.mesh import batch_shards

SMALL_EVAL = 20  # an eval split below this many records gets a warning: its accuracy says little


@dataclasses.dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig
    sources: tuple[DataSource, ...]
    manifests: tuple[Manifest, ...]
    manifest: Manifest  # the run's (kept in the run directory): the set allowing the longest sequences
    primary: str  # that set's folder
    max_length: int
    objective: Objective
    train_sets: tuple[list[str], ...]  # each set's train shards
    train_units: tuple[int, ...]  # each set's train records
    eval_sets: dict[str, list[str]]  # evaluated at each eval: the data's eval split ("", or each set's by name), named sets
    data_evals: tuple[str, ...]  # the eval sets of the data: their counts add up to eval_*
    rows: int  # packed rows of this process's micro-batch: one per batch shard
    local_batch: int  # records this process reads per micro-batch
    packing: str
    total_steps: int
    evaluations: frozenset[int]  # the steps after which the run evaluates
    train_rounding: int  # lengths per doubling of the train loader's rows (``lengths_per_doubling``)
    eval_rounding: dict[str, int]  # of each eval set's loader
    pad_id: int
    row_shape: RowShape | None = None  # packing ``fixed``: every train and eval micro-batch's shape

    @property
    def mixture(self) -> bool:
        return len(self.sources) > 1

    @property
    def weights(self) -> list[float] | None:
        """The sets' sampling weights of a mixture; None for one set."""
        return [s.weight for s in self.sources] if self.mixture else None

    def warn_small_evals(self) -> None:
        """A warning for each eval split too small for its accuracy to say much (given once every
        check has passed: a refused run prints its one line alone)."""
        for name, m in zip([s.name if self.mixture else "" for s in self.sources], self.manifests):
            n_eval = m.splits["eval"].records if "eval" in m.splits else 0
            if 0 < n_eval < SMALL_EVAL:
                warnings.warn(f"the eval split{f' of {name}' if name else ''} holds {n_eval} "
                              f"{self.objective.kind.units}: its accuracy moves in steps of {1 / n_eval:.2g} and says "
                              f"little (a 95% interval spans about +-{min(1.0, 0.98 / n_eval ** 0.5):.2f}); preprocess "
                              "with a larger --eval-fraction for a figure to rely on", RmflowWarning, stacklevel=3)


def plan_run(cfg: TrainConfig, *, mesh_shape: Mapping[str, int], processes: int, backend: str) -> RunPlan:
    """The plan of ``cfg`` on a device mesh of ``mesh_shape`` (axis -> size, the batch split over
    ``BATCH_AXES``) over ``processes`` processes on ``backend``; raises TrainError on the first
    check it fails."""
    shards = batch_shards(mesh_shape)
    sources = cfg.sources
    mixture = len(sources) > 1
    manifests = [read_manifest(s.path) for s in sources]
    check_distinct_sets(sources, manifests)
    check_same_preprocessing(sources, manifests)
    manifest = max(manifests, key=lambda m: m.max_length)
    primary = sources[manifests.index(manifest)].path
    max_length = cfg.data.max_length_over(manifest.max_length)
    for source, m in zip(sources, manifests):
        try:
            m.check_compatible(max_length=max_length)
        except ManifestError as e:
            raise TrainError(f"{source.path}: {e}" if mixture else str(e)) from e
    try:
        objective = for_config(cfg, manifest)
    except ValueError as e:
        raise TrainError(f"{primary}: {e}") from None
    check_labels(cfg, sources, manifests, objective)
    train_sets = tuple(shard_paths(s.path, m, "train") for s, m in zip(sources, manifests))
    for source, paths in zip(sources, train_sets):
        if not paths:
            raise TrainError(f"{source.path} has no train {objective.kind.units}")
    eval_sets = {(s.name if mixture else ""): paths for s, m in zip(sources, manifests)
                 if (paths := shard_paths(s.path, m, "eval"))}
    data_evals = tuple(eval_sets)
    eval_sets.update(_named_eval_sets(cfg.data.eval or {}, sources, manifest, eval_sets, max_length, objective))
    _check_metric_for_best(cfg.checkpoint.metric_for_best, objective, data_evals, eval_sets)
    if not objective.kind.pairwise and cfg.center_rewards_coefficient:
        raise TrainError(f"{cfg.data.train} holds {objective.kind.data} ({objective.kind.description}): "
                         "center_rewards_coefficient applies to pairwise (outcome) reward models; set it to 0")
    check_batch(cfg.batch_size, mesh_shape, processes)
    local_batch = cfg.batch_size // processes
    train_units = tuple(m.splits["train"].records for m in manifests)
    total_steps = plan_steps(cfg, sum(train_units))
    if cfg.optimizer.warmup_steps >= total_steps:
        raise TrainError(f"optimizer.warmup_steps {cfg.optimizer.warmup_steps} >= the run's {total_steps} steps: the learning "
                         "rate would never reach its peak; use fewer warmup steps")
    evaluations = frozenset(step for step in range(1, total_steps + 1) if evaluates_at(cfg, step, total_steps))
    # How finely each loader rounds its rows, by the batches its shapes serve (the run's steps; an
    # eval set's batches on this process times the run's evaluations) and by what a compilation
    # costs on this platform
    eval_rounding = {name: lengths_per_doubling(-(-(count_records(paths) // processes) // local_batch)
                                                * len(evaluations), backend)
                     for name, paths in eval_sets.items()}
    check_packing(cfg.data.packing, processes)
    plan = RunPlan(cfg=cfg, sources=sources, manifests=tuple(manifests), manifest=manifest, primary=primary,
                   max_length=max_length, objective=objective, train_sets=train_sets, train_units=train_units,
                   eval_sets=eval_sets, data_evals=data_evals, rows=shards // processes, local_batch=local_batch,
                   packing=resolve_packing(cfg.data.packing, backend, math.prod(mesh_shape.values()), processes),
                   total_steps=total_steps, evaluations=evaluations,
                   train_rounding=lengths_per_doubling(total_steps, backend), eval_rounding=eval_rounding,
                   pad_id=manifest.tokenizer.pad_token_id or 0)
    return dataclasses.replace(plan, row_shape=fixed_row_shape(plan)) if plan.packing == "fixed" else plan


SIZE_SAMPLE = 1024  # records whose units size a fixed row (evenly spaced over the training data)


def fixed_row_shape(plan: RunPlan) -> RowShape:
    """The one micro-batch shape of a run in packing ``fixed`` (``trainer.data.rows.row_shape_for``):
    its units sized on ``SIZE_SAMPLE`` records spread evenly over the training sets (a mixture's
    by weight). A row holds the longest unit of the training and eval sets: the longest one
    ``max_length`` allows (a pair's two sequences whole, one solution) when the row is as long
    anyway, else the longest the records' headers give (a pair's two sequences, a solution, a
    prompt and its K responses)."""
    import grain
    from rmflow.schemas.record import decode, peek_lengths

    cfg, objective, local_batch, rows = plan.cfg, plan.objective, plan.local_batch, plan.rows
    collate = objective.packed(local_batch, plan.max_length, plan.pad_id, rows)
    sizes = []
    weights = [s.weight for s in plan.sources]
    for paths, weight in zip(plan.train_sets, weights):
        source = grain.sources.ArrayRecordDataSource(list(paths))
        n = max(16, round(SIZE_SAMPLE * weight / sum(weights)))
        for i in sorted({int(x) for x in np.linspace(0, len(source) - 1, min(n, len(source)))}):
            sizes.append(collate.size(decode(source[i])))
    wanted = cfg.data.row_tokens or target_tokens(sizes, batch_size=local_batch, rows=rows)
    bound = None if objective.kind.name == RESPONSES.name else plan.max_length * (2 if objective.kind.pairwise else 1)
    if bound is not None and wanted >= bound:
        longest = bound
    else:  # every record's header: (chosen, rejected) tokens, a solution's (tokens, 0), a unit's (tokens, 0)
        longest = max(sum(peek_lengths(source[i])) for paths in (*plan.train_sets, *plan.eval_sets.values())
                      for source in [grain.sources.ArrayRecordDataSource(list(paths))] for i in range(len(source)))
    try:
        return row_shape_for(sizes, batch_size=local_batch, rows=rows, longest=longest, row_tokens=cfg.data.row_tokens)
    except ValueError as e:
        raise TrainError(str(e)) from None


def other_kind(name: str, named: str, training: str) -> str:
    """Why eval set ``name``, of records of kind ``named``, cannot be evaluated in a run on records
    of kind ``training``: each kind's eval runs its own objective's figures."""
    return (f"data.eval {name!r} holds {kind_named(named).data} and this run trains on {kind_named(training).data}: a "
            "run evaluates its own kind of records. Evaluate the set after training with `rmflow eval --model RUN "
            "--data ...`" + (", or preprocess it with --pairs-from expand to evaluate it as pairs during the run"
                              if (named, training) == (RESPONSES.name, OUTCOME.name) else ""))


def check_labels(cfg: TrainConfig, sources, manifests: list[Manifest], objective: Objective) -> None:
    """The sets' labels mean one thing to the objective: a regression head fits the same
    attributes in every set, scored by the same weights (unless train gives its own), and margins
    from scores are only preprocessed for an objective that uses them."""
    if objective.regression and len({m.attributes for m in manifests}) > 1:
        raise TrainError("objective " + cfg.objective + ": the sets of the mixture keep different attributes ("
                         + "; ".join(f"{s.name}: {', '.join(m.attributes) or 'none'}" for s, m in zip(sources, manifests))
                         + "); preprocess every set with the same --attributes")
    with_margins = [s.name for s, m in zip(sources, manifests) if m.config.get("margin_from_scores")]
    if with_margins and objective.kind.name == RESPONSES.name and not objective.uses_margins:
        raise TrainError(f"{', '.join(with_margins)}: preprocessed with --margin-from-scores, whose margins objective "
                         f"{cfg.objective} does not use (only a Bradley-Terry ranking does): train with objective "
                         "bradley-terry, or preprocess without --margin-from-scores")
    scored_by = {m.config.get("attribute_weights") or "" for m in manifests if m.scored_by_weights}
    if objective.regression and not cfg.attribute_weights.strip() and len(scored_by) > 1:
        raise TrainError("objective " + cfg.objective + ": the sets of the mixture were scored by different "
                         "attribute weights (" + "; ".join(f"{s.name}: {m.config.get('attribute_weights')}"
                                                           for s, m in zip(sources, manifests) if m.scored_by_weights)
                         + "), and the head's reward would be the first set's: give --attribute-weights "
                         "NAME=WEIGHT,... for the reward, or preprocess the sets with the same weights")


def check_packing(packing: str, processes: int) -> None:
    """Fixed rows run in one process: over several, each process's eval sets would make a
    different number of batches, which the processes must run together."""
    if packing == "fixed" and processes > 1:
        raise TrainError(f"data.packing fixed over {processes} processes: each process's eval sets would make "
                         "a different number of batches, which the processes must run together; use pack (auto "
                         "picks it)")


def check_batch(batch_size: int, mesh_shape: Mapping[str, int], processes: int) -> None:
    """A batch splits evenly over the mesh's batch shards, and those over the processes."""
    shards = batch_shards(mesh_shape)
    if batch_size % shards:
        raise TrainError(f"batch_size {batch_size} must be a multiple of the {shards} batch shards "
                         f"(mesh data x fsdp x expert = "
                         f"{' x '.join(str(mesh_shape.get(a, 1)) for a in ('data', 'fsdp', 'expert'))})")
    if shards % processes:
        raise TrainError(f"the mesh splits batches {shards} ways, not a multiple of the {processes} processes")


def check_distinct_sets(sources, manifests: list[Manifest]) -> None:
    """No two sets of a mixture are the same shards (a link, a copy, or the same inputs preprocessed
    twice with the same options into two folders: ``Manifest.content_identity``), which would
    train on them twice their share without a word."""
    seen: dict[str, str] = {}
    for source, m in zip(sources, manifests):
        key = m.content_identity()
        if key in seen:
            raise TrainError(f"data.train: sets {seen[key]!r} and {source.name!r} are the same shards ({source.path}: "
                             "the same inputs and options: a link, a copy, or a second preprocessing of them): give "
                             "each set once, its weight sets its share")
        seen[key] = source.name


def _named_eval_sets(eval_data: dict[str, list[str]], sources, manifest: Manifest, data_sets: dict[str, list[str]],
                     max_length: int, objective: Objective) -> dict[str, list[str]]:
    """``data.eval``'s shard folders (raw files were preprocessed before the run: ``rmflow.eval.sets``),
    each evaluated whole (every split) under its name."""
    training = {os.path.realpath(s.path): s.name for s in sources}
    out = {}
    for name, paths in eval_data.items():
        folder = paths[0]
        if len(paths) != 1 or not os.path.exists(os.path.join(folder, MANIFEST_FILE)):
            raise TrainError(f"data.eval {name}: {', '.join(paths)} is not a shard folder (no manifest.json): "
                             "`rmflow train` and `rmflow run` preprocess raw files first "
                             "(rmflow.eval.sets.preprocess_eval_sets); or give a folder of `rmflow preprocess`")
        if name in data_sets:
            raise TrainError(f"data.eval {name}: a set of the mixture has this name (its eval split is logged "
                             f"as eval/{name}/...); give the eval set another name")
        if os.path.realpath(folder) in training:
            raise TrainError(f"data.eval {name}: {folder} is training data; its eval split is evaluated already "
                             "(eval_*); name only held-out sets")
        named = read_manifest(folder)
        if named.kind != manifest.kind:
            raise TrainError(other_kind(name, named.kind, manifest.kind))
        check_same_preprocessing((DataSource("the data", ""), DataSource(name, folder)), [manifest, named],
                                 f"data.eval {name!r} and the training data were")
        if objective.regression and named.attributes != objective.attributes:
            raise TrainError(f"data.eval {name}: {folder} keeps the attribute ratings "
                             f"{', '.join(named.attributes) or '(none)'}; the head fits "
                             f"{', '.join(objective.attributes)}, in that order: preprocess it with --attributes "
                             f"{','.join(objective.attributes)}")
        try:
            named.check_compatible(max_length=max_length)
        except ManifestError as e:
            raise TrainError(f"data.eval {name} ({folder}): {e}") from e
        found = [p for split in named.splits for p in shard_paths(folder, named, split)]
        if not found:
            raise TrainError(f"data.eval {name}: {folder} holds no {objective.kind.units}")
        out[name] = found
    return out


def _check_metric_for_best(metric: str, objective: Objective, data_evals: tuple[str, ...],
                           eval_sets: dict[str, list[str]]) -> None:
    """``metric_for_best`` names a metric this run's evals log."""
    if not metric:
        return
    names = objective.metric_names
    logged = ([f"eval_{m}" for m in names] if data_evals else []) + \
        [f"eval/{s}/{m}" for s in eval_sets if s for m in names]
    if metric not in logged:
        shown = ", ".join(k for k in logged if k.endswith(("accuracy", "loss"))) or "none: the run has no eval set"
        raise TrainError(f"checkpoint.metric_for_best {metric!r} is not a metric this run's evals log; for example {shown}")
