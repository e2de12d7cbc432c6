"""What a run trains, by the kind of its shards (the manifest's ``kind``, ``schemas.kinds``):
each reward model kind's training strategy, its batch keys, loss, metrics and collations.

* ``outcome``: preference pairs; Bradley-Terry with margin and reward centering
  (``trainer.loss.pairwise_loss``); normalised by the number of pairs.
* ``process``: stepwise solutions; cross-entropy over 2 classes at each labelled step's end
  (``trainer.loss.step_loss``); normalised by the number of labelled steps, as TRL's PRMTrainer
  averages over every labelled token of the batch.
* ``multi-response``: K scored responses per prompt, the prompt computed once; a ranking loss over
  each prompt's responses (``trainer.loss.listwise_loss``: Bradley-Terry over every pair whose
  scores differ, or Plackett-Luce over the ranking, the config's ``objective``) with reward
  centering; normalised by the number of prompts. The regression objectives (``regression``, and
  a ranking loss ``+regression``) give the model an attribute head, one output per attribute the
  records keep, fitted to the ratings by squared error (``trainer.loss.regression_sums``), the
  reward the outputs' weighted sum, which the ranking loss and the metrics take.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from rmflow.schemas import kinds
from rmflow.schemas.attributes import parse_weights, weights_over
from rmflow.schemas.config import SCORED_BY_WEIGHTS
from rmflow.schemas.kinds import ModelKind
from rmflow.schemas.manifest import Manifest
from rmflow.schemas.options import ConfigError
from rmflow.schemas.train_config import OBJECTIVES as CONFIG_OBJECTIVES
from rmflow.schemas.train_config import EnsembleConfig, TrainConfig, fits_ratings, ranking_loss
from rmflow.trainer.data.collate import Collate
from rmflow.trainer.data.packing import PackCollate
from rmflow.trainer.data.response_units import ResponsesCollate, ResponsesPackCollate
from rmflow.trainer.data.steps import StepCollate, StepPackCollate
from rmflow.trainer.loss import (
    RANKING_LOSSES,
    RANKING_SUM_KEYS,
    REGRESSION_SUM_KEYS,
    STEP_SUM_KEYS,
    SUM_KEYS,
    listwise_loss,
    merge_sums,
    pair_metrics_of_sums,
    pairwise_loss,
    ranking_metrics_of_sums,
    regression_metrics_of_sums,
    regression_sums,
    step_loss,
    step_metrics_of_sums,
)
from rmflow.trainer.modeling.config import ScoreHead

ROW_KEYS = ("input_ids", "positions", "segment_ids", "branch_ids")
ROUTER_SUM = "router_aux_sum"  # a mixture of experts' load-balancing loss, summed over units (``step._loss``)
_MODEL_ARGS = ("input_ids", "positions", "segment_ids", "reward_index", "branch_ids")


def pair_rewards(model, batch: dict[str, Any]) -> tuple[Any, Any]:
    """Chosen and rejected rewards, one per pair slot, from one forward pass over a batch in
    the shared layout (``trainer.data.collate``): padded rows or packed rows alike."""
    pairs = model(*(batch[k] for k in _MODEL_ARGS)).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def bootstrap_weights(keys: jax.Array, members: int) -> jax.Array:
    """Each member's weight of each pair, (pairs, members): a Poisson(1) draw from the pair's key
    and the member's index (the online bootstrap, Oza and Russell 2001: each member sees its own
    resample of the pairs, the same one every epoch and after a resume)."""
    def draw(key, m):
        return jax.random.poisson(jax.random.fold_in(jax.random.fold_in(jax.random.key(0), m), key), 1.0)

    return jax.vmap(lambda k: jax.vmap(lambda m: draw(k, m))(jnp.arange(members)))(keys).astype(jnp.float32)


def _pairwise(model, mb: dict[str, Any], center_coef: float, bootstrap: bool = False):
    if model.config.members:  # an ensemble: each member's loss, their mean; the metrics the reward's
        members = model.config.members
        outputs = model.logits(*(mb[k] for k in _MODEL_ARGS)).reshape(-1, 2, members)
        weights = mb["weight"][:, None] * (bootstrap_weights(mb["pair_key"], members) if bootstrap
                                           else jnp.ones((1, members), jnp.float32))
        each = jax.vmap(lambda c, r, w: pairwise_loss(c, r, mb["margin"], w, center_coef)[1], in_axes=-1)(
            outputs[:, 0], outputs[:, 1], weights)
        reward = model.reward_of(outputs)
        _, sums = pairwise_loss(reward[:, 0], reward[:, 1], mb["margin"], mb["weight"], center_coef)
        return jnp.mean(each["bt_loss_sum"] + center_coef * each["center_sum"]), sums
    chosen, rejected = pair_rewards(model, mb)
    _, sums = pairwise_loss(chosen, rejected, mb["margin"], mb["weight"], center_coef)
    return sums["bt_loss_sum"] + center_coef * sums["center_sum"], sums


def _pairwise_bootstrapped(model, mb: dict[str, Any], center_coef: float):
    """``_pairwise`` of an ensemble whose members each weigh the pairs by their bootstrap draws (one
    function, so that a run's step program hashes alike in every call)."""
    return _pairwise(model, mb, center_coef, bootstrap=True)


def _stepwise(model, mb: dict[str, Any], center_coef: float):
    _, sums = step_loss(model.logits(*(mb[k] for k in _MODEL_ARGS)), mb["step_labels"], mb["step_weight"])
    return sums["loss_sum"], sums


def _listwise(ranking: str):
    def loss(model, mb: dict[str, Any], center_coef: float):
        def sums_of(rewards):
            return listwise_loss(rewards, mb["response_scores"], mb["response_group"], center_coef, ranking,
                                 mb["response_margins"])[1]

        if model.config.members:  # an ensemble: each member's loss, their mean; the metrics the reward's
            outputs = model.logits(*(mb[k] for k in _MODEL_ARGS))
            sums = sums_of(model.reward_of(outputs))
            return jnp.mean(jax.vmap(sums_of, in_axes=-1)(outputs)["loss_sum"]), sums
        sums = sums_of(model(*(mb[k] for k in _MODEL_ARGS)))
        return sums["loss_sum"], sums

    return loss


def _with_regression(ranking: str):
    """The regression objectives: squared error of the attribute head's outputs on the ratings,
    plus ``ranking``'s loss of the reward (their weighted sum) when one is named; centering as for
    the ranking losses; the ranking sums are kept for the metrics either way."""
    def loss(model, mb: dict[str, Any], center_coef: float):
        outputs = model.logits(*(mb[k] for k in _MODEL_ARGS))  # (R, S, N)
        _, sums = listwise_loss(model.reward_of(outputs), mb["response_scores"], mb["response_group"], center_coef,
                                ranking or RANKING_LOSSES[0], mb["response_margins"])
        reg = regression_sums(outputs, mb["response_attributes"], mb["response_group"])
        total = (sums["rank_loss_sum"] if ranking else 0.0) + center_coef * sums["center_sum"] + reg["mse_sum"]
        return total, {**sums, **reg, "loss_sum": total}

    return loss


@dataclasses.dataclass(frozen=True)
class Objective:
    kind: ModelKind
    device_keys: tuple[str, ...]  # what the jitted step receives
    slot_keys: tuple[str, ...]  # (R, S) keys whose S differs between micro-batches (padded to one S)
    sum_keys: tuple[str, ...]
    count_key: str  # the sum the gradient is divided by
    metrics_of_sums: Callable[[dict[str, float]], dict[str, Any]]
    # (model, micro-batch, center_coef) -> (summed objective to differentiate, metric sums)
    loss: Callable[[Any, dict[str, Any], float], tuple[Any, dict[str, Any]]]
    padded: type  # the collation of one record a padded row (trainer.data: none and bucket modes)
    packed: type  # the collation of records packed into long rows (pack mode)
    ranking: str = ""  # the config's ``objective``, for a kind that has a choice (``CONFIG_OBJECTIVES``)
    attributes: tuple[str, ...] = ()  # a regression objective's attributes, for its metrics (``for_config``)
    model_head: ScoreHead = ScoreHead()  # the score head it trains on the run's data (``for_config``)

    @property
    def name(self) -> str:
        """The objective's key in ``OBJECTIVES``: its kind's name, with its ranking loss if not the first."""
        return self.kind.name if self.ranking in ("", RANKING_LOSSES[0]) else f"{self.kind.name}:{self.ranking}"

    @property
    def uses_margins(self) -> bool:
        """Its loss reads the records' margins (``--margin-from-scores``): a Bradley-Terry loss's."""
        return self.kind.pairwise and ranking_loss(self.ranking) in ("", RANKING_LOSSES[0])

    @property
    def regression(self) -> bool:
        """Trains an attribute head (one output per attribute) on the records' ratings."""
        return fits_ratings(self.ranking)

    def head(self, manifest: Manifest, attribute_weights: str = "", ensemble: EnsembleConfig | None = None
             ) -> ScoreHead:
        """The score head a run of this objective trains on ``manifest``'s shards: its kind's, an
        ensemble's (``ensemble.members`` outputs), or an attribute head over the attributes the
        records keep, weighted by ``attribute_weights`` (name=weight,...; empty: those
        preprocessing scored the responses by)."""
        if ensemble is not None and ensemble.members:
            if self.regression or not self.kind.pairwise:
                raise ConfigError(f"ensemble.members {ensemble.members}: an ensemble of reward heads trains on pairs "
                                  f"or ranked responses; this run trains "
                                  f"{'an attribute head' if self.regression else self.kind.description}")
            if ensemble.bootstrap and self.kind is not kinds.OUTCOME:
                raise ConfigError("ensemble.bootstrap resamples preference pairs; K responses per prompt train each "
                                  "member on every prompt (drop ensemble.bootstrap)")
            return ScoreHead(ensemble.members, members=ensemble.members, member_reward=ensemble.reward,
                             member_layers=ensemble.layers)
        if not self.regression:
            return ScoreHead(self.kind.head.outputs)
        names = manifest.attributes
        if not names:
            raise ConfigError(f"objective {self.ranking} fits the responses' attribute ratings, which these shards "
                              "do not keep: preprocess with --attributes NAME,NAME,... (the ratings to keep)")
        given = attribute_weights.strip()
        if not given and not manifest.scored_by_weights:
            raise ConfigError(f"objective {self.ranking}: give --attribute-weights NAME=WEIGHT,... over "
                              f"{', '.join(names)} (the reward is the outputs' weighted sum); only shards of a layout "
                              f"always scored by preprocessing's weights ({', '.join(SCORED_BY_WEIGHTS)}) take those "
                              "by default")
        weights = parse_weights(attribute_weights if given else manifest.config.get("attribute_weights") or "")
        what = "attribute_weights" if given else "the shards' scores (preprocess's attribute_weights)"
        return ScoreHead(len(names), names, weights_over(names, weights, what))

    def for_data(self, manifest: Manifest, attribute_weights: str = "", ensemble: EnsembleConfig | None = None
                 ) -> Objective:
        """This objective on ``manifest``'s shards: with the score head it trains there (``head``)
        and, for a regression, the attribute names its metrics name."""
        head = self.head(manifest, attribute_weights, ensemble)
        loss = _pairwise_bootstrapped if ensemble is not None and ensemble.bootstrap else self.loss
        return dataclasses.replace(self, model_head=head, attributes=head.attributes if self.regression else (),
                                   loss=loss)

    def fits(self, head: ScoreHead) -> bool:
        """``head`` is one this objective trains."""
        if head.members or self.model_head.members:
            return (head.members, head.member_layers) == (self.model_head.members, self.model_head.member_layers)
        return bool(head.attributes) == self.regression and (self.regression or head.num_labels == self.kind.head.outputs)

    def with_router(self) -> Objective:
        """This objective for a mixture of experts: its sums and metrics also the router's
        load-balancing loss (``router_aux_loss``, per unit)."""
        return dataclasses.replace(self, sum_keys=self.sum_keys + (ROUTER_SUM,))

    def merge(self, a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...] = ()) -> dict[str, Any]:
        """Two batches' metric statistics (of ``keys``, by default ``sum_keys``) as one: sums
        added, a regression's centred moments merged (``merge_sums``); on the device and on the
        host alike."""
        return merge_sums(a, b, keys or self.sum_keys)

    def metrics(self, sums: dict[str, Any]) -> dict[str, Any]:
        out = regression_metrics_of_sums(sums, self.attributes) if self.regression else self.metrics_of_sums(sums)
        if ROUTER_SUM in sums and sums.get(self.count_key):
            out["router_aux_loss"] = float(sums[ROUTER_SUM]) / float(sums[self.count_key])
        return out

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The names of the metrics an eval logs (``eval_NAME``, ``eval/SET/NAME``)."""
        return tuple(self.metrics(dict.fromkeys(self.sum_keys, 1.0)))


def greater_is_better(metric: str) -> bool:
    """How a metric ranks checkpoints: a loss is better lower, every other eval metric higher."""
    return not metric.endswith(("loss", "mse"))


OUTCOME = Objective(kinds.OUTCOME, (*ROW_KEYS, "reward_index", "margin", "weight", "pair_key"), (), SUM_KEYS, "pairs",
                    pair_metrics_of_sums, _pairwise, Collate, PackCollate)
PROCESS = Objective(kinds.PROCESS, (*ROW_KEYS, "reward_index", "step_labels", "step_weight"),
                    ("reward_index", "step_labels", "step_weight"), STEP_SUM_KEYS, "steps", step_metrics_of_sums, _stepwise,
                    StepCollate, StepPackCollate)
_RESPONSE_KEYS = ("reward_index", "response_scores", "response_margins", "response_group")
RESPONSES = tuple(
    Objective(kinds.RESPONSES, (*ROW_KEYS, *_RESPONSE_KEYS), _RESPONSE_KEYS, RANKING_SUM_KEYS, "prompts",
              ranking_metrics_of_sums, _listwise(ranking), functools.partial(ResponsesCollate, attributes=False),
              functools.partial(ResponsesPackCollate, attributes=False), ranking)  # ratings not collated
    for ranking in RANKING_LOSSES)
_ATTRIBUTE_KEYS = (*_RESPONSE_KEYS, "response_attributes")
REGRESSIONS = tuple(
    Objective(kinds.RESPONSES, (*ROW_KEYS, *_ATTRIBUTE_KEYS), _ATTRIBUTE_KEYS, RANKING_SUM_KEYS + REGRESSION_SUM_KEYS,
              "prompts", ranking_metrics_of_sums, _with_regression(ranking_loss(objective)),
              ResponsesCollate, ResponsesPackCollate, objective)
    for objective in CONFIG_OBJECTIVES if fits_ratings(objective))
OBJECTIVES = {o.name: o for o in (OUTCOME, PROCESS, *RESPONSES, *REGRESSIONS)}


def objective_for(kind: str, ranking: str = RANKING_LOSSES[0]) -> Objective:
    """The objective of shards of ``kind`` (or an objective's ``name``), with the ranking loss
    ``ranking`` where the kind has a choice (K responses per prompt); for the others only the
    default is accepted (a pair's two responses have one ranking: Bradley-Terry)."""
    if kind in OBJECTIVES and ":" in kind:
        return OBJECTIVES[kind]
    if kind not in OBJECTIVES:
        raise ValueError(f"no objective for shards of kind {kind!r}; known: {sorted(OBJECTIVES)}")
    if ranking not in CONFIG_OBJECTIVES:
        raise ValueError(f"objective {ranking!r}: use one of {', '.join(CONFIG_OBJECTIVES)}")
    name = kind if ranking == RANKING_LOSSES[0] else f"{kind}:{ranking}"
    if name not in OBJECTIVES:
        raise ValueError(f"objective {ranking} applies to K responses per prompt; shards of kind {kind} train "
                         f"with {RANKING_LOSSES[0]}")
    return OBJECTIVES[name]


def for_config(cfg: TrainConfig, manifest: Manifest) -> Objective:
    """A run's objective, built once from its config and its shards (data kind x head x loss):
    the kind's objective with the config's ranking loss, its score head over the data; the model
    builder, the loader and the step all take this object."""
    return objective_for(manifest.kind, cfg.objective).for_data(manifest, cfg.attribute_weights, cfg.ensemble)
