"""The train state and the jitted train / eval steps (the optimizer: ``trainer.optimizer``; the
host-side batching: ``trainer.batching``).

The train step takes ``accum`` micro-batches stacked on a leading axis and scans over them,
summing gradients of the *summed* per-pair (per-step, for a process model) objective; it divides
by the total number of real pairs (labelled steps) once. So k micro-batches give exactly the
update of one k-times-larger batch. What is trained comes from ``trainer.objective``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rmflow.schemas.heads import head_of
from rmflow.schemas.train_config import OptimizerConfig, TrainConfig
from rmflow.trainer.errors import TrainError
from rmflow.trainer.modeling import lora
from rmflow.trainer.modeling.decoder import RewardTransformer, router_loss
from rmflow.trainer.objective import OUTCOME, ROUTER_SUM, Objective
from rmflow.trainer.optimizer import (
    clip_scale,
    hyperparameters,
    learning_rate_at,
    make_optimizer,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What the compiled train and eval steps depend on besides the shapes (and shardings) of
    their arguments: the model's structure, the objective, the schedule, and whether weight
    decay and gradient clipping are on. Hashable: the steps are jitted once per process with it
    static, so two Trainers of one program (a run resumed in the same process, eval after train,
    a sweep over learning rates) trace and compile each batch shape once. The optimizer's other
    numbers are the step's ``hyper`` argument (``hyperparameters``)."""

    graphdef: Any
    objective: Objective  # what the step trains (``trainer.objective``); hashable, built once a run
    lr_schedule: str
    adam_b1: float
    adam_b2: float
    decays: bool
    clips: bool
    experts: int = 0  # a mixture of experts' count: its router's load-balancing loss is added (``_loss``)
    moments: str = "float32"  # AdamW's moment storage (``trainer.moments``)
    offload: bool = False  # the optimizer state lives in host memory between steps

    @property
    def sum_keys(self) -> tuple[str, ...]:
        return self.objective.sum_keys + ((ROUTER_SUM,) if self.experts else ())

    def model(self, params: Any, frozen: Any, others: Any) -> RewardTransformer:
        return nnx.merge(self.graphdef, params, frozen, others)

    def optimizer(self, hyper: dict[str, Any]) -> optax.GradientTransformation:
        return make_optimizer(OptimizerConfig(schedule=self.lr_schedule, adam_b1=self.adam_b1, adam_b2=self.adam_b2,
                                              weight_decay=float(self.decays), moments=self.moments), hyper=hyper)


class _RouterTap:
    """The model as an objective's loss sees it, keeping each forward's router statistics."""

    def __init__(self, model: RewardTransformer):
        self.model, self.config, self.stats = model, model.config, []

    def logits(self, *args):
        out, stats = self.model.logits(*args, with_router=True)
        self.stats.append(stats)
        return out

    def reward_of(self, logits):
        return self.model.reward_of(logits)

    def __call__(self, *args):
        return self.reward_of(self.logits(*args))


def _loss(program: StepProgram, model: RewardTransformer, mb, hyper_center, hyper_router):
    """The objective's summed loss and metric sums; for a mixture of experts plus the router's
    load-balancing loss (``router_loss`` of the statistics summed over the step's forwards) times
    its coefficient, per unit (scaled by the objective's count, as the rest is summed), and its
    sum (``ROUTER_SUM``)."""
    if not program.experts:
        return program.objective.loss(model, mb, hyper_center)
    tap = _RouterTap(model)
    total, sums = program.objective.loss(tap, mb, hyper_center)
    aux = router_loss(sum(tap.stats), program.experts) * sums[program.objective.count_key]
    return total + hyper_router * aux, {**sums, ROUTER_SUM: aux}


def _objective(program: StepProgram, params, mb, frozen, others, hyper, key=None):
    """``key``: LoRA adapter dropout's, in training (``lora.dropout_key``); None: no dropout."""
    with lora.dropout_key(key):
        return _loss(program, program.model(params, frozen, others), mb, hyper["center_coef"], hyper["router_coef"])


