"""Batches of stepwise solutions (process reward models), padded or packed.

The row keys are the pairs' (``trainer.data.collate``): ``input_ids``, ``positions``,
``segment_ids``, ``branch_ids`` (always 0: a solution is one sequence). Then, with S step slots
per row:

* ``reward_index``: (R, S) the index within its row of each step's scoring token;
* ``step_labels``: (R, S) 1 correct, 0 incorrect; ``step_weight``: (R, S) 1 for a real step,
  0 for a padding slot;
* ``record_steps``: (n, 3) host only: for each of the n records collated, in order, its row,
  its first step slot and its step count (to read per-solution results back);
* ``real_tokens``, ``computed_tokens``: as for pairs.

S is a power of two (from 8) that holds the fullest row's steps, so jit sees few shapes.
``batch_size`` counts solutions per micro-batch in both modes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from rmflow.schemas.record import StepRecord
from rmflow.trainer.data.collate import FINEST, bucket_length, check_fits, empty_rows, fine_length
from rmflow.trainer.data.packing import assign_rows

MIN_STEP_SLOTS = 8


def step_slots(most: int) -> int:
    """Step slots per row: the power of two (from 8) that holds ``most`` steps."""
    slots = MIN_STEP_SLOTS
    while slots < most:
        slots *= 2
    return slots


def _arrays(rows: int, length: int, slots: int, pad_id: int) -> dict[str, np.ndarray]:
    return {
        **empty_rows(rows, length, pad_id),
        "reward_index": np.zeros((rows, slots), np.int32),
        "step_labels": np.zeros((rows, slots), np.int32),
        "step_weight": np.zeros((rows, slots), np.float32),
    }


def _place(b: dict[str, np.ndarray], row: int, start: int, first_slot: int, segment: int, r: StepRecord) -> None:
    n, k = len(r.input_ids), len(r.step_ends)
    b["input_ids"][row, start : start + n] = r.input_ids
    b["positions"][row, start : start + n] = np.arange(n)
    b["segment_ids"][row, start : start + n] = segment
    b["reward_index"][row, first_slot : first_slot + k] = start + r.step_ends
    b["step_labels"][row, first_slot : first_slot + k] = r.step_labels
    b["step_weight"][row, first_slot : first_slot + k] = 1.0


@dataclasses.dataclass(frozen=True)
class StepCollate:
    """One solution a row, right-padded to one length (``lengths``: "pow2" or "fine", and
    ``per_doubling``, as ``Collate``)."""

    batch_size: int
    max_length: int
    pad_id: int = 0
    lengths: str = "pow2"
    per_doubling: int = FINEST

    def __call__(self, records: Sequence[StepRecord]) -> dict[str, np.ndarray]:
        longest = max(len(r.input_ids) for r in records)
        check_fits(longest, self.max_length)
        length = bucket_length(longest, self.max_length) if self.lengths == "pow2" \
            else min(fine_length(longest, self.per_doubling), self.max_length)
        b = _arrays(self.batch_size, length, step_slots(max(len(r.step_ends) for r in records)), self.pad_id)
        for i, r in enumerate(records):
            _place(b, i, 0, 0, 1, r)
        real = sum(len(r.input_ids) for r in records)
        return {**b, "record_steps": np.array([[i, 0, len(r.step_ends)] for i, r in enumerate(records)], np.int32),
                "real_tokens": np.int64(real), "computed_tokens": np.int64(real)}


@dataclasses.dataclass(frozen=True)
class StepPackCollate:
    """Solutions packed into ``rows`` rows with no padding between them (one segment each;
    attention never crosses segments), longest first to the least-filled row."""

    batch_size: int
    max_length: int
    pad_id: int = 0
    rows: int = 1
    per_doubling: int = FINEST

    def __call__(self, records: Sequence[StepRecord]) -> dict[str, np.ndarray]:
        for r in records:
            check_fits(len(r.input_ids), self.max_length)
        placement = assign_rows([len(r.input_ids) for r in records], self.rows)
        length = fine_length(max(sum(len(records[i].input_ids) for i in row) for row in placement), self.per_doubling)
        slots = step_slots(max(sum(len(records[i].step_ends) for i in row) for row in placement))
        return _lay_out(records, placement, length, slots, self.pad_id)

    def size(self, r: StepRecord) -> tuple[int, int]:
        """A solution in a row: (its tokens, its steps' slots) (``trainer.data.rows``)."""
        check_fits(len(r.input_ids), self.max_length)
        return len(r.input_ids), len(r.step_ends)

    def layout(self, length: int, slots: int):
        """The collation of solutions already placed in rows (``trainer.data.rows``): ``length``
        tokens and ``slots`` step slots a row."""
        def lay_out(records: Sequence[StepRecord], placement: list[list[int]]) -> dict[str, np.ndarray]:
            return _lay_out(records, placement, length, slots, self.pad_id)

        return lay_out


def _lay_out(records: Sequence[StepRecord], placement: list[list[int]], length: int, slots: int, pad_id: int
             ) -> dict[str, np.ndarray]:
    b = _arrays(len(placement), length, slots, pad_id)
    record_steps = np.zeros((len(records), 3), np.int32)
    for row, members in enumerate(placement):
        start = first = 0
        for j, i in enumerate(members):
            r = records[i]
            _place(b, row, start, first, j + 1, r)
            record_steps[i] = (row, first, len(r.step_ends))
            start += len(r.input_ids)
            first += len(r.step_ends)
    real = sum(len(r.input_ids) for r in records)
    return {**b, "record_steps": record_steps, "real_tokens": np.int64(real), "computed_tokens": np.int64(real)}


def record_step_values(values: np.ndarray, record_steps: np.ndarray) -> list[np.ndarray]:
    """Per-slot values (R, S) of a batch -> one array per record, in collation order."""
    return [np.asarray(values[row, first : first + k]) for row, first, k in record_steps]
