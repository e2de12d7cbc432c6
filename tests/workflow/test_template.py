"""The Dataflow Flex Template, offline: its metadata matches the CLI's options one to one and
parses as the Dataflow API's TemplateMetadata; the launch request parses as the API's
LaunchFlexTemplateRequest; the entry point, given exactly the arguments the launcher passes,
runs on the local runner and publishes a complete, dated output."""

import datetime
import json
import pathlib
import re

import pytest
import typer
from rmflow.pipelines.template import (
    NOT_PARAMETERS,
    LaunchEnvironment,
    config_from_args,
    expand_date,
    launch_body,
    main,
    metadata,
)
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.options import help_for

from rmflow.cli import app

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"
CLI_ONLY = {"verbose", "detach"}  # console options of the CLI, not of the job
CLI_TO_FIELD = {"input": "inputs"}


def cli_options() -> dict[str, str]:
    command = typer.main.get_command(app).commands["preprocess"]
    return {CLI_TO_FIELD.get(p.name, p.name): p.help for p in command.params if p.name and p.name not in CLI_ONLY}


def test_metadata_matches_the_cli_one_to_one():
    params = {p["name"]: p for p in metadata()["parameters"]}
    cli = cli_options()
    assert set(params) == set(cli) - set(NOT_PARAMETERS)
    for name, p in params.items():
        assert p["helpText"].startswith(cli[name]) and cli[name] == help_for(PreprocessConfig, name)
        assert p["isOptional"] == (name not in ("inputs", "output", "tokenizer"))


def test_metadata_parses_as_the_dataflow_api_message_and_validates_values():
    from google.cloud.dataflow_v1beta3 import TemplateMetadata

    msg = TemplateMetadata.from_json(json.dumps(metadata()))  # unknown fields would raise
    assert len(msg.parameters) == len(metadata()["parameters"])
    params = {p["name"]: p for p in metadata()["parameters"]}

    def ok(name, value):
        return all(re.fullmatch(r, value) for r in params[name].get("regexes", []))

    assert ok("inputs", "gs://b/raw/*.jsonl.gz,gs://b/more/x.parquet") and not ok("inputs", "/local/raw")
    assert ok("output", "gs://b/shards/{date}") and not ok("output", "shards/")
    assert ok("tokenizer", "gs://b/tok") and ok("tokenizer", "HuggingFaceTB/SmolLM2-135M")
    assert ok("max_length", "2048") and not ok("max_length", "2k")
    assert ok("eval_fraction", "0.05") and ok("dedup", "true") and not ok("dedup", "yes please")
    assert ok("format", "hh-rlhf") and not ok("format", "csv")


def test_launch_body_parses_as_the_api_request():
    from google.cloud.dataflow_v1beta3 import LaunchFlexTemplateRequest

    body = launch_body("gs://b/templates/rmflow.json",
                       {"inputs": "gs://b/raw/*.jsonl.gz", "tokenizer": "gs://b/tok", "output": "gs://b/shards/{date}",
                        "max_length": "1024"},
                       environment=LaunchEnvironment(temp_location="gs://b/tmp", max_workers=20,
                                                     worker_image="europe-docker.pkg.dev/p/r/rmflow:1"))
    req = LaunchFlexTemplateRequest.from_json(json.dumps({"projectId": "p", "location": "europe-west4", **body}))
    assert req.launch_parameter.container_spec_gcs_path == "gs://b/templates/rmflow.json"
    assert dict(req.launch_parameter.parameters)["output"] == "gs://b/shards/{date}"
    assert req.launch_parameter.environment.max_workers == 20
    with pytest.raises(ValueError, match="not template parameters"):
        launch_body("gs://b/t.json", {"runner": "DirectRunner"})


def test_output_is_dated_per_run():
    now = datetime.datetime(2026, 11, 23, 2, 0, 5, tzinfo=datetime.UTC)
    assert expand_date("gs://b/shards/{date}", now) == "gs://b/shards/2026-11-23"
    assert expand_date("gs://b/shards/{datetime}", now) == "gs://b/shards/20261123-020005"
    cfg = config_from_args(["--inputs=gs://b/a.jsonl,gs://b/c.jsonl", "--output=gs://b/s/{date}", "--tokenizer=x/y",
                            "--max_length=512", "--dedup=true", "--project=p", "--region=r",
                            "--decontaminate=gs://b/rb.jsonl,gs://b/pb/*.jsonl", "--decontaminate_ngram=8"])
    assert cfg.inputs == ("gs://b/a.jsonl", "gs://b/c.jsonl") and cfg.max_length == 512 and cfg.dedup
    assert cfg.decontaminate == ("gs://b/rb.jsonl", "gs://b/pb/*.jsonl") and cfg.decontaminate_ngram == 8
    assert re.fullmatch(r"gs://b/s/\d{4}-\d\d-\d\d", cfg.output)
    assert cfg.runner == "DataflowRunner" and "--project=p" in cfg.beam_args


