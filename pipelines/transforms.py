"""The preprocess steps as Beam composite PTransforms, thin wrappers over the pure cores.

Every step that can reject a record returns ``{"main": ..., "dead": ...}``; dead letters
are dicts (source, line, stage, category, code, reason, record) and end in
``errors.jsonl``. Counters live in the ``rmflow`` namespace.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from collections.abc import Iterable
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.utils import shared
from rmflow.pipelines.finalize import finalize
from rmflow.pipelines.io import iter_records, write_array_record_shard
from rmflow.pipelines.splitting import assign_shard, assign_split
from rmflow.pipelines.tokenizer_files import read_tokenizer_files
from rmflow.rendering.formats import (
    BadRecord,
    CanonicalPair,
    Duplicate,
    Tie,
    detect_format,
    parse_json_object,
)
from rmflow.rendering.responses import group_rows, normalize_all, read_row
from rmflow.rendering.tokenize import (
    RecordTokenizer,
    Rendered,
    TokenizedResponses,
    TokenizerAssets,
    build_tokenizer,
)
from rmflow.schemas import jsontext
from rmflow.schemas.config import ROW_FORMATS, STEP_SEPARATOR, attribute_names
from rmflow.schemas.kinds import kind_of_record
from rmflow.schemas.manifest import shard_name
from rmflow.schemas.record import encode

NAMESPACE = "rmflow"
DEAD = "dead"
INTERNAL_ERROR = "internal_error"
FILES = "files"


def counter(name: str):
    return Metrics.counter(NAMESPACE, name)


def dead_letter(stage: str, source: str, line: int, raw: Any, err: BadRecord) -> dict[str, Any]:
    return {
        "source": source,
        "line": line,
        "stage": stage,
        "category": err.category,
        "code": err.code,
        "reason": err.message,
        "record": raw,
    }


def as_bad_record(e: Exception) -> BadRecord:
    """Whatever one record raised, as the reason it was not written: a ``BadRecord`` keeps its
    code; anything unexpected (a bug here or in a library, a RecursionError on absurd nesting)
    becomes ``internal_error`` with the exception's text, so one record never stops the job."""
    if isinstance(e, BadRecord):
        return e
    text = str(e)
    text = text if len(text) <= 500 else text[:500] + "..."
    return BadRecord(INTERNAL_ERROR, f"unexpected error while processing this record: {type(e).__name__}: {text}")


def _split_outputs(pcoll_tuple) -> dict[str, beam.PCollection]:
    return {"main": pcoll_tuple.main, "dead": pcoll_tuple[DEAD]}


# --------------------------------------------------------------------------- read


