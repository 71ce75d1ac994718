#!/usr/bin/env bash
# A Docker engine for the sidecar image on a machine that has no running daemon and no Docker Hub access.
# Idempotent: every step is skipped when its result is already there.
#
# Why each step is the way it is (all verified on such a machine):
# - Debian's own packages (docker.io 20.10, docker-compose 1.29, debootstrap) install from the apt mirror the
#   machine already has, where Docker's packages and Hub are out of reach.
# - dockerd runs with --storage-driver=vfs (works on any file system, overlayfs may be unavailable inside a VM or
#   container), --iptables=false and --bridge=none (no bridge networking): images are built and run with the host
#   network, which is what the Makefile does (`docker build --network host`, `docker run --network host`).
# - No base image can be pulled, so a minimal Debian with python3 is built with debootstrap from the same mirror
#   (~1 min, ~300 MB) and imported as LOCAL_BASE_IMAGE; the Dockerfile takes its base as an ARG, so real users keep
#   python:3.11-slim. The image is built from wheels made on the host (`make image`), so pip inside the build needs
#   neither the network nor the host's CA certificates, and with the classic builder (DOCKER_BUILDKIT=0), since
#   Debian's docker.io comes without BuildKit/buildx.
#
# - The compose file's `redis` profile runs `redis:7` from Docker Hub; where it cannot be pulled, LOCAL_REDIS_IMAGE
#   is built from the base image with Debian's redis-server package (7.0, what the tests run against too).
#
#   scripts/docker_engine.sh [up]     install docker.io/docker-compose/debootstrap if missing, start dockerd if
#                                     `docker info` does not answer, build + import the base image if missing,
#                                     build the Redis image if redis:7 is neither here nor pullable
#   scripts/docker_engine.sh status   say what is there
#   scripts/docker_engine.sh stop     stop the dockerd this script started (by its PID file)
#
# Environment:
#   LOCAL_BASE_IMAGE   tag of the Debian-based Python image built with debootstrap (local/debian-python:bookworm)
#   LOCAL_REDIS_IMAGE  tag of the Redis image built from it when redis:7 cannot be had (local/redis:7)
#   DEBIAN_SUITE       suite for debootstrap (default: the host's VERSION_CODENAME, e.g. bookworm)
#   DEBIAN_MIRROR      mirror for debootstrap (default: the one apt already uses, read from /etc/apt/sources.list*)
#   DOCKER_STATE_DIR   where dockerd's log and PID file go (/tmp/slime-gateway-docker)
#   DOCKERD_ARGS       extra dockerd flags
set -euo pipefail

LOCAL_BASE_IMAGE=${LOCAL_BASE_IMAGE:-local/debian-python:bookworm}
LOCAL_REDIS_IMAGE=${LOCAL_REDIS_IMAGE:-local/redis:7}
OFFICIAL_REDIS_IMAGE=redis:7
DOCKER_STATE_DIR=${DOCKER_STATE_DIR:-/tmp/slime-gateway-docker}
DOCKERD_LOG=$DOCKER_STATE_DIR/dockerd.log
DOCKERD_PID=$DOCKER_STATE_DIR/dockerd.pid
DOCKERD_READY_TIMEOUT_S=${DOCKERD_READY_TIMEOUT_S:-60}

step() { echo "==> docker_engine: $*"; }
info() { echo "    $*"; }
die() { echo "!! docker_engine: $*" >&2; exit 1; }

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || die "not root and no sudo: run as root to install packages and start dockerd"
  SUDO=(sudo)
fi

host_codename() {
  # shellcheck disable=SC1091
  (. /etc/os-release && echo "${VERSION_CODENAME:-}")
}

