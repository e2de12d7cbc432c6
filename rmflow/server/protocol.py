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
from collections.abc import Callable
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


def _encode_all(items: list[Any], encode, what: str, check=None) -> list[Any]:
    """Every item encoded; nothing is scored when any is bad. With ``check`` (what encoding checks
    before it tokenizes), every item is checked first and all bad items named at once, so that a
    request with a bad item is refused before any item is tokenized; encoding then stops at the
    first item it refuses (too many tokens: a request of many over-long items costs one
    tokenization, not one an item)."""
    out, bad = [], []
    for i, item in enumerate(items if check else ()):
        try:
            check(item)
        except BadConversation as e:
            bad.append({"index": i, "error": str(e)})
    for i, item in enumerate(items if not bad else ()):
        try:
            out.append(encode(item))
        except BadConversation as e:
            bad.append({"index": i, "error": str(e)})
            break
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
    # (model, item, truncate) -> what encoding checks before it tokenizes, alone; None: encoding only
    check: Callable[..., Any] | None = None


# Each kind on POST /v1/score: its part of the kind's handlers (rmflow.handlers).
OUTCOME_NATIVE = Native("conversations", "conversation", {"scores": "score", "normalized_scores": "score_normalized"},
                        RewardModel.check)
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
    sent = [key for key in dict.fromkeys((native.key, RESPONSES_KEY, *(p.key for p in every("protocol").values())))
            if key in body]
    if len(sent) > 1:
        raise RequestError(400, f"send one of {', '.join(repr(k) for k in sent)}, not several: one request scores one "
                                "kind of item")
    if RESPONSES_KEY in body and kind_named(rm.kind).head.per_conversation:
        return _read_responses(body, rm, native, max_items, units)
    for other in every("protocol").values():
        if other is not native and other.key in body and native.key not in body:
            raise RequestError(400, f"this is {kind_named(rm.kind).description}: send '{native.key}', not "
                                    f"'{other.key}'", reason="wrong_kind")
    items = _list(body, native.key, max_items)
    normalized, truncate = _options(body, rm)
    scorer = handler(rm.kind, "scorer")
    check = (lambda x: native.check(rm, x, truncate=truncate)) if native.check else None
    encoded = _encode_all(items, lambda x: scorer.encode(rm, x, truncate=truncate), native.what, check)
    return Parsed(encoded, [scorer.size(x) for x in encoded], {"normalized": normalized})


def _options(body: dict[str, Any], rm: RewardModel) -> tuple[bool, str]:
    """A native request's ``normalized`` and ``truncate``, checked."""
    normalized = _flag(body, "normalized", False)
    if normalized and not (rm.normalization and rm.normalization.get("std")):
        raise RequestError(400, "'normalized': this model has no reward_normalization.json (run `rmflow eval "
                                "--normalize` on it first)")
    truncate = body.get("truncate") or "error"  # absent or null: unset, as every option
    if truncate not in SCORE_TRUNCATE:
        raise RequestError(400, f"'truncate' must be one of {', '.join(map(repr, SCORE_TRUNCATE))}, got {truncate!r}")
    return normalized, truncate


def _read_responses(body: dict[str, Any], rm: RewardModel, native, max_items: int, units: bool) -> Parsed:
    from rmflow.scoring.scorers import response_count, responses_of
    from rmflow.trainer.inference import response_units

    records = _list(body, RESPONSES_KEY, max_items)
    normalized, truncate = _options(body, rm)
    scorer = handler(rm.kind, "scorer")
    responses = sum(response_count(r) for r in records)  # counted before any is rendered or tokenized
    if responses > max_items:
        raise RequestError(413, f"'{RESPONSES_KEY}' holds {responses} responses, at most {max_items} a request "
                                "(--max-request-items counts each response); split the request", reason="too_many_items")

    def conversations_of(record: Any) -> list:
        try:
            conversations = responses_of(record)
        except Exception as e:  # noqa: BLE001 - a BadRecord from the layout's reader, said as the item's error
            raise BadConversation(getattr(e, "message", str(e))) from None
        if not conversations:
            raise BadConversation("is not one prompt's K responses (a responses, rewardbench2, nectar or "
                                  "ultrafeedback-raw record)")
        return conversations

    def check(record: Any) -> None:  # every record checked before any is tokenized
        for c in conversations_of(record):
            native.check(rm, c, truncate=truncate)

    def encode(record: Any) -> list[Any]:
        return [scorer.encode(rm, c, truncate=truncate) for c in conversations_of(record)]

    grouped = _encode_all(records, encode, "responses", check)
    # each record's prompt computed once: its responses in units of the prompt and several responses
    # (the server's --response-units); else each response alone, a conversation an item
    items = [response_units(g, rm.max_length) if units else g for g in grouped]
    encoded = [u for record in items for u in record]
    return Parsed(encoded, [scorer.size(x) for x in encoded],
                  {"normalized": normalized, "groups": [len(u) for u in items]},
                  sequences=[getattr(x, "k", 1) for x in encoded])


