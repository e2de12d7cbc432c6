"""LoRA on a quantised frozen base (``lora.base_dtype: int8 | nf4``): codes on the nearest level,
the bytes a weight, a checkpoint quantised tensor by tensor as it is read, no dequantised weight
kept for the backward pass, and a run that trains, resumes bit for bit, plans its memory and
exports merged weights transformers scores as rmflow does."""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rmflow.trainer.checkpoints import load_trained_model
from rmflow.trainer.errors import Interrupted
from rmflow.trainer.modeling import lora, quant
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.train import run as train

from tests.training.test_step import CFG
from tests.training.test_train import GOOD, config, synthetic  # noqa: F401 - the synthetic shards fixture


@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("shape,axis,block", [((256, 24), 0, 64), ((100, 30), 0, 64), ((7, 33), 1, 0),
                                              ((3, 130, 5), 1, 64), ((12, 40), 1, 16)])
def test_each_weight_takes_its_nearest_level(kind, shape, axis, block):
    """Every weight dequantises to the level nearest it, computed here independently (each
    element against every level), padding cut off; the codes and scales keep the weight's axes."""
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 0.02
    q = quant.quantize(w, kind, axis=axis, block=block)
    got = np.asarray(quant.dequantize(q))
    assert got.shape == w.shape and got.dtype == np.float32
    x = np.moveaxis(w, axis, -1)
    n = x.shape[-1]
    b = n if block == 0 else min(block, n)
    b += b % 2
    pad = -n % b
    blocks = np.concatenate([x, np.zeros((*x.shape[:-1], pad), np.float32)], -1).reshape(*x.shape[:-1], -1, b)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    levels = np.arange(-127, 128, dtype=np.float32) / 127 if kind == "int8" else quant.NF4
    nearest = levels[np.abs((blocks / absmax)[..., None] - levels).argmin(-1)]
    want = np.moveaxis((nearest * absmax).reshape(*x.shape[:-1], -1)[..., :n], -1, axis)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    codes, scales = quant.storage_shapes(kind, shape, axis, block)
    assert q.codes.shape == codes and q.block_scales.shape == scales
    blank = quant.placeholder(kind, shape, axis=axis, block=block)
    assert (blank.codes.shape, blank.codes.dtype) == (q.codes.shape, q.codes.dtype)


def test_a_tensor_is_quantised_a_chunk_at_a_time_alike(monkeypatch):
    """Chunks of a few weights (along the first axis not blocked) give the whole tensor's codes."""
    w = np.random.default_rng(1).standard_normal((3, 70, 20)).astype(np.float32)
    for kind in quant.KINDS:
        whole = quant.quantize(w, kind, axis=1, block=16)
        monkeypatch.setattr(quant, "CHUNK", 50)
        parts = quant.quantize(w, kind, axis=1, block=16)
        monkeypatch.undo()
        np.testing.assert_array_equal(parts.codes, whole.codes)
        np.testing.assert_array_equal(parts.block_scales, whole.block_scales)


def test_bytes_a_weight():
    """int8: 1 + 4/64 bytes a weight; nf4: 0.5 + 4/64 (QLoRA's without double quantisation)."""
    w = np.ones((4096, 1024), np.float32)
    for kind, per in (("int8", 1 + 4 / 64), ("nf4", 0.5 + 4 / 64)):
        assert quant.nbytes(quant.quantize(w, kind, axis=0, block=64)) == w.size * per


def _model(kind: str, targets="all-linear") -> RewardTransformer:
    model = RewardTransformer(CFG, rngs=nnx.Rngs(0))
    lora.apply(model, lora.LoraConfig(rank=4, target_modules=targets, base_dtype=kind))
    return model


def test_every_base_matrix_is_quantised_and_the_rest_kept():
    """Kernels and the embedding are held as codes; norms, adapters and the score head in float32;
    the forward pass is the float32 model's within the quantisation's error."""
    ids, pos, seg, at = jnp.array([[5, 6, 7, 8, 0]]), jnp.arange(5)[None], jnp.array([[1, 1, 1, 1, 0]]), jnp.array([[3]])
    ref = np.asarray(_model("float32").logits(ids, pos, seg, at))
    for kind, tol in (("int8", 0.02), ("nf4", 0.2)):
        model = _model(kind)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            name, v = ".".join(map(str, path)), var.get_value()
            held = isinstance(v, quant.Quantized)
            assert held == (not name.startswith("score") and "lora_" not in name and len(quant.shape(var)) >= 2), name
        got = np.asarray(model.logits(ids, pos, seg, at))
        assert np.abs(got - ref).max() < tol * max(np.abs(ref).max(), 1.0), (kind, got, ref)


def test_the_backward_pass_keeps_no_dequantised_weight():
    """A quantised kernel is dequantised again in the backward pass: no residual the shape of a
    base matrix in float32 (a full-precision copy of each layer's weights) is kept."""
    from jax._src.ad_checkpoint import saved_residuals

    model = _model("nf4")
    graphdef, params, rest = nnx.split(model, lora.trainable_filter(lora.LoraConfig()), ...)
    ids, pos, seg, at = jnp.array([[5, 6, 7, 8]]), jnp.arange(4)[None], jnp.ones((1, 4), jnp.int32), jnp.array([[3]])

    def loss(params):
        return nnx.merge(graphdef, params, rest).logits(ids, pos, seg, at).sum()

    kept = {tuple(aval.shape) for aval, _ in saved_residuals(loss, params) if aval.dtype == jnp.float32}
    matrices = {quant.shape(v) for _, v in nnx.to_flat_state(rest) if isinstance(v.get_value(), quant.Quantized)}
    assert matrices and not kept & matrices, kept & matrices
    # the same model with a float32 base does keep its kernels (the check can fail)
    dense = _model("float32")
    graphdef, params, rest = nnx.split(dense, lora.trainable_filter(lora.LoraConfig()), ...)
    kept = {tuple(aval.shape) for aval, _ in saved_residuals(loss, params) if aval.dtype == jnp.float32}
    assert kept & matrices


