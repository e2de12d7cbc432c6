"""Data parallelism on 8 (fake CPU) devices: the sharded step equals the single-device step,
and each device holds whole pairs (a chosen row and its rejected row together, or packed
rows of whole pairs)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tests.training.test_step import CFG, records
    from rmflow.trainer.data import Collate, PackCollate
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.batching import stack_micro_batches
    from rmflow.schemas.train_config import OptimizerConfig
    from rmflow.trainer.step import Trainer

    assert len(jax.devices()) == 8
    def fresh():
        return Trainer(RewardTransformer(CFG, rngs=nnx.Rngs(0)), OptimizerConfig(learning_rate=1e-3), total_steps=5,
                       center_coef=0.01)
    host = {k: np.asarray(v) for k, v in stack_micro_batches([Collate(8, 64)(records(7))]).items()}
    t = fresh()
    single, m1 = t.train_step(t.init_state, {k: jnp.asarray(v) for k, v in host.items()})
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch = jax.device_put(host, NamedSharding(mesh, P(None, "data")))
    ids = batch["input_ids"]
    for shard in ids.addressable_shards:  # 16 rows over 8 devices: rows 2i and 2i+1 together
        assert shard.data.shape[1] == 2 and shard.index[1].start % 2 == 0
    t = fresh()
    sharded, m8 = t.train_step(jax.device_put(t.init_state, NamedSharding(mesh, P())), batch)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert abs(float(m1["loss_sum"]) - float(m8["loss_sum"])) < 1e-4

    # Packed: one row per device, each holding whole pairs; equal to the padded single-device step.
    packed = {k: np.asarray(v) for k, v in stack_micro_batches([PackCollate(8, 64, rows=8)(records(7))]).items()}
    batch = jax.device_put(packed, NamedSharding(mesh, P(None, "data")))
    for shard in batch["reward_index"].addressable_shards:  # a row's reward tokens live on its device
        assert shard.data.shape[1] == 1
    t = fresh()
    sharded, m8 = t.train_step(jax.device_put(t.init_state, NamedSharding(mesh, P())), batch)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert abs(float(m1["loss_sum"]) - float(m8["loss_sum"])) < 1e-4 and float(m8["pairs"]) == 7
    print("OK")
''')


def test_eight_devices_match_one():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=repo, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
