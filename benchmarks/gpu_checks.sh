#!/usr/bin/env bash
# The checks that need a GPU, in one run (docs/gpu.md records their figures, with the card named):
#
#     bash benchmarks/gpu_checks.sh [OUT_DIR]      (default: ./gpu-checks; ray needed for the Ray engine)
#
# 1. the CUDA tests: the device, every batched route of the cohort engine and its DP-SGD clients against the
#    sequential path (RTOL 1e-4 on CUDA), the process grid;
# 2. issue 40's two GPU targets, whole rounds through the launcher (round 2 of 3, the server's work included in
#    both): 100 cnn-mnist clients under Flower's Ray simulation against the cohort engine in 1 and 8 processes
#    (target: 10x faster than Ray), and the exchange alone;
# 3. 100 resnet18-gn clients, Ray against the cohort engine in 8 processes (target: 3x faster than Ray);
# 4. the server's own work on 100 replies on that host's CPU (the floor of any engine's round).
# Each step writes its JSON rows and its log under OUT_DIR and the next one runs even if it fails.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
py=${PYTHON:-python3}

step() {  # step NAME COMMAND...: run, keep its log, say how it ended
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$out/$name.log" | tail -25
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

nvidia-smi -L | tee "$out/card.txt"
$py -c "import torch, flwr; print('torch', torch.__version__, 'flwr', flwr.__version__, torch.cuda.get_device_name())" |
  tee -a "$out/card.txt"
step cuda-tests $py -m pytest -q -m "" -p no:cacheprovider tests/test_device.py tests/test_cohort.py \
  tests/test_cohort_dpsgd.py tests/test_process_grid.py
step cnn-mnist $py -m benchmarks.cohort --engines ray,cohort,cohort-run --processes 1,8 --models cnn-mnist \
  --cohorts 100 --device auto --timeout 150 --out "$out/cnn-mnist.json"
step resnet18-gn $py -m benchmarks.cohort --engines ray,cohort-run --processes 8 --models resnet18-gn \
  --cohorts 100 --device auto --timeout 200 --out "$out/resnet18-gn.json"
step server-replies $py -m benchmarks.server_replies --replies 100 --models cnn-mnist,resnet18-gn
