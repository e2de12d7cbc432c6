"""Parity with transformers' PyTorch models: tiny random checkpoints built here with torch,
loaded by rmflow, compared on the same right-padded batches (max abs diff <= 1e-4, float32)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from rmflow.trainer.modeling.convert import CheckpointError, load_reward_model

from tests import forward

VOCAB, PAD = 97, 0
LENGTHS = (24, 13, 6)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              pad_token_id=PAD, rms_norm_eps=1e-6)

ARCHS = {
    "llama": ("LlamaConfig", "Llama", {}),
    "llama-bias": ("LlamaConfig", "Llama", {"attention_bias": True, "mlp_bias": True}),
    "llama2-linear-rope": ("LlamaConfig", "Llama",
                           {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama3-rope": ("LlamaConfig", "Llama",
                    {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                         "rope_theta": 500000.0}}),
    "mistral-sliding-window": ("MistralConfig", "Mistral", {"sliding_window": 8, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2", {}),
    "qwen3": ("Qwen3Config", "Qwen3", {"head_dim": 32}),
    "olmo2": ("Olmo2Config", "Olmo2", {}),
    "phi3": ("Phi3Config", "Phi3", {}),
    "phi3-longrope-window": ("Phi3Config", "Phi3", {
        "sliding_window": 8, "original_max_position_embeddings": 32,  # max_position_embeddings 256: factor 8
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 1.2, 1.1, 3.0,
                                                                                            1.0, 1.3],
                            "long_factor": [4.0] * 8, "original_max_position_embeddings": 32}}),
    # Phi-4-mini: LongRoPE on the first 3/4 of each head's dimensions
    "phi4-mini-partial-rotary": ("Phi3Config", "Phi3", {
        "original_max_position_embeddings": 32, "partial_rotary_factor": 0.75,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.5, 2.0, 1.2, 1.1, 3.0], "long_factor": [4.0] * 6,
                            "original_max_position_embeddings": 32}}),
    # Gemma 2: a local then a global layer (window 8), soft-capped logits (a cap small enough to
    # bite on random weights), query_pre_attn_scalar apart from head_dim, GeGLU, (1 + w) norms
    "gemma2": ("Gemma2Config", "Gemma2", {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 0.5,
                                         "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0}),
    # Gemma 3 (text): q/k norms, a RoPE per layer type (the global layer's linearly scaled)
    "gemma3": ("Gemma3TextConfig", "Gemma3Text", {
        "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
    # mixtures of experts: Qwen3-MoE with a dense layer and its chosen experts' weights as they
    # are; Mixtral's renormalised, with a window
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3Moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 24, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", "Mixtral", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                            "sliding_window": 8}),
}


def batch(seed=0):
    rng = np.random.default_rng(seed)
    t = max(LENGTHS)
    ids = np.full((len(LENGTHS), t), PAD, np.int32)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = rng.integers(3, VOCAB, n)
    mask = (np.arange(t)[None] < np.array(LENGTHS)[:, None]).astype(np.int32)
    return ids, mask


def ours(model, ids, mask):
    t = ids.shape[1]
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), ids.shape)
    return np.asarray(forward.rewards(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask),
                                      jnp.asarray(np.array(LENGTHS, np.int32) - 1)))


def build_hf(arch, head, tmp_path, **extra):
    config_cls, prefix, kw = ARCHS[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**COMMON, **kw, **extra, num_labels=1)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, f"{prefix}{head}")(cfg).eval()
    with torch.no_grad():  # norms initialise to a constant: perturbed, so that their weights count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_rewards_match_sequence_classification(arch, tmp_path):
    hf = build_hf(arch, "ForSequenceClassification", tmp_path)
    ids, mask = batch()
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long()).logits[:, 0].numpy()
    got = ours(load_reward_model(str(tmp_path)), ids, mask)
    assert got.shape == (len(LENGTHS),)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral-sliding-window", "olmo2", "phi3-longrope-window",
                                  "phi4-mini-partial-rotary", "gemma2", "gemma3", "qwen3-moe", "mixtral"])
def test_every_layer_matches(arch, tmp_path):
    hf = build_hf(arch, "ForSequenceClassification", tmp_path)
    ids, mask = batch(1)
    with torch.no_grad():
        hf_states = hf.model(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                             output_hidden_states=True).hidden_states
    model = load_reward_model(str(tmp_path))
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    states = list(forward.hidden_states(model, jnp.asarray(ids), positions, jnp.asarray(mask)))
    states[-1] = model.model.norm(states[-1])  # transformers' last entry is after the final norm
    assert len(states) == len(hf_states)
    real = mask.astype(bool)
    for i, (a, b) in enumerate(zip(states, hf_states)):
        np.testing.assert_allclose(np.asarray(a)[real], b.numpy()[real], atol=1e-4, rtol=0, err_msg=f"layer {i}")


def test_causal_lm_checkpoint_gets_a_fresh_seeded_head(tmp_path):
    """SmolLM2-style: a Llama causal LM with tied embeddings (no lm_head tensor saved)."""
    hf = build_hf("llama", "ForCausalLM", tmp_path, tie_word_embeddings=True)
    ids, mask = batch(2)
    a, b = load_reward_model(str(tmp_path), seed=1), load_reward_model(str(tmp_path), seed=1)
    assert np.array_equal(a.score.kernel[...], b.score.kernel[...])  # seeded
    assert not np.array_equal(a.score.kernel[...], load_reward_model(str(tmp_path), seed=2).score.kernel[...])
    assert float(jnp.std(a.score.kernel[...])) < 0.2  # small init
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long()).last_hidden_state
    idx = np.array(LENGTHS) - 1
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    got = forward.hidden_at(a, jnp.asarray(ids), positions, jnp.asarray(mask), jnp.asarray(idx))
    np.testing.assert_allclose(np.asarray(got), hidden.numpy()[np.arange(len(idx)), idx], atol=1e-4, rtol=0)


def test_packed_pairs_do_not_see_each_other(tmp_path):
    build_hf("qwen3", "ForSequenceClassification", tmp_path)
    model = load_reward_model(str(tmp_path))
    ids, mask = batch(3)
    alone = ours(model, ids, mask)
    # Pack sequences 1 and 2 into one row: segments 1 and 2, positions restart at 0.
    a, b = ids[1, :LENGTHS[1]], ids[2, :LENGTHS[2]]
    row = np.concatenate([a, b, np.full(5, PAD)])[None].astype(np.int32)
    seg = np.concatenate([np.full(len(a), 1), np.full(len(b), 2), np.zeros(5)])[None].astype(np.int32)
    pos = np.concatenate([np.arange(len(a)), np.arange(len(b)), np.zeros(5)])[None].astype(np.int32)
    idx = np.array([[len(a) - 1, len(a) + len(b) - 1]], np.int32)
    packed = np.asarray(forward.rewards(model, jnp.asarray(row), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(idx)))
    assert packed.shape == (1, 2)
    np.testing.assert_allclose(packed[0], alone[1:], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_bfloat16_compute_and_remat_agree_with_float32(tmp_path):
    build_hf("llama", "ForSequenceClassification", tmp_path)
    ids, mask = batch(4)
    ref = ours(load_reward_model(str(tmp_path)), ids, mask)
    np.testing.assert_allclose(ours(load_reward_model(str(tmp_path), remat=True), ids, mask), ref, atol=1e-6)
    bf16 = ours(load_reward_model(str(tmp_path), dtype=jnp.bfloat16), ids, mask)
    assert bf16.dtype == np.float32
    np.testing.assert_allclose(bf16, ref, atol=0.05, rtol=0.05)


def test_mismatched_checkpoint_lists_every_problem(tmp_path):
    from safetensors.torch import load_file, save_file

    build_hf("llama", "ForSequenceClassification", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors.pop("model.norm.weight")
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:, :10].contiguous()
    tensors["extra.weight"] = torch.zeros(3)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_reward_model(str(tmp_path))
    msg = str(e.value)
    for part in ("model.layers.1.mlp.up_proj.weight", "model.norm.weight", "q_proj.weight", "extra.weight"):
        assert part in msg


def test_a_bfloat16_checkpoint_is_read_on_the_host_as_float32(tmp_path):
    """Checkpoints saved in bfloat16 (most published ones) read as float32 numpy arrays, every
    value kept (converted by numpy on the host, never on a device)."""
    import torch
    from rmflow.trainer.modeling.convert import read_tensors
    from safetensors.torch import save_file

    weights = {"w": torch.randn(5, 7).to(torch.bfloat16), "b": torch.randn(3).to(torch.bfloat16)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    tensors = read_tensors(str(tmp_path))
    for name, value in weights.items():
        assert tensors[name].dtype == np.float32 and isinstance(tensors[name], np.ndarray)
        np.testing.assert_array_equal(tensors[name], value.float().numpy())


@pytest.mark.parametrize("head", ["ForSequenceClassification", "ForCausalLM"])
def test_a_checkpoint_loads_without_drawing_the_weights_it_holds(head, tmp_path, monkeypatch):
    """The model a checkpoint fills is built abstractly: no weight it holds is first drawn at random
    (for a causal LM, only its fresh score head is); a variable nothing filled is an error naming it."""
    import jax
    from flax import nnx
    from jax._src import random as jax_random  # what the initializers call
    from rmflow.trainer.modeling.convert import CheckpointError, check_concrete
    from rmflow.trainer.modeling.decoder import RewardTransformer

    build_hf("llama", head, tmp_path)
    drawn = []
    normal = jax_random.normal

    def recording(key, shape=(), *args, **kwargs):
        if not isinstance(key, jax.core.Tracer):  # a concrete draw, not an abstract one
            drawn.append(tuple(shape))
        return normal(key, shape, *args, **kwargs)

    monkeypatch.setattr(jax_random, "normal", recording)
    model = load_reward_model(str(tmp_path))
    hidden = model.config.hidden_size
    assert drawn == ([] if head == "ForSequenceClassification" else [(hidden, 1)])
    abstract = nnx.eval_shape(lambda: RewardTransformer(model.config, rngs=nnx.Rngs(0)))
    with pytest.raises(CheckpointError, match=r"left model\.embed_tokens\.embedding, .* and \d+ more without a value"):
        check_concrete(abstract, "probe")
