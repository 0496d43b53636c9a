#!/usr/bin/env bash
# Run kvoffload's whole test suite (after scripts/setup.sh). Extra arguments go to pytest
# and select what runs in the main environment only.
#
# Without arguments, and when scripts/setup.sh made the second environment (.venv-vllm033,
# scripts/install_vllm_next.sh), the connector's scheduler-side tests then run again
# against vLLM 0.33's real scheduler (scripts/test_vllm_next.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q
if [ -x .venv-vllm033/bin/python ]; then
  bash scripts/test_vllm_next.sh
else
  echo "test.sh: no .venv-vllm033 (scripts/install_vllm_next.sh): vLLM 0.33 not tested"
fi
