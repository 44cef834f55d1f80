#!/usr/bin/env bash
# Train on every GPU of this machine (or every CPU core without GPUs) with torchrun.
#   scripts/train_single_node.sh [--section.field=value ...]
# NPROC_PER_NODE overrides the process count (default: auto).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-.venv/bin/python}
cmd=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="${NPROC_PER_NODE:-auto}"
  train.py "$@")
echo "train_single_node.sh: ${cmd[*]}"
# A fresh rendezvous store per restart (see launch_multinode.sh).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# Stop signals (SIGTERM, SIGUSR2, SIGINT) however delivered: one checkpoint, exit 75
# (see scripts/supervise.py).
exec "$PYTHON" scripts/supervise.py -- "${cmd[@]}"
