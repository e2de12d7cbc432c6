"""Padding-free packing and memory-efficient attention: the packed batch is the padded batch.

* blockwise (flash) attention equals the dense reference, outputs and gradients, on packed
  rows with shared prompts, sliding windows and grouped-query heads;
* PackCollate's layout: the prompt once, positions continuing into each reply, reward
  indices at the right tokens, whole pairs per row, exact counts;
* for every supported architecture, rewards, loss and gradients of a packed batch equal
  those of the padded batch within 1e-5 (float32);
* the loader in every packing mode is deterministic, resumes exactly, and serves every pair
  once per epoch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rmflow.schemas.record import PairRecord, encode
from rmflow.trainer.data import (
    Collate,
    LoaderSpec,
    PackCollate,
    fine_length,
    lengths_per_doubling,
    make_loader,
)
from rmflow.trainer.data.collate import ACCELERATOR_COMPILE_COST
from rmflow.trainer.data.loader import collate_fn
from rmflow.trainer.data.packing import assign_rows, pack_unit
from rmflow.trainer.loss import pairwise_loss
from rmflow.trainer.modeling.attention import attention
from rmflow.trainer.modeling.convert import load_reward_model
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.objective import OUTCOME, pair_rewards
from rmflow.trainer.optimizer import clip_scale

from tests.layouts import packed_layout
from tests.training.test_model_parity import ARCHS, build_hf

VOCAB = 97


def assert_attention_equals_reference(impl, window, t, block, branches=2, scale=None, softcap=None):
    rng = np.random.default_rng(t)
    b, n, k, d = 2, 4, 2, 16
    seg, pos, br = packed_layout(rng, b, t, branches=branches)
    q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32)
    kv = [jnp.asarray(rng.normal(size=(b, t, k, d)), jnp.float32) for _ in range(2)]
    weights = jnp.asarray(rng.normal(size=(d,)), jnp.float32)

    def run(impl, block):
        def f(q, k, v):
            o = attention(q, k, v, seg, pos, br, implementation=impl, window=window, block=block, scale=scale,
                          softcap=softcap)
            o = jnp.where(seg[:, :, None, None] > 0, o, 0.0)  # padding queries are never read
            return (o * weights).sum(), o
        # jitted: one compilation, not one per operation (the blockwise loops' bodies included)
        (_, o), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, *kv)
        return o, g

    with jax.default_matmul_precision("highest"):  # float32 products on every backend (GPUs default to TF32)
        (o_ref, g_ref), (o, g) = run("xla", None), run(impl, block)
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(g, g_ref):  # gradients reach ~30 here: float32 rounding needs the relative term
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize("t,block", [(300, 64), (256, 128), (40, 128)])
def test_blockwise_attention_equals_reference(window, t, block):
    assert_attention_equals_reference("blockwise", window, t, block)


@pytest.mark.parametrize("window,t", [(None, 100), (17, 150)])
def test_pallas_attention_equals_reference_in_interpret_mode(window, t):
    """The Pallas kernels (forward, dq, dk/dv) run here in interpret mode: the same kernel code
    the GPU compiles through Triton, executed with JAX operations."""
    assert_attention_equals_reference("pallas", window, t, 32)  # several blocks, a partial last one


@pytest.mark.parametrize("impl,t,block", [("blockwise", 300, 64), ("pallas", 150, 32)])
def test_soft_capped_logits_at_another_scale_equal_the_reference(impl, t, block):
    """Gemma 2's logits: scaled by query_pre_attn_scalar^-0.5 and soft-capped (a cap of 1.5 on
    scores of unit normals bites), outputs and every gradient through the cap, window on."""
    assert_attention_equals_reference(impl, 17, t, block, scale=0.6, softcap=1.5)


def test_cudnn_is_never_chosen_for_soft_capped_logits_and_refused_when_asked():
    from rmflow.trainer.modeling.attention import resolve_attention

    assert resolve_attention("auto", jnp.bfloat16, "gpu", softcap=True) == "pallas"
    assert resolve_attention("auto", jnp.bfloat16, "gpu", packed=True, devices=8, softcap=True) == "blockwise"
    with pytest.raises(ValueError, match="cudnn cannot soft-cap"):
        resolve_attention("cudnn", jnp.bfloat16, "gpu", softcap=True)


@pytest.mark.parametrize("block,warps,stages", [(64, 4, 3), (128, 8, 2)])
def test_pallas_kernels_lower_to_triton_for_nvidia_gpus(block, warps, stages):
    """The kernels as the GPU compiles them, lowered here without one (JAX lowers for the cuda
    platform on any host): forward, dq and dk/dv become Triton kernels with the launch settings
    asked for, on a row that is no power of two long (Triton takes only power-of-two tensors; the
    kernels load whole blocks). What this cannot catch, Triton's own compilation to the device,
    the GPU check measures (benchmarks/gpu.py)."""
    from jax import export
    from rmflow.trainer.modeling.pallas_attention import pallas_attention

    rng = np.random.default_rng(0)
    seg, pos, br = packed_layout(rng, 1, 1280, (16, 300))
    q = jnp.asarray(rng.normal(size=(1, 1280, 9, 64)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(size=(1, 1280, 3, 64)), jnp.bfloat16)

    def fwd_bwd(q, k, v):
        out, pull = jax.vjp(lambda q, k, v: pallas_attention(q, k, v, seg, pos, br, block=block, interpret=False,
                                                             num_warps=warps, num_stages=stages), q, k, v)
        return out, pull(out)

    lowered = export.export(jax.jit(fwd_bwd), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, kv, kv)
    text = lowered.mlir_module()
    for kernel in ("_forward_kernel", "_dq_kernel", "_dkdv_kernel"):
        assert f'name = "{kernel}", num_stages = {stages} : i32, num_warps = {warps} : i32' in text, kernel


def test_segment_bounds_and_the_blocks_the_kernels_visit():
    from rmflow.trainer.modeling.pallas_attention import segment_bounds

    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 3, 3, 0, 0]])
    first, last = segment_bounds(seg)
    assert first.tolist() == [[0, 0, 0, 3, 3, 5, 6, 6, 8, 9]]
    assert last.tolist() == [[2, 2, 2, 4, 4, 5, 7, 7, 8, 9]]


def rec(i, prompt, n_c, n_r, margin=None, rng=None):
    rng = rng or np.random.default_rng(i)
    p = rng.integers(3, VOCAB, prompt)
    c = np.r_[p, rng.integers(3, VOCAB, n_c)].astype(np.int32)
    r = np.r_[p, rng.integers(3, VOCAB, n_r)].astype(np.int32)
    return PairRecord(c, r, len(c) - 1, len(r) - 1, prompt, f"{i:032x}", "s", margin)


def test_pack_unit_shares_the_prompt_and_continues_positions():
    r = rec(0, 5, 3, 4)
    u = pack_unit(r)
    assert len(u.ids) == 5 + 3 + 4
    assert u.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8]
    assert u.branches.tolist() == [0] * 5 + [1] * 3 + [2] * 4
    assert u.ids[u.chosen_at] == r.chosen_ids[-1] and u.positions[u.chosen_at] == len(r.chosen_ids) - 1
    assert u.ids[u.rejected_at] == r.rejected_ids[-1] and u.positions[u.rejected_at] == len(r.rejected_ids) - 1
    # the rejected reply's own tokens, read by (branch 0 or 2), are the rejected sequence
    assert u.ids[(u.branches != 1)].tolist() == r.rejected_ids.tolist()
    # a record whose sequences do not share prompt_len tokens is packed whole, nothing shared
    odd = PairRecord(r.chosen_ids, np.r_[[1], r.rejected_ids[1:]].astype(np.int32), r.chosen_last,
                     r.rejected_last, 5, "0" * 32)
    v = pack_unit(odd)
    assert len(v.ids) == len(r.chosen_ids) + len(r.rejected_ids) and (v.branches > 0).all()
    assert v.positions[v.rejected_at] == len(r.rejected_ids) - 1


def test_pack_collate_rows_slots_and_counts():
    recs = [rec(i, 6 + i, 10 + 3 * i, 5 + i, margin=0.5 * i) for i in range(5)]
    b = PackCollate(batch_size=6, max_length=64, pad_id=2, rows=2)(recs)
    assert b["input_ids"].shape[0] == 2 and b["input_ids"].shape[1] == fine_length(b["input_ids"].shape[1])
    assert b["reward_index"].shape == (2, 12) and b["weight"].shape == (12,)
    assert b["weight"].sum() == 5
    assert b["real_tokens"] == sum(len(r.chosen_ids) + len(r.rejected_ids) for r in recs)
    assert b["computed_tokens"] == b["real_tokens"] - sum(r.prompt_len for r in recs)
    assert (b["segment_ids"] > 0).sum() == b["computed_tokens"]
    for i, r in enumerate(recs):  # each record's slot points at its own reward tokens and margin
        slot = b["pair_slot"][i]
        row, j = divmod(int(slot), 6)
        c_at, r_at = b["reward_index"][row, 2 * j : 2 * j + 2]
        assert b["input_ids"][row, c_at] == r.chosen_ids[-1] and b["positions"][row, c_at] == r.chosen_last
        assert b["input_ids"][row, r_at] == r.rejected_ids[-1] and b["positions"][row, r_at] == r.rejected_last
        assert b["weight"][slot] == 1 and b["margin"][slot] == pytest.approx(0.5 * i)
        assert b["segment_ids"][row, c_at] == b["segment_ids"][row, r_at] == j + 1  # one unit, one row
    assert (b["input_ids"][b["segment_ids"] == 0] == 2).all()


def test_rows_are_balanced_and_deterministic():
    lengths = [50, 10, 40, 30, 20, 20]
    rows = assign_rows(lengths, 2)
    assert rows == assign_rows(lengths, 2)
    assert sorted(sum(rows, [])) == list(range(6))
    loads = [sum(lengths[i] for i in r) for r in rows]
    assert max(loads) - min(loads) <= 10


def test_fine_lengths_waste_at_most_an_eighth_from_a_small_set():
    sizes = {fine_length(n) for n in range(1, 8193)}
    assert len(sizes) <= 8 * 9 + 1  # 8 per doubling from 16 to 8192
    for n in range(17, 8193):
        assert n <= fine_length(n) <= n * 9 / 8
    assert [fine_length(n) for n in (1, 16, 17, 100, 129, 257, 2049)] == [16, 16, 18, 104, 144, 288, 2304]


@pytest.mark.parametrize("per_doubling", [1, 2, 4, 8])
def test_coarser_lengths_are_a_subset_wasting_at_most_one_over_their_count(per_doubling):
    sizes = {fine_length(n, per_doubling) for n in range(1, 8193)}
    assert len(sizes) <= per_doubling * 9 + 1
    assert sizes <= {fine_length(n) for n in range(1, 8193)}  # every coarse length is a fine one
    for n in range(17, 8193):
        assert n <= fine_length(n, per_doubling) <= n * (1 + 1 / per_doubling)
    if per_doubling == 1:  # the next power of two
        assert [fine_length(n, 1) for n in (17, 100, 129, 2049, 4096)] == [32, 128, 256, 4096, 4096]


def test_rows_are_rounded_as_finely_as_the_batches_repay():
    """The rounding grows as the square root of the batches run: a short run compiles few
    shapes (the demo's 40 steps), a long one pads little."""
    got = [lengths_per_doubling(n) for n in (0, 1, 40, 63, 64, 255, 256, 1023, 1024, 10**6)]
    assert got == [1, 1, 1, 1, 2, 2, 4, 4, 8, 8]
    # on an accelerator a compilation costs many more steps: a one-epoch run of 320 steps (the real
    # SmolLM2 on an H200) compiles powers of two only, and each threshold moves up as much
    scale = ACCELERATOR_COMPILE_COST
    for backend in ("gpu", "tpu"):
        got = [lengths_per_doubling(n, backend) for n in (320, 64 * scale - 1, 64 * scale, 256 * scale, 1024 * scale)]
        assert got == [1, 1, 2, 4, 8]
    for mode in ("pack", "bucket"):  # the loader's collation takes it
        c = collate_fn(mode, batch_size=4, max_length=4096, pad_id=0, rows=1, per_doubling=2)
        assert c.per_doubling == 2
    recs = [rec(i, 40, 50 + 3 * i, 40 + 2 * i) for i in range(8)]  # 1,180 tokens packed
    lengths = {g: PackCollate(8, 256, per_doubling=g)(recs)["input_ids"].shape[1] for g in (1, 2, 8)}
    assert lengths == {1: 2048, 2: 1536, 8: 1280}


def batches_for(recs, batch_size=4):
    padded = [Collate(batch_size, 64)(recs[i : i + batch_size]) for i in range(0, len(recs), batch_size)]
    packed = [PackCollate(batch_size, 64)(recs[i : i + batch_size]) for i in range(0, len(recs), batch_size)]
    return padded, packed


@nnx.jit
def _objective_and_grads(model, batch):
    def f(m):
        rc, rr = pair_rewards(m, batch)
        loss, _ = pairwise_loss(rc, rr, batch["margin"], batch["weight"], 0.01)
        return loss, (rc, rr)

    (loss, (rc, rr)), g = nnx.value_and_grad(f, has_aux=True)(model)
    # The rewards run the last layer at the reward tokens only: its hidden states there, and the
    # whole last layer's read at those tokens.
    args = [batch[k] for k in ("input_ids", "positions", "segment_ids")]
    index, branches = batch["reward_index"], batch["branch_ids"]
    full = jnp.take_along_axis(model.model(*args, branches), index[..., None], axis=1)
    return loss, rc, rr, g, (model.model.hidden_at(*args, index, branches), full)


def objective_and_grads(model, batch):
    """Loss, the real pairs' rewards, the gradients of ``model`` on ``batch``, and the last
    layer's hidden states at the reward tokens computed both ways: jitted, one compilation per
    shape (run op by op, a model compiles each of its hundreds of operations per shape)."""
    loss, rc, rr, g, hidden = _objective_and_grads(
        model, {k: jnp.asarray(batch[k]) for k in (*OUTCOME.device_keys, "margin", "weight")})
    slot = batch["pair_slot"]
    return float(loss), np.asarray(rc)[slot], np.asarray(rr)[slot], g, hidden


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_batch_equals_padded_batch(arch, tmp_path):
    build_hf(arch, "ForSequenceClassification", tmp_path)
    rng = np.random.default_rng(1)
    # prompts long enough to cross Mistral's sliding window (8) from the replies
    recs = [rec(i, int(rng.integers(4, 14)), int(rng.integers(2, 12)), int(rng.integers(2, 12)),
                margin=0.1 * i, rng=rng) for i in range(6)]
    reference = load_reward_model(str(tmp_path), attention="xla")
    blockwise = load_reward_model(str(tmp_path), attention="blockwise")
    for padded, packed in zip(*batches_for(recs)):
        loss_a, rc_a, rr_a, g_a, _ = objective_and_grads(reference, padded)
        for model in (reference, blockwise):
            loss_b, rc_b, rr_b, g_b, (at, full) = objective_and_grads(model, packed)
            assert loss_b == pytest.approx(loss_a, abs=1e-5)
            np.testing.assert_allclose(rc_b, rc_a, atol=1e-5, rtol=0)
            np.testing.assert_allclose(rr_b, rr_a, atol=1e-5, rtol=0)
            for a, b in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
            # The rewards run the last layer at the reward tokens only: the same hidden states as
            # the whole last layer read at those tokens.
            np.testing.assert_allclose(np.asarray(at), np.asarray(full), atol=1e-5, rtol=0)


def test_clip_scale_equals_optax_clipping():
    rng = np.random.default_rng(0)
    summed = {"a": jnp.asarray(rng.normal(size=(7, 3)) * 40), "b": jnp.asarray(rng.normal(size=(5,)))}
    pairs = jnp.float32(6)
    for max_norm in (0.0, 1.0, 1e6):
        mean = jax.tree.map(lambda g: g / pairs, summed)
        expected = optax.clip_by_global_norm(max_norm).update(mean, None)[0] if max_norm else mean
        factor, norm = clip_scale(optax.global_norm(summed), pairs, max_norm)
        assert float(norm) == pytest.approx(float(optax.global_norm(mean)), rel=1e-6)
        clipped = [g * factor for g in jax.tree.leaves(summed)]
        for a, b in zip(jax.tree.leaves(expected), clipped):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


@pytest.fixture()
def shards(tmp_path):
    from rmflow.pipelines.io import write_array_record_shard

    rng = np.random.default_rng(3)
    paths = []
    for s in range(2):
        p = str(tmp_path / f"train-{s:05d}-of-00002.array_record")
        recs = [rec(20 * s + k, int(rng.integers(2, 20)), int(rng.integers(1, 30)), int(rng.integers(1, 30)),
                    rng=rng) for k in range(20)]
        write_array_record_shard(p, [encode(r) for r in recs])
        paths.append(p)
    return paths


@pytest.mark.parametrize("packing", ["none", "bucket", "pack"])
def test_loader_modes_serve_every_pair_once_and_resume_exactly(shards, packing):
    def batches(state=None, n=None):
        it = iter(make_loader(shards, LoaderSpec(batch_size=4, max_length=64, seed=2, num_epochs=2, shard_by_process=False,
                              packing=packing)))
        if state is not None:
            it.set_state(state)
        out = []
        for b in it:
            out.append(b)
            if n is not None and len(out) == n:
                return out, it.get_state()
        return out, None

    def ids(bs):
        return [np.concatenate([b["input_ids"].ravel(), b["positions"].ravel()]) for b in bs]

    full, _ = batches()
    assert len(full) == 20  # 40 pairs x 2 epochs / 4
    assert sum(float(b["weight"].sum()) for b in full) == 80
    assert sum(int(b["real_tokens"]) for b in full) == 2 * sum(
        len(r.chosen_ids) + len(r.rejected_ids) for r in _all(shards))
    again, _ = batches()
    assert all(np.array_equal(a, b) for a, b in zip(ids(full), ids(again)))
    first, state = batches(n=7)
    rest, _ = batches(state)
    assert all(np.array_equal(a, b) for a, b in zip(ids(first + rest), ids(full)))


def test_an_endless_loader_takes_batches_of_one(shards):
    """Training reads endlessly (its steps decide when to stop): in batches of one record too
    (Grain's endless repeat overflows len() in batches of one), every pair served once per pass."""
    it = iter(make_loader(shards, LoaderSpec(batch_size=1, max_length=64, seed=2, num_epochs=None, shard_by_process=False,
                          packing="pack")))
    served = [next(it) for _ in range(80)]
    firsts = [b["input_ids"][0, :8].tobytes() for b in served]
    assert len(set(firsts[:40])) == 40 and sorted(firsts[:40]) == sorted(firsts[40:])
    mixed = iter(make_loader([shards[:1], shards[1:]], LoaderSpec(batch_size=1, max_length=64, seed=2, num_epochs=None,
                             shuffle=True, shard_by_process=False, packing="pack", weights=[1.0, 1.0])))
    assert all(next(mixed)["input_ids"].shape[0] == 1 for _ in range(5))  # a mixture too


def _all(shards):
    import grain
    from rmflow.schemas.record import decode

    source = grain.sources.ArrayRecordDataSource(shards)
    return [decode(source[i]) for i in range(len(source))]


def test_bucket_and_pack_pad_less_than_none(shards):
    def padding(packing):
        bs = list(make_loader(shards, LoaderSpec(batch_size=4, max_length=64, seed=0, num_epochs=1, shard_by_process=False,
                              packing=packing)))
        return 1 - sum(int(b["computed_tokens"]) for b in bs) / sum(b["input_ids"].size for b in bs)

    none, bucket, pack = padding("none"), padding("bucket"), padding("pack")
    assert bucket < none and pack < none


def test_a_seen_shape_never_recompiles():
    from rmflow.trainer.batching import stack_micro_batches

    from tests.training.test_step import records, trainer

    compiles = []

    def listen(event, duration, **kw):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        _steps_compile_once_per_shape(compiles, trainer, records, stack_micro_batches)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _steps_compile_once_per_shape(compiles, trainer, records, stack_micro_batches):
    t = trainer()
    state = t.init_state
    recs = records(16)
    batches = [stack_micro_batches([PackCollate(4, 64)(recs[i : i + 4])]) for i in range(0, 16, 4)]
    seen = set()
    for batch in batches + batches:  # the second pass sees only known shapes
        before = len(compiles)
        state, _ = t.train_step(state, batch)
        shape = batch["input_ids"].shape
        assert (len(compiles) > before) == (shape not in seen), f"shape {shape}"
        seen.add(shape)


def test_auto_packing_and_attention_resolve_by_backend():
    from rmflow.schemas.config import ConfigError
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer.data import resolve_packing
    from rmflow.trainer.modeling.attention import resolve_attention

    assert [resolve_packing("auto", b) for b in ("cpu", "gpu", "tpu")] == ["fixed", "fixed", "bucket"]
    assert [resolve_packing("auto", b, 8) for b in ("cpu", "gpu", "tpu")] == ["fixed", "bucket", "bucket"]
    assert resolve_packing("auto", "cpu", 1, processes=2) == "pack"  # eval batches the same count on each
    assert resolve_packing("none", "gpu") == "none"
    assert resolve_attention("auto", jnp.float32, "cpu") == "blockwise"
    assert resolve_attention("auto", jnp.float32, "cpu", packed=True) == "blockwise"
    # one GPU: packed rows take the Pallas kernels; one 16-bit sequence a row cuDNN
    assert resolve_attention("auto", jnp.bfloat16, "gpu", packed=True) == "pallas"
    assert resolve_attention("auto", jnp.float32, "gpu", packed=True) == "pallas"
    assert resolve_attention("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert resolve_attention("auto", jnp.float32, "gpu") == "blockwise"  # cuDNN takes 16-bit types only
    # several GPUs: no Pallas (no partitioning rule); cuDNN takes 16-bit types only
    assert resolve_attention("auto", jnp.bfloat16, "gpu", packed=True, devices=8) == "cudnn"
    assert resolve_attention("auto", jnp.float32, "gpu", devices=8) == "blockwise"
    assert resolve_attention("auto", jnp.bfloat16, "tpu", packed=True) == "blockwise"
    assert resolve_attention("cudnn", jnp.bfloat16, "gpu", packed=True) == "cudnn"  # asked for: kept
    with pytest.raises(ConfigError, match="packing 'tight'"):
        TrainConfig(data={"train": "d", "packing": "tight"}, model="m", output="o")
    with pytest.raises(ConfigError, match="attention 'flash'"):
        TrainConfig(data="d", model={"path": "m", "attention": "flash"}, output="o")


@pytest.mark.parametrize("devices,dtype,packing,attention", [
    (1, "bfloat16", "fixed", "pallas"), (1, "float32", "fixed", "pallas"),
    (8, "bfloat16", "bucket", "cudnn"), (8, "float32", "bucket", "blockwise")])
def test_a_run_on_gpus_packs_and_builds_its_model_with_the_attention_for_its_rows(monkeypatch, devices, dtype, packing,
                                                                                  attention):
    """The run's packing and the model's attention are decided together (``auto``): on one GPU a
    run packs and its model takes the Pallas kernels; over several, whose mesh the kernels cannot
    be partitioned over yet, it buckets with cuDNN (16-bit) or the blockwise kernel."""
    from rmflow.schemas.train_config import TrainConfig
    from rmflow.trainer import model_setup as setup
    from rmflow.trainer.data import resolve_packing
    from rmflow.trainer.modeling.config import ModelConfig

    monkeypatch.setattr(setup.jax, "default_backend", lambda: "gpu")
    cfg = TrainConfig(data="d", model={"path": "micro", "dtype": dtype}, output="o")
    resolved = resolve_packing(cfg.data.packing, "gpu", devices)
    model = setup.base_model(cfg, ModelConfig.preset("micro", vocab_size=64, num_labels=1), packing=resolved,
                             devices=devices)
    assert (resolved, model.model.attention) == (packing, attention)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU (CI has none); "
                    "measured on an H100 with benchmarks/device.py, see docs/benchmarks.md")
def test_cudnn_attention_equals_reference_on_gpu():
    rng = np.random.default_rng(0)
    b, t, n, k, d = 2, 1024, 8, 2, 64
    seg, pos, br = packed_layout(rng, b, t, (16, 200))
    real = seg[:, :, None, None] > 0
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16) for h in (n, k, k))

    def run(impl):
        def f(q, k, v):
            o = attention(q, k, v, seg, pos, br, implementation=impl)
            return jnp.where(real, o, 0).astype(jnp.float32).sum(), o
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, kk, v)

    (_, o), g = run("cudnn")
    (_, o_ref), g_ref = run("xla")
    np.testing.assert_allclose(np.where(real, o, 0).astype(np.float32), np.where(real, o_ref, 0).astype(np.float32),
                               atol=3e-2)
    for a, r in zip(g, g_ref):  # bfloat16: compare relative to the gradient's scale
        r = np.asarray(r, np.float32)
        assert np.abs(np.asarray(a, np.float32) - r).max() <= 2e-2 * np.abs(r).max()


