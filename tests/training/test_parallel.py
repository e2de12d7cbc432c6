"""Sharded training on 8 fake CPU devices: meshes (data, fsdp, tensor) of (8,1,1), (2,4,1), (1,4,2)
and (1,1,8) give the single-device loss and parameters after several steps (1e-5), the state is
sharded as the name rules say (asserted on the arrays, not only on the result), and a sharded
checkpoint restores onto another mesh shape."""

import os
import subprocess
import sys
import textwrap

import pytest
from rmflow.trainer.parallel import MeshError, mesh_shape

SCRIPT = textwrap.dedent('''
    import sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tests.training.test_step import CFG, records
    from rmflow.trainer.data import Collate, PackCollate
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.parallel import batch_shards, describe, make_mesh, shardings
    from rmflow.trainer.parallel.mesh import BATCH_AXES
    from rmflow.trainer.batching import stack_micro_batches
    from rmflow.schemas.train_config import OptimizerConfig
    from rmflow.trainer.step import Trainer

    assert len(jax.devices()) == 8
    STEPS = 3

    def fresh():
        return Trainer(RewardTransformer(CFG, rngs=nnx.Rngs(0)),
                       OptimizerConfig(learning_rate=1e-3, weight_decay=0.01), total_steps=5, center_coef=0.01)

    def batches(collate):
        return [{k: np.asarray(v) for k, v in stack_micro_batches([collate(records(8, seed=s))]).items()}
                for s in range(STEPS)]

    def train(t, state, host_batches, mesh=None):
        losses = []
        for hb in host_batches:
            if mesh is None:
                b = {k: jnp.asarray(v) for k, v in hb.items()}
            else:
                b = jax.device_put(hb, NamedSharding(mesh, P(None, BATCH_AXES)))
            state, m = t.train_step(state, b)
            losses.append(float(m["loss_sum"]))
        return state, losses

    padded = batches(Collate(8, 64))
    t = fresh()
    reference, ref_losses = train(t, t.init_state, padded)
    ref_params = jax.tree.leaves(reference.params)

    for shape in [(8, 1, 1), (2, 4, 1), (1, 4, 2), (1, 1, 8)]:
        mesh = make_mesh(shape)
        t = fresh()
        state = t.use_mesh(mesh)
        state, losses = train(t, state, padded, mesh)
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
        for a, b in zip(ref_params, jax.tree.leaves(state.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
        # The arrays are sharded as the rules say, after the steps too (params and AdamW moments).
        expected = dict((name, spec) for name, _, spec in describe(state, mesh))
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        from rmflow.trainer.parallel import param_name
        for path, x in leaves:
            spec = expected[param_name(path)]
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (shape, param_name(path), x.sharding)
            parts = [mesh.shape[a] if a else 1 for a in tuple(spec) + (None,) * (x.ndim - len(spec))]
            assert x.addressable_shards[0].data.shape == tuple(d // n for d, n in zip(x.shape, parts))
        q = state.params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
        mu = state.opt_state[0].mu["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
        want = {(8, 1, 1): (32, 32), (2, 4, 1): (8, 32), (1, 4, 2): (8, 16), (1, 1, 8): (32, 4)}[shape]
        assert q.addressable_shards[0].data.shape == want and mu.addressable_shards[0].data.shape == want
        print("mesh", shape, "ok")

    # Packed rows, one per batch shard, on (1, 4, 2): equal to the same packed batch on one device.
    mesh = make_mesh((1, 4, 2))
    packed = batches(PackCollate(8, 64, rows=batch_shards(mesh)))
    t = fresh()
    one, one_losses = train(t, t.init_state, packed)
    t = fresh()
    state, losses = train(t, t.use_mesh(mesh), packed, mesh)
    np.testing.assert_allclose(losses, one_losses, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)

    # A checkpoint saved sharded on (1, 4, 2) restores onto (2, 1, 4), bit for bit.
    with tempfile.TemporaryDirectory() as d:
        mgr = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
                                    item_names=("state",))
        mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(jax.tree.leaves(state))))
        mgr.wait_until_finished()
        other = make_mesh((2, 1, 4))
        targets = jax.tree.leaves(shardings(t.init_state, other))
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(jax.tree.leaves(state), targets)]
        restored = mgr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        for a, b, s in zip(jax.tree.leaves(state), restored, targets):
            assert b.sharding.is_equivalent_to(s, b.ndim)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("OK")
''')


def run_8_devices(script: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=repo, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_meshes_match_one_device_and_shard_as_the_rules_say():
    out = run_8_devices(SCRIPT)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), (out.stdout[-2000:], out.stderr[-4000:])


