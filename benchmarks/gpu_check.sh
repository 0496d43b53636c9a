#!/usr/bin/env bash
# Device checks for the CUDA transfer backend; run on a machine with a CUDA GPU.
# Runs the GPU-marked tests, then the bandwidth benchmark through the CUDA backend with a
# pinned host arena: its ratio column is the worker's throughput over one contiguous copy
# of the same bytes between the device cache and the pinned arena. Each part has its own
# time limit; the whole stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' || {
  echo "gpu_check: torch sees no CUDA device" >&2; exit 3; }
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
status=0
timeout 240 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider || status=$?
timeout 150 "$PY" benchmarks/transfer_bandwidth.py --device cuda --reps 5 || status=$?
timeout 60 "$PY" benchmarks/transfer_bandwidth.py --device cuda --reps 3 --segments 8 \
  --sizes-kib 64 1024 || status=$?
exit $status
