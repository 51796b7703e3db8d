"""A lost peer ends a run in one line, within a bound (ditcore.parallel.watchdog): the verdict on a table of
heartbeats and its line; the watchdog itself against a real TCPStore, its peer played by the test (a step deadline, a
stop signal, a store that dies); and every process group's collective timeout against a frozen peer (2 gloo
processes). dit-train's whole runs with a peer killed or stopped: tests/apps/test_train_lost_peer.py."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ditcore.parallel.watchdog import (
    EXIT_LOST,
    LINE,
    Beat,
    Watchdog,
    beat_interval,
    is_distributed,
    judge,
    lost_line,
    spans,
)

CKPT = Path("RUN/checkpoints/step-0000030")
TAIL = f"the newest complete checkpoint is {CKPT} — relaunch with --resume auto to continue from it"
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:39309: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error.")


def two_nodes(**times: float) -> dict[int, Beat]:
    """Ranks 0-1 on node1 (the store's host), 2-3 on node2, 4-5 on node3; heartbeats written at `times` (r0=...), else
    at 199.5. The table is read at wall time 200."""
    hosts = ["node1", "node1", "node2", "node2", "node3", "node3"]
    return {r: Beat(times.get(f"r{r}", 199.5), h, 100 + r, store_host=h == "node1") for r, h in enumerate(hosts)}


def test_heartbeat_interval_is_an_eighth_of_the_timeout_within_half_a_second_and_five():
    assert [beat_interval(s) for s in (600, 40, 10, 2, 0.1)] == [5.0, 5.0, 1.25, 0.5, 0.5]


def test_one_lost_rank_is_the_contract_line_and_the_lowest_fresh_rank_says_it():
    beats = two_nodes(r2=186.0)  # rank 2 last heard of 14 s before the read; stale after 3 x 1.25 s
    v = judge(me=3, known=beats, read=beats, now=200.0, stale=3.75)
    assert v.lost == {2: 14.0} and v.reporter == 0
    assert lost_line(v, "at step 37", CKPT) == ("error: lost contact with rank 2 on host node2 (last heartbeat 14 s "
                                                f"ago) at step 37; {TAIL}")


def test_ranks_are_grouped_by_host_plural_and_in_runs():
    beats = two_nodes(r0=180.0, r2=186.0, r3=190.1, r5=188.0)  # rank 4 fresh: node3 is up, its rank 5 is not
    v = judge(me=4, known=beats, read=beats, now=200.0, stale=3.75)
    assert list(v.lost) == [0, 2, 3, 5] and v.reporter == 1  # the lowest fresh rank, not rank 0
    assert lost_line(v, "at step 37", CKPT) == (
        "error: lost contact with rank 0 on host node1 (last heartbeat 20 s ago); ranks 2-3 on host node2 (last "
        f"heartbeat 10 s ago); rank 5 on host node3 (last heartbeat 12 s ago) at step 37; {TAIL}")
    assert LINE == "error: lost contact with "  # what infra/slurm/train.sbatch looks for
    assert spans([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"


def test_a_rank_that_finished_is_not_lost_and_this_rank_is_never_stale_to_itself():
    beats = two_nodes(r0=100.0, r3=100.0)
    beats[0] = Beat(100.0, "node1", 100, True, done=True)  # it closed its watchdog: its heartbeat ages, it is not lost
    v = judge(me=3, known=beats, read=beats, now=200.0, stale=3.75)  # rank 3 is this rank: its own thread lagged
    assert v.lost == {} and v.reporter == 1
    assert lost_line(v, "at step 5", None, cause="a collective failed (Timed out)") == (
        "error: a collective failed (Timed out) at step 5, yet every rank's heartbeat is fresh; no checkpoint is "
        "complete yet — relaunch with --resume auto to start the run again")


def test_a_store_that_stopped_answering_is_its_host_lost_with_every_rank_on_it():
    beats = two_nodes()
    v = judge(me=3, known=beats, read=None, now=200.0, stale=3.75, store="node1:29500")
    assert v.lost == {0: None, 1: None} and v.reporter == 2  # the lowest rank off the store's host
    assert lost_line(v, "at step 37", CKPT) == (
        "error: lost contact with ranks 0-1 on host node1 (the rendezvous store at node1:29500 stopped answering) at "
        f"step 37; {TAIL}")
    # seen from the store's own host, which is up: the process that held it (rank 0's, without torchrun's agent) went
    v = judge(me=1, known=beats, read=None, now=200.0, stale=3.75, holder=0, store="node1:29500")
    assert v.lost == {0: None} and v.reporter == 1
    v = judge(me=1, known=beats, read=None, now=200.0, stale=3.75, holder=None, store="node1:29500")  # the agent's
    assert v.lost == {} and lost_line(v, "after step 30", CKPT) == (
        "error: a collective failed after step 30, and the rendezvous store at node1:29500 stopped answering; "
        f"{TAIL}")


def test_distributed_errors_are_told_from_others_through_causes_and_checkpoint_failures():
    assert is_distributed(RuntimeError(GLOO_RESET))
    assert is_distributed(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                       "waiting 10000ms for recv operation to complete"))
    assert is_distributed(dist.DistNetworkError("Connection reset by peer"))
    assert is_distributed(dist.DistBackendError("NCCL communicator was aborted on rank 0"))
    assert not is_distributed(RuntimeError("CUDA out of memory"))
    assert not is_distributed(ValueError("train.global_batch=5"))
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as inner:
            raise ValueError("could not gather the loader states") from inner
    except ValueError as outer:
        assert is_distributed(outer)
    assert is_distributed(CheckpointException("save", {1: (RuntimeError(GLOO_RESET), None)}))
    assert not is_distributed(CheckpointException("save", {1: (OSError(28, "No space left on device"), None)}))


# ------------------------------------------------------------------------------------------- the watchdog itself

TIMEOUT_S = 2.0  # heartbeats every 0.5 s, stale after 1.5 s; a step's deadline 2 + 1.5 s


@pytest.fixture
def store(monkeypatch):
    """A rendezvous store in this process (its server stops when the object goes), as MASTER_ADDR:MASTER_PORT."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # rank 0's process holds it
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return {"master": master}


class Peer:
    """The other rank's heartbeat, every 0.1 s from a thread, until `stop()` (it died, or froze)."""

    def __init__(self, rank: int, port: int, host: str = "node2", store_host: bool = False):
        self.client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        self.key, self.host, self.store_host = f"ditcore/watchdog/0/heartbeat/{rank}", host, store_host
        self.stopped = threading.Event()
        self.beat()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def beat(self):
        self.client.set(self.key, Beat(time.time(), self.host, 4242, self.store_host).encode())
        self.last = time.monotonic()

    def run(self):
        while not self.stopped.wait(0.1):
            self.beat()

    def stop(self):
        self.stopped.set()
        self.thread.join()


def watch(rank: int = 0) -> tuple[Watchdog, list]:
    exits = []
    dog = Watchdog(TIMEOUT_S, newest=lambda: CKPT, rank=rank, world_size=2,
                   exit=lambda code: exits.append((code, time.monotonic())))
    return dog.start(), exits


def lines_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


def test_a_step_past_its_deadline_with_a_frozen_peer_ends_in_the_line(store, capfd):
    peer = Peer(1, store["master"].port)
    dog, exits = watch()
    dog.stepping(1)
    dog.stepped(1)  # the process's first step: no deadline
    dog.stepping(2)
    started = time.monotonic()
    peer.stop()  # frozen: no heartbeat from here on, no collective error either
    dog.threads[1].join(timeout=30)
    assert [code for code, _ in exits] == [EXIT_LOST]
    seconds = exits[0][1] - started
    deadline = TIMEOUT_S + dog.margin  # 3.5 s; then a read of the heartbeats (it is stale by then)
    assert deadline <= seconds <= deadline + dog.interval + 1.0, seconds
    [line] = lines_of(capfd.readouterr().err)
    heard = int(re.search(r"last heartbeat (\d+) s ago", line).group(1))
    assert abs(heard - (exits[0][1] - peer.last)) <= 1
    assert line == f"error: lost contact with rank 1 on host node2 (last heartbeat {heard} s ago) at step 2; {TAIL}"


def test_a_step_past_its_deadline_with_every_peer_answering_says_so(store, capfd):
    peer = Peer(1, store["master"].port)
    dog, exits = watch()
    dog.stepped(0)
    dog.stepping(1)
    started = time.monotonic()
    dog.threads[1].join(timeout=30)
    peer.stop()
    seconds = exits[0][1] - started  # the deadline, then a full stale period + an interval without a stale heartbeat
    assert TIMEOUT_S + 2 * dog.stale + dog.interval <= seconds <= TIMEOUT_S + 2 * dog.stale + 2 * dog.interval + 1.0
    assert lines_of(capfd.readouterr().err) == [
        "error: no training step completed in 4 s (the collective timeout 2 s + 1.5 s) at step 1, yet every rank's "
        f"heartbeat is fresh; {TAIL}"]


def test_a_stop_signal_while_a_peer_is_stale_ends_the_first_step_too(store, capfd):
    """srun ending the job step after a node died: the signal finds this rank blocked on the peer (the first step has
    no deadline); it exits once the peer's heartbeat is stale, instead of the stop checkpoint that could not work."""
    peer = Peer(1, store["master"].port)
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))  # as Preempted's
    try:
        dog, exits = watch()
        dog.stepping(1)
        peer.stop()
        signal.raise_signal(signal.SIGUSR1)
        started = time.monotonic()
        dog.threads[1].join(timeout=30)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [signal.SIGUSR1] and [code for code, _ in exits] == [EXIT_LOST]
    assert exits[0][1] - peer.last <= dog.stale + 2 * dog.interval + 1.0  # stale, then seen at the next read
    assert exits[0][1] - started < TIMEOUT_S  # well before any deadline or collective timeout
    assert [line.split(" (")[0] for line in lines_of(capfd.readouterr().err)] == [
        "error: lost contact with rank 1 on host node2"]


