"""Reward functions for TRL's ``GRPOTrainer`` (``reward_funcs=``): an rmflow reward model in
this process (``RewardModel.as_reward_func``) or behind a running ``rmflow serve``
(``server_reward_func``).

TRL calls a reward function with keyword arguments: ``prompts`` and ``completions`` (one each a
generation), ``completion_ids``, the dataset's other columns, ``trainer_state`` and logging hooks,
and takes back one float (or None: no reward) a completion. Both formats TRL's datasets come in
are read:

* conversational: a prompt is a list of messages, a completion the list of messages the policy
  added (an assistant reply, tool calls and results): scored as ``prompt + completion``;
* standard: prompt and completion are strings: scored as a user turn and the assistant's reply,
  rendered with the reward model's own chat template (what it was trained on).

A completion that cannot be scored (an empty reply, a reply longer than the model's positions
after left truncation) gets None, which TRL counts as no reward for that completion, rather than
stopping the training run.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from rmflow.schemas import jsontext
from rmflow.scoring.errors import BadConversation

RewardFunc = Callable[..., list[float | None]]


def conversation_of(prompt: Any, completion: Any) -> list[dict[str, Any]]:
    """One generation as the conversation to score (the module's two formats)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
        return [*prompt, *completion]
    raise BadConversation(f"a prompt and completion must both be strings or both lists of messages, got "
                          f"{type(prompt).__name__} and {type(completion).__name__}")


def _named(fn: RewardFunc, name: str) -> RewardFunc:
    fn.__name__ = fn.__qualname__ = name  # TRL logs each reward function's rewards under its name
    return fn


def local_reward_func(rm, *, normalized: bool = False, truncate: str = "left", batch_size: int | None = None,
                      name: str = "rmflow_reward", deterministic: bool = False) -> RewardFunc:
    """``rm`` (an outcome ``RewardModel``) as a TRL reward function; ``normalized``: rewards
    standardised by the model's stored mean and std (``rmflow eval --normalize``);
    ``deterministic``: a completion's reward never depends on the others of its call."""
    if normalized and not (rm.normalization and rm.normalization.get("std")):
        raise ValueError("normalized=True: this model has no reward_normalization.json (run `rmflow eval "
                         "--normalize` on it first)")

    def reward(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        encoded, where = [], []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            try:
                encoded.append(rm.encode(conversation_of(p, c), truncate=truncate))
                where.append(i)
            except BadConversation:
                continue
        out: list[float | None] = [None] * len(completions)
        if encoded:
            scores = rm.score_ids(encoded, deterministic=deterministic,
                                  **({"batch_size": batch_size} if batch_size else {}))
            for i, s in zip(where, rm.normalize(scores) if normalized else scores):
                out[i] = float(s)
        return out

    return _named(reward, name)


def server_reward_func(url: str, *, api_key: str | None = None, normalized: bool = False, timeout: float = 300.0,
                       name: str = "rmflow_reward") -> RewardFunc:
    """A TRL reward function that asks a running ``rmflow serve`` at ``url`` (its native
    ``POST /v1/score``, with ``truncate: left``): an empty completion gets None without being
    sent, one the server refuses (422, naming it: too long even truncated, say) gets None and the
    others are sent again; any other refusal (auth, a full queue) is raised with its message."""
    endpoint = url.rstrip("/") + "/v1/score"
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}

    def post(conversations: list[list[dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
        body = jsontext.dumps({"conversations": conversations, "truncate": "left", "normalized": normalized}).encode()
        request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, {"error": text[:500]}

    def reward(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        conversations = [conversation_of(p, c) for p, c in zip(prompts, completions, strict=True)]
        sent = [i for i, c in enumerate(conversations) if _has_reply(c)]
        out: list[float | None] = [None] * len(conversations)
        # the items the server refuses (422, each named: those its checks find before tokenizing, then
        # those tokenizing finds) get None, and the rest are sent again; each round drops one or more
        while sent:
            status, answer = post([conversations[i] for i in sent])
            if status == 200:
                for i, s in zip(sent, answer["normalized_scores" if normalized else "scores"]):
                    out[i] = float(s)
                return out
            refused = {item["index"] for item in answer.get("items", []) if isinstance(item, dict)}
            if status != 422 or not refused:
                raise RuntimeError(f"rmflow serve at {url} answered {status}: {answer.get('error', answer)}")
            sent = [i for k, i in enumerate(sent) if k not in refused]
        return out

    return _named(reward, name)


def _has_reply(conversation: list[dict[str, Any]]) -> bool:
    """Whether the conversation ends with an assistant message that says something or calls a
    tool (an empty reply is not sent: it would make the server refuse the whole request)."""
    last = conversation[-1] if conversation else {}
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return False
    content = last.get("content")
    return bool(last.get("tool_calls")) or not isinstance(content, str) or bool(content.strip())
