"""Stopping a run at a step every rank agrees on: signals (Slurm preemption, Ctrl-C, a closed terminal) are recorded,
and the training loop asks after every step whether any rank saw one."""

from __future__ import annotations

import os
import shlex
import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ditcore import runs, stopping


def sample_command(ckpt: Path, prompts: Sequence[str] = (), num_classes: int = 0) -> str:
    """The command that samples a checkpoint's EMA weights before the run is exported, to copy from a stop message:
    with the run's first validation prompt, or class 0 for a class-conditional model."""
    what = "--class 0" if num_classes else f"--prompt {shlex.quote(prompts[0] if prompts else 'describe what to draw')}"
    return f"dit-sample generate --checkpoint {shlex.quote(str(ckpt))} {what}"


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

    def __init__(self, world_size: int, on_gpu: bool, rank: int = 0, timeout: timedelta | None = None,
                 run_dir: Path | None = None, sample: Callable[[Path], str] | None = None):
        """run_dir, sample: a second Ctrl-C's message names the run's newest complete checkpoint and `sample(it)`,
        the command that samples it (`sample_command`)."""
        self.world_size, self.rank = world_size, rank
        self.run_dir, self.sample = run_dir, sample
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
                raise Interrupted(self.interrupted_line())
            if self.interrupted_at is None and self.rank == 0:
                # os.write, not print: the handler may run in the middle of a print (tqdm's) to the same stream
                os.write(2, b"\nCtrl-C: stopping after this step with a checkpoint (press it again to exit at once)\n")
            self.interrupted_at = self.interrupted_at or now
        self.flag = True

    def interrupted_line(self) -> str:
        """What a second Ctrl-C leaves: the newest complete checkpoint, to continue from or sample."""
        line = "interrupted by a second Ctrl-C: nothing half-written was published"
        if self.run_dir is None:
            return f"{line}; the newest complete checkpoint is kept for --resume auto"
        newest = runs.newest(self.run_dir)
        if newest is None:
            return f"{line}; no checkpoint of {self.run_dir} is complete yet (--resume auto starts the run again)"
        how = f", or sample it: {self.sample(newest)}" if self.sample is not None else ""
        return f"{line}; the newest complete checkpoint, {newest}, is kept for --resume auto{how}"

    def signalled(self) -> bool:
        return self.any_rank(self.flag)

    def any_rank(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        t = torch.tensor([float(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t[0])
