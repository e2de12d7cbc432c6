"""The metrics a run logs: a window of training micro-batches summed between logging steps (the
run's metric history, ``metrics.jsonl``, is read and written by ``trainer.rundir``)."""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from rmflow.trainer.objective import Objective


class MetricWindow:
    """Exact sums over one logging window; per-step figures (grad norm, lr) averaged."""

    def __init__(self, objective: Objective, sources: tuple[str, ...] | list[str] = ()):
        """``sources``: the names of a mixture's sets, whose records drawn are counted per window
        (``pairs/NAME``, ``solutions/NAME``)."""
        self.objective, self.sources = objective, tuple(sources)
        self.reset()

    def reset(self):
        self.sums = {k: 0.0 for k in self.objective.sum_keys}
        self.grad_norm, self.steps, self.start = 0.0, 0, time.perf_counter()
        self.real = self.computed = self.total = 0
        self.lr = 0.0
        self.drawn = np.zeros(len(self.sources), np.int64)

    def add(self, m: dict[str, Any], micro: list[dict[str, np.ndarray]], slots: int):
        """``slots``: token slots of the step's batch as the device got it (micro-batches padded
        to one length when accumulating)."""
        self.sums = self.objective.merge(self.sums, {k: np.asarray(m[k], np.float64) for k in self.objective.sum_keys})
        self.grad_norm += float(m["grad_norm"])
        self.lr = float(m["learning_rate"])
        self.steps += 1
        self.real += sum(int(b["real_tokens"]) for b in micro)
        self.computed += sum(int(b["computed_tokens"]) for b in micro)
        self.total += slots
        if self.sources:
            self.drawn += sum(b["source_counts"] for b in micro)

    def finish(self) -> dict[str, Any]:
        seconds = time.perf_counter() - self.start
        if jax.process_count() > 1:  # token counts are per process: add them up (every process logs here)
            from jax.experimental import multihost_utils

            local = np.array([self.real, self.computed, self.total, *self.drawn], np.int64)
            totals = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, local.size).sum(0)
            self.real, self.computed, self.total = (int(v) for v in totals[:3])
            self.drawn = totals[3:]
        out = {**self.objective.metrics(self.sums), "grad_norm": self.grad_norm / max(self.steps, 1), "learning_rate": self.lr,
               "real_tokens": self.real, "tokens_per_second": self.real / seconds if seconds else 0.0,
               "padding_fraction": 1.0 - self.computed / self.total if self.total else 0.0,
               "computed_fraction": self.computed / self.real if self.real else 0.0,
               **{f"{self.objective.kind.units}/{name}": int(n) for name, n in zip(self.sources, self.drawn)}}
        self.reset()
        return out
