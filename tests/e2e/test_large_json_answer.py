"""A non-streamed answer above Envoy's buffer (``envoy.max_request_bytes``, here 16 KiB), through
real Envoy 1.40: it reaches the client whole, and extproc, which reads it chunk by chunk, records
it and settles it to its usage.

The guard for a tempting saving (docs/decisions/0002-hand-written-protobuf.md): asked for such
an answer ``BUFFERED_PARTIAL`` (one message instead of headers + body), Envoy 1.40 sent extproc
all of it as a partial and never ended the client's response.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.chaos.support import wait_until
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import user

pytestmark = pytest.mark.e2e

BUFFER = 16384
MAX_TOKENS = 6000
"""~6 bytes a simulated token: an answer of ~40 kB, above the buffer."""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    d = default_doc()
    d["envoy"]["max_request_bytes"] = BUFFER
    d["clusters"]["vllm-long"]["simulate"] = {"decode_ms_per_token": 0}
    d["telemetry"] = {"sample": 0, "sample_min_per_s": 0, "envoy_usage": True}
    d["rate_limits"] = {"tenant": {"default": {"tokens": "1000000/d"}}}
    with running_gateway(d, str(tmp_path_factory.mktemp("gw-json-answer")),
                         capture_logs=True) as gateway:
        yield gateway


def done_lines(gw: Gateway) -> list[dict[str, object]]:
    return [json.loads(line) for line in gw.logs().splitlines() if '"request_done"' in line]


def test_an_answer_above_the_buffer_reaches_the_client_whole_and_is_settled_to_its_usage(
        gw: Gateway) -> None:
    client = openai.OpenAI(base_url=gw.openai_base, api_key="sk-long", max_retries=0,
                           timeout=60, default_headers={"x-tenant-id": "long"})
    raw = client.chat.completions.with_raw_response.create(
        model="llama-2-13b", messages=user("write at length"), max_tokens=MAX_TOKENS)
    answer = raw.parse()
    assert len(raw.http_response.content) > 2 * BUFFER
    assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS
    assert len(answer.choices[0].message.content or "") > BUFFER
    wait_until(lambda: len(done_lines(gw)) >= 1, 10, 0.05)
    (line,) = done_lines(gw)
    assert line["status"] == 200 and line["outcome"] == "ok"
    assert line["charged_tokens"] == answer.usage.total_tokens
