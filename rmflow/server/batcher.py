"""Dynamic batching for the reward server: requests from many clients share forward passes.

Handlers ``submit`` a request's encoded items (token ids, with their size in tokens) and await
one future per item; a single device thread takes what is queued once a token budget's worth is
there or ``max_wait_s`` after the oldest item came (at most a few budgets' worth), cuts it into
batches of the model's fixed shapes (shortest first) and runs them one after another, resolving
each item's future with its own result. The HTTP event loop never touches the device.

* Fair: the queue keeps each request's items apart and a take draws from the waiting requests in
  arrival order, at most one token budget from each a pass: requests finish in the order they
  came, yet a small request never waits behind all of a big one's.
* Bounded: a new request is refused (``QueueFull``: the server answers 503 with Retry-After) when
  the queue would hold more than ``max_queue`` sequences (a unit of K responses counts K), or
  when the work ahead of it would take longer than ``max_queue_wait_s`` at the throughput the
  forward passes have measured; an empty queue always takes a request. Clients that would time out waiting get an answer they can retry instead.
* Cancellable: ``cancel`` drops a request's waiting items (its client went away).
* ``close`` stops taking new items and finishes every queued one; ``cut`` fails the waiting ones
  with ``Closed`` (a shutdown out of time): the batch on the device still finishes.
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
    """The queue is full (items, or estimated wait): try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Closed(Exception):
    """The batcher is shutting down and takes no new items (or cut the waiting ones)."""


@dataclasses.dataclass
class _Item:
    payload: Any
    size: int
    future: concurrent.futures.Future
    queued_at: float
    sequences: int = 1  # the conversations it scores (a unit of one prompt's responses: several)


class Submitted(list):
    """A request's futures, one per item in order; ``request`` names it for ``cancel``."""

    request: int


@dataclasses.dataclass
class BatchStats:
    """What one forward pass did (the metrics endpoint's histograms read these)."""

    items: int  # rows: items run
    tokens: int  # tokens run (a unit's prompt once)
    sequences: int  # conversations scored
    seconds: float
    waited: float  # the oldest item's time in the queue before its batch ran


RATE_SMOOTHING = 0.3  # weight of the newest take in the measured throughput (tokens per second)


