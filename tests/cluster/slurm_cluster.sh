#!/usr/bin/env bash
# A real two-node (or, with SLURM_TEST_NODES, larger) Slurm on this one machine, for the tests (Debian's slurm-wlm and munge).
#
#   tests/cluster/slurm_cluster.sh start DIR   # munged, slurmctld, slurmd n1 and n2; prints `export SLURM_CONF=...`
#   eval "$(tests/cluster/slurm_cluster.sh start DIR)"   # ... and sets SLURM_CONF in this shell (sbatch needs it)
#   SLURM_TEST_NODES=3 tests/cluster/slurm_cluster.sh start DIR   # a third node, n3 at 127.0.0.3 (2 to 9 nodes)
#   tests/cluster/slurm_cluster.sh stop DIR    # stops exactly the daemons `start` recorded in DIR/pids
#
# Needs root (SlurmUser=root) and Debian's slurmctld slurmd slurm-client munge (`.ci/run` installs them).
# Everything runs as ordinary processes (no systemd); ports are picked free; munge gets its own
# key and socket, so nothing outside DIR (and one /tmp directory for munge) is touched.
# Nodes: n1 at 127.0.0.1 and n2 at 127.0.0.2 (nI at 127.0.0.I up to SLURM_TEST_NODES, default 2), 1 CPU
# each (SLURM_TEST_CPUS=N for more), so `sbatch -N 2` spans two of them.
# SLURM_TEST_PREEMPT=GRACE_SECONDS: Slurm's own preemption (PreemptType=preempt/partition_prio,
# PreemptMode=REQUEUE): `main` (the default) gets PriorityTier=1 and GraceTime=GRACE_SECONDS, and a `high`
# partition on the same nodes (PriorityTier=2) preempts its jobs. Unset: one partition, no preemption.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action=$1
dir=$(realpath -m "$2")

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

start() {
    local count=${SLURM_TEST_NODES:-2} nodes=() i
    if ! [[ $count =~ ^[2-9]$ ]]; then
        echo "SLURM_TEST_NODES=$count: valid: 2 to 9 (nI at 127.0.0.I)" >&2
        exit 2
    fi
    for i in $(seq "$count"); do nodes+=("n$i"); done
    local grace=${SLURM_TEST_PREEMPT:-} preempt="" main_extra="" high_line=""
    if [[ -n $grace ]]; then
        if ! [[ $grace =~ ^[0-9]+$ ]]; then
            echo "SLURM_TEST_PREEMPT=$grace: valid: a GraceTime in seconds (0 or more)" >&2
            exit 2
        fi
        preempt=$'PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE\n'
        main_extra=" PriorityTier=1 GraceTime=$grace"
        high_line=$'\n'"PartitionName=high Nodes=$(IFS=,; echo "${nodes[*]}") PriorityTier=2 MaxTime=INFINITE State=UP"
    fi
    mkdir -p "$dir"/state "$dir"/log
    for i in "${nodes[@]}"; do mkdir -p "$dir/spool/$i"; done
    # munged runs as the munge user and must reach its directory: keep it out of DIR's (0700) parents.
    local munge_dir
    munge_dir=$(mktemp -d /tmp/megarl-munge.XXXXXX)
    echo "$munge_dir" > "$dir/munge_dir"
    chown munge:munge "$munge_dir"
    chmod 0755 "$munge_dir"  # munged wants its socket directory searchable by all
    runuser -u munge -- mungekey --create --keyfile "$munge_dir/munge.key"
    runuser -u munge -- munged --key-file "$munge_dir/munge.key" --socket "$munge_dir/munge.sock" \
        --pid-file "$munge_dir/munged.pid" --log-file "$munge_dir/munged.log" --seed-file "$munge_dir/munged.seed"
    for _ in $(seq 50); do [[ -s $munge_dir/munged.pid ]] && break; sleep 0.1; done
    echo "munged $(cat "$munge_dir/munged.pid")" > "$dir/pids"

    local ctld_port cpus node_lines=""
    ctld_port=$(free_port)
    cpus=${SLURM_TEST_CPUS:-1}
    for i in $(seq "$count"); do
        node_lines+="NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.$i Port=$(free_port) CPUs=$cpus RealMemory=4000 State=UNKNOWN"$'\n'
    done
    cat > "$dir/slurm.conf" <<EOF
ClusterName=megarltest
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_dir/munge.sock,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
${preempt}${node_lines}PartitionName=main Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP${main_extra}${high_line}
EOF
    export SLURM_CONF=$dir/slurm.conf
    setsid slurmctld -D -i -f "$SLURM_CONF" > "$dir/log/slurmctld.out" 2>&1 < /dev/null &
    echo "slurmctld $!" >> "$dir/pids"
    for node in "${nodes[@]}"; do
        setsid slurmd -D -N "$node" -f "$SLURM_CONF" > "$dir/log/slurmd.$node.out" 2>&1 < /dev/null &
        echo "slurmd $!" >> "$dir/pids"
    done
    for _ in $(seq 300); do
        if [[ $(sinfo -h -p main -o '%T %D' 2>/dev/null) == "idle $count" ]]; then
            echo "export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.1
    done
    echo "slurm did not come up; logs in $dir/log" >&2
    sinfo >&2 || true
    exit 1
}

stop() {
    [[ -f $dir/pids ]] || return 0
    local name pid
    while read -r name pid; do
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "$name ($pid) did not stop; killing it" >&2
            kill -9 "$pid" 2>/dev/null || true
        fi
    done < <(tac "$dir/pids")
    rm -f "$dir/pids"
    if [[ -f $dir/munge_dir ]]; then
        rm -rf "$(cat "$dir/munge_dir")"
        rm -f "$dir/munge_dir"
    fi
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
