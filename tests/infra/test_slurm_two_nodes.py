"""infra/slurm/ on two nodes (conftest.py: each node a network namespace with its own address, host name, slurmd),
as a user submits it: `sbatch --nodes=2 infra/slurm/train.sbatch mock ...` with NPROC_PER_NODE=2 (4 gloo ranks).

- HSDP sharded within a node and replicated across the two, and TP=2 within a node x DP=2 across: each job meets in
  a rendezvous across the hosts, is preempted (SIGUSR1), checkpoints, requeues, both nodes resume, and the run ends
  at its last step with the same loss at every step and the same weights as one node's 4-rank run of the layout;
- one node's processes SIGKILLed mid-step: the survivors stop within parallel.timeout_s plus a margin with one line
  naming the lost host, the newest complete checkpoint intact; the job requeues itself and resumes from it;
- a rendezvous that cannot complete (a node that never starts its torchrun, the first node's port taken) fails
  within a bounded time with one line naming the cause;
- prepare.sbatch on two nodes writes one dataset with both nodes' shards."""

import csv
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ditcore import runs

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS = 60
TIMEOUT_S = 10  # parallel.timeout_s of the jobs that lose a node
MARGIN_S = 20  # what the survivors may take beyond it: the watchdog's poll and margin, torchrun's and srun's exits


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    out = tmp_path_factory.mktemp("two-nodes") / "mock"
    subprocess.run([str(BIN / "dit-prepare"), "mock", "--out", str(out), "--num", "64", "--latent-shape", "16,1,8,8",
                    "--video-ratio", "0", "--text-len", "8", "--text-dim", "32"], check=True, capture_output=True)
    return out


LAYOUTS = {  # name: (overrides, global batch): 4 ranks, micro-batch 2, one micro-batch a step on every DP rank
    "hsdp": (["parallel.fsdp=true", "parallel.fsdp_shard=2"], 8),  # shards within a node, replicas across nodes
    "tp2xdp2": (["parallel.tp=2"], 4),  # TP groups (0, 1) and (2, 3): within a node; DP across
}


def overrides(data: Path, run_dir: Path, layout: str, *extra, every: int = 1000) -> list[str]:
    layout_args, global_batch = LAYOUTS[layout]
    return ["model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32", "data.num_workers=0",
            f"data.path={data}", f"train.run_dir={run_dir}", f"train.steps={STEPS}",
            f"train.global_batch={global_batch}", "train.micro_batch=2", f"checkpoint.every={every}",
            "logging.every=1", "logging.tensorboard=false", *layout_args, *extra]


