"""The remote tier's URL: how it is checked (``check_remote_url``), shown (``masked_url``)
and split into the server's address and the credentials written in it.

Contract. A URL that ``check_remote_url`` accepts is read the same way by this module and
by redis-py's ``from_url`` (``urllib.parse.urlsplit``): the user and password are what
stands between ``scheme://`` and the last ``@`` before the first ``/``, ``?`` or ``#``.
Anything that would make the two readings differ, or that would let the URL override a
documented option, is refused with a ``ConfigError`` naming the URL's option:

* an ``@`` after the host (a password holding an unescaped ``/``, ``?`` or ``#``), a
  control character, a host part ``urlsplit`` cannot read, a port that is no number, a
  fragment, or a database path that is not ``/N``;
* every query parameter except ``db`` (``ACCEPTED_QUERY``); transport security
  (``ssl_*``), timeouts, pool size, credentials and retries have their own options
  (``QUERY_OPTIONS`` names them) and are never taken from the URL.

``masked_url`` never shows any part of a password, for any string (checked or not):
everything between ``scheme://`` and the *last* ``@`` of the whole string is masked unless
it is a plain ``user[:password]`` (then only the user is shown), and every query value but
a numeric ``db`` is masked. Error messages show it through ``kvoffload.errors.shown``.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlsplit

from kvoffload.errors import ConfigError, shown

REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
"""URL schemes of the remote tier (what redis-py's ``from_url`` connects to)."""

MASK = "***"
"""What a password looks like in every log line, error message and repr."""

ACCEPTED_QUERY = ("db",)
"""The only query parameter a remote URL may carry (the database number)."""

MAX_DB = 2**31 - 1
"""The largest database number a URL may name."""

_TLS = "the server's certificate and host name are always verified; no option turns that off"
QUERY_OPTIONS: dict[str, str] = {
    "socket_timeout": "remote_timeout_s",
    "timeout": "remote_timeout_s",
    "socket_connect_timeout": "remote_connect_timeout_s",
    "max_connections": "remote_max_connections",
    "password": "remote_password_file (or $KVOFFLOAD_REMOTE_PASSWORD)",
    "username": "remote_username",
    "ssl_ca_certs": "remote_tls_ca_file",
    "ssl_ca_path": "remote_tls_ca_file",
    "ssl_ca_data": "remote_tls_ca_file",
    "ssl_certfile": "remote_tls_cert_file",
    "ssl_keyfile": "remote_tls_key_file",
    "retry_on_timeout": "remote_retry_interval_s (the tier never retries a call silently)",
    "retry_on_error": "remote_retry_interval_s (the tier never retries a call silently)",
}
"""Query parameters redis-py would read, and the documented option that sets each."""


def masked_url(url: str) -> str:
    """``url`` with no part of its password shown: ``redis://user:***@host:port/0``.

    Everything between ``scheme://`` and the last ``@`` is masked (a plain ``user`` or
    ``user:password`` keeps its user); query values other than a numeric ``db`` and any
    fragment are masked too. Safe on any string, checked or not.
    """
    scheme, sep, after = url.partition("://")
    if not sep:
        scheme, after = "", url
    head, at, tail = after.rpartition("@")
    if at:
        user, colon, password = head.partition(":")
        if any(c in head for c in "/?#") or "@" in user:
            head = MASK
        elif colon and password:
            head = f"{user}:{MASK}"
    address, qmark, query = tail.partition("?")
    address, hash_, _ = address.partition("#")
    if qmark:
        query = query.partition("#")[0]
        shown_pairs = []
        for pair in query.split("&"):
            key, eq, value = pair.partition("=")
            if eq and not (key == "db" and value.isascii() and value.isdigit()):
                value = MASK
            shown_pairs.append(key + eq + value)
        address += "?" + "&".join(shown_pairs)
    if hash_ or "#" in query:
        address += "#" + MASK
    return scheme + sep + head + at + address


def _netloc_end(after: str) -> int:
    """Where the host part of ``after`` (a URL past ``scheme://``) ends, as ``urlsplit``
    cuts it: at the first ``/``, ``?`` or ``#``."""
    return min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))


def _split_url(url: str) -> tuple[str, str, str, str]:
    """``(scheme://, userinfo@, host:port, rest)`` of a checked URL, by the cuts
    ``urlsplit`` makes (``check_remote_url`` refuses URLs where they would differ)."""
    scheme, sep, after = url.partition("://")
    if not sep:
        return "", "", url, ""
    end = _netloc_end(after)
    userinfo, at, hostport = after[:end].rpartition("@")
    return scheme + sep, userinfo + at, hostport, after[end:]


