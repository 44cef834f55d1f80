#!/usr/bin/env bash
# Start this node's share of a multi-node job: run the same command on every node.
#
#   MASTER_ADDR=10.1.0.5 NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 scripts/launch_multinode.sh --train.epochs=10
#
# Required: MASTER_ADDR (address of node 0, which hosts the rendezvous), NNODES, NODE_RANK.
# Optional: MASTER_PORT (29500), NPROC_PER_NODE (auto: one per GPU, else one per CPU core;
#   gpu or xpu where there are some, cpu, or a count >= 1),
#   JOB_ID (ddp-job; the same on all nodes of one job, distinct per job), MAX_RESTARTS (3),
#   RDZV_JOIN_TIMEOUT (600 s to wait for all nodes), SOCKET_IFNAME (network interface for gloo
#   and NCCL, e.g. eth0), LOCAL_ADDR (this node's address as the others reach it; default: its
#   host name, which must resolve everywhere), PYTHON (.venv/bin/python when present, else python3),
#   TRAIN_SCRIPT (train.py; your own entry point that ends in train.main(), e.g. one that
#   registers extra checkpointed state).
# RDZV_CHECK (1) meets all nodes on RDZV_CHECK_PORT (MASTER_PORT + 1) before torchrun starts,
#   so failures are explained (scripts/rendezvous_check.py: exit 69, retryable, when a node is
#   late or unreachable; 2 for a setup to fix, MASTER_PORT taken on node 0 included); 0 skips it.
# SUPERVISE_GRACE_S (120): the preemption budget, how long a stop signal leaves the workers to
#   write their checkpoint; scripts/supervise.py gives torchrun the same shutdown timeout
#   (TORCH_ELASTIC_SHUTDOWN_TIMEOUT). A scheduler's own grace (Slurm's KillWait or --signal lead
#   time, Kubernetes' terminationGracePeriodSeconds) must be longer still.
# Network: every node must reach node 0 on MASTER_PORT and RDZV_CHECK_PORT, and all nodes each
#   other on ephemeral ports (torchrun's worker store, gloo and NCCL pick free ports).
# Debug knobs passed through when set: NCCL_DEBUG, TORCH_DISTRIBUTED_DEBUG, NCCL_IB_DISABLE,
#   NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME.
# Every other argument is a train.py config override (--section.field=value).
set -euo pipefail
# exitcodes.py's values (tests/test_exitcodes.py checks them)
EXIT_BAD_INPUT=2
EXIT_PREEMPTED=75

die() { echo "launch_multinode.sh: $*" >&2; exit "$EXIT_BAD_INPUT"; }

require_int() {  # name value minimum
  # No leading zeros: bash arithmetic would read them as octal, Python and torchrun as decimal.
  [[ "$2" =~ ^(0|[1-9][0-9]*)$ ]] || die "$1=$2 is not a non-negative integer"
  (( $2 >= $3 )) || die "$1=$2 must be >= $3"
}

[[ -n "${MASTER_ADDR:-}" ]] || die "MASTER_ADDR is not set: give the address of node 0"
[[ -n "${NNODES:-}" ]] || die "NNODES is not set: give the number of nodes in the job"
[[ -n "${NODE_RANK:-}" ]] || die "NODE_RANK is not set: give this node's index, 0 to NNODES-1"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-auto}
JOB_ID=${JOB_ID:-ddp-job}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_JOIN_TIMEOUT=${RDZV_JOIN_TIMEOUT:-600}

require_int NNODES "$NNODES" 1
require_int NODE_RANK "$NODE_RANK" 0
(( NODE_RANK < NNODES )) || die "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"
require_int MASTER_PORT "$MASTER_PORT" 1
(( MASTER_PORT <= 65535 )) || die "MASTER_PORT=$MASTER_PORT is not a TCP port"
# torchrun's own words (determine_local_world_size in torch/distributed/run.py): auto (one per
# GPU, else per CPU core), gpu, xpu, cpu, or a count; it takes 0 and -1 too, and fails later.
[[ "$NPROC_PER_NODE" =~ ^(auto|gpu|xpu|cpu)$ ]] || require_int NPROC_PER_NODE "$NPROC_PER_NODE" 1
require_int MAX_RESTARTS "$MAX_RESTARTS" 0
require_int RDZV_JOIN_TIMEOUT "$RDZV_JOIN_TIMEOUT" 1
RDZV_CHECK=${RDZV_CHECK:-1}
[[ "$RDZV_CHECK" == 0 || "$RDZV_CHECK" == 1 ]] || die "RDZV_CHECK=$RDZV_CHECK must be 0 or 1"
if [[ "$RDZV_CHECK" == 1 ]]; then
  RDZV_CHECK_PORT=${RDZV_CHECK_PORT:-$(( MASTER_PORT + 1 ))}
  require_int RDZV_CHECK_PORT "$RDZV_CHECK_PORT" 1
  (( RDZV_CHECK_PORT <= 65535 && RDZV_CHECK_PORT != MASTER_PORT )) \
    || die "RDZV_CHECK_PORT=$RDZV_CHECK_PORT must be a TCP port other than MASTER_PORT"
