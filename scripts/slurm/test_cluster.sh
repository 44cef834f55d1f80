#!/usr/bin/env bash
# A real Slurm cluster on this machine, for tests: one slurmctld and N slurmd, each on its own
# "host" (a network namespace from scripts/netns_cluster.sh, with its own address, host name
# and /etc/hosts). Debian 12's Slurm 22.05 and munge (scripts/setup.sh installs them). Root only.
#
#   scripts/slurm/test_cluster.sh up 2            # controller "ctl" and nodes node1, node2
#   scripts/slurm/test_cluster.sh ctl sbatch ...  # a Slurm command on the controller host
#   scripts/slurm/test_cluster.sh exec 2 CMD...   # CMD on node2 (0 is the controller host)
#   scripts/slurm/test_cluster.sh crash 2         # node2 dies: slurmd and every process on it
#   scripts/slurm/test_cluster.sh revive 2        # node2 comes back: slurmd starts again
#   scripts/slurm/test_cluster.sh down            # stop every daemon, remove hosts and files
#
# TEST_CLUSTER (default slm, at most 8 characters) names the cluster: its namespaces and links
# (as NETNS_PREFIX) and its one state directory, ${TMPDIR:-/tmp}/slurm-test-$TEST_CLUSTER, which
# holds everything: slurm.conf, the hosts file, the munge key and socket, spool and state save
# directories, logs (log/). Several clusters can coexist under different names.
#
# Hosts: ctl = 10.77.0.1 runs slurmctld and munged; node<i> = 10.77.0.<i+1> runs slurmd. Each
# command runs in the host's network namespace, a UTS namespace with its host name, and a private
# mount namespace where the cluster's hosts file covers /etc/hosts (every name resolves to its
# host's address, never to loopback) and its configuration directory covers /etc/slurm. nsenter
# rather than `ip netns exec`, which remounts /sys and hides /sys/fs/cgroup from slurmd.
# No cgroups: proctrack/linuxproc finds a job's processes by parentage, task/none binds nothing.
# Nothing outside the state directory and the namespaces is written; `down` leaves no process,
# namespace, mount (each mount namespace ends with its last process) or file behind.
set -euo pipefail

PREFIX=${TEST_CLUSTER:-slm}
DIR=${TMPDIR:-/tmp}/slurm-test-$PREFIX
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NETNS=$HERE/../netns_cluster.sh
die() { echo "test_cluster.sh: $*" >&2; exit 2; }
say() { echo "test_cluster.sh: $*" >&2; }

[[ $(id -u) -eq 0 ]] || die "needs root (network namespaces, daemons as root)"
for tool in slurmctld slurmd sbatch munged nsenter unshare; do
  command -v "$tool" >/dev/null || die "needs $tool (scripts/setup.sh installs Slurm and munge)"
done

host_name() { if (( $1 == 0 )); then echo ctl; else echo "node$1"; fi; }
netns() { echo "/run/netns/${PREFIX}-node$1"; }  # netns_cluster.sh's names: host i = node<i>

# Run "$@" on host $1 (see the header). The host's namespaces are made afresh for each command,
# so that a command still finds the host after its daemon died.
on_host() {
  local i=$1; shift
  [[ -e $(netns "$i") ]] || die "no host $i in cluster $PREFIX (up first?)"
  # shellcheck disable=SC2016  # expanded by the inner shell
  nsenter --net="$(netns "$i")" unshare --uts --mount --propagation private sh -c '
    hostname "$0" && mount --bind "$1/hosts" /etc/hosts && mount --bind "$1/etc" /etc/slurm \
      && shift && exec "$@"' "$(host_name "$i")" "$DIR" \
    env SLURM_CONF="$DIR/etc/slurm.conf" "$@"
}

