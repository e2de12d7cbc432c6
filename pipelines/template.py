"""`rmflow preprocess` as a Dataflow Flex Template: its parameters, its entry point, its launch.

One container image serves as the template launcher and as the workers (``deploy/dataflow/``).
``metadata()`` derives the template's parameters from ``PreprocessConfig``, one per option the
CLI has (help texts included, values validated by regexes), so template and CLI cannot drift.
``main(argv)`` is the entry point the launcher runs with ``--<parameter>=<value>`` arguments and
Dataflow's own pipeline options; it submits the job and returns (the job finalises itself).
``launch_body(...)`` is the JSON for the ``flexTemplates.launch`` REST call, which Cloud
Scheduler posts nightly. An output ``gs://b/shards/{date}`` is expanded at launch (UTC), so
each scheduled run writes a new dated folder and never touches the previous one.

    python -m rmflow.pipelines.template metadata > metadata.json
    python -m rmflow.pipelines.template launch-body --template gs://b/templates/rmflow.json \\
        --param inputs=gs://b/raw/*.jsonl.gz --param tokenizer=gs://b/tokenizer \\
        --param output=gs://b/shards/{date} --temp-location gs://b/tmp
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from typing import Any

from rmflow.schemas.config import FORMATS as INPUT_FORMATS
from rmflow.schemas.config import LENGTH_POLICIES, PreprocessConfig, help_for

# Options that are not template parameters: where and how the job runs is Dataflow's to say
# (runner, Beam options), and local worker processes do not exist there.
NOT_PARAMETERS = ("runner", "beam_args", "num_workers")
GCS = r"^gs:\/\/[^\n\r]+$"
TOKENIZER = r"^(gs:\/\/[^\n\r]+|[A-Za-z0-9][\w.-]*\/[\w.-]+|[A-Za-z0-9][\w.-]*)$"
REGEXES = {
    "inputs": [r"^gs:\/\/[^\n\r]+(,gs:\/\/[^\n\r]+)*$"],
    "output": [GCS],
    "tokenizer": [TOKENIZER],
    "chat_template": [GCS],
    "format": ["^(" + "|".join(("auto",) + tuple(INPUT_FORMATS)) + ")$"],
    "length_policy": ["^(" + "|".join(LENGTH_POLICIES) + ")$"],
}
INT, FLOAT, BOOL = r"^[0-9]+$", r"^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$", r"^(true|false)$"
LABELS = {"inputs": "Input files", "output": "Output folder", "tokenizer": "Tokenizer"}
WORKER_IMAGE_ENV = "RMFLOW_WORKER_IMAGE"  # set in the image: workers run the launcher's image


def parameter_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(PreprocessConfig) if f.name not in NOT_PARAMETERS]


def _regexes(f: dataclasses.Field) -> list[str]:
    if f.name in REGEXES:
        return REGEXES[f.name]
    return {"int": [INT], "float": [FLOAT], "bool": [BOOL]}.get(str(f.type), [])


def metadata() -> dict[str, Any]:
    """The Flex Template's metadata.json (the Dataflow API's TemplateMetadata, as JSON)."""
    params = []
    for f in parameter_fields():
        required = f.name in ("inputs", "output", "tokenizer")
        p = {"name": f.name, "label": LABELS.get(f.name, f.name.replace("_", " ").capitalize()),
             "helpText": help_for(PreprocessConfig, f.name) + (" Comma-separated." if _is_list(f) else "")
             + ("" if required or f.default in (None, ()) else f" Default: {_text(f.default)}."),
             "isOptional": not required}
        if _regexes(f):
            p["regexes"] = _regexes(f)
        if not required and f.default not in (None, ()):
            p["defaultValue"] = _text(f.default)
        params.append(p)
    return {"name": "rmflow-preprocess",
            "description": "rmflow preprocess: raw preference pairs to tokenized ArrayRecord shards plus a manifest "
                           "(the job publishes the output and writes COMPLETED when it is complete).",
            "parameters": params}


def _is_list(f: dataclasses.Field) -> bool:
    return str(f.type).startswith("tuple")


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parse(f: dataclasses.Field, text: str) -> Any:
    if _is_list(f):
        return tuple(p for p in text.split(",") if p)
    kind = str(f.type)
    if kind == "bool":
        return text.strip().lower() in ("true", "1", "yes")
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    return text


def expand_date(path: str, now: datetime.datetime | None = None) -> str:
    """``{date}`` -> 2026-11-23, ``{datetime}`` -> 20261123-020000 (UTC): one folder per run."""
    now = now or datetime.datetime.now(datetime.UTC)
    return path.replace("{date}", now.strftime("%Y-%m-%d")).replace("{datetime}", now.strftime("%Y%m%d-%H%M%S"))


def config_from_args(argv: list[str]) -> PreprocessConfig:
    """Template parameters (``--name=value``) to the config; every other argument is a Beam
    pipeline option, passed through (the launcher adds the runner, project, region ...)."""
    parser = argparse.ArgumentParser(prog="rmflow-template", allow_abbrev=False)
    for f in parameter_fields():
        parser.add_argument(f"--{f.name}", required=f.name in ("inputs", "output", "tokenizer"))
    known, beam_args = parser.parse_known_args(argv)
    values = {f.name: _parse(f, getattr(known, f.name)) for f in parameter_fields()
              if getattr(known, f.name) not in (None, "")}
    values["output"] = expand_date(values["output"])
    if os.environ.get(WORKER_IMAGE_ENV) and not any(a.startswith("--sdk_container_image") for a in beam_args):
        beam_args = [*beam_args, f"--sdk_container_image={os.environ[WORKER_IMAGE_ENV]}"]
    runner = next((a.split("=", 1)[1] for a in beam_args if a.startswith("--runner=")), "DataflowRunner")
    return PreprocessConfig(**values, runner=runner, beam_args=tuple(beam_args))


def main(argv: list[str] | None = None) -> None:
    """The template's entry point: build the job and submit it; a local runner runs it here."""
    from rmflow.pipelines.preprocess import LOCAL_RUNNERS, run

    cfg = config_from_args(list(sys.argv[1:] if argv is None else argv))
    run(cfg, wait=cfg.runner.lower() in LOCAL_RUNNERS)


