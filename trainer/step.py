"""Optimizer, train state and the jitted train / eval steps.

The train step takes ``accum`` micro-batches stacked on a leading axis and scans over them,
summing gradients of the *summed* per-pair (per-step, for a process model) objective; it divides
by the total number of real pairs (labelled steps) once. So k micro-batches give exactly the
update of one k-times-larger batch. What is trained comes from ``trainer.objective``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rmflow.schemas.config import TrainConfig
from rmflow.trainer.modeling import lora
from rmflow.trainer.modeling.llama import RewardTransformer
from rmflow.trainer.objective import OUTCOME, ROW_KEYS, Objective, objective_for

DEVICE_KEYS = OUTCOME.device_keys  # an outcome model's batch (``Objective.device_keys`` in general)


_TRAIN = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer's settings: ``TrainConfig``'s fields of the same names (defaults included),
    plus the run's planned ``total_steps``."""

    learning_rate: float = _TRAIN["learning_rate"]
    learning_rate_end: float = _TRAIN["learning_rate_end"]
    warmup_steps: int = _TRAIN["warmup_steps"]
    lr_schedule: str = _TRAIN["lr_schedule"]
    weight_decay: float = _TRAIN["weight_decay"]
    adam_b1: float = _TRAIN["adam_b1"]
    adam_b2: float = _TRAIN["adam_b2"]
    adam_eps: float = _TRAIN["adam_eps"]
    max_grad_norm: float = _TRAIN["max_grad_norm"]
    total_steps: int = 1000  # planned per run (trainer.setup.plan_steps)

    @classmethod
    def of(cls, cfg: TrainConfig, total_steps: int) -> OptimConfig:
        return cls(total_steps=total_steps, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)
                                               if f.name != "total_steps"})


# The optimizer's numbers passed to the compiled step. Adam's betas stay constants of the program:
# optax computes 1 - beta from them, which in float32 would round otherwise than from a Python float.
HYPER_KEYS = ("learning_rate", "learning_rate_end", "warmup_steps", "total_steps", "weight_decay", "adam_eps",
              "max_grad_norm")


def hyperparameters(c: OptimConfig) -> dict[str, np.ndarray]:
    """The optimizer's numbers as the train step's runtime argument: runs that differ only in them
    (a learning-rate sweep, a resumed run given more steps) share one compiled program per shape.
    The schedule's derived constants are computed here in double precision, as optax computes
    them from Python floats, so the learning rate is optax's to the bit."""
    steps = ("warmup_steps", "total_steps")
    out = {k: np.asarray(getattr(c, k), np.int32 if k in steps else np.float32) for k in HYPER_KEYS}
    alpha = c.learning_rate_end / c.learning_rate if c.learning_rate else 0.0
    out.update(lr_span=np.float32(c.learning_rate - c.learning_rate_end), cosine_alpha=np.float32(alpha),
               cosine_keep=np.float32(1 - alpha))
    return out


def learning_rate_at(step: jax.Array, hyper: dict[str, Any], kind: str) -> jax.Array:
    """Linear warmup from 0 to learning_rate, then linear or cosine decay to learning_rate_end:
    optax's linear_schedule, cosine_decay_schedule and join_schedules, computed from arrays."""
    lr, warmup = hyper["learning_rate"], hyper["warmup_steps"]
    decay_steps = jnp.maximum(hyper["total_steps"] - warmup, 1)
    after = step - warmup
    if kind == "cosine":
        count = jnp.minimum(after, decay_steps).astype(jnp.float32)
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * count / decay_steps.astype(jnp.float32)))
        decay = lr * (hyper["cosine_keep"] * cosine + hyper["cosine_alpha"])
    elif kind == "linear":
        frac = 1 - jnp.clip(after, 0, decay_steps) / decay_steps
        decay = hyper["lr_span"] * frac + hyper["learning_rate_end"]
    else:
        raise ValueError(f"schedule {kind!r}: use 'linear' or 'cosine'")
    warm = -lr * (1 - jnp.clip(step, 0, warmup) / jnp.maximum(warmup, 1)) + lr
    return jnp.where(step < warmup, warm, decay)


