"""Binary codec for one tokenized preference pair: the unit stored in every shard.

The record is read on the training hot path, so decoding is one ``struct`` unpack, one
CRC check and two zero-copy ``numpy.frombuffer`` views. Layout (little endian)::

    0   magic        4s   b"RMPR"
    4   version      u8   RECORD_VERSION
    5   flags        u8   bit 0: margin present, bit 1: subset present
    6   reserved     u16  0
    8   n_chosen     u32  tokens in the chosen sequence (prompt + chosen reply)
    12  n_rejected   u32  tokens in the rejected sequence (prompt + rejected reply)
    16  chosen_last  u32  index of the token whose score is the chosen reward
    20  rejected_last u32 same for the rejected sequence
    24  prompt_len   u32  leading tokens shared by both sequences (the prompt)
    28  margin       f32  0.0 when absent
    32  pair_id      16s  stable content hash of the pair
    48  source_len   u16
    50  subset_len   u16
    52  source, subset    utf-8, then zero padding to a multiple of 4
    ..  chosen ids   i32[n_chosen]
    ..  rejected ids i32[n_rejected]
    -4  crc32        u32  of every byte before it

The reward positions are stored explicitly: with tokenizers whose pad id equals eos
(SmolLM2, many Llama fine-tunes) "the last non-pad token" cannot be found by search.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np

from schemas.errors import RmflowError

MAGIC = b"RMPR"
RECORD_VERSION = 1

_HEADER = struct.Struct("<4sBBHIIIIIf16sHH")
_CRC = struct.Struct("<I")
_FLAG_MARGIN = 1
_FLAG_SUBSET = 2
_MAX_STR = 0xFFFF
_TOKENS = np.dtype("<i4")


class RecordCorruptError(RmflowError, ValueError):
    """A shard record failed its integrity checks (bad magic, version, CRC or bounds)."""


@dataclasses.dataclass(frozen=True, eq=False)
class PairRecord:
    """One tokenized preference pair.

    ``chosen_ids`` and ``rejected_ids`` are full sequences (prompt followed by the reply),
    unpadded. ``chosen_last``/``rejected_last`` index the token whose score is the reward.
    """

    chosen_ids: np.ndarray
    rejected_ids: np.ndarray
    chosen_last: int
    rejected_last: int
    prompt_len: int
    pair_id: str
    source: str = ""
    margin: float | None = None
    subset: str | None = None

    def __post_init__(self) -> None:
        for name in ("chosen_ids", "rejected_ids"):
            arr = np.asarray(getattr(self, name))
            if arr.ndim != 1:
                raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
            if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
                raise ValueError(f"{name} has token ids outside [0, 2**31)")
            object.__setattr__(self, name, arr.astype(_TOKENS, copy=False))
        _check_bounds(
            len(self.chosen_ids), len(self.rejected_ids),
            self.chosen_last, self.rejected_last, self.prompt_len, ValueError,
        )
        if len(bytes.fromhex(self.pair_id)) != 16:
            raise ValueError(f"pair_id must be 32 hex characters, got {self.pair_id!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PairRecord):
            return NotImplemented
        return (
            np.array_equal(self.chosen_ids, other.chosen_ids)
            and np.array_equal(self.rejected_ids, other.rejected_ids)
            and (self.chosen_last, self.rejected_last, self.prompt_len, self.pair_id,
                 self.source, self.margin, self.subset)
            == (other.chosen_last, other.rejected_last, other.prompt_len, other.pair_id,
                other.source, other.margin, other.subset)
        )

    __hash__ = None  # mutable numpy payload


def _check_bounds(n_c, n_r, c_last, r_last, prompt_len, exc) -> None:
    if n_c == 0 or n_r == 0:
        raise exc(f"empty sequence (chosen {n_c} tokens, rejected {n_r} tokens)")
    if not 0 <= c_last < n_c:
        raise exc(f"chosen_last {c_last} outside [0, {n_c})")
    if not 0 <= r_last < n_r:
        raise exc(f"rejected_last {r_last} outside [0, {n_r})")
    if not 0 <= prompt_len <= min(n_c, n_r):
        raise exc(f"prompt_len {prompt_len} outside [0, {min(n_c, n_r)}]")


def _utf8(value: str | None, field: str) -> bytes:
    raw = (value or "").encode("utf-8")
    if len(raw) > _MAX_STR:
        raise ValueError(f"{field} is {len(raw)} bytes; at most {_MAX_STR} fit in a record")
    return raw


def encode(rec: PairRecord) -> bytes:
    """Serialise a record; ``decode(encode(r)) == r``."""
    source = _utf8(rec.source, "source")
    subset = _utf8(rec.subset, "subset")
    flags = (_FLAG_MARGIN if rec.margin is not None else 0) | (
        _FLAG_SUBSET if rec.subset is not None else 0
    )
    header = _HEADER.pack(
        MAGIC, RECORD_VERSION, flags, 0,
        len(rec.chosen_ids), len(rec.rejected_ids),
        rec.chosen_last, rec.rejected_last, rec.prompt_len,
        float(rec.margin or 0.0), bytes.fromhex(rec.pair_id),
        len(source), len(subset),
    )
    strings = source + subset
    pad = b"\0" * (-(len(header) + len(strings)) % 4)
    body = b"".join((header, strings, pad, rec.chosen_ids.tobytes(), rec.rejected_ids.tobytes()))
    return body + _CRC.pack(zlib.crc32(body))


def decode(buf: bytes) -> PairRecord:
    """Parse and verify a record. Raises RecordCorruptError on any inconsistency."""
    n = len(buf)
    if n < _HEADER.size + _CRC.size:
        raise RecordCorruptError(f"record is {n} bytes, shorter than the {_HEADER.size}-byte header")
    (magic, version, flags, _, n_c, n_r, c_last, r_last, prompt_len, margin, pid,
     src_len, sub_len) = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RecordCorruptError(f"bad magic {magic!r}: not an rmflow pair record")
    if version != RECORD_VERSION:
        raise RecordCorruptError(
            f"record version {version}, this rmflow reads version {RECORD_VERSION}: "
            "re-run `rmflow preprocess` with this version"
        )
    (crc,) = _CRC.unpack_from(buf, n - _CRC.size)
    if zlib.crc32(memoryview(buf)[: n - _CRC.size]) != crc:
        raise RecordCorruptError("CRC mismatch: the record bytes are corrupted")
    str_end = _HEADER.size + src_len + sub_len
    tok_start = str_end + (-str_end % 4)
    if tok_start + 4 * (n_c + n_r) + _CRC.size != n:
        raise RecordCorruptError(f"length mismatch: header says {n_c}+{n_r} tokens, record has {n} bytes")
    _check_bounds(n_c, n_r, c_last, r_last, prompt_len, RecordCorruptError)
    chosen = np.frombuffer(buf, _TOKENS, n_c, tok_start)
    rejected = np.frombuffer(buf, _TOKENS, n_r, tok_start + 4 * n_c)
    rec = object.__new__(PairRecord)  # fields already validated: skip __post_init__
    for key, value in (
        ("chosen_ids", chosen), ("rejected_ids", rejected),
        ("chosen_last", c_last), ("rejected_last", r_last), ("prompt_len", prompt_len),
        ("pair_id", pid.hex()),
        ("source", bytes(buf[_HEADER.size : _HEADER.size + src_len]).decode("utf-8")),
        ("margin", float(margin) if flags & _FLAG_MARGIN else None),
        ("subset", bytes(buf[_HEADER.size + src_len : str_end]).decode("utf-8")
         if flags & _FLAG_SUBSET else None),
    ):
        object.__setattr__(rec, key, value)
    return rec


def peek_lengths(buf: bytes) -> tuple[int, int]:
    """(chosen tokens, rejected tokens) from the header alone; ``decode`` verifies the rest
    when the record is read for training."""
    if len(buf) < _HEADER.size or buf[:4] != MAGIC:
        raise RecordCorruptError("not an rmflow pair record (bad magic or too short)")
    fields = _HEADER.unpack_from(buf, 0)
    return fields[4], fields[5]
