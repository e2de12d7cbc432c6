"""Shards and runs on an object store, through fsspec (here its in-memory filesystem, a real
fsspec implementation; gs:// is the same code with gcsfs): training stages remote shards into
the local cache once, writes a remote run through a local mirror synced after every save, and
eval / export read a remote run and remote shards."""

import json
import os
import pathlib

import fsspec
import pytest
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer import storage
from rmflow.trainer.train import run as train

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"


@pytest.fixture
def remote_shards(demo_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("RMFLOW_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    root = f"/{tmp_path.name}"
    fs.put(str(demo_shards), f"{root}/shards", recursive=True)
    yield f"memory://{root}/shards", f"memory://{root}"
    fs.rm(root, recursive=True)


def test_train_eval_export_with_remote_shards_and_run(remote_shards, tmp_path):
    shards, bucket = remote_shards
    run_url = f"{bucket}/runs/r1"
    train(TrainConfig(data=shards, model="micro", output=run_url, max_steps=3, batch_size=4, checkpoint={"save_steps": 1, "keep_newest": 1}, logging={"steps": 1}))
    fs = fsspec.filesystem("memory")
    remote = {p.split("/runs/r1/", 1)[1] for p in fs.find(run_url.removeprefix("memory://"))}
    assert {"config.json", "model_config.json", "metrics.jsonl", "tokenizer/tokenizer.json"} <= remote
    assert any(p.startswith("checkpoints/3/") for p in remote)
    assert not any(p.startswith(("checkpoints/1/", "checkpoints/2/")) for p in remote)  # pruned remotely too
    cfg = json.loads(fs.cat_file(run_url.removeprefix("memory://") + "/config.json"))
    assert cfg["data"]["train"] == shards and cfg["output"] == run_url  # the run names the remote paths
    assert len(fs.cat_file(run_url.removeprefix("memory://") + "/metrics.jsonl").splitlines()) == 3

    # The shards were staged once; a second staging reuses the copy.
    local = storage.stage_shards(shards)
    stamp = os.path.getmtime(os.path.join(local, "manifest.json"))
    assert storage.stage_shards(shards) == local and os.path.getmtime(os.path.join(local, "manifest.json")) == stamp

    from rmflow.schemas.config import EvalConfig, ExportConfig
    from rmflow.trainer.export import export

    from rmflow.eval.evaluation import run_eval

    m = run_eval(EvalConfig(model=run_url, data=(shards,), output=str(tmp_path / "eval")))
    assert m["pairs"] > 0
    out = export(ExportConfig(run=run_url, output=str(tmp_path / "hf")))
    assert (pathlib.Path(out) / "model.safetensors").exists()
    assert json.loads((pathlib.Path(out) / "rmflow_export.json").read_text())["run"] == run_url

    # Without --resume an existing remote run is refused and left whole (the mirror would replace it).
    before = sorted(fs.find(run_url.removeprefix("memory://")))
    with pytest.raises(storage.StorageError, match="already holds a run: pass --resume"):
        train(TrainConfig(data=shards, model="micro", output=run_url, max_steps=1, batch_size=4))
    assert sorted(fs.find(run_url.removeprefix("memory://"))) == before

    # Resume brings the remote run down first: more steps continue from step 3.
    train(TrainConfig(data=shards, model="micro", output=run_url, max_steps=3, batch_size=4, checkpoint={"save_steps": 1, "keep_newest": 1}, logging={"steps": 1}),
          resume=True)  # already complete: nothing lost
    assert len(fs.cat_file(run_url.removeprefix("memory://") + "/metrics.jsonl").splitlines()) == 3


def test_staging_checks_the_disk_first(remote_shards, monkeypatch):
    shards, _ = remote_shards
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1024))
    with pytest.raises(storage.StorageError, match=r"needs 0\.\d\d GiB of local disk .* set RMFLOW_CACHE"):
        storage.stage_shards(shards)


def test_remote_shards_must_be_complete(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe(f"/{tmp_path.name}-x/shards/manifest.json", b"{}")
    with pytest.raises(storage.StorageError, match="no COMPLETED marker"):
        storage.stage_shards(f"memory:///{tmp_path.name}-x/shards")
