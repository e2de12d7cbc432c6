"""The Python API: load a trained reward model and score conversations in a few lines.

    >>> from rmflow import RewardModel
    >>> rm = RewardModel.load("runs/rm1")          # a run directory, or an exported checkpoint
    >>> conversation = [{"role": "user", "content": "How do I boil an egg?"},
    ...                 {"role": "assistant", "content": "Eight minutes in boiling water."}]
    >>> rm.score([conversation]).shape
    (1,)
    >>> chosen = [conversation]
    >>> rejected = [[conversation[0], {"role": "assistant", "content": "No idea."}]]
    >>> r_chosen, r_rejected = rm.score_pairs(chosen, rejected)
    >>> bool(abs(float(rm.score(chosen)[0]) - float(r_chosen[0])) < 1e-4)
    True

The chat template of the model's own tokenizer is applied; conversations are scored in batches
sorted by length, results come back in input order as float32 numpy arrays. A conversation
must end with the assistant reply to score. ``rmflow score`` is a thin wrapper over this class.

Every scoring method takes ``deterministic=True``: each conversation then runs alone in its row,
in a batch shape its own length sets (``ScoringShapes(deterministic=True)``), so its score is
the same to the last bit whatever it is scored with, in any call, here, in `rmflow score
--deterministic` or behind `rmflow serve --deterministic` (one set of shapes for all, whatever
their batch settings; on one kind of device). By default conversations share packed rows, which
is faster and equal to float rounding.

A process reward model (trained on stepwise data) scores every step of a solution: the prompt
and steps are rendered exactly as `rmflow preprocess` rendered its training data (chat template,
each step followed by the step separator), and ``score_steps`` returns P(step is correct)::

    prm = RewardModel.load("runs/prm1")
    [p] = prm.score_steps([{"prompt": "What is 2 + 3 * 4?", "completions": ["3 * 4 = 12.", "2 + 12 = 14."]}])
    p.shape == (2,)  # one probability per step; a step is judged wrong when it is below 0.5
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rmflow.schemas.config import SCORING_BATCH_SIZE
from rmflow.schemas.heads import ATTRIBUTE_SCORES, ATTRIBUTES, Head, head_of
from rmflow.schemas.kinds import OUTCOME, PROCESS, ModelKind, kind_named
from rmflow.scoring.errors import BadConversation, WrongModelKind

Conversation = Sequence[dict[str, str]] | dict[str, Any]

# The tokens a conversation is given in packed rows when only a batch size is: a full forward of
# ``RewardModel.shapes(batch_size)`` holds batch_size x this many.
PACKED_TOKENS_PER_ITEM = 512


def conversation_messages(obj: Any) -> tuple[tuple[str, ...], ...]:
    """The messages of a conversation (a list of ``{role, content}``, or an object with ``messages``),
    read by the preprocessing code itself (roles, text parts, tool calls), ending with an assistant
    message."""
    from rmflow.rendering.formats import BadRecord, check_prompt, check_reply_end, read_messages

    msgs = obj.get("messages") if isinstance(obj, dict) else obj
    if not isinstance(msgs, (list, tuple)) or not msgs:
        raise BadConversation("expected a non-empty list of messages, or an object with 'messages'")
    try:
        messages = read_messages(msgs, "messages")
        # the rules preprocessing applies to what it trains on: a reply at the end, a user's turn before
        check_reply_end(messages, "messages")
        check_prompt(messages, "messages")
    except BadRecord as e:
        raise BadConversation(e.message) from e
    return messages


def _chars(message: tuple) -> int:
    """A message's characters: its text and its tool calls' JSON."""
    return len(message[1]) + (len(message[2]) if len(message) > 2 else 0)


def _encode_each(items: Sequence[Any], encode, what: str) -> list:
    """``encode`` of every item; a BadConversation names the item's index."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(encode(item))
        except BadConversation as e:
            raise BadConversation(f"{what} {i}: {e}") from e
    return out