class DynamicBatcher:
    """``run(payloads) -> results`` scores one batch; ``plan(sizes) -> [index arrays]`` cuts a
    list of item sizes into batches that ``run`` accepts (``ScoringShapes.plan``); with ``group``,
    ``plan(sizes, groups=[group(payload), ...])`` (what besides its size fixes an item's place in a
    batch: ``Scorer.group``)."""

    def __init__(self, run: Callable[[list], Sequence[Any]], plan: Callable[..., list], *,
                 token_budget: int, max_wait_s: float = 0.005, max_queue: int = 4096,
                 max_queue_wait_s: float | None = None, on_batch: Callable[[BatchStats], None] | None = None,
                 group: Callable[[Any], Any] | None = None):
        self._run, self._plan, self._on_batch, self._group = run, plan, on_batch, group
        self.token_budget, self.max_wait_s, self.max_queue = token_budget, max_wait_s, max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self._requests: collections.OrderedDict[int, collections.deque[_Item]] = collections.OrderedDict()
        self._next_request = 0
        self._queued_items = self._queued_tokens = self._running_tokens = 0
        self.tokens_per_second: float | None = None  # measured on the forward passes; None until one ran
        self._measured_full = False
        self._cond = threading.Condition()
        self._closing = False
        self._cut: str | None = None
        self.cut_items = 0  # items ``cut`` failed, from the queue and from the take in hand
        self._thread = threading.Thread(target=self._loop, name="rmflow-batcher", daemon=True)
        self._thread.start()

    @property
    def cut_reason(self) -> str | None:
        """Why ``cut`` failed the waiting items; None while it has not."""
        return self._cut

    @property
    def depth(self) -> int:
        """Sequences (conversations) waiting for a forward pass."""
        return self._queued_items

    def estimated_wait(self, extra_tokens: int = 0) -> float | None:
        """Seconds until the queued work (and ``extra_tokens`` more) is done, at the measured rate."""
        rate = self.tokens_per_second
        return None if not rate else (self._queued_tokens + self._running_tokens + extra_tokens) / rate

    def submit(self, payloads: Sequence[Any], sizes: Sequence[int], sequences: Sequence[int] | None = None
               ) -> Submitted:
        """Queue a request's items together (all or none); one future per item, in order.
        ``sequences``: the conversations each item scores (default one)."""
        now = time.monotonic()
        items = [_Item(p, int(n), concurrent.futures.Future(), now, int(k))
                 for p, n, k in zip(payloads, sizes, sequences or [1] * len(payloads))]
        tokens = sum(i.size for i in items)
        with self._cond:
            if self._closing:
                raise Closed(self._cut or "the server is shutting down")
            if self._queued_items + sum(i.sequences for i in items) > self.max_queue:
                raise QueueFull(f"{self._queued_items} sequences queued, at most {self.max_queue}")
            ahead = self.estimated_wait()  # the work before this request's own (however big it is)
            if self.max_queue_wait_s and self._queued_items and ahead is not None and ahead > self.max_queue_wait_s:
                raise QueueFull(f"about {ahead:.1f} s of work queued ahead of this request, at most "
                                f"{self.max_queue_wait_s:g} s (--max-queue-wait-s)",
                                retry_after=max(1.0, ahead - self.max_queue_wait_s / 2))
            out = Submitted(i.future for i in items)
            out.request = self._next_request
            self._next_request += 1
            if not items:
                return out
            self._requests[out.request] = collections.deque(items)
            self._queued_items += sum(i.sequences for i in items)
            self._queued_tokens += tokens
            self._cond.notify()
        return out

    def cancel(self, submitted: Submitted) -> int:
        """Drop a request's items that have not run (its client went away); how many were dropped."""
        with self._cond:
            waiting = self._requests.pop(submitted.request, collections.deque())
            self._queued_items -= sum(i.sequences for i in waiting)
            self._queued_tokens -= sum(i.size for i in waiting)
        return sum(f.cancel() for f in submitted)  # taken but not yet run: skipped by the loop

    def close(self, timeout: float | None = None) -> None:
        """Take no new items; return once every queued item has its result (or ``timeout``)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    def cut(self, reason: str) -> int:
        """Take no new items and fail every item not yet on the device with ``Closed(reason)``
        (the batch running finishes); how many were failed here (the loop fails the rest of its take)."""
        with self._cond:
            self._closing, self._cut = True, reason
            waiting = [i for q in self._requests.values() for i in q]
            self._requests.clear()
            self._queued_items = self._queued_tokens = 0
            self._cond.notify()
        for i in waiting:
            if i.future.set_running_or_notify_cancel():
                i.future.set_exception(Closed(reason))
        self.cut_items += len(waiting)
        return len(waiting)

    def _take(self) -> list[_Item] | None:
        """Block until there is work; then wait for a full budget or the oldest item's deadline,
        and take up to a few budgets' worth, at most a budget from each waiting request a pass."""
        with self._cond:
            while not self._requests:
                if self._closing:
                    return None
                self._cond.wait()
            deadline = min(q[0].queued_at for q in self._requests.values()) + self.max_wait_s
            while self._queued_tokens < self.token_budget and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
                if not self._requests:  # cancelled or cut while waiting
                    return []
            # Up to a few budgets' worth: sorted together by length, they cut into fuller batches
            # of like lengths than one budget's worth would (the batches still run one by one).
            # Requests in arrival order, at most one budget from each a pass: requests finish in
            # the order they came (as they would first come, first served), yet one big request
            # never holds the device while the small ones behind it wait.
            taken, tokens, cap = [], 0, TAKE_BUDGETS * self.token_budget
            while self._requests and tokens < cap:
                took = False
                for request in list(self._requests):
                    waiting, mine = self._requests[request], 0
                    while waiting and mine < self.token_budget and (not taken or tokens + waiting[0].size <= cap):
                        item = waiting.popleft()
                        taken.append(item)
                        tokens += item.size
                        mine += item.size
                        took = True
                    if not waiting:
                        del self._requests[request]
                    if tokens >= cap:
                        break
                if not took:
                    break
            self._queued_items -= sum(i.sequences for i in taken)
            self._queued_tokens -= tokens
            self._running_tokens = tokens
            return taken

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            try:
                self._run_take(taken)
            except Exception as e:  # noqa: BLE001 - a bug in planning or metrics: this take's clients get it
                for i in taken:  # those still without a result; the thread goes on serving
                    f = i.future
                    if not f.done() and (f.running() or f.set_running_or_notify_cancel()):
                        f.set_exception(e)
            with self._cond:
                self._running_tokens = 0

    def _run_take(self, taken: list[_Item]) -> None:
        """One take's batches, one after another; then the throughput they ran at."""
        started, done_tokens = time.monotonic(), 0
        sizes = [i.size for i in taken]
        plan = self._plan(sizes) if self._group is None else \
            self._plan(sizes, groups=[self._group(i.payload) for i in taken])
        for batch in plan:
            items = [taken[k] for k in batch]
            if self._cut is not None:  # a shutdown out of time: nothing more goes to the device
                for i in items:
                    if i.future.set_running_or_notify_cancel():
                        i.future.set_exception(Closed(self._cut))
                        self.cut_items += 1
                continue
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
            done_tokens += sum(i.size for i in live)
            if self._on_batch:
                self._on_batch(BatchStats(len(live), sum(i.size for i in live), sum(i.sequences for i in live),
                                          time.monotonic() - start,
                                          start - min(i.queued_at for i in live)))
        elapsed = time.monotonic() - started
        with self._cond:
            if done_tokens and elapsed > 0:
                self._measure(done_tokens / elapsed, full=done_tokens >= self.token_budget)

    def _measure(self, rate: float, full: bool) -> None:
        """The throughput a backlog runs at: takes of a full budget or more (what a queue is worked
        off in) are averaged; smaller ones, which underrate it, only count until a full one ran."""
        old = self.tokens_per_second
        if full:
            self.tokens_per_second = rate if not self._measured_full else \
                (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * rate
            self._measured_full = True
        elif not self._measured_full:
            self.tokens_per_second = rate if old is None else max(old, rate)
