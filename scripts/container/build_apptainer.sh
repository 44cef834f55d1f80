#!/usr/bin/env bash
# Build the Apptainer image (scripts/container/ddp-pipeline.def) from this checkout's files:
# the tracked ones and untracked ones git does not ignore (never .venv, runs/, data/).
#   scripts/container/build_apptainer.sh [OUTPUT.sif]      (default: ddp-pipeline.sif)
# EXTRA_CA_CERTS: a PEM file to trust while downloading (a network that intercepts HTTPS).
# Needs apptainer and debootstrap; root, or --fakeroot where the site allows it
# (APPTAINER_BUILD_OPTIONS="--fakeroot").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=$(realpath -m "${1:-ddp-pipeline.sif}")
command -v apptainer >/dev/null || { echo "build_apptainer.sh: apptainer is not installed" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ddp-apptainer.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
  | tar --null -T - -cf - | tar -x -C "$work/src"
: > "$work/ca.pem"
if [[ -n ${EXTRA_CA_CERTS:-} ]]; then
  grep -q "BEGIN CERTIFICATE" "$EXTRA_CA_CERTS" 2>/dev/null \
    || { echo "build_apptainer.sh: EXTRA_CA_CERTS=$EXTRA_CA_CERTS holds no PEM certificate" >&2; exit 2; }
  cp "$EXTRA_CA_CERTS" "$work/ca.pem"
fi
# shellcheck disable=SC2086  # options, split on purpose
apptainer build ${APPTAINER_BUILD_OPTIONS:-} --build-arg "SRC=$work/src" \
  --build-arg "EXTRA_CA_CERTS=$work/ca.pem" "$out" scripts/container/ddp-pipeline.def