def test_a_store_that_dies_is_its_host_lost_and_the_survivor_off_it_says_so(store, capfd):
    """Rank 0, on node1, holds the store; this process is rank 1 on another host. The store's process ends: a
    collective error reaches the loop, and the line names node1's rank, found from the first heartbeats alone."""
    peer = Peer(0, store["master"].port, host="node1", store_host=True)
    dog, exits = watch(rank=1)
    dog.known[1] = Beat(dog.known[1].time, "node2", dog.known[1].pid, store_host=False)  # as seen from node2
    dog.stepped(3)
    dog.stepping(4)
    peer.stop()
    del store["master"], peer  # the server goes with its last reference
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection reset"):  # the test's exit returned: lost() raises it again
        dog.lost(RuntimeError(GLOO_RESET))
    assert [code for code, _ in exits] == [EXIT_LOST] and exits[0][1] - started <= dog.stale + 1.0
    port = dog.store_name.split(":")[1]
    assert lines_of(capfd.readouterr().err) == [
        f"error: lost contact with rank 0 on host node1 (the rendezvous store at 127.0.0.1:{port} stopped answering) "
        f"at step 4; {TAIL}"]


def test_a_survivor_that_trips_after_the_line_was_said_stays_silent(store, capfd):
    """Rank 0 said the line and exited; rank 2, whose collective fails only later, finds ranks 0 and 1 stale and
    itself the lowest fresh rank: the store's claim on the line keeps it silent."""
    peers = [Peer(r, store["master"].port) for r in (0, 1)]
    exits = []
    dog = Watchdog(TIMEOUT_S, newest=lambda: CKPT, rank=2, world_size=3, exit=exits.append).start()
    for peer in peers:
        peer.stop()
    peers[0].client.add("ditcore/watchdog/0/line", 1)  # rank 0's claim, before its exit
    with pytest.raises(RuntimeError):
        dog.lost(RuntimeError(GLOO_RESET))
    assert exits == [EXIT_LOST] and dog.claimed == 2
    assert lines_of(capfd.readouterr().err) == []


