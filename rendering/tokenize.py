"""Chat template and tokenization: canonical pairs to token ids with explicit reward indices.

``TokenizerAssets`` holds the tokenizer's files as bytes (where they are read from and written
to is the Beam stage's: ``pipelines.tokenizer_files``); its hash is the tokenizer's identity as
used, which the manifest, a run and an export carry. ``RecordTokenizer`` renders and tokenizes a
record exactly as preprocessing did: the Beam step wraps it, and scoring (the API, the server,
eval, batch scoring) calls it directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
from rmflow.rendering.formats import BadRecord, CanonicalPair, CanonicalSteps, Message
from rmflow.rendering.length import TooLong, apply_length_policy, apply_length_policy_steps
from rmflow.rendering.responses import CanonicalResponses, spread
from rmflow.schemas import jsontext
from rmflow.schemas.config import STEP_SEPARATOR
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.manifest import (
    TokenizerInfo,
    sha256_text,
    tokenizer_sha256,
    vocabulary_sha256,
)
from rmflow.schemas.record import PairRecord, ResponsesRecord, StepRecord

# transformers announces at import that PyTorch is absent: irrelevant here (tokenizers only).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class TokenizerError(RmflowError, RuntimeError):
    """The tokenizer cannot be loaded or cannot do what the run needs."""


@dataclasses.dataclass(frozen=True)
class TokenizerAssets:
    name: str
    files: dict[str, bytes]
    chat_template_override: str | None = None

    @property
    def sha256(self) -> str:
        """The tokenizer's identity as used (the chat template override applied)."""
        return tokenizer_sha256(self.files_as_used())

    def files_as_used(self) -> dict[str, bytes]:
        """The tokenizer's files with the chat template override (if any) applied."""
        if self.chat_template_override is None:
            return dict(self.files)
        files = dict(self.files)
        files.pop("chat_template.json", None)
        if "tokenizer_config.json" in files:
            config = json.loads(files["tokenizer_config.json"])
            config.pop("chat_template", None)
            files["tokenizer_config.json"] = (jsontext.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
        files["chat_template.jinja"] = self.chat_template_override.encode("utf-8")
        return files

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer as used carries a chat template (its own, or the override)."""
        if self.chat_template_override is not None or "chat_template.jinja" in self.files \
                or "chat_template.json" in self.files:
            return True
        try:
            return bool(json.loads(self.files.get("tokenizer_config.json", b"{}")).get("chat_template"))
        except ValueError:
            return False

    @property
    def key(self) -> str:
        """Identity of the tokenizer as used: its files and any chat template override."""
        return self.sha256


def build_tokenizer(assets: TokenizerAssets) -> Any:
    """A transformers fast tokenizer from the assets, with the chat template override applied."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="rmflow-tok-") as d:
        for name, data in assets.files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        try:
            tok = AutoTokenizer.from_pretrained(d)
        except Exception as e:
            raise TokenizerError(f"cannot load tokenizer {assets.name}: {type(e).__name__}: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise TokenizerError(f"tokenizer {assets.name} has no fast (Rust) implementation; rmflow needs one")
    if assets.chat_template_override is not None:
        tok.chat_template = assets.chat_template_override
    return tok


def tokenizer_info(assets: TokenizerAssets, tok: Any) -> TokenizerInfo:
    return TokenizerInfo(
        name=assets.name,
        sha256=assets.sha256,
        vocabulary_sha256=vocabulary_sha256(assets.files),
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        chat_template_sha256=sha256_text(tok.chat_template),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizedPair:
    canonical: CanonicalPair  # the record it was tokenized from
    chosen_ids: np.ndarray
    rejected_ids: np.ndarray
    prompt_len: int
    head_len: int  # template tokens truncate-prompt must keep at the start
    special_text: bool = False  # its messages hold special-token text, tokenized as text

    @property
    def n_tokens(self) -> int:
        return len(self.chosen_ids) + len(self.rejected_ids)

    def fit(self, max_length: int, policy: str) -> PairRecord:
        """The shard record that fits ``max_length`` under the length policy (raises TooLong)."""
        p = self.canonical
        chosen, rejected, prompt_len = apply_length_policy(
            self.chosen_ids, self.rejected_ids, self.prompt_len, self.head_len, max_length, policy)
        return PairRecord(chosen_ids=chosen, rejected_ids=rejected, chosen_last=len(chosen) - 1,
                          rejected_last=len(rejected) - 1, prompt_len=prompt_len, pair_id=p.pair_id,
                          source=os.path.basename(p.source), margin=p.margin, subset=p.subset)

    def left_out(self, max_length: int, policy: str, record) -> tuple[tuple[int, str, str], ...]:
        """(count, code, why) of the parts of a written record left out of it: a pair keeps all."""
        return ()


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizedSteps:
    canonical: CanonicalSteps  # the record it was tokenized from
    input_ids: np.ndarray
    step_ends: np.ndarray  # the token scoring each step
    prompt_len: int
    head_len: int
    special_text: bool = False  # its messages hold special-token text, tokenized as text

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    def fit(self, max_length: int, policy: str) -> StepRecord:
        """The shard record that fits ``max_length`` under the length policy (raises TooLong)."""
        p = self.canonical
        ids, ends, prompt_len = apply_length_policy_steps(
            self.input_ids, self.step_ends, self.prompt_len, self.head_len, max_length, policy)
        return StepRecord(input_ids=ids, step_ends=ends, step_labels=[int(x) for x in p.labels],
                          prompt_len=prompt_len, record_id=p.pair_id, source=os.path.basename(p.source),
                          subset=p.subset)

    def left_out(self, max_length: int, policy: str, record) -> tuple[tuple[int, str, str], ...]:
        """(count, code, why) of the parts of a written record left out of it: a solution keeps all."""
        return ()


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizedResponses:
    canonical: CanonicalResponses  # the record it was tokenized from
    sequences: tuple[np.ndarray, ...]  # the prompt and each response, whole
    prompt_len: int  # leading tokens every sequence shares (the prompt)
    head_len: int
    special_text: bool = False
    too_long: frozenset[int] = frozenset()  # responses never tokenized: their characters alone are too many

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def fitting(self, max_length: int, policy: str) -> list[int]:
        """The responses whose conversation fits ``max_length`` under the length policy."""
        if policy not in ("drop", "truncate-prompt"):
            raise ValueError(f"unknown length policy {policy!r}")
        p = self.prompt_len
        room = 0 if policy == "drop" else p - min(self.head_len, p)  # prompt tokens that may go
        return [i for i, s in enumerate(self.sequences) if i not in self.too_long and len(s) - room <= max_length]

    def fit(self, max_length: int, policy: str) -> ResponsesRecord:
        """The shard record that fits ``max_length``: each response whose conversation (prompt and
        response) is too long is left out (``drop``), or the oldest prompt tokens after the
        template's leading ones are cut so that the longest response that can fit does
        (``truncate-prompt``; a response too long even so is left out); of those that fit, at most
        the record's ``most`` (``rendering.responses.spread``). Raises TooLong when fewer than two
        responses, or only responses of one score, remain; a record that keeps its ratings (a
        regression head fits them) needs one response that fits."""
        p, seqs = self.prompt_len, self.sequences
        keep = self.fitting(max_length, policy)
        scores = self.canonical.scores
        rated = bool(self.canonical.attributes)
        if not keep or not rated and (len(keep) < 2 or len({scores[i] for i in keep}) < 2):
            longest = max(len(s) for s in seqs)
            raise TooLong("too_long" if policy == "drop" else "replies_too_long",
                          f"{len(keep)} of {len(seqs)} responses fit max_length {max_length} with their prompt "
                          f"(the longest has {longest} tokens)" + ("" if len(keep) < 2 else ", all of one score"))
        if self.canonical.most:  # at most this many of those that fit
            keep = spread(keep, scores, self.canonical.most)
        cut = max(0, max(len(seqs[i]) for i in keep) - max_length)
        head = min(self.head_len, p)
        prompt = seqs[keep[0]][:p]
        prompt = np.concatenate([prompt[:head], prompt[head + cut:]])
        responses = [seqs[i][p:] for i in keep]
        c = self.canonical
        return ResponsesRecord(prompt_ids=prompt, responses=responses,
                               lasts=[len(prompt) + len(r) - 1 for r in responses],
                               scores=[scores[i] for i in keep], record_id=c.pair_id,
                               source=os.path.basename(c.source), subset=c.subset,
                               margin_from_scores=c.margin_from_scores,
                               attributes=[c.attributes[i] for i in keep] if c.attributes else None)

    def left_out(self, max_length: int, policy: str, record: ResponsesRecord) -> tuple[tuple[int, str, str], ...]:
        """(count, code, why) of the responses left out of the written ``record``: too long with
        their prompt, or past --max-responses."""
        fit = len(self.fitting(max_length, policy))
        return ((len(self.canonical.responses) - fit, "long_response",
                 f"a response too long for max_length {max_length} with its prompt, left out of its record"),
                (fit - record.k, "capped_response", "a response past --max-responses, left out of its record"))


def step_token_ends(char_ends: Sequence[int], offsets: Sequence[tuple[int, int]], prompt_len: int) -> np.ndarray:
    """The token that scores each step: the last token that ends at or before the step's end (its
    text and separator), so it never covers text of a later step. Raises BadRecord when a step
    gets no token of its own."""
    ends = np.maximum.accumulate(np.asarray([o[1] for o in offsets], np.int64))
    idx = np.searchsorted(ends, np.asarray(char_ends, np.int64), side="right") - 1
    previous = prompt_len - 1
    for i, t in enumerate(idx):
        if t <= previous:
            raise BadRecord("step_boundary", f"step {i} has no token of its own: its text merges into a token of "
                            "the text before it (choose a --step-separator that the tokenizer keeps apart)")
        previous = t
    return idx.astype(np.int32)


def left_cut(text: str, keep: int) -> str | None:
    """``text`` without its start, at least its last ``keep`` characters kept, cut where the text's
    tokens do not depend on what came before: at a word's start (a space after a non-space), where
    pre-tokenizers (byte-level BPE's regex, SentencePiece's ``▁``) split, so the tokens after the
    cut are those of the whole text (a cut inside a word would re-segment its end: BPE merges
    run over the whole word). The nearest such start at most ``keep`` characters further back;
    None when there is none (one word that long)."""
    if len(text) <= keep:
        return text

    def starts_word(i: int) -> bool:
        return i == 0 or (text[i].isspace() and not text[i - 1].isspace())

    lo, at = max(0, len(text) - 2 * keep), len(text) - keep
    while at > lo and not starts_word(at):
        at -= 1
    return text[at:] if starts_word(at) else None


# Texts that exercise what maps text to ids beyond the vocabulary: normalisation, pre-tokenisation
# (spaces, digits, punctuation, scripts), merges, byte fallback (``text_to_ids_difference``).
PROBES = (
    "Hello, world! How are you today?", "  two  spaces,\ttabs\n\nand new lines\r\n", "don't it's we'll I'M",
    "1234567890 3.14159 -42 1e-5 1,000,000", "Ünïcödé ñ ß café naïve Ελληνικά русский", "日本語 中文 한국어 ไทย العربية עברית",
    "emoji 😀🚀 👍🏽 ✓ ∑ → ∞", "def f(x):\n    return x ** 2  # square\n", "https://example.com/a?b=c&d=%20",
    "<html><body>x</body></html> {\"key\": [1, 2]}", "a" * 64, " leading space", "trailing space ", "",
)


def text_to_ids_difference(a: str, b: str) -> str | None:
    """How two tokenizer folders map text to ids differently (their vocabularies with the added
    tokens, then ``PROBES`` and the tokens' own texts), or None when they map it alike: a
    tokenizer re-saved by another transformers release has other file bytes and the same ids."""
    import os

    from tokenizers import Tokenizer

    paths = [os.path.join(folder, "tokenizer.json") for folder in (a, b)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        return f"no tokenizer.json to compare ({', '.join(missing)})"
    ta, tb = (Tokenizer.from_file(p) for p in paths)
    va, vb = ta.get_vocab(with_added_tokens=True), tb.get_vocab(with_added_tokens=True)
    if va != vb:
        differ = sorted(set(va.items()) ^ set(vb.items()))
        return f"their vocabularies differ ({len(differ):,} (token, id) entries, e.g. {differ[0]!r})"
    added = [sorted((t.content, t.special) for t in x.get_added_tokens_decoder().values()) for x in (ta, tb)]
    if added[0] != added[1]:
        return "their added (special) tokens differ"
    for text in (*PROBES, *sorted(va)[:: max(1, len(va) // 2000)]):
        for special in (False, True):
            if ta.encode(text, add_special_tokens=special).ids != tb.encode(text, add_special_tokens=special).ids:
                return f"they tokenize {text[:40]!r} differently" + (" (with special tokens)" if special else "")
    return None


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RecordTokenizer:
    """Renders canonical records (pairs, stepwise solutions) with the chat template and tokenizes
    every sequence they hold, a batch at a time."""

    def __init__(self, tokenizer: Any, step_separator: str = STEP_SEPARATOR):
        self.tok = tokenizer
        self.step_separator = step_separator
        self.backend = tokenizer.backend_tokenizer
        self.backend.no_truncation()
        self.backend.no_padding()
        self._head_cache: dict[tuple[Message, ...], int] = {}
        self._template: Any = None
        self._variables: dict[str, Any] = {}
        self._special: Any = None  # the special tokens' strings, as one pattern (False: none)
        self._plain: Any = None  # a copy of the backend that encodes special-token strings as text
        self._longest: int | None = None  # the longest vocabulary entry's characters (``longest_token``)

    def _render_many(self, conversations: list[tuple[Message, ...]], generation_prompt: bool) -> list[str]:
        """Render with the compiled template, as apply_chat_template does (same sandboxed
        jinja environment, same variables), minus its per-call overhead."""
        if self._template is None:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._template = _compile_jinja_template(self.tok.get_chat_template())
            self._variables = dict(self.tok.special_tokens_map, tools=None, documents=None)
        render = self._template.render
        if any(len(m) > 2 for conv in conversations for m in conv) and not self.renders_tool_calls:
            raise BadRecord("tool_calls_unsupported", "a message has tool_calls and the chat template does not "
                            "render them (it never reads 'tool_calls'): they would be dropped; use a template "
                            "that renders tool calls (--chat-template)")
        return [
            render(messages=[message_dict(m) for m in conv], add_generation_prompt=generation_prompt,
                   **self._variables)
            for conv in conversations
        ]

    @property
    def renders_tool_calls(self) -> bool:
        return "tool_calls" in (self.tok.get_chat_template() or "")

    def _encode(self, texts: list[str]):
        return self.backend.encode_batch(texts, add_special_tokens=False)

    def head_len(self, prompt: tuple[Message, ...]) -> int:
        """Tokens the template puts before the first non-system message's content.

        Found by rendering two probe conversations that differ only in that content and
        taking their common token prefix; cached per distinct system prefix.
        """
        system = tuple(m for m in prompt if m[0] == "system")
        system = system if prompt[: len(system)] == system else ()
        if system not in self._head_cache:
            probes = self._render_many([system + (("user", "x"),), system + (("user", "y"),)], False)
            a, b = (np.asarray(e.ids) for e in self._encode(probes))
            self._head_cache[system] = _common_prefix(a, b)
        return self._head_cache[system]

    def render(self, pairs: Sequence[CanonicalPair]) -> list[Rendered | BadRecord]:
        """Apply the chat template: prompt (with generation prompt), prompt+chosen, prompt+rejected.

        One renderer call per kind for the whole batch; if any conversation fails, the
        batch is rendered pair by pair so that only the failing pairs are rejected.
        """
        try:
            return self._render_batch(pairs)
        except Exception:  # noqa: BLE001 - find the pairs the template refuses
            if len(pairs) == 1:
                return [self._template_error(pairs[0])]
            return [r for p in pairs for r in self.render([p])]

    def _render_batch(self, items: Sequence[CanonicalPair | CanonicalSteps | CanonicalResponses]) -> list:
        text_pairs = [p for p in items if isinstance(p, CanonicalPair) and not p.is_tokenized]
        solutions = [p for p in items if isinstance(p, CanonicalSteps)]
        prompts = [p for p in items if isinstance(p, CanonicalResponses)]
        pairs = iter(self._render_pairs(text_pairs)) if text_pairs else iter(())
        steps = iter(self._render_steps(solutions)) if solutions else iter(())
        lists = iter(self._render_responses(prompts)) if prompts else iter(())
        return [next(steps) if isinstance(p, CanonicalSteps) else next(lists) if isinstance(p, CanonicalResponses)
                else Rendered(p) if p.is_tokenized else next(pairs) for p in items]

    def _render_responses(self, items: Sequence[CanonicalResponses]) -> list[RenderedResponses]:
        """The prompt (with generation prompt), and the prompt with each response."""
        prompts = self._render_many([p.prompt for p in items], True)
        whole = iter(self._render_many([p.prompt + r for p in items for r in p.responses], False))
        return [RenderedResponses(p, prompt, tuple(next(whole) for _ in p.responses))
                for p, prompt in zip(items, prompts)]

    def _render_steps(self, items: Sequence[CanonicalSteps]) -> list[RenderedSteps | BadRecord]:
        """The prompt (with generation prompt) and the whole solution, every step followed by the
        separator in one assistant message; each step's end located in the rendered text."""
        sep = self.step_separator
        prompts = self._render_many([p.prompt for p in items], True)
        full = self._render_many([p.prompt + (("assistant", "".join(s + sep for s in p.steps)),) for p in items],
                                 False)
        out: list[RenderedSteps | BadRecord] = []
        for item, prompt, text in zip(items, prompts, full):
            if not text.startswith(prompt):
                out.append(BadRecord("template_error", "the chat template does not render the prompt as the start "
                                     "of the conversation, so the steps cannot be located"))
                continue
            cursor, ends = len(prompt), []
            for step in item.steps:
                at = text.find(step, cursor)
                if at < 0:
                    break
                cursor = at + len(step)
                if text.startswith(sep, cursor):
                    cursor += len(sep)
                ends.append(cursor)
            if len(ends) < len(item.steps):
                out.append(BadRecord("template_error", f"step {len(ends)} is not in the rendered text: the chat "
                                     "template changed it"))
                continue
            out.append(RenderedSteps(item, prompt, text, tuple(ends)))
        return out

    def _render_pairs(self, pairs: Sequence[CanonicalPair]) -> list[Rendered]:
        prompts = self._render_many([p.prompt for p in pairs], True)
        chosen = self._render_many([p.prompt + p.chosen for p in pairs], False)
        rejected = self._render_many([p.prompt + p.rejected for p in pairs], False)
        return [Rendered(*row) for row in zip(pairs, prompts, chosen, rejected)]

    def _template_error(self, pair: CanonicalPair | CanonicalSteps) -> BadRecord:
        try:
            self._render_batch([pair])
        except BadRecord as e:
            return e
        except Exception as e:  # jinja2 errors, a template's raise_exception(...)
            return BadRecord("template_error", f"chat template failed: {type(e).__name__}: {e}")
        return BadRecord("template_error", "chat template failed in a batch but not alone")

    @property
    def longest_token(self) -> int:
        """The characters of the vocabulary's longest entry: no text of n tokens is longer than n times it."""
        if self._longest is None:
            self._longest = max(map(len, self.tok.get_vocab()), default=1)
        return self._longest

    def too_long(self, r: Rendered | RenderedSteps | RenderedResponses, max_length: int, policy: str
                 ) -> tuple[BadRecord | None, frozenset[int]]:
        """What a rendered record's characters alone say, before it is tokenized: (why it cannot
        fit ``max_length`` tokens under the length policy, or None; which of its responses cannot).
        A text of more than ``max_length`` times the longest token's characters has more than
        ``max_length`` tokens: under ``drop`` a sequence that long, under ``truncate-prompt`` a
        reply (or steps) that long, never fits; the prompt is what truncation may cut."""
        limit = max_length * self.longest_token
        whole = policy == "drop"
        sizes = [len(t) - (0 if whole or not t.startswith(r.prompt_text) else len(r.prompt_text)) for t in r.texts]
        if isinstance(r, RenderedResponses):
            over = frozenset(i for i, n in enumerate(sizes) if n > limit)
            return (TooLong("too_long" if whole else "replies_too_long", f"every response has more than {limit:,} "
                            f"characters with {'its prompt' if whole else 'no prompt'}: more than max_length "
                            f"{max_length} tokens") if len(over) == len(sizes) else None), over
        if max(sizes) > limit:
            what = "sequence" if whole else "reply" if isinstance(r, Rendered) else "solution's steps"
            return TooLong("too_long" if whole else "replies_too_long" if isinstance(r, Rendered) else "steps_too_long",
                           f"a {what} of {max(sizes):,} characters: more than max_length {max_length} tokens "
                           "(refused before tokenizing)"), frozenset()
        return None, frozenset()

    def tokenize(self, items: Sequence[Rendered | RenderedSteps], max_length: int | None = None,
                 policy: str = "drop") -> list[TokenizedPair | TokenizedSteps | BadRecord]:
        """Tokenize rendered pairs (and solutions) in one batch call; locate the prompt boundary
        (and the step ends) in tokens. With ``max_length``, a text its characters alone show too
        long (``too_long``) is never tokenized: its record refused, or its response left out."""
        bounds = {}
        if max_length is not None:
            for r in items:
                if not r.canonical.is_tokenized:
                    bounds[id(r)] = self.too_long(r, max_length, policy)
        items_in = items
        items = [r for r in items_in if bounds.get(id(r), (None,))[0] is None]
        skip = {id(r): bounds[id(r)][1] for r in items if id(r) in bounds and bounds[id(r)][1]}
        texts = [t for r in items if not r.canonical.is_tokenized
                 for i, t in enumerate(r.texts) if i not in skip.get(id(r), ())]
        try:
            encodings = iter(self._encode(texts) if texts else [])
        except Exception:  # noqa: BLE001 - isolate the text the tokenizer refuses
            return [self._tokenize_one(r) for r in items]
        out: list[TokenizedPair | BadRecord] = []
        for r in items:
            p = r.canonical
            if p.is_tokenized:
                out.append(TokenizedPair(
                    p, np.asarray(p.chosen_ids, np.int32), np.asarray(p.rejected_ids, np.int32),
                    p.prompt_len or 0, 0,
                ))
                continue
            skipped = skip.get(id(r), frozenset())
            encs = [None if i in skipped else next(encodings) for i in range(len(r.texts))]
            if self._has_special_text(p):  # rare: re-encode with the messages' special-token text as text
                try:
                    encs = [None if i in skipped else self._encode_as_text(text, msgs)
                            for i, (text, msgs) in enumerate(zip(r.texts, _conversations(r)))]
                except BadRecord as e:
                    out.append(e)
                    continue
                done = self._tokenized(r, *encs)
                out.append(done if isinstance(done, BadRecord) else dataclasses.replace(done, special_text=True))
                continue
            out.append(self._tokenized(r, *encs))
        done = iter(out)
        return [bounds[id(r)][0] if bounds.get(id(r), (None,))[0] is not None else next(done) for r in items_in]

    def _special_pattern(self):
        if self._special is None:
            import re

            special = sorted({t.content for t in self.tok.added_tokens_decoder.values() if t.special}
                             | set(self.tok.all_special_tokens), key=len, reverse=True)
            self._special = re.compile("|".join(re.escape(t) for t in special if t)) if special else False
        return self._special

    def _has_special_text(self, item: CanonicalPair | CanonicalSteps) -> bool:
        return self._any_special([m[1] for m in item.prompt] + list(item.reply_texts))

    def _any_special(self, texts: Sequence[str]) -> bool:
        pattern = self._special_pattern()
        return bool(pattern) and any(pattern.search(t) for t in texts)

    def render_text(self, conversation: tuple[Message, ...]) -> str:
        """One conversation rendered with the chat template, as a pair's side is."""
        return self._render_many([conversation], False)[0]

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        """Token ids of a text already rendered with a chat template (special-token strings are
        the control tokens they name), as a rendering is tokenized."""
        return np.asarray(self.backend.encode(text, add_special_tokens=add_special_tokens).ids, np.int32)

    def encode_conversation(self, conversation: tuple[Message, ...]) -> np.ndarray:
        """Token ids of one whole conversation (a reply to score), rendered and tokenized exactly as
        preprocessing renders a pair's side: message text is text. Raises BadRecord."""
        [text] = self._render_many([conversation], False)
        contents = [m[1] for m in conversation]
        enc = self._encode_as_text(text, contents) if self._any_special(contents) else self._encode([text])[0]
        return np.asarray(enc.ids, np.int32)

    def _encode_as_text(self, text: str, contents: list[str]) -> _Encoding:
        """Encode a rendered conversation whose message texts hold special-token strings: those
        strings are encoded as the plain text they are (never as the control tokens the template
        places); everything else as usual. Raises BadRecord when the template changed a message
        so that its text cannot be found in the rendering."""
        pattern = self._special_pattern()
        if self._plain is None:
            from tokenizers import Tokenizer

            self._plain = Tokenizer.from_str(self.backend.to_str())
            self._plain.encode_special_tokens = True
            self._plain.no_truncation()
            self._plain.no_padding()
        spans, cursor = [], 0
        for content in contents:
            if not pattern.search(content):
                continue
            at = text.find(content, cursor)
            if at < 0:
                raise BadRecord("special_token_text", "a message holds special-token text and the chat template "
                                "changes that message, so its text cannot be kept apart from the template's tokens")
            spans += [(at + m.start(), at + m.end()) for m in pattern.finditer(content)]
            cursor = at + len(content)
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        start = 0
        for a, b in spans + [(len(text), len(text))]:
            for lo, hi, backend in ((start, a, self.backend), (a, b, self._plain)):
                if hi > lo:
                    enc = backend.encode(text[lo:hi], add_special_tokens=False)
                    ids += enc.ids
                    offsets += [(lo + x, lo + y) for x, y in enc.offsets]
            start = b
        return _Encoding(ids, offsets)

    def _tokenize_one(self, r: Rendered | RenderedSteps) -> TokenizedPair | TokenizedSteps | BadRecord:
        if r.canonical.is_tokenized:
            return self.tokenize([r])[0]
        try:
            encodings = self._encode(list(r.texts))
        except Exception as e:  # noqa: BLE001
            return BadRecord("tokenize_error", f"the tokenizer failed: {type(e).__name__}: {e}")
        return self._tokenized(r, *encodings)

    def _tokenized_steps(self, r: RenderedSteps, enc: Any) -> TokenizedSteps | BadRecord:
        ids = np.asarray(enc.ids, np.int32)
        prompt_len = enc.char_to_token(len(r.prompt_text))
        if prompt_len is None:
            return BadRecord("template_error", "the rendered solution has no token after its prompt")
        try:
            ends = step_token_ends(r.step_char_ends, enc.offsets, prompt_len)
        except BadRecord as e:
            return e
        return TokenizedSteps(r.canonical, ids, ends, prompt_len, self.head_len(r.canonical.prompt))

    def _tokenized_responses(self, r: RenderedResponses, encs: Sequence[Any]) -> TokenizedResponses | BadRecord:
        # a response its characters showed too long was not tokenized (None): left out, as one too long is
        too_long = frozenset(i for i, e in enumerate(encs) if e is None)
        seqs = tuple(np.zeros(0, np.int32) if e is None else np.asarray(e.ids, np.int32) for e in encs)
        real = [s for i, s in enumerate(seqs) if i not in too_long]
        if not all(len(s) for s in real):
            return BadRecord("template_error", "the chat template rendered an empty sequence")
        common = min((_common_prefix(real[0], s) for s in real[1:]), default=len(real[0]))  # K = 1: its own length
        prompt_len = None
        if all(t.startswith(r.prompt_text) for t in r.texts):
            at = {e.char_to_token(len(r.prompt_text)) for e in encs if e is not None}
            if len(at) == 1 and None not in at and next(iter(at)) <= common:
                prompt_len = next(iter(at))
        if prompt_len is None:  # the template does not render the prompt as a prefix
            prompt_len = common
        prompt_len = min(prompt_len, min(len(s) for s in real) - 1)
        return TokenizedResponses(r.canonical, seqs, prompt_len, self.head_len(r.canonical.prompt), too_long=too_long)

    def _tokenized(self, r: Rendered | RenderedSteps | RenderedResponses, enc_c: Any, *more: Any
                   ) -> TokenizedPair | TokenizedSteps | TokenizedResponses | BadRecord:
        if isinstance(r, RenderedSteps):
            return self._tokenized_steps(r, enc_c)
        if isinstance(r, RenderedResponses):
            return self._tokenized_responses(r, (enc_c, *more))
        enc_r = more[0]
        chosen = np.asarray(enc_c.ids, np.int32)
        rejected = np.asarray(enc_r.ids, np.int32)
        if not len(chosen) or not len(rejected):
            return BadRecord("template_error", "the chat template rendered an empty sequence")
        common = _common_prefix(chosen, rejected)
        prompt_len = None
        boundary = len(r.prompt_text)
        if r.chosen_text.startswith(r.prompt_text) and r.rejected_text.startswith(r.prompt_text):
            pc, pr = enc_c.char_to_token(boundary), enc_r.char_to_token(boundary)
            if pc is not None and pc == pr and pc <= common:
                prompt_len = pc
        if prompt_len is None:  # the template does not render the prompt as a prefix
            prompt_len = common
        prompt_len = min(prompt_len, len(chosen) - 1, len(rejected) - 1)
        return TokenizedPair(r.canonical, chosen, rejected, prompt_len, self.head_len(r.canonical.prompt))

    def __call__(self, pairs: Sequence[CanonicalPair]) -> list[TokenizedPair | BadRecord]:
        """Render and tokenize; a pair that fails comes back as its BadRecord."""
        rendered = self.render(pairs)
        done = iter(self.tokenize([r for r in rendered if not isinstance(r, BadRecord)]))
        return [r if isinstance(r, BadRecord) else next(done) for r in rendered]


def message_dict(m: Message) -> dict[str, Any]:
    d = {"role": m[0], "content": m[1]}
    if len(m) > 2:
        d["tool_calls"] = json.loads(m[2])
    return d


def _conversations(r: Rendered | RenderedSteps | RenderedResponses) -> list[list[str]]:
    """The message texts (in order) of each text ``r.texts`` holds."""
    p = r.canonical
    prompt = [m[1] for m in p.prompt]
    if isinstance(r, RenderedSteps):
        return [prompt + list(p.steps)]
    if isinstance(r, RenderedResponses):
        return [prompt + [m[1] for m in resp] for resp in p.responses]
    return [prompt + [m[1] for m in p.chosen], prompt + [m[1] for m in p.rejected]]


class _Encoding:
    """What the tokenizers library's Encoding offers that this module reads, for a sequence
    encoded in pieces."""

    def __init__(self, ids: list[int], offsets: list[tuple[int, int]]):
        self.ids, self.offsets = ids, offsets

    def char_to_token(self, char: int) -> int | None:
        for i, (a, b) in enumerate(self.offsets):
            if a <= char < b:
                return i
        return None


@dataclasses.dataclass(frozen=True)
class Rendered:
    canonical: CanonicalPair
    prompt_text: str = ""
    chosen_text: str = ""
    rejected_text: str = ""

    @property
    def texts(self) -> tuple[str, ...]:
        return (self.chosen_text, self.rejected_text)


@dataclasses.dataclass(frozen=True)
class RenderedSteps:
    canonical: CanonicalSteps
    prompt_text: str
    text: str
    step_char_ends: tuple[int, ...]  # in ``text``: after each step and its separator

    @property
    def texts(self) -> tuple[str, ...]:
        return (self.text,)


@dataclasses.dataclass(frozen=True)
class RenderedResponses:
    canonical: CanonicalResponses
    prompt_text: str
    texts: tuple[str, ...]  # the prompt with each response
