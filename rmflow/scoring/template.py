"""`rmflow score --runner` as a Dataflow Flex Template: the scoring job's parameters and entry point.

The machinery is preprocess's (``pipelines/template.py``): parameters derived from
``ScoreConfig`` (help texts included, values validated by regexes), ``{date}`` in the output
expanded at launch, the launch request body. The image differs: scoring workers need JAX, so the
scoring template is built from ``deploy/dataflow/Dockerfile`` with the ``all,gcp`` extras (CPU
workers) or ``all,gcp,cuda`` and an accelerator (GPU workers); see docs/scoring-serving.md.

    python -m rmflow.scoring.template metadata > deploy/dataflow/score-metadata.json
    python -m rmflow.scoring.template launch-body --template gs://b/templates/rmflow-score.json \\
        --param model=gs://b/export/2026-11-23 --param input='gs://b/candidates/*.jsonl' \\
        --param output=gs://b/scores/{date} --temp-location gs://b/tmp
"""

from __future__ import annotations

import sys

from rmflow.pipelines.template import GCS, TemplateSpec, cli, config_from_args, one_of
from rmflow.schemas.config import SCORE_OUTPUT_FORMATS, SCORE_TRUNCATE, ScoreConfig

SCORE = TemplateSpec(
    name="rmflow-score",
    description="rmflow score: a reward model's scores for every record of JSONL or Parquet files (conversations, "
                "preference pairs, stepwise solutions), as sorted shards with errors.jsonl and summary.json (the job "
                "publishes the output and writes COMPLETED when it is complete).",
    config=ScoreConfig,
    required=("model", "input", "output"),
    regexes={"model": [GCS], "input": [GCS], "output": [GCS], "step": [r"^([0-9]+|best)$"],
             "output_format": one_of(SCORE_OUTPUT_FORMATS), "truncate": one_of(SCORE_TRUNCATE)},
    labels={"model": "Reward model", "input": "Input files", "output": "Output folder"},
)


def main(argv: list[str] | None = None) -> None:
    """The scoring template's entry point: build the job and submit it; a local runner runs it here."""
    from rmflow.pipelines.runner import is_local
    from rmflow.scoring.batch import run as run_config

    cfg = config_from_args(list(sys.argv[1:] if argv is None else argv), SCORE)
    run_config(cfg, wait=is_local(cfg.runner))


if __name__ == "__main__":
    cli(sys.argv[1:], SCORE, prog="python -m rmflow.scoring.template")
