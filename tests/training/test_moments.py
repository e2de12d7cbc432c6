"""AdamW's moments stored in bfloat16 or int8 blocks (``optimizer.moments``) and the optimizer state
kept in host memory (``optimizer.offload``): each code decodes within a level of its value and
is unbiased, the state is the promised size, a run trains like float32 AdamW, resumes exactly,
and offloading changes nothing but where the state lives."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rmflow.trainer import moments as M
from rmflow.trainer.errors import TrainError
from rmflow.trainer.train import run as train

from tests.training.test_train import config, synthetic, timing_free  # noqa: F401 - the fixture

DRAWS = 400


def _draws(encode, decode, x):
    """Every decoding of ``x`` encoded at steps 1..DRAWS (each step draws its own noise)."""
    return np.stack([np.asarray(decode(encode(x, M._uniform(x.shape, jnp.asarray(s), 3)))) for s in range(1, DRAWS + 1)])


def _levels(scale, levels, first, top):
    return scale * np.square((np.arange(top + 1) + first) / levels)


def test_first_moment_codes_land_on_the_levels_around_the_value_and_average_to_it():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 600)) * np.exp(rng.uniform(-8, 0, (3, 600)))).astype(np.float32)  # 4 orders
    x[1, 300:556] = 0.0  # an all-zero block
    got = _draws(M.encode_first, M.decode_first, jnp.asarray(x))
    assert got.shape == (DRAWS, 3, 600)
    scales = np.abs(np.pad(x, [(0, 0), (0, 168)]).reshape(3, 3, 256)).max(-1)
    for r in range(3):
        for b in range(3):
            sl = slice(256 * b, min(256 * (b + 1), 600))
            lv = _levels(scales[r, b], 127, 0, 127)
            mag, seen = np.abs(x[r, sl]), np.abs(got[:, r, sl])
            k = np.clip(np.searchsorted(lv, mag, side="right") - 1, 0, 126)
            lo, hi = lv[k], lv[k + 1]
            assert np.all((seen >= lo - 1e-7 * lv[-1]) & (seen <= hi + 1e-7 * lv[-1]))  # one of the two levels
            assert np.all(np.sign(got[:, r, sl]) * np.sign(x[r, sl]) >= 0)  # never the wrong sign
            gap = hi - lo
            np.testing.assert_array_less(np.abs(seen.mean(0) - mag), gap / 8 + 1e-12)  # unbiased: 5 sigma
    assert np.all(got[:, 1, 300:556] == 0)


def test_second_moment_codes_never_decode_to_zero_and_average_to_it():
    rng = np.random.default_rng(1)
    v = np.square(rng.standard_normal((2, 512)) * np.exp(rng.uniform(-6, 0, (2, 512)))).astype(np.float32)
    v[0, :10] = 0.0  # never-updated elements beside updated ones
    got = _draws(M.encode_second, M.decode_second, jnp.asarray(v))
    assert np.all(got > 0)  # zero is no level: an update never divides by eps alone
    root, seen = np.sqrt(v), np.sqrt(got)
    scales = root.reshape(2, 2, 256).max(-1)
    lv = np.stack([_levels(s, 256, 1, 255) for s in scales.ravel()]).reshape(2, 2, 256)
    for r in range(2):
        for b in range(2):
            sl = slice(256 * b, 256 * (b + 1))
            levels, w = lv[r, b], root[r, sl]
            k = np.clip(np.searchsorted(levels, w, side="right") - 1, 0, 254)
            above = w >= levels[0]
            assert np.all(np.isclose(seen[:, r, sl], levels[k], rtol=1e-5) | np.isclose(seen[:, r, sl], levels[k + 1], rtol=1e-5)
                          | ~above)  # one of the two levels around its root
            gap = np.square(levels[k + 1]) - np.square(levels[k])  # unbiased in the moment itself
            np.testing.assert_array_less(np.abs(got[:, r, sl].mean(0) - v[r, sl])[above], gap[above] / 8 + 1e-12)
            assert np.all(seen[:, r, sl][:, ~above] == levels[0])  # below the lowest level: the lowest


def test_bfloat16_stochastic_rounding_picks_a_neighbour_and_averages_to_the_value():
    x = jnp.asarray(np.random.default_rng(2).standard_normal(1000).astype(np.float32) * 1e-3)
    got = np.stack([np.asarray(M._round_bf16(x, M._uniform(x.shape, jnp.asarray(s), 0)).astype(jnp.float32))
                    for s in range(1, DRAWS + 1)])
    bits = np.asarray(x).view(np.uint32) & np.uint32(0xFFFF0000)
    down, up = bits.view(np.float32), (bits + np.uint32(0x10000)).view(np.float32)  # the bfloat16s around x
    assert np.all((got == down) | (got == up))
    np.testing.assert_array_less(np.abs(got.mean(0) - np.asarray(x)), np.abs(up - down) / 8 + 1e-12)


def test_int8_keeps_float32_where_blocks_would_cost_more_than_they_save():
    assert M.stored_dtype("int8", (8192,)) == "float32"  # a vector (a norm's weight)
    assert M.stored_dtype("int8", (4096, 1)) == "float32"  # the score head
    assert M.stored_dtype("int8", (4096, 8)) == "float32"  # a LoRA adapter's A: its rank axis last
    assert M.stored_dtype("int8", (8, 4096)) == "int8"  # and its B
    assert M.stored_dtype("int8", (4096, 64)) == "int8"  # a short axis: one block, no padding
    assert M.stored_dtype("bfloat16", (8192,)) == "bfloat16" and M.stored_dtype("int8", (63, 64)) == "float32"
    x = jnp.asarray(np.random.default_rng(3).standard_normal((100, 64)).astype(np.float32))
    m = M.encode_first(x, M._uniform(x.shape, jnp.asarray(1), 0))
    assert m.block_scales.shape == (100, 1) and m.codes.shape == (100, 64)
    np.testing.assert_allclose(M.decode_first(m), x, atol=float(jnp.abs(x).max()) * 2 / 127)


def test_the_noise_is_a_function_of_the_element_step_and_salt():
    a = M._uniform((4, 300), jnp.asarray(7), 1)
    np.testing.assert_array_equal(a, M._uniform((4, 300), jnp.asarray(7), 1))
    assert not np.array_equal(a, M._uniform((4, 300), jnp.asarray(8), 1))
    assert not np.array_equal(a, M._uniform((4, 300), jnp.asarray(7), 2))
    assert 0.0 <= float(a.min()) and float(a.max()) < 1.0 and abs(float(a.mean()) - 0.5) < 0.02


def _tiny_params():
    from flax import nnx
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer

    abstract = nnx.eval_shape(lambda: RewardTransformer(ModelConfig.tiny(49152), rngs=nnx.Rngs(0), scan_layers=False))
    return nnx.state(abstract, nnx.Param)


@pytest.mark.parametrize("moments,most", [("float32", 8.0), ("bfloat16", 4.0), ("int8", 2.5)])
def test_state_bytes_per_trained_parameter(moments, most):
    from rmflow.schemas.train_config import OptimizerConfig
    from rmflow.trainer.optimizer import make_optimizer

    params = _tiny_params()
    count = sum(x.size for x in jax.tree.leaves(params))
    state = jax.eval_shape(make_optimizer(OptimizerConfig(moments=moments)).init, params)
    per = M.state_bytes(state) / count
    assert per <= most + 1e-3 and per > most - 0.5, per  # int8: 2.03 with the scales and float32 small arrays


def test_a_compact_moment_is_sharded_by_its_parameters_rule():
    from jax.sharding import Mesh
    from rmflow.schemas.train_config import OptimizerConfig
    from rmflow.trainer.optimizer import make_optimizer
    from rmflow.trainer.parallel.rules import describe, spec_for

    params = _tiny_params()
    state = jax.eval_shape(make_optimizer(OptimizerConfig(moments="int8")).init, params)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    rows = {name: spec for name, _, spec in describe(state, mesh)}
    gate = next(n for n in rows if n.endswith("layers.0.mlp.gate_proj.kernel") and ".mu." in n)
    assert rows[gate] == spec_for("model.layers.0.mlp.gate_proj.kernel", (256, 768), mesh)
    codes = [x for x in jax.tree.leaves(state) if getattr(x, "dtype", None) == jnp.int8]
    assert codes and all(x.ndim >= 1 for x in codes)


def _dtypes(state):
    return sorted({str(x.dtype) for x in jax.tree.leaves(state.opt_state) if x.ndim})


@pytest.mark.slow
def test_compact_moments_train_like_float32_and_resume_exactly(synthetic, tmp_path):  # noqa: F811
    kw = dict(max_steps=30, logging={"steps": 10}, eval_steps=30, checkpoint={"save_steps": 15})

    def cfg(name, moments):
        return config(synthetic, tmp_path / name, **kw, optimizer={"learning_rate": 1e-3, "moments": moments})

    runs = {m: train(cfg(m, m)) for m in ("float32", "bfloat16", "int8")}
    assert _dtypes(runs["bfloat16"].state) == ["bfloat16", "float32"]
    assert _dtypes(runs["int8"].state) == ["float32", "int8", "uint8"]
    ref = runs["float32"].history[-1]
    for m in ("bfloat16", "int8"):
        got = runs[m].history[-1]
        assert abs(got["loss"] - ref["loss"]) <= 0.05 * ref["loss"] + 0.01, (m, got["loss"], ref["loss"])
        assert got["eval_accuracy"] >= ref["eval_accuracy"] - 0.05, (m, got["eval_accuracy"], ref["eval_accuracy"])
    # resumed from the middle checkpoint: bitwise the uninterrupted run (the rounding noise is the step's)
    straight = [np.asarray(x) for x in jax.tree.leaves(runs["int8"].state)]
    shutil.rmtree(tmp_path / "int8" / "checkpoints" / "30")
    resumed = train(cfg("int8", "int8"), resume=True)
    assert timing_free(resumed.history) == timing_free(runs["int8"].history)
    for a, b in zip(jax.tree.leaves(resumed.state), straight):
        np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(TrainError, match="optimizer.moments 'int8' -> 'bfloat16'.*another format"):
        train(cfg("int8", "bfloat16"), resume=True, allow_config_change=True)


def test_offloaded_state_lives_in_host_memory_and_changes_nothing(synthetic, tmp_path):  # noqa: F811
    kw = dict(max_steps=12, logging={"steps": 4}, checkpoint={"save_steps": 6})
    plain = train(config(synthetic, tmp_path / "plain", **kw))
    off = train(config(synthetic, tmp_path / "off", **{**kw, "optimizer": {"learning_rate": 1e-3, "offload": True}}))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(off.state.opt_state)}
    assert kinds == {"pinned_host"}, kinds
    assert {x.sharding.memory_kind for x in jax.tree.leaves(off.state.params)} == {"device"}
    assert timing_free(off.history) == timing_free(plain.history)
    for a, b in zip(jax.tree.leaves(off.state), jax.tree.leaves(plain.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # offloading is where the state lives, not what the run computes: a resume may turn it off
    shutil.rmtree(tmp_path / "off" / "checkpoints" / "12")
    back = train(config(synthetic, tmp_path / "off", **kw), resume=True)
    for a, b in zip(jax.tree.leaves(back.state), jax.tree.leaves(plain.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