def one_node_run(data: Path, run_dir: Path, layout: str) -> Path:
    """The same layout and steps as 4 processes of one machine (torchrun --standalone), for reference."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=4", "--no-python", "--", str(BIN / "dit-train"),
           "--config", "mock", *overrides(data, run_dir, layout)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def text(log: Path) -> str:
    return log.read_text(errors="replace").replace("\r", "\n")


def metrics_rows(run_dir: Path) -> int:
    return sum(max(0, len(p.read_text().splitlines()) - 1) for p in run_dir.glob("csv/run-*/metrics.csv"))


def submit(cluster, env, log: Path, script: str, *args, nodes=2) -> str:
    return cluster.run("sbatch", "--parsable", f"--nodes={nodes}", f"--output={log}", REPO / "infra/slurm" / script,
                       *args, cwd=REPO, env=env).stdout.strip()


def assert_same_run(run_dir: Path, reference: Path, report: str):
    """Every step's loss and the final weights (model, EMA, AdamW state) equal the reference run's. The same layout
    does the same floating-point operations in the same order on one node or two (gloo's reductions follow the
    ranks, not the hosts), so equal means bit for bit."""
    mine, ref = runs.step_dir(run_dir, STEPS), runs.step_dir(reference, STEPS)
    assert runs.read_values(mine)["history"] == runs.read_values(ref)["history"], report
    for part in (runs.MODEL, runs.EMA, runs.OPTIM):
        a, b = runs.read_full(mine, part), runs.read_full(ref, part)
        assert a.keys() == b.keys(), part
        for k in a:
            assert torch.equal(a[k], b[k]), f"{part}.{k} differs from the one-node run\n{report}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_nodes_are_preempted_requeued_and_end_as_one_node_would(cluster, job_env, mock, tmp_path, layout):
    run_dir, log = tmp_path / "run", tmp_path / "train.out"
    env = job_env | {"NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    job = submit(cluster, env, log, "train.sbatch", "mock", *overrides(mock, run_dir, layout))
    cluster.wait_for("the first training steps", lambda: metrics_rows(run_dir) >= 2, 180, log)
    cluster.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@120 does at the time limit
    state = cluster.wait(job, log)
    reference = one_node_run(mock, tmp_path / "one-node", layout)
    out, report = text(log), cluster.report(log)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", f"{state}\n{report}"

    # Both starts ran on both hosts: the rendezvous across them, 4 ranks.
    assert out.count("on 2 node(s): node1 node2") == 2, report
    for node in ("node1", "node2"):
        assert out.count(f"train.sbatch: node {node}: torchrun starts") == 2, report
    assert out.count("Starting with 4 processes") == 2 and f"requeueing job {job}" in out, report

    # One voice: rank 0 alone prints the run's lines, once a start (Fabric's print would speak on each node).
    stopped, final = runs.by_write_order(run_dir)  # the checkpoint of the preemption, the last step's
    stop_step = runs.step_of(stopped)
    assert out.count(f"stopped by signal at step {stop_step}") == 1 and out.count(f"done: {STEPS} steps") == 1, report
    assert out.count(f"resumed from {stopped}") == 1 and out.count("data      64 samples") == 2, report
    assert runs.trajectory(run_dir, final) == [final, stopped] and runs.step_of(final) == STEPS
    for ckpt in (stopped, final):  # one manifest, written by rank 0, measures the files of all 4 ranks on both hosts
        manifest = runs.read_manifest(ckpt)
        assert {runs.rng_file(r) for r in range(4)} <= set(manifest["files"]), manifest["files"]
        assert [runs.verify(ckpt, name, manifest) for name in manifest["files"]] == [None] * len(manifest["files"])

    # The loss curve is continuous across the requeue (one row a step, no step twice) and the run equals one node's.
    steps = [int(row["step"]) for p in sorted(run_dir.glob("csv/run-*/metrics.csv"))
             for row in csv.DictReader(p.open())]
    assert steps == list(range(1, STEPS + 1)), steps
    assert_same_run(run_dir, reference, report)


def job_processes(cluster, node: str) -> list[int]:
    """The PIDs of the job's torchrun and dit-train processes on NODE."""
    return [pid for pid, cmd in cluster.processes(node).items() if "torchrun" in cmd or "dit-train" in cmd]


