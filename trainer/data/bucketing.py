"""Length-bucketed batching: pairs of similar length in one micro-batch.

``LengthBuckets`` is a Grain ``MapDataset`` over the shuffled stream: positions are taken in
windows of ``window`` micro-batches; inside a window the records are sorted by length and cut
into micro-batches, whose order is then shuffled with a seed of its own. Each position maps to
one record by a pure function of (seed, position), so the loader's checkpointed state (the
next position) still resumes exactly. The lengths come from the records' headers, read one
window at a time (no pass over the data at start-up).
"""

from __future__ import annotations

import threading

import grain
import numpy as np
from rmflow.schemas.record import peek_lengths


def _raw(item) -> bytes:
    return item[1] if isinstance(item, tuple) else item  # a mixture's records come as (set, bytes)


class LengthBuckets(grain.MapDataset):
    def __init__(self, parent: grain.MapDataset, *, batch_size: int, window: int, seed: int):
        super().__init__(parent)
        self.batch_size, self.span, self.seed = batch_size, batch_size * window, seed
        self._cached: tuple[int, list] | None = None
        self._lock = threading.Lock()  # Grain reads positions from several threads

    def __len__(self) -> int:
        return len(self._parent)

    def __getstate__(self):  # sent to Grain's worker processes: without the lock and the cache
        return {**self.__dict__, "_lock": None, "_cached": None}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return f"LengthBuckets(batch_size={self.batch_size}, window={self.span // self.batch_size}, seed={self.seed})"

    def _window(self, w: int) -> list:
        """Window ``w``'s records, in bucketed order."""
        with self._lock:
            if self._cached is not None and self._cached[0] == w:
                return self._cached[1]
        end = min((w + 1) * self.span, len(self._parent))
        items = [self._parent[pos] for pos in range(w * self.span, end)]
        lengths = [max(peek_lengths(_raw(item))) for item in items]
        by_length = sorted(range(len(items)), key=lambda i: (lengths[i], i))
        batches = [by_length[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
        rng = np.random.default_rng([self.seed, w])
        full = [b for b in batches if len(b) == self.batch_size]
        order = [full[i] for i in rng.permutation(len(full))] + [b for b in batches if len(b) < self.batch_size]
        ordered = [items[i] for b in order for i in b]
        with self._lock:
            self._cached = (w, ordered)
        return ordered

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is past the last record")
        items = self._window(index // self.span)
        return items[index % self.span]
