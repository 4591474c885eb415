"""Checking a Redis URL before anything uses it: what a URL no request could ever use raises.

No ``redis`` import: the supervisor of ``--workers`` checks the URL once, before it starts the
workers, without loading a Redis client. The text of every error names the setting and the
problem, never a part of the URL: a password written into the URL without percent-encoding
(``/``, ``?``, ``#``, ``@`` in it) spills into the host, port or path, and a parser's own
message would quote it.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit

URL_SETTING = "LLM_SIDECAR_REDIS_URL"
"""Where every service's Redis URL comes from (``Settings.redis_url``)."""
SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
TLS_FILE_PARAMS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
UNPARSED = ("the URL does not parse as scheme://[USER:PASSWORD@]HOST[:PORT][/DB][?PARAMS]; "
            "percent-encode any / ? # @ : [ ] in the user name or password")


class RedisUrlError(ValueError):
    """A Redis URL no request could ever use. The services print it as their one line of a bad
    config and exit 1."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{URL_SETTING}: {problem}")


def check_url(url: str) -> None:
    """Raise :class:`RedisUrlError` for a URL no request could ever use: one that does not
    parse (a port that is not a number, an unclosed ``[``), an unknown scheme, or a TLS file
    that does not exist (no host is fine: redis-py's ``localhost``). Checked at start-up,
    because at request time a broken setup would only look like a Redis outage, forever."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not 0 to 65535
    except ValueError:
        raise RedisUrlError(UNPARSED) from None
    if parts.scheme not in SCHEMES:
        # The text before "://" is no secret (a URL without one has no scheme at all).
        scheme = parts.scheme if "://" in url else ""
        raise RedisUrlError(f"Redis URL scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    query = parse_qs(parts.query)
    for name in TLS_FILE_PARAMS:
        for path in query.get(name, []):
            if not os.path.isfile(path):
                raise RedisUrlError(f"Redis URL parameter {name}: no such file {path!r}")
