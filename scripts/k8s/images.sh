#!/usr/bin/env bash
# Build (or reuse) every image the k8s tier's node runs; nothing is pulled from a registry (none is reachable).
#
#   mixplane-python:bookworm  the base: `debootstrap --variant=minbase` of Debian 12 (python3 3.11, venv, CA
#                             certificates + this machine's extra CAs from /usr/local/share/ca-certificates)
#   k8s.gcr.io/pause:3.2      the sandbox image, its one static binary compiled by build.sh from the k8s tree
#   mixplane:0.1.0            the project's Dockerfile, unchanged, FROM the base above (PYTHON_IMAGE)
#   mixplane-trainer:0.1.0    the project's image + the client's torch extra (the CPU torch wheel of this machine
#                             when /opt/wheels has it, else torch from PyPI) for the end-to-end trainer pods
#
# Images live in a Docker data-root of their own, ~/.cache/mixplane/docker (the node's dockerd uses the same one;
# ~/.cache/mixplane/docker.lock keeps the two apart). It starts a dockerd of its own on it (no bridge, no iptables,
# its own exec-root and pidfile) and stops it by pid. (Not the test node's dockerd: its builds could not reach the
# package index, by the node's network discipline.) Idempotent: debootstrap runs once
# (its tarball is cached), `docker build` reuses its layers.
#   MIXPLANE_IMAGES="base pause project trainer"  which to build (default all)
#   MIXPLANE_IMAGES_COLD=1                          rebuild the project and trainer images without the layer cache
set -euo pipefail

HOME="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}"
export HOME
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
K8S_CACHE="${MIXPLANE_K8S_CACHE:-$HOME/.cache/mixplane/k8s-1.20.2}"
IMG_CACHE="$HOME/.cache/mixplane/images"
DATA_ROOT="${MIXPLANE_DOCKER_ROOT:-$HOME/.cache/mixplane/docker}"
DOCKER=/usr/bin/docker  # Debian's client (a newer /usr/local/bin/docker may come first on PATH)
BASE_TAG=mixplane-python:bookworm
PAUSE_TAG=k8s.gcr.io/pause:3.2
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)
PROJECT_TAG="mixplane:$VERSION"
TRAINER_TAG="mixplane-trainer:$VERSION"
TORCH_PIN=$(grep -o 'torch==[0-9.]*' "$REPO/pyproject.toml" | head -1)
WANT="${MIXPLANE_IMAGES:-base pause project trainer}"
NOCACHE=""
if [ -n "${MIXPLANE_IMAGES_COLD:-}" ]; then NOCACHE="--no-cache"; fi
MIRROR="${MIXPLANE_DEBIAN_MIRROR:-}"
export DEBIAN_FRONTEND=noninteractive

log() { echo "[k8s-images $(date -u +%H:%M:%S)] $*"; }
want() { [[ " $WANT " == *" $1 "* ]]; }

# docker.io, debootstrap, the pause binary (build.sh waits for a build already running)
if ! [ -x /usr/sbin/dockerd ] || ! [ -x /usr/sbin/debootstrap ] || { want pause && ! [ -x "$K8S_CACHE/bin/pause" ]; }; then
  bash "$HERE/build.sh" node
fi

mkdir -p "$IMG_CACHE" "$DATA_ROOT"
exec 7>"$IMG_CACHE/.lock"  # one build of the cache at a time
flock 7

