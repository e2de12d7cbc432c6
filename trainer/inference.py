"""One inference path: a trained reward model loaded with what scoring it needs, and the scoring
core every consumer shares (`rmflow eval`, `rmflow score`, the Python API, export; next, the
reward server and batch scoring).

``load_model`` reads a run directory (its newest or a given checkpoint) or an exported
checkpoint folder, local or remote, with its tokenizer folder, pad id, step separator and kind
(``schemas.kinds``). ``score_sequences`` / ``score_pairs`` / ``score_steps`` run it: pairs and
solutions packed as in training and scored by the training code's own forward. Nothing here
imports the training loop.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from rmflow.schemas.config import SCORING_BATCH_SIZE, STEP_SEPARATOR
from rmflow.schemas.errors import RmflowError
from rmflow.schemas.kinds import ModelKind, kind_of_head
from rmflow.schemas.outputs import EXPORT_INFO
from rmflow.schemas.record import PairRecord, StepRecord
from rmflow.trainer import storage
from rmflow.trainer.checkpoints import load_trained_model
from rmflow.trainer.data import PackCollate, StepPackCollate, bucket_length
from rmflow.trainer.data.steps import record_step_values
from rmflow.trainer.modeling.convert import load_reward_model
from rmflow.trainer.modeling.llama import RewardTransformer
from rmflow.trainer.objective import PROCESS
from rmflow.trainer.rundir import is_run_dir, tokenizer_fingerprint
from rmflow.trainer.step import DEVICE_KEYS, pair_rewards

NORMALIZATION_FILE = "reward_normalization.json"  # in a model folder: `rmflow eval --normalize`'s mean and std


class ModelLoadError(RmflowError):
    """The path names no trained reward model rmflow can load; the message says what to give."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer_dir: str | None  # None: no tokenizer files (callers that need one say so)
    pad_id: int
    description: str  # which weights: the run and step, or the checkpoint folder
    folder: str = ""  # the local folder it was read from (a copy, for a remote one)
    step_separator: str = STEP_SEPARATOR  # a process model's: the text after every step, as in its training data

    @property
    def normalization(self) -> dict[str, Any] | None:
        """The mean and std `rmflow eval --normalize` stored with the model, or None."""
        path = os.path.join(self.folder, NORMALIZATION_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    @property
    def kind(self) -> ModelKind:
        """Its reward model kind (``schemas.kinds``), by the width of its score head."""
        return kind_of_head(self.model.config.num_labels)



def load_model(path: str, step: int | None = None) -> LoadedModel:
    """A run directory (its newest checkpoint, or ``step``) or an exported checkpoint folder, local
    or remote (copied down first)."""
    path = storage.stage_run(path)
    if is_run_dir(path):
        model, run, step = load_trained_model(path, step)
        return LoadedModel(model, run.tokenizer_dir, run.pad_id,
                           f"run {os.path.abspath(path)}, checkpoint step {step} (base: {run.config.model})", path,
                           run.manifest.config.get("step_separator", STEP_SEPARATOR))
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path} does not exist: give a run directory (`rmflow train --output`) or an "
                             "exported checkpoint folder")
    if step is not None:
        raise ModelLoadError(f"{path} is an exported checkpoint (one set of weights): --step applies to run directories")
    model = load_reward_model(path)
    with open(os.path.join(path, "config.json")) as f:
        pad = json.load(f).get("pad_token_id") or 0
    description = f"checkpoint {os.path.abspath(path)}"
    info = os.path.join(path, EXPORT_INFO)
    separator = STEP_SEPARATOR
    if os.path.exists(info):
        with open(info) as f:
            exported = json.load(f)
        description += f" (exported from run {exported.get('run')}, step {exported.get('step')})"
        separator = exported.get("step_separator", separator)
    return LoadedModel(model, path if tokenizer_fingerprint(path) else None, pad, description, path, separator)



def require_tokenizer(model_path: str, tokenizer: str | None, why: str) -> str:
    if tokenizer is None:
        raise ModelLoadError(f"{model_path} has no tokenizer files (tokenizer.json ...), which {why} needs: copy "
                             "the tokenizer the model was trained with into it")
    return tokenizer



def score_sequences(model: RewardTransformer, sequences: Sequence[np.ndarray], *, batch_size: int = SCORING_BATCH_SIZE,
                    pad_id: int = 0, progress=None) -> np.ndarray:
    """The reward of each token sequence (at its last token), batched in length order to waste
    little padding; returned in the input order."""
    @jax.jit
    def forward(ids, pos, seg, idx):
        return model(ids, pos, seg, idx)

    order = np.argsort([len(s) for s in sequences], kind="stable")
    scores = np.zeros(len(sequences), np.float32)
    longest_allowed = max(len(s) for s in sequences)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        length = bucket_length(max(len(sequences[i]) for i in chunk), longest_allowed)
        ids = np.full((batch_size, length), pad_id, np.int32)
        seg = np.zeros_like(ids)
        last = np.zeros(batch_size, np.int32)
        for row, i in enumerate(chunk):
            n = len(sequences[i])
            ids[row, :n], seg[row, :n], last[row] = sequences[i], 1, n - 1
        pos = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape)
        scores[chunk] = np.asarray(forward(ids, pos, seg, last))[: len(chunk)]
        if progress:
            progress(len(chunk))
    return scores



def score_pairs(model: RewardTransformer, records: Sequence[PairRecord], *, batch_size: int = SCORING_BATCH_SIZE,
                max_length: int | None = None, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rewards of chosen and rejected for each record, in order: the records packed as in
    training (``PackCollate``, one row) and scored by the same ``pair_rewards``."""
    longest = max(max(len(r.chosen_ids), len(r.rejected_ids)) for r in records)
    collate = PackCollate(batch_size, max(max_length or 0, longest), pad_id)
    forward = jax.jit(lambda batch: pair_rewards(model, batch))
    rc, rr = [], []
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        b = collate(chunk)
        c, r = (np.asarray(x) for x in forward({k: b[k] for k in DEVICE_KEYS}))
        rc.append(c[b["pair_slot"]])
        rr.append(r[b["pair_slot"]])
    return np.concatenate(rc), np.concatenate(rr)



def score_steps(model: RewardTransformer, records: Sequence[StepRecord], *, batch_size: int = SCORING_BATCH_SIZE,
                max_length: int | None = None, pad_id: int = 0) -> list[np.ndarray]:
    """P(correct) of each step of each record, in order: the records packed as in training
    (``StepPackCollate``, one row) and scored by the model's step logits."""
    longest = max(len(r.input_ids) for r in records)
    collate = StepPackCollate(batch_size, max(max_length or 0, longest), pad_id)
    forward = jax.jit(lambda b: jax.nn.softmax(model.logits(b["input_ids"], b["positions"], b["segment_ids"],
                                                            b["reward_index"], b["branch_ids"]), axis=-1)[..., 1])
    out: list[np.ndarray] = []
    for i in range(0, len(records), batch_size):
        b = collate(records[i : i + batch_size])
        p = np.asarray(forward({k: b[k] for k in PROCESS.device_keys}))
        out += record_step_values(p, b["record_steps"])
    return out
