import json

import pytest
from rmflow.schemas.config import ConfigError, PreprocessConfig
from rmflow.schemas.manifest import (
    InputFile,
    Manifest,
    ManifestError,
    ShardInfo,
    SplitInfo,
    TokenizerInfo,
    sha256_files,
)

BASE = dict(inputs=("a.jsonl",), output="out", tokenizer="tok")


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"inputs": ()}, "inputs"), ({"output": ""}, "output"), ({"tokenizer": ""}, "tokenizer"),
        ({"format": "csv"}, "format"), ({"length_policy": "cut"}, "length_policy"),
        ({"max_length": 4}, "max_length"), ({"max_length": True}, "max_length"),
        ({"eval_fraction": 1.0}, "eval_fraction"), ({"max_bad_fraction": -0.1}, "max_bad_fraction"),
        ({"num_workers": 0}, "num_workers"), ({"num_shards": -1}, "num_shards"),
    ],
)
def test_invalid_config_says_what_to_fix(kw, message):
    with pytest.raises(ConfigError, match=message):
        PreprocessConfig(**{**BASE, **kw})


def test_config_is_frozen_and_round_trips():
    cfg = PreprocessConfig(**BASE, dedup=True)
    with pytest.raises(AttributeError):
        cfg.max_length = 3
    assert PreprocessConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ConfigError, match="unknown PreprocessConfig keys"):
        PreprocessConfig.from_dict({**BASE, "max_len": 3})
    assert "output" not in cfg.output_affecting() and "max_length" in cfg.output_affecting()


def manifest(**kw):
    base = dict(
        tokenizer=TokenizerInfo("tok", "ab" * 32, 100, 2, 2, None),
        max_length=512, length_policy="drop",
        splits={"train": SplitInfo(3, (ShardInfo("train-00000-of-00001.array_record", 3),))},
        inputs=(InputFile("a.jsonl", 10),), config={"max_length": 512},
    )
    base.update(kw)
    return Manifest(**base)


def test_manifest_round_trip_and_checks():
    m = manifest()
    assert Manifest.from_json(m.to_json()) == m
    m.check_compatible(tokenizer_sha256="ab" * 32, max_length=1024)
    with pytest.raises(ManifestError, match="tokenizer hash.*max_length 512"):
        m.check_compatible(tokenizer_sha256="cd" * 32, max_length=256)
    with pytest.raises(ManifestError, match="do not add up"):
        manifest(splits={"train": SplitInfo(4, (ShardInfo("x", 3),))})
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_json('{"manifest_version": 2}')
    with pytest.raises(ManifestError, match="this rmflow reads 2: re-run"):
        Manifest.from_json('{"manifest_version": 99}')
    with pytest.raises(ManifestError, match="re-run"):
        Manifest.from_json('{"manifest_version": true}')


def test_a_manifest_counts_records_and_refuses_another_version():
    """The manifest counts each split's and shard's records, whatever the kind (version 2); a
    manifest of another version is refused in one line saying to preprocess again."""
    import json

    m = manifest()
    written = json.loads(m.to_json())
    assert written["manifest_version"] == 2 and written["splits"]["train"]["records"] == 3
    assert "pairs" not in written["splits"]["train"] and "pairs" not in written["splits"]["train"]["shards"][0]
    old = json.loads(m.to_json())
    old["manifest_version"] = 1
    for split in old["splits"].values():
        split["pairs"] = split.pop("records")
        for shard in split["shards"]:
            shard["pairs"] = shard.pop("records")
    with pytest.raises(ManifestError, match="manifest version 1; this rmflow reads 2: re-run `rmflow preprocess`"):
        Manifest.from_json(json.dumps(old))


def test_tokenizer_hash_is_order_free_and_content_sensitive():
    assert sha256_files({"a": b"1", "b": b"2"}) == sha256_files({"b": b"2", "a": b"1"})
    assert sha256_files({"a": b"1"}) != sha256_files({"a": b"2"}) != sha256_files({"b": b"1"})


def test_tokenizer_identity_covers_the_template_and_the_vocabulary_identity_does_not():
    from rmflow.schemas.manifest import tokenizer_sha256, vocabulary_sha256

    files = {"tokenizer.json": b'{"model": 1}', "tokenizer_config.json": b'{"chat_template": "A", "x": 1}'}
    other_template = {**files, "tokenizer_config.json": b'{"x": 1, "chat_template": "B"}'}
    own_file = {**files, "chat_template.jinja": b"C"}
    other_vocab = {**files, "tokenizer.json": b'{"model": 2}'}
    assert len({tokenizer_sha256(f) for f in (files, other_template, own_file, other_vocab)}) == 4
    assert vocabulary_sha256(files) == vocabulary_sha256(other_template) == vocabulary_sha256(own_file)
    assert vocabulary_sha256(other_vocab) != vocabulary_sha256(files)
    assert tokenizer_sha256({**files, "README.md": b"x"}) == tokenizer_sha256(files)  # tokenizer files only


def test_the_step_separator_of_shards_is_read_in_one_place():
    """The manifest says how its stepwise records were rendered (``Manifest.step_separator``):
    the preprocess config's, or the default for a manifest from before the option. Nothing reads
    the manifest's config for it with a fallback of its own."""
    import pathlib
    import re

    from rmflow.schemas.config import STEP_SEPARATOR

    assert manifest(config={"max_length": 512, "step_separator": "\n\n"}).step_separator == "\n\n"
    assert manifest(config={"max_length": 512}).step_separator == STEP_SEPARATOR
    root = pathlib.Path(__file__).resolve().parents[2]
    home = root / "schemas" / "manifest.py"
    reads = re.compile(r"config(\.get\(|\[)[\"']step_separator[\"']")
    for package in ("schemas", "rendering", "pipelines", "trainer", "rmflow"):
        for f in sorted((root / package).rglob("*.py")):
            if f != home:
                assert not reads.search(f.read_text()), f"{f.relative_to(root)}: use Manifest.step_separator"


def test_an_export_config_says_what_it_lacks():
    from rmflow.schemas.config import ConfigError, ExportConfig

    with pytest.raises(ConfigError, match="export needs output: the folder to export into"):
        ExportConfig(run="runs/rm1")
    with pytest.raises(ConfigError, match="export needs run"):
        ExportConfig(output="hf")
    assert ExportConfig(run="r", output="o", step="3").step == 3 and ExportConfig(run="r", output="o").max_shard_bytes == 2**31
