"""Multi-response layouts: one prompt with K rated or ranked responses, read into one
``CanonicalResponses``: kept whole (a responses record, trained listwise: at most
``max_responses`` of them, ``cap_responses``), or turned into preference pairs (``to_pairs``):
every ordered pair with a score difference (``expand``), or one pair a prompt (``best-worst``,
``best-random``).

Layouts, as they are published (``schemas.config.MULTI_FORMATS``; detected by their signatures in
``rendering.formats``):

* ``responses``: ``prompt`` (a string, messages, or an HH transcript), ``responses`` (K strings
  or message lists) and ``scores`` (K numbers, higher is better) or ``ranks`` (K integers, 1 is
  best); both, when they order the responses alike.
* ``rewardbench2``: ``prompt``, ``chosen`` and ``rejected`` as lists of strings (RewardBench 2,
  RM-Bench): every chosen response scores 1, every rejected one 0.
* ``nectar``: ``prompt`` (an HH transcript) and ``answers``: ``[{"answer", "rank", "model"}]``.
* ``helpsteer``: one row per response (HelpSteer2): ``prompt``, ``response`` and integer
  attributes (``helpfulness``, ``correctness``, ``coherence``, ``complexity``, ``verbosity``); the
  rows of one prompt are grouped into one record (``group_rows``, in the pipeline a GroupByKey),
  each response scored by a weighted sum of its attributes (``--attribute-weights``).
* ``ultrafeedback-raw``: ``instruction`` and ``completions``: ``[{"response", "fine-grained_score",
  "overall_score", "annotations"}]``; a completion's score is its ``fine-grained_score`` (the
  mean of its aspects' ratings), else the mean of its annotations' ``Rating``s, else its
  ``overall_score``.

Attribute ratings (``attributes``: names, in order) are kept beside each response's score when
asked for: a ``responses`` record's per-response ``attributes`` objects (which, without ``scores``
or ``ranks``, also give the score: their weighted sum by ``weights``), HelpSteer's columns,
UltraFeedback's ``annotations.<aspect>.Rating``; a response without one of them makes its record
a bad record (``missing_attribute``), and a layout that carries none cannot give them.

A response given twice with the same score (and ratings) is kept once (counted: ``merged``);
given twice with other scores, its labels contradict and every copy is left out
(``contradicted``), as is an empty response (``dropped``); the record is kept while two responses
remain.

Pure functions, no Beam. Bad input raises ``BadRecord`` with a code: ``too_few_responses``,
``missing_score``, ``missing_attribute``, ``bad_value``, ``duplicate_response``, ``all_tied`` (a
``Tie``), ``one_response`` (``Unranked``, no error: a record with its ratings kept is kept unranked).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from rmflow.rendering.formats import (
    MAX_MARGIN,
    BadRecord,
    CanonicalPair,
    CanonicalSteps,
    Message,
    Tie,
    Unranked,
    check_prompt,
    check_reply,
    is_empty_reply,
    normalize,
    parse_hh_transcript,
    read_messages,
)
from rmflow.schemas import jsontext
from rmflow.schemas.config import MULTI_FORMATS, PAIRS_FROM, ROW_FORMATS, attribute_names

PAIR_MODES = tuple(m for m in PAIRS_FROM if m)
MAX_SCORE = 1e15  # a rating or rank; past this a score difference loses its meaning in float32


@dataclasses.dataclass(frozen=True)
class CanonicalResponses:
    """One prompt and its K >= 2 responses, each with a score (higher is better; a rank r is
    scored -r); with attribute ratings kept, also K = 1 or every score equal (``ranked`` false:
    nothing to rank, its ratings to fit)."""

    source: str
    line: int
    prompt: tuple[Message, ...]
    responses: tuple[tuple[Message, ...], ...]
    scores: tuple[float, ...]
    subset: str | None = None
    merged: int = 0  # responses given twice (the same text, scored alike), kept once
    dropped: int = 0  # empty responses, left out
    contradicted: int = 0  # copies of a text scored two ways (its labels contradict), left out
    capped: int = 0  # responses past --max-responses, left out (``cap_responses``)
    most: int = 0  # kept whole: at most this many of the responses that fit the length policy (0: all)
    margin_from_scores: bool = False  # trained with each pair's score difference as its margin
    attributes: tuple[tuple[float, ...], ...] = ()  # each response's ratings, by ``attribute_names``; () none
    attribute_names: tuple[str, ...] = ()
    weighted: bool = False  # its scores are the weighted sums of its responses' ratings (``weights``)
    raw: str = dataclasses.field(default="", compare=False, repr=False)  # for the errors file
    margin = None  # a pair's field, absent here
    is_tokenized = False

    @property
    def ranked(self) -> bool:
        """Two of its responses score differently (as stored): it has something to rank."""
        return len(set(map(stored, self.scores))) > 1

    @property
    def group(self) -> str:
        """The prompt's content hash: every pair made from this prompt goes to one split."""
        blob = jsontext.dumps(["prompt", self.prompt], ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return hashlib.blake2b(blob, digest_size=16).hexdigest()

    @property
    def split_key(self) -> str:
        """The prompt: its record goes to the split its pairs would (``to_pairs``), so that a
        listwise run and a run on the same data as pairs hold out the same prompts."""
        return self.group

    @property
    def pair_id(self) -> str:
        """Stable 128-bit content hash of the prompt, its responses and their scores (the name is
        the pairs': dedup keys on it)."""
        content = ["responses", self.prompt, self.responses, self.scores]
        if self.attributes:  # ratings kept are content too (records without them keep their ids)
            content += [self.attribute_names, self.attributes]
        blob = jsontext.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return hashlib.blake2b(blob, digest_size=16).hexdigest()

    @property
    def reply_texts(self) -> tuple[str, ...]:
        """The text of each response (its messages' text, a line each)."""
        return tuple("\n".join(m[1] for m in r) for r in self.responses)


def _prompt(value: Any, name: str) -> tuple[Message, ...]:
    """A prompt: messages, an HH transcript (its open last Assistant turn dropped) or plain text."""
    if isinstance(value, str):
        if not value.strip():
            raise BadRecord("empty_prompt", f"'{name}' is empty")
        if "\n\nHuman:" in value or value.startswith("Human:"):
            msgs = parse_hh_transcript(value, name)
            if msgs and msgs[-1][0] == "assistant" and not msgs[-1][1]:
                msgs = msgs[:-1]
            if not msgs or msgs[-1][0] != "user":
                raise BadRecord("bad_transcript", f"'{name}' does not end with a Human turn")
            return msgs
        return (("user", value),)
    return check_prompt(read_messages(value, name), name)


EMPTY: tuple = ()  # an empty response: dropped from its record (counted), the others kept


def _response(value: Any, name: str) -> tuple[Message, ...]:
    if value is None:  # a missing response (a null in a Parquet list): left out, as an empty one is
        return EMPTY
    if isinstance(value, str):
        return (("assistant", value),) if value.strip() else EMPTY
    msgs = read_messages(value, name)
    if not msgs or (len(msgs) == 1 and msgs[0][0] == "assistant" and is_empty_reply(msgs[0])):
        return EMPTY
    return check_reply(msgs, name)


_NUMBER = re.compile(r"\s*[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?\s*")


def _score(value: Any, name: str) -> float:
    if value is None:
        raise BadRecord("missing_score", f"{name} has no score")
    if isinstance(value, str):  # a number written as text ("4", as UltraFeedback's ratings are)
        if not _NUMBER.fullmatch(value):
            raise BadRecord("bad_value", f"{name} {value!r} is not a number")
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRecord("bad_value", f"{name} {value!r} is not a number")
    try:
        value = float(value)
    except OverflowError:
        raise BadRecord("bad_value", f"{name} is a number too large to be a score") from None
    if not math.isfinite(value) or abs(value) > MAX_SCORE:
        raise BadRecord("bad_value", f"{name} {value!r} is not a finite number within +-{MAX_SCORE:g}")
    return value


def _list(record: Mapping[str, Any], name: str) -> list:
    value = record.get(name)
    if not isinstance(value, (list, tuple)):
        raise BadRecord("bad_type" if name in record else "missing_field",
                        f"field '{name}' must be a list" + ("" if name in record else ", and is missing"))
    return list(value)


def _ratings(value: Any, names: tuple[str, ...], where: str) -> tuple[float, ...]:
    """The ratings ``names`` of one response from its object of ratings (``value``), in order;
    BadRecord ``missing_attribute`` when one is absent (or "N/A"), ``bad_value`` when not a number."""
    if not names:
        return ()
    if not isinstance(value, Mapping):
        raise BadRecord("missing_attribute", f"{where} has no attribute ratings ({', '.join(names)} asked for)")
    out = []
    for name in names:
        rating = value.get(name)
        if isinstance(rating, Mapping):  # UltraFeedback's {"Rating": "4", "Rationale": ...}
            rating = rating.get("Rating")
        if rating is None or (isinstance(rating, str) and rating.strip().upper() in ("", "N/A")):
            raise BadRecord("missing_attribute", f"{where} has no rating '{name}'")
        out.append(_score(rating, f"{where}.{name}"))
    return tuple(out)


def _no_ratings(layout: str, names: tuple[str, ...]) -> None:
    if names:
        raise BadRecord("missing_attribute", f"layout {layout} carries no attribute ratings ({', '.join(names)} "
                        "asked for)")


def _responses(r, names=(), weights=None):
    responses = _list(r, "responses")
    rated = _list(r, "attributes") if "attributes" in r else None
    if names and rated is None:
        raise BadRecord("missing_attribute", f"no 'attributes' (one object of ratings a response): {', '.join(names)} "
                        "asked for")
    ratings = [_ratings(x, names, f"attributes[{i}]") for i, x in enumerate(rated)] if names else []
    ranked = None
    if "ranks" in r:
        ranks = _list(r, "ranks")
        ranked = [-_score(x, f"ranks[{i}]") for i, x in enumerate(ranks)]
        if any(s > -1 or not float(s).is_integer() for s in ranked):
            raise BadRecord("bad_value", f"ranks {ranks}: integers from 1 (the best)")
    if "scores" in r:  # with ranks too (Nectar as published beside its scores), they must order alike
        scores = [_score(x, f"scores[{i}]") for i, x in enumerate(_list(r, "scores"))]
        if ranked is not None and (len(ranked) != len(scores) or any(
                (a > b) != (c > d) for a, c in zip(scores, ranked) for b, d in zip(scores, ranked))):
            raise BadRecord("bad_value", "'scores' and 'ranks' order the responses differently: give one")
    elif ranked is None and rated is not None:  # scored by their ratings' weighted sum, as HelpSteer's rows
        weights = weights or {}
        scores = [sum(w * _ratings(x, (name,), f"attributes[{i}]")[0] for name, w in weights.items())
                  for i, x in enumerate(rated)]
    else:
        scores = ranked
    if scores is None:
        raise BadRecord("missing_score", "a responses record needs 'scores', 'ranks' or per-response 'attributes'")
    if len(scores) != len(responses) or (names and len(ratings) != len(responses)):
        raise BadRecord("bad_value", f"{len(responses)} responses but {len(scores)} scores"
                        + (f" and {len(ratings)} attribute ratings" if names else "") + ": one each")
    return (_prompt(r.get("prompt"), "prompt"), [_response(x, f"responses[{i}]") for i, x in enumerate(responses)],
            scores, ratings)


def _rewardbench2(r, names=(), weights=None):
    _no_ratings("rewardbench2", names)
    chosen, rejected = _list(r, "chosen"), _list(r, "rejected")
    responses = [_response(x, f"chosen[{i}]") for i, x in enumerate(chosen)]
    responses += [_response(x, f"rejected[{i}]") for i, x in enumerate(rejected)]
    if not chosen or not rejected:
        raise BadRecord("too_few_responses", "a record needs at least one chosen and one rejected response")
    return _prompt(r.get("prompt"), "prompt"), responses, [1.0] * len(chosen) + [0.0] * len(rejected), []


def _nectar(r, names=(), weights=None):
    _no_ratings("nectar", names)
    answers = _list(r, "answers")
    responses, scores = [], []
    for i, a in enumerate(answers):
        if not isinstance(a, Mapping):
            raise BadRecord("bad_type", f"answers[{i}] must be an object with 'answer' and 'rank'")
        responses.append(_response(a.get("answer"), f"answers[{i}].answer"))
        rank = _score(a.get("rank"), f"answers[{i}].rank")
        if rank < 1 or not rank.is_integer():
            raise BadRecord("bad_value", f"answers[{i}].rank {rank:g}: an integer from 1 (the best)")
        scores.append(-rank)
    return _prompt(r.get("prompt"), "prompt"), responses, scores, []


def _completion_score(c: Mapping[str, Any], name: str) -> tuple[str, float]:
    """(where the score came from, the score): one scale per record (``_ultrafeedback_raw``)."""
    if c.get("fine-grained_score") is not None:
        return "fine-grained_score", _score(c["fine-grained_score"], f"{name}.fine-grained_score")
    notes = c.get("annotations")
    if isinstance(notes, Mapping) and notes:  # an aspect rated "N/A" (as UltraFeedback has some) is left out
        ratings = [_score(v.get("Rating") if isinstance(v, Mapping) else None, f"{name}.annotations.{k}")
                   for k, v in notes.items()
                   if not (isinstance(v, Mapping) and str(v.get("Rating")).strip().upper() == "N/A")]
        if ratings:
            return "fine-grained_score", sum(ratings) / len(ratings)  # the same mean, on the same 1-5 scale
    return "overall_score", _score(c.get("overall_score"), f"{name}.overall_score")


def _ultrafeedback_raw(r, names=(), weights=None):
    completions = _list(r, "completions")
    responses, scores, ratings = [], [], []
    for i, c in enumerate(completions):
        if not isinstance(c, Mapping):
            raise BadRecord("bad_type", f"completions[{i}] must be an object with 'response'")
        responses.append(_response(c.get("response"), f"completions[{i}].response"))
        scores.append(_completion_score(c, f"completions[{i}]"))
        if names:  # its aspects' ratings
            ratings.append(_ratings(c.get("annotations"), names, f"completions[{i}].annotations"))
    scales = {where for where, _ in scores}
    if len(scales) > 1:  # overall_score is 1-10, the aspects' ratings 1-5: not comparable
        raise BadRecord("mixed_scores", "some completions are scored by their aspects' ratings and some by "
                        "overall_score, on another scale: give one kind of score for every completion")
    return _prompt(r.get("instruction"), "instruction"), responses, [s for _, s in scores], ratings


_READERS = {"responses": _responses, "rewardbench2": _rewardbench2, "nectar": _nectar,
            "ultrafeedback-raw": _ultrafeedback_raw}
assert set(_READERS) == set(MULTI_FORMATS) - set(ROW_FORMATS)


@dataclasses.dataclass(frozen=True)
class Row:
    """One response of a response-a-row layout, and the key of its prompt."""

    source: str
    line: int
    prompt: tuple[Message, ...]
    response: tuple[Message, ...]
    score: float
    attributes: tuple[float, ...] = ()  # the ratings asked for (``attribute_names``), in order
    attribute_names: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The prompt as canonical JSON: the rows of one prompt share it."""
        return jsontext.dumps(self.prompt, ensure_ascii=False, separators=(",", ":"))


def read_row(record: Any, *, source: str, line: int, weights: Mapping[str, float],
             attributes: tuple[str, ...] = ()) -> Row:
    """One ``helpsteer`` row; its score the weighted sum of its attributes, and the ratings
    ``attributes`` kept. Raises BadRecord."""
    if not isinstance(record, Mapping):
        raise BadRecord("not_an_object", f"record is a JSON {type(record).__name__}, not an object")
    score = sum(w * _score(record.get(name), f"attribute '{name}'") for name, w in weights.items())
    ratings = _ratings(record, tuple(attributes), "the row")
    response = _response(record.get("response"), "response")
    if response == EMPTY:  # a row is one response: an empty one is a bad row
        raise BadRecord("empty_reply", "'response' is empty")
    return Row(source, line, _prompt(record.get("prompt"), "prompt"), response, score, ratings, tuple(attributes))


def row_messages(record: Mapping[str, Any]) -> tuple[Message, ...]:
    """A response-a-row record's prompt and response, the one conversation it holds (to score it;
    its ratings are not needed). Raises BadRecord."""
    response = _response(record.get("response"), "response")
    if response == EMPTY:
        raise BadRecord("empty_reply", "'response' is empty: nothing to score")
    return _prompt(record.get("prompt"), "prompt") + response


def group_rows(rows: list[Row]) -> dict[str, Any]:
    """The rows of one prompt as one ``responses`` record (the first row's place names it), with
    their ratings (``attributes``) when kept."""
    rows = sorted(rows, key=lambda r: (r.source, r.line))
    out = {"prompt": [{"role": m[0], "content": m[1]} for m in rows[0].prompt],
           "responses": [[{"role": m[0], "content": m[1]} for m in r.response] for r in rows],
           "scores": [r.score for r in rows]}
    if rows[0].attribute_names:
        out["attributes"] = [dict(zip(r.attribute_names, r.attributes)) for r in rows]
    return out

# Where each K-response layout keeps its prompt and its responses, read without their labels (scores,
# ranks, ratings, a rejected one beside a chosen one): the prompt's field, and each list of
# responses with the field that holds an item's text (None: the item is the response)
RAW_RESPONSES: dict[str, tuple[str, tuple[tuple[str, str | None], ...]]] = {
    "responses": ("prompt", (("responses", None),)),
    "rewardbench2": ("prompt", (("chosen", None), ("rejected", None))),
    "nectar": ("prompt", (("answers", "answer"),)),
    "ultrafeedback-raw": ("instruction", (("completions", "response"),)),
}


def _raw_list(record: Mapping[str, Any], name: str, field: str | None) -> list[tuple[Message, ...]]:
    items = _list(record, name)
    if field is None:
        return [_response(x, f"{name}[{i}]") for i, x in enumerate(items)]
    if not all(isinstance(x, Mapping) for x in items):
        raise BadRecord("bad_type", f"each of '{name}' must be an object with '{field}'")
    return [_response(x.get(field), f"{name}[{i}].{field}") for i, x in enumerate(items)]


def raw_responses(record: Mapping[str, Any], fmt: str) -> tuple[tuple[Message, ...], list[tuple[Message, ...]]]:
    """The prompt and every response of a record as given (none left out: to score them all).
    Raises BadRecord, an empty response among them included."""
    if fmt in RAW_RESPONSES:  # to score them, the responses need none of their labels
        prompt_field, lists = RAW_RESPONSES[fmt]
        prompt = _prompt(record.get(prompt_field), prompt_field)
        responses = [r for name, field in lists for r in _raw_list(record, name, field)]
    else:
        prompt, responses, _, _ = _READERS[fmt](record)
    for i, r in enumerate(responses):
        if r == EMPTY:
            raise BadRecord("empty_reply", f"response {i} is empty: nothing to score")
    return prompt, responses


def scored_by_weights(record: Mapping[str, Any], fmt: str) -> bool:
    """Whether a record's scores are the weighted sums of its ratings: a ``responses`` record rated
    only by 'attributes' (no scores or ranks), as ``_responses`` reads it."""
    return fmt == "responses" and "scores" not in record and "ranks" not in record and "attributes" in record


def stored(score: float) -> float:
    """A score as a record stores it (float32): what ties and orders are decided on."""
    return float(np.float32(score))


def read_responses(record: Mapping[str, Any], fmt: str, *, source: str, line: int, attributes: tuple[str, ...] = (),
                   weights: Mapping[str, float] | None = None) -> CanonicalResponses:
    """One raw record of multi-response layout ``fmt``, with each response's ratings ``attributes``
    (names, in order; ``weights`` score a record rated only by them); raises BadRecord (a Tie
    when every score is equal: no pair to learn from)."""
    names = tuple(attributes)
    prompt, given, given_scores, given_ratings = _READERS[fmt](record, names, weights)
    labels = list(zip(given_scores, given_ratings)) if names else [(s, ()) for s in given_scores]
    scored: dict[tuple, set] = {}
    for resp, label in zip(given, labels):
        scored.setdefault(resp, set()).add(label)
    seen: set[tuple] = set()
    responses, scores, ratings, empty, contradicted = [], [], [], 0, 0
    for resp, (score, rating) in zip(given, labels):
        if resp == EMPTY:  # nothing to score: left out, counted
            empty += 1
        elif len(scored[resp]) > 1:  # the same text labelled two ways: its labels contradict; every copy left out
            contradicted += 1
        elif resp not in seen:  # the same text twice, labelled alike: one response
            seen.add(resp)
            responses.append(resp)
            scores.append(score)
            ratings.append(rating)
    if contradicted and len(responses) < 2:
        raise BadRecord("duplicate_response", f"{len(responses)} distinct response(s) ({contradicted} left out: the same "
                        "text scored two ways): a record needs at least 2")
    if not responses:
        raise BadRecord("too_few_responses", "no response left: a record needs at least 2")
    # unranked (one response, or every score equal as the shards store them, float32): kept for its
    # ratings when they are kept (a regression head fits them), else not written (no error)
    if len(responses) < 2 and not names:
        raise Unranked("one_response", "one distinct response: nothing to rank (kept with --attributes, to fit its "
                                       "ratings)")
    if len(responses) > 1 and len(set(map(stored, scores))) == 1 and not names:
        raise Tie("all_tied", f"all {len(scores)} responses score {scores[0]:g}"
                  + ("" if len(set(scores)) == 1 else " as stored (float32)") + ": no preference to learn")
    subset = record.get("subset")
    if subset is not None and not isinstance(subset, str):
        raise BadRecord("bad_type", f"field 'subset' must be str, got {type(subset).__name__}")
    return CanonicalResponses(source, line, prompt, tuple(responses), tuple(scores), subset,
                              merged=len(given) - len(responses) - empty - contradicted, dropped=empty,
                              contradicted=contradicted, attributes=tuple(ratings) if names else (),
                              attribute_names=names, weighted=scored_by_weights(record, fmt))


def to_pairs(r: CanonicalResponses, mode: str, *, margin_from_scores: bool = False,
             min_score_gap: float = 0.0) -> list[CanonicalPair]:
    """The preference pairs of ``r``: ``expand``, every ordered pair whose scores differ by at least
    ``min_score_gap`` (and by more than 0); ``best-worst``, the best response against the worst;
    ``best-random``, the best against one of the lower-scored, picked by a hash of the record.
    Ties among the best (or the worst) go to the first. Each pair is in ``r``'s group (split
    with its prompt), with ``score_gap`` its score difference and, with ``margin_from_scores``,
    that difference as its margin. Raises BadRecord when no pair clears ``min_score_gap``."""
    s = r.scores
    if mode == "expand":
        order = [(i, j) for i in range(len(s)) for j in range(len(s))
                 if s[i] > s[j] and s[i] - s[j] >= min_score_gap]
    elif mode in ("best-worst", "best-random"):
        best = max(range(len(s)), key=lambda i: (s[i], -i))
        lower = [j for j in range(len(s)) if s[best] - s[j] >= max(min_score_gap, 1e-300) and s[j] < s[best]]
        if not lower:
            order = []
        elif mode == "best-worst":
            order = [(best, min(lower, key=lambda j: (s[j], j)))]
        else:  # picked by the record's content: the same pair wherever the file is and whatever its order
            content = jsontext.dumps([r.group, r.responses, r.scores], ensure_ascii=False).encode("utf-8")
            pick = int(hashlib.blake2b(content, digest_size=8).hexdigest(), 16)
            order = [(best, lower[pick % len(lower)])]
    else:
        raise ValueError(f"mode {mode!r}: use one of {', '.join(PAIR_MODES)}")
    if not order:
        raise BadRecord("weak_label", f"no two responses' scores differ by --min-score-gap {min_score_gap:g}")
    if margin_from_scores and any(s[i] - s[j] > MAX_MARGIN for i, j in order):
        raise BadRecord("bad_value", f"a score difference beyond {MAX_MARGIN:g} as a margin: a margin is in reward "
                        "units, where anything near this size only saturates the loss (rescale the scores)")
    return [CanonicalPair(r.source, r.line, r.prompt, r.responses[i], r.responses[j],
                          margin=s[i] - s[j] if margin_from_scores else None, subset=r.subset,
                          score_gap=s[i] - s[j], group=r.group) for i, j in order]


def spread(indices, scores, most: int) -> list[int]:
    """At most ``most`` of ``indices``: the best- and the worst-scored and the rest spread evenly over
    the ranking between them (ties in the order given), in their order."""
    ranked = sorted(indices, key=lambda i: (-scores[i], i))
    if len(ranked) <= most:
        return sorted(ranked)
    return sorted({ranked[round(j * (len(ranked) - 1) / (most - 1))] for j in range(most)})


def cap_responses(r: CanonicalResponses, most: int) -> CanonicalResponses:
    """``r`` with at most ``most`` responses: the best, the worst, and the rest spread evenly over
    the ranking between them (ties in the order given), kept in their order; the others are
    counted (``capped``)."""
    if len(r.responses) <= most:
        return r
    keep = spread(range(len(r.responses)), r.scores, most)
    k = len(r.responses)
    return dataclasses.replace(r, responses=tuple(r.responses[i] for i in keep),
                               scores=tuple(r.scores[i] for i in keep), capped=r.capped + k - len(keep),
                               attributes=tuple(r.attributes[i] for i in keep) if r.attributes else ())


# What normalize_all does with an option left out (NORMALIZE_OPTIONS)
NORMALIZE_DEFAULTS = {"margin_from_scores": False, "min_score_gap": 0.0, "drop_score_ties": False, "pairs_from": "",
                      "max_responses": 0, "attributes": ()}


def normalize_all(record: Any, fmt: str, *, source: str, line: int, options: Mapping[str, Any] | None = None,
                  weights: Mapping[str, float] | None = None
                  ) -> tuple[list[CanonicalPair | CanonicalSteps | CanonicalResponses], CanonicalResponses | None]:
    """One raw record in layout ``fmt`` to its canonical records: one (``formats.normalize``), or
    for a multi-response layout the pairs ``pairs_from`` makes of it or (``pairs_from`` empty) the
    record itself, at most ``max_responses`` of its responses (0: all), each with its ratings
    ``attributes`` (names, or the config's comma-separated text); with the responses they were
    made of (what was merged, dropped or capped). ``options``: preprocess's NORMALIZE_OPTIONS
    (each left out: its default). Raises BadRecord."""
    unknown = set(options or {}) - set(NORMALIZE_DEFAULTS)
    if unknown:
        raise TypeError(f"normalize_all: unknown options {sorted(unknown)}")
    o = {**NORMALIZE_DEFAULTS, **(options or {})}
    margin_from_scores, min_score_gap, pairs_from, max_responses = \
        o["margin_from_scores"], o["min_score_gap"], o["pairs_from"], o["max_responses"]
    attributes, drop_score_ties = o["attributes"], o["drop_score_ties"]
    names = attribute_names(attributes) if isinstance(attributes, str) else tuple(attributes)
    if fmt not in MULTI_FORMATS:
        return [normalize(record, fmt, source=source, line=line, margin_from_scores=margin_from_scores,
                          min_score_gap=min_score_gap, drop_score_ties=drop_score_ties)], None
    if not isinstance(record, Mapping):
        raise BadRecord("not_an_object", f"record is a JSON {type(record).__name__}, not an object")
    if fmt in ROW_FORMATS:  # grouped by their prompt before (group_rows): one row alone is no record
        raise BadRecord("response_row", f"layout {fmt} has one response a row; `rmflow preprocess` groups the rows "
                        "of each prompt")
    responses = read_responses(record, fmt, source=source, line=line, attributes=names, weights=weights)
    if not pairs_from:  # capped among the responses that fit the length policy (``TokenizedResponses.fit``)
        if margin_from_scores and max(responses.scores) - min(responses.scores) > MAX_MARGIN:
            raise BadRecord("bad_value", f"a score difference beyond {MAX_MARGIN:g} as a margin: a margin is in "
                            "reward units, where anything near this size only saturates the loss (rescale the scores)")
        whole = dataclasses.replace(responses, margin_from_scores=margin_from_scores, most=max_responses)
        return [whole], whole
    if max_responses:  # at most max_responses before the pairs are made (K² / 2 of them)
        responses = cap_responses(responses, max_responses)
    pairs = to_pairs(responses, pairs_from, margin_from_scores=margin_from_scores, min_score_gap=min_score_gap)
    return pairs, responses
