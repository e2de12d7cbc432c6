"""What a reward model outputs, in one table: its score head.

The other axis of a model is the data it trains on (``schemas.kinds``: a pair, a solution's
steps, a prompt's K responses). A head says what the model's outputs are and everything that
follows from them: how Hugging Face names the head and its labels, how PEFT names the task,
whether a conversation gets one scalar reward (which eval can normalise and the server can score
K responses of), what an answer carries beside the reward, and how the model card shows it.

* ``reward``: one output, the reward (Bradley-Terry on pairs or K responses).
* ``attributes``: one output per rated attribute (the regression objectives); the reward is their
  weighted sum; every answer carries the outputs by name too.
* ``step-classes``: two classes at each step's end, P(correct) (process reward models), exported
  as a token classifier as TRL and Axolotl do.
* ``ensemble``: one output per member of an ensemble trained on one backbone, each its own
  reward; the model's reward is their mean, or a conservative one (``MEMBER_REWARDS``: their
  minimum, or the mean minus a multiple of their spread); every answer carries the members'
  rewards, their mean and their spread.

Code that varies by head asks the model's head (``head_of``) for it; it never tests a model's
attributes or widths itself. A new head (say, an ensemble's N rewards) is one class and one entry
here, and its scorer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rmflow.schemas.errors import RmflowError

ATTRIBUTE_SCORES = "attribute_scores"  # an attribute head's outputs by name, beside each reward
RESPONSE_ATTRIBUTES = "response_attribute_scores"  # ... for each response of a K-response record
ATTRIBUTE_WEIGHTS = "attribute_weights"  # config.json's key for an attribute head's weights by name
ENSEMBLE_KEY = "rmflow_ensemble"  # config.json's key for an ensemble head: {"members": N, "reward": RULE}
MEMBER_SCORES, SCORE_MEAN, SCORE_STD = "member_scores", "score_mean", "score_std"  # an ensemble's answer
# An ensemble whose members have their own top layers exports one checkpoint per member, in
# MEMBER_FOLDER + its index, beside ENSEMBLE_FILE ({"members", "reward", "layers", "checkpoints"})
ENSEMBLE_FILE, MEMBER_FOLDER = "ensemble.json", "member-"
# An ensemble's reward over its members' (``member_reward``): their mean; their minimum; the mean
# minus LAMBDA times their standard deviation (a lower confidence bound; Coste et al., 2024)
MEMBER_REWARDS = ("mean", "min", "lcb:LAMBDA")


class UnknownHead(RmflowError, ValueError):
    """A score head of a width no head has."""


class HeadConfig(Protocol):
    """What a head reads of a model's configuration (``ModelConfig``, ``ScoreHead``)."""

    num_labels: int
    attributes: tuple[str, ...]
    attribute_weights: tuple[float, ...]
    members: int
    member_reward: str
    member_layers: int


def member_reward(rule: str) -> tuple[str, float]:
    """An ensemble's reward rule (``MEMBER_REWARDS``) as (``mean``, ``min`` or ``lcb``, its lambda);
    raises UnknownHead naming the forms."""
    rule = (rule or "mean").strip()
    if rule in ("mean", "min"):
        return rule, 0.0
    if rule.startswith("lcb:"):
        try:
            lam = float(rule[4:])
        except ValueError:
            lam = -1.0
        if 0 <= lam < float("inf"):
            return "lcb", lam
    raise UnknownHead(f"an ensemble's reward {rule!r}: use {', '.join(MEMBER_REWARDS)} (LAMBDA >= 0, e.g. lcb:1)")


@dataclasses.dataclass(frozen=True)
class Head:
    """A score head. ``kind``: the model kind it scores as (``schemas.kinds``); ``per_conversation``:
    one scalar reward per conversation (``rmflow eval --normalize`` standardises it; the server
    scores a prompt's K responses as units of one); ``bias``: the Hugging Face head it exports to
    has one; ``api``: the Python API's scoring methods for it, as users are told."""

    name: str
    kind: str
    outputs: int  # its width; 0: one per attribute
    hf_head: str  # the Hugging Face class suffix of an export ("ForSequenceClassification")
    bias: bool
    peft_task: str  # an exported adapter's PEFT task_type
    per_conversation: bool
    api: str
    hf_label_names: tuple[str, ...] = ()  # id2label's names, when fixed
    # the answer's fields beside the reward (``answer``), each with its name in a K-response
    # record's answer (a list, one a response); scoring keeps the head's outputs for them
    answer_keys: tuple[tuple[str, str], ...] = ()

    @property
    def keeps_outputs(self) -> bool:
        """Scoring keeps the head's outputs beside the reward (for the answer's fields)."""
        return bool(self.answer_keys)

    def describe(self, cfg: HeadConfig, kind_description: str) -> str:
        """The model, in words, as its card and messages say it."""
        return kind_description

    def hf_labels(self, cfg: HeadConfig) -> dict[str, str]:
        """An export's id2label."""
        return {str(i): n for i, n in enumerate(self.hf_label_names)}

    def hf_config(self, cfg: HeadConfig) -> dict[str, Any]:
        """What an export's config.json says of the head beyond its class and labels."""
        return {}

    def answer(self, outputs: Sequence[float] | None, cfg: HeadConfig) -> dict[str, Any]:
        """An answer's fields beside the reward, from a conversation's head outputs."""
        return {}

    def recipe(self, cfg: HeadConfig) -> dict[str, str]:
        """The model card's recipe entries the head scores by (over the train options)."""
        return {}

    def label_weights(self, cfg: HeadConfig) -> str | None:
        """The attribute weights its reward is the weighted sum by (name=weight,...), if any."""
        return None

    def usage(self, cfg: HeadConfig, kind_description: str) -> list[str]:
        """The model card's usage example's last lines: what the logits are, and the reward."""
        return [f"    logits = model(**ids).logits  # the score head's outputs: {kind_description}"]

    def loading(self, cfg: HeadConfig, auto_class: str) -> list[str]:
        """The model card's usage example's line that loads the export with transformers."""
        return [f'model = {auto_class}.from_pretrained("PATH").eval()']


