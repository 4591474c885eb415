"""Error bodies, response bodies and SSE chunks, field for field."""

from __future__ import annotations

import orjson

from simulator import sse
from simulator.errors import model_not_found, validation_error
from simulator.generation import SequencePlan
from simulator.responses import (
    ResponseMeta,
    Usage,
    chat_completion,
    embedding_list,
    model_list,
    text_completion,
)

META = ResponseMeta("chatcmpl-1", 1700000000, "m")
HEAD = {"id": "chatcmpl-1", "created": 1700000000, "model": "m"}


def test_error_bodies() -> None:
    assert model_not_found("x").body() == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert validation_error("bad.", "n").message == "bad. (parameter=n)"
    assert validation_error("bad.", "n", 0).message == "bad. (parameter=n, value=0)"


def test_usage_shapes() -> None:
    assert Usage(3, 2).to_dict() == {
        "prompt_tokens": 3,
        "total_tokens": 5,
        "completion_tokens": 2,
        "prompt_tokens_details": None,
    }
    assert Usage(3, 2).to_dict(details=False) == {
        "prompt_tokens": 3,
        "total_tokens": 5,
        "completion_tokens": 2,
    }


def test_chat_completion_body() -> None:
    body = chat_completion(META, [SequencePlan(7, ("a", " b"), "length")])
    assert body == {
        **HEAD,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "a b",
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": Usage(7, 2).to_dict(),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }


def test_text_completion_body_has_a_choice_per_prompt_and_summed_usage() -> None:
    plans = [SequencePlan(2, ("x",), "length"), SequencePlan(3, ("y", " z"), "stop")]
    body = text_completion(META, plans)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "x", "length"),
        (1, "y z", "stop"),
    ]
    assert body["object"] == "text_completion"
    assert body["usage"] == Usage(5, 3).to_dict()


def test_embedding_and_model_bodies() -> None:
    assert embedding_list(META, [[0.5], "AAAAPw=="], 4) == {
        **HEAD,
        "object": "list",
        "data": [
            {"index": 0, "object": "embedding", "embedding": [0.5]},
            {"index": 1, "object": "embedding", "embedding": "AAAAPw=="},
        ],
        "usage": Usage(4, 0).to_dict(),
    }
    assert model_list(["a"], 5, 2048)["data"][0] == {
        "id": "a",
        "object": "model",
        "created": 5,
        "owned_by": "vllm",
        "root": "a",
        "parent": None,
        "max_model_len": 2048,
        "permission": [],
    }


def test_sse_event_framing() -> None:
    assert sse.sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse.DONE == b"data: [DONE]\n\n"


CHUNK = {**HEAD, "object": "chat.completion.chunk"}


def test_chat_chunks() -> None:
    assert sse.chat_role_chunk(META) == {
        **CHUNK,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    assert sse.chat_token_chunk(META, " w", None) == {
        **CHUNK,
        "choices": [{"index": 0, "delta": {"content": " w"}, "logprobs": None, "finish_reason": None}],
    }
    last = sse.chat_token_chunk(META, " w", "length", Usage(3, 2))
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["stop_reason"] is None
    assert last["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
    assert "usage" not in sse.chat_token_chunk(META, " w", "length")


def test_completion_and_usage_chunks() -> None:
    assert sse.completion_token_chunk(META, 1, "t", "stop") == {
        **HEAD,
        "object": "text_completion",
        "choices": [
            {"index": 1, "text": "t", "logprobs": None, "finish_reason": "stop", "stop_reason": None}
        ],
    }
    assert sse.usage_chunk(META, "chat.completion.chunk", Usage(1, 2)) == {
        **CHUNK,
        "choices": [],
        "usage": {"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2},
    }
    assert orjson.loads(sse.sse_event(sse.usage_chunk(META, "x", Usage(1, 1)))[6:]) is not None
