#!/usr/bin/env bash
# Train on every GPU of this machine (or every CPU core without GPUs) with torchrun.
#   scripts/train_single_node.sh [--section.field=value ...]
# NPROC_PER_NODE overrides the process count: auto (default: one per GPU, else one per CPU
# core), a count >= 1, cpu (one per core), gpu or xpu (one per device: only where there are
# some). TRAIN_SCRIPT (train.py) names your own entry point that ends in train.main().
# SUPERVISE_GRACE_S (120) is the preemption budget: how long a stop signal leaves the workers
# to write their checkpoint (scripts/supervise.py gives torchrun the same). TRAIN_JOB_ID: below.
set -euo pipefail
EXIT_BAD_INPUT=2
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-.venv/bin/python}
NPROC_PER_NODE=${NPROC_PER_NODE:-auto}

die() { echo "train_single_node.sh: $*" >&2; exit "$EXIT_BAD_INPUT"; }

# torchrun's own check (determine_local_world_size in torch/distributed/run.py) takes any int,
# 0 and -1 included, and fails later with a traceback and exit 1, which schedulers retry.
case $NPROC_PER_NODE in
  auto | cpu) ;;
  gpu | xpu)
    device=$([[ $NPROC_PER_NODE == gpu ]] && echo cuda || echo xpu)
    "$PYTHON" -c "import sys, torch; sys.exit(not torch.$device.is_available())" \
      || die "NPROC_PER_NODE=$NPROC_PER_NODE, but torch sees no $device device on this host:" \
        "use auto, cpu or a count" ;;
  *)
    # No leading zeros or signs: bash would read 010 as octal, torchrun as ten.
    [[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] \
      || die "NPROC_PER_NODE=$NPROC_PER_NODE is not a process count >= 1 nor auto, cpu, gpu" \
        "or xpu" ;;
esac

# TRAIN_JOB_ID names the job across launches (a container restarted by its runtime: see
# scripts/container/job_id.sh), so that a launch after a hard kill takes its run dir's lease
# back at once instead of being refused until it expires. Unset: a new id per launch
# (--standalone), and a second launch on a run dir in use is refused. (Not JOB_ID: batch
# systems such as Grid Engine set that for every job, and shells export it for
# launch_multinode.sh; two launches sharing it would take the run dir from each other.)
if [[ -n ${TRAIN_JOB_ID:-} ]]; then
  rdzv=(--nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --rdzv-id="$TRAIN_JOB_ID")
else
  rdzv=(--standalone)
fi
cmd=("$PYTHON" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node="$NPROC_PER_NODE"
  "${TRAIN_SCRIPT:-train.py}" "$@")
echo "train_single_node.sh: ${cmd[*]}"
# A fresh rendezvous store per restart (see launch_multinode.sh).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# Stop signals (SIGTERM, SIGUSR2, SIGINT) however delivered: one checkpoint, exit 75
# (see scripts/supervise.py).
exec "$PYTHON" scripts/supervise.py -- "${cmd[@]}"
