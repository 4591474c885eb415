"""Chat and completions bodies as the router reads them: output budget, choices, prompts, bounds.

Each bound is tried the way a client would try to get around it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from extproc import bodies
from extproc.bodies import (
    MAX_CHOICES,
    MAX_PROMPTS,
    MAX_TOKEN_IDS,
    Api,
    GenerationBody,
    PromptParts,
    parse_generation,
)
from extproc.errors import ClientError

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> GenerationBody:
    return parse_generation("chat", orjson.dumps({"model": "m", "messages": MESSAGES, **fields}))


def completion(prompt: Any = "hi", **fields: Any) -> GenerationBody:
    return parse_generation("completions", orjson.dumps({"model": "m", "prompt": prompt, **fields}))


def refused(api: Api, doc: dict[str, Any]) -> ClientError:
    with pytest.raises(ClientError) as caught:
        parse_generation(api, json.dumps({"model": "m", **doc}).encode())
    assert (caught.value.status, caught.value.type) == (400, "invalid_request_error")
    return caught.value


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"max_tokens": 50}, 50),
    ({"max_completion_tokens": 10}, 10),
    ({"max_completion_tokens": 10, "max_tokens": 50}, 10),  # the newer field wins, as in vLLM
    ({"max_completion_tokens": 0}, None),  # vLLM: "not set", so not a free high priority
    ({"max_completion_tokens": 0, "max_tokens": 50}, 50),  # vLLM falls back to max_tokens
    ({"max_completion_tokens": None, "max_tokens": 50}, 50),
    ({"max_tokens": 0}, None),
    ({"max_completion_tokens": 0, "max_tokens": 0}, None),
])
def test_chat_output_budget(fields: dict[str, Any], expected: int | None) -> None:
    assert chat(**fields).max_output_tokens == expected


@pytest.mark.parametrize(("fields", "expected"), [
    ({"max_tokens": 2000}, 2000),
    # vLLM's completions API has no max_completion_tokens (it ignores the field): a client
    # claiming 1 token of output there must still be weighed by the max_tokens it gets.
    ({"max_completion_tokens": 1, "max_tokens": 2000}, 2000),
    ({"max_completion_tokens": 1}, None),
    ({"max_tokens": 0}, None),
])
def test_completions_output_budget(fields: dict[str, Any], expected: int | None) -> None:
    assert completion(**fields).max_output_tokens == expected


@pytest.mark.parametrize("fields", [
    {"max_tokens": "5"}, {"max_tokens": 1.5}, {"max_tokens": True},
    {"max_completion_tokens": "0"}, {"max_completion_tokens": 10, "max_tokens": "x"},
])
def test_output_budget_types(fields: dict[str, Any]) -> None:
    assert refused("chat", {"messages": MESSAGES, **fields}).param in fields


@pytest.mark.parametrize(("fields", "choices"), [
    ({}, 1), ({"n": None}, 1), ({"n": 1}, 1), ({"n": 4}, 4), ({"n": MAX_CHOICES}, MAX_CHOICES),
    ({"best_of": 5}, 5), ({"n": 2, "best_of": 5}, 5), ({"n": 3, "best_of": 1}, 3),
    ({"n": 2, "best_of": MAX_CHOICES}, MAX_CHOICES),
])
def test_choices(fields: dict[str, Any], choices: int) -> None:
    assert chat(**fields).choices == choices
    assert completion(**fields).choices == choices


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"n": 129}, "n", "n may be at most 128; this request asks for 129."),
    ({"n": 100_000}, "n", "n may be at most 128; this request asks for 100000."),
    ({"n": 2**64 - 1}, "n", f"n may be at most 128; this request asks for {2**64 - 1}."),
    ({"n": 10**30}, "n", "n must be an integer."),  # JSON parsing makes it a float
    ({"best_of": 129}, "best_of", "best_of may be at most 128; this request asks for 129."),
    ({"n": 1, "best_of": 1000}, "best_of", "best_of may be at most 128; this request asks for 1000."),
    ({"n": 0}, "n", "n must be at least 1."),
    ({"n": -3}, "n", "n must be at least 1."),
    ({"n": 2.0}, "n", "n must be an integer."),
    ({"n": "2"}, "n", "n must be an integer."),
    ({"n": True}, "n", "n must be an integer."),
])
def test_choice_bounds(fields: dict[str, Any], param: str, message: str) -> None:
    cases: tuple[tuple[Api, dict[str, Any]], ...] = (
        ("chat", {"messages": MESSAGES}), ("completions", {"prompt": "x"}))
    for api, doc in cases:
        err = refused(api, {**doc, **fields})
        assert (err.code, err.param, err.message) == ("invalid_request", param, message)


def test_n_is_refused_before_the_messages_are_read() -> None:
    # A broken message list after a bad n: the cheap bound answers, not the per-message walk.
    err = refused("chat", {"n": 129, "messages": [{"content": 1}] * 100})
    assert err.param == "n"


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", (PromptParts(("hi",), 0, 0),)),
    (["a", "bb"], (PromptParts(("a",), 0, 0), PromptParts(("bb",), 0, 0))),
    ([1, 2, 3], (PromptParts((), 3, 0),)),
    ([[1], [2, 3]], (PromptParts((), 1, 0), PromptParts((), 2, 0))),
])
def test_completion_prompts_are_one_entry_each(prompt: Any,
                                               expected: tuple[PromptParts, ...]) -> None:
    assert completion(prompt).prompts == expected


def test_a_chat_body_is_one_prompt() -> None:
    parsed = chat(n=3, max_tokens=7)
    assert parsed.prompts == (PromptParts(("hi",), 0, 1),)
    assert (parsed.choices, parsed.max_output_tokens) == (3, 7)


@pytest.mark.parametrize(("value", "expected"), [(None, 0), (0, 0), (300, 300)])
def test_min_tokens(value: object, expected: int) -> None:
    assert chat(min_tokens=value).min_output_tokens == expected


@pytest.mark.parametrize("value", [-1, "5", 2.5, True])
def test_a_bad_min_tokens_is_refused_before_vllm(value: object) -> None:
    with pytest.raises(ClientError) as caught:
        chat(min_tokens=value)
    assert caught.value.param == "min_tokens"


@pytest.mark.parametrize("field", ["tools", "functions", "response_format", "documents"])
def test_what_the_chat_template_renders_beside_the_messages_is_counted(field: str) -> None:
    """A client cannot hide a long prompt in a field the template renders: vLLM counts it."""
    value = [{"title": "t", "text": "long " * 50}]
    parsed = parse_generation("chat", orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}))
    assert parsed.prompts == (PromptParts(("hi", orjson.dumps(value).decode()), 0, 1),)


@pytest.mark.parametrize(("prompt", "ok"), [
    (["a"] * MAX_PROMPTS, True),
    (["a"] * (MAX_PROMPTS + 1), False),
    ([[7]] * MAX_PROMPTS, True),
    ([[7]] * (MAX_PROMPTS + 1), False),
])
def test_at_most_2048_prompts(prompt: list[Any], ok: bool) -> None:
    if ok:
        assert len(completion(prompt).prompts) == MAX_PROMPTS
        return
    err = refused("completions", {"prompt": prompt})
    assert (err.code, err.param) == ("invalid_request", "prompt")
    assert err.message == "prompt may hold at most 2048 prompts; this one has 2049. Split the batch."


@pytest.mark.parametrize(("prompt", "ok"), [
    ([1] * MAX_TOKEN_IDS, True),  # one prompt of a million ids
    ([1] * (MAX_TOKEN_IDS + 1), False),
    ([[1] * (MAX_TOKEN_IDS // 2)] * 2, True),
    ([[1] * (MAX_TOKEN_IDS // 2), [1] * (MAX_TOKEN_IDS // 2 + 1)], False),  # spread over prompts
])
def test_at_most_a_million_token_ids(prompt: list[Any], ok: bool) -> None:
    if ok:
        assert sum(p.token_ids for p in completion(prompt).prompts) == MAX_TOKEN_IDS
        return
    err = refused("completions", {"prompt": prompt})
    assert (err.code, err.param) == ("invalid_request", "prompt")
    assert err.message == ("A request may carry at most 1000000 token ids; this one has "
                           "1000001.")


class CountingScan:
    """Counts the per-id type scans: the bounds must answer before any of them."""

    def __init__(self) -> None:
        self.calls = 0
        self.scan = bodies._token_list

    def __call__(self, value: list[Any]) -> bool:
        self.calls += 1
        return self.scan(value)


@pytest.mark.parametrize(("prompt", "what"), [
    ([[7]] * 1_000_000, "prompts"),  # a million token-id lists: was tier high, ~2 s of CPU
    ([["bad"]] * (MAX_PROMPTS + 1), "prompts"),  # the bound, not the shape, answers
    ([1] * MAX_TOKEN_IDS + ["bad"], "token ids"),
    ([[1] * 600_000, [1] * 600_000, "bad"], "token ids"),
])
def test_bounds_answer_before_any_per_item_work(monkeypatch: pytest.MonkeyPatch,
                                                prompt: list[Any], what: str) -> None:
    scan = CountingScan()
    monkeypatch.setattr(bodies, "_token_list", scan)
    err = refused("completions", {"prompt": prompt})
    assert what in err.message and scan.calls == 0


@pytest.mark.parametrize("fields", [{"max_tokens": -5}, {"max_completion_tokens": -1, "max_tokens": 50}])
def test_a_negative_output_budget_is_refused_before_vllm(fields: dict[str, Any]) -> None:
    """vLLM's fallback covers 0 only (-1 is truthy): it answers a negative budget with a 400,
    and so does the gateway, before anything is sent."""
    with pytest.raises(ClientError) as caught:
        parse_generation("chat", orjson.dumps({"model": "m", "messages": [], **fields}))
    assert caught.value.status == 400 and "must be at least 1" in caught.value.message


def chat_prompt(messages: list[dict[str, Any]], **fields: Any) -> PromptParts:
    [prompt] = parse_generation("chat", orjson.dumps(
        {"model": "m", "messages": messages, **fields})).prompts
    return prompt


LONG = "word " * 2000


@pytest.mark.parametrize("part", [
    {"type": "refusal", "refusal": LONG},         # vLLM renders each as message text
    {"type": "thinking", "thinking": LONG},
    {"type": "input_text", "text": LONG},
    {"type": "output_text", "text": LONG},
    {"type": "some_future_text", "body": LONG},   # an unknown part: counted, not trusted
])
def test_no_content_part_hides_its_text(part: dict[str, Any]) -> None:
    prompt = chat_prompt([{"role": "assistant", "content": [part]}])
    assert LONG in prompt.texts


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "tool_call_id", "name",
                                   "tool_calls", "tools", "anything_a_template_reads"])
def test_no_message_field_hides_its_text(field: str) -> None:
    prompt = chat_prompt([{"role": "assistant", "content": "ok", field: LONG}])
    assert orjson.dumps(LONG).decode() in prompt.texts


def test_a_custom_role_is_counted_and_the_usual_ones_are_in_the_allowance() -> None:
    assert chat_prompt([{"role": LONG, "content": "x"}]).texts == ("x", LONG)
    for role in ("system", "developer", "user", "assistant", "tool", "function"):
        assert chat_prompt([{"role": role, "content": "x"}]).texts == ("x",)


@pytest.mark.parametrize("field", ["chat_template", "chat_template_kwargs"])
def test_a_requests_own_template_and_its_variables_are_counted(field: str) -> None:
    value: Any = LONG if field == "chat_template" else {"system_prompt": LONG}
    prompt = chat_prompt(MESSAGES, **{field: value})
    assert prompt.texts == ("hi", orjson.dumps(value).decode())


DATA_URL = "data:image/png;base64," + "A" * 100_000


@pytest.mark.parametrize(("part", "media"), [
    ({"type": "image_url", "image_url": {"url": DATA_URL}}, (1, 0, 0)),
    ({"type": "input_image", "image_url": DATA_URL}, (1, 0, 0)),
    ({"image_url": DATA_URL}, (1, 0, 0)),                            # no type: read by key
    ({"type": "image_url", "uuid": "u1", "image_url": None}, (1, 0, 0)),  # a cached item
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, (0, 1, 0)),
    ({"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}}, (0, 1, 0)),
    ({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, (0, 0, 1)),
])
def test_media_parts_are_items_not_text(part: dict[str, Any], media: tuple[int, int, int]) -> None:
    """An image's base64 is not prompt text (it would count ~33,000 tokens here); it is an item
    the model's ``media_tokens`` prices."""
    prompt = chat_prompt([{"role": "user", "content": [{"type": "text", "text": "see"}, part,
                                                       part]}])
    assert prompt.texts == ("see",)
    assert prompt.media == tuple(2 * n for n in media)


