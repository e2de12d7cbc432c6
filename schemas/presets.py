"""Random-init model presets: the names ``--model`` accepts besides a checkpoint.

One table, read by the config (a preset name is not a path), the trainer (the architecture),
export and the workflow. Each preset is a Llama; its vocabulary comes from the shards.

* ``tiny``: 4 layers, hidden 256: the demo's model and the benchmarks'.
* ``micro``: 2 layers, hidden 64: a smoke-test model, far cheaper than tiny to compile and run,
  what the test suite trains.
"""

from __future__ import annotations

from typing import Any

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
    "micro": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32),
}
# What every preset shares.
PRESET_BASE: dict[str, Any] = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0,
                                   max_position_embeddings=4096)


def is_preset(model: str) -> bool:
    """Whether ``--model`` names a random-init preset rather than a checkpoint."""
    return model in MODEL_PRESETS


def describe(name: str) -> str:
    p = MODEL_PRESETS[name]
    return f"{name} ({p['num_hidden_layers']} layers, hidden {p['hidden_size']})"
