"""The reward server's request bodies, read and checked without any HTTP: each reader turns a
decoded JSON body into the items to score, or raises ``RequestError`` naming what is wrong (and,
for a bad item, its index). Three protocols:

* native ``POST /v1/score``: conversations (OpenAI-style messages), rendered with the model's
  own chat template, or (``responses``) records of one prompt's K responses in any
  multi-response layout, each response scored with its prompt; for a process reward model,
  solutions (prompt and steps);
* ``POST /get_reward``: OpenRLHF's remote reward model (``--remote_rm_url``): ``query`` holds
  full texts the policy already rendered; ``prompts`` and ``labels`` are accepted and ignored;
* ``POST /classify``: vLLM's pooling API as verl's reward loop calls it: ``input``, one text or
  a list, already rendered with the reward model's template.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rmflow.handlers import every, handler
from rmflow.schemas.config import SCORE_TRUNCATE
from rmflow.schemas.kinds import OUTCOME, kind_named
from rmflow.scoring.api import BadConversation, RewardModel


class RequestError(Exception):
    """A request that cannot be served as sent: HTTP ``status``, a message, the bad items."""

    def __init__(self, status: int, message: str, items: list[dict[str, Any]] | None = None, reason: str = "bad_request"):
        super().__init__(message)
        self.status, self.message, self.items, self.reason = status, message, items or [], reason

    def body(self) -> dict[str, Any]:
        return {"error": self.message, **({"items": self.items} if self.items else {})}





@dataclasses.dataclass
class Parsed:
    """A request's items, encoded for the model, and what the response needs to know."""

    encoded: list[Any]
    sizes: list[int]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)
    sequences: list[int] | None = None  # the conversations each item scores (None: one each)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _list(body: dict[str, Any], key: str, limit: int, *, also: str = "") -> list[Any]:
    if key not in body:
        raise RequestError(400, f"missing '{key}'{also}")
    value = body[key]
    if not isinstance(value, list):
        raise RequestError(400, f"'{key}' must be a list, got {type(value).__name__}")
    if not value:
        raise RequestError(400, f"'{key}' is empty: send at least one item")
    if len(value) > limit:
        raise RequestError(413, f"'{key}' has {len(value)} items, at most {limit} a request (--max-request-items); "
                                "split the request", reason="too_many_items")
    return value


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false option; absent or null: ``default`` (as vLLM reads an unset option)."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(400, f"'{key}' must be true or false, got {value!r}")
    return value


def _encode_all(items: list[Any], encode, what: str) -> list[Any]:
    """Every item encoded; all bad items named at once (nothing is scored when any is bad)."""
    out, bad = [], []
    for i, item in enumerate(items):
        try:
            out.append(encode(item))
        except BadConversation as e:
            bad.append({"index": i, "error": str(e)})
    if bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise RequestError(422, f"{what} {first['index']}: {first['error']}{more}", bad, reason="bad_item")
    return out


def _kind_check(rm: RewardModel, wanted, endpoint: str) -> None:
    if rm.kind != wanted.name:
        raise RequestError(400, f"{endpoint}: this server's model is {rm.description} ({rm.kind} reward model); "
                                f"{endpoint} serves {wanted.description}s", reason="wrong_kind")


@dataclasses.dataclass(frozen=True)
class Native:
    """A reward model kind's native request and response: the request's list key, each item's
    encoding, and the response columns (name -> the scoring field of the kind's scorer)."""

    key: str
    what: str  # one item, in error messages
    columns: dict[str, str]


# Each kind on POST /v1/score: its part of the kind's handlers (rmflow.handlers).
OUTCOME_NATIVE = Native("conversations", "conversation", {"scores": "score", "normalized_scores": "score_normalized"})
PROCESS_NATIVE = Native("solutions", "solution", {"step_scores": "step_scores", "first_errors": "first_error"})


RESPONSES_KEY = "responses"  # POST /v1/score: records of one prompt's K responses (an outcome model)


