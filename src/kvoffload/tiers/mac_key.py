"""The lower tiers' MAC key, read from a file or the environment (``read_mac_key``).

The key is a secret (see ``kvoffload.blockfile.framing``): it comes from a file (option
``tier_mac_key_file``) or the environment variable ``KVOFFLOAD_TIER_MAC_KEY``, never from
an option value, and no error message shows it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from kvoffload.blockfile.framing import MIN_MAC_KEY_BYTES, MacKey
from kvoffload.errors import ConfigError, shown
from kvoffload.files import UnreadableFileError, open_regular_file

MAC_KEY_ENV = "KVOFFLOAD_TIER_MAC_KEY"
"""Environment variable holding the tiers' MAC key (when ``tier_mac_key_file`` is not set)."""
MAX_MAC_KEY_FILE_BYTES = 4096
"""The largest key file read (anything bigger is not a key file)."""
KEY_FILE_FORBIDDEN_MODE = 0o077
"""Permission bits a key file may not have: any access by its group or by others (the
key is a secret; ``chmod 600`` leaves none of them)."""
_KEY_FIX = (f"Use at least {MIN_MAC_KEY_BYTES} random bytes, the same for every engine "
            "sharing the tiers, e.g. openssl rand -hex 32")


def read_mac_key(path: str | None, environ: Mapping[str, str]) -> MacKey | None:
    """The tiers' MAC key: the contents of file ``path`` if given, else the value of
    ``KVOFFLOAD_TIER_MAC_KEY`` in ``environ``; None when neither is set. Surrounding
    whitespace (a trailing newline) is not part of the key.

    Raises:
        ConfigError: both are set; the file is missing, unreadable, not a regular file,
            accessible by its group or others (``chmod 600`` it), or over 4 KiB; the key
            is shorter than 16 bytes. Messages name the file or the variable, never the
            key.
    """
    from_env = environ.get(MAC_KEY_ENV)
    if path is not None and from_env is not None:
        raise ConfigError("tier_mac_key_file", f"is set and so is {MAC_KEY_ENV}",
                          "Give the key one way: unset the variable or drop the option.")
    if path is not None:
        secret = _read_key_file(path).strip()
        if len(secret) < MIN_MAC_KEY_BYTES:
            raise ConfigError("tier_mac_key_file", f"{path} holds {len(secret)} bytes of "
                              f"key, fewer than {MIN_MAC_KEY_BYTES}",
                              f"{_KEY_FIX} > {path}")
        return MacKey(secret)
    if from_env is None:
        return None
    secret = from_env.encode("utf-8", "surrogateescape").strip()
    if len(secret) < MIN_MAC_KEY_BYTES:
        raise ConfigError(MAC_KEY_ENV, f"holds {len(secret)} bytes, fewer than "
                          f"{MIN_MAC_KEY_BYTES}", f"{_KEY_FIX}, or unset it to run "
                          "without a MAC key")
    return MacKey(secret)


def _read_key_file(path: str) -> bytes:
    """The bytes of key file ``path`` (never waits on a FIFO; refuses anything but a
    regular file of at most ``MAX_MAC_KEY_FILE_BYTES`` that only its owner may access,
    as ``chmod 600`` leaves it)."""
    fix = ("Point tier_mac_key_file at a readable file holding the key; make one with "
           "openssl rand -hex 32 > FILE")
    if not path.strip():
        raise ConfigError("tier_mac_key_file", "is empty", fix)
    name = shown(path) if "\0" in path else path
    try:
        with open_regular_file(path) as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & KEY_FILE_FORBIDDEN_MODE:
                raise ConfigError("tier_mac_key_file", f"{path} may be read or written by "
                                  f"other users (mode {stat.S_IMODE(mode):04o})",
                                  f"Let only its owner access it: chmod 600 {path}")
            data = f.read(MAX_MAC_KEY_FILE_BYTES + 1)
    except UnreadableFileError as exc:
        opened = "cannot be opened "
        problem = (f"cannot open {name} {exc.reason[len(opened):]}"
                   if exc.reason.startswith(opened) else f"{name} {exc.reason}")
        raise ConfigError("tier_mac_key_file", problem, fix) from None
    except OSError as exc:
        raise ConfigError("tier_mac_key_file", f"cannot read {name} "
                          f"({exc.strerror or type(exc).__name__})", fix) from None
    if len(data) > MAX_MAC_KEY_FILE_BYTES:
        raise ConfigError("tier_mac_key_file", f"{path} is over {MAX_MAC_KEY_FILE_BYTES} "
                          "bytes, too big for a key file", fix)
    return data