# ---- the base rootfs (no dockerd needed) ----
if want base && [ ! -f "$IMG_CACHE/base.tar" ]; then
  if [ -z "$MIRROR" ]; then
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
      MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    else
      MIRROR=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
    fi
  fi
  root="$IMG_CACHE/rootfs.tmp"
  rm -rf "$root"
  log "debootstrap bookworm from $MIRROR (~3 min)"
  t0=$(date +%s)
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$MIRROR" > "$IMG_CACHE/debootstrap.log" 2>&1 \
    || { tail -30 "$IMG_CACHE/debootstrap.log"; exit 1; }
  # pip inside `docker build` verifies TLS against this machine's CAs (an egress proxy may sign with its own)
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  fi
  chroot "$root" update-ca-certificates >/dev/null
  # trim: docs, man pages, locales, apt's lists and caches (~60 MB)
  rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/cache/apt/* \
    "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/usr/share/locale/*
  find "$root/usr/share/locale" "$root/usr/lib/python3.11" -name '__pycache__' -prune -exec rm -rf {} + 2>/dev/null || true
  tar -C "$root" --numeric-owner -cf "$IMG_CACHE/base.tar.tmp" .
  mv "$IMG_CACHE/base.tar.tmp" "$IMG_CACHE/base.tar"
  rm -rf "$root"
  log "base rootfs: $(du -h "$IMG_CACHE/base.tar" | cut -f1) in $(( $(date +%s) - t0 )) s"
fi

# ---- a dockerd of our own on the cache's data-root ----
RUN=""
stop_dockerd() {
  [ -n "$RUN" ] || return 0
  if [ -f "$RUN/docker.pid" ]; then
    pid=$(cat "$RUN/docker.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  # whatever dockerd left mounted under its exec-root
  { grep -o " $RUN/[^ ]*" /proc/self/mountinfo || true; } | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$RUN"
}
exec 8>"$HOME/.cache/mixplane/docker.lock"  # the data-root's lock (a running test node holds it)
flock 8
RUN=$(mktemp -d /tmp/mixplane-dockerd.XXXXXX)
trap stop_dockerd EXIT
cat > "$RUN/daemon.json" <<EOF
{"data-root": "$DATA_ROOT", "exec-root": "$RUN/exec", "pidfile": "$RUN/docker.pid",
 "hosts": ["unix://$RUN/docker.sock"], "storage-driver": "overlay2", "exec-opts": ["native.cgroupdriver=cgroupfs"],
 "bridge": "none", "iptables": false, "ip-forward": false, "ip-masq": false, "ip6tables": false,
 "default-runtime": "mixplane-runc", "runtimes": {"mixplane-runc": {"path": "$HERE/runc-clamp"}}}
EOF
/usr/sbin/dockerd --config-file "$RUN/daemon.json" > "$RUN/dockerd.log" 2>&1 7>&- 8>&- &
export DOCKER_HOST="unix://$RUN/docker.sock"
for _ in $(seq 1 300); do $DOCKER version >/dev/null 2>&1 && break; sleep 0.2; done
$DOCKER version >/dev/null 2>&1 || { tail -30 "$RUN/dockerd.log"; exit 1; }

have() { $DOCKER image inspect "$1" >/dev/null 2>&1; }

if want base && ! have "$BASE_TAG"; then
  log "docker import $BASE_TAG"
  $DOCKER import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' -c 'ENV LANG=C.UTF-8' \
    "$IMG_CACHE/base.tar" "$BASE_TAG" >/dev/null
fi

if want pause && ! have "$PAUSE_TAG"; then
  ctx=$(mktemp -d)
  cp "$K8S_CACHE/bin/pause" "$ctx/pause"
  tar -C "$ctx" --numeric-owner --owner=0 --group=0 -cf - pause \
    | $DOCKER import -c 'ENTRYPOINT ["/pause"]' -c 'USER 65535:65535' - "$PAUSE_TAG" >/dev/null
  rm -rf "$ctx"
  log "pause image $PAUSE_TAG"
fi

if want project; then
  t0=$(date +%s)
  log "docker build $PROJECT_TAG (Dockerfile, PYTHON_IMAGE=$BASE_TAG)"
  # the build context: what the Dockerfile copies, nothing else (a worktree's .venv would be GBs)
  ctx=$(mktemp -d)
  cp "$REPO/Dockerfile" "$REPO/pyproject.toml" "$REPO/README.md" "$ctx/"
  cp -r "$REPO/src" "$ctx/src"
  find "$ctx/src" -name '__pycache__' -prune -exec rm -rf {} +
  find "$ctx/src" -name '*.egg-info' -prune -exec rm -rf {} +
  find "$ctx" -exec touch -h -d 2020-01-01 {} +  # fixed mtimes: a fresh copy must not look changed to the layer cache
  # the build stage tagged too: untagged, `image prune` below would remove it and with it the layer cache
  for target in "--target build -t ${PROJECT_TAG}-build" "-t $PROJECT_TAG"; do
    # shellcheck disable=SC2086
    $DOCKER build -q $NOCACHE --network host --build-arg "PYTHON_IMAGE=$BASE_TAG" $target "$ctx" >/dev/null \
      || { $DOCKER build --network host --build-arg "PYTHON_IMAGE=$BASE_TAG" $target "$ctx" 2>&1 | tail -40; exit 1; }
  done
  rm -rf "$ctx"
  log "$PROJECT_TAG: $(( $(date +%s) - t0 )) s, $($DOCKER image inspect -f '{{.Size}}' "$PROJECT_TAG") bytes"
fi

if want trainer; then
  t0=$(date +%s)
  ctx=$(mktemp -d)
  wheel=$(ls /opt/wheels/torch-"${TORCH_PIN#torch==}"+cpu-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then cp "$wheel" "$ctx/"; fi
  cp "$HERE/trainer.Dockerfile" "$ctx/Dockerfile"
  find "$ctx" -exec touch -h -d 2020-01-01 {} +
  log "docker build $TRAINER_TAG (${wheel:-$TORCH_PIN from PyPI})"
  $DOCKER build -q $NOCACHE --network host --build-arg "BASE=$PROJECT_TAG" --build-arg "TORCH=$TORCH_PIN" -t "$TRAINER_TAG" "$ctx" >/dev/null \
    || { $DOCKER build --network host --build-arg "BASE=$PROJECT_TAG" --build-arg "TORCH=$TORCH_PIN" -t "$TRAINER_TAG" "$ctx" 2>&1 | tail -40; exit 1; }
  rm -rf "$ctx"
  log "$TRAINER_TAG: $(( $(date +%s) - t0 )) s, $($DOCKER image inspect -f '{{.Size}}' "$TRAINER_TAG") bytes"
fi

$DOCKER image prune -f >/dev/null  # dangling layers of former builds
log "images: $($DOCKER images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | tr '\n' ' ')"
