"""Near-duplicates: records whose prompts (or whole pairs) are almost the same text.

MinHash over word shingles with locality-sensitive hashing, the method of the large dedup
pipelines (Broder 1997; the BigCode and text-dedup recipes): the text is normalised to words as
decontamination does (``decontaminate.words``), cut into ``SHINGLE``-word shingles, and
summarised by ``PERMUTATIONS`` min-hashes; two texts whose signatures agree on a fraction f of
the min-hashes have an estimated Jaccard similarity f. The signature is cut into ``BANDS`` bands;
records that share a band land in one bucket and are compared there.

Deterministic: in a bucket every record similar enough (estimated Jaccard >= the threshold) to
the bucket's earliest record (by input file, then line) is a near-duplicate of it; a record
found in several buckets keeps the earliest such record, and a chain (C near B, B near A) is
followed to the record that is kept, which the errors file names. The Beam step is
``DropNearDuplicates``; the pure core is ``signature`` and ``similarity``.
"""

from __future__ import annotations

import hashlib

import apache_beam as beam
import numpy as np
from apache_beam.pvalue import AsDict, TaggedOutput
from rmflow.pipelines.decontaminate import prompt_of, words
from rmflow.pipelines.transforms import DEAD, dead_letter
from rmflow.rendering.formats import Duplicate

SHINGLE = 5  # words per shingle
PERMUTATIONS = 128  # min-hashes per signature
BANDS = 16  # LSH bands of PERMUTATIONS // BANDS rows: pairs above ~0.7 similar share a band with high chance
_PRIME = np.uint64((1 << 61) - 1)
_RNG = np.random.default_rng(20261124)  # fixed: signatures are comparable across runs and workers
_A = _RNG.integers(1, (1 << 61) - 1, PERMUTATIONS, dtype=np.uint64)
_B = _RNG.integers(0, (1 << 61) - 1, PERMUTATIONS, dtype=np.uint64)


def texts_of(pair, mode: str) -> str:
    """The text compared: the prompt (``prompt``), or the prompt and both replies or all steps (``pair``)."""
    parts = [prompt_of(pair.prompt)]
    if mode == "pair":
        for i, reply in enumerate(pair.reply_texts):
            parts += ["\x00", reply] if i else [reply]  # a separator no text holds between replies
    return "\n".join(parts)


def signature(text: str) -> np.ndarray | None:
    """The MinHash signature (PERMUTATIONS uint64) of a text's word shingles; None for no words."""
    ws = words(text)
    if not ws:
        return None
    shingles = {" ".join(ws[i:i + SHINGLE]) for i in range(max(1, len(ws) - SHINGLE + 1))}
    hashes = np.fromiter((int.from_bytes(hashlib.blake2b(s.encode(), digest_size=4).digest(), "little")
                          for s in shingles), np.uint64, len(shingles))
    with np.errstate(over="ignore"):  # universal hashing mod 2**64, then mod a Mersenne prime
        return ((np.outer(hashes, _A) + _B) % _PRIME).min(axis=0)


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Estimated Jaccard similarity of the shingle sets behind two signatures."""
    return float(np.mean(a == b))


def bands(sig: np.ndarray):
    rows = PERMUTATIONS // BANDS
    for i in range(BANDS):
        yield i, hashlib.blake2b(sig[i * rows:(i + 1) * rows].tobytes(), digest_size=8).digest()


def _signed(keyed, mode: str):
    key, pair = keyed
    if pair.is_tokenized:  # ids, no text: nothing to compare
        return
    sig = signature(texts_of(pair, mode))
    if sig is not None:
        yield key, sig


def _bucket_entries(keyed_sig):
    key, sig = keyed_sig
    for band in bands(sig):
        yield band, (key, sig)


def _similar_in_bucket(bucket, threshold: float):
    """(record key, (earliest similar key, similarity)) for each member near the bucket's earliest."""
    _, members = bucket
    members = sorted(members, key=lambda m: m[0])
    for i, (key, sig) in enumerate(members):
        # the earliest member of another record: the pairs made of one record's K responses share
        # its prompt by design, and are never each other's near-duplicates
        first = next(((k, g) for k, g in members[:i] if k[:2] != key[:2]), None)
        if first is not None and (s := similarity(sig, first[1])) >= threshold:
            yield key, (first[0], s)


class _DropFn(beam.DoFn):
    def __init__(self, mode: str):
        self.mode = mode

    def process(self, keyed, near: dict):
        key, pair = keyed
        if key not in near:
            yield pair
            return
        kept, s = near[key]
        while kept in near:  # a chain: follow it to the record that is kept
            kept = near[kept][0]
        what = "prompt" if self.mode == "prompt" else "pair"
        err = Duplicate("near_duplicate", f"near-duplicate {what} (estimated Jaccard similarity {s:.2f} of "
                                          f"{SHINGLE}-word shingles) of {kept[0]}:{kept[1]}, which is kept")
        yield TaggedOutput(DEAD, dead_letter("near_dedup", pair.source, pair.line, pair.raw, err))


class DropNearDuplicates(beam.PTransform):
    """Keep one record of each group of near-duplicate prompts (``mode`` prompt) or pairs (``pair``);
    the others are dead letters (category duplicate, code near_duplicate) naming the kept record."""

    def __init__(self, mode: str, threshold: float):
        super().__init__()
        self.mode, self.threshold = mode, threshold

    def expand(self, pairs):
        keyed = pairs | "KeyByRecord" >> beam.Map(lambda p: ((p.source, p.line, p.pair_id), p))  # one record: several pairs
        near = (
            keyed
            | "MinHash" >> beam.FlatMap(_signed, self.mode)
            | "LSHBands" >> beam.FlatMap(_bucket_entries)
            | "GroupByBand" >> beam.GroupByKey()
            | "CompareInBucket" >> beam.FlatMap(_similar_in_bucket, self.threshold)
            | "EarliestSimilar" >> beam.CombinePerKey(min)
        )
        out = keyed | "DropNear" >> beam.ParDo(_DropFn(self.mode), AsDict(near)).with_outputs(DEAD, main="main")
        return {"main": out.main, "dead": out[DEAD]}
