"""Scoring in packed rows: conversations and units of one prompt's K responses side by side in
rows, each on its own segment (attention never crosses segments; a unit's responses each see
the prompt and themselves only, as in training), in a handful of fixed shapes.

``PackedShapes`` is the set of shapes and how items are placed in rows: rows of one length (the
length most items fit: the model's training length, by default), as many a forward as hold the
token budget, a quarter of them, or one (a lone short request runs in one row, not a full
forward); an item longer than a row, up to ``max_length``, in a row of its power of two, one row
a forward, compiled the first time one comes. ``PackedScorer`` runs them. So a server compiles
at most 3 programs at start-up, whatever lengths and mixes of requests come. Several rows of moderate length, not one
long row, because the last layer runs at the reward slots against every key of their row, and
a CPU runs the blockwise attention's loops a block at a time (docs/benchmarks.md, "Compile
once"). A conversation's score is
its own alone (its segment sees nothing else), to float rounding: a Beam job that must rerun
byte-identical scores in ``ScoringShapes`` (one item a row, the shape set by the item alone).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
from flax import nnx
from rmflow.schemas.heads import head_of
from rmflow.schemas.record import ResponsesRecord, is_unit, item_scores, item_tokens
from rmflow.trainer.data.response_units import ResponsesUnit, responses_unit
from rmflow.trainer.inference.programs import _rewards_and_outputs
from rmflow.trainer.modeling.decoder import RewardTransformer

ALIGN = 128  # row lengths are multiples of this
SLOT_TOKENS = 8  # a row has a reward slot per this many of its tokens (from 8, at most MAX_SLOTS)...
MAX_SLOTS = 256  # ...so that the last layer, run at the reward slots, stays a small share of the row
OPEN_ROWS = 32  # rows still taking items while ``place`` fills them (first-fit over these)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class PackedShapes:
    """The rows packed scoring runs: rows of ``row_length`` tokens (0: ``max_length``), as many
    a forward as hold ``token_budget`` tokens, and fewer (a quarter, one) for a short queue; an
    item longer than a row (up to ``max_length``) runs in a row of its own length class, one row
    a forward, compiled on first use. ``shapes``: the (at most 3) compiled at start-up."""

    max_length: int
    token_budget: int = 16384
    row_length: int = 0

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.token_budget < 1 or self.row_length < 0:
            raise ValueError(f"packed shapes need a positive max_length and token budget: {self}")

    @property
    def row(self) -> int:
        """A row's tokens: the length most items fit (the model's training length, by default)."""
        return _align(min(self.row_length or self.max_length, self.max_length))

    def long_size(self, tokens: int) -> int:
        """The row an item longer than ``row`` runs in, alone or with other long ones: the power of
        two that holds it (from twice ``row``), at most ``max_length`` (aligned). Compiled the
        first time an item needs it, never at start-up: a model's positions can be far more than
        any request holds."""
        size = 2 * self.row
        while size < tokens:
            size *= 2
        return min(size, _align(self.max_length))

    @property
    def rows(self) -> int:
        """Rows a full forward holds: the token budget's worth."""
        return max(1, self.token_budget // self.row)

    @property
    def row_counts(self) -> tuple[int, ...]:
        """The forwards' row counts, smallest first: one, a quarter of the full count, the full count."""
        return tuple(sorted({1, max(1, self.rows // 4), self.rows}))

    def slots(self, tokens: int) -> int:
        """The reward slots of a row of ``tokens``: a power of two, one per ``SLOT_TOKENS``, from 8
        to ``MAX_SLOTS``."""
        need = min(MAX_SLOTS, max(8, tokens // SLOT_TOKENS))
        return 1 << (need - 1).bit_length()

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, tokens) of each program compiled at start-up."""
        return tuple((r, self.row) for r in self.row_counts)

    def describe(self, up_to: int = 0, units: bool = False) -> str:
        """What a server of these rows compiles at start-up (``PackedScorer.warm_up``; ``up_to``
        and ``units`` change nothing: a row takes conversations and units alike)."""
        longer = (f"; an item over {self.row:,} tokens in a row of its power of two up to {_align(self.max_length):,}, "
                  "compiled on first use") if _align(self.max_length) > self.row else ""
        return (f"{len(self.shapes)} packed shapes ({', '.join(f'{r} x {n:,}' for r, n in self.shapes)} tokens: one "
                "row and a full forward compiled before ready, any between right after), conversations and response "
                f"units side by side{longer}")

    def place(self, lengths: Sequence[int], slots: Sequence[int]) -> list[list[int]]:
        """Rows of indices into ``lengths``: longest first, each item to the first of the last
        ``OPEN_ROWS`` rows of its class (``row`` tokens, or ``long_size`` for a longer item) with room
        for its tokens and its reward slots. Deterministic; the rows of ``row`` tokens first."""
        rows: dict[int, list[list[int]]] = {}  # by row length: the rows, and their (tokens, slots)
        loads: dict[int, list[tuple[int, int]]] = {}
        for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
            n, s = int(lengths[i]), int(slots[i])
            size = self.row if n <= self.row else self.long_size(n)
            if n > size or s > self.slots(size):
                raise ValueError(f"an item of {n} tokens and {s} scores: more than the longest row's "
                                 f"{size} tokens (max_length {self.max_length}) and its {self.slots(size)} scores")
            these, load = rows.setdefault(size, []), loads.setdefault(size, [])
            for r in range(max(0, len(these) - OPEN_ROWS), len(these)):
                if load[r][0] + n <= size and load[r][1] + s <= self.slots(size):
                    these[r].append(i)
                    load[r] = (load[r][0] + n, load[r][1] + s)
                    break
            else:
                these.append([i])
                load.append((n, s))
        return [sorted(r) for size in sorted(rows) for r in rows[size]]

    def plan(self, lengths: Sequence[int], *, one_length: bool = False,
             groups: Sequence[int] | None = None) -> list[np.ndarray]:
        """Batches of indices into ``lengths``, each a forward of one shape: the rows ``place``
        makes (``groups``: each item's reward slots, 1 when None), up to ``rows`` a batch, a long
        row alone. ``one_length`` has no meaning here (an item's row depends on its neighbours):
        refused."""
        if one_length:
            raise ValueError("packed rows cannot score each item in a shape of its own: use ScoringShapes")
        placed = self.place(lengths, list(groups) if groups is not None else [1] * len(lengths))
        short = [r for r in placed if max(int(lengths[i]) for i in r) <= self.row]
        batches = [short[k : k + self.rows] for k in range(0, len(short), self.rows)]
        batches += [[r] for r in placed if max(int(lengths[i]) for i in r) > self.row]
        return [np.asarray(sorted(i for r in b for i in r), np.int64) for b in batches]


class PackedScorer:
    """An outcome model's forward over packed rows (``PackedShapes``), jitted once per shape:
    ``run_items`` scores a batch of conversations and units (as ``plan`` cuts them: one forward)
    in rows; ``run``, ``run_outputs``, ``run_units`` and ``score`` as ``SequenceScorer``'s. The
    parameters are an argument of the compiled function."""

    def __init__(self, model: RewardTransformer, shapes: PackedShapes, *, pad_id: int = 0):
        self._graphdef, self._state = nnx.split(model)
        self.shapes, self.pad_id = shapes, pad_id
        self.keeps_outputs = head_of(model.config).keeps_outputs
        self.compiled: set[tuple[int, int]] = set()  # (rows, tokens) run so far
        self._pending: set[int] = set()  # row counts compiling in the background (``warm_up``)

    def warm_up(self, units: bool = False, up_to: int | None = None) -> None:
        """Compile the start-up shapes: one row and a full forward now, the row counts between them
        in a background thread (until each is ready a forward that would take it runs in the next
        larger count), so a server says ready after two compilations. ``units`` and ``up_to``
        change nothing: each row takes conversations and units alike; a longer item's row
        compiles when one first comes."""
        counts = self.shapes.row_counts
        for rows in (counts[0], counts[-1]):
            self._forward(self._rows(self.shapes.row, [[] for _ in range(rows)], []))
        later = [c for c in counts if c not in (counts[0], counts[-1])]
        self._pending.update(later)

        def compile_later():
            for rows in later:
                self._forward(self._rows(self.shapes.row, [[] for _ in range(rows)], []))
                self._pending.discard(rows)

        if later:
            threading.Thread(target=compile_later, name="rmflow-packed-warm-up", daemon=True).start()

    @property
    def warming(self) -> bool:
        """Whether row counts are still compiling in the background (``warm_up``)."""
        return bool(self._pending)

    def row_count(self, rows: int) -> int:
        """The compiled row count a forward of ``rows`` rows runs in: the smallest that holds them,
        passing over those still compiling in the background."""
        return next(c for c in self.shapes.row_counts if c >= rows and c not in self._pending)

    def _rows(self, tokens: int, placement: list[list[int]], items: Sequence) -> dict[str, np.ndarray]:
        r, slots = len(placement), self.shapes.slots(tokens)
        b = {"input_ids": np.full((r, tokens), self.pad_id, np.int32),
             **{k: np.zeros((r, tokens), np.int32) for k in ("positions", "segment_ids", "branch_ids")},
             "reward_index": np.zeros((r, slots), np.int32)}
        for row, members in enumerate(placement):
            start = first = 0
            for j, i in enumerate(members):
                item = items[i]
                u = responses_unit(item) if is_unit(item) else _sequence_unit(item)
                end = start + len(u.ids)
                b["input_ids"][row, start:end], b["positions"][row, start:end] = u.ids, u.positions
                b["branch_ids"][row, start:end], b["segment_ids"][row, start:end] = u.branches, j + 1
                b["reward_index"][row, first : first + len(u.reward_at)] = start + u.reward_at
                start, first = end, first + len(u.reward_at)
        return b

    def _forward(self, b: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        self.compiled.add(b["input_ids"].shape)
        rewards, outputs = _rewards_and_outputs(self._graphdef, self._state, b["input_ids"], b["positions"],
                                                b["segment_ids"], b["reward_index"], b["branch_ids"])
        return np.asarray(rewards), np.asarray(outputs)

    def run_items(self, items: Sequence) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each item's rewards (one for a conversation, K for a unit) and, for an attribute head,
        its outputs (one row of N each): the items in rows (``PackedShapes.place``), run in
        forwards of the compiled shapes (one, for a batch ``plan`` cut)."""
        shapes = self.shapes
        tokens = [item_tokens(x) for x in items]
        placed = [(r, max(tokens[i] for i in r)) for r in shapes.place(tokens, [item_scores(x) for x in items])]
        short = [r for r, longest in placed if longest <= shapes.row]
        forwards = [(shapes.row, short[k : k + shapes.rows]) for k in range(0, len(short), shapes.rows)]
        forwards += [(shapes.long_size(longest), [r]) for r, longest in placed if longest > shapes.row]
        out: list = [None] * len(items)
        for tokens, rows in forwards:
            count = self.row_count(len(rows)) if tokens == shapes.row else 1
            rewards, outputs = self._forward(self._rows(tokens, rows + [[] for _ in range(count - len(rows))], items))
            for row, members in enumerate(rows):
                first = 0
                for i in members:
                    k = item_scores(items[i])
                    out[i] = (rewards[row, first : first + k],
                              outputs[row, first : first + k] if self.keeps_outputs else None)
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
        return score_planned(self, sequences, progress)


def score_planned(scorer, sequences: Sequence[np.ndarray], progress=None) -> np.ndarray:
    """Rewards of any number of sequences, in input order, as ``scorer`` (a packed or a one-a-row
    scorer) plans and runs them: its shapes' ``plan`` cuts the batches, its ``run`` scores each."""
    scores = np.zeros(len(sequences), np.float32)
    for batch in scorer.shapes.plan([len(s) for s in sequences]):
        scores[batch] = scorer.run([sequences[i] for i in batch])
        if progress:
            progress(len(batch))
    return scores


def _sequence_unit(seq: np.ndarray) -> ResponsesUnit:
    n = len(seq)
    return ResponsesUnit(np.asarray(seq, np.int32), np.arange(n, dtype=np.int32), np.zeros(n, np.int32),
                         np.asarray([n - 1], np.int32))
