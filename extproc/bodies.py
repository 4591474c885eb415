"""Parsing OpenAI request bodies (chat, completions, embeddings) into plain frozen values.

Each body is parsed once (orjson); what later steps need is pulled out here and the parsed
object is kept so a rewrite (canary model, priority) does not parse again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from extproc.errors import ClientError, bad_request
from extproc.quick_init import quick_init

Api = Literal["chat", "completions", "embeddings"]


@quick_init
@dataclass(frozen=True)
class PromptParts:
    """The prompt as the token counter sees it: texts, explicit token ids, message count, and
    the media items of a chat prompt (images, audio clips, videos; see :data:`MEDIA_PARTS`)."""

    texts: tuple[str, ...]
    token_ids: int
    messages: int
    media: tuple[int, int, int] = (0, 0, 0)


@quick_init
@dataclass(frozen=True)
class GenerationBody:
    """A chat or completions request, reduced to what routing and the reservation need."""

    api: Api
    model: str
    prompts: tuple[PromptParts, ...]
    """One for chat; one per entry of a batched completions ``prompt`` (vLLM serves each as its
    own request)."""
    max_output_tokens: int | None
    """Output tokens asked for per sequence, as vLLM reads them: chat's ``max_completion_tokens``,
    else ``max_tokens``; a value of 0 or less counts as not set (vLLM's ``or`` falls back the
    same way). None: the model's ``default_max_tokens``."""
    choices: int
    """Sequences generated per prompt: ``n``, or ``best_of`` when larger (vLLM generates
    ``best_of`` and returns the best ``n``)."""
    stream: bool
    include_usage: bool
    doc: dict[str, Any]
    min_output_tokens: int = 0
    """vLLM's ``min_tokens``: the least output per sequence (0: not set)."""


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


def _output_field(doc: dict[str, Any], name: str) -> int | None:
    """An output budget field; 0 is "not set", as vLLM's ``max_completion_tokens or
    max_tokens`` treats it (a client sending ``max_completion_tokens: 0`` gets the fallback,
    not a cheap estimate). A negative value is a 400, as vLLM answers it: never sent on."""
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer.", param=name)
    if value < 0:
        raise bad_request(f"{name} must be at least 1.", param=name)
    return value if value > 0 else None


def _bool_field(doc: dict[str, Any], name: str) -> bool:
    value = doc.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean.", param=name)
    return value


def _token_list(value: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


_EMBEDS = 3
MEDIA_PARTS = {"image_url": 0, "input_image": 0, "image_embeds": _EMBEDS, "image_pil": 0,
               "audio_url": 1, "input_audio": 1, "audio_embeds": _EMBEDS, "video_url": 2}
"""vLLM's media content parts (its ``MM_PARSER_MAP``), as an index into ``PromptParts.media``
(image, audio, video). A part without a ``type`` (or with a ``uuid``) is read by its key, as
vLLM does. Precomputed embeddings (``_EMBEDS``) are refused: as with ``prompt_embeds``, their
length is inside a serialized tensor, so no price per item bounds them."""

_PART_TEXT_SKIP = frozenset(("type", "uuid"))
_MESSAGE_SKIP = frozenset(("role", "content"))
ROLES = frozenset(("system", "developer", "user", "assistant", "tool", "function"))
"""The usual roles, whose markers :data:`extproc.tokens.PER_MESSAGE_TOKENS` allows for."""
TEMPLATE_FIELDS = ("tools", "functions", "response_format", "documents", "chat_template",
                   "chat_template_kwargs")
"""Request fields a chat template renders beside the messages (or is: a request's own
``chat_template``, on a pool that trusts one, puts its literal text in every prompt)."""


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def _media_index(part: dict[str, Any]) -> int | None:
    kind = part.get("type")
    if isinstance(kind, str) and part.get("uuid") is None:
        return MEDIA_PARTS.get(kind)
    if kind is None or part.get("uuid") is not None:
        for key, index in MEDIA_PARTS.items():
            if key in part and key != "input_image":
                return index
    return None


def _chat_prompt(doc: dict[str, Any]) -> PromptParts:
    """Every text vLLM's chat template can render, so that no field hides a long prompt: the
    text of each content part whatever its type (``text``, ``refusal``, ``thinking``, ...),
    each message's other fields (``name``, ``tool_calls``, ``reasoning``, ...), and the
    request's :data:`TEMPLATE_FIELDS`; media parts are counted as items, not as text."""
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of message objects.", param="messages")
    texts: list[str] = []
    media = [0, 0, 0]
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
                if part.get("type") == "text" and not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content[{j}].text must be a string.",
                                      param="messages")
                index = _media_index(part)
                if index is not None:
                    if index == _EMBEDS:
                        raise bad_request(
                            f"messages[{i}].content[{j}]: image and audio embeddings cannot be "
                            "counted against your limits here; send the media itself.",
                            param="messages")
                    media[index] += 1
                    continue
                texts.extend(_as_text(value) for key, value in part.items()
                             if key not in _PART_TEXT_SKIP and value is not None)
        elif content is not None:
            raise bad_request(f"messages[{i}].content must be a string or an array of parts.",
                              param="messages")
        if role not in ROLES:
            texts.append(role)  # a template prints the role: a custom one may be long
        if len(message) > 2 or "content" not in message:  # more than role and content
            texts.extend(orjson.dumps(value).decode() for key, value in message.items()
                         if key not in _MESSAGE_SKIP and value is not None)
    for extra in TEMPLATE_FIELDS:
        if doc.get(extra) is not None:
            texts.append(orjson.dumps(doc[extra]).decode())
    return PromptParts(tuple(texts), 0, len(messages), (media[0], media[1], media[2]))


