"""The preprocess job finalises itself: run as a bare Beam job (no launcher reading anything
back, as on Dataflow when the launcher has gone), it publishes a complete output, COMPLETED
last; when its checks fail it publishes nothing and leaves the reason in the staging folder."""

import json
import pathlib

import pytest
from rmflow.pipelines.preprocess import build, finalization, make_pipeline, make_plan, run
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.manifest import Manifest

DEMO = pathlib.Path(__file__).resolve().parents[2] / "rmflow" / "demo"


def bare_job(cfg: PreprocessConfig):
    """What a worker fleet does with the submitted graph: run it; nobody waits for the result."""
    cfg = cfg.with_absolute_paths()
    plan = make_plan(cfg)
    p = make_pipeline(cfg)
    build(p, cfg, plan, finalization(cfg, plan))
    return plan, p.run()


def test_a_bare_job_publishes_a_complete_output(tmp_path, tokenizer_dir):
    cfg = PreprocessConfig(inputs=(str(DEMO / "hh_rlhf_helpful_sample.jsonl.gz"),), output=str(tmp_path / "out"),
                           tokenizer=tokenizer_dir, max_length=256, length_policy="truncate-prompt",
                           max_bad_fraction=1.0)
    plan, result = bare_job(cfg)
    result.wait_until_finish()
    out = tmp_path / "out"
    assert (out / "COMPLETED").exists() and not pathlib.Path(plan.staging).exists()
    names = {p.name for p in out.iterdir()}
    assert {"manifest.json", "stats.json", "config.json", "errors.jsonl", "tokenizer"} <= names
    assert not names & {"_summary.json", "_owner.json", "_FAILED.json"}
    manifest = Manifest.from_json((out / "manifest.json").read_text())
    stats = json.loads((out / "stats.json").read_text())
    c = stats["counts"]
    assert stats["reconciles"] and c["records_read"] == 500
    assert sum(s.records for s in manifest.splits.values()) == c["pairs_written"]
    assert c["prompt_truncated"] > 0  # counted exactly in the job, not read from runner metrics
    assert len((out / "errors.jsonl").read_text().splitlines()) == c["records_read"] - c["pairs_written"]
    # The launcher's view equals what the job wrote.
    again = run(PreprocessConfig(**{**cfg.to_dict(), "output": str(tmp_path / "again")}))
    assert again.stats["counts"] == c


def test_a_failed_job_publishes_nothing(tmp_path, tokenizer_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "c", "rejected": "r"}\n' + '{"broken\n' * 9)
    cfg = PreprocessConfig(inputs=(str(bad),), output=str(tmp_path / "out"), tokenizer=tokenizer_dir)
    with pytest.raises(Exception, match="are bad, more than --max-bad-fraction"):  # noqa: B017 - the runner's wrapper
        _, result = bare_job(cfg)
        result.wait_until_finish()
    assert not (tmp_path / "out").exists()
    (staging,) = tmp_path.glob("out.tmp-*")
    failed = json.loads((staging / "_FAILED.json").read_text())
    assert "9 of 10 records (90.0%) are bad" in failed["error"] and failed["counts"]["errors"] == 9
    assert len((staging / "errors.jsonl").read_text().splitlines()) == 9