class RewardModel:
    """A trained reward model with its tokenizer: ``load``, then ``score`` / ``score_pairs``."""

    def __init__(self, loaded, tokenizer, normalization: dict[str, float] | None = None):
        self._loaded = loaded
        self.tokenizer = tokenizer
        self.normalization = normalization
        self.positions = loaded.model.config.max_position_embeddings  # the most tokens the model reads
        self.max_length = self.positions  # the most it scores: its positions, unless limit_length lowers it
        # the length it was trained at (its data's max_length), when the run or export records it
        self.trained_max_length = loaded.trained_max_length
        self.description = loaded.description
        self.kind = loaded.kind.name  # schemas.kinds: "outcome" (a score per conversation), "process" (per step)
        self.step_separator = loaded.step_separator
        self._renderer = None
        self._scorers: dict[Any, Any] = {}  # ScoringShapes -> its scorer (compiled once per shape)

    @classmethod
    def load(cls, path: str, step: int | str | None = None, *, reward: str = "") -> RewardModel:
        """From a run directory (its newest checkpoint, or ``step``) or an exported checkpoint
        folder, local or remote (gs://, copied down once). ``reward``: an ensemble's reward over
        its members (mean, min, lcb:LAMBDA; ``use_reward``), if not the one it was trained with."""
        from transformers import AutoTokenizer

        from rmflow.trainer.backend import configure_xla
        from rmflow.trainer.inference import load_model, require_tokenizer

        configure_xla()  # before the backend starts
        loaded = load_model(path, step, reward)
        tok = AutoTokenizer.from_pretrained(require_tokenizer(path, loaded.tokenizer_dir, "scoring"))
        return cls(loaded, tok, loaded.normalization)

    def _record_tokenizer(self):
        from rmflow.rendering.tokenize import RecordTokenizer

        if self._renderer is None:
            self._renderer = RecordTokenizer(self.tokenizer, self.step_separator)
        return self._renderer

    @property
    def pad_id(self) -> int:
        return self._loaded.pad_id

    def identity(self) -> dict[str, Any]:
        """Which weights score: run, step, kind and tokenizer hash (``LoadedModel.identity``)."""
        return self._loaded.identity()

    def encode(self, conversation: Conversation, *, truncate: str = "error") -> np.ndarray:
        """Token ids of one conversation, rendered and tokenized as preprocessing does (the chat
        template applied; message text, special-token strings included, as text); raises
        BadConversation. Longer than the model's positions: an error, or with ``truncate="left"``
        the earliest tokens dropped, as long as the reply to score stays whole."""
        from rmflow.rendering.formats import BadRecord

        messages = self.check(conversation, truncate=truncate)
        try:
            ids = np.asarray(self._record_tokenizer().encode_conversation(messages), np.int32)
        except BadRecord as e:
            raise BadConversation(e.message) from e
        if len(ids) <= self.max_length:
            return ids
        if truncate == "left":
            reply = len(self.encode_text(messages[-1][1]))
            if reply < self.max_length:
                return ids[-self.max_length:]
            raise BadConversation(f"the reply alone has {reply} tokens, more than the model's {self.max_length} "
                                  "positions: left truncation cannot keep it whole")
        raise BadConversation(f"{len(ids)} tokens, more than the model's {self.max_length} positions (left truncation "
                              "drops the earliest tokens: `rmflow score --truncate left`, the server's "
                              "\"truncate\": \"left\", RewardModel.encode(..., truncate=\"left\"))")

    def check(self, conversation: Conversation, *, truncate: str = "error") -> tuple:
        """What ``encode`` checks before tokenizing, alone (cheap: no tokenizer runs): the
        conversation's messages, each rule of a scorable reply, and its characters (with
        ``truncate="left"``, cut before a word's start to what its tokens could fill); returns the
        messages to tokenize, or raises BadConversation. A server checks every item of a request
        so before it tokenizes any."""
        messages = conversation_messages(conversation)
        if truncate == "left":  # bounded too: the reply whole, the rest cut to its last characters
            return self._cut_chars(messages)
        self.check_chars(sum(map(_chars, messages)))
        return messages

    def _cut_chars(self, messages: tuple) -> tuple:
        """``messages`` bounded for left truncation before any is tokenized: the reply (the last
        message) refused when longer than ``max_chars``, then the latest ``max_chars`` characters
        before it (the earliest message kept cut from its start, those before it dropped). The last
        ``max_length`` tokens of a conversation lie within its last ``max_chars`` characters, so the
        tokens left truncation keeps are the same."""
        reply = _chars(messages[-1])
        if reply > self.max_chars:
            raise BadConversation(f"the reply alone has {reply:,} characters, more than {self.max_length:,} tokens "
                                  "ever hold: left truncation cannot keep it whole (refused before tokenizing)")
        from rmflow.rendering.tokenize import left_cut

        room, kept = self.max_chars, [messages[-1]]
        for m in reversed(messages[:-1]):
            n = _chars(m)
            if n <= room:
                kept.append(m)
                room -= n
                continue
            if room and len(m) == 2:  # text, not tool calls (whose JSON cannot be cut): at a word's start
                tail = left_cut(m[1], room)
                if tail is None:
                    raise BadConversation(f"a message of {len(m[1]):,} characters without a space to cut it at: "
                                          "left truncation cannot keep the tokens the whole text would end with")
                kept.append((m[0], tail))
            break
        return tuple(reversed(kept))

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        """Token ids of a text already rendered with a chat template (special-token strings are
        the control tokens they name), as preprocessing tokenizes a rendering; a text longer than
        twice ``max_chars`` (what a cut at a word's start may keep, ``left_cut``) is refused before
        it is tokenized."""
        if len(text) > 2 * self.max_chars:
            self.check_chars(len(text))
        return np.asarray(self._record_tokenizer().encode_text(text, add_special_tokens=add_special_tokens), np.int32)

    @property
    def assistant_marker(self) -> str:
        """What this model's chat template puts before an assistant reply (after the user's
        turn): a rendered text without it was not made with this template."""
        return self._template_parts()[0]

    @property
    def turn_end(self) -> str:
        """What this model's chat template puts after the last assistant reply (SmolLM2's:
        ``<|im_end|>\\n``): a rendered conversation of its training data ends with it."""
        return self._template_parts()[1]

    @property
    def user_marker(self) -> str:
        """What this model's chat template puts before a user message that follows a reply: a
        rendered text with one after its last assistant marker ends with the user's turn."""
        return self._template_parts()[2]

    def _template_parts(self) -> tuple[str, str, str]:
        if not hasattr(self, "_parts"):
            rendered = self._record_tokenizer().render_text((("user", "\x00U\x00"), ("assistant", "\x00A\x00"),
                                                             ("user", "\x00V\x00"), ("assistant", "\x00B\x00")))
            reply, second = rendered.index("\x00A\x00"), rendered.index("\x00V\x00")
            end = rendered[rendered.index("\x00B\x00") + 3:]
            between = rendered[reply + 3: second]  # the first reply's turn end, then the next user turn's start
            user = between[len(end):] if end and between.startswith(end) else between
            self._parts = (rendered[rendered.index("\x00U\x00") + 3: reply].strip(), end, user.strip())
        return self._parts

    @property
    def max_chars(self) -> int:
        """More characters than any text of ``max_length`` tokens holds (no token of the vocabulary
        is longer than its longest entry): a longer text is refused before it is tokenized."""
        return self.chars_for(self.max_length)

    def chars_for(self, tokens: int) -> int:
        """More characters than any text of ``tokens`` tokens holds (``RecordTokenizer.longest_token``)."""
        return tokens * self._record_tokenizer().longest_token

    def check_chars(self, n: int) -> None:
        """Raise BadConversation when ``n`` characters cannot fit ``max_length`` tokens."""
        if n > self.max_chars:
            raise BadConversation(f"{n:,} characters, more than {self.max_length:,} tokens ever hold (the longest "
                                  f"token has {self._record_tokenizer().longest_token} characters): refused before "
                                  "tokenizing; shorten or split it")

    def limit_length(self, max_length: int) -> None:
        """Score at most ``max_length`` tokens (at most the model's positions): longer inputs are
        refused or cut as ``truncate`` says, and the batch shapes stop there. The scorers built
        for the earlier limit are dropped."""
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 1 <= max_length <= self.positions:
            raise ValueError(f"max_length {max_length!r}: must be an integer from 1 to the model's "
                             f"{self.positions} positions")
        self.max_length = max_length
        self._scorers.clear()

    def shapes(self, batch_size: int = SCORING_BATCH_SIZE, token_budget: int | None = None,
               small_batches: bool = False, *, packed: bool = True, row_length: int = 0,
               deterministic: bool = False):
        """The batch shapes this model scores in. ``packed`` (for the kinds that score packed
        rows, ``trainer.inference.PACKED_CORES``): conversations and K-response units side by side
        in rows of ``row_length`` tokens (0: the length the model was trained at, else its
        ``max_length``), as many a forward as hold ``token_budget`` tokens (by default
        ``batch_size`` conversations of ``PACKED_TOKENS_PER_ITEM``), a longer item in a row of
        ``max_length`` (``PackedShapes``); else one item a row (``ScoringShapes``: power-of-two
        lengths up to the model's positions, ``batch_size`` rows each, or with a token budget as
        many rows as fit it, at most ``batch_size``; ``small_batches``: smaller ones too), an
        item's shape set by itself alone. ``deterministic``: one item a row in the one shape its
        length sets, the same for every caller (``ScoringShapes.deterministic_for``: the batch
        settings are not used), so that its score never depends on its batch or entry point."""
        from rmflow.trainer.inference import PACKED_CORES, PackedShapes, ScoringShapes

        if deterministic:  # the same shapes whatever the caller's batch settings
            return ScoringShapes.deterministic_for(self.positions)
        if packed and self.kind in PACKED_CORES:
            return PackedShapes(self.max_length, token_budget or batch_size * PACKED_TOKENS_PER_ITEM,
                                row_length or self.trained_max_length or 0)
        return ScoringShapes(self.max_length, max_rows=batch_size, token_budget=token_budget,
                             small_batches=small_batches)

    def scorer(self, shapes=None):
        """The model's scorer for ``shapes`` (default ``self.shapes()``), its kind's
        (``trainer.inference.SCORING_CORES``, ``PACKED_CORES`` for packed rows): built and
        compiled once and reused by every later call."""
        from rmflow.trainer.inference import PACKED_CORES, SCORING_CORES, PackedShapes

        shapes = shapes or self.shapes()
        if shapes not in self._scorers:
            make = (PACKED_CORES if isinstance(shapes, PackedShapes) else SCORING_CORES)[self.kind]
            self._scorers[shapes] = make(self._loaded.model, shapes, pad_id=self._loaded.pad_id)
        return self._scorers[shapes]

    def use_reward(self, rule: str) -> None:
        """An ensemble's reward from now on (``schemas.heads.MEMBER_REWARDS``: mean, min, or
        lcb:LAMBDA, the members' mean minus LAMBDA x their std); its scorers compile again."""
        from rmflow.trainer.inference import use_member_reward

        use_member_reward(self._loaded.model, rule, self.description)
        self.normalization = self._loaded.normalization  # figures of another rule no longer apply
        self._scorers.clear()

    @property
    def model(self):
        """The network that scores (``trainer.modeling.decoder.RewardTransformer``)."""
        return self._loaded.model

    @property
    def head(self) -> Head:
        """What the model outputs (``schemas.heads``): its score head."""
        return head_of(self._loaded.model.config)

    @property
    def model_config(self):
        """The model's configuration (its family, size, and what its head reads: ``schemas.heads``)."""
        return self._loaded.model.config

    @property
    def attributes(self) -> tuple[str, ...]:
        """An attribute head's outputs, by name (a model trained with a regression objective); ()
        for any other model. Its reward is their weighted sum (``attribute_weights``)."""
        return self._loaded.model.config.attributes

    @property
    def attribute_weights(self) -> dict[str, float]:
        return dict(zip(self.attributes, self._loaded.model.config.attribute_weights))

    def score_groups(self, groups: Sequence[Sequence[np.ndarray]], *, deterministic: bool = False) -> list[np.ndarray]:
        """The reward of each encoded conversation (``encode``) of each group, one group a prompt's
        K responses, the prompt computed once (``trainer.inference.score_groups``); equal to
        ``score_ids`` of each alone (``deterministic``: ``score_ids`` of each, bitwise)."""
        if deterministic:
            if any(not len(g) for g in groups):
                raise ValueError("a group with no conversation: each group holds one prompt's K >= 1 conversations")
            flat = [s for g in groups for s in g]
            scores = self.score_ids(flat, deterministic=True)
            cuts = np.cumsum([len(g) for g in groups])[:-1]
            return list(np.split(scores, cuts)) if len(groups) else []
        return self.score_groups_outputs(groups)[0]

    def score_groups_outputs(self, groups: Sequence[Sequence[np.ndarray]]
                             ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``score_groups``, and each conversation's score head outputs, (K, N) a group (an
        attribute head's: one per attribute, ``attributes``)."""
        from rmflow.trainer.inference import score_groups

        return score_groups(self._loaded.model, groups, pad_id=self._loaded.pad_id)

    def score_records(self, records: Sequence[Any], *, batch_size: int = SCORING_BATCH_SIZE):
        """Scores of tokenized records of one data kind (shards', or raw files read by
        ``rendering.prepare``), each packed as training packs it, the prompt once
        (``trainer.inference.RECORD_SCORING``): for pairs (chosen, rejected) rewards; for
        solutions P(correct) of each step, an array a record; for K responses (rewards, the
        head's outputs), an array each a record. Equal to scoring each conversation alone."""
        from rmflow.schemas.kinds import kind_of_record
        from rmflow.trainer.inference import RECORD_SCORING

        if not len(records):
            raise ValueError("no records to score")
        return RECORD_SCORING[kind_of_record(records[0]).name](self._loaded.model, list(records),
                                                               batch_size=batch_size, pad_id=self.pad_id)

    def score_attributes(self, conversations: Sequence[Conversation], *, batch_size: int = SCORING_BATCH_SIZE,
                         deterministic: bool = False) -> list[dict[str, float]]:
        """An attribute head's outputs for each conversation, by name (``attributes``), in input
        order; the reward (``score``) is their weighted sum."""
        self._require(OUTCOME, "score_attributes")
        if self.head is not ATTRIBUTES:
            raise WrongModelKind(f"score_attributes: this model's head is {self.head.name}, not an attribute head "
                                 "(it was not trained with a regression objective); use score")
        seqs = _encode_each(conversations, self.encode, "conversation")
        scorer = self.scorer(self.shapes(batch_size, deterministic=deterministic))
        out: list[dict[str, float]] = [{}] * len(seqs)
        for batch in scorer.shapes.plan([len(s) for s in seqs]):
            _, outputs = scorer.run_outputs([seqs[i] for i in batch])
            for i, row in zip(batch, outputs):
                out[i] = self.head.answer(row, self._loaded.model.config)[ATTRIBUTE_SCORES]
        return out

    def score_ids(self, sequences: Sequence[np.ndarray], *, batch_size: int = SCORING_BATCH_SIZE,
                  progress=None, deterministic: bool = False) -> np.ndarray:
        """Rewards of token sequences (each scored at its last token), in input order
        (``deterministic``: each the same to the last bit however it is batched)."""
        self._require(OUTCOME, "score_ids")
        if not len(sequences):
            return np.zeros(0, np.float32)
        return self.scorer(self.shapes(batch_size, deterministic=deterministic)).score(list(sequences), progress)

    def score(self, conversations: Sequence[Conversation], *, batch_size: int = SCORING_BATCH_SIZE,
              normalized: bool = False, deterministic: bool = False) -> np.ndarray:
        """One reward per conversation, float32, in input order. ``normalized``: standardised by
        the mean and std that `rmflow eval --normalize` stored with the model; ``deterministic``:
        each the same to the last bit whatever it is scored with (the module doc)."""
        self._require(OUTCOME, "score")
        scores = self.score_ids(_encode_each(conversations, self.encode, "conversation"), batch_size=batch_size,
                                deterministic=deterministic)
        return self.normalize(scores) if normalized else scores

    def score_pairs(self, chosen: Sequence[Conversation], rejected: Sequence[Conversation], *,
                    batch_size: int = SCORING_BATCH_SIZE, deterministic: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Rewards of chosen and rejected conversations, pair by pair (equal lengths)."""
        self._require(OUTCOME, "score_pairs")
        if len(chosen) != len(rejected):
            raise ValueError(f"{len(chosen)} chosen but {len(rejected)} rejected conversations")
        scores = self.score([*chosen, *rejected], batch_size=batch_size, deterministic=deterministic)
        return scores[: len(chosen)], scores[len(chosen):]

    # ------------------------------------------------------------------ process reward models

    def encode_steps(self, solution: dict[str, Any], *, truncate: str = "error") -> tuple[np.ndarray, np.ndarray]:
        """(token ids, index of each step's scoring token) of one solution, ``{"prompt": ...,
        "completions": [step, ...]}``, rendered by the preprocessing code itself; raises
        BadConversation (also when too long: every step is scored, so nothing is truncated)."""
        from rmflow.rendering.formats import BadRecord, solution_to_score

        self._require(PROCESS, "encode_steps")
        try:
            canonical = solution_to_score(solution)
            self.check_chars(sum(len(m[1]) for m in canonical.prompt) + sum(map(len, canonical.steps)))
            [out] = self._record_tokenizer()([canonical])
        except BadRecord as e:
            raise BadConversation(e.message) from e
        if isinstance(out, BadRecord):
            raise BadConversation(out.message)
        if len(out.input_ids) > self.max_length:
            raise BadConversation(f"{len(out.input_ids)} tokens, more than the model's {self.max_length} positions"
                                  + (" (a solution is never truncated: each step is scored)" if truncate == "left"
                                     else ""))
        return out.input_ids, out.step_ends

    def score_step_ids(self, encoded: Sequence[tuple[np.ndarray, np.ndarray]], *, batch_size: int = SCORING_BATCH_SIZE,
                       progress=None, deterministic: bool = False) -> list[np.ndarray]:
        """P(correct) of each step of each encoded solution, float32, in input order."""
        self._require(PROCESS, "score_step_ids")
        return self.scorer(self.shapes(batch_size, deterministic=deterministic)).score(list(encoded), progress)

    def score_steps(self, solutions: Sequence[dict[str, Any]], *, batch_size: int = SCORING_BATCH_SIZE,
                    deterministic: bool = False) -> list[np.ndarray]:
        """For a process reward model: P(step is correct) for every step of every solution, one
        float32 array per solution, in input order."""
        self._require(PROCESS, "score_steps")
        return self.score_step_ids(_encode_each(solutions, self.encode_steps, "solution"), batch_size=batch_size,
                                   deterministic=deterministic)

    def as_reward_func(self, *, normalized: bool = False, truncate: str = "left", batch_size: int | None = None,
                       name: str = "rmflow_reward", deterministic: bool = False):
        """This model as a reward function for TRL's ``GRPOTrainer(reward_funcs=...)``: called with
        ``prompts`` and ``completions`` (conversational or plain text) and TRL's other keyword
        arguments, it returns one reward a completion (None where one cannot be scored, as TRL
        allows). ``rmflow.scoring.grpo`` says how each format is read; its ``server_reward_func``
        asks a running ``rmflow serve`` instead."""
        from rmflow.scoring.grpo import local_reward_func

        self._require(OUTCOME, "as_reward_func")
        return local_reward_func(self, normalized=normalized, truncate=truncate, batch_size=batch_size, name=name,
                                 deterministic=deterministic)

    def _require(self, kind: ModelKind, method: str) -> None:
        if self.kind == kind.name:
            return
        mine = kind_named(self.kind)
        raise WrongModelKind(f"{method}: this is {mine.description}, not {kind.description}: use {mine.head.api}")

    def normalize(self, scores: np.ndarray) -> np.ndarray:
        if not self.normalization or not self.normalization.get("std"):
            raise ValueError("this model has no reward_normalization.json (for an ensemble: of the reward it scores "
                             "with): run `rmflow eval --normalize` first")
        return ((np.asarray(scores, np.float64) - self.normalization["mean"])
                / self.normalization["std"]).astype(np.float32)
