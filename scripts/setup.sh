#!/usr/bin/env bash
# Set up kvoffload on a fresh machine: a virtual environment in .venv with the library,
# its optional extras, the test tools, vLLM's CPU build (for the connector tests), two more
# environments with vLLM 0.33 and 0.34 (.venv-vllm033, .venv-vllm034, for the connector's
# scheduler-side tests) and a local redis-server (for the shared-tier tests).
#
#   bash scripts/setup.sh            # everything
#   KVOFFLOAD_SKIP_VLLM=1 bash scripts/setup.sh   # without vLLM (saves ~5 minutes)
#   KVOFFLOAD_SKIP_VLLM_NEXT=1 bash scripts/setup.sh   # without the vLLM 0.33/0.34 environments
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
"${PIP[@]}" install -q "torch==2.13.0"
"${PIP[@]}" install -q -e ".[torch,cli,redis,dev]"

if [ -z "${KVOFFLOAD_SKIP_VLLM:-}" ] && [ -f scripts/install_vllm.sh ]; then
  bash scripts/install_vllm.sh
  # Environments with vLLM 0.33 and 0.34 for the scheduler-side tests (~2-3 minutes each).
  if [ -z "${KVOFFLOAD_SKIP_VLLM_NEXT:-}" ]; then
    bash scripts/install_vllm_next.sh
  fi
fi

if [ -f scripts/install_redis.sh ]; then
  bash scripts/install_redis.sh
fi
echo "kvoffload is set up in .venv"
