"""A two-node Slurm cluster on one machine, for `make test-slurm` (Debian's slurm-wlm and munge, run as root).

Each node is a network namespace of its own (`ip netns`) joined to a bridge by a veth pair, with its own address,
host name (a UTS namespace) and /etc/hosts (a mount namespace, a file in the test's folder bound over it), its own
slurmd with its own spool folder, log and pid file. The controller namespace holds the bridge, slurmctld and munged
(one key and socket, in the test's folder: the nodes share the file system, as a cluster shares its NFS home).
Nothing routes out of these namespaces: they have no default route, only the bridge and their loopback. The test's
own commands (sbatch, scontrol, ...) run in the controller's namespace.

    ctl   (bridge dc…br, 10.R.S.1)   slurmctld, munged, the test's sbatch/scontrol
    node1 (dcnet0, 10.R.S.11)        slurmd -N node1 → batch scripts, srun tasks, torchrun, dit-train
    node2 (dcnet0, 10.R.S.12)        slurmd -N node2

At the end every process in the namespaces is killed and the namespaces deleted: `ip netns list` and the process
table are as before (a test asserts it). Where namespaces cannot be made (no root, no `ip`), the tests are skipped
with the reason; where CI=true, that is a failure."""

import contextlib
import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SBIN = [os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]  # slurmctld, slurmd, munged and ip live in sbin
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
NODES = ("node1", "node2")
IFNAME = "dcnet0"  # each node's interface on the bridge (one name in every node: GLOO_SOCKET_IFNAME=dcnet0 works)


def which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join(SBIN))


def tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").replace("\r", "\n") if path.exists() else "(missing)\n"
    return f"--- {path.name} (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])


def wait_for(what: str, ready, timeout: float, cluster=None, *logs: Path):
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{cluster.report(*logs) if cluster else ''}")
        time.sleep(0.2)


