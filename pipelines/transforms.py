"""The preprocess steps as Beam composite PTransforms, thin wrappers over the pure cores.

Every step that can reject a record returns ``{"main": ..., "dead": ...}``; dead letters
are dicts (source, line, stage, category, code, reason, record) and end in
``errors.jsonl``. Counters live in the ``rmflow`` namespace.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.utils import shared
from rmflow.pipelines.finalize import finalize
from rmflow.pipelines.io import BEAM, write_array_record_shard
from rmflow.pipelines.splitting import assign_shard, assign_split
from rmflow.pipelines.tokenizer_files import read_tokenizer_files
from rmflow.rendering.formats import CanonicalPair
from rmflow.rendering.steps import (  # noqa: F401 - the step cores' names, re-exported for the Beam stage
    DEAD,
    FILES,
    INTERNAL_ERROR,
    MAIN,
    NOTED,
    Grouped,
    Made,
    as_bad_record,
    dead_letter,
    fit_length,
    grouped_record,
    keep_first,
    keyed_row,
    normalize_record,
    read_file,
    render_batch,
    tokenize_batch,
)
from rmflow.rendering.tokenize import (
    RecordTokenizer,
    Rendered,
    TokenizerAssets,
    build_tokenizer,
)
from rmflow.schemas import jsontext
from rmflow.schemas.config import ROW_FORMATS, STEP_SEPARATOR, attribute_names
from rmflow.schemas.kinds import kind_of_record
from rmflow.schemas.manifest import shard_name

NAMESPACE = "rmflow"


def counter(name: str):
    return Metrics.counter(NAMESPACE, name)


def emit(events) -> Iterator:
    """A step core's events (``rendering.steps``) as a DoFn's outputs: MAIN the main output, the
    rest tagged."""
    for tag, value in events:
        yield value if tag == MAIN else TaggedOutput(tag, value)


def _split_outputs(pcoll_tuple) -> dict[str, beam.PCollection]:
    return {"main": pcoll_tuple.main, "dead": pcoll_tuple[DEAD]}


# --------------------------------------------------------------------------- read


class ReadRecordsFn(beam.DoFn):
    """One input file to (source, line, format, raw JSON text) records (``steps.read_file``)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.read = counter("records_read")

    def process(self, path: str):
        for tag, value in read_file(path, self.fmt, BEAM):
            if tag == FILES:
                self.read.inc(value[1])
            yield value if tag == MAIN else TaggedOutput(tag, value)


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


class NormalizeFn(beam.DoFn):
    """Raw records to canonical pairs (``steps.normalize_record``)."""

    def __init__(self, options: dict[str, Any], weights: dict[str, float] | None = None):
        self.options, self.weights = options, weights

    def process(self, element):
        yield from emit(normalize_record(element, self.options, self.weights))


class ReadRowFn(beam.DoFn):
    """A response-a-row layout's row, keyed by its prompt (``steps.keyed_row``)."""

    def __init__(self, weights: dict[str, float], attributes: tuple[str, ...] = ()):
        self.weights, self.attributes = weights, attributes

    def process(self, element):
        yield from emit(keyed_row(element, self.weights, self.attributes))


class GroupedFn(beam.DoFn):
    """One prompt's rows as one ``responses`` record (``steps.grouped_record``)."""

    def process(self, element):
        yield from emit(grouped_record(list(element[1])))


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
    """Of pairs with one content id keep the first by (source, line) (``steps.keep_first``)."""

    def process(self, element):
        yield from emit(keep_first(list(element[1])))


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
    (tests/workflow/test_remote.py checks that no transform holds the files)."""

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


class RenderFn(_TokenizerDoFn):
    """A batch of canonical pairs to a batch of rendered pairs (``steps.render_batch``)."""

    def process(self, batch: list[CanonicalPair], assets: TokenizerAssets):
        ok = []
        for tag, value in render_batch(self.tokenizer(assets), batch):
            if tag == MAIN:
                ok.append(value)
            else:
                yield TaggedOutput(tag, value)
        if ok:
            yield ok


class TokenizeFn(_TokenizerDoFn):
    """Rendered records to token ids (``steps.tokenize_batch``)."""

    def __init__(self, step_separator: str = STEP_SEPARATOR, max_length: int | None = None, policy: str = "drop"):
        super().__init__(step_separator)
        self.max_length, self.policy = max_length, policy
        self.tokens = counter("tokens")

    def process(self, batch: list[Rendered], assets: TokenizerAssets):
        for tag, value in tokenize_batch(self.tokenizer(assets), batch, self.max_length, self.policy):
            if tag == MAIN:
                self.tokens.inc(value.n_tokens)
            yield value if tag == MAIN else TaggedOutput(tag, value)


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
    """A tokenized record fitted by the length policy and encoded (``steps.fit_length``)."""

    def __init__(self, max_length: int, policy: str, names: dict[str, str] | None = None):
        self.max_length, self.policy, self.names = max_length, policy, names or {}
        self.truncated = counter("prompt_truncated")

    def process(self, tp):
        for tag, value in fit_length(tp, self.max_length, self.policy, self.names):
            if tag == MAIN and value[3]:
                self.truncated.inc()
            yield value if tag == MAIN else TaggedOutput(tag, value)


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


def _counts_by_reason(letters, label: str, item: str, key: tuple[str, str] = ("category", "code")):
    """(item, ((a, b), count)) for each value of the ``key`` fields among dead-letter-shaped entries."""
    return (
        letters
        | f"{label}Key" >> beam.Map(lambda d: ((d[key[0]], d[key[1]]), d.get("count", 1)))
        | f"Count{label}" >> beam.CombinePerKey(sum)
        | f"{label}Items" >> beam.Map(lambda kv, item=item: (item, kv))
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
