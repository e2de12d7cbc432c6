"""The preprocess steps' cores: each takes one element (a file, a raw record, a batch) and yields
what it passes on and what it sets aside, as ``(tag, value)`` events: ``MAIN`` the element for the
next step, ``DEAD`` a dead letter (a record not written, with its reason), ``NOTED`` a count of
something written for a reason (a score tie kept, pairs made of one prompt's responses), ``FILES``
a file's record count and layout.

Pure functions, no Beam: the Beam stage wraps each in its DoFn (``pipelines.transforms``), and
``rendering.prepare`` chains them in one process (`rmflow eval` of raw files), so both count and
write alike.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from rmflow.rendering.files import FileSystem, iter_records
from rmflow.rendering.formats import BadRecord, Duplicate, Tie, detect_format, parse_json_object
from rmflow.rendering.responses import group_rows, normalize_all, read_row
from rmflow.rendering.tokenize import RecordTokenizer
from rmflow.schemas import jsontext
from rmflow.schemas.record import encode

MAIN = "main"
DEAD = "dead"
NOTED = "noted"  # records written and counted for a reason (a score tie kept, pairs made)
FILES = "files"
INTERNAL_ERROR = "internal_error"

Event = tuple[str, Any]


def dead_letter(stage: str, source: str, line: int, raw: Any, err: BadRecord) -> dict[str, Any]:
    return {"source": source, "line": line, "stage": stage, "category": err.category, "code": err.code,
            "reason": err.message, "record": raw}


def as_bad_record(e: Exception) -> BadRecord:
    """Whatever one record raised, as the reason it was not written: a ``BadRecord`` keeps its
    code; anything unexpected (a bug here or in a library, a RecursionError on absurd nesting)
    becomes ``internal_error`` with the exception's text, so one record never stops the job."""
    if isinstance(e, BadRecord):
        return e
    text = str(e)
    text = text if len(text) <= 500 else text[:500] + "..."
    return BadRecord(INTERNAL_ERROR, f"unexpected error while processing this record: {type(e).__name__}: {text}")


class Grouped(BadRecord):
    """Not an error: a row of a response-a-row layout, read into its prompt's record (counted, so
    that rows read = records made of them + these)."""

    category = "grouped"


class Made(BadRecord):
    """Not an error: the extra pairs one record made (its K responses' pairs, past the first),
    counted (``count``) so that records read plus pairs made equals what was written or not."""

    category = "made"


class Merged(BadRecord):
    """Not an error: a response given twice in one record with the same score, kept once."""

    category = "merged"


class Weighted(BadRecord):
    """Not an error: a record whose scores are its responses' ratings weighted by
    --attribute-weights (counted: the manifest says its labels come from those weights)."""

    category = "weighted"


class KeptUnranked(BadRecord):
    """Not an error: a record with nothing to rank (one response, or all of one score) written for
    its attribute ratings (counted)."""

    category = "unranked_kept"


def _noted(stage: str, source: str, line: int, note: BadRecord, count: int = 1) -> Event:
    letter = dead_letter(stage, source, line, "", note)
    return NOTED, ({**letter, "count": count} if count != 1 else letter)


# --------------------------------------------------------------------------- read


