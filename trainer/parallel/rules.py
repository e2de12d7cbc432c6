"""Sharding rules keyed on parameter names (our names mirror Hugging Face's).

Each rule maps a parameter-name pattern to a PartitionSpec over the mesh axes, for the array as
stored (kernels are (in, out)). The same rules shard the optimizer state: AdamW's moments sit
under the parameter's own name. A dimension the axis size does not divide stays whole
(replicated along that axis), so any model runs on any mesh; ``describe`` lists those cases.

    embed_tokens  (vocab, hidden)        vocab over tensor, hidden over fsdp
    q/k/v_proj    (hidden, heads*dim)    hidden over fsdp, heads over tensor (bias: heads over tensor)
    o_proj        (heads*dim, hidden)    heads over tensor, hidden over fsdp
    gate/up_proj  (hidden, intermediate) hidden over fsdp, intermediate over tensor
    down_proj     (intermediate, hidden) intermediate over tensor, hidden over fsdp
    norms, o_proj bias                   replicated
    score         (hidden, 1)            hidden over fsdp
    router gate   (hidden, experts)      hidden over fsdp
    experts' gate/up (experts, hidden, intermediate), down (experts, intermediate, hidden):
                                         experts over expert, hidden over fsdp, intermediate over tensor
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rmflow.trainer.modeling.quant import Quantized
from rmflow.trainer.moments import Int8Moment

RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens\.embedding$", P("tensor", "fsdp")),
    (r"self_attn\.[qkv]_proj\.kernel$", P("fsdp", "tensor")),
    (r"self_attn\.[qkv]_proj\.bias$", P("tensor")),
    (r"self_attn\.o_proj\.kernel$", P("tensor", "fsdp")),
    (r"self_attn\.o_proj\.bias$", P()),
    (r"mlp\.(gate|up)_proj\.kernel$", P("fsdp", "tensor")),
    (r"mlp\.(gate|up)_proj\.bias$", P("tensor")),
    (r"mlp\.down_proj\.kernel$", P("tensor", "fsdp")),
    (r"mlp\.down_proj\.bias$", P()),
    (r"(norm|layernorm)\.weight$", P()),
    (r"score\.kernel$", P("fsdp", None)),
    (r"mlp\.gate\.kernel$", P("fsdp", None)),
    (r"mlp\.experts\.(gate|up)_proj$", P("expert", "fsdp", "tensor")),
    (r"mlp\.experts\.down_proj$", P("expert", "tensor", "fsdp")),
)


# Attributes naming how an array is held, not which: an NNX variable's value, an int8 moment's
# or a quantised weight's codes and block scales (sharded by their parameter's rule).
_STORAGE = frozenset(("value", *Int8Moment._fields, *(f.name for f in dataclasses.fields(Quantized))))


def param_name(path: tuple) -> str:
    """A pytree path to a dotted name: ``model.layers.0.self_attn.q_proj.kernel``."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey) and k.name not in _STORAGE:
            parts.append(k.name)
    return ".".join(parts)


def spec_for(name: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of one array: the first matching rule, with every axis that does not
    divide its dimension dropped; scalars and unmatched names are replicated."""
    if not shape:
        return P()
    for pattern, spec in RULES:
        if re.search(pattern, name):
            if len(spec) > len(shape):
                return P()
            dims = []
            for size, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
                dims.append(axis if axis is not None and size % mesh.shape[axis] == 0 else None)
            return P(*dims)
    return P()


def shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every leaf of ``tree`` (parameters, optimizer state, a whole train state)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_for(param_name(path), getattr(x, "shape", ()), mesh)), tree)


def describe(tree: Any, mesh: Mesh) -> list[tuple[str, tuple[int, ...], P]]:
    """(name, shape, spec) of every array, for logs and tests."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = param_name(path)
        out.append((name, tuple(getattr(x, "shape", ())), spec_for(name, tuple(getattr(x, "shape", ())), mesh)))
    return out