write_config() {  # N
  local n=$1 i
  mkdir -p "$DIR"/{etc,state,log,run} "$DIR/spool"
  { echo "127.0.0.1 localhost"; for (( i = 0; i <= n; i++ )); do
      echo "10.77.0.$(( i + 1 )) $(host_name "$i")"; done; } > "$DIR/hosts"
  cat > "$DIR/etc/slurm.conf" <<EOF
# Written by scripts/slurm/test_cluster.sh for test cluster $PREFIX.
ClusterName=test$PREFIX
SlurmctldHost=ctl(10.77.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: processes found by parentage; no binding, no accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
# Fast and bounded: SIGTERM to SIGKILL in 30 s (time enough for a checkpoint), a dead slurmd
# noticed in about 10 s, a node that comes back is usable at once, no grace past time limits.
KillWait=30
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
TCPTimeout=2
InactiveLimit=0
OverTimeLimit=0
MinJobAge=300
UnkillableStepTimeout=60
JobRequeue=1
ReturnToService=2
NodeName=node[1-$n] CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # Each node's address (NodeAddr) comes from its name, through the hosts file.
  for (( i = 1; i <= n; i++ )); do mkdir -p "$DIR/spool/node$i"; done
}

start_munge() {
  mkdir -p -m 700 "$DIR/munge"
  head -c 1024 /dev/urandom > "$DIR/munge/munge.key"
  chmod 600 "$DIR/munge/munge.key"
  # --force: munged refuses root and shared directories otherwise. One munged serves every host:
  # its socket is a file path, which crosses network namespaces.
  on_host 0 munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
}

start_slurmd() {  # i
  on_host "$1" slurmd -N "node$1" || die "slurmd on node$1 did not start (log/slurmd-node$1.log)"
}

wait_idle() {  # N: until every node answers as idle, or 30 s
  local n=$1 idle
  for _ in $(seq 150); do
    idle=$(on_host 0 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
    (( idle == n )) && return 0
    sleep 0.2
  done
  on_host 0 sinfo -N >&2 || true
  die "the nodes did not come up idle within 30 s (logs in $DIR/log)"
}

up() {
  local n=$1 i
  [[ "$n" =~ ^[1-8]$ ]] || die "node count must be 1 to 8, got $n"
  [[ ! -e $DIR ]] || die "$DIR exists: cluster $PREFIX is up or left over ('down' first)"
  mkdir -p "$DIR"
  NETNS_PREFIX=$PREFIX bash "$NETNS" up $(( n + 1 )) >/dev/null
  write_config "$n"
  start_munge
  # -c: a fresh cluster, no state to recover.
  on_host 0 slurmctld -c || die "slurmctld did not start (log/slurmctld.log)"
  for (( i = 1; i <= n; i++ )); do start_slurmd "$i"; done
  wait_idle "$n"
  echo "cluster $PREFIX: controller ctl (10.77.0.1), nodes node[1-$n], state in $DIR"
}

# Kill every process of host i (its slurmd, slurmstepd and job processes) as a power cut would.
crash() {
  local i=$1 pids
  [[ "$i" =~ ^[1-9]$ ]] || die "crash takes a node number, 1 to N"
  for _ in $(seq 50); do
    pids=$(ip netns pids "${PREFIX}-node$i" 2>/dev/null || true)
    [[ -z "$pids" ]] && return 0
    kill -9 $pids 2>/dev/null || true
    sleep 0.1
  done
  die "processes of node$i survived SIGKILL"
}

down() {
  # Every daemon and job runs inside a namespace of this cluster: netns_cluster.sh kills all of
  # them, removes the namespaces and the bridge. The mount namespaces end with their processes.
  NETNS_PREFIX=$PREFIX bash "$NETNS" down
  rm -rf "$DIR"
}

case "${1:-}" in
  up) up "${2:?node count}" ;;
  down) down ;;
  exec) shift; i=${1:?host number}; shift; on_host "$i" "$@" ;;
  ctl) shift; on_host 0 "$@" ;;
  crash) crash "${2:?node number}" ;;
  revive) start_slurmd "${2:?node number}" ;;
  dir) echo "$DIR" ;;
  *) die "usage: test_cluster.sh up N | down | exec I CMD... | ctl CMD... | crash I | revive I | dir" ;;
esac
