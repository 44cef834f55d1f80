#!/usr/bin/env bash
# The image's entry point (under tini). With no arguments, or only --section.field=value
# overrides, it trains the default job (configs/fashion_mnist.toml) on this container's GPUs (or
# CPU cores) into /runs/default, unless an override names another --run.dir. Anything else is a
# command, run as given from /opt/ddp:
#   podman run ... ddp-pipeline                              # the default job
#   podman run ... ddp-pipeline --train.epochs=2             # the default job, overridden
#   podman run ... ddp-pipeline bash scripts/launch_multinode.sh --run.dir=/runs/a ...
set -euo pipefail
cd /opt/ddp
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  exec .venv/bin/python train.py --help
fi
if [[ $# -gt 0 && $1 != --* ]]; then
  exec "$@"
fi
run_dir=(--run.dir=/runs/default)
for arg in "$@"; do
  [[ $arg == --run.dir=* || $arg == --run.dir ]] && run_dir=()
done
# The container's own id (kept by its restarts): a restart after a hard kill resumes at once.
TRAIN_JOB_ID=${TRAIN_JOB_ID:-$(bash scripts/container/job_id.sh)}
export TRAIN_JOB_ID
exec bash scripts/train_single_node.sh --config configs/fashion_mnist.toml "${run_dir[@]}" "$@"