def _train_step(program: StepProgram, state: TrainState, batch: dict[str, jax.Array], frozen: Any, others: Any,
                hyper: dict[str, jax.Array]):
    grad_fn = jax.value_and_grad(functools.partial(_objective, program), has_aux=True)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)  # resumes draw alike
    def micro(carry, x):
        grads, sums = carry
        i, mb = x
        (_, s), g = grad_fn(state.params, mb, frozen, others, hyper, jax.random.fold_in(step_key, i))
        return (jax.tree.map(jnp.add, grads, g), program.objective.merge(sums, s, keys)), None

    keys = program.sum_keys
    n_micro = jax.tree.leaves(batch)[0].shape[0]
    if n_micro == 1:  # one micro-batch: no accumulator buffers
        (_, sums), grads = grad_fn(state.params, {k: v[0] for k, v in batch.items()}, frozen, others, hyper,
                                   jax.random.fold_in(step_key, 0))
    else:
        first = jax.eval_shape(grad_fn, state.params, {k: v[0] for k, v in batch.items()}, frozen, others, hyper,
                               step_key)[0][1]  # the sums' shapes: an attribute head's are per attribute
        zeros = (jax.tree.map(jnp.zeros_like, state.params), {k: jnp.zeros(first[k].shape, jnp.float32) for k in keys})
        (grads, sums), _ = jax.lax.scan(micro, zeros, (jnp.arange(n_micro), batch))
    factor, grad_norm = clip_scale(optax.global_norm(grads), sums[program.objective.count_key],
                                   hyper["max_grad_norm"] if program.clips else 0.0)
    grads = jax.tree.map(lambda g: g * factor, grads)
    opt_state = jax.device_put(state.opt_state, jax.memory.Space.Device) if program.offload else state.opt_state
    updates, opt_state = program.optimizer(hyper).update(grads, opt_state, state.params)
    if program.offload:  # back to host memory: the step's output sharding keeps it there
        opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
    params = optax.apply_updates(state.params, updates)
    metrics = {**sums, "grad_norm": grad_norm,
               "learning_rate": learning_rate_at(state.step, hyper, program.lr_schedule)}
    return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def _eval_step(program: StepProgram, params: Any, mb: dict[str, jax.Array], frozen: Any, others: Any, coefs):
    """The metric sums of one micro-batch; ``coefs``: the centering and router coefficients."""
    return _loss(program, program.model(params, frozen, others), mb, *coefs)[1]


_TRAIN_JIT = jax.jit(_train_step, static_argnums=0, donate_argnums=1)


def _eval_stacked(program: StepProgram, params: Any, batch: dict[str, jax.Array], frozen: Any, others: Any,
                  coefs):
    """The eval step on one micro-batch stacked as the loop places batches (taken apart inside
    the program, so the same placement and compile-ahead serve training and evaluation)."""
    return _eval_step(program, params, {k: v[0] for k, v in batch.items()}, frozen, others, coefs)


_EVAL_STACKED_JIT = jax.jit(_eval_stacked, static_argnums=0)
# Background compilations at once: XLA's compiler releases the GIL, so a run's first shapes,
# compiled ahead, are ready together instead of one after another; a quarter of the cores,
# at most 4, leaving the rest to the loader and the training thread.
COMPILE_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 4 if hasattr(os, "sched_getaffinity")
                                else (os.cpu_count() or 1) // 4))
# Tracing is serialised process-wide: LoRA's dropout key is a module-level context.
_TRACE_LOCK = threading.Lock()
_SHARDED_JITS: dict[tuple, Any] = {}  # (program, the state's shardings) -> the train step jitted with them
_EXECUTABLES: dict[tuple, Any] = {}  # compiled train and eval steps of this process, by program, shardings, step and shapes
_EXECUTABLES_LOCK = threading.Lock()


def forget_compiled() -> None:
    """Drop the train and eval steps this process compiled, and JAX's in-memory caches, as a
    new process would start: what compiles next comes from the persistent cache, if one is on."""
    _SHARDED_JITS.clear()
    _EXECUTABLES.clear()
    jax.clear_caches()


