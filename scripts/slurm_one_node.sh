#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests of `slm-bench submit` (and for trying it by hand).
#
#   scripts/slurm_one_node.sh start   write the config, start munged, slurmctld and slurmd; print the SLURM_CONF line
#   scripts/slurm_one_node.sh stop    stop slurmd and slurmctld (munged is left to the system)
#
# Needs Debian's slurm-wlm and munge (`apt-get install slurm-wlm munge`; .ci/run installs them) and root: the
# daemons run as root, the jobs as the user who submits them. Everything lives in $SLM_BENCH_SLURM_DIR
# (default /tmp/slm-bench-slurm); nothing under /etc is written, so a real Slurm on the machine is not touched.
# Ports 16817/16818, not Slurm's 6817/6818, for the same reason. Use the cluster with SLURM_CONF=<dir>/slurm.conf.
set -euo pipefail
DIR=${SLM_BENCH_SLURM_DIR:-/tmp/slm-bench-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)

stop() {
  for daemon in slurmd slurmctld; do
    if [ -f "$DIR/$daemon.pid" ]; then kill "$(cat "$DIR/$daemon.pid")" 2>/dev/null || true; rm -f "$DIR/$daemon.pid"; fi
  done
}

start() {
  for tool in slurmctld slurmd munged sinfo; do
    command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install slurm-wlm munge" >&2; exit 2; }
  done
  [ "$(id -u)" = 0 ] || { echo "the one-node cluster's daemons run as root: run this as root" >&2; exit 2; }
  if SLURM_CONF=$CONF sinfo --noheader --format=%t 2>/dev/null | grep -qE 'idle|mix|alloc'; then
    echo "export SLURM_CONF=$CONF"; exit 0   # already running
  fi
  stop
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat > "$CONF" <<CONF
# one-node test cluster written by scripts/slurm_one_node.sh
ClusterName=slmbench
SlurmctldHost=$HOST
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=3600
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$HOST CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  if ! munge -n >/dev/null 2>&1; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
    chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null || true
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged || /usr/sbin/munged --force
  fi
  SLURM_CONF=$CONF slurmctld -f "$CONF"
  SLURM_CONF=$CONF slurmd -f "$CONF"
  for _ in $(seq 60); do
    if SLURM_CONF=$CONF sinfo --noheader --format=%t 2>/dev/null | grep -q idle; then echo "export SLURM_CONF=$CONF"; exit 0; fi
    sleep 0.5
  done
  echo "the one-node cluster did not come up; logs in $DIR/log:" >&2
  tail -n 20 "$DIR/log/"*.log >&2 || true
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