def read_file(path: str, fmt: str, fs: FileSystem | None = None) -> Iterator[Event]:
    """One input file to (source, line, format, raw JSON text) records; the format is detected per
    file from its first record that fits a layout, unless forced. A file whose first JSON object
    fits several layouts is not guessed at: each of its records is set aside as ``ambiguous_layout``.
    Last, the file's count of records read and its layout (``FILES``)."""
    layout = None if fmt == "auto" else fmt
    ambiguous: BadRecord | None = None
    n = last_line = 0
    try:
        for line, raw, problem in iter_records(path, fs):
            n, last_line = n + 1, line
            if problem:
                yield DEAD, dead_letter("read", path, line, raw, BadRecord("bad_encoding", problem))
            elif ambiguous is not None:  # the file's layout is undecidable: none of it is guessed
                yield DEAD, dead_letter("read", path, line, raw, ambiguous)
            elif layout is None:  # parse here only until the file's layout is known
                try:
                    layout = detect_format(parse_json_object(raw))
                except Exception as e:  # noqa: BLE001 - contained to this record
                    err = as_bad_record(e)
                    if err.code == "ambiguous_layout":
                        ambiguous = BadRecord(err.code, f"the file's layout is ambiguous: {err.message}")
                    yield DEAD, dead_letter("read", path, line, raw, ambiguous or err)
                    continue
                yield MAIN, (path, line, layout, raw)
            else:
                yield MAIN, (path, line, layout, raw)
    except Exception as e:  # noqa: BLE001 - a truncated gzip, an unreadable Parquet file ...
        n += 1
        err = BadRecord("unreadable_file", f"reading stopped after line {last_line}: {type(e).__name__}: {e}")
        yield DEAD, dead_letter("read", path, last_line + 1, None, err)
    yield FILES, (path, n, layout)  # layout: the file's, as read (None: none detected)


# --------------------------------------------------------------------------- normalize


def normalize_record(element: tuple, options: dict[str, Any], weights: dict[str, float] | None) -> Iterator[Event]:
    """A raw record to canonical pairs (or one prompt's K responses, or a solution); what cannot be
    one is a dead letter, and what is written for a reason is noted (a score tie kept, responses
    merged or left out, pairs made of K responses)."""
    source, line, fmt, raw = element
    stage = f"normalize:{fmt}"
    try:
        pairs, responses = normalize_all(parse_json_object(raw), fmt, source=source, line=line, options=options,
                                         weights=weights)
    except Exception as e:  # noqa: BLE001 - contained to this record
        yield DEAD, dead_letter(stage, source, line, raw, as_bad_record(e))
        return
    if responses is not None:
        yield from _response_notes(stage, source, line, responses)
    if len(pairs) > 1:  # the pairs of a prompt's K responses: counted, so the job reconciles exactly
        made = Made("pairs_from_responses", f"{len(pairs)} pairs made of one prompt's responses")
        yield _noted(stage, source, line, made, len(pairs) - 1)
    for pair in pairs:  # one, or the pairs of a prompt's K responses
        if getattr(pair, "score_gap", None) == 0:
            yield _noted(stage, source, line, Tie("score_tie_kept", "score_chosen = score_rejected (kept; "
                                                                    "--drop-score-ties drops it)"))
        yield MAIN, dataclasses.replace(pair, raw=raw)


def _response_notes(stage: str, source: str, line: int, responses) -> Iterator[Event]:
    """What a record of K responses was written with: responses merged or left out (counted, never
    silent), nothing to rank (kept for its ratings), scores from weighted ratings."""
    for n, note in ((responses.merged, Merged("duplicate_response", "a response given twice with the same score, "
                                                                    "kept once")),
                    (responses.dropped, Merged("empty_response", "an empty response, left out of its record")),
                    (responses.contradicted, Merged("contradicting_response", "the same text scored two ways, left "
                                                                              "out of its record")),
                    (responses.capped, Merged("capped_response", "a response past --max-responses, left out of its "
                                                                 "record"))):
        if n:
            yield _noted(stage, source, line, note, n)
    if not responses.ranked:
        yield _noted(stage, source, line, KeptUnranked("unranked_kept", "nothing to rank: written for its attribute "
                                                                        "ratings"))
    if responses.weighted:
        yield _noted(stage, source, line, Weighted("scored_by_weights", "scored by the weighted sum of its responses' "
                                                                        "attribute ratings"))


def keyed_row(element: tuple, weights: dict[str, float], attributes: tuple[str, ...]) -> Iterator[Event]:
    """A response-a-row layout's row, keyed by its prompt; a bad row is a dead letter."""
    source, line, fmt, raw = element
    try:
        row = read_row(parse_json_object(raw), source=source, line=line, weights=weights, attributes=attributes)
    except Exception as e:  # noqa: BLE001 - contained to this row
        yield DEAD, dead_letter(f"normalize:{fmt}", source, line, raw, as_bad_record(e))
        return
    yield MAIN, (row.key, row)


