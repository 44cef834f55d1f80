#!/usr/bin/env bash
# Install what this project needs, idempotently: Fashion-MNIST from Debian (when root and
# missing), uv, and the locked Python environment in .venv (uv.lock: the same versions on
# every node). Safe to run again; each step is skipped when already done.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "setup.sh: $*" >&2; }

if [[ ! -d /usr/share/datasets/fashion-mnist ]]; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    say "installing Debian's dataset-fashion-mnist (the offline Fashion-MNIST)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    say "Fashion-MNIST is not in /usr/share/datasets/fashion-mnist and this is not a root" \
        "Debian shell: train.py will download it into --data.root instead"
  fi
fi

if ! command -v uv >/dev/null; then
  say "installing uv"
  python3 -m pip install --quiet uv 2>/dev/null \
    || python3 -m pip install --quiet --user uv 2>/dev/null \
    || python3 -m pip install --quiet --break-system-packages uv
  export PATH="$HOME/.local/bin:$PATH"
fi

# --frozen: install exactly uv.lock, never re-resolve; the interpreter must already exist.
UV_PYTHON_DOWNLOADS=never uv sync --frozen --quiet
say "environment ready: $(.venv/bin/python -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)')"
