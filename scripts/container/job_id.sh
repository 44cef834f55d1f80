#!/usr/bin/env bash
# Print an id for this container that its restarts keep and other containers do not share:
# container-<12 hex of sha256 of the host directory its /etc/hosts is bind-mounted from>.
# Docker and Podman mount it from the container's own directory (.../containers/<id>/hosts,
# .../containers/<id>/userdata/hosts), the kubelet from the pod's (.../pods/<uid>/etc-hosts):
# kept by `docker restart`, `--restart=always` and a pod's container restarts, also with the
# host's network (where the host name is the host's). Prints nothing outside a container.
#   scripts/container/job_id.sh [MOUNTINFO]   (default /proc/self/mountinfo)
set -euo pipefail
# mountinfo fields (proc(5)): 4 the root of the mount within its file system, 5 the mount point
source=$(awk '$5 == "/etc/hosts" { print $4; exit }' "${1:-/proc/self/mountinfo}")
case $source in
  */containers/*/* | */pods/*/*) printf 'container-%s\n' "$(printf %s "$source" | sha256sum | cut -c1-12)" ;;
  *) ;;
esac
