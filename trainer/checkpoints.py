"""A run's Orbax checkpoints: the manager, the newest step, and a trained model read back from
one (for evaluation, export and scoring as much as for resuming).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import jax
from flax import nnx
from rmflow.trainer import storage
from rmflow.trainer.compilation import use_compilation_cache
from rmflow.trainer.errors import TrainError
from rmflow.trainer.model_setup import base_model
from rmflow.trainer.modeling import lora
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.objective import greater_is_better
from rmflow.trainer.rundir import (
    CHECKPOINTS,
    METRICS_FILE,
    RunFiles,
    read_history,
    read_run,
)

STATE_ITEM = "state"  # the train state's item in a checkpoint (beside the data loader's)


def checkpoint_manager(run_dir: str):
    """Orbax's manager of a run's checkpoints; it deletes none (``steps_to_keep`` decides)."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(run_dir, CHECKPOINTS)),
        # cleanup_tmp_directories: a checkpoint a killed process left half-written is removed, never read
        options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True, enable_async_checkpointing=False,
                                             cleanup_tmp_directories=True),
        item_names=(STATE_ITEM, "data"),
    )


def steps_to_keep(steps, history: list[dict[str, Any]], *, newest: int, metric: str = "", best: int = 0) -> set[int]:
    """The checkpoints that survive pruning: the ``newest`` latest, and with ``metric`` the
    ``best`` best by its value in the run's history (ties: the earlier step). The history is the
    run's own (rewritten on resume to end at the restored step), so a resumed run ranks its
    earlier checkpoints as the uninterrupted run did."""
    steps = sorted(steps)
    keep = set(steps[-newest:]) if newest else set()
    if metric and best:
        sign = -1.0 if greater_is_better(metric) else 1.0
        scored = {h["step"]: float(h[metric]) for h in history
                  if h.get("step") in steps and isinstance(h.get(metric), (int, float)) and math.isfinite(h[metric])}
        keep |= set(sorted(scored, key=lambda s: (sign * scored[s], s))[:best])
    return keep


def prune(manager, history: list[dict[str, Any]], cfg) -> None:
    """Delete the checkpoints ``steps_to_keep`` does not keep (every process alike)."""
    keep = steps_to_keep(manager.all_steps(), history, newest=cfg.checkpoint.keep_newest,
                         metric=cfg.checkpoint.metric_for_best,
                         best=cfg.checkpoint.keep_best)
    for step in sorted(set(manager.all_steps()) - keep):
        manager.delete(step)


def best_step(run_dir: str, run: RunFiles, steps) -> int:
    """The checkpoint the run's ``metric_for_best`` ranks first (``--step best``)."""
    metric = run.config.checkpoint.metric_for_best
    if not metric:
        raise TrainError(f"--step best: {run_dir} was trained without checkpoint.metric_for_best, so no checkpoint is ranked; "
                         f"give a step ({', '.join(map(str, sorted(steps)))}) or train with --checkpoint.metric-for-best METRIC")
    history = read_history(os.path.join(run_dir, METRICS_FILE))
    ranked = steps_to_keep(steps, history, newest=0, metric=metric, best=1)
    if not ranked:
        raise TrainError(f"--step best: no checkpoint of {run_dir} has a logged {metric} "
                         f"(checkpoints: {sorted(steps)}); give a step")
    return ranked.pop()


def existing_checkpoint(run_dir: str) -> int | None:
    """The newest checkpoint step of a run directory, or None; creates nothing."""
    if not os.path.isdir(os.path.join(run_dir, CHECKPOINTS)):
        return None
    return checkpoint_manager(run_dir).latest_step()


@contextlib.contextmanager
def reading_checkpoint(run_dir: str, step: int):
    """Orbax's failures to read a checkpoint (a damaged file, another layout) as one line."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - Orbax, TensorStore and friends raise many kinds
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise TrainError(f"checkpoint step {step} of {run_dir} cannot be read ({type(e).__name__}: {first}): it is "
                         "damaged or was written by another rmflow; resume from another checkpoint (remove this "
                         "step's folder) or start a new run") from e


def load_trained_model(run_dir: str, step: int | str | None = None) -> tuple[RewardTransformer, RunFiles, int]:
    """The reward model of a run directory, with the parameters of its newest (or given) checkpoint;
    ``step="best"``: the one its ``metric_for_best`` ranks first. Only the trained parameters are
    read: the optimizer's state, twice their size, stays on disk, and no optimizer is built."""
    import orbax.checkpoint as ocp

    run_dir = storage.stage_run(run_dir)  # a remote run: a local copy
    run = read_run(run_dir)
    use_compilation_cache("auto")  # scoring a run twice compiles its shapes once
    latest = existing_checkpoint(run_dir)
    if latest is None:
        raise TrainError(f"{run_dir} has no checkpoint yet: training stopped before its first save "
                         "(resume it with `rmflow train --resume`, or set checkpoint.save_steps)")
    lora_cfg = run.config.lora
    if lora_cfg is not None:  # frozen base weights come from the base model, adapters from here
        model = base_model(run.config.with_overrides(["model.dtype=float32", "model.gradient_checkpointing=false"]),
                           run.model_config, head=run.model_config.head)
    else:
        model = RewardTransformer(run.model_config, rngs=nnx.Rngs(0), attention=run.config.model.attention,
                                  scan_layers=run.config.scans_layers(training=False))
    manager = checkpoint_manager(run_dir)
    step = latest if step is None else best_step(run_dir, run, manager.all_steps()) if step == "best" else step
    if step not in manager.all_steps():
        raise TrainError(f"{run_dir} has no checkpoint of step {step}; it has {sorted(manager.all_steps())}")
    params = nnx.state(model, lora.trainable_filter(lora_cfg))  # what the run trained, as the trainer split it
    leaves, treedef = jax.tree.flatten(params)
    with reading_checkpoint(run_dir, step):
        # the item's own tree metadata (a checkpointer's would look for step metadata inside the item, and warn)
        saved = ocp.PyTreeCheckpointHandler().metadata(manager.directory / str(step) / STATE_ITEM).tree
    # a checkpoint is the train state's leaves in order: the step, the trained parameters, the
    # optimizer's state, the dropout key (trainer.step.TrainState)
    if len(saved) < len(leaves) + 2 or any(tuple(m.shape) != tuple(x.shape) for m, x in zip(saved[1:], leaves)):
        raise TrainError(f"{run_dir}: checkpoint step {step} does not hold the parameters of the run's model "
                         f"({len(leaves)} arrays); it was written by another model or another rmflow")
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # whatever mesh trained it
    target = [ocp.PLACEHOLDER] * len(saved)
    restore = [ocp.PLACEHOLDER] * len(saved)
    for i, x in enumerate(leaves, start=1):
        target[i] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
        restore[i] = ocp.ArrayRestoreArgs(sharding=one, dtype=x.dtype)
    with reading_checkpoint(run_dir, step):
        restored = manager.restore(step, args=ocp.args.Composite(
            **{STATE_ITEM: ocp.args.PyTreeRestore(item=target, restore_args=restore)}))
    nnx.update(model, jax.tree.unflatten(treedef, list(restored[STATE_ITEM])[1:len(leaves) + 1]))
    return model, run, step
