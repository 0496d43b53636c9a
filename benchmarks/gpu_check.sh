#!/usr/bin/env bash
# Device checks for the CUDA transfer backend; run on a machine with a CUDA GPU.
# Runs the GPU-marked tests (the staging-budget ones among them) and the staging-budget
# tests on CPU tensors, then the bandwidth benchmark through the CUDA backend with a
# pinned host arena: its ratio column is the worker's throughput over one contiguous copy
# of the same bytes between the device cache and the pinned arena. The last two runs
# measure the staging budget (docs/transfer.md): blocks of 64 page segments (32 layers, K
# and V apart, as vLLM hands them over), jobs of 32 blocks (64-128 MiB); first a worker
# with the default budget (64 MiB per direction) timed beside one whose 1 GiB budget never
# splits a job, then one with 8 MiB beside the default. The "split" columns are the
# compared worker's throughput over the first one's (paired median; chunks per store job
# in brackets). Each part has its own time limit; the whole stays under 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' || {
  echo "gpu_check: torch sees no CUDA device" >&2; exit 3; }
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
status=0
timeout 180 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider || status=$?
timeout 40 "$PY" -m pytest tests/worker/test_worker_staging_budget.py -q -p no:cacheprovider \
  || status=$?
timeout 100 "$PY" benchmarks/transfer_bandwidth.py --device cuda --reps 5 || status=$?
timeout 60 "$PY" benchmarks/transfer_bandwidth.py --device cuda --reps 3 --segments 8 \
  --sizes-kib 64 1024 || status=$?
budget_run() {
  timeout 60 "$PY" benchmarks/transfer_bandwidth.py --device cuda --reps 5 --segments 64 \
    --sizes-kib 2048 4096 --blocks-per-job 32 --total-mib 128 "$@"
}
budget_run --staging-bytes 1GiB --compare-staging 64MiB || status=$?
budget_run --compare-staging 8MiB || status=$?
exit $status