def _texts(values: list[Any], key: str, rm: RewardModel, *, add_special_tokens: bool,
           keep_last: int | None = None, too_long: str = "") -> list[Any]:
    """Rendered conversations, each as the reward model's training data ends one (``unpadded``),
    checked (not empty, a reply) and tokenized; longer than the server's length, refused (``too_long``
    says how the endpoint's origin would have it cut), or with ``keep_last`` cut to its last
    ``keep_last`` tokens (the reply's end, where the reward is read), the text bounded by
    characters before it is tokenized either way."""
    def check(text: Any) -> str:  # every text checked before any is tokenized (``_encode_all``): cheap, linear
        if not isinstance(text, str):
            raise BadConversation(f"must be a string (a rendered conversation), got {type(text).__name__}")
        text = unpadded(text, rm)
        if not text[: len(text) - len(rm.turn_end)].strip():
            raise BadConversation("is empty")
        marker, user = rm.assistant_marker, rm.user_marker
        if marker and marker in text and not text[text.rindex(marker) + len(marker): len(text) - len(rm.turn_end)
                                                  ].strip():
            raise BadConversation("ends with an empty reply (preprocessing refuses empty replies too: empty_reply)")
        if marker and user and marker in text and text.rfind(user) > text.rindex(marker):
            raise BadConversation(f"ends with a user turn ({user!r} after the last {marker!r}): a reward model scores "
                                  "an assistant reply, as preprocessing and /v1/score require")
        if keep_last is not None:  # its last tokens lie within its last characters, cut at a word's start
            from rmflow.rendering.tokenize import left_cut

            cut = left_cut(text, rm.chars_for(keep_last))
            if cut is None:
                raise BadConversation(f"{len(text):,} characters without a space to cut them at: cutting it would "
                                      "change the tokens it ends with")
            text = cut  # at most twice the characters its tokens could fill: bounded
        else:
            rm.check_chars(len(text))
        return text

    def encode(text: Any):
        ids = rm.encode_text(check(text), add_special_tokens=add_special_tokens)
        if keep_last is not None:
            ids = ids[-keep_last:]
        if len(ids) > rm.max_length:
            raise BadConversation(f"{len(ids)} tokens, more than the server's {rm.max_length} (--max-length)"
                                  + (f"; {too_long}" if too_long else ""))
        if not len(ids):
            raise BadConversation("has no tokens")
        return ids

    return _encode_all(values, encode, key, check)


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
    # as OpenRLHF's own server, a query longer than the server's length is cut, never refused: the
    # reward is read at its end, so its earliest tokens go
    encoded = _texts(queries, "query", rm, add_special_tokens=False, keep_last=rm.max_length)
    missing, warnings = _template_mismatches(queries, "queries", rm)
    return Parsed(encoded, [len(x) for x in encoded], {"template_mismatches": missing}, warnings)


def _template_mismatches(texts: list[str], what: str, rm: RewardModel) -> tuple[int, list[str]]:
    """(how many, the warning): rendered texts without the assistant marker of the reward model's
    chat template, made with another template (or holding no reply), whose scores are not what
    the model was trained to give: scored, and said, on every rendered-text endpoint."""
    marker = rm.assistant_marker
    missing = [i for i, q in enumerate(texts) if marker and marker not in q]
    return len(missing), [f"{len(missing)} of {len(texts)} {what} (first: {missing[0]}) lack {marker!r}, which the "
                          "reward model's chat template puts before a reply: they were rendered with another "
                          "template, or hold no reply, and their scores are not what the reward model was trained "
                          "to give"] if missing else []