EXPERTS_SCRIPT = textwrap.dedent('''
    import dataclasses
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tests.training.test_step import CFG, records
    from rmflow.trainer.data import Collate
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.parallel import describe, make_mesh
    from rmflow.trainer.parallel.mesh import BATCH_AXES
    from rmflow.trainer.batching import stack_micro_batches
    from rmflow.schemas.train_config import OptimizerConfig
    from rmflow.trainer.step import Trainer

    assert len(jax.devices()) == 8
    MOE = dataclasses.replace(CFG, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, sparse_layers=(0, 1), router_aux_loss_coef=0.01)

    def fresh():
        return Trainer(RewardTransformer(MOE, rngs=nnx.Rngs(0)), OptimizerConfig(learning_rate=1e-3), total_steps=5,
                       router_coef=0.5)

    host = [{k: np.asarray(v) for k, v in stack_micro_batches([Collate(8, 64)(records(8, seed=s))]).items()}
            for s in range(2)]

    def train(mesh):
        t = fresh()
        state = t.init_state if mesh is None else t.use_mesh(mesh)
        out = []
        for hb in host:
            b = {k: jnp.asarray(v) for k, v in hb.items()} if mesh is None else \
                jax.device_put(hb, NamedSharding(mesh, P(None, BATCH_AXES)))
            state, m = t.train_step(state, b)
            out.append((float(m["loss_sum"]), float(m["router_aux_sum"])))
        return state, out

    ref_state, ref = train(None)
    for shape in [(1, 1, 2, 4), (2, 1, 1, 4), (1, 2, 2, 2)]:
        mesh = make_mesh(shape)
        state, got = train(mesh)
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
        for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(state.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
        specs = {name: spec for name, _, spec in describe(state.params, mesh)}
        up = [n for n in specs if n.endswith("mlp.experts.up_proj")][0]
        assert specs[up][0] == "expert", specs[up]
        w = state.params["model"]["layers"][0]["mlp"]["experts"]["up_proj"][...]
        assert w.addressable_shards[0].data.shape[0] == 4 // mesh.shape["expert"]
        print("mesh", shape, "ok")
    print("OK")
''')


@pytest.mark.slow
def test_experts_shard_over_the_expert_axis_with_the_loss_and_gradients_of_one_device():
    """A mixture of experts on 8 fake devices, its experts split over the expert axis (with data,
    fsdp and tensor too): the reward loss, the router's loss and the parameters after two steps
    equal one device's (1e-5), each device holding its share of the experts."""
    out = run_8_devices(EXPERTS_SCRIPT)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), (out.stdout[-2000:], out.stderr[-4000:])


def test_mesh_shape_resolution():
    assert mesh_shape((-1, 1, 1), 8) == (8, 1, 1)
    assert mesh_shape((1, -1, 2), 8) == (1, 4, 2)
    assert mesh_shape((2, 4, 1), 8) == (2, 4, 1)
    for bad, match in [((3, -1, 1), "not a multiple"), ((2, 2, 1), "holds 4 devices"), ((-1, -1, 1), "at most one"),
                       ((0, 1, 1), "positive"), ((8, 1), "one size per axis")]:
        with pytest.raises(MeshError, match=match):
            mesh_shape(bad, 8)


RESUME_SCRIPT = textwrap.dedent('''
    import json, shutil, sys, pathlib
    import jax, numpy as np
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.checkpoints import load_trained_model
    from rmflow.trainer.train import run as train

    base, shards = pathlib.Path(sys.argv[1]), sys.argv[2]  # shards: the demo at max_length 128 (read only)
    # adam_eps 1e-6: AdamW divides by sqrt(v), so embedding rows with gradients near 1e-9 turn the
    # summation-order noise of another mesh into updates near lr (one element in 12.6M off by 1.3e-5
    # at eps 1e-8); the larger eps bounds that without changing what is compared.
    common = dict(data={"train": shards, "packing": "none"}, model="micro", max_steps=4, batch_size=8,
                  checkpoint={"save_steps": 2, "keep_newest": 2}, optimizer={"learning_rate": 1e-3, "adam_eps": 1e-6},
                  logging={"steps": 1})
    # The whole run on (1, 4, 2): parameters sharded over fsdp and tensor.
    train(TrainConfig(output=str(base / "a"), mesh={"data": 1, "fsdp": 4, "tensor": 2}, **common))
    # Interrupted after its step-2 checkpoint, resumed on another mesh shape, (2, 1, 2) with each
    # row's tokens split over a context axis of 2.
    shutil.copytree(base / "a", base / "b")
    shutil.rmtree(base / "b" / "checkpoints" / "4")
    train(TrainConfig(output=str(base / "b"), mesh={"data": 2, "fsdp": 1, "tensor": 2, "context": 2}, **common),
          resume=True)
    (ma, _, _), (mb, _, _) = load_trained_model(str(base / "a")), load_trained_model(str(base / "b"))
    from flax import nnx
    for x, y in zip(jax.tree.leaves(nnx.state(ma)), jax.tree.leaves(nnx.state(mb))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0)
    la = [json.loads(l)["loss"] for l in open(base / "a" / "metrics.jsonl")]
    lb = [json.loads(l)["loss"] for l in open(base / "b" / "metrics.jsonl")]
    np.testing.assert_allclose(la, lb, atol=1e-5)
    print("OK")
''')


