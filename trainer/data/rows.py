"""Rows of one fixed shape, filled from the record stream: the ``fixed`` packing mode.

Every micro-batch of a run is ``rows`` rows of ``tokens`` tokens with ``slots`` unit slots a
row (pairs, labelled steps or responses, by kind: ``RowShape``), so the train step and the eval
step compile once a run. ``FixedRows`` reads the stream (Grain's, in order) into a window of
``window`` records and lays them out first-fit, oldest first: each record goes, whole, into the
first row with room for its tokens and its slots; what fits nowhere waits for the next batch,
still first in line. A record never waits longer than the batches its window's older records
fill, and the oldest always fits an empty row, so every record is served, in close to stream
order. A micro-batch then holds a varying number of records (``batch_size`` on average when
``tokens`` is chosen by ``row_shape_for``); the step divides its summed loss by the records the
step holds (``trainer.step``), so each record counts alike whatever batch it lands in.

The iterator's state is the parent's state before the oldest record still waiting, how many
records were read since, and which of those were already served: a restore reads them again
and resumes on exactly the next batch (JSON-able: it goes into the run's checkpoints).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

WINDOW_BATCHES = 4  # the packer's window: this many batches' worth of records read ahead
ROW_ALIGN = 128  # a chosen row length is a multiple of this (the attention kernels' blocks)...
SHORT_ALIGN = 16  # ...or of this, for rows up to 1,024 tokens


@dataclasses.dataclass(frozen=True)
class RowShape:
    """A micro-batch's fixed shape: ``rows`` rows of ``tokens`` tokens, ``slots`` unit slots a row."""

    rows: int
    tokens: int
    slots: int

    def __post_init__(self) -> None:
        if min(self.rows, self.tokens, self.slots) < 1:
            raise ValueError(f"a row shape needs positive rows, tokens and slots: {self}")


def target_tokens(sizes: Sequence[tuple[int, int]], *, batch_size: int, rows: int) -> int:
    """A row's tokens for ``rows`` rows to hold ``batch_size`` units of ``sizes`` (a sample of
    the data's (tokens, slots)) on average: the mean unit times the units a row holds, plus 1/16
    for the units that do not fill a row exactly, rounded up to ``ROW_ALIGN`` (``SHORT_ALIGN`` up
    to 1,024 tokens)."""
    if not sizes:
        raise ValueError("no records to size the rows by")
    mean = sum(t for t, _ in sizes) / len(sizes)
    wanted = batch_size / rows * mean * 17 / 16
    align = ROW_ALIGN if wanted > 1024 else SHORT_ALIGN
    return math.ceil(wanted / align) * align


def row_shape_for(sizes: Sequence[tuple[int, int]], *, batch_size: int, rows: int, longest: int,
                  row_tokens: int = 0) -> RowShape:
    """The row shape of a run whose units (one per record) take ``sizes`` (tokens, slots), a
    sample of the data: a row's tokens are ``row_tokens`` when given, else ``target_tokens``
    (``batch_size`` records a step on average), and never fewer than ``longest`` (the longest
    unit the data holds, which must fit alone). Its slots hold twice the records a row holds
    on average, rounded up to a power of two, and never fewer than the sample's largest unit."""
    if row_tokens:
        if row_tokens < longest:
            raise ValueError(f"data.row_tokens {row_tokens}: a row must hold the longest record of this data "
                             f"({longest} tokens); set it to at least {longest}, or 0 to have it chosen")
        length = row_tokens
    else:
        length = max(longest, target_tokens(sizes, batch_size=batch_size, rows=rows))
    mean_tokens = sum(t for t, _ in sizes) / len(sizes)
    mean_slots = sum(s for _, s in sizes) / len(sizes)
    need = max(max(s for _, s in sizes), math.ceil(2 * length / mean_tokens * mean_slots))
    return RowShape(rows, int(length), 1 << (need - 1).bit_length())


def first_fit(sizes: Sequence[tuple[int, int]], shape: RowShape) -> list[list[int]]:
    """Indices into ``sizes`` per row: each unit, in order, into the first row with room for
    its (tokens, slots); units that fit nowhere are left out (they wait). Deterministic."""
    load = [0] * shape.rows
    used = [0] * shape.rows
    out: list[list[int]] = [[] for _ in range(shape.rows)]
    for i, (t, s) in enumerate(sizes):
        for row in range(shape.rows):
            if load[row] + t <= shape.tokens and used[row] + s <= shape.slots:
                load[row] += t
                used[row] += s
                out[row].append(i)
                break
    return out


