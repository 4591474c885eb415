"""Parsing OpenAI request bodies (chat, completions, embeddings) into plain frozen values.

Each body is parsed once (orjson); what later steps need is pulled out here and the parsed
object is kept so a rewrite (canary model, priority) does not parse again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from extproc.errors import ClientError, bad_request

Api = Literal["chat", "completions", "embeddings"]


@dataclass(frozen=True)
class PromptParts:
    """The prompt as the token counter sees it: texts, explicit token ids and message count."""

    texts: tuple[str, ...]
    token_ids: int
    messages: int


@dataclass(frozen=True)
class GenerationBody:
    """A chat or completions request, reduced to what routing needs."""

    api: Api
    model: str
    prompt: PromptParts
    max_output_tokens: int | None
    stream: bool
    include_usage: bool
    doc: dict[str, Any]


@dataclass(frozen=True)
class EmbeddingsBody:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    single: bool
    """True when ``input`` was one item rather than a list."""
    dimensions: int | None
    encoding_format: str
    doc: dict[str, Any]


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}.",
                          code="invalid_json") from None
    if not isinstance(doc, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return doc


def model_of(doc: dict[str, Any]) -> str:
    model = doc.get("model")
    if model is None:
        raise bad_request("You must provide a model parameter.", param="model")
    if not isinstance(model, str) or not model:
        raise bad_request("The model parameter must be a non-empty string.", param="model")
    return model


def _int_field(doc: dict[str, Any], name: str, minimum: int) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer.", param=name)
    if value < minimum:
        raise bad_request(f"{name} must be at least {minimum}.", param=name)
    return value


def _bool_field(doc: dict[str, Any], name: str) -> bool:
    value = doc.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean.", param=name)
    return value


def _token_list(value: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _chat_prompt(doc: dict[str, Any]) -> PromptParts:
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of message objects.", param="messages")
    texts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object.", param="messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}].role must be a string.", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise bad_request(f"messages[{i}].content[{j}] must be an object.",
                                      param="messages")
                text = part.get("text")
                if part.get("type") == "text" and not isinstance(text, str):
                    raise bad_request(f"messages[{i}].content[{j}].text must be a string.",
                                      param="messages")
                if isinstance(text, str):
                    texts.append(text)
        elif content is not None:
            raise bad_request(f"messages[{i}].content must be a string or an array of parts.",
                              param="messages")
        # Tool calls and names are part of the prompt too: count their text.
        for extra in ("name", "tool_calls", "function_call"):
            if extra in message and message[extra] is not None:
                texts.append(orjson.dumps(message[extra]).decode())
    for extra in ("tools", "functions", "response_format"):
        if doc.get(extra) is not None:
            texts.append(orjson.dumps(doc[extra]).decode())
    return PromptParts(tuple(texts), 0, len(messages))


def _completion_prompt(doc: dict[str, Any]) -> PromptParts:
    prompt = doc.get("prompt")
    bad = bad_request("prompt must be a string, an array of strings, an array of token ids, "
                      "or an array of token-id arrays.", param="prompt")
    if isinstance(prompt, str):
        return PromptParts((prompt,), 0, 0)
    if not isinstance(prompt, list) or not prompt:
        raise bad
    if all(isinstance(p, str) for p in prompt):
        return PromptParts(tuple(prompt), 0, 0)
    if _token_list(prompt):
        return PromptParts((), len(prompt), 0)
    if all(isinstance(p, list) and p and _token_list(p) for p in prompt):
        # vLLM treats each entry as its own prompt; the longest one decides the pool.
        return PromptParts((), max(len(p) for p in prompt), 0)
    raise bad


def parse_generation(api: Api, raw: bytes) -> GenerationBody:
    """A chat or completions body; raises :class:`ClientError` on anything malformed."""
    doc = parse_json_object(raw)
    model = model_of(doc)
    prompt = _chat_prompt(doc) if api == "chat" else _completion_prompt(doc)
    max_tokens = _int_field(doc, "max_completion_tokens", 0)
    if max_tokens is None:
        max_tokens = _int_field(doc, "max_tokens", 0)
    stream = _bool_field(doc, "stream")
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object.", param="stream_options")
    include_usage = bool(options and options.get("include_usage") is True)
    return GenerationBody(api, model, prompt, max_tokens, stream, include_usage, doc)


MAX_EMBEDDING_INPUTS = 2048
"""OpenAI's limit on one embeddings batch. Without one, an 8 MB body of two million tiny inputs
kept extproc's event loop busy for seconds (a cache key and a token count per input)."""


def parse_embeddings(raw: bytes) -> EmbeddingsBody:
    """An embeddings body with its inputs normalised to a tuple of strings or token-id tuples."""
    doc = parse_json_object(raw)
    model = model_of(doc)
    value = doc.get("input")
    bad = bad_request("input must be a non-empty string, an array of strings, an array of token "
                      "ids, or an array of token-id arrays.", param="input")
    inputs: tuple[str | tuple[int, ...], ...]
    single = False
    if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS \
            and not isinstance(value[0], int):  # a token-id array is one input: may be longer
        raise bad_request(f"input may hold at most {MAX_EMBEDDING_INPUTS} items; this one has "
                          f"{len(value)}. Split the batch.", param="input")
    if isinstance(value, str):
        inputs, single = (value,), True
    elif isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            inputs = tuple(value)
        elif _token_list(value):
            inputs, single = (tuple(value),), True
        elif all(isinstance(v, list) and v and _token_list(v) for v in value):
            inputs = tuple(tuple(v) for v in value)
        else:
            raise bad
    else:
        raise bad
    dimensions = _int_field(doc, "dimensions", 1)
    encoding = doc.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'.", param="encoding_format")
    return EmbeddingsBody(model, inputs, single, dimensions, encoding, doc)


__all__ = ["ClientError", "EmbeddingsBody", "GenerationBody", "PromptParts", "parse_embeddings",
           "parse_generation", "parse_json_object"]
