"""Record decode speed (the training hot path) against pickle of the same fields.

Builds records from real token lengths (the shared HH-RLHF data's p50 is about 220 tokens a
side), then times `schemas.record.decode` (magic, version, CRC32, bounds, zero-copy
arrays) beside `pickle.loads` of a dict holding the same arrays (no integrity checks).

    .venv/bin/python benchmarks/codec.py [--records 20000]
"""

from __future__ import annotations

import argparse
import pickle
import time

import numpy as np
from rmflow.schemas.record import PairRecord, decode, encode


def best_of(fn, items, repeat=5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for x in items:
            fn(x)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(args.records):
        n_c, n_r, p = int(rng.integers(60, 500)), int(rng.integers(60, 500)), 40
        c = rng.integers(0, 49152, n_c, dtype=np.int32)
        r = np.r_[c[:p], rng.integers(0, 49152, n_r - p)].astype(np.int32)
        recs.append(PairRecord(c, r, n_c - 1, n_r - 1, p, rng.bytes(16).hex(), "hh.jsonl.gz", margin=0.5))
    ours = [encode(r) for r in recs]
    pickled = [pickle.dumps({k: getattr(r, k) for k in ("chosen_ids", "rejected_ids", "chosen_last",
                             "rejected_last", "prompt_len", "pair_id", "source", "margin", "subset")},
                            protocol=pickle.HIGHEST_PROTOCOL) for r in recs]
    t_ours, t_ref = best_of(decode, ours), best_of(pickle.loads, pickled)
    print(f"{args.records} records, mean {np.mean([len(b) for b in ours]):.0f} bytes each (best of 5)")
    print(f"{'rmflow decode (CRC-checked)':30} {args.records / t_ours:12,.0f} records/s")
    print(f"{'pickle.loads (reference)':30} {args.records / t_ref:12,.0f} records/s")
    print(f"ratio rmflow / pickle: {t_ref / t_ours:.2f}x")


if __name__ == "__main__":
    main()