def test_the_entry_point_runs_locally_with_the_launchers_arguments(tmp_path, tokenizer_dir):
    params = {"inputs": str(DEMO / "hh_rlhf_helpful_sample.jsonl.gz"), "tokenizer": tokenizer_dir,
              "output": str(tmp_path / "shards" / "{date}"), "max_length": "256", "eval_fraction": "0.1"}
    body = launch_body("gs://b/templates/rmflow.json", params)
    argv = [f"--{k}={v}" for k, v in body["launchParameter"]["parameters"].items()] + ["--runner=DirectRunner"]
    main(argv)
    (dated,) = (tmp_path / "shards").iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", dated.name) and (dated / "COMPLETED").exists()
    manifest = json.loads((dated / "manifest.json").read_text())
    assert manifest["max_length"] == 256 and manifest["splits"]["eval"]["records"] > 0
    # A second launch the same day leaves the first run's output untouched.
    stamp = (dated / "manifest.json").read_bytes()
    with pytest.raises(Exception, match="already exists"):
        main(argv)
    assert (dated / "manifest.json").read_bytes() == stamp


def test_launch_body_command_prints_a_valid_request(capsys):
    from google.cloud.dataflow_v1beta3 import LaunchFlexTemplateRequest
    from rmflow.pipelines.template import _cli

    _cli(["launch-body", "--template", "gs://b/t.json", "--param", "inputs=gs://b/raw/*.jsonl.gz",
          "--param", "tokenizer=gs://b/tok", "--param", "output=gs://b/shards/{date}", "--temp-location", "gs://b/tmp"])
    body = json.loads(capsys.readouterr().out)
    req = LaunchFlexTemplateRequest.from_json(json.dumps({"projectId": "p", "location": "r", **body}))
    assert req.launch_parameter.environment.temp_location == "gs://b/tmp"


# ---------------------------------------------------------------------------- the scoring template


def test_the_scoring_template_matches_rmflow_score_one_to_one():
    from google.cloud.dataflow_v1beta3 import TemplateMetadata
    from rmflow.schemas.config import ScoreConfig

    from rmflow.scoring.template import SCORE

    meta = metadata(SCORE)
    TemplateMetadata.from_json(json.dumps(meta))  # unknown fields would raise
    params = {p["name"]: p for p in meta["parameters"]}
    command = typer.main.get_command(app).commands["score"]
    cli = {p.name: p.help for p in command.params if p.name}
    assert set(params) == set(cli) - set(SCORE.not_parameters)
    for name, p in params.items():
        assert p["helpText"].startswith(cli[name]) and cli[name] == help_for(ScoreConfig, name)
        assert p["isOptional"] == (name not in ("model", "input", "output"))

    def ok(name, value):
        return all(re.fullmatch(r, value) for r in params[name].get("regexes", []))

    assert ok("step", "best") and ok("step", "400") and not ok("step", "newest")
    assert ok("output_format", "parquet") and not ok("output_format", "csv") and ok("overwrite", "true")
    assert ok("model", "gs://b/export/2026-11-23") and not ok("model", "runs/rm1")
    cfg = config_from_args(["--model=gs://b/m", "--input=gs://b/c/*.jsonl", "--output=gs://b/s/{date}",
                            "--step=best", "--output_format=parquet", "--project=p"], SCORE)
    assert cfg.step == "best" and cfg.output_format == "parquet" and re.fullmatch(r"gs://b/s/\d{4}-\d\d-\d\d", cfg.output)
    assert cfg.runner == "DataflowRunner" and cfg.beam_args == ("--project=p",)


def test_a_gpu_image_gives_its_workers_their_accelerator_unless_the_launch_does(monkeypatch):
    from rmflow.pipelines.template import image_options

    assert image_options(["--project=p"]) == ["--project=p"]  # a CPU image adds nothing
    monkeypatch.setenv("RMFLOW_WORKER_IMAGE", "r/score-gpu:1")
    monkeypatch.setenv("RMFLOW_WORKER_ACCELERATOR", "type:nvidia-l4;count:1;install-nvidia-driver")
    monkeypatch.setenv("RMFLOW_WORKER_MACHINE_TYPE", "g2-standard-4")
    assert image_options(["--project=p"]) == [
        "--project=p", "--sdk_container_image=r/score-gpu:1",
        "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver",
        "--machine_type=g2-standard-4"]
    own = ["--machine_type=g2-standard-8", "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:2",
           "--sdk_container_image=mine"]
    assert image_options(own) == own
    body = launch_body("gs://b/t.json", {"inputs": "gs://b/x"}, environment=LaunchEnvironment(
        machine_type="g2-standard-4", experiments=("no_use_multiple_sdk_containers",)))
    from google.cloud.dataflow_v1beta3 import LaunchFlexTemplateRequest

    req = LaunchFlexTemplateRequest.from_json(json.dumps({"projectId": "p", "location": "r", **body}))
    assert req.launch_parameter.environment.machine_type == "g2-standard-4"
    assert list(req.launch_parameter.environment.additional_experiments) == ["no_use_multiple_sdk_containers"]
