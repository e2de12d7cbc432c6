"""Length policy and train/eval split: pure functions on token ids and pair ids."""

from __future__ import annotations

import numpy as np
from rmflow.rendering.formats import BadRecord


class TooLong(BadRecord):
    """The pair does not fit in max_length under the chosen policy (a counted drop, not an error)."""

    category = "too_long"


def apply_length_policy(
    chosen: np.ndarray,
    rejected: np.ndarray,
    prompt_len: int,
    head_len: int,
    max_length: int,
    policy: str,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Return (chosen, rejected, prompt_len) that fit in ``max_length`` or raise TooLong.

    ``drop``: a pair with either side longer than max_length is dropped.
    ``truncate-prompt``: cut the oldest prompt tokens after the first ``head_len`` tokens
    (the template's leading tokens: BOS, system turn, first turn header), keeping both
    replies whole. Both sides share the prompt, so the same tokens go from each. A pair
    whose replies alone do not fit is dropped. The end of a reply is never cut.
    """
    longest = max(len(chosen), len(rejected))
    excess = longest - max_length
    if excess <= 0:
        return chosen, rejected, prompt_len
    if policy == "drop":
        raise TooLong(
            "too_long",
            f"chosen {len(chosen)} / rejected {len(rejected)} tokens; max_length is {max_length}",
        )
    if policy != "truncate-prompt":
        raise ValueError(f"unknown length policy {policy!r}")
    head = min(head_len, prompt_len)
    if excess > prompt_len - head:
        raise TooLong(
            "replies_too_long",
            f"replies need {longest - prompt_len} tokens plus {head} template tokens; "
            f"max_length is {max_length}",
        )
    return _cut(chosen, head, excess), _cut(rejected, head, excess), prompt_len - excess


def _cut(ids: np.ndarray, head: int, excess: int) -> np.ndarray:
    """``ids`` without the ``excess`` tokens that follow the first ``head``."""
    return ids[np.r_[0:head, head + excess : len(ids)]]


def apply_length_policy_steps(
    ids: np.ndarray,
    step_ends: np.ndarray,
    prompt_len: int,
    head_len: int,
    max_length: int,
    policy: str,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The same policies for a stepwise solution (one sequence): ``drop`` drops it when longer
    than max_length; ``truncate-prompt`` cuts the oldest prompt tokens after the template's
    leading ones and keeps every step whole (the step ends move with the cut), or drops it."""
    excess = len(ids) - max_length
    if excess <= 0:
        return ids, step_ends, prompt_len
    if policy == "drop":
        raise TooLong("too_long", f"{len(ids)} tokens (prompt and {len(step_ends)} steps); max_length is "
                      f"{max_length}")
    if policy != "truncate-prompt":
        raise ValueError(f"unknown length policy {policy!r}")
    head = min(head_len, prompt_len)
    if excess > prompt_len - head:
        raise TooLong("steps_too_long", f"the {len(step_ends)} steps need {len(ids) - prompt_len} tokens plus "
                      f"{head} template tokens; max_length is {max_length}")
    return _cut(ids, head, excess), step_ends - excess, prompt_len - excess
