"""The scoring cores, compiled once per shape: ``SequenceScorer`` (a reward per conversation, and
per response of a unit) and ``StepScorer`` (P(correct) per step); ``score_sequences`` /
``score_pairs`` / ``score_steps`` run a model over records as eval does."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flax import nnx
from rmflow.schemas.config import SCORING_BATCH_SIZE
from rmflow.schemas.heads import head_of
from rmflow.schemas.kinds import OUTCOME as OUTCOME_KIND
from rmflow.schemas.kinds import PROCESS, RESPONSES
from rmflow.schemas.record import PairRecord, ResponsesRecord, StepRecord, is_unit
from rmflow.trainer.data import PackCollate, StepPackCollate
from rmflow.trainer.data.response_units import record_values, units_in_rows
from rmflow.trainer.data.rows import packed_batches, row_shape_for, window_for
from rmflow.trainer.data.steps import MIN_STEP_SLOTS, record_step_values, step_slots
from rmflow.trainer.inference.packed import PackedScorer, score_planned
from rmflow.trainer.inference.programs import (
    _packed_pair_rewards,
    _rewards,
    _rewards_and_outputs,
    _step_probabilities,
)
from rmflow.trainer.inference.shapes import ScoringShapes
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.objective import OUTCOME


def padded_rows(shapes: ScoringShapes, lengths: Sequence[int], pad_id: int, what: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, segment ids) of one batch's rows, all padding, in the fixed shape its longest
    item needs: at most the rows of that length; more items than those is an error."""
    length = shapes.length_for(max(lengths))
    if len(lengths) > shapes.rows(length):
        raise ValueError(f"{len(lengths)} {what} of up to {length} tokens: a batch holds {shapes.rows(length)}")
    rows = shapes.rows_for(len(lengths), length)
    return np.full((rows, length), pad_id, np.int32), np.zeros((rows, length), np.int32)


