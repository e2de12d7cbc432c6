"""Readers and per-file layout detection through the real pipeline: Parquet, JSON arrays,
globs, directories, gzip; damaged files; margins, subsets and truncate-prompt end to end."""

import gzip
import json

import grain
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rmflow.pipelines.preprocess import PreprocessError, run
from rmflow.schemas.config import PreprocessConfig
from rmflow.schemas.record import decode

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731


def records(result, split="train"):
    info = result.manifest.splits[split]
    src = grain.sources.ArrayRecordDataSource([f"{result.output}/{s.file}" for s in info.shards])
    return [decode(src[i]) for i in range(len(src))]


def cfg(inputs, out, tokenizer_dir, **kw):
    kw.setdefault("eval_fraction", 0.0)
    return PreprocessConfig(inputs=tuple(inputs), output=str(out), tokenizer=tokenizer_dir, **kw)


def test_parquet_json_array_gzip_and_globs(tmp_path, tokenizer_dir):
    data = tmp_path / "data"
    data.mkdir()
    conv = [{"prompt": [U(f"q{i}")], "chosen": [A(f"c{i}")], "rejected": [A(f"r{i}")], "margin": float(i),
             "subset": "pq"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(conv), data / "conv.parquet")
    (data / "arr.json").write_text(json.dumps([{"prompt": f"p{i}", "chosen": "yes", "rejected": "no"} for i in range(4)]))
    with gzip.open(data / "hh.jsonl.gz", "wt") as f:
        for i in range(3):
            f.write(json.dumps({"chosen": f"\n\nHuman: h{i}\n\nAssistant: good", "rejected": f"\n\nHuman: h{i}\n\nAssistant: bad"}) + "\n")
    (data / "notes.txt").write_text("not data")  # ignored: not a data file
    result = run(cfg([str(data)], tmp_path / "out", tokenizer_dir))
    assert result.stats["records_per_file"] == {str(data / "arr.json"): 4, str(data / "conv.parquet"): 5,
                                                str(data / "hh.jsonl.gz"): 3}
    recs = records(result)
    assert len(recs) == 12
    pq_recs = [r for r in recs if r.source == "conv.parquet"]
    assert sorted(r.margin for r in pq_recs) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert {r.subset for r in pq_recs} == {"pq"}
    assert all(r.margin is None and r.subset is None for r in recs if r.source != "conv.parquet")
    # A glob picks the same files as the folder.
    again = run(cfg([str(data / "*.parquet"), str(data / "*.json*")], tmp_path / "out2", tokenizer_dir))
    assert again.stats["counts"]["pairs_written"] == 12


def test_damaged_files_are_reported_not_fatal(tmp_path, tokenizer_dir):
    good = b"".join(json.dumps({"prompt": f"p{i}", "chosen": "yes", "rejected": "no"}).encode() + b"\n" for i in range(50))
    (tmp_path / "ok.jsonl").write_bytes(good)
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(good)[:-40])  # truncated download
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    result = run(cfg([str(tmp_path / "*.*")], tmp_path / "out", tokenizer_dir, max_bad_fraction=1.0))
    errors = [json.loads(line) for line in open(tmp_path / "out" / "errors.jsonl")]
    unreadable = {e["source"].split("/")[-1] for e in errors if e["code"] == "unreadable_file"}
    assert unreadable == {"cut.jsonl.gz", "bad.parquet"}
    c = result.stats["counts"]
    assert c["records_read"] == c["pairs_written"] + c["errors"] + c["ties"] + c["duplicates"] + c["dropped_too_long"]
    assert c["pairs_written"] >= 50


def test_format_override_and_undetectable_file(tmp_path, tokenizer_dir):
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n")
    with pytest.raises(PreprocessError, match="unknown_layout|bad"):
        run(cfg([str(tmp_path / "a.jsonl")], tmp_path / "o1", tokenizer_dir, format="hh-rlhf"))
    result = run(cfg([str(tmp_path / "a.jsonl")], tmp_path / "o2", tokenizer_dir, format="text"))
    assert result.stats["counts"]["pairs_written"] == 1


def test_truncate_prompt_policy_end_to_end(tmp_path, tokenizer_dir, hf_tokenizer):
    long_history = [U("x " * 400), A("ok"), U("Now the real question?")]
    rows = [{"prompt": long_history, "chosen": [A("Good reply.")], "rejected": [A("Bad.")]},
            {"prompt": [U("q")], "chosen": [A("y " * 600)], "rejected": [A("n")]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PreprocessError, match="no pair survived"):  # both pairs exceed 256 tokens
        run(cfg([str(tmp_path / "d.jsonl")], tmp_path / "drop", tokenizer_dir, max_length=256))
    result = run(cfg([str(tmp_path / "d.jsonl")], tmp_path / "trunc", tokenizer_dir, max_length=256,
                     length_policy="truncate-prompt", max_bad_fraction=1.0))
    c = result.stats["counts"]
    assert (c["pairs_written"], c["dropped_too_long"]) == (1, 1)  # the long reply is never cut
    (rec,) = records(result)
    assert len(rec.chosen_ids) == 256
    text = hf_tokenizer.decode(rec.chosen_ids.tolist())
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert text.endswith("Now the real question?<|im_end|>\n<|im_start|>assistant\nGood reply.<|im_end|>\n")
    errors = [json.loads(line) for line in open(tmp_path / "trunc" / "errors.jsonl")]
    assert [e["code"] for e in errors] == ["replies_too_long"]
    assert result.stats["counters"]["prompt_truncated"] == 1
    assert result.stats["counters"]["not_written_too_long"] == 1


def test_byte_order_mark_and_gzip_by_magic_bytes(tmp_path):
    """A UTF-8 BOM (files saved on Windows or from spreadsheets) is valid data, not bad JSON;
    gzip is recognised by its magic bytes, whatever the file is called."""
    import gzip

    from rmflow.pipelines.io import iter_records

    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "c", "rejected": "d"}]
    text = "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")
    bom = tmp_path / "excel.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + text)
    array = tmp_path / "excel.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode("utf-8"))
    hidden_gzip = tmp_path / "export.jsonl"  # gzipped, named as plain JSON Lines
    hidden_gzip.write_bytes(gzip.compress(b"\xef\xbb\xbf" + text))
    for path in (bom, array, hidden_gzip):
        got = list(iter_records(str(path)))
        assert [problem for _, _, problem in got] == [None, None], path.name
        assert [json.loads(raw) for _, raw, _ in got] == rows, path.name


