"""Random packed-row layouts (numpy only: the device benchmark imports it too)."""

import numpy as np


def packed_layout(rng, b: int, t: int, lengths: tuple[int, int] = (1, 40), branches: int = 2):
    """(segment_ids, positions, branch_ids), each (b, t): rows of units, a prompt then
    ``branches`` branches (a pair's two replies, or K responses) whose positions all continue from
    the prompt; part lengths drawn from ``lengths``."""
    seg, pos, br = (np.zeros((b, t), np.int32) for _ in range(3))
    for row in range(b):
        start, s = 0, 1
        while start < t - 20:
            p, *parts = (int(x) for x in rng.integers(*lengths, 1 + branches))
            n = min(p + sum(parts), t - start)
            seg[row, start : start + n] = s
            pos[row, start : start + n] = np.concatenate([np.arange(p), *(p + np.arange(c) for c in parts)])[:n]
            br[row, start : start + n] = np.concatenate([np.zeros(p), *(np.full(c, i + 1) for i, c in
                                                                        enumerate(parts))])[:n]
            start, s = start + n, s + 1
    return seg, pos, br
