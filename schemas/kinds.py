"""The kinds of data rmflow trains on, in one table every stage reads: one of a model's two axes.

A kind decides what a shard record is, which eval modes apply, what the statistics count and
what a user is told, and which score head its records train by default (``head``). What a model
outputs is the other axis, the head (``schemas.heads``: how wide, how Hugging Face and PEFT name
it, what an answer carries); a kind's own is ``kind.head``. Code that varies by kind reads a field of ``ModelKind`` (or looks its own behaviour up by
``ModelKind.name`` in a table checked complete by ``tests/project/test_kinds.py``); it never compares
kind names, record types or head widths itself; what varies by head it reads of ``head``.

* ``outcome``: preference pairs (``PairRecord``); one score per conversation; Bradley-Terry.
* ``process``: stepwise solutions (``StepRecord``); P(correct) at each step's end; per-step
  cross-entropy over 2 classes, exported as a token classifier as TRL and Axolotl do.
* ``multi-response``: one prompt with K scored or ranked responses (``ResponsesRecord``), its prompt
  computed once; a listwise loss (``trainer.objective``). The model it trains scores one
  conversation as an outcome model does (``scores_as``): it evaluates, exports, scores and serves
  as one.

A multi-response run's regression objectives give the model an attribute head
(``schemas.heads.ATTRIBUTES``: one output per rated attribute, its reward their weighted sum):
still an outcome model, whose head a model's configuration says (``schemas.heads.head_of``).

A new kind (say, a generative judge) is one entry here, its record type in
``schemas/record.py``, its rendering recipe (``rendering``), its objective in
``trainer/objective.py``, its scoring core in ``trainer/inference/cores.py`` and its handler set in
``rmflow/handlers.py``; ``tests/project/test_kinds.py`` names any that lacks it.
"""

from __future__ import annotations

import dataclasses

from rmflow.schemas.errors import RmflowError
from rmflow.schemas.heads import REWARD, STEP_CLASSES, Head
from rmflow.schemas.record import PairRecord, ResponsesRecord, StepRecord


class UnknownKind(RmflowError, ValueError):
    """A kind name or score-head width that no entry of ``KINDS`` has."""


@dataclasses.dataclass(frozen=True)
class ModelKind:
    name: str  # the manifest's and eval.json's ``kind``
    description: str  # "an outcome reward model (...)", for messages
    record: type  # the shard record type (schemas.record)
    head: Head  # the score head its records train by default (``schemas.heads``)
    unit: str  # what one record is, singular and plural, as users are told ("pair", "solution")
    units: str
    data: str  # the data it trains on, in words ("preference pairs")
    eval_modes: tuple[str, ...]  # the ``rmflow eval --mode`` values it accepts
    record_modes: tuple[str, ...]  # the ``rmflow eval --mode`` values that evaluate its records (shards or raw files)
    pairwise: bool  # scores come in chosen/rejected pairs (reward centering applies)
    counts_steps: bool  # the preprocessing statistics count steps (and incorrect ones)
    lengths: tuple[str, ...]  # the length histograms of its records' ``stat_lengths`` that a summary shows
    headline: tuple[str, ...]  # the eval metrics a workflow summary reports, in order
    scores_as: str = ""  # the kind of the model it trains, when another's (what a run records); "": itself

    @property
    def model(self) -> ModelKind:
        """The kind of the model trained on these records: what inference, eval, export, scoring
        and serving treat the run as."""
        return kind_named(self.scores_as) if self.scores_as else self


OUTCOME = ModelKind(
    name="outcome",
    description="an outcome reward model (one score per conversation)",
    record=PairRecord,
    head=REWARD,
    unit="pair",
    units="pairs",
    data="preference pairs",
    eval_modes=("pairs", "rewardbench-v1", "rewardbench-v2", "responses"),
    record_modes=("pairs", "rewardbench-v1"),
    pairwise=True,
    counts_steps=False,
    lengths=("prompt", "chosen", "rejected"),
    headline=("accuracy", "pairs"),
)
PROCESS = ModelKind(
    name="process",
    description="a process reward model (P(correct) for each step of a solution)",
    record=StepRecord,
    head=STEP_CLASSES,
    unit="solution",
    units="solutions",
    data="stepwise solutions",
    eval_modes=("pairs",),
    record_modes=("pairs",),
    pairwise=False,
    counts_steps=True,
    lengths=("prompt", "sequence", "steps"),
    headline=("step_accuracy", "first_error_accuracy", "solutions"),
)
RESPONSES = ModelKind(
    name="multi-response",
    description="an outcome reward model trained on K responses per prompt (one score per conversation)",
    record=ResponsesRecord,
    head=REWARD,
    unit="prompt",
    units="prompts",
    data="prompts with K scored responses",
    eval_modes=("pairs", "responses"),
    record_modes=("pairs", "responses"),
    pairwise=True,
    counts_steps=False,
    lengths=("prompt", "longest", "responses"),
    headline=("accuracy", "best_of_k_accuracy", "prompts"),
    scores_as="outcome",
)
KINDS: dict[str, ModelKind] = {k.name: k for k in (OUTCOME, PROCESS, RESPONSES)}


def kind_named(name: str) -> ModelKind:
    if name not in KINDS:
        raise UnknownKind(f"unknown reward model kind {name!r}; rmflow knows {', '.join(KINDS)}")
    return KINDS[name]


def kind_of_record(record: object) -> ModelKind:
    for k in KINDS.values():
        if isinstance(record, k.record):
            return k
    raise UnknownKind(f"{type(record).__name__} is the record of no reward model kind")


def kind_of_head(num_labels: int) -> ModelKind:
    """The kind of model a score head of ``num_labels`` outputs is (``schemas.heads``: the kind its
    head scores as; a kind that trains another kind's model is never the answer)."""
    from rmflow.schemas.heads import UnknownHead, head_of

    try:
        return kind_named(head_of({"num_labels": num_labels}).kind)
    except UnknownHead:
        raise UnknownKind(f"a score head of {num_labels} outputs is no reward model kind rmflow knows "
                          f"({', '.join(f'{k.name}: {k.head.outputs}' for k in KINDS.values() if not k.scores_as)})"
                          ) from None