def test_datasets_users_already_have_a_save_to_disk_folder_and_a_hub_data_set_in_the_local_cache(
        tmp_path, tokenizer_dir, monkeypatch):
    """A folder written by datasets.Dataset.save_to_disk (Arrow IPC streams, its metadata JSON
    left out as not data), and hf://datasets/OWNER/NAME read offline from the local Hugging Face
    cache's snapshot (its Parquet shards, the revision refs/main names); each the same records as
    the same pairs in JSON Lines. Not in the cache: one line saying how to download it."""
    import datasets

    pairs = [{"prompt": [U(f"q{i}")], "chosen": [A(f"good {i}")], "rejected": [A(f"bad {i}")]} for i in range(6)]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    reference = sorted((r.chosen_ids.tolist(), r.rejected_ids.tolist())
                       for r in records(run(cfg([str(jsonl)], tmp_path / "ref", tokenizer_dir))))

    datasets.Dataset.from_list(pairs).save_to_disk(str(tmp_path / "saved"))
    saved = run(cfg([str(tmp_path / "saved")], tmp_path / "from-disk", tokenizer_dir))
    assert saved.stats["counts"]["errors"] == 0 and list(saved.stats["records_per_file"].values()) == [6]
    assert sorted((r.chosen_ids.tolist(), r.rejected_ids.tolist()) for r in records(saved)) == reference

    cache = tmp_path / "hub"  # the layout huggingface_hub's downloads leave (HF_HUB_CACHE)
    repo = cache / "datasets--me--prefs"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(pairs), repo / "snapshots" / "abc123" / "data" / "train-00000-of-00001.parquet")
    (repo / "snapshots" / "abc123" / "README.md").write_text("# a card, not data")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    hub = run(cfg(["hf://datasets/me/prefs"], tmp_path / "from-hub", tokenizer_dir))
    assert sorted((r.chosen_ids.tolist(), r.rejected_ids.tolist()) for r in records(hub)) == reference
    from rmflow.pipelines.io import expand_inputs  # a glob inside the snapshot picks files, as for any folder

    assert [p for p, _ in expand_inputs(("hf://datasets/me/prefs/data/train-*.parquet",))] == \
        [str(repo / "snapshots" / "abc123" / "data" / "train-00000-of-00001.parquet")]
    with pytest.raises(PreprocessError, match="hf download --repo-type dataset me/other"):
        run(cfg(["hf://datasets/me/other"], tmp_path / "missing", tokenizer_dir))
    # a revision, as HfFileSystem spells it: a commit's snapshot, or a branch's ref; else how to get it
    at = run(cfg(["hf://datasets/me/prefs@abc123"], tmp_path / "at", tokenizer_dir))
    assert sorted((r.chosen_ids.tolist(), r.rejected_ids.tolist()) for r in records(at)) == reference
    with pytest.raises(PreprocessError, match="me/prefs at revision v2 is not in the local Hugging Face cache .*"
                                              "hf download --repo-type dataset me/prefs --revision v2$"):
        run(cfg(["hf://datasets/me/prefs@v2"], tmp_path / "v2", tokenizer_dir))
    with pytest.raises(PreprocessError, match="rmflow reads the Hub's data sets, as hf://datasets/OWNER/NAME"):
        run(cfg(["hf://me/prefs"], tmp_path / "no-datasets", tokenizer_dir))
    # a DatasetDict: its splits' files share a name; each record names its own (its split's folder),
    # and the summary says why the metadata files were not read
    datasets.DatasetDict({"train": datasets.Dataset.from_list(pairs[:4]),
                          "test": datasets.Dataset.from_list(pairs[4:])}).save_to_disk(str(tmp_path / "dict"))
    split = run(cfg([str(tmp_path / "dict")], tmp_path / "from-dict", tokenizer_dir))
    assert sorted({r.source for r in records(split)}) == ["test/data-00000-of-00001.arrow",
                                                          "train/data-00000-of-00001.arrow"]
    from rmflow.pipelines.io import skipped_summary

    line = skipped_summary(split.stats["skipped_inputs"])
    assert "the metadata of datasets.save_to_disk folders" in line and "earlier rmflow outputs" not in line, line
