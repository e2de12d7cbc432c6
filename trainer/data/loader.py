"""The Grain input pipeline (Grain's dataset API: ``MapDataset`` sources, sliced per process,
shuffled, mixed, batched; an ``IterDataset`` to iterate): ArrayRecord shards to micro-batches
(layout: ``trainer.data.collate``).

``packing`` picks how pairs become rows (``PACKING``):

* ``none``: each sequence its own row, right-padded to a power of two (from 16, capped at
  max_length); pairs in shuffled order.
* ``bucket``: the same rows, but the pairs of a micro-batch have similar lengths
  (``trainer.data.bucketing``), and rows are padded to a finer set of lengths.
* ``pack``: each pair packed as one unit (prompt once, both replies) into ``rows`` long rows
  with no padding between pairs (``trainer.data.packing``), ``batch_size`` pairs a micro-batch.
* ``fixed``: the same units, in ``rows`` rows of one fixed length (``row_tokens``) filled from
  the stream (``trainer.data.rows``): one shape a run, ``batch_size`` pairs a micro-batch on
  average.

Stepwise solutions (process reward models) are collated by ``trainer.data.steps`` in the same
modes: one solution a row, or packed (each reward model kind's collations are its objective's,
``trainer.objective``).

In every mode but ``fixed`` a micro-batch holds exactly ``batch_size`` pairs (solutions) (fewer only at
the end of a finite pass, the rest weight 0); in every mode the loader's state, checkpointed with the run, resumes on
exactly the next batch. Records are decoded (and CRC-checked) in Grain's worker processes.
Every position of the stream maps to one record by a pure function of the seed, the sets'
sizes and weights and the position, so no sampler's state or repr is checked on a restore.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence

import grain
from rmflow.schemas.record import PairRecord, StepRecord, decode
from rmflow.schemas.train_config import PACKED, PACKING
from rmflow.trainer.data.bucketing import LengthBuckets
from rmflow.trainer.data.collate import FINEST
from rmflow.trainer.data.mixture import LabelledBatch
from rmflow.trainer.data.rows import FixedRows, RowShape, window_for

if typing.TYPE_CHECKING:
    from rmflow.trainer.objective import Objective

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


class Tag(grain.transforms.Map):
    """A record paired with the index of its set (a mixture's)."""

    def __init__(self, index: int):
        self.index = index

    def map(self, raw: bytes) -> tuple[int, bytes]:
        return self.index, raw


def resolve_packing(packing: str, backend: str, devices: int = 1, processes: int = 1) -> str:
    """``auto`` -> ``fixed`` on CPU and on one GPU (each prompt computed once, no padding between
    pairs, one shape a run; on the GPU with the Pallas kernels, ``resolve_attention``), ``pack``
    there with several processes (each process's eval set then makes as many batches, as the
    batches' collectives need; fixed rows make as many as their records fill), ``bucket`` over
    several GPUs (the Pallas kernels have no partitioning rule yet; cuDNN's fused attention takes
    one sequence a row) and on TPU, whose splash attention takes no run-time mask that could
    express the shared prompt. ``devices``: how many devices the batch is split over.
    docs/training.md, "Packing, attention and speed", has the measurements behind these."""
    if packing not in PACKING:
        raise ValueError(f"packing {packing!r}: use one of {PACKING}")
    if packing != "auto":
        return packing
    if backend == "cpu" or (backend == "gpu" and devices == 1):
        return "fixed" if processes == 1 else "pack"
    return "bucket"


def collate_fn(packing: str, *, batch_size: int, max_length: int, pad_id: int, rows: int,
               objective: Objective | None = None, per_doubling: int = FINEST):
    """The collation of a packing mode for the records ``objective`` trains on (its own
    collations, ``trainer.objective``; None: preference pairs'); ``per_doubling``: how finely
    ``pack`` and ``bucket`` round row lengths (``fine_length``)."""
    if objective is None:  # imported here: Grain's workers get the collation, not the objective's jax
        from rmflow.trainer.objective import OUTCOME

        objective = OUTCOME
    padded, packed = objective.padded, objective.packed
    if packing in PACKED:  # fixed: the packed collation's ``size`` and ``layout``
        return packed(batch_size, max_length, pad_id, rows, per_doubling=per_doubling)
    if packing in ("none", "bucket"):
        return padded(batch_size, max_length, pad_id, lengths="pow2" if packing == "none" else "fine",
                      per_doubling=per_doubling)
    raise ValueError(f"packing {packing!r}: use one of {PACKING}")


def count_records(paths: Sequence[str]) -> int:
    """How many records the shards hold (read from their indexes, not decoded)."""
    return len(grain.sources.ArrayRecordDataSource(list(paths)))


def _shard(sharding: tuple[int, int] | None, by_process: bool) -> tuple[int, int]:
    """(index, count) of this process's slice of every stream."""
    if sharding is not None:
        return sharding
    if by_process:
        opts = grain.sharding.ShardByJaxProcess(drop_remainder=True)
        return opts.shard_index, opts.shard_count
    return 0, 1


ENDLESS = 2**48  # records an endless stream holds: Grain's endless repeat in batches of 1 overflows len()


def _stream(source, *, shard: tuple[int, int], shuffle: bool, seed: int, num_epochs: int | None,
            tag: int | None = None) -> grain.MapDataset:
    """One set's records in this process's order: the process's slice of the set (every
    ``count``-th record from ``index``, the set first cut to a multiple of the processes, so
    each gets as many and no record goes to two), shuffled anew each pass (``shuffle``),
    repeated ``num_epochs`` times (None: endlessly, ``ENDLESS`` records). ``tag``: each record paired with its set."""
    index, count = shard
    ds = grain.MapDataset.source(source)
    ds = ds[: len(ds) - len(ds) % count][index::count]
    if tag is not None:
        ds = ds.map(Tag(tag))
    if shuffle:
        ds = ds.shuffle(seed)
    if num_epochs is None:  # endless: as many passes as a length Python's len() takes in batches of 1
        num_epochs = ENDLESS // max(len(ds), 1)  # (the same records at every index as an endless repeat)
    return ds.repeat(num_epochs)


def mixed_stream(sources: Sequence, weights: Sequence[float], *, shard: tuple[int, int], seed: int
                 ) -> grain.MapDataset:
    """The sets' streams (``_stream``, endless, each tagged with its set) mixed by ``weights``."""
    if len(weights) != len(sources) or not weights:
        raise ValueError("a mixture needs one weight per set")
    sets = [_stream(source, shard=shard, shuffle=True, seed=(seed + i) % 2**31, num_epochs=None, tag=i)
            for i, source in enumerate(sources)]
    return grain.MapDataset.mix(sets, [float(w) for w in weights]) if len(sets) > 1 else sets[0]


@dataclasses.dataclass(frozen=True)
class LoaderSpec:
    """How a loader batches its shards. ``rows``: packed rows per micro-batch (``pack``; a multiple
    of the data-parallel devices). ``shard``: this process's (index, count) slice (None: by the
    JAX process, or all of it without ``shard_by_process``). ``worker_count``: processes decoding
    records (0: this one; the batches are the same either way). ``weights``: one per set of a
    mixture. ``per_doubling``: how finely row lengths round (``lengths_per_doubling``)."""

    batch_size: int
    max_length: int
    seed: int = 0
    num_epochs: int | None = 1
    shuffle: bool = True
    worker_count: int = 0
    pad_id: int = 0
    shard_by_process: bool = True
    packing: str = "none"
    rows: int = 1
    shard: tuple[int, int] | None = None
    objective: Objective | None = None  # what the records train (``trainer.objective``); None: pairs
    weights: Sequence[float] | None = None
    per_doubling: int = FINEST
    row_tokens: int = 0  # ``fixed``: tokens a row (``trainer.data.rows.row_shape_for``)
    row_slots: int = 0  # ``fixed``: unit slots a row

    @property
    def row_shape(self) -> RowShape:
        return RowShape(self.rows, self.row_tokens, self.row_slots)


def make_loader(shard_paths: Sequence[str], spec: LoaderSpec) -> grain.IterDataset:
    """The shards as a Grain dataset of micro-batches (iterate it; its iterator's state, saved
    with each checkpoint, resumes on exactly the next batch): one slice of the records per JAX
    process, in a seeded order reshuffled each epoch.

    With ``spec.weights``, ``shard_paths`` holds one list of shards per set and the loader draws
    from the sets mixed by those weights (``grain.MapDataset.mix``), endlessly, each set in
    its own shuffled passes; each batch then counts its records per set in ``source_counts``."""
    collate = collate_fn(spec.packing, batch_size=spec.batch_size, max_length=spec.max_length, pad_id=spec.pad_id,
                         rows=spec.rows, objective=spec.objective, per_doubling=spec.per_doubling)
    where = _shard(spec.shard, spec.shard_by_process)
    if spec.weights is None:
        ds = _stream(grain.sources.ArrayRecordDataSource(list(shard_paths)), shard=where, shuffle=spec.shuffle,
                     seed=spec.seed, num_epochs=spec.num_epochs)
        decode_op = DecodeRecord()
    else:
        if spec.num_epochs is not None or not spec.shuffle:
            raise ValueError("a mixture is drawn endlessly and shuffled (num_epochs=None, shuffle=True)")
        ds = mixed_stream([grain.sources.ArrayRecordDataSource(list(paths)) for paths in shard_paths], spec.weights,
                          shard=where, seed=spec.seed)
        decode_op = DecodeLabelled()
        if spec.packing != "fixed":  # FixedRows counts a mixture's sets itself
            collate = LabelledBatch(collate, len(shard_paths))
    if spec.packing == "fixed":  # records decoded in order (in the workers, if any), laid out here
        shape = spec.row_shape
        return FixedRows(_workers(ds.map(decode_op).to_iter_dataset(READ_OPTIONS), spec.worker_count), shape=shape,
                         size=collate.size, layout=collate.layout(shape.tokens, shape.slots),
                         window=window_for(shape, spec.batch_size), labels=len(shard_paths) if spec.weights else 0)
    if spec.packing == "bucket":
        ds = LengthBuckets(ds, batch_size=spec.batch_size, window=BUCKET_WINDOW, seed=spec.seed)
    ds = ds.map(decode_op).batch(spec.batch_size, drop_remainder=False, batch_fn=collate)
    return _workers(ds.to_iter_dataset(READ_OPTIONS), spec.worker_count)


def _workers(ds: grain.IterDataset, count: int) -> grain.IterDataset:
    """``ds`` computed in ``count`` worker processes (0: in this one)."""
    if not count:
        return ds
    from absl import flags

    if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; we do not run under absl.app
        flags.FLAGS.mark_as_parsed()
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=count))
