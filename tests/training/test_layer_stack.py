"""The decoder's layer stack: one scanned layer (``scan_layers: on``) against the layers unrolled,
what runs inside a layer (remat, LoRA's adapter dropout) under both, and what ``auto`` picks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rmflow.schemas.config import ConfigError
from rmflow.schemas.train_config import OptimizerConfig, TrainConfig
from rmflow.trainer.modeling import lora
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.step import Trainer

CFG = dataclasses.replace(ModelConfig.tiny(vocab_size=97), hidden_size=32, intermediate_size=48, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_hidden_layers=3)
T = 16


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(3, CFG.vocab_size, (2, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    segments = jnp.asarray([[1] * T, [1] * 10 + [0] * 6], jnp.int32)
    return ids, positions, segments, jnp.asarray([T - 1, 9], jnp.int32)


def model(scan: bool, remat: bool = False, dropout: float | None = None, cfg: ModelConfig = CFG) -> RewardTransformer:
    """``dropout``: LoRA adapters on every projection with this dropout (None: no adapters)."""
    m = RewardTransformer(cfg, rngs=nnx.Rngs(0), scan_layers=scan, remat=remat)
    if dropout is not None:
        lora.apply(m, lora.LoraConfig(rank=4, alpha=8, dropout=dropout), seed=0)
        for i, (_, linear) in enumerate(lora.lora_linears(m, lora.TARGETS)):  # adapters that change the output
            linear.lora_B[...] = jax.random.normal(jax.random.key(i), linear.lora_B[...].shape) * 0.05
    return m


def value_and_grad(m: RewardTransformer, key=None):
    graphdef, state = nnx.split(m)
    batch = inputs()

    def loss(state):
        with lora.dropout_key(key):
            return jnp.sum(nnx.merge(graphdef, state)(*batch) ** 2)

    return jax.jit(jax.value_and_grad(loss))(state)


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_layers_equal_unrolled_layers(remat):
    """Rewards, every layer's hidden states and the gradients, with LoRA dropout drawing the same
    masks in both (each layer folds its number into the step's key)."""
    key = jax.random.key(3)
    (v_scan, g_scan), (v_loop, g_loop) = (value_and_grad(model(s, remat, dropout=0.3), key) for s in (True, False))
    np.testing.assert_allclose(v_scan, v_loop, rtol=1e-6)
    assert_trees_close(g_scan, g_loop, atol=1e-5)
    ids, positions, segments, _ = inputs(1)
    scanned = nnx.jit(lambda m: m.model.hidden_states(ids, positions, segments))(model(True))
    unrolled = nnx.jit(lambda m: m.model.hidden_states(ids, positions, segments))(model(False))
    assert len(scanned) == len(unrolled) == CFG.num_hidden_layers + 1
    assert_trees_close(scanned, unrolled, atol=1e-6)


@pytest.mark.parametrize("scan", [True, False])
def test_remat_with_adapter_dropout_draws_the_masks_of_the_step(scan):
    """Recomputing a layer in the backward pass must draw the same dropout masks as the forward
    pass, and the masks of the key given (nnx.remat may reuse a trace across calls: a key read
    inside it would leak a tracer, or be another call's)."""
    plain = value_and_grad(model(scan, remat=False, dropout=0.3), jax.random.key(3))
    rematted = value_and_grad(model(scan, remat=True, dropout=0.3), jax.random.key(3))
    np.testing.assert_allclose(rematted[0], plain[0], rtol=1e-6)
    assert_trees_close(rematted[1], plain[1], atol=1e-5)
    other = value_and_grad(model(scan, remat=True, dropout=0.3), jax.random.key(4))
    assert abs(float(other[0] - plain[0])) > 1e-6  # another key, other masks
    m = model(scan, remat=True, dropout=0.3)
    with lora.dropout_key(jax.random.key(3)):  # op by op, after the jitted calls above: no stale trace
        eager = jnp.sum(m(*inputs()) ** 2)
    np.testing.assert_allclose(eager, plain[0], rtol=1e-5)


def _dots(m: RewardTransformer) -> int:
    """Matrix products in the train step's lowered program."""
    trainer = Trainer(m, OptimizerConfig(learning_rate=1e-3), total_steps=5)
    ids, positions, segments, _ = inputs()
    batch = {"input_ids": ids.reshape(1, 1, -1), "positions": positions.reshape(1, 1, -1),
             "segment_ids": jnp.where(segments.reshape(1, 1, -1) > 0, 1, 0),
             "branch_ids": jnp.asarray(np.r_[np.zeros(10), np.ones(6), np.full(16, 2)], jnp.int32).reshape(1, 1, -1),
             "reward_index": jnp.asarray([[[15, 31]]], jnp.int32), "margin": jnp.zeros((1, 1), jnp.float32),
             "weight": jnp.ones((1, 1), jnp.float32)}
    return trainer.lower(trainer.init_state, batch).as_text().count("dot_general")


def test_a_deeper_model_compiles_one_layer():
    """With scanned layers the train step's program holds the layer once, whatever the depth (so a
    30-layer model compiles in about the time of a 2-layer one); unrolled, every layer is a copy."""
    deep, shallow = (dataclasses.replace(CFG, num_hidden_layers=n) for n in (8, 3))
    assert _dots(model(True, cfg=deep)) == _dots(model(True, cfg=shallow))
    assert _dots(model(False, cfg=deep)) > 2 * _dots(model(False, cfg=shallow))


def _temp_bytes(dropout: float) -> int:
    m = model(True, dropout=dropout)
    graphdef, params, frozen = nnx.split(m, nnx.LoRAParam, ...)
    batch = inputs()
    ids = jnp.tile(batch[0], (4, 16))  # long enough rows that activations dominate
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    segments, index = jnp.ones_like(ids), jnp.full((ids.shape[0],), ids.shape[1] - 1, jnp.int32)

    def loss(params):
        with lora.dropout_key(jax.random.key(0)):
            return jnp.sum(nnx.merge(graphdef, params, frozen)(ids, positions, segments, index))

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_adapter_dropout_keeps_no_extra_activations():
    """LoRA's dropped inputs are recomputed in the backward pass, not kept: with dropout the
    backward's working memory (scanned layers, the default) is close to without (kept, each
    adapted projection would add an activation of its input's size)."""
    with_dropout, without = _temp_bytes(0.1), _temp_bytes(0.0)
    assert with_dropout < 1.25 * without, (with_dropout, without)


def test_auto_scans_with_lora_and_for_scoring_and_unrolls_full_fine_tuning():
    base = {"data": "shards", "output": "run"}
    full, adapters = TrainConfig(**base, model="tiny"), TrainConfig(**base, model="tiny", lora={"rank": 4})
    assert not full.scans_layers() and full.scans_layers(training=False)
    assert adapters.scans_layers() and adapters.scans_layers(training=False)
    assert TrainConfig(**base, model={"path": "tiny", "scan_layers": "on"}).scans_layers()
    assert not TrainConfig(**base, lora={"rank": 4}, model={"path": "tiny", "scan_layers": "off"}).scans_layers(
        training=False)
    with pytest.raises(ConfigError, match="scan_layers 'yes': use one of"):
        TrainConfig(**base, model={"path": "tiny", "scan_layers": "yes"})
