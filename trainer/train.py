"""`rmflow train`: shards + a checkpoint (or the tiny preset) to a trained reward model.

``run(cfg)`` checks the shards' manifest against the run, builds the model and the Grain
loader, and trains with the jitted step on a device mesh (``data`` x ``fsdp`` x ``tensor``, from
the config) over the devices of every process, parameters and optimizer state sharded by the
name rules of ``trainer.parallel``.
Every ``save_steps`` it saves, with Orbax, the train state (params, optimizer state, step, RNG)
together with the Grain iterator's state, so ``resume=True`` continues on exactly the next
batch: after a crash or ``kill -9`` the final parameters and the metric history equal those
of a run never interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rmflow.schemas.config import TrainConfig
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.kinds import ModelKind
from rmflow.schemas.manifest import MANIFEST_FILE, ManifestError
from rmflow.schemas.outputs import output_lock
from rmflow.schemas.presets import is_preset
from rmflow.schemas.sources import DataSource, canonical_data, with_paths
from rmflow.schemas.stops import at_step_boundaries
from rmflow.trainer import storage
from rmflow.trainer.batching import stack_micro_batches, widen
from rmflow.trainer.checkpoints import checkpoint_manager, existing_checkpoint, prune, reading_checkpoint
from rmflow.trainer.compilation import use_compilation_cache
from rmflow.trainer.data import count_records, lengths_per_doubling, make_loader, resolve_packing
from rmflow.trainer.data.lookahead import Lookahead
from rmflow.trainer.errors import Interrupted, TrainError
from rmflow.trainer.loggers import Reporters, check_available
from rmflow.trainer.memory import release_free_memory
from rmflow.trainer.modeling.convert import resolve
from rmflow.trainer.objective import objective_for
from rmflow.trainer.parallel import BATCH_AXES, batch_shards, distributed, make_mesh
from rmflow.trainer.rundir import (
    CONFIG_HISTORY,
    METRICS_FILE,
    RESUME_SHAPE_KEYS,
    append_history,
    read_history,
    record_config,
    resume_changes,
    write_history,
    write_mixture,
    write_run_files,
)
from rmflow.trainer.setup import (
    build_model,
    check_output,
    check_same_preprocessing,
    evaluates_at,
    plan_steps,
    read_manifest,
    shard_paths,
)
from rmflow.trainer.step import Trainer, TrainState, make_trainer
from rmflow.trainer.window import MetricWindow

SMALL_EVAL = 20  # an eval split below this many pairs gets a warning: its accuracy says little


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    trainer: Trainer
    history: list[dict[str, Any]]
    total_steps: int


# --------------------------------------------------------------------------- run


class Run:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.sources = cfg.sources
        self.mixture = len(self.sources) > 1
        manifests = [read_manifest(s.path) for s in self.sources]
        check_same_preprocessing(self.sources, manifests)
        # The run's manifest (kept in the run directory): the set allowing the longest sequences
        self.manifest = max(manifests, key=lambda m: m.max_length)
        self.primary = self.sources[manifests.index(self.manifest)].path
        self.max_length = cfg.max_length or self.manifest.max_length
        for source, manifest in zip(self.sources, manifests):
            try:
                manifest.check_compatible(max_length=self.max_length)
            except ManifestError as e:
                raise TrainError(f"{source.path}: {e}" if self.mixture else str(e)) from e
        self.objective = objective_for(self.manifest.kind)
        self.train_sets = [shard_paths(s.path, m, "train") for s, m in zip(self.sources, manifests)]
        for source, paths in zip(self.sources, self.train_sets):
            if not paths:
                raise TrainError(f"{source.path} has no train {self.objective.kind.units}")
        # Evaluated at each eval: the eval split of the data (of each set of a mixture, by its name)
        self.eval_sets = {(s.name if self.mixture else ""): paths for s, m in zip(self.sources, manifests)
                          if (paths := shard_paths(s.path, m, "eval"))}
        self.data_evals = tuple(self.eval_sets)  # their counts add up to eval_*
        self.add_named_eval_sets(cfg.eval_data or {})
        check_metric_for_best(cfg.metric_for_best, self)
        if not self.objective.kind.pairwise and cfg.center_rewards_coefficient:
            raise TrainError(f"{cfg.data} holds {self.objective.kind.data} ({self.objective.kind.description}): "
                             "center_rewards_coefficient applies to pairwise (outcome) reward models; set it to 0")
        self.mesh = make_mesh(cfg.mesh_shape)
        shards, procs = batch_shards(self.mesh), jax.process_count()
        if cfg.batch_size % shards:
            raise TrainError(f"batch_size {cfg.batch_size} must be a multiple of the {shards} batch shards "
                             f"(mesh data x fsdp = {self.mesh.shape['data']} x {self.mesh.shape['fsdp']})")
        if shards % procs:
            raise TrainError(f"the mesh splits batches {shards} ways, not a multiple of the {procs} processes")
        self.rows = shards // procs  # packed rows of this process's micro-batch: one per batch shard
        self.local_batch = cfg.batch_size // procs  # pairs this process reads per micro-batch
        backend = jax.default_backend()
        self.packing = resolve_packing(cfg.packing, backend, self.mesh.size)
        self.train_units = [m.splits["train"].records for m in manifests]
        self.total_steps = plan_steps(cfg, sum(self.train_units))
        if cfg.warmup_steps >= self.total_steps:
            raise TrainError(f"warmup_steps {cfg.warmup_steps} >= the run's {self.total_steps} steps: the learning "
                             "rate would never reach its peak; use fewer warmup steps")
        # How finely each loader rounds its rows (lengths_per_doubling), by the batches its shapes serve
        # (the run's steps; an eval set's batches on this process times the run's evaluations) and
        # by what a compilation costs on this platform
        self.train_rounding = lengths_per_doubling(self.total_steps, backend)
        evaluations = sum(evaluates_at(cfg, step, self.total_steps) for step in range(1, self.total_steps + 1))
        self.eval_rounding = {}
        for name, paths in self.eval_sets.items():
            batches = -(-(count_records(paths) // procs) // self.local_batch)
            self.eval_rounding[name] = lengths_per_doubling(batches * evaluations, backend)
        model = build_model(cfg, self.manifest, self.packing, self.mesh.size)
        self.pad_id = self.manifest.tokenizer.pad_token_id or 0
        self.trainer = make_trainer(cfg, model, self.total_steps, self.objective)
        release_free_memory()  # initialisation temporaries
        for name, m in zip([s.name if self.mixture else "" for s in self.sources], manifests):
            n_eval = m.splits["eval"].records if "eval" in m.splits else 0
            if 0 < n_eval < SMALL_EVAL:  # after every check: a refused run prints its one line alone
                warnings.warn(f"the eval split{f' of {name}' if name else ''} holds {n_eval} "
                              f"{self.objective.kind.units}: its accuracy moves in steps of {1 / n_eval:.2g} and says "
                              f"little (a 95% interval spans about +-{min(1.0, 0.98 / n_eval ** 0.5):.2f}); preprocess "
                              "with a larger --eval-fraction for a figure to rely on", RmflowWarning, stacklevel=2)

    def add_named_eval_sets(self, eval_data: dict[str, list[str]]) -> None:
        """``eval_data``'s shard folders (raw files were preprocessed before the run: ``rmflow.eval.sets``),
        each evaluated whole (every split) under its name."""
        training = {os.path.realpath(s.path): s.name for s in self.sources}
        for name, paths in eval_data.items():
            folder = paths[0]
            if len(paths) != 1 or not os.path.exists(os.path.join(folder, MANIFEST_FILE)):
                raise TrainError(f"eval_data {name}: {', '.join(paths)} is not a shard folder (no manifest.json): "
                                 "`rmflow train` and `rmflow run` preprocess raw files first "
                                 "(rmflow.eval.sets.preprocess_eval_sets); or give a folder of `rmflow preprocess`")
            if name in self.eval_sets:
                raise TrainError(f"eval_data {name}: a set of the mixture has this name (its eval split is logged "
                                 f"as eval/{name}/...); give the eval set another name")
            if os.path.realpath(folder) in training:
                raise TrainError(f"eval_data {name}: {folder} is training data; its eval split is evaluated already "
                                 "(eval_*); name only held-out sets")
            manifest = read_manifest(folder)
            check_same_preprocessing((DataSource("the data", ""), DataSource(name, folder)), [self.manifest, manifest])
            try:
                manifest.check_compatible(max_length=self.max_length)
            except ManifestError as e:
                raise TrainError(f"eval_data {name} ({folder}): {e}") from e
            paths = [p for split in manifest.splits for p in shard_paths(folder, manifest, split)]
            if not paths:
                raise TrainError(f"eval_data {name}: {folder} holds no {self.objective.kind.units}")
            self.eval_sets[name] = paths

    def train_loader(self):
        weights = [s.weight for s in self.sources] if self.mixture else None
        return self.loader(self.train_sets if self.mixture else self.train_sets[0], train=True,
                           per_doubling=self.train_rounding, weights=weights)

    def eval_loader(self, name: str):
        return self.loader(self.eval_sets[name], train=False, per_doubling=self.eval_rounding[name])

    def loader(self, paths, *, train: bool, per_doubling: int, weights=None):
        return make_loader(paths, batch_size=self.local_batch, max_length=self.max_length, seed=self.cfg.seed,
                           num_epochs=None if train else 1, shuffle=train, worker_count=self.cfg.loader_workers,
                           pad_id=self.pad_id, packing=self.packing, rows=self.rows, kind=self.objective.kind.name,
                           weights=weights, per_doubling=per_doubling)

    def to_device(self, micro: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        """Each process's micro-batches become its slice of the global batch (rows split over
        data x fsdp; a pair's rows never separate). Processes agree on one row length first."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            local = [max(b[k].shape[-1] for b in micro) for k in ("input_ids", "reward_index")]
            length, slots = (int(v) for v in np.max(multihost_utils.process_allgather(np.int32(local)), axis=0))
            micro = [widen(b, length, slots, self.objective) for b in micro]
        host = stack_micro_batches(micro, self.objective)
        sharding = NamedSharding(self.mesh, P(None, BATCH_AXES))
        return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in host.items()}

    def compile_ahead(self, coming: list[dict[str, np.ndarray]], steps_left: int) -> None:
        """Start compiling the train steps of the coming micro-batches (grouped ``grad_accum`` to a
        step, at most ``steps_left`` steps) whose shapes are new."""
        accum = self.cfg.grad_accum
        for i in range(0, min(len(coming) // accum, steps_left) * accum, accum):
            self.trainer.compile_ahead(stack_micro_batches(coming[i : i + accum], self.objective))

    def eval_sums(self, params, name: str) -> dict[str, float]:
        sums = dict.fromkeys(self.objective.sum_keys, 0.0)
        for b in self.eval_loader(name):
            s = self.trainer.eval_step(params, {k: v[0] for k, v in self.to_device([b]).items()})
            for k in sums:
                sums[k] += float(s[k])
        return sums

    def evaluate(self, params) -> dict[str, Any]:
        """Metrics of every eval set: ``eval_*`` for the data's eval split (of all sets of a
        mixture together, from the summed counts), ``eval/NAME/*`` for each named set."""
        out, total = {}, dict.fromkeys(self.objective.sum_keys, 0.0)
        for name in self.eval_sets:
            sums = self.eval_sums(params, name)
            if name:
                out.update({f"eval/{name}/{k}": v for k, v in self.objective.metrics(sums).items()})
            if name in self.data_evals:
                total = {k: total[k] + sums[k] for k in total}
        if self.data_evals:
            out = {**{f"eval_{k}": v for k, v in self.objective.metrics(total).items()}, **out}
        release_free_memory()  # what compiling the eval shapes left
        return out


def run(cfg: TrainConfig, *, resume: bool = False, on_log: Callable[[dict], None] | None = None,
        on_start: Callable[[int, ModelKind], None] | None = None, allow_config_change: bool = False) -> TrainResult:
    """Train; ``on_start(step, kind)`` is called once every check has passed, before the first step
    (``step`` > 0 when resuming; ``kind``: the reward model kind of the run's shards), ``on_log(record)``
    with each metrics record. The run directory is
    locked for the whole run (by process 0 of a multi-process run): a second run into it is refused.
    A resume whose config would change the run's trajectory is refused unless ``allow_config_change``;
    every config a run trains under is kept in config_history.jsonl."""
    cfg = cfg.with_absolute_paths()  # stored in the run: valid from any working directory
    distributed.initialize(cfg.distributed, cfg.coordinator_address, cfg.num_processes)  # before any backend use
    lock = output_lock(cfg.output, "rmflow train") if distributed.is_primary() else contextlib.nullcontext()
    with lock, at_step_boundaries() as stop:  # from here a signal stops the run at its next step boundary
        return _run(cfg, resume, on_log, on_start, allow_config_change, stop)


def _run(cfg: TrainConfig, resume: bool, on_log, on_start, allow_config_change: bool, stop: list[int]
         ) -> TrainResult:
    import grain
    import orbax.checkpoint as ocp

    use_compilation_cache(cfg.compilation_cache)
    primary = distributed.is_primary()
    if storage.is_remote(cfg.output) and jax.process_count() > 1:
        raise TrainError(f"--output {cfg.output}: a multi-process run writes its checkpoints from every process, "
                         "so --output must be a folder all hosts share (NFS/Filestore, or a gcsfuse mount)")
    local_sources = with_paths(cfg.sources, storage.stage_shards)  # remote shards: a local copy (disk checked first)
    run_dir = storage.local_run_dir(cfg.output, resume)  # remote run: written locally, mirrored after saves
    check_output(run_dir, resume)
    # Every check before anything is written: a refused run leaves the existing one intact.
    latest = existing_checkpoint(run_dir)
    if latest is not None and not resume:
        raise TrainError(f"{cfg.output} already has checkpoints (step {latest}): pass --resume to continue "
                         "or choose another --output")
    changed = resume_changes(run_dir, cfg, local_sources) if latest is not None else {}
    shapes = sorted(set(changed) & RESUME_SHAPE_KEYS)
    if shapes:
        raise TrainError(f"--resume with another {' and '.join(shapes)} than the run's checkpoints have "
                         f"({'; '.join(f'{k}: {changed[k][0]!r} -> {changed[k][1]!r}' for k in shapes)}): its "
                         "parameters have other shapes; start a new run (another --output)")
    if changed and not allow_config_change:
        raise TrainError(f"--resume with a changed configuration would change the run's trajectory from step "
                         f"{latest}: {'; '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changed.items())}. Resume "
                         "with the run's own values, or pass --allow-config-change (recorded in "
                         f"{CONFIG_HISTORY})")
    local_evals = {name: [storage.stage_shards(paths[0])] if storage.is_shard_folder(paths) else paths
                   for name, paths in (cfg.eval_data or {}).items()} or None
    r = Run(dataclasses.replace(cfg, data=canonical_data(local_sources), eval_data=local_evals, output=run_dir))
    check_available(cfg)
    if resume and latest is None:
        warnings.warn(f"--resume: {cfg.output} has no checkpoint to continue from; starting at step 0",
                      RmflowWarning, stacklevel=2)
    if primary:  # one writer for the run's own files; every process takes part in checkpoints
        write_run_files(run_dir, cfg, r.trainer.model(r.trainer.init_state.params).config,
                        None if is_preset(cfg.model) else resolve(cfg.model), data_dir=r.primary)
        if r.mixture:
            write_mixture(run_dir, cfg.sources, local_sources, r.train_units,
                          drawn=r.total_steps * cfg.batch_size * cfg.grad_accum)
        if latest is None or changed:
            record_config(run_dir, cfg, latest or 0, changed)

    state = r.trainer.use_mesh(r.mesh)  # parameters and optimizer state sharded by the name rules
    treedef = jax.tree.structure(state)
    iterator = iter(r.train_loader())
    ahead = compile_ahead_steps(cfg.compile_ahead, jax.default_backend(), jax.process_count())
    if ahead:
        iterator = Lookahead(iterator, ahead * cfg.grad_accum)
    manager = checkpoint_manager(run_dir)
    history = []
    metrics_path = os.path.join(run_dir, METRICS_FILE)
    if resume and latest is not None:
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # onto this run's mesh, whatever saved it
                    for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(r.trainer.state_shardings))]
        with reading_checkpoint(run_dir, latest):
            restored = manager.restore(latest, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(iterator)))
        state = jax.tree.unflatten(treedef, list(restored["state"]))
        history = [h for h in read_history(metrics_path) if h["step"] <= latest]
    if primary:
        write_history(metrics_path, history)

    # After a resume, TensorBoard drops the events logged past the restored checkpoint.
    writer = Reporters(cfg, run_dir, purge_step=int(state.step) + 1 if resume and latest is not None else None) \
        if primary else None
    window = MetricWindow(r.objective, [s.name for s in r.sources] if r.mixture else ())
    step = int(state.step)
    if on_start:
        on_start(step, r.objective.kind)
    shapes = set()  # batch shapes compiled so far
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(manager.wait_until_finished)
        cleanup.callback(r.trainer.stop_compiling)
        if writer is not None:
            cleanup.callback(writer.close)
        state, history = _loop(cfg, r, state, step, iterator, ahead, manager, writer, window, history, metrics_path,
                               primary, on_log, shapes, stop, run_dir)
    if primary and storage.is_remote(cfg.output):  # the closed event files, the last metrics
        storage.mirror(run_dir, cfg.output)
    return TrainResult(state, r.trainer, history, r.total_steps)