class ReadRecordsFn(beam.DoFn):
    """One input file to (source, line, format, raw JSON text); the format is detected per file
    from its first record that fits a layout, unless forced. A file whose first JSON object fits
    several layouts is not guessed at: each of its records is set aside as ``ambiguous_layout``."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.read = counter("records_read")

    def process(self, path: str):
        fmt = None if self.fmt == "auto" else self.fmt
        ambiguous: BadRecord | None = None
        n = 0
        last_line = 0
        try:
            for line, raw, problem in iter_records(path):
                n += 1
                last_line = line
                if problem:
                    yield TaggedOutput(DEAD, dead_letter("read", path, line, raw, BadRecord("bad_encoding", problem)))
                    continue
                if ambiguous is not None:  # the file's layout is undecidable: none of it is guessed
                    yield TaggedOutput(DEAD, dead_letter("read", path, line, raw, ambiguous))
                    continue
                if fmt is None:  # parse here only until the file's layout is known
                    try:
                        fmt = detect_format(parse_json_object(raw))
                    except Exception as e:  # noqa: BLE001 - contained to this record
                        err = as_bad_record(e)
                        if err.code == "ambiguous_layout":
                            ambiguous = BadRecord(err.code, f"the file's layout is ambiguous: {err.message}")
                        yield TaggedOutput(DEAD, dead_letter("read", path, line, raw, ambiguous or err))
                        continue
                yield path, line, fmt, raw
        except Exception as e:  # noqa: BLE001 - a truncated gzip, an unreadable Parquet file ...
            n += 1
            err = BadRecord("unreadable_file", f"reading stopped after line {last_line}: {type(e).__name__}: {e}")
            yield TaggedOutput(DEAD, dead_letter("read", path, last_line + 1, None, err))
        self.read.inc(n)
        yield TaggedOutput(FILES, (path, n, fmt))  # fmt: its layout, as read (None: none detected)


class ReadPreferenceData(beam.PTransform):
    def __init__(self, paths: list[str], fmt: str):
        super().__init__()
        self.paths, self.fmt = paths, fmt

    def expand(self, pbegin):
        out = (
            pbegin
            | "Files" >> beam.Create(self.paths)
            | "ReadFiles" >> beam.ParDo(ReadRecordsFn(self.fmt)).with_outputs(DEAD, FILES, main="main")
        )
        # Files are read whole by one worker each; spread their records over all workers.
        main = out.main | "Spread" >> beam.Reshuffle()
        return {"main": main, "dead": out[DEAD], "files": out[FILES]}


# --------------------------------------------------------------------------- normalize


NOTED = "noted"  # the tag of records written and counted for a reason (a score tie kept, pairs made)


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


class NormalizeFn(beam.DoFn):
    """Raw records to canonical pairs; what cannot be one is a dead letter, and a score tie kept
    is noted (dead-letter shaped, category tie, code score_tie_kept) so the stats count it."""

    def __init__(self, options: dict[str, Any], weights: dict[str, float] | None = None):
        self.options, self.weights = options, weights

    def process(self, element):
        source, line, fmt, raw = element
        try:
            pairs, responses = normalize_all(parse_json_object(raw), fmt, source=source, line=line,
                                             weights=self.weights, **self.options)
        except Exception as e:  # noqa: BLE001 - contained to this record
            yield TaggedOutput(DEAD, dead_letter(f"normalize:{fmt}", source, line, raw, as_bad_record(e)))
            return
        for n, note in ((responses.merged if responses else 0,
                         Merged("duplicate_response", "a response given twice with the same score, kept once")),
                        (responses.dropped if responses else 0,
                         Merged("empty_response", "an empty response, left out of its record")),
                        (responses.contradicted if responses else 0,
                         Merged("contradicting_response", "the same text scored two ways, left out of its record")),
                        (responses.capped if responses else 0,
                         Merged("capped_response", "a response past --max-responses, left out of its record"))):
            if n:  # the record is written all the same: counted, never silent
                yield TaggedOutput(NOTED, {**dead_letter(f"normalize:{fmt}", source, line, "", note), "count": n})
        if responses is not None and not responses.ranked:
            note = KeptUnranked("unranked_kept", "nothing to rank: written for its attribute ratings")
            yield TaggedOutput(NOTED, dead_letter(f"normalize:{fmt}", source, line, "", note))
        if responses is not None and responses.weighted:
            note = Weighted("scored_by_weights", "scored by the weighted sum of its responses' attribute ratings")
            yield TaggedOutput(NOTED, dead_letter(f"normalize:{fmt}", source, line, "", note))
        if len(pairs) > 1:  # the pairs of a prompt's K responses: counted, so the job reconciles exactly
            made = Made("pairs_from_responses", f"{len(pairs)} pairs made of one prompt's responses")
            yield TaggedOutput(NOTED, {**dead_letter(f"normalize:{fmt}", source, line, "", made),
                                       "count": len(pairs) - 1})
        for pair in pairs:  # one, or the pairs of a prompt's K responses
            if getattr(pair, "score_gap", None) == 0:
                note = Tie("score_tie_kept", "score_chosen = score_rejected (kept; --drop-score-ties drops it)")
                yield TaggedOutput(NOTED, dead_letter(f"normalize:{fmt}", source, line, "", note))
            yield dataclasses.replace(pair, raw=raw)


class ReadRowFn(beam.DoFn):
    """A response-a-row layout's row, keyed by its prompt; a bad row is a dead letter."""

    def __init__(self, weights: dict[str, float], attributes: tuple[str, ...] = ()):
        self.weights, self.attributes = weights, attributes

    def process(self, element):
        source, line, fmt, raw = element
        try:
            row = read_row(parse_json_object(raw), source=source, line=line, weights=self.weights,
                           attributes=self.attributes)
        except Exception as e:  # noqa: BLE001 - contained to this row
            yield TaggedOutput(DEAD, dead_letter(f"normalize:{fmt}", source, line, raw, as_bad_record(e)))
            return
        yield row.key, row


