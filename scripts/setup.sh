#!/usr/bin/env bash
# Install what this project needs, idempotently: Fashion-MNIST, Slurm and Podman from Debian
# (when root and missing), uv, and the locked Python environment in .venv (uv.lock: the same
# versions on every node). Safe to run again; each step is skipped when already done.
#   scripts/setup.sh [uv sync options, e.g. --group ray]
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

# Slurm (22.05 on Debian 12) for the test cluster of scripts/slurm/test_cluster.sh. Its daemons
# are started by that script only: stop whatever the packages' init scripts may have started
# (on a machine without systemd, usually nothing), so no system-wide Slurm or munge is left.
slurm_packages=(slurmctld slurmd slurm-client munge)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    say "installing Debian's ${slurm_packages[*]} (the test Slurm cluster)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${slurm_packages[@]}" >/dev/null
    for service in slurmctld slurmd munge; do
      if command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
        systemctl disable --now "$service" >/dev/null 2>&1 || true
      elif [[ -x /etc/init.d/$service ]]; then
        /etc/init.d/"$service" stop >/dev/null 2>&1 || true
      fi
    done
  else
    say "Slurm is not installed and this is not a root Debian shell: the Slurm tests skip"
  fi
fi

# Podman, runc and debootstrap for the container tests (tests/multinode/test_container.py):
# the image is built from a base debootstrapped from the Debian archive (no registry needed).
# Podman runs no daemon, so nothing is left running; runc because crun refuses hosts whose
# cgroups are in hybrid mode.
if ! command -v podman >/dev/null || ! command -v runc >/dev/null \
   || ! command -v debootstrap >/dev/null; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    say "installing Debian's podman, runc and debootstrap (the container tests)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      podman runc debootstrap >/dev/null
  else
    say "podman or debootstrap is missing and this is not a root Debian shell: the container" \
        "tests skip"
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
# --compile-bytecode: every process of every job imports torch, and a Python that may not write
# bytecode (PYTHONDONTWRITEBYTECODE, a read-only venv) compiles it from source each time, at
# more than twice the CPU of an import from bytecode (BENCHMARKS.md, "Overhead": start-up).
# Compiled once here; a later run skips what is compiled.
# Arguments go to uv sync: `scripts/setup.sh --group ray` adds Ray (scripts/ray_train.py).
UV_PYTHON_DOWNLOADS=never uv sync --frozen --compile-bytecode --quiet "$@"
# The repository's own modules too (__pycache__ is git-ignored; a changed file is recompiled in
# memory, never run stale): a quarter of a second for every process, rank and restart.
.venv/bin/python -m compileall -q -x '/\.venv/|/data/' . >/dev/null || true
say "environment ready: $(.venv/bin/python -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)')"
