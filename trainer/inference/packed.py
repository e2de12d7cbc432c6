"""Scoring in packed rows: conversations and units of one prompt's K responses side by side in
one row, each on its own segment (attention never crosses segments; a unit's responses each see
the prompt and themselves only, as in training), in a handful of fixed row sizes.

``PackedShapes`` is the set of rows (``ROW_SIZES`` sizes: the full row, holding the token
budget and the longest item, then each a quarter of the one above, down to ``MIN_ROW``), and
how items are cut into rows; ``PackedScorer`` runs one row of items. So a server compiles
``ROW_SIZES`` programs at start-up, whatever lengths and mixes of requests come, and a lone
short request runs in the smallest row, not a full one. A conversation's score is its own alone
(its segment sees nothing else), to float rounding: a Beam job that must rerun byte-identical
scores in ``ScoringShapes`` (one item a row, the shape set by the item alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from flax import nnx
from rmflow.schemas.heads import head_of
from rmflow.schemas.record import ResponsesRecord, is_unit, item_scores
from rmflow.trainer.data.response_units import ResponsesUnit, responses_unit
from rmflow.trainer.inference.programs import _rewards_and_outputs
from rmflow.trainer.modeling.decoder import RewardTransformer

ROW_SIZES = 4  # row sizes compiled: the programs a server compiles at start-up
MIN_ROW = 256  # the smallest row's tokens at least
ALIGN = 128  # row sizes are multiples of this
SLOT_TOKENS = 8  # a row has a reward slot per this many of its tokens (at least 8 slots)
OPEN_ROWS = 8  # rows still taking items while ``plan`` fills them (first-fit over these)


def _tokens(item) -> int:
    return item.unit_len if is_unit(item) else len(item)


@dataclasses.dataclass(frozen=True)
class PackedShapes:
    """The rows packed scoring runs: ``ROW_SIZES`` sizes of one row each, the largest holding
    ``token_budget`` tokens and an item of ``max_length`` (a conversation; a unit of responses
    is cut to fit it, ``response_units``)."""

    max_length: int
    token_budget: int = 16384

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.token_budget < 1:
            raise ValueError(f"packed shapes need a positive max_length and token budget: {self}")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The row sizes, smallest first."""
        full = -(-max(self.token_budget, self.max_length) // ALIGN) * ALIGN
        out = [full]
        while len(out) < ROW_SIZES and out[-1] // 4 >= MIN_ROW:
            out.append(-(-(out[-1] // 4) // ALIGN) * ALIGN)
        return tuple(reversed(out))

    def slots(self, tokens: int) -> int:
        """The reward slots of a row of ``tokens``: a power of two, one per ``SLOT_TOKENS`` at least 8."""
        need = max(8, tokens // SLOT_TOKENS)
        return 1 << (need - 1).bit_length()

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, tokens) of each compiled program."""
        return tuple((1, n) for n in self.sizes)

    def describe(self, up_to: int = 0, units: bool = False) -> str:
        """What a server of these rows compiled at start-up: every row size (``up_to`` and
        ``units`` change nothing: a row takes short and long items, conversations and units)."""
        return (f"{len(self.sizes)} packed row sizes compiled ({', '.join(f'{n:,}' for n in self.sizes)} tokens), "
                "conversations and response units side by side")

    def size_for(self, tokens: int) -> int:
        """The smallest row that holds ``tokens``."""
        for n in self.sizes:
            if tokens <= n:
                return n
        raise ValueError(f"{tokens} tokens: more than the largest row's {self.sizes[-1]} (max_length {self.max_length})")

    def plan(self, lengths: Sequence[int], *, one_length: bool = False,
             groups: Sequence[int] | None = None) -> list[np.ndarray]:
        """Batches (one row each) of indices into ``lengths``, every item in one: longest first,
        each to the first of the last ``OPEN_ROWS`` rows with room for its tokens and its reward
        slots (``groups``: each item's, 1 when None), the rest in input order. ``one_length``
        has no meaning here (an item's row depends on its neighbours): refused."""
        if one_length:
            raise ValueError("packed rows cannot score each item in a shape of its own: use ScoringShapes")
        if not len(lengths):
            return []
        full = self.sizes[-1]
        cap = self.slots(full)
        slots = list(groups) if groups is not None else [1] * len(lengths)
        order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
        rows: list[list[int]] = []
        load: list[tuple[int, int]] = []
        first_open = 0
        for i in order:
            n, s = int(lengths[i]), int(slots[i])
            if n > full or s > cap:
                raise ValueError(f"an item of {n} tokens and {s} scores: more than a row's {full} tokens and {cap}")
            for r in range(max(first_open, len(rows) - OPEN_ROWS), len(rows)):
                if load[r][0] + n <= full and load[r][1] + s <= cap:
                    rows[r].append(i)
                    load[r] = (load[r][0] + n, load[r][1] + s)
                    break
            else:
                rows.append([i])
                load.append((n, s))
        return [np.asarray(sorted(r), np.int64) for r in rows]


class PackedScorer:
    """An outcome model's forward over packed rows (``PackedShapes``), jitted once per row size:
    ``run_items`` scores one batch (conversations and units, as ``plan`` cuts them) in one row,
    the smallest that holds it; ``run``, ``run_outputs``, ``run_units`` and ``score`` as
    ``SequenceScorer``'s. The parameters are an argument of the compiled function."""

    def __init__(self, model: RewardTransformer, shapes: PackedShapes, *, pad_id: int = 0):
        self._graphdef, self._state = nnx.split(model)
        self.shapes, self.pad_id = shapes, pad_id
        self.keeps_outputs = head_of(model.config).keeps_outputs
        self.compiled: set[tuple[int, int]] = set()  # (rows, tokens) run so far

    def warm_up(self, units: bool = False, up_to: int | None = None) -> None:
        """Compile every row size now (``units`` and ``up_to`` change nothing: each row takes
        conversations and units alike, and a short item runs in a small row)."""
        for _, n in self.shapes.shapes:
            self._forward(self._row(n, []))

    def _row(self, tokens: int, items: Sequence) -> dict[str, np.ndarray]:
        slots = self.shapes.slots(tokens)
        b = {"input_ids": np.full((1, tokens), self.pad_id, np.int32),
             **{k: np.zeros((1, tokens), np.int32) for k in ("positions", "segment_ids", "branch_ids")},
             "reward_index": np.zeros((1, slots), np.int32)}
        start = first = 0
        for j, item in enumerate(items):
            u = responses_unit(item) if is_unit(item) else _sequence_unit(item)
            end = start + len(u.ids)
            b["input_ids"][0, start:end], b["positions"][0, start:end] = u.ids, u.positions
            b["branch_ids"][0, start:end], b["segment_ids"][0, start:end] = u.branches, j + 1
            b["reward_index"][0, first : first + len(u.reward_at)] = start + u.reward_at
            start, first = end, first + len(u.reward_at)
        return b

    def _forward(self, b: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        self.compiled.add(b["input_ids"].shape)
        rewards, outputs = _rewards_and_outputs(self._graphdef, self._state, b["input_ids"], b["positions"],
                                                b["segment_ids"], b["reward_index"], b["branch_ids"])
        return np.asarray(rewards)[0], np.asarray(outputs)[0]

    def run_items(self, items: Sequence) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each item's rewards (one for a conversation, K for a unit) and, for an attribute head,
        its outputs (one row of N each), from one forward of the smallest row that holds them."""
        tokens = sum(_tokens(x) for x in items)
        if sum(item_scores(x) for x in items) > self.shapes.slots(self.shapes.size_for(tokens)):
            raise ValueError(f"{len(items)} items of {sum(item_scores(x) for x in items)} scores: more than a row holds")
        rewards, outputs = self._forward(self._row(self.shapes.size_for(tokens), items))
        out, first = [], 0
        for x in items:
            k = item_scores(x)
            out.append((rewards[first : first + k], outputs[first : first + k] if self.keeps_outputs else None))
            first += k
        return out

    def run(self, sequences: Sequence[np.ndarray]) -> np.ndarray:
        return self.run_outputs(sequences)[0]

    def run_outputs(self, sequences: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        got = self.run_items(sequences)
        rewards = np.concatenate([r for r, _ in got]) if got else np.zeros(0, np.float32)
        return rewards, np.concatenate([o for _, o in got]) if self.keeps_outputs and got else None

    def run_units(self, units: Sequence[ResponsesRecord]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        got = self.run_items(units)
        return [r for r, _ in got], [o for _, o in got] if self.keeps_outputs else None

    def score(self, sequences: Sequence[np.ndarray], progress=None) -> np.ndarray:
        """Rewards of any number of sequences (each at its last token), in input order."""
        scores = np.zeros(len(sequences), np.float32)
        for batch in self.shapes.plan([len(s) for s in sequences]):
            scores[batch] = self.run([sequences[i] for i in batch])
            if progress:
                progress(len(batch))
        return scores


def _sequence_unit(seq: np.ndarray) -> ResponsesUnit:
    n = len(seq)
    return ResponsesUnit(np.asarray(seq, np.int32), np.arange(n, dtype=np.int32), np.zeros(n, np.int32),
                         np.asarray([n - 1], np.int32))
