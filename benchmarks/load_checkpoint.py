"""Seconds to load a Hugging Face checkpoint into rmflow (``load_reward_model``) in a fresh
process, imports included: the cost every load pays (`rmflow serve`'s start, eval, score, export,
training from a checkpoint). By default a SmolLM2-135M-shaped causal LM with random weights,
built with transformers and saved once into ``--checkpoint``.

    .venv/bin/python benchmarks/load_checkpoint.py [--checkpoint /tmp/smol_ck] [--repeat 3]

To compare two versions of the loader, run it on each in turn, alternating, on the same checkpoint.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys

LOAD = ("import time; t = time.perf_counter(); import jax; from flax import nnx; "
        "from rmflow.trainer.modeling.convert import load_reward_model; "
        "m = load_reward_model({path!r}); jax.block_until_ready(nnx.state(m)); print(time.perf_counter() - t)")


def smollm2_shaped(folder: pathlib.Path) -> None:
    """A SmolLM2-135M-shaped Llama causal LM, random weights (the load does not depend on them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                                 max_position_embeddings=8192)).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="/tmp/smol_ck", help="a checkpoint folder (made if it has no config.json)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    folder = pathlib.Path(a.checkpoint)
    if not (folder / "config.json").exists():
        smollm2_shaped(folder)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    times = []
    for _ in range(a.repeat):
        out = subprocess.run([sys.executable, "-c", LOAD.format(path=str(folder))], capture_output=True, text=True,
                             env=env, check=True).stdout
        times.append(float(out.strip().splitlines()[-1]))
    print(f"load {folder}: median {statistics.median(times):.2f} s over {len(times)} processes "
          f"({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
