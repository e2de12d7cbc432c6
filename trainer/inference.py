"""One inference path: a trained reward model loaded with what scoring it needs, and the scoring
core every consumer shares (`rmflow eval`, `rmflow score`, the Python API, export, the reward
server and batch scoring).

``load_model`` reads a run directory (its newest or a given checkpoint) or an exported
checkpoint folder, local or remote, with its tokenizer folder, pad id, step separator and kind
(``schemas.kinds``). ``score_sequences`` / ``score_pairs`` / ``score_steps`` run it: pairs and
solutions packed as in training and scored by the training code's own forward. Nothing here
imports the training loop.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from rmflow.schemas import jsontext
from rmflow.schemas.config import SCORING_BATCH_SIZE, STEP_SEPARATOR
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.heads import head_of
from rmflow.schemas.kinds import OUTCOME as OUTCOME_KIND
from rmflow.schemas.kinds import PROCESS, RESPONSES, ModelKind, kind_named
from rmflow.schemas.manifest import RenderSpec
from rmflow.schemas.outputs import EXPORT_INFO
from rmflow.schemas.record import PairRecord, ResponsesRecord, StepRecord
from rmflow.trainer import storage
from rmflow.trainer.checkpoints import load_trained_model
from rmflow.trainer.data import PackCollate, StepPackCollate, bucket_length
from rmflow.trainer.data.collate import MIN_BUCKET
from rmflow.trainer.data.response_units import ResponsesPackCollate, record_values, units_in_rows
from rmflow.trainer.data.steps import MIN_STEP_SLOTS, record_step_values, step_slots
from rmflow.trainer.modeling.config import head_kind
from rmflow.trainer.modeling.convert import load_reward_model
from rmflow.trainer.modeling.decoder import RewardTransformer
from rmflow.trainer.objective import OUTCOME, pair_rewards
from rmflow.trainer.rundir import is_run_dir, tokenizer_fingerprint

NORMALIZATION_FILE = "reward_normalization.json"  # in a model folder: `rmflow eval --normalize`'s mean and std


def write_normalization(folder: str, stats: dict[str, Any]) -> None:
    """Store a reward model's score statistics (``mean``, ``std`` and what they were measured on)
    in its folder: rmflow's ``NORMALIZATION_FILE``, and, in a Hugging Face export, ``mean`` and
    ``std`` in its config.json too, where OpenRLHF's reward model reads them (its
    ``--normalize_reward``)."""
    with open(os.path.join(folder, NORMALIZATION_FILE), "w") as f:
        jsontext.dump(stats, f, indent=2)
    config = os.path.join(folder, "config.json")
    if os.path.exists(os.path.join(folder, EXPORT_INFO)) and os.path.exists(config):
        cfg = jsontext.read(config)
        cfg.update({"mean": float(stats["mean"]), "std": float(stats["std"])})
        with open(config, "w") as f:
            jsontext.dump(cfg, f, indent=2)


# The scoring forwards, jitted once per process: the model's structure (its nnx GraphDef, hashable and
# equal for two loads of one architecture) is a static argument and its parameters an ordinary one,
# so the compiled program holds no weights, and a model loaded again (a Beam worker's next DoFn, a
# second job in one process, the API after eval) or another checkpoint of the same run reuses
# every shape already traced and compiled in this process.
@functools.partial(jax.jit, static_argnums=0)
def _rewards(graphdef: nnx.GraphDef, state: nnx.State, ids, pos, seg, idx) -> jax.Array:
    return nnx.merge(graphdef, state)(ids, pos, seg, idx)


@functools.partial(jax.jit, static_argnums=0)
def _rewards_and_outputs(graphdef: nnx.GraphDef, state: nnx.State, ids, pos, seg, idx, branches=None
                         ) -> tuple[jax.Array, jax.Array]:
    """The rewards and the score head's outputs (an attribute head's: one per attribute)."""
    model = nnx.merge(graphdef, state)
    outputs = model.logits(ids, pos, seg, idx, branches)
    return model.reward_of(outputs), outputs


@functools.partial(jax.jit, static_argnums=0)
def _step_probabilities(graphdef: nnx.GraphDef, state: nnx.State, ids, pos, seg, idx, branches=None) -> jax.Array:
    logits = nnx.merge(graphdef, state).logits(ids, pos, seg, idx, branches)
    return jax.nn.softmax(logits, axis=-1)[..., 1]


@functools.partial(jax.jit, static_argnums=0)
def _packed_pair_rewards(graphdef: nnx.GraphDef, state: nnx.State, batch: dict) -> tuple[jax.Array, jax.Array]:
    return pair_rewards(nnx.merge(graphdef, state), batch)


# A forward pass's fixed cost, in tokens, when ``ScoringShapes.plan`` weighs one batch against two:
# it keeps the plan from splitting a batch to save a few padded tokens.
BATCH_OVERHEAD_TOKENS = 64


class ModelLoadError(RmflowError):
    """The path names no trained reward model rmflow can load; the message says what to give."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer_dir: str | None  # None: no tokenizer files (callers that need one say so)
    pad_id: int
    description: str  # which weights: the run and step, or the checkpoint folder
    folder: str = ""  # the local folder it was read from (a copy, for a remote one)
    render: RenderSpec | None = None  # how its training data was rendered, when its run or export says (RenderSpec)
    step: int | None = None  # the checkpoint step (a run's, or the one an export was made from)
    run: str | None = None  # the run directory the weights come from, when known
    trained_max_length: int | None = None  # its training data's max_length, when known (a run, an export)
    recorded_kind: str | None = None  # the kind its run or export recorded (None: a checkpoint rmflow did not make)
    label_weights: str | None = None  # the attribute weights its training data's scores were the weighted sums of

    def identity(self) -> dict[str, Any]:
        """What a scorer reports with its scores: the weights (run and step), the kind and the
        tokenizer's fingerprint (the same hash the manifest keeps, chat template included)."""
        return {"description": self.description, "run": self.run, "step": self.step, "kind": self.kind.name,
                "tokenizer_hash": tokenizer_fingerprint(self.tokenizer_dir) if self.tokenizer_dir else None}

    @property
    def step_separator(self) -> str:
        """A process model's: the text after every step, as in its training data."""
        return self.render.step_separator if self.render else STEP_SEPARATOR

    @property
    def normalization(self) -> dict[str, Any] | None:
        """The mean and std `rmflow eval --normalize` stored with the model, or None."""
        path = os.path.join(self.folder, NORMALIZATION_FILE)
        if not os.path.exists(path):
            return None
        return jsontext.read(path)

    @property
    def kind(self) -> ModelKind:
        """Its reward model kind (``schemas.kinds``): the one its run or export recorded; for a
        checkpoint rmflow did not make, the one its Hugging Face head is exported as (its only
        identity there)."""
        return kind_named(self.recorded_kind) if self.recorded_kind else self.model.config.kind