def read_native(body: Any, rm: RewardModel, max_items: int, units: bool = True) -> Parsed:
    """``{"conversations": [...], "normalized": false, "truncate": "error"}`` (an outcome model),
    ``{"responses": [{"prompt": ..., "responses": [...]}, ...]}`` (an outcome model: each record's
    responses scored with its prompt; ``units``: the prompt computed once, the record queued as
    units of ``trainer.inference.response_units``, else a conversation an item;
    ``Parsed.options["groups"]``: how many items each record is queued as)
    or ``{"solutions": [{"prompt": ..., "completions": [...]}, ...]}`` (a process model)."""
    body = _object(body)
    native = handler(rm.kind, "protocol")
    if RESPONSES_KEY in body and native.key not in body and kind_named(rm.kind).normalizable:
        return _read_responses(body, rm, native, max_items, units)
    for other in every("protocol").values():
        if other is not native and other.key in body and native.key not in body:
            raise RequestError(400, f"this is {kind_named(rm.kind).description}: send '{native.key}', not "
                                    f"'{other.key}'", reason="wrong_kind")
    items = _list(body, native.key, max_items)
    normalized, truncate = _options(body, rm)
    scorer = handler(rm.kind, "scorer")
    encoded = _encode_all(items, lambda x: scorer.encode(rm, x, truncate=truncate), native.what)
    return Parsed(encoded, [scorer.size(x) for x in encoded], {"normalized": normalized})


def _options(body: dict[str, Any], rm: RewardModel) -> tuple[bool, str]:
    """A native request's ``normalized`` and ``truncate``, checked."""
    normalized = _flag(body, "normalized", False)
    if normalized and not (rm.normalization and rm.normalization.get("std")):
        raise RequestError(400, "'normalized': this model has no reward_normalization.json (run `rmflow eval "
                                "--normalize` on it first)")
    truncate = body.get("truncate", "error")
    if truncate not in SCORE_TRUNCATE:
        raise RequestError(400, f"'truncate' must be one of {', '.join(map(repr, SCORE_TRUNCATE))}, got {truncate!r}")
    return normalized, truncate


def _read_responses(body: dict[str, Any], rm: RewardModel, native, max_items: int, units: bool) -> Parsed:
    from rmflow.scoring.scorers import responses_of
    from rmflow.trainer.inference import response_units

    records = _list(body, RESPONSES_KEY, max_items)
    normalized, truncate = _options(body, rm)
    scorer = handler(rm.kind, "scorer")

    def encode(record: Any) -> list[Any]:
        try:
            conversations = responses_of(record)
        except Exception as e:  # noqa: BLE001 - a BadRecord from the layout's reader, said as the item's error
            raise BadConversation(getattr(e, "message", str(e))) from None
        if not conversations:
            raise BadConversation("is not one prompt's K responses (a responses, rewardbench2, nectar or "
                                  "ultrafeedback-raw record)")
        return [scorer.encode(rm, c, truncate=truncate) for c in conversations]

    grouped = _encode_all(records, encode, "responses")
    responses = sum(len(g) for g in grouped)
    if responses > max_items:
        raise RequestError(413, f"'{RESPONSES_KEY}' holds {responses} responses, at most {max_items} a request "
                                "(--max-request-items counts each response); split the request", reason="too_many_items")
    # each record's prompt computed once: its responses in units of the prompt and several responses
    # (the server's --response-units); else each response alone, a conversation an item
    items = [response_units(g, rm.max_length) if units else g for g in grouped]
    encoded = [u for record in items for u in record]
    return Parsed(encoded, [scorer.size(x) for x in encoded],
                  {"normalized": normalized, "groups": [len(u) for u in items]},
                  sequences=[getattr(x, "k", 1) for x in encoded])


def _texts(values: list[Any], key: str, rm: RewardModel, *, add_special_tokens: bool) -> list[Any]:
    """Rendered conversations, each as the reward model's training data ends one (``unpadded``),
    checked (not empty, a reply, not too long: by characters before tokenizing) and tokenized."""
    def encode(text: Any):
        if not isinstance(text, str):
            raise BadConversation(f"must be a string (a rendered conversation), got {type(text).__name__}")
        text = unpadded(text, rm)
        rm.check_chars(len(text))
        if not text[: len(text) - len(rm.turn_end)].strip():
            raise BadConversation("is empty")
        marker = rm.assistant_marker
        if marker and marker in text and not text[text.rindex(marker) + len(marker): len(text) - len(rm.turn_end)
                                                  ].strip():
            raise BadConversation("ends with an empty reply (preprocessing refuses empty replies too: empty_reply)")
        ids = rm.encode_text(text, add_special_tokens=add_special_tokens)
        if len(ids) > rm.max_length:
            raise BadConversation(f"{len(ids)} tokens, more than the server's {rm.max_length} (--max-length)")
        if not len(ids):
            raise BadConversation("has no tokens")
        return ids

    return _encode_all(values, encode, key)


