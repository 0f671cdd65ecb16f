#!/usr/bin/env bash
# Build (or reuse) the Kubernetes test-tier binaries: kube-apiserver and kube-controller-manager 1.20.2 from
# Debian's `kubernetes` source package, plus etcd (etcd-server), kubectl (kubernetes-client) and Prometheus from
# Debian binaries. Idempotent: the Go build is skipped when the cache already holds the binaries.
# Why from source: Debian bookworm ships only the client; the server binaries come from the same source package.
#
#   build.sh          the control plane (what the control-plane-only tests need)
#   build.sh node     + a node: kubelet, kube-scheduler, kube-proxy (same tree, +3.5 min), the pause binary (gcc -static
#                     from the tree's build/pause/linux/pause.c) and Debian's docker.io, containerd, runc, tini,
#                     iptables, conntrack, debootstrap (tests/k8s/cluster.py's node; images: scripts/k8s/images.sh)
set -euo pipefail

MODE="${1:-control-plane}"
case "$MODE" in control-plane|node) ;; *) echo "usage: build.sh [node]" >&2; exit 2;; esac

K8S_VERSION="${K8S_VERSION:-1.20.2}"
HOME="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}"
export HOME
CACHE="${MIXPLANE_K8S_CACHE:-$HOME/.cache/mixplane/k8s-$K8S_VERSION}"
BIN="$CACHE/bin"
SRC="$CACHE/src"
export DEBIAN_FRONTEND=noninteractive

log() { echo "[k8s-build $(date -u +%H:%M:%S)] $*"; }

# one build at a time (parallel test sessions may all find the cache empty)
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

need_apt=()
pkgs=(etcd-server prometheus rsync golang-go golang-github-modern-go-reflect2-dev dpkg-dev)
targets=(kube-apiserver kube-controller-manager)
if [ "$MODE" = node ]; then
  pkgs+=(docker.io containerd runc tini iptables nftables conntrack debootstrap gcc libc6-dev iproute2 openssl)
  targets+=(kubelet kube-scheduler kube-proxy)
fi
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p")
done
# kubectl: Debian's kubernetes-client, unless some kubectl is already on PATH (its package may own /usr/bin/kubectl).
if ! command -v kubectl >/dev/null 2>&1; then need_apt+=(kubernetes-client); fi

apt_updated=0
apt_update() { if [ "$apt_updated" = 0 ]; then apt-get update -qq -o DPkg::Lock::Timeout=600; apt_updated=1; fi; }

if [ "${#need_apt[@]}" -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  apt_update
  # (another apt may be running: wait for its lock rather than fail)
  apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "${need_apt[@]}" >/dev/null
fi

missing=()
for b in "${targets[@]}"; do [ -x "$BIN/$b" ] || missing+=("$b"); done
if [ "${#missing[@]}" -eq 0 ] && { [ "$MODE" != node ] || [ -x "$BIN/pause" ]; }; then
  log "cached: $BIN"
  exit 0
fi

# deb-src line for the same archive (and suite) as the machine's main deb line.
if ! grep -rqs '^Types:.*deb-src\|^deb-src ' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    suites=$(awk '/^Suites:/{$1=""; print; exit}' /etc/apt/sources.list.d/debian.sources)
    keyring=$(awk '/^Signed-By:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    { echo "Types: deb-src"; echo "URIs: $uri"; echo "Suites:$suites"; echo "Components: main";
      [ -n "$keyring" ] && echo "Signed-By: $keyring"; } > /etc/apt/sources.list.d/mixplane-src.sources
  else
    line=$(grep -m1 '^deb ' /etc/apt/sources.list)
    echo "deb-src ${line#deb }" > /etc/apt/sources.list.d/mixplane-src.list
  fi
  apt_updated=0
fi
apt_update

mkdir -p "$SRC" "$BIN"
cd "$SRC"
if [ ! -f .extracted ]; then  # (a run killed mid-extraction leaves no stamp: fetch again)
  rm -rf kubernetes-* kubernetes_*
  log "apt-get source kubernetes"
  apt-get source -qq kubernetes >/dev/null
  touch .extracted
fi
srcdir=$(ls -d kubernetes-*/ | head -1)
srcdir="$SRC/${srcdir%/}"
log "source: $srcdir"

# The vendored reflect2 1.0.1 segfaults in map iteration under Go 1.19: use Debian's 1.0.2.
r2=/usr/share/gocode/src/github.com/modern-go/reflect2
vr2="$srcdir/vendor/github.com/modern-go/reflect2"
rm -f "$vr2"/*.go "$vr2"/*.s
cp "$r2"/*.go "$vr2"/
cp "$r2"/*.s "$vr2"/ 2>/dev/null || true
rm -f "$vr2"/*_test.go

# GOPATH laid out as debian/rules does: the tree is reachable as $GOPATH/src/k8s.io/kubernetes.
export GOPATH="$CACHE/gopath"
mkdir -p "$GOPATH/src/k8s.io"
ln -sfn "$srcdir" "$GOPATH/src/k8s.io/kubernetes"
export GOCACHE="${GOCACHE:-$HOME/.cache/mixplane/go-build}"
export CGO_ENABLED=0
export GO111MODULE="${GO111MODULE:-off}"
export GOFLAGS="${GOFLAGS:-}"
export KUBE_GIT_VERSION="v$K8S_VERSION" KUBE_GIT_TREE_STATE=clean
cd "$GOPATH/src/k8s.io/kubernetes"
if [ "${#missing[@]}" -gt 0 ]; then
  what="${missing[*]/#/cmd/}"
  log "make WHAT=$what (go $(go env GOVERSION))"
  make WHAT="$what"
  for b in "${missing[@]}"; do
    f=$(find _output -type f -name "$b" -perm -u+x | head -1)
    install -m 0755 "$f" "$BIN/$b"
  done
fi
if [ "$MODE" = node ] && [ ! -x "$BIN/pause" ]; then
  # the sandbox image's only binary, from the same tree (kubelet 1.20's default image is k8s.gcr.io/pause:3.2)
  gcc -Os -static -DVERSION=v3.2-mixplane -o "$BIN/pause.tmp" build/pause/linux/pause.c
  strip "$BIN/pause.tmp" 2>/dev/null || true
  mv "$BIN/pause.tmp" "$BIN/pause"
fi
log "built: $(ls "$BIN")"
