"""Padding-free packing: a micro-batch of pairs into a few long rows.

A pair is packed as one unit: its prompt once, then the chosen reply (branch 1), then the
rejected reply (branch 2), positions continuing from the prompt in both replies. Attention
(``trainer.modeling.attention``) lets the rejected reply see the prompt but not the chosen
reply, so each reply's hidden states, and so its reward, are those of its own full sequence,
computed with the prompt once instead of twice. A record whose two sequences do not start
with the same ``prompt_len`` tokens is packed with no shared prefix (both sequences whole).

Units go to ``rows`` rows (one per data-parallel device, so a pair never spans devices),
longest first to the least-filled row, which balances the rows. The row length is the
fullest row's, rounded up by ``fine_length`` (``per_doubling`` lengths per doubling: at most
1/8 wasted in a long run, coarser in a short one), so jit sees a handful of shapes. The
batch always holds exactly the micro-batch's pairs: ``batch_size`` keeps its meaning (pairs
per micro-batch) in every packing mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from rmflow.schemas.record import PairRecord
from rmflow.trainer.data.collate import FINEST, check_fits, fine_length, pair_arrays, pair_key


@dataclasses.dataclass(frozen=True)
class Unit:
    """One pair laid out for packing."""

    ids: np.ndarray
    positions: np.ndarray
    branches: np.ndarray
    chosen_at: int  # reward token of each reply, as an index into the unit
    rejected_at: int


def pack_unit(r: PairRecord) -> Unit:
    c, rj, p = r.chosen_ids, r.rejected_ids, r.prompt_len
    if not (0 < p <= min(len(c), len(rj)) and np.array_equal(c[:p], rj[:p])):
        p = 0  # nothing shared: both sequences whole
    nc, nr = len(c) - p, len(rj) - p
    ids = np.concatenate([c[:p], c[p:], rj[p:]])
    positions = np.concatenate([np.arange(p), np.arange(p, p + nc), np.arange(p, p + nr)]).astype(np.int32)
    branches = np.concatenate([np.zeros(p), np.ones(nc), np.full(nr, 2)]).astype(np.int32)

    def at(last: int, offset: int) -> int:  # index of a sequence's token within the unit
        return last if last < p else offset + last - p

    return Unit(ids.astype(np.int32), positions, branches, at(r.chosen_last, p), at(r.rejected_last, p + nc))


def assign_rows(lengths: Sequence[int], rows: int) -> list[list[int]]:
    """Unit indices per row: longest first to the least-filled row (ties: the lowest row, then
    the earlier unit); each row keeps its units in batch order. Deterministic."""
    load = [0] * rows
    out: list[list[int]] = [[] for _ in range(rows)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = min(range(rows), key=lambda k: (load[k], k))
        load[row] += lengths[i]
        out[row].append(i)
    return [sorted(r) for r in out]


@dataclasses.dataclass(frozen=True)
class PackCollate:
    """Pairs -> ``rows`` packed rows with ``batch_size`` pair slots each (see the module doc)."""

    batch_size: int
    max_length: int
    pad_id: int = 0
    rows: int = 1
    per_doubling: int = FINEST

    def __call__(self, records: Sequence[PairRecord]) -> dict[str, np.ndarray]:
        for r in records:
            check_fits(max(len(r.chosen_ids), len(r.rejected_ids)), self.max_length)
        units = [pack_unit(r) for r in records]
        placement = assign_rows([len(u.ids) for u in units], self.rows)
        length = fine_length(max(sum(len(units[i].ids) for i in row) for row in placement), self.per_doubling)
        return self._lay_out(records, units, placement, length, self.batch_size)

    def size(self, r: PairRecord) -> tuple[int, int]:
        """A pair's unit in a row: (its tokens, 1 pair slot) (``trainer.data.rows``)."""
        check_fits(max(len(r.chosen_ids), len(r.rejected_ids)), self.max_length)
        return len(pack_unit(r).ids), 1

    def layout(self, length: int, slots: int):
        """The collation of pairs already placed in rows (``trainer.data.rows``): ``length``
        tokens and ``slots`` pair slots a row."""
        def lay_out(records: Sequence[PairRecord], placement: list[list[int]]) -> dict[str, np.ndarray]:
            return self._lay_out(records, [pack_unit(r) for r in records], placement, length, slots)

        return lay_out

    def _lay_out(self, records: Sequence[PairRecord], units: list[Unit], placement: list[list[int]], length: int,
                 k: int) -> dict[str, np.ndarray]:
        rows = len(placement)
        ids = np.full((rows, length), self.pad_id, np.int32)
        pos = np.zeros((rows, length), np.int32)
        seg = np.zeros((rows, length), np.int32)
        br = np.zeros((rows, length), np.int32)
        index = np.zeros((rows, 2 * k), np.int32)
        order = []  # the pair slot (row * k + j) of each record
        for row, members in enumerate(placement):
            start = 0
            for j, i in enumerate(members):
                u = units[i]
                end = start + len(u.ids)
                ids[row, start:end], pos[row, start:end], br[row, start:end] = u.ids, u.positions, u.branches
                seg[row, start:end] = j + 1
                index[row, 2 * j : 2 * j + 2] = (start + u.chosen_at, start + u.rejected_at)
                order.append((row * k + j, i))
                start = end
        slots = pair_arrays([], rows * k)
        pair_slot = np.zeros(len(records), np.int32)
        for slot, i in order:
            slots["margin"][slot] = records[i].margin or 0.0
            slots["weight"][slot] = 1.0
            slots["pair_key"][slot] = pair_key(records[i])
            pair_slot[i] = slot
        return {
            "input_ids": ids, "positions": pos, "segment_ids": seg, "branch_ids": br, "reward_index": index,
            **slots, "pair_slot": pair_slot,
            "real_tokens": np.int64(sum(len(r.chosen_ids) + len(r.rejected_ids) for r in records)),
            "computed_tokens": np.int64(sum(len(u.ids) for u in units)),
        }
