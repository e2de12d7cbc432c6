"""Long rows split over devices along their tokens (``mesh.context``): on 8 fake CPU devices, rows
of 8k tokens packed with the prompt once (branch masks) give one device's loss and gradients
(1e-5, float32) over a context axis of 8, composed with fsdp and tensor, in bfloat16 with recomputed
layers, and for LoRA on an nf4 base over 5 devices (the row padded to whole blocks on each); each
device then holds a share of the activations, not the whole row's."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rmflow.trainer.modeling.attention import blockwise_attention
from rmflow.trainer.parallel import mesh_shape

from tests.training.test_parallel import run_8_devices

SCRIPT = textwrap.dedent('''
    import contextlib
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tests.training.test_step import CFG
    from rmflow.schemas.record import PairRecord
    from rmflow.schemas.train_config import OptimizerConfig
    from rmflow.trainer.batching import stack_micro_batches
    from rmflow.trainer.data import PackCollate
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.parallel import make_mesh
    from rmflow.trainer.parallel.mesh import BATCH_AXES
    from rmflow.trainer.step import Trainer

    assert len(jax.devices()) == 8

    def pairs(n, seed):
        """Pairs of a 1k-token prompt and replies of 300 to 700 tokens: four fill an 8k row."""
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            p = rng.integers(3, 64, 1024)
            c = np.r_[p, rng.integers(3, 64, int(rng.integers(300, 700)))].astype(np.int32)
            r = np.r_[p, rng.integers(3, 64, int(rng.integers(300, 700)))].astype(np.int32)
            out.append(PairRecord(c, r, len(c) - 1, len(r) - 1, 1024, f"{i:032x}", "s"))
        return out

    host = {k: np.asarray(v) for k, v in stack_micro_batches([PackCollate(4, 2048, rows=2)(pairs(8, 0))]).items()}
    assert host["input_ids"].shape[-1] >= 7680, host["input_ids"].shape
    assert int(host["branch_ids"].max()) == 2  # the prompt once, each reply on its branch

    def fresh():
        return Trainer(RewardTransformer(CFG, rngs=nnx.Rngs(0)), OptimizerConfig(learning_rate=1e-3),
                       total_steps=5, center_coef=0.01)

    def loss_and_grads(t, params, mesh=None):
        batch = {k: jnp.asarray(v[0]) for k, v in host.items()}
        if mesh is not None:
            batch = jax.device_put(batch, NamedSharding(mesh, P(BATCH_AXES)))
        f = jax.jit(jax.value_and_grad(lambda p, b: t._objective(p, b, t.frozen)[0]))
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            return f(params, batch)

    t = fresh()
    ref_loss, ref_grads = loss_and_grads(t, t.init_state.params)

    for shape in [(1, 1, 1, 1, 8), (1, 2, 2, 1, 2)]:
        mesh = make_mesh(shape)
        t = fresh()
        state = t.use_mesh(mesh)
        loss, grads = loss_and_grads(t, state.params, mesh)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * float(np.abs(a).max()) + 1e-8)
        # the train step itself, on the mesh, gives the same loss
        placed = jax.device_put(host, NamedSharding(mesh, P(None, BATCH_AXES)))
        _, metrics = t.train_step(state, placed)
        np.testing.assert_allclose(float(metrics["loss_sum"]), float(ref_loss), rtol=1e-5)
        print("mesh", shape, "ok", float(loss))

    # bfloat16 compute with its layers recomputed: the loss of one device's bfloat16 model
    def bf16():
        return Trainer(RewardTransformer(CFG, dtype=jnp.bfloat16, remat=True, rngs=nnx.Rngs(0)),
                       OptimizerConfig(learning_rate=1e-3), total_steps=5, center_coef=0.01)

    t = bf16()
    one_loss, one_grads = loss_and_grads(t, t.init_state.params)
    t = bf16()
    state = t.use_mesh(make_mesh((1, 1, 1, 1, 2), jax.devices()[:2]))
    loss, grads = loss_and_grads(t, state.params, make_mesh((1, 1, 1, 1, 2), jax.devices()[:2]))
    np.testing.assert_allclose(float(loss), float(one_loss), rtol=1e-3)
    for a, b in zip(jax.tree.leaves(one_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                                   atol=2e-2 * float(np.abs(np.asarray(a, np.float32)).max()) + 1e-6)
    print("bfloat16 ok", float(loss), float(one_loss))

    # LoRA on an nf4 base, the row split over 5 devices (its length not a multiple of 5 blocks: padded)
    from rmflow.trainer.modeling import lora
    spec = lora.LoraConfig(rank=4, target_modules="all-linear", base_dtype="nf4")

    def qlora():
        model = RewardTransformer(CFG, rngs=nnx.Rngs(0))
        lora.apply(model, spec)
        return Trainer(model, OptimizerConfig(learning_rate=1e-3), total_steps=5, trainable=lora.trainable_filter(spec))

    assert host["input_ids"].shape[-1] % (5 * 128)
    t = qlora()
    one_loss, one_grads = loss_and_grads(t, t.init_state.params)
    five = make_mesh((1, 1, 1, 1, 5), jax.devices()[:5])
    t = qlora()
    loss, grads = loss_and_grads(t, t.use_mesh(five).params, five)
    np.testing.assert_allclose(float(loss), float(one_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(one_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * float(np.abs(a).max()) + 1e-8)
    print("nf4 LoRA on 5 ok")

    # Each device keeps its share of the rows: the step's temporaries over a context axis of 8 are
    # a fraction of the same step's on one device.
    temps = {}
    for shape, devices in [((1, 1, 1, 1, 1), jax.devices()[:1]), ((1, 1, 1, 1, 8), jax.devices())]:
        t = fresh()
        t.use_mesh(make_mesh(shape, devices))
        temps[shape] = t.compile_train(host)[1].memory_analysis().temp_size_in_bytes
    print("temporaries", temps)
    assert temps[(1, 1, 1, 1, 8)] < 0.4 * temps[(1, 1, 1, 1, 1)], temps
    print("OK")
''')


@pytest.mark.slow
def test_rows_split_over_a_context_axis_match_one_device():
    r = run_8_devices(SCRIPT, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


@pytest.mark.parametrize("window", [None, 40])
def test_the_blockwise_kernel_from_an_offset_is_the_rows_share(window):
    """Queries from an offset against the whole row's keys give that share of the whole row's
    attention and of its gradients (the kernel each context device runs), with branches,
    packed segments and a sliding window."""
    from rmflow.trainer.modeling.attention import _flash

    rng = np.random.default_rng(0)
    b, t, n, kh, d, block = 2, 256, 4, 2, 8, 32
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for h in (n, kh, kh))
    seg = jnp.asarray(np.repeat([[1] * 100 + [2] * 120 + [0] * 36], b, 0), jnp.int32)
    br = jnp.asarray(np.tile(np.r_[[0] * 40, [1] * 30, [2] * 30, [0] * 50, [1] * 35, [2] * 35, [0] * 36], (b, 1)),
                     jnp.int32)
    pos = jnp.asarray(np.tile(np.r_[np.arange(70), np.arange(40, 70), np.arange(85), np.arange(50, 85),
                                    np.zeros(36, int)], (b, 1)), jnp.int32)
    whole = lambda q, k, v: blockwise_attention(q, k, v, seg, pos, br, window=window, block=block)  # noqa: E731
    ref, vjp = jax.vjp(whole, q, k, v)
    dout = jnp.asarray(rng.standard_normal(ref.shape), jnp.float32)
    dq, dk, dv = vjp(dout)
    parts = 4
    share = t // parts
    dk_sum, dv_sum = jnp.zeros_like(k), jnp.zeros_like(v)
    for p in range(parts):
        sl = slice(p * share, (p + 1) * share)
        f = lambda q, k, v, p=p: _flash(q, k, v, seg, pos, br, jnp.int32(p * share), window, block,  # noqa: E731
                                        (None, None))
        out, vjp_p = jax.vjp(f, q[:, sl], k, v)
        np.testing.assert_allclose(out, ref[:, sl], atol=1e-6)
        dq_p, dk_p, dv_p = vjp_p(dout[:, sl])
        np.testing.assert_allclose(dq_p, dq[:, sl], atol=1e-5)
        dk_sum, dv_sum = dk_sum + dk_p, dv_sum + dv_p
    np.testing.assert_allclose(dk_sum, dk, atol=1e-5)
    np.testing.assert_allclose(dv_sum, dv, atol=1e-5)


def test_mesh_shapes_take_a_context_axis():
    assert mesh_shape((1, 1, 1, 1, -1), 8) == (1, 1, 1, 1, 8)
    assert mesh_shape((2, 1, 1, 1), 2) == (2, 1, 1, 1)  # four sizes: context 1
    from rmflow.schemas.train_config import TrainConfig

    cfg = TrainConfig(data="d", model="tiny", output="o").with_overrides(["mesh.context=4", "mesh.data=1"])
    assert cfg.mesh.shape == (1, 1, 1, 1, 4)


def test_a_mixture_of_experts_is_refused_a_context_axis():
    """Its router sorts a row's tokens by expert: a row split over devices is refused in one line."""
    import dataclasses

    from flax import nnx
    from rmflow.schemas.train_config import OptimizerConfig
    from rmflow.trainer.errors import TrainError
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.parallel import AXES
    from rmflow.trainer.step import Trainer

    from tests.training.test_step import CFG

    moe = dataclasses.replace(CFG, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, sparse_layers=(0, 1))
    trainer = Trainer(RewardTransformer(moe, rngs=nnx.Rngs(0)), OptimizerConfig(), total_steps=2)
    with pytest.raises(TrainError, match="mixture of experts cannot split its rows over a context axis"):
        trainer.use_mesh(jax.sharding.AbstractMesh((1, 1, 1, 1, 2), AXES))