def url_without_credentials(url: str) -> str:
    """``url`` without its ``user:password@`` part (what redis-py is given, with the
    resolved credentials as keyword arguments)."""
    scheme, _, hostport, rest = _split_url(url)
    return scheme + hostport + rest


def url_credentials(url: str) -> tuple[str | None, str | None]:
    """The (percent-decoded) user and password written in ``url``, None where absent."""
    userinfo = _split_url(url)[1][:-1]
    if not userinfo:
        return None, None
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon and password else None)


def url_db(url: str) -> int:
    """The database a checked URL names (its ``/N`` path or ``?db=N``; 0 when neither)."""
    parts = urlsplit(url)
    for key, value in parse_qsl(parts.query):
        if key == "db":
            return int(value)
    number = parts.path[1:] if not url.lower().startswith("unix://") else ""
    return int(number) if number else 0


def _refuse(field: str, url: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(field, f"{shown(masked_url(url))} {problem}", fix)


_ENCODE = ("Percent-encode those characters of the user and password (/ as %2F, ? as %3F, "
           "# as %23, @ as %40), or put the password in remote_password_file.")


def check_remote_url(url: str, field: str = "remote_url") -> None:
    """Refuse (``ConfigError`` naming ``field``) a URL that is not a Redis URL, that
    redis-py would read differently from this module, or that carries query parameters
    other than ``db`` (module docstring)."""
    if not url:
        raise ConfigError(field, "is empty", "Give redis://host:port/db.")
    if not url.lower().startswith(REMOTE_SCHEMES):
        raise _refuse(field, url, "is not a Redis URL", "Use redis://host:port/db, "
                      "rediss://host:port/db (TLS) or unix:///path/to/redis.sock.")
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        raise _refuse(field, url, "holds a control character (a newline, a tab, ...)",
                      "Remove it; percent-encode it if the password holds it.")
    scheme, _, after = url.partition("://")
    end = _netloc_end(after)
    if "@" in after[end:]:
        raise _refuse(field, url, "has an '@' after the host: the user or password holds "
                      "an unescaped '/', '?' or '#'", _ENCODE)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - reading it checks it
    except ValueError:
        raise _refuse(field, url, "has a host part that cannot be read (a port that is no "
                      "number in 0..65535, an unclosed '[', or characters that change "
                      "meaning under Unicode normalisation)",
                      "Write host:port with a port number; " + _ENCODE[0].lower()
                      + _ENCODE[1:]) from None
    if parts.fragment or url.endswith("#"):
        raise _refuse(field, url, "has a '#' fragment, which the server never sees",
                      "Drop it (percent-encode a '#' in the password as %23).")
    db_in_path = _check_path(field, url, scheme.lower(), parts.path)
    _check_query(field, url, parts.query, db_in_path)


def _check_path(field: str, url: str, scheme: str, path: str) -> bool:
    """A ``redis``/``rediss`` path is empty, ``/`` or ``/N`` (the database); a ``unix``
    path is the socket's. Returns whether the path names a database."""
    if scheme == "unix" or path in ("", "/"):
        return False
    number = path[1:]
    if not _is_db(number):
        raise _refuse(field, url, f"names the database {shown(unquote(path))}, which is "
                      f"not a number in 0..{MAX_DB}", "Use redis://host:port/N, e.g. /0.")
    return True


def _is_db(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 10 and int(text) <= MAX_DB


def _check_query(field: str, url: str, query: str, db_in_path: bool) -> None:
    """Only ``db``, once, as a number, and not beside a database path."""
    seen: set[str] = set()
    for key, value in parse_qsl(query, keep_blank_values=True):
        name = shown(key)
        if key not in ACCEPTED_QUERY:
            option = QUERY_OPTIONS.get(key)
            if option is None and key.startswith("ssl_"):
                raise _refuse(field, url, f"sets the query parameter {name}, which would "
                              f"change transport security ({_TLS})",
                              "Drop it; give CA and client certificates with the "
                              "remote_tls_* options.")
            raise _refuse(field, url, f"sets the query parameter {name}, which is not "
                          "accepted (a remote URL takes only ?db=N)",
                          f"Drop it and set {option} instead." if option else
                          "Drop it; the remote_* options list every setting of the tier.")
        if key in seen:
            raise _refuse(field, url, f"sets {name} twice", "Give it once.")
        seen.add(key)
        if not _is_db(value):
            raise _refuse(field, url, f"sets db to {shown(value)}, which is not a number "
                          f"in 0..{MAX_DB}", "Give ?db=N with a whole number, e.g. 0.")
        if db_in_path:
            raise _refuse(field, url, "names the database both in its path and as ?db=",
                          "Give it once, e.g. redis://host:port/0.")
