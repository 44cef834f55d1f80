#!/usr/bin/env bash
# A cluster of N "hosts" on this machine: Linux network namespaces joined by a bridge, each with
# its own address and its own host name (UTS namespace), for testing what crosses a network.
# Needs root and iproute2. Addresses are 10.77.0.<i+1>/24 and exist only inside the namespaces.
#
#   scripts/netns_cluster.sh up 2              # create hosts node0, node1 (10.77.0.1, 10.77.0.2)
#   scripts/netns_cluster.sh exec 1 CMD...     # run CMD on host 1 (interface eth0, hostname node1)
#   scripts/netns_cluster.sh down              # remove everything `up` created
#   scripts/netns_cluster.sh demo              # up 2, a 2-node x 2-process training run, down
#
# NETNS_PREFIX (default ddp, at most 8 characters) names the bridge, links and namespaces, so
# several clusters can coexist (the tests use a random prefix each).
set -euo pipefail

PREFIX=${NETNS_PREFIX:-ddp}
SUBNET=10.77.0
die() { echo "netns_cluster.sh: $*" >&2; exit 2; }
(( ${#PREFIX} <= 8 )) || die "NETNS_PREFIX=$PREFIX is longer than 8 characters"
[[ $(id -u) -eq 0 ]] || die "needs root (ip netns)"
command -v ip >/dev/null || die "needs iproute2 (apt-get install iproute2)"

ns() { echo "${PREFIX}-node$1"; }
addr() { echo "$SUBNET.$(( $1 + 1 ))"; }

up() {
  local n=$1
  [[ "$n" =~ ^[1-9]$ ]] || die "host count must be 1 to 9, got $n"
  ip link add "${PREFIX}br" type bridge
  # Hosts with br_netfilter and a FORWARD policy of DROP (Docker hosts) would filter bridged
  # traffic between the namespaces: exempt this bridge from iptables where the kernel allows.
  ip link set "${PREFIX}br" type bridge nf_call_iptables 0 nf_call_ip6tables 0 2>/dev/null || true
  ip link set "${PREFIX}br" up
  for (( i = 0; i < n; i++ )); do
    ip netns add "$(ns "$i")"
    ip link add "${PREFIX}h$i" type veth peer name "${PREFIX}n$i"
    ip link set "${PREFIX}h$i" master "${PREFIX}br" up
    ip link set "${PREFIX}n$i" netns "$(ns "$i")"
    ip -n "$(ns "$i")" link set "${PREFIX}n$i" name eth0
    ip -n "$(ns "$i")" addr add "$(addr "$i")/24" dev eth0
    ip -n "$(ns "$i")" link set eth0 up
    ip -n "$(ns "$i")" link set lo up
    echo "node$i $(addr "$i") netns $(ns "$i")"
  done
}

down() {
  local name
  for name in $(ip netns list | awk '{print $1}' | grep "^${PREFIX}-node" || true); do
    # Kill until none is left: a process may fork (torchrun starting workers) meanwhile.
    for _ in $(seq 50); do
      [[ -z "$(ip netns pids "$name" 2>/dev/null)" ]] && break
      ip netns pids "$name" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
      sleep 0.1
    done
    ip netns del "$name"
  done
  ip link del "${PREFIX}br" 2>/dev/null || true
  # Links of deleted namespaces vanish asynchronously: wait (briefly) until none is left.
  for _ in $(seq 50); do
    ip -br link | grep -q "^${PREFIX}\(br\|h[0-9]\)" || return 0
    sleep 0.1
  done
  echo "netns_cluster.sh: links of $PREFIX still present after down" >&2
  return 1
}

exec_on() {
  local i=$1; shift
  # A UTS namespace gives each host its own name, as on separate machines.
  exec ip netns exec "$(ns "$i")" unshare --uts sh -c 'hostname "$0"; exec "$@"' "node$i" "$@"
}

demo() {
  local self
  self=$(realpath "$0")
  trap down EXIT
  up 2
  cd "$(dirname "$self")/.."
  local run_dir=${RUN_DIR:-runs/netns-demo} pids=() i
  for i in 0 1; do
    NETNS_PREFIX=$PREFIX "$self" exec "$i" env MASTER_ADDR="$(addr 0)" MASTER_PORT=29400 NNODES=2 NODE_RANK=$i \
      NPROC_PER_NODE=2 SOCKET_IFNAME=eth0 LOCAL_ADDR="$(addr "$i")" MAX_RESTARTS=0 \
      RDZV_JOIN_TIMEOUT=60 bash scripts/launch_multinode.sh --run.dir="$run_dir" --data.dataset=synthetic \
      --train.epochs=1 --data.num_workers=0 --log.every_steps=8 "$@" 2>&1 \
      | sed -u "s/^/[node$i] /" &
    pids+=($!)
  done
  local status=0
  for i in "${pids[@]}"; do wait "$i" || status=1; done
  return $status
}

case "${1:-}" in
  up) up "${2:?host count}" ;;
  down) down ;;
  exec) shift; exec_on "$@" ;;
  demo) shift; demo "$@" ;;
  *) die "usage: netns_cluster.sh up N | exec I CMD... | down | demo [train.py overrides]" ;;
esac