def read_classify(body: Any, rm: RewardModel, max_items: int) -> Parsed:
    """vLLM / verl: ``{"model": ..., "input": text or [text, ...], "activation": bool}``
    (``use_activation`` as newer vLLM names it; ``add_special_tokens`` as vLLM, default true;
    ``truncate_prompt_tokens`` as vLLM: an input longer than the server's length is refused
    unless it asks to keep its last k tokens, -1 for the server's length)."""
    return _read_inputs(body, rm, max_items, "/classify", activation=True, truncation="vllm")


def read_pooling(body: Any, rm: RewardModel, max_items: int) -> Parsed:
    """vLLM's ``/pooling``: ``{"model": ..., "input": text or [text, ...]}``, the reward raw unless
    ``use_activation`` is true (a reward model's pooler applies none); ``encoding_format``
    "float" only; ``truncate_prompt_tokens`` as for /classify."""
    return _read_inputs(body, rm, max_items, "/pooling", activation=False, truncation="vllm", encodings=True)


def read_embeddings(body: Any, rm: RewardModel, max_items: int) -> Parsed:
    """SGLang's ``/v1/embeddings``, as verl's reward loop sends it for a reward model:
    ``{"model": ..., "input": text or [text, ...]}``; the reward comes back raw, as the
    embedding's last (only) element (``encoding_format`` "float", ``dimensions`` 1 at most). An
    input longer than the server's length is refused, as SGLang refuses it unless started with
    --allow-auto-truncate."""
    return _read_inputs(body, rm, max_items, "/v1/embeddings", activation=False, truncation="sglang", encodings=True,
                        dimensions=True)


VLLM_TRUNCATE = "truncate_prompt_tokens"


def _read_inputs(body: Any, rm: RewardModel, max_items: int, endpoint: str, *, activation: bool, truncation: str,
                 encodings: bool = False, dimensions: bool = False) -> Parsed:
    """The rendered conversations of a vLLM- or SGLang-style request (``input``), and whether the
    reward goes through the sigmoid (``use_activation`` / ``activation``, default ``activation``).
    What the server cannot produce (base64, more dimensions than the one reward) is refused."""
    body = _object(body)
    _kind_check(rm, OUTCOME, endpoint)
    if "input" not in body:
        raise RequestError(400, "missing 'input' (a rendered conversation, or a list of them)")
    if encodings and body.get("encoding_format") not in (None, "float"):
        raise RequestError(400, f"{endpoint}: 'encoding_format' {body['encoding_format']!r}: this server returns "
                                "floats only; send \"float\" or leave it out")
    if dimensions and not (body.get("dimensions") is None or type(body["dimensions"]) is int and body["dimensions"] == 1):
        raise RequestError(400, f"{endpoint}: 'dimensions' {body['dimensions']!r}: a reward model's embedding is its "
                                "one reward (1 dimension); leave it out")
    single = isinstance(body["input"], str)
    inputs = [body["input"]] if single else _list(body, "input", max_items)
    if inputs and not all(isinstance(x, str) for x in inputs):
        raise RequestError(400, f"{endpoint}: 'input' must be rendered text (a string or a list of strings); send "
                                "conversations as messages to /v1/score")
    activation = _flag(body, "use_activation", _flag(body, "activation", activation))
    keep_last, too_long = None, "send 'truncate_prompt_tokens' (k, or -1 for the server's length) to keep the " \
        "last tokens, as vLLM does" if truncation == "vllm" else "SGLang refuses it too (without " \
        "--allow-auto-truncate); cut it, or score it as messages on /v1/score with \"truncate\": \"left\""
    if truncation == "vllm" and body.get(VLLM_TRUNCATE) is not None:
        k = body[VLLM_TRUNCATE]
        if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or 1 <= k <= rm.max_length):
            raise RequestError(400, f"'{VLLM_TRUNCATE}' {k!r}: -1 (the server's length) or an integer from 1 to "
                                    f"the server's {rm.max_length} tokens")
        keep_last = rm.max_length if k == -1 else k
    encoded = _texts(inputs, "input", rm, add_special_tokens=_flag(body, "add_special_tokens", True),
                     keep_last=keep_last, too_long=too_long)
    missing, warnings = _template_mismatches(inputs, "inputs", rm)
    return Parsed(encoded, [len(x) for x in encoded], {"activation": activation, "template_mismatches": missing},
                  warnings)
