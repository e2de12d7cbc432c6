"""Decontamination: drop every training record that shares an n-gram with an evaluation prompt.

The recipe of Skywork-Reward and cleaned UltraFeedback: text is normalised to words (Unicode NFKC,
case-folded, split on anything that is not a letter or digit, so whitespace, punctuation and
full-width variants compare equal), every run of ``n`` consecutive words of every evaluation prompt
is an n-gram, and a training record whose prompt (and, when asked, replies) holds any of them is
contaminated. Prompts shorter than ``n`` words count as one n-gram of all their words: a short
evaluation prompt is found where a training prompt equals it, not inside a longer one.

The pure core (``words``, ``ngrams``, ``EvalIndex``) is wrapped by the Beam step
``Decontaminate`` in one of two ways, which find the same overlaps:

* ``side-input`` (small evaluation sets): the evaluation n-grams are built once, in the pipeline,
  into a side input (an index of 8-byte hashes, held in each worker's memory: its size per
  n-gram is in docs/preprocessing.md), and every training record is checked against it;
* ``join`` (large ones, which no worker could hold): every n-gram of every training record and of
  every evaluation prompt is keyed by its hash and the two are joined (CoGroupByKey), then each
  record's hits are joined back to the record. It shuffles every n-gram, so it is the slower one
  when the index fits.

``auto`` picks the join when the evaluation files hold more than ``JOIN_ABOVE_BYTES`` of text
(a gzipped file counted at four times its size). The first overlap in reading order is reported
(deterministic): the evaluation file, its item, and the n-gram.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import unicodedata
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.pvalue import AsSingleton, TaggedOutput
from rmflow.pipelines.io import iter_records
from rmflow.pipelines.transforms import DEAD, dead_letter
from rmflow.rendering.formats import (
    BadRecord,
    CanonicalPair,
    CanonicalSteps,
    detect_format,
    parse_json_object,
)
from rmflow.rendering.responses import normalize_all
from rmflow.schemas import jsontext
from rmflow.schemas.config import DECONTAMINATE_METHODS

CONTAMINATED = "contaminated"
MARKED = "marked"  # the tag of records found contaminated and kept (mark_only)
CONTAMINATION_FILE = "contamination.jsonl"  # in the output, with mark_only: the records kept
JOIN_ABOVE_BYTES = 64 * 2**20  # evaluation text above this: join (a side input of more would crowd a worker's memory)
_WORD = re.compile(r"[^\W_]+")  # letters and digits, any script
PROMPT_FIELDS = ("prompt", "question", "problem", "instruction", "query", "input", "text")


class Contaminated(BadRecord):
    """The record shares an n-gram with an evaluation prompt."""

    category = CONTAMINATED

    def __init__(self, message: str, eval_file: str):
        super().__init__(f"{CONTAMINATED}:{eval_file}", message)


def words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def ngrams(ws: list[str], n: int) -> Iterator[tuple[int, tuple[str, ...]]]:
    """(hash, words) of each n-gram in order; a text shorter than ``n`` words is one n-gram."""
    if not ws:
        return
    for i in range(max(1, len(ws) - n + 1)):
        gram = tuple(ws[i:i + n])
        yield _hash(gram), gram


def _hash(gram: tuple[str, ...]) -> int:
    return int.from_bytes(hashlib.blake2b(" ".join(gram).encode(), digest_size=8).digest(), "little")


def prompt_of(messages) -> str:
    """The text of a prompt's turns, the system turn left out (instructions, not the task)."""
    return "\n".join(m[1] for m in messages if m[0] != "system")


def prompt_text(record: Any, source: str, line: int) -> str:
    """The prompt of one evaluation item, in any layout preprocess reads, or a plain prompt list
    (a JSON string per line, or an object with one of PROMPT_FIELDS)."""
    if isinstance(record, str):
        return record
    try:
        item = normalize_all(record, detect_format(record), source=source, line=line, options={"pairs_from": "best-worst"})[0][0]
        return prompt_of(item.prompt)
    except BadRecord:
        for field in PROMPT_FIELDS:
            if isinstance(record.get(field), str):
                return record[field]
        raise BadRecord("no_prompt", f"{source}:{line}: no prompt found (a layout preprocess reads, a JSON "
                        f"string, or an object with one of {', '.join(PROMPT_FIELDS)})") from None


