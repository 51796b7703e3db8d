"""infra/slurm/ on one node of the test cluster (conftest.py: two nodes, each a network namespace): prepare.sbatch
writes a mock dataset; train.sbatch trains on it through srun -> torchrun with 2 processes (CPU, gloo) on a cluster
without GPUs, is preempted with SIGUSR1 as at its time limit, checkpoints, requeues itself and resumes to the last
step. The daemons' logs stay in the tmp folder and their tails are printed when a check fails.

`make test-slurm` runs the tests of this folder (marked slurm: not part of `make test`). Without slurmctld or
network namespaces they are skipped, except in CI (CI=true), where that is a failure."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ditcore import runs

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS = 100  # 0.1-0.25 s a step on 2 cores: the first job is still training when SIGUSR1 comes, 2 steps in


def metrics_rows(run_dir: Path) -> int:
    return sum(max(0, len(p.read_text().splitlines()) - 1) for p in run_dir.glob("csv/run-*/metrics.csv"))


def test_train_sbatch_is_preempted_requeued_and_resumes_to_the_end(cluster, job_env, tmp_path):
    """prepare.sbatch, then train.sbatch with 2 CPU processes: SIGUSR1 to the batch script (as Slurm sends it
    before the time limit) -> checkpoint, requeue (same job id, restart 1), resume from that checkpoint, finish."""
    data, run_dir = tmp_path / "mock", tmp_path / "run"
    prep_log, train_log = tmp_path / "prepare.out", tmp_path / "train.out"
    # A cluster without GPUs, as the scripts' headers say: Slurm's own SBATCH_GPUS_PER_NODE=0 overrides the
    # #SBATCH --gpus-per-node=8 line, which sbatch would refuse here.
    prep = cluster.run("sbatch", "--parsable", f"--output={prep_log}", REPO / "infra/slurm/prepare.sbatch", "mock",
                       "--out", data, "--num", 64, "--latent-shape", "16,1,8,8", "--video-ratio", 0,
                       "--text-len", 8, "--text-dim", 32, cwd=REPO, env=job_env).stdout.strip()
    state = cluster.wait(prep, prep_log)
    assert state["JobState"] == "COMPLETED" and (data / "ditcore.json").exists(), cluster.report(prep_log)

    overrides = ["model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32", "data.num_workers=0",
                 f"data.path={data}", f"train.run_dir={run_dir}", f"train.steps={STEPS}", "train.global_batch=4",
                 "train.micro_batch=2", "checkpoint.every=1000", "logging.every=1", "logging.tensorboard=false"]
    job = cluster.run("sbatch", "--parsable", f"--output={train_log}", REPO / "infra/slurm/train.sbatch", "mock",
                      *overrides, cwd=REPO, env=job_env | {"NPROC_PER_NODE": "2"}).stdout.strip()
    cluster.wait_for("the first training steps", lambda: metrics_rows(run_dir) >= 2, 180, train_log)
    cluster.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@120 does at the time limit
    state = cluster.wait(job, train_log)
    log = train_log.read_text(errors="replace").replace("\r", "\n")
    report = cluster.report(train_log)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", f"{state}\n{report}"

    # The job log, appended across the requeue: two starts, 2 processes with 0 GPUs each, the preemption.
    assert f"job {job} (restart 0)" in log and f"job {job} (restart 1)" in log, report
    assert log.count("2 process(es) and 0 GPU(s) per node, ") == 2, report
    assert "SIGUSR1: the time limit is near" in log and f"requeueing job {job}" in log, report
    assert log.count("Starting with 2 processes") == 2, report
    assert f"done: {STEPS} steps" in log, report

    # The run dir: the checkpoint written at the preemption, and the resumed run's final one continuing it.
    ckpts = runs.by_write_order(run_dir)
    assert [runs.step_of(p) for p in ckpts][-1] == STEPS and len(ckpts) == 2, f"{ckpts}\n{report}"
    stopped, final = ckpts
    stop_step = runs.step_of(stopped)
    assert 0 < stop_step < STEPS and f"stopped by signal at step {stop_step}" in log, report
    assert runs.trajectory(run_dir, final) == [final, stopped]
    mine, parent = runs.lineage(final), runs.lineage(stopped)
    assert mine["run"] == parent["run"] and mine["parent"]["name"] == stopped.name
    assert len(list(run_dir.glob("csv/run-*"))) == 2 and metrics_rows(run_dir) == STEPS
    assert (run_dir / "export").is_dir()


def test_selftest_passes_with_venv_set():
    """selftest.sh with VENV set, as its own message invites: a real environment's apps do not shadow its stubs."""
    proc = subprocess.run(["bash", str(REPO / "infra/slurm/selftest.sh")], capture_output=True, text=True,
                          env={**os.environ, "VENV": str(BIN.parent)}, timeout=300)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("0 failed"), proc.stdout + proc.stderr
