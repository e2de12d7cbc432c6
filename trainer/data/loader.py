"""The Grain input pipeline: ArrayRecord shards to fixed-shape batches of pairs.

Each pair becomes two rows, chosen then rejected, side by side ([c0, r0, c1, r1, ...]), so
splitting the row axis evenly over devices never separates a pair. Rows are right-padded to a
length bucket (a power of two from 16 up to max_length) to bound recompilation; the last
partial batch is filled with weight-0 pairs, so every batch has the same number of rows.
Records are decoded (and CRC-checked) in Grain's worker processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grain
import numpy as np

from schemas.record import PairRecord, decode

MIN_BUCKET = 16


class DecodePair(grain.transforms.Map):
    def map(self, raw: bytes) -> PairRecord:
        return decode(raw)


def bucket_length(longest: int, max_length: int) -> int:
    if longest > max_length:
        raise ValueError(f"a record has {longest} tokens, more than max_length {max_length}: "
                         "preprocess with this max_length or raise it")
    length = MIN_BUCKET
    while length < longest:
        length *= 2
    return min(length, max_length)


@dataclasses.dataclass(frozen=True)
class Collate:
    """A list of PairRecords to a dict of numpy arrays with fixed leading shapes."""

    batch_size: int
    max_length: int
    pad_id: int = 0

    def __call__(self, records: Sequence[PairRecord]) -> dict[str, np.ndarray]:
        real = len(records)
        records = list(records) + [records[0]] * (self.batch_size - real)
        longest = max(max(len(r.chosen_ids), len(r.rejected_ids)) for r in records)
        length = bucket_length(longest, self.max_length)
        rows = 2 * self.batch_size
        ids = np.full((rows, length), self.pad_id, np.int32)
        seg = np.zeros((rows, length), np.int32)
        index = np.zeros(rows, np.int32)
        for i, r in enumerate(records):
            for j, (seq, last) in enumerate(((r.chosen_ids, r.chosen_last), (r.rejected_ids, r.rejected_last))):
                ids[2 * i + j, : len(seq)] = seq
                seg[2 * i + j, : len(seq)] = 1
                index[2 * i + j] = last
        weight = (np.arange(self.batch_size) < real).astype(np.float32)
        return {
            "input_ids": ids,
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
            "segment_ids": seg,
            "reward_index": index,
            "margin": np.array([r.margin or 0.0 for r in records], np.float32),
            "weight": weight,
            "real_tokens": np.int64((seg[: 2 * real] > 0).sum()),
        }


def make_loader(
    shard_paths: Sequence[str],
    *,
    batch_size: int,
    max_length: int,
    seed: int,
    num_epochs: int | None = 1,
    shuffle: bool = True,
    worker_count: int = 0,
    pad_id: int = 0,
    shard_by_process: bool = True,
) -> grain.DataLoader:
    """A Grain DataLoader over the shards: seeded global shuffle, epochs, one shard of the data
    per JAX process, decoding in ``worker_count`` processes (0: in this process)."""
    if worker_count:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; we do not run under absl.app
            flags.FLAGS.mark_as_parsed()
    source = grain.sources.ArrayRecordDataSource(list(shard_paths))
    sharding = grain.sharding.ShardByJaxProcess(drop_remainder=True) if shard_by_process else grain.sharding.NoSharding()
    sampler = grain.samplers.IndexSampler(
        num_records=len(source), shard_options=sharding, shuffle=shuffle, num_epochs=num_epochs, seed=seed
    )
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=[DecodePair(), grain.transforms.Batch(batch_size, drop_remainder=False,
                                                         batch_fn=Collate(batch_size, max_length, pad_id))],
        worker_count=worker_count,
    )
