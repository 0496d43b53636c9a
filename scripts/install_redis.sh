#!/usr/bin/env bash
# Make sure a `redis-server` binary exists (the remote-tier tests start their own server on
# a free loopback port; nothing here starts or enables a system service).
#
# Installs Debian's `redis-server` package with apt-get when the binary is missing. Needs
# root (as on CI) or passwordless sudo; otherwise it says what to run and exits non-zero.
#
#   bash scripts/install_redis.sh
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server present: $(redis-server --version)"
  exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "redis-server is missing and this user cannot install packages." >&2
    echo "Run as root: apt-get update && apt-get install -y --no-install-recommends redis-server" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# The package may have started a service on 6379; tests never use it, stop it if it runs.
if command -v service >/dev/null 2>&1; then
  "${SUDO[@]}" service redis-server stop >/dev/null 2>&1 || true
fi
echo "redis-server installed: $(redis-server --version)"
