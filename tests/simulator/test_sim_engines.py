"""``llm-sidecar sim --engine``: ``/metrics`` in each engine's names and text, which the picker
reads with no configuration; vLLM stays the default."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.picker.engines import parse_pod
from extproc.picker.state import PodMetrics
from simulator import RunningSimulator, SimConfig, add_arguments, config_from_args, sse
from simulator.exposition import ENGINES
from simulator.metrics import SimMetrics
from simulator.overrides import SimOverrides

StartSim = Callable[..., Awaitable[RunningSimulator]]

# The gauge each engine names its queue with (and nothing else's).
QUEUE_NAME = {"vllm": "vllm:num_requests_waiting", "sglang": "sglang:num_queue_reqs",
              "tgi": "tgi_queue_size", "llamacpp": "llamacpp:requests_deferred",
              "trtllm": "nv_trt_llm_request_metrics"}
HAS_KV = {"vllm": True, "sglang": True, "tgi": False, "llamacpp": False, "trtllm": True}


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_reports_the_load_in_its_own_names(engine: str) -> None:
    metrics = SimMetrics('Qwen/Qwen3-8B "x"', engine)
    metrics.set_load(3, 5, 0.42)
    metrics.first_token(0.05, 1_234_567)
    metrics.token(None)
    text = metrics.render().decode()
    assert QUEUE_NAME[engine] in text
    others = set(QUEUE_NAME.values()) - {QUEUE_NAME[engine]}
    assert not [name for name in others if name in text]
    # Valid text (prometheus_client's parser reads it), and the picker reads the load from it.
    assert list(text_string_to_metric_families(text))
    assert parse_pod(text) == PodMetrics(waiting=5, running=3,
                                         kv_usage=0.42 if HAS_KV[engine] else None)
    metrics.set_overrides(SimOverrides(waiting=40, running=1, kv_usage=0.99))
    assert parse_pod(metrics.render().decode()) == PodMetrics(
        waiting=40, running=1, kv_usage=0.99 if HAS_KV[engine] else None)


async def _load(http: aiohttp.ClientSession, sim: RunningSimulator) -> PodMetrics:
    async with http.get(sim.url + "/metrics") as response:
        assert response.status == 200
        return parse_pod(await response.text())


@pytest.mark.parametrize("engine", ["sglang", "tgi", "llamacpp", "trtllm"])
async def test_a_busy_simulator_looks_busy_in_its_engines_names(
        engine: str, start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine=engine, max_num_seqs=1, decode_ms_per_token=50.0)
    body = {"model": "m", "prompt": "hello", "max_tokens": 200}
    requests = [asyncio.create_task(http.post(sim.url + "/v1/completions", json=body))
                for _ in range(3)]
    try:
        deadline = asyncio.get_running_loop().time() + 15.0
        while (load := await _load(http, sim)) != PodMetrics(
                waiting=2, running=1, kv_usage=load.kv_usage):
            assert asyncio.get_running_loop().time() < deadline, load
            await asyncio.sleep(0.01)
        assert (load.kv_usage is not None and load.kv_usage > 0) is HAS_KV[engine]
    finally:
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)


def test_the_engine_flag_and_its_default() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--port=1", "--name=n"])).engine == "vllm"
    args = parser.parse_args(["--port=1", "--name=n", "--engine=trtllm"])
    assert config_from_args(args) == SimConfig(name="n", engine="trtllm")
    with pytest.raises(SystemExit):
        parser.parse_args(["--port=1", "--name=n", "--engine=ollama"])
    with pytest.raises(ValueError, match="engine must be one of vllm, sglang, tgi, llamacpp, trtllm"):
        SimConfig(name="n", engine="ollama")


def test_stream_chunks_take_each_engines_shape() -> None:
    """llama.cpp's key order (choices first, usage and timings after object), SGLang's usage
    null on every content chunk, vLLM's as it was."""
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": []}
    usage = {**chunk, "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    assert sse.engine_event(chunk, "vllm") == sse.sse_event(chunk)
    llama = sse.engine_event(usage, "llamacpp")
    assert llama.startswith(b'data: {"choices":[],"created":1,"id":"c","model":"m",'
                            b'"system_fingerprint":"b1-sim","object":"chat.completion.chunk",'
                            b'"usage":{')
    assert b'"timings":{"prompt_n":2,"predicted_n":3}}' in llama
    assert sse.engine_event(chunk, "sglang").endswith(b',"usage":null}\n\n')
    assert sse.engine_event(usage, "sglang") == sse.sse_event(usage)
