"""Weighted mixtures of shard sets: the batches' per-set counts.

The loader mixes the sets with Grain's own mixing (``grain.MapDataset.mix``: a deterministic
interleaving that holds the weights' proportions in every stretch of the stream), each set in
its own shuffled, endlessly repeated order, reshuffled every pass (``trainer.data.loader``). A
set weighted above its share of the records therefore repeats sooner, one weighted below is
subsampled. Every position maps to one record by a pure function of (seed, weights, sizes,
position), so the loader's checkpointed state resumes a mixture exactly, like a single set.

Each record comes tagged with its set (``loader.Tag``); ``LabelledBatch`` counts them per batch
(``source_counts``, host only), which the run logs per set.
"""

from __future__ import annotations

import numpy as np


class LabelledBatch:
    """A collation of (set, record) pairs: the records collated, plus ``source_counts``."""

    def __init__(self, collate, num_sources: int):
        self.collate, self.num_sources = collate, num_sources

    def __call__(self, items):
        batch = self.collate([record for _, record in items])
        batch["source_counts"] = np.bincount([s for s, _ in items], minlength=self.num_sources).astype(np.int64)
        return batch
