"""The remote code paths, offline: every read and write through a non-local Beam filesystem
with object-store semantics, and the graph as it would be submitted to Dataflow."""

import base64
import bz2
import os
import pathlib
import pickle
import shutil

import pytest
from apache_beam.options.pipeline_options import GoogleCloudOptions, StandardOptions
from rmflow.pipelines import io as rio
from rmflow.pipelines.preprocess import Plan, PreprocessError, build, make_pipeline, pipeline_options, run
from rmflow.pipelines.tokenizer_files import load_tokenizer_assets
from rmflow.schemas.config import PreprocessConfig

from tests import fakefs

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"


@pytest.fixture()
def bucket(tmp_path, monkeypatch):
    monkeypatch.setattr(fakefs, "ROOT", str(tmp_path / "fakegcs"))
    root = pathlib.Path(fakefs.ROOT) / "bucket"
    shutil.copytree(DEMO / "tokenizer", root / "tok")
    (root / "in").mkdir()
    shutil.copy(DEMO / "hh_rlhf_helpful_sample.jsonl.gz", root / "in" / "sample.jsonl.gz")
    return root


def test_pipeline_reads_and_writes_through_a_remote_filesystem(bucket, tmp_path, tokenizer_dir):
    remote = run(PreprocessConfig(inputs=("fakegcs://bucket/in",), output="fakegcs://bucket/out",
                                  tokenizer="fakegcs://bucket/tok", num_shards=2))
    out = bucket / "out"
    assert (out / "COMPLETED").exists() and (out / "manifest.json").exists()
    leftovers = [f for d in bucket.iterdir() if ".tmp-" in d.name for f in d.rglob("*") if f.is_file()]
    assert not leftovers  # every staged object was moved (the fake keeps empty local folders)
    local = run(PreprocessConfig(inputs=(str(bucket / "in"),), output=str(tmp_path / "local"),
                                 tokenizer=tokenizer_dir, num_shards=2))
    assert remote.manifest.tokenizer.sha256 == local.manifest.tokenizer.sha256
    for split in local.manifest.splits.values():
        for shard in split.shards:  # uploaded shards equal locally written ones, byte for byte
            assert (out / shard.file).read_bytes() == (tmp_path / "local" / shard.file).read_bytes()
    assert remote.stats["counts"] == local.stats["counts"]
    assert rio.exists("fakegcs://bucket/out")


def test_shard_upload_is_idempotent(bucket):
    dest = "fakegcs://bucket/shards/train-00000-of-00001.array_record"
    rio.write_array_record_shard(dest, [b"a", b"bc"])
    first = (bucket / "shards" / "train-00000-of-00001.array_record").read_bytes()
    rio.write_array_record_shard(dest, [b"a", b"bc"])  # a retried bundle
    assert (bucket / "shards" / "train-00000-of-00001.array_record").read_bytes() == first
    assert os.listdir(bucket / "shards") == ["train-00000-of-00001.array_record"]


def test_graph_builds_for_dataflow(tokenizer_dir, monkeypatch):
    # Option validation asks GCS about the temp bucket's soft-delete policy: no network here.
    monkeypatch.setattr(GoogleCloudOptions, "_warn_if_soft_delete_policy_enabled", lambda self, arg: None)
    cfg = PreprocessConfig(
        inputs=("gs://my-bucket/in/*.jsonl",), output="gs://my-bucket/out", tokenizer=tokenizer_dir,
        beam_args=("--runner", "DataflowRunner", "--project", "my-proj", "--region", "europe-west4",
                   "--temp_location", "gs://my-bucket/tmp", "--max_num_workers", "8", "--no_auth",
                   "--extra_package", "dist/rmflow-0.1.0-py3-none-any.whl"),
    )
    opts = pipeline_options(cfg)
    assert opts.view_as(StandardOptions).runner == "DataflowRunner"
    assert opts.view_as(GoogleCloudOptions).project == "my-proj"
    p = make_pipeline(cfg)
    shutil.rmtree(p.local_tempdir)  # Beam's local temporary folder: this graph is built, never run
    assert type(p.runner).__name__ == "DataflowRunner"
    plan = Plan([("gs://my-bucket/in/a.jsonl", 1000)], load_tokenizer_assets(tokenizer_dir),
                {"train": 2, "eval": 1}, "gs://my-bucket/out.tmp-test")
    build(p, cfg, plan)
    proto = p.to_runner_api()  # serialises every DoFn, as submission does
    labels = {t.unique_name for t in proto.components.transforms.values()}
    for step in ("Read", "NormalizePairs", "ApplyChatTemplate", "Tokenize", "LengthPolicy", "Split",
                 "WriteShards", "WriteErrors", "Finalize"):
        assert step in labels
    # The tokenizer's files do not travel in the graph: every DoFn is bz2-(de)compressed at
    # submission and again as each bundle processor starts. The workers read them from the staging
    # folder (make_plan writes them there; test_the_tokenizer_reaches_the_workers_through_staging).
    packed = len(base64.b64encode(bz2.compress(pickle.dumps(plan.assets.files))))
    holders = sorted(t.unique_name for t in proto.components.transforms.values() if len(t.spec.payload) > packed // 20)
    assert holders == [], holders
    assert proto.ByteSize() < packed // 2, (proto.ByteSize(), packed)  # the whole job's graph


def test_remote_runner_without_rmflow_code_is_refused(tokenizer_dir):
    cfg = PreprocessConfig(inputs=("gs://my-bucket/in",), output="gs://my-bucket/out", tokenizer=tokenizer_dir,
                           beam_args=("--runner", "DataflowRunner", "--project", "p"))
    with pytest.raises(PreprocessError, match="--extra_package dist/rmflow"):
        pipeline_options(cfg)
