#!/usr/bin/env bash
# A Slurm cluster on this one machine, for tests and for trying deploy/slurm-batch.sh:
# munged, slurmctld and slurmd (Debian's munge, slurmctld, slurmd, slurm-client packages)
# with a generated config, all state, logs, sockets and the munge key under DIR, so nothing
# of the machine's own configuration is read or changed. Runs as root (slurmd must).
#
#   scripts/slurm-local.sh start DIR    # then: export SLURM_CONF=DIR/slurm.conf
#   scripts/slurm-local.sh stop DIR
set -euo pipefail
cmd=${1:?usage: slurm-local.sh start|stop DIR}
dir=$(realpath -m "${2:?usage: slurm-local.sh start|stop DIR}")
export SLURM_CONF=$dir/slurm.conf

stop() {
  [ -f "$dir/slurmctld.pid" ] && { timeout 10 scontrol shutdown >/dev/null 2>&1 || true; }
  for pid in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  sleep 1
}

case $cmd in
start)
  for tool in munged slurmctld slurmd sbatch scontrol sinfo; do
    command -v "$tool" >/dev/null || { echo "slurm-local: $tool is missing: apt-get install munge slurmctld slurmd slurm-client" >&2; exit 1; }
  done
  [ "$(id -u)" = 0 ] || { echo "slurm-local: slurmd runs as root; run this as root" >&2; exit 1; }
  stop
  mkdir -p "$dir"/{state,spool,log,munge}
  chmod 700 "$dir/munge"
  key=$dir/munge/munge.key
  if [ ! -f "$key" ]; then
    dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
    chmod 400 "$key"
  fi
  munged --force --key-file="$key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 2048 ))
  cat > "$SLURM_CONF" <<EOF
ClusterName=sluicelocal
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
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
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  slurmctld -c
  slurmd
  for _ in $(seq 60); do
    state=$(sinfo -h -o %T 2>/dev/null || true)
    case $state in idle*|mixed*|allocated*) echo "export SLURM_CONF=$SLURM_CONF"; exit 0 ;; esac
    sleep 0.5
  done
  echo "slurm-local: the node did not come up (state '${state:-none}'); logs in $dir/log" >&2
  tail -n 20 "$dir"/log/*.log >&2 || true
  exit 1
  ;;
stop) stop ;;
*) echo "usage: slurm-local.sh start|stop DIR" >&2; exit 2 ;;
esac
