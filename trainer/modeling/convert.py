"""Hugging Face checkpoints to rmflow reward models: a name map, nothing more.

Our parameter paths mirror Hugging Face's names: ``model.layers.0.mlp.up_proj.kernel`` is
``model.layers.0.mlp.up_proj.weight`` transposed. A ``*ForCausalLM`` checkpoint gets a fresh,
seeded ``score`` head (``num_labels`` outputs); a classifier whose head is a reward model kind's
(``schemas.kinds``: ``*ForSequenceClassification``, 1 label; ``*ForTokenClassification``, 2, a
process reward model) brings its own.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from rmflow.schemas import jsontext
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.heads import ENSEMBLE_FILE, ENSEMBLE_KEY, UnknownHead, head_of, same_outputs
from rmflow.schemas.kinds import kind_named
from rmflow.trainer.modeling.config import (
    ATTRIBUTE_WEIGHTS,
    MOE_LAYOUT,
    ModelConfig,
    ScoreHead,
    head_kind,
    hf_num_labels,
)
from rmflow.trainer.modeling.decoder import RewardTransformer, score_layer

IGNORED = ("lm_head.weight",)  # a causal LM's head: not part of a reward model
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved


class CheckpointError(RmflowError, ValueError):
    """The checkpoint cannot be loaded; the message lists every problem."""


def hf_name(path: tuple) -> tuple[str, bool]:
    """Our parameter path -> (Hugging Face tensor name, whether to transpose)."""
    *parents, leaf = (str(p) for p in path)
    if leaf == "kernel":
        return ".".join([*parents, "weight"]), True
    if leaf == "embedding":
        return ".".join([*parents, "weight"]), False
    return ".".join([*parents, leaf]), False


_MEMBER_LAYER = re.compile(r"^members\.(\d+)\.layers\.(\d+)\.")


def member_layer(name: str) -> tuple[int, int, str] | None:
    """An ensemble member's own layer's tensor name (``members.M.layers.J.REST``) as (M, J, REST);
    None for any other name."""
    found = _MEMBER_LAYER.match(name)
    return (int(found[1]), int(found[2]), name[found.end():]) if found else None


def source_name(name: str, cfg: ModelConfig) -> str:
    """The base checkpoint's name of a tensor: an ensemble member's own layer J is a copy of the
    base's layer ``num_hidden_layers - member_layers + J`` (``decoder.MemberLayers``)."""
    member = member_layer(name)
    if member is None:
        return name
    _, j, rest = member
    return f"model.layers.{cfg.num_hidden_layers - cfg.member_layers + j}.{rest}"


def _layer_names(tensors, fused: str) -> list[str]:
    """The checkpoint's names of one fused tensor kind, a layer each (``...layers.N.<fused>.weight``)."""
    return [n for n in tensors if n.endswith(f".{fused}.weight")]


def split_fused(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A checkpoint's fused projections (``ModelConfig.fused_projections``: Phi-3's qkv_proj and
    gate_up_proj) as the model's own, split on the output axis; a fused tensor of another size
    than its parts is an error naming it."""
    for fused, parts in cfg.fused_projections():
        for name in _layer_names(tensors, fused):
            value, prefix = tensors.pop(name), name[: -len(f"{fused}.weight")]
            total = sum(n for _, n in parts)
            if value.shape[0] != total:
                raise CheckpointError(f"{name} has {value.shape[0]} outputs; this config's "
                                      f"{' + '.join(p for p, _ in parts)} make {total}")
            start = 0
            for part, n in parts:
                tensors[f"{prefix}{part}.weight"] = value[start: start + n]
                start += n
    return tensors


def join_fused(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of ``split_fused``: the model's projections fused as the family's checkpoints
    hold them (an export)."""
    for fused, parts in cfg.fused_projections():
        first = parts[0][0]
        for name in _layer_names(tensors, first):
            prefix = name[: -len(f"{first}.weight")]
            tensors[f"{prefix}{fused}.weight"] = np.concatenate(
                [tensors.pop(f"{prefix}{part}.weight") for part, _ in parts], axis=0)
    return tensors


def _sparse_prefixes(tensors, cfg: ModelConfig):
    """(the checkpoint's block prefix, the model's, the projections' checkpoint names) of each
    sparse layer (``MOE_LAYOUT``)."""
    if not cfg.sparse_layers:
        return
    block, names = MOE_LAYOUT[cfg.model_type]
    for layer in cfg.sparse_layers:
        yield f"model.layers.{layer}.{block}.", f"model.layers.{layer}.mlp.", names


