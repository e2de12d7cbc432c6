"""The architecture of a Llama-family decoder, read from a Hugging Face ``config.json``.

Covers Llama 2/3 (RoPE scaling: linear, llama3), Mistral, Qwen2/2.5 (q/k/v bias), Qwen3
(q/k RMSNorm over each head, explicit head_dim), OLMo 2 (q/k RMSNorm over the whole projection,
each sublayer's output normalised instead of its input), Phi-3 (q/k/v and gate/up projections
fused in the checkpoint, ``FUSED_PROJECTIONS``; LongRoPE within the original context; RoPE on
a part of each head, ``partial_rotary_factor``, as Phi-4-mini), Gemma 2 (``_gemma``: scaled
embeddings, (1 + w) norms before and after each sublayer, GeGLU, soft-capped attention logits,
local and global layers), Gemma 3's language model (``gemma3_text``: Gemma 2's traits, q/k norms,
a RoPE per layer type, ``_gemma3_rope``) and SmolLM2 (a Llama with tied embeddings).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from rmflow.schemas.errors import RmflowError
from rmflow.schemas.heads import ATTRIBUTE_WEIGHTS, ENSEMBLE_KEY, UnknownHead, check_head, head_of  # noqa: F401 - config.json's key, re-exported
from rmflow.schemas.kinds import KINDS, OUTCOME, ModelKind, kind_named
from rmflow.schemas.presets import MODEL_PRESETS, PRESET_BASE


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face decoder family (its ``model_type``) as rmflow builds, reads and writes it: one
    entry of ``FAMILIES`` is all that varies by family.

    ``prefix``: the Hugging Face class prefix. ``qkv_bias``: biases on the q, k, v projections
    (None: the config's ``attention_bias``, which then also sets the output projection's).
    ``qk_norm``: RMSNorm of queries and keys, per head or over the whole projection (None: none).
    ``post_norms``: norms after attention and MLP too (OLMo 2). ``gemma``: Gemma's embedding scale,
    GeGLU, soft-capping, sliding windows and (1 + weight) norms. ``moe``: a sparse layer's block
    name and its experts' projection names in the checkpoint. ``fused``: checkpoint tensors that
    hold several projections (split at load, joined at export). ``partial_rotary``: RoPE may rotate
    only part of a head. ``rope_per_layer_type``: Gemma 3's RoPE for its global and its sliding
    layers."""

    prefix: str
    qkv_bias: bool | None = None
    qk_norm: str | None = None
    post_norms: bool = False
    norm_in_float32: bool = False
    gemma: bool = False
    moe: tuple[str, dict[str, str]] | None = None
    fused: tuple = ()
    partial_rotary: bool = False
    rope_per_layer_type: bool = False  # a RoPE for the global layers and another for the sliding ones


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2", qkv_bias=True),
    "qwen3": Family("Qwen3", qk_norm="head"),
    "olmo2": Family("Olmo2", qk_norm="projection", post_norms=True, norm_in_float32=True),
    "phi3": Family("Phi3", partial_rotary=True,
                   fused=(("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                          ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))),
    "gemma2": Family("Gemma2", norm_in_float32=True, gemma=True),
    # Gemma 3's language model (its base checkpoints: Gemma3ForCausalLM)
    "gemma3_text": Family("Gemma3Text", qk_norm="head", norm_in_float32=True, gemma=True, rope_per_layer_type=True),
    "qwen3_moe": Family("Qwen3Moe", qk_norm="head",
                        moe=("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"})),
    "mixtral": Family("Mixtral", moe=("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})),
}
# The table's columns as the modules that read one of them name it
ARCHITECTURES = {name: f.prefix for name, f in FAMILIES.items()}  # model_type -> Hugging Face class prefix
# Mixture-of-experts families: the checkpoint's name of a sparse layer's block and of each expert's
# gate, up and down projections (``experts.E.NAME.weight``); the model's are ``mlp`` and
# ``experts.gate_proj`` ... stacked over the experts (``modeling.convert.stack_experts``).
MOE_LAYOUT = {name: f.moe for name, f in FAMILIES.items() if f.moe}
GEMMA = tuple(name for name, f in FAMILIES.items() if f.gemma)
# Checkpoint tensors that hold several of the model's projections, concatenated on their output
# axis in this order (split when a checkpoint loads, joined again when a model exports).
FUSED_PROJECTIONS = {name: f.fused for name, f in FAMILIES.items() if f.fused}
QK_NORM_OVER = ("head", "projection")
# Families whose attention rotates only the first ``partial_rotary_factor`` of each head's
# dimensions (transformers' apply_rotary_pos_emb splits there); the others rotate all of it.
PARTIAL_ROTARY = tuple(name for name, f in FAMILIES.items() if f.partial_rotary)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation (Gemma: GeGLU with tanh-approximated gelu)
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class ModelConfigError(RmflowError, ValueError):
    """The checkpoint's config.json describes something rmflow cannot build; says what."""




@dataclasses.dataclass(frozen=True)
class ScoreHead:
    """A model's score head: its outputs, and for an attribute head (the regression objectives)
    each output's name and its weight in the reward."""

    num_labels: int = 1
    attributes: tuple[str, ...] = ()
    attribute_weights: tuple[float, ...] = ()
    members: int = 0  # an ensemble head's (schemas.heads.ENSEMBLE): one output per member
    member_reward: str = "mean"  # ... and the reward over them (schemas.heads.MEMBER_REWARDS)
    member_layers: int = 0  # ... and the top layers each member has of its own (0: the head only)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_params: tuple[tuple[str, float], ...] = ()  # factor, low/high_freq_factor, original_max_position_embeddings
    # longrope (Phi-3): each frequency's factor within the original context, its short_factor
    rope_short_factor: tuple[float, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_over: str = "head"  # the q/k RMSNorm over each head (Qwen3) or the whole projection (OLMo 2)
    post_norms: bool = False  # OLMo 2: each sublayer's output normalised before the residual, its input not
    norm_weight_in_float32: bool = False  # OLMo 2: RMSNorm's weight applied before the cast to the compute dtype
    tie_word_embeddings: bool = False
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions RoPE rotates (the first ones)
    # Gemma 2: the embeddings scaled by sqrt(hidden_size); RMSNorm weights w applied as (1 + w) in
    # float32; every sublayer normalised on the way in and on the way out; GeGLU; attention logits
    # soft-capped (cap * tanh(logits / cap)) and scaled by query_pre_attn_scalar^-0.5 instead of
    # head_dim^-0.5; layers alternating local (sliding-window) and global attention (layer_types).
    embed_scale: bool = False
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + w)
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] = ()  # each layer's attention; () every layer alike (sliding_window if set)
    # Gemma 3: the sliding layers' RoPE base (default RoPE), the others taking rope_theta and its
    # scaling; None: one RoPE for every layer
    sliding_rope_theta: float | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): the layers whose MLP is a router over
    # num_experts experts of moe_intermediate_size, each token sent to its num_experts_per_tok
    # most probable ones, their outputs weighted by the router's probabilities (renormalised
    # over the chosen ones with norm_topk_prob); router_aux_loss_coef: the checkpoint's
    # load-balancing coefficient (the train option's default)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # Mistral; Qwen2 when use_sliding_window
    pad_token_id: int | None = None
    num_labels: int = 1  # outputs of the score head: its reward model kind's (schemas.kinds), or one per attribute
    # An attribute head (the regression objectives): one output per attribute, by name, and the
    # reward their weighted sum; an outcome model's kind otherwise. () for the kinds' own heads.
    attributes: tuple[str, ...] = ()
    attribute_weights: tuple[float, ...] = ()
    # An ensemble head: one output per member, the reward ``member_reward`` over them (schemas.heads)
    members: int = 0
    member_reward: str = "mean"
    # ... whose members each have their own copy of the top ``member_layers`` decoder layers
    # (``decoder.MemberLayers``); the layers below are shared. 0: the members share every layer.
    member_layers: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "attributes", tuple(self.attributes))
        object.__setattr__(self, "attribute_weights", tuple(float(w) for w in self.attribute_weights))
        try:
            check_head(self)
        except UnknownHead as e:
            raise ModelConfigError(str(e)) from None
        if not 0 <= self.member_layers <= self.num_hidden_layers:
            raise ModelConfigError(f"ensemble.layers {self.member_layers}: the members' own top layers, from 0 to the "
                                   f"model's {self.num_hidden_layers}")
        if self.model_type not in ARCHITECTURES:
            raise ModelConfigError(
                f"model_type {self.model_type!r} is not supported; rmflow builds {sorted(ARCHITECTURES)}"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ModelConfigError(f"partial_rotary_factor {self.partial_rotary_factor}: RoPE needs an even number of "
                                   f"dimensions from 2 to head_dim {self.head_dim}")
        if self.partial_rotary_factor != 1 and self.model_type not in PARTIAL_ROTARY:
            raise ModelConfigError(f"partial_rotary_factor {self.partial_rotary_factor} for model_type "
                                   f"{self.model_type}: transformers rotates a part of each head only for "
                                   f"{', '.join(PARTIAL_ROTARY)}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "sparse_layers", tuple(self.sparse_layers))
        if self.sparse_layers and not (0 < self.num_experts_per_tok <= self.num_experts
                                       and self.moe_intermediate_size > 0):
            raise ModelConfigError(f"a mixture of experts needs 1 <= num_experts_per_tok <= num_experts and a "
                                   f"moe_intermediate_size: got {self.num_experts_per_tok}, {self.num_experts}, "
                                   f"{self.moe_intermediate_size}")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or set(self.layer_types) - set(LAYER_TYPES)):
            raise ModelConfigError(f"layer_types {list(self.layer_types)}: one of {LAYER_TYPES} for each of the "
                                   f"{self.num_hidden_layers} layers")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelConfigError("layer_types has sliding_attention layers but the config sets no sliding_window")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"hidden activation {self.hidden_act!r} is not supported; supported: {ACTIVATIONS}")
        if self.qk_norm_over not in QK_NORM_OVER:
            raise ModelConfigError(f"qk_norm_over {self.qk_norm_over!r}: one of {QK_NORM_OVER}")
        if self.rope_type not in ROPE_TYPES:
            raise ModelConfigError(f"rope type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier token)."""
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    @property
    def positions_field(self) -> str:
        """The checkpoint field ``max_position_embeddings`` comes from, as messages name it: LongRoPE's
        ``original_max_position_embeddings`` (rmflow runs within the context it was pretrained at)."""
        return "original_max_position_embeddings, LongRoPE's pretrained context" if self.rope_type == "longrope" \
            else "max_position_embeddings"

    @property
    def router_stats_size(self) -> int:
        """The length of a layer's router statistics (``llama.SparseMoE``): per expert the chosen
        count and the probability sum, then the tokens; 0 for a model without experts."""
        return 2 * self.num_experts + 1 if self.sparse_layers else 0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates (the first ones), as transformers counts them."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def head(self) -> ScoreHead:
        return ScoreHead(self.num_labels, self.attributes, self.attribute_weights, self.members, self.member_reward,
                         self.member_layers)

    @property
    def kind(self) -> ModelKind:
        """The reward model kind of the score head: an attribute head's reward is one score per
        conversation, an outcome model's."""
        return kind_named(head_of(self).kind)

    def with_head(self, head: ScoreHead) -> ModelConfig:
        return dataclasses.replace(self, **dataclasses.asdict(head))

    def one_member(self) -> ModelConfig:
        """One member of an ensemble as a plain reward model (a member's export): the outcome head."""
        return self.with_head(ScoreHead(OUTCOME.head.outputs))

    @property
    def hf_prefix(self) -> str:
        return ARCHITECTURES[self.model_type]

    def fused_projections(self) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
        """The checkpoint's fused tensors in each layer: (its name, ((a projection, its output
        size), ...)), by ``FUSED_PROJECTIONS``; none for most families."""
        q, kv, i = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim, \
            self.intermediate_size
        size = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "mlp.gate_proj": i,
                "mlp.up_proj": i}
        return tuple((fused, tuple((p, size[p]) for p in parts))
                     for fused, parts in FUSED_PROJECTIONS.get(self.model_type, ()))

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> ModelConfig:
        """From a parsed config.json (transformers 4.x or 5.x layout)."""
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; rmflow builds {sorted(ARCHITECTURES)}"
            )
        missing = [k for k in REQUIRED_HF_KEYS if d.get(k) is None]
        if missing:
            raise ModelConfigError(f"the checkpoint's config.json has no {missing}: a {model_type} config needs them "
                                   "(is it complete, and from a transformers model?)")
        heads, family = d["num_attention_heads"], FAMILIES[model_type]
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            **_rope(d, model_type, heads),
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.qkv_bias is None else False,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=family.qk_norm is not None,
            qk_norm_over=family.qk_norm or "head",
            post_norms=family.post_norms,
            norm_weight_in_float32=family.norm_in_float32,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            **(_gemma(d) if family.gemma else {"hidden_act": d.get("hidden_act") or "silu"}),
            **(_experts(d) if family.moe else {}),
            sliding_window=_sliding_window(d),
            pad_token_id=d.get("pad_token_id"),
            **dataclasses.asdict(_head(d)),
        )

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides: Any) -> ModelConfig:
        """A random-init Llama of ``schemas.presets.MODEL_PRESETS``."""
        return cls(**{**PRESET_BASE, **MODEL_PRESETS[name], "vocab_size": vocab_size, **overrides})

    @classmethod
    def tiny(cls, vocab_size: int, **overrides: Any) -> ModelConfig:
        """The tiny preset: 4 layers, hidden 256 (the demo's and the benchmarks' model)."""
        return cls.preset("tiny", vocab_size, **overrides)

    @classmethod
    def micro(cls, vocab_size: int, **overrides: Any) -> ModelConfig:
        """The micro preset: 2 layers, hidden 64 (what the tests train)."""
        return cls.preset("micro", vocab_size, **overrides)


