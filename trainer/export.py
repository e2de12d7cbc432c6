"""Export a trained run as a Hugging Face checkpoint that
``transformers.AutoModelForSequenceClassification.from_pretrained`` loads (a process reward
model: ``AutoModelForTokenClassification``).

config.json names the ``*ForSequenceClassification`` architecture with num_labels 1 (a process
model: ``*ForTokenClassification``, num_labels 2, label 0 "incorrect", 1 "correct") and the
shards' pad id; weights are float32 safetensors (sharded above ``max_shard_bytes``); the
tokenizer files and chat template used in preprocessing are copied beside them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from collections.abc import Iterator

import ml_dtypes
import numpy as np
from flax import nnx
from rmflow.schemas import jsontext
from rmflow.schemas.config import ExportConfig
from rmflow.schemas.errors import RmflowError, RmflowWarning
from rmflow.schemas.heads import ENSEMBLE_FILE, MEMBER_FOLDER, head_of
from rmflow.schemas.kinds import ModelKind, kind_named
from rmflow.schemas.outputs import EXPORT_INFO, check_replaceable, output_lock, staged_output
from rmflow.schemas.presets import is_preset
from rmflow.trainer import storage
from rmflow.trainer.checkpoints import load_trained_model
from rmflow.trainer.inference import NORMALIZATION_FILE, write_normalization
from rmflow.trainer.model_card import model_card
from rmflow.trainer.modeling import lora, quant
from rmflow.trainer.modeling.config import ModelConfig
from rmflow.trainer.modeling.convert import hf_name, join_fused, member_layer, resolve, unstack_experts
from rmflow.trainer.modeling.decoder import RewardTransformer

MAX_SHARD_BYTES = 2 << 30


def hf_config(model_cfg: ModelConfig, base: dict | None, pad_token_id: int | None, kind: ModelKind,
              dtype: str = "float32") -> dict:
    """config.json of the exported model: ``kind``'s Hugging Face head (sequence or token
    classification); ``base`` is the source checkpoint's."""
    c = model_cfg
    rope = {"rope_type": c.rope_type, "rope_theta": c.rope_theta, **dict(c.rope_params)}
    cfg = dict(base or {
        "model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_parameters": rope, "attention_bias": c.qkv_bias, "mlp_bias": c.mlp_bias,
        "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
        "tie_word_embeddings": False,
    })
    cfg.pop("auto_map", None)  # the base's own remote code (Phi-3's hub configs): the export is transformers' class
    for key in ("rope_scaling", "rope_parameters"):  # LongRoPE's first name, which transformers 5 no longer reads
        rope_cfg = cfg.get(key)
        if isinstance(rope_cfg, dict) and "su" in (rope_cfg.get("type"), rope_cfg.get("rope_type")):
            cfg[key] = {**{k: v for k, v in rope_cfg.items() if k != "type"}, "rope_type": "longrope"}
    score_head = head_of(c)  # its labels, and what else config.json says of it (``ModelConfig.from_hf`` reads it back)
    labels = score_head.hf_labels(c)
    head = {"architectures": [f"{c.hf_prefix}{kind.head.hf_head}"], "num_labels": c.num_labels,
            "id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}, **score_head.hf_config(c)}
    cfg.update({**head, "pad_token_id": pad_token_id, "torch_dtype": dtype, "dtype": dtype})
    cfg.pop("problem_type", None)
    return cfg


def _named(model: RewardTransformer) -> dict[str, np.ndarray]:
    """The model's tensors by their Hugging Face names, float32 (a quantised base weight as it
    dequantises)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transpose = hf_name(path)
        value = np.asarray(quant.value(var), np.float32)
        out[name] = np.ascontiguousarray(value.T if transpose else value)
    return out


def state_dict(model: RewardTransformer) -> dict[str, np.ndarray]:
    """The model's tensors by their Hugging Face names, fused where its family's checkpoints fuse
    them (``modeling.convert.join_fused``)."""
    return unstack_experts(join_fused(_named(model), model.config), model.config)


def member_state_dicts(model: RewardTransformer) -> Iterator[dict[str, np.ndarray]]:
    """An ensemble whose members have their own top layers (``ModelConfig.member_layers``) as one
    plain reward model per member, one at a time (each written before the next is built): the
    shared layers, the member's own in the base's top layers' places, and the score head's output
    for that member."""
    cfg = model.config
    first, plain = cfg.num_hidden_layers - cfg.member_layers, cfg.one_member()
    named = _named(model)
    shared = {n: v for n, v in named.items() if member_layer(n) is None and not n.startswith("score.")}
    for m in range(cfg.members):
        own = {f"model.layers.{first + j}.{rest}": v for n, v in named.items()
               for (i, j, rest) in [member_layer(n) or (-1, 0, "")] if i == m}
        score = {n: v[m:m + 1] for n, v in named.items() if n.startswith("score.")}
        yield unstack_experts(join_fused({**shared, **own, **score}, plain), plain)


def _save_file(tensors: dict[str, np.ndarray], path: str) -> None:
    """safetensors' save_file, its I/O failures (a full disk ...) raised as the OSError they are."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:
        raise OSError(None, f"cannot write the weights: {e}", path) from e


def save_safetensors(tensors: dict[str, np.ndarray], folder: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        _save_file(shards[0], os.path.join(folder, "model.safetensors"))
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        _save_file(shard, os.path.join(folder, name))
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        jsontext.dump(index, f, indent=2, sort_keys=True)
    return names




class ExportError(RmflowError):
    """The export cannot be written where asked; the message says why."""


EXPORT = "export"  # schemas.outputs.OUTPUT_SIGNATURES' name of what export writes


def export(cfg: ExportConfig) -> str:
    """Write the checkpoint into a staging folder beside ``cfg.output``, then swap it in: an
    earlier export there is replaced whole (no stale weight file survives), and an interrupted
    export leaves the old one intact. A LoRA run exports merged weights, or with ``adapter`` a
    PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, the score head as
    a module to save) that ``peft.PeftModel.from_pretrained`` loads onto the base model. Returns
    the export's folder."""
    output = os.path.abspath(cfg.output)
    with output_lock(output, "rmflow export"):
        folder = _export(cfg.run, output, cfg.step, cfg.max_shard_bytes, cfg.adapter, cfg.dtype)
    if cfg.push_to_hub:
        push_to_hub(folder, cfg.push_to_hub)
    return folder


def check_hf_class(model_cfg: ModelConfig, kind: ModelKind) -> None:
    """The Hugging Face class an export of ``kind`` names must exist in transformers (Gemma 3's
    text model has a sequence classifier but no token classifier, so a process reward model of it
    has no Hugging Face layout)."""
    import transformers

    name = f"{model_cfg.hf_prefix}{kind.head.hf_head}"
    if not hasattr(transformers, name):
        raise ExportError(f"transformers has no {name}, so {kind.description} of a {model_cfg.model_type} model has no "
                          "Hugging Face layout to export to: score and serve it from its run directory (rmflow "
                          "score, rmflow serve and the API read runs)")


def push_to_hub(folder: str, repo: str) -> str:
    """Upload an export to the Hub repository ``repo`` (created private if missing); returns the
    commit's URL. Any failure (no network, no token, no right) is one line saying so, the export
    itself kept where it is."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, private=True, exist_ok=True)
        commit = api.upload_folder(folder_path=folder, repo_id=repo, commit_message="rmflow export")
    except Exception as e:  # noqa: BLE001 - connection, auth and permission errors alike: said in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ExportError(f"--push-to-hub {repo}: the upload failed ({type(e).__name__}: {first[:200]}); the export "
                          f"is complete in {folder}: upload it later with `hf upload {repo} {folder}`") from None
    return getattr(commit, "commit_url", str(commit))


def _export(run_dir: str, output: str, step: int | str | None, max_shard_bytes: int, adapter: bool,
            dtype: str = "float32") -> str:
    check_replaceable(output, EXPORT, inputs=(run_dir,))  # never a folder of other files: replaced whole
    model, run, step = load_trained_model(run_dir, step)
    if adapter and run.config.lora is None:
        raise ExportError(f"{run_dir} is not a LoRA run: --adapter exports LoRA adapters; export it without --adapter")
    if adapter and run.model_config.fused_projections():
        raise ExportError(f"{run_dir}: a {run.model_config.hf_prefix} checkpoint fuses its projections "
                          f"({', '.join(f for f, _ in run.model_config.fused_projections())}), which a PEFT adapter of "
                          "rmflow's separate projections cannot target: export it without --adapter (merged weights)")
    experts = sorted(set(lora.EXPERT_TARGETS) & set(run.config.lora.target_modules)) if run.config.lora else []
    if adapter and run.model_config.member_layers:
        raise ExportError(f"{run_dir}: an ensemble whose members have their own layers (ensemble.layers "
                          f"{run.model_config.member_layers}) exports one merged checkpoint per member; export it "
                          "without --adapter")
    if adapter and run.model_config.sparse_layers and experts:
        raise ExportError(f"{run_dir}: adapters on a mixture of experts' experts ({', '.join(experts)}), stacked over "
                          "the experts, have no PEFT layout: export it without --adapter (merged weights)")
    base = run.base_config
    if run.tokenizer_dir is None:
        warnings.warn(f"{run_dir} has no tokenizer files; the export will have none: copy the tokenizer the "
                      "shards were made with into it", RmflowWarning, stacklevel=2)
    pad = export_pad_id(run)
    kind = kind_named(run.manifest.model_kind)  # the run's own: its Hugging Face head, as TRL and Axolotl export that kind
    check_hf_class(run.model_config, kind)
    with staged_output(output, EXPORT) as staging:  # swapped in whole; an interrupted export leaves the old one
        if adapter:
            base_path = os.path.abspath(resolve(run.config.model.path)) if not is_preset(run.config.model.path) else None
            if base_path is None:  # a preset's random base exists nowhere else: ship it, in base/
                plain = nnx.clone(model)
                lora.strip(plain)
                _write_checkpoint(plain, os.path.join(staging, "base"), base, pad, kind, max_shard_bytes, dtype)
                base_path = "base"  # relative: the export moves and uploads whole (loading: docs/training.md)
            write_adapter(model, staging, run.config.lora, base_path, kind)
        else:
            lora.merge(model)  # a LoRA run exports W + A B alpha/rank: a plain checkpoint
            members = [f for f in _write_checkpoints(model, staging, base, pad, kind, max_shard_bytes, dtype)
                       if f != staging]
        if run.tokenizer_dir is not None:  # beside the checkpoint, and in each member's (each loads alone)
            for folder in [staging, *(() if adapter else members)]:
                for name in os.listdir(run.tokenizer_dir):
                    shutil.copy(os.path.join(run.tokenizer_dir, name), os.path.join(folder, name))
        normalization = os.path.join(run.path, NORMALIZATION_FILE)  # the run as loaded (a remote one staged once)
        with open(os.path.join(staging, EXPORT_INFO), "w") as f:
            jsontext.dump({"run": run_dir if storage.is_remote(run_dir) else os.path.abspath(run_dir), "step": step,
                       "data": run.config.data.train, "tokenizer_sha256": run.manifest.tokenizer.sha256,
                       "format": "peft-adapter" if adapter else "checkpoint", "kind": run.manifest.model_kind,
                       "step_separator": run.manifest.step_separator, "render": dataclasses.asdict(run.manifest.render),
                       "max_length": run.manifest.max_length, "label_weights": run.manifest.label_weights,
                       **({"lora": dataclasses.asdict(run.config.lora)} if run.config.lora is not None else {})},
                      f, indent=2)
        if os.path.exists(normalization) and not adapter:  # the run's `rmflow eval --normalize` figures, and OpenRLHF's
            write_normalization(staging, jsontext.read(normalization))
        with open(os.path.join(staging, "README.md"), "w") as f:  # the model card
            f.write(model_card(run, step, kind, f"{run.model_config.hf_prefix}{kind.head.hf_head}", adapter))
    return output


def export_pad_id(run) -> int | None:
    """The export's ``pad_token_id``: the tokenizer's pad; for a tokenizer without one, a token that
    never ends a rendered conversation (eos, unless the chat template ends a reply with it), since
    transformers reads a sequence classifier's score at the last token that is not padding and
    cannot score a batch without a pad id."""
    info = run.manifest.tokenizer
    if info.pad_token_id is not None or run.tokenizer_dir is None:
        return info.pad_token_id
    from rmflow.rendering.tokenize import RecordTokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run.tokenizer_dir)
    last = int(RecordTokenizer(tok).encode_conversation((("user", "Hi."), ("assistant", "Hello.")))[-1])
    candidates = (info.eos_token_id, tok.bos_token_id, tok.unk_token_id, 0, 1)
    return next(int(t) for t in candidates if t is not None and int(t) != last)


def _write_checkpoint(model: RewardTransformer, folder: str, base: dict | None, pad: int | None, kind: ModelKind,
                      max_shard_bytes: int, dtype: str = "float32"):
    _write_tensors(state_dict(model), model.config, folder, base, pad, kind, max_shard_bytes, dtype)


def _write_tensors(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, folder: str, base: dict | None,
                   pad: int | None, kind: ModelKind, max_shard_bytes: int, dtype: str = "float32"):
    os.makedirs(folder, exist_ok=True)
    if dtype == "bfloat16":  # rounded once, from float32 (a LoRA run's merged weights included)
        tensors = {name: value.astype(ml_dtypes.bfloat16) for name, value in tensors.items()}
    save_safetensors(tensors, folder, max_shard_bytes)
    with open(os.path.join(folder, "config.json"), "w") as f:
        jsontext.dump(hf_config(model_cfg, base, pad, kind, dtype), f, indent=2, sort_keys=True)


def _write_checkpoints(model: RewardTransformer, folder: str, base: dict | None, pad: int | None, kind: ModelKind,
                       max_shard_bytes: int, dtype: str = "float32") -> list[str]:
    """The model as one checkpoint in ``folder``; an ensemble whose members have their own top
    layers as one plain checkpoint per member (``MEMBER_FOLDER`` + its index) and ``ENSEMBLE_FILE``
    naming them, its reward rule and its own layers (``convert.open_tensors`` reads them back as
    one model). Returns the checkpoint folders."""
    cfg = model.config
    if not cfg.member_layers:
        _write_checkpoint(model, folder, base, pad, kind, max_shard_bytes, dtype)
        return [folder]
    names = [f"{MEMBER_FOLDER}{m}" for m in range(cfg.members)]
    for name, tensors in zip(names, member_state_dicts(model)):
        _write_tensors(tensors, cfg.one_member(), os.path.join(folder, name), base, pad, kind, max_shard_bytes, dtype)
    with open(os.path.join(folder, ENSEMBLE_FILE), "w") as f:
        jsontext.dump({"members": cfg.members, "reward": cfg.member_reward, "layers": cfg.member_layers,
                       "checkpoints": names}, f, indent=2)
    return [os.path.join(folder, name) for name in names]


PEFT_PREFIX = "base_model.model."


def write_adapter(model: RewardTransformer, folder: str, cfg, base_path: str, kind: ModelKind) -> None:
    """PEFT's adapter layout: lora_A.weight (rank, in), lora_B.weight (out, rank) per targeted module,
    the trained score head under its own name (``modules_to_save``), task SEQ_CLS (a process
    model: TOKEN_CLS, the head's bias too)."""
    from safetensors.numpy import save_file

    tensors = {}
    for name, (a, b) in lora.adapters(model).items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a, np.float32).T)
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b, np.float32).T)
    tensors[f"{PEFT_PREFIX}score.weight"] = np.ascontiguousarray(np.asarray(model.score.kernel[...], np.float32).T)
    if model.score.bias is not None:
        tensors[f"{PEFT_PREFIX}score.bias"] = np.asarray(model.score.bias[...], np.float32)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": kind.head.peft_task, "r": cfg.rank, "lora_alpha": cfg.alpha,
              "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.target_modules), "bias": "none",
              "modules_to_save": ["score"], "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "base_model_name_or_path": base_path}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        jsontext.dump(config, f, indent=2, sort_keys=True)
