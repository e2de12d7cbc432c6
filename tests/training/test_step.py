import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rmflow.schemas.record import PairRecord
from rmflow.schemas.train_config import OptimizerConfig
from rmflow.trainer import step as step_module
from rmflow.trainer.batching import stack_micro_batches
from rmflow.trainer.data import Collate
from rmflow.trainer.loss import pair_metrics_of_sums
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.optimizer import (
    decay_mask,
    hyperparameters,
    learning_rate_schedule,
    make_optimizer,
)
from rmflow.trainer.step import Trainer

CFG = ModelConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def records(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(3, 64, 5)
        c = np.r_[p, rng.integers(3, 64, int(rng.integers(2, 9)))].astype(np.int32)
        r = np.r_[p, rng.integers(3, 64, int(rng.integers(2, 9)))].astype(np.int32)
        out.append(PairRecord(c, r, len(c) - 1, len(r) - 1, 5, f"{i:032x}", "s", margin=float(i % 3) * 0.1))
    return out


def trainer(**optim):
    model = RewardTransformer(CFG, rngs=nnx.Rngs(0))
    return Trainer(model, OptimizerConfig(learning_rate=1e-3, **optim), total_steps=10, center_coef=0.01)


def copy_state(state):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def test_parameters_change_and_metrics_count_pairs():
    t = trainer()
    before = copy_state(t.init_state)
    batch = stack_micro_batches([Collate(4, 64)(records(3))])
    after, m = t.train_step(copy_state(before), batch)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.allclose(a, b), before.params, after.params))
    assert all(changed), "every parameter should move"
    assert int(after.step) == 1 and float(m["pairs"]) == 3  # the filler pair does not count
    assert np.isfinite(float(m["grad_norm"])) and float(m["learning_rate"]) == pytest.approx(1e-3)


def test_gradient_accumulation_equals_one_big_batch():
    recs = records(8, seed=1)
    t = trainer()
    big, m_big = t.train_step(copy_state(t.init_state), stack_micro_batches([Collate(8, 64)(recs)]))
    # 4 micro-batches of 2 pairs (one with a filler pair: 3 real pairs + 1 filler twice)
    micro = [Collate(2, 64)(recs[i:i + 2]) for i in range(0, 8, 2)]
    acc, m_acc = t.train_step(copy_state(t.init_state), stack_micro_batches(micro))
    for a, b in zip(jax.tree.leaves(big.params), jax.tree.leaves(acc.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert pair_metrics_of_sums({k: float(v) for k, v in m_big.items()})["loss"] == pytest.approx(
        pair_metrics_of_sums({k: float(v) for k, v in m_acc.items()})["loss"], abs=1e-6)


def test_no_weight_decay_on_norms_and_biases():
    params = nnx.state(RewardTransformer(CFG.__class__(**{**CFG.__dict__, "qkv_bias": True}), rngs=nnx.Rngs(0)),
                       nnx.Param)
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(decay_mask(params))}
    assert flat["model.layers.0.self_attn.q_proj.kernel"] is True
    assert flat["model.layers.0.self_attn.q_proj.bias"] is False
    assert flat["model.layers.0.input_layernorm.weight"] is False and flat["model.norm.weight"] is False
    assert flat["model.embed_tokens.embedding"] is True


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_warmup_then_decay_to_end(schedule):
    s = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, learning_rate_end=0.1, warmup_steps=10,
                                               schedule=schedule), total_steps=110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0) and float(s(110)) == pytest.approx(0.1, abs=1e-6)
    assert float(s(60)) == pytest.approx(0.55, abs=1e-6)  # halfway: both schedules give the midpoint


def _optax_schedule(c: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The schedule from optax's own functions, its numbers Python floats."""
    decay_steps = max(total_steps - c.warmup_steps, 1)
    decay = (optax.cosine_decay_schedule(c.learning_rate, decay_steps, alpha=c.learning_rate_end / c.learning_rate)
             if c.schedule == "cosine" else optax.linear_schedule(c.learning_rate, c.learning_rate_end, decay_steps))
    return optax.join_schedules([optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps), decay],
                                [c.warmup_steps]) if c.warmup_steps else decay


