#!/bin/bash
# Runs train.sbatch and prepare.sbatch on this machine, without Slurm: stub `srun` and `scontrol` commands stand in
# for Slurm, stub `dit-train`/`dit-prepare` for the apps, and the real torchrun (from .venv, or VENV) launches them.
# The stub srun runs each "node" on localhost and, like slurmstepd, delivers a forwarded signal to every process
# of the step. Checks: SIGUSR1 to the batch script → every rank checkpoints, torchrun survives, the step exits 0
# and the job is requeued; a finished run is not requeued; a failure keeps its non-zero status; arguments reach
# the apps unchanged.
#
#   bash infra/slurm/selftest.sh                   (about a minute; torchrun from .venv, made by `make install`)
#   VENV=/path/.venv bash infra/slurm/selftest.sh  (torchrun from that environment)
#
# The jobs run with VENV set to a stand-in environment ($work/venv) whose bin/ holds the stub apps and a link to
# the real torchrun: the scripts' VENV handling is exercised, and a real dit-train never shadows the stubs. It
# always ends with a summary line, also when a check cannot run.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
venv=${VENV:-$here/../../.venv}
if [[ ! -x "$venv/bin/torchrun" ]]; then
    echo "selftest: no torchrun in $venv/bin: run 'make install' or set VENV" >&2
    exit 2
fi
venv=$(cd "$venv" && pwd)  # the link below must not be relative
work=$(mktemp -d)
failures=0
# shellcheck disable=SC2317  # called by trap
finish() {
    local rc=$?
    rm -rf "$work"
    if (( rc != 0 && failures == 0 )); then
        echo "selftest: stopped early (exit status $rc); the checks before this line are all that ran"
        echo "1 failed"
    else
        echo "$failures failed"
    fi
}
trap finish EXIT
mkdir -p "$work/bin" "$work/venv/bin"
ln -s "$venv/bin/torchrun" "$work/venv/bin/torchrun"

cat > "$work/bin/srun" <<'EOF'
#!/bin/bash
# Stub srun: --ntasks tasks on this host; USR1 is delivered to every process of the step (as proctrack/cgroup
# does, whatever their session), SIGTERM answered with SIGKILL to the step (as srun does).
ntasks=1
while [[ "$1" == -* ]]; do
    [[ "$1" == --ntasks=* ]] && ntasks=${1#*=}
    shift
done
tasks=()
for ((i = 0; i < ntasks; i++)); do
    SLURM_PROCID=$i SLURM_NODEID=$i setsid "$@" &
    tasks+=("$!")
done
tree() { local c; for c in $(ps -o pid= --ppid "$1"); do echo "$c"; tree "$c"; done; }
step() { local t; for t in "${tasks[@]}"; do echo "$t"; tree "$t"; done; }
trap 'echo "srun: USR1" >> "$SIM_DIR/events"; kill -USR1 $(step) 2>/dev/null' USR1
trap 'kill -KILL $(step) 2>/dev/null' TERM
rc=0
for t in "${tasks[@]}"; do
    while :; do
        wait "$t" && r=0 || r=$?
        if (( r > 128 )) && kill -0 "$t" 2>/dev/null; then continue; fi
        break
    done
    (( r > rc )) && rc=$r
done
exit "$rc"
EOF
cat > "$work/bin/scontrol" <<'EOF'
#!/bin/bash
case "$1 $2" in
    "show hostnames") for ((i = 0; i < SIM_NODES; i++)); do echo localhost; done ;;
    "requeue "*) echo "requeue $3" >> "$SIM_DIR/events" ;;
    *) exit 1 ;;
esac
EOF
cat > "$work/venv/bin/dit-train" <<'EOF'
#!/usr/bin/env python3
import os, signal, sys, time
events = open(os.path.join(os.environ["SIM_DIR"], "events"), "a", buffering=1)
rank = os.environ["RANK"]
ignored = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
stop = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.append(1))
events.write(f"rank {rank} of {os.environ['WORLD_SIZE']} started, usr1 ignored={ignored}, args={sys.argv[1:]}\n")
for _ in range(int(os.environ.get("FAKE_STEPS", "300"))):
    time.sleep(0.1)
    if stop:
        time.sleep(2)  # a checkpoint that takes a while
        events.write(f"rank {rank} checkpointed\n")
        sys.exit(0)
