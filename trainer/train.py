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
from rmflow.schemas import jsontext
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.kinds import ModelKind
from rmflow.schemas.outputs import output_lock
from rmflow.schemas.presets import is_preset
from rmflow.schemas.sources import canonical_data, with_paths
from rmflow.schemas.stops import at_step_boundaries
from rmflow.schemas.train_config import RESUME_FIXED, TrainConfig
from rmflow.trainer import storage
from rmflow.trainer.backend import configure_xla
from rmflow.trainer.batching import stack_micro_batches, widen
from rmflow.trainer.checkpoints import checkpoint_manager, existing_checkpoint, prune, reading_checkpoint
from rmflow.trainer.compilation import use_compilation_cache
from rmflow.trainer.data import LoaderSpec, make_loader
from rmflow.trainer.data.lookahead import Lookahead, checkpointable
from rmflow.trainer.data.rows import OtherPackingState
from rmflow.trainer.errors import Interrupted, TrainError
from rmflow.trainer.loggers import Reporters, check_available
from rmflow.trainer.memory import release_free_memory
from rmflow.trainer.memory_plan import MemoryPlan, check_memory, plan_memory
from rmflow.trainer.model_setup import (
    build_model,
    check_output,
)
from rmflow.trainer.modeling.convert import resolve
from rmflow.trainer.parallel import BATCH_AXES, distributed, make_mesh
from rmflow.trainer.plan import plan_run
from rmflow.trainer.rundir import (
    CONFIG_HISTORY,
    METRICS_FILE,
    MODEL_CONFIG,
    append_history,
    read_history,
    record_config,
    resume_changes,
    write_history,
    write_mixture,
    write_run_files,
)
from rmflow.trainer.step import Trainer, TrainState, make_trainer
from rmflow.trainer.window import MetricWindow


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    trainer: Trainer
    history: list[dict[str, Any]]
    total_steps: int


# --------------------------------------------------------------------------- run


