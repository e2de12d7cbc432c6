"""Dynamic batching for the reward server: requests from many clients share forward passes.

Handlers ``submit`` encoded items (token ids, with their size in tokens) and await one future
per item; a single device thread takes what is queued once a token budget's worth is there or
``max_wait`` after the oldest item came (at most a few budgets' worth), cuts it into batches of the model's fixed shapes
(shortest first) and runs them one after another, resolving each item's future with its own
result. The HTTP event loop never touches the device. A bounded queue refuses new work when
full (the server answers 503 with Retry-After) instead of growing without limit; ``close``
stops taking new items and finishes every queued one before the thread ends.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

TAKE_BUDGETS = 4  # token budgets taken from the queue at once, at most


class QueueFull(Exception):
    """The queue holds ``max_queue`` items already: try again shortly."""


class Closed(Exception):
    """The batcher is shutting down and takes no new items."""


@dataclasses.dataclass
class _Item:
    payload: Any
    size: int
    future: concurrent.futures.Future
    queued_at: float


@dataclasses.dataclass
class BatchStats:
    """What one forward pass did (the metrics endpoint's histograms read these)."""

    items: int
    tokens: int
    seconds: float
    waited: float  # the oldest item's time in the queue before its batch ran


class DynamicBatcher:
    """``run(payloads) -> results`` scores one batch; ``plan(sizes) -> [index arrays]`` cuts a
    list of item sizes into batches that ``run`` accepts (``ScoringShapes.plan``)."""

    def __init__(self, run: Callable[[list], Sequence[Any]], plan: Callable[[list[int]], list], *,
                 token_budget: int, max_wait_s: float = 0.005, max_queue: int = 4096,
                 on_batch: Callable[[BatchStats], None] | None = None):
        self._run, self._plan, self._on_batch = run, plan, on_batch
        self.token_budget, self.max_wait_s, self.max_queue = token_budget, max_wait_s, max_queue
        self._queue: collections.deque[_Item] = collections.deque()
        self._queued_tokens = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="rmflow-batcher", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Items waiting for a forward pass."""
        return len(self._queue)

    def submit(self, payloads: Sequence[Any], sizes: Sequence[int]) -> list[concurrent.futures.Future]:
        """Queue a request's items together (all or none); one future per item, in order."""
        now = time.monotonic()
        items = [_Item(p, int(n), concurrent.futures.Future(), now) for p, n in zip(payloads, sizes)]
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down")
            if len(self._queue) + len(items) > self.max_queue:
                raise QueueFull(f"{len(self._queue)} items queued, at most {self.max_queue}")
            self._queue.extend(items)
            self._queued_tokens += sum(i.size for i in items)
            self._cond.notify()
        return [i.future for i in items]

    def close(self, timeout: float | None = None) -> None:
        """Take no new items; return once every queued item has its result (or ``timeout``)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    def _take(self) -> list[_Item] | None:
        """Block until there is work; then wait for a full budget or the oldest item's deadline."""
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            deadline = self._queue[0].queued_at + self.max_wait_s
            while self._queued_tokens < self.token_budget and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            # Up to a few budgets' worth: sorted together by length, they cut into fuller batches
            # of like lengths than one budget's worth would (the batches still run one by one).
            taken, tokens = [], 0
            while self._queue and (not taken or tokens + self._queue[0].size <= TAKE_BUDGETS * self.token_budget):
                item = self._queue.popleft()
                taken.append(item)
                tokens += item.size
            self._queued_tokens -= tokens
            return taken

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            for batch in self._plan([i.size for i in taken]):
                items = [taken[k] for k in batch]
                live = [i for i in items if i.future.set_running_or_notify_cancel()]
                if not live:
                    continue
                start = time.monotonic()
                try:
                    results = self._run([i.payload for i in live])
                except Exception as e:  # noqa: BLE001 - the batch's clients get the error; the server stays up
                    for i in live:
                        i.future.set_exception(e)
                    continue
                for i, r in zip(live, results):
                    i.future.set_result(r)
                if self._on_batch:
                    self._on_batch(BatchStats(len(live), sum(i.size for i in live), time.monotonic() - start,
                                              start - min(i.queued_at for i in live)))