def _loop(cfg, r, state, step, iterator, ahead, manager, writer, window, history, metrics_path, primary, on_log,
          shapes, stop, run_dir):
    import grain
    import orbax.checkpoint as ocp

    def save(step: int) -> None:
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(jax.tree.leaves(state)),
            data=grain.checkpoint.CheckpointSave(iterator)))
        manager.wait_until_finished()
        prune(manager, history, cfg)
        if primary and storage.is_remote(cfg.output):
            manager.wait_until_finished()
            if writer is not None:
                writer.flush()
            storage.mirror(run_dir, cfg.output)

    while step < r.total_steps:
        if stop:
            _stop(stop[0], step, manager, save, cfg)
        micro = [next(iterator) for _ in range(cfg.grad_accum)]
        if ahead:
            r.compile_ahead(iterator.ahead(), r.total_steps - step - 1)
        batch = r.to_device(micro)
        compiles = batch["input_ids"].shape not in shapes
        if compiles:  # the compiler needs a few hundred MiB: start it from a trimmed heap
            shapes.add(batch["input_ids"].shape)
            release_free_memory()
        state, m = r.trainer.train_step(state, batch)
        step += 1
        m = jax.device_get(m)
        if compiles:  # and give back what it freed
            release_free_memory()
        loss = float(m["loss_sum"]) / max(float(m[r.objective.count_key]), 1.0)
        if not math.isfinite(loss):
            raise TrainError(
                f"loss is {loss} at step {step}: training diverged. Nothing from this step was saved; the "
                f"newest checkpoint is step {manager.latest_step()}. Lower learning_rate or max_grad_norm.")
        window.add(m, micro, slots=batch["input_ids"].size)
        record = None
        saving = (cfg.save_steps and step % cfg.save_steps == 0) or step == r.total_steps
        if step % cfg.logging_steps == 0 or saving:  # windows end at saves: resumed runs log alike
            record = {"step": step, **window.finish()}
        if evaluates_at(cfg, step, r.total_steps):
            record = {**(record or {"step": step}), **r.evaluate(state.params)}
        if record:
            history.append(record)
            if primary:
                append_history(metrics_path, record)
                writer.log(record, step)
            if on_log:
                on_log(record)
        if saving:
            save(step)
    return state, history  # a stop asked for during the last step: the run is complete, saved


