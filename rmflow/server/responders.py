"""What each scoring endpoint answers, in its protocol's form: one small function per protocol,
``(service, parsed request, results) -> JSON body``. The results are the scorer's fields per
item (``rmflow.scoring.scorers``); the request was read by ``rmflow.server.protocol``.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from rmflow.handlers import handler
from rmflow.server.protocol import Parsed

Responder = Callable[[Any, Parsed, list], dict[str, Any]]  # (service, parsed request, results) -> body


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _per_record(parsed: Parsed, results: list) -> list[list[dict[str, Any]]]:
    """Each K-response record's results, in the given order: a record's items are units of its
    responses (a list of fields each) or one response alone."""
    groups = parsed.options["groups"]
    ends = list(itertools.accumulate(groups))
    return [[r for item in results[end - k: end] for r in (item if isinstance(item, list) else [item])]
            for k, end in zip(groups, ends)]


def respond_native(service, parsed: Parsed, results: list) -> dict[str, Any]:
    """``/v1/score``: the kind's columns per conversation, or per record of K responses its
    responses' scores and the best one; the fields the model's head adds beside each reward
    (``Head.answer_keys``: an attribute head's outputs by name)."""
    rm, normalized = service.rm, parsed.options.get("normalized")
    if "groups" in parsed.options:
        per = _per_record(parsed, results)
        out = {"response_scores": [[r["score"] for r in rs] for rs in per],
               "best_responses": [max(range(len(rs)), key=lambda i, rs=rs: rs[i]["score"]) for rs in per],
               **{many: [[r[key] for r in rs] for rs in per] for key, many in rm.head.answer_keys}}
        if normalized:
            out["normalized_response_scores"] = [[r["score_normalized"] for r in rs] for rs in per]
        return {**out, "model": rm.identity()}
    out = {column: [r[field] for r in results] for column, field in handler(rm.kind, "protocol").columns.items()
           if field != "score_normalized" or normalized}
    return {**out, **{key: [r[key] for r in results] for key, _ in rm.head.answer_keys}, "model": rm.identity()}


def _reward(service, r: dict[str, Any]) -> float:
    return r["score_normalized"] if service.cfg.normalize else r["score"]


def _value(service, parsed: Parsed, r: dict[str, Any]) -> float:
    return _sigmoid(_reward(service, r)) if parsed.options["activation"] else _reward(service, r)


def _usage(parsed: Parsed) -> dict[str, int]:
    tokens = sum(parsed.sizes)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def respond_get_reward(service, parsed: Parsed, results: list) -> dict[str, Any]:
    """OpenRLHF's ``/get_reward``."""
    rewards = [_reward(service, r) for r in results]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}


def respond_classify(service, parsed: Parsed, results: list) -> dict[str, Any]:
    """vLLM's ClassificationResponse."""
    data = [{"index": i, "label": "LABEL_0", "probs": [_value(service, parsed, r)], "num_classes": 1,
             "object": "classification"} for i, r in enumerate(results)]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": service.cfg.model, "data": data, "usage": _usage(parsed)}


def respond_pooling(service, parsed: Parsed, results: list) -> dict[str, Any]:
    """vLLM's PoolingResponse."""
    data = [{"index": i, "object": "pooling", "data": [_value(service, parsed, r)]} for i, r in enumerate(results)]
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": service.cfg.model, "data": data, "usage": _usage(parsed)}


def respond_embeddings(service, parsed: Parsed, results: list) -> dict[str, Any]:
    """SGLang's EmbeddingResponse."""
    data = [{"index": i, "object": "embedding", "embedding": [_value(service, parsed, r)]}
            for i, r in enumerate(results)]
    return {"object": "list", "model": service.cfg.model, "usage": _usage(parsed), "data": data}
