#!/usr/bin/env bash
# Send the SuperNode image to the Docker engines of a multi-host deployment (docs/multihost.md),
# from the engine that built it, without any public registry. Two ways:
#   load      (default) `docker save` once to a file, then `docker load` into every engine at once
#             (the whole image crosses each link; nothing to run on the hosts).
#   registry  a local registry (Debian's docker-registry) serves it; each engine pulls only the
#             layers it lacks (after an image edit: the changed layers only). The engines must
#             trust it: `--insecure-registry ADDR:PORT` (a private link) or a TLS registry.
# Targets: ENGINE[=TLS_DIR] as in a hosts file (tcp://HOST:2376=~/.docker/pi, ssh://pi@board,
# unix:///var/run/docker.sock), or --hosts FILE (every engine = "docker" host of a hosts file,
# each with its own image).
#
# Usage: docker/push-images.sh [--via load|registry] [--from ENGINE] [--registry ADDR:PORT]
#                              [--image IMAGE] (--hosts FILE | TARGET...)
#   --from      the engine that has the image (default $DOCKER_HOST, else the local socket)
#   --image     the image (default flchurn-client:latest; --hosts: each host's `image`)
#   --registry  --via registry: where the engines reach the registry (e.g. 10.213.7.1:5000); it is
#               started here on 0.0.0.0:PORT (docker-registry, storage in $REGISTRY_DIR) unless
#               something already answers there; the source engine pushes to 127.0.0.1:PORT
#               (a loopback registry needs no TLS)
# Prints the seconds each step took.
set -euo pipefail
cd "$(dirname "$0")/.."
VIA=load FROM="${DOCKER_HOST:-unix:///var/run/docker.sock}" REGISTRY="" IMAGE="" HOSTS="" TARGETS=()
fail() { echo "push-images.sh: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --via) VIA="$2"; shift 2 ;;
    --from) FROM="$2"; shift 2 ;;
    --registry) REGISTRY="$2"; shift 2 ;;
    --image) IMAGE="$2"; shift 2 ;;
    --hosts) HOSTS="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    -*) fail "unknown option $1" ;;
    *) TARGETS+=("$1"); shift ;;
  esac
