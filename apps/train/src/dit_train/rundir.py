"""Who writes a run directory: one training run at a time, and a new run over an old one only when asked for.

The lock is RUN_DIR/.lock, held by the job's global rank 0 for as long as it lives, with a POSIX record lock
(fcntl.lockf) and a JSON record of the holder in the file (host, pid, since, command) for the message a second run
gets. The kernel drops the lock when the process ends, however it ends (kill -9 included), so a record left behind
never blocks anybody: only the lock counts. POSIX locks rather than flock because a forked child (a data-loader
worker) does not inherit them, so the workers of a killed trainer cannot keep the folder held, and because NFS
implements them across hosts (v3 with lockd, v4); Lustre needs its `flock` mount option. Their one trap: a process
drops its lock when it closes any descriptor of the file, so the holder never opens the file a second time.

Starting over (`--resume none`) where checkpoints exist would mix two runs in one folder: it is refused unless
`--overwrite` says to remove what the earlier run wrote. Resuming a run that has nothing left to train with another
config (a command meant for a new run, in a folder a finished run holds) is refused too
(dit_train.resume_config.nothing_to_train), before anything is written.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dit_train import resume_config
from ditcore import durable, runs
from ditcore.errors import ConfigError
from ditcore.runs import CheckpointError


class RunDirInUse(RuntimeError):
    """Another training run holds the run directory."""


class RunDirLock:
    """The lock on a run directory, held by this process until it ends (the descriptor is never closed)."""

    def __init__(self, fd: int | None, path: Path):
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunDirLock:
        """Lock run_dir and record this process as its holder; RunDirInUse naming the holder if another has it."""
        path = Path(run_dir) / runs.LOCK_FILE
        try:
            # a planted link is refused, not followed; O_NONBLOCK: opening a planted FIFO must not wait for a writer
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            os.set_blocking(fd, True)
        except OSError as e:
            raise ConfigError("train.run_dir", str(run_dir), f"a folder whose {runs.LOCK_FILE} file dit-train can open "
                                                             f"and lock ({e.strerror}: remove {path})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device: it cannot hold the record, nor a lock
            os.close(fd)
            raise ConfigError("train.run_dir", str(run_dir), f"a folder whose {runs.LOCK_FILE} is a regular file "
                                                             f"({path} is not one: remove it)")
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)  # this process holds no lock on the file: closing loses nothing
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise RunDirInUse(f"train.run_dir {run_dir} is in use by another training run ({holder(path)}) — "
                                  "wait for it to end or stop it, or use another train.run_dir") from None
            # a file system without locks (an NFS mount without lockd, say): train, but say what is not guarded
            print(f"warning: cannot lock train.run_dir {run_dir} ({e.strerror}): nothing stops a second run from "
                  "writing into it at the same time", file=sys.stderr, flush=True)
            return cls(None, path)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "command": shlex.join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def holder(path: Path) -> str:
    """Who holds the lock file at `path`, in words, from the record its holder wrote."""
    try:
        record = json.loads(path.read_text())
        return (f"pid {record['pid']} on host {record['host']}, since {record['since']}: "
                f"{' '.join(str(record['command']).split())[:200]}")
    except (OSError, ValueError, KeyError, TypeError):
        return f"its holder has not written its record into {path} yet"


def start_over(run_dir: Path, resume: str, overwrite: bool) -> None:
    """Refuse `--resume none` where checkpoints exist, unless --overwrite; with --overwrite remove what an earlier run
    wrote (saying what, in one line), so that this run starts from scratch."""
    ckpts = runs.by_write_order(run_dir)
    if overwrite:
        if resume not in ("none", "auto"):
            raise CheckpointError(f"--overwrite starts a new run and removes the checkpoints in {run_dir}: it cannot "
                                  f"be combined with --resume {resume} — drop one of them")
        removed = remove_outputs(run_dir)
        if removed:
            print(f"--overwrite: removed what an earlier run wrote in {run_dir}: {', '.join(removed)}",
                  file=sys.stderr, flush=True)
    elif resume == "none" and ckpts:
        raise CheckpointError(f"--resume none: train.run_dir {run_dir} already has {counted(ckpts)} (the "
                              f"newest: {ckpts[-1].name}) — continue that run with --resume auto, start the new run "
                              "in another train.run_dir, or pass --overwrite to remove them and that run's other "
                              "outputs")


def check_continues(run_dir: Path, resume: str, cfg) -> None:
    """Refuse (CheckpointError) to resume, with another config, a checkpoint this config trains no further
    (resume_config.nothing_to_train); `cfg` resolved, as the checkpoint's config was saved. A checkpoint that cannot
    be read is left to dit_train.checkpoint.resume, which says what is wrong with it."""
    ckpt = None if resume == "none" else runs.newest(run_dir) if resume == "auto" else Path(resume)
    if ckpt is None or not runs.is_complete(ckpt):
        return
    try:
        saved = runs.read_config(ckpt)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return
    refusal = resume_config.nothing_to_train(resume_config.compare(saved, cfg, ckpt), runs.step_of(ckpt), saved, cfg)
    if refusal:
        raise CheckpointError(refusal)


def remove_outputs(run_dir: Path) -> list[str]:
    """Remove what dit-train writes in run_dir (runs.OUTPUTS; nothing else, the lock neither); returns what was
    there."""
    removed = []
    for name in runs.OUTPUTS:
        path = Path(run_dir) / name
        if not (path.exists() or path.is_symlink()):
            continue
        if name == runs.CHECKPOINTS:
            ckpts = runs.by_write_order(run_dir)
            removed.append(f"{name}/ ({counted(ckpts)}" + (f", the newest {ckpts[-1].name})" if ckpts else ")"))
        else:
            removed.append(f"{name}/" if path.is_dir() and not path.is_symlink() else name)
        if path.is_dir() and not path.is_symlink():
            durable.remove_dir(path)
        else:
            path.unlink()
    return removed


def counted(ckpts: list) -> str:
    return f"{len(ckpts)} checkpoint" + ("" if len(ckpts) == 1 else "s")


def csv_version(run_dir: Path) -> str:
    """A csv/ folder name no earlier run in run_dir has: run-<start time>, then -2, -3 … for runs started in the
    same second (runs of one run dir follow one another: the lock)."""
    stem = f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    name, n = stem, 1
    while (Path(run_dir) / runs.CSV / name).exists():
        n += 1
        name = f"{stem}-{n}"
    return name


def first_process() -> bool:
    """Whether this is the job's global rank 0, before its process group exists: torchrun sets RANK in every process
    it starts; Fabric's launcher sets LOCAL_RANK (and NODE_RANK) in the processes it starts after the first."""
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "NODE_RANK", "LOCAL_RANK"))