class GroupedFn(beam.DoFn):
    """One prompt's rows as one ``responses`` record, named by its first row; each other row is
    counted (``Grouped``), so that the job reconciles its rows read exactly."""

    def process(self, element):
        _, rows = element
        rows = sorted(rows, key=lambda r: (r.source, r.line))
        first = rows[0]
        for r in rows[1:]:
            note = Grouped("response_row", f"a response of the prompt of {os.path.basename(first.source)}:{first.line}")
            yield TaggedOutput(NOTED, dead_letter("group", r.source, r.line, "", note))
        yield first.source, first.line, "responses", jsontext.dumps(group_rows(rows), ensure_ascii=False)


class GroupRows(beam.PTransform):
    """The rows of a response-a-row layout (``ROW_FORMATS``) grouped by their prompt (GroupByKey)
    into one record each. Outputs main (records in the ``responses`` layout), dead and noted."""

    def __init__(self, weights: dict[str, float], attributes: tuple[str, ...] = ()):
        super().__init__()
        self.weights, self.attributes = weights, attributes

    def expand(self, rows):
        keyed = rows | "ReadRows" >> beam.ParDo(ReadRowFn(self.weights, self.attributes)).with_outputs(DEAD, main="main")
        out = (keyed.main | "GroupByPrompt" >> beam.GroupByKey()
               | "ToRecords" >> beam.ParDo(GroupedFn()).with_outputs(NOTED, main="main"))
        return {"main": out.main, "dead": keyed[DEAD], "noted": out[NOTED]}


class NormalizePairs(beam.PTransform):
    """``options``: the NORMALIZE_OPTIONS of the config; ``weights``: its attribute weights (the
    rows of response-a-row layouts are grouped first). Outputs main, dead and noted."""

    def __init__(self, options: dict[str, Any], weights: dict[str, float] | None = None):
        super().__init__()
        self.options, self.weights = options, weights or {"helpfulness": 1.0}

    def expand(self, records):
        single, rows = records | "ByLayout" >> beam.Partition(lambda r, _: int(r[2] in ROW_FORMATS), 2)
        grouped = rows | "GroupRows" >> GroupRows(self.weights, attribute_names(self.options.get("attributes", "")))
        records = (single, grouped["main"]) | "WithGrouped" >> beam.Flatten()
        out = records | "Normalize" >> beam.ParDo(NormalizeFn(self.options, self.weights)).with_outputs(
            DEAD, NOTED, main="main")
        dead = (out[DEAD], grouped["dead"]) | "NormalizeDead" >> beam.Flatten()
        noted = (out[NOTED], grouped["noted"]) | "NormalizeNoted" >> beam.Flatten()
        return {"main": out.main, "dead": dead, "noted": noted}


# --------------------------------------------------------------------------- dedup


class KeepFirstFn(beam.DoFn):
    """Of pairs with one content id keep the first by (source, line); the rest are duplicates."""

    def process(self, element):
        _, pairs = element
        first, *rest = sorted(pairs, key=lambda p: (p.source, p.line))
        yield first
        for p in rest:
            err = Duplicate("duplicate", f"exact duplicate of {first.source}:{first.line}")
            yield TaggedOutput(DEAD, dead_letter("dedup", p.source, p.line, p.raw, err))


class DropDuplicates(beam.PTransform):
    def expand(self, pairs):
        return _split_outputs(
            pairs
            | "KeyByContent" >> beam.Map(lambda p: (p.pair_id, p))
            | "GroupByContent" >> beam.GroupByKey()
            | "KeepFirst" >> beam.ParDo(KeepFirstFn()).with_outputs(DEAD, main="main")
        )


# --------------------------------------------------------------------------- template + tokenize


_TOKENIZERS = shared.Shared()  # one tokenizer per worker process, shared by every DoFn


def shared_record_tokenizer(assets: TokenizerAssets, step_separator: str = STEP_SEPARATOR) -> RecordTokenizer:
    """The process-wide RecordTokenizer for these assets (loaded once per worker process).

    The caller must keep the returned object referenced: the cache holds it weakly.
    """
    return _TOKENIZERS.acquire(lambda: RecordTokenizer(build_tokenizer(assets), step_separator),
                               tag=f"{assets.key}:{step_separator!r}")


class TokenizerFiles(beam.PTransform):
    """The tokenizer's files as a one-element PCollection, for the steps that read them as a side
    input. The graph holds only their folder's name: the launcher wrote them, as used, into the
    job's staging folder (``make_plan``), where the workers read them and whence they are published
    with the shards. Beam bz2-pickles every DoFn at level 9 when the graph is built and again as
    each bundle processor starts: a DoFn holding the tokenizer's files would make every job
    (de)compress them each time, and every Dataflow job submit that much more graph
    (tests/test_remote.py checks that no transform holds the files)."""

    def __init__(self, folder: str, name: str):
        super().__init__()
        self.folder, self.name = folder, name

    def expand(self, pbegin):
        return pbegin | "Impulse" >> beam.Impulse() | "Files" >> beam.Map(_staged_tokenizer, self.folder, self.name)


