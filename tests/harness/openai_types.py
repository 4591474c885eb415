"""Typed shapes for the ``openai`` client in tests: its error body is ``object`` in the SDK."""

from __future__ import annotations

from typing import Any

import openai
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam


def user(content: str) -> list[ChatCompletionMessageParam]:
    """A one-message chat from the user."""
    return [{"role": "user", "content": content}]


def error_body(err: openai.APIStatusError) -> dict[str, Any]:
    """The OpenAI error object of a non-2xx reply (the SDK unwraps ``{"error": ...}``)."""
    body = err.body
    assert isinstance(body, dict), body
    return body


def usage_of(reply: ChatCompletion | Completion) -> CompletionUsage:
    """The usage of a non-streamed reply, which the simulator always sends."""
    assert reply.usage is not None, reply
    return reply.usage
