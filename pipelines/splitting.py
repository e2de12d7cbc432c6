"""Which split and which shard a record goes to: a salted hash of its content id, so the
assignment is deterministic, independent of the input's order and of how the job is split."""

from __future__ import annotations

import hashlib


def _unit_hash(text: str) -> float:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def assign_split(pair_id: str, eval_fraction: float, seed: int = 0) -> str:
    """Deterministic train/eval split by a salted hash of the pair's content id."""
    return "eval" if _unit_hash(f"split:{seed}:{pair_id}") < eval_fraction else "train"


def assign_shard(pair_id: str, num_shards: int) -> int:
    return min(num_shards - 1, int(_unit_hash(f"shard:{pair_id}") * num_shards))
