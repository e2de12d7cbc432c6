"""Blockwise attention over packed rows of K branches a unit, forward and backward, against the
kernel at another git revision (``--against REV``: the change to measure is what lies between),
in one process, alternated, median and spread of the repeats.

    .venv/bin/python benchmarks/attention_branches.py --against REV [--tokens 4096] [--repeat 6]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

from bench_common import REPO

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def kernel_at(revision: str, folder: str):
    """The attention module of ``revision`` (its blockwise kernel), loaded from a copy."""
    text = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:trainer/modeling/attention.py"],
                          check=True, capture_output=True, text=True).stdout
    path = os.path.join(folder, "attention_then.py")
    pathlib.Path(path).write_text(text)
    spec = importlib.util.spec_from_file_location("attention_then", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_common import load_test_helper
    from rmflow.trainer.modeling import attention as now

    packed_layout = load_test_helper("layouts").packed_layout

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the git revision whose kernel to compare with")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=6)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        then = kernel_at(a.against, tmp)
        rng = np.random.default_rng(0)
        b, n, k, d = 1, 4, 2, 64
        print(f"| branches a unit | part lengths | {a.against} ms | now ms | faster by |\n| ---: | --- | ---: | ---: | ---: |")
        for branches, lengths in ((6, (50, 400)), (2, (100, 600))):
            seg, pos, br = packed_layout(rng, b, a.tokens, lengths=lengths, branches=branches)
            q = jnp.asarray(rng.normal(size=(b, a.tokens, n, d)), jnp.float32)
            kv = [jnp.asarray(rng.normal(size=(b, a.tokens, k, d)), jnp.float32) for _ in range(2)]
            fns = {}
            for name, mod in (("then", then), ("now", now)):
                def total(q, k, v, mod=mod, layout=(seg, pos, br)):
                    return mod.blockwise_attention(q, k, v, *layout).sum()

                fns[name] = jax.jit(jax.grad(total, argnums=(0, 1, 2)))
                jax.block_until_ready(fns[name](q, *kv))  # compiled before timing
            times: dict[str, list[float]] = {"then": [], "now": []}
            for rep in range(a.repeat):
                for name in ("then", "now") if rep % 2 == 0 else ("now", "then"):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fns[name](q, *kv))
                    times[name].append(time.perf_counter() - t0)
            ms = {name: [1000 * t for t in ts] for name, ts in times.items()}
            med = {name: statistics.median(v) for name, v in ms.items()}
            print(f"| {branches} | {lengths[0]}-{lengths[1]} | {med['then']:.0f} ({min(ms['then']):.0f}-"
                  f"{max(ms['then']):.0f}) | {med['now']:.0f} ({min(ms['now']):.0f}-{max(ms['now']):.0f}) | "
                  f"{med['then'] / med['now']:.2f}x |")


if __name__ == "__main__":
    main()
