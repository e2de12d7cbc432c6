"""The Grain input pipeline: shards to fixed-shape batches (``loader``) of pairs, padded
(``collate``), length-bucketed (``bucketing``) or packed without padding (``packing``); stepwise
solutions for process reward models likewise (``steps``), and K responses with their prompt
once (``response_units``); weighted mixtures of shard sets (``mixture``) and the batches read
ahead (``lookahead``)."""

from rmflow.trainer.data.collate import Collate, bucket_length, fine_length, lengths_per_doubling
from rmflow.trainer.data.loader import PACKING, LoaderSpec, count_records, make_loader, resolve_packing
from rmflow.trainer.data.packing import PackCollate
from rmflow.trainer.data.steps import StepCollate, StepPackCollate

__all__ = ["PACKING", "Collate", "LoaderSpec", "PackCollate", "StepCollate", "StepPackCollate", "bucket_length", "count_records",
           "fine_length", "lengths_per_doubling", "make_loader", "resolve_packing"]
