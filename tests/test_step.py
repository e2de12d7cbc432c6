import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rmflow.schemas.record import PairRecord
from rmflow.trainer.data import Collate
from rmflow.trainer.loss import pair_metrics_of_sums
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.llama import RewardTransformer
from rmflow.trainer.step import OptimConfig, Trainer, decay_mask, learning_rate_schedule, stack_micro_batches

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
    return Trainer(model, OptimConfig(learning_rate=1e-3, total_steps=10, **optim), center_coef=0.01)


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
    params = nnx.state(RewardTransformer(CFG.__class__(**{**CFG.__dict__, "qkv_bias": True}), rngs=nnx.Rngs(0)), nnx.Param)
    flat = {".".join(map(str, p)): v.value for p, v in nnx.to_flat_state(decay_mask(params))}
    assert flat["model.layers.0.self_attn.q_proj.kernel"] is True
    assert flat["model.layers.0.self_attn.q_proj.bias"] is False
    assert flat["model.layers.0.input_layernorm.weight"] is False and flat["model.norm.weight"] is False
    assert flat["model.embed_tokens.embedding"] is True


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_warmup_then_decay_to_end(schedule):
    s = learning_rate_schedule(OptimConfig(learning_rate=1.0, learning_rate_end=0.1, warmup_steps=10,
                                           total_steps=110, lr_schedule=schedule))
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0) and float(s(110)) == pytest.approx(0.1, abs=1e-6)
    assert float(s(60)) == pytest.approx(0.55, abs=1e-6)  # halfway: both schedules give the midpoint


def test_optimizer_settings_are_the_train_config_s():
    """OptimConfig holds TrainConfig's fields of the same names, defaults included: one source."""
    import dataclasses

    from rmflow.schemas.config import TrainConfig

    train = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for f in dataclasses.fields(OptimConfig):
        if f.name != "total_steps":
            assert f.name in train and f.default == train[f.name], f.name
    cfg = TrainConfig(data="d", model="micro", output="o", learning_rate=3e-4, lr_schedule="cosine", adam_b2=0.95)
    o = OptimConfig.of(cfg, 7)
    assert (o.learning_rate, o.lr_schedule, o.adam_b2, o.total_steps) == (3e-4, "cosine", 0.95, 7)


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
