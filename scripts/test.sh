#!/usr/bin/env bash
# Run kvoffload's whole test suite (after scripts/setup.sh). Extra arguments go to pytest
# and select what runs in the main environment only.
#
# Without arguments, the connector's scheduler-side tests then run again against the real
# scheduler of each newer vLLM whose environment scripts/setup.sh made
# (scripts/install_vllm_next.sh: .venv-vllm033, .venv-vllm034; scripts/test_vllm_next.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q
for venv in .venv-vllm033 .venv-vllm034; do
  if [ -x "$venv/bin/python" ]; then
    VENV=$venv bash scripts/test_vllm_next.sh
  else
    echo "test.sh: no $venv (scripts/install_vllm_next.sh): vLLM 0.${venv#.venv-vllm0} not tested"
  fi
done
