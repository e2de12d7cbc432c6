"""Each reward model kind's behaviour in rmflow's commands, in one place: its evaluator, the
summary `rmflow eval` prints, its scorer (`rmflow score`, the Python API's batches, the Beam
job, the server) and its `rmflow serve` request and response. A new kind (``schemas.kinds``)
adds one entry here, beside its objective in ``trainer.objective`` and its rendering recipe in
``rendering``; ``tests/project/test_kinds.py`` names any part a kind lacks.

The parts live in their capability's package and are named here as ``module:attribute``,
imported on first use, so that a command imports its own package only (the server never
imports eval, and nothing but `rmflow preprocess` and `rmflow score --runner` imports the Beam stage).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from rmflow.schemas.kinds import KINDS, OUTCOME, PROCESS, RESPONSES, kind_named


@dataclasses.dataclass(frozen=True)
class KindHandlers:
    evaluate: str  # (EvalConfig, LoadedModel, records) -> (metrics, the writer of the eval folder)
    summary: str  # eval metrics -> (title, rows of (label, value)) of the table `rmflow eval` prints
    scorer: str  # rmflow.scoring.scorers.Scorer: encode, size, run, fields, warm-up
    protocol: str  # rmflow.server.protocol.Native: POST /v1/score's list key and response columns

    def load(self, part: str) -> Any:
        module, _, name = getattr(self, part).partition(":")
        return getattr(importlib.import_module(module), name)


HANDLERS = {
    OUTCOME.name: KindHandlers("rmflow.eval.evaluation:eval_pairs", "rmflow.eval.reports:pair_summary",
                               "rmflow.scoring.scorers:OUTCOME_SCORER", "rmflow.server.protocol:OUTCOME_NATIVE"),
    # K responses per prompt: evaluated as rankings; the model it trains scores and serves as an outcome model
    RESPONSES.name: KindHandlers("rmflow.eval.ranking:eval_records", "rmflow.eval.reports:pair_summary",
                                 "rmflow.scoring.scorers:OUTCOME_SCORER", "rmflow.server.protocol:OUTCOME_NATIVE"),
    PROCESS.name: KindHandlers("rmflow.eval.evaluation:eval_process", "rmflow.eval.reports:process_summary",
                               "rmflow.scoring.scorers:PROCESS_SCORER", "rmflow.server.protocol:PROCESS_NATIVE"),
}
PARTS = tuple(f.name for f in dataclasses.fields(KindHandlers))


def handler(kind: str, part: str) -> Any:
    """Kind ``kind``'s ``part`` (one of ``PARTS``)."""
    return HANDLERS[kind_named(kind).name].load(part)


def every(part: str) -> dict[str, Any]:
    """``part`` of every kind, by kind name."""
    return {name: handler(name, part) for name in KINDS}