def _optax_adamw(c: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW from optax's own functions, the optimizer's numbers Python floats."""
    return optax.adamw(_optax_schedule(c, total_steps), b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                       weight_decay=c.weight_decay, mask=decay_mask)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("warmup,weight_decay", [(0, 0.0), (3, 0.01)])
def test_the_optimizer_with_its_numbers_as_arguments_is_optax_s_to_the_bit(schedule, warmup, weight_decay):
    """The step gets the optimizer's numbers as arrays (one program for every learning rate);
    its updates and learning rates equal optax's AdamW built from Python floats, bit for bit."""
    c = OptimizerConfig(learning_rate=3e-4, learning_rate_end=1e-5, warmup_steps=warmup, schedule=schedule,
                        weight_decay=weight_decay, adam_eps=1e-6)
    steps = 12
    params = {"dense": {"kernel": jnp.ones((4, 3))}, "norm": {"weight": jnp.ones(3)}}
    ours, reference = make_optimizer(c, steps), _optax_adamw(c, steps)
    state, ref_state = ours.init(params), reference.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)  # checkpoints keep their layout
    update = jax.jit(lambda g, s, p, h: make_optimizer(c, hyper=h).update(g, s, p))
    ref_update = jax.jit(reference.update)
    hyper, rng, p, ref_p = hyperparameters(c, steps), np.random.default_rng(0), params, params
    for _ in range(14):  # past the end of the schedule
        g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
        u, state = update(g, state, p, hyper)
        ref_u, ref_state = ref_update(g, ref_state, ref_p)
        p, ref_p = optax.apply_updates(p, u), optax.apply_updates(ref_p, ref_u)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
            np.testing.assert_array_equal(a, b)
    ours_lr, ref_lr = learning_rate_schedule(c, steps), _optax_schedule(c, steps)
    assert [float(ours_lr(i)) for i in range(16)] == [float(ref_lr(i)) for i in range(16)]


def test_runs_that_differ_in_the_optimizer_s_numbers_share_one_compiled_step():
    """A second Trainer with another learning rate, warmup, planned length, epsilon, clipping norm
    and centering coefficient traces nothing new, and its numbers take effect."""
    batch = stack_micro_batches([Collate(4, 64)(records(4))])
    a = trainer()
    first, m_a = a.train_step(copy_state(a.init_state), batch)
    compiled = step_module._TRAIN_JIT._cache_size()
    b = Trainer(RewardTransformer(CFG, rngs=nnx.Rngs(0)), OptimizerConfig(learning_rate=3e-3, warmup_steps=2,
                adam_eps=1e-6, max_grad_norm=0.5), total_steps=50, center_coef=0.1)
    second, m_b = b.train_step(copy_state(b.init_state), batch)
    assert step_module._TRAIN_JIT._cache_size() == compiled
    assert float(m_a["learning_rate"]) == pytest.approx(1e-3) and float(m_b["learning_rate"]) == 0.0  # warmup
    third, m = b.train_step(second, batch)
    assert float(m["learning_rate"]) == pytest.approx(1.5e-3) and step_module._TRAIN_JIT._cache_size() == compiled
    for t, coef in ((a, 0.01), (b, 0.1)):  # eval's loss holds each run's own centering term
        s = {k: float(v) for k, v in t.eval_batch(first.params, batch).items()}
        assert s["loss_sum"] == pytest.approx(s["bt_loss_sum"] + coef * s["center_sum"], rel=1e-5)


def test_a_run_s_trainer_takes_the_optimizer_section_and_planned_steps():
    """make_trainer builds the optimizer from the config's optimizer section (its one definition)
    over the run's planned steps."""
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.step import make_trainer

    cfg = TrainConfig(data="d", model="micro", output="o",
                      optimizer={"learning_rate": 3e-4, "schedule": "cosine", "adam_b2": 0.95})
    t = make_trainer(cfg, RewardTransformer(CFG, rngs=nnx.Rngs(0)), 7)
    assert (t.program.lr_schedule, t.program.adam_b2) == ("cosine", 0.95)
    assert float(t.hyper["learning_rate"]) == pytest.approx(3e-4) and int(t.hyper["total_steps"]) == 7