def test_a_checkpoint_is_quantised_as_it_is_read(tmp_path):
    """The loader maps the checkpoint's file and stores each tensor as it reads it: ``store`` sees
    one tensor at a time, float32, and the tensors it was given are views of the file, not copies."""
    import mmap

    import torch
    import transformers
    from rmflow.trainer.modeling.convert import load_reward_model, open_tensors

    hf = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_labels=1, pad_token_id=0)).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    tensors = open_tensors(str(tmp_path))
    assert all(isinstance(_root(t), mmap.mmap) for t in tensors.values())
    seen = []
    store = lora.base_storage(lora.LoraConfig(base_dtype="nf4"))

    def spy(name, value):
        seen.append((name, value.dtype))
        return store(name, value)

    model = load_reward_model(str(tmp_path), store=spy)
    assert len(seen) == len(nnx.to_flat_state(nnx.state(model, nnx.Param))) and all(d == np.float32 for _, d in seen)
    assert isinstance(model.model.layers[0].mlp.up_proj.kernel.get_value(), quant.Quantized)
    assert isinstance(model.model.embed_tokens.embedding.get_value(), quant.Quantized)
    assert model.score.kernel.get_value().dtype == jnp.float32


def _root(array):
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array.obj if isinstance(array, memoryview) else array


@pytest.mark.slow
def test_an_nf4_lora_run_trains_resumes_plans_and_exports(synthetic, tmp_path):  # noqa: F811
    import torch
    import transformers
    from rmflow.schemas.config import ExportConfig
    from rmflow.schemas.outputs import EXPORT_INFO
    from rmflow.trainer.export import export
    from rmflow.trainer.train import memory_plan

    from tests.scoring.test_export import rmflow_rewards

    spec = {"rank": 4, "alpha": 8, "base_dtype": "nf4", "target_modules": ["q_proj", "v_proj", "down_proj"]}
    optimizer = {"warmup_steps": 2, "learning_rate": 3e-3, "learning_rate_end": 3e-3}
    cfg = config(synthetic, tmp_path / "run", max_steps=8, checkpoint={"save_steps": 4}, lora=spec,
                 optimizer=optimizer)
    full = train(cfg)
    frozen = full.trainer.frozen
    matrices = [v for _, v in nnx.to_flat_state(frozen) if len(quant.shape(v)) >= 2]
    weights = sum(int(np.prod(quant.shape(v))) for v in matrices)
    assert all(isinstance(v.get_value(), quant.Quantized) for v in matrices)
    assert quant.nbytes([v.get_value() for v in matrices]) / weights <= 0.6  # the base's bytes a weight
    assert full.history[-1]["loss"] < full.history[0]["loss"]

    plan = memory_plan(cfg)  # the frozen base counted as held; the levers offer the other storages
    assert plan.frozen >= quant.nbytes(frozen) and plan.frozen < 0.2 * 4 * weights + 4096
    assert set(plan.base_savings) == set() and "lora.base_dtype" not in plan.advice()
    wide = memory_plan(config(synthetic, tmp_path / "plan", max_steps=8, lora={**spec, "base_dtype": "bfloat16"}))
    assert set(wide.base_savings) == {"int8", "nf4"} and wide.base_savings["nf4"] > wide.base_savings["int8"] > 0

    def ctrl_c_at_step_4(record):
        if record["step"] == 4:
            os.kill(os.getpid(), signal.SIGINT)

    again = config(synthetic, tmp_path / "resumed", max_steps=8, checkpoint={"save_steps": 4}, lora=spec,
                   optimizer=optimizer)
    with pytest.raises(Interrupted):
        train(again, on_log=ctrl_c_at_step_4)
    resumed = train(again, resume=True)
    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Only the adapters and the head are checkpointed: the base is quantised again from its source, alike.
    loaded, _, _ = load_trained_model(str(tmp_path / "run"))
    held = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    for path, var in nnx.to_flat_state(frozen):
        for a, b in zip(jax.tree.leaves(var.get_value()), jax.tree.leaves(held[path].get_value()), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The merged export holds the dequantised base plus the adapters, in float32: transformers
    # scores like rmflow's quantised model.
    out = export(ExportConfig(run=str(tmp_path / "run"), output=str(tmp_path / "hf")))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ids = [[2000 + i, 2100, GOOD, 2200 + i] for i in range(3)]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids)).logits[:, 0].numpy()
    np.testing.assert_allclose(rmflow_rewards(loaded, ids), expected, atol=1e-4, rtol=0)
    # --dtype bfloat16: the merged weights rounded once; transformers in bfloat16 scores within its rounding
    half = export(ExportConfig(run=str(tmp_path / "run"), output=str(tmp_path / "hf16"), dtype="bfloat16"))
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf16 = transformers.AutoModelForSequenceClassification.from_pretrained(half, dtype=torch.bfloat16).eval()
    assert next(hf16.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        got16 = hf16(input_ids=torch.tensor(ids)).logits[:, 0].float().numpy()
    print("bfloat16 export against rmflow:", np.abs(got16 - expected).max(), expected)
    np.testing.assert_allclose(got16, expected, atol=0.025 * max(1.0, float(np.abs(expected).max())), rtol=0)
    assert json.loads((tmp_path / "hf" / EXPORT_INFO).read_text())["lora"]["base_dtype"] == "nf4"
    assert "nf4" in (tmp_path / "hf" / "README.md").read_text()