events.write(f"rank {rank} finished\n")
sys.exit(int(os.environ.get("FAKE_RC", "0")))
EOF
cat > "$work/venv/bin/dit-prepare" <<'EOF'
#!/usr/bin/env python3
import os, sys
with open(os.path.join(os.environ["SIM_DIR"], "events"), "a") as f:
    f.write(f"prepare rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} args={sys.argv[1:]}\n")
EOF
chmod +x "$work/bin/"* "$work/venv/bin/dit-"*

check() {  # check NAME CONDITION...
    local name=$1
    shift
    if "$@"; then echo "ok    $name"; else echo "FAIL  $name"; failures=$((failures + 1)); fi
}
count() { grep -c -- "$1" "$SIM_DIR/events" || true; }

# simulate SCRIPT NODES PROCS USR1_AFTER_START(yes|no) ARGS... → sets status; the script's output is in $SIM_DIR/out
simulate() {
    local script=$1 nodes=$2 procs=$3 usr1=$4
    shift 4
    export SIM_DIR="$work/$RANDOM" SIM_NODES=$nodes
    mkdir -p "$SIM_DIR"
    touch "$SIM_DIR/events"
    cp "$here/$script" "$SIM_DIR/job"  # Slurm runs a copy of the script from its spool directory
    (
        cd "$SIM_DIR"
        # The submitting shell's PATH and VENV=the stand-in environment, as `VENV=... sbatch` would pass them on.
        export PATH="$work/bin:$PATH" VENV="$work/venv" SLURM_JOB_ID=$((4000 + RANDOM % 1000)) SLURM_NNODES=$nodes \
            SLURM_JOB_NODELIST="node[1-$nodes]" SLURM_CPUS_PER_TASK=2 NPROC_PER_NODE=$procs
        exec bash ./job "$@"  # $! is then the batch shell itself, which USR1 must reach
    ) > "$SIM_DIR/out" 2>&1 &
    local job=$!
    if [[ "$usr1" == yes ]]; then
        for _ in $(seq 300); do
            (( $(count started) >= nodes * procs )) && break
            sleep 0.1
        done
        kill -USR1 "$job" 2>/dev/null || echo "selftest: the job had ended before SIGUSR1 could be sent"
    fi
    wait "$job" && status=0 || status=$?
}

simulate train.sbatch 2 2 yes mock train.steps=10 --print-config
check "preempted: the job exits 0" test "$status" -eq 0
check "preempted: 4 ranks started with SIGUSR1 ignored" test "$(count 'usr1 ignored=True')" -eq 4
check "preempted: arguments reach dit-train" \
    test "$(count "args=\['--config', 'mock', '--resume', 'auto', 'train.steps=10', '--print-config'\]")" -eq 4
check "preempted: every rank checkpointed" test "$(count checkpointed)" -eq 4
check "preempted: the job requeued itself" test "$(count requeue)" -eq 1
[[ $failures -eq 0 ]] || cat "$SIM_DIR/out"

FAKE_STEPS=5 simulate train.sbatch 2 "" no mock  # NPROC_PER_NODE unset, no GPU
check "finished: the job exits 0" test "$status" -eq 0
check "finished: not requeued" test "$(count requeue)" -eq 0
check "no GPU, NPROC_PER_NODE unset: 1 process per node" test "$(count started)" -eq 2
check "no GPU: the process gets the task's 2 CPUs as threads" \
    grep -q "1 process(es) and 0 GPU(s) per node, 2 thread(s) each" "$SIM_DIR/out"

FAKE_STEPS=5 FAKE_RC=3 simulate train.sbatch 1 2 no mock
check "failed: the job exits non-zero" test "$status" -ne 0
check "failed: not requeued" test "$(count requeue)" -eq 0

simulate train.sbatch 1 1 no mock --resume none
check "--resume is refused" test "$status" -eq 2

simulate train.sbatch 1 1 no mock --overwrite
check "--overwrite is refused" test "$status" -eq 2

simulate prepare.sbatch 2 1 no synthetic --out /tmp/x --num 50 --workers 2
check "prepare: exits 0" test "$status" -eq 0
check "prepare: 2 ranks, arguments unchanged (--num is not torchrun's)" \
    test "$(count "of 2 args=\['synthetic', '--out', '/tmp/x', '--num', '50', '--workers', '2'\]")" -eq 2

simulate prepare.sbatch 2 1 no mock --out /tmp/x
check "prepare: mock on 2 nodes is refused" test "$status" -eq 2

exit $(( failures > 0 ))