# The Debian mirror apt already uses: the first URI serving "<suite>" (not -security/-updates) in the deb822
# files under /etc/apt/sources.list.d/*.sources or the one-line entries of /etc/apt/sources.list{,.d/*.list}.
debian_mirror() {
  local suite=$1 files=()
  shopt -s nullglob
  files=(/etc/apt/sources.list.d/*.sources)
  shopt -u nullglob
  if [ ${#files[@]} -gt 0 ]; then
    awk -v suite="$suite" '
      function flush() { if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && uris != "") {
                           split(uris, u, " "); print u[1]; found = 1; exit } types = suites = uris = "" }
      /^[ \t]*$/        { flush(); next }
      /^[ \t]*#/        { next }
      /^Types:/         { sub(/^Types:[ \t]*/, "");  types = $0 }
      /^Suites:/        { sub(/^Suites:[ \t]*/, ""); suites = $0 }
      /^URIs:/          { sub(/^URIs:[ \t]*/, "");   uris = $0 }
      END               { if (!found) flush() }
    ' "${files[@]}" | head -n1 && return 0
  fi
  shopt -s nullglob
  files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list)
  shopt -u nullglob
  [ ${#files[@]} -gt 0 ] || return 0
  # "deb [options] URI SUITE COMPONENTS..."
  awk -v suite="$suite" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                                       if ($(i + 1) == suite) { print $i; exit } }' "${files[@]}" 2>/dev/null | head -n1
}

engine_answers() { docker info >/dev/null 2>&1; }