def _staged_tokenizer(_: Any, folder: str, name: str) -> TokenizerAssets:
    return read_tokenizer_files(folder, name)


class _TokenizerDoFn(beam.DoFn):
    """Takes the tokenizer's files as a side input (``TokenizerFiles``); the tokenizer built from
    them is shared by every DoFn of the worker process and built once (``shared_record_tokenizer``).
    A DoFn serves one step, whose side input is always the same files: it looks them up once, on
    its first batch (``setup`` cannot read side inputs), not per batch (their key hashes all of the tokenizer's files)."""

    def __init__(self, step_separator: str = STEP_SEPARATOR):
        self.step_separator = step_separator
        self.core: RecordTokenizer | None = None

    def tokenizer(self, assets: TokenizerAssets) -> RecordTokenizer:
        if self.core is None:
            self.core = shared_record_tokenizer(assets, self.step_separator)
        return self.core


def _per_record(fn, batch: list) -> list:
    """``fn`` maps a batch to one result (or BadRecord) per item; if the batch call itself raises,
    each item is retried alone and an item that still raises gets its own dead letter."""
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


class RenderFn(_TokenizerDoFn):
    """A batch of canonical pairs to a batch of rendered pairs (template errors dead-lettered)."""

    def process(self, batch: list[CanonicalPair], assets: TokenizerAssets):
        ok = []
        for pair, r in zip(batch, _per_record(self.tokenizer(assets).render, batch)):
            if isinstance(r, BadRecord):
                yield TaggedOutput(DEAD, dead_letter("chat_template", pair.source, pair.line, pair.raw, r))
            else:
                ok.append(r)
        if ok:
            yield ok


class TokenizeFn(_TokenizerDoFn):
    """Rendered records to token ids; with ``max_length``, a text its characters alone show too long
    for it is never tokenized (``RecordTokenizer.too_long``)."""

    def __init__(self, step_separator: str = STEP_SEPARATOR, max_length: int | None = None, policy: str = "drop"):
        super().__init__(step_separator)
        self.max_length, self.policy = max_length, policy
        self.tokens = counter("tokens")

    def process(self, batch: list[Rendered], assets: TokenizerAssets):
        tokenize = functools.partial(self.tokenizer(assets).tokenize, max_length=self.max_length, policy=self.policy)
        for r, result in zip(batch, _per_record(tokenize, batch)):
            if isinstance(result, BadRecord):
                yield TaggedOutput(DEAD, dead_letter("tokenize", r.canonical.source, r.canonical.line, r.canonical.raw, result))
            else:
                self.tokens.inc(result.n_tokens)
                yield result


class ApplyChatTemplate(beam.PTransform):
    """Batches pairs (the renderer and the tokenizer both work a batch per call) and renders them.
    ``tokenizer``: the ``TokenizerFiles`` PCollection."""

    def __init__(self, tokenizer, batch_size: int, step_separator: str = STEP_SEPARATOR):
        super().__init__()
        self.tokenizer, self.batch_size, self.step_separator = tokenizer, batch_size, step_separator

    def expand(self, pairs):
        return _split_outputs(
            pairs
            | "Batch" >> beam.BatchElements(min_batch_size=min(8, self.batch_size), max_batch_size=self.batch_size)
            | "Render" >> beam.ParDo(RenderFn(self.step_separator), beam.pvalue.AsSingleton(self.tokenizer))
            .with_outputs(DEAD, main="main")
        )


class Tokenize(beam.PTransform):
    """Rendered batches to token ids. ``tokenizer``: the ``TokenizerFiles`` PCollection; ``max_length``
    and ``policy``: the length policy's, which bounds the texts by characters before tokenizing."""

    def __init__(self, tokenizer, step_separator: str = STEP_SEPARATOR, max_length: int | None = None,
                 policy: str = "drop"):
        super().__init__()
        self.tokenizer, self.step_separator, self.max_length, self.policy = tokenizer, step_separator, max_length, policy

    def expand(self, rendered_batches):
        return _split_outputs(
            rendered_batches
            | "Encode" >> beam.ParDo(TokenizeFn(self.step_separator, self.max_length, self.policy),
                                     beam.pvalue.AsSingleton(self.tokenizer))
            .with_outputs(DEAD, main="main")
        )


