"""Reward-hacking signals: what `rmflow serve` watches in the scores an RL loop asks it for.

Over a sliding window of the last ``--monitor-window`` conversations an outcome model scored:

* ``drift``: how far the window's mean score has moved from the mean the model carries
  (``reward_normalization.json``: `rmflow eval --normalize`'s figures on held-out data, which an
  export keeps), in units of that data's standard deviation. A policy that finds what the model
  over-rates pushes its scores past anything the held-out data reached.
* ``length correlation``: Pearson's r between a conversation's score and its length in tokens (the
  prompt and the reply). A policy that games a length bias makes its replies longer as its reward
  climbs.
* ``over trained length``: the share of conversations longer than the model was trained on, whose
  scores the model was never taught to give.
* ``spread ratio`` (an ensemble): the members' mean disagreement (the std of their rewards) over
  the window against theirs on the held-out data (``reward_normalization.json``'s
  ``member_std``). Members that agree on what they were trained on and disagree on what the policy
  now writes say the policy has left the data the model knows.

Each is a gauge of ``GET /metrics``, a field of ``GET /v1/model``'s ``monitor``, and part of the
line logged every ``--monitor-log-every`` conversations; when one crosses its threshold
(``THRESHOLDS``) once the window holds ``MIN_SEQUENCES``, one warning line says which and what
to check, and another when it is back under.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

# signal -> (threshold, what its warning says); a signal warns when its value's magnitude exceeds it
THRESHOLDS = {
    "drift": (1.0, "the mean score moved more than 1 std of the held-out scores from their mean: the policy may "
                   "have found what the reward model over-rates; read some of its top-scored replies"),
    "length_correlation": (0.5, "scores move with length (Pearson's r beyond +-0.5): the policy may be gaming a "
                                "length bias; compare rewards at matched lengths"),
    "over_trained_length": (0.05, "more than 5% of conversations are longer than the model was trained on: their "
                                  "scores are extrapolation; cap generation length or train longer"),
    "spread_ratio": (1.5, "the ensemble's members disagree more than 1.5x as much as on held-out data: the policy "
                          "writes what the model was not trained on; trust its top rewards least"),
}
MIN_SEQUENCES = 200  # a window holding fewer warns of nothing (its figures are noise); a smaller window: once full


class RewardMonitor:
    """Thread-safe: ``observe`` from the request handlers, ``summary`` for /v1/model and the gauges."""

    def __init__(self, window: int, *, reference: dict[str, Any] | None = None, trained_length: int | None = None,
                 log_every: int = 0, emit: Callable[[str], None] | None = None):
        self.window = window
        self.emit = emit or (lambda line: print(line, flush=True))  # the server's log: its stdout
        self.reference = reference if reference and reference.get("std") else None
        self.trained_length = trained_length
        self.log_every = log_every
        self._scores: collections.deque[float] = collections.deque(maxlen=window)
        self._tokens: collections.deque[int] = collections.deque(maxlen=window)
        self._spreads: collections.deque[float] = collections.deque(maxlen=window)  # an ensemble's score_std
        self.seen = 0
        self.warnings = 0
        self._warning: dict[str, bool] = dict.fromkeys(THRESHOLDS, False)
        self._lock = threading.Lock()

    def observe(self, scores, tokens, spreads=None) -> None:
        """Conversations just scored: their scores and token counts (and an ensemble's spreads)."""
        if not self.window:
            return
        spreads = [np.nan] * len(scores) if spreads is None else spreads
        kept = [(float(s), int(n), float(d)) for s, n, d in zip(scores, tokens, spreads)
                if np.isfinite(s)]  # a NaN says nothing of drift
        with self._lock:
            before = self.seen
            self._scores.extend(s for s, _, _ in kept)
            self._tokens.extend(n for _, n, _ in kept)
            self._spreads.extend(d for _, _, d in kept)
            self.seen += len(kept)
            figures = self._figures()
            lines = self._crossings(figures)
            logged = self.log_every and self.seen // self.log_every > before // self.log_every
        for line in lines:
            self.emit(line)
        if logged:
            self.emit(f"rmflow serve: monitor: {describe(figures)}")

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {**self._figures(), "warnings": self.warnings,
                    "warning": sorted(k for k, on in self._warning.items() if on),
                    "thresholds": {k: v for k, (v, _) in THRESHOLDS.items()}}

    def value(self, name: str) -> float:
        """A signal's value for its gauge (nan while it has none)."""
        got = self.summary().get(name)
        return float("nan") if got is None else float(got)

    def _figures(self) -> dict[str, Any]:
        s, n = np.asarray(self._scores, np.float64), np.asarray(self._tokens, np.float64)
        out: dict[str, Any] = {"window": self.window, "sequences": len(s), "seen": self.seen,
                               "score_mean": float(s.mean()) if len(s) else None,
                               "score_std": float(s.std()) if len(s) else None,
                               "reference": self.reference and {"mean": self.reference["mean"],
                                                                "std": self.reference["std"]},
                               "trained_length": self.trained_length}
        out["drift"] = (float((s.mean() - self.reference["mean"]) / self.reference["std"])
                        if len(s) and self.reference else None)
        out["length_correlation"] = (float(np.corrcoef(s, n)[0, 1]) if len(s) > 2 and s.std() > 0 and n.std() > 0
                                     else None)
        out["over_trained_length"] = float((n > self.trained_length).mean()) if len(n) and self.trained_length else None
        d = np.asarray(self._spreads, np.float64)
        d = d[np.isfinite(d)]
        out["spread"] = float(d.mean()) if len(d) else None
        held_out = (self.reference or {}).get("member_std")
        out["spread_ratio"] = float(d.mean() / held_out) if len(d) and held_out else None
        return out

    def _crossings(self, figures: dict[str, Any]) -> list[str]:
        lines = []
        for name, (limit, why) in THRESHOLDS.items():
            value = figures[name]
            full = figures["sequences"] >= min(MIN_SEQUENCES, self.window)
            over = value is not None and full and abs(value) > limit
            if over and not self._warning[name]:
                self.warnings += 1
                lines.append(f"rmflow serve: WARNING {name.replace('_', ' ')} {value:+.3f} over the last "
                             f"{figures['sequences']:,} conversations: {why}")
            elif not over and self._warning[name] and value is not None:
                lines.append(f"rmflow serve: {name.replace('_', ' ')} back under {limit:g} ({value:+.3f})")
            self._warning[name] = over if value is not None else self._warning[name]
        return lines


def describe(figures: dict[str, Any]) -> str:
    def f(x, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    return (f"{figures['sequences']:,} conversations in the window ({figures['seen']:,} seen): score mean "
            f"{f(figures['score_mean'], '.4f')} std {f(figures['score_std'], '.4f')}, drift {f(figures['drift'], '+.3f')}"
            f", length correlation {f(figures['length_correlation'], '+.3f')}, over trained length "
            f"{f(figures['over_trained_length'], '.1%')}"
            + (f", spread {f(figures['spread'], '.4f')} ({f(figures['spread_ratio'], '.2f')}x held-out)"
               if figures["spread"] is not None else ""))


def sequence_tokens(item) -> list[int]:
    """The tokens of each conversation an encoded item scores (a unit's: its prompt and one response each)."""
    lasts = getattr(item, "lasts", None)
    return [int(x) + 1 for x in lasts] if lasts is not None else [len(item)]
