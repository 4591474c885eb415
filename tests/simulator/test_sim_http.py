"""Wire-level behaviour: raw SSE bytes, error mapping, headers, journal, metrics, scheduling."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers

from simulator import RunningSimulator, SimConfig, build_app
from simulator.embeddings import decode_base64
from simulator.state import STATE
from tests.harness.waits import until

StartSim = Callable[..., Awaitable[RunningSimulator]]
HELLO = [{"role": "user", "content": "hello"}]  # 9 prompt tokens


def _events(raw: bytes) -> list[Any]:
    """The data payloads of an SSE body; fails on anything that is not a ``data:`` event."""
    assert raw.endswith(b"\n\n")
    events = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


async def _post(http: aiohttp.ClientSession, sim: RunningSimulator, path: str, body: Any) -> tuple[int, Any]:
    async with http.post(sim.url + path, json=body) as response:
        return response.status, await response.json()


async def test_chat_sse_is_framed_like_vllm(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    body = {"model": "m", "messages": HELLO, "max_tokens": 2, "stream": True}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert response.headers["x-sim-name"] == "test-pool"
        events = _events(await response.read())
    assert events[-1] == "[DONE]"
    role, first, last = events[:-1]
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert first["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["stop_reason"] is None
    assert all("usage" not in event for event in (role, first, last))
    assert {e["object"] for e in (role, first, last)} == {"chat.completion.chunk"}


async def test_continuous_usage_stats_put_usage_on_every_chunk(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    body = {
        "messages": HELLO,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with http.post(sim.url + "/v1/chat/completions", json=body) as response:
        events = _events(await response.read())[:-1]
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 1, 2, 2]
    assert events[-1]["choices"] == []


async def test_a_stream_interval_sends_several_tokens_a_chunk(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """vLLM's ``--stream-interval`` (and speculative decoding) put several tokens in one chunk:
    a reader counting chunks undercounts; the usage chunk tells the truth."""
    sim = await start_sim(stream_interval=4)
    body = {"messages": HELLO, "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as response:
        events = _events(await response.read())[:-1]
    role, *tokens, usage = events
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert [e["usage"]["completion_tokens"] for e in tokens] == [4, 8, 10]
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 10
    text = "".join(e["choices"][0]["delta"]["content"] for e in tokens)
    async with http.post(sim.url + "/v1/chat/completions",
                         json={"messages": HELLO, "max_tokens": 10}) as response:
        assert (await response.json())["choices"][0]["message"]["content"] == text


async def test_completion_sse_interleaves_prompts_by_index(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(decode_ms_per_token=1.0)
    body = {"prompt": ["a", "b"], "max_tokens": 2, "stream": True}
    async with http.post(sim.url + "/v1/completions", json=body) as response:
        events = _events(await response.read())
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1]]
    assert [(c["index"], c["finish_reason"]) for c in choices] == [
        (0, None),
        (1, None),
        (0, "length"),
        (1, "length"),
    ]
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events[:-1])


async def test_n_choices_are_generated_counted_and_streamed_as_vllm_does(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """``n``: that many choices per prompt, each its own words; usage counts every choice's
    tokens and each prompt once; a stream opens with a role chunk per choice and numbers the
    tokens by choice (completions: prompt ``i``'s choice ``j`` is ``i * n + j``)."""
    sim = await start_sim(decode_ms_per_token=1.0)
    status, body = await _post(http, sim, "/v1/chat/completions",
                               {"messages": HELLO, "max_tokens": 4, "n": 3})
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(set(texts)) == 3
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                             "prompt_tokens_details": None}
    _, one = await _post(http, sim, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 4})
    assert one["choices"][0]["message"]["content"] == texts[0]  # choice 0 is n = 1's answer

    stream = {"messages": HELLO, "max_tokens": 4, "n": 3, "stream": True,
              "stream_options": {"include_usage": True}}
    async with http.post(sim.url + "/v1/chat/completions", json=stream) as response:
        events = _events(await response.read())
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"role": "assistant", "content": ""}] * 3
    by_choice: dict[int, str] = {}
    for chunk in chunks[3:]:
        [choice] = chunk["choices"]
        by_choice[choice["index"]] = by_choice.get(choice["index"], "") + choice["delta"]["content"]
    assert [by_choice[i] for i in range(3)] == texts
    assert usage["usage"]["completion_tokens"] == 12 and usage["usage"]["prompt_tokens"] == 9

    status, body = await _post(http, sim, "/v1/completions",
                               {"prompt": ["a", "b c"], "max_tokens": 2, "n": 2})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    _, single = await _post(http, sim, "/v1/completions", {"prompt": ["a", "b c"], "max_tokens": 2})
    assert [body["choices"][i]["text"] for i in (0, 2)] == [c["text"] for c in single["choices"]]
    assert body["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 2 * single["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    ("path", "data", "message"),
    [
        ("/v1/chat/completions", b"{not json", "JSON decode error"),
        ("/v1/completions", b"", "The request body is empty"),
        ("/v1/embeddings", b"\xff\xfe", "JSON decode error"),
        ("/v1/chat/completions", b"[]", "The request body must be a JSON object"),
    ],
)
async def test_malformed_bodies_are_400_json(
    start_sim: StartSim, http: aiohttp.ClientSession, path: str, data: bytes, message: str
) -> None:
    sim = await start_sim()
    async with http.post(sim.url + path, data=data,
                         headers={"Content-Type": "application/json"}) as response:
        assert response.status == 400
        assert response.content_type == "application/json"
        assert response.headers["x-sim-name"] == "test-pool"
        body = await response.json()
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["code"] == 400
    assert body["error"]["message"].startswith(message)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_a_body_that_is_not_application_json_is_vllms_400(
    start_sim: StartSim, http: aiohttp.ClientSession, content_type: str | None
) -> None:
    """vLLM's ``validate_json_request``: any other media type, a missing one too, is refused
    before the body is read."""
    sim = await start_sim()
    headers = {} if content_type is None else {"Content-Type": content_type}
    data = orjson.dumps({"messages": HELLO})
    async with http.post(sim.url + "/v1/chat/completions", data=data, headers=headers,
                         skip_auto_headers=["Content-Type"]) as response:
        assert response.status == 400
        body = await response.json()
    assert "Unsupported Media Type: Only 'application/json' is allowed" in body["error"]["message"]
    assert sim.app[STATE].journal.entries()[-1]["path"] == "/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "hello"})],
)
@pytest.mark.parametrize("salt", ["", 7, ["a"]])
async def test_a_bad_cache_salt_is_vllms_400(
    start_sim: StartSim, http: aiohttp.ClientSession, path: str, body: dict[str, Any], salt: object
) -> None:
    sim = await start_sim()
    async with http.post(sim.url + path, json={**body, "cache_salt": salt}) as response:
        assert response.status == 400
        assert response.content_type == "application/json"
        assert response.headers["x-sim-name"] == "test-pool"
        answer = await response.json()
    assert answer == {
        "error": {
            "message": "Parameter 'cache_salt' must be a non-empty string if provided. "
            "(parameter=cache_salt)",
            "type": "BadRequestError",
            "param": "cache_salt",
            "code": 400,
        }
    }


