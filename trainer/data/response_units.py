"""Batches of multi-response records (``ResponsesRecord``): each prompt once, then its K responses.

A record is laid out as one unit: its prompt (branch 0), then response i on branch i + 1, the
positions of every response continuing from the prompt's end. Attention
(``trainer.modeling.attention``) lets each response see the prompt and itself only, so each
response's hidden states, and so its reward, are those of its own whole conversation, with the
prompt computed once instead of K times. Units go one to a row (``ResponsesCollate``: the
``none`` and ``bucket`` modes) or several to a row (``ResponsesPackCollate``: ``pack``), as pairs'
units do (``trainer.data.packing``).

The row keys are the pairs' (``trainer.data.collate``). Then, with S response slots per row:

* ``reward_index``: (R, S) the index within its row of each response's reward token;
* ``response_scores``: (R, S) float32, each response's score (higher is better);
* ``response_margins``: (R, S) float32, the score again where its record trains with margins
  from the scores (Bradley-Terry's margin between two responses is the difference), else 0;
* ``response_attributes``: (R, S, N) float32, each response's N attribute ratings (N = 0 for
  records that keep none);
* ``response_group``: (R, S) int32, the record each slot belongs to within its row (1, 2, ...),
  0 for a padding slot; a record's slots are contiguous;
* ``record_slots``: (n, 3) host only: for each of the n records collated, in order, its row, its
  first slot and its response count (to read per-record results back);
* ``real_tokens``: tokens of every (prompt, response) conversation as stored, the prompt counted
  once per response as a trainer of pairs or single sequences computes it; ``computed_tokens``:
  the non-padding tokens the model runs (the prompt once a record).

S is a power of two (from 8) that holds the fullest row's responses, so jit sees few shapes.
``batch_size`` counts records (prompts) per micro-batch in both modes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from rmflow.schemas.record import ResponsesRecord
from rmflow.trainer.data.collate import FINEST, bucket_length, check_fits, empty_rows, fine_length
from rmflow.trainer.data.packing import assign_rows
from rmflow.trainer.data.steps import step_slots


@dataclasses.dataclass(frozen=True)
class ResponsesUnit:
    """One record laid out for a row (see the module doc)."""

    ids: np.ndarray
    positions: np.ndarray
    branches: np.ndarray
    reward_at: np.ndarray  # each response's reward token, as an index into the unit


def responses_unit(r: ResponsesRecord) -> ResponsesUnit:
    p = r.prompt_len
    ids = np.concatenate([r.prompt_ids, *r.responses]).astype(np.int32)
    positions = np.concatenate([np.arange(p)] + [np.arange(p, p + len(x)) for x in r.responses]).astype(np.int32)
    branches = np.concatenate([np.zeros(p)] + [np.full(len(x), i + 1) for i, x in enumerate(r.responses)])
    starts = p + np.concatenate([[0], np.cumsum([len(x) for x in r.responses])[:-1]])
    # a reward token in the prompt (never written by preprocess, allowed by the record) stays there
    at = np.where(r.lasts < p, r.lasts, starts + r.lasts - p).astype(np.int32)
    return ResponsesUnit(ids, positions, branches.astype(np.int32), at)


def _fits(records: Sequence[ResponsesRecord], max_length: int) -> None:
    for r in records:
        check_fits(r.prompt_len + max(len(x) for x in r.responses), max_length)


def _arrays(rows: int, length: int, slots: int, pad_id: int, attributes: int) -> dict[str, np.ndarray]:
    return {
        **empty_rows(rows, length, pad_id),
        "reward_index": np.zeros((rows, slots), np.int32),
        "response_scores": np.zeros((rows, slots), np.float32),
        "response_margins": np.zeros((rows, slots), np.float32),
        "response_attributes": np.zeros((rows, slots, attributes), np.float32),
        "response_group": np.zeros((rows, slots), np.int32),
    }


def _collate(records: Sequence[ResponsesRecord], placement: list[list[int]], length_of, pad_id: int,
             attributes: bool = True, slots: int = 0) -> dict[str, np.ndarray]:
    """``slots``: response slots a row (0: the power of two, from 8, that holds the fullest row's)."""
    units = [responses_unit(r) for r in records]
    length = length_of(max(sum(len(units[i].ids) for i in row) for row in placement))
    slots = slots or step_slots(max(sum(records[i].k for i in row) for row in placement))
    n_attr = {r.attributes.shape[1] for r in records} if attributes else {0}
    if len(n_attr) > 1:
        raise ValueError(f"records of one batch keep different numbers of attribute ratings {sorted(n_attr)}: "
                         "preprocess every set with the same --attributes")
    b = _arrays(len(placement), length, slots, pad_id, n_attr.pop() if n_attr else 0)
    record_slots = np.zeros((len(records), 3), np.int32)
    for row, members in enumerate(placement):
        start = first = 0
        for j, i in enumerate(members):
            u, r = units[i], records[i]
            end = start + len(u.ids)
            b["input_ids"][row, start:end], b["positions"][row, start:end] = u.ids, u.positions
            b["branch_ids"][row, start:end] = u.branches
            b["segment_ids"][row, start:end] = j + 1
            b["reward_index"][row, first : first + r.k] = start + u.reward_at
            b["response_scores"][row, first : first + r.k] = r.scores
            if attributes:
                b["response_attributes"][row, first : first + r.k] = r.attributes
            if r.margin_from_scores:
                b["response_margins"][row, first : first + r.k] = r.scores
            b["response_group"][row, first : first + r.k] = j + 1
            record_slots[i] = (row, first, r.k)
            start, first = end, first + r.k
    real = sum(r.k * r.prompt_len + sum(len(x) for x in r.responses) for r in records)
    return {**b, "record_slots": record_slots, "real_tokens": np.int64(real),
            "computed_tokens": np.int64(sum(len(u.ids) for u in units))}


@dataclasses.dataclass(frozen=True)
class ResponsesCollate:
    """One record a row (its prompt once, then its responses), right-padded to one length
    (``lengths``: "pow2" or "fine", and ``per_doubling``, as ``Collate``); a partial last batch
    gets empty rows."""

    batch_size: int
    max_length: int
    pad_id: int = 0
    lengths: str = "pow2"
    per_doubling: int = FINEST
    attributes: bool = True  # collate the attribute ratings (the regression objectives'); else width 0

    def __call__(self, records: Sequence[ResponsesRecord]) -> dict[str, np.ndarray]:
        _fits(records, self.max_length)
        placement = [[i] for i in range(len(records))] + [[] for _ in range(self.batch_size - len(records))]
        # a unit holds K responses: its row may be longer than max_length (each conversation is not),
        # then rounded to a power of two (a few shapes), as one up to it is
        length_of = (lambda n: bucket_length(n, self.max_length) if n <= self.max_length
                     else 1 << (n - 1).bit_length()) if self.lengths == "pow2" \
            else (lambda n: fine_length(n, self.per_doubling))
        return _collate(records, placement, length_of, self.pad_id, self.attributes)


@dataclasses.dataclass(frozen=True)
class ResponsesPackCollate:
    """Records packed into ``rows`` rows with no padding between them, longest first to the
    least-filled row (``trainer.data.packing.assign_rows``)."""

    batch_size: int
    max_length: int
    pad_id: int = 0
    rows: int = 1
    per_doubling: int = FINEST
    attributes: bool = True  # as ResponsesCollate's

    def __call__(self, records: Sequence[ResponsesRecord]) -> dict[str, np.ndarray]:
        _fits(records, self.max_length)
        placement = assign_rows([r.unit_len for r in records], self.rows)
        return _collate(records, placement, lambda n: fine_length(n, self.per_doubling), self.pad_id, self.attributes)

    def size(self, r: ResponsesRecord) -> tuple[int, int]:
        """A record's unit in a row: (its tokens, its responses' slots) (``trainer.data.rows``)."""
        _fits([r], self.max_length)
        return r.unit_len, r.k

    def layout(self, length: int, slots: int):
        """The collation of records already placed in rows (``trainer.data.rows``): ``length``
        tokens and ``slots`` response slots a row."""
        def lay_out(records: Sequence[ResponsesRecord], placement: list[list[int]]) -> dict[str, np.ndarray]:
            return _collate(records, placement, lambda n: length, self.pad_id, self.attributes, slots)

        return lay_out


def units_in_rows(records: Sequence[ResponsesRecord], rows: int, length: int, pad_id: int = 0
                  ) -> dict[str, np.ndarray]:
    """One record a row in a shape the caller fixed (``rows`` x ``length``, empty rows after the
    records; response slots a power of two from 8), no attribute ratings: what scoring with
    compiled shapes runs (``trainer.inference.SequenceScorer.run_units``)."""
    if len(records) > rows:
        raise ValueError(f"{len(records)} records for {rows} rows")
    for r in records:
        check_fits(r.unit_len, length)
    placement = [[i] for i in range(len(records))] + [[] for _ in range(rows - len(records))]
    return _collate(records, placement, lambda n: length, pad_id, attributes=False)


def record_values(values: np.ndarray, record_slots: np.ndarray) -> list[np.ndarray]:
    """Per-slot values (R, S) of a batch -> one array per record (its responses'), in collation order."""
    return [np.asarray(values[row, first : first + k]) for row, first, k in record_slots]