MAX_CHOICES = 128
"""Most sequences one request may generate per prompt (``n``, ``best_of``): each is a whole
generation, so without a cap one request could ask a pool for 100,000 of them."""
MAX_PROMPTS = 2048
"""Most prompts in one batched completions request (OpenAI's batch limit, as for embeddings)."""
MAX_TOKEN_IDS = 1_000_000
"""Most token ids one request may carry. A million one-id prompts used to cost extproc ~2 s of
CPU (a type check per id, then a count per prompt) and came out tier ``high``."""


def _choices(doc: dict[str, Any]) -> int:
    """``n``, or ``best_of`` when larger, capped: read before any work that grows with them."""
    choices = 1
    for name in ("n", "best_of"):
        value = _int_field(doc, name, 1)
        if value is None:
            continue
        if value > MAX_CHOICES:
            raise bad_request(f"{name} may be at most {MAX_CHOICES}; this request asks for "
                              f"{value}.", param=name)
        choices = max(choices, value)
    return choices


def _completion_prompts(doc: dict[str, Any]) -> tuple[PromptParts, ...]:
    """The prompts of a completions body; the batch size and the token-id total are checked
    before any per-item work (only ``len`` of the lists is read first)."""
    if doc.get("prompt_embeds") is not None:
        # vLLM (--enable-prompt-embeds) serves them beside the prompt; their length is inside a
        # serialized tensor, so they would pass every token limit and context check uncounted.
        raise bad_request("prompt_embeds cannot be counted against your limits here; send the "
                          "prompt as text or token ids.", param="prompt_embeds")
    prompt = doc.get("prompt")
    bad = bad_request("prompt must be a string, an array of strings, an array of token ids, "
                      "or an array of token-id arrays.", param="prompt")
    if isinstance(prompt, str):
        return (PromptParts((prompt,), 0, 0),)
    if not isinstance(prompt, list) or not prompt:
        raise bad
    flat = isinstance(prompt[0], int)  # one prompt of token ids, else a batch of prompts
    if not flat and len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt may hold at most {MAX_PROMPTS} prompts; this one has "
                          f"{len(prompt)}. Split the batch.", param="prompt")
    ids = len(prompt) if flat else sum(len(p) for p in prompt if isinstance(p, list))
    if ids > MAX_TOKEN_IDS:
        raise bad_request(f"A request may carry at most {MAX_TOKEN_IDS} token ids; this one has "
                          f"{ids}.", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return tuple(PromptParts((p,), 0, 0) for p in prompt)
    if _token_list(prompt):
        return (PromptParts((), len(prompt), 0),)
    if all(isinstance(p, list) and p and _token_list(p) for p in prompt):
        return tuple(PromptParts((), len(p), 0) for p in prompt)
    raise bad


def _include_usage(doc: dict[str, Any]) -> bool:
    """Whether vLLM sends this stream's usage: ``stream_options`` present and its
    ``include_usage`` true, or absent (vLLM's ``StreamOptions`` defaults it to true once the
    object is sent: ``{}`` and ``{"continuous_usage_stats": true}`` ask for usage); ``null``
    is false. Its flags must be booleans: vLLM would read ``1`` or ``"yes"`` as true too, and
    extproc would strip a usage chunk the client asked for."""
    options = doc.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object.", param="stream_options")
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"stream_options.{name} must be a boolean.", param="stream_options")
    return bool(options.get("include_usage", True))


def parse_generation(api: Api, raw: bytes) -> GenerationBody:
    """A chat or completions body; raises :class:`ClientError` on anything malformed.

    The scalar fields and the bounds come first, so an oversized request is refused before the
    per-message or per-prompt work that would grow with it.
    """
    doc = parse_json_object(raw)
    model = model_of(doc)
    choices = _choices(doc)
    # Completions has no max_completion_tokens (OpenAI's legacy API, and vLLM ignores it there):
    # reading it would let a client claim 1 token of output and ask for thousands.
    max_tokens = _output_field(doc, "max_completion_tokens") if api == "chat" else None
    fallback = _output_field(doc, "max_tokens")
    if max_tokens is None:
        max_tokens = fallback
    stream = _bool_field(doc, "stream")
    include_usage = _include_usage(doc)
    min_tokens = _int_field(doc, "min_tokens", 0) or 0
    prompts = (_chat_prompt(doc),) if api == "chat" else _completion_prompts(doc)
    return GenerationBody(api, model, prompts, max_tokens, choices, stream, include_usage, doc,
                          min_tokens)


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


__all__ = ["MAX_CHOICES", "MAX_PROMPTS", "MAX_TOKEN_IDS", "ClientError", "EmbeddingsBody",
           "GenerationBody", "PromptParts", "parse_embeddings", "parse_generation",
           "parse_json_object"]
