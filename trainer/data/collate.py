"""The batch layout every mode shares, and the padded collation (one sequence a row).

A batch is a dict of numpy arrays:

* ``input_ids``, ``positions``, ``segment_ids``, ``branch_ids``: (R, T) rows of tokens; segment 0 is
  padding; branches are explained in ``trainer.modeling.attention``.
* ``reward_index``: (R, S), S even: the explicit index, within its row, of each scored
  sequence's reward token. Read row by row, the scored sequences come in pairs, chosen then
  rejected, so the model's (R, S) rewards reshaped to (-1, 2) are the pairs in order.
* ``margin``, ``weight``: (R * S / 2,) per pair; weight 0 marks a slot holding no real pair.
* ``pair_key``: (R * S / 2,) per pair, a 31-bit number from its id (``pair_key``): what an
  ensemble's bootstrap draws each member's weight of the pair from, the same every epoch.
* ``pair_slot``: (n,) the slot of each of the n records collated, in their order (host only).
* ``real_tokens``: tokens of the real pairs' chosen and rejected sequences as stored (prompt
  counted in both, as every trainer counts them); ``computed_tokens``: the non-padding slots
  the model actually runs (fewer when a packed pair holds its prompt once).

Splitting the row axis evenly over devices never separates a pair, and every pair's rows
and its margin and weight land on the same device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from rmflow.schemas.record import PairRecord

MIN_BUCKET = 16


def bucket_length(longest: int, max_length: int) -> int:
    """The power of two (from 16) that holds ``longest``, capped at max_length."""
    check_fits(longest, max_length)
    length = MIN_BUCKET
    while length < longest:
        length *= 2
    return min(length, max_length)


FINEST = 8  # lengths per doubling of a long run's rows (``fine_length``): at most 1/8 wasted


def fine_length(longest: int, per_doubling: int = FINEST) -> int:
    """A length from a small fixed set: powers of two up to 16, then ``per_doubling`` lengths per
    doubling, multiples of 2**k / per_doubling in (2**k, 2**(k+1)]. It wastes at most
    1/per_doubling (8: at most 1/8, about 1/16 on average; 1: the next power of two)."""
    if longest <= MIN_BUCKET:
        return MIN_BUCKET
    step = max(1, (1 << ((longest - 1).bit_length() - 1)) // per_doubling)
    return -(-longest // step) * step


# How many times dearer a compilation is, against the steps it serves, on an accelerator than on
# a CPU: a step runs tens to hundreds of times faster there while compiling a shape takes as long
# or longer (XLA autotunes each new shape's kernels), so a shape must serve that many more
# batches before a finer grid of lengths pays. The figures it rests on: docs/benchmarks.md.
ACCELERATOR_COMPILE_COST = 16


def lengths_per_doubling(batches: int, backend: str = "cpu") -> int:
    """How finely to round the rows of ``batches`` batches run by one compiled program each of
    their shapes (a run's train steps; an eval set's batches times its evaluations) on
    ``backend``: 1, 2, 4 or ``FINEST`` lengths per doubling of ``fine_length``.

    Each length a run meets costs a compilation; each padded token costs compute in every batch
    that has it. The padding falls as 1/g with g lengths per doubling and the compilations grow
    as g, so the best g grows as the square root of the batches over a compilation's cost in
    steps: on a CPU 1 below 64 batches, 2 below 256, 4 below 1,024, then 8; on an accelerator
    (``ACCELERATOR_COMPILE_COST``) each threshold that many times higher."""
    scale = 64 * (1 if backend == "cpu" else ACCELERATOR_COMPILE_COST)
    g = 1
    while g < FINEST and batches >= scale * g * g:
        g *= 2
    return g


def check_fits(longest: int, max_length: int) -> None:
    if longest > max_length:
        raise ValueError(f"a record has {longest} tokens, more than max_length {max_length}: "
                         "preprocess with this max_length or raise it")


def empty_rows(rows: int, length: int, pad_id: int) -> dict[str, np.ndarray]:
    """The row keys of ``rows`` rows of ``length`` tokens, all padding (segment 0)."""
    return {"input_ids": np.full((rows, length), pad_id, np.int32),
            **{k: np.zeros((rows, length), np.int32) for k in ("positions", "segment_ids", "branch_ids")}}


def pair_key(record: PairRecord) -> int:
    """A pair's 31-bit key: the first 31 bits of its id (a hash of its content)."""
    return int(record.pair_id[:8], 16) & 0x7FFFFFFF


def pair_arrays(records: Sequence[PairRecord], slots: int) -> dict[str, np.ndarray]:
    """margin, weight and key for ``slots`` pair slots, the first ``len(records)`` real."""
    margin, key = np.zeros(slots, np.float32), np.zeros(slots, np.int32)
    margin[: len(records)] = [r.margin or 0.0 for r in records]
    key[: len(records)] = [pair_key(r) for r in records]
    return {"margin": margin, "weight": (np.arange(slots) < len(records)).astype(np.float32), "pair_key": key}


@dataclasses.dataclass(frozen=True)
class Collate:
    """Pairs -> 2 * batch_size rows [c0, r0, c1, r1, ...], right-padded to one length.

    ``lengths``: "pow2" (a power of two from 16, capped at max_length) or "fine"
    (``fine_length`` at ``per_doubling``: for batches of similar lengths). A partial last
    batch is filled with weight-0 slots.
    """

    batch_size: int
    max_length: int
    pad_id: int = 0
    lengths: str = "pow2"
    per_doubling: int = FINEST

    def __call__(self, records: Sequence[PairRecord]) -> dict[str, np.ndarray]:
        longest = max(max(len(r.chosen_ids), len(r.rejected_ids)) for r in records)
        check_fits(longest, self.max_length)
        if self.lengths == "pow2":
            length = bucket_length(longest, self.max_length)
        else:
            length = min(fine_length(longest, self.per_doubling), self.max_length)
        rows = 2 * self.batch_size
        ids = np.full((rows, length), self.pad_id, np.int32)
        seg = np.zeros((rows, length), np.int32)
        index = np.zeros((rows, 1), np.int32)
        for i, r in enumerate(records):
            for j, (seq, last) in enumerate(((r.chosen_ids, r.chosen_last), (r.rejected_ids, r.rejected_last))):
                ids[2 * i + j, : len(seq)] = seq
                seg[2 * i + j, : len(seq)] = 1
                index[2 * i + j] = last
        real = int(seg.sum())
        return {
            "input_ids": ids,
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
            "segment_ids": seg,
            "branch_ids": np.zeros((rows, length), np.int32),
            "reward_index": index,
            **pair_arrays(records, self.batch_size),
            "pair_slot": np.arange(len(records), dtype=np.int32),
            "real_tokens": np.int64(real),
            "computed_tokens": np.int64(real),
        }
