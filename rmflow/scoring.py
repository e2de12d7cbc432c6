"""`rmflow score`: rewards for conversations (message lists), batched by length.

Input JSONL: one conversation a line, either a list of ``{role, content}`` messages or an
object with ``messages`` (other fields are kept in the output), ending with the assistant reply
to score. Output JSONL, in input order: the line's fields plus ``score`` (and
``score_normalized`` when the model carries reward_normalization.json from
`rmflow eval --normalize`), or, for a line that cannot be scored, its fields plus ``line`` and
``error`` (bad JSON, invalid UTF-8, no final assistant message, too long ...).

A process reward model scores steps: each input line is a solution, ``{"prompt": ...,
"completions": [step, ...]}`` (TRL's stepwise layout; labels, if present, are kept and ignored),
and the output adds ``step_scores`` (P(step is correct), one per step) and ``first_error``
(the first step scored below 0.5, -1 when none).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from rmflow.api import BadConversation, RewardModel
from schemas.config import SCORING_BATCH_SIZE
from schemas.errors import RmflowError
from trainer.evaluate import STEP_THRESHOLD, first_error

STEP_FIELDS = ("step_scores", "first_error")  # what scoring a solution adds


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


class ScoreError(RmflowError):
    """A scoring job cannot run; the message says why and what to do."""


def score_file(model_path: str, input_path: str, output_path: str, *, batch_size: int = SCORING_BATCH_SIZE,
               progress_factory=None) -> dict[str, int]:
    """Score a JSONL file through the Python API (``rmflow.RewardModel``), one result line per
    input line; a line that cannot be scored keeps its fields and gets ``line`` and ``error``."""
    if os.path.isdir(output_path):
        raise ScoreError(f"--output {output_path} is a folder; give the JSONL file to write")
    if not os.path.isfile(input_path):
        raise ScoreError(f"--input {input_path} is not a file; give a JSONL file of conversations")
    rm = RewardModel.load(model_path)
    process = rm.kind == "process"
    rows: list[dict[str, Any]] = []
    seqs, where = [], []
    for line_no, text, problem in _lines(input_path):
        obj = None
        try:
            if problem:
                raise BadConversation(problem)
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise BadConversation(f"not valid JSON: {e}") from e
            ids = rm.encode_steps(obj) if process else rm.encode(obj)
            rows.append({**(obj if isinstance(obj, dict) else {"messages": obj})})
            seqs.append(ids)
            where.append(len(rows) - 1)
        except Exception as e:  # noqa: BLE001 - every bad line is reported, none is lost
            reason = str(e) if isinstance(e, BadConversation) else f"{type(e).__name__}: {e}"
            kept = {k: v for k, v in obj.items() if k not in ("score", "score_normalized", *STEP_FIELDS)} \
                if isinstance(obj, dict) else {}  # the user's own fields (an id ...), to join results back
            rows.append({**kept, "line": line_no, "error": reason})
    if process:
        for i, p in zip(where, rm.score_step_ids(seqs, batch_size=batch_size)):
            rows[i]["step_scores"] = [float(x) for x in p]
            rows[i]["first_error"] = first_error(p < STEP_THRESHOLD)
        _write(output_path, rows)
        return {"scored": len(seqs), "errors": len(rows) - len(seqs)}
    progress = progress_factory(len(seqs)) if progress_factory and seqs else None
    scores = rm.score_ids(seqs, batch_size=batch_size, progress=progress)
    normalized = rm.normalize(scores) if rm.normalization and rm.normalization.get("std") else None
    for k, (i, s) in enumerate(zip(where, scores)):
        rows[i]["score"] = float(s)
        if normalized is not None:
            rows[i]["score_normalized"] = float(normalized[k])
    _write(output_path, rows)
    return {"scored": len(seqs), "errors": len(rows) - len(seqs)}


def _write(path: str, rows: list[dict[str, Any]]) -> None:
    """Written beside, then renamed over ``path``: an interrupted write leaves the earlier file whole."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
