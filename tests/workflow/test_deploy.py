"""Deployment files stay in step with the code: the committed template metadata is what the code
generates, the image's Beam version satisfies rmflow's, the entry point file calls the template
entry point, and the Airflow DAG (where Airflow is installed: the `airflow` extra) has the
documented task graph."""

import os
import pathlib
import re
import tomllib

import pytest
from rmflow.pipelines.template import metadata

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def test_committed_metadata_is_generated_from_the_config():
    import json

    from rmflow.scoring.template import SCORE

    assert json.loads((DEPLOY / "dataflow" / "metadata.json").read_text()) == metadata(), \
        "regenerate with: make template-metadata"
    assert json.loads((DEPLOY / "dataflow" / "score-metadata.json").read_text()) == metadata(SCORE), \
        "regenerate with: make score-template-metadata"


def test_image_beam_version_satisfies_the_dependency():
    from packaging.requirements import Requirement

    version = re.search(r"ARG BEAM_VERSION=(\S+)", (DEPLOY / "dataflow" / "Dockerfile").read_text()).group(1)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["preprocess"]
    beam = next(Requirement(d) for d in deps if d.startswith("apache-beam"))
    assert beam.specifier.contains(version)
    assert 'FLEX_TEMPLATE_PYTHON_PY_FILE=/template/main.py' in (DEPLOY / "dataflow" / "Dockerfile").read_text()
    assert "from rmflow.pipelines.template import main" in (DEPLOY / "dataflow" / "main.py").read_text()
    assert "from rmflow.scoring.template import main" in (DEPLOY / "dataflow" / "score_main.py").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert "TEMPLATE_MAIN=deploy/dataflow/score_main.py" in makefile and "EXTRAS=$(SCORE_EXTRAS)" in makefile


def test_airflow_dag_task_graph():
    if os.environ.get("RMFLOW_REQUIRE_AIRFLOW"):  # `make test-airflow`: a failed provider install must fail
        import airflow.providers.google.cloud.operators.dataflow  # noqa: F401
        import airflow.providers.ssh.operators.ssh  # noqa: F401
    pytest.importorskip("airflow.providers.google.cloud.operators.dataflow")
    pytest.importorskip("airflow.providers.ssh.operators.ssh")
    import importlib.util

    spec = importlib.util.spec_from_file_location("rmflow_dag", DEPLOY / "airflow" / "rmflow_dag.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # as the scheduler parses it
    dag = module.dag
    assert dag.dag_id == "rmflow_nightly"
    assert {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks} == {
        "preprocess": ["train"], "train": ["eval"], "eval": ["export"], "export": ["score"], "score": []}
    from rmflow.pipelines.template import PREPROCESS, parameter_fields

    from rmflow.scoring.template import SCORE

    for task, spec in (("preprocess", PREPROCESS), ("score", SCORE)):  # the DAG launches the templates' parameters
        given = dag.get_task(task).body["launchParameter"]["parameters"]
        assert set(spec.required) <= set(given) <= {f.name for f in parameter_fields(spec)}, task


@pytest.mark.parametrize("name", ["gpu-1host-8x.yaml", "tpu-v5e-32.yaml"])
def test_worked_train_configs_are_valid(name):
    import yaml
    from rmflow.schemas.train_config import TrainConfig

    raw = yaml.safe_load((DEPLOY / "train" / name).read_text())
    cfg = TrainConfig.from_dict({**raw, "data": "gs://b/shards", "output": "/tmp/run"})
    assert cfg.mesh.fsdp == -1 and cfg.model.dtype == "bfloat16"


def test_the_suite_starts_without_xdist():
    """`make test-airflow` runs pytest in a virtualenv without pytest-xdist: the conftest must not
    need it (an xdist-only hook would fail that run before collecting anything)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--collect-only",
                        "-q", "tests/workflow/test_deploy.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
