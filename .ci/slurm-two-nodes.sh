#!/usr/bin/env bash
# Start a second SLURM cluster of two nodes on this one machine, for the real multi-node tests, and print
# the settings they need (NAME=value lines). It runs beside .ci/slurm.sh's one-node cluster (which it
# starts first, for the packages and munge) on its own ports, state and spool folders, so neither
# disturbs the other's jobs.
#
# Two slurmd daemons on one host: `slurmd -N NAME`, each node on its own Port=. Checked with Debian 12's
# slurm-wlm 22.05.8: both register and `srun -N2` runs a task on each. The node names are names this host
# already resolves (its short host name and localhost), because the trials' torchrun rendezvous is on the
# first node by its name, as on a real cluster. Unlike the one-node cluster, this one binds each task to
# its CPUs as real clusters do (task/affinity, TaskPluginParam=Cores; no cgroups), so a step that asks
# for too few CPUs shows it: its ranks share one core. Each node declares this machine's cores: the two
# nodes share them. Run as root. A cluster this script started earlier and still answering is reused.
set -euo pipefail

DIR=${AUTOTUNE_SLURM2_DIR:-/var/lib/autotune-slurm-two}
CONF=$DIR/slurm.conf
PARTITION=${AUTOTUNE_SLURM2_PARTITION:-two}
CTLD_PORT=${AUTOTUNE_SLURM2_PORT:-6917} # the one-node cluster has SLURM's defaults, 6817 and 6818

bash "$(dirname "$0")/slurm.sh" >/dev/null # packages, munge (and the one-node cluster)

FIRST=$(hostname -s)
SECOND=localhost
if [ "$FIRST" = "$SECOND" ] || ! getent hosts "$FIRST" >/dev/null || ! getent hosts "$SECOND" >/dev/null; then
  echo "slurm-two-nodes.sh: needs two names for this host ($(hostname -s) and localhost) that resolve" >&2
  exit 1
fi
NODES=("$FIRST" "$SECOND")

idle_nodes() { SLURM_CONF=$CONF sinfo -h -N -p "$PARTITION" -o %t 2>/dev/null | grep -c '^idle$' || true; }

if [ ! -s "$CONF" ] || [ "$(idle_nodes)" != 2 ]; then
  mkdir -p "$DIR/state" "$DIR/log" "$DIR/spool-${NODES[0]}" "$DIR/spool-${NODES[1]}"
  hardware=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')
  cat >"$CONF" <<EOF
# Two-node test cluster on one host, written by autotune's .ci/slurm-two-nodes.sh
ClusterName=autotune-ci-two
SlurmctldHost=$FIRST
SlurmctldPort=$CTLD_PORT
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
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 14)) $hardware State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 15)) $hardware State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  # Daemons left by an earlier run read the old file: end them by the pid each one wrote.
  for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
    if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 50); do kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null || break; sleep 0.1; done
    fi
  done
  # -c: start without the jobs of the state saved before. A machine that stopped (or was imaged) while the
  # suite ran keeps its jobs there, and the controller would requeue and run them again on the new cluster.
  /usr/sbin/slurmctld -c -f "$CONF"
  for node in "${NODES[@]}"; do /usr/sbin/slurmd -f "$CONF" -N "$node"; done
  for _ in $(seq 120); do
    [ "$(idle_nodes)" = 2 ] && break
    for node in "${NODES[@]}"; do
      state=$(SLURM_CONF=$CONF sinfo -h -N -n "$node" -o %t 2>/dev/null || true)
      case "$state" in down* | drain* | unk*) SLURM_CONF=$CONF scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;; esac
    done
    sleep 0.5
  done
  if [ "$(idle_nodes)" != 2 ]; then
    echo "slurm-two-nodes.sh: the two nodes did not come up idle (sinfo: $(SLURM_CONF=$CONF sinfo -N -h 2>&1 | tr '\n' ' ')); see $DIR/log/" >&2
    exit 1
  fi
fi

echo "AUTOTUNE_TEST_SLURM2_CONF=$CONF"
echo "AUTOTUNE_TEST_SLURM2_PARTITION=$PARTITION"