def test_a_shape_compiled_ahead_is_compiled_off_the_training_thread_and_trains_alike():
    import threading

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from rmflow.trainer.parallel import BATCH_AXES, make_mesh

    mesh = make_mesh((-1, 1, 1))
    place = lambda host: {k: jax.device_put(v, NamedSharding(mesh, P(None, BATCH_AXES)))  # noqa: E731
                          for k, v in host.items()}
    hosts = [stack_micro_batches([Collate(4, 64)(records(4, seed))]) for seed in (0, 1)]
    assert hosts[0]["input_ids"].shape == hosts[1]["input_ids"].shape  # one shape, two batches
    threads = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            threads.append(threading.current_thread().name)

    ahead = trainer()
    state = ahead.use_mesh(mesh)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert ahead.compile_ahead(hosts[0]) and not ahead.compile_ahead(hosts[1])  # once per shape
        main = threading.current_thread().name
        for host in hosts:
            state, m = ahead.train_step(state, place(host))
        assert threads and main not in threads, threads  # compiled in the background only
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        ahead.stop_compiling()
    plain = trainer()
    reference = plain.use_mesh(mesh)
    for host in hosts:  # compiled on demand
        reference, m_ref = plain.train_step(reference, place(host))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(m["loss_sum"]) == float(m_ref["loss_sum"])


def test_a_step_finds_its_executable_without_describing_the_state_again(monkeypatch):
    """Every step (and every batch read ahead) looks up its compiled executable: the state's, the
    frozen parameters' and their shardings' description is made once, in ``use_mesh``, not per
    lookup (flattening a deep model's state on every lookup is costly)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from rmflow.trainer import step as step_module
    from rmflow.trainer.parallel import BATCH_AXES, make_mesh

    mesh = make_mesh((-1, 1, 1))
    hosts = [stack_micro_batches([Collate(4, 64)(records(4, seed))]) for seed in (0, 1, 2)]
    t = trainer()
    state = t.use_mesh(mesh)
    described = []
    real = step_module._avals
    monkeypatch.setattr(step_module, "_avals", lambda tree: described.append(1) or real(tree))
    for host in hosts:
        t.compile_ahead(host)
        state, m = t.train_step(state, {k: jax.device_put(v, NamedSharding(mesh, P(None, BATCH_AXES)))
                                        for k, v in host.items()})
    t.stop_compiling()
    assert not described
    assert np.isfinite(float(m["loss_sum"]))


def test_a_step_never_waits_behind_a_queued_compilation(monkeypatch):
    """A train shape queued behind background work (here the eval-shape job, held) is taken back
    and compiled by the step itself; the job stops at stop_compiling."""
    import threading

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from rmflow.trainer import step as step_module
    from rmflow.trainer.parallel import BATCH_AXES, make_mesh

    monkeypatch.setattr(step_module, "COMPILE_THREADS", 1)
    mesh = make_mesh((-1, 1, 1))
    host = stack_micro_batches([Collate(4, 64)(records(4, 7))])
    t = trainer()
    state = t.use_mesh(mesh)
    step_module.forget_compiled()
    release, started = threading.Event(), threading.Event()

    def held():  # the eval-shape job's batches, held until the step is done
        started.set()
        release.wait(120)
        return iter(())

    assert t.compile_evals_ahead(lambda: held())
    assert started.wait(60)
    assert t.compile_ahead(host)  # queued behind the held job
    done = []
    stepping = threading.Thread(target=lambda: done.append(t.train_step(
        state, {k: jax.device_put(v, NamedSharding(mesh, P(None, BATCH_AXES))) for k, v in host.items()})))
    stepping.start()
    stepping.join(120)
    release.set()
    t.stop_compiling()
    assert done and np.isfinite(float(done[0][1]["loss_sum"]))  # trained without waiting for the job
