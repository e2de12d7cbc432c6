"""The metrics a run logs: a window of training micro-batches summed between logging steps, and
the run's metric history (``metrics.jsonl``), rewritten on resume to end at the restored step.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np
from rmflow.trainer.objective import Objective


class MetricWindow:
    """Exact sums over one logging window; per-step figures (grad norm, lr) averaged."""

    def __init__(self, objective: Objective):
        self.objective = objective
        self.reset()

    def reset(self):
        self.sums = {k: 0.0 for k in self.objective.sum_keys}
        self.grad_norm, self.steps, self.start = 0.0, 0, time.perf_counter()
        self.real = self.computed = self.total = 0
        self.lr = 0.0

    def add(self, m: dict[str, Any], micro: list[dict[str, np.ndarray]], slots: int):
        """``slots``: token slots of the step's batch as the device got it (micro-batches padded
        to one length when accumulating)."""
        for k in self.objective.sum_keys:
            self.sums[k] += float(m[k])
        self.grad_norm += float(m["grad_norm"])
        self.lr = float(m["learning_rate"])
        self.steps += 1
        self.real += sum(int(b["real_tokens"]) for b in micro)
        self.computed += sum(int(b["computed_tokens"]) for b in micro)
        self.total += slots

    def finish(self) -> dict[str, Any]:
        seconds = time.perf_counter() - self.start
        if jax.process_count() > 1:  # token counts are per process: add them up (every process logs here)
            from jax.experimental import multihost_utils

            totals = multihost_utils.process_allgather(np.array([self.real, self.computed, self.total], np.int64))
            self.real, self.computed, self.total = (int(v) for v in np.asarray(totals).reshape(-1, 3).sum(0))
        out = {**self.objective.metrics(self.sums), "grad_norm": self.grad_norm / max(self.steps, 1), "learning_rate": self.lr,
               "real_tokens": self.real, "tokens_per_second": self.real / seconds if seconds else 0.0,
               "padding_fraction": 1.0 - self.computed / self.total if self.total else 0.0,
               "computed_fraction": self.computed / self.real if self.real else 0.0}
        self.reset()
        return out


def read_history(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_history(path: str, history: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(h, sort_keys=True) + "\n" for h in history)


def append_history(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
