"""dit-train under torchrun when a peer is lost mid-run: a worker killed (its sockets close at once) or stopped (a
frozen node: its sockets stay open), and the same with the survivor signalled, as srun does when it ends a job step
after a node died. The survivor exits within parallel.timeout_s + margin (ditcore.parallel.watchdog) with exactly one
line naming the lost rank and the newest complete checkpoint, exit code 75 and no traceback from any rank; the run then
continues from that checkpoint with --resume auto. The unit cases (the line from a table of heartbeats, the deadline,
the store's death) are in tests/ditcore/parallel/test_watchdog.py."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ditcore import runs
from ditcore.parallel.watchdog import EXIT_LOST, STALE_BEATS, beat_interval

BIN = Path(sys.executable).parent
TIMEOUT_S = 10  # parallel.timeout_s: heartbeats every 1.25 s, stale after 3.75 s, a step's deadline 13.75 s
INTERVAL = beat_interval(TIMEOUT_S)
STALE = MARGIN = STALE_BEATS * INTERVAL
SLACK_S = 4  # 2 shared cores: a process scheduled late, a read of the store that waits its turn
ARGS = ["--config", "demo", "model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32", "data.num_workers=0",
        "train.micro_batch=2", "train.global_batch=4", "optim.lr=1e-3", "logging.every=1", "logging.tensorboard=false",
        "validation.every=0", "validation.steps=1", "checkpoint.every=3", f"parallel.timeout_s={TIMEOUT_S}"]
LOST = re.compile(r"^error: lost contact with rank 1 on host (\S+) \(last heartbeat (\d+) s ago\) (?:at|after) step "
                  r"(\d+); the newest complete checkpoint is (\S+) — relaunch with --resume auto to continue from it$",
                  re.MULTILINE)


def env() -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """16 random latents (images and 2-frame clips) with 3 text tokens of width 16."""
    from dit_prepare.cli import mock

    root = tmp_path_factory.mktemp("lost-peer") / "data"
    mock(out=root, num=16, latent_shape="4,1,8,8", video_latent_shape="4,2,4,4", video_ratio=0.5, text_len=3,
         text_dim=16, seed=0, shard_size=1000, overwrite=False, keep_partial=False, val_samples=0)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps_logged(run: Path) -> int:
    try:
        return sum(1 for f in run.glob("csv/*/metrics.csv") for _ in csv.DictReader(f.open()))
    except (OSError, ValueError, TypeError):  # a row half-written as it is read
        return 0


@dataclass
class Lost:
    seconds: float  # from the signal to rank 1 until rank 0 (the survivor) exited
    exit_code: int  # rank 0's, as torchrun reports it
    err: dict[int, str]  # each worker's stdout + stderr
    agent: str  # torchrun's own output (its ChildFailedError summary: a launcher's traceback, no rank's)


def lose_rank_1(data: Path, run: Path, logs: Path, sig: int, then_term: bool = False) -> Lost:
    """2 workers under torchrun (their output in files of their own); after 4 logged steps (a checkpoint at step 3)
    `sig` goes to rank 1 — and with `then_term`, SIGTERM to rank 0 a second later —; timed until rank 0 exits."""
    import psutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "--redirects=3", f"--log-dir={logs}", str(BIN / "dit-train"), *ARGS, f"data.path={data}",
           f"train.run_dir={run}", "train.steps=100000"]
    agent_log = logs.with_suffix(".agent")
    with agent_log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(), start_new_session=True)
    workers = {}
    try:
        deadline = time.monotonic() + 180
        while steps_logged(run) < 4:
            assert proc.poll() is None, agent_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no 4 steps within 180 s"
            time.sleep(0.05)
        workers = {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children()}
        started = time.monotonic()
        workers[1].send_signal(sig)
        if then_term:
            time.sleep(1)
            workers[0].send_signal(signal.SIGTERM)
        while workers[0].is_running() and workers[0].status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() - started < TIMEOUT_S + MARGIN + 60, "rank 0 did not exit"
            time.sleep(0.02)
        seconds = time.monotonic() - started
        with contextlib.suppress(psutil.NoSuchProcess):  # the killed one may be reaped already
            workers[1].send_signal(signal.SIGKILL)  # the stopped one
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    agent = agent_log.read_text()
    code = re.search(r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: (-?\d+)", agent)
    err = {rank: "".join(f.read_text(errors="replace") for f in sorted(logs.glob(f"*/attempt_0/{rank}/*.log")))
           for rank in (0, 1)}
    print(f"{signal.Signals(sig).name}{' + SIGTERM' if then_term else ''}: rank 0 exited {seconds:.2f} s after it")
    return Lost(seconds, int(code.group(1)) if code else None, err, agent)


def assert_one_line(lost: Lost, run: Path) -> tuple[re.Match, Path]:
    """Exactly one line, from rank 0, naming rank 1, this host and the newest complete checkpoint; exit code 75; no
    traceback from either rank."""
    everything = "\n".join([*lost.err.values(), lost.agent])
    assert everything.count("error: lost contact with ") == 1, everything[-3000:]
    match = LOST.search(lost.err[0])
    assert match, lost.err[0][-3000:]
    assert match.group(1) == socket.gethostname()
    ckpt = Path(match.group(4))
    assert ckpt == runs.newest(run) and runs.is_complete(ckpt)  # the step being saved, if any, stayed .tmp-step-*
    assert lost.exit_code == EXIT_LOST, lost.agent[-3000:]
    for rank in (0, 1):
        assert "Traceback" not in lost.err[rank], lost.err[rank][-3000:]
    return match, ckpt


def test_a_killed_peer_ends_the_survivor_in_one_line_and_the_run_resumes(data, tmp_path):
    run = tmp_path / "run"
    lost = lose_rank_1(data, run, tmp_path / "logs", signal.SIGKILL)
    # gloo raises at once (the peer's sockets closed); the peer's heartbeat is stale STALE later; one more read
    assert lost.seconds <= STALE + 2 * INTERVAL + SLACK_S < TIMEOUT_S + MARGIN
    match, ckpt = assert_one_line(lost, run)
    assert STALE <= int(match.group(2)) <= STALE + 2 * INTERVAL + SLACK_S
    step = runs.step_of(ckpt)
    resumed = subprocess.run([str(BIN / "dit-train"), *ARGS, f"data.path={data}", f"train.run_dir={run}",
                              f"train.steps={step + 2}", "--resume", "auto"], capture_output=True, text=True,
                             timeout=300, env=env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt} at step {step}" in resumed.stdout + resumed.stderr
    assert f"done: {step + 2} steps" in resumed.stdout
    assert runs.step_of(runs.newest(run)) == step + 2


# the signal's path without dit-train: test_watchdog's test_a_stop_signal_while_a_peer_is_stale_ends_the_first_step_too
@pytest.mark.parametrize("then_term", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["frozen", "frozen-then-sigterm"])
def test_a_frozen_peer_ends_the_survivor_in_one_line_within_the_timeout(data, tmp_path, then_term):
    """SIGSTOP: the peer's sockets stay open, so the survivor's collective raises only at parallel.timeout_s. With a
    SIGTERM to the survivor a second later (srun ending the job step): the stop checkpoint, whose collectives could
    not finish, is not attempted; the survivor exits as soon as the peer's heartbeat is stale."""
    run = tmp_path / "run"
    lost = lose_rank_1(data, run, tmp_path / "logs", signal.SIGSTOP, then_term)
    if then_term:
        assert STALE <= lost.seconds <= min(STALE + 2 * INTERVAL + SLACK_S, TIMEOUT_S)
    else:  # the collective started up to a step before the stop; then one read of the heartbeats
        assert TIMEOUT_S - 1 <= lost.seconds <= TIMEOUT_S + MARGIN + SLACK_S
    assert_one_line(lost, run)
    assert "stopped by signal" not in lost.err[0]  # no stop checkpoint
