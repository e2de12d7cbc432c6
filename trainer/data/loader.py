"""The Grain DataLoader: ArrayRecord shards to micro-batches (layout: ``trainer.data.collate``).

``packing`` picks how pairs become rows (``PACKING``):

* ``none``: each sequence its own row, right-padded to a power of two (from 16, capped at
  max_length); pairs in shuffled order.
* ``bucket``: the same rows, but the pairs of a micro-batch have similar lengths
  (``trainer.data.bucketing``), and rows are padded to a finer set of lengths.
* ``pack``: each pair packed as one unit (prompt once, both replies) into ``rows`` long rows
  with no padding between pairs (``trainer.data.packing``).

Stepwise solutions (process reward models) are collated by ``trainer.data.steps`` in the same
modes: one solution a row, or packed (``COLLATES``: the collations of each reward model kind).

In every mode a micro-batch holds exactly ``batch_size`` pairs (solutions) (fewer only at the end of a
finite pass, the rest weight 0) and the loader's state, checkpointed with the run, resumes on
exactly the next batch. Records are decoded (and CRC-checked) in Grain's worker processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
from rmflow.schemas.kinds import OUTCOME, PROCESS
from rmflow.schemas.record import PairRecord, StepRecord, decode
from rmflow.schemas.train_config import PACKING
from rmflow.trainer.data.bucketing import LengthBucketSampler
from rmflow.trainer.data.collate import FINEST, Collate
from rmflow.trainer.data.mixture import Labelled, LabelledBatch, MixtureSampler
from rmflow.trainer.data.packing import PackCollate
from rmflow.trainer.data.steps import StepCollate, StepPackCollate

BUCKET_WINDOW = 32  # micro-batches whose pairs are sorted by length together in bucket mode
# Record reads per process: Grain's default (16 threads, 500 records ahead) holds memory in 16
# threads' heaps for no gain; 4 threads read far faster than a step consumes (benchmarks/train.py).
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=128)


class DecodeRecord(grain.transforms.Map):
    def map(self, raw: bytes) -> PairRecord | StepRecord:
        return decode(raw)


class DecodeLabelled(grain.transforms.Map):
    def map(self, item: tuple[int, bytes]) -> tuple[int, PairRecord | StepRecord]:
        return item[0], decode(item[1])


def resolve_packing(packing: str, backend: str, devices: int = 1) -> str:
    """``auto`` -> ``pack`` on CPU and on one GPU (each prompt computed once, no padding between
    pairs; on the GPU with the Pallas kernels, ``resolve_attention``), ``bucket`` over several
    GPUs (the Pallas kernels have no partitioning rule yet; cuDNN's fused attention takes one
    sequence a row) and on TPU, whose splash attention takes no run-time mask that could express
    the shared prompt. ``devices``: how many devices the batch is split over. README, "Packing,
    attention and speed", has the measurements behind these."""
    if packing not in PACKING:
        raise ValueError(f"packing {packing!r}: use one of {PACKING}")
    if packing != "auto":
        return packing
    return "pack" if backend == "cpu" or (backend == "gpu" and devices == 1) else "bucket"


# Each reward model kind's (schemas.kinds) collations: (one record a padded row, packed rows).
COLLATES = {OUTCOME.name: (Collate, PackCollate), PROCESS.name: (StepCollate, StepPackCollate)}


def collate_fn(packing: str, *, batch_size: int, max_length: int, pad_id: int, rows: int, kind: str = OUTCOME.name,
               per_doubling: int = FINEST):
    """The collation of a packing mode for the records of a reward model kind (``schemas.kinds``);
    ``per_doubling``: how finely ``pack`` and ``bucket`` round row lengths (``fine_length``)."""
    padded, packed = COLLATES[kind]
    if packing == "pack":
        return packed(batch_size, max_length, pad_id, rows, per_doubling=per_doubling)
    if packing in ("none", "bucket"):
        return padded(batch_size, max_length, pad_id, lengths="pow2" if packing == "none" else "fine",
                      per_doubling=per_doubling)
    raise ValueError(f"packing {packing!r}: use one of {PACKING}")


def count_records(paths: Sequence[str]) -> int:
    """How many records the shards hold (read from their indexes, not decoded)."""
    return len(grain.sources.ArrayRecordDataSource(list(paths)))


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
    packing: str = "none",
    rows: int = 1,
    shard: tuple[int, int] | None = None,
    kind: str = OUTCOME.name,
    weights: Sequence[float] | None = None,
    per_doubling: int = FINEST,
) -> grain.DataLoader:
    """A Grain DataLoader over the shards: seeded global shuffle, epochs, one shard of the data
    per JAX process, decoding in ``worker_count`` processes (0: in this process). ``rows``:
    packed rows per micro-batch (``pack``; a multiple of the data-parallel devices).

    With ``weights``, ``shard_paths`` holds one list of shards per set and the loader draws
    from the sets mixed by those weights, endlessly (``trainer.data.mixture``); each batch then
    counts its records per set in ``source_counts``."""
    if worker_count:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; we do not run under absl.app
            flags.FLAGS.mark_as_parsed()
    collate = collate_fn(packing, batch_size=batch_size, max_length=max_length, pad_id=pad_id, rows=rows, kind=kind,
                         per_doubling=per_doubling)
    sets = [list(p) for p in shard_paths] if weights is not None else [list(shard_paths)]
    source = grain.sources.ArrayRecordDataSource([p for paths in sets for p in paths])
    if shard is not None:  # an explicit (index, count): what process ``index`` of ``count`` would read
        sharding = grain.sharding.ShardOptions(shard_index=shard[0], shard_count=shard[1], drop_remainder=True)
    elif shard_by_process:
        sharding = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    else:
        sharding = grain.sharding.NoSharding()
    decode_op, reads = DecodeRecord(), source
    if weights is None:
        sampler = grain.samplers.IndexSampler(
            num_records=len(source), shard_options=sharding, shuffle=shuffle, num_epochs=num_epochs, seed=seed
        )
    else:
        if num_epochs is not None or not shuffle:
            raise ValueError("a mixture is drawn endlessly and shuffled (num_epochs=None, shuffle=True)")
        sizes = [count_records(paths) for paths in sets]
        sampler = MixtureSampler(sizes, weights, shard_options=sharding, seed=seed)
        reads, decode_op = Labelled(source, sampler.offsets), DecodeLabelled()
        collate = LabelledBatch(collate, len(sizes))
    if packing == "bucket":
        sampler = LengthBucketSampler(sampler, source, batch_size=batch_size, window=BUCKET_WINDOW, seed=seed)
    return grain.DataLoader(
        data_source=reads,
        sampler=sampler,
        operations=[decode_op, grain.transforms.Batch(batch_size, drop_remainder=False, batch_fn=collate)],
        worker_count=worker_count,
        shard_options=sharding,
        read_options=READ_OPTIONS,
    )
