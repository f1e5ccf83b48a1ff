#!/usr/bin/env bash
# benchmarks/gpu_check.py on a lent GPU (the `device` tool), in two calls made back to back: the
# machine keeps /tmp only while it is warm (30 s after a call), and Flower's wheels and CIFAR-10
# together are over one call's 64 MiB.
#
# Here, once (both folders are in .gitignore, so they travel only when carried):
#   ../shared/tools/gpu-wheels.sh .gpu                       # Flower, Ray, ... as wheels (~46 MB)
#   mkdir -p .gpu-data && cp -r ../shared/data/cifar10 .gpu-data/   # 54 MB
# Then, on the device:
#   run(carry [".gpu"],      "bash benchmarks/gpu_check.sh install", timeout_s 120)
#   run(carry [".gpu-data"], "bash benchmarks/gpu_check.sh check",   timeout_s 560)
# The check's budget (GPU_CHECK_BUDGET, default 470 s) leaves the call's limit room; its table is
# printed, and gpu_check.json, its log and the profiler traces come back under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  install)
    bash .gpu/install.sh
    PYTHONPATH=/tmp/site:$PWD python3 -c "import flwr, ray; print('flwr', flwr.__version__, 'ray', ray.__version__)"
    ;;
  check)
    [ -d /tmp/site ] || { echo "no /tmp/site: run 'gpu_check.sh install' first, in the call just before" >&2; exit 2; }
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
    export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    set -o pipefail
    mkdir -p "${OUT:-/tmp/gpu-check}"
    python3 -m benchmarks.gpu_check --device cuda --data-dir .gpu-data --out "${OUT:-/tmp/gpu-check}" \
      --budget "${GPU_CHECK_BUDGET:-470}" "${@:2}" 2>&1 | grep -v " INFO " | tee "${OUT:-/tmp/gpu-check}/log.txt"
    ;;
  *) echo "usage: $0 install | check [gpu_check.py options]" >&2; exit 2 ;;
esac
