"""Random batch compositions, and float32 scores as their bits: what the deterministic-scoring test
and its benchmark (``benchmarks/deterministic.py``, which loads this file by path) compare."""

import numpy as np


def bits(x) -> np.ndarray:
    """float32 values as int32 bit patterns: equal only when every bit is."""
    return np.asarray(x, np.float32).view(np.int32)


def compositions(n: int, times: int, seed: int):
    """``times`` random ways to cut items 0..n-1 into batches: a random order, cut in 2 to 12 at random."""
    rng = np.random.default_rng(seed)
    for _ in range(times):
        order = rng.permutation(n)
        yield np.split(order, np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(1, min(n, 12))),
                                                 replace=False)))