def learning_rate_schedule(c: OptimConfig) -> optax.Schedule:
    """The schedule of ``c`` as a function of the step."""
    if c.lr_schedule not in ("linear", "cosine"):
        raise ValueError(f"schedule {c.lr_schedule!r}: use 'linear' or 'cosine'")
    hyper = hyperparameters(c)
    return lambda step: learning_rate_at(jnp.asarray(step, jnp.int32), hyper, c.lr_schedule)


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices and embeddings only: never on norm weights or biases."""
    def decays(path, _) -> bool:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return bool(names) and names[-1] in ("kernel", "embedding", "lora_A", "lora_B")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(c: OptimConfig, hyper: dict[str, Any] | None = None) -> optax.GradientTransformation:
    """AdamW. Gradient clipping is not in this chain: the step applies it together with the
    division by the number of pairs, in one pass over the gradients (``clip_scale``). Inside the
    jitted step the numbers come from ``hyper`` (arrays); what shapes the program comes from ``c``:
    the schedule's kind, Adam's betas, and whether there is weight decay at all. The state's
    layout is the same either way."""
    h = hyperparameters(c) if hyper is None else hyper
    return optax.chain(
        optax.identity(),  # where the clipping transform stood: checkpoints keep their layout
        optax.adamw(lambda step: learning_rate_at(step, h, c.lr_schedule), b1=c.adam_b1, b2=c.adam_b2,
                    eps=h["adam_eps"], weight_decay=h["weight_decay"] if c.weight_decay else 0.0, mask=decay_mask),
    )


def clip_scale(summed_norm: jax.Array, pairs: jax.Array, max_norm) -> tuple[jax.Array, jax.Array]:
    """(factor, norm): the gradient of the summed objective times ``factor`` is the mean
    gradient, clipped to ``max_norm`` as optax.clip_by_global_norm does; ``norm`` is the mean
    gradient's norm before clipping. One multiply instead of a divide and a clip, so the step
    holds one gradient-sized temporary fewer (50 MiB for a 49k-token vocabulary at hidden 256)."""
    n = jnp.maximum(pairs, 1.0)
    norm = summed_norm / n
    if isinstance(max_norm, (int, float)) and not max_norm:
        return 1.0 / n, norm
    return jnp.where(norm < max_norm, 1.0, max_norm / jnp.maximum(norm, 1e-30)) / n, norm


def pair_rewards(model: RewardTransformer, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
    """Chosen and rejected rewards, one per pair slot, from one forward pass over a batch in
    the shared layout (``trainer.data.collate``): padded rows or packed rows alike."""
    r = model(batch["input_ids"], batch["positions"], batch["segment_ids"], batch["reward_index"],
              batch["branch_ids"])
    pairs = r.reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


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
    their arguments: the model's structure, the objective, the schedule's kind, and whether weight
    decay and gradient clipping are on. Hashable: the steps are jitted once per process with it
    static, so two Trainers of one program (a run resumed in the same process, eval after train,
    a sweep over learning rates) trace and compile each batch shape once. The optimizer's other
    numbers are the step's ``hyper`` argument (``hyperparameters``)."""

    graphdef: Any
    kind: str  # the objective's (``trainer.objective.OBJECTIVES``)
    lr_schedule: str
    adam_b1: float
    adam_b2: float
    decays: bool
    clips: bool

    @property
    def objective(self) -> Objective:
        return objective_for(self.kind)

    def model(self, params: Any, frozen: Any, others: Any) -> RewardTransformer:
        return nnx.merge(self.graphdef, params, frozen, others)

    def optimizer(self, hyper: dict[str, Any]) -> optax.GradientTransformation:
        return make_optimizer(OptimConfig(lr_schedule=self.lr_schedule, adam_b1=self.adam_b1, adam_b2=self.adam_b2,
                                          weight_decay=float(self.decays)), hyper)


def _objective(program: StepProgram, params, mb, frozen, others, center_coef, key=None):
    """``key``: LoRA adapter dropout's, in training (``lora.dropout_key``); None: no dropout."""
    with lora.dropout_key(key):
        return program.objective.loss(program.model(params, frozen, others), mb, center_coef)


def _train_step(program: StepProgram, state: TrainState, batch: dict[str, jax.Array], frozen: Any, others: Any,
                hyper: dict[str, jax.Array]):
    grad_fn = jax.value_and_grad(functools.partial(_objective, program), has_aux=True)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)  # resumes draw alike
    center = hyper["center_coef"]

    def micro(carry, x):
        grads, sums = carry
        i, mb = x
        (_, s), g = grad_fn(state.params, mb, frozen, others, center, jax.random.fold_in(step_key, i))
        return (jax.tree.map(jnp.add, grads, g), {k: sums[k] + s[k] for k in keys}), None

    keys = program.objective.sum_keys
    n_micro = jax.tree.leaves(batch)[0].shape[0]
    if n_micro == 1:  # one micro-batch: no accumulator buffers
        (_, sums), grads = grad_fn(state.params, {k: v[0] for k, v in batch.items()}, frozen, others, center,
                                   jax.random.fold_in(step_key, 0))
    else:
        zeros = (jax.tree.map(jnp.zeros_like, state.params), {k: jnp.zeros((), jnp.float32) for k in keys})
        (grads, sums), _ = jax.lax.scan(micro, zeros, (jnp.arange(n_micro), batch))
    factor, grad_norm = clip_scale(optax.global_norm(grads), sums[program.objective.count_key],
                                   hyper["max_grad_norm"] if program.clips else 0.0)
    grads = jax.tree.map(lambda g: g * factor, grads)
    updates, opt_state = program.optimizer(hyper).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**sums, "grad_norm": grad_norm,
               "learning_rate": learning_rate_at(state.step, hyper, program.lr_schedule)}
    return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def _eval_step(program: StepProgram, params: Any, mb: dict[str, jax.Array], frozen: Any, others: Any, center_coef):
    return program.objective.loss(program.model(params, frozen, others), mb, center_coef)[1]


