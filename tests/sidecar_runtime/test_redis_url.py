"""A Redis URL no request could use stops a service with one line that names no part of it."""

from __future__ import annotations

import pytest

from sidecar_runtime.redis.client import make_client
from sidecar_runtime.redis.url import UNPARSED, RedisUrlError, check_url

PARTS = ("zq9K", "wv7X", "jj3Q")
"""Pieces of a password with the URL's own delimiters in it (``zq9K/wv7X?jj3Q``)."""
SCHEMES = "redis, rediss, redis+cluster, rediss+cluster"


@pytest.mark.parametrize(("url", "problem"), [
    # A password not percent-encoded: its first part reads as the port, the rest as the path.
    ("redis://:zq9K/wv7X@127.0.0.1:6379/0", UNPARSED),
    ("rediss://app:zq9K?wv7X@h:6380/0", UNPARSED),
    ("redis://:zq9K#wv7X@h/0", UNPARSED),
    ("redis+cluster://:zq9K/wv7X?jj3Q@h:7000", UNPARSED),
    ("redis://:pw@h:99999/0", UNPARSED),                     # port out of range
    ("redis://:pw@[127.0.0.1:1/0", UNPARSED),                # an unclosed [
    ("http://h:6379/0", f"Redis URL scheme 'http' is not one of {SCHEMES}"),
    ("zq9K@h:6379", f"Redis URL scheme '' is not one of {SCHEMES}"),
    ("unix:///run/redis.sock", f"Redis URL scheme 'unix' is not one of {SCHEMES}"),
])
def test_a_url_that_cannot_work_is_refused_naming_no_part_of_it(url: str, problem: str) -> None:
    with pytest.raises(RedisUrlError) as caught:
        check_url(url)
    assert str(caught.value) == f"LLM_SIDECAR_REDIS_URL: {problem}"
    assert not any(part in str(caught.value) for part in PARTS)


@pytest.mark.parametrize(("url", "problem"), [
    ("redis://h:6379/0?socket_timeout=zq9K",
     "Redis URL parameter socket_timeout: not a value it takes"),
    ("redis://:zq9K/wv7X@h/0", UNPARSED),                    # refused before redis-py reads it
])
def test_what_redis_py_refuses_is_refused_naming_no_part_of_it(url: str, problem: str) -> None:
    with pytest.raises(RedisUrlError) as caught:
        make_client(url, 0.05)
    assert str(caught.value) == f"LLM_SIDECAR_REDIS_URL: {problem}"
    assert not any(part in str(caught.value) for part in PARTS)


@pytest.mark.parametrize("url", [
    "redis://:pw@127.0.0.1:6379/0", "rediss://app:p%2Fw%3F@h:6380/1", "redis://h",
    "redis://", "rediss+cluster://:pw@h:7000", "redis://h/0?password=pw&db=1",
])
async def test_a_usable_url_passes(url: str) -> None:
    check_url(url)
    client = make_client(url, 0.05)
    await client.aclose()
