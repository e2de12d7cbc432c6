"""Airflow DAG: nightly rmflow on new preference data.

    preprocess (Dataflow Flex Template) -> train (accelerator host, over SSH) -> eval -> export
        -> score (Dataflow Flex Template: the day's candidate replies scored by the new export)

Each run writes dated folders (``{{ ds }}``): shards, run, eval report, export and scores of one day
never touch another day's. The preprocess and scoring jobs publish their output and ``COMPLETED``
by themselves; the Dataflow operator waits for each job to finish, so training starts on complete
shards only. Settings are Airflow Variables (``rmflow_project``, ``rmflow_region``, ``rmflow_bucket``,
``rmflow_template``, ``rmflow_score_template``, ``rmflow_tokenizer``, ``rmflow_train_config``) and
the SSH connection ``rmflow_accelerator`` to a host with ``rmflow[cuda]`` (or a TPU VM) installed.
The candidates to score are ``gs://BUCKET/candidates/DAY/*.jsonl`` (conversations, or pairs);
the scoring template built with ``GPU=1`` runs its workers on NVIDIA L4s.
"""

from __future__ import annotations

import datetime

from airflow import DAG
from airflow.providers.google.cloud.operators.dataflow import DataflowStartFlexTemplateOperator
from airflow.providers.ssh.operators.ssh import SSHOperator

BUCKET = "{{ var.value.rmflow_bucket }}"
DAY = "{{ ds }}"
SHARDS = f"gs://{BUCKET}/shards/{DAY}"
RUN = f"gs://{BUCKET}/runs/{DAY}"
EXPORT = f"gs://{BUCKET}/export/{DAY}"


def dataflow_job(task_id: str, template_variable: str, parameters: dict, **environment) -> DataflowStartFlexTemplateOperator:
    """A Flex Template job of the day (its template's gs:// path in an Airflow Variable); the task
    waits for the job, which publishes its output and COMPLETED by itself."""
    return DataflowStartFlexTemplateOperator(
        task_id=task_id,
        project_id="{{ var.value.rmflow_project }}",
        location="{{ var.value.rmflow_region }}",
        wait_until_finished=True,
        body={"launchParameter": {
            "jobName": f"rmflow-{task_id}-{{{{ ds_nodash }}}}",
            "containerSpecGcsPath": f"{{{{ var.value.{template_variable} }}}}",
            "parameters": parameters,
            "environment": {"tempLocation": f"gs://{BUCKET}/tmp", **environment},
        }},
    )


with DAG(
    dag_id="rmflow_nightly",
    schedule="0 2 * * *",
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["rmflow"],
    doc_md=__doc__,
) as dag:
    preprocess = dataflow_job("preprocess", "rmflow_template", {
        "inputs": f"gs://{BUCKET}/raw/{DAY}/*.jsonl.gz", "output": SHARDS,
        "tokenizer": "{{ var.value.rmflow_tokenizer }}", "max_length": "2048"})
    train = SSHOperator(
        task_id="train",
        ssh_conn_id="rmflow_accelerator",
        command=f"rmflow train --config {{{{ var.value.rmflow_train_config }}}} --data {SHARDS} --output {RUN}",
        cmd_timeout=None,
    )
    evaluate = SSHOperator(
        task_id="eval",
        ssh_conn_id="rmflow_accelerator",
        command=f"rmflow eval --model {RUN} --data {SHARDS} --output /tmp/rmflow-eval-{DAY} && "
                f"gsutil -m cp -r /tmp/rmflow-eval-{DAY} gs://{BUCKET}/eval/{DAY}",
    )
    export = SSHOperator(
        task_id="export",
        ssh_conn_id="rmflow_accelerator",
        command=f"rmflow export {RUN} --output /tmp/rmflow-export-{DAY} && "
                f"gsutil -m cp -r /tmp/rmflow-export-{DAY} {EXPORT}",
    )
    score = dataflow_job("score", "rmflow_score_template", {
        "model": EXPORT, "input": f"gs://{BUCKET}/candidates/{DAY}/*.jsonl", "output": f"gs://{BUCKET}/scores/{DAY}",
        "output_format": "parquet", "group_by": "prompt_id"}, maxWorkers=8)
    preprocess >> train >> evaluate >> export >> score
