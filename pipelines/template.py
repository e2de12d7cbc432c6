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
import os
import sys
from typing import Any

from rmflow.schemas import jsontext
from rmflow.schemas.config import FORMATS as INPUT_FORMATS
from rmflow.schemas.config import LENGTH_POLICIES, PreprocessConfig
from rmflow.schemas.options import help_for

GCS = r"^gs:\/\/[^\n\r]+$"
TOKENIZER = r"^(gs:\/\/[^\n\r]+|[A-Za-z0-9][\w.-]*\/[\w.-]+|[A-Za-z0-9][\w.-]*)$"
INT, FLOAT, BOOL = r"^[0-9]+$", r"^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$", r"^(true|false)$"
WORKER_IMAGE_ENV = "RMFLOW_WORKER_IMAGE"  # set in the image: workers run the launcher's image
# Set in a GPU image (deploy/dataflow/Dockerfile's WORKER_ACCELERATOR, WORKER_MACHINE_TYPE): the job's
# workers get these GPUs (Dataflow's worker_accelerator service option) and machine type, unless the
# launch names its own.
WORKER_ACCELERATOR_ENV, WORKER_MACHINE_TYPE_ENV = "RMFLOW_WORKER_ACCELERATOR", "RMFLOW_WORKER_MACHINE_TYPE"


def one_of(choices) -> list[str]:
    return ["^(" + "|".join(choices) + ")$"]


@dataclasses.dataclass(frozen=True)
class TemplateSpec:
    """One Flex Template: the config whose fields are its parameters (less ``not_parameters``:
    where and how the job runs is Dataflow's to say), which are required, the regexes that
    validate values beyond their type, and ``dated``: the paths whose ``{date}`` is expanded at
    launch (one new folder per scheduled run)."""

    name: str
    description: str
    config: type
    required: tuple[str, ...]
    not_parameters: tuple[str, ...] = ("runner", "beam_args")
    regexes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    dated: tuple[str, ...] = ("output",)


PREPROCESS = TemplateSpec(
    name="rmflow-preprocess",
    description="rmflow preprocess: raw preference pairs to tokenized ArrayRecord shards plus a manifest (the job "
                "publishes the output and writes COMPLETED when it is complete).",
    config=PreprocessConfig,
    required=("inputs", "output", "tokenizer"),
    # local worker processes do not exist on Dataflow
    not_parameters=("runner", "beam_args", "num_workers"),
    regexes={"inputs": [r"^gs:\/\/[^\n\r]+(,gs:\/\/[^\n\r]+)*$"], "output": [GCS], "tokenizer": [TOKENIZER],
             "chat_template": [GCS], "format": one_of(("auto",) + tuple(INPUT_FORMATS)),
             "length_policy": one_of(LENGTH_POLICIES)},
    labels={"inputs": "Input files", "output": "Output folder", "tokenizer": "Tokenizer"},
)
NOT_PARAMETERS = PREPROCESS.not_parameters


def parameter_fields(spec: TemplateSpec = PREPROCESS) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(spec.config) if f.name not in spec.not_parameters]


def _regexes(f: dataclasses.Field, spec: TemplateSpec) -> list[str]:
    if f.name in spec.regexes:
        return spec.regexes[f.name]
    return {"int": [INT], "float": [FLOAT], "bool": [BOOL]}.get(str(f.type), [])


def metadata(spec: TemplateSpec = PREPROCESS) -> dict[str, Any]:
    """The Flex Template's metadata.json (the Dataflow API's TemplateMetadata, as JSON)."""
    params = []
    for f in parameter_fields(spec):
        required = f.name in spec.required
        p = {"name": f.name, "label": spec.labels.get(f.name, f.name.replace("_", " ").capitalize()),
             "helpText": help_for(spec.config, f.name) + (" Comma-separated." if _is_list(f) else "")
             + ("" if required or f.default in (None, (), "") else f" Default: {_text(f.default)}."),
             "isOptional": not required}
        if _regexes(f, spec):
            p["regexes"] = _regexes(f, spec)
        if not required and f.default not in (None, (), ""):
            p["defaultValue"] = _text(f.default)
        params.append(p)
    return {"name": spec.name, "description": spec.description, "parameters": params}


def _is_list(f: dataclasses.Field) -> bool:
    return str(f.type).startswith("tuple")


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parse(f: dataclasses.Field, text: str) -> Any:
    if _is_list(f):
        return tuple(p for p in text.split(",") if p)
    type_text = str(f.type)
    if type_text == "bool":
        return text.strip().lower() in ("true", "1", "yes")
    if type_text == "int":
        return int(text)
    if type_text == "float":
        return float(text)
    return text


def expand_date(path: str, now: datetime.datetime | None = None) -> str:
    """``{date}`` -> 2026-11-23, ``{datetime}`` -> 20261123-020000 (UTC): one folder per run."""
    now = now or datetime.datetime.now(datetime.UTC)
    return path.replace("{date}", now.strftime("%Y-%m-%d")).replace("{datetime}", now.strftime("%Y%m%d-%H%M%S"))


