#!/usr/bin/env bash
# Start a one-node SLURM cluster on this machine for the SLURM tests and print the settings they need
# (lines of NAME=value for the environment). Installs Debian's slurm-wlm and munge when missing.
#
# Checked with Debian 12's slurm-wlm 22.05: process tracking by linuxproc; no accounting database
# (sacct fails, which is why autotune's SLURM executor reads squeue and scontrol instead). Cores are the
# consumable resource and memory is not, so several one-core jobs share the node as workers on a cluster
# share nodes. Each job is bound to the cores it was given, as real clusters bind them (task/affinity,
# TaskPluginParam=Cores), with no cgroups (22.05 has no CgroupPlugin=disabled, and slurmd fails to start
# without working cgroups when a cgroup.conf asks for them: none is written). An unbound job would run on
# every core here, and its trials, which take turns per core with every other trial on the machine
# (autotune.search.workers.cpu_turn), would each wait for the trials of the suite's other tests to end.
# Run as root. A cluster this script started earlier and still answering is reused.
set -euo pipefail

SLURM_CONF=${AUTOTUNE_SLURM_CONF:-/etc/slurm/slurm.conf}
PARTITION=${AUTOTUNE_SLURM_PARTITION:-debug}

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# munge: the key (Debian's package makes one; make it where it did not) and the daemon.
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --force >/dev/null
  chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

node_state() { sinfo -h -N -p "$PARTITION" -o %t 2>/dev/null | head -1; }

if [ "$(node_state)" != "idle" ] && [ "$(node_state)" != "mix" ] && [ "$(node_state)" != "alloc" ]; then
  NODE=$(hostname -s)
  mkdir -p "$(dirname "$SLURM_CONF")" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  cat >"$SLURM_CONF" <<EOF
# One-node test cluster written by autotune's .ci/slurm.sh
ClusterName=autotune-ci
SlurmctldHost=$NODE
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=Cores
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
$(slurmd -C | head -1) State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  # Daemons left by an earlier run read the old file: end them by the pid each one wrote.
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 50); do kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null || break; sleep 0.1; done
    fi
  done
  # -c: start without the jobs of the state saved before. A machine that stopped (or was imaged) while the
  # suite ran keeps its jobs there, and the controller would requeue and run them again on the new cluster.
  /usr/sbin/slurmctld -c -f "$SLURM_CONF"
  /usr/sbin/slurmd -f "$SLURM_CONF"
  for _ in $(seq 120); do
    state=$(node_state)
    [ "$state" = "idle" ] && break
    case "$state" in down* | drain* | unk*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;; esac
    sleep 0.5
  done
  if [ "$(node_state)" != "idle" ]; then
    echo "slurm.sh: the node did not come up idle (sinfo: $(node_state)); see /var/log/slurm/" >&2
    exit 1
  fi
fi

echo "AUTOTUNE_TEST_SLURM_PARTITION=$PARTITION"
echo "SLURM_CONF=$SLURM_CONF"
