"""`rmflow score`: rewards for conversations (message lists), batched by length.

Input JSONL: one conversation a line, either a list of ``{role, content}`` messages or an
object with ``messages`` (other fields are kept in the output), ending with the assistant reply
to score. Output JSONL, in input order: the line's fields plus ``score`` (and
``score_normalized`` when the model carries reward_normalization.json from
`rmflow eval --normalize`), or, for a line that cannot be scored, its fields plus ``line`` and
``error`` (bad JSON, invalid UTF-8, no final assistant message, too long ...).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from rmflow.evaluation import NORMALIZATION_FILE, load_model, require_tokenizer
from trainer.evaluate import score_sequences
from trainer.train import TrainError


class BadLine(ValueError):
    """A line that cannot be scored; its message goes in the output line's 'error'."""


def _conversation(obj: Any) -> list[dict[str, str]]:
    msgs = obj.get("messages") if isinstance(obj, dict) else obj
    if not isinstance(msgs, list) or not msgs:
        raise BadLine("expected a non-empty list of messages, or an object with 'messages'")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadLine(f"message {i} must be an object with string 'role' and 'content'")
    if msgs[-1]["role"] != "assistant":  # a reward model scores a reply, not a question
        raise BadLine(f"the last message is the {msgs[-1]['role']}'s; a reward model scores an assistant reply: "
                      "end the conversation with the assistant message to score")
    return msgs


def _lines(path: str):
    """(line number, decoded text or None, problem or None) for each non-blank line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield line_no, raw.decode("utf-8"), None
            except UnicodeDecodeError as e:
                yield line_no, None, f"line is not valid UTF-8 ({e}); save the file as UTF-8"


def score_file(model_path: str, input_path: str, output_path: str, *, batch_size: int = 16,
               progress_factory=None) -> dict[str, int]:
    from transformers import AutoTokenizer

    if os.path.isdir(output_path):
        raise TrainError(f"--output {output_path} is a folder; give the JSONL file to write")
    if not os.path.isfile(input_path):
        raise TrainError(f"--input {input_path} is not a file; give a JSONL file of conversations")
    loaded = load_model(model_path)
    model, pad_id = loaded.model, loaded.pad_id
    tok = AutoTokenizer.from_pretrained(require_tokenizer(model_path, loaded.tokenizer_dir, "scoring"))
    limit = model.config.max_position_embeddings
    rows: list[dict[str, Any]] = []
    seqs, where = [], []
    for line_no, text, problem in _lines(input_path):
        obj = None
        try:
            if problem:
                raise BadLine(problem)
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise BadLine(f"not valid JSON: {e}") from e
            ids = tok.apply_chat_template(_conversation(obj), tokenize=True, return_dict=False)
            if len(ids) > limit:
                raise BadLine(f"{len(ids)} tokens, more than the model's {limit} positions")
            rows.append({**(obj if isinstance(obj, dict) else {"messages": obj})})
            seqs.append(np.asarray(ids, np.int32))
            where.append(len(rows) - 1)
        except Exception as e:  # noqa: BLE001 - every bad line is reported, none is lost
            reason = str(e) if isinstance(e, BadLine) else f"{type(e).__name__}: {e}"
            kept = {k: v for k, v in obj.items() if k not in ("score", "score_normalized")} \
                if isinstance(obj, dict) else {}  # the user's own fields (an id ...), to join results back
            rows.append({**kept, "line": line_no, "error": reason})
    scores = np.zeros(0)
    if seqs:
        progress = progress_factory(len(seqs)) if progress_factory else None
        scores = score_sequences(model, seqs, batch_size=batch_size, pad_id=pad_id, progress=progress)
    norm = None
    if os.path.exists(os.path.join(model_path, NORMALIZATION_FILE)):
        with open(os.path.join(model_path, NORMALIZATION_FILE)) as f:
            norm = json.load(f)
    for i, s in zip(where, scores):
        rows[i]["score"] = float(s)
        if norm and norm["std"] > 0:
            rows[i]["score_normalized"] = (float(s) - norm["mean"]) / norm["std"]
    with open(output_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return {"scored": len(seqs), "errors": len(rows) - len(seqs)}