@dataclasses.dataclass(frozen=True)
class AttributeHead(Head):
    """One output per attribute; the reward is their weighted sum (config.json's
    ``attribute_weights``, which ``ModelConfig.from_hf`` reads back)."""

    def describe(self, cfg: HeadConfig, kind_description: str) -> str:
        return (f"an outcome reward model with an attribute head: one output per attribute "
                f"({', '.join(cfg.attributes)}), the reward their weighted sum ({weights_text(cfg)})")

    def hf_labels(self, cfg: HeadConfig) -> dict[str, str]:
        return {str(i): n for i, n in enumerate(cfg.attributes)}

    def hf_config(self, cfg: HeadConfig) -> dict[str, Any]:
        return {ATTRIBUTE_WEIGHTS: dict(zip(cfg.attributes, cfg.attribute_weights))}

    def answer(self, outputs: Sequence[float] | None, cfg: HeadConfig) -> dict[str, Any]:
        return {} if outputs is None else {ATTRIBUTE_SCORES: dict(zip(cfg.attributes, (float(x) for x in outputs)))}

    def recipe(self, cfg: HeadConfig) -> dict[str, str]:
        return {ATTRIBUTE_WEIGHTS: weights_text(cfg)}

    def label_weights(self, cfg: HeadConfig) -> str | None:
        return weights_text(cfg)

    def usage(self, cfg: HeadConfig, kind_description: str) -> list[str]:
        weights = ", ".join(f"{w:g}" for w in cfg.attribute_weights)
        return [f"    logits = model(**ids).logits[0]  # one output per attribute: {', '.join(cfg.attributes)}",
                f"reward = float(logits @ torch.tensor([{weights}]))  # their weighted sum (config.json's "
                "attribute_weights)"]


@dataclasses.dataclass(frozen=True)
class EnsembleHead(Head):
    """One output per member; the reward is the rule ``member_reward`` names over them (config.json's
    ``rmflow_ensemble``, which ``ModelConfig.from_hf`` reads back)."""

    def describe(self, cfg: HeadConfig, kind_description: str) -> str:
        shared = (f"sharing all but the top {cfg.member_layers} layers, which each has its own"
                  if cfg.member_layers else "on one backbone")
        return (f"an outcome reward model with an ensemble head: {cfg.members} members {shared}, each a reward; the "
                f"reward {rule_text(cfg.member_reward)}")

    def hf_labels(self, cfg: HeadConfig) -> dict[str, str]:
        return {str(i): f"member_{i}" for i in range(cfg.members)}

    def hf_config(self, cfg: HeadConfig) -> dict[str, Any]:
        return {ENSEMBLE_KEY: {"members": cfg.members, "reward": cfg.member_reward}}

    def answer(self, outputs: Sequence[float] | None, cfg: HeadConfig) -> dict[str, Any]:
        if outputs is None:
            return {}
        values = [float(x) for x in outputs]
        mean = sum(values) / len(values)
        std = (sum((x - mean) ** 2 for x in values) / len(values)) ** 0.5
        return {MEMBER_SCORES: values, SCORE_MEAN: mean, SCORE_STD: std}

    def recipe(self, cfg: HeadConfig) -> dict[str, str]:
        return {"ensemble.members": str(cfg.members), "ensemble.reward": cfg.member_reward,
                **({"ensemble.layers": str(cfg.member_layers)} if cfg.member_layers else {})}

    def usage(self, cfg: HeadConfig, kind_description: str) -> list[str]:
        kind, lam = member_reward(cfg.member_reward)
        reward = {"mean": "logits.mean()", "min": "logits.min()",
                  "lcb": f"logits.mean() - {lam:g} * logits.std(unbiased=False)"}[kind]
        if cfg.member_layers:
            return [f"    logits = torch.cat([m(**ids).logits[0] for m in models])  # one reward per member "
                    f"({cfg.members})", f"reward = float({reward})  # {ENSEMBLE_FILE}'s reward: {cfg.member_reward}"]
        return [f"    logits = model(**ids).logits[0]  # one reward per ensemble member ({cfg.members})",
                f"reward = float({reward})  # config.json's rmflow_ensemble reward: {cfg.member_reward}"]

    def loading(self, cfg: HeadConfig, auto_class: str) -> list[str]:
        if not cfg.member_layers:
            return super().loading(cfg, auto_class)
        return [f"# one checkpoint per member: its own top {cfg.member_layers} layers over the shared ones",
                f'models = [{auto_class}.from_pretrained(f"PATH/{MEMBER_FOLDER}{{m}}").eval() '
                f"for m in range({cfg.members})]"]