BARE_HEAD_SEED = 0  # a base model's fresh score head (``load_reward_model``'s default seed)


def load_model(path: str, step: int | str | None = None) -> LoadedModel:
    """A run directory (its newest checkpoint, or ``step``) or a checkpoint folder, local or
    remote (copied down first): an export, any ``*ForSequenceClassification`` reward model, or a
    base model (a causal LM), which gets a fresh score head seeded with ``BARE_HEAD_SEED``, so
    the untrained baseline is scored, evaluated and served like any model."""
    path = storage.stage_run(path)
    if is_run_dir(path):
        model, run, step = load_trained_model(path, step)
        return LoadedModel(model, run.tokenizer_dir, run.pad_id,
                           f"run {os.path.abspath(path)}, checkpoint step {step} (base: {run.config.model.path})", path,
                           run.manifest.render, step, os.path.abspath(path),
                           run.manifest.max_length, run.manifest.model_kind, run.manifest.label_weights)
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path} does not exist: give a run directory (`rmflow train --output`) or an "
                             "exported checkpoint folder")
    if step is not None:
        raise ModelLoadError(f"{path} is an exported checkpoint (one set of weights): --step applies to run directories")
    model = load_reward_model(path, seed=BARE_HEAD_SEED)
    raw = jsontext.read(os.path.join(path, "config.json"))
    pad = raw.get("pad_token_id") or 0
    description = f"checkpoint {os.path.abspath(path)}"
    if head_kind(raw) is None:  # a base model, scored as it is: the untrained baseline
        description += f" (a base model with a fresh score head, seeded with {BARE_HEAD_SEED}: untrained)"
    info = os.path.join(path, EXPORT_INFO)
    render, exported = None, {}
    if os.path.exists(info):
        exported = jsontext.read(info)
        description += f" (exported from run {exported.get('run')}, step {exported.get('step')})"
        render = exported_render(exported)
    loaded = LoadedModel(model, path if tokenizer_fingerprint(path) else None, pad, description, path, render,
                         exported.get("step"), exported.get("run"), exported.get("max_length"), exported.get("kind"),
                         exported.get("label_weights"))
    if loaded.kind != model.config.kind:
        raise ModelLoadError(f"{path}: {EXPORT_INFO} says it is {loaded.kind.description}; its config.json has "
                             f"{model.config.num_labels} output(s), {model.config.kind.description}")
    return loaded



