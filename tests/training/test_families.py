"""Each model family beyond Llama's as a user meets it: a base checkpoint built with
transformers trained into a reward model on the synthetic task (it learns it), exported, and
the export loaded back by transformers with rmflow's rewards. Parity of every layer and of
packed rows with transformers: ``tests/training/test_model_parity.py`` and ``tests/training/test_packing.py``,
whose ``ARCHS`` hold every family."""

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
import transformers
from rmflow.schemas.config import ExportConfig
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.checkpoints import load_trained_model
from rmflow.trainer.export import export
from rmflow.trainer.train import run as train

from tests.scoring.test_export import rmflow_rewards
from tests.training.test_train import synthetic  # noqa: F401 - the fixture

FAMILIES = {  # family -> (config class, model class prefix, its own options)
    "olmo2": ("Olmo2Config", "Olmo2", {}),
    "phi3": ("Phi3Config", "Phi3", {}),  # its q/k/v and gate/up projections fused in the checkpoint
    # local (window 8) and global layers, soft-capped logits, its own attention scale
    "gemma2": ("Gemma2Config", "Gemma2", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                         "attn_logit_softcapping": 50.0}),
    # Gemma 3's language model: q/k norms, a sliding then a global layer, each with its RoPE
    "gemma3": ("Gemma3TextConfig", "Gemma3Text", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                                 "layer_types": ["sliding_attention", "full_attention"]}),
}
CAUSAL = {"gemma3": "Gemma3ForCausalLM"}
FAMILIES.update({  # mixtures of experts: a router over 4 experts, 2 a token
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3Moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "Mixtral", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
})  # a base checkpoint's class, where not PREFIXForCausalLM