done
[[ "$VIA" == load || "$VIA" == registry ]] || fail "--via must be load or registry, not $VIA"
command -v docker >/dev/null || fail "no docker CLI (apt-get install docker.io)"
PY="${PYTHON:-python3}"
declare -A IMG_OF=()
if [[ -n "$HOSTS" ]]; then
  # one line a docker host: ENGINE=TLS_DIR IMAGE (deploy.hosts reads the file: its errors name the key)
  listing=$("$PY" -c '
import sys
from deploy.hosts import HostsError, load_hosts
try:
    plan = load_hosts(sys.argv[1])
except HostsError as err:
    sys.exit(str(err))
for h in plan.hosts:
    if h.engine == "docker":
        print(f"{h.docker}={h.tls_dir or str()} {h.image}")' "$HOSTS") || exit 2
  mapfile -t lines <<< "$listing"
  [[ -n "$listing" ]] || lines=()
  for l in "${lines[@]}"; do TARGETS+=("${l%% *}"); IMG_OF["${l%% *}"]="${IMAGE:-${l##* }}"; done
fi
[[ ${#TARGETS[@]} -gt 0 ]] || fail "no target engine (TARGET... or --hosts FILE)"
IMAGE="${IMAGE:-flchurn-client:latest}"

# docker CLI arguments for ENGINE[=TLS_DIR]
engine_args() {
  local url="${1%%=*}" tls=""
  [[ "$1" == *=* ]] && tls="${1#*=}"
  if [[ "$url" == tcp://* ]]; then
    [[ -n "$tls" ]] || fail "$url: tcp:// needs =TLS_DIR (ca.pem, cert.pem, key.pem)"
    tls="${tls/#\~/$HOME}"
    echo "-H $url --tlsverify --tlscacert $tls/ca.pem --tlscert $tls/cert.pem --tlskey $tls/key.pem"
  else
    echo "-H $url"
  fi
}
SRC=$(engine_args "$FROM")
# shellcheck disable=SC2086
docker $SRC version >/dev/null 2>&1 || fail "no Docker engine answers at $FROM (--from, or DOCKER_HOST)"
# shellcheck disable=SC2086
docker $SRC image inspect "$IMAGE" >/dev/null 2>&1 || fail "$FROM has no image $IMAGE (build it: TARGET=client docker/build-local.sh)"
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
pids=() names=()

if [[ "$VIA" == load ]]; then
  tmp="$(mktemp -d "${TMPDIR:-/var/tmp}/flchurn-image.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  t0=$(now)
  # shellcheck disable=SC2086
  docker $SRC save -o "$tmp/image.tar" "$IMAGE"
  echo "saved $IMAGE ($(($(stat -c %s "$tmp/image.tar") / 1000000)) MB) in $(took "$t0") s"
  t1=$(now)
  for t in "${TARGETS[@]}"; do
    img="${IMG_OF[$t]:-$IMAGE}"
    [[ "$img" == "$IMAGE" ]] || fail "$t wants $img; one image per call with --via load (--image)"
    # shellcheck disable=SC2046
    ( s=$(now); docker $(engine_args "$t") load -q -i "$tmp/image.tar" >/dev/null && echo "loaded into ${t%%=*} in $(took "$s") s" ) &
    pids+=($!) names+=("$t")
  done
else
  [[ -n "$REGISTRY" ]] || fail "--via registry needs --registry ADDR:PORT (the address the engines reach)"
  port="${REGISTRY##*:}"
  if ! curl -fsS -m 3 -o /dev/null "http://127.0.0.1:$port/v2/" 2>/dev/null; then
    command -v docker-registry >/dev/null || fail "no docker-registry (apt-get install docker-registry)"
    made_dir=""
    [[ -n "${REGISTRY_DIR:-}" ]] || { REGISTRY_DIR="$(mktemp -d "${TMPDIR:-/var/tmp}/flchurn-registry.XXXXXX")"; made_dir="$REGISTRY_DIR"; }
    printf 'version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 0.0.0.0:%s\n' \
      "$REGISTRY_DIR" "$port" > "$REGISTRY_DIR/config.yml"
    docker-registry serve "$REGISTRY_DIR/config.yml" > "$REGISTRY_DIR/registry.log" 2>&1 &
    reg_pid=$!
    trap 'kill $reg_pid 2>/dev/null || true; wait $reg_pid 2>/dev/null || true; [[ -z "$made_dir" ]] || rm -rf "$made_dir"' EXIT
    for _ in $(seq 50); do curl -fsS -m 1 -o /dev/null "http://127.0.0.1:$port/v2/" 2>/dev/null && break; sleep 0.2; done
    echo "registry started on 0.0.0.0:$port (pid $reg_pid, storage $REGISTRY_DIR${made_dir:+, removed at the end}; stopped at the end)"
  fi
  repo="${IMAGE%%:*}" tag="${IMAGE##*:}"; [[ "$IMAGE" == *:* ]] || tag=latest
  t0=$(now)
  # shellcheck disable=SC2086
  docker $SRC tag "$IMAGE" "127.0.0.1:$port/$repo:$tag" && docker $SRC push -q "127.0.0.1:$port/$repo:$tag" >/dev/null
  echo "pushed $IMAGE to the registry in $(took "$t0") s"
  t1=$(now)
  for t in "${TARGETS[@]}"; do
    # shellcheck disable=SC2046
    ( s=$(now); a=$(engine_args "$t"); docker $a pull -q "$REGISTRY/$repo:$tag" >/dev/null \
        && docker $a tag "$REGISTRY/$repo:$tag" "$IMAGE" && echo "pulled into ${t%%=*} in $(took "$s") s" ) &
    pids+=($!) names+=("$t")
  done
fi
failed=0
for k in "${!pids[@]}"; do
  wait "${pids[$k]}" || { echo "push-images.sh: ${names[$k]%%=*}: failed" >&2; failed=1; }
done
echo "$IMAGE on ${#TARGETS[@]} engine(s) in $(took "$t1") s (all at once, via $VIA)"
exit $failed
