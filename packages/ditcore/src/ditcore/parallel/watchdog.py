"""A lost peer ends a multi-process run in one line, within a bound, instead of a hang.

Two bounds make every wait finite:
- the collective timeout (dit-train's parallel.timeout_s) on every process group of the run: torch's default group
  (MegatronStrategy → init_process_group), Megatron-Core's (ParallelDims.initialize) and those made afterwards from
  ParallelGroups.timeout (HSDP's, the experts', the stop flag's). A collective with a peer that died raises at once
  (gloo: its sockets closed); with a peer that stopped answering (a frozen node keeps its sockets open) it raises when
  the timeout runs out. On GPUs `raise_on_nccl_timeout` makes NCCL's timed-out collective raise too.
- a `Watchdog` per rank, for what no collective bounds (a GPU stuck behind a collective NCCL did not abort, a
  deadlock): it ends the rank when a training step has not completed within timeout + margin. The process's first step
  is exempt (torch.compile, NCCL's lazy communicators and the first loader fill take what they take; its collectives
  are still bounded by the timeout).

Either way — a distributed error reaching the training loop (`Watchdog.lost`), the step deadline, or a stop signal
(srun ending the step after a node died) while a peer's heartbeat is stale — the rank judges which peers are lost
(`judge`) and exits with EXIT_LOST. Each rank's heartbeat (wall time, host, pid) is in the rendezvous store
(its own client of MASTER_ADDR:MASTER_PORT: the store's reads do not return while its host is frozen, so they run in a
thread of their own and are given up on after STALE_BEATS intervals); a heartbeat older than STALE_BEATS intervals is
a lost rank, and a store that fails or stops answering is its host lost, with every rank on it. Exactly one survivor
prints one line on stderr (`lost_line`, which begins with LINE: job scripts look for it to requeue): the lowest rank
whose heartbeat is fresh, which claims the line in the store first, so that a survivor that trips later stays silent;
when the store itself is gone, the lowest rank not on its host, unclaimed. The others exit silently. No Python
traceback: the process leaves with os._exit, as an atexit handler or a process group's destructor could wait on the
dead peer, and C++'s own messages about the broken connections (gloo, c10d) go to /dev/null from the trip on.

Hosts' clocks are assumed synchronised (NTP) to well within a heartbeat interval: ages compare one host's wall time
with another's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

EXIT_LOST = 75  # EX_TEMPFAIL (sysexits.h): the run cannot go on with its peers; relaunched, it continues
LINE = "error: lost contact with "  # what a lost peer's line begins with (infra/slurm/train.sbatch looks for it)
STALE_BEATS = 3  # a heartbeat older than this many intervals is a lost rank's
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def beat_interval(timeout_s: float) -> float:
    """Seconds between a rank's heartbeats: an eighth of the collective timeout, within [0.5, 5]."""
    return max(0.5, min(5.0, timeout_s / 8))


def raise_on_nccl_timeout() -> None:
    """A timed-out NCCL collective aborts the communicators and raises in the training loop (CleanUpOnly), which then
    names the lost rank, instead of taking the process down from NCCL's watchdog thread (TearDown: torchrun's default
    for its workers, 1) before the line is written. Before the first NCCL process group is made."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"


def is_distributed(error: BaseException) -> bool:
    """Whether an exception is (or was raised from) a collective's or the store's failure: torch's DistError family
    (NCCL's DistBackendError, DistNetworkError, DistStoreError) or gloo's plain RuntimeError (its messages name
    gloo's sources: "[.../gloo/transport/tcp/pair.cc:537] Read error ... Connection reset by peer", "Timed out
    waiting 10000ms for recv operation to complete"). DCP's CheckpointException holds each rank's failure."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in str(e).lower()):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException)]
    return False


