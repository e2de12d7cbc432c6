"""`rmflow score`: rewards for conversations (message lists), batched by length.

Input JSONL: one conversation a line, either a list of ``{role, content}`` messages or an
object with ``messages`` (other fields are kept in the output), ending with the assistant reply
to score. Output JSONL, in input order: the line's fields plus ``score`` (and
``score_normalized`` when the model carries reward_normalization.json from
`rmflow eval --normalize`), or, for a line that cannot be scored, its fields plus ``line`` and
``error`` (bad JSON, invalid UTF-8 or Unicode, NaN, no final assistant message, too long ...).
A line's own field named like one of rmflow's (``score``, ``line``, ``error`` ...) is kept as
``input_<name>``. `rmflow score` exits 1 when more than ``--max-bad-fraction`` of the lines
are bad (the file is written either way).

A process reward model scores steps: each input line is a solution, ``{"prompt": ...,
"completions": [step, ...]}`` (TRL's stepwise layout; labels, if present, are kept and ignored),
and the output adds ``step_scores`` (P(step is correct), one per step) and ``first_error``
(the first step scored below 0.5, -1 when none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from rmflow.eval.metrics import first_error
from rmflow.handlers import handler
from rmflow.schemas import jsontext
from rmflow.schemas.config import SCORING_BATCH_SIZE
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.kinds import kind_named
from rmflow.schemas.metrics import STEP_THRESHOLD
from rmflow.schemas.record import ResponsesRecord
from rmflow.schemas.stops import refuse_if_stopping
from rmflow.scoring.api import BadConversation, RewardModel, attribute_scores


def _lines(path: str):
    """(line number, decoded text or None, problem or None) for each non-blank line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield line_no, raw.decode("utf-8"), None
            except UnicodeDecodeError as e:
                yield line_no, None, f"line is not valid UTF-8 ({e}); save the file as UTF-8"


class ScoreError(RmflowError):
    """A scoring job cannot run; the message says why and what to do."""


def echoed(fields: dict[str, Any], reserved: frozenset[str] | set[str]) -> dict[str, Any]:
    """A record's own fields, to write beside rmflow's (``reserved``: the scores, the job's
    ``source`` and ``line``, ``error``): a field named like one of those keeps its value under
    ``input_<name>`` (prefixed again while that name is taken too), so neither overwrites the other."""
    out = {}
    for key, value in fields.items():
        name = key
        while name in reserved or (name != key and name in fields) or name in out:
            name = f"input_{name}"
        out[name] = value
    return out


LINE_FIELDS = frozenset({"line", "error"})  # what a line that cannot be scored gets