# --------------------------------------------------------------------------- length policy


class LengthPolicyFn(beam.DoFn):
    """``names``: the inputs whose records name them by more than their file name (``source_names``)."""

    def __init__(self, max_length: int, policy: str, names: dict[str, str] | None = None):
        self.max_length, self.policy, self.names = max_length, policy, names or {}
        self.truncated = counter("prompt_truncated")

    def process(self, tp):
        p = tp.canonical
        try:
            record = tp.fit(self.max_length, self.policy)
            if p.source in self.names:
                record = dataclasses.replace(record, source=self.names[p.source])
            encoded = encode(record)  # here, so a record the codec refuses is dead-lettered, not fatal
        except Exception as e:  # noqa: BLE001 - contained to this record
            yield TaggedOutput(DEAD, dead_letter("length", p.source, p.line, p.raw, as_bad_record(e)))
            return
        truncated = record.prompt_len != tp.prompt_len
        if truncated:
            self.truncated.inc()
        if isinstance(tp, TokenizedResponses):  # responses left out of a record that is written: counted
            fit = len(tp.fitting(self.max_length, self.policy))
            for n, note in ((len(p.responses) - fit, Merged("long_response", "a response too long for max_length "
                                                            f"{self.max_length} with its prompt, left out of its record")),
                            (fit - record.k, Merged("capped_response", "a response past --max-responses, left out "
                                                    "of its record"))):
                if n:
                    yield TaggedOutput(NOTED, {**dead_letter("length", p.source, p.line, "", note), "count": n})
        yield record, encoded, (p.source, p.line), truncated, tp.special_text, p.split_key


class ApplyLengthPolicy(beam.PTransform):
    """Outputs main (records that fit), dead (records that do not) and noted (responses left out
    of a record that was written)."""

    def __init__(self, max_length: int, policy: str, names: dict[str, str] | None = None):
        super().__init__()
        self.max_length, self.policy, self.names = max_length, policy, names

    def expand(self, tokenized):
        out = tokenized | "Filter" >> beam.ParDo(LengthPolicyFn(self.max_length, self.policy, self.names)).with_outputs(
            DEAD, NOTED, main="main")
        return {"main": out.main, "dead": out[DEAD], "noted": out[NOTED]}


# --------------------------------------------------------------------------- split + write


def _to_shard_entry(item, eval_fraction: float, seed: int, shard_counts: dict[str, int]):
    rec, encoded, (source, line), truncated, special_text, split_key = item
    split = assign_split(split_key, eval_fraction, seed)  # a pair's content, or its prompt's (K responses)
    key = (split, assign_shard(rec.record_id, shard_counts[split]))
    return key, ((rec.record_id, source, line), encoded, rec.stat_lengths(), truncated,
                 kind_of_record(rec).name, special_text)


class SplitTrainEval(beam.PTransform):
    """Deterministic split by a salted hash of each record's split key (its content; the prompt's
    for the pairs of one prompt's K responses), then a shard key per record."""

    def __init__(self, eval_fraction: float, seed: int, shard_counts: dict[str, int]):
        super().__init__()
        self.eval_fraction, self.seed, self.shard_counts = eval_fraction, seed, shard_counts

    def expand(self, records):
        return records | "AssignSplitAndShard" >> beam.Map(
            _to_shard_entry, self.eval_fraction, self.seed, self.shard_counts
        )


class WriteShardFn(beam.DoFn):
    def __init__(self, folder: str, shard_counts: dict[str, int]):
        self.folder, self.shard_counts = folder, shard_counts
        self.written = counter("pairs_written")

    def process(self, element):
        (split, index), entries = element
        entries = sorted((e for e in entries if e is not None), key=lambda e: e[0])
        name = shard_name(split, index, self.shard_counts[split])
        write_array_record_shard(f"{self.folder}/{name}", [e[1] for e in entries])
        self.written.inc(len(entries))
        hist: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        sources: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # written, chosen longer
        for (_, source, _), _, lengths, _, _, _ in entries:
            for field, n in lengths.items():
                hist[field][n] += 1
            sources[source][0] += 1
            sources[source][1] += lengths.get("chosen", 0) > lengths.get("rejected", 0)
        yield {"split": split, "file": name, "records": len(entries), "truncated": sum(e[3] for e in entries),
               "special_text": sum(e[5] for e in entries),
               "lengths": {k: dict(v) for k, v in hist.items()},
               "kinds": dict(collections.Counter(e[4] for e in entries)),
               "sources": {k: v for k, v in sorted(sources.items())}}


