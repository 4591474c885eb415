"""Parsed requests: the fields of vLLM's request bodies the simulator acts on.

Each ``parse_*`` function takes the decoded JSON body and returns a frozen request, or raises
``SimError`` (400) naming the field, as vLLM's pydantic validation does. Fields the simulator does
not act on (temperature, top_p, stop, seed, tools, ...) are accepted and ignored, as vLLM accepts
unknown fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from simulator.errors import bad_request, validation_error
from simulator.tokens import ChatMessage, ChatPrompt, Prompt, TokenPrompt

EncodingFormat = Literal["float", "base64"]
MAX_CHOICES = 1024


@dataclass(frozen=True)
class GenerationRequest:
    """A chat or text completion request.

    ``prompts`` has one ``ChatPrompt`` for chat, one or more text/token prompts for completions.
    ``max_tokens`` is a chat request's ``max_completion_tokens`` when set and not 0, else
    ``max_tokens``; ``min_tokens`` is vLLM's (0: not set). ``cache_salt`` is vLLM's prefix-cache
    salt (``None``: not set): prompts share cached blocks only with prompts of the same salt.
    ``n``: the choices generated per prompt (vLLM's ``n``; ``best_of``, which vLLM V1 dropped,
    is ignored with the other fields the simulator does not act on).
    """

    model: str | None
    prompts: tuple[Prompt, ...]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    priority: int
    min_tokens: int = 0
    cache_salt: str | None = None
    n: int = 1


@dataclass(frozen=True)
class EmbeddingRequest:
    """An embeddings request; ``inputs`` are texts or token-id prompts."""

    model: str | None
    inputs: tuple[str | TokenPrompt, ...]
    encoding_format: EncodingFormat
    dimensions: int | None
    priority: int


def parse_chat_request(body: object) -> GenerationRequest:
    """A ``/v1/chat/completions`` body; ``messages`` must be a non-empty list of messages."""
    fields = _object(body)
    raw_messages = fields.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    prompt = ChatPrompt(tuple(_message(m, i) for i, m in enumerate(raw_messages)))
    completion = _optional_int(fields, "max_completion_tokens")
    legacy = _optional_int(fields, "max_tokens")
    # vLLM reads ``max_completion_tokens or max_tokens``: a 0 falls back as an absent field does.
    return _generation(fields, (prompt,), completion or legacy)


def parse_completion_request(body: object) -> GenerationRequest:
    """A ``/v1/completions`` body; ``prompt`` is a text, texts, token ids, or lists of token ids."""
    fields = _object(body)
    if "prompt" not in fields or fields["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompts = _prompt_items(fields["prompt"], "prompt")
    for prompt in prompts:
        if prompt == "" or prompt == TokenPrompt(()):
            raise validation_error("The decoder prompt cannot be empty", "prompt")
    return _generation(fields, prompts, _optional_int(fields, "max_tokens"))


def parse_embedding_request(body: object) -> EmbeddingRequest:
    """A ``/v1/embeddings`` body; ``encoding_format`` is ``float`` (default) or ``base64``."""
    fields = _object(body)
    if "input" not in fields or fields["input"] is None:
        raise bad_request("'input' is required", "input")
    inputs = _prompt_items(fields["input"], "input")
    for item in inputs:
        if item == "" or item == TokenPrompt(()):
            raise validation_error("The input cannot be empty", "input")
    encoding = fields.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = _optional_int(fields, "dimensions")
    if dimensions is not None and dimensions < 1:
        raise validation_error("dimensions must be at least 1", "dimensions", dimensions)
    return EmbeddingRequest(
        model=_model(fields),
        inputs=inputs,
        encoding_format="float" if encoding == "float" else "base64",
        dimensions=dimensions,
        priority=_priority(fields),
    )


def _generation(
    fields: dict[str, object], prompts: tuple[Prompt, ...], max_tokens: int | None
) -> GenerationRequest:
    if max_tokens is not None and max_tokens < 1:
        raise validation_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    min_tokens = _optional_int(fields, "min_tokens") or 0
    if min_tokens < 0:
        raise validation_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                               "min_tokens", min_tokens)
    if max_tokens is not None and min_tokens > max_tokens:
        raise validation_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                               f"got {min_tokens}.", "min_tokens", min_tokens)
    n = _optional_int(fields, "n")
    if n is None:
        n = 1
    elif n < 1:
        raise validation_error(f"n must be at least 1, got {n}.", "n", n)
    elif n > MAX_CHOICES:  # the simulator's own bound: each choice is planned up front
        raise validation_error(f"The vLLM simulator serves at most n={MAX_CHOICES}.", "n", n)
    stream = _optional_bool(fields, "stream") or False
    include_usage, continuous = _stream_options(fields, stream)
    return GenerationRequest(
        model=_model(fields),
        prompts=prompts,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        priority=_priority(fields),
        min_tokens=min_tokens,
        cache_salt=_cache_salt(fields),
        n=n,
    )


def _cache_salt(fields: dict[str, object]) -> str | None:
    """vLLM's ``cache_salt``: absent or null is no salt, else a non-empty string.

    vLLM checks it in a pydantic validator that raises its ``VLLMValidationError``, hence that
    error's wording (``parameter=cache_salt``, no value) rather than a plain type error.
    """
    salt = fields.get("cache_salt")
    if salt is None or (isinstance(salt, str) and salt):
        return salt
    raise validation_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")


def _stream_options(fields: dict[str, object], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage) as vLLM's ``should_include_usage`` decides them."""
    options = fields.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    # vLLM rejects only truthy options without streaming: `{}` passes its `data.get(...)` test.
    if options and not stream:
        raise validation_error("Stream options can only be defined when `stream=True`.", "stream_options")
    # StreamOptions.include_usage defaults to True in vLLM once stream_options is present; an
    # explicit null is None there, which its `if ... include_usage` reads as false.
    include = _optional_bool(options, "include_usage", "stream_options.include_usage")
    include_usage = "include_usage" not in options if include is None else include
    continuous = _optional_bool(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    return include_usage, include_usage and bool(continuous)


def _message(raw: object, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise bad_request(f"'{where}' must be an object", "messages")
    role = raw.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request(f"'{where}.role' must be a non-empty string", "messages")
    return ChatMessage(role=role, texts=_content_texts(raw.get("content"), where) + _tool_texts(raw))


def _content_texts(content: object, where: str) -> tuple[str, ...]:
    """Text of a message's content; non-text parts (images, audio) count nothing here."""
    if content is None:
        return ()
    if isinstance(content, str):
        return (content,)
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or a list of parts", "messages")
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"'{where}.content' parts must be objects with a type", "messages")
        if part["type"] == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"'{where}.content' text parts need a string 'text'", "messages")
            texts.append(text)
    return tuple(texts)