@pytest.mark.slow
def test_train_on_a_sharded_mesh_and_resume_on_another(tmp_path, demo_shards):
    """`trainer.train.run` end to end: a run on (1, 4, 2), interrupted after a checkpoint, resumed
    on (2, 1, 2) x context 2, ends with the uninterrupted run's parameters and losses."""
    out = run_8_devices(RESUME_SCRIPT.replace("sys.argv[1]", repr(str(tmp_path))).replace("sys.argv[2]", repr(str(demo_shards))))
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), (out.stdout[-2000:], out.stderr[-4000:])


ENSEMBLE_SCRIPT = textwrap.dedent('''
    import dataclasses
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tests.training.test_step import CFG, records
    from rmflow.trainer.data import Collate
    from rmflow.trainer.memory_plan import shard_bytes
    from rmflow.trainer.modeling import lora
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.objective import OUTCOME
    from rmflow.trainer.parallel import make_mesh
    from rmflow.trainer.parallel.mesh import BATCH_AXES
    from rmflow.trainer.batching import stack_micro_batches
    from rmflow.schemas.train_config import EnsembleConfig, LoraConfig, OptimizerConfig
    from rmflow.trainer.step import Trainer

    assert len(jax.devices()) == 8
    ENS = dataclasses.replace(CFG, num_labels=3, members=3, member_layers=1)
    objective = OUTCOME.for_data(None, "", EnsembleConfig(members=3, layers=1))
    host = [{k: np.asarray(v) for k, v in stack_micro_batches([Collate(8, 64)(records(8, seed=s))]).items()}
            for s in range(2)]

    def fresh(lora_cfg):
        model = RewardTransformer(ENS, rngs=nnx.Rngs(0))
        if lora_cfg is not None:
            lora.apply(model, lora_cfg)
        return Trainer(model, OptimizerConfig(learning_rate=1e-3), total_steps=5, center_coef=0.01,
                       objective=objective, trainable=lora.trainable_filter(lora_cfg))

    def train(mesh, lora_cfg):
        t = fresh(lora_cfg)
        state = t.init_state if mesh is None else t.use_mesh(mesh)
        out = []
        for hb in host:
            b = {k: jnp.asarray(v) for k, v in hb.items()} if mesh is None else \\
                jax.device_put(hb, NamedSharding(mesh, P(None, BATCH_AXES)))
            state, m = t.train_step(state, b)
            out.append(float(m["loss_sum"]))
        return t, state, out

    for lora_cfg in (None, LoraConfig(rank=4, base_dtype="nf4")):
        _, ref_state, ref = train(None, lora_cfg)
        for shape in [(2, 2, 2), (1, 4, 2)]:
            t, state, got = train(make_mesh(shape), lora_cfg)
            np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
            for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(state.params)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
            q = state.params["members"][2]["layers"][0]["self_attn"]["q_proj"]
            q = q["lora_A" if lora_cfg else "kernel"][...]
            if lora_cfg is None:  # a member's own layers shard by the same rules as the shared ones
                assert q.addressable_shards[0].data.shape == (32 // shape[1], 32 // shape[2]), q.sharding
            else:  # the members' frozen copies stay one array each on the mesh: member 0's bytes only
                once = shard_bytes(list(lora.held_once(t.frozen).values()))
                assert shard_bytes(t.frozen) == once < sum(
                    x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(t.frozen))
            print("mesh", shape, "lora" if lora_cfg else "full", "ok")
    print("OK")
''')


@pytest.mark.slow
def test_an_ensemble_with_its_own_layers_trains_on_a_mesh_as_on_one_device():
    """Members with their own top layers (``ensemble.layers``), fully trained and as LoRA
    members over one frozen base, on (data, fsdp, tensor) meshes: the loss and parameters of one
    device, the members' layers sharded by the rules, the frozen copies one array each."""
    out = run_8_devices(ENSEMBLE_SCRIPT)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), (out.stdout[-2000:], out.stderr[-4000:])