def head_kind(d: Mapping[str, Any]) -> ModelKind | None:
    """The reward model kind whose Hugging Face head a checkpoint's ``architectures`` name, or
    None (a causal LM: no score head)."""
    for kind in KINDS.values():
        if any(a.endswith(kind.head.hf_head) for a in d.get("architectures") or []):
            return kind
    return None


def hf_num_labels(d: Mapping[str, Any]) -> int:
    """A Hugging Face classifier config's label count (``PretrainedConfig``'s default: 2)."""
    return int(d.get("num_labels") or len(d.get("id2label") or {0: 0, 1: 1}))


def _head(d: Mapping[str, Any]) -> ScoreHead:
    """The score head a checkpoint brings: a classifier's labels (checked against its kind when
    its weights are loaded), an attribute head's with its names (``id2label``) and weights
    (``attribute_weights``, as ``rmflow export`` writes them); for a causal LM, the outcome head's
    (a fresh head of the size the run asks for replaces it)."""
    if head_kind(d) is None:
        return ScoreHead(OUTCOME.head.outputs)
    ensemble = d.get(ENSEMBLE_KEY)
    if ensemble:
        if not isinstance(ensemble, Mapping) or ensemble.get("members") != hf_num_labels(d):
            raise ModelConfigError(f"{ENSEMBLE_KEY} {ensemble!r} must name its members, one per output "
                                   f"(num_labels {hf_num_labels(d)})")
        return ScoreHead(hf_num_labels(d), members=int(ensemble["members"]),
                         member_reward=str(ensemble.get("reward") or "mean"),
                         member_layers=int(ensemble.get("layers") or 0))
    weights = d.get(ATTRIBUTE_WEIGHTS)
    if not weights:
        return ScoreHead(hf_num_labels(d))
    labels = d.get("id2label") or {}
    names = tuple(str(labels.get(str(i), labels.get(i, ""))) for i in range(hf_num_labels(d)))
    if not isinstance(weights, Mapping) or set(weights) != set(names):
        raise ModelConfigError(f"{ATTRIBUTE_WEIGHTS} {weights!r} must weigh each output of id2label {labels!r} by name")
    return ScoreHead(len(names), names, tuple(float(weights[n]) for n in names))