def config_from_args(argv: list[str], spec: TemplateSpec = PREPROCESS):
    """Template parameters (``--name=value``) to the spec's config; every other argument is a
    Beam pipeline option, passed through (the launcher adds the runner, project, region ...)."""
    parser = argparse.ArgumentParser(prog=spec.name, allow_abbrev=False)
    for f in parameter_fields(spec):
        parser.add_argument(f"--{f.name}", required=f.name in spec.required)
    known, beam_args = parser.parse_known_args(argv)
    values = {f.name: _parse(f, getattr(known, f.name)) for f in parameter_fields(spec)
              if getattr(known, f.name) not in (None, "")}
    for name in spec.dated:
        if name in values:
            values[name] = expand_date(values[name])
    beam_args = image_options(beam_args)
    runner = next((a.split("=", 1)[1] for a in beam_args if a.startswith("--runner=")), "DataflowRunner")
    return spec.config(**values, runner=runner, beam_args=tuple(beam_args))


def image_options(beam_args: list[str]) -> list[str]:
    """The Beam options the launcher's image implies, where the launch does not give its own:
    the workers' image (this one), and in a GPU image their accelerator and machine type."""
    def given(*names: str) -> bool:
        return any(a.split("=", 1)[0] in names for a in beam_args)

    out = list(beam_args)
    if os.environ.get(WORKER_IMAGE_ENV) and not given("--sdk_container_image", "--worker_harness_container_image"):
        out.append(f"--sdk_container_image={os.environ[WORKER_IMAGE_ENV]}")
    if os.environ.get(WORKER_ACCELERATOR_ENV) and not any("worker_accelerator=" in a for a in beam_args):
        out.append(f"--dataflow_service_options=worker_accelerator={os.environ[WORKER_ACCELERATOR_ENV]}")
    if os.environ.get(WORKER_MACHINE_TYPE_ENV) and not given("--machine_type", "--worker_machine_type"):
        out.append(f"--machine_type={os.environ[WORKER_MACHINE_TYPE_ENV]}")
    return out


def main(argv: list[str] | None = None) -> None:
    """The preprocess template's entry point: build the job and submit it; a local runner runs it here."""
    from rmflow.pipelines.preprocess import run
    from rmflow.pipelines.runner import is_local

    cfg = config_from_args(list(sys.argv[1:] if argv is None else argv))
    run(cfg, wait=is_local(cfg.runner))


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """The Dataflow job's runtime environment for a template launch (each unset: Dataflow's
    default). ``machine_type``: the workers' (their GPUs come with the image,
    ``WORKER_ACCELERATOR_ENV``); ``experiments``: Dataflow experiments, e.g.
    ``no_use_multiple_sdk_containers``: one SDK process, one model, per worker."""

    temp_location: str | None = None
    max_workers: int | None = None
    service_account: str | None = None
    worker_image: str | None = None
    machine_type: str | None = None
    experiments: tuple[str, ...] = ()


# LaunchEnvironment's fields as the REST API's FlexTemplateRuntimeEnvironment names them
ENVIRONMENT_FIELDS = {"temp_location": "tempLocation", "max_workers": "maxWorkers",
                      "service_account": "serviceAccountEmail", "worker_image": "sdkContainerImage",
                      "machine_type": "machineType", "experiments": "additionalExperiments"}


def launch_body(template: str, parameters: dict[str, str], *, job_name: str = "rmflow-preprocess",
                environment: LaunchEnvironment = LaunchEnvironment(), spec: TemplateSpec = PREPROCESS
                ) -> dict[str, Any]:
    """The request body of ``POST .../locations/{region}/flexTemplates:launch``."""
    unknown = set(parameters) - {f.name for f in parameter_fields(spec)}
    if unknown:
        raise ValueError(f"not template parameters: {sorted(unknown)}")
    env = {api: list(value) if isinstance(value, tuple) else value for name, api in ENVIRONMENT_FIELDS.items()
           if (value := getattr(environment, name))}
    launch = {"jobName": job_name, "containerSpecGcsPath": template, "parameters": dict(parameters)}
    if env:
        launch["environment"] = env
    return {"launchParameter": launch}


def cli(argv: list[str], spec: TemplateSpec = PREPROCESS, prog: str = "python -m rmflow.pipelines.template") -> None:
    """``metadata`` (print metadata.json) and ``launch-body`` (print the launch request) for ``spec``."""
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("metadata", help="print metadata.json")
    body = sub.add_parser("launch-body", help="print the flexTemplates:launch request body")
    body.add_argument("--template", required=True, help="gs:// path of the template spec (rmflow.json)")
    body.add_argument("--param", action="append", default=[], help="name=value (repeatable)")
    body.add_argument("--job-name", default=spec.name)
    body.add_argument("--temp-location")
    body.add_argument("--max-workers", type=int)
    body.add_argument("--service-account")
    body.add_argument("--machine-type", help="worker machine type (g2-standard-4: one NVIDIA L4)")
    body.add_argument("--experiment", action="append", default=[],
                      help="a Dataflow experiment, e.g. no_use_multiple_sdk_containers (repeatable)")
    a = parser.parse_args(argv)
    if a.cmd == "metadata":
        print(jsontext.dumps(metadata(spec), indent=2))
        return
    params = dict(p.split("=", 1) for p in a.param)
    environment = LaunchEnvironment(temp_location=a.temp_location, max_workers=a.max_workers,
                                    service_account=a.service_account, machine_type=a.machine_type,
                                    experiments=tuple(a.experiment))
    print(jsontext.dumps(launch_body(a.template, params, job_name=a.job_name, environment=environment, spec=spec),
                         indent=2))


_cli = cli


if __name__ == "__main__":
    cli(sys.argv[1:])
