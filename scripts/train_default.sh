#!/usr/bin/env bash
# Set up (idempotent) and train the default job, configs/fashion_mnist.toml: MiniResNet on
# Fashion-MNIST with one process per GPU, or per CPU core without GPUs. Arguments are config
# overrides (they beat the file).
#   scripts/train_default.sh [--section.field=value ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec bash scripts/train_single_node.sh --config configs/fashion_mnist.toml "$@"