def _longrope(d: Mapping[str, Any], rope: dict[str, Any], heads: int, partial: float = 1.0
              ) -> tuple[int, tuple[float, ...], dict]:
    """LongRoPE (Phi-3) as rmflow runs it: within the context it was pretrained at
    (``original_max_position_embeddings``, the positions rmflow then allows), where transformers
    takes each frequency's ``short_factor`` and scales cos and sin by the attention factor
    (given, or sqrt(1 + ln(max / original) / ln(original))). Past it transformers switches to
    ``long_factor``, which rmflow does not: sequences are kept within the original context."""
    # the top-level value first, as transformers reads it (its Phi3Config keeps one there)
    original = d.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    short = rope.get("short_factor")
    rotary = int((d.get("head_dim") or d["hidden_size"] // heads) * partial)  # the dimensions RoPE rotates
    if not original or not isinstance(short, (list, tuple)) or len(short) != rotary // 2:
        raise ModelConfigError(f"a longrope config needs original_max_position_embeddings and a short_factor of "
                               f"one number per rotated pair of dimensions ({rotary // 2}); got {original!r} and "
                               f"{short!r}")
    factor = rope.get("factor") or d.get("max_position_embeddings", original) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return int(original), tuple(float(x) for x in short), {"attention_factor": float(attention)}


def _gemma(d: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2's and 3's traits (see ``ModelConfig``), read as transformers reads them: GeGLU from
    ``hidden_activation``, the layers sliding and global by ``layer_types`` (by default every
    ``sliding_window_pattern``-th layer global: Gemma 2's 2, Gemma 3's 6, as their configs make
    them)."""
    if d.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention: rmflow's attention is causal (an encoder-style Gemma "
                               "is not supported)")
    layers = d["num_hidden_layers"]
    # Gemma 2 alternates whatever its config says; Gemma 3's configs name their pattern
    pattern = 2 if d.get("model_type") == "gemma2" else d.get("sliding_window_pattern") or 6
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                     for i in range(layers)]
    return {"embed_scale": True, "norm_offset": 1.0, "sandwich_norms": True,
            "hidden_act": d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
            # Gemma 3's attention keeps the config's cap but never applies it (as transformers runs it)
            "attn_logit_softcapping": d.get("attn_logit_softcapping") if d.get("model_type") == "gemma2" else None,
            "query_pre_attn_scalar": d.get("query_pre_attn_scalar"), "layer_types": tuple(types)}


def _rope(d: Mapping[str, Any], model_type: str, heads: int) -> dict[str, Any]:
    """The RoPE fields of a config.json (transformers 4.x ``rope_scaling`` or 5.x
    ``rope_parameters``): type, theta and scaling parameters, the rotated fraction of a head, the
    positions (LongRoPE's within its original context), Gemma 3's sliding layers' own theta."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    sliding_theta = None
    if FAMILIES[model_type].rope_per_layer_type:  # the global layers' read below
        rope, sliding_theta = _gemma3_rope(d)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # Phi-3's first configs name LongRoPE "su"
    theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    partial = float(rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0)
    positions = d.get("max_position_embeddings", 4096)
    short: tuple[float, ...] = ()
    if rope_type == "longrope":
        positions, short, rope = _longrope(d, rope, heads, partial)
    params = tuple(sorted((k, float(v)) for k, v in rope.items()
                          if k in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings", "attention_factor")))
    return {"rope_theta": float(theta), "rope_type": rope_type, "rope_params": params,
            "sliding_rope_theta": sliding_theta, "partial_rotary_factor": partial,
            "max_position_embeddings": positions, "rope_short_factor": short}


def _gemma3_rope(d: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's RoPE: the global layers' (``rope_parameters.full_attention``, or the top-level
    ``rope_theta`` and ``rope_scaling`` of older configs; base 1e6) and the sliding layers' base
    (``rope_parameters.sliding_attention``, or ``rope_local_base_freq``; 1e4), whose RoPE must be
    the default one, as every Gemma 3 has it."""
    given = d.get("rope_parameters") or {}
    if "full_attention" in given or "sliding_attention" in given:
        full, local = dict(given.get("full_attention") or {}), dict(given.get("sliding_attention") or {})
    else:
        full, local = dict(given or d.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", d.get("rope_theta") or 1e6)
    local.setdefault("rope_theta", d.get("rope_local_base_freq") or 1e4)
    rope_type = local.get("rope_type") or local.get("type") or "default"
    if rope_type != "default":
        raise ModelConfigError(f"rope_parameters.sliding_attention rope_type {rope_type!r}: rmflow runs the sliding "
                               "layers' default RoPE (their own base) only")
    return full, float(local["rope_theta"])


def _experts(d: Mapping[str, Any]) -> dict[str, Any]:
    """A mixture of experts as transformers builds it: Qwen3-MoE's sparse layers are every
    ``decoder_sparse_step``-th one not in ``mlp_only_layers``, Mixtral's all of them (its expert
    size ``intermediate_size``, its chosen experts' weights always renormalised). Router jitter
    noise, a training-time perturbation, is not applied (as dropout is not)."""
    layers = d["num_hidden_layers"]
    if d["model_type"] == "mixtral":
        experts = d.get("num_local_experts") or 0
        return {"num_experts": experts, "num_experts_per_tok": d.get("num_experts_per_tok") or 0,
                "moe_intermediate_size": d["intermediate_size"], "norm_topk_prob": True,
                "sparse_layers": tuple(range(layers)) if experts else (),
                "router_aux_loss_coef": float(d.get("router_aux_loss_coef") or 0.0)}
    # hub configs name it num_experts; transformers 5 writes num_local_experts
    experts, step = d.get("num_experts") or d.get("num_local_experts") or 0, d.get("decoder_sparse_step") or 1
    dense = set(d.get("mlp_only_layers") or ())
    return {"num_experts": experts, "num_experts_per_tok": d.get("num_experts_per_tok") or 0,
            "moe_intermediate_size": d.get("moe_intermediate_size") or 0,
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "sparse_layers": tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0),
            "router_aux_loss_coef": float(d.get("router_aux_loss_coef") or 0.0)}


def _sliding_window(d: Mapping[str, Any]) -> int | None:
    if d.get("model_type") in ("qwen2", "qwen3", "qwen3_moe") and not d.get("use_sliding_window", False):
        return None
    return d.get("sliding_window") or None