def launch_body(template: str, parameters: dict[str, str], *, job_name: str = "rmflow-preprocess",
                temp_location: str | None = None, max_workers: int | None = None,
                service_account: str | None = None, worker_image: str | None = None) -> dict[str, Any]:
    """The request body of ``POST .../locations/{region}/flexTemplates:launch``."""
    unknown = set(parameters) - {f.name for f in parameter_fields()}
    if unknown:
        raise ValueError(f"not template parameters: {sorted(unknown)}")
    env: dict[str, Any] = {}
    if temp_location:
        env["tempLocation"] = temp_location
    if max_workers:
        env["maxWorkers"] = max_workers
    if service_account:
        env["serviceAccountEmail"] = service_account
    if worker_image:
        env["sdkContainerImage"] = worker_image
    launch = {"jobName": job_name, "containerSpecGcsPath": template, "parameters": dict(parameters)}
    if env:
        launch["environment"] = env
    return {"launchParameter": launch}


def _cli(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m rmflow.pipelines.template")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("metadata", help="print metadata.json")
    body = sub.add_parser("launch-body", help="print the flexTemplates:launch request body")
    body.add_argument("--template", required=True, help="gs:// path of the template spec (rmflow.json)")
    body.add_argument("--param", action="append", default=[], help="name=value (repeatable)")
    body.add_argument("--job-name", default="rmflow-preprocess")
    body.add_argument("--temp-location")
    body.add_argument("--max-workers", type=int)
    body.add_argument("--service-account")
    a = parser.parse_args(argv)
    if a.cmd == "metadata":
        print(json.dumps(metadata(), indent=2))
        return
    params = dict(p.split("=", 1) for p in a.param)
    print(json.dumps(launch_body(a.template, params, job_name=a.job_name, temp_location=a.temp_location,
                                 max_workers=a.max_workers, service_account=a.service_account), indent=2))


if __name__ == "__main__":
    _cli(sys.argv[1:])
