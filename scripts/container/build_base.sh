#!/usr/bin/env bash
# A Debian 12 (bookworm) base image from the Debian package archive alone, for machines that
# reach a Debian mirror but no container registry: debootstrap a minimal root file system and
# import it as an image. Pass it to build.sh as BASE; where a registry is reachable,
# debian:bookworm-slim does the same job.
#   scripts/container/build_base.sh [IMAGE]      (default: localhost/debian:bookworm-debootstrap)
# MIRROR (default http://deb.debian.org/debian) and SECURITY_MIRROR name the archive; ENGINE
# the container engine (see engine.sh). Needs root and debootstrap (apt-get install debootstrap).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./engine.sh
image=${1:-localhost/debian:bookworm-debootstrap}
mirror=${MIRROR:-http://deb.debian.org/debian}
security=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
[[ $(id -u) -eq 0 ]] || { echo "build_base.sh: debootstrap needs root" >&2; exit 2; }
command -v debootstrap >/dev/null \
  || { echo "build_base.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }

root=$(mktemp -d /var/tmp/bookworm-root.XXXXXX)
container=""
cleanup() {
  rm -rf "$root" "$root.tar"
  if [[ -n $container ]]; then buildah rm "$container" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
debootstrap --variant=minbase bookworm "$root" "$mirror" >&2
# The same package sources as debian:bookworm-slim: updates and security fixes as well.
cat > "$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
SOURCES
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log
# debootstrap copies this machine's DNS settings and name in: an image must not carry them.
: > "$root/etc/resolv.conf"
rm -f "$root/etc/hostname"
case $ENGINE in
  podman|docker) tar -C "$root" --numeric-owner -c . | "$ENGINE" import - "$image" >/dev/null ;;
  buildah)  # buildah add unpacks an archive, but reads none from standard input
    tar -C "$root" --numeric-owner -cf "$root.tar" .
    container=$(buildah from scratch)
    buildah add "$container" "$root.tar" / >/dev/null
    buildah commit --rm "$container" "$image" >/dev/null
    container="" ;;
esac
echo "$image"