install_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  if [ ${#missing[@]} -eq 0 ]; then
    step "packages: docker.io, docker-compose, debootstrap already installed"
    return
  fi
  step "installing ${missing[*]} with apt-get (apt-get update first)"
  "${SUDO[@]}" apt-get update -qq
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  info "installed: $(dockerd --version 2>/dev/null || echo '?')"
}

start_engine() {
  if engine_answers; then
    step "engine: dockerd already answers ($(docker version -f '{{.Server.Version}}' 2>/dev/null || echo '?'))"
    return
  fi
  mkdir -p "$DOCKER_STATE_DIR"
  # No bridge and no iptables here (no bridge networking on this machine); vfs works on any filesystem.
  local args=(--storage-driver=vfs --iptables=false --bridge=none)
  # shellcheck disable=SC2206
  args+=(${DOCKERD_ARGS:-})
  step "engine: starting dockerd ${args[*]} (log: $DOCKERD_LOG)"
  # setsid: the daemon outlives this script (and make); its PID is kept for `stop`.
  "${SUDO[@]}" setsid dockerd "${args[@]}" >"$DOCKERD_LOG" 2>&1 </dev/null &
  echo $! >"$DOCKERD_PID"
  local waited=0
  until engine_answers; do
    if ! kill -0 "$(cat "$DOCKERD_PID")" 2>/dev/null; then
      tail -n 30 "$DOCKERD_LOG" >&2 || true
      die "dockerd exited during startup (log above)"
    fi
    [ "$waited" -lt "$DOCKERD_READY_TIMEOUT_S" ] || die "dockerd not ready after ${DOCKERD_READY_TIMEOUT_S} s (see $DOCKERD_LOG)"
    sleep 1
    waited=$((waited + 1))
  done
  info "dockerd ready after ~${waited} s (pid $(cat "$DOCKERD_PID"))"
}

build_base_image() {
  if docker image inspect "$LOCAL_BASE_IMAGE" >/dev/null 2>&1; then
    step "base image: $LOCAL_BASE_IMAGE already there ($(docker image inspect -f '{{.Size}}' "$LOCAL_BASE_IMAGE") bytes)"
    return
  fi
  local suite=${DEBIAN_SUITE:-$(host_codename)}
  [ -n "$suite" ] || die "cannot tell the Debian suite: set DEBIAN_SUITE (e.g. bookworm)"
  local mirror=${DEBIAN_MIRROR:-$(debian_mirror "$suite")}
  [ -n "$mirror" ] || die "no Debian mirror for '$suite' in /etc/apt/sources.list*: set DEBIAN_MIRROR"
  local rootfs
  rootfs=$(mktemp -d "${TMPDIR:-/tmp}/debian-python-rootfs.XXXXXX")
  # shellcheck disable=SC2064
  trap "${SUDO[*]} rm -rf '$rootfs'" EXIT
  step "base image: debootstrap $suite from $mirror into $rootfs (about a minute)"
  local started=$SECONDS
  "${SUDO[@]}" debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$suite" "$rootfs" "$mirror" >"$DOCKER_STATE_DIR/debootstrap.log" 2>&1 \
    || { tail -n 30 "$DOCKER_STATE_DIR/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  # mktemp made the directory 0700: it becomes the image's "/", which every user must be able to traverse.
  "${SUDO[@]}" chmod 0755 "$rootfs"
  # Downloaded .debs and package lists are not needed at run time.
  "${SUDO[@]}" rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  step "base image: importing as $LOCAL_BASE_IMAGE"
  # An imported root file system has no image config: give it the PATH and CMD a python image has.
  "${SUDO[@]}" tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$LOCAL_BASE_IMAGE" >/dev/null
  info "built in $((SECONDS - started)) s: $(docker image inspect -f '{{.Size}}' "$LOCAL_BASE_IMAGE") bytes," \
       "$(docker run --rm --network host "$LOCAL_BASE_IMAGE" python3 --version)"
}

build_redis_image() {
  local image
  for image in "$OFFICIAL_REDIS_IMAGE" "$LOCAL_REDIS_IMAGE"; do
    if docker image inspect "$image" >/dev/null 2>&1; then
      step "redis image: $image already there"
      return
    fi
  done
  if docker pull "$OFFICIAL_REDIS_IMAGE" >/dev/null 2>&1; then
    step "redis image: pulled $OFFICIAL_REDIS_IMAGE"
    return
  fi
  step "redis image: $OFFICIAL_REDIS_IMAGE cannot be pulled; building $LOCAL_REDIS_IMAGE from $LOCAL_BASE_IMAGE (Debian's redis-server)"
  # The imported base keeps debootstrap's /etc/apt/sources.list (its mirror); its package lists were removed.
  DOCKER_BUILDKIT=0 docker build --quiet --network host --tag "$LOCAL_REDIS_IMAGE" - >/dev/null <<DOCKERFILE
FROM $LOCAL_BASE_IMAGE
RUN apt-get update -qq \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null \\
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
USER redis
WORKDIR /var/lib/redis
CMD ["redis-server"]
DOCKERFILE
  info "built: $(docker run --rm --network host "$LOCAL_REDIS_IMAGE" redis-server --version | cut -d' ' -f1-3)"
}

status() {
  if engine_answers; then
    echo "engine: up ($(docker version -f '{{.Server.Version}}' 2>/dev/null))"
  else
    echo "engine: down"
  fi
  if [ -f "$DOCKERD_PID" ]; then echo "dockerd started by this script: pid $(cat "$DOCKERD_PID")"; fi
  if engine_answers && docker image inspect "$LOCAL_BASE_IMAGE" >/dev/null 2>&1; then
    echo "base image: $LOCAL_BASE_IMAGE"
  else
    echo "base image: $LOCAL_BASE_IMAGE missing (or engine down)"
  fi
  for image in "$OFFICIAL_REDIS_IMAGE" "$LOCAL_REDIS_IMAGE"; do
    if engine_answers && docker image inspect "$image" >/dev/null 2>&1; then echo "redis image: $image"; fi
  done
}

stop_engine() {
  if [ ! -f "$DOCKERD_PID" ]; then
    step "stop: no PID file ($DOCKERD_PID): this script did not start a dockerd; nothing to do"
    return
  fi
  local pid
  pid=$(cat "$DOCKERD_PID")
  if kill -0 "$pid" 2>/dev/null; then
    step "stop: stopping dockerd (pid $pid)"
    "${SUDO[@]}" kill -TERM "$pid"
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then die "dockerd (pid $pid) still running after 30 s"; fi
  else
    step "stop: dockerd (pid $pid) is not running"
  fi
  rm -f "$DOCKERD_PID"
}

case "${1:-up}" in
  up)
    install_packages
    start_engine
    build_base_image
    build_redis_image
    ;;
  status) status ;;
  stop) stop_engine ;;
  *) die "usage: $0 [up|status|stop]" ;;
esac
