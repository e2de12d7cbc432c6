"""Random packed-row layouts (numpy only: the device benchmark imports it too)."""

import numpy as np


def packed_layout(rng, b: int, t: int, lengths: tuple[int, int] = (1, 40)):
    """(segment_ids, positions, branch_ids), each (b, t): rows of units, a prompt then two
    branches whose positions both continue from the prompt; part lengths drawn from ``lengths``."""
    seg, pos, br = (np.zeros((b, t), np.int32) for _ in range(3))
    for row in range(b):
        start, s = 0, 1
        while start < t - 20:
            p, c, r = (int(x) for x in rng.integers(*lengths, 3))
            n = min(p + c + r, t - start)
            seg[row, start : start + n] = s
            pos[row, start : start + n] = np.r_[np.arange(p), p + np.arange(c), p + np.arange(r)][:n]
            br[row, start : start + n] = np.r_[np.zeros(p), np.ones(c), np.full(r, 2)][:n]
            start, s = start + n, s + 1
    return seg, pos, br
