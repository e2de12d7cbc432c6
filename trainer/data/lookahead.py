"""A loader iterator that reads batches ahead of the ones it hands out.

The training loop looks at the batches coming next (``ahead``) to compile their shapes in the
background before they are needed. Reading ahead must not move the data order nor the
checkpoint: ``get_state`` is the state right after the last batch handed out, as if nothing had
been read ahead, so a run saved and resumed continues on exactly the next batch.
"""

from __future__ import annotations

import collections
import json
from typing import Any

from rmflow.schemas import jsontext


class Lookahead:
    """Wraps a Grain iterator (anything with ``__next__``, ``get_state`` and ``set_state``),
    keeping up to ``depth`` batches read ahead; checkpoint it as ``checkpointable(it)``."""

    def __init__(self, iterator, depth: int):
        self._it = iterator
        self._depth = depth
        self._buffer: collections.deque[tuple[Any, Any]] = collections.deque()  # (batch, state after it)
        self._state = iterator.get_state()

    def __iter__(self):
        return self

    def _fill(self, n: int) -> None:
        while len(self._buffer) < n:
            try:
                batch = next(self._it)
            except StopIteration:
                return
            self._buffer.append((batch, self._it.get_state()))

    def __next__(self):
        self._fill(1)
        if not self._buffer:
            raise StopIteration
        batch, self._state = self._buffer.popleft()
        return batch

    def ahead(self) -> list:
        """The next ``depth`` batches (fewer at the end of the data), still to be handed out."""
        self._fill(self._depth)
        return [b for b, _ in self._buffer]

    def get_state(self):
        return self._state

    def set_state(self, state) -> None:
        self._it.set_state(state)
        self._buffer.clear()
        self._state = state

    def start_prefetch(self) -> None:  # called by Grain's checkpoint handler after a restore
        start = getattr(self._it, "start_prefetch", None)
        if start is not None:
            start()


class JsonState:
    """An iterator as Grain's checkpoint handler takes one that is not a Grain dataset iterator
    (a ``Lookahead``): its state (a dataset iterator's mapping) as JSON bytes."""

    def __init__(self, iterator):
        self.iterator = iterator

    def get_state(self) -> bytes:
        return jsontext.dumps(self.iterator.get_state()).encode()

    def set_state(self, state: bytes) -> None:
        self.iterator.set_state(json.loads(state))

    def start_prefetch(self) -> None:
        self.iterator.start_prefetch()


def checkpointable(iterator):
    """``iterator`` as Grain's checkpoint handler saves and restores it."""
    import grain

    return iterator if isinstance(iterator, grain.DatasetIterator) else JsonState(iterator)