def unpadded(text: str, rm: RewardModel) -> str:
    """A rendered conversation as the model's training data ends one, however a policy batch
    padded it: runs of pad and eos stripped from both ends (and a trailing copy of the template's
    turn end, SmolLM2's ``<|im_end|>\\n``), then the turn end appended once. OpenRLHF's own server
    strips pad and eos runs and appends one eos; appending the template's turn end instead gives
    the text the exact ending the model was trained on, so ``t``, ``t + eos``, ``t + eos * 5``
    and ``eos * 5 + t`` get one reward."""
    tok, end = rm.tokenizer, rm.turn_end
    fillers = [x for x in dict.fromkeys((tok.pad_token, tok.eos_token)) if x]
    ends = [x for x in dict.fromkeys((end, end.strip(), *fillers)) if x]
    start, stop = 0, len(text)  # moved over the runs, the text sliced once: linear in its length
    changed = True
    while changed:
        changed = False
        for x in fillers:
            while text.startswith(x, start, stop):
                start, changed = start + len(x), True
        for x in ends:
            while stop - start >= len(x) and text.endswith(x, start, stop):
                stop, changed = stop - len(x), True
    return text[start:stop] + end


def read_get_reward(body: Any, rm: RewardModel, max_items: int) -> Parsed:
    """OpenRLHF: ``{"query": [text, ...], "prompts": [...], "labels": [...]}``; each query is
    scored as the text it is (tokenized with the reward model's tokenizer, no tokens added)."""
    body = _object(body)
    _kind_check(rm, OUTCOME, "/get_reward")
    queries = _list(body, "query", max_items, also=" (OpenRLHF sends the rendered prompt + response texts there)")
    for key in ("prompts", "labels"):
        if body.get(key) is not None and (not isinstance(body[key], list) or len(body[key]) != len(queries)):
            raise RequestError(400, f"'{key}' must be a list as long as 'query' ({len(queries)})")
    encoded = _texts(queries, "query", rm, add_special_tokens=False)
    marker = rm.assistant_marker
    missing = [i for i, q in enumerate(queries) if marker and marker not in q]
    warnings = [f"{len(missing)} of {len(queries)} queries (first: {missing[0]}) lack {marker!r}, which the reward "
                "model's chat template puts before a reply: they were rendered with another template, and their "
                "scores are not what the reward model was trained to give"] if missing else []
    return Parsed(encoded, [len(x) for x in encoded], {"template_mismatches": len(missing)}, warnings)


def read_classify(body: Any, rm: RewardModel, max_items: int) -> Parsed:
    """vLLM / verl: ``{"model": ..., "input": text or [text, ...], "activation": bool}``
    (``use_activation`` as newer vLLM names it; ``add_special_tokens`` as vLLM, default true)."""
    return _read_inputs(body, rm, max_items, "/classify", activation=True)


def read_pooling(body: Any, rm: RewardModel, max_items: int) -> Parsed:
    """vLLM's ``/pooling``: ``{"model": ..., "input": text or [text, ...]}``, the reward raw unless
    ``use_activation`` is true (a reward model's pooler applies none)."""
    return _read_inputs(body, rm, max_items, "/pooling", activation=False)


def read_embeddings(body: Any, rm: RewardModel, max_items: int) -> Parsed:
    """SGLang's ``/v1/embeddings``, as verl's reward loop sends it for a reward model:
    ``{"model": ..., "input": text or [text, ...]}``; the reward comes back raw, as the
    embedding's last (only) element."""
    return _read_inputs(body, rm, max_items, "/v1/embeddings", activation=False)


def _read_inputs(body: Any, rm: RewardModel, max_items: int, endpoint: str, *, activation: bool) -> Parsed:
    """The rendered conversations of a vLLM- or SGLang-style request (``input``), and whether the
    reward goes through the sigmoid (``use_activation`` / ``activation``, default ``activation``)."""
    body = _object(body)
    _kind_check(rm, OUTCOME, endpoint)
    if "input" not in body:
        raise RequestError(400, "missing 'input' (a rendered conversation, or a list of them)")
    single = isinstance(body["input"], str)
    inputs = [body["input"]] if single else _list(body, "input", max_items)
    if inputs and not all(isinstance(x, str) for x in inputs):
        raise RequestError(400, f"{endpoint}: 'input' must be rendered text (a string or a list of strings); send "
                                "conversations as messages to /v1/score")
    activation = _flag(body, "use_activation", _flag(body, "activation", activation))
    encoded = _texts(inputs, "input", rm, add_special_tokens=_flag(body, "add_special_tokens", True))
    return Parsed(encoded, [len(x) for x in encoded], {"activation": activation})
