#!/usr/bin/env bash
# An arm64 (aarch64) SuperNode root and image built on an x86-64 host without any image registry
# (only a Debian mirror and a Python package index are reached):
#   1. `debootstrap --arch=arm64 --foreign`-style bootstrap through qemu-aarch64-static (binfmt):
#      Debian bookworm minbase with python3 and a venv at /opt/venv;
#   2. natively on the host, uv resolves docker/client-requirements.txt for aarch64 with
#      torch==2.10.0 (PyPI's last CPU-only aarch64 wheel) and pip downloads those wheels; the
#      root's pip (under emulation) only installs them: offline, --no-deps, no byte-compiling; the
#      project's packages (docker/sources.py: pyproject.toml's, as every image) go to /app, on the venv's
#      path through a .pth file;
#   3. a tarball of the root, and `docker import --platform linux/arm64` as flchurn-client:arm64
#      (relabelled through docker save/load where the engine ignores --platform)
#      when a Docker engine answers (otherwise the root and the tarball stay, and it says so).
# The root is cached outside the repository (ARM64_CACHE, default /var/cache/flchurn-arm64):
# a rerun skips step 1 (FORCE_ROOT=1 redoes it) and reinstalls only the project's code.
# Emulation is ~8x slower than native: never time anything in this root.
# Usage: sudo docker/build-arm64.sh
#   apt-get install qemu-user-static binfmt-support debootstrap   (Debian 12) first.
# Variables (defaults): ARM64_CACHE (/var/cache/flchurn-arm64), FLCHURN_ARM64_IMAGE
#   (flchurn-client:arm64), DEBIAN_MIRROR (http://deb.debian.org/debian), PIP_INDEX_URL (host
#   pip's index-url, else https://pypi.org/simple).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${ARM64_CACHE:-/var/cache/flchurn-arm64}"
ROOT="$CACHE/rootfs"
TARBALL="$CACHE/flchurn-client-arm64.tar"
WHEELS="$CACHE/wheels"
IMAGE="${FLCHURN_ARM64_IMAGE:-flchurn-client:arm64}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
QEMU=/usr/bin/qemu-aarch64-static

fail() { echo "build-arm64.sh: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || fail "debootstrap and chroot need root: run with sudo"
command -v debootstrap >/dev/null || fail "no debootstrap: apt-get install debootstrap"
[[ -x $QEMU ]] || fail "no $QEMU: apt-get install qemu-user-static binfmt-support"
ls /proc/sys/fs/binfmt_misc/ 2>/dev/null | grep -q aarch64 ||
  fail "no qemu-aarch64 binfmt handler registered: apt-get install binfmt-support; update-binfmts --enable qemu-aarch64"
if [[ -z "${PIP_INDEX_URL:-}" ]]; then
  PIP_INDEX_URL="$(python3 -m pip config get global.index-url 2>/dev/null || true)"
  PIP_INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}"
fi

mounted=()
cleanup() {  # never leave the chroot's binds behind, whatever failed
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" || true; done
}
trap cleanup EXIT
in_root() {
  local m
  for m in proc sys dev; do
    if ! grep -q " $ROOT/$m " /proc/mounts; then mount --bind "/$m" "$ROOT/$m"; mounted+=("$ROOT/$m"); fi
  done
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  nice -n 10 chroot "$ROOT" /usr/bin/env -i PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    PIP_CERT="$CA_BUNDLE" PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}

