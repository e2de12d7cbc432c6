"""The training stage's errors, beside their owner and below every module that raises them (so
none of those imports the training loop to raise one)."""

from __future__ import annotations

from rmflow.schemas.errors import RmflowError


class TrainError(RmflowError, RuntimeError):
    """The run cannot start or had to stop; the message says why and what to do."""


class Interrupted(TrainError):
    """SIGINT or SIGTERM stopped the run at a step boundary, after a checkpoint of that step."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # as a shell reports a process a signal ended
