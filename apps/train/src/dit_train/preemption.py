"""Stopping a run at a step every rank agrees on: signals (Slurm preemption, Ctrl-C, a closed terminal) are recorded,
and the training loop asks after every step whether any rank saw one."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ditcore import stopping


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C: exit at once. A KeyboardInterrupt, so that no `except Exception` on the way catches it."""


class Preempted:
    """SIGTERM / SIGUSR1 (Slurm preemption or time limit), SIGINT (Ctrl-C) and SIGHUP (the terminal closed) →
    finish the step, checkpoint, exit 0: the handler only records the signal (ditcore.stopping), the loop looks at it
    after every step. A second Ctrl-C exits at once (Interrupted): a checkpoint being written stays an unpublished
    .tmp-step-* folder, which never passes as complete and which the next save removes.

    Every rank must stop at the same step, so the ranks agree on such flags over a CPU (gloo) group: an
    all-reduce of a host tensor, which never waits for the GPU's queue of work. A lost peer makes that all-reduce (or
    the step's collectives) fail: the stop checkpoint, whose collectives could only fail or wait, is not attempted, and
    the watchdog ends the process in one line (ditcore.parallel.watchdog, exit code 75); a signal that finds a rank
    blocked on a peer whose heartbeat is stale ends it so too.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
    # Under torchrun one Ctrl-C arrives twice, from the terminal and forwarded by torchrun's agent a moment later:
    # only a Ctrl-C this long after the first is a second one.
    REPEAT_S = 1.0

    def __init__(self, world_size: int, on_gpu: bool, rank: int = 0, timeout: timedelta | None = None):
        self.world_size, self.rank = world_size, rank
        self.interrupted_at: float | None = None  # the first Ctrl-C
        # CPU: the default group is gloo already. timeout: the run's collective timeout (ditcore.parallel.watchdog)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if world_size > 1 and on_gpu else None
        self.flag = False
        self.signals = stopping.Signals(self.SIGNALS, then=self._handle).__enter__()

    def close(self) -> None:
        """Give the signals back to the handlers they had before."""
        self.signals.__exit__(None, None, None)

    def _handle(self, signum: int) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self.interrupted_at is not None and now - self.interrupted_at > self.REPEAT_S:
                raise Interrupted("interrupted by a second Ctrl-C: nothing half-written was published; the newest "
                                  "complete checkpoint is kept for --resume auto")
            if self.interrupted_at is None and self.rank == 0:
                # os.write, not print: the handler may run in the middle of a print (tqdm's) to the same stream
                os.write(2, b"\nCtrl-C: stopping after this step with a checkpoint (press it again to exit at once)\n")
            self.interrupted_at = self.interrupted_at or now
        self.flag = True

    def signalled(self) -> bool:
        return self.any_rank(self.flag)

    def any_rank(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        t = torch.tensor([float(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t[0])
