"""`rmflow score --runner ...`: scoring a dataset as a Beam job (locally, or on Dataflow).

The graph, one labelled step each:

    Read (files -> (source, line, raw); unreadable lines to the dead letters)
    Parse (JSON; what each record is: a conversation, a preference pair, a stepwise solution)
    Score (Beam's RunInference with ``RewardModelHandler``: the model loaded once per worker,
           elements batched by token weight, each batch cut into the scoring core's shapes;
           a record that cannot be encoded comes back as an error, not an exception)
    WriteScores (sorted by (source, line) into a fixed number of JSONL shards: reruns are
                 byte-identical), WriteErrors (one sorted file), [BestOfN], Finalize

``Finalize`` is the graph's last step, as in preprocess: it reconciles the counts exactly
(records read = scored + errors), writes ``summary.json`` (counts by reason, the model's
identity), moves the staging folder to the output and writes ``COMPLETED`` last; a job that
fails publishes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import apache_beam as beam
from apache_beam.ml.inference.base import ModelHandler, PredictionResult, RunInference
from apache_beam.pvalue import TaggedOutput

from rmflow.handlers import every
from rmflow.pipelines import io as rio
from rmflow.pipelines.publication import FAILED_FILE, publish, published, refuse
from rmflow.pipelines.runner import launched, new_pipeline, runner_options
from rmflow.pipelines.staging import new_staging
from rmflow.pipelines.transforms import DEAD, FILES, ReadRecordsFn, as_bad_record, dead_letter
from rmflow.rendering.formats import BadRecord
from rmflow.schemas import jsontext
from rmflow.schemas.config import MAX_BAD_FRACTION, ScoreConfig
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.kinds import kind_named
from rmflow.schemas.manifest import COMPLETED_FILE, ERRORS_FILE
from rmflow.schemas.outputs import SCORES_SUMMARY
from rmflow.schemas.paths import is_url
from rmflow.scoring.api import BadConversation, RewardModel
from rmflow.scoring.scorers import (
    BEST_RESPONSE,
    PAIR_FIELDS,
    RESPONSE_ATTRIBUTES,
    RESPONSE_SCORES,
    ScoringMode,
    echoed,
    encode_record,
    score_encoded,
)

SCORES_PREFIX = "scores"
BEST_FILE = "best.jsonl"
PAIRS_FILE = "pairs.jsonl"
SUMMARY_FILE = SCORES_SUMMARY
SCORES_OUTPUT = "scoring job output"  # schemas.outputs.OUTPUT_SIGNATURES' name of what the job writes
SCORE_FIELDS = tuple(dict.fromkeys((*PAIR_FIELDS, *(f for s in every("scorer").values() for f in s.fields),
                                    RESPONSE_SCORES, BEST_RESPONSE, RESPONSE_ATTRIBUTES)))  # last, in this order
JOB_FIELDS = frozenset({"source", "line", "error", *SCORE_FIELDS})  # rmflow's: a record's own is input_<name>
CONTENT_FIELDS = ("messages", "chosen", "rejected", "prompt", "completions", "steps")  # not echoed back
RESPONSES_CONTENT = ("responses", "answers", "instruction")  # a K-response record's, besides: not echoed back


class BatchScoreError(RmflowError):
    """A scoring job that cannot run or did not reconcile; nothing was published."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the workers and the last step need (picklable)."""

    model: str
    step: int | str | None
    staging: str
    output: str
    num_shards: int
    token_budget: int
    batch_rows: int
    group_by: str | None
    started: float
    output_format: str = "jsonl"
    max_bad_fraction: float = MAX_BAD_FRACTION
    truncate: str = "error"
    mode: ScoringMode = ScoringMode()  # deterministic scores, an ensemble's reward rule


# --------------------------------------------------------------------------- what a record is


def _parse(raw: str) -> Any:
    """A record's JSON: an object, or a bare list of messages (a conversation); raises BadRecord."""
    try:
        return jsontext.loads(raw, allow_nan=False)
    except json.JSONDecodeError as e:
        raise BadRecord("bad_json", f"malformed JSON: {e}") from e
    except jsontext.NotJsonText as e:
        raise BadRecord("bad_text", str(e)) from e
    except RecursionError as e:
        raise BadRecord("too_deeply_nested", "JSON nested deeper than the parser's recursion limit") from e


def _approx_tokens(example: tuple[str, int, str]) -> int:
    return 1 + len(example[2]) // 4