_TRAIN_JIT = jax.jit(_train_step, static_argnums=0, donate_argnums=1)
_EVAL_JIT = jax.jit(_eval_step, static_argnums=0)
_SHARDED_JITS: dict[tuple, Any] = {}  # (program, the state's shardings) -> the train step jitted with them
_EXECUTABLES: dict[tuple, Any] = {}  # compiled train steps of this process, by program, shardings and shapes
_EXECUTABLES_LOCK = threading.Lock()


def forget_compiled() -> None:
    """Drop the train and eval steps this process compiled, and JAX's in-memory caches, as a
    new process would start: what compiles next comes from the persistent cache, if one is on."""
    _SHARDED_JITS.clear()
    _EXECUTABLES.clear()
    jax.clear_caches()


def _avals(tree: Any) -> tuple:
    """A hashable description of a pytree of (abstract) arrays or shardings: its structure, and
    each leaf's shape, dtype and sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) if hasattr(x, "shape") else x
                          for x in leaves)


class Trainer:
    """Holds the model's static structure and runs the process-wide jitted steps over a TrainState pytree."""

    def __init__(self, model: RewardTransformer, optim: OptimConfig, *, center_coef: float = 0.0, seed: int = 0,
                 trainable=nnx.Param, objective: Objective = OUTCOME):
        """``trainable``: an NNX filter of the parameters to train (all, or with LoRA the adapters and
        the score head); the other parameters are frozen: no gradient, no optimizer state, passed
        to the jitted steps as an argument (never baked into the compiled program). ``objective``:
        an outcome or a process reward model's loss and batch (``trainer.objective``). The
        optimizer's numbers and ``center_coef`` are arguments of the step too."""
        if model.config.num_labels != objective.num_labels:
            raise ValueError(f"a {objective.kind.name} reward model needs a score head of {objective.num_labels} "
                             f"output(s); this model has {model.config.num_labels}")
        learning_rate_schedule(optim)  # an unknown schedule is refused here, not at the first step
        self.objective = objective
        self.graphdef, params, self.frozen, self.others = nnx.split(model, trainable, nnx.Param, ...)
        self.program = StepProgram(self.graphdef, objective.kind.name, optim.lr_schedule, optim.adam_b1,
                                   optim.adam_b2, bool(optim.weight_decay), bool(optim.max_grad_norm))
        self.hyper = jax.tree.map(jnp.asarray, {**hyperparameters(optim), "center_coef": np.float32(center_coef)})
        self.tx = make_optimizer(optim)
        self.init_state = TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
            rng=jax.random.key_data(jax.random.key(seed)),
        )
        self._train_jit = _TRAIN_JIT
        # Compiled train steps by batch shapes, made on demand or ahead of time (``compile_ahead``),
        # once the mesh is known (``use_mesh``). Tracing is serialised: LoRA's dropout key is a
        # module-level context.
        self._abstract_state = self._batch_sharding = None
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._trace_lock = threading.Lock()

    def use_mesh(self, mesh) -> TrainState:
        """Shard the state over ``mesh`` by the parameter-name rules (``trainer.parallel``) and
        keep it so: the step's output state has the input's shardings. Returns the placed state."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from rmflow.trainer.parallel import BATCH_AXES, shardings

        self.state_shardings = shardings(self.init_state, mesh)
        self.frozen = jax.device_put(self.frozen, shardings(self.frozen, mesh))
        replicated = NamedSharding(mesh, P())
        self.hyper = jax.device_put(self.hyper, replicated)
        self.others = jax.device_put(self.others, replicated)
        key = (self.program, _avals(self.state_shardings), replicated)
        if key not in _SHARDED_JITS:
            _SHARDED_JITS[key] = jax.jit(_train_step, static_argnums=0, donate_argnums=1,
                                         out_shardings=(self.state_shardings, replicated))
        self._train_jit = _SHARDED_JITS[key]
        self._abstract_state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                            self.init_state, self.state_shardings)
        self._batch_sharding = NamedSharding(mesh, P(None, BATCH_AXES))  # as the loop places batches
        self._pending.clear()
        return jax.device_put(self.init_state, self.state_shardings)

    def _key(self, batch_key: tuple) -> tuple:
        return (self.program, _avals(self._abstract_state), _avals(self.frozen), _avals(self.others), batch_key)

    def train_step(self, state: TrainState, batch: dict[str, jax.Array]):
        if self._abstract_state is None:  # no mesh given: jit as usual
            return self._train_jit(self.program, state, batch, self.frozen, self.others, self.hyper)
        key = _shapes(batch)
        step = _EXECUTABLES.get(self._key(key))
        if step is None:
            pending = self._pending.pop(key, None)
            step = pending.result() if pending is not None else self._compile(
                {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()})
        return step(state, batch, self.frozen, self.others, self.hyper)

    def compile_ahead(self, host_batch: dict[str, np.ndarray]) -> bool:
        """Start compiling the train step for a coming batch's shapes (host arrays as
        ``stack_micro_batches`` makes them) in a background thread, so that the batch finds it
        ready; True when a compilation started. Once per shape; needs ``use_mesh`` first."""
        if self._abstract_state is None:
            return False
        key = _shapes(host_batch)
        if self._key(key) in _EXECUTABLES or key in self._pending:
            return False
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rmflow-compile")
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self._batch_sharding)
                    for k, v in host_batch.items()}
        self._pending[key] = self._compiler.submit(self._compile, abstract)
        return True

    def stop_compiling(self) -> None:
        """Drop compilations not started; wait for the one running (it cannot be interrupted)."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=True, cancel_futures=True)
            self._compiler = None
        self._pending.clear()

    def lower(self, state: Any, batch: dict[str, Any]):
        """The train step lowered for ``state`` and ``batch`` (arrays or ShapeDtypeStructs)."""
        with self._trace_lock:
            return self._train_jit.lower(self.program, state, batch, self.frozen, self.others, self.hyper)

    def _compile(self, abstract_batch: dict[str, jax.ShapeDtypeStruct]):
        key = self._key(_shapes(abstract_batch))
        compiled = self.lower(self._abstract_state, abstract_batch).compile()
        with _EXECUTABLES_LOCK:
            return _EXECUTABLES.setdefault(key, compiled)

    def eval_step(self, params: Any, mb: dict[str, jax.Array]):
        return _EVAL_JIT(self.program, params, mb, self.frozen, self.others, self.hyper["center_coef"])

    def model(self, params: Any, frozen: Any = None) -> RewardTransformer:
        return self.program.model(params, self.frozen if frozen is None else frozen, self.others)

    def rewards(self, params: Any, mb: dict[str, jax.Array], frozen: Any = None) -> tuple[jax.Array, jax.Array]:
        return pair_rewards(self.model(params, frozen), mb)

    def _objective(self, params, mb, frozen, key=None):
        """The summed objective and its metric sums (``key``: LoRA dropout's; None: none)."""
        return _objective(self.program, params, mb, frozen, self.others, self.hyper["center_coef"], key)


