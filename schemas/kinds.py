"""The kinds of reward model rmflow trains, in one table every stage reads.

A kind decides what a shard record is, how wide the score head is, how Hugging Face names
the head, which eval modes apply, what the statistics count and what a user is told. Code
that varies by kind reads a field of ``ModelKind`` (or looks its own behaviour up by
``ModelKind.name`` in a table checked complete by ``tests/test_kinds.py``); it never compares
kind names or head widths itself.

* ``outcome``: preference pairs (``PairRecord``); one score per conversation; Bradley-Terry.
* ``process``: stepwise solutions (``StepRecord``); P(correct) at each step's end; per-step
  cross-entropy over 2 classes, exported as a token classifier as TRL and Axolotl do.
* ``multi-response``: one prompt with K scored or ranked responses (``ResponsesRecord``), its prompt
  computed once; a listwise loss (``trainer.objective``). The model it trains scores one
  conversation as an outcome model does (``scores_as``): it evaluates, exports, scores and serves
  as one.

A multi-response run's regression objectives give the model an attribute head (one output per
rated attribute, its reward their weighted sum): still an outcome model, whose score head
``trainer.modeling.config.ScoreHead`` describes; ``kind_of_head`` knows only the kinds' own heads.

A new kind (say, a generative judge) is one entry here, its record type in
``schemas/record.py``, its rendering recipe (``rendering``), its objective in
``trainer/objective.py``, its scoring core in ``trainer/inference.py`` and its handler set in
``rmflow/handlers.py``; ``tests/test_kinds.py`` names any that lacks it.
"""

from __future__ import annotations

import dataclasses

from rmflow.schemas.errors import RmflowError
from rmflow.schemas.record import PairRecord, ResponsesRecord, StepRecord


class UnknownKind(RmflowError, ValueError):
    """A kind name or score-head width that no entry of ``KINDS`` has."""


@dataclasses.dataclass(frozen=True)
class ModelKind:
    name: str  # the manifest's and eval.json's ``kind``
    description: str  # "an outcome reward model (...)", for messages
    record: type  # the shard record type (schemas.record)
    num_labels: int  # width of the score head
    unit: str  # what one record is, singular and plural, as users are told ("pair", "solution")
    units: str
    data: str  # the data it trains on, in words ("preference pairs")
    hf_head: str  # the Hugging Face class suffix of an export ("ForSequenceClassification")
    head_bias: bool  # the score head has a bias (as the Hugging Face head it exports to)
    hf_labels: dict[str, str]  # an export's id2label
    peft_task: str  # an exported adapter's PEFT task_type
    eval_modes: tuple[str, ...]  # the ``rmflow eval --mode`` values it accepts
    record_modes: tuple[str, ...]  # the ``rmflow eval --mode`` values that evaluate its records (shards or raw files)
    pairwise: bool  # scores come in chosen/rejected pairs (reward centering applies)
    normalizable: bool  # one scalar score per conversation, which ``rmflow eval --normalize`` standardises
    counts_steps: bool  # the preprocessing statistics count steps (and incorrect ones)
    lengths: tuple[str, ...]  # the length histograms of its records' ``stat_lengths`` that a summary shows
    headline: tuple[str, ...]  # the eval metrics a workflow summary reports, in order
    api: str  # the Python API's scoring methods for it (``rmflow.RewardModel``), as users are told
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
    num_labels=1,
    unit="pair",
    units="pairs",
    data="preference pairs",
    hf_head="ForSequenceClassification",
    head_bias=False,
    hf_labels={"0": "LABEL_0"},
    peft_task="SEQ_CLS",
    eval_modes=("pairs", "rewardbench-v1", "rewardbench-v2", "responses"),
    record_modes=("pairs", "rewardbench-v1"),
    pairwise=True,
    normalizable=True,
    counts_steps=False,
    lengths=("prompt", "chosen", "rejected"),
    headline=("accuracy", "pairs"),
    api="score or score_pairs (a score per whole reply)",
)
PROCESS = ModelKind(
    name="process",
    description="a process reward model (P(correct) for each step of a solution)",
    record=StepRecord,
    num_labels=2,
    unit="solution",
    units="solutions",
    data="stepwise solutions",
    hf_head="ForTokenClassification",  # a class per step end, as TRL and Axolotl export them
    head_bias=True,
    hf_labels={"0": "incorrect", "1": "correct"},
    peft_task="TOKEN_CLS",
    eval_modes=("pairs",),
    record_modes=("pairs",),
    pairwise=False,
    normalizable=False,
    counts_steps=True,
    lengths=("prompt", "sequence", "steps"),
    headline=("step_accuracy", "first_error_accuracy", "solutions"),
    api="score_steps([{'prompt': ..., 'completions': [step, ...]}]) (P(correct) for each step)",
)
RESPONSES = ModelKind(
    name="multi-response",
    description="an outcome reward model trained on K responses per prompt (one score per conversation)",
    record=ResponsesRecord,
    num_labels=1,
    unit="prompt",
    units="prompts",
    data="prompts with K scored responses",
    hf_head="ForSequenceClassification",
    head_bias=False,
    hf_labels={"0": "LABEL_0"},
    peft_task="SEQ_CLS",
    eval_modes=("pairs", "responses"),
    record_modes=("pairs", "responses"),
    pairwise=True,
    normalizable=True,
    counts_steps=False,
    lengths=("prompt", "longest", "responses"),
    headline=("accuracy", "best_of_k_accuracy", "prompts"),
    api="score or score_pairs (a score per whole reply)",
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
    """The kind of model a score head of ``num_labels`` outputs is (a kind that trains another
    kind's model is never the answer)."""
    for k in KINDS.values():
        if k.num_labels == num_labels and not k.scores_as:
            return k
    raise UnknownKind(f"a score head of {num_labels} outputs is no reward model kind rmflow knows "
                      f"({', '.join(f'{k.name}: {k.num_labels}' for k in KINDS.values())})")
