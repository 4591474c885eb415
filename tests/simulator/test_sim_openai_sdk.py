"""The simulator through the real ``openai`` SDK, as clients and the gateway will use it."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from simulator import RunningSimulator
from simulator.embeddings import decode_base64

StartSim = Callable[..., Awaitable[RunningSimulator]]
SdkFor = Callable[[RunningSimulator], openai.AsyncOpenAI]
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]  # 4 + 3 + 2 = 9 tokens


async def test_chat_non_streamed(start_sim: StartSim, sdk_for: SdkFor) -> None:
    sim = await start_sim(models=("llama",))
    reply = await sdk_for(sim).chat.completions.create(
        model="llama",
        messages=HELLO,
        max_tokens=5,
    )
    assert reply.id.startswith("chatcmpl-")
    assert reply.object == "chat.completion"
    assert reply.model == "llama"
    assert reply.system_fingerprint is None
    choice = reply.choices[0]
    assert (choice.index, choice.finish_reason, choice.message.role) == (0, "length", "assistant")
    assert len((choice.message.content or "").split(" ")) == 5
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (9, 5)
    assert reply.usage.total_tokens == 14


async def test_chat_without_max_tokens_stops_naturally(start_sim: StartSim, sdk_for: SdkFor) -> None:
    sim = await start_sim(default_output_tokens=7)
    reply = await sdk_for(sim).chat.completions.create(model="any-name", messages=HELLO)
    assert reply.model == "any-name"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 7


async def test_chat_streams_tokens_as_they_are_generated(start_sim: StartSim, sdk_for: SdkFor) -> None:
    sim = await start_sim(decode_ms_per_token=50.0)
    start = time.monotonic()
    stream = await sdk_for(sim).chat.completions.create(
        model="m",
        messages=HELLO,
        max_tokens=10,
        stream=True,
    )
    arrivals = []
    chunks = []
    async for chunk in stream:
        arrivals.append(time.monotonic() - start)
        chunks.append(chunk)
    total = arrivals[-1]
    assert total >= 0.45  # 10 tokens x 50 ms
    # The first chunk came while generation was still going: streamed chunks spread over the
    # ~450 ms of decoding (a buffered answer arrives all at once). A machine under load only
    # spreads them more, unlike a bound on when the first one arrives.
    assert arrivals[-1] - arrivals[0] >= 0.2
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(text.split(" ")) == 10
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1


async def test_include_usage_adds_a_final_usage_chunk(start_sim: StartSim, sdk_for: SdkFor) -> None:
    sim = await start_sim()
    stream = await sdk_for(sim).chat.completions.create(
        model="m",
        messages=HELLO,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (9, 3)
    assert all(chunk.usage is None for chunk in chunks[:-1])


async def test_completions_plain_and_streamed(start_sim: StartSim, sdk_for: SdkFor) -> None:
    sim = await start_sim()
    client = sdk_for(sim)
    reply = await client.completions.create(model="m", prompt=["abcd", "abcdefgh"], max_tokens=2)
    assert reply.id.startswith("cmpl-")
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, 4)
    stream = await client.completions.create(
        model="m", prompt=[1, 2, 3], max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices).count(" ") == 3
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 3


async def test_embeddings_through_the_sdk(start_sim: StartSim, sdk_for: SdkFor) -> None:
    sim = await start_sim(embedding_dim=16)
    client = sdk_for(sim)
    floats = await client.embeddings.create(model="e", input=["a", "b"], encoding_format="float")
    packed = await client.embeddings.create(model="e", input=["a", "b"], encoding_format="base64")
    assert [len(d.embedding) for d in floats.data] == [16, 16]
    assert floats.usage.prompt_tokens == 2
    for f, b in zip(floats.data, packed.data, strict=True):
        vector = b.embedding if isinstance(b.embedding, list) else decode_base64(b.embedding)
        assert vector == f.embedding


async def test_context_overflow_is_a_bad_request(start_sim: StartSim, sdk_for: SdkFor) -> None:
    sim = await start_sim(max_model_len=20)
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk_for(sim).chat.completions.create(
            model="m",
            messages=HELLO,
            max_tokens=12,
        )
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "message": "This model's maximum context length is 20 tokens. However, you requested 12 "
        "output tokens and your prompt contains at least 9 input tokens, for a total of at least "
        "21 tokens. Please reduce the length of the input prompt or the number of requested "
        "output tokens. (parameter=input_tokens, value=9)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }


async def test_unknown_model_is_not_found(start_sim: StartSim, sdk_for: SdkFor) -> None:
    sim = await start_sim(models=("llama", "llama-v2"))
    client = sdk_for(sim)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="gpt-4", messages=HELLO)
    assert caught.value.body == {
        "message": "The model `gpt-4` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    listed = await client.models.list()
    assert [m.id for m in listed.data] == ["llama", "llama-v2"]
