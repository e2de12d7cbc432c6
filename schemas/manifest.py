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

from rmflow.schemas import jsontext
from rmflow.schemas.config import SCORED_BY_WEIGHTS, STEP_SEPARATOR
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.kinds import KINDS, OUTCOME
from rmflow.schemas.record import RECORD_VERSION

MANIFEST_VERSION = 2
READABLE_MANIFESTS = {MANIFEST_VERSION: "records"}  # version -> the key of each split's and shard's record count
MANIFEST_FILE = "manifest.json"
STATS_FILE = "stats.json"
CONFIG_FILE = "config.json"
ERRORS_FILE = "errors.jsonl"
COMPLETED_FILE = "COMPLETED"
TOKENIZER_DIR = "tokenizer"  # the tokenizer files as used (chat template override applied)
SPLITS = ("train", "eval")

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


def tokenizer_sha256(files: Mapping[str, bytes]) -> str:
    """The identity of a tokenizer as it is used: its files (TOKENIZER_FILES, a chat template
    override already applied), hashed alike wherever they are read (the assets preprocessing
    loads, the shards' and a run's ``tokenizer/`` copies, an export)."""
    return sha256_files({name: data for name, data in files.items() if name in TOKENIZER_FILES})


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def vocabulary_sha256(files: Mapping[str, bytes]) -> str:
    """The identity of a tokenizer without its chat template: what maps text to ids. A base model
    is checked against shards with it (the template is part of how the data was rendered, and
    `--chat-template` may replace it); a trained run or an export, with ``tokenizer_sha256``."""
    kept = {name: data for name, data in files.items() if name in TOKENIZER_FILES and name not in CHAT_TEMPLATE_FILES}
    if "tokenizer_config.json" in kept:
        try:
            config = json.loads(kept["tokenizer_config.json"])
            config.pop("chat_template", None)
            kept["tokenizer_config.json"] = jsontext.dumps(config, sort_keys=True).encode()
        except ValueError:
            pass
    return sha256_files(kept)


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
    vocabulary_sha256: str | None = None  # without the chat template (None: a manifest from before it)


# How special-token strings inside message text are tokenized: as text, never as the control
# tokens they spell (rmflow.rendering.tokenize), so a message cannot forge a turn or an end of text.
SPECIAL_TEXT = "text"


