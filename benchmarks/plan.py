"""How much of a scoring plan's compute is real tokens: ``ScoringShapes.plan`` (the cut with the
fewest padded tokens) against a greedy cut (sorted, a new batch only when the rows run out),
on the lengths of real HH-RLHF conversations, for server-sized takes of k queued requests and for
the whole set at once. Pure arithmetic over the batch shapes (no model runs).

    .venv/bin/python benchmarks/plan.py [--n 512] [--max-length 512] [--token-budget 8192]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
from bench_common import REPO
from serve import conversations


def greedy_cut(shapes, lengths):
    batches = []
    for i in np.argsort(lengths, kind="stable"):
        if not batches or len(batches[-1]) + 1 > shapes.rows(shapes.length_for(int(lengths[i]))):
            batches.append([])
        batches[-1].append(i)
    return [np.asarray(b) for b in batches]


def computed(shapes, batches, lengths) -> int:
    total = 0
    for b in batches:
        length = shapes.length_for(int(lengths[b].max()))
        total += shapes.rows_for(len(b), length) * length
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--max-batch-rows", type=int, default=64)
    a = ap.parse_args()
    from rmflow.pipelines.tokenizer_files import load_tokenizer_assets
    from rmflow.rendering.tokenize import RecordTokenizer, build_tokenizer
    from rmflow.trainer.inference import ScoringShapes

    tok = RecordTokenizer(build_tokenizer(load_tokenizer_assets(str(REPO / "rmflow" / "demo" / "tokenizer"))))
    lengths = np.asarray([len(tok.encode_text(tok.render_text(tuple((m["role"], m["content"]) for m in c))))
                          for c in conversations(2 * a.n)])
    lengths = lengths[lengths <= a.max_length][: a.n]
    shapes = ScoringShapes(a.max_length, max_rows=a.max_batch_rows, token_budget=a.token_budget, small_batches=True)
    rng = np.random.default_rng(0)
    print(f"{len(lengths)} HH-RLHF conversations (median {int(np.median(lengths))} tokens); real / computed tokens:")
    for k in (16, 32, 48, 64, len(lengths)):
        real = plan = greedy = 0
        for _ in range(200 if k < len(lengths) else 1):
            take = rng.choice(lengths, k, replace=False) if k < len(lengths) else lengths
            real += int(take.sum())
            plan += computed(shapes, shapes.plan(take), take)
            greedy += computed(shapes, greedy_cut(shapes, take), take)
        print(f"  {'all' if k == len(lengths) else k:>4} queued: plan {real / plan:.2f}, greedy cut {real / greedy:.2f}")


if __name__ == "__main__":
    main()
