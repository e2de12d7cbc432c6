"""A reward server's shapes: packed rows (the default for outcome models) against one
conversation a row (the shapes it compiled before), in one process, alternating.

For each side, from an empty in-process cache and with no persistent compilation cache: the
programs compiled at start-up and the seconds they take before a server would say ready (what
`rmflow serve` does before /health is 200: the server's shapes, its token budget and rows,
response units on) and until all are compiled (packed rows compile the row counts between one
and a full forward in the background, once ready), then
the seconds to score the same HH-RLHF conversations (``scorer.score``: as the server's batcher
cuts a long queue) and the largest difference between the two sides' scores.

    .venv/bin/python benchmarks/serve_shapes.py RUN_OR_EXPORT [--n 400] [--repeat 3]
        [--token-budget 16384] [--max-batch-rows 64] [--startup-length 0]

(RUN_OR_EXPORT: e.g. the demo's export, ``make demo`` then ``demo-output/export``.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RMFLOW_COMPILATION_CACHE", "off")

from serve import conversations  # noqa: E402 - after the cache setting: it imports rmflow


def side(rm, packed: bool, a, encoded) -> dict:
    import jax
    from rmflow.trainer.compilation import use_compilation_cache

    use_compilation_cache("off")
    jax.clear_caches()
    rm._scorers.clear()
    shapes = rm.shapes(a.max_batch_rows, a.token_budget, small_batches=True, packed=packed)
    scorer = rm.scorer(shapes)
    startup = a.startup_length or rm.trained_max_length or rm.max_length
    t = time.perf_counter()
    scorer.warm_up(units=True, up_to=startup)
    warm = time.perf_counter() - t  # what a server waits for before it says ready
    while getattr(scorer, "warming", False):  # packed: the row counts compiled right after, in the background
        time.sleep(0.01)
    after = time.perf_counter() - t
    programs = len(scorer.compiled)
    t = time.perf_counter()
    scores = scorer.score(encoded)
    return {"warm": warm, "all": after, "programs": programs, "score": time.perf_counter() - t, "scores": scores,
            "after": len(scorer.compiled) - programs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--max-batch-rows", type=int, default=64)
    ap.add_argument("--startup-length", type=int, default=0)
    a = ap.parse_args()
    from rmflow import RewardModel

    rm = RewardModel.load(a.model)
    convs = [c for c in conversations(a.n * 2) if len(rm.encode(c)) <= rm.max_length][: a.n]
    encoded = [rm.encode(c) for c in convs]
    runs: dict[str, list[dict]] = {"one a row": [], "packed": []}
    for rep in range(a.repeat):
        order = [False, True] if rep % 2 == 0 else [True, False]
        for packed in order:
            runs["packed" if packed else "one a row"].append(side(rm, packed, a, encoded))
    tokens = sum(map(len, encoded))
    print(f"{rm.description}: {len(encoded)} HH-RLHF conversations ({tokens:,} tokens), max_length {rm.max_length}, "
          f"token budget {a.token_budget}, {a.max_batch_rows} rows at most; median (min..max) of {a.repeat}, "
          "no compilation cache")
    print("| shapes | programs at start-up | seconds compiling before ready | all of them | scoring s | "
          "programs compiled scoring | tokens/s scoring |\n| --- | ---: | --- | --- | --- | ---: | ---: |")
    for name, rs in runs.items():
        w, s, al = [r["warm"] for r in rs], [r["score"] for r in rs], [r["all"] for r in rs]
        print(f"| {name} | {rs[0]['programs']} | {statistics.median(w):.1f} ({min(w):.1f}..{max(w):.1f}) "
              f"| {statistics.median(al):.1f} ({min(al):.1f}..{max(al):.1f}) "
              f"| {statistics.median(s):.1f} ({min(s):.1f}..{max(s):.1f}) | {rs[0]['after']} "
              f"| {tokens / statistics.median(s):,.0f} |")
    diff = max(abs(float(x) - float(y)) for x, y in zip(runs["packed"][0]["scores"], runs["one a row"][0]["scores"]))
    print(f"largest |score difference| packed vs one a row: {diff:.2e}")


if __name__ == "__main__":
    main()
