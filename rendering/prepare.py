"""Raw data files to shard records in one process: the preprocess job's steps (``steps``) chained
without Beam, for what reads raw files where Beam is not installed (`rmflow eval` of a JSONL, on
a training or serving host). The records, the records set aside with their reasons, and the
statistics (``accounting``) are the job's, computed alike; what the job writes (shards, the
manifest) is not written.

Also the checks a preprocessing makes of its options against the inputs' layouts, before it
reads them (``check_score_options``, ``check_pairs_from``), which the Beam job makes too.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from collections.abc import Iterator
from typing import Any

from rmflow.rendering import steps
from rmflow.rendering.accounting import PreprocessError, check_quality, gather, summarize
from rmflow.rendering.files import (
    FileSystem,
    InputError,
    iter_records,
    list_inputs,
    source_names,
    streams_records,
)
from rmflow.rendering.formats import SCORED_LAYOUTS, BadRecord, detect_format, parse_json_object
from rmflow.rendering.tokenize import RecordTokenizer
from rmflow.schemas.config import (
    MULTI_FORMATS,
    NORMALIZE_OPTIONS,
    ROW_FORMATS,
    SCORED_BY_WEIGHTS,
    STEP_FORMATS,
    WHOLE_GAP,
    PreprocessConfig,
    attribute_names,
    parse_weights,
)
from rmflow.schemas.errors import RmflowWarning
from rmflow.schemas.kinds import kind_of_record
from rmflow.schemas.record import decode

LAYOUT_SAMPLE_FILES = 64  # at most this many input files' layouts are read at plan time (check_score_options)


# The options that act only on some layouts: (option, the layouts it acts on, what it acts on).
# Given for inputs of none of them, an option would do nothing, silently: refused.
LAYOUT_OPTIONS = (
    ("min_score_gap", SCORED_LAYOUTS, "layouts with scores (score_chosen and score_rejected, or K scored responses)"),
    ("margin_from_scores", SCORED_LAYOUTS, "layouts with scores (score_chosen and score_rejected, or K scored "
                                           "responses)"),
    ("drop_score_ties", ("ultrafeedback",), "pairs that carry scores (score_chosen = score_rejected); K responses of "
                                            "equal scores never make a pair, and the listwise losses skip them"),
    ("attributes", ("helpsteer", "ultrafeedback-raw", "responses"), "K responses rated on attributes (helpsteer, "
                                                                     "ultrafeedback-raw, responses with 'attributes')"),
    ("attribute_weights", ("helpsteer", "responses"), "responses rated only by their attributes (helpsteer rows, "
                                                      "responses records with 'attributes' and no scores)"),
    ("pairs_from", MULTI_FORMATS, "K responses per prompt (" + ", ".join(MULTI_FORMATS) + ")"),
    ("max_responses", MULTI_FORMATS, "K responses per prompt (" + ", ".join(MULTI_FORMATS) + ")"),
    ("step_separator", STEP_FORMATS, "stepwise solutions (" + ", ".join(STEP_FORMATS) + ")"),
)


def check_score_options(cfg: PreprocessConfig, files: list[str], fs: FileSystem | None = None) -> None:
    """Refuse the options that act on some layouts only (``LAYOUT_OPTIONS``) when no input is of
    one: they would do nothing, silently. The layouts are read as the job reads them: forced by
    --format, else each file's first record that fits one. Only when every file's layout is known
    is anything refused: more than LAYOUT_SAMPLE_FILES files, or files read whole to reach a record
    (JSON arrays, Parquet), are not probed, and pass (``warn_unused_options`` speaks after the job)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    inert = {"max_responses": 0}  # a value that asks for nothing (0: keep every response): never refused
    asked = [(name, acts, what) for name, acts, what in LAYOUT_OPTIONS
             if getattr(cfg, name) not in (defaults[name], inert.get(name, defaults[name]))]
    if not asked:
        return
    if cfg.format != "auto":
        layouts = {cfg.format}
    elif len(files) <= LAYOUT_SAMPLE_FILES:
        layouts = {first_layout(p, fs=fs) for p in files}
    else:
        return
    if None in layouts:
        return
    for name, acts, what in asked:
        if not layouts & set(acts):
            raise PreprocessError(f"--{name.replace('_', '-')}: acts on {what}, and the inputs are "
                                  f"{', '.join(sorted(layouts))}: it would do nothing; drop it, or give such data")


def warn_unused_options(cfg: PreprocessConfig, stats: dict[str, Any], layouts: tuple[str, ...]) -> None:
    """After the job: --attribute-weights given, and no record was scored by them (``responses``
    records that all carried scores of their own)."""
    default = next(f.default for f in dataclasses.fields(cfg) if f.name == "attribute_weights")
    if cfg.attribute_weights != default and not stats["counts"].get("scored_by_weights") \
            and not set(layouts) & set(SCORED_BY_WEIGHTS):
        warnings.warn(f"--attribute-weights {cfg.attribute_weights}: no record was scored by them (every one "
                      "carried scores or ranks of its own)", RmflowWarning, stacklevel=3)