class RewardModelHandler(ModelHandler):
    """Beam's ``ModelHandler`` for an rmflow reward model: loaded once per worker process;
    examples are (source, line, object); each batch is encoded and scored in the core's shapes,
    and every example gets back ``{"fields": ...}`` or ``{"error": ..., "code": ...}``."""

    def __init__(self, spec: JobSpec):
        # Batches weighed in approximate tokens (4 bytes of JSON each), a few budgets at most:
        # sorted together, they cut into full batches of like lengths.
        super().__init__(element_size_fn=_approx_tokens, min_batch_size=spec.token_budget,
                         max_batch_size=4 * spec.token_budget)
        self.spec = spec

    def load_model(self) -> RewardModel:
        return RewardModel.load(self.spec.model, self.spec.step, reward=self.spec.mode.reward)

    def run_inference(self, batch: Sequence[tuple[str, int, str]], model: RewardModel,
                      inference_args: dict[str, Any] | None = None) -> Iterable[PredictionResult]:
        out: list[dict[str, Any]] = [{} for _ in batch]
        encoded, owner = [], []
        for i, (source, line, raw) in enumerate(batch):
            try:
                encoded.append(encode_record(model, _parse(raw), source=source, line=line, truncate=self.spec.truncate))
                owner.append(i)
            except BadConversation as e:
                out[i] = {"error": str(e), "code": "bad_conversation"}
            except Exception as e:  # noqa: BLE001 - one record, never the job: a bad record or a bug, named
                err = as_bad_record(e)
                out[i] = {"error": err.message, "code": err.code}
        # one item a row, in the core's shapes, a batch never spanning two (what fixes a record's score
        # to the last bit, whatever else the bundle holds: a rerun writes the same bytes)
        shapes = model.shapes(self.spec.batch_rows, self.spec.token_budget, packed=False,
                              deterministic=self.spec.mode.deterministic)
        for i, fields in zip(owner, score_encoded(model, encoded, shapes, one_length=True)):
            out[i] = fields if "error" in fields else {"fields": fields}
        return [PredictionResult(ex, r) for ex, r in zip(batch, out)]

    def get_metrics_namespace(self) -> str:
        return "rmflow_score"


# --------------------------------------------------------------------------- steps


class RouteFn(beam.DoFn):
    """A scored example to an output row (the job's source and line, the record's own fields minus
    the content, the scores), or to the dead letters. A record's field named like one of the
    job's is kept as ``input_<name>`` (``scoring.echoed``): the job's never lose to it."""

    def process(self, result: PredictionResult):
        source, line, raw = result.example
        r = result.inference
        if "error" in r:
            yield TaggedOutput(DEAD, dead_letter("score", source, line, raw, BadRecord(r["code"], r["error"])))
            return
        obj = _parse(raw)
        content = (*CONTENT_FIELDS, *(RESPONSES_CONTENT if RESPONSE_SCORES in r["fields"] else ()))
        kept = {k: v for k, v in obj.items() if k not in content} if isinstance(obj, dict) else {}
        yield {**echoed(kept, JOB_FIELDS | {"_raw"}), "source": source, "line": line, **r["fields"], "_raw": raw}


def _shard(key: tuple[str, int], n: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key[0]}\0{key[1]}".encode(), digest_size=8).digest(), "big") % n


def _shard_name(index: int, n: int, fmt: str) -> str:
    return f"{SCORES_PREFIX}-{index:05d}-of-{n:05d}.{fmt}"


def _sorted_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(({k: v for k, v in r.items() if k != "_raw"} for r in rows if r),
                  key=lambda r: (r["source"], r["line"]))