@dataclasses.dataclass(frozen=True)
class RenderSpec:
    """How records became token ids: what scoring must repeat exactly for its rewards to mean
    what training's did (``rmflow.rendering``). A manifest states it (``Manifest.render``); a run
    keeps its manifest, an export writes it into its export info."""

    tokenizer_sha256: str  # the tokenizer as used, chat template included
    vocabulary_sha256: str | None  # the text-to-ids part alone (None: a manifest from before it)
    chat_template_sha256: str | None
    step_separator: str  # the text after every step of a stepwise solution
    special_text: str = SPECIAL_TEXT

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RenderSpec:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    file: str
    records: int  # pairs, solutions: the units of the manifest's kind


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    records: int
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
    kind: str = OUTCOME.name
    layouts: tuple[str, ...] = ()  # the inputs' layouts as read (--format, or each file's as detected)
    weighted_scores: bool = False  # some records' scores are weighted sums of their ratings (attribute_weights)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ManifestError(f"unknown kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        for name, split in self.splits.items():
            if name not in SPLITS:
                raise ManifestError(f"unknown split {name!r}; expected one of {SPLITS}")
            if sum(s.records for s in split.shards) != split.records:
                raise ManifestError(f"split {name}: shard record counts do not add up to {split.records}")

    @property
    def attributes(self) -> tuple[str, ...]:
        """The attribute ratings each multi-response record holds, by name in order (preprocess's
        ``attributes``); () when none were kept."""
        text = self.config.get("attributes") or ""
        return tuple(n.strip() for n in text.split(",")) if text.strip() else ()

    @property
    def input_layouts(self) -> tuple[str, ...]:
        """The layouts its records were read in: as detected (``layouts``), or a manifest from
        before that field, its --format when one was forced."""
        fmt = self.config.get("format")
        return self.layouts or ((fmt,) if fmt and fmt != "auto" else ())

    @property
    def scored_by_weights(self) -> bool:
        """Its records' scores are the weighted sums of their attribute ratings (preprocess's
        ``attribute_weights``): a layout read that way (``SCORED_BY_WEIGHTS``), or records rated only by
        their attributes (``weighted_scores``)."""
        return self.weighted_scores or any(layout in SCORED_BY_WEIGHTS for layout in self.input_layouts)

    @property
    def label_weights(self) -> str | None:
        """The attribute weights its records' scores are the weighted sums of (``scored_by_weights``), else None."""
        return self.config.get("attribute_weights") if self.scored_by_weights else None

    @property
    def model_kind(self) -> str:
        """The kind of the model trained on these shards (``ModelKind.model``): what its run and
        its export are scored, evaluated and served as."""
        return KINDS[self.kind].model.name

    @property
    def render(self) -> RenderSpec:
        """How these records were rendered (``RenderSpec``)."""
        t = self.tokenizer
        return RenderSpec(t.sha256, t.vocabulary_sha256, t.chat_template_sha256, self.step_separator)

    @property
    def step_separator(self) -> str:
        """The text after every step of a stepwise solution, as these records were rendered: the
        preprocess config's (``STEP_SEPARATOR`` in a manifest from before the option). Scoring
        renders with it, so that a process model reads steps as it was trained on them."""
        return self.config.get("step_separator", STEP_SEPARATOR)

    def to_json(self) -> str:
        return jsontext.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def content_identity(self) -> str:
        """The manifest without what says where or how its job ran (``WHERE_AND_HOW``: the output
        folder, the runner ...): two preprocessings of the same inputs with the same options (the
        same shards) share it, wherever they were written."""
        from rmflow.schemas.config import WHERE_AND_HOW

        d = dataclasses.asdict(self)
        d["config"] = {k: v for k, v in d["config"].items() if k not in WHERE_AND_HOW}
        return jsontext.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            d = json.loads(text)
            version = d.get("manifest_version")
            count = READABLE_MANIFESTS.get(version) if type(version) is int else None
            if count is None:
                raise ManifestError(
                    f"manifest version {d.get('manifest_version')!r}; this rmflow reads "
                    f"{' and '.join(map(str, READABLE_MANIFESTS))}: re-run `rmflow preprocess`"
                )
            return cls(
                tokenizer=TokenizerInfo(**d["tokenizer"]),
                max_length=d["max_length"],
                length_policy=d["length_policy"],
                splits={
                    k: SplitInfo(v[count], tuple(ShardInfo(s["file"], s[count]) for s in v["shards"]))
                    for k, v in d["splits"].items()
                },
                inputs=tuple(InputFile(**f) for f in d["inputs"]),
                config=d["config"],
                manifest_version=MANIFEST_VERSION,  # read into this version's terms
                record_version=d["record_version"],
                kind=d["kind"],
                layouts=tuple(d.get("layouts", ())),
                weighted_scores=bool(d.get("weighted_scores", False)),
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ManifestError(f"malformed manifest: {type(e).__name__}: {e}") from e

    def check_compatible(
        self, *, tokenizer_sha256: str | None = None, max_length: int | None = None,
        vocabulary_sha256: str | None = None,
    ) -> None:
        """Raise ManifestError listing every way these shards differ from what a run expects."""
        problems = []
        if self.record_version != RECORD_VERSION:
            problems.append(f"record version {self.record_version} != {RECORD_VERSION} (this rmflow)")
        if vocabulary_sha256 is not None and vocabulary_sha256 != self.tokenizer.vocabulary_sha256:
            problems.append(f"tokenizer (vocabulary) hash {str(self.tokenizer.vocabulary_sha256)[:12]}… (shards, "
                            f"{self.tokenizer.name}) != {vocabulary_sha256[:12]}… (this run)")
        if tokenizer_sha256 is not None and tokenizer_sha256 != self.tokenizer.sha256:
            problems.append(
                f"tokenizer hash {self.tokenizer.sha256[:12]}… (shards, {self.tokenizer.name}) "
                f"!= {tokenizer_sha256[:12]}… (this run)"
            )
        if max_length is not None and max_length < self.max_length:
            problems.append(f"max_length {self.max_length} (shards) > {max_length} (this run)")
        if problems:
            raise ManifestError("shards do not match this run: " + "; ".join(problems))