def sh(*cmd, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def netns_list() -> set[str]:
    return {line.split()[0] for line in sh(which("ip"), "netns", "list").stdout.splitlines() if line.strip()}


@dataclass
class Network:
    """The namespaces, bridge and veth pairs; `close` kills whatever runs in them and deletes them."""

    prefix: str
    subnet: str  # "10.R.S"
    made: list[str] = field(default_factory=list)

    @property
    def ctl(self) -> str:
        return f"{self.prefix}ctl"

    def ns(self, node: str) -> str:
        return f"{self.prefix}{node}"

    def addr(self, node: str) -> str:
        return f"{self.subnet}.1" if node == "ctl" else f"{self.subnet}.{10 + NODES.index(node) + 1}"

    @staticmethod
    def enter(ns: str) -> list[str]:
        """The prefix that runs a command in namespace NS. nsenter, not `ip netns exec`: that one mounts a sysfs of
        the namespace's own over /sys, without /sys/fs/cgroup, and slurmd will not start without it."""
        return [which("nsenter"), f"--net=/run/netns/{ns}"]

    def ip(self, ns: str, *args):
        sh(which("ip"), "-n", ns, *args)

    def build(self):
        ip, bridge = which("ip"), f"{self.prefix}br"
        for ns in (self.ctl, *map(self.ns, NODES)):
            sh(ip, "netns", "add", ns)
            self.made.append(ns)
            self.ip(ns, "link", "set", "lo", "up")
        self.ip(self.ctl, "link", "add", bridge, "type", "bridge")
        self.ip(self.ctl, "addr", "add", f"{self.addr('ctl')}/24", "dev", bridge)
        self.ip(self.ctl, "link", "set", bridge, "up")
        for i, node in enumerate(NODES, 1):
            outer = f"{self.prefix}v{i}"  # made in ctl, its peer made straight in the node's namespace
            self.ip(self.ctl, "link", "add", outer, "type", "veth", "peer", "name", IFNAME, "netns", self.ns(node))
            self.ip(self.ctl, "link", "set", outer, "master", bridge)
            self.ip(self.ctl, "link", "set", outer, "up")
            self.ip(self.ns(node), "addr", "add", f"{self.addr(node)}/24", "dev", IFNAME)
            self.ip(self.ns(node), "link", "set", IFNAME, "up")

    def pids(self, *names: str) -> list[int]:
        """The processes in the namespaces NAMES (default: all of the cluster's)."""
        out = []
        for ns in names or self.made:
            out += [int(p) for p in sh(which("ip"), "netns", "pids", ns, check=False).stdout.split()]
        return out

    def close(self):
        """SIGKILL every process left in the namespaces (daemons are stopped before, by SIGTERM), then delete them."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for ns in reversed(self.made):
            sh(which("ip"), "netns", "del", ns, check=False)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can), found by making one."""
    if not which("ip") or not which("unshare") or not which("nsenter"):
        return "the `ip`, `unshare` and `nsenter` commands are needed (apt-get install iproute2 util-linux)"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as {getpass.getuser()}, uid {os.geteuid()})"
    probe = f"dcprobe{os.getpid()}"
    made = sh(which("ip"), "netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    sh(which("ip"), "netns", "del", probe, check=False)
    return None


def missing_slurm() -> str | None:
    missing = [name for name in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel") if not which(name)]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): "
                "apt-get install slurm-wlm munge (.ci/run does)")
    return namespaces_unavailable()


def free_subnet() -> str:
    """A 10.R.S.0/24 that no route of this machine uses (the namespaces have their own routes; this keeps the
    addresses in the logs unambiguous)."""
    used = sh(which("ip"), "route").stdout
    while True:
        subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
        if f"{subnet}." not in used:
            return subnet


@dataclass
class Cluster:
    root: Path
    env: dict
    net: Network
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def start(self, name: str, *cmd, node: str = "ctl"):
        """A daemon in the foreground in NODE's namespaces, its output in log/NAME[-NODE].out."""
        if node == "ctl":
            wrap = self.net.enter(self.net.ctl)
        else:  # its own host name and /etc/hosts: a UTS and a mount namespace inside the node's network namespace
            script = f'hostname {node} && mount --bind {self.root}/hosts /etc/hosts && exec "$@"'
            wrap = [*self.net.enter(self.net.ns(node)), which("unshare"), "--uts", "--mount", "--propagation",
                    "private", "sh", "-c", script, node]
        with open(self.root / "log" / f"{name}{'' if node == 'ctl' else '-' + node}.out", "w") as out:
            self.daemons.append(subprocess.Popen([*wrap, which(name), *map(str, cmd)], stdout=out,
                                                 stderr=subprocess.STDOUT, env=self.env))

    def run(self, *cmd, check=True, env=None, node: str = "ctl", timeout=120, **kw) -> subprocess.CompletedProcess:
        """A command in the controller's namespace (sbatch, scontrol, ...), or in a node's network namespace."""
        ns = self.net.ctl if node == "ctl" else self.net.ns(node)
        proc = subprocess.run([*self.net.enter(ns), *map(str, cmd)], capture_output=True, text=True,
                              env=env or self.env, timeout=timeout, **kw)
        assert not check or proc.returncode == 0, f"{' '.join(map(str, cmd))}: {proc.stderr}\n{self.report()}"
        return proc

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job_id: str, *logs: Path, timeout: float = 300) -> dict:
        """Wait until the job has ended (sbatch --wait polls only every few seconds); its final state."""
        wait_for(f"job {job_id} ended", lambda: self.job(job_id).get("JobState") in ENDED, timeout, self, *logs)
        return self.job(job_id)

    def wait_for(self, what: str, ready, timeout: float, *logs: Path):
        """Poll `ready()` until true; a failure with the daemons' and the given logs' tails after `timeout` s."""
        wait_for(what, ready, timeout, self, *logs)

    def processes(self, node: str) -> dict[int, str]:
        """What runs on NODE: pid -> command line."""
        out = {}
        for pid in self.net.pids(self.net.ns(node)):
            with contextlib.suppress(OSError):
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        return out

    def idle(self) -> bool:
        return self.run("sinfo", "-h", "-o", "%t", check=False).stdout.split() == ["idle"]

    def report(self, *logs: Path) -> str:
        """The tails of the daemons' logs and of the given job logs, for a failed check."""
        return "\n".join(tail(p) for p in (*logs, *sorted((self.root / "log").iterdir())))