def _stop(signum: int, step: int, manager, save, cfg: TrainConfig) -> None:
    """Stop at this step boundary: save its checkpoint (unless saved), then raise Interrupted."""
    if step and manager.latest_step() != step:
        save(step)
    manager.wait_until_finished()
    name = signal.Signals(signum).name
    where = f"checkpoint step {step} is saved" if step else "no step was trained, so nothing was saved"
    raise Interrupted(f"stopped by {name} at step {step}: {where}; continue with `rmflow train --output "
                      f"{cfg.output} ... --resume`", signum)


def check_metric_for_best(metric: str, run: Run) -> None:
    """``metric_for_best`` names a metric this run's evals log."""
    if not metric:
        return
    names = run.objective.metric_names
    logged = ([f"eval_{m}" for m in names] if run.data_evals else []) + \
        [f"eval/{s}/{m}" for s in run.eval_sets if s for m in names]
    if metric not in logged:
        shown = ", ".join(k for k in logged if k.endswith(("accuracy", "loss"))) or "none: the run has no eval set"
        raise TrainError(f"metric_for_best {metric!r} is not a metric this run's evals log; for example {shown}")


COMPILE_AHEAD_ON_ACCELERATORS = 8


def compile_ahead_steps(setting: int, backend: str, processes: int) -> int:
    """Steps to read ahead for background compilation: ``compile_ahead`` resolved (-1: on GPU and
    TPU only); none with several processes, which agree on each step's shape as it comes."""
    if processes > 1:
        return 0
    if setting < 0:
        return COMPILE_AHEAD_ON_ACCELERATORS if backend in ("gpu", "tpu", "cuda", "rocm") else 0
    return setting


