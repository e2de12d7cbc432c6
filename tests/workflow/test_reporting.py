"""report_to: Weights & Biases (offline) gets the same metrics at the same steps as metrics.jsonl
and the resolved config, read back from the run's own W&B record file; a resumed training run
continues the same W&B run; TensorBoard stays the default; jsonl is always written."""

import json
import pathlib
import shutil
import struct
import time

import pytest
from rmflow.schemas.config import ConfigError
from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.train import run as train

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"


def wandb_records(path: pathlib.Path) -> list:
    """The protobuf records of a .wandb file (W&B's log format: a 7-byte header, then 32 KiB
    blocks of records, each with a 7-byte header: crc, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    return [pb.Record.FromString(c) for c in out]


def finished_records(run_dir: pathlib.Path, timeout: float = 120.0) -> list:
    """The records of the run's .wandb file once its exit record is on disk. ``wandb.finish``
    returns after telling W&B's service process that the run is done; the service flushes and
    closes the file afterwards, so a file read at once can still be empty (seen on a loaded CI)."""
    deadline = time.monotonic() + timeout
    while True:
        paths = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(paths) <= 1, paths
        try:
            records = wandb_records(paths[0]) if paths else []
        except Exception:  # a record half-written as we read: read again
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"no exit record in {paths} after {timeout:.0f} s"
        time.sleep(0.2)


def logged(run_dir: pathlib.Path):
    history, config, run_id = {}, {}, None
    for r in finished_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(row.get("_step", r.history.step.num), {}).update(row)
        elif kind == "run":
            run_id = r.run.run_id
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    return run_id, history, config


@pytest.mark.slow
def test_wandb_gets_the_same_metrics_and_the_config(demo_shards, tmp_path, monkeypatch):
    shards = demo_shards
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrainConfig(data=str(shards), model="micro", output=str(tmp_path / "run"), max_steps=4, batch_size=4,
                      logging={"steps": 1, "report_to": ("tensorboard", "wandb")}, eval_steps=2,
                      checkpoint={"save_steps": 2})
    train(cfg)
    run_id, history, config = logged(tmp_path / "run")
    jsonl = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert sorted(history) == sorted(jsonl) == [1, 2, 3, 4]
    for step, rec in jsonl.items():
        for key in ("loss", "accuracy", "learning_rate", "tokens_per_second"):
            assert history[step][key] == pytest.approx(rec[key], rel=1e-12)
    assert history[2]["eval_accuracy"] == pytest.approx(jsonl[2]["eval_accuracy"])
    assert config["optimizer"]["learning_rate"] == cfg.optimizer.learning_rate
    assert config["data"]["train"] == str(shards)
    assert (tmp_path / "run" / "tensorboard").is_dir()
    assert run_id == (tmp_path / "run" / "wandb_id").read_text().strip()

    # Resumed from the step-2 checkpoint: the same W&B run id.
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
    shutil.rmtree(tmp_path / "run" / "wandb")
    train(cfg, resume=True)
    again, history, _ = logged(tmp_path / "run")
    assert again == run_id and sorted(history) == [3, 4]


def test_report_to_values(demo_shards, tmp_path):
    shards = demo_shards
    assert TrainConfig(data="d", model="micro", output="o").logging.report_to == ("tensorboard",)
    assert TrainConfig(data="d", model="micro", output="o", logging={"report_to": ["none"]}).logging.report_to == ()
    cfg = TrainConfig(data="d", model="micro", output="o").with_overrides(["logging.report_to=tensorboard,wandb"])
    assert cfg.logging.report_to == ("tensorboard", "wandb")
    with pytest.raises(ConfigError, match="report_to \\['mlflow'\\]"):
        TrainConfig(data="d", model="micro", output="o", logging={"report_to": ("mlflow",)})
    train(TrainConfig(data=str(shards), model="micro", output=str(tmp_path / "quiet"), max_steps=1, batch_size=2, logging={"report_to": ()}))
    assert not (tmp_path / "quiet" / "tensorboard").exists() and (tmp_path / "quiet" / "metrics.jsonl").exists()
