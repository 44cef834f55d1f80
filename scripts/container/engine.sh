# Sourced by the container scripts: pick the engine and the options every call needs.
#   ENGINE   podman, docker or buildah (default: the first one installed, in that order)
if [[ -z ${ENGINE:-} ]]; then
  for candidate in podman docker buildah; do
    if command -v "$candidate" >/dev/null; then ENGINE=$candidate; break; fi
  done
fi
[[ -n ${ENGINE:-} ]] || { echo "${0##*/}: no container engine (podman, docker or buildah)" >&2; exit 2; }
case $ENGINE in
  podman|buildah|docker) ;;
  *) echo "${0##*/}: ENGINE=$ENGINE: use podman, docker or buildah" >&2; exit 2 ;;
esac
# Options for podman and buildah (build and run) on hosts like CI sandboxes:
# - a root without CAP_SYS_RESOURCE cannot raise the open-files and process limits to Podman's
#   defaults: ask for 20000 and 32768 (or the caller's hard limit, if lower) instead;
# - crun refuses hosts whose cgroups are in hybrid mode (v1 controllers plus an empty
#   /sys/fs/cgroup/unified): runc works there.
ENGINE_OPTS=()
if [[ $ENGINE != docker ]]; then
  cap() { local hard=$1 want=$2; [[ $hard == unlimited || $hard -ge $want ]] && echo "$want" || echo "$hard"; }
  nofile=$(cap "$(ulimit -Hn)" 20000) nproc=$(cap "$(ulimit -Hu)" 32768)
  ENGINE_OPTS=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
  if [[ -d /sys/fs/cgroup/unified ]] && command -v runc >/dev/null; then
    ENGINE_OPTS+=(--runtime "$(command -v runc)")
  fi
fi
