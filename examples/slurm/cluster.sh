#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for trying the sbatch script and for the engine tests:
# munged, slurmctld and one slurmd (2 CPUs), all listening on 127.0.0.1, all state under one folder.
#
#   examples/slurm/cluster.sh start DIR   # prints `export SLURM_CONF=DIR/slurm.conf`; Slurm's commands need it
#   examples/slurm/cluster.sh stop DIR    # kills the three daemons by the PIDs in DIR
#
# Needs Debian's slurm-wlm and munge (`apt-get install -y slurm-wlm munge`) and root (the daemons run as root here,
# as in a container; a real cluster runs them as its own users). Nothing outside DIR is written but the munge key's
# copy in DIR. Ports: SLURM_PORTS_BASE (default 16817) for slurmctld, the next one for slurmd.
set -euo pipefail

command=${1:?usage: cluster.sh start|stop DIR}
dir=$(realpath -m "${2:?usage: cluster.sh start|stop DIR}")
base=${SLURM_PORTS_BASE:-16817}
node=$(hostname -s)

stop() {
    for daemon in slurmd slurmctld munged; do
        if [[ -f "$dir/$daemon.pid" ]]; then
            kill -9 "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
            rm -f "$dir/$daemon.pid"
        fi
    done
}

if [[ $command == stop ]]; then
    stop
    exit 0
fi
[[ $command == start ]] || { echo "usage: cluster.sh start|stop DIR" >&2; exit 2; }
for program in munged slurmctld slurmd sbatch; do
    command -v "$program" >/dev/null || { echo "$program not found: apt-get install -y slurm-wlm munge" >&2; exit 2; }
done

mkdir -p "$dir"/{state,spool,log,munge}
chmod 700 "$dir/munge"
# munged wants a key only its user can read; Debian's package made one at install.
install -m 400 /etc/munge/munge.key "$dir/munge/munge.key"
munged --force --socket="$dir/munge/socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"

cpus=2
memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
cat > "$dir/slurm.conf" <<EOF
ClusterName=hetero
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$base
SlurmdPort=$((base + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=600
KillWait=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -i        # -i: ignore state a previous cluster left in DIR
slurmd -N "$node"

# Ready when the node is idle (slurmd registered with the controller).
for _ in $(seq 1 100); do
    if sinfo -h -N -o "%t" 2>/dev/null | grep -q idle; then
        echo "export SLURM_CONF=$dir/slurm.conf"
        exit 0
    fi
    sleep 0.2
done
echo "the Slurm node did not come up within 20 s; logs in $dir/log" >&2
stop
exit 1
