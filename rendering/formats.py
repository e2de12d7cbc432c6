"""Format adapters: one raw record (a dict from JSONL or Parquet) to one canonical pair, or, for
the stepwise layouts of process reward models, one canonical stepwise solution.

Pure functions, no Beam. Each adapter raises ``BadRecord`` (or its subclass ``Tie``) with
a short machine-readable ``code`` and a message that says what is wrong with the record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from rmflow.schemas import jsontext
from rmflow.schemas.config import FORMATS, MULTI_FORMATS, STEP_FORMATS

Message = tuple[str, ...]  # (role, content), or (role, content, tool calls as canonical JSON)
ROLES = ("system", "user", "assistant", "tool")
MAX_SUBSET_CHARS = 1000  # a label, not text (the record codec holds at most 64 KiB)
MAX_MARGIN = 1000.0  # a margin is in reward (logit) units; past this it only saturates the loss


class BadRecord(Exception):
    """The record cannot become a training pair. ``code`` names the kind of problem."""

    category = "error"

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Tie(BadRecord):
    """Chosen and rejected are identical (or, dropped on request, scored alike): the pair carries
    no preference signal."""

    category = "tie"

    def __init__(self, code: str = "tie",
                 message: str = "chosen and rejected are identical (a tie: no preference signal)"):
        super().__init__(code, message)


class Unranked(BadRecord):
    """A prompt with one response (a row layout's prompt with one row, say): nothing to rank, and
    no error; kept when its attribute ratings are (they fit a regression head as they are)."""

    category = "unranked"


class WeakLabel(BadRecord):
    """The chosen reply's score is above the rejected one's by less than --min-score-gap."""

    category = "weak_label"


class Duplicate(BadRecord):
    """An exact copy of a pair seen earlier (dropped only when dedup is on)."""

    category = "duplicate"


@dataclasses.dataclass(frozen=True)
class CanonicalPair:
    """A preference pair in one layout, whatever the input looked like.

    Text pairs carry messages; pre-tokenized pairs carry ids (and no messages).
    """

    source: str
    line: int
    prompt: tuple[Message, ...] = ()
    chosen: tuple[Message, ...] = ()
    rejected: tuple[Message, ...] = ()
    margin: float | None = None
    subset: str | None = None
    chosen_ids: tuple[int, ...] | None = None
    rejected_ids: tuple[int, ...] | None = None
    prompt_len: int | None = None
    score_gap: float | None = None  # score_chosen - score_rejected, for layouts that carry scores
    group: str | None = None  # the prompt's hash, for pairs made from one multi-response record
    raw: str = dataclasses.field(default="", compare=False, repr=False)  # for the errors file

    @property
    def is_tokenized(self) -> bool:
        return self.chosen_ids is not None

    @property
    def reply_texts(self) -> tuple[str, ...]:
        """The text of each reply (its messages' text, a line each): what decontamination and
        near-duplicate detection compare beside the prompt. A tokenized pair has none to give."""
        return ("\n".join(m[1] for m in self.chosen), "\n".join(m[1] for m in self.rejected))

    @property
    def split_key(self) -> str:
        """What decides the pair's split: its content, or with the other pairs of its prompt's
        responses (``group``), so that no prompt is in both splits."""
        return self.group or self.pair_id

    @property
    def pair_id(self) -> str:
        """Stable 128-bit content hash: equal for exact duplicate pairs, whatever their source."""
        if self.is_tokenized:
            content: Any = ["ids", self.chosen_ids, self.rejected_ids, self.prompt_len]
        else:
            content = ["msgs", self.prompt, self.chosen, self.rejected]
        blob = jsontext.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return hashlib.blake2b(blob, digest_size=16).hexdigest()


@dataclasses.dataclass(frozen=True)
class CanonicalSteps:
    """A stepwise solution (process supervision): the prompt, the steps, one label per step
    (True: the step is correct)."""

    source: str
    line: int
    prompt: tuple[Message, ...]
    steps: tuple[str, ...]
    labels: tuple[bool, ...]
    subset: str | None = None
    raw: str = dataclasses.field(default="", compare=False, repr=False)
    margin = None  # a pair's field, absent here
    is_tokenized = False

    @property
    def reply_texts(self) -> tuple[str, ...]:
        """The solution as one reply: its steps, a line each."""
        return ("\n".join(self.steps),)

    @property
    def split_key(self) -> str:
        return self.pair_id

    @property
    def pair_id(self) -> str:
        """Stable 128-bit content hash (the name is the pairs': dedup and the split key on it)."""
        blob = jsontext.dumps(["steps", self.prompt, self.steps, self.labels], ensure_ascii=False,
                          separators=(",", ":")).encode("utf-8")
        return hashlib.blake2b(blob, digest_size=16).hexdigest()


# --------------------------------------------------------------------------- detection


def parse_json_object(raw: str) -> dict[str, Any]:
    try:
        obj = jsontext.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRecord("bad_json", f"malformed JSON: {e}") from e
    except jsontext.NotJsonText as e:
        raise BadRecord("bad_text", str(e)) from e
    except RecursionError as e:  # thousands of nested brackets: no preference record looks like this
        raise BadRecord("too_deeply_nested", "JSON nested deeper than the parser's recursion limit") from e
    if not isinstance(obj, dict):
        raise BadRecord("not_an_object", f"record is a JSON {type(obj).__name__}, not an object")
    return obj



def _looks_like_transcript(value: Any) -> bool:
    """A string holding a Human/Assistant conversation (HH-RLHF), not one reply."""
    return isinstance(value, str) and bool(_HH_TURN.search(value)) and "Assistant:" in value


# Each layout's signature: a record fits a layout when its predicate holds. Detection takes the one
# layout that fits, and refuses a record that fits none or several (never a silent guess).
_SIGNATURES: dict[str, Callable[[Mapping[str, Any], set[str]], bool]] = {
    "stepwise": lambda r, k: {"completions", "labels"} <= k,
    "processbench": lambda r, k: {"problem", "steps", "label"} <= k,
    "tokenized": lambda r, k: {"chosen_ids", "rejected_ids"} <= k or {"input_ids_chosen", "input_ids_rejected"} <= k,
    "ultrafeedback": lambda r, k: {"chosen", "rejected", "score_chosen", "score_rejected"} <= k,
    "conversational": lambda r, k: {"prompt", "chosen", "rejected"} <= k and isinstance(r["prompt"], (list, tuple))
    and not {"score_chosen", "score_rejected"} <= k,
    "text": lambda r, k: {"prompt", "chosen", "rejected"} <= k and isinstance(r["prompt"], str)
    and not _rewardbench2(r, k) and not {"score_chosen", "score_rejected"} <= k,
    # K responses per prompt (rendering.responses)
    "responses": lambda r, k: "responses" in k and bool({"scores", "ranks", "attributes"} & k),
    "rewardbench2": lambda r, k: _rewardbench2(r, k),
    "nectar": lambda r, k: {"prompt", "answers"} <= k,
    "ultrafeedback-raw": lambda r, k: {"instruction", "completions"} <= k and isinstance(r["completions"], list)
    and all(isinstance(c, Mapping) for c in r["completions"]),
    "helpsteer": lambda r, k: {"prompt", "response", "helpfulness"} <= k and not {"chosen", "rejected"} & k,
    "axolotl": lambda r, k: {"input", "chosen", "rejected"} <= k,
    "implicit": lambda r, k: {"chosen", "rejected"} <= k and not {"prompt", "input"} & k
    and isinstance(r["chosen"], (list, tuple)) and not {"score_chosen", "score_rejected"} <= k,
    "hh-rlhf": lambda r, k: {"chosen", "rejected"} <= k and not {"input"} & k and _looks_like_transcript(r["chosen"]),
}
assert set(_SIGNATURES) == set(FORMATS)


def _strings(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(x, str) for x in value)


def _rewardbench2(r: Mapping[str, Any], k: set[str]) -> bool:
    return {"prompt", "chosen", "rejected"} <= k and isinstance(r["prompt"], str) and _strings(r["chosen"]) \
        and _strings(r["rejected"])


def candidate_formats(record: Mapping[str, Any]) -> list[str]:
    """Every layout whose signature the record fits, in FORMATS order."""
    keys = set(record)
    return [fmt for fmt in FORMATS if _SIGNATURES[fmt](record, keys)]


# layouts whose records carry scores: score_chosen / score_rejected, or K scored responses
SCORED_LAYOUTS = ("ultrafeedback", *MULTI_FORMATS)


def detect_format(record: Mapping[str, Any]) -> str:
    """The layout of one record, from its keys and value types. Raises BadRecord when none fits
    (``unknown_layout``) or when more than one does (``ambiguous_layout``: pass --format)."""
    found = candidate_formats(record)
    if len(found) == 1:
        return found[0]
    keys = sorted(record)
    if found:
        hint = ""
        if "hh-rlhf" in found and "text" in found:
            hint = ("; 'chosen' holds a whole Human/Assistant transcript beside a 'prompt' string: --format hh-rlhf "
                    "reads the transcripts (the prompt column is then ignored), --format text takes each "
                    "transcript as one reply")
        raise BadRecord(
            "ambiguous_layout",
            f"keys {keys} fit several layouts ({', '.join(found)}); name one with --format{hint}",
        )
    if not ({"chosen", "rejected"} <= set(keys)):
        raise BadRecord(
            "unknown_layout",
            f"no known layout has keys {keys}: every layout needs 'chosen' and "
            "'rejected' (or 'chosen_ids' and 'rejected_ids'; stepwise data: 'prompt', 'completions', 'labels')",
        )
    raise BadRecord(
        "unknown_layout",
        "'chosen' and 'rejected' without 'prompt' must be message lists (implicit prompt) "
        "or HH-RLHF transcripts with '\\n\\nHuman:' / '\\n\\nAssistant:' turns",
    )


# --------------------------------------------------------------------------- helpers


def _field(record: Mapping[str, Any], name: str, *types: type) -> Any:
    if name not in record:
        raise BadRecord("missing_field", f"missing field '{name}'")
    value = record[name]
    if not isinstance(value, types) or isinstance(value, bool):
        expected = " or ".join(t.__name__ for t in types)
        raise BadRecord(
            "bad_type", f"field '{name}' must be {expected}, got {type(value).__name__}"
        )
    return value


def _valid_text(text: str, name: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON "\ud800": a lone surrogate is not text
        raise BadRecord("bad_text", f"{name} is not valid Unicode: {e.reason} at character {e.start}") from e
    return text


def _text(value: Any, name: str) -> str:
    if isinstance(value, str):
        return _valid_text(value, name)
    # Multimodal-style content: [{"type": "text", "text": "..."}]
    if isinstance(value, (list, tuple)):
        for i, p in enumerate(value):
            if not (isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                part_type = p.get("type") if isinstance(p, Mapping) else type(p).__name__
                raise BadRecord("bad_type", f"{name} content part {i} is {part_type!r}: content is a string or a list of "
                                "text parts ({'type': 'text', 'text': ...}); a reward model here reads text only")
        return _valid_text("".join(p["text"] for p in value), name)
    raise BadRecord("bad_type", f"{name} content must be a string or a list of text parts, got {type(value).__name__}")


def read_messages(value: Any, name: str) -> tuple[Message, ...]:
    """A message list read as every layout reads one (roles, text parts, tool calls); raises BadRecord."""
    return _messages(value, name)


def _messages(value: Any, name: str) -> tuple[Message, ...]:
    if isinstance(value, Mapping):  # a single message where a list was expected
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise BadRecord("bad_type", f"field '{name}' must be a list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise BadRecord("bad_message", f"{name}[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise BadRecord("bad_role", f"{name}[{i}] has role {role!r}; expected one of {ROLES}")
        calls = m.get("tool_calls")
        if calls:  # an assistant's tool calls are part of what it said: kept, rendered by the template
            if role != "assistant" or not isinstance(calls, (list, tuple)):
                raise BadRecord("bad_message", f"{name}[{i}]: 'tool_calls' is a list, on assistant messages")
            content = m.get("content") or ""
            try:
                dumped = jsontext.dumps(list(calls), ensure_ascii=False, sort_keys=True, separators=(",", ":"))
            except (TypeError, ValueError, RecursionError) as e:
                raise BadRecord("bad_message", f"{name}[{i}]: 'tool_calls' is not JSON: {e}") from e
            out.append((role, _text(content, f"{name}[{i}]"), _valid_text(dumped, f"{name}[{i}].tool_calls")))
            continue
        if "content" not in m or m["content"] is None:
            raise BadRecord("bad_message", f"{name}[{i}] has no 'content'")
        out.append((role, _text(m["content"], f"{name}[{i}]")))
    return tuple(out)


def _reply(value: Any, name: str) -> tuple[Message, ...]:
    """A reply: assistant messages, or a plain string (one assistant message)."""
    if isinstance(value, str):
        return _check_reply((("assistant", _valid_text(value, f"'{name}'")),), name)
    return _check_reply(_messages(value, name), name)


def is_empty_reply(message: Message) -> bool:
    """A reply with no text and no tool calls: nothing to score or to learn from."""
    return not message[1].strip() and len(message) < 3


def check_reply(msgs: tuple[Message, ...], name: str) -> tuple[Message, ...]:
    """The one rule for a reply a reward model learns or scores (a pair's chosen and rejected, each
    of K responses: preprocess, eval, score, serve and the API alike): assistant messages first
    (tool results may come between), ending with a non-empty assistant message, at whose end the
    reward is read."""
    if not msgs:
        raise BadRecord("empty_reply", f"'{name}' has no messages")
    if msgs[0][0] != "assistant":
        raise BadRecord("bad_role", f"'{name}' must start with an assistant message, got {msgs[0][0]!r}")
    check_reply_end(msgs, name)
    return msgs


def check_reply_end(msgs: tuple[Message, ...], name: str) -> None:
    """A conversation to score ends with the assistant's non-empty reply (``check_reply``)."""
    if msgs[-1][0] != "assistant":
        raise BadRecord("bad_role", f"'{name}' ends with a {msgs[-1][0]} message; the reward is read at the end of "
                                    "the assistant's reply: end it with the assistant message to score")
    if is_empty_reply(msgs[-1]):
        raise BadRecord("empty_reply", f"'{name}' ends with an empty reply")


def check_prompt(msgs: tuple[Message, ...], name: str) -> tuple[Message, ...]:
    """The one rule for a prompt (what the reply answers): messages, one of them the user's."""
    if not msgs:
        raise BadRecord("empty_prompt", f"'{name}' has no messages")
    if not any(m[0] == "user" for m in msgs):
        raise BadRecord("bad_role", f"'{name}' has no user message: a reply answers a user's turn")
    return msgs


_check_reply = check_reply


def _split_common_prefix(chosen, rejected) -> tuple[tuple, tuple, tuple]:
    """Implicit prompt: the longest common message prefix of two conversations."""
    if chosen == rejected:
        raise Tie()
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    prompt, c, r = chosen[:k], chosen[k:], rejected[k:]
    if not prompt:
        raise BadRecord("no_common_prompt", "chosen and rejected share no leading messages: no prompt to compare on")
    check_prompt(prompt, "prompt (the messages chosen and rejected share)")
    if not c or not r:
        raise BadRecord(
            "no_reply", "one conversation is a prefix of the other: there is no reply to compare"
        )
    if c[0][0] != "assistant" or r[0][0] != "assistant":
        raise BadRecord(
            "diverge_before_reply",
            "chosen and rejected diverge at a non-assistant turn: they do not share one prompt",
        )
    return prompt, _check_reply(c, "chosen"), _check_reply(r, "rejected")


def _nonempty(text: str, name: str, code: str) -> str:
    if not text.strip():
        raise BadRecord(code, f"'{name}' is empty")
    return _valid_text(text, f"'{name}'")


# --------------------------------------------------------------------------- adapters


def _text_format(r):
    prompt = _nonempty(_field(r, "prompt", str), "prompt", "empty_prompt")
    chosen = _nonempty(_field(r, "chosen", str), "chosen", "empty_reply")
    rejected = _nonempty(_field(r, "rejected", str), "rejected", "empty_reply")
    return (("user", prompt),), (("assistant", chosen),), (("assistant", rejected),)


def _conversational(r):
    prompt = check_prompt(_messages(_field(r, "prompt", list, tuple), "prompt"), "prompt")
    return prompt, _reply(_field(r, "chosen", list, tuple, str, dict), "chosen"), _reply(
        _field(r, "rejected", list, tuple, str, dict), "rejected"
    )


def _implicit(r):
    chosen = _messages(_field(r, "chosen", list, tuple), "chosen")
    rejected = _messages(_field(r, "rejected", list, tuple), "rejected")
    return _split_common_prefix(chosen, rejected)


_HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):[ \t]?")


def parse_hh_transcript(text: str, name: str) -> tuple[Message, ...]:
    """'\\n\\nHuman: a\\n\\nAssistant: b' -> (('user', 'a'), ('assistant', 'b'))."""
    marks = list(_HH_TURN.finditer(text))
    if not marks:
        raise BadRecord("bad_transcript", f"'{name}' has no '\\n\\nHuman:' or '\\n\\nAssistant:' turns")
    if text[: marks[0].start()].strip():
        raise BadRecord("bad_transcript", f"'{name}' has text before its first turn marker")
    msgs = []
    for m, nxt in zip(marks, marks[1:] + [None]):
        content = text[m.end() : nxt.start() if nxt else len(text)]
        msgs.append(("user" if m.group(1) == "Human" else "assistant", content.strip()))
    return tuple(msgs)


def _hh(r):
    chosen = parse_hh_transcript(_valid_text(_field(r, "chosen", str), "'chosen'"), "chosen")
    rejected = parse_hh_transcript(_valid_text(_field(r, "rejected", str), "'rejected'"), "rejected")
    for name, conv in (("chosen", chosen), ("rejected", rejected)):
        if conv[-1][0] != "assistant":
            raise BadRecord("bad_transcript", f"'{name}' does not end with an Assistant turn")
    return _split_common_prefix(chosen, rejected)


def _axolotl(r):
    prompt: tuple[Message, ...] = ()
    system = r.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise BadRecord("bad_type", f"field 'system' must be str, got {type(system).__name__}")
        _valid_text(system, "'system'")
        if system.strip():
            prompt = (("system", system),)
    user = _nonempty(_field(r, "input", str), "input", "empty_prompt")
    chosen = _nonempty(_field(r, "chosen", str), "chosen", "empty_reply")
    rejected = _nonempty(_field(r, "rejected", str), "rejected", "empty_reply")
    return prompt + (("user", user),), (("assistant", chosen),), (("assistant", rejected),)


_ADAPTERS: dict[str, Callable] = {
    "text": _text_format,
    "conversational": _conversational,
    "implicit": _implicit,
    "hh-rlhf": _hh,
    "axolotl": _axolotl,
    "ultrafeedback": _implicit,
}
assert set(_ADAPTERS) | {"tokenized"} | set(STEP_FORMATS) | set(MULTI_FORMATS) == set(FORMATS)


def _steps_list(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise BadRecord("bad_type", f"field '{name}' must be a list of step strings, got {type(value).__name__}")
    if not value:
        raise BadRecord("no_steps", f"'{name}' has no steps")
    steps = []
    for i, step in enumerate(value):
        if not isinstance(step, str):
            raise BadRecord("bad_type", f"{name}[{i}] must be a string, got {type(step).__name__}")
        steps.append(_nonempty(step, f"{name}[{i}]", "empty_step"))
    return tuple(steps)


def _step_prompt(value: Any, name: str) -> tuple[Message, ...]:
    if isinstance(value, str):
        return (("user", _nonempty(value, name, "empty_prompt")),)
    prompt = _messages(value, name)
    if not prompt:
        raise BadRecord("empty_prompt", f"'{name}' has no messages")
    return prompt


def _stepwise(r: Mapping[str, Any], source: str, line: int, subset: str | None) -> CanonicalSteps:
    """TRL's ``stepwise_supervised`` layout (Axolotl's too): prompt, completions, labels."""
    prompt = _step_prompt(_field(r, "prompt", str, list, tuple), "prompt")
    steps = _steps_list(_field(r, "completions", list, tuple), "completions")
    labels = _field(r, "labels", list, tuple)
    if len(labels) != len(steps):
        raise BadRecord("label_count", f"{len(steps)} completions but {len(labels)} labels: one label per step")
    out = []
    for i, label in enumerate(labels):
        if isinstance(label, bool) or (isinstance(label, int) and label in (0, 1)):
            out.append(bool(label))
        else:
            raise BadRecord("bad_label", f"labels[{i}] is {label!r}: a label is true (correct step) or false")
    return CanonicalSteps(source, line, prompt, steps, tuple(out), subset)


def solution_to_score(record: Any) -> CanonicalSteps:
    """A solution to score with a process reward model: ``prompt`` (a string or messages) and its
    steps (``completions`` as in the stepwise layout, or ``steps``); labels, if any, are ignored.
    Raises BadRecord."""
    if not isinstance(record, Mapping) or "messages" in record and "prompt" not in record:
        raise BadRecord("not_a_solution", "a process reward model scores the steps of a solution, an object with "
                        "'prompt' and 'completions' (the steps); this is a conversation, which an outcome reward "
                        "model scores")
    prompt = _step_prompt(_field(record, "prompt", str, list, tuple), "prompt")
    name = "completions" if "completions" in record or "steps" not in record else "steps"
    return CanonicalSteps("", 0, prompt, _steps_list(_field(record, name, list, tuple), name), ())


def _processbench(r: Mapping[str, Any], source: str, line: int, subset: str | None) -> CanonicalSteps:
    """ProcessBench: problem, steps, label = the index of the earliest wrong step (-1: none). The
    steps after the first wrong one carry no label, so the record keeps the steps up to it:
    whether a model finds the first wrong step is decided by those steps alone."""
    prompt = (("user", _nonempty(_field(r, "problem", str), "problem", "empty_prompt")),)
    steps = _steps_list(_field(r, "steps", list, tuple), "steps")
    label = _field(r, "label", int)
    if not -1 <= label < len(steps):
        raise BadRecord("bad_label", f"label {label} is not -1 or the index of one of the {len(steps)} steps")
    if label == -1:
        return CanonicalSteps(source, line, prompt, steps, (True,) * len(steps), subset)
    return CanonicalSteps(source, line, prompt, steps[: label + 1], (True,) * label + (False,), subset)


def _number(r: Mapping[str, Any], name: str) -> float:
    value = _field(r, name, int, float)
    if not math.isfinite(value):
        raise BadRecord("bad_value", f"field '{name}' must be finite, got {value}")
    return float(value)


def _token_ids(r: Mapping[str, Any], names: tuple[str, ...]) -> tuple[int, ...]:
    name = next((n for n in names if n in r), names[0])
    ids = _field(r, name, list, tuple)
    if not ids:
        raise BadRecord("empty_reply", f"'{name}' is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids):
        raise BadRecord("bad_value", f"'{name}' must hold non-negative integer token ids below 2**31")
    return tuple(ids)


def _tokenized(r, source, line, margin, subset) -> CanonicalPair:
    chosen = _token_ids(r, ("chosen_ids", "input_ids_chosen"))
    rejected = _token_ids(r, ("rejected_ids", "input_ids_rejected"))
    if chosen == rejected:
        raise Tie()
    prompt_len = None
    for key in ("prompt_len", "prompt_length"):
        if r.get(key) is not None:
            prompt_len = int(_number(r, key))
            if not 0 <= prompt_len < min(len(chosen), len(rejected)) or chosen[:prompt_len] != rejected[:prompt_len]:
                raise BadRecord("bad_value", f"'{key}' {prompt_len} is not a prefix shared by both sequences")
    if prompt_len is None:
        prompt_len = 0
        while prompt_len < min(len(chosen), len(rejected)) and chosen[prompt_len] == rejected[prompt_len]:
            prompt_len += 1
        prompt_len = min(prompt_len, min(len(chosen), len(rejected)) - 1)
    return CanonicalPair(source, line, margin=margin, subset=subset, chosen_ids=chosen,
                         rejected_ids=rejected, prompt_len=prompt_len)


def normalize(
    record: Any, fmt: str, *, source: str, line: int, margin_from_scores: bool = False,
    min_score_gap: float = 0.0, drop_score_ties: bool = False,
) -> CanonicalPair | CanonicalSteps:
    """One raw record in layout ``fmt`` to a CanonicalPair (a CanonicalSteps for the stepwise
    layouts); raises BadRecord, Tie or WeakLabel. A layout with scores (``score_chosen``,
    ``score_rejected``): equal scores are a tie (dropped with ``drop_score_ties``, else kept with
    ``score_gap`` 0), a gap under ``min_score_gap`` a weak label."""
    if not isinstance(record, Mapping):
        raise BadRecord("not_an_object", f"record is a JSON {type(record).__name__}, not an object")
    if fmt in MULTI_FORMATS:  # K responses: rendering.responses.normalize_all makes its pairs
        raise BadRecord("multi_response", f"layout {fmt} holds K responses per prompt, not one pair")
    margin = score_gap = None
    if record.get("margin") is not None:
        margin = _number(record, "margin")
    if fmt == "ultrafeedback":
        sc, sr = _number(record, "score_chosen"), _number(record, "score_rejected")
        if sc < sr:
            raise BadRecord("scores_contradict", f"score_chosen {sc} < score_rejected {sr}: the labels contradict the scores")
        if sc == sr and (drop_score_ties or min_score_gap > 0):
            raise Tie("score_tie", f"score_chosen = score_rejected = {sc:g} (dropped: "
                      f"{'--drop-score-ties' if drop_score_ties else '--min-score-gap'})")
        if sc - sr < min_score_gap:
            raise WeakLabel("score_gap", f"score_chosen {sc:g} - score_rejected {sr:g} = {sc - sr:g} is under "
                            f"--min-score-gap {min_score_gap:g}")
        score_gap = sc - sr
        if margin is None and margin_from_scores:
            margin = sc - sr
    subset = record.get("subset")
    if subset is not None and not isinstance(subset, str):
        raise BadRecord("bad_type", f"field 'subset' must be str, got {type(subset).__name__}")
    if subset is not None and len(subset) > MAX_SUBSET_CHARS:
        raise BadRecord("bad_value", f"field 'subset' has {len(subset):,} characters; a subset name has at most "
                        f"{MAX_SUBSET_CHARS:,}")
    if margin is not None and abs(margin) > MAX_MARGIN:
        raise BadRecord("bad_value", f"margin {margin:g} is beyond +-{MAX_MARGIN:g}: a margin is in reward units, "
                        "subtracted from the reward difference inside a log-sigmoid, where anything near this "
                        "size only saturates the loss (rescale the column)")
    if fmt in STEP_FORMATS:
        return (_stepwise if fmt == "stepwise" else _processbench)(record, source, line, subset)
    if fmt == "tokenized":
        return _tokenized(record, source, line, margin, subset)
    prompt, chosen, rejected = _ADAPTERS[fmt](record)
    if chosen == rejected:
        raise Tie()
    return CanonicalPair(source, line, prompt, chosen, rejected, margin, subset, score_gap=score_gap)