def check_pairs_from(cfg: PreprocessConfig, files: list[str], fs: FileSystem | None = None) -> None:
    """Inputs that mix K-response layouts and pairs (or stepwise data) without --pairs-from are
    refused before the job (the first would be responses records, the rest another kind: the job
    would fail at its end), as far as the sampled files' layouts tell (``check_score_options``)."""
    if cfg.pairs_from or cfg.format != "auto" or len(files) > LAYOUT_SAMPLE_FILES:
        return  # one forced --format is one kind
    layouts = {(layout, path) for path in files if (layout := first_layout(path, fs=fs)) is not None}
    multi = sorted((lay, path) for lay, path in layouts if lay in MULTI_FORMATS)
    other = sorted((lay, path) for lay, path in layouts if lay not in MULTI_FORMATS)
    if multi and cfg.min_score_gap:
        raise PreprocessError(f"{multi[0][1]} holds K responses per prompt (layout {multi[0][0]}): {WHOLE_GAP}")
    if multi and other:
        raise PreprocessError(f"{multi[0][1]} holds K responses per prompt (layout {multi[0][0]}) and {other[0][1]} "
                              f"{other[0][0]} records: one output holds one kind. Add --pairs-from expand, best-worst "
                              "or best-random to train on all of it as pairs, or preprocess them into separate outputs")


def first_layout(path: str, records: int = 100, fs: FileSystem | None = None) -> str | None:
    """The layout of a JSON Lines file's first record that fits one (of its first ``records``);
    None for other files (read whole to reach a record: ``streams_records``) or when none fits."""
    if not streams_records(path, fs):
        return None
    for n, (_, raw, problem) in enumerate(iter_records(path, fs)):
        if n >= records:
            return None
        if problem:
            continue
        try:
            return detect_format(parse_json_object(raw))
        except BadRecord:
            continue
    return None


@dataclasses.dataclass
class Prepared:
    """What a preprocessing of raw files yields in one process: the records (as the shards would
    hold them, sorted by record id), the dead letters (each record set aside, with its reason),
    the statistics (``accounting.summarize``: counts that reconcile) and each file's layout."""

    records: list[Any]
    dead: list[dict[str, Any]]
    stats: dict[str, Any]
    layouts: tuple[str, ...]
    inputs: tuple[tuple[str, int], ...] = ()  # (path, bytes) of each file read, as a manifest lists them


def prepare(cfg: PreprocessConfig, tokenizer: RecordTokenizer, fs: FileSystem | None = None,
            errors_file: str = "") -> Prepared:
    """``cfg.inputs`` through the preprocess steps in this process, with ``tokenizer`` (the chat
    template and tokenizer the model reads with); ``cfg.output`` is not written. Raises
    PreprocessError as the job would (no records, too many bad ones: ``check_quality``, naming
    ``errors_file``, where the caller keeps the dead letters, which the error carries as ``dead``)."""
    if cfg.decontaminate or cfg.near_dedup != "off":
        raise PreprocessError("decontamination and near-duplicate removal run in `rmflow preprocess` only")
    started, skipped = time.time(), []
    try:
        listed = list_inputs(cfg.inputs, skipped, fs)
    except InputError as e:
        raise PreprocessError(str(e)) from e
    files = [path for path, _, _ in listed]
    check_score_options(cfg, files, fs)
    check_pairs_from(cfg, files, fs)
    out = _Collected()
    records = out.take(_read(files, cfg, fs))
    pairs = out.take(_normalized(records, cfg))
    if cfg.dedup:
        pairs = out.take(_deduplicated(pairs))
    fitted = out.take(_fitted(pairs, cfg, tokenizer, source_names(files)))
    summary = gather(out.items(fitted))
    stats = summarize(summary, cfg, time.time() - started)
    stats["skipped_inputs"] = [{"path": path, "why": why} for path, why in skipped]
    try:
        check_quality(stats, cfg, errors_file.rpartition("/")[0] if errors_file else "")
    except PreprocessError as e:
        e.dead = out.dead  # every record set aside, for the caller to keep where the user reads it
        raise
    kept = sorted(fitted, key=lambda f: (f[0].record_id, f[2]))
    return Prepared([decode(f[1]) for f in kept], out.dead, stats,
                    tuple(sorted({x for x in summary["layouts"].values() if x})),
                    tuple((path, size) for path, size, _ in listed))