class WriteShards(beam.PTransform):
    """Group pairs by shard (every shard exists, even if empty), sort each deterministically
    by pair id, write it as ArrayRecord with group_size:1."""

    def __init__(self, folder: str, shard_counts: dict[str, int]):
        super().__init__()
        self.folder, self.shard_counts = folder, shard_counts

    def expand(self, keyed):
        empty = [((s, i), None) for s, n in self.shard_counts.items() for i in range(n)]
        return (
            (keyed, keyed.pipeline | "AllShards" >> beam.Create(empty))
            | "WithEmptyShards" >> beam.Flatten()
            | "GroupByShard" >> beam.GroupByKey()
            | "Write" >> beam.ParDo(WriteShardFn(self.folder, self.shard_counts))
        )


class ErrorToJsonFn(beam.DoFn):
    """Counts every record not written (``not_written_<category>``, one place for all steps)."""

    def process(self, d):
        counter(f"not_written_{d['category']}").inc()
        yield jsontext.dumps(d, sort_keys=True)  # ASCII: any bad text survives


class WriteErrors(beam.PTransform):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def expand(self, dead):
        return (
            dead
            | "ToJson" >> beam.ParDo(ErrorToJsonFn())
            | "Write" >> beam.io.WriteToText(self.path, shard_name_template="", num_shards=1)
        )


# --------------------------------------------------------------------------- summary


def _summary_items(files, dead, shards, marked) -> Iterable:
    return (
        files | "FileCounts" >> beam.Map(lambda f: ("file", f)),
        dead
        | "DeadKey" >> beam.Map(lambda d: ((d["category"], d["code"]), (1, (d["source"] or "", d["line"] or 0, str(d["reason"])))))
        | "CountDead" >> beam.CombinePerKey(CountWithExample())
        | "DeadItems" >> beam.Map(lambda kv: ("dead", kv)),
        _counts_by_reason(dead, "DeadByFile", "dead_by_file", key=("source", "category")),
        shards | "ShardItems" >> beam.Map(lambda s: ("shard", s)),
        _counts_by_reason(marked, "Marked", "marked"),
        _counts_by_reason(marked | "MadeOrGrouped" >> beam.Filter(lambda d: d["category"] in (Made.category,
                                                                                            Grouped.category)),
                          "MadeByFile", "made_by_file", key=("source", "category")),
    )


class CountWithExample(beam.CombineFn):
    """(count, example) of one reason: how many records, and the first of them by file and line
    (source, line, message), whose message says what to do (the one-line error quotes it)."""

    def create_accumulator(self):
        return 0, None

    def add_input(self, acc, value):
        return self.merge_accumulators([acc, value])

    def merge_accumulators(self, accs):
        examples = [a[1] for a in accs if a[1] is not None]
        return sum(a[0] for a in accs), min(examples) if examples else None

    def extract_output(self, acc):
        return acc


def _counts_by_reason(letters, label: str, kind: str, key: tuple[str, str] = ("category", "code")):
    """(kind, ((a, b), count)) for each value of the ``key`` fields among dead-letter-shaped entries."""
    return (
        letters
        | f"{label}Key" >> beam.Map(lambda d: ((d[key[0]], d[key[1]]), d.get("count", 1)))
        | f"Count{label}" >> beam.CombinePerKey(sum)
        | f"{label}Items" >> beam.Map(lambda kv, kind=kind: (kind, kv))
    )


class Finalize(beam.PTransform):
    """Exact counts gathered in the pipeline itself (not from metrics), then the job's last step,
    run once: reconcile, write manifest and statistics, publish (``pipelines.finalize``). It waits
    for every shard (its input) and for the errors file (``after``, a side input). Its inputs:
    (files, dead letters, shards, records marked but written). The tokenizer's files are in the
    staging folder already (``TokenizerFiles``), published with the rest."""

    def __init__(self, fin, after):
        super().__init__()
        self.fin, self.after = fin, after

    def expand(self, inputs):
        return (
            _summary_items(*inputs)
            | "Gather" >> beam.Flatten()
            | "ToList" >> beam.combiners.ToList()
            | "Publish" >> beam.Map(finalize, self.fin, beam.pvalue.AsList(self.after))
        )