def slurm_conf(root: Path, net: Network, user: str) -> str:
    sock = root / "munge" / "munge.socket"
    cpus = sh(which("slurmd"), "-C").stdout.split("\n")[0].split()
    hw = " ".join(kv for kv in cpus if kv.split("=")[0] in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket",
                                                           "ThreadsPerCore"))
    # RealMemory is left at Slurm's default (1 MiB): --mem=0 asks for all of it, and no job is refused for memory.
    # Both nodes claim the machine's CPUs (they share them). cred_expire: a requeued job waits cred_expire + 1 s
    # before it may start again (120 s by default); sched_interval: how often pending jobs are looked at without an
    # event (60 s by default). SlurmdTimeout: a node whose slurmd stops answering is DOWN after this.
    nodes = "\n".join(f"NodeName={n} NodeHostname={n} NodeAddr={net.addr(n)} {hw} State=UNKNOWN" for n in NODES)
    return f"""\
ClusterName=ditcoretest
SlurmctldHost={socket.gethostname().split('.')[0]}({net.addr('ctl')})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
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
SlurmdTimeout=30
MinJobAge=600
KillWait=10
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def netns_processes() -> dict:
    """Processes whose network namespace is not this one's (pid -> command): what a leaked cluster leaves."""
    mine = os.readlink("/proc/self/ns/net")
    out = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(p / "ns/net") != mine:
                    out[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return out


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    reason = missing_slurm()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    before = (netns_list(), set(netns_processes()))
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("log", "munge", "state", "spool"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "munge.socket"
    net = Network(prefix=f"dc{os.getpid() % 100000}", subnet=free_subnet())
    (root / "plugstack.conf").write_text("")  # no SPANK plugins (pyxis and the like) from /etc/slurm
    (root / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{net.addr(n)} {n}\n" for n in ("ctl", *NODES)))
    (root / "slurm.conf").write_text(slurm_conf(root, net, getpass.getuser()))
    # The job gets this environment (sbatch passes it on): no Slurm variables of an outer job, and this cluster's.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env |= {"SLURM_CONF": str(root / "slurm.conf"), "PYTHONWARNINGS": "ignore"}
    c = Cluster(root, env, net)
    log = root / "log"
    try:
        net.build()
        # In the foreground (-F, -D): the PIDs are the daemons', to stop them by. munged -f: /tmp is world-writable,
        # which munged would refuse for the key's and socket's folders.
        c.start("munged", "-F", "-f", f"--socket={sock}", f"--key-file={key}", f"--pid-file={root}/munge/pid",
                f"--seed-file={root}/munge/seed", f"--log-file={log}/munged.log")
        wait_for("munged's socket", sock.exists, 30, c)
        c.start("slurmctld", "-D", "-i")  # -i: no state from an earlier run (there is none)
        for node in NODES:
            (root / "spool" / node).mkdir(mode=0o700)
            c.start("slurmd", "-D", "-N", node, node=node)
        wait_for("nodes node1 and node2 idle", c.idle, 60, c)
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
        net.close()
    left = (netns_list() - before[0], set(netns_processes()) - before[1])
    assert left == (set(), set()), f"the cluster left namespaces or processes behind: {left}"


@pytest.fixture
def job_env(cluster):
    """The environment a user's shell gives sbatch on this cluster: the venv, no GPU request, a fresh port."""
    return cluster.env | {"VENV": str(Path(sys.executable).parent.parent), "SBATCH_GPUS_PER_NODE": "0"}