def test_one_process_has_no_watchdog_and_other_errors_pass_through():
    dog = Watchdog(TIMEOUT_S, newest=lambda: None, rank=0, world_size=1).start()
    dog.stepping(1)
    dog.lost(RuntimeError(GLOO_RESET))  # nothing to judge: returns, the caller raises it
    dog.close()
    assert not dog.enabled and not hasattr(dog, "threads")


def test_a_normal_end_leaves_a_heartbeat_that_never_counts_as_lost(store):
    peer = Peer(1, store["master"].port)
    dog, exits = watch()
    dog.stepped(1)
    dog.close()
    peer.stop()
    beat = Beat.decode(dist.TCPStore("127.0.0.1", store["master"].port, is_master=False,
                                     wait_for_workers=False).get("ditcore/watchdog/0/heartbeat/0"))
    assert beat.done and beat.host == socket.gethostname() and exits == []
    assert judge(1, {0: beat}, {0: beat}, now=beat.time + 1000, stale=1.5).lost == {}


# ------------------------------------------------------------------------------------------- collective timeouts

def test_every_process_group_gives_up_on_a_frozen_peer_within_its_timeout(run_torchrun, tmp_path):
    """Fabric's default group (MegatronStrategy's timeout), Megatron-Core's DP×CP, expert and gloo data-parallel
    groups, and an HSDP mesh's replicate group: an all-reduce that a frozen peer never joins raises after the timeout,
    not torch's 30 minutes."""
    seconds = 2.0
    proc = run_torchrun("timeout_worker.py", str(seconds), str(tmp_path / "raised.json"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised = json.loads((tmp_path / "raised.json").read_text())
    assert set(raised) == {"default", "dp_cp", "ep", "dp_gloo", "hsdp_replicate"}
    for name, (after, message) in raised.items():
        # gloo's wait counts from the collective's start; 1.5 s: the other four were started in between, on 2 cores
        assert seconds <= after <= seconds + 1.5, (name, after)
        assert "Timed out waiting 2000ms" in message, (name, message)
