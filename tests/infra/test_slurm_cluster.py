"""infra/slurm/ as a real cluster runs it: a one-node Slurm cluster on localhost (Debian's slurm-wlm and munge), with
its own slurm.conf, munge key and socket, state and spool folders and ports under the test's tmp folder, run as the
current user. prepare.sbatch writes a mock dataset; train.sbatch trains on it through srun -> torchrun with 2
processes (CPU, gloo) on a cluster without GPUs, is preempted with SIGUSR1 as at its time limit, checkpoints,
requeues itself and resumes to the last step. The daemons are stopped by their PIDs; their logs stay in the tmp
folder and their tails are printed when a check fails.

`make test-slurm` runs this file (marked slurm: not part of `make test`). Without slurmctld it is skipped, except
in CI (CI=true), where a missing Slurm is a failure."""

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ditcore import runs

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SBIN = [os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]  # slurmctld, slurmd and munged live in sbin
STEPS = 100  # 0.1-0.25 s a step on 2 cores: the first job is still training when SIGUSR1 comes, 2 steps in
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join(SBIN))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").replace("\r", "\n") if path.exists() else "(missing)\n"
    return f"--- {path.name} (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])


@dataclass
class Cluster:
    root: Path
    env: dict
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def start(self, name: str, *cmd):
        """A daemon in the foreground, its output in log/NAME.out (the child keeps the file open)."""
        with open(self.root / "log" / f"{name}.out", "w") as out:
            self.daemons.append(subprocess.Popen([which(name), *map(str, cmd)], stdout=out,
                                                 stderr=subprocess.STDOUT, env=self.env))

    def run(self, *cmd, check=True, env=None, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env or self.env, timeout=120,
                              **kw)
        assert not check or proc.returncode == 0, f"{' '.join(map(str, cmd))}: {proc.stderr}\n{self.report()}"
        return proc

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job_id: str, *logs: Path, timeout: float = 300) -> dict:
        """Wait until the job has ended (sbatch --wait polls only every few seconds); its final state."""
        wait_for(f"job {job_id} ended", lambda: self.job(job_id).get("JobState") in ENDED, timeout, self, *logs)
        return self.job(job_id)

    def report(self, *logs: Path) -> str:
        """The tails of the daemons' logs and of the given job logs, for a failed check."""
        return "\n".join(tail(p) for p in (*logs, *sorted((self.root / "log").iterdir())))


def missing_slurm() -> str | None:
    missing = [name for name in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel") if not which(name)]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): "
                "apt-get install slurm-wlm munge (.ci/run does)")
    return None


def node_line(slurmd: str) -> str:
    """This machine's hardware as slurmd sees it (CPUs, sockets, cores, threads), as node `localhost`. RealMemory is
    left at Slurm's default (1 MiB): --mem=0 asks for all of it, and no job here is refused for memory."""
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    hw = [kv for kv in out.split() if kv.split("=")[0] in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket",
                                                            "ThreadsPerCore")]
    return f"NodeName=localhost NodeHostname=localhost NodeAddr=127.0.0.1 {' '.join(hw)} State=UNKNOWN"


def wait_for(what: str, ready, timeout: float, cluster: Cluster | None = None, *logs: Path):
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{cluster.report(*logs) if cluster else ''}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = missing_slurm()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("log", "munge", "state", "spool"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "munge.socket"
    user = getpass.getuser()
    (root / "plugstack.conf").write_text("")  # no SPANK plugins (pyxis and the like) from /etc/slurm
    # cred_expire: a requeued job waits cred_expire + 1 s before it may start again (120 s by default);
    # sched_interval: how often pending jobs are looked at without an event (60 s by default).
    (root / "slurm.conf").write_text(f"""\
ClusterName=ditcoretest
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
{node_line(which("slurmd"))}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    # The job gets this environment (sbatch passes it on): no Slurm variables of an outer job, and this cluster's.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env |= {"SLURM_CONF": str(root / "slurm.conf"), "PYTHONWARNINGS": "ignore"}
    c = Cluster(root, env)
    log = root / "log"
    # In the foreground (-F, -D): the PIDs are the daemons', to stop them by. munged -f: /tmp is world-writable,
    # which munged would refuse for the key's and socket's folders.
    try:
        c.start("munged", "-F", "-f", f"--socket={sock}", f"--key-file={key}", f"--pid-file={root}/munge/pid",
                f"--seed-file={root}/munge/seed", f"--log-file={log}/munged.log")
        wait_for("munged's socket", sock.exists, 30, c)
        c.start("slurmctld", "-D", "-i")  # -i: no state from an earlier run (there is none)
        c.start("slurmd", "-D", "-N", "localhost")
        wait_for("node localhost idle", lambda: c.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
                 == "idle", 60, c)
        yield c
    finally:
        for proc in reversed(c.daemons):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(c.daemons):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def metrics_rows(run_dir: Path) -> int:
    return sum(max(0, len(p.read_text().splitlines()) - 1) for p in run_dir.glob("csv/run-*/metrics.csv"))


def test_train_sbatch_is_preempted_requeued_and_resumes_to_the_end(cluster, tmp_path):
    """prepare.sbatch, then train.sbatch with 2 CPU processes: SIGUSR1 to the batch script (as Slurm sends it
    before the time limit) -> checkpoint, requeue (same job id, restart 1), resume from that checkpoint, finish."""
    data, run_dir = tmp_path / "mock", tmp_path / "run"
    prep_log, train_log = tmp_path / "prepare.out", tmp_path / "train.out"
    # A cluster without GPUs, as the scripts' headers say: Slurm's own SBATCH_GPUS_PER_NODE=0 overrides the
    # #SBATCH --gpus-per-node=8 line, which sbatch would refuse here.
    cluster.env |= {"VENV": str(BIN.parent), "SBATCH_GPUS_PER_NODE": "0", "RDZV_PORT": str(free_port())}

    prep = cluster.run("sbatch", "--parsable", f"--output={prep_log}", REPO / "infra/slurm/prepare.sbatch", "mock",
                       "--out", data, "--num", 64, "--latent-shape", "16,1,8,8", "--video-ratio", 0,
                       "--text-len", 8, "--text-dim", 32, cwd=REPO).stdout.strip()
    state = cluster.wait(prep, prep_log)
    assert state["JobState"] == "COMPLETED" and (data / "ditcore.json").exists(), cluster.report(prep_log)

    overrides = ["model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32", "data.num_workers=0",
                 f"data.path={data}", f"train.run_dir={run_dir}", f"train.steps={STEPS}", "train.global_batch=4",
                 "train.micro_batch=2", "checkpoint.every=1000", "logging.every=1", "logging.tensorboard=false"]
    job = cluster.run("sbatch", "--parsable", f"--output={train_log}", REPO / "infra/slurm/train.sbatch", "mock",
                      *overrides, cwd=REPO, env=cluster.env | {"NPROC_PER_NODE": "2"}).stdout.strip()
    wait_for("the first training steps", lambda: metrics_rows(run_dir) >= 2, 180, cluster, train_log)
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
