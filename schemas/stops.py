"""Stop requests: the one place where rmflow handles the signals that ask a process to stop.

Whatever the policy, a signal is handled the same way: the handlers are installed from the main
thread only (Python delivers signals there; elsewhere the block runs unguarded), the previous
handlers come back when the block ends. A stop that unwinds the command is noted here
(``note_stop``) so that nothing is published after it (``refuse_if_stopping``, called by every
publishing step: the signal's KeyboardInterrupt alone is not enough, since one raised inside a
finalizer is ignored by Python and a library may catch it). Two policies use it:

* ``unwinding`` (every command): SIGTERM, a scheduler's stop or ``kill``, unwinds like Ctrl-C,
  so that staging folders and locks are cleaned up by the code being left rather than the
  process vanishing mid-write;
* ``at_step_boundaries`` (the training loop): SIGINT and SIGTERM are only recorded, and the loop
  stops at its next step boundary with a checkpoint; a second SIGINT stops at once.

The reward server stops by uvicorn's own graceful shutdown, whose handlers replace these while
it runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

_stopping: list[int] = []  # the signals that asked this process to stop, newest last


def note_stop(signum: int) -> None:
    _stopping.append(signum)


def stop_signal() -> int | None:
    """The newest signal that asked this process to stop, or None."""
    return _stopping[-1] if _stopping else None


def clear_stop() -> None:
    _stopping.clear()


def refuse_if_stopping() -> None:
    """Raise KeyboardInterrupt, before anything is published, once a stop was asked for."""
    if _stopping:
        raise KeyboardInterrupt(f"stopped by signal {_stopping[-1]} before publishing")


@contextlib.contextmanager
def handling(signums: tuple[int, ...], handler: Callable) -> Iterator[bool]:
    """``handler`` for ``signums`` while the block runs, the previous handlers restored after;
    yields whether it was installed (only the main thread can install one)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield True
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def unwinding(received: list[int] | None = None) -> Iterator[list[int]]:
    """SIGTERM raises KeyboardInterrupt where the main thread is, as Ctrl-C does; the stop is
    noted. Where a KeyboardInterrupt would be lost (``_raising_is_safe``), the signal is delivered
    again a moment later instead. ``received`` gets the signals; the stop is this block's alone
    (cleared when it ends, so that later work in this process, an API call in a test, publishes)."""
    received = [] if received is None else received
    active = [True]

    def deliver_again(signum):
        if active[0]:
            os.kill(os.getpid(), signum)

    def handler(signum, frame):
        received.append(signum)
        note_stop(signum)
        if not _raising_is_safe(frame):  # raised here, the interrupt would be lost: deliver it again soon
            timer = threading.Timer(0.05, deliver_again, (signum,))
            timer.daemon = True
            timer.start()
            return
        raise KeyboardInterrupt

    installed = [False]
    try:
        with handling((signal.SIGTERM,), handler) as installed[0]:
            if installed[0]:
                clear_stop()
            try:
                yield received
            finally:
                active[0] = False
    finally:
        if installed[0]:  # after the previous handler is back: a signal arriving meanwhile is not left noted
            clear_stop()


def _raising_is_safe(frame) -> bool:
    """Whether a KeyboardInterrupt raised in ``frame`` reaches the code being interrupted. Not inside
    a finalizer (``__del__``: Python prints and ignores it) nor inside an import (a C extension's
    start-up code records it as uncaught, and the interpreter then exits by SIGINT whatever the
    command said)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.startswith("<frozen importlib"):
            return False
        frame = frame.f_back
    return True


@contextlib.contextmanager
def at_step_boundaries() -> Iterator[list[int]]:
    """SIGINT and SIGTERM only record that a stop was asked for; the loop reads the list at each
    step boundary. (Python's default raises KeyboardInterrupt wherever the main thread happens to
    be: inside a JAX callback it can be swallowed, mid-write it leaves a half checkpoint.) A
    second SIGINT stops at once."""
    received: list[int] = []

    def handler(signum, frame):
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        received.append(signum)

    with handling((signal.SIGINT, signal.SIGTERM), handler):
        yield received