@dataclasses.dataclass
class EvalIndex:
    """Evaluation n-gram hash -> (evaluation file, item line): the first item that holds it."""

    n: int
    where: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)

    def add(self, text: str, source: str, line: int) -> None:
        for h, _ in ngrams(words(text), self.n):
            self.where.setdefault(h, (source, line))

    def merge(self, other: EvalIndex) -> EvalIndex:
        for h, at in other.where.items():
            if h not in self.where or at < self.where[h]:
                self.where[h] = at
        return self

    def first_overlap(self, texts: Iterable[str]) -> tuple[tuple[str, ...], str, int] | None:
        """(n-gram, evaluation file, item line) of the first n-gram of ``texts`` in the index."""
        for text in texts:
            for h, gram in ngrams(words(text), self.n):
                if h in self.where:
                    return (gram, *self.where[h])
        return None


def _json_string(text: str, path: str, line: int) -> Any:
    try:
        return jsontext.loads(text)
    except (ValueError, RecursionError) as e:
        raise BadRecord("bad_eval_file", f"{path}:{line}: not valid JSON text: {e}") from e


def eval_prompts(path: str) -> Iterator[tuple[int, str]]:
    """(line, prompt text) of each item of one evaluation file. An item that cannot be read, or
    whose prompt cannot be found, raises BadRecord naming the file and line: a decontamination
    that silently skipped items would be wrong."""
    for line, raw, problem in iter_records(path):
        if problem:
            raise BadRecord("bad_eval_file", f"{path}:{line}: {problem}")
        text = raw.strip()  # a JSON object, a JSON string, or a plain line of a prompt list
        try:
            record: Any = parse_json_object(text) if text.startswith("{") else (
                _json_string(text, path, line) if text.startswith('"') else text)
        except BadRecord as e:
            raise BadRecord("bad_eval_file", e.message if e.message.startswith(f"{path}:") else
                            f"{path}:{line}: {e.message}") from None
        yield line, prompt_text(record, path, line)


def index_file(path: str, n: int) -> EvalIndex:
    """The n-grams of one evaluation file's prompts (``eval_prompts``)."""
    index = EvalIndex(n)
    for line, text in eval_prompts(path):
        index.add(text, path, line)
    return index


def eval_file_counts(path: str, n: int) -> dict[str, int]:
    """What one evaluation file gives the index: its items and their n-grams (distinct within
    each item), read as the pipeline reads it. The launcher counts them before the job starts,
    so that a malformed file fails there, naming file and line, and an empty one is refused:
    decontaminating against nothing would pass silently."""
    items = grams = 0
    for _, text in eval_prompts(path):
        items += 1
        grams += len({h for h, _ in ngrams(words(text), n)})
    if not items:
        raise BadRecord("empty_eval_file", f"{path} holds no evaluation items: nothing to decontaminate against "
                                           "(give the benchmark's file of prompts)")
    return {"items": items, "ngrams": grams}


def record_texts(pair: CanonicalPair | CanonicalSteps, replies: bool) -> list[str]:
    return [prompt_of(pair.prompt), *(pair.reply_texts if replies else ())]


class _IndexFileFn(beam.DoFn):
    def __init__(self, n: int):
        self.n = n

    def process(self, path: str):
        try:
            yield index_file(path, self.n)
        except BadRecord as e:
            raise ValueError(f"--decontaminate: {e.message}") from None


class _MergeIndexes(beam.CombineFn):
    def __init__(self, n: int):
        self.n = n

    def create_accumulator(self):
        return EvalIndex(self.n)

    def add_input(self, acc, index):
        return acc.merge(index)

    def merge_accumulators(self, accs):
        out = EvalIndex(self.n)
        for a in accs:
            out.merge(a)
        return out

    def extract_output(self, acc):
        return acc


class CheckFn(beam.DoFn):
    def __init__(self, replies: bool, mark_only: bool):
        self.replies, self.mark_only = replies, mark_only

    def process(self, pair, index: EvalIndex):
        if pair.is_tokenized:  # ids, no text: nothing to compare with (docs/preprocessing.md says so)
            yield pair
            return
        hit = index.first_overlap(record_texts(pair, self.replies))
        if hit is None:
            yield pair
        else:
            yield from _contaminated(pair, hit, self.mark_only)


def use_join(method: str, eval_files: list[tuple[str, int]]) -> bool:
    """Whether ``method`` (``schemas.config.DECONTAMINATE_METHODS``) joins for these (path, size) evaluation files."""
    if method not in DECONTAMINATE_METHODS:
        raise ValueError(f"decontaminate_method {method!r}: use one of {', '.join(DECONTAMINATE_METHODS)}")
    text = sum(size * (4 if path.endswith(".gz") else 1) for path, size in eval_files)
    return method == "join" or (method == "auto" and text > JOIN_ABOVE_BYTES)