def test_a_lost_node_stops_the_survivors_in_time_and_the_job_resumes_from_its_checkpoint(cluster, job_env, mock,
                                                                                         tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.out"
    env = job_env | {"NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    args = overrides(mock, run_dir, "hsdp", f"parallel.timeout_s={TIMEOUT_S}", every=10)
    job = submit(cluster, env, log, "train.sbatch", "mock", *args)
    cluster.wait_for("a checkpoint and more steps", lambda: runs.by_write_order(run_dir) and metrics_rows(run_dir)
                     >= 13, 180, log)
    victims = job_processes(cluster, "node2")
    assert victims, cluster.report(log)
    for pid in victims:
        os.kill(pid, 9)
    killed = time.monotonic()
    cluster.wait_for("the step's end", lambda: "the training step exited with status" in text(log), 120, log)
    took = time.monotonic() - killed
    newest = runs.by_write_order(run_dir)[-1]
    state = cluster.wait(job, log)
    out, report = text(log), cluster.report(log)
    assert took < TIMEOUT_S + MARGIN_S, f"the survivors took {took:.1f} s\n{report}"
    lines = [line for line in out.splitlines() if line.startswith("error: lost contact with ")]
    assert len(lines) == 1 and "node2" in lines[0], report
    # No rank's traceback nor gloo's messages: only torchrun's own (srun ends node1's torchrun with SIGTERM).
    failed = out.split("the training step exited with status")[0]
    assert "[rank" not in failed and "gloo/transport" not in failed and "RuntimeError" not in failed, report
    print(f"survivors gone {took:.1f} s after the kill")
    assert "a node was lost: lost contact with " in out and f"requeueing job {job}" in out, report
    # The requeued job resumed from the newest complete checkpoint of the first and ended the run.
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", f"{state}\n{report}"
    assert f"resumed from {newest}" in out and f"done: {STEPS} steps" in out, report
    assert runs.step_of(runs.by_write_order(run_dir)[-1]) == STEPS


def test_a_node_that_never_starts_fails_the_rendezvous_in_bounded_time_naming_it(cluster, job_env, mock, tmp_path):
    """node2 hangs in its node setup (a stuck mount, a container that never pulls): the job ends within
    RDZV_TIMEOUT plus a margin, with one line that names node2."""
    hang = tmp_path / "node-setup.sh"
    hang.write_text('if [[ "$SLURMD_NODENAME" == node2 ]]; then sleep 600; fi\n')
    log = tmp_path / "train.out"
    env = job_env | {"NPROC_PER_NODE": "1", "RDZV_TIMEOUT": "15", "NODE_SETUP_SCRIPT": str(hang)}
    start = time.monotonic()
    job = submit(cluster, env, log, "train.sbatch", "mock", *overrides(mock, tmp_path / "run", "hsdp"))
    state = cluster.wait(job, log, timeout=120)
    took, out, report = time.monotonic() - start, text(log), cluster.report(log)
    assert state["JobState"] == "FAILED" and took < 15 + 45, f"{state} after {took:.0f} s\n{report}"
    lines = [line for line in out.splitlines() if "did not join" in line]
    assert len(lines) == 1 and lines[0].split(" s: ")[1].startswith("node2 did not join"), report


def test_a_taken_rendezvous_port_fails_in_bounded_time_saying_so(cluster, job_env, mock, tmp_path):
    port = 29000 + os.getpid() % 1000
    squatter = subprocess.Popen([*cluster.net.enter(cluster.net.ns("node1")), sys.executable, "-c",
                                 f"import socket, time\ns = socket.socket()\ns.bind(('0.0.0.0', {port}))\n"
                                 "s.listen()\nprint('listening', flush=True)\ntime.sleep(600)"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "listening"
        log = tmp_path / "train.out"
        env = job_env | {"NPROC_PER_NODE": "1", "RDZV_TIMEOUT": "15", "RDZV_PORT": str(port)}
        start = time.monotonic()
        job = submit(cluster, env, log, "train.sbatch", "mock", *overrides(mock, tmp_path / "run", "hsdp"))
        state = cluster.wait(job, log, timeout=60)
    finally:
        squatter.kill()
        squatter.wait()
    took, out, report = time.monotonic() - start, text(log), cluster.report(log)
    assert state["JobState"] == "FAILED" and took < 30, f"{state} after {took:.0f} s\n{report}"
    lines = [line for line in out.splitlines() if "taken" in line]
    assert lines == [f"train.sbatch: the rendezvous port {port} on node1 is taken by another program: set RDZV_PORT "
                     "to a free port"], report


def test_prepare_sbatch_on_two_nodes_writes_one_dataset_with_both_nodes_shards(cluster, job_env, tmp_path):
    out, log = tmp_path / "synthetic", tmp_path / "prepare.out"
    job = submit(cluster, job_env | {"NPROC_PER_NODE": "1"}, log, "prepare.sbatch", "synthetic", "--out", out,
                 "--num", 24, "--size", 32, "--frames", 4, "--fit-samples", 24, "--shard-size", 10)
    state = cluster.wait(job, log)
    report = cluster.report(log)
    assert state["JobState"] == "COMPLETED" and (out / "ditcore.json").exists(), f"{state}\n{report}"
    shards = sorted(p.name for p in out.glob("*.tar"))
    assert {name.split("-")[0] for name in shards} == {"rank0", "rank1"}, shards
    assert json.loads((out / "ditcore.json").read_text())["counts"]["samples"] == 24
    summary = [line for line in text(log).splitlines() if line.startswith("samples ")]
    assert len(summary) == 1 and summary[0].split()[1] == "24", report  # one summary, of both nodes' samples


def test_the_nodes_reach_each_other_and_nothing_else(cluster):
    """The cluster's traffic stays on its bridge: a node's only route is the bridge's subnet (no default route), it
    reaches the other node's slurmd, and an address outside is unreachable at once."""
    subnet = cluster.net.subnet
    routes = cluster.run("ip", "-4", "route", node="node1").stdout.split("\n")
    assert [r.split()[:3] for r in routes if r] == [[f"{subnet}.0/24", "dev", "dcnet0"]], routes
    probe = ("import socket, sys\nwith socket.socket() as s:\n    s.settimeout(5)\n"
             "    print(s.connect_ex((sys.argv[1], 6818)))")  # 6818: slurmd's port on every node
    assert cluster.run(sys.executable, "-c", probe, cluster.net.addr("node2"), node="node1").stdout.strip() == "0"
    unreachable = cluster.run(sys.executable, "-c", probe, "198.51.100.1", node="node1").stdout.strip()
    assert unreachable == str(errno.ENETUNREACH), unreachable
