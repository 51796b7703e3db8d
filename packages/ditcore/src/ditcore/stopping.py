"""Signals that end a command (Ctrl-C, SIGTERM, a closed terminal), acted on where the command's work loop chooses.

Python's default Ctrl-C raises KeyboardInterrupt wherever the main thread happens to be, and code in between (an
`except BaseException`, a `__del__`, a callback, a worker pool's result handling) can catch and drop it: the command
then goes on as if nothing was pressed. Within `Signals` the handler only records the signal; the work loops call
`check()` at a bounded interval (per sample, per sampler step, inside every long wait: `POLL_S`), which raises
`Stopped` at a point whose callers all clean up. A second signal while stopping is recorded too, so it cannot cut
that cleanup short.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 0.1  # the longest a wait goes without looking at the signals


class Stopped(KeyboardInterrupt):
    """A signal asked the command to stop. A KeyboardInterrupt, so that no `except Exception` on the way catches it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {name(signum)}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's own: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP


def name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Signals:
    """Within the block, `signals` are recorded (and `then(signum)` called, from the handler) instead of acted on;
    the handlers they had before are given back after it. Main thread only, as every signal handler."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS, then: Callable[[int], None] | None = None):
        self.signals, self.then = signals, then
        self.received: list[int] = []

    def __enter__(self) -> Signals:
        self.previous = {sig: signal.signal(sig, self._record) for sig in self.signals}
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _record(self, signum, frame) -> None:
        self.received.append(signum)
        if self.then is not None:
            self.then(signum)

    def check(self) -> None:
        if self.received:
            raise Stopped(self.received[0])


_active: list[Signals] = []  # the blocks the main thread is in, innermost last


def requested() -> int | None:
    """The first signal any enclosing `Signals` block has recorded, or None."""
    return next((s.received[0] for s in _active if s.received), None)


def check() -> None:
    """Raise Stopped if any enclosing `Signals` block has recorded a signal (outside one: nothing to do)."""
    signum = requested()
    if signum is not None:
        raise Stopped(signum)


def checked(callback: Callable[..., None]) -> Callable[..., None]:
    """`callback` (a sampler's per-step one: a progress bar), with a look at the signals first."""

    def call(*args) -> None:
        check()
        callback(*args)

    return call
