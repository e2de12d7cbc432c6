"""The Grain input pipeline: shards to fixed-shape batches of pairs (``loader``), padded
(``collate``), length-bucketed (``bucketing``) or packed without padding (``packing``)."""

from trainer.data.collate import Collate, bucket_length, fine_length
from trainer.data.loader import PACKING, make_loader, resolve_packing
from trainer.data.packing import PackCollate

__all__ = ["PACKING", "Collate", "PackCollate", "bucket_length", "fine_length", "make_loader", "resolve_packing"]
