"""Host-side batching for the train and eval steps: micro-batches widened to one row length and
stacked on a leading axis (the step scans over it)."""

from __future__ import annotations

from typing import Any

import numpy as np
from rmflow.trainer.objective import OUTCOME, ROW_KEYS, Objective


def widen(batch: dict[str, np.ndarray], length: int, slots: int | None = None,
          objective: Objective = OUTCOME) -> dict[str, np.ndarray]:
    """Right-pad a micro-batch's rows (segment 0: padding) to ``length`` tokens and its per-row
    step slots (weight 0: padding) to ``slots``."""
    def pad(k, x):
        if k in ROW_KEYS and x.shape[1] < length:
            return np.pad(x, [(0, 0), (0, length - x.shape[1])])
        if slots is not None and k in objective.slot_keys and x.shape[1] < slots:
            return np.pad(x, [(0, 0), (0, slots - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
        return x

    return {k: pad(k, v) for k, v in batch.items()}


def stack_micro_batches(batches: list[dict[str, Any]], objective: Objective = OUTCOME) -> dict[str, np.ndarray]:
    """Host batches -> the train step's batch (still on the host): a leading micro-batch axis.
    Rows are right-padded (segment 0) to the longest micro-batch's length, step slots to the most."""
    length = max(b["input_ids"].shape[1] for b in batches)
    slots = max(b["reward_index"].shape[1] for b in batches)
    wide = [widen({k: b[k] for k in objective.device_keys}, length, slots, objective) for b in batches]
    return {k: np.stack([b[k] for b in wide]) for k in objective.device_keys}