def _placed(sequences: Sequence[np.ndarray], ids: np.ndarray, seg: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, segment ids, each row's last token) with each sequence at the start of its row of the
    padding ``ids`` and ``seg`` (filled in place)."""
    last = np.zeros(len(ids), np.int32)
    for row, s in enumerate(sequences):
        ids[row, : len(s)], seg[row, : len(s)], last[row] = s, 1, len(s) - 1
    return ids, seg, last


class SequenceScorer:
    """An outcome model's forward, jitted once over the shapes of ``ScoringShapes``: ``score``
    cuts any number of token sequences into batches of those shapes and returns the rewards in
    input order; ``run`` scores one batch that fits a shape (the reward server's batcher).
    The parameters are an argument of the compiled function, not constants baked into it."""

    def __init__(self, model: RewardTransformer, shapes: ScoringShapes, *, pad_id: int = 0):
        self._graphdef, self._state = nnx.split(model)
        self.shapes, self.pad_id = shapes, pad_id
        self.keeps_outputs = head_of(model.config).keeps_outputs  # the head's outputs scored beside the reward
        self.compiled: set[tuple[int, int]] = set()  # shapes run so far

    def warm_up(self, units: bool = False, up_to: int | None = None) -> None:
        """Compile every shape now, or those up to length ``up_to`` (a server does this before it
        says it is ready; a longer one compiles when first run); ``units``: also every shape of
        ``run_units`` (with ``UNIT_RESPONSES`` response slots)."""
        for rows, length in self.shapes.shapes:
            if up_to is not None and length > up_to:
                continue
            self._run_padded(np.full((rows, length), self.pad_id, np.int32), np.zeros((rows, length), np.int32),
                             np.zeros(rows, np.int32))
            if units:
                self._run_units_padded(units_in_rows([], rows, length, self.pad_id))  # UNIT_RESPONSES slots

    def _run_padded(self, ids: np.ndarray, seg: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        self.compiled.add(ids.shape)
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        if self.keeps_outputs:
            rewards, outputs = _rewards_and_outputs(self._graphdef, self._state, ids, pos, seg, last)
            return np.asarray(rewards), np.asarray(outputs)
        return np.asarray(_rewards(self._graphdef, self._state, ids, pos, seg, last)), None

    def run(self, sequences: Sequence[np.ndarray]) -> np.ndarray:
        """Rewards of one batch: at most the rows of the length its longest sequence needs."""
        return self.run_outputs(sequences)[0]

    def run_padded(self, sequences: Sequence[np.ndarray], length: int) -> np.ndarray:
        """Rewards of sequences each alone in a row of ``length`` tokens (any length that holds the
        longest; a program of its own per batch size and length): what eval's probes compare with
        the same sequences in the shapes of the set, to find a score that moves with its padding."""
        ids = np.full((len(sequences), length), self.pad_id, np.int32)
        return self._run_padded(*_placed(sequences, ids, np.zeros_like(ids)))[0]

    def run_outputs(self, sequences: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """Rewards of one batch and, for an attribute head, its outputs (B, N); else None."""
        ids, seg = padded_rows(self.shapes, [len(s) for s in sequences], self.pad_id, "sequences")
        rewards, outputs = self._run_padded(*_placed(sequences, ids, seg))
        return rewards[: len(sequences)], None if outputs is None else outputs[: len(sequences)]

    def run_units(self, units: Sequence[ResponsesRecord]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Rewards of one batch of units (``response_units``: a prompt once, then its responses),
        one a row, at most the rows of the length its longest unit needs: each unit's rewards
        (K,) and, for an attribute head, its outputs (K, N); else None."""
        length = self.shapes.length_for(max(u.unit_len for u in units))
        if len(units) > self.shapes.rows(length):
            raise ValueError(f"{len(units)} units of up to {length} tokens: a batch holds {self.shapes.rows(length)}")
        b = units_in_rows(units, self.shapes.rows_for(len(units), length), length, self.pad_id)
        rewards, outputs = self._run_units_padded(b)
        return (record_values(rewards, b["record_slots"]),
                record_values(outputs, b["record_slots"]) if self.keeps_outputs else None)

    def _run_units_padded(self, b: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        idx = b["reward_index"]
        self.compiled.add((*b["input_ids"].shape, idx.shape[1]))
        rewards, outputs = _rewards_and_outputs(self._graphdef, self._state, b["input_ids"], b["positions"],
                                                b["segment_ids"], idx, b["branch_ids"])
        return np.asarray(rewards), np.asarray(outputs)

    def run_items(self, items: Sequence) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each item's rewards (one for a conversation, K for a unit) and, for an attribute head,
        its outputs, the conversations and the units each in one forward of a compiled shape."""
        out: list = [None] * len(items)
        seqs = [i for i, x in enumerate(items) if not is_unit(x)]
        units = [i for i, x in enumerate(items) if is_unit(x)]
        if seqs:
            scores, outputs = self.run_outputs([items[i] for i in seqs])
            for j, i in enumerate(seqs):
                out[i] = (scores[j : j + 1], None if outputs is None else outputs[j : j + 1])
        if units:
            rewards, outputs = self.run_units([items[i] for i in units])
            for j, i in enumerate(units):
                out[i] = (rewards[j], None if outputs is None else outputs[j])
        return out

    def score(self, sequences: Sequence[np.ndarray], progress=None) -> np.ndarray:
        """Rewards of any number of sequences (each at its last token), in input order."""
        return score_planned(self, sequences, progress)


class StepScorer:
    """A process model's P(correct) of each step, jitted once over the shapes of ``ScoringShapes``
    (and a power of two of step slots, from 8): one solution a row, right-padded, so a
    solution's scores never depend on what it was batched with. ``run`` scores one batch that fits
    a shape (the server's batcher, a Beam job's bundle); ``score`` any number, in input order.
    Solutions are (token ids, index of each step's scoring token)."""

    def __init__(self, model: RewardTransformer, shapes: ScoringShapes, *, pad_id: int = 0):
        self._graphdef, self._state = nnx.split(model)
        self.shapes, self.pad_id = shapes, pad_id
        self.compiled: set[tuple[int, int, int]] = set()  # (rows, length, slots) run so far

    @staticmethod
    def slots(solution: tuple[np.ndarray, np.ndarray]) -> int:
        """The step slots a solution's row needs (part of its batch's shape)."""
        return step_slots(len(solution[1]))

    def warm_up(self, up_to: int | None = None) -> None:
        """Compile every shape (up to length ``up_to``) with the fewest step slots now; a batch with
        more steps in a row, or longer, compiles on first use."""
        for rows, length in self.shapes.shapes:
            if up_to is not None and length > up_to:
                continue
            self._run_padded(np.full((rows, length), self.pad_id, np.int32), np.zeros((rows, length), np.int32),
                             np.zeros((rows, MIN_STEP_SLOTS), np.int32))

    def _run_padded(self, ids: np.ndarray, seg: np.ndarray, idx: np.ndarray) -> np.ndarray:
        self.compiled.add((*ids.shape, idx.shape[1]))
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        return np.asarray(_step_probabilities(self._graphdef, self._state, ids, pos, seg, idx))

    def run(self, solutions: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """P(correct) per step of one batch: at most the rows of the length its longest needs."""
        ids, seg = padded_rows(self.shapes, [len(s) for s, _ in solutions], self.pad_id, "solutions")
        idx = np.zeros((len(ids), max(self.slots(s) for s in solutions)), np.int32)
        for row, (s, ends) in enumerate(solutions):
            ids[row, : len(s)], seg[row, : len(s)], idx[row, : len(ends)] = s, 1, ends
        p = self._run_padded(ids, seg, idx)
        return [p[row, : len(ends)].astype(np.float32) for row, (_, ends) in enumerate(solutions)]

    def score(self, solutions: Sequence[tuple[np.ndarray, np.ndarray]], progress=None) -> list[np.ndarray]:
        """P(correct) per step of any number of solutions, in input order."""
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(solutions)
        for batch in self.shapes.plan([len(s[0]) for s in solutions], one_length=True,
                                      groups=[self.slots(s) for s in solutions]):
            for i, p in zip(batch, self.run([solutions[i] for i in batch])):
                out[i] = p
            if progress:
                progress(len(batch))
        return out


# Each reward model kind's (schemas.kinds) scorer: a score per sequence, or P(correct) per step; in
# one item a row (``ScoringShapes``), and in packed rows (``PackedShapes``) for the kinds that have one.
SCORING_CORES = {OUTCOME_KIND.name: SequenceScorer, PROCESS.name: StepScorer, RESPONSES.name: SequenceScorer}
PACKED_CORES = {OUTCOME_KIND.name: PackedScorer, RESPONSES.name: PackedScorer}


def score_sequences(model: RewardTransformer, sequences: Sequence[np.ndarray], *, batch_size: int = SCORING_BATCH_SIZE,
                    pad_id: int = 0, progress=None) -> np.ndarray:
    """The reward of each token sequence (at its last token), ``batch_size`` a forward in length
    order, in power-of-two lengths; returned in the input order (a one-off ``SequenceScorer``)."""
    if not len(sequences):
        return np.zeros(0, np.float32)
    shapes = ScoringShapes(max(len(s) for s in sequences), max_rows=batch_size)
    return SequenceScorer(model, shapes, pad_id=pad_id).score(sequences, progress)


def record_batches(collate, records: Sequence, *, batch_size: int = 0, row_tokens: int = 0):
    """``records`` packed as training packs them (``collate``: a kind's packed collation, its
    ``size`` and ``layout``), in rows of one shape so that scoring them compiles one program:
    one row holding ``batch_size`` records on average, or ``row_tokens`` tokens (at least the
    longest record's unit). Yields (batch, the records' indices in the batch's order)."""
    sizes = [collate.size(r) for r in records]
    longest = max(t for t, _ in sizes)
    shape = row_shape_for(sizes, batch_size=max(batch_size, 1), rows=1, longest=longest,
                          row_tokens=max(row_tokens, longest) if row_tokens else 0)
    lay_out = collate.layout(shape.tokens, shape.slots)
    for placement in packed_batches(sizes, shape, window_for(shape, batch_size)):
        order = [i for row in placement for i in row]
        local = {i: k for k, i in enumerate(order)}
        yield lay_out([records[i] for i in order], [[local[i] for i in row] for row in placement]), order


def score_pairs(model: RewardTransformer, records: Sequence[PairRecord], *, batch_size: int = SCORING_BATCH_SIZE,
                max_length: int | None = None, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rewards of chosen and rejected for each record, in order: the records packed as in
    training (``PackCollate``, one row of one length for all: ``record_batches``) and scored
    by the same ``pair_rewards``."""
    longest = max(max(len(r.chosen_ids), len(r.rejected_ids)) for r in records)
    collate = PackCollate(batch_size, max(max_length or 0, longest), pad_id)
    graphdef, state = nnx.split(model)
    chosen, rejected = np.zeros(len(records), np.float32), np.zeros(len(records), np.float32)
    for b, order in record_batches(collate, records, batch_size=batch_size):
        c, r = (np.asarray(x) for x in _packed_pair_rewards(graphdef, state, {k: b[k] for k in OUTCOME.device_keys}))
        chosen[order], rejected[order] = c[b["pair_slot"]], r[b["pair_slot"]]
    return chosen, rejected


def score_steps(model: RewardTransformer, records: Sequence[StepRecord], *, batch_size: int = SCORING_BATCH_SIZE,
                max_length: int | None = None, pad_id: int = 0) -> list[np.ndarray]:
    """P(correct) of each step of each record, in order: the records packed as in training
    (``StepPackCollate``, one row of one length for all: ``record_batches``) and scored by the
    model's step logits."""
    longest = max(len(r.input_ids) for r in records)
    collate = StepPackCollate(batch_size, max(max_length or 0, longest), pad_id)
    graphdef, state = nnx.split(model)
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(records)
    for b, order in record_batches(collate, records, batch_size=batch_size):
        p = np.asarray(_step_probabilities(graphdef, state, *(b[k] for k in (
            "input_ids", "positions", "segment_ids", "reward_index", "branch_ids"))))
        for i, values in zip(order, record_step_values(p, b["record_steps"])):
            out[i] = values
    return out
