"""The fixed batch shapes scoring compiles (``ScoringShapes``) and how a set of sequences is
planned into them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from rmflow.schemas.config import SCORING_BATCH_SIZE
from rmflow.trainer.data import bucket_length
from rmflow.trainer.data.collate import MIN_BUCKET

# Deterministic scoring's shapes (``ScoringShapes.deterministic_for``), one set for every caller so
# that a conversation runs in the same program (and gets the same bits) in every entry point: at
# most this many rows a forward, and this many tokens.
DETERMINISTIC_ROWS = 8
DETERMINISTIC_TOKENS = 16384

# A forward pass's fixed cost, in tokens, when ``ScoringShapes.plan`` weighs one batch against two:
# it keeps the plan from splitting a batch to save a few padded tokens.
BATCH_OVERHEAD_TOKENS = 64



@dataclasses.dataclass(frozen=True)
class ScoringShapes:
    """The fixed set of (rows, length) shapes scoring runs, so jit compiles each once (and a
    server compiles them all at load, never per request): lengths are the powers of two from 16
    below ``max_length``, then ``max_length``; a length's rows are ``token_budget // length``
    rounded down to a power of two, between 1 and ``max_rows``. With no token budget every
    length gets ``max_rows`` rows (``batch_size`` sequences a forward, what eval and the API do).
    ``small_batches``: each length also has every power of two of rows below its full count, so
    that a few sequences (a lone request on a quiet server, the half of the clients whose requests
    came in while the last batch ran) run in a forward their size, not a full one.

    ``deterministic``: every batch is one shape, the shape its items' own lengths (and ``groups``)
    set, with a length's one row count, whatever else is planned beside them (``plan`` always
    as with ``one_length``); an item then runs in the same compiled program, alone in its row,
    however it is batched, and its score is the same to the last bit (no small batches: each
    would be another program)."""

    max_length: int
    max_rows: int = SCORING_BATCH_SIZE
    token_budget: int | None = None
    small_batches: bool = False
    deterministic: bool = False

    @classmethod
    def deterministic_for(cls, positions: int) -> ScoringShapes:
        """The deterministic shapes of a model of ``positions`` positions: the same for every
        caller, whatever batch size, token budget or length limit it scores with, so that a
        conversation's program (and its score's every bit) depends on the model and its own length
        alone: power-of-two lengths, at most ``DETERMINISTIC_ROWS`` rows and
        ``DETERMINISTIC_TOKENS`` tokens a forward."""
        return cls(positions, max_rows=DETERMINISTIC_ROWS, token_budget=DETERMINISTIC_TOKENS, deterministic=True)

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.max_rows < 1 or (self.token_budget is not None and self.token_budget < 1):
            raise ValueError(f"scoring shapes need a positive max_length, max_rows and token budget: {self}")
        if self.deterministic and self.small_batches:
            raise ValueError("deterministic scoring shapes have one row count a length: no small batches")

    @property
    def lengths(self) -> tuple[int, ...]:
        out, n = [], MIN_BUCKET
        while n < self.max_length:
            out.append(n)
            n *= 2
        return (*out, self.max_length)

    def length_for(self, n: int) -> int:
        """The shortest length of the set that holds ``n`` tokens."""
        return bucket_length(n, self.max_length)

    def rows(self, length: int) -> int:
        if self.token_budget is None:
            return self.max_rows
        return max(1, min(self.max_rows, 1 << max(self.token_budget // length, 1).bit_length() - 1))

    def row_options(self, length: int) -> tuple[int, ...]:
        """The batch sizes compiled for ``length``, smallest first."""
        full = self.rows(length)
        if not self.small_batches:
            return (full,)
        return tuple(1 << k for k in range(full.bit_length()) if 1 << k < full) + (full,)

    def rows_for(self, n: int, length: int) -> int:
        """The smallest compiled batch size of ``length`` that holds ``n`` sequences."""
        return next(r for r in self.row_options(length) if r >= n)

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((r, n) for n in self.lengths for r in self.row_options(n))

    def describe(self, up_to: int, units: bool = False) -> str:
        """What a server of these shapes compiled at start-up: those up to ``up_to`` tokens
        (``units``: each also for K-response units)."""
        compiled = sum(n <= up_to for _, n in self.shapes)
        return (f"{compiled} batch shapes up to {up_to:,} tokens compiled{', each also for response units' if units else ''}"
                f"{', longer ones on first use' if up_to < self.max_length else ''}"
                f"{'; deterministic: each item alone in its row, in the shape its length sets' if self.deterministic else ''}")

    def plan(self, lengths: Sequence[int], *, one_length: bool = False,
             groups: Sequence[Any] | None = None) -> list[np.ndarray]:
        """Batches of indices into ``lengths``, shortest first, each fitting a shape of the set
        (at most the rows of the length its longest member needs).

        By default the cut costs the fewest padded tokens: the inputs sorted by length are
        split into consecutive batches by dynamic programming, a batch costing its padded shape
        (compiled rows x length) plus ``BATCH_OVERHEAD_TOKENS``. A few dozen queued requests
        of mixed lengths (a server's batch) then pad as little as a whole sorted dataset does.

        ``one_length``: a batch never spans two lengths of the set, nor two ``groups`` (what
        else fixes a batch's shape: a process model's step slots), so an input's padded shape
        depends on itself alone (and its score, to the last bit, on nothing else: what makes a
        Beam job's reruns byte-identical)."""
        if not len(lengths):
            return []
        if one_length or self.deterministic:
            return self._plan_by_shape(lengths, groups)
        sizes = np.asarray(lengths, np.int64)
        self.length_for(int(sizes.max()))  # the longest fits (or the error names the limit)
        order = np.argsort(sizes, kind="stable")
        padded = np.asarray(self.lengths)[np.searchsorted(self.lengths, sizes[order])]  # length_for, vectorised
        tables: dict[int, np.ndarray] = {}  # length -> compiled rows for a batch of k (index k)
        n = len(order)
        best, prev = np.zeros(n + 1), np.zeros(n + 1, np.int64)
        for j in range(1, n + 1):
            length = int(padded[j - 1])
            if length not in tables:
                tables[length] = np.asarray([0] + [self.rows_for(k, length) for k in range(1, self.rows(length) + 1)])
            table = tables[length]
            lo = max(0, j - (len(table) - 1))
            cost = best[lo:j] + table[j - np.arange(lo, j)] * length + BATCH_OVERHEAD_TOKENS
            k = int(np.argmin(cost))  # the first minimum: the largest batch among equals
            best[j], prev[j] = cost[k], lo + k
        cuts, j = [], n
        while j > 0:
            cuts.append((int(prev[j]), j))
            j = int(prev[j])
        return [order[a:b].astype(np.int64) for a, b in reversed(cuts)]

    def _plan_by_shape(self, lengths: Sequence[int], groups: Sequence[Any] | None) -> list[np.ndarray]:
        def key(i: int) -> tuple:
            return (self.length_for(int(lengths[i])), groups[i] if groups is not None else 0)

        order = sorted(np.argsort(np.asarray(lengths, np.int64), kind="stable"), key=lambda i: (key(i), lengths[i]))
        batches: list[list[int]] = []
        for i in order:
            length = self.length_for(int(lengths[i]))
            if not batches or len(batches[-1]) + 1 > self.rows(length) or key(batches[-1][0]) != key(i):
                batches.append([])
            batches[-1].append(int(i))
        return [np.asarray(b, np.int64) for b in batches]