mkdir -p "$CACHE"
t0=$(date +%s)
DONE="$ROOT/.flchurn-deps-installed"  # written last: a root cut short is redone, never reused
if [[ -n "${FORCE_ROOT:-}" || ! -e "$DONE" ]]; then
  rm -rf "$ROOT"
  echo "== debootstrap --arch=arm64 bookworm -> $ROOT ($DEBIAN_MIRROR)"
  nice -n 10 debootstrap --arch=arm64 --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$ROOT" "$DEBIAN_MIRROR"
  [[ -r "$CA_BUNDLE" ]] && cp "$CA_BUNDLE" "$ROOT$CA_BUNDLE"
  in_root python3 -m venv /opt/venv
  # pip under emulation is ~8x slower at resolving and byte-compiling: the host's own pip picks and
  # downloads the aarch64 wheels natively, the emulated pip only unpacks them (offline, no .pyc).
  echo "== resolve the client requirements for aarch64 / CPython 3.11 (natively, uv)"
  # pip on the host would evaluate markers for x86-64 (torch's CUDA wheels); uv resolves for the
  # target platform. The torch lines of client-requirements.txt go: 2.10.0 is named instead.
  [[ -x "$CACHE/uv-venv/bin/uv" ]] || { python3 -m venv "$CACHE/uv-venv" && "$CACHE/uv-venv/bin/pip" install --quiet uv; }
  { echo "torch==2.10.0"; grep -v '^torch' docker/client-requirements.txt; } > "$CACHE/requirements-aarch64.in"
  "$CACHE/uv-venv/bin/uv" pip compile --quiet --index-url "$PIP_INDEX_URL" --python-platform aarch64-manylinux_2_28 \
    --python-version 3.11 --no-header --no-annotate "$CACHE/requirements-aarch64.in" -o "$CACHE/requirements-aarch64.txt"
  echo "== download those aarch64 wheels (natively)"
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  python3 -m pip download --quiet --no-deps --index-url "$PIP_INDEX_URL" --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 --platform linux_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
    -d "$WHEELS" -r "$CACHE/requirements-aarch64.txt"
  echo "== pip install $(ls "$WHEELS" | wc -l) wheels ($(du -sh "$WHEELS" | cut -f1)) under emulation: offline, no .pyc"
  cp "$CACHE/requirements-aarch64.txt" "$ROOT/tmp/client-requirements.txt"
  mkdir -p "$ROOT/tmp/wheels" && cp "$WHEELS"/* "$ROOT/tmp/wheels/"
  in_root pip install --no-index --no-deps --find-links /tmp/wheels --no-compile -r /tmp/client-requirements.txt
  rm -rf "$ROOT/tmp/wheels"
  in_root apt-get clean
  rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/*
  touch "$DONE"
else
  echo "== $ROOT exists (FORCE_ROOT=1 rebuilds it)"
fi
t1=$(date +%s)

echo "== the project's packages (docker/sources.py) -> $ROOT/app"
rm -rf "$ROOT/app" && mkdir -p "$ROOT/app" "$ROOT/state" "$ROOT/data"
# the project's sources: pyproject.toml's hatch packages (docker/sources.py, the one list of every image)
python3 docker/sources.py --copy . "$ROOT/app"
# a .pth line, not `pip install .`: a build under emulation would fetch setuptools and compile
echo /app > "$ROOT/opt/venv/lib/python3.11/site-packages/flchurn-app.pth"
in_root python -c 'import torch, flwr, client_app.app; print("aarch64 root:", torch.__version__, flwr.__version__)'
cleanup; mounted=()
grep -q " $ROOT/" /proc/mounts && fail "mounts under $ROOT are still there (see /proc/mounts)"
t2=$(date +%s)

echo "== tarball -> $TARBALL"
tar -C "$ROOT" --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* -cf "$TARBALL" .
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  echo "== docker import --platform linux/arm64 -> $IMAGE"
  docker import --platform linux/arm64 \
    -c 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c "ENV PIP_CERT=$CA_BUNDLE" -c 'ENV LANG=C.UTF-8' -c 'ENV FLWR_TELEMETRY_ENABLED=0' \
    -c 'ENV FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1' -c 'WORKDIR /app' -c 'EXPOSE 9094' \
    -c 'CMD ["flower-supernode", "--help"]' "$TARBALL" "$IMAGE" >/dev/null
  if [[ "$(docker image inspect -f '{{.Architecture}}' "$IMAGE")" != arm64 ]]; then
    # Docker 20.10 without the experimental daemon ignores import's --platform: relabel the config
    echo "== relabel $IMAGE as linux/arm64/v8 (docker save, docker/relabel_image.py, docker load)"
    saved="$(mktemp -d "$CACHE/saved.XXXXXX")"
    docker save "$IMAGE" | tar -x -C "$saved"
    python3 docker/relabel_image.py "$saved" linux/arm64/v8 >/dev/null
    tar -c -C "$saved" . | docker load >/dev/null
    rm -rf "$saved"
  fi
  echo "== $IMAGE: $(docker image inspect -f '{{.Os}}/{{.Architecture}} {{.Size}} bytes' "$IMAGE")"
else
  echo "build-arm64.sh: no Docker engine answers: no image; the root $ROOT and $TARBALL stay (docker import later)" >&2
fi
t3=$(date +%s)
echo "== done: root $((t1 - t0)) s, project $((t2 - t1)) s, tarball/import $((t3 - t2)) s;" \
     "root $(du -sh "$ROOT" | cut -f1), tarball $(du -sh "$TARBALL" | cut -f1)"