def _write_jsonl_shard(item, staging: str, n: int):
    index, rows = item
    rows = _sorted_rows(rows)
    body = "".join(jsontext.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    rio.write_bytes(f"{staging}/{_shard_name(index, n, 'jsonl')}", body.encode("utf-8"))
    yield _shard_name(index, n, "jsonl"), len(rows)


# ---- Parquet: one schema for every shard, agreed before any is written

FIRST_COLUMNS = ("source", "line")


def _column_types(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each field of a shard's rows -> its Arrow type, or "json" where the values' types differ
    (an id that is a number here and a string there): such a field is written as JSON text."""
    import pyarrow as pa

    names = dict.fromkeys(k for r in rows for k in r)
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = pa.array([r.get(name) for r in rows]).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
            out[name] = "json"
    return out


def _merge_types(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    import pyarrow as pa

    out = dict(a)
    for name, t in b.items():
        if out.get(name, t) == t:
            out[name] = t
        elif "json" in (out[name], t):
            out[name] = "json"
        else:
            try:
                out[name] = pa.unify_schemas([pa.schema([(name, out[name])]), pa.schema([(name, t)])],
                                             promote_options="permissive").field(name).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                out[name] = "json"
    return out


class MergeTypes(beam.CombineFn):
    """Every shard's column types -> one schema (types promoted where Arrow can, JSON text where not)."""

    def create_accumulator(self):
        return {}

    def add_input(self, acc, types):
        return _merge_types(acc, types)

    def merge_accumulators(self, accs):
        out: dict[str, Any] = {}
        for a in accs:
            out = _merge_types(out, a)
        return out

    def extract_output(self, acc):
        return acc


def parquet_schema(types: dict[str, Any], score_fields: Sequence[str]):
    """The output schema: source and line, the input's own fields by name, then the scores in
    the scorer's order (a fixed order: reruns write the same bytes)."""
    import pyarrow as pa

    order = [c for c in FIRST_COLUMNS if c in types]
    order += sorted(c for c in types if c not in FIRST_COLUMNS and c not in score_fields)
    order += [c for c in score_fields if c in types]
    return pa.schema([(c, pa.string() if types[c] == "json" else
                       (pa.string() if pa.types.is_null(types[c]) else types[c])) for c in order],
                     metadata={"rmflow_json_columns": jsontext.dumps(sorted(c for c in order if types[c] == "json"))})


def _write_parquet_shard(item, staging: str, n: int, types: dict[str, Any], score_fields: Sequence[str]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    index, rows = item
    rows = _sorted_rows(rows)
    schema = parquet_schema(types, score_fields)
    as_json = set(json.loads(schema.metadata[b"rmflow_json_columns"]))
    columns = {c: [(jsontext.dumps(r[c], ensure_ascii=False, sort_keys=True) if c in as_json and r.get(c) is not None
                    else r.get(c)) for r in rows] for c in schema.names}
    table = pa.table(columns, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    rio.write_bytes(f"{staging}/{_shard_name(index, n, 'parquet')}", sink.getvalue().to_pybytes())
    yield _shard_name(index, n, "parquet"), len(rows)


class WriteScores(beam.PTransform):
    """Rows to ``n`` shards (JSONL or Parquet) by a hash of (source, line), each sorted:
    deterministic files. Every shard is written, empty or not; Parquet shards share one schema."""

    def __init__(self, staging: str, n: int, fmt: str = "jsonl", score_fields: Sequence[str] = ()):
        super().__init__()
        self.staging, self.n, self.fmt, self.score_fields = staging, n, fmt, tuple(score_fields)

    def expand(self, rows):
        n, staging = self.n, self.staging
        keyed = rows | "Key" >> beam.Map(lambda r: (_shard((r["source"], r["line"]), n), r))
        empty = rows.pipeline | "AllShards" >> beam.Create([(i, None) for i in range(n)])
        grouped = (keyed, empty) | "Both" >> beam.Flatten() | "Group" >> beam.GroupByKey()
        if self.fmt == "jsonl":
            return grouped | "Write" >> beam.FlatMap(_write_jsonl_shard, staging, n)
        types = (grouped
                 | "ColumnTypes" >> beam.Map(lambda kv: _column_types(_sorted_rows(kv[1])))
                 | "OneSchema" >> beam.CombineGlobally(MergeTypes()))
        return grouped | "Write" >> beam.FlatMap(_write_parquet_shard, staging, n, beam.pvalue.AsSingleton(types),
                                                 self.score_fields)


def _write_sorted(lines: list[str], path: str) -> int:
    rio.write_bytes(path, "".join(sorted(lines)).encode("utf-8"))
    return len(lines)


def _best_of_group(kv) -> dict[str, Any] | None:
    group, rows = kv
    rows = sorted(rows, key=lambda r: (-r["score"], r["source"], r["line"]))
    best, worst = rows[0], rows[-1]
    return {"group": group, "size": len(rows), "best": best, "worst": worst}


class BestOfN(beam.PTransform):
    """Per value of ``field``: the highest-scoring candidate (``best.jsonl``: the rejection-sampling
    step) and, when a group has two or more, best against worst as a preference pair (``pairs.jsonl``)."""

    def __init__(self, field: str, staging: str):
        super().__init__()
        self.field, self.staging = field, staging

    def expand(self, rows):
        f = self.field
        groups = (
            rows
            | "HasScore" >> beam.Filter(lambda r: "score" in r and r.get(f) is not None)
            | "ByGroup" >> beam.Map(lambda r: (jsontext.dumps(r[f], sort_keys=True), r))
            | "Group" >> beam.GroupByKey()
            | "Pick" >> beam.Map(_best_of_group)
        )
        best = groups | "BestLine" >> beam.Map(
            lambda g: jsontext.dumps({**{k: v for k, v in json.loads(g["best"]["_raw"]).items()}, "score": g["best"]["score"],
                                  "group_size": g["size"]}, ensure_ascii=False) + "\n")
        pairs = (
            groups
            | "Pairs" >> beam.Filter(lambda g: g["size"] > 1 and g["best"]["score"] > g["worst"]["score"])
            | "PairLine" >> beam.Map(lambda g: jsontext.dumps(_as_pair(g), ensure_ascii=False) + "\n")
        )
        s = self.staging
        wrote_best = best | "AllBest" >> beam.combiners.ToList() | "WriteBest" >> beam.Map(
            lambda ls: ("best", _write_sorted(ls, f"{s}/{BEST_FILE}")))
        wrote_pairs = pairs | "AllPairs" >> beam.combiners.ToList() | "WritePairs" >> beam.Map(
            lambda ls: ("pairs", _write_sorted(ls, f"{s}/{PAIRS_FILE}")))
        return (wrote_best, wrote_pairs) | "BestCounts" >> beam.Flatten()


def _as_pair(g: dict[str, Any]) -> dict[str, Any]:
    best, worst = json.loads(g["best"]["_raw"]), json.loads(g["worst"]["_raw"])
    chosen = best.get("messages", best) if isinstance(best, dict) else best
    rejected = worst.get("messages", worst) if isinstance(worst, dict) else worst
    return {"group": json.loads(g["group"]), "chosen": chosen, "rejected": rejected,
            "score_chosen": g["best"]["score"], "score_rejected": g["worst"]["score"]}


def finalize(items: list, spec: JobSpec, identity: dict[str, Any]) -> dict[str, Any]:
    """Reconcile (read = scored + errors, exactly), write summary.json, publish, COMPLETED."""
    out, staging = spec.output.rstrip("/"), spec.staging
    earlier = published(out, staging, SUMMARY_FILE)
    if earlier is not None:
        return earlier
    files = {v[0]: v[1] for k, v in items if k == "file"}
    shards = sorted(v for k, v in items if k == "shard")
    errors = {}
    for k, v in items:
        if k == "error":
            errors[v] = errors.get(v, 0) + 1
    best = {v[0]: v[1] for k, v in items if k == "best"}
    read, scored, bad = sum(files.values()), sum(n for _, n in shards), sum(errors.values())
    summary = {"model": identity, "records_read": read, "scored": scored, "errors": bad,
               "errors_by_reason": dict(sorted(errors.items())), "files": files,
               "shards": [{"file": f, "records": n} for f, n in shards], **({"best_of_n": best} if best else {}),
               "seconds": round(time.time() - spec.started, 3)}
    refusal = None
    if read != scored + bad:
        refusal = (f"counts do not reconcile: {read} read, {scored} scored, {bad} errors; nothing published "
                   f"(staging left at {staging})")
    elif read and bad / read > spec.max_bad_fraction:
        top = ", ".join(f"{code} x{n}" for code, n in sorted(errors.items(), key=lambda kv: -kv[1])[:5])
        refusal = (f"{bad} of {read} records ({bad / read:.1%}) cannot be scored, more than --max-bad-fraction "
                   f"{spec.max_bad_fraction:.1%} (top reasons: {top}). Nothing was published; every bad record and "
                   f"its reason is in {staging}/{ERRORS_FILE}")
    if refusal:
        refuse(staging, {**summary, "error": refusal}, BatchScoreError(refusal))
    rio.write_bytes(f"{staging}/{SUMMARY_FILE}", (jsontext.dumps(summary, indent=2, sort_keys=True) + "\n").encode())
    publish(staging, out, SCORES_OUTPUT)
    return summary


def build(p: beam.Pipeline, files: list[str], spec: JobSpec, identity: dict[str, Any]) -> None:
    read = p | "Files" >> beam.Create(files) | "Read" >> beam.ParDo(ReadRecordsFn("score")).with_outputs(
        DEAD, FILES, main="main")
    examples = read.main | "Spread" >> beam.Reshuffle() | "Example" >> beam.Map(lambda x: (x[0], x[1], x[3]))
    scored = examples | "Score" >> RunInference(RewardModelHandler(spec))
    routed = scored | "Route" >> beam.ParDo(RouteFn()).with_outputs(DEAD, main="rows")
    shards = routed.rows | "WriteScores" >> WriteScores(spec.staging, spec.num_shards, spec.output_format,
                                                        SCORE_FIELDS)
    dead = (read[DEAD], routed[DEAD]) | "AllErrors" >> beam.Flatten()
    error_lines = dead | "ErrorJson" >> beam.Map(lambda d: jsontext.dumps(d, sort_keys=True) + "\n")
    wrote_errors = (error_lines | "AllErrorLines" >> beam.combiners.ToList()
                    | "WriteErrors" >> beam.Map(lambda ls, s=spec.staging: _write_sorted(ls, f"{s}/{ERRORS_FILE}")))
    items = [
        read[FILES] | "FileItems" >> beam.Map(lambda f: ("file", f)),
        shards | "ShardItems" >> beam.Map(lambda s: ("shard", s)),
        dead | "ErrorItems" >> beam.Map(lambda d: ("error", d["code"])),
    ]
    if spec.group_by:
        items.append(routed.rows | "BestOfN" >> BestOfN(spec.group_by, spec.staging)
                     | "BestItems" >> beam.Map(lambda b: ("best", b)))
    (
        items
        | "AllItems" >> beam.Flatten()
        | "Gather" >> beam.combiners.ToList()
        | "Finalize" >> beam.Map(_finalize_after, spec, identity, beam.pvalue.AsSingleton(wrote_errors))
    )


def _finalize_after(items, spec, identity, _errors_written):
    """``finalize`` once the errors file is written (the side input makes the step wait for it)."""
    return finalize(items, spec, identity)


# --------------------------------------------------------------------------- the job


def make_pipeline(runner: str, beam_args: Sequence[str]) -> beam.Pipeline:
    from rmflow.schemas.options import command_flags

    return new_pipeline(runner_options(beam_args, runner, command_flags(ScoreConfig), "score"))


def run(cfg: ScoreConfig, *, wait: bool = True) -> dict[str, Any] | None:
    """`rmflow score --runner ...` (and the scoring Flex Template): score every record of
    ``cfg.input`` (JSONL, JSON, Parquet; a file, folder or glob) into the folder ``cfg.output``;
    returns summary.json's contents (None with ``wait=False``)."""
    from rmflow.pipelines.io import expand_inputs

    pipeline = make_pipeline(cfg.runner, cfg.beam_args)  # its flags checked before anything else
    output = cfg.output.rstrip("/") if is_url(cfg.output) else os.path.abspath(cfg.output)
    rio.check_replaceable(output, SCORES_OUTPUT, BatchScoreError, inputs=(cfg.input, cfg.model))
    if rio.exists(f"{output}/{COMPLETED_FILE}") and not cfg.overwrite:
        raise BatchScoreError(f"{output} already holds a scoring job's output: give --overwrite to replace it")
    listed = expand_inputs((cfg.input,))
    files, size = [path for path, _ in listed], sum(n for _, n in listed)
    rm = RewardModel.load(cfg.model, cfg.step, reward=cfg.reward)  # fails here, in one line, before any worker starts
    group_by = cfg.group_by or None
    if group_by and not kind_named(rm.kind).pairwise:
        raise BatchScoreError("--group-by picks the best of each group by score: an outcome reward model's")
    with launched(pipeline) as p:
        spec = JobSpec(model=cfg.model, step=cfg.step, staging=new_staging(output), output=output,
                       num_shards=cfg.num_shards or max(1, size // (256 << 20)), token_budget=cfg.token_budget,
                       batch_rows=cfg.batch_size, group_by=group_by, started=time.time(),
                       output_format=cfg.output_format, max_bad_fraction=cfg.max_bad_fraction, truncate=cfg.truncate,
                       mode=ScoringMode(cfg.deterministic, cfg.reward))
        build(p, files, spec, rm.identity())
        try:  # a local runner raises from run(), a remote job from wait_until_finish()
            result = p.run()
            if wait:
                result.wait_until_finish()
        except Exception as e:  # noqa: BLE001 - the job's own reason when its last step refused, else the job's
            failed = f"{spec.staging}/{FAILED_FILE}"
            if isinstance(e, BatchScoreError) or not rio.exists(failed):
                raise
            raise BatchScoreError(json.loads(rio.read_bytes(failed))["error"]) from e
    if not wait:
        return None
    return json.loads(rio.read_bytes(f"{output}/{SUMMARY_FILE}"))