def score_file(model_path: str, input_path: str, output_path: str, *, step: int | str | None = None,
               batch_size: int = SCORING_BATCH_SIZE, truncate: str = "error", progress_factory=None) -> dict[str, int]:
    """Score a JSONL file through the Python API (``rmflow.RewardModel``), one result line per
    input line; a line that cannot be scored keeps its fields and gets ``line`` and ``error``.
    ``truncate="left"``: a conversation longer than the model's positions loses its earliest tokens."""
    if os.path.isdir(output_path):
        raise ScoreError(f"--output {output_path} is a folder; give the JSONL file to write")
    if not os.path.isfile(input_path):
        raise ScoreError(f"--input {input_path} is not a file; give a JSONL file of conversations")
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise ScoreError(f"--output {output_path} is the input file: give another path (the scores are written "
                         "beside, then renamed over it)")
    rm = RewardModel.load(model_path, step)
    scorer = handler(rm.kind, "scorer")
    rows: list[dict[str, Any]] = []
    seqs, owners = [], []  # each conversation's row
    groups: list[tuple[int, list]] = []  # (row, its K encoded conversations): one prompt, computed once
    for line_no, text, problem in _lines(input_path):
        obj = None
        try:
            if problem:
                raise BadConversation(problem)
            try:
                obj = jsontext.loads(text, allow_nan=False)
            except (ValueError, RecursionError) as e:  # NotJsonText is a ValueError
                raise BadConversation(f"not valid JSON text: {e}") from e
            conversations = responses_of(obj) if kind_named(rm.kind).normalizable else None
            encoded = [scorer.encode(rm, c, truncate=truncate) for c in (conversations or [obj])]
            rows.append(echoed(obj if isinstance(obj, dict) else {"messages": obj}, OUTPUT_FIELDS | LINE_FIELDS))
            if conversations:
                groups.append((len(rows) - 1, encoded))
            else:
                seqs.extend(encoded)
                owners.extend(len(rows) - 1 for _ in encoded)
        except Exception as e:  # noqa: BLE001 - every bad line is reported, none is lost
            reason = str(e) if isinstance(e, BadConversation) else f"{type(e).__name__}: {e}"
            kept = echoed(obj, OUTPUT_FIELDS | LINE_FIELDS) \
                if isinstance(obj, dict) else {}  # the user's own fields (an id ...), to join results back
            rows.append({**kept, "line": line_no, "error": reason})
    progress = progress_factory(len(seqs) + len(groups)) if progress_factory and (seqs or groups) else None
    shapes = rm.shapes(batch_size)
    for batch in shapes.plan([scorer.size(x) for x in seqs]):
        for i, fields in zip(batch, scorer.run(rm, [seqs[i] for i in batch], shapes)):
            rows[owners[i]].update(fields)
        if progress:
            progress(len(batch))
    if groups:  # a record of K responses: its prompt computed once
        for (row, _), fields in zip(groups, group_fields(rm, [g for _, g in groups])):
            rows[row].update(fields)
        if progress:
            progress(len(groups))
    _write(output_path, rows)
    scored = len(set(owners) | {row for row, _ in groups})
    return {"scored": scored, "errors": len(rows) - scored}



