"""End to end on the HH-RLHF pairs of ../shared/data (a glob over the folder, which also
holds other data sets) with the SmolLM2 tokenizer: reconciliation, ties, determinism
(byte-identical reruns, 1 vs 2 workers), read-back through Grain."""

import gzip
import json
import pathlib

import grain
import numpy as np
import pytest
from rmflow.pipelines.preprocess import PreprocessError, run
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.manifest import Manifest
from rmflow.schemas.record import decode

HH_FILES = ("hh_helpful_base_test_first2000.jsonl.gz", "hh_helpful_rejection_sampled_test.jsonl.gz")
EXPECTED_TIES = 33  # documented in ../shared/data/README.md (1 + 32)


def config(shared_data, tokenizer_dir, out, **kw):
    return PreprocessConfig(inputs=(str(shared_data / "hh_*.jsonl.gz"),), output=str(out), tokenizer=tokenizer_dir,
                            max_length=1024, eval_fraction=0.05, num_shards=2, **kw)


@pytest.fixture(scope="module")
def runs(shared_data, tokenizer_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    first = run(config(shared_data, tokenizer_dir, base / "a"))
    second = run(config(shared_data, tokenizer_dir, base / "b", num_workers=2))
    return first, second


def shard_paths(result):
    out = pathlib.Path(result.output)
    return {name: out / s.file for name, split in result.manifest.splits.items() for s in split.shards}


def test_counts_reconcile_and_ties_are_reported(runs, shared_data):
    stats = runs[0].stats
    c = stats["counts"]
    total = sum(1 for f in HH_FILES for line in gzip.open(shared_data / f, "rt") if line.strip())
    assert c["records_read"] == total == 4749
    assert c["records_read"] == c["pairs_written"] + c["dropped_too_long"] + c["ties"] + c["duplicates"] + c["errors"]
    assert c["ties"] == EXPECTED_TIES
    assert c["pairs_written"] == c["pairs_written_train"] + c["pairs_written_eval"]
    assert 0 < c["pairs_written_eval"] < 0.1 * c["pairs_written"]
    errors = [json.loads(line) for line in open(pathlib.Path(runs[0].output) / "errors.jsonl")]
    assert len(errors) == c["records_read"] - c["pairs_written"]
    assert sum(e["category"] == "tie" for e in errors) == EXPECTED_TIES
    lines = {f: gzip.open(shared_data / f, "rt").read().split("\n") for f in HH_FILES}
    for e in errors:  # every dropped record is traceable to its file and line, with its raw text
        assert e["record"] == lines[pathlib.Path(e["source"]).name][e["line"] - 1] and e["reason"]


def test_outputs_are_complete_and_described(runs, shared_data, tokenizer_dir):
    out = pathlib.Path(runs[0].output)
    names = {p.name for p in out.iterdir()}
    assert {"manifest.json", "stats.json", "config.json", "errors.jsonl", "COMPLETED"} <= names
    assert not list(out.parent.glob("a.tmp-*"))  # staging was published, not left behind
    m = Manifest.from_json((out / "manifest.json").read_text())
    assert m == runs[0].manifest
    assert m.tokenizer.pad_token_id == m.tokenizer.eos_token_id == 2
    assert m.max_length == 1024 and m.length_policy == "drop"
    assert [f.path.split("/")[-1] for f in m.inputs] == list(HH_FILES)
    assert [s.file for s in m.splits["train"].shards] == ["train-00000-of-00002.array_record",
                                                          "train-00001-of-00002.array_record"]
    assert m.splits["train"].records == runs[0].stats["counts"]["pairs_written_train"]
    assert m.config["tokenizer"] == tokenizer_dir
    stats = json.loads((out / "stats.json").read_text())
    for field in ("prompt", "chosen", "rejected"):
        s = stats["lengths"]["train"][field]
        assert s["count"] == m.splits["train"].records and s["p50"] <= s["p99"] <= s["max"] <= 1024
        assert sum(s["histogram"]["counts"]) == s["count"]


def test_rerun_gives_byte_identical_shards(runs):
    a, b = shard_paths(runs[0]), shard_paths(runs[1])
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes(), name
    assert runs[0].manifest.splits == runs[1].manifest.splits


def test_every_shard_reads_back_through_grain(runs, hf_tokenizer):
    m = runs[0].manifest
    seen = set()
    for info in m.splits.values():
        paths = [str(pathlib.Path(runs[0].output) / s.file) for s in info.shards]
        source = grain.sources.ArrayRecordDataSource(paths)
        assert len(source) == info.records
        for i in range(len(source)):
            rec = decode(source[i])
            assert rec.pair_id not in seen
            seen.add(rec.pair_id)
            assert rec.chosen_last == len(rec.chosen_ids) - 1 and len(rec.chosen_ids) <= m.max_length
            assert np.array_equal(rec.chosen_ids[: rec.prompt_len], rec.rejected_ids[: rec.prompt_len])
    # Spot-check one record's tokens against the tokenizer's own rendering.
    rec = decode(grain.sources.ArrayRecordDataSource([str(shard_paths(runs[0])["eval"])])[0])
    text = hf_tokenizer.decode(rec.chosen_ids.tolist())
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n")
    assert hf_tokenizer.decode(rec.chosen_ids[: rec.prompt_len].tolist()).endswith("<|im_start|>assistant\n")


def test_existing_output_is_refused_unless_overwrite(runs, shared_data, tokenizer_dir):
    cfg = config(shared_data, tokenizer_dir, runs[0].output)
    with pytest.raises(PreprocessError, match="already exists.*--overwrite"):
        run(cfg)