def check_fits(size: tuple[int, int], shape: RowShape) -> None:
    """A unit of ``size`` (tokens, slots) fits an empty row of ``shape``, or a one-line error."""
    if size[0] > shape.tokens:
        raise ValueError(f"a record's unit has {size[0]} tokens, more than a row's {shape.tokens}: raise "
                         "data.row_tokens (0 chooses one from the data)")
    if size[1] > shape.slots:
        raise ValueError(f"a record's unit has {size[1]} scored parts (steps, responses), more than a row's "
                         f"{shape.slots} slots (twice the average the sampled data needs): split such records, "
                         "or raise data.row_tokens (a row's slots grow with it)")


def window_for(shape: RowShape, batch_size: int) -> int:
    """The records a packer reads ahead: ``WINDOW_BATCHES`` micro-batches' worth, a micro-batch
    counted as ``batch_size`` records or, when its rows hold more (rows made long for the longest
    record), as half its slots."""
    return WINDOW_BATCHES * max(batch_size, shape.rows * shape.slots // 2)


def packed_batches(sizes: Sequence[tuple[int, int]], shape: RowShape, window: int) -> list[list[list[int]]]:
    """Every unit of ``sizes`` in micro-batches of ``shape``, as ``FixedRows`` lays out a stream
    (first-fit over a window of ``window`` units, oldest first): each batch's indices into
    ``sizes`` per row. What scoring a known set of records runs: one shape for all of them."""
    pending: list[int] = []
    following = 0
    out = []
    while following < len(sizes) or pending:
        while following < len(sizes) and len(pending) < window:
            check_fits(sizes[following], shape)
            pending.append(following)
            following += 1
        placement = [[pending[i] for i in row] for row in first_fit([sizes[i] for i in pending], shape)]
        placed = {i for row in placement for i in row}
        pending = [i for i in pending if i not in placed]
        out.append(placement)
    return out


class OtherPackingState(ValueError):
    """A loader state saved by another packing mode than ``fixed``."""


class FixedRows(grain.IterDataset):
    """Micro-batches of one ``RowShape`` from a stream of records (or (set, record) items of a
    mixture). ``size(record)``: its unit's (tokens, slots); ``layout(records, placement)``:
    the batch of those records in those rows; ``labels``: the sets of a mixture (each batch then
    counts its records per set in ``source_counts``), 0 for one set."""

    def __init__(self, parent: grain.IterDataset, *, shape: RowShape, size: Callable[[Any], tuple[int, int]],
                 layout: Callable[[list, list[list[int]]], dict[str, np.ndarray]], window: int, labels: int = 0):
        super().__init__(parent)
        self.shape, self.size, self.layout, self.window, self.labels = shape, size, layout, window, labels

    def __str__(self) -> str:
        return f"FixedRows(shape={self.shape}, window={self.window})"

    def __iter__(self) -> grain.DatasetIterator:
        return _FixedRowsIterator(self._parent.__iter__(), self)


class _FixedRowsIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, spec: FixedRows):
        super().__init__(parent)
        self._spec = spec
        # the records read and not yet trimmed, oldest first: [parent state before it, item, size, served]
        self._read: list[list] = []
        self._exhausted = False

    def _pull(self) -> bool:
        state = self._parent.get_state()
        try:
            item = next(self._parent)
        except StopIteration:
            self._exhausted = True
            return False
        size = self._spec.size(item[1] if self._spec.labels else item)
        check_fits(size, self._spec.shape)
        self._read.append([state, item, size, False])
        return True

    def __next__(self) -> dict[str, np.ndarray]:
        waiting = sum(not e[3] for e in self._read)
        while not self._exhausted and waiting < self._spec.window and self._pull():
            waiting += 1
        pending = [e for e in self._read if not e[3]]
        if not pending:
            raise StopIteration
        placement = first_fit([e[2] for e in pending], self._spec.shape)
        chosen = sorted(i for row in placement for i in row)
        index = {i: k for k, i in enumerate(chosen)}  # pending index -> position in the batch's records
        for i in chosen:
            pending[i][3] = True
        items = [pending[i][1] for i in chosen]
        while self._read and self._read[0][3]:
            self._read.pop(0)
        if self._spec.labels:
            batch = self._spec.layout([r for _, r in items], [[index[i] for i in row] for row in placement])
            batch["source_counts"] = np.bincount([s for s, _ in items], minlength=self._spec.labels).astype(np.int64)
            return batch
        return self._spec.layout(items, [[index[i] for i in row] for row in placement])

    def get_state(self) -> dict[str, Any]:
        if not self._read:
            return {"parent": self._parent.get_state(), "read": 0, "served": []}
        return {"parent": self._read[0][0], "read": len(self._read),
                "served": [i for i, e in enumerate(self._read) if e[3]]}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"parent", "read", "served"}:
            raise OtherPackingState("the loader state was not saved by rows of one fixed shape (packing fixed)")
        self._parent.set_state(state["parent"])
        self._read, self._exhausted = [], False
        served = set(state["served"])
        for i in range(state["read"]):
            if not self._pull():
                raise ValueError("the checkpointed loader state reads past the end of its data: the shards changed")
            self._read[-1][3] = i in served
