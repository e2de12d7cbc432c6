"""The reward server's Prometheus metrics (``GET /metrics``, text exposition format), in a
registry of its own: requests and errors by endpoint and reason, queue depth, batch sizes in
items and tokens, tokens scored (and per second over the last few seconds), request latency,
forward-pass time and queue wait."""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # no *_created series: counters and histograms only

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATE_WINDOW_S = 10.0


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("rmflow_requests", "Requests answered, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("rmflow_request_errors", "Requests refused or failed, by endpoint and reason.",
                              ["endpoint", "reason"], registry=r)
        self.sequences = Counter("rmflow_sequences_scored", "Sequences scored.", registry=r)
        self.tokens = Counter("rmflow_tokens_scored", "Real (unpadded) tokens run: one prompt's K responses "
                                                      "with their prompt once.", registry=r)
        self.template_mismatches = Counter("rmflow_template_mismatches",
                                           "Rendered texts without the reward model's assistant marker.", registry=r)
        Gauge("rmflow_queue_depth", "Sequences waiting for a forward pass.", registry=r).set_function(queue_depth)
        Gauge("rmflow_tokens_per_second", f"Real tokens scored per second over the last {RATE_WINDOW_S:g} s.",
              registry=r).set_function(self._rate)
        self.ready = Gauge("rmflow_ready", "1 once the model is loaded and every batch shape compiled.", registry=r)
        self.batch_items = Histogram("rmflow_batch_sequences", "Sequences per forward pass.", buckets=SIZE_BUCKETS,
                                     registry=r)
        self.batch_tokens = Histogram("rmflow_batch_tokens", "Real tokens per forward pass.", buckets=TOKEN_BUCKETS,
                                      registry=r)
        self.latency = Histogram("rmflow_request_latency_seconds", "Request latency, received to answered.",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.forward = Histogram("rmflow_forward_seconds", "Time of one forward pass.", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.queue_wait = Histogram("rmflow_queue_wait_seconds", "Oldest item's wait before its forward pass.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def watch(self, signal) -> None:
        """Gauges of the reward-hacking signals (``monitor.RewardMonitor``): ``signal(name)`` is
        the value of one (nan while it has none)."""
        for name, text in (("drift", "Window mean score minus the model's held-out mean, in held-out stds."),
                           ("length_correlation", "Pearson's r of score and tokens over the window."),
                           ("over_trained_length", "Share of the window longer than the model was trained on."),
                           ("score_mean", "Mean score over the window."), ("score_std", "Std of the scores over the window."),
                           ("spread", "An ensemble's mean members' std over the window."),
                           ("spread_ratio", "An ensemble's spread against its held-out spread.")):
            Gauge(f"rmflow_monitor_{name}", text, registry=self.registry).set_function(
                lambda name=name: signal(name))

    def batch(self, stats) -> None:
        """One forward pass (``batcher.BatchStats``)."""
        self.sequences.inc(stats.sequences)
        self.tokens.inc(stats.tokens)
        self.batch_items.observe(stats.sequences)
        self.batch_tokens.observe(stats.tokens)
        self.forward.observe(stats.seconds)
        self.queue_wait.observe(stats.waited)
        with self._lock:
            self._recent.append((time.monotonic(), stats.tokens))

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)