def _shapes(batch: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()))


def widen(batch: dict[str, np.ndarray], length: int, slots: int | None = None,
          objective: Objective = OUTCOME) -> dict[str, np.ndarray]:
    """Right-pad a micro-batch's rows (segment 0: padding) to ``length`` tokens and its per-row
    step slots (weight 0: padding) to ``slots``."""
    def pad(k, x):
        if k in ROW_KEYS and x.shape[1] < length:
            return np.pad(x, [(0, 0), (0, length - x.shape[1])])
        if slots is not None and k in objective.slot_keys and x.shape[1] < slots:
            return np.pad(x, [(0, 0), (0, slots - x.shape[1])])
        return x

    return {k: pad(k, v) for k, v in batch.items()}


def stack_micro_batches(batches: list[dict[str, Any]], objective: Objective = OUTCOME) -> dict[str, np.ndarray]:
    """Host batches -> the train step's batch (still on the host): a leading micro-batch axis.
    Rows are right-padded (segment 0) to the longest micro-batch's length, step slots to the most."""
    length = max(b["input_ids"].shape[1] for b in batches)
    slots = max(b["reward_index"].shape[1] for b in batches)
    wide = [widen({k: b[k] for k in objective.device_keys}, length, slots, objective) for b in batches]
    return {k: np.stack([b[k] for b in wide]) for k in objective.device_keys}