class Run:
    """A planned run (``trainer.plan``) on this process's devices: the mesh, the model and its
    jitted trainer, the loaders and the evaluation."""

    def __init__(self, cfg: TrainConfig, *, abstract: bool = False):
        """``abstract``: the model's variables as shapes only, no weight drawn or read (what a
        memory plan compiles against: ``trainer.memory_plan``)."""
        self.cfg = cfg
        self.mesh = make_mesh(cfg.mesh.shape)
        self.plan = plan = plan_run(cfg, mesh_shape=dict(self.mesh.shape), processes=jax.process_count(),
                                    backend=jax.default_backend())
        model = build_model(cfg, plan.manifest, plan.objective, plan.packing, self.mesh.size, plan.primary,
                            abstract=abstract)
        self.trainer = make_trainer(cfg, model, plan.total_steps, plan.objective)
        self.objective = self.trainer.objective  # with the router's loss for a mixture of experts
        # The read-ahead window's groups compile_ahead has looked at, by their batches' ids.
        self._looked_at: dict[tuple[int, ...], list] = {}
        release_free_memory()  # initialisation temporaries
        if not abstract:  # a memory plan's run warns nothing: the run itself will
            plan.warn_small_evals()

    def train_loader(self):
        plan = self.plan
        return self.loader(plan.train_sets if plan.mixture else plan.train_sets[0], train=True,
                           per_doubling=plan.train_rounding, weights=plan.weights)

    def eval_loader(self, name: str, workers: int | None = None):
        return self.loader(self.plan.eval_sets[name], train=False, per_doubling=self.plan.eval_rounding[name],
                           workers=workers)

    def loader(self, paths, *, train: bool, per_doubling: int, weights=None, workers: int | None = None):
        plan = self.plan
        return make_loader(paths, LoaderSpec(batch_size=plan.local_batch, max_length=plan.max_length, seed=self.cfg.seed,
                           num_epochs=None if train else 1, shuffle=train,
                           worker_count=self.cfg.data.workers if workers is None else workers,
                           pad_id=plan.pad_id, packing=plan.packing, rows=plan.rows, objective=self.objective,
                           weights=weights, per_doubling=per_doubling,
                           **({"row_tokens": plan.row_shape.tokens, "row_slots": plan.row_shape.slots}
                              if plan.row_shape else {})))

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
        step, at most ``steps_left`` steps) whose shapes are new. A group already looked at (it
        stays in the read-ahead window for several steps) is not stacked again."""
        accum = self.cfg.grad_accum
        looked_at = {}
        for i in range(0, min(len(coming) // accum, steps_left) * accum, accum):
            group = coming[i : i + accum]
            ids = tuple(id(b) for b in group)
            looked_at[ids] = group  # held while in the window, so that no new batch takes these ids
            if ids not in self._looked_at:
                self.trainer.compile_ahead(stack_micro_batches(group, self.objective))
        self._looked_at = looked_at

    def compile_evals_ahead(self) -> None:
        """Compile the eval step, in the background, for every shape the run's evaluations will
        meet (each eval set's batches as its loader makes them, read in the background job: in
        this process, no loader workers), so that no evaluation waits for the compiler."""
        def batches():
            for name in self.plan.eval_sets:
                for b in self.eval_loader(name, workers=0):
                    yield stack_micro_batches([b], self.objective)

        self.trainer.compile_evals_ahead(batches)

    def eval_sums(self, params, name: str) -> dict[str, float]:
        # Each batch's sums stay on the device until the set is done: no wait between batches.
        outs = [self.trainer.eval_batch(params, self.to_device([b])) for b in self.eval_loader(name)]
        sums = dict.fromkeys(self.objective.sum_keys, 0.0)
        for s in jax.device_get(outs):  # in float64; an attribute head's: one per attribute
            sums = self.objective.merge(sums, {k: np.asarray(s[k], np.float64) for k in sums})
        return sums

    def evaluate(self, params) -> dict[str, Any]:
        """Metrics of every eval set: ``eval_*`` for the data's eval split (of all sets of a
        mixture together, from the summed counts), ``eval/NAME/*`` for each named set."""
        self.trainer.finish_eval_compiles()
        out, total = {}, dict.fromkeys(self.objective.sum_keys, 0.0)
        for name in self.plan.eval_sets:
            sums = self.eval_sums(params, name)
            if name:
                out.update({f"eval/{name}/{k}": v for k, v in self.objective.metrics(sums).items()})
            if name in self.plan.data_evals:
                total = self.objective.merge(total, sums)
        if self.plan.data_evals:
            out = {**{f"eval_{k}": v for k, v in self.objective.metrics(total).items()}, **out}
        release_free_memory()  # what compiling the eval shapes left
        return out


def check_same_head(run_dir: str, model_config) -> None:
    """A resumed run's score head must be its checkpoints' (its outputs and their names: another
    objective or other attribute ratings make another head), checked before any file of the run
    is rewritten, so that a refused resume leaves the run as it was."""
    stored = jsontext.read(os.path.join(run_dir, MODEL_CONFIG))
    before = (stored.get("num_labels", 1), tuple(stored.get("attributes") or ()), stored.get("member_layers", 0))
    now = (model_config.num_labels, model_config.attributes, model_config.member_layers)
    if before != now:
        def said(head):
            return (f"{head[0]} output(s)" + (f" ({', '.join(head[1])})" if head[1] else "")
                    + (f", each member with its own top {head[2]} layers" if head[2] else ""))

        raise TrainError(f"--resume: the run's checkpoints hold a score head of {said(before)}; this config trains "
                         f"one of {said(now)} (another objective, other attribute ratings or another "
                         "ensemble.members or ensemble.layers): resume with the run's objective, data and ensemble, or start a new run "
                         "(another --output)")


def run(cfg: TrainConfig, *, resume: bool = False, on_log: Callable[[dict], None] | None = None,
        on_start: Callable[[int, ModelKind], None] | None = None, allow_config_change: bool = False) -> TrainResult:
    """Train; ``on_start(step, kind)`` is called once every check has passed, before the first step
    (``step`` > 0 when resuming; ``kind``: the reward model kind of the run's shards), ``on_log(record)``
    with each metrics record. The run directory is
    locked for the whole run (by process 0 of a multi-process run): a second run into it is refused.
    A resume whose config would change the run's trajectory is refused unless ``allow_config_change``;
    every config a run trains under is kept in config_history.jsonl."""
    cfg = cfg.with_absolute_paths()  # stored in the run: valid from any working directory
    configure_xla()  # before the backend starts
    distributed.initialize(cfg.mesh.distributed, cfg.mesh.coordinator_address, cfg.mesh.num_processes)  # before any backend use
    lock = output_lock(cfg.output, "rmflow train") if distributed.is_primary() else contextlib.nullcontext()
    with lock, at_step_boundaries() as stop:  # from here a signal stops the run at its next step boundary
        return _run(cfg, resume, on_log, on_start, allow_config_change, stop)


def _run(cfg: TrainConfig, resume: bool, on_log, on_start, allow_config_change: bool, stop: list[int]
         ) -> TrainResult:
    use_compilation_cache(cfg.compilation_cache)
    if storage.is_remote(cfg.output) and jax.process_count() > 1:
        raise TrainError(f"--output {cfg.output}: a multi-process run writes its checkpoints from every process, "
                         "so --output must be a folder all hosts share (NFS/Filestore, or a gcsfuse mount)")
    local_sources = with_paths(cfg.sources, storage.stage_shards)  # remote shards: a local copy (disk checked first)
    run_dir = storage.local_run_dir(cfg.output, resume)  # remote run: written locally, mirrored after saves
    check_output(run_dir)
    # Every check before anything is written: a refused run leaves the existing one intact.
    latest, changed = check_resume(cfg, run_dir, local_sources, resume, allow_config_change)
    run_cfg = dataclasses.replace(staged_config(cfg, local_sources), output=run_dir)
    check_available(cfg)
    check_memory(run_cfg, abstract_run)  # on an accelerator: a step that cannot fit is refused before any weight is loaded
    r = Run(run_cfg)
    if resume and latest is None:
        warnings.warn(f"--resume: {cfg.output} has no checkpoint to continue from; starting at step 0",
                      RmflowWarning, stacklevel=2)
    if cfg.ensemble.members and not cfg.center_rewards_coefficient:
        warnings.warn("ensemble.members without center_rewards_coefficient: Bradley-Terry leaves each member's "
                      "offset free, so the members' spread (score_std, lcb rewards, the disagreement figures) "
                      "measures their offsets more than their disagreement; set center_rewards_coefficient (e.g. "
                      "0.01) to center each member", RmflowWarning, stacklevel=2)
    if latest is not None:
        check_same_head(run_dir, r.trainer.model(r.trainer.init_state.params).config)
    feed = Feed.of(cfg, r)
    out = Outputs.of(cfg, run_dir, on_log)
    state = r.trainer.use_mesh(r.mesh)  # parameters and optimizer state sharded by the name rules
    if resume and latest is not None:  # before the run's files are rewritten: a refused restore leaves them
        state = out.restore(latest, state, r.trainer.state_shardings, feed.iterator, r.plan.packing)
    if distributed.is_primary():  # one writer for the run's own files; every process takes part in checkpoints
        _write_run(cfg, r, run_dir, local_sources, latest, changed)
    out.begin(int(state.step))
    if on_start:
        on_start(int(state.step), r.objective.kind)
    loop = Loop(cfg, r, feed, out, MetricWindow(r.objective, [s.name for s in r.plan.sources] if r.plan.mixture else ()),
                stop)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(out.manager.wait_until_finished)
        cleanup.callback(r.trainer.stop_compiling)
        if out.writer is not None:
            cleanup.callback(out.writer.close)
        state = loop.train(state, int(state.step))
    if out.primary and storage.is_remote(cfg.output):  # the closed event files, the last metrics
        storage.mirror(run_dir, cfg.output)
    return TrainResult(state, r.trainer, out.history, r.plan.total_steps)


def abstract_run(cfg: TrainConfig) -> Run:
    """``cfg``'s run with its model as shapes only: what a memory plan compiles against."""
    return Run(cfg, abstract=True)


def memory_plan(cfg: TrainConfig) -> MemoryPlan:
    """``rmflow train --plan``: the memory plan of ``cfg``'s train step (``trainer.memory_plan``),
    made as a run makes it (XLA set up, the compilation cache used, remote shards staged; eval
    sets are not the step's), nothing written to its output."""
    cfg = cfg.with_absolute_paths()
    configure_xla()
    use_compilation_cache(cfg.compilation_cache)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval=None))
    return plan_memory(abstract_run(staged_config(cfg)))[0]


def staged_config(cfg: TrainConfig, local_sources=None) -> TrainConfig:
    """``cfg`` reading local copies of its remote shards (``local_sources``: its training sets
    already staged; default: staged here), the training sets and the named eval sets."""
    local_sources = with_paths(cfg.sources, storage.stage_shards) if local_sources is None else local_sources
    local_evals = {name: [storage.stage_shards(paths[0])] if storage.is_shard_folder(paths) else paths
                   for name, paths in (cfg.data.eval or {}).items()} or None
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train=canonical_data(local_sources),
                                                             eval=local_evals))


def check_resume(cfg: TrainConfig, run_dir: str, local_sources, resume: bool, allow_config_change: bool
                 ) -> tuple[int | None, dict[str, tuple[Any, Any]]]:
    """(the newest checkpoint or None, the options a resume changes): a run with checkpoints
    continues only with --resume, under the options it was trained with unless
    ``allow_config_change`` (never under another model or LoRA: ``RESUME_FIXED``)."""
    latest = existing_checkpoint(run_dir)
    if latest is not None and not resume:
        raise TrainError(f"{cfg.output} already has checkpoints (step {latest}): pass --resume to continue "
                         "or choose another --output")
    changed = resume_changes(run_dir, cfg, local_sources) if latest is not None else {}
    fixed = [k for k in changed if k in RESUME_FIXED]
    if fixed:
        raise TrainError(f"--resume with another {' and '.join(fixed)} than the run's checkpoints have: "
                         + "; ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}: {RESUME_FIXED[k]}" for k in fixed)
                         + ". Resume with the run's own values, or start a new run (another --output)")
    if changed and not allow_config_change:
        raise TrainError(f"--resume with a changed configuration would change the run's trajectory from step "
                         f"{latest}: {'; '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changed.items())}. Resume "
                         "with the run's own values, or pass --allow-config-change (recorded in "
                         f"{CONFIG_HISTORY})")
    return latest, changed


def _write_run(cfg: TrainConfig, r: Run, run_dir: str, local_sources, latest: int | None, changed: dict) -> None:
    """The run's own files: its config, model config, base config, data manifest, mixture."""
    write_run_files(run_dir, cfg, r.trainer.model(r.trainer.init_state.params).config,
                    None if is_preset(cfg.model.path) else resolve(cfg.model.path), data_dir=r.plan.primary)
    if r.plan.mixture:
        write_mixture(run_dir, cfg.sources, local_sources, r.plan.train_units,
                      drawn=r.plan.total_steps * cfg.batch_size * cfg.grad_accum)
    if latest is None or changed:
        record_config(run_dir, cfg, latest or 0, changed)


@dataclasses.dataclass
class Feed:
    """The training batches: the loader's iterator, read ``ahead`` steps ahead (in a Lookahead)
    when shapes compile in the background."""

    iterator: Any
    ahead: int

    @classmethod
    def of(cls, cfg: TrainConfig, r: Run) -> Feed:
        iterator = iter(r.train_loader())
        ahead = compile_ahead_steps(cfg.compile_ahead, jax.default_backend(), jax.process_count())
        return cls(Lookahead(iterator, ahead * cfg.grad_accum) if ahead else iterator, ahead)


@dataclasses.dataclass
class Outputs:
    """Where a run's results go: its folder, the checkpoint manager, the metrics history (and
    its file), TensorBoard and W&B on the primary process, and the caller's ``on_log``."""

    cfg: TrainConfig
    run_dir: str
    manager: Any  # Orbax's checkpoint manager
    writer: Reporters | None
    primary: bool
    on_log: Callable[[dict], None] | None
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, cfg: TrainConfig, run_dir: str, on_log) -> Outputs:
        return cls(cfg, run_dir, checkpoint_manager(run_dir), None, distributed.is_primary(), on_log)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, METRICS_FILE)

    def restore(self, latest: int, state: TrainState, shardings, iterator, packing: str) -> TrainState:
        """The state and the loader's position at checkpoint ``latest``, onto this run's mesh
        (whatever mesh saved it); the history up to it. ``packing``: the run's resolved packing mode,
        named when the loader's saved position is another mode's."""
        import grain
        import orbax.checkpoint as ocp

        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
                    for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(shardings))]
        with reading_checkpoint(self.run_dir, latest):
            try:
                restored = self.manager.restore(latest, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract),
                    data=grain.checkpoint.CheckpointRestore(checkpointable(iterator))))
            except OtherPackingState:  # saved by pack, bucket or none; this run packs fixed rows
                raise TrainError(_other_mode(latest, packing, "pack, bucket or none", "pack")) from None
            except KeyError as e:  # Grain's batch iterator given the fixed rows' state
                if packing == "fixed":
                    raise
                raise TrainError(_other_mode(latest, packing, "fixed", "fixed")) from e
        self.history = [h for h in read_history(self.metrics_path) if h["step"] <= latest]
        return jax.tree.unflatten(jax.tree.structure(state), list(restored["state"]))

    def begin(self, step: int) -> None:
        """The metrics file as far as ``step``, and the reporters; after a resume TensorBoard drops
        the events logged past the restored checkpoint."""
        if self.primary:
            write_history(self.metrics_path, self.history)
            self.writer = Reporters(self.cfg, self.run_dir, purge_step=step + 1 if step else None)

    def publish(self, step: int, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.primary:
            append_history(self.metrics_path, record)
            self.writer.log(record, step)
        if self.on_log:
            self.on_log(record)


def _other_mode(step: int, packing: str, saved: str, resume_with: str) -> str:
    return (f"--resume: checkpoint {step} holds the loader's position as packing {saved} saves it, and this run "
            f"packs {packing}: resume with the run's own mode (--set data.packing={resume_with} "
            "--allow-config-change; a run started when auto meant pack resumes with pack)")


@dataclasses.dataclass(frozen=True)
class Hook:
    """Something the loop does at a step boundary when ``due(step)``: ``act(step, state, record)``
    adds to the step's record or acts on the state."""

    name: str
    due: Callable[[int], bool]
    act: Callable[[int, Any, dict], None]


@dataclasses.dataclass
class Loop:
    """The training loop: each step trains one batch, then its hooks (``hooks``, each with the
    steps it is due at) run in order at the step boundary: ``log`` (the window's metrics at
    logging steps, and at saves, so that a resumed run logs alike), ``evaluate`` (at the plan's
    evaluations), ``publish`` (the record to the history, the metrics file, TensorBoard and
    ``on_log``), ``checkpoint`` (at save steps and the last). A stop asked for by a signal is
    taken at the next step boundary (``stop_if_asked``)."""

    cfg: TrainConfig
    run: Run
    feed: Feed
    out: Outputs
    window: MetricWindow
    stop: list[int]  # the signals that asked for a stop (``schemas.stops.at_step_boundaries``)
    shapes: set = dataclasses.field(default_factory=set)  # batch shapes compiled so far
    evals_ahead: bool = False  # the evaluations' shapes sent to the background compiler

    @property
    def hooks(self) -> tuple[Hook, ...]:
        every = self.cfg.logging.steps
        return (Hook("log", lambda step: step % every == 0 or self.saves_at(step),  # windows end at saves
                     lambda step, state, record: record.update({"step": step, **self.window.finish()})),
                Hook("evaluate", lambda step: step in self.run.plan.evaluations, self.evaluate),
                Hook("publish", lambda step: True, self.publish),
                Hook("checkpoint", self.saves_at, lambda step, state, record: self.save(step, state)))

    @property
    def iterator(self) -> Any:
        return self.feed.iterator

    @property
    def manager(self) -> Any:
        return self.out.manager

    def train(self, state: TrainState, step: int) -> TrainState:
        hooks = self.hooks
        while step < self.run.plan.total_steps:
            self.stop_if_asked(step, state)
            state = self.train_step(state, step)
            step += 1
            record: dict[str, Any] = {}
            for hook in hooks:
                if hook.due(step):
                    hook.act(step, state, record)
        return state  # a stop asked for during the last step: the run is complete, saved

    def saves_at(self, step: int) -> bool:
        return bool(self.cfg.checkpoint.save_steps and step % self.cfg.checkpoint.save_steps == 0) or step == self.run.plan.total_steps

    def train_step(self, state: TrainState, step: int) -> TrainState:
        """One step: the next micro-batches to the device (the coming shapes compiled ahead),
        trained; its metrics into the window, a diverged loss refused."""
        r, cfg = self.run, self.cfg
        micro = [next(self.iterator) for _ in range(cfg.grad_accum)]
        if self.feed.ahead:
            r.compile_ahead(self.iterator.ahead(), r.plan.total_steps - step - 1)
            if not self.evals_ahead:  # queued behind the first train shapes
                self.evals_ahead = True
                r.compile_evals_ahead()
        batch = r.to_device(micro)
        compiles = batch["input_ids"].shape not in self.shapes
        if compiles:  # the compiler needs a few hundred MiB: start it from a trimmed heap
            self.shapes.add(batch["input_ids"].shape)
            release_free_memory()
        state, m = r.trainer.train_step(state, batch)
        m = jax.device_get(m)
        if compiles:  # and give back what it freed
            release_free_memory()
        loss = float(m["loss_sum"]) / max(float(m[r.objective.count_key]), 1.0)
        if not math.isfinite(loss):
            raise TrainError(
                f"loss is {loss} at step {step + 1}: training diverged. Nothing from this step was saved; the "
                f"newest checkpoint is step {self.manager.latest_step()}. Lower learning_rate or max_grad_norm.")
        self.window.add(m, micro, slots=batch["input_ids"].size)
        return state

    def evaluate(self, step: int, state: TrainState, record: dict) -> None:
        record.setdefault("step", step)
        record.update(self.run.evaluate(state.params))

    def publish(self, step: int, state: TrainState, record: dict) -> None:
        if record:
            self.out.publish(step, record)

    def save(self, step: int, state: TrainState) -> None:
        import grain
        import orbax.checkpoint as ocp

        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(jax.tree.leaves(state)),
            data=grain.checkpoint.CheckpointSave(checkpointable(self.iterator))))
        self.manager.wait_until_finished()
        prune(self.manager, self.out.history, self.cfg)
        if self.out.primary and storage.is_remote(self.cfg.output):
            self.manager.wait_until_finished()
            if self.out.writer is not None:
                self.out.writer.flush()
            storage.mirror(self.out.run_dir, self.cfg.output)

    def stop_if_asked(self, step: int, state: TrainState) -> None:
        """Stop at this step boundary when a signal asked to: save its checkpoint (unless saved),
        then raise Interrupted."""
        if not self.stop:
            return
        if step and self.manager.latest_step() != step:
            self.save(step, state)
        self.manager.wait_until_finished()
        name = signal.Signals(self.stop[0]).name
        where = f"checkpoint step {step} is saved" if step else "no step was trained, so nothing was saved"
        raise Interrupted(f"stopped by {name} at step {step}: {where}; continue with `rmflow train --output "
                          f"{self.cfg.output} ... --resume`", self.stop[0])


COMPILE_AHEAD_ON_ACCELERATORS = 8


def compile_ahead_steps(setting: int, backend: str, processes: int) -> int:
    """Steps to read ahead for background compilation: ``compile_ahead`` resolved (-1: on GPU and
    TPU only); none with several processes, which agree on each step's shape as it comes."""
    if processes > 1:
        return 0
    if setting < 0:
        return COMPILE_AHEAD_ON_ACCELERATORS if backend in ("gpu", "tpu", "cuda", "rocm") else 0
    return setting


