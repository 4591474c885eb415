"""Request and response bodies for the benchmark, shaped like the OpenAI API as vLLM serves it.

The stand-in upstream answers with these bytes (Envoy ``direct_response`` or the paced SSE
server), so extproc reads the same usage fields and SSE framing it reads from a real vLLM pod.
"""

from __future__ import annotations

import json

MODEL = "bench-model"
PACED_MODEL = "bench-paced"
PACED256_MODEL = "bench-paced256"
EMBED_MODEL = "bench-embed"
CREATED = 1_700_000_000
OUTPUT_TOKENS = 64
PROMPT_TOKENS = 24
EMBED_DIM = 1024


def _dumps(doc: object) -> str:
    return json.dumps(doc, separators=(",", ":"))


def chat_request(prompt_bytes: int = 0, *, stream: bool = False, model: str = MODEL,
                 max_tokens: int = OUTPUT_TOKENS) -> bytes:
    """A chat request; ``prompt_bytes`` > 0 pads the user message to about that size."""
    content = "Summarise the attached contract in three bullet points, plain English please."
    if prompt_bytes > len(content):
        filler = "The party of the first part agrees to the terms set out below. "
        content = (filler * (prompt_bytes // len(filler) + 1))[:prompt_bytes]
    doc: dict[str, object] = {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": content},
        ],
        "max_tokens": max_tokens,
        "temperature": 0.2,
    }
    if stream:
        doc["stream"] = True
        doc["stream_options"] = {"include_usage": True}
    return _dumps(doc).encode()


def embeddings_request() -> bytes:
    return _dumps({"model": EMBED_MODEL, "input": ["the quick brown fox jumps over the lazy dog",
                                                  "a contract is a promise the law enforces"],
                   "encoding_format": "float"}).encode()


def _tokens(n: int) -> list[str]:
    words = ("The", " contract", " says", " the", " buyer", " pays", " within", " thirty",
             " days", ",", " the", " seller", " ships", " within", " ten", ".")
    return [words[i % len(words)] for i in range(n)]


def _usage(prompt: int, completion: int) -> dict[str, object]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": None}


def chat_response(model: str = MODEL) -> str:
    """A non-streamed ``chat.completion`` as vLLM writes it."""
    return _dumps({
        "id": "chatcmpl-bench0000000000000000000000000000",
        "object": "chat.completion", "created": CREATED, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "reasoning_content": None,
                                             "content": "".join(_tokens(OUTPUT_TOKENS)),
                                             "tool_calls": []},
                     "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": _usage(PROMPT_TOKENS, OUTPUT_TOKENS), "prompt_logprobs": None,
    })


def sse_events(tokens: int = OUTPUT_TOKENS, model: str = MODEL) -> list[str]:
    """The SSE events of a streamed chat completion with ``include_usage``, one per token."""
    head = {"id": "chatcmpl-bench0000000000000000000000000000",
            "object": "chat.completion.chunk", "created": CREATED, "model": model}
    events = [_dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                  "content": ""},
                                           "logprobs": None, "finish_reason": None}]})]
    for token in _tokens(tokens):
        events.append(_dumps({**head, "choices": [{"index": 0, "delta": {"content": token},
                                                   "logprobs": None, "finish_reason": None}]}))
    events.append(_dumps({**head, "choices": [{"index": 0, "delta": {"content": ""},
                                               "logprobs": None, "finish_reason": "length",
                                               "stop_reason": None}]}))
    events.append(_dumps({**head, "choices": [], "usage": _usage(PROMPT_TOKENS, tokens)}))
    return [f"data: {e}\n\n" for e in events] + ["data: [DONE]\n\n"]


def embeddings_response() -> str:
    vector = [round(((i * 7919) % 2000) / 1000 - 1, 6) for i in range(EMBED_DIM)]
    return _dumps({
        "id": "embd-bench", "object": "list", "created": CREATED, "model": EMBED_MODEL,
        "data": [{"index": i, "object": "embedding", "embedding": vector} for i in range(2)],
        "usage": {"prompt_tokens": 20, "total_tokens": 20, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    })


def write_extproc_load(path: str) -> None:
    """The file the ext_proc load clients (``bench.h2_extproc_load``, extproc_workers' grpc
    client) read: a chat request and its answer, split by a NUL byte."""
    with open(path, "wb") as handle:
        handle.write(chat_request() + b"\0" + chat_response().encode())
