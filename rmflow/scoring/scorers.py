"""`rmflow score`: rewards for the records of a JSONL file, batched by length.

Input JSONL, one record a line (``encode_record``): a conversation (a list of ``{role, content}``
messages, or an object with ``messages``) ending with the assistant reply to score; one prompt's
K >= 1 responses in any multi-response layout (each response scored with its prompt, the prompt
computed once); a response-a-row record (HelpSteer's: its prompt and response); or a preference
pair in any pair layout (both replies, each with the prompt). Other fields are kept in the output.
Output JSONL, in input order: the line's fields plus ``score`` (``score_normalized`` when the model
carries reward_normalization.json from `rmflow eval --normalize`; an attribute head's
``attribute_scores``), ``response_scores`` and ``best_response`` (``response_attribute_scores``)
for K responses, ``score_chosen``, ``score_rejected``, ``margin`` and ``agrees`` for a pair; or,
for a line that cannot be scored, its fields plus ``line`` and ``error`` (bad JSON, invalid UTF-8
or Unicode, NaN, no final assistant message, too long ...). A line's own field named like one of
rmflow's (``score``, ``line``, ``error`` ...) is kept as ``input_<name>``. `rmflow score` exits 1
when more than ``--max-bad-fraction`` of the lines are bad (the file is written either way).

A process reward model scores steps: each input line is a solution, ``{"prompt": ...,
"completions": [step, ...]}`` (TRL's stepwise layout; labels, if present, are kept and ignored),
and the output adds ``step_scores`` (P(step is correct), one per step) and ``first_error``
(the first step scored below 0.5, -1 when none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any

from rmflow.handlers import handler
from rmflow.rendering.responses import RAW_RESPONSES
from rmflow.schemas import jsontext
from rmflow.schemas.config import SCORING_BATCH_SIZE
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.heads import ATTRIBUTE_SCORES, RESPONSE_ATTRIBUTES  # noqa: F401 - re-exported for the Beam job
from rmflow.schemas.kinds import kind_named
from rmflow.schemas.metrics import STEP_THRESHOLD, first_error
from rmflow.schemas.outputs import inside_of, nested_in
from rmflow.schemas.record import is_unit, item_scores, item_tokens
from rmflow.schemas.stops import refuse_if_stopping
from rmflow.scoring.api import BadConversation, RewardModel


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


@dataclasses.dataclass(frozen=True)
class ScoringMode:
    """How a job's scores are computed, beside its model and batches: ``deterministic`` (each
    conversation alone in its row, its score the same to the last bit however it is batched) and
    an ensemble's ``reward`` rule (empty: the one it was trained with)."""

    deterministic: bool = False
    reward: str = ""