# ---------------------------------------------------------------------------------------------------------------
# Heartbeats and the verdict on them: pure, so that the line can be tested from a table


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat, as written into the store."""

    time: float  # wall clock (time.time()) when written
    host: str
    pid: int
    store_host: bool  # this rank runs on the host of the rendezvous store (MASTER_ADDR)
    done: bool = False  # the rank finished (or stopped) normally: it is not lost when its heartbeat ages

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Beat:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class Verdict:
    lost: dict[int, float | None]  # lost rank → age of its last heartbeat in seconds (None: the store is gone)
    hosts: dict[int, str]  # every rank's host
    reporter: int  # the rank that prints the line
    store: str | None = None  # "ADDR:PORT" of the store, when it stopped answering


def judge(me: int, known: dict[int, Beat], read: dict[int, Beat] | None, now: float, stale: float,
          holder: int | None = None, store: str = "") -> Verdict:
    """Which ranks are lost, and who says so. known: every rank's first heartbeat (hosts); read: the heartbeats as read
    at wall time `now`, None if the store failed or stopped answering; stale: seconds after which a heartbeat is a lost
    rank's; holder: the rank whose process holds the store (None: torchrun's agent does). This rank (`me`) is alive.

    With the store gone, its host is lost with every rank on it (its ranks other than those on this rank's own host,
    which is evidently up); on this host, only the store's holder (a rank's process, when no agent holds it)."""
    hosts = {r: b.host for r, b in known.items()}
    if read is None:
        here = known[me].host
        gone = {r for r, b in known.items() if b.store_host and b.host != here}
        if not gone and holder is not None and holder != me:
            gone = {holder}
        alive = [r for r in sorted(known) if r not in gone]
        return Verdict({r: None for r in sorted(gone)}, hosts, alive[0], store)
    lost = {r: now - b.time for r, b in sorted(read.items()) if r != me and not b.done and now - b.time > stale}
    fresh = [r for r in sorted(read) if r not in lost and not read[r].done]
    return Verdict(lost, hosts, min(fresh, default=me))


def spans(ranks: list[int]) -> str:
    """Sorted ranks as runs: [2, 3, 5] → "2-3, 5"."""
    runs = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def lost_line(verdict: Verdict, where: str, newest: Path | None, cause: str = "a collective failed") -> str:
    """The one line: which ranks on which hosts were lost and when last heard of, where training was (`where`: "at
    step 37"), and what to relaunch with. With nothing lost (every heartbeat fresh), `cause` says what happened."""
    tail = (f"the newest complete checkpoint is {newest} — relaunch with --resume auto to continue from it" if newest
            else "no checkpoint is complete yet — relaunch with --resume auto to start the run again")
    if not verdict.lost and verdict.store is not None:  # the store is on this host, which is up: its process went
        return f"error: {cause} {where}, and the rendezvous store at {verdict.store} stopped answering; {tail}"
    if not verdict.lost:
        return f"error: {cause} {where}, yet every rank's heartbeat is fresh; {tail}"
    by_host: dict[str, list[int]] = {}
    for r in verdict.lost:
        by_host.setdefault(verdict.hosts.get(r, "?"), []).append(r)
    parts = []
    for host, ranks in by_host.items():
        ranks = sorted(ranks)
        if verdict.store is not None:
            heard = f"the rendezvous store at {verdict.store} stopped answering"
        else:
            heard = f"last heartbeat {min(verdict.lost[r] for r in ranks):.0f} s ago"
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {spans(ranks)}"
        parts.append(f"{which} on host {host} ({heard})")
    return f"{LINE}{'; '.join(parts)} {where}; {tail}"


# ---------------------------------------------------------------------------------------------------------------
# The watchdog


class Watchdog:
    """Heartbeats, the step deadline and the exit in one line, for one rank of a multi-process run (with one process:
    nothing). Use as a context manager around what follows the process group's creation: a distributed error leaving
    it ends the process (`lost`); `stepping(n)` / `stepped(n)` around each training step arm and disarm the deadline.

    timeout_s: the collective timeout of the run's process groups; newest: the newest complete checkpoint, asked when
    the line is written; exit: how the process leaves (tests pass their own)."""

    def __init__(self, timeout_s: float, newest: Callable[[], Path | None], rank: int | None = None,
                 world_size: int | None = None, exit: Callable[[int], None] = os._exit):
        self.world_size = world_size if world_size is not None else dist.get_world_size()
        self.enabled = self.world_size > 1
        self.rank = rank if rank is not None else dist.get_rank() if self.enabled else 0
        self.timeout_s, self.newest, self.exit = timeout_s, newest, exit
        self.interval = beat_interval(timeout_s)
        self.stale = STALE_BEATS * self.interval
        self.margin = self.stale  # the collective's own timeout raises first, and a dead peer's heartbeat is stale
        self.where = "before the first step"
        self.deadline: float | None = None  # monotonic; None: no step under way, or the process's first
        self.first = True
        self.tripped: tuple[str, float, float] | None = None  # (cause, monotonic time, wall time)
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # close(): the threads end
        self.wake = threading.Event()  # the beat thread's sleep, cut short
        self.wanted = threading.Event()  # the beat thread reads every heartbeat too
        self.signalled = False
        self.table: tuple[float, float, dict[int, Beat]] | None = None  # (monotonic, wall time, beats) of a read
        self.store_error: BaseException | None = None
        self.claimed: int | None = None  # the store's count of claims on the line, ours included
        self.claiming = threading.Event()
        self.done = False
        self.wakeup: tuple[int, int] | None = None  # the signal wake-up pipe (read, write)

    # -- the run's side

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, kind, error, tb) -> None:
        if error is not None:
            self.lost(error)  # returns unless the error is a lost peer's
        self.close()

    def start(self) -> Watchdog:
        """Connect to the store, write the first heartbeat, wait for every rank's (at most the timeout), start the
        threads. Collective in effect: every rank calls it at the same point."""
        if not self.enabled:
            return self
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store_name = f"{addr}:{port}"
        # the agent's store: torchrun's; otherwise rank 0's process holds it (torch's env:// rendezvous, Fabric)
        self.holder = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        self.prefix = f"ditcore/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.me = Beat(time.time(), socket.gethostname(), os.getpid(), store_host=is_this_host(addr))
        self.client = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.stale))
        self.client.set(self._key(self.rank), self.me.encode())
        keys = [self._key(r) for r in range(self.world_size)]
        self.client.wait(keys, timedelta(seconds=self.timeout_s))
        self.known = {r: Beat.decode(raw) for r, raw in enumerate(self.client.multi_get(keys))}
        if threading.current_thread() is threading.main_thread():
            self.wakeup = os.pipe()
            os.set_blocking(self.wakeup[1], False)
            self.previous_wakeup = signal.set_wakeup_fd(self.wakeup[1], warn_on_full_buffer=False)
        self.threads = [threading.Thread(target=self._beat, name="ditcore-heartbeat", daemon=True),
                        threading.Thread(target=self._watch, name="ditcore-watchdog", daemon=True)]
        for t in self.threads:
            t.start()
        return self

    def stepping(self, step: int) -> None:
        """Training step `step` (counted from 1) begins: it must complete within timeout + margin (not the process's
        first)."""
        self.where = f"at step {step}"
        if not self.first:
            self.deadline = time.monotonic() + self.timeout_s + self.margin

    def stepped(self, step: int) -> None:
        self.deadline, self.first, self.where = None, False, f"after step {step}"

    def lost(self, error: BaseException) -> None:
        """An exception ending training: a distributed one (`is_distributed`) ends the process — the line, if this rank
        says it, and EXIT_LOST — and never returns; any other returns, to be raised."""
        if not self.enabled or not is_distributed(error) or self.done:
            return
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self._trip(f"a collective failed ({first[:200]})")
        self.threads[1].join()  # the watch thread ends the process
        raise error  # the watch thread died: at least the error, as it was

    def close(self) -> None:
        """The run ended without a lost peer: a last heartbeat says so (its age never makes it lost), the threads end
        and signals wake nobody."""
        if not self.enabled or self.done:
            return
        self.done = True
        self.deadline = None
        if self.wakeup is not None:
            signal.set_wakeup_fd(self.previous_wakeup)
        self.stopping.set()
        self.wake.set()
        if self.wakeup is not None:
            os.write(self.wakeup[1], b"\0")  # the watch thread's wait, cut short (0 is no signal)
        for t in self.threads:
            t.join(timeout=self.stale)
        if self.wakeup is not None:
            for fd in self.wakeup:
                os.close(fd)
        if self.threads[0].is_alive():  # its read of a store that stopped answering never returned: leave the client
            return
        with contextlib.suppress(Exception):  # the store may be gone with a peer that finished first
            self.client.set(self._key(self.rank), Beat(time.time(), self.me.host, self.me.pid, self.me.store_host,
                                                       done=True).encode())

    # -- the threads

    def _key(self, rank: int) -> str:
        return f"{self.prefix}heartbeat/{rank}"

    def _beat(self) -> None:
        """The only user of the store client: this rank's heartbeat every interval; every rank's, read, when asked
        (`wanted`); the claim on the line. A failure (the store's host died) is kept for the verdict and ends it."""
        try:
            while not self.stopping.is_set():
                now = time.time()
                self.client.set(self._key(self.rank), Beat(now, self.me.host, self.me.pid, self.me.store_host
                                                           ).encode())
                if self.wanted.is_set():
                    raw = self.client.multi_get([self._key(r) for r in range(self.world_size)])
                    self.table = (time.monotonic(), time.time(), {r: Beat.decode(b) for r, b in enumerate(raw)})
                if self.claiming.is_set() and self.claimed is None:
                    self.claimed = self.client.add(f"{self.prefix}line", 1)
                self.wake.wait(self.interval)
                self.wake.clear()
        except Exception as e:  # DistNetworkError, DistStoreError: its C++ side has said so on stderr
            self.store_error = e

    def _watch(self) -> None:
        """Every quarter interval: the step deadline, and stop signals (a signal with a peer's heartbeat stale trips);
        once tripped, the verdict and the exit."""
        tick = self.interval / 4
        while self.tripped is None and not self.stopping.is_set():
            self._sleep_for_signals(tick)
            if self.deadline is not None and time.monotonic() > self.deadline:
                self._trip(f"no training step completed in {self.timeout_s + self.margin:.0f} s (the collective "
                           f"timeout {self.timeout_s:g} s + {self.margin:g} s)")
            elif self.signalled and self.table is not None and self._verdict(self.table).lost:
                self._trip("a stop signal came")
        if self.tripped is not None:
            self._conclude()

    def _sleep_for_signals(self, seconds: float) -> None:
        if self.wakeup is None:
            self.stopping.wait(seconds)
            return
        ready, _, _ = select.select([self.wakeup[0]], [], [], seconds)
        if ready:
            with contextlib.suppress(BlockingIOError, OSError):
                if set(os.read(self.wakeup[0], 64)) & set(STOP_SIGNALS):
                    self.signalled = True
                    self.wanted.set()
                    self.wake.set()

    def _trip(self, cause: str) -> None:
        with self.lock:
            if self.tripped is None:
                self.tripped = (cause, time.monotonic(), time.time())
                self.wanted.set()
                self.wake.set()

    def _verdict(self, table: tuple[float, float, dict[int, Beat]] | None) -> Verdict:
        read = None if table is None else table[2]
        return judge(self.rank, self.known, read, table[1] if table else time.time(), self.stale, self.holder,
                     self.store_name)

    def _conclude(self) -> None:
        """Judge once the heartbeats tell (a peer stale, or a full stale period plus an interval since the trip, by
        which a peer that died just before it is stale), or the store is gone (it failed, or no read came back in a
        stale period); the lowest fresh rank claims the line and prints it; exit."""
        cause, t0, _ = self.tripped
        stderr = _silence_stderr()  # from here on, C++'s messages about the broken connections go nowhere
        while True:
            time.sleep(self.interval / 4)
            table = self.table if self.table is not None and self.table[0] > t0 else None
            if self.store_error is not None or (table is None and time.monotonic() > t0 + self.stale):
                verdict = self._verdict(None)
                break
            if table is not None:
                verdict = self._verdict(table)
                if verdict.lost or time.monotonic() > t0 + self.stale + self.interval:
                    break
        if verdict.reporter == self.rank and self._claim(verdict):
            with contextlib.suppress(Exception):
                line = lost_line(verdict, self.where, self.newest(), cause)
                os.write(stderr, f"\n{line}\n".encode())
        self.exit(EXIT_LOST)
        os.dup2(stderr, 2)  # a test's exit returns: its stderr back, the heartbeats end
        os.close(stderr)
        self.stopping.set()
        self.wake.set()

    def _claim(self, verdict: Verdict) -> bool:
        """Whether this rank is the first to claim the line in the store (another survivor that tripped earlier has
        said it already). Unclaimed where the store is gone or does not answer: then the rule alone decides."""
        if verdict.store is not None or self.store_error is not None:
            return True
        self.claiming.set()
        self.wake.set()
        give_up = time.monotonic() + self.stale
        while self.claimed is None and self.store_error is None and time.monotonic() < give_up:
            time.sleep(self.interval / 8)
        return self.claimed in (1, None)


def is_this_host(addr: str) -> bool:
    """Whether `addr` (MASTER_ADDR: a name or an address) is this host: one of its addresses can be bound here."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for a in addresses:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET6 if ":" in a else socket.AF_INET) as s:
            s.bind((a, 0))
            return True
    return False


def _silence_stderr() -> int:
    """Flush Python's streams, send file descriptor 2 to /dev/null (C++ logs of the other threads: gloo, c10d) and
    return a descriptor of the real stderr, for the line."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    return saved
