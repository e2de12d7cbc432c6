"""The manifest: the only contract between the preprocess and train stages.

A shard directory holds ``manifest.json`` (this), ``stats.json``, ``config.json``,
``errors.jsonl``, the ArrayRecord shards and, written last, ``COMPLETED``. A consumer
reads the manifest, checks it against its own run (``check_compatible``) and opens the
shards it lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from schemas.errors import RmflowError
from schemas.record import RECORD_VERSION

MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"
STATS_FILE = "stats.json"
CONFIG_FILE = "config.json"
ERRORS_FILE = "errors.jsonl"
COMPLETED_FILE = "COMPLETED"
TOKENIZER_DIR = "tokenizer"  # the tokenizer files as used (chat template override applied)
SPLITS = ("train", "eval")
# What the shards train: an outcome reward model (preference pairs, PairRecord) or a process
# reward model (stepwise solutions with a label per step, StepRecord).
KINDS = ("outcome", "process")

# Files that define a Hugging Face tokenizer's behaviour; hashed in sorted name order.
TOKENIZER_FILES = (
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "merges.txt",
    "special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
    "vocab.json", "vocab.txt",
)


class ManifestError(RmflowError, ValueError):
    """A manifest is malformed or does not match the run that wants to read it."""


def sha256_files(files: Mapping[str, bytes]) -> str:
    """Hash of a set of named files, independent of order and of where they live."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.array_record"


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    name: str
    sha256: str
    vocab_size: int
    pad_token_id: int | None
    eos_token_id: int | None
    chat_template_sha256: str | None


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    file: str
    pairs: int


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    pairs: int
    shards: tuple[ShardInfo, ...]


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerInfo
    max_length: int
    length_policy: str
    splits: Mapping[str, SplitInfo]
    inputs: tuple[InputFile, ...]
    config: Mapping[str, Any]
    manifest_version: int = MANIFEST_VERSION
    record_version: int = RECORD_VERSION
    kind: str = "outcome"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ManifestError(f"unknown kind {self.kind!r}; expected one of {KINDS}")
        for name, split in self.splits.items():
            if name not in SPLITS:
                raise ManifestError(f"unknown split {name!r}; expected one of {SPLITS}")
            if sum(s.pairs for s in split.shards) != split.pairs:
                raise ManifestError(f"split {name}: shard pair counts do not add up to {split.pairs}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            d = json.loads(text)
            if d.get("manifest_version") != MANIFEST_VERSION:
                raise ManifestError(
                    f"manifest version {d.get('manifest_version')!r}; this rmflow reads "
                    f"{MANIFEST_VERSION}: re-run `rmflow preprocess`"
                )
            return cls(
                tokenizer=TokenizerInfo(**d["tokenizer"]),
                max_length=d["max_length"],
                length_policy=d["length_policy"],
                splits={
                    k: SplitInfo(v["pairs"], tuple(ShardInfo(**s) for s in v["shards"]))
                    for k, v in d["splits"].items()
                },
                inputs=tuple(InputFile(**f) for f in d["inputs"]),
                config=d["config"],
                manifest_version=d["manifest_version"],
                record_version=d["record_version"],
                kind=d.get("kind", "outcome"),  # manifests written before process models: pairs
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ManifestError(f"malformed manifest: {type(e).__name__}: {e}") from e

    def check_compatible(
        self, *, tokenizer_sha256: str | None = None, max_length: int | None = None
    ) -> None:
        """Raise ManifestError listing every way these shards differ from what a run expects."""
        problems = []
        if self.record_version != RECORD_VERSION:
            problems.append(f"record version {self.record_version} != {RECORD_VERSION} (this rmflow)")
        if tokenizer_sha256 is not None and tokenizer_sha256 != self.tokenizer.sha256:
            problems.append(
                f"tokenizer hash {self.tokenizer.sha256[:12]}… (shards, {self.tokenizer.name}) "
                f"!= {tokenizer_sha256[:12]}… (this run)"
            )
        if max_length is not None and max_length < self.max_length:
            problems.append(f"max_length {self.max_length} (shards) > {max_length} (this run)")
        if problems:
            raise ManifestError("shards do not match this run: " + "; ".join(problems))