def base_checkpoint(family: str, folder: pathlib.Path, tokenizer_dir: str) -> pathlib.Path:
    """A random base model of ``family`` (a causal LM: rmflow gives it a fresh score head), with
    the shards' tokenizer."""
    config_cls, prefix, kw = FAMILIES[family]
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=256, pad_token_id=tok.pad_token_id, **kw)
    getattr(transformers, CAUSAL.get(family, f"{prefix}ForCausalLM"))(cfg).save_pretrained(folder)
    for f in pathlib.Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_trains_learns_exports_and_scores_alike_in_transformers(family, synthetic, tokenizer_dir,  # noqa: F811
                                                                          tmp_path):
    base = base_checkpoint(family, tmp_path / "base", tokenizer_dir)
    result = train(TrainConfig.from_dict({
        "data": str(synthetic), "model": str(base), "output": str(tmp_path / "run"), "max_steps": 60,
        "batch_size": 16, "seed": 0, "eval_steps": 60, "optimizer": {"learning_rate": 1e-3, "warmup_steps": 10},
        "logging": {"steps": 20}}))
    final = result.history[-1]
    assert final["eval_accuracy"] > 0.95 and result.history[0]["loss"] > final["loss"], final  # it learns

    out = pathlib.Path(export(ExportConfig(run=str(tmp_path / "run"), output=str(tmp_path / "hf"))))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [f"{FAMILIES[family][1]}ForSequenceClassification"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    ids_list = [rng.integers(2000, 3000, n).tolist() for n in (9, 14, 5)]
    pad = config["pad_token_id"]  # transformers finds each row's last token by it
    batch = {"input_ids": torch.tensor([x + [pad] * (14 - len(x)) for x in ids_list]),
             "attention_mask": torch.tensor([[1] * len(x) + [0] * (14 - len(x)) for x in ids_list])}
    with torch.no_grad():
        expected = hf(**batch).logits[:, 0].numpy()
    model, _, _ = load_trained_model(str(tmp_path / "run"))
    np.testing.assert_allclose(rmflow_rewards(model, ids_list), expected, atol=1e-4, rtol=0)


def test_fused_projections_split_and_join_back_and_a_wrong_size_is_named():
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.convert import CheckpointError, join_fused, split_fused

    cfg = ModelConfig.from_hf({"model_type": "phi3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 6,
                               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})
    rng = np.random.default_rng(0)
    fused = {"model.layers.0.self_attn.qkv_proj.weight": rng.normal(size=(8 + 4 + 4, 8)),
             "model.layers.0.mlp.gate_up_proj.weight": rng.normal(size=(12, 8))}
    parts = split_fused(dict(fused), cfg)
    assert parts["model.layers.0.self_attn.k_proj.weight"].shape == (4, 8)
    np.testing.assert_array_equal(parts["model.layers.0.mlp.up_proj.weight"], fused["model.layers.0.mlp.gate_up_proj.weight"][6:])
    again = join_fused(parts, cfg)
    assert set(again) == set(fused)
    for name in fused:
        np.testing.assert_array_equal(again[name], fused[name])
    with pytest.raises(CheckpointError, match="qkv_proj.weight has 15 outputs"):
        split_fused({"model.layers.0.self_attn.qkv_proj.weight": np.zeros((15, 8))}, cfg)


def test_a_longrope_config_is_read_within_its_original_context_or_refused_naming_what_is_missing():
    from rmflow.trainer.modeling.config import ModelConfig, ModelConfigError

    d = {"model_type": "phi3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 6, "num_hidden_layers": 1,
         "num_attention_heads": 2, "max_position_embeddings": 4096, "original_max_position_embeddings": 64,
         "rope_scaling": {"type": "su", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}}
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_type == "longrope" and cfg.rope_short_factor == (1.0, 2.0)
    assert cfg.max_position_embeddings == 64  # the positions rmflow allows: the short factors' range
    assert cfg.positions_field.startswith("original_max_position_embeddings")  # what messages name as the limit
    assert ModelConfig.from_hf({**d, "rope_scaling": None}).positions_field == "max_position_embeddings"
    assert dict(cfg.rope_params)["attention_factor"] == pytest.approx(np.sqrt(1 + np.log(64) / np.log(64)))
    with pytest.raises(ModelConfigError, match="short_factor"):
        ModelConfig.from_hf({**d, "rope_scaling": {"type": "longrope", "long_factor": [3.0, 4.0]}})


def test_rope_on_part_of_each_head_is_read_where_transformers_applies_it_and_refused_elsewhere():
    """partial_rotary_factor (Phi-4-mini: 0.75, top level or among the RoPE parameters) sets the
    rotated dimensions, also the short factors' count; a family whose transformers code rotates
    whole heads, or a factor leaving an odd or empty part, is refused naming the field."""
    from rmflow.trainer.modeling.config import ModelConfig, ModelConfigError

    d = {"model_type": "phi3", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 6, "num_hidden_layers": 1,
         "num_attention_heads": 2}
    assert ModelConfig.from_hf({**d, "partial_rotary_factor": 0.75}).rotary_dim == 12
    assert ModelConfig.from_hf({**d, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                         "partial_rotary_factor": 0.5}}).rotary_dim == 8
    with pytest.raises(ModelConfigError, match="one number per rotated pair of dimensions .6."):
        ModelConfig.from_hf({**d, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
                             "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}})
    for bad, field in (({**d, "model_type": "llama", "partial_rotary_factor": 0.5}, "model_type llama"),
                       ({**d, "partial_rotary_factor": 0.7}, "partial_rotary_factor 0.7")):
        with pytest.raises(ModelConfigError, match=field):
            ModelConfig.from_hf(bad)


def test_a_lora_run_of_a_fused_family_exports_merged_and_refuses_an_adapter(synthetic, tokenizer_dir,  # noqa: F811
                                                                            tmp_path):
    from rmflow.trainer.export import ExportError

    base = base_checkpoint("phi3", tmp_path / "base", tokenizer_dir)
    train(TrainConfig.from_dict({"data": str(synthetic), "model": str(base), "output": str(tmp_path / "run"),
                                 "max_steps": 2, "batch_size": 4, "lora": {"rank": 2},
                                 "optimizer": {"learning_rate": 1e-3, "warmup_steps": 1}}))
    with pytest.raises(ExportError, match="fuses its projections"):
        export(ExportConfig(run=str(tmp_path / "run"), output=str(tmp_path / "adapter"), adapter=True))
    out = pathlib.Path(export(ExportConfig(run=str(tmp_path / "run"), output=str(tmp_path / "hf"))))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Phi3ForSequenceClassification"]


def test_export_config_drops_remote_code_and_renames_su_and_checkpoints_read_on_the_host(tmp_path):
    """A base config's auto_map (remote code) is not carried into the export, LongRoPE's first
    name 'su' is written as 'longrope' (transformers 5 reads only that), the top-level
    original_max_position_embeddings wins as in transformers; bfloat16, float16 and int tensors
    read from safetensors exactly, on the host."""
    from rmflow.schemas.kinds import OUTCOME
    from rmflow.trainer.export import hf_config
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.convert import read_tensors
    from safetensors.torch import save_file

    base = {"model_type": "phi3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 6, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 4096, "original_max_position_embeddings": 64,
            "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"},
            "rope_scaling": {"type": "su", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
                             "original_max_position_embeddings": 128}}
    cfg = ModelConfig.from_hf(base)
    assert cfg.max_position_embeddings == 64  # the top-level value, as transformers takes it
    out = hf_config(cfg, base, 0, OUTCOME)
    assert "auto_map" not in out and out["rope_scaling"]["rope_type"] == "longrope" and "type" not in out["rope_scaling"]
    weights = {"bf": torch.randn(3, 5).to(torch.bfloat16), "half": torch.randn(4).half(),
               "ints": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = read_tensors(str(tmp_path))
    for name, value in weights.items():
        np.testing.assert_array_equal(got[name], value.float().numpy())


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_rms_norm_rounds_in_bfloat16_as_the_family_does(family):
    """Llama's RMSNorm casts, then applies its weight in bfloat16; OLMo 2's applies it in float32
    and casts once: each family's norm equals transformers' own in bfloat16, bit for bit."""
    import jax.numpy as jnp
    from rmflow.trainer.modeling.decoder import RMSNorm

    module = getattr(transformers.models, family)
    hf_norm = getattr(getattr(module, f"modeling_{family}"), f"{FAMILY_PREFIX[family]}RMSNorm")(16, eps=1e-6)
    rng = np.random.default_rng(0)
    weight, x = rng.normal(1.0, 0.3, 16).astype(np.float32), rng.normal(size=(4, 16)).astype(np.float32)
    weight = torch.tensor(weight).to(torch.bfloat16).float().numpy()  # a bfloat16 model's weights, exactly
    with torch.no_grad():
        hf_norm.weight.copy_(torch.tensor(weight))
        expected = hf_norm.to(torch.bfloat16)(torch.tensor(x).to(torch.bfloat16)).float().numpy()
    ours = RMSNorm(16, 1e-6, dtype=jnp.bfloat16, weight_in_float32=family == "olmo2")  # as ModelConfig sets it
    ours.weight[...] = jnp.asarray(weight)
    got = np.asarray(ours(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    np.testing.assert_array_equal(got, expected)
    from rmflow.trainer.modeling.config import ModelConfig

    cfg = ModelConfig.from_hf({"model_type": family, "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 2})
    assert cfg.norm_weight_in_float32 == (family == "olmo2")


FAMILY_PREFIX = {"llama": "Llama", "olmo2": "Olmo2"}


def test_a_gemma2_config_is_read_as_transformers_reads_it_or_refused_naming_the_field():
    """Gemma 2's layers sliding and global by layer_types (by default the even ones sliding), its
    activation, cap and scale; an encoder-style (bidirectional) config, an activation rmflow does
    not run, a sliding layer without a window: refused before any weight loads, naming the field."""
    from rmflow.trainer.modeling.config import ModelConfig, ModelConfigError

    d = {"model_type": "gemma2", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 6, "num_hidden_layers": 3,
         "num_attention_heads": 2, "head_dim": 16, "sliding_window": 4, "attn_logit_softcapping": 50.0,
         "query_pre_attn_scalar": 144, "hidden_activation": "gelu_pytorch_tanh"}
    cfg = ModelConfig.from_hf(d)
    assert [cfg.layer_window(i) for i in range(3)] == [4, None, 4]
    assert cfg.attention_scale == pytest.approx(144 ** -0.5) and cfg.attn_logit_softcapping == 50.0
    assert (cfg.embed_scale, cfg.norm_offset, cfg.sandwich_norms, cfg.hidden_act) == (True, 1.0, True,
                                                                                     "gelu_pytorch_tanh")
    assert ModelConfig.from_hf({**d, "layer_types": ["full_attention"] * 3}).layer_window(0) is None
    for bad, field in (({**d, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
                       ({**d, "hidden_activation": "relu"}, "hidden activation 'relu'"),
                       ({**d, "sliding_window": None}, "sets no sliding_window"),
                       ({**d, "layer_types": ["full_attention"]}, "layer_types")):
        with pytest.raises(ModelConfigError, match=field):
            ModelConfig.from_hf(bad)


def test_a_family_transformers_has_no_head_for_is_refused_at_export_naming_the_class():
    from rmflow.schemas.kinds import OUTCOME, PROCESS
    from rmflow.trainer.export import ExportError, check_hf_class
    from rmflow.trainer.modeling.config import ModelConfig

    cfg = ModelConfig.from_hf({"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 6,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16, "sliding_window": 4})
    check_hf_class(cfg, OUTCOME)  # Gemma3TextForSequenceClassification
    with pytest.raises(ExportError, match="transformers has no Gemma3TextForTokenClassification"):
        check_hf_class(cfg, PROCESS)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_the_router_load_balancing_loss_equals_transformers(family, tmp_path):
    """The router statistics, summed over every layer but the last (which routes only the reward
    tokens in training), give transformers' load_balancing_loss_func of those layers' router
    logits (padding left out by the mask), within 1e-5."""
    import jax.numpy as jnp
    from rmflow.trainer.modeling.convert import load_reward_model
    from rmflow.trainer.modeling.decoder import router_loss

    from tests.training.test_model_parity import ARCHS, batch, build_hf

    hf = build_hf(family, "ForSequenceClassification", tmp_path)
    ids, mask = batch()
    with torch.no_grad():
        logits = hf.model(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                          output_router_logits=True).router_logits
    module = __import__(f"transformers.models.{hf.config.model_type}.modeling_{hf.config.model_type}",
                        fromlist=["load_balancing_loss_func"])
    experts = ARCHS[family][2].get("num_experts") or ARCHS[family][2]["num_local_experts"]
    model = load_reward_model(str(tmp_path))
    sparse = model.config.sparse_layers  # the layers transformers' router logits come from, in order
    logits = tuple(g for layer, g in zip(sparse, logits) if layer != model.config.num_hidden_layers - 1)
    expected = float(module.load_balancing_loss_func(logits, experts, 2, torch.tensor(mask)))
    t = ids.shape[1]
    every = jnp.broadcast_to(jnp.arange(t), ids.shape)  # the last layer at every token: a full forward
    _, stats = model.model.hidden_at(jnp.asarray(ids), every, jnp.asarray(mask), every, with_router=True)
    assert float(router_loss(stats, experts)) == pytest.approx(expected, abs=1e-5)


def test_a_mixture_of_experts_logs_its_router_loss_weighted_by_the_option(synthetic, tokenizer_dir,  # noqa: F811
                                                                         tmp_path):
    """router_aux_loss is logged; the option's coefficient (the checkpoint's by default) is what
    the loss adds: the same step's loss differs by the coefficient times it."""
    base = base_checkpoint("qwen3-moe", tmp_path / "base", tokenizer_dir)
    losses = {}
    for coef in (0.0, 0.5):
        result = train(TrainConfig.from_dict({
            "data": str(synthetic), "model": str(base), "output": str(tmp_path / f"run-{coef}"), "max_steps": 1,
            "batch_size": 8, "seed": 0, "router_aux_loss_coefficient": coef, "logging": {"steps": 1},
            "optimizer": {"warmup_steps": 0}}))
        losses[coef] = result.history[0]
    assert losses[0.0]["router_aux_loss"] == pytest.approx(losses[0.5]["router_aux_loss"], rel=1e-6)
    assert losses[0.0]["router_aux_loss"] >= 1.0  # k = 2 experts a token: 2 at a perfect balance
    assert losses[0.5]["loss"] == pytest.approx(losses[0.0]["loss"], rel=1e-6)  # the reward loss, logged apart
    assert losses[0.5]["grad_norm"] != pytest.approx(losses[0.0]["grad_norm"], rel=1e-6)  # the router's trained


def test_lora_on_a_mixture_of_experts_adapts_the_attention_and_each_expert(synthetic, tokenizer_dir,  # noqa: F811
                                                                           tmp_path):
    """Adapters on the attention and on every expert (stacked as the experts are) train, with
    dropout; the merged export is scored by transformers as rmflow scores the run; a PEFT adapter
    export of the experts is refused, naming them."""
    from rmflow.trainer.export import ExportError

    base = base_checkpoint("mixtral", tmp_path / "base", tokenizer_dir)
    result = train(TrainConfig.from_dict({
        "data": str(synthetic), "model": str(base), "max_steps": 3, "batch_size": 8, "output": str(tmp_path / "lora"),
        "optimizer": {"warmup_steps": 1, "learning_rate": 1e-2},
        "lora": {"rank": 4, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}}))
    assert result.history[-1]["step"] == 3 and "router_aux_loss" in result.history[-1]
    model, _, _ = load_trained_model(str(tmp_path / "lora"))
    from rmflow.trainer.modeling import lora

    names = lora.adapters(model)
    assert any(n.endswith("experts.gate_proj") for n in names)
    a, b = next(v for n, v in names.items() if n.endswith("experts.down_proj"))
    assert a.shape[0] == b.shape[0] == 4 and float(np.abs(b).max()) > 0  # one pair an expert, trained
    out = pathlib.Path(export(ExportConfig(run=str(tmp_path / "lora"), output=str(tmp_path / "hf"))))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ids = [[2000 + i, 2100 + i, 2200 + i, 5] for i in range(3)]
    with torch.no_grad():
        theirs = np.array([float(hf(input_ids=torch.tensor([s])).logits[0, 0]) for s in ids])
    np.testing.assert_allclose(rmflow_rewards(model, [np.array(s) for s in ids]), theirs, atol=1e-4)
    with pytest.raises(ExportError, match="adapters on a mixture of experts' experts .down_proj, gate_proj."):
        export(ExportConfig(run=str(tmp_path / "lora"), output=str(tmp_path / "adapter"), adapter=True))


def test_a_mixture_of_experts_resumes_exactly(synthetic, tokenizer_dir, tmp_path):  # noqa: F811
    """Resumed from step 2's checkpoint, the last two steps are those of the run uninterrupted
    (router loss included)."""
    base = base_checkpoint("qwen3-moe", tmp_path / "base", tokenizer_dir)

    def run(out, steps, resume=False):
        cfg = TrainConfig.from_dict({"data": str(synthetic), "model": str(base), "output": str(out), "max_steps": steps,
                                     "batch_size": 8, "optimizer": {"warmup_steps": 1, "learning_rate": 1e-3},
                                     "checkpoint": {"save_steps": 2}, "logging": {"steps": 1}})
        return train(cfg, resume=resume).history

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "parts", 4)
    shutil.rmtree(tmp_path / "parts" / "checkpoints" / "4")  # as if stopped after step 2's save
    parts = run(tmp_path / "parts", 4, resume=True)
    for a, b in zip(whole[-2:], parts[-2:]):
        assert (a["step"], a["loss"], a["router_aux_loss"]) == pytest.approx((b["step"], b["loss"], b["router_aux_loss"]),
                                                                             abs=1e-6)


def test_weight_decay_reaches_the_experts_and_gemma_3_applies_no_cap():
    """The stacked expert matrices decay as every matrix does; Gemma 3's attention, as
    transformers runs it, never applies its config's cap; Gemma 2 alternates whatever its config's
    pattern says."""
    import dataclasses

    from flax import nnx
    from rmflow.trainer.modeling.config import ModelConfig
    from rmflow.trainer.modeling.decoder import RewardTransformer
    from rmflow.trainer.optimizer import decay_mask
    from rmflow.trainer.parallel import param_name

    from tests.training.test_step import CFG

    moe = dataclasses.replace(CFG, model_type="mixtral", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=8, sparse_layers=(0, 1))
    params = nnx.state(RewardTransformer(moe, rngs=nnx.Rngs(0)), nnx.Param).to_pure_dict()
    import jax

    mask = {param_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]}
    assert mask["model.layers.0.mlp.experts.down_proj"] and mask["model.layers.0.mlp.gate.kernel"]
    assert not mask["model.layers.0.input_layernorm.weight"]
    d = {"vocab_size": 10, "hidden_size": 32, "intermediate_size": 6, "num_hidden_layers": 6, "num_attention_heads": 2,
         "head_dim": 16, "sliding_window": 4, "attn_logit_softcapping": 50.0, "sliding_window_pattern": 3}
    assert ModelConfig.from_hf({**d, "model_type": "gemma3_text"}).attn_logit_softcapping is None
    gemma2 = ModelConfig.from_hf({**d, "model_type": "gemma2"})
    assert [gemma2.layer_window(i) for i in range(6)] == [4, None] * 3 and gemma2.attn_logit_softcapping == 50.0
