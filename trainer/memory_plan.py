"""A run's memory on each device, planned before any weight is loaded.

``plan_memory`` builds the run as ``trainer.train.Run`` does, with an abstract model
(``model_setup.base_model(abstract=True)``: shapes and dtypes, no weight drawn or read), places
nothing, and compiles the train step ahead of time for the configured mesh on the widest batch
the run's loader can make (packing ``fixed``: its one shape). Per device it reports what the
step's arguments hold, each from its shapes and sharding (trained parameters, frozen weights,
optimizer state on the device and offloaded to the host, the batch), and what XLA's memory
analysis of the compiled step adds (temporaries: the gradients, the activations kept for the
backward pass and the workspace; outputs not written over their inputs). Their sum is the
step's peak, against the device's memory.

``advice`` names the levers and the state each saves (LoRA's frozen base in bfloat16, int8 or
nf4, the optimizer's moments in bfloat16 or int8 and its state offloaded, exactly, from the
state's shapes; the parameters and state sharded
over ``fsdp``), and those that change only the step (layers recomputed, shorter rows, LoRA). A
run on an accelerator, one process in packing ``fixed`` (one shape: the plan is exact), makes the
same plan before loading weights and refuses a step that cannot fit, with the peak of each
alternative compiled the same way (``check_memory``); the executable compiled for the plan is the
one training then runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from rmflow.schemas.train_config import BASE_DTYPES, MOMENTS, TrainConfig
from rmflow.trainer.errors import TrainError

GIB = 2 ** 30
HOST = "pinned_host"


def shard_bytes(tree: Any, *, memory_kind: str | None = None) -> int:
    """Bytes one device holds of ``tree``'s arrays (abstract or placed): each leaf's shard. Only
    the leaves in ``memory_kind`` (None: the device's own memory). A placed array that is several
    leaves (an ensemble's LoRA members' one frozen base) counts once."""
    total, seen = 0, set()
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if sharding is None or not hasattr(x, "dtype") or (isinstance(x, jax.Array) and id(x) in seen):
            continue
        seen.add(id(x))
        kind = sharding.memory_kind if sharding.memory_kind != "device" else None
        if kind != memory_kind:
            continue
        total += math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def device_limit() -> int | None:
    """Bytes the first device holds for arrays (its allocator's limit); None where the backend
    keeps no such count (CPU: arrays live in host memory)."""
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A train step's memory on one device, in bytes (``plan_memory``)."""

    device: str
    mesh: dict[str, int]
    limit: int | None
    parameters: int  # the trained parameters' shards
    frozen: int  # weights not trained (LoRA's base), and the model's other variables
    optimizer: int  # the optimizer state in the device's memory
    host_optimizer: int  # the optimizer state offloaded to host memory (``optimizer.offload``)
    batch: int
    temporaries: int  # XLA's temporaries: the gradients, the activations, the workspace
    outputs: int  # the step's outputs not written over its inputs
    trained: int  # trained parameters, all devices
    batch_shape: tuple[int, ...]  # (micro-batches, rows, tokens)
    moments: str
    moment_savings: dict[str, int]  # moments -> the device bytes that storage saves
    base_savings: dict[str, int]  # LoRA's base_dtype -> the device bytes that storage of the base saves
    lora: bool
    remat: bool

    @property
    def gradients(self) -> int:
        """The gradients' share of the temporaries: one of each trained parameter's shard."""
        return min(self.parameters, self.temporaries)

    @property
    def total(self) -> int:
        return self.parameters + self.frozen + self.optimizer + self.batch + self.temporaries + self.outputs

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total <= self.limit

    def levers(self) -> list[tuple[str, int | None]]:
        """(what to set, the device bytes of state it saves, or None where it changes the step's
        temporaries alone), those with a figure first. A saving of state is not all a step's
        peak changes by: compact moments are decoded for the update, an offloaded state is moved
        to the device for it (``check_memory`` compiles the alternatives to say which fit)."""
        out: list[tuple[str, int | None]] = []
        for moments, saved in self.moment_savings.items():
            out.append((f"optimizer.moments={moments}", saved))
        for kind, saved in self.base_savings.items():
            out.append((f"lora.base_dtype={kind}", saved))
        if self.optimizer:
            out.append(("optimizer.offload=true", self.optimizer))
        fsdp, data = self.mesh.get("fsdp", 1), self.mesh.get("data", 1)
        if fsdp == 1 and data > 1:
            shared = self.parameters + self.optimizer + self.gradients
            out.append((f"mesh.fsdp={data} (with mesh.data=1)", shared - shared // data))
        if not self.remat:
            out.append(("model.gradient_checkpointing=true (the activations kept: one layer's input each)", None))
        if not self.lora:
            out.append(("lora.rank=16 (only adapters trained: no gradients or optimizer state for the base)", None))
        out.append(("a smaller data.row_tokens or batch_size (the activations grow with a micro-batch's tokens)", None))
        return out

    def advice(self) -> str:
        """One line: the levers, each with the state it saves."""
        return "; ".join(what if saved is None else f"{what} saves {saved / GIB:.2f} GiB of state"
                         for what, saved in self.levers())

    def render(self) -> str:
        mesh = " x ".join(f"{k} {v}" for k, v in self.mesh.items())
        rows = [("trained parameters", self.parameters, f"{self.trained:,} parameters"),
                ("frozen weights and buffers", self.frozen, "LoRA's base" if self.lora else ""),
                ("optimizer state", self.optimizer, f"moments {self.moments}"),
                ("batch", self.batch, " x ".join(map(str, self.batch_shape)) + " (micro-batches x rows x tokens)"),
                ("temporaries", self.temporaries, f"XLA's: the gradients ({self.gradients / GIB:.2f} GiB), the "
                                                  "activations, the workspace"),
                ("step outputs", self.outputs, "not written over the inputs")]
        lines = [f"Memory plan of one train step, per device ({self.device}; mesh {mesh}):"]
        lines += [f"  {name:<28}{size / GIB:9.3f} GiB  {note}".rstrip() for name, size, note in rows]
        if self.host_optimizer:
            lines.append(f"  {'optimizer state on the host':<28}{self.host_optimizer / GIB:9.3f} GiB  "
                         "host memory, moved to the device for each update")
        limit = "no device memory limit known (CPU: the host's memory)" if self.limit is None else \
            f"of {self.limit / GIB:.2f} GiB: {'fits' if self.fits else 'DOES NOT FIT'}"
        lines.append(f"  {'total':<28}{self.total / GIB:9.3f} GiB  {limit}")
        lines.append("Levers: " + self.advice())
        return "\n".join(lines)


def widest_batch(run) -> dict[str, np.ndarray]:
    """The train step's widest batch in ``run`` (a ``trainer.train.Run``), on the host: its first
    micro-batch widened to the longest row and the most reward slots its loader can make
    (packing ``fixed``: the run's one row shape as it is), stacked ``grad_accum`` times."""
    from rmflow.trainer.batching import stack_micro_batches, widen
    from rmflow.trainer.data import fine_length

    plan, objective = run.plan, run.objective
    first = next(iter(run.train_loader()))
    if plan.packing != "fixed":  # rows up to the length cap, rounded as the loader rounds them
        unit = plan.max_length * (2 if objective.kind.pairwise else 1)
        per_row = -(-plan.local_batch // plan.rows) if plan.packing == "pack" else 1
        length = fine_length(plan.max_length if plan.packing != "pack" else unit * per_row, plan.train_rounding)
        slots = first["reward_index"].shape[1] * per_row
        first = widen(first, max(length, first["input_ids"].shape[1]), slots, objective)
    return stack_micro_batches([first] * run.cfg.grad_accum, objective)


def _savings(now: int, alternatives: dict[str, Any], mesh) -> dict[str, int]:
    """{name: device bytes saved} of each alternative (a tree of shapes, sharded by the rules as
    the run's own) that holds less than ``now``."""
    from rmflow.trainer.parallel import shardings

    out = {}
    for name, shapes in alternatives.items():
        placed = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                              shardings(shapes, mesh))
        saved = now - shard_bytes(placed)
        if saved > 0:
            out[name] = saved
    return out


def _moment_savings(trainer, state, cfg: TrainConfig) -> dict[str, int]:
    """Device bytes each other moment storage would save, where it saves any (the state's
    shapes under it, sharded by the same rules); nothing when the state is offloaded already."""
    from rmflow.trainer.optimizer import make_optimizer

    if cfg.optimizer.offload:
        return {}
    return _savings(shard_bytes(state.opt_state), {
        moments: jax.eval_shape(make_optimizer(dataclasses.replace(cfg.optimizer, moments=moments)).init, state.params)
        for moments in MOMENTS if moments != cfg.optimizer.moments}, trainer.mesh)


def _base_savings(trainer, cfg: TrainConfig) -> dict[str, int]:
    """Device bytes each other storage of LoRA's frozen base would save, where it saves any: the
    frozen weights' shapes as ``lora.base_storage`` holds them, sharded by the same rules."""
    from rmflow.trainer.modeling import lora, quant

    if cfg.lora is None:
        return {}
    weights = {".".join(map(str, path)): jax.ShapeDtypeStruct(quant.shape(var), np.float32)
               for path, var in lora.held_once(trainer.frozen).items()}

    def held(kind: str):
        store = lora.base_storage(dataclasses.replace(cfg.lora, base_dtype=kind))
        return jax.eval_shape(lambda w: {name: store(name, x) for name, x in w.items()}, weights)

    return _savings(shard_bytes(_held_frozen(trainer)),
                    {kind: held(kind) for kind in BASE_DTYPES if kind != cfg.lora.base_dtype}, trainer.mesh)


def _held_frozen(trainer) -> list:
    """The trainer's frozen weights as held (``lora.held_once``: an ensemble's LoRA members keep
    one frozen base)."""
    from rmflow.trainer.modeling import lora

    return list(lora.held_once(trainer.frozen).values())


def plan_memory(run) -> tuple[MemoryPlan, Any]:
    """The memory plan of a run's train step (``run``: a ``trainer.train.Run`` built abstract),
    and its compiled executable (kept by the trainer's cache: a run of the same config then
    compiles nothing more for that shape)."""
    cfg, trainer = run.cfg, run.trainer
    state = trainer.use_mesh(run.mesh)
    host = widest_batch(run)
    batch, compiled = trainer.compile_train(host)
    analysis = compiled.memory_analysis()
    temps = int(analysis.temp_size_in_bytes) if analysis is not None else 0
    outputs = max(int(analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes), 0) if analysis else 0
    plan = MemoryPlan(
        device=jax.devices()[0].device_kind, mesh=dict(run.mesh.shape), limit=device_limit(),
        parameters=shard_bytes(state.params), frozen=shard_bytes((_held_frozen(trainer), trainer.others)),
        optimizer=shard_bytes(state.opt_state), host_optimizer=shard_bytes(state.opt_state, memory_kind=HOST),
        batch=shard_bytes(batch), temporaries=temps, outputs=max(outputs, 0),
        trained=sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
        batch_shape=tuple(host["input_ids"].shape), moments=cfg.optimizer.moments,
        moment_savings=_moment_savings(trainer, state, cfg), base_savings=_base_savings(trainer, cfg),
        lora=cfg.lora is not None,
        remat=cfg.model.gradient_checkpointing)
    return plan, compiled


# What check_memory tries when a step does not fit: the levers a compilation measures exactly.
ALTERNATIVES = (("lora.base_dtype=nf4", "lora", "base_dtype", "nf4"),
                ("optimizer.moments=int8", "optimizer", "moments", "int8"),
                ("optimizer.offload=true", "optimizer", "offload", True),
                ("model.gradient_checkpointing=true", "model", "gradient_checkpointing", True))


def check_memory(cfg: TrainConfig, make_run: Callable[[TrainConfig], Any], limit: int | None = None
                 ) -> MemoryPlan | None:
    """Refuse, in one line, a run whose train step cannot fit in its device's memory (``limit``:
    that memory; default the device's own), naming the alternatives (``ALTERNATIVES``, each
    compiled: its peak, and whether it fits) and the other levers. Checked where the plan is the
    run's exact shape, one process in packing ``fixed``, and the backend counts device memory
    (not on CPU) or ``limit`` is given. ``make_run``: a config's run, built abstract."""
    from rmflow.trainer.data import resolve_packing

    limit = device_limit() if limit is None else limit
    packing = resolve_packing(cfg.data.packing, jax.default_backend(), len(jax.devices()), jax.process_count())
    if limit is None or packing != "fixed" or jax.process_count() > 1:
        return None
    plan = dataclasses.replace(plan_memory(make_run(cfg))[0], limit=limit)
    if plan.fits:
        return plan
    tried = []
    for what, section, name, value in ALTERNATIVES:
        if getattr(cfg, section) is None or getattr(getattr(cfg, section), name) == value:
            continue  # a full fine-tuning has no base to quantise
        other = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
        total = plan_memory(make_run(other))[0].total
        tried.append(f"{what}: {total / GIB:.2f} GiB" + (" (fits)" if total <= limit else ""))
    measured = ("lora.base_dtype", "optimizer.", "model.gradient_checkpointing")  # the alternatives' settings, compiled above
    rest = [what for what, _ in plan.levers() if not what.startswith(measured)]
    raise TrainError(f"the train step needs {plan.total / GIB:.2f} GiB a device and the device holds "
                     f"{limit / GIB:.2f} GiB; with " + "; ".join(tried + rest)
                     + ". rmflow train --plan prints the whole plan")