def test_xla_flags_respect_the_user():
    from rmflow.trainer.backend import configure_xla

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    added = configure_xla(env)
    assert all(f.split("=")[0] in env["XLA_FLAGS"] for f in added)
    assert env["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=8")
    assert configure_xla(env) == []  # never twice, never over the user's own setting
    untouched = {"XLA_FLAGS": "--x", "RMFLOW_XLA_DEFAULTS": "1"}
    assert configure_xla(untouched) == [] and untouched["XLA_FLAGS"] == "--x"


def test_reading_ahead_keeps_the_order_and_the_checkpoint_state(shards):
    from rmflow.trainer.data.lookahead import Lookahead

    def loader():
        return iter(make_loader(shards, LoaderSpec(batch_size=4, max_length=64, seed=2, num_epochs=1, shard_by_process=False,
                                packing="pack")))

    plain, ahead = loader(), Lookahead(loader(), depth=3)
    for _ in range(4):
        assert len(ahead.ahead()) == 3
        a, b = next(plain), next(ahead)
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        assert ahead.get_state() == plain.get_state()  # as if nothing had been read ahead
    state = ahead.get_state()
    rest = [b["input_ids"] for b in plain]
    resumed = Lookahead(loader(), depth=3)
    resumed.set_state(state)
    again = [b["input_ids"] for b in resumed]
    assert len(again) == len(rest) > 0
    for a, b in zip(rest, again):
        np.testing.assert_array_equal(a, b)


def test_a_model_with_pallas_attention_scores_packed_rows_as_the_reference():
    from tests.training.test_step import CFG, records

    batch = {k: jnp.asarray(v) for k, v in PackCollate(4, 64)(records(4)).items() if k in OUTCOME.device_keys}
    rewards = []
    for impl in ("xla", "pallas"):
        model = RewardTransformer(CFG, rngs=nnx.Rngs(0), attention=impl)
        with jax.default_matmul_precision("highest"):
            rewards.append(np.asarray(jnp.stack(pair_rewards(model, batch))))
    np.testing.assert_allclose(rewards[1], rewards[0], atol=1e-5, rtol=0)