async def test_unknown_routes_and_methods(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    async with http.get(sim.url + "/v1/nothing") as response:
        assert (response.status, await response.json()) == (404, {"detail": "Not Found"})
        assert response.headers["x-sim-name"] == "test-pool"
    async with http.get(sim.url + "/v1/chat/completions") as response:
        assert (response.status, await response.json()) == (405, {"detail": "Method Not Allowed"})
        assert response.headers["Allow"] == "POST"


async def test_health_models_and_name_header(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(name="vllm-long", max_model_len=32768)
    async with http.get(sim.url + "/health") as response:
        assert (response.status, response.headers["x-sim-name"]) == (200, "vllm-long")
    async with http.get(sim.url + "/v1/models") as response:
        cards = (await response.json())["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("vllm-long", 32768)]


async def test_embeddings_float_and_base64_are_identical(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(embedding_dim=32)
    _, floats = await _post(http, sim, "/v1/embeddings", {"input": ["alpha", "beta"]})
    _, packed = await _post(
        http, sim, "/v1/embeddings", {"input": ["alpha", "beta"], "encoding_format": "base64"}
    )
    assert [decode_base64(d["embedding"]) for d in packed["data"]] == [d["embedding"] for d in floats["data"]]
    assert floats["usage"] == {
        "prompt_tokens": 2 + 1,  # "alpha" is 5 bytes, "beta" 4
        "total_tokens": 3,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    status, token_ids = await _post(http, sim, "/v1/embeddings", {"input": [[1, 2, 3], [4]]})
    assert status == 200 and token_ids["usage"]["prompt_tokens"] == 4
    # The same input gives the same vector on every call, alone or in a batch.
    _, again = await _post(http, sim, "/v1/embeddings", {"input": "alpha"})
    assert again["data"][0]["embedding"] == floats["data"][0]["embedding"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "dimensions": 8}, 200, None),
        ({"input": "x", "dimensions": 33}, 400, "dimensions"),
        ({"input": "x" * 41}, 400, "input_tokens"),  # 11 tokens > max_model_len 10
        ({"input": "x", "model": "nope"}, 404, "model"),
    ],
)
async def test_embedding_limits(
    start_sim: StartSim, http: aiohttp.ClientSession, body: Any, status: int, param: str | None
) -> None:
    sim = await start_sim(embedding_dim=32, max_model_len=10, models=("e",))
    got, answer = await _post(http, sim, "/v1/embeddings", body)
    assert got == status
    if status == 200:
        assert len(answer["data"][0]["embedding"]) == 8
    else:
        assert answer["error"]["param"] == param


async def test_journal_serves_requests_nested_deeper_than_json_writers_go(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """vLLM reads JSON 1,024 levels deep, orjson writes 255 and the standard library ~990: the
    journal still answers once it holds such requests (the deepest body as a placeholder)."""
    sim = await start_sim()
    journal: list[Any] = []
    for depth in (300, 1000):
        deep = b"[" * depth + b"]" * depth
        raw = b'{"model": "m", "max_tokens": 1, "prompt": "x", "guided_json": ' + deep + b"}"
        async with http.post(sim.url + "/v1/completions", data=raw,
                             headers={"content-type": "application/json"}) as response:
            assert response.status == 200
        async with http.get(sim.url + "/sim/requests") as response:
            assert response.status == 200
            journal = await response.json()
    first, second = journal
    assert first["body"]["prompt"] == "x"
    assert second["body"] == "<nested deeper than the journal can write>"


async def test_journal_records_api_requests_only(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    body = {"input": ["a"], "model": "e"}
    async with http.post(sim.url + "/v1/embeddings?trace=1", json=body, headers={"X-Tenant-Id": "legal"}):
        pass
    async with http.post(sim.url + "/v1/completions", data=b"{oops"):
        pass
    async with http.get(sim.url + "/health"), http.get(sim.url + "/metrics"):
        pass
    async with http.get(sim.url + "/sim/requests") as response:
        entries = await response.json()
    assert [(e["method"], e["path"], e["body"]) for e in entries] == [
        ("POST", "/v1/embeddings", body),
        ("POST", "/v1/completions", None),
    ]
    assert entries[0]["headers"]["x-tenant-id"] == "legal"
    assert entries[0]["headers"]["content-type"] == "application/json"
    assert entries[0]["query"] == {"trace": "1"}
    async with http.delete(sim.url + "/sim/requests") as response:
        assert await response.json() == {"deleted": 2}
    async with http.get(sim.url + "/sim/requests") as response:
        assert await response.json() == []


async def test_journal_never_serves_credentials(start_sim: StartSim,
                                                http: aiohttp.ClientSession) -> None:
    """GET /sim/requests is reachable by whoever reaches the pool: it must not hand out keys."""
    sim = await start_sim()
    secrets = {"Authorization": "Bearer sk-client-secret", "X-Api-Key": "sk-other-secret",
               "Cookie": "session=s3cr3t", "Proxy-Authorization": "Basic cHJveHk="}
    async with http.post(sim.url + "/v1/embeddings", json={"input": ["a"], "model": "e"},
                         headers=secrets):
        pass
    async with http.get(sim.url + "/sim/requests") as response:
        text = await response.text()
    for value in secrets.values():
        assert value not in text and value.split()[-1] not in text
    [entry] = json.loads(text)
    digest = hashlib.sha256(b"Bearer sk-client-secret").hexdigest()[:12]
    assert entry["headers"]["authorization"] == f"redacted sha256:{digest}"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_count_what_was_served(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(models=("llama",))
    for _ in range(2):
        await _post(http, sim, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3})
    await _post(http, sim, "/v1/completions", {"prompt": "abcd", "stream": False})
    await _post(http, sim, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 9999})
    async with http.get(sim.url + "/metrics") as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        samples = _samples(await response.text())
    model = (("model_name", "llama"),)
    assert samples[("vllm:prompt_tokens_total", model)] == 9 + 9 + 1
    assert samples[("vllm:generation_tokens_total", model)] == 3 + 3 + 16
    success = "vllm:request_success_total"
    assert samples[(success, (("finished_reason", "length"), *model))] == 2
    assert samples[(success, (("finished_reason", "stop"), *model))] == 1
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 3
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 3
    assert samples[("vllm:time_per_output_token_seconds_count", model)] == 2 + 2 + 15
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert samples[(f"vllm:{gauge}", model)] == 0


async def test_running_and_waiting_follow_the_batch_and_priority_wins(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(max_num_seqs=1, decode_ms_per_token=20.0)
    finished: list[str] = []

    async def chat(tag: str, priority: int, tokens: int) -> None:
        body = {"messages": HELLO, "max_tokens": tokens, "priority": priority}
        status, _ = await _post(http, sim, "/v1/chat/completions", body)
        assert status == 200
        finished.append(tag)

    model = (("model_name", "test-pool"),)

    async def counts() -> tuple[float, float]:
        async with http.get(sim.url + "/metrics") as response:
            samples = _samples(await response.text())
        return (samples[("vllm:num_requests_running", model)],
                samples[("vllm:num_requests_waiting", model)])

    async def counts_are(running: int, waiting: int) -> bool:
        return await counts() == (running, waiting)

    # The blocker's 40 tokens take 0.8 s: long enough to queue both late requests behind it.
    blocker = asyncio.create_task(chat("blocker", 0, 40))
    await until(lambda: counts_are(1, 0), timeout_s=10, what="the blocker to run")
    late = [asyncio.create_task(chat("low", 9, 1)), asyncio.create_task(chat("high", -1, 1))]
    await until(lambda: counts_are(1, 2), timeout_s=10, what="both late requests to wait")
    await asyncio.gather(blocker, *late)
    assert finished == ["blocker", "high", "low"]


async def test_a_client_that_hangs_up_is_counted_as_an_abort(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(decode_ms_per_token=20.0)
    body = {"messages": HELLO, "max_tokens": 200, "stream": True}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as response:
        await response.content.readuntil(b"\n\n")
        response.close()
    metrics = sim.app[STATE].metrics.registry
    labels = {"model_name": "test-pool"}
    aborts = {**labels, "finished_reason": "abort"}
    await until(lambda: metrics.get_sample_value("vllm:request_success_total", aborts) == 1,
                timeout_s=10, what="the abort to be counted")
    assert metrics.get_sample_value("vllm:num_requests_running", labels) == 0


async def test_shutdown_finishes_in_flight_streams_at_once(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(decode_ms_per_token=200.0)
    body = {"messages": HELLO, "max_tokens": 50, "stream": True}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as response:
        await response.content.readuntil(b"\n\n")
        start = time.monotonic()
        sim.app[STATE].engine.stop()
        rest = await response.read()
    assert time.monotonic() - start < 3.0  # at once, not the 10 s of the 49 tokens left
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_a_tokenizer_file_drives_the_counts(
    tmp_path: Path, start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    sim = await start_sim(tokenizer=str(tmp_path / "tokenizer.json"))
    _, reply = await _post(http, sim, "/v1/completions", {"prompt": "hi hi hi hi hi", "max_tokens": 1})
    assert reply["usage"]["prompt_tokens"] == 5


def test_build_app_refuses_a_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer file not found"):
        build_app(SimConfig(name="p", tokenizer=str(tmp_path / "missing.json")))


async def test_request_id_header_becomes_the_response_id(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    async with http.post(
        sim.url + "/v1/chat/completions", json={"messages": HELLO}, headers={"X-Request-Id": "abc"}
    ) as response:
        assert (await response.json())["id"] == "chatcmpl-abc"
