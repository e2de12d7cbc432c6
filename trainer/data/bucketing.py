"""Length-bucketed batching: pairs of similar length in one micro-batch.

``LengthBucketSampler`` wraps Grain's shuffled ``IndexSampler``: positions are taken in
windows of ``window`` micro-batches; inside a window the records are sorted by length and cut
into micro-batches, whose order is then shuffled with a seed of its own. Each position maps to
one record by a pure function of (seed, position), so the loader's checkpointed state (the
last position read) still resumes exactly. The lengths come from the records' headers, read
one window at a time (no pass over the data at start-up).
"""

from __future__ import annotations

import numpy as np
from rmflow.schemas.record import peek_lengths


class LengthBucketSampler:
    def __init__(self, base, source, *, batch_size: int, window: int, seed: int):
        self.base, self.source = base, source
        self.batch_size, self.span, self.seed = batch_size, batch_size * window, seed
        self._cached: tuple[int, list] | None = None

    def __repr__(self) -> str:  # Grain checks a restored state against the sampler's repr
        return (f"LengthBucketSampler(base={self.base!r}, batch_size={self.batch_size}, "
                f"window={self.span // self.batch_size}, seed={self.seed})")

    def __len__(self) -> int:
        return len(self.base)

    def _window(self, w: int) -> list:
        """The base sampler's metadata for window w, in bucketed order."""
        if self._cached is not None and self._cached[0] == w:
            return self._cached[1]
        metas = []
        for pos in range(w * self.span, (w + 1) * self.span):
            try:
                metas.append(self.base[pos])
            except IndexError:  # the last epoch ends inside this window
                break
        lengths = [max(peek_lengths(self.source[m.record_key])) for m in metas]
        by_length = sorted(range(len(metas)), key=lambda i: (lengths[i], i))
        batches = [by_length[i : i + self.batch_size] for i in range(0, len(metas), self.batch_size)]
        rng = np.random.default_rng([self.seed, w])
        full = [b for b in batches if len(b) == self.batch_size]
        order = [full[i] for i in rng.permutation(len(full))] + [b for b in batches if len(b) < self.batch_size]
        ordered = [metas[i] for b in order for i in b]
        self._cached = (w, ordered)
        return ordered

    def __getitem__(self, index: int):
        metas = self._window(index // self.span)
        offset = index % self.span
        if offset >= len(metas):
            raise IndexError(f"index {index} is past the last record")
        m = metas[offset]
        return type(m)(index=index, record_key=m.record_key, rng=m.rng)