@dataclass
class Claim:
    """The first process's hold on the run dir, or why it was refused (kept for the others to hear of)."""

    lock: RunDirLock | None
    refusal: Exception | None

    def agree(self, fabric) -> None:
        """Collective, once the processes are up: all of them stop, exit status 2, if the first one was refused. It
        says why in one line, as the CLI would, before any of them leaves: torchrun stops the rest when one ends."""
        from dit_train.checkpoint import all_ranks

        if not all_ranks(fabric, self.refusal is not None)[0]:
            return
        if self.refusal is not None:
            print(f"error: {self.refusal}", file=sys.stderr, flush=True)
        all_ranks(fabric, None)
        raise SystemExit(2)


def claim(run_dir: Path, resume: str, overwrite: bool, cfg) -> Claim:
    """Before anything is written into run_dir: on the job's first process take the lock, check that a new run over
    old checkpoints was asked for and carry out --overwrite, and that a resume of a run with nothing left to train
    keeps its config (`check_continues`); elsewhere nothing. A refusal is raised at once where no
    other process of the job runs yet (one process, or Fabric's launcher before it starts the others); under torchrun
    the others are waiting for the first in the launch, so it is kept for Claim.agree."""
    if not first_process():
        return Claim(None, None)
    lock = None
    try:
        lock = RunDirLock.acquire(run_dir)
        start_over(run_dir, resume, overwrite)
        check_continues(run_dir, resume, cfg)
    except (RunDirInUse, CheckpointError) as e:
        if "RANK" not in os.environ:
            raise
        return Claim(lock, e)
    return Claim(lock, None)