def rule_text(rule: str) -> str:
    kind, lam = member_reward(rule)
    return {"mean": "is their mean", "min": "is their minimum",
            "lcb": f"is their mean minus {lam:g} x their standard deviation"}[kind]


def weights_text(cfg: HeadConfig) -> str:
    """An attribute head's weights as --attribute-weights takes them (name=weight,...)."""
    return ",".join(f"{n}={w:g}" for n, w in zip(cfg.attributes, cfg.attribute_weights))


REWARD = Head(name="reward", kind="outcome", outputs=1, hf_head="ForSequenceClassification", bias=False,
              peft_task="SEQ_CLS", per_conversation=True, api="score or score_pairs (a score per whole reply)",
              hf_label_names=("LABEL_0",))
ATTRIBUTES = AttributeHead(name="attributes", kind="outcome", outputs=0, hf_head="ForSequenceClassification",
                           bias=False, peft_task="SEQ_CLS", per_conversation=True,
                           api="score or score_pairs (a score per whole reply, the attributes' weighted sum)",
                           answer_keys=((ATTRIBUTE_SCORES, RESPONSE_ATTRIBUTES),))
STEP_CLASSES = Head(name="step-classes", kind="process", outputs=2,
                    hf_head="ForTokenClassification",  # a class per step end, as TRL and Axolotl export them
                    bias=True, peft_task="TOKEN_CLS", per_conversation=False,
                    api="score_steps([{'prompt': ..., 'completions': [step, ...]}]) (P(correct) for each step)",
                    hf_label_names=("incorrect", "correct"))
ENSEMBLE = EnsembleHead(name="ensemble", kind="outcome", outputs=0, hf_head="ForSequenceClassification", bias=False,
                        peft_task="SEQ_CLS", per_conversation=True,
                        api="score or score_pairs (a score per whole reply: the members' mean, or the rule asked)",
                        answer_keys=((MEMBER_SCORES, "response_member_scores"), (SCORE_MEAN, "response_score_means"),
                                     (SCORE_STD, "response_score_stds")))
HEADS: dict[str, Head] = {h.name: h for h in (REWARD, ATTRIBUTES, STEP_CLASSES, ENSEMBLE)}


def check_head(cfg: HeadConfig) -> None:
    """A head's configuration is one a head has: an attribute head one name and one weight per
    output, any other a known width. Raises UnknownHead naming what is wrong."""
    named = cfg.attributes or cfg.attribute_weights
    if named and not len(cfg.attributes) == len(cfg.attribute_weights) == cfg.num_labels:
        raise UnknownHead(f"an attribute head needs one name and one weight per output: num_labels {cfg.num_labels}, "
                          f"attributes {cfg.attributes}, attribute_weights {cfg.attribute_weights}")
    if cfg.members and (named or cfg.members < 2 or cfg.members != cfg.num_labels):
        raise UnknownHead(f"an ensemble head needs 2 or more members, one output each and no attributes: members "
                          f"{cfg.members}, num_labels {cfg.num_labels}, attributes {cfg.attributes}")
    member_reward(cfg.member_reward)
    if cfg.member_layers and not cfg.members:
        raise UnknownHead(f"member_layers {cfg.member_layers}: the top layers of an ensemble's members; this head "
                          "has no members")
    head_of(cfg)


def same_outputs(a: HeadConfig, b: HeadConfig) -> bool:
    """Whether two heads have the same outputs (their width and names; an attribute head's weights
    are a run's choice, not parameters)."""
    return (a.num_labels, a.attributes, a.members, a.member_layers) == (b.num_labels, b.attributes, b.members,
                                                                         b.member_layers)


def head_of(cfg: HeadConfig | Mapping[str, Any]) -> Head:
    """The head of a model configured by ``cfg`` (its attributes, else its width)."""
    get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
    if get("attributes", ()):
        return ATTRIBUTES
    if get("members", 0):
        return ENSEMBLE
    width = get("num_labels", 1)
    for head in HEADS.values():
        if head.outputs == width:
            return head
    widths = ", ".join(f"{h.name}: {h.outputs}" for h in HEADS.values() if h.outputs)
    widths += ", attributes: one per attribute, ensemble: one per member"
    raise UnknownHead(f"a score head of {width} outputs is no head rmflow knows ({widths})")