def stack_experts(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A mixture of experts' checkpoint tensors as the model holds them: each sparse layer's router
    as ``mlp.gate`` and its experts' projections, (out, in) one tensor an expert, stacked and
    transposed to (E, in, out) (``Experts``). A missing expert is an error naming it."""
    if not cfg.sparse_layers:
        return tensors
    for theirs, ours, names in _sparse_prefixes(tensors, cfg):
        if f"{theirs}gate.weight" in tensors:
            tensors[f"{ours}gate.weight"] = tensors.pop(f"{theirs}gate.weight")
        for mine, name in names.items():
            keys = [f"{theirs}experts.{e}.{name}.weight" for e in range(cfg.num_experts)]
            missing = [k for k in keys if k not in tensors]
            if len(missing) == len(keys):
                continue  # reported as the model's missing tensor
            if missing:
                raise CheckpointError(f"the checkpoint lacks {', '.join(missing[:3])}"
                                      + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                                      + f": a {cfg.model_type} layer has {cfg.num_experts} experts")
            tensors[f"{ours}experts.{mine}"] = _Stacked([tensors.pop(k) for k in keys])
    return tensors


class _Stacked:
    """Experts' tensors (out, in), stacked transposed, (E, in, out), when read (``np.asarray``):
    the loader stores a stacked projection as it stores any tensor, so a mixture's experts are
    not all read from the file before the first is stored."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.shape = (len(parts), *parts[0].shape[::-1])

    def __array__(self, dtype=None, copy=None):
        return np.stack([np.asarray(p.T, dtype) for p in self.parts])


def unstack_experts(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of ``stack_experts``: the layout the family's checkpoints have (an export)."""
    for theirs, ours, names in _sparse_prefixes(tensors, cfg):
        tensors[f"{theirs}gate.weight"] = tensors.pop(f"{ours}gate.weight")
        for mine, name in names.items():
            stacked = tensors.pop(f"{ours}experts.{mine}")
            for e in range(cfg.num_experts):
                tensors[f"{theirs}experts.{e}.{name}.weight"] = np.ascontiguousarray(stacked[e].T)
    return tensors


def resolve(checkpoint: str, weights: bool = True) -> str:
    """A local checkpoint folder, or a hub id downloaded to the local cache (``weights`` False:
    its JSON files only, the configuration and the tokenizer's)."""
    if os.path.isdir(checkpoint):
        return checkpoint
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(checkpoint, allow_patterns=["*.json", "*.safetensors"] if weights else ["*.json"])
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated
        raise CheckpointError(
            f"{checkpoint!r} is not a folder and could not be fetched from the Hugging Face Hub "
            f"({type(e).__name__}: {e})"
        ) from e


def read_config(folder: str) -> tuple[ModelConfig, dict[str, Any]]:
    raw = read_raw_config(folder)
    return ModelConfig.from_hf(raw), raw


def read_raw_config(folder: str) -> dict[str, Any]:
    """A checkpoint's config.json; for an ensemble exported one checkpoint per member
    (``ENSEMBLE_FILE``), its first member's with the ensemble's head: one output per member."""
    ensemble = _ensemble_file(folder)
    if ensemble is not None:
        raw = read_raw_config(os.path.join(folder, ensemble["checkpoints"][0]))
        n = len(ensemble["checkpoints"])
        labels = {str(m): f"member_{m}" for m in range(n)}
        return {**raw, "num_labels": n, "id2label": labels, "label2id": {v: int(k) for k, v in labels.items()},
                ENSEMBLE_KEY: {"members": n, "reward": ensemble["reward"], "layers": ensemble["layers"]}}
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face checkpoint")
    return jsontext.read(path)


def is_ensemble_export(folder: str) -> bool:
    """Whether ``folder`` is an ensemble exported one checkpoint per member (``ENSEMBLE_FILE``)."""
    return os.path.exists(os.path.join(folder, ENSEMBLE_FILE))


def _ensemble_file(folder: str) -> dict[str, Any] | None:
    """An ensemble export's ``ENSEMBLE_FILE``, checked (None: the folder is one checkpoint)."""
    path = os.path.join(folder, ENSEMBLE_FILE)
    if not os.path.exists(path):
        return None
    ensemble = jsontext.read(path)
    checkpoints = ensemble.get("checkpoints") if isinstance(ensemble, dict) else None
    layers = ensemble.get("layers") if isinstance(ensemble, dict) else None
    if (not isinstance(checkpoints, list) or len(checkpoints) < 2 or not isinstance(layers, int) or layers < 1
            or not isinstance(ensemble.get("reward"), str)
            or not all(isinstance(c, str) and os.path.isdir(os.path.join(folder, c)) for c in checkpoints)):
        raise CheckpointError(f"{path} must name 2 or more member checkpoints (folders beside it), the members' own "
                              f"layers and their reward (as rmflow export writes it); it holds {ensemble!r:.300}")
    return ensemble


def _ensemble_tensors(folder: str, ensemble: dict[str, Any]) -> dict[str, np.ndarray]:
    """An ensemble export's members as one model's tensors: the shared layers (which every
    member's checkpoint must hold alike), member m's own top layers as ``members.m.layers.j``,
    the score head one row per member; each member's tensors as the model holds them
    (``split_fused``, ``stack_experts``) before they are renamed."""
    cfg = read_config(os.path.join(folder, ensemble["checkpoints"][0]))[0]
    first = cfg.num_hidden_layers - ensemble["layers"]
    out: dict[str, np.ndarray] = {}
    scores: dict[str, list[np.ndarray]] = {}
    for m, checkpoint in enumerate(ensemble["checkpoints"]):
        tensors = stack_experts(split_fused(open_tensors(os.path.join(folder, checkpoint)), cfg), cfg)
        for name, value in tensors.items():
            layer = re.match(r"^model\.layers\.(\d+)\.", name)
            if layer and int(layer[1]) >= first:
                out[f"members.{m}.layers.{int(layer[1]) - first}.{name[layer.end():]}"] = value
            elif name.startswith("score."):
                scores.setdefault(name, []).append(value)
            elif name not in out:
                out[name] = value
            elif not np.array_equal(np.asarray(out[name]), np.asarray(value)):
                raise CheckpointError(f"{folder}: {checkpoint}'s {name} differs from {ensemble['checkpoints'][0]}'s; "
                                      f"the members of an ensemble share every layer below their own top "
                                      f"{ensemble['layers']}")
    return {**out, **{name: np.concatenate(rows) for name, rows in scores.items()}}


def open_tensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of a single or sharded safetensors checkpoint as a read-only numpy view of the
    mapped file, in its stored dtype: nothing is read until a tensor is used, so a loader converts
    (and quantises) one tensor at a time and the checkpoint never sits in memory whole."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(jsontext.read(index)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    ensemble = _ensemble_file(folder) if not files else None
    if ensemble is not None:
        return _ensemble_tensors(folder, ensemble)
    if not files:
        raise CheckpointError(f"{folder} has no .safetensors files")
    tensors = {}
    for name in files:  # read and converted by numpy on the host: no device program, whatever backend JAX has
        tensors.update(_map_safetensors(os.path.join(folder, name)))
    return tensors


def read_tensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint (``open_tensors``) as a float32 numpy array."""
    return {name: value.astype(np.float32) for name, value in open_tensors(folder).items()}


_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}


def _map_safetensors(path: str) -> dict[str, np.ndarray]:
    """One safetensors file's tensors as numpy views of the file mapped into memory (the mapping
    lives as long as a view does). The format read directly (an 8-byte little-endian header
    length, a JSON header of dtypes, shapes and byte offsets, the data): safetensors' numpy
    reader has no bfloat16, and its JAX readers put tensors on a device."""
    if os.path.getsize(path) < 8:
        raise CheckpointError(f"{path} is not a safetensors file: it has no header")
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + size])
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key} has dtype {info['dtype']}, which rmflow does not read")
        start, end = info["data_offsets"]
        count = (end - start) // np.dtype(dtype).itemsize
        out[key] = np.frombuffer(data, dtype=dtype, count=count, offset=8 + size + start).reshape(info["shape"])
    return out


def _scores_as(cfg: ModelConfig, kind) -> bool:
    """Whether a checkpoint's head (``schemas.heads``) is one of ``kind``'s models."""
    try:
        return head_of(cfg).kind == kind.name
    except UnknownHead:
        return False


def _describe(head: ScoreHead) -> str:
    score_head = head_of(head)
    return score_head.describe(head, kind_named(score_head.kind).description)


def load_reward_model(checkpoint: str, *, dtype=jnp.float32, remat: bool = False, seed: int = 0,
                      attention: str = "auto", head: ScoreHead | None = None, scan_layers: bool = True,
                      store: Callable[[str, np.ndarray], Any] | None = None) -> RewardTransformer:
    """Build the reward model a checkpoint describes and load its weights. ``head``: the score
    head the caller needs (1 output: reward, 2: process model, or an attribute head); None takes
    the checkpoint's. ``store``: how a weight is held, given its dotted name and its float32
    value (a frozen base in bfloat16 or quantised: ``modeling.lora.base_storage``), applied to
    each tensor as it is read; None: float32."""
    folder = resolve(checkpoint)
    cfg, raw = read_config(folder)
    tensors = open_tensors(folder)
    kind = head_kind(raw)  # None: a causal LM, which gets a fresh score head
    is_classifier = kind is not None
    if kind is not None and not _scores_as(cfg, kind):
        raise CheckpointError(f"a *{kind.head.hf_head} checkpoint must have num_labels={kind.head.outputs} to be "
                              f"{kind.description} (or name its outputs' {ATTRIBUTE_WEIGHTS}: an attribute head); "
                              f"{checkpoint} has {hf_num_labels(raw)}")
    # the same outputs by name (an attribute head's weights are the run's: not parameters)
    if kind is not None and head is not None and not same_outputs(cfg, head):
        raise CheckpointError(f"{checkpoint} is {_describe(cfg.head)}, but this run trains {_describe(head)}: "
                              "start from its base model instead")
    if head is not None:
        cfg = cfg.with_head(head)
    tensors = stack_experts(split_fused(tensors, cfg), cfg)
    # built abstractly: every weight comes from the checkpoint, so none is drawn at random first
    model = nnx.eval_shape(lambda: RewardTransformer(cfg, dtype=dtype, remat=remat, rngs=nnx.Rngs(0),
                                                     attention=attention, scan_layers=scan_layers))
    model.model.set_rope_tables(cfg)
    if not is_classifier:  # a causal LM: a fresh score head, seeded (its bias, if any, 0)
        model.score = score_layer(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    copies = not is_ensemble_export(folder)  # a base's layers that each member copies (an export: its own)
    missing, bad_shape, used = _fill(state, tensors, cfg if copies else None, is_classifier, store)
    unexpected = sorted(set(tensors) - used - set(IGNORED)
                        - {n for n in tensors if n.endswith(IGNORED_SUFFIXES)})
    if missing or bad_shape or unexpected:
        parts = [f"missing: {missing}" if missing else "", f"wrong shape: {bad_shape}" if bad_shape else "",
                 f"unexpected: {unexpected}" if unexpected else ""]
        raise CheckpointError(f"checkpoint {checkpoint} does not match a {cfg.hf_prefix} reward model; "
                              + "; ".join(p for p in parts if p))
    nnx.update(model, state)
    check_concrete(model, checkpoint)
    return model


def _fill(state, tensors: dict[str, np.ndarray], copies: ModelConfig | None, is_classifier: bool,
          store: Callable[[str, np.ndarray], Any] | None) -> tuple[list[str], list[str], set[str]]:
    """Set each of ``state``'s parameters from its checkpoint tensor (through ``store``); returns
    the names missing, those of the wrong shape, and those used. ``copies``: the config whose
    ensemble members' own layers copy the checkpoint's top layers (``source_name``); with
    ``store`` (a frozen base) each member's copy of a layer is one array, stored once."""
    missing, bad_shape, used = [], [], set()
    stored: dict[str, Any] = {}
    for path, var in nnx.to_flat_state(state):
        name, transpose = hf_name(path)
        member = member_layer(name)
        name = source_name(name, copies) if copies is not None else name
        if name.startswith("score.") and not is_classifier:
            continue
        if name not in tensors:
            missing.append(name)
            continue
        if store is not None and member and name in stored:
            var.set_value(stored[name])
            continue
        value = tensors[name].T if transpose else tensors[name]
        expected = var.get_value().shape  # abstract (a shape and dtype) until set
        if value.shape != expected:
            bad_shape.append(f"{name}: checkpoint {tensors[name].shape}, model expects "
                             f"{expected[::-1] if transpose else expected}")
            continue
        value = np.asarray(value, np.float32)  # this tensor read from the file, converted on the host
        var.set_value(store(".".join(map(str, path)), value) if store else jnp.asarray(value))
        if store is not None and member:
            stored[name] = var.get_value()
        used.add(name)
    return missing, bad_shape, used


def check_concrete(model: RewardTransformer, checkpoint: str) -> None:
    """Every variable of a model built abstractly holds a value: one the checkpoint did not fill
    and the loader did not compute would otherwise surface as a shape without data at first use."""
    import jax

    empty = [".".join(map(str, path)) for path, var in nnx.to_flat_state(nnx.state(model))
             if isinstance(var.get_value(), jax.ShapeDtypeStruct)]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise CheckpointError(f"loading {checkpoint} left {shown} without a value: the loader must set every "
                              "variable the checkpoint does not hold")