fi

if [[ -n "${SOCKET_IFNAME:-}" ]]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ "$NPROC_PER_NODE" == gpu || "$NPROC_PER_NODE" == xpu ]]; then
  device=$([[ $NPROC_PER_NODE == gpu ]] && echo cuda || echo xpu)
  "$PYTHON" -c "import sys, torch; sys.exit(not torch.$device.is_available())" \
    || die "NPROC_PER_NODE=$NPROC_PER_NODE, but torch sees no $device device on node" \
      "$NODE_RANK: use auto, cpu or a count"
fi

is_host=false
(( NODE_RANK == 0 )) && is_host=true  # node 0 hosts the c10d rendezvous store

cmd=("$PYTHON" -m torch.distributed.run
  --nnodes="$NNODES"
  --nproc-per-node="$NPROC_PER_NODE"
  --rdzv-backend=c10d
  --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
  --rdzv-id="$JOB_ID"
  --rdzv-conf="join_timeout=$RDZV_JOIN_TIMEOUT,is_host=$is_host"
  --max-restarts="$MAX_RESTARTS")
# The address other nodes reach this one at; without it torchrun advertises this host's FQDN,
# which must then resolve on every node.
[[ -n "${LOCAL_ADDR:-}" ]] && cmd+=(--local-addr="$LOCAL_ADDR")
cmd+=("${TRAIN_SCRIPT:-train.py}" "$@")

for knob in NCCL_DEBUG TORCH_DISTRIBUTED_DEBUG NCCL_IB_DISABLE NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
  [[ -n "${!knob:-}" ]] && echo "launch_multinode.sh: $knob=${!knob}"
done
if [[ "$RDZV_CHECK" == 1 ]]; then
  # Meet all nodes first: a missing node, a wrong MASTER_ADDR or a taken port then fails within
  # RDZV_JOIN_TIMEOUT with a message naming the endpoint and the missing NODE_RANKs.
  env MASTER_ADDR="$MASTER_ADDR" RDZV_CHECK_PORT="$RDZV_CHECK_PORT" NNODES="$NNODES" \
    NODE_RANK="$NODE_RANK" RDZV_JOIN_TIMEOUT="$RDZV_JOIN_TIMEOUT" MASTER_PORT="$MASTER_PORT" \
    "$PYTHON" scripts/rendezvous_check.py &
  check_pid=$!
  # A stop signal while the nodes meet: nothing trained yet, so "preempted, resubmit" (75);
  # the check must not live on holding its port. In the background: a trap interrupts `wait`.
  trap 'kill "$check_pid" 2>/dev/null; echo "launch_multinode.sh: stopped by a signal before" \
    "training started: exit $EXIT_PREEMPTED" >&2; exit "$EXIT_PREEMPTED"' TERM USR2 INT HUP
  wait "$check_pid"  # its failure (exit 69 or 2) ends this script with that code (set -e)
  trap - TERM USR2 INT HUP
fi
echo "launch_multinode.sh: node $NODE_RANK of $NNODES: ${cmd[*]}"
# A fresh rendezvous store per restart round: torchrun otherwise keeps one store for all
# restarts, where a restarted process group can find the dead workers' addresses.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# Preemption and restarts: scripts/supervise.py runs torchrun. However a stop signal (SIGTERM,
# SIGUSR2, SIGINT, SIGHUP) arrives, to this process, to torchrun, to each worker or all at once
# and repeated, the workers agree at the next step boundary, write one checkpoint and the exit
# is 75 ("preempted, resubmit"); 76 means "no progress across restarts: do not resubmit".
exec "$PYTHON" scripts/supervise.py -- "${cmd[@]}"
