#!/usr/bin/env bash
# Build the project's image without any image registry (only a Debian mirror and a Python
# package index are reached):
#   1. a base image BASE_IMAGE (default flchurn-base:bookworm): Debian bookworm made by
#      `debootstrap --variant=minbase` with python3 and a venv at /opt/venv first on PATH
#      (Debian's python refuses system-wide pip installs, PEP 668), the host's CA bundle
#      (/etc/ssl/certs/ca-certificates.crt, in case pip goes through a proxy with its own CA) and
#      PIP_CERT pointing at it, imported with `docker import`. Cached: skipped when the image
#      exists (FORCE_BASE=1 rebuilds it);
#   2. docker/Dockerfile on that base, built with `--network host` so that pip reaches the
#      index the host uses. The build context is the project's sources only (a tar on stdin),
#      never .venv or results.
# Usage: sudo docker/build-local.sh            (root: debootstrap and the Docker socket)
# Variables (defaults): FLCHURN_IMAGE (flchurn:latest), BASE_IMAGE (flchurn-base:bookworm),
#   DEBIAN_MIRROR (http://deb.debian.org/debian), PIP_INDEX_URL (the host pip's index-url, else
#   https://pypi.org/simple), TORCH_INDEX_URL (https://download.pytorch.org/whl/cpu if it answers,
#   else PIP_INDEX_URL: PyPI's default torch is the CUDA build, several GB), LOCAL_TORCH_WHEEL
#   (TARGET=client without the CPU index: a CPU torch wheel for CPython 3.11; default the newest
#   /opt/wheels/torch-*+cpu-cp311-*.whl).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${FLCHURN_IMAGE:-flchurn:latest}"
BASE_IMAGE="${BASE_IMAGE:-flchurn-base:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

fail() { echo "build-local.sh: $*" >&2; exit 1; }
command -v docker >/dev/null || fail "no docker CLI: apt-get install docker.io"
docker info >/dev/null 2>&1 || fail "no Docker engine answers: start dockerd (as root: dockerd >/tmp/dockerd.log 2>&1 &)"

if [[ -z "${PIP_INDEX_URL:-}" ]]; then
  PIP_INDEX_URL="$(python3 -m pip config get global.index-url 2>/dev/null || true)"
  PIP_INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}"
fi
if [[ -z "${TORCH_INDEX_URL:-}" ]]; then
  if curl -fsS -m 15 -o /dev/null "$CPU_TORCH_INDEX/torch/" 2>/dev/null; then
    TORCH_INDEX_URL="$CPU_TORCH_INDEX"
  else
    echo "build-local.sh: $CPU_TORCH_INDEX does not answer: torch comes from $PIP_INDEX_URL (CUDA build, several GB)" >&2
    TORCH_INDEX_URL="$PIP_INDEX_URL"
  fi
fi

t0=$(date +%s)
if [[ -n "${FORCE_BASE:-}" ]] || ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || fail "no debootstrap: apt-get install debootstrap"
  [[ $(id -u) == 0 ]] || fail "debootstrap needs root: run with sudo"
  rootfs="$(mktemp -d /tmp/flchurn-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' EXIT
  echo "== debootstrap bookworm -> $rootfs ($DEBIAN_MIRROR)"
  nice -n 10 debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$DEBIAN_MIRROR"
  [[ -r "$CA_BUNDLE" ]] && cp "$CA_BUNDLE" "$rootfs$CA_BUNDLE"
  chroot "$rootfs" python3 -m venv /opt/venv
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/usr/share/doc/* \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
  echo "== docker import -> $BASE_IMAGE"
  tar -C "$rootfs" -c . | docker import \
    -c 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c "ENV PIP_CERT=$CA_BUNDLE" -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
else
  echo "== $BASE_IMAGE exists (FORCE_BASE=1 rebuilds it)"
fi
t1=$(date +%s)

echo "== docker build -> $IMAGE (base $BASE_IMAGE, torch from $TORCH_INDEX_URL, pip from $PIP_INDEX_URL)"
# TARGET=client: the slim SuperNode image (docker/Dockerfile.client; default image flchurn-client:latest)
DOCKERFILE=docker/Dockerfile
if [[ "${TARGET:-}" == client ]]; then
  DOCKERFILE=docker/Dockerfile.client
  IMAGE="${FLCHURN_CLIENT_IMAGE:-flchurn-client:latest}"
fi
# the project's sources: pyproject.toml's hatch packages (docker/sources.py, the one list of every image)
listed="$(python3 docker/sources.py)" || fail "docker/sources.py could not read pyproject.toml"
mapfile -t project <<< "$listed"
sources=("${project[@]}" docker/sources.py "$DOCKERFILE" docker/client-requirements.txt)
wheel=()  # the client image without the CPU index: a local CPU torch wheel (LOCAL_TORCH_WHEEL)
if [[ "${TARGET:-}" == client && "$TORCH_INDEX_URL" != "$CPU_TORCH_INDEX" ]]; then
  LOCAL_TORCH_WHEEL="${LOCAL_TORCH_WHEEL:-$(ls /opt/wheels/torch-*+cpu-cp311-*.whl 2>/dev/null | tail -1)}"
  if [[ -n "$LOCAL_TORCH_WHEEL" ]]; then
    echo "== CPU torch from $LOCAL_TORCH_WHEEL (the requirements' torch line is skipped)"
    wheel=(-C "$(dirname "$LOCAL_TORCH_WHEEL")" --transform 's,^torch-,wheels/torch-,' "$(basename "$LOCAL_TORCH_WHEEL")")
  else
    echo "build-local.sh: no CPU torch: the client image gets PyPI's CUDA build (set LOCAL_TORCH_WHEEL)" >&2
  fi
fi
tar -c --exclude=__pycache__ --exclude='*.pyc' "${sources[@]}" "${wheel[@]}" |
  DOCKER_BUILDKIT=0 nice -n 10 docker build --network host -f "$DOCKERFILE" -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg PIP_INDEX_URL="$PIP_INDEX_URL" \
    --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" -
t2=$(date +%s)
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
echo "== built $IMAGE: base $((t1 - t0)) s, image $((t2 - t1)) s, size $((size / 1000000)) MB"