def response_fields(scores: list[float], attributes: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """A K-response record's output: its responses' scores in the given order and the best's index;
    for an attribute head, each response's outputs by name."""
    return {RESPONSE_SCORES: scores, BEST_RESPONSE: max(range(len(scores)), key=scores.__getitem__),
            **({RESPONSE_ATTRIBUTES: attributes} if attributes else {})}


def group_fields(rm: RewardModel, groups: list[list]) -> list[dict[str, Any]]:
    """``response_fields`` of each group of encoded conversations (one prompt's K), its prompt computed once."""
    rewards, outputs = rm.score_groups_outputs(groups)
    return [response_fields([float(s) for s in r], [attribute_scores(rm.attributes, o) for o in out]
                            if rm.attributes else None) for r, out in zip(rewards, outputs)]


def responses_of(obj: Any) -> list[list[dict[str, str]]] | None:
    """A record of K responses to one prompt (a multi-response layout, ``rendering.responses``; a
    ``prompt`` with its ``responses`` needs no scores or ranks here) as
    its K conversations, the prompt and each response, to score in one call (in the given order,
    left-out responses included: every response gets its score); None for any other record."""
    from rmflow.rendering.formats import candidate_formats
    from rmflow.rendering.responses import raw_responses
    from rmflow.schemas.config import MULTI_FORMATS, ROW_FORMATS

    if not isinstance(obj, dict):
        return None
    found = candidate_formats(obj)
    layouts = [f for f in found if f in MULTI_FORMATS and f not in ROW_FORMATS]
    if not found and "messages" not in obj and isinstance(obj.get("responses"), list) and "prompt" in obj:
        layouts = ["responses"]  # a prompt and its responses, not yet scored (and nothing else): to score
    if len(layouts) != 1:
        return None
    prompt, responses = raw_responses(obj, layouts[0])
    as_dicts = [{"role": m[0], "content": m[1]} for m in prompt]
    return [as_dicts + [{"role": m[0], "content": m[1]} for m in r] for r in responses]


def _outcome_fields(rm: RewardModel, scores, outputs) -> list[dict[str, Any]]:
    normalized = rm.normalize(scores) if rm.normalization and rm.normalization.get("std") else None
    return [{"score": float(s), **({"score_normalized": float(normalized[k])} if normalized is not None else {}),
             **({ATTRIBUTE_SCORES: attribute_scores(rm.attributes, outputs[k])} if outputs is not None else {})}
            for k, s in enumerate(scores)]


def _run_outcome(rm: RewardModel, items: list, shapes) -> list:
    """One batch of encoded conversations (each gets its fields) and units of one prompt's
    responses (``response_units``: each gets its responses' fields, a list, the prompt computed
    once), each kind in one forward of a compiled shape."""
    scorer, out = rm.scorer(shapes), [None] * len(items)
    seqs = [i for i, x in enumerate(items) if not isinstance(x, ResponsesRecord)]
    units = [i for i, x in enumerate(items) if isinstance(x, ResponsesRecord)]
    if seqs:
        scores, outputs = scorer.run_outputs([items[i] for i in seqs])
        for i, fields in zip(seqs, _outcome_fields(rm, scores, outputs)):
            out[i] = fields
    if units:
        rewards, outputs = scorer.run_units([items[i] for i in units])
        for j, i in enumerate(units):
            out[i] = _outcome_fields(rm, rewards[j], None if outputs is None else outputs[j])
    return out


def _outcome_size(item) -> int:
    return item.unit_len if isinstance(item, ResponsesRecord) else len(item)


def _run_process(rm: RewardModel, solutions: list, shapes) -> list[dict[str, Any]]:
    return [{"step_scores": [float(x) for x in p], "first_error": first_error(p < STEP_THRESHOLD)}
            for p in rm.scorer(shapes).run(solutions)]


def _warm(rm: RewardModel, shapes, units: bool = False) -> None:
    rm.scorer(shapes).warm_up()  # a process model's: it has no K-response items


def _warm_outcome(rm: RewardModel, shapes, units: bool = False) -> None:
    rm.scorer(shapes).warm_up(units=units)  # ``units``: the shapes of K-response items' units too


def _step_slots(solution) -> int:
    from rmflow.trainer.inference import StepScorer

    return StepScorer.slots(solution)


@dataclasses.dataclass(frozen=True)
class Scorer:
    # one input object (and truncate=: error or left) -> what ``run`` takes; raises BadConversation
    encode: Callable[..., Any]
    size: Callable[[Any], int]  # an encoded input's tokens (how batches are cut)
    # one batch that fits a shape of the ScoringShapes -> the fields each input gets
    run: Callable[[RewardModel, list, Any], list[dict[str, Any]]]
    fields: tuple[str, ...]
    # compile the batch shapes before the first request (and, if asked, those of response units)
    warm_up: Callable[[RewardModel, Any, bool], None]
    # what besides its length fixes an encoded input's batch shape (``ScoringShapes.plan``'s groups)
    group: Callable[[Any], int] = lambda x: 0


# Each reward model kind's scoring of one input (a JSONL line, a server request item): its part
# of the kind's handlers (rmflow.handlers).
ATTRIBUTE_SCORES = "attribute_scores"  # an attribute head's outputs by name (RewardModel.attributes)
OUTCOME_SCORER = Scorer(RewardModel.encode, _outcome_size, _run_outcome, ("score", "score_normalized", ATTRIBUTE_SCORES),
                        _warm_outcome)
PROCESS_SCORER = Scorer(RewardModel.encode_steps, lambda x: len(x[0]), _run_process, ("step_scores", "first_error"),
                        _warm, _step_slots)
# a K-response record's (responses_of)
RESPONSE_SCORES, BEST_RESPONSE, RESPONSE_ATTRIBUTES = "response_scores", "best_response", "response_attribute_scores"
OUTPUT_FIELDS = frozenset({*(f for s in (OUTCOME_SCORER, PROCESS_SCORER) for f in s.fields), RESPONSE_SCORES,
                           BEST_RESPONSE, RESPONSE_ATTRIBUTES})  # rmflow's: never a record's own


def _write(path: str, rows: list[dict[str, Any]]) -> None:
    """Written beside, then renamed over ``path``: an interrupted write leaves the earlier file whole."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        refuse_if_stopping()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
