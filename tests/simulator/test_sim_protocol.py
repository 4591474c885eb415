"""Request parsing: accepted shapes and the exact 400 for each malformed field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from simulator.errors import SimError
from simulator.protocol import (
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
)
from simulator.tokens import ChatMessage, ChatPrompt, TokenPrompt

HELLO = [{"role": "user", "content": "hello"}]


def test_chat_request_fields() -> None:
    parsed = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                },
            ],
            "max_tokens": 9,
            "max_completion_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "priority": -3,
            "temperature": 0.2,
            "n": 1,
        }
    )
    assert parsed.prompts == (
        ChatPrompt(
            (
                ChatMessage("system", ("be brief",)),
                ChatMessage("user", ("a",)),
                ChatMessage("assistant", ("f", "{}")),
            )
        ),
    )
    assert (parsed.model, parsed.max_tokens, parsed.stream, parsed.priority) == ("m", 7, True, -3)
    assert (parsed.include_usage, parsed.continuous_usage) == (True, True)


@pytest.mark.parametrize(
    ("fields", "max_tokens"),
    [
        ({"max_completion_tokens": 0}, None),  # vLLM: ``max_completion_tokens or max_tokens``
        ({"max_completion_tokens": 0, "max_tokens": 5}, 5),
        ({"max_completion_tokens": 3, "max_tokens": 5}, 3),
        ({"max_completion_tokens": None, "max_tokens": 5}, 5),
    ],
)
def test_chat_max_completion_tokens_0_falls_back_as_in_vllm(
    fields: dict[str, object], max_tokens: int | None
) -> None:
    parsed = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **fields})
    assert parsed.max_tokens == max_tokens


@pytest.mark.parametrize(
    ("options", "stream", "usage"),
    [
        (None, True, (False, False)),
        ({}, True, (True, False)),  # vLLM's StreamOptions.include_usage defaults to true
        ({}, False, (True, False)),  # an empty object passes vLLM's stream check
        ({"include_usage": False, "continuous_usage_stats": True}, True, (False, False)),
        ({"include_usage": None}, True, (False, False)),  # None there: its `if` reads false
        ({"continuous_usage_stats": True}, True, (True, True)),
    ],
)
def test_stream_options_follow_vllm(
    options: dict[str, Any] | None, stream: bool, usage: tuple[bool, bool]
) -> None:
    parsed = parse_chat_request({"messages": HELLO, "stream": stream, "stream_options": options})
    assert (parsed.include_usage, parsed.continuous_usage) == usage


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("hi", ("hi",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], (TokenPrompt((1, 2, 3)),)),
        ([[1], [2, 3]], (TokenPrompt((1,)), TokenPrompt((2, 3)))),
    ],
)
def test_completion_prompt_forms(prompt: Any, prompts: tuple[Any, ...]) -> None:
    parsed = parse_completion_request({"prompt": prompt})
    assert parsed.prompts == prompts
    assert (parsed.model, parsed.max_tokens, parsed.stream, parsed.priority) == (None, None, False, 0)


def test_embedding_request_fields() -> None:
    parsed = parse_embedding_request(
        {"input": [[1, 2]], "model": "e", "encoding_format": "base64", "dimensions": 8}
    )
    assert parsed.inputs == (TokenPrompt((1, 2)),)
    assert (parsed.model, parsed.encoding_format, parsed.dimensions) == ("e", "base64", 8)
    assert parse_embedding_request({"input": "x", "encoding_format": None}).encoding_format == "float"


CHAT_ERRORS = [
    ([1, 2], None, "The request body must be a JSON object"),
    ({}, "messages", "'messages' must be a non-empty list of messages"),
    ({"messages": []}, "messages", "'messages' must be a non-empty list of messages"),
    ({"messages": ["hi"]}, "messages", "'messages[0]' must be an object"),
    ({"messages": [{"content": "x"}]}, "messages", "'messages[0].role' must be a non-empty string"),
    (
        {"messages": [{"role": "user", "content": 5}]},
        "messages",
        "'messages[0].content' must be a string or a list of parts",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages",
        "'messages[0].content' text parts need a string 'text'",
    ),
    ({"messages": HELLO, "model": 3}, "model", "'model' must be a string"),
    ({"messages": HELLO, "max_tokens": "5"}, "max_tokens", "'max_tokens' must be an integer"),
    ({"messages": HELLO, "max_tokens": True}, "max_tokens", "'max_tokens' must be an integer"),
    (
        {"messages": HELLO, "max_tokens": 0},
        "max_tokens",
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
    ),
    (
        {"messages": HELLO, "max_tokens": 10, "min_tokens": 11},
        "min_tokens",
        "min_tokens must be less than or equal to max_tokens=10, got 11. "
        "(parameter=min_tokens, value=11)",
    ),
    (
        {"messages": HELLO, "min_tokens": -1},
        "min_tokens",
        "min_tokens must be greater than or equal to 0, got -1. (parameter=min_tokens, value=-1)",
    ),
    (
        {"messages": HELLO, "n": 0},
        "n",
        "n must be at least 1, got 0. (parameter=n, value=0)",
    ),
    ({"messages": HELLO, "n": "2"}, "n", "'n' must be an integer"),
    (
        {"messages": HELLO, "n": 10**8},
        "n",
        "The vLLM simulator serves at most n=1024. (parameter=n, value=100000000)",
    ),
    ({"messages": HELLO, "stream": "yes"}, "stream", "'stream' must be a boolean"),
    (
        {"messages": HELLO, "stream_options": {"include_usage": True}},
        "stream_options",
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
    ),
    (
        {"messages": HELLO, "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
        "'stream_options.include_usage' must be a boolean",
    ),
    ({"messages": HELLO, "priority": 1.5}, "priority", "'priority' must be an integer"),
]


@pytest.mark.parametrize(("body", "param", "message"), CHAT_ERRORS)
def test_chat_request_errors(body: Any, param: str | None, message: str) -> None:
    with pytest.raises(SimError) as caught:
        parse_chat_request(body)
    assert (caught.value.status, caught.value.param, caught.value.message) == (400, param, message)


FORMS = "a string, a non-empty list of strings, a list of non-negative token ids, or a list of token-id lists"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "prompt", "'prompt' is required"),
        ({"prompt": None}, "prompt", "'prompt' is required"),
        ({"prompt": []}, "prompt", f"'prompt' must be {FORMS}"),
        ({"prompt": 5}, "prompt", f"'prompt' must be {FORMS}"),
        ({"prompt": ["a", 1]}, "prompt", f"'prompt' must be {FORMS}"),
        ({"prompt": [-1]}, "prompt", f"'prompt' must be {FORMS}"),
        ({"prompt": [[1], []]}, "prompt", "The decoder prompt cannot be empty (parameter=prompt)"),
        ({"prompt": ""}, "prompt", "The decoder prompt cannot be empty (parameter=prompt)"),
    ],
)
def test_completion_request_errors(body: Any, param: str, message: str) -> None:
    with pytest.raises(SimError) as caught:
        parse_completion_request(body)
    assert (caught.value.status, caught.value.param, caught.value.message) == (400, param, message)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "input", "'input' is required"),
        ({"input": ["ok", ""]}, "input", "The input cannot be empty (parameter=input)"),
        (
            {"input": "x", "encoding_format": "int8"},
            "encoding_format",
            "'encoding_format' must be 'float' or 'base64'",
        ),
        (
            {"input": "x", "dimensions": 0},
            "dimensions",
            "dimensions must be at least 1 (parameter=dimensions, value=0)",
        ),
    ],
)
def test_embedding_request_errors(body: Any, param: str, message: str) -> None:
    with pytest.raises(SimError) as caught:
        parse_embedding_request(body)
    assert (caught.value.status, caught.value.param, caught.value.message) == (400, param, message)


PARSERS = [
    pytest.param(parse_chat_request, {"messages": HELLO}, id="chat"),
    pytest.param(parse_completion_request, {"prompt": "hello"}, id="completion"),
]
ParseFn = Callable[[object], GenerationRequest]


@pytest.mark.parametrize(("parse", "base"), PARSERS)
@pytest.mark.parametrize(
    ("fields", "salt"),
    [
        ({}, None),
        ({"cache_salt": None}, None),  # vLLM: null is no salt
        ({"cache_salt": "abc"}, "abc"),
        ({"cache_salt": " "}, " "),  # vLLM checks emptiness only, it does not strip
    ],
)
def test_cache_salt_is_optional(
    parse: ParseFn, base: dict[str, object], fields: dict[str, object], salt: str | None
) -> None:
    assert parse({**base, **fields}).cache_salt == salt


SALT_MESSAGE = "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"


@pytest.mark.parametrize(("parse", "base"), PARSERS)
@pytest.mark.parametrize("salt", ["", 5, [], {}, False])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_400(
    parse: ParseFn, base: dict[str, object], salt: object
) -> None:
    with pytest.raises(SimError) as caught:
        parse({**base, "cache_salt": salt})
    error = caught.value
    assert (error.status, error.param, error.message) == (400, "cache_salt", SALT_MESSAGE)
