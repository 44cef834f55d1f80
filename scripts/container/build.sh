#!/usr/bin/env bash
# Build the training image from the Containerfile at the repository root.
#   scripts/container/build.sh [IMAGE]           (default: ddp-pipeline:latest)
# Settings (environment):
#   ENGINE            podman, docker or buildah (default: the first one installed)
#   BASE              the Debian 12 image to start from (default: debian:bookworm-slim from a
#                     registry; scripts/container/build_base.sh makes one without a registry)
#   EXTRA_CA_CERTS    a PEM file of certificates to trust while building (a network that
#                     intercepts HTTPS); used for the downloads only, not kept in the image
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./engine.sh
cd ../..
image=${1:-ddp-pipeline:latest}
if [[ -v BASE && -z $BASE ]]; then
  echo "build.sh: BASE is set but empty (did build_base.sh fail?)" >&2; exit 2
fi
args=(--build-arg "BASE=${BASE:-debian:bookworm-slim}")
if [[ -n ${EXTRA_CA_CERTS:-} ]]; then
  [[ -r $EXTRA_CA_CERTS ]] || { echo "build.sh: EXTRA_CA_CERTS=$EXTRA_CA_CERTS is not a readable file" >&2; exit 2; }
  grep -q "BEGIN CERTIFICATE" "$EXTRA_CA_CERTS" \
    || { echo "build.sh: EXTRA_CA_CERTS=$EXTRA_CA_CERTS holds no PEM certificate" >&2; exit 2; }
  args+=(--build-arg "EXTRA_CA_CERTS=$(cat "$EXTRA_CA_CERTS")")
fi
case $ENGINE in
  # --layers=false: no cached stage images, which would keep EXTRA_CA_CERTS in their history.
  podman|buildah) "$ENGINE" build "${ENGINE_OPTS[@]}" --layers=false --network=host -f Containerfile -t "$image" "${args[@]}" . ;;
  docker) docker build --network=host -f Containerfile -t "$image" "${args[@]}" . ;;
esac