def _contaminated(pair, hit, mark_only: bool):
    """The pair (when kept) and its dead letter or mark, for ``hit`` = (n-gram, eval file, line)."""
    gram, eval_file, eval_line = hit
    err = Contaminated(f"shares the {len(gram)}-gram {' '.join(gram)!r} with {eval_file}:{eval_line}", eval_file)
    entry = dead_letter("decontaminate", pair.source, pair.line, pair.raw, err)
    if mark_only:
        yield pair
        yield TaggedOutput(MARKED, entry)
    else:
        yield TaggedOutput(DEAD, entry)


class _EvalGramsFn(beam.DoFn):
    """(n-gram hash, (evaluation file, line)) for every n-gram of one evaluation file."""

    def __init__(self, n: int):
        self.n = n

    def process(self, path: str):
        try:
            index = index_file(path, self.n)
        except BadRecord as e:
            raise ValueError(f"--decontaminate: {e.message}") from None
        yield from index.where.items()


def _record_grams(keyed, n: int, replies: bool):
    """(n-gram hash, (record key, ordinal, n-gram)) for every n-gram of a record, in reading order."""
    key, pair = keyed
    if pair.is_tokenized:
        return
    ordinal = 0
    for text in record_texts(pair, replies):
        for h, gram in ngrams(words(text), n):
            yield h, (key, ordinal, gram)
            ordinal += 1


def _hits(joined):
    """For an n-gram hash found in both: (record key, (ordinal, n-gram, eval file, line)) per record."""
    _, groups = joined
    if not groups["eval"] or not groups["train"]:
        return
    where = min(groups["eval"])
    for key, ordinal, gram in groups["train"]:
        yield key, (ordinal, gram, *where)


class _ApplyHitsFn(beam.DoFn):
    def __init__(self, mark_only: bool):
        self.mark_only = mark_only

    def process(self, joined):
        _, groups = joined
        hits = list(groups["hit"])
        for pair in groups["pair"]:  # one: keys are unique
            if hits:
                yield from _contaminated(pair, min(hits)[1:], self.mark_only)
            else:
                yield pair


class Decontaminate(beam.PTransform):
    """Drop the pairs (or solutions) that share an n-gram with any evaluation file's prompts, or
    with ``mark_only`` keep them and list them (the ``marked`` output, dead-letter shaped).
    ``join``: a CoGroupByKey on n-gram hashes instead of a side-input index (large evaluation sets)."""

    def __init__(self, eval_files: tuple[str, ...], n: int, replies: bool, mark_only: bool = False,
                 join: bool = False):
        """``eval_files``: the files themselves (the plan expands the user's globs and folders)."""
        super().__init__()
        self.eval_files, self.n, self.replies, self.mark_only, self.join = eval_files, n, replies, mark_only, join

    def expand(self, pairs):
        files = pairs.pipeline | "EvalFiles" >> beam.Create(list(self.eval_files))
        if self.join:
            checked = self._join(pairs, files)
        else:
            index = (files
                     | "IndexEvalPrompts" >> beam.ParDo(_IndexFileFn(self.n))
                     | "MergeIndex" >> beam.CombineGlobally(_MergeIndexes(self.n)))
            checked = pairs | "CheckOverlap" >> beam.ParDo(CheckFn(self.replies, self.mark_only), AsSingleton(index)
                                                           ).with_outputs(DEAD, MARKED, main="main")
        return {"main": checked.main, "dead": checked[DEAD], "marked": checked[MARKED]}

    def _join(self, pairs, files):
        keyed = pairs | "KeyByRecord" >> beam.Map(lambda p: ((p.source, p.line, p.pair_id), p))  # one record: several pairs
        eval_grams = files | "EvalNgrams" >> beam.ParDo(_EvalGramsFn(self.n))
        train_grams = keyed | "RecordNgrams" >> beam.FlatMap(_record_grams, self.n, self.replies)
        hits = (
            {"eval": eval_grams, "train": train_grams}
            | "JoinNgrams" >> beam.CoGroupByKey()
            | "Hits" >> beam.FlatMap(_hits)
        )
        return (
            {"pair": keyed, "hit": hits}
            | "JoinHits" >> beam.CoGroupByKey()
            | "ApplyHits" >> beam.ParDo(_ApplyHitsFn(self.mark_only)).with_outputs(DEAD, MARKED, main="main")
        )
