"""K responses to one prompt scored with the prompt computed once: ``response_units`` (a record's
responses in units of the compiled shapes), ``score_groups`` and ``score_responses``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flax import nnx
from rmflow.schemas.record import ResponsesRecord
from rmflow.trainer.data.response_units import ResponsesPackCollate, record_values
from rmflow.trainer.data.steps import MIN_STEP_SLOTS
from rmflow.trainer.inference.cores import record_batches, score_pairs, score_steps
from rmflow.trainer.inference.programs import _rewards_and_outputs
from rmflow.trainer.modeling.decoder import RewardTransformer


def score_responses(model: RewardTransformer, records: Sequence[ResponsesRecord], *, tokens: int = 8192,
                    max_length: int | None = None, pad_id: int = 0) -> list[np.ndarray]:
    """The reward of each response of each record, in order, each prompt computed once: the
    records packed as in training (``ResponsesPackCollate``, rows of one shape for all: ``tokens``
    tokens, or the longest record's unit: ``record_batches``) and scored at every response's
    reward token."""
    return score_responses_outputs(model, records, tokens=tokens, max_length=max_length, pad_id=pad_id)[0]


def score_responses_outputs(model: RewardTransformer, records: Sequence[ResponsesRecord], *, tokens: int = 8192,
                            max_length: int | None = None, pad_id: int = 0
                            ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``score_responses``, and the score head's outputs of each response of each record, (K, N)
    (an attribute head's: one per attribute)."""
    longest = max(r.prompt_len + max(len(x) for x in r.responses) for r in records)
    collate = ResponsesPackCollate(1, max(max_length or 0, longest), pad_id)
    graphdef, state = nnx.split(model)
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(records)
    heads: list[np.ndarray] = [np.zeros((0, 0), np.float32)] * len(records)
    for b, order in record_batches(collate, records, row_tokens=tokens):
        rewards, outputs = _rewards_and_outputs(graphdef, state, *(b[k] for k in (
            "input_ids", "positions", "segment_ids", "reward_index", "branch_ids")))
        for i, r, o in zip(order, record_values(np.asarray(rewards), b["record_slots"]),
                           record_values(np.asarray(outputs), b["record_slots"])):
            out[i], heads[i] = r, o
    return out, heads


def _as_unit(seqs: Sequence[np.ndarray], shared: int) -> ResponsesRecord:
    return ResponsesRecord(prompt_ids=seqs[0][:shared], responses=[s[shared:] for s in seqs],
                           lasts=[len(s) - 1 for s in seqs], scores=np.zeros(len(seqs)), record_id="0" * 32)


def shared_prefix(seqs: Sequence[np.ndarray]) -> int:
    """How many tokens ``seqs`` share at their start (one prompt's conversations: the prompt),
    leaving each at least one token of its own (its response, whose last token is its reward's)."""
    shared = min(len(s) for s in seqs) - 1
    for s in seqs[1:]:
        diff = np.flatnonzero(seqs[0][:shared] != s[:shared])
        shared = int(diff[0]) if diff.size else shared
    return shared


def score_groups(model: RewardTransformer, groups: Sequence[Sequence[np.ndarray]], *, pad_id: int = 0
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The reward of each sequence of each group (one prompt's K conversations, each the prompt and
    one response, as encoded for scoring), at its last token, the tokens the group's sequences
    share at their start computed once (``score_responses``); and each sequence's score head
    outputs, (K, N) a group. A group of one (K = 1) is its one conversation, scored alone."""
    groups = [[np.asarray(s, np.int32) for s in seqs] for seqs in groups]
    if any(not g for g in groups):
        raise ValueError("a group with no conversation: each group holds one prompt's K >= 1 conversations")
    several = [i for i, g in enumerate(groups) if len(g) > 1]
    rewards: list[np.ndarray] = [np.zeros(0, np.float32)] * len(groups)
    outputs: list[np.ndarray] = [np.zeros((0, 0), np.float32)] * len(groups)
    if several:
        r, o = score_responses_outputs(model, [_as_unit(groups[i], shared_prefix(groups[i])) for i in several],
                                       pad_id=pad_id)
        for j, i in enumerate(several):
            rewards[i], outputs[i] = r[j], o[j]
    alone = [i for i, g in enumerate(groups) if len(g) == 1]
    if alone:
        seqs = [groups[i][0] for i in alone]
        ids = np.full((len(seqs), max(map(len, seqs))), pad_id, np.int32)
        seg, last = np.zeros_like(ids), np.asarray([len(x) - 1 for x in seqs], np.int32)
        for row, x in enumerate(seqs):
            ids[row, : len(x)], seg[row, : len(x)] = x, 1
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        r, o = (np.asarray(x) for x in _rewards_and_outputs(*nnx.split(model), ids, pos, seg, last))
        for j, i in enumerate(alone):
            rewards[i], outputs[i] = r[j : j + 1], o[j : j + 1]
    return rewards, outputs


# The responses one scoring unit holds at most (``response_units``): the response slots of the
# reward server's compiled unit shapes, each warmed at load.
UNIT_RESPONSES = MIN_STEP_SLOTS


def response_units(seqs: Sequence[np.ndarray], max_length: int) -> list[np.ndarray | ResponsesRecord]:
    """One prompt's K conversations (each the prompt and one response, as encoded for scoring, at
    most ``max_length`` tokens) as the fewest units that each hold the prompt once and up to
    ``UNIT_RESPONSES`` of its responses in ``max_length`` tokens, in order; a unit left with one
    response is that conversation itself (a plain sequence). Each response's reward equals its
    conversation's scored alone."""
    seqs = [np.asarray(s, np.int32) for s in seqs]
    if len(seqs) < 2:
        return list(seqs)
    shared = shared_prefix(seqs)
    cuts, size = [[]], shared
    for i, s in enumerate(seqs):
        own = len(s) - shared
        if cuts[-1] and (len(cuts[-1]) == UNIT_RESPONSES or size + own > max_length):
            cuts.append([])
            size = shared
        cuts[-1].append(i)
        size += own
    return [seqs[c[0]] if len(c) == 1 else _as_unit([seqs[i] for i in c], shared) for c in cuts]


def _pair_records(model: RewardTransformer, records, *, batch_size: int, pad_id: int):
    return score_pairs(model, records, batch_size=batch_size, pad_id=pad_id)


def _step_records(model: RewardTransformer, records, *, batch_size: int, pad_id: int):
    return score_steps(model, records, batch_size=batch_size, pad_id=pad_id)


def _response_records(model: RewardTransformer, records, *, batch_size: int, pad_id: int):
    return score_responses_outputs(model, records, pad_id=pad_id)


# Each data kind's (schemas.kinds) tokenized records scored as training packs them (a pair's or K
# responses' prompt once): pairs -> (chosen, rejected) rewards; solutions -> P(correct) of each
# step, one array a record; K responses -> (rewards, head outputs), one array each a record.
RECORD_SCORING = {"outcome": _pair_records, "process": _step_records, "multi-response": _response_records}