def grouped_record(rows: list) -> Iterator[Event]:
    """One prompt's rows as one ``responses`` record, named by its first row; each other row is
    counted (``Grouped``), so that the job reconciles its rows read exactly."""
    rows = sorted(rows, key=lambda r: (r.source, r.line))
    first = rows[0]
    for r in rows[1:]:
        note = Grouped("response_row", f"a response of the prompt of {os.path.basename(first.source)}:{first.line}")
        yield _noted("group", r.source, r.line, note)
    yield MAIN, (first.source, first.line, "responses", jsontext.dumps(group_rows(rows), ensure_ascii=False))


def keep_first(pairs: list) -> Iterator[Event]:
    """Of records with one content id keep the first by (source, line); the rest are duplicates."""
    first, *rest = sorted(pairs, key=lambda p: (p.source, p.line))
    yield MAIN, first
    for p in rest:
        yield DEAD, dead_letter("dedup", p.source, p.line, p.raw,
                                Duplicate("duplicate", f"exact duplicate of {first.source}:{first.line}"))


# --------------------------------------------------------------------------- template + tokenize


def per_record(fn: Callable[[list], list], batch: list) -> list:
    """``fn`` maps a batch to one result (or BadRecord) per item; if the batch call itself raises,
    each item is retried alone and an item that still raises gets its own reason."""
    try:
        return fn(batch)
    except Exception:  # noqa: BLE001 - find the record(s) responsible
        out = []
        for item in batch:
            try:
                out.extend(fn([item]))
            except Exception as e:  # noqa: BLE001 - contained to this record
                out.append(as_bad_record(e))
        return out


def render_batch(tokenizer: RecordTokenizer, batch: list) -> Iterator[Event]:
    """Canonical records rendered with the chat template (template errors dead-lettered)."""
    for canonical, r in zip(batch, per_record(tokenizer.render, batch)):
        if isinstance(r, BadRecord):
            yield DEAD, dead_letter("chat_template", canonical.source, canonical.line, canonical.raw, r)
        else:
            yield MAIN, r


def tokenize_batch(tokenizer: RecordTokenizer, batch: list, max_length: int | None, policy: str
                   ) -> Iterator[Event]:
    """Rendered records to token ids; with ``max_length``, a text its characters alone show too
    long for it is never tokenized (``RecordTokenizer.too_long``)."""
    def tokenize(items: list) -> list:
        return tokenizer.tokenize(items, max_length=max_length, policy=policy)

    for r, result in zip(batch, per_record(tokenize, batch)):
        if isinstance(result, BadRecord):
            c = r.canonical
            yield DEAD, dead_letter("tokenize", c.source, c.line, c.raw, result)
        else:
            yield MAIN, result


# --------------------------------------------------------------------------- length policy


def fit_length(tp, max_length: int, policy: str, names: dict[str, str]) -> Iterator[Event]:
    """A tokenized record fitted to ``max_length`` by the length policy and encoded (a record the
    codec refuses is dead-lettered, not fatal): ``(record, encoded, (source, line), truncated,
    special text, split key)``. ``names``: the inputs whose records name them by more than their
    file name (``files.source_names``). Responses left out of a record that is written: noted."""
    p = tp.canonical
    try:
        record = tp.fit(max_length, policy)
        if p.source in names:
            record = dataclasses.replace(record, source=names[p.source])
        encoded = encode(record)
    except Exception as e:  # noqa: BLE001 - contained to this record
        yield DEAD, dead_letter("length", p.source, p.line, p.raw, as_bad_record(e))
        return
    for n, code, why in tp.left_out(max_length, policy, record):  # parts of a written record left out: counted
        if n:
            yield _noted("length", p.source, p.line, Merged(code, why), n)
    yield MAIN, (record, encoded, (p.source, p.line), record.prompt_len != tp.prompt_len, tp.special_text, p.split_key)