def _place(tree: Any, shardings: Any, *, shared: bool = False) -> Any:
    """``tree`` placed with ``shardings`` (one for every leaf, or one for all); a leaf that is
    only a shape (an abstract model's) becomes its shape with its sharding. ``shared``: an array
    that is several leaves (an ensemble's members' one frozen base, ``lora.share_frozen``) is
    placed once and stays one array; never for a train state, whose donated leaves must each be
    their own buffer."""
    leaves, treedef = jax.tree.flatten(tree)
    specs = [shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding) else treedef.flatten_up_to(shardings)
    placed: dict[tuple[int, Any], Any] = {}

    def place(x, sh):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        if not shared:
            return jax.device_put(x, sh)
        key = (id(x), sh)
        if key not in placed:
            placed[key] = (x, jax.device_put(x, sh))  # x kept alive, so its id is not reused meanwhile
        return placed[key][1]

    return treedef.unflatten([place(x, sh) for x, sh in zip(leaves, specs)])


def _avals(tree: Any) -> tuple:
    """A hashable description of a pytree of (abstract) arrays or shardings: its structure, and
    each leaf's shape, dtype and sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) if hasattr(x, "shape") else x
                          for x in leaves)


class Trainer:
    """Holds the model's static structure and runs the process-wide jitted steps over a TrainState pytree."""

    def __init__(self, model: RewardTransformer, optim: OptimizerConfig, *, total_steps: int = 1000,
                 center_coef: float = 0.0, seed: int = 0, trainable=nnx.Param, objective: Objective = OUTCOME,
                 router_coef: float = 0.0):
        """``trainable``: an NNX filter of the parameters to train (all, or with LoRA the adapters and
        the score head); the other parameters are frozen: no gradient, no optimizer state, passed
        to the jitted steps as an argument (never baked into the compiled program). ``objective``:
        an outcome or a process reward model's loss and batch (``trainer.objective``). The
        optimizer's numbers (its schedule over ``total_steps``) and ``center_coef`` are arguments
        of the step too."""
        if not objective.fits(model.config.head):
            wants = "an attribute head (one output per attribute)" if objective.regression else \
                f"a score head of {objective.kind.head.outputs} output(s)"
            raise ValueError(f"objective {objective.name} trains {wants}; this model is "
                             f"{head_of(model.config).describe(model.config, model.config.kind.description)}")
        self.objective = objective
        self.graphdef, params, self.frozen, self.others = nnx.split(model, trainable, nnx.Param, ...)
        experts = model.config.num_experts if model.config.sparse_layers else 0
        self.program = StepProgram(self.graphdef, objective, optim.schedule, optim.adam_b1,
                                   optim.adam_b2, bool(optim.weight_decay), bool(optim.max_grad_norm), experts,
                                   optim.moments, optim.offload)
        self.objective = objective.with_router() if experts else objective
        hyper = hyperparameters(optim, total_steps)
        self.hyper = jax.tree.map(jnp.asarray, {**hyper, "center_coef": np.float32(center_coef),
                                                "router_coef": np.float32(router_coef)})
        self.tx = make_optimizer(optim, hyper=hyper)
        # an abstract model (``model_setup.base_model(abstract=True)``): its optimizer state as shapes too
        self.abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        opt_state = jax.eval_shape(self.tx.init, params) if self.abstract else self.tx.init(params)
        if optim.offload and not self.abstract:  # in host memory from the start: the step's input and output alike
            opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
        self.init_state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                                     rng=jax.random.key_data(jax.random.key(seed)))
        self._train_jit = _TRAIN_JIT
        # Compiled train and eval steps by batch shapes, made on demand or ahead of time
        # (``compile_ahead``, ``compile_evals_ahead``), once the mesh is known (``use_mesh``).
        self._abstract_state = self._batch_sharding = None
        self._mesh = None  # ``use_mesh``'s: set while a mixture of experts' steps are traced
        self._static_key: tuple = ()  # what an executable's key holds besides the batch's shapes
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._stopping = threading.Event()  # tells a background job looking for eval shapes to stop
        self._evals_job: concurrent.futures.Future | None = None

    def use_mesh(self, mesh) -> TrainState:
        """Shard the state over ``mesh`` by the parameter-name rules (``trainer.parallel``) and
        keep it so: the step's output state has the input's shardings. Returns the placed state
        (of an abstract trainer: its shapes with their shardings, nothing placed)."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from rmflow.trainer.parallel import BATCH_AXES, shardings

        if self.program.experts and mesh.shape.get("context", 1) > 1:
            raise TrainError("a mixture of experts cannot split its rows over a context axis (its router sorts a "
                             "row's tokens by expert): set mesh.context=1 and use mesh.expert or mesh.fsdp")
        self._mesh = mesh
        self.state_shardings = shardings(self.init_state, mesh)
        if self.program.offload:  # the optimizer state kept in host memory (``optimizer.offload``)
            self.state_shardings = dataclasses.replace(self.state_shardings, opt_state=jax.tree.map(
                lambda s: s.with_memory_kind("pinned_host"), self.state_shardings.opt_state))
        self.frozen = _place(self.frozen, shardings(self.frozen, mesh), shared=True)
        replicated = NamedSharding(mesh, P())
        self.hyper = jax.device_put(self.hyper, replicated)
        self.others = _place(self.others, replicated, shared=True)
        key = (self.program, _avals(self.state_shardings), replicated)
        if key not in _SHARDED_JITS:
            _SHARDED_JITS[key] = jax.jit(_train_step, static_argnums=0, donate_argnums=1,
                                         out_shardings=(self.state_shardings, replicated))
        self._train_jit = _SHARDED_JITS[key]
        self._abstract_state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                            self.init_state, self.state_shardings)
        self._batch_sharding = NamedSharding(mesh, P(None, BATCH_AXES))  # as the loop places batches
        # Described once: flattening the state and its shardings costs milliseconds a call with
        # a deep model's hundreds of leaves, and every step looks up its executable.
        self._static_key = (self.program, _avals(self._abstract_state), _avals(self.frozen), _avals(self.others))
        self._pending.clear()
        return _place(self.init_state, self.state_shardings)

    def _key(self, batch_key: tuple) -> tuple:
        return (*self._static_key, batch_key)

    def train_step(self, state: TrainState, batch: dict[str, jax.Array]):
        if self._abstract_state is None:  # no mesh given: jit as usual
            return self._train_jit(self.program, state, batch, self.frozen, self.others, self.hyper)
        return self._executable("train", batch)(state, batch, self.frozen, self.others, self.hyper)

    def eval_batch(self, params: Any, batch: dict[str, jax.Array]):
        """The eval step's metric sums on one micro-batch stacked as the loop places batches
        (``stack_micro_batches`` of one); compiled ahead like the train step's shapes."""
        if self._abstract_state is None:
            return _EVAL_STACKED_JIT(self.program, params, batch, self.frozen, self.others, self._coefs())
        return self._executable("eval", batch)(params, batch, self.frozen, self.others, self._coefs())

    def _executable(self, step: str, batch: dict[str, jax.Array]):
        """The compiled ``step`` ("train" or "eval") for the batch's shapes: made before, being made
        in the background (waited for), or compiled now."""
        key = (step, _shapes(batch))
        compiled = _EXECUTABLES.get(self._key(key))
        if compiled is not None:
            return compiled
        pending = self._pending.pop(key, None)
        if pending is not None and not pending.cancel():  # started: wait for it (a job queued is taken back)
            try:
                return pending.result()
            except Exception:  # noqa: BLE001 - compiled again below, where its error (if any) is raised
                pass
        return self._compile(step, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                                    for k, v in batch.items()})

    def compile_ahead(self, host_batch: dict[str, np.ndarray], step: str = "train") -> bool:
        """Start compiling ``step`` ("train" or "eval") for a coming batch's shapes (host arrays as
        ``stack_micro_batches`` makes them) in the background, so that the batch finds it ready;
        True when a compilation started. Once per shape; needs ``use_mesh`` first. Up to
        ``COMPILE_THREADS`` compile at once (the compiler releases the GIL; tracing is serialised)."""
        if self._abstract_state is None:
            return False
        key = (step, _shapes(host_batch))
        if self._key(key) in _EXECUTABLES or key in self._pending:
            return False
        self._pending[key] = self._pool().submit(self._compile, step, self._abstract(host_batch))
        return True

    def compile_evals_ahead(self, batches: Callable[[], Iterable[dict[str, np.ndarray]]]) -> bool:
        """Compile the eval step for every shape of ``batches()`` (host batches as the loop stacks
        them) in one background job: the batches are read there too, off the training thread,
        and the shapes compiled one after another, so a pool thread is left to the train step's
        shapes (a step never waits behind this job: ``_executable`` compiles a shape itself
        rather than wait for a queued one). Needs ``use_mesh`` first."""
        if self._abstract_state is None:
            return False

        def job() -> None:
            for host_batch in batches():
                if self._stopping.is_set():
                    return
                key = self._key(("eval", _shapes(host_batch)))
                if key not in _EXECUTABLES:
                    self._compile("eval", self._abstract(host_batch))

        self._evals_job = self._pool().submit(job)
        return True

    def finish_eval_compiles(self) -> None:
        """Before an evaluation: wait for the eval-shape job if it is running (a shape it is
        compiling is not compiled twice); one still queued is dropped, each shape then compiled
        where it is met."""
        job, self._evals_job = self._evals_job, None
        if job is not None and not job.cancel():
            try:
                job.result()
            except Exception:  # noqa: BLE001 - a shape it failed on is compiled where met, its error raised there
                pass

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._compiler is None:
            self._stopping.clear()
            self._compiler = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="rmflow-compile")
        return self._compiler

    @property
    def mesh(self):
        """The mesh ``use_mesh`` placed the state on (None before)."""
        return self._mesh

    def compile_train(self, host_batch: dict[str, np.ndarray]):
        """(the batch's shapes as the step takes them, the train step compiled for them), on the
        mesh of ``use_mesh``; kept, so the step finds it when it meets that shape."""
        batch = self._abstract(host_batch)
        key = self._key(("train", _shapes(batch)))
        return batch, _EXECUTABLES.get(key) or self._compile("train", batch)

    def _abstract(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self._batch_sharding) for k, v in host_batch.items()}

    def stop_compiling(self) -> None:
        """Drop compilations not started; wait for those running (they cannot be interrupted; a
        job looking for eval shapes stops after the one it is compiling)."""
        self._stopping.set()
        if self._compiler is not None:
            self._compiler.shutdown(wait=True, cancel_futures=True)
            self._compiler = None
        self._pending.clear()

    def lower(self, state: Any, batch: dict[str, Any]):
        """The train step lowered for ``state`` and ``batch`` (arrays or ShapeDtypeStructs)."""
        with _TRACE_LOCK, self._tracing_mesh():
            return self._train_jit.lower(self.program, state, batch, self.frozen, self.others, self.hyper)

    def _compile(self, step: str, abstract_batch: dict[str, jax.ShapeDtypeStruct]):
        key = self._key((step, _shapes(abstract_batch)))
        if step == "train":
            lowered = self.lower(self._abstract_state, abstract_batch)
        else:
            with _TRACE_LOCK, self._tracing_mesh():
                lowered = _EVAL_STACKED_JIT.lower(self.program, self._abstract_state.params, abstract_batch,
                                                  self.frozen, self.others, self._coefs())
        compiled = lowered.compile()
        with _EXECUTABLES_LOCK:
            return _EXECUTABLES.setdefault(key, compiled)

    def _tracing_mesh(self):
        """The mesh set while the steps of a mixture of experts (each batch shard routes its own
        rows: ``decoder.SparseMoE``) or of rows split over a ``context`` axis (attention over
        the gathered row: ``attention.context_attention``) are traced; other runs trace without one."""
        needed = self._mesh is not None and (self.program.experts or self._mesh.shape.get("context", 1) > 1)
        return jax.set_mesh(self._mesh) if needed else contextlib.nullcontext()

    def _coefs(self) -> tuple:
        return self.hyper["center_coef"], self.hyper["router_coef"]

    def model(self, params: Any, frozen: Any = None) -> RewardTransformer:
        return self.program.model(params, self.frozen if frozen is None else frozen, self.others)

    def _objective(self, params, mb, frozen, key=None):
        """The summed objective and its metric sums (``key``: LoRA dropout's; None: none)."""
        return _objective(self.program, params, mb, frozen, self.others, self.hyper, key)


def _shapes(batch: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()))


def make_trainer(cfg: TrainConfig, model: RewardTransformer, total_steps: int, objective: Objective | None = None
                 ) -> Trainer:
    """The jitted trainer of a run's config: its optimizer, centering, seed, LoRA's trainable
    parameters and the objective of its kind (an outcome model's by default)."""
    coef = cfg.router_aux_loss_coefficient
    return Trainer(model, cfg.optimizer, total_steps=total_steps, center_coef=cfg.center_rewards_coefficient,
                   router_coef=model.config.router_aux_loss_coef if coef == -1 else coef,
                   seed=cfg.seed, trainable=lora.trainable_filter(cfg.lora),
                   objective=objective or OUTCOME)