def score_file(model_path: str, input_path: str, output_path: str, *, step: int | str | None = None,
               batch_size: int = SCORING_BATCH_SIZE, truncate: str = "error", mode: ScoringMode = ScoringMode(),
               progress_factory=None) -> dict[str, int]:
    """Score a JSONL file through the Python API (``rmflow.RewardModel``), one result line per
    input line, each line what ``encode_record`` reads (a conversation, a preference pair, one
    prompt's K responses, a solution); a line that cannot be scored keeps its fields and gets
    ``line`` and ``error``, and no line takes the others' scores with it (``score_encoded``).
    ``truncate="left"``: a conversation longer than the model's positions loses its earliest tokens;
    ``mode``: deterministic scores, an ensemble's reward rule (``ScoringMode``)."""
    if os.path.isdir(output_path):
        raise ScoreError(f"--output {output_path} is a folder; give the JSONL file to write")
    if not os.path.isfile(input_path):
        raise ScoreError(f"--input {input_path} is not a file; give a JSONL file of conversations")
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise ScoreError(f"--output {output_path} is the input file: give another path (the scores are written "
                         "beside, then renamed over it)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(output_path))):
        raise ScoreError(f"--output {output_path}: its folder does not exist; create it, or give another path")
    inside = nested_in(output_path) or (f"--output {output_path} is inside the model folder {model_path}: give a "
                                         "path outside it" if inside_of(model_path, [output_path]) else None)
    if inside:  # a file of another output (an export's config.json, a manifest) would be overwritten
        raise ScoreError(inside)
    rm = RewardModel.load(model_path, step, reward=mode.reward)
    rows: list[dict[str, Any]] = []
    encoded, owners = [], []  # each encodable line's (what, sequences), and its (row, line number)
    for line_no, text, problem in _lines(input_path):
        obj = None
        try:
            if problem:
                raise BadConversation(problem)
            try:
                obj = jsontext.loads(text, allow_nan=False)
            except (ValueError, RecursionError) as e:  # NotJsonText is a ValueError
                raise BadConversation(f"not valid JSON text: {e}") from e
            encoded.append(encode_record(rm, obj, source=input_path, line=line_no, truncate=truncate))
            rows.append(echoed(obj if isinstance(obj, dict) else {"messages": obj}, OUTPUT_FIELDS | LINE_FIELDS))
            owners.append((len(rows) - 1, line_no))
        except Exception as e:  # noqa: BLE001 - every bad line is reported, none is lost
            reason = str(e) if isinstance(e, BadConversation) else getattr(e, "message", None) or \
                f"{type(e).__name__}: {e}"
            kept = echoed(obj, OUTPUT_FIELDS | LINE_FIELDS) \
                if isinstance(obj, dict) else {}  # the user's own fields (an id ...), to join results back
            rows.append({**kept, "line": line_no, "error": reason})
    fields = score_encoded(rm, encoded, rm.shapes(batch_size, deterministic=mode.deterministic),
                           progress_factory=progress_factory)
    for (row, line_no), result in zip(owners, fields):
        if "error" in result:  # could not be scored (a bug, named): the line's fields and why
            rows[row] = {**rows[row], "line": line_no, "error": result["error"]}
        else:
            rows[row].update(result)
    _write(output_path, rows)
    scored = sum("error" not in r for r in rows)
    return {"scored": scored, "errors": len(rows) - scored}


def response_fields(scores: list[float], extra: dict[str, list] | None = None) -> dict[str, Any]:
    """A K-response record's output: its responses' scores in the given order and the best's index,
    and ``extra``: the fields the model's head adds, a list each (``Head.answer_keys``)."""
    return {RESPONSE_SCORES: scores, BEST_RESPONSE: max(range(len(scores)), key=scores.__getitem__), **(extra or {})}


RESPONSES, PAIR, CONVERSATION, SOLUTION = "responses", "pair", "conversation", "solution"  # what a record is
PAIR_FIELDS = ("score_chosen", "score_rejected", "margin", "agrees")  # a preference pair's output


def encode_record(rm: RewardModel, obj: Any, *, source: str = "", line: int = 0, truncate: str = "error"
                  ) -> tuple[str, list]:
    """(what the record is, its encoded sequences): for a process model a solution (one); else one
    prompt's K >= 1 responses (``responses_of``: each with the prompt, in the given order), a
    preference pair (chosen and rejected, each with the prompt), a response-a-row record (its
    prompt and response: one conversation) or a conversation (one). Raises BadConversation or
    BadRecord. What `rmflow score` (in process and as a Beam job) reads."""
    from rmflow.rendering.formats import normalize

    scorer = handler(rm.kind, "scorer")
    if not kind_named(rm.kind).pairwise:
        return SOLUTION, [scorer.encode(rm, obj, truncate=truncate)]
    conversations = responses_of(obj)
    if conversations is not None:
        return RESPONSES, [scorer.encode(rm, c, truncate=truncate) for c in conversations]
    row = row_conversation(obj)
    if row is not None:
        return CONVERSATION, [scorer.encode(rm, row, truncate=truncate)]
    if isinstance(obj, dict) and "tokenized" in _layouts(obj):
        raise BadConversation("a pair of token ids: scoring renders text with the model's chat template, so give the "
                              "pair as text (chosen and rejected replies)")
    if isinstance(obj, dict) and "chosen" in obj and "rejected" in obj and "messages" not in obj:
        pair = normalize(obj, _pair_layout(obj), source=source, line=line)
        if not getattr(pair, "chosen", None) or getattr(pair, "is_tokenized", False):
            raise BadConversation("a pair to score needs chosen and rejected replies as text")
        return PAIR, [scorer.encode(rm, _as_dicts(pair.prompt + reply), truncate=truncate)
                      for reply in (pair.chosen, pair.rejected)]
    return CONVERSATION, [scorer.encode(rm, obj, truncate=truncate)]


def _layouts(obj: dict[str, Any]) -> list[str]:
    from rmflow.rendering.formats import candidate_formats

    return candidate_formats(obj)


def _pair_layout(obj: dict[str, Any]) -> str:
    from rmflow.rendering.formats import detect_format

    return detect_format(obj)


def _as_dicts(messages) -> list[dict[str, str]]:
    from rmflow.rendering.tokenize import message_dict

    return [message_dict(m) for m in messages]


def score_encoded(rm: RewardModel, records: list[tuple[str, list]], shapes, *, one_length: bool = False,
                  progress_factory=None) -> list[dict[str, Any]]:
    """The output fields of each encoded record (``encode_record``), in order, scored in batches
    of ``shapes`` (``ScoringShapes.plan``; ``one_length``: as a Beam job cuts them): a record of K
    responses in units of its prompt and several responses (``trainer.inference.response_units``,
    the prompt computed once; K = 1: its one conversation), as the server scores it (deterministic
    ``shapes``: each response its own conversation, a row of its own). A batch that
    fails is run again an item at a time, so only a record that cannot be scored alone fails, with
    ``{"error": ...}``: no record takes the others' scores with it."""
    from rmflow.trainer.inference import response_units

    scorer = handler(rm.kind, "scorer")
    items, owner = [], []  # what the batches run, and the record each belongs to
    for r, (what, seqs) in enumerate(records):
        parts = response_units(seqs, rm.max_length) if what == RESPONSES and not isolates(shapes) else seqs
        items += parts
        owner += [r] * len(parts)
    results: list[Any] = [None] * len(items)
    progress = progress_factory(len(items)) if progress_factory and items else None
    sizes = [scorer.size(x) for x in items]
    for batch in shapes.plan(sizes, one_length=one_length, groups=[scorer.group(x) for x in items]):
        for i, fields in zip(batch, _run_isolated(rm, scorer, [items[i] for i in batch], shapes)):
            results[i] = fields
        if progress:
            progress(len(batch))
    per: list[list] = [[] for _ in records]
    for i, r in enumerate(owner):
        per[r].append(results[i])
    return [_record_fields(what, rs, rm.head) for (what, _), rs in zip(records, per)]


def isolates(shapes) -> bool:
    """Whether ``shapes`` score each item alone, in the shape it sets (``ScoringShapes``): then no
    response shares a row with its siblings in a unit either."""
    return bool(getattr(shapes, "deterministic", False))


def _run_isolated(rm: RewardModel, scorer: Scorer, items: list, shapes) -> list:
    """``scorer.run`` of one batch; when it raises, each item alone, an item that fails alone
    getting its exception in place of its fields."""
    try:
        return scorer.run(rm, items, shapes)
    except Exception as e:  # noqa: BLE001 - a bug: confined to the records it touches, named in their error
        if len(items) == 1:
            return [e]
        return [r for x in items for r in _run_isolated(rm, scorer, [x], shapes)]


def _record_fields(what: str, results: list, head) -> dict[str, Any]:
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None:
        return {"error": f"could not be scored: {type(failed).__name__}: {str(failed)[:500]} (a bug in rmflow: "
                         "please report it with this line)", "code": "internal_error"}
    if what == RESPONSES:  # units give a list of fields, one a response; a response alone its own
        each = [f for r in results for f in (r if isinstance(r, list) else [r])]
        extra = {many: [f[key] for f in each] for key, many in head.answer_keys}
        return response_fields([f["score"] for f in each], extra)
    if what == PAIR:
        c, r = results[0]["score"], results[1]["score"]
        return dict(zip(PAIR_FIELDS, (c, r, c - r, bool(c > r))))
    return results[0]


def row_conversation(obj: Any) -> list[dict[str, str]] | None:
    """A response-a-row record (HelpSteer's: a prompt, one response, its ratings) as the one
    conversation it scores, its prompt and response; None for any other record."""
    from rmflow.rendering.formats import candidate_formats
    from rmflow.rendering.responses import row_messages
    from rmflow.schemas.config import ROW_FORMATS

    if not isinstance(obj, dict) or "messages" in obj or not set(candidate_formats(obj)) & set(ROW_FORMATS):
        return None
    return _as_dicts(row_messages(obj))


# Where each multi-response layout keeps its responses: to count them before reading any
RESPONSE_LISTS = {layout: tuple(name for name, _ in lists) for layout, (_, lists) in RAW_RESPONSES.items()}


def responses_layout(obj: Any) -> str | None:
    """The multi-response layout of a record of K responses to score (``responses_of``), or None."""
    from rmflow.rendering.formats import candidate_formats
    from rmflow.schemas.config import MULTI_FORMATS, ROW_FORMATS

    if not isinstance(obj, dict) or "messages" in obj:  # a conversation is one, whatever else it carries
        return None
    found = candidate_formats(obj)
    layouts = [f for f in found if f in MULTI_FORMATS and f not in ROW_FORMATS]
    if not found and isinstance(obj.get("responses"), list) and "prompt" in obj:
        layouts = ["responses"]  # a prompt and its responses, not yet scored (and nothing else): to score
    if not layouts and isinstance(obj.get("prompt"), str) and all(
            isinstance(obj.get(side), list) and all(isinstance(x, str) for x in obj[side]) for side in ("chosen", "rejected")):
        layouts = ["rewardbench2"]  # a RewardBench 2 record with no rejected answer (or no chosen): still K to score
    return layouts[0] if len(layouts) == 1 else None


def check_one_layout(obj: Any) -> None:
    """A record to score is read as one layout, as preprocess reads it: one whose keys fit several
    (K responses with scores and a pair, or a prompt's unscored ``responses`` beside ``chosen`` and
    ``rejected``) is refused, never scored as whichever its keys happen to favour. A record with
    ``messages`` is a conversation, whatever else it carries."""
    from rmflow.rendering.formats import candidate_formats

    if not isinstance(obj, dict) or "messages" in obj:
        return
    from rmflow.schemas.config import MULTI_FORMATS

    found = candidate_formats(obj)
    if isinstance(obj.get("responses"), list) and {"chosen", "rejected"} & set(obj) \
            and not set(found) & set(MULTI_FORMATS):
        found = ["responses to score", *found]  # a prompt's unscored responses, beside a pair
    if len(found) > 1:
        raise BadConversation(f"keys {sorted(obj)} fit several layouts ({', '.join(found)}): give a record of one "
                              "(drop the other's fields)")


def response_count(obj: Any) -> int:
    """How many responses a record of K responses holds, counted without reading them (1 for any
    other record): what bounds a request before anything in it is rendered or tokenized."""
    layout = responses_layout(obj)
    if layout is None:
        return 1
    return sum(len(v) for name in RESPONSE_LISTS[layout] if isinstance(v := obj.get(name), list)) or 1


def responses_of(obj: Any) -> list[list[dict[str, str]]] | None:
    """A record of K responses to one prompt (a multi-response layout, ``rendering.responses``; a
    ``prompt`` with its ``responses`` needs no scores or ranks here) as
    its K conversations, the prompt and each response, to score in one call (in the given order,
    left-out responses included: every response gets its score); None for any other record."""
    from rmflow.rendering.responses import raw_responses

    check_one_layout(obj)
    layout = responses_layout(obj)
    if layout is None:
        return None
    prompt, responses = raw_responses(obj, layout)
    if not responses:
        raise BadConversation(f"no responses to score: the {layout} record's list of responses is empty")
    return [_as_dicts(prompt + r) for r in responses]


def _outcome_fields(rm: RewardModel, scores, outputs) -> list[dict[str, Any]]:
    """Each conversation's answer: its reward, normalised when the model has the figures, and the
    fields its head adds (``Head.answer``: an attribute head's outputs by name)."""
    normalized = rm.normalize(scores) if rm.normalization and rm.normalization.get("std") else None
    head, cfg = rm.head, rm.model_config
    return [{"score": float(s), **({"score_normalized": float(normalized[k])} if normalized is not None else {}),
             **head.answer(None if outputs is None else outputs[k], cfg)} for k, s in enumerate(scores)]


def _run_outcome(rm: RewardModel, items: list, shapes) -> list:
    """One batch of encoded conversations (each gets its fields) and units of one prompt's
    responses (``response_units``: each gets its responses' fields, a list, the prompt computed
    once), as the scorer of ``shapes`` runs them (``run_items``: packed in one row, or each kind
    in one forward of a compiled shape)."""
    out = []
    for item, (rewards, outputs) in zip(items, rm.scorer(shapes).run_items(items)):
        fields = _outcome_fields(rm, rewards, outputs)
        out.append(fields if is_unit(item) else fields[0])
    return out


def _run_process(rm: RewardModel, solutions: list, shapes) -> list[dict[str, Any]]:
    return [{"step_scores": [float(x) for x in p], "first_error": first_error(p < STEP_THRESHOLD)}
            for p in rm.scorer(shapes).run(solutions)]


def _warm(rm: RewardModel, shapes, units: bool = False, up_to: int | None = None) -> None:
    rm.scorer(shapes).warm_up(up_to=up_to)  # a process model's: it has no K-response items


def _warm_outcome(rm: RewardModel, shapes, units: bool = False, up_to: int | None = None) -> None:
    rm.scorer(shapes).warm_up(units=units, up_to=up_to)  # ``units``: the shapes of K-response items' units too


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
    # compile the batch shapes (up to a length) before the first request (and, if asked, those of response units)
    warm_up: Callable[[RewardModel, Any, bool, int | None], None]
    # what besides its length an encoded input takes of a batch (``plan``'s groups): of one item a row,
    # what fixes its shape (a solution's step slots; a unit's responses); of a packed row, its reward slots
    group: Callable[[Any], int] = lambda x: 0


# Each reward model kind's scoring of one input (a JSONL line, a server request item): its part
# of the kind's handlers (rmflow.handlers).
OUTCOME_SCORER = Scorer(RewardModel.encode, item_tokens, _run_outcome, ("score", "score_normalized", ATTRIBUTE_SCORES),
                        _warm_outcome, item_scores)
PROCESS_SCORER = Scorer(RewardModel.encode_steps, lambda x: len(x[0]), _run_process, ("step_scores", "first_error"),
                        _warm, _step_slots)
# a K-response record's (responses_of)
RESPONSE_SCORES, BEST_RESPONSE = "response_scores", "best_response"
OUTPUT_FIELDS = frozenset({*(f for s in (OUTCOME_SCORER, PROCESS_SCORER) for f in s.fields), RESPONSE_SCORES,
                           BEST_RESPONSE, RESPONSE_ATTRIBUTES})  # rmflow's: never a record's own


def _write(path: str, rows: list[dict[str, Any]]) -> None:
    """Written beside, then renamed over ``path``: an interrupted write leaves the earlier file whole."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(jsontext.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        refuse_if_stopping()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