def _tool_texts(raw: dict[str, object]) -> tuple[str, ...]:
    """Names and argument strings of an assistant message's tool calls, which occupy context."""
    calls = raw.get("tool_calls")
    if not isinstance(calls, list):
        return ()
    texts: list[str] = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            pieces = (function.get("name"), function.get("arguments"))
            texts.extend(piece for piece in pieces if isinstance(piece, str))
    return tuple(texts)


def _prompt_items(value: object, field: str) -> tuple[str | TokenPrompt, ...]:
    """OpenAI's four prompt forms: text, list of texts, token ids, list of token-id lists."""
    if isinstance(value, str):
        return (value,)
    forms = (
        f"'{field}' must be a string, a non-empty list of strings, a list of non-negative "
        "token ids, or a list of token-id lists"
    )
    if not isinstance(value, list) or not value:
        raise bad_request(forms, field)
    if all(isinstance(item, str) for item in value):
        return tuple(value)
    if all(_is_token_id(item) for item in value):
        return (TokenPrompt(tuple(value)),)
    if all(isinstance(item, list) and all(_is_token_id(i) for i in item) for item in value):
        return tuple(TokenPrompt(tuple(item)) for item in value)
    raise bad_request(forms, field)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _object(body: object) -> dict[str, object]:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    return body


def _model(fields: dict[str, object]) -> str | None:
    """``model`` is optional in vLLM (the first served model answers); when given, a string."""
    model = fields.get("model")
    if model is None or isinstance(model, str):
        return model
    raise bad_request("'model' must be a string", "model")


def _priority(fields: dict[str, object]) -> int:
    priority = _optional_int(fields, "priority")
    return 0 if priority is None else priority


def _optional_int(fields: dict[str, object], key: str) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", key)
    return value


def _optional_bool(fields: dict[str, object], key: str, name: str | None = None) -> bool | None:
    value = fields.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise bad_request(f"'{name or key}' must be a boolean", name or key)
