"""Binary codecs for the units stored in shards: a tokenized preference pair (outcome reward
models, ``PairRecord``), a tokenized stepwise solution (process reward models, ``StepRecord``)
or one prompt with its K scored responses (``ResponsesRecord``).

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

A step record (magic b"RMST", same version and CRC rules)::

    0   magic        4s   b"RMST"
    4   version      u8   RECORD_VERSION
    5   flags        u8   bit 1: subset present
    6   reserved     u16  0
    8   n_tokens     u32  tokens of the sequence (prompt, then every step and its separator)
    12  n_steps      u32  labelled steps
    16  prompt_len   u32  leading tokens of the prompt
    20  record_id    16s  stable content hash of the record
    36  source_len   u16
    38  subset_len   u16
    40  source, subset    utf-8, then zero padding to a multiple of 4
    ..  input ids    i32[n_tokens]
    ..  step ends    i32[n_steps]  index of the token that scores each step, strictly increasing
    ..  labels       u8[n_steps]   1: the step is correct, 0: it is not; zero padding to 4 bytes
    -4  crc32        u32  of every byte before it

A responses record (magic b"RMKR", same version and CRC rules)::

    0   magic        4s   b"RMKR"
    4   version      u8   RECORD_VERSION
    5   flags        u8   bit 0: margins from the scores, bit 1: subset present
    6   reserved     u16  0
    8   k            u32  responses (at least 2; 1 with attribute ratings)
    12  attributes   u32  N: rated attributes per response (0: none)
    16  prompt_len   u32  tokens of the prompt, stored once
    20  n_tokens     u32  tokens of all responses together (each the continuation after the prompt)
    24  record_id    16s  stable content hash of the record
    40  source_len   u16
    42  subset_len   u16
    44  source, subset    utf-8, then zero padding to a multiple of 4
    ..  lengths      u32[k]     tokens of each response
    ..  lasts        u32[k]     index, in prompt + response i, of the token whose score is its reward
    ..  scores       f32[k]     each response's score, higher is better (a rank r is stored as -r)
    ..  attributes   f32[k * N] each response's attribute ratings, row by row
    ..  prompt ids   i32[prompt_len]
    ..  response ids i32[n_tokens]
    -4  crc32        u32  of every byte before it

``decode`` reads any kind (by magic); the manifest says which kind a shard folder holds.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
from rmflow.schemas.errors import RmflowError

MAGIC = b"RMPR"
STEP_MAGIC = b"RMST"
RESPONSES_MAGIC = b"RMKR"
RECORD_VERSION = 1

_HEADER = struct.Struct("<4sBBHIIIIIf16sHH")
_STEP_HEADER = struct.Struct("<4sBBHIII16sHH")
_RESPONSES_HEADER = struct.Struct("<4sBBHIIII16sHH")
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
            object.__setattr__(self, name, _token_array(getattr(self, name), name))
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

    @property
    def record_id(self) -> str:
        return self.pair_id

    def stat_lengths(self) -> dict[str, int]:
        """What the preprocessing statistics histogram: prompt, chosen and rejected tokens."""
        return {"prompt": self.prompt_len, "chosen": len(self.chosen_ids), "rejected": len(self.rejected_ids)}


@dataclasses.dataclass(frozen=True, eq=False)
class StepRecord:
    """One tokenized stepwise solution: the prompt and its steps, one sequence.

    ``step_ends[i]`` indexes the token whose prediction scores step i (the last token of the
    step and its separator); ``step_labels[i]`` is 1 when step i is correct, 0 when not.
    """

    input_ids: np.ndarray
    step_ends: np.ndarray
    step_labels: np.ndarray
    prompt_len: int
    record_id: str
    source: str = ""
    subset: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", _token_array(self.input_ids, "input_ids"))
        object.__setattr__(self, "step_ends", np.asarray(self.step_ends).astype(_TOKENS, copy=False))
        labels = np.asarray(self.step_labels)
        if labels.size and not np.isin(labels, (0, 1)).all():
            raise ValueError("step_labels must be 0 (incorrect) or 1 (correct)")
        object.__setattr__(self, "step_labels", labels.astype(np.uint8, copy=False))
        _check_steps(len(self.input_ids), self.step_ends, len(self.step_labels), self.prompt_len, ValueError)
        if len(bytes.fromhex(self.record_id)) != 16:
            raise ValueError(f"record_id must be 32 hex characters, got {self.record_id!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepRecord):
            return NotImplemented
        return (
            np.array_equal(self.input_ids, other.input_ids)
            and np.array_equal(self.step_ends, other.step_ends)
            and np.array_equal(self.step_labels, other.step_labels)
            and (self.prompt_len, self.record_id, self.source, self.subset)
            == (other.prompt_len, other.record_id, other.source, other.subset)
        )

    __hash__ = None

    def stat_lengths(self) -> dict[str, int]:
        """What the preprocessing statistics histogram: prompt and sequence tokens, steps, and
        how many of its steps are labelled incorrect."""
        return {"prompt": self.prompt_len, "sequence": len(self.input_ids), "steps": len(self.step_ends),
                "incorrect": int((self.step_labels == 0).sum())}

    @property
    def first_error(self) -> int:
        """Index of the first incorrect step, -1 when every step is correct."""
        wrong = np.flatnonzero(self.step_labels == 0)
        return int(wrong[0]) if wrong.size else -1


@dataclasses.dataclass(frozen=True, eq=False)
class ResponsesRecord:
    """One tokenized prompt and its K >= 2 responses, each with its score (higher is better) and
    optionally N attribute ratings (with them, K >= 1: a record kept to fit its ratings alone).

    The prompt is stored once (``prompt_ids``); response i is the continuation ``responses[i]``
    after it, so that ``sequence(i)`` (prompt, then response i) is what a pair record would hold
    as one side. ``lasts[i]`` indexes the token of ``sequence(i)`` whose score is its reward.
    """

    prompt_ids: np.ndarray
    responses: tuple[np.ndarray, ...]
    lasts: np.ndarray
    scores: np.ndarray
    record_id: str
    source: str = ""
    subset: str | None = None
    attributes: np.ndarray | None = None  # (K, N) float32; None or N = 0: no attributes
    margin_from_scores: bool = False  # Bradley-Terry's margin between two responses: their score difference

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", _token_array(self.prompt_ids, "prompt_ids"))
        object.__setattr__(self, "responses", tuple(_token_array(r, f"responses[{i}]")
                                                    for i, r in enumerate(self.responses)))
        k = len(self.responses)
        object.__setattr__(self, "lasts", np.asarray(self.lasts).astype(_TOKENS, copy=False))
        object.__setattr__(self, "scores", np.asarray(self.scores, np.float32))
        attrs = np.zeros((k, 0), np.float32) if self.attributes is None else np.asarray(self.attributes, np.float32)
        if attrs.ndim == 1 and attrs.size == 0:
            attrs = attrs.reshape(k, 0)
        object.__setattr__(self, "attributes", attrs)
        _check_responses(len(self.prompt_ids), [len(r) for r in self.responses], self.lasts, self.scores,
                         self.attributes, ValueError)
        if len(bytes.fromhex(self.record_id)) != 16:
            raise ValueError(f"record_id must be 32 hex characters, got {self.record_id!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ResponsesRecord):
            return NotImplemented
        return (
            np.array_equal(self.prompt_ids, other.prompt_ids)
            and len(self.responses) == len(other.responses)
            and all(np.array_equal(a, b) for a, b in zip(self.responses, other.responses))
            and np.array_equal(self.lasts, other.lasts)
            and np.array_equal(self.scores, other.scores)
            and np.array_equal(self.attributes, other.attributes)
            and (self.record_id, self.source, self.subset, self.margin_from_scores)
            == (other.record_id, other.source, other.subset, other.margin_from_scores)
        )

    __hash__ = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def k(self) -> int:
        return len(self.responses)

    @property
    def unit_len(self) -> int:
        """Its tokens laid out as one unit: the prompt once, then every response."""
        return self.prompt_len + sum(len(r) for r in self.responses)

    def sequence(self, i: int) -> np.ndarray:
        """The prompt then response ``i``: the whole conversation its reward scores."""
        return np.concatenate([self.prompt_ids, self.responses[i]])

    def stat_lengths(self) -> dict[str, int]:
        """What the preprocessing statistics histogram: the prompt, the longest conversation
        (prompt and its longest response), the responses, and the tokens stored (prompt once)."""
        longest = max(len(r) for r in self.responses)
        return {"prompt": self.prompt_len, "longest": self.prompt_len + longest, "responses": self.k,
                "tokens": self.unit_len}


def _check_responses(prompt_len: int, lengths: list[int], lasts: np.ndarray, scores: np.ndarray,
                     attributes: np.ndarray, exc) -> None:
    k = len(lengths)
    if k < (1 if attributes.size else 2):  # one response: only to fit its ratings
        raise exc(f"a responses record needs at least 2 responses (1 with attribute ratings), got {k}")
    if any(n == 0 for n in lengths):
        raise exc("a response has no tokens")
    if lasts.shape != (k,) or scores.shape != (k,):
        raise exc(f"{k} responses need {k} reward indices and {k} scores, got {lasts.shape} and {scores.shape}")
    if attributes.ndim != 2 or attributes.shape[0] != k:
        raise exc(f"attributes must be ({k}, N), got {attributes.shape}")
    if not np.isfinite(scores).all() or not np.isfinite(attributes).all():
        raise exc("scores and attributes must be finite")
    for i, (n, last) in enumerate(zip(lengths, lasts)):
        if not 0 <= last < prompt_len + n:
            raise exc(f"lasts[{i}] {int(last)} outside [0, {prompt_len + n})")


def _token_array(value, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} has token ids outside [0, 2**31)")
    return arr.astype(_TOKENS, copy=False)


def _check_steps(n: int, ends: np.ndarray, n_labels: int, prompt_len: int, exc) -> None:
    if n == 0:
        raise exc("empty sequence")
    if ends.ndim != 1 or not len(ends):
        raise exc("a step record needs at least one step")
    if len(ends) != n_labels:
        raise exc(f"{len(ends)} step ends but {n_labels} labels")
    if not 0 <= prompt_len < n:
        raise exc(f"prompt_len {prompt_len} outside [0, {n})")
    if ends[0] < 0 or ends[-1] >= n or (len(ends) > 1 and (np.diff(ends) <= 0).any()):
        raise exc(f"step ends must increase strictly within [0, {n}), got {ends.tolist()[:8]}")


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


def encode(rec: PairRecord | StepRecord | ResponsesRecord) -> bytes:
    """Serialise a record; ``decode(encode(r)) == r``."""
    if isinstance(rec, StepRecord):
        return _encode_steps(rec)
    if isinstance(rec, ResponsesRecord):
        return _encode_responses(rec)
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


def _encode_steps(rec: StepRecord) -> bytes:
    source = _utf8(rec.source, "source")
    subset = _utf8(rec.subset, "subset")
    header = _STEP_HEADER.pack(
        STEP_MAGIC, RECORD_VERSION, _FLAG_SUBSET if rec.subset is not None else 0, 0,
        len(rec.input_ids), len(rec.step_ends), rec.prompt_len, bytes.fromhex(rec.record_id),
        len(source), len(subset),
    )
    strings = source + subset
    pad = b"\0" * (-(len(header) + len(strings)) % 4)
    labels = rec.step_labels.tobytes()
    body = b"".join((header, strings, pad, rec.input_ids.tobytes(), rec.step_ends.tobytes(), labels,
                     b"\0" * (-len(labels) % 4)))
    return body + _CRC.pack(zlib.crc32(body))


def _encode_responses(rec: ResponsesRecord) -> bytes:
    source = _utf8(rec.source, "source")
    subset = _utf8(rec.subset, "subset")
    lengths = np.array([len(r) for r in rec.responses], "<u4")
    header = _RESPONSES_HEADER.pack(
        RESPONSES_MAGIC, RECORD_VERSION,
        (_FLAG_SUBSET if rec.subset is not None else 0) | (_FLAG_MARGIN if rec.margin_from_scores else 0), 0,
        rec.k, rec.attributes.shape[1], rec.prompt_len, int(lengths.sum()), bytes.fromhex(rec.record_id),
        len(source), len(subset),
    )
    strings = source + subset
    pad = b"\0" * (-(len(header) + len(strings)) % 4)
    body = b"".join((header, strings, pad, lengths.tobytes(), rec.lasts.astype("<u4").tobytes(),
                     rec.scores.astype("<f4").tobytes(), rec.attributes.astype("<f4").tobytes(),
                     rec.prompt_ids.tobytes(), *(r.tobytes() for r in rec.responses)))
    return body + _CRC.pack(zlib.crc32(body))


def _decode_responses(buf: bytes) -> ResponsesRecord:
    _verify(buf, _RESPONSES_HEADER, "responses record")
    _, _, flags, _, k, n_attr, prompt_len, n_tok, rid, src_len, sub_len = _RESPONSES_HEADER.unpack_from(buf, 0)
    str_end = _RESPONSES_HEADER.size + src_len + sub_len
    at = str_end + (-str_end % 4)
    if at + 4 * (3 * k + k * n_attr + prompt_len + n_tok) + _CRC.size != len(buf):
        raise RecordCorruptError(f"length mismatch: header says {k} responses, {n_attr} attributes and "
                                 f"{prompt_len}+{n_tok} tokens, record has {len(buf)} bytes")
    lengths = np.frombuffer(buf, "<u4", k, at)
    lasts = np.frombuffer(buf, "<u4", k, at + 4 * k).astype(_TOKENS)
    scores = np.frombuffer(buf, "<f4", k, at + 8 * k)
    attributes = np.frombuffer(buf, "<f4", k * n_attr, at + 12 * k).reshape(k, n_attr)
    tok = at + 4 * (3 * k + k * n_attr)
    if int(lengths.sum()) != n_tok:
        raise RecordCorruptError(f"response lengths add up to {int(lengths.sum())}, the header says {n_tok}")
    prompt = np.frombuffer(buf, _TOKENS, prompt_len, tok)
    ends = np.cumsum(lengths, dtype=np.int64)
    start = tok + 4 * prompt_len
    responses = tuple(np.frombuffer(buf, _TOKENS, int(n), start + 4 * int(e - n)) for n, e in zip(lengths, ends))
    _check_responses(prompt_len, [int(n) for n in lengths], lasts, scores, attributes, RecordCorruptError)
    rec = object.__new__(ResponsesRecord)
    for key, value in (
        ("prompt_ids", prompt), ("responses", responses), ("lasts", lasts), ("scores", scores),
        ("record_id", rid.hex()),
        ("source", bytes(buf[_RESPONSES_HEADER.size : _RESPONSES_HEADER.size + src_len]).decode("utf-8")),
        ("subset", bytes(buf[_RESPONSES_HEADER.size + src_len : str_end]).decode("utf-8")
         if flags & _FLAG_SUBSET else None),
        ("attributes", attributes), ("margin_from_scores", bool(flags & _FLAG_MARGIN)),
    ):
        object.__setattr__(rec, key, value)
    return rec


def _verify(buf: bytes, header: struct.Struct, what: str) -> None:
    n = len(buf)
    if n < header.size + _CRC.size:
        raise RecordCorruptError(f"record is {n} bytes, shorter than the {header.size}-byte {what} header")
    version = buf[4]
    if version != RECORD_VERSION:
        raise RecordCorruptError(
            f"record version {version}, this rmflow reads version {RECORD_VERSION}: "
            "re-run `rmflow preprocess` with this version"
        )
    (crc,) = _CRC.unpack_from(buf, n - _CRC.size)
    if zlib.crc32(memoryview(buf)[: n - _CRC.size]) != crc:
        raise RecordCorruptError("CRC mismatch: the record bytes are corrupted")


def _decode_steps(buf: bytes) -> StepRecord:
    _verify(buf, _STEP_HEADER, "step record")
    _, _, flags, _, n_tok, n_steps, prompt_len, rid, src_len, sub_len = _STEP_HEADER.unpack_from(buf, 0)
    str_end = _STEP_HEADER.size + src_len + sub_len
    tok_start = str_end + (-str_end % 4)
    labels_start = tok_start + 4 * (n_tok + n_steps)
    if labels_start + n_steps + (-n_steps % 4) + _CRC.size != len(buf):
        raise RecordCorruptError(f"length mismatch: header says {n_tok} tokens and {n_steps} steps, "
                                 f"record has {len(buf)} bytes")
    ids = np.frombuffer(buf, _TOKENS, n_tok, tok_start)
    ends = np.frombuffer(buf, _TOKENS, n_steps, tok_start + 4 * n_tok)
    labels = np.frombuffer(buf, np.uint8, n_steps, labels_start)
    _check_steps(n_tok, ends, n_steps, prompt_len, RecordCorruptError)
    if (labels > 1).any():
        raise RecordCorruptError("step labels must be 0 or 1")
    rec = object.__new__(StepRecord)
    for key, value in (
        ("input_ids", ids), ("step_ends", ends), ("step_labels", labels), ("prompt_len", prompt_len),
        ("record_id", rid.hex()),
        ("source", bytes(buf[_STEP_HEADER.size : _STEP_HEADER.size + src_len]).decode("utf-8")),
        ("subset", bytes(buf[_STEP_HEADER.size + src_len : str_end]).decode("utf-8")
         if flags & _FLAG_SUBSET else None),
    ):
        object.__setattr__(rec, key, value)
    return rec


def decode(buf: bytes) -> PairRecord | StepRecord | ResponsesRecord:
    """Parse and verify a record of any kind. Raises RecordCorruptError on any inconsistency."""
    if bytes(buf[:4]) == STEP_MAGIC:
        return _decode_steps(buf)
    if bytes(buf[:4]) == RESPONSES_MAGIC:
        return _decode_responses(buf)
    n = len(buf)
    if n < _HEADER.size + _CRC.size:
        raise RecordCorruptError(f"record is {n} bytes, shorter than the {_HEADER.size}-byte header")
    (magic, _version, flags, _, n_c, n_r, c_last, r_last, prompt_len, margin, pid,
     src_len, sub_len) = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RecordCorruptError(f"bad magic {magic!r}: not an rmflow pair record")
    _verify(buf, _HEADER, "pair record")
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
    """(chosen tokens, rejected tokens) from the header alone, (tokens, 0) for a step record and
    (tokens stored: the prompt once and every response, 0) for a responses record, as it is laid
    out in a row; ``decode`` verifies the rest when the record is read for training."""
    if len(buf) >= _STEP_HEADER.size and buf[:4] == STEP_MAGIC:
        return _STEP_HEADER.unpack_from(buf, 0)[4], 0
    if len(buf) >= _RESPONSES_HEADER.size and buf[:4] == RESPONSES_MAGIC:
        fields = _RESPONSES_HEADER.unpack_from(buf, 0)
        return fields[6] + fields[7], 0
    if len(buf) < _HEADER.size or buf[:4] != MAGIC:
        raise RecordCorruptError("not an rmflow pair record (bad magic or too short)")
    fields = _HEADER.unpack_from(buf, 0)
    return fields[4], fields[5]


def item_tokens(item: object) -> int:
    """The tokens a scoring item runs: a unit's prompt once and its responses, or a conversation's."""
    return item.unit_len if isinstance(item, ResponsesRecord) else len(item)


def item_scores(item: object) -> int:
    """The scores a scoring item yields: one per response of a unit (``is_unit``), one for a conversation."""
    return item.k if isinstance(item, ResponsesRecord) else 1


def is_unit(item: object) -> bool:
    """Whether a scoring item is a unit of one prompt's K responses (the prompt once, then each
    response: a ``ResponsesRecord``) rather than one encoded conversation."""
    return isinstance(item, ResponsesRecord)
