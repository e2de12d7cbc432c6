"""Deterministic scoring against the default (packed rows), on real HH-RLHF conversations.

In the Python API (``RewardModel.score_ids``, the conversations already encoded): the two modes'
throughput, alternated, ``--repeat`` times each (median and spread); the largest deviation of
the default's scores from the deterministic ones, absolutely and against the scores' spread; then
the conversations scored in ``--compositions`` random batch compositions (a random order cut into
2 to 12 calls; the default mode in 3 of them): how many scores change by any bit. Over HTTP: `rmflow serve` and
`rmflow serve --deterministic` (fresh processes, alternated), ``--clients`` concurrent clients
each sending its share of a random composition as requests of up to ``--request-items``
conversations: throughput and the scores that differ by any bit from the API's deterministic
ones (the deterministic server: none allowed).

    .venv/bin/python benchmarks/deterministic.py [--model RUN_OR_EXPORT] [--n 1000] [--repeat 3]

Without --model it trains the tiny preset for 2 steps on the demo data first (a model's weights
do not change its speed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time

import numpy as np
import requests
from bench_common import load_test_helper
from serve import conversations, default_model, fits, start_server

_helper = load_test_helper("compositions")  # the test's own compositions and bit comparison
bits, compositions = _helper.bits, _helper.compositions


def spread(xs) -> str:
    return f"median {statistics.median(xs):.2f} s, {min(xs):.2f}-{max(xs):.2f} s over {len(xs)}"


def http_run(url: str, convs: list, clients: int, items: int, seed: int) -> tuple[float, np.ndarray]:
    """(wall seconds, scores): ``clients`` threads, each sending its share of a random order in
    requests of 1 to ``items`` conversations."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(convs))
    requests_, k = [], 0
    while k < len(order):
        size = int(rng.integers(1, items + 1))
        requests_.append(order[k : k + size])
        k += size
    shares = [requests_[i::clients] for i in range(clients)]
    out = np.zeros(len(convs), np.float32)

    def client(share):
        session = requests.Session()
        for batch in share:
            r = session.post(url + "/v1/score", json={"conversations": [convs[i] for i in batch]}, timeout=600)
            assert r.status_code == 200, r.text
            out[batch] = r.json()["scores"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, shares))
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a run directory or an export; default: the tiny preset, trained 2 steps")
    ap.add_argument("--n", type=int, default=1000, help="conversations")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32, help="the API's batch size")
    ap.add_argument("--token-budget", type=int, default=8192, help="the servers' token budget")
    ap.add_argument("--max-batch-rows", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compositions", type=int, default=20)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--request-items", type=int, default=16)
    a = ap.parse_args()
    from rmflow import RewardModel

    model = a.model or default_model(tempfile.mkdtemp(prefix="rmflow-bench-deterministic-"))
    rm = RewardModel.load(model)
    rm.limit_length(a.max_length)
    convs = [c for c in conversations(a.n * 2) if fits(rm, c)][: a.n]
    encoded = [rm.encode(c) for c in convs]
    print(f"{len(convs)} HH-RLHF conversations, {sum(map(len, encoded)):,} tokens, max_length {a.max_length}; "
          f"model: {rm.description}")

    def score(deterministic: bool, items=None):
        return rm.score_ids(encoded if items is None else [encoded[i] for i in items], batch_size=a.batch_size,
                            deterministic=deterministic)

    want, packed = score(True), score(False)  # compiled before the timed runs
    times = {True: [], False: []}
    for _ in range(a.repeat):
        for mode in (False, True):
            t = time.perf_counter()
            score(mode)
            times[mode].append(time.perf_counter() - t)
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"API throughput: deterministic {len(convs) / statistics.median(times[True]):,.1f} seq/s "
          f"({spread(times[True])}), default {len(convs) / statistics.median(times[False]):,.1f} seq/s "
          f"({spread(times[False])}): deterministic {ratio:.2f}x the default")
    dev = np.abs(packed - want)
    print(f"default vs deterministic: largest deviation {dev.max():.2e} ({dev.max() / want.std():.1e} of the scores' "
          f"std {want.std():.3f}), median {np.median(dev):.1e}")
    for mode in (True, False):
        first = want if mode else packed
        changed, largest = 0, 0.0
        times_ = a.compositions if mode else min(a.compositions, 3)  # the default's changes show in a few
        for batches in compositions(len(convs), times_, seed=1):
            got = np.zeros(len(convs), np.float32)
            for b in batches:
                got[b] = score(mode, b)
            changed += int((bits(got) != bits(first)).sum())
            largest = max(largest, float(np.abs(got - first).max()))
        print(f"{'deterministic' if mode else 'default'}: {changed} of {len(convs) * times_:,} scores "
              f"differ by any bit over {times_} random compositions (largest change {largest:.1e})")

    walls: dict[bool, list[float]] = {True: [], False: []}
    differ: dict[bool, int] = {True: 0, False: 0}
    for r in range(a.repeat):
        for mode in (False, True):
            proc, url = start_server(model, a, *(["--deterministic"] if mode else []), "--max-queue-wait-s", "0")
            try:
                wall, got = http_run(url, convs, a.clients, a.request_items, seed=100 + r)
            finally:
                proc.kill()
                proc.wait()
            walls[mode].append(wall)
            differ[mode] += int((bits(got) != bits(want)).sum())
    ratio = statistics.median(walls[False]) / statistics.median(walls[True])
    print(f"HTTP, {a.clients} concurrent clients, requests of 1-{a.request_items}: deterministic "
          f"{len(convs) / statistics.median(walls[True]):,.1f} seq/s ({spread(walls[True])}), default "
          f"{len(convs) / statistics.median(walls[False]):,.1f} seq/s ({spread(walls[False])}): deterministic "
          f"{ratio:.2f}x the default; scores differing by any bit from the API's deterministic ones: "
          f"deterministic {differ[True]}, default {differ[False]} of {len(convs) * a.repeat:,}")


if __name__ == "__main__":
    main()