def test_prompt_embeds_are_refused_rather_than_passed_uncounted() -> None:
    """vLLM serves ``prompt_embeds`` beside ``prompt``: their length is inside a serialized
    tensor, so a 1-token prompt could carry 30,000 positions past every limit."""
    for doc in ({"prompt": "x", "prompt_embeds": "UEsDBAAA"}, {"prompt_embeds": ["UEsDBAAA"]}):
        err = refused("completions", doc)
        assert (err.param, err.code) == ("prompt_embeds", "invalid_request")
    assert completion("x", prompt_embeds=None).prompts == (PromptParts(("x",), 0, 0),)


@pytest.mark.parametrize(("options", "include_usage"), [
    (None, False),
    ({}, True),                                   # vLLM's StreamOptions default
    ({"continuous_usage_stats": True}, True),
    ({"include_usage": True}, True),
    ({"include_usage": False}, False),
    ({"include_usage": None}, False),             # None: falsy to vLLM
])
def test_include_usage_as_vllm_reads_it(options: Any, include_usage: bool) -> None:
    assert chat(stream=True, stream_options=options).include_usage is include_usage


@pytest.mark.parametrize("options", [{"include_usage": 1}, {"include_usage": "yes"},
                                     {"continuous_usage_stats": "true"}, [], "x"])
def test_a_stream_option_that_is_no_boolean_is_refused(options: Any) -> None:
    """vLLM would read ``1`` or ``"yes"`` as true; extproc, reading it as false, would strip
    the usage the client asked for. A clear 400 instead."""
    err = refused("chat", {"messages": MESSAGES, "stream": True, "stream_options": options})
    assert err.param == "stream_options"


@pytest.mark.parametrize("part", [{"type": "image_embeds", "image_embeds": "UEsDBA"},
                                  {"type": "audio_embeds", "audio_embeds": "UEsDBA"},
                                  {"image_embeds": "UEsDBA"}])
def test_media_embeddings_are_refused_rather_than_priced_as_one_item(part: dict[str, Any]) -> None:
    """Their positions are inside a serialized tensor, as ``prompt_embeds``' are: a flat price
    per item would let one carry a whole context past every limit."""
    err = refused("chat", {"messages": [{"role": "user", "content": [part]}]})
    assert err.param == "messages" and "embeddings" in err.message
