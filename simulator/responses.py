"""Non-streamed response bodies, field for field as current vLLM serialises them.

vLLM dumps its pydantic response models whole, so optional fields it does not fill still appear as
``null`` (``system_fingerprint``, ``service_tier``, ``stop_reason``, ``prompt_logprobs``...). Chat
messages omit ``tool_calls`` when there are none, as current vLLM's serializer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from simulator.generation import SequencePlan


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response shares."""

    id: str
    created: int
    model: str


@dataclass(frozen=True)
class Usage:
    """Token usage of one request."""

    prompt_tokens: int
    completion_tokens: int

    def to_dict(self, *, details: bool = True) -> dict[str, Any]:
        """vLLM's ``UsageInfo``; ``details=False`` drops the null ``prompt_tokens_details``
        (streamed usage is dumped with ``exclude_none``)."""
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if details:
            body["prompt_tokens_details"] = None
        return body


def usage_of(plans: Sequence[SequencePlan], n: int = 1) -> Usage:
    """Usage summed over the sequences of a request, ``n`` per prompt in a row: vLLM counts
    each prompt once, however many choices it has, and every choice's tokens."""
    return Usage(sum(p.prompt_tokens for p in plans[::n]), sum(len(p.pieces) for p in plans))


def chat_completion(meta: ResponseMeta, plans: Sequence[SequencePlan]) -> dict[str, Any]:
    """A ``chat.completion`` body with one assistant choice per sequence (``n``)."""
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [_chat_choice(index, plan) for index, plan in enumerate(plans)],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_of(plans, len(plans)).to_dict(),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }


def _chat_choice(index: int, plan: SequencePlan) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": plan.text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": plan.finish_reason,
        "stop_reason": None,
        "token_ids": None,
    }


def text_completion(meta: ResponseMeta, plans: Sequence[SequencePlan], n: int = 1) -> dict[str, Any]:
    """A ``text_completion`` body with ``n`` choices per prompt, in prompt order (the index of
    prompt ``i``'s choice ``j`` is ``i * n + j``, as vLLM numbers them)."""
    choices = [
        {
            "index": index,
            "text": plan.text,
            "logprobs": None,
            "finish_reason": plan.finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        for index, plan in enumerate(plans)
    ]
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_of(plans, n).to_dict(),
        "kv_transfer_params": None,
    }


def embedding_list(
    meta: ResponseMeta, embeddings: Sequence[list[float] | str], prompt_tokens: int
) -> dict[str, Any]:
    """An embeddings body; each item is a float list or a base64 string, in input order."""
    data = [
        {"index": index, "object": "embedding", "embedding": embedding}
        for index, embedding in enumerate(embeddings)
    ]
    return {
        "id": meta.id,
        "object": "list",
        "created": meta.created,
        "model": meta.model,
        "data": data,
        "usage": Usage(prompt_tokens, 0).to_dict(),
    }


def model_list(names: Sequence[str], created: int, max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models``: one vLLM model card per served name."""
    cards: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [],
        }
        for name in names
    ]
    return {"object": "list", "data": cards}