class _Collected:
    """The events of the chained steps: the main elements passed on, the rest kept aside."""

    def __init__(self) -> None:
        self.dead: list[dict[str, Any]] = []
        self.noted: list[dict[str, Any]] = []
        self.files: list[tuple] = []

    def take(self, events: Iterator[steps.Event]) -> list[Any]:
        main: list[Any] = []
        into = {steps.MAIN: main, steps.DEAD: self.dead, steps.NOTED: self.noted, steps.FILES: self.files}
        for tag, value in events:
            into[tag].append(value)
        return main

    def items(self, fitted: list[tuple]) -> list[tuple[str, Any]]:
        """The job's summary items (``accounting.gather``) of what was collected: each file, the dead
        letters counted by reason (the first of each by source and line) and by file, the noted
        counts, and the written records as one shard."""
        items: list[tuple[str, Any]] = [("file", f) for f in self.files]
        by_reason: dict[tuple, list] = {}
        for d in self.dead:
            n, example = by_reason.get((d["category"], d["code"]), (0, None))
            this = (d["source"] or "", d["line"] or 0, str(d["reason"]))
            by_reason[(d["category"], d["code"])] = [n + 1, min(this, example) if example else this]
        items += [("dead", (key, tuple(v))) for key, v in by_reason.items()]
        items += [("dead_by_file", kv) for kv in _counts(self.dead, ("source", "category")).items()]
        items += [("marked", kv) for kv in _counts(self.noted, ("category", "code")).items()]
        made = [d for d in self.noted if d["category"] in (steps.Made.category, steps.Grouped.category)]
        items += [("made_by_file", kv) for kv in _counts(made, ("source", "category")).items()]
        return items + [("shard", _shard_summary(fitted))]


def _counts(letters: list[dict[str, Any]], key: tuple[str, str]) -> dict[tuple, int]:
    out: dict[tuple, int] = collections.Counter()
    for d in letters:
        out[(d[key[0]], d[key[1]])] += d.get("count", 1)
    return dict(out)


def _shard_summary(fitted: list[tuple]) -> dict[str, Any]:
    """The written records' summary as one train shard's (what the job's shard writer reports)."""
    hist: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sources: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # written, chosen longer
    for record, _, (source, _), _, _, _ in fitted:
        lengths = record.stat_lengths()
        for field, n in lengths.items():
            hist[field][n] += 1
        sources[source][0] += 1
        sources[source][1] += lengths.get("chosen", 0) > lengths.get("rejected", 0)
    return {"split": "train", "file": "(in process)", "records": len(fitted), "truncated": sum(f[3] for f in fitted),
            "special_text": sum(f[4] for f in fitted), "lengths": {k: dict(v) for k, v in hist.items()},
            "kinds": dict(collections.Counter(kind_of_record(f[0]).name for f in fitted)),
            "sources": dict(sorted(sources.items()))}


def _read(files: list[str], cfg: PreprocessConfig, fs: FileSystem | None) -> Iterator[steps.Event]:
    for path in files:
        yield from steps.read_file(path, cfg.format, fs)


def _normalized(records: list[tuple], cfg: PreprocessConfig) -> Iterator[steps.Event]:
    """Normalize, the rows of response-a-row layouts grouped by prompt first (as ``GroupRows``)."""
    options = {k: getattr(cfg, k) for k in NORMALIZE_OPTIONS}
    weights = parse_weights(cfg.attribute_weights) or {"helpfulness": 1.0}
    rows: dict[Any, list] = {}
    for r in records:
        if r[2] not in ROW_FORMATS:
            yield from steps.normalize_record(r, options, weights)
            continue
        for tag, value in steps.keyed_row(r, weights, attribute_names(options.get("attributes", ""))):
            if tag == steps.MAIN:
                rows.setdefault(value[0], []).append(value[1])
            else:
                yield tag, value
    for group in rows.values():
        for tag, value in steps.grouped_record(group):
            yield from steps.normalize_record(value, options, weights) if tag == steps.MAIN else [(tag, value)]


def _deduplicated(pairs: list) -> Iterator[steps.Event]:
    by_id: dict[str, list] = {}
    for p in pairs:
        by_id.setdefault(p.pair_id, []).append(p)
    for group in by_id.values():
        yield from steps.keep_first(group)


def _fitted(pairs: list, cfg: PreprocessConfig, tokenizer: RecordTokenizer, names: dict[str, str]
            ) -> Iterator[steps.Event]:
    """Rendered, tokenized and fitted to the length policy, a batch of ``cfg.batch_size`` at a time."""
    for start in range(0, len(pairs), cfg.batch_size):
        rendered = []
        for tag, value in steps.render_batch(tokenizer, pairs[start: start + cfg.batch_size]):
            if tag == steps.MAIN:
                rendered.append(value)
            else:
                yield tag, value
        for tag, value in steps.tokenize_batch(tokenizer, rendered, cfg.max_length, cfg.length_policy):
            yield from steps.fit_length(value, cfg.max_length, cfg.length_policy, names) if tag == steps.MAIN \
                else [(tag, value)]


def local_record_tokenizer(folder: str, step_separator: str, fmt: str = "auto") -> RecordTokenizer:
    """The record tokenizer of a local tokenizer folder, built as the preprocess job builds its
    own (``build_tokenizer`` of the folder's files); one without a chat template is refused
    unless the data is pre-tokenized, as the job refuses it."""
    import os

    from rmflow.rendering.tokenize import TokenizerAssets, build_tokenizer
    from rmflow.schemas.manifest import TOKENIZER_FILES

    files = {}
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = f.read()
    assets = TokenizerAssets(folder, files, None)
    if not assets.has_chat_template and fmt != "tokenized":
        raise PreprocessError(f"tokenizer {folder} has no chat template, which renders conversations into text")
    return RecordTokenizer(build_tokenizer(assets), step_separator)