def exported_render(exported: dict[str, Any]) -> RenderSpec:
    """The ``RenderSpec`` an export's info records; from an export made before it was written
    there, the same from the fields it had (the tokenizer's hash, the step separator)."""
    if "render" in exported:
        return RenderSpec.from_dict(exported["render"])
    return RenderSpec(exported.get("tokenizer_sha256", ""), None, None, exported.get("step_separator", STEP_SEPARATOR))


def require_tokenizer(model_path: str, tokenizer: str | None, why: str) -> str:
    if tokenizer is None:
        raise ModelLoadError(f"{model_path} has no tokenizer files (tokenizer.json ...), which {why} needs: copy "
                             "the tokenizer the model was trained with into it")
    return tokenizer



@dataclasses.dataclass(frozen=True)
class ScoringShapes:
    """The fixed set of (rows, length) shapes scoring runs, so jit compiles each once (and a
    server compiles them all at load, never per request): lengths are the powers of two from 16
    below ``max_length``, then ``max_length``; a length's rows are ``token_budget // length``
    rounded down to a power of two, between 1 and ``max_rows``. With no token budget every
    length gets ``max_rows`` rows (``batch_size`` sequences a forward, what eval and the API do).
    ``small_batches``: each length also has every power of two of rows below its full count, so
    that a few sequences (a lone request on a quiet server, the half of the clients whose requests
    came in while the last batch ran) run in a forward their size, not a full one."""

    max_length: int
    max_rows: int = SCORING_BATCH_SIZE
    token_budget: int | None = None
    small_batches: bool = False

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.max_rows < 1 or (self.token_budget is not None and self.token_budget < 1):
            raise ValueError(f"scoring shapes need a positive max_length, max_rows and token budget: {self}")

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
        if one_length:
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

    def run_outputs(self, sequences: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """Rewards of one batch and, for an attribute head, its outputs (B, N); else None."""
        length = self.shapes.length_for(max(len(s) for s in sequences))
        if len(sequences) > self.shapes.rows(length):
            raise ValueError(f"{len(sequences)} sequences of up to {length} tokens: a batch holds "
                             f"{self.shapes.rows(length)}")
        rows = self.shapes.rows_for(len(sequences), length)
        ids = np.full((rows, length), self.pad_id, np.int32)
        seg = np.zeros_like(ids)
        last = np.zeros(rows, np.int32)
        for row, s in enumerate(sequences):
            ids[row, : len(s)], seg[row, : len(s)], last[row] = s, 1, len(s) - 1
        rewards, outputs = self._run_padded(ids, seg, last)
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

    def score(self, sequences: Sequence[np.ndarray], progress=None) -> np.ndarray:
        """Rewards of any number of sequences (each at its last token), in input order."""
        scores = np.zeros(len(sequences), np.float32)
        for batch in self.shapes.plan([len(s) for s in sequences]):
            scores[batch] = self.run([sequences[i] for i in batch])
            if progress:
                progress(len(batch))
        return scores


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
        length = self.shapes.length_for(max(len(ids) for ids, _ in solutions))
        if len(solutions) > self.shapes.rows(length):
            raise ValueError(f"{len(solutions)} solutions of up to {length} tokens: a batch holds "
                             f"{self.shapes.rows(length)}")
        rows = self.shapes.rows_for(len(solutions), length)
        ids = np.full((rows, length), self.pad_id, np.int32)
        seg = np.zeros_like(ids)
        idx = np.zeros((rows, max(self.slots(s) for s in solutions)), np.int32)
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


# Each reward model kind's (schemas.kinds) scorer: a score per sequence, or P(correct) per step.
SCORING_CORES = {OUTCOME_KIND.name: SequenceScorer, PROCESS.name: StepScorer, RESPONSES.name: SequenceScorer}


def score_sequences(model: RewardTransformer, sequences: Sequence[np.ndarray], *, batch_size: int = SCORING_BATCH_SIZE,
                    pad_id: int = 0, progress=None) -> np.ndarray:
    """The reward of each token sequence (at its last token), ``batch_size`` a forward in length
    order, in power-of-two lengths; returned in the input order (a one-off ``SequenceScorer``)."""
    if not len(sequences):
        return np.zeros(0, np.float32)
    shapes = ScoringShapes(max(len(s) for s in sequences), max_rows=batch_size)
    return SequenceScorer(model, shapes, pad_id=pad_id).score(sequences, progress)


def score_pairs(model: RewardTransformer, records: Sequence[PairRecord], *, batch_size: int = SCORING_BATCH_SIZE,
                max_length: int | None = None, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rewards of chosen and rejected for each record, in order: the records packed as in
    training (``PackCollate``, one row) and scored by the same ``pair_rewards``."""
    longest = max(max(len(r.chosen_ids), len(r.rejected_ids)) for r in records)
    collate = PackCollate(batch_size, max(max_length or 0, longest), pad_id)
    graphdef, state = nnx.split(model)
    rc, rr = [], []
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        b = collate(chunk)
        c, r = (np.asarray(x) for x in _packed_pair_rewards(graphdef, state, {k: b[k] for k in OUTCOME.device_keys}))
        rc.append(c[b["pair_slot"]])
        rr.append(r[b["pair_slot"]])
    return np.concatenate(rc), np.concatenate(rr)



def score_responses(model: RewardTransformer, records: Sequence[ResponsesRecord], *, tokens: int = 8192,
                    max_length: int | None = None, pad_id: int = 0) -> list[np.ndarray]:
    """The reward of each response of each record, in order, each prompt computed once: the
    records packed as in training (``ResponsesPackCollate``, one row of about ``tokens`` tokens,
    or one record) and scored at every response's reward token."""
    return score_responses_outputs(model, records, tokens=tokens, max_length=max_length, pad_id=pad_id)[0]


def score_responses_outputs(model: RewardTransformer, records: Sequence[ResponsesRecord], *, tokens: int = 8192,
                            max_length: int | None = None, pad_id: int = 0
                            ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``score_responses``, and the score head's outputs of each response of each record, (K, N)
    (an attribute head's: one per attribute)."""
    graphdef, state = nnx.split(model)
    out: list[np.ndarray] = []
    heads: list[np.ndarray] = []
    start = 0
    while start < len(records):
        end, size = start, 0
        while end < len(records) and (end == start or size + records[end].unit_len <= tokens):
            size += records[end].unit_len
            end += 1
        chunk = records[start:end]
        longest = max(r.prompt_len + max(len(x) for x in r.responses) for r in chunk)
        b = ResponsesPackCollate(len(chunk), max(max_length or 0, longest), pad_id)(chunk)
        rewards, outputs = _rewards_and_outputs(graphdef, state, *(b[k] for k in (
            "input_ids", "positions", "segment_ids", "reward_index", "branch_ids")))
        out += record_values(np.asarray(rewards), b["record_slots"])
        heads += record_values(np.asarray(outputs), b["record_slots"])
        start = end
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


def score_steps(model: RewardTransformer, records: Sequence[StepRecord], *, batch_size: int = SCORING_BATCH_SIZE,
                max_length: int | None = None, pad_id: int = 0) -> list[np.ndarray]:
    """P(correct) of each step of each record, in order: the records packed as in training
    (``StepPackCollate``, one row) and scored by the model's step logits."""
    longest = max(len(r.input_ids) for r in records)
    collate = StepPackCollate(batch_size, max(max_length or 0, longest), pad_id)
    graphdef, state = nnx.split(model)
    out: list[np.ndarray] = []
    for i in range(0, len(records), batch_size):
        b = collate(records[i : i + batch_size])
        p = np.asarray(_step_probabilities(graphdef, state, *(b[k] for k in (
            "input_ids", "positions", "segment_ids", "reward_index", "branch_ids"))))
        out += record_step_values(p, b["record_steps"])
    return out
