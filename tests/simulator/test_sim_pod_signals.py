"""Through the real simulator server: the signals an endpoint picker reads from a pod.

KV-cache admission and ``vllm:num_requests_waiting``, prefix-cache counters and the prefill they
save, the speed factor, ``POST /sim/state`` overrides, failing metrics, and ``/dcgm/metrics``.
Timing assertions only use lower bounds the simulator guarantees (it never answers early) and
upper bounds with hundreds of milliseconds of slack.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator import RunningSimulator
from simulator.dcgm import GPU_IDLE, HW_THERMAL, SW_THERMAL

StartSim = Callable[..., Awaitable[RunningSimulator]]


async def _scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every sample of a Prometheus text page by name (the last series of a labelled name)."""
    async with http.get(url) as response:
        assert response.status == 200
        text = await response.text()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


async def _vllm(http: aiohttp.ClientSession, sim: RunningSimulator) -> dict[str, float]:
    return await _scrape(http, sim.url + "/metrics")


async def _until(
    http: aiohttp.ClientSession, sim: RunningSimulator, name: str, value: float
) -> dict[str, float]:
    """Wait until ``/metrics`` reports ``name == value`` (fails after 10 s); that scrape."""
    deadline = time.monotonic() + 10
    while (samples := await _vllm(http, sim)).get(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.01)
    return samples


async def _complete(http: aiohttp.ClientSession, sim: RunningSimulator, ids: list[int], out: int) -> float:
    """POST a token-id completion; returns its duration in seconds."""
    start = time.monotonic()
    body = {"model": "m", "prompt": ids, "max_tokens": out}
    async with http.post(sim.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()
    return time.monotonic() - start


async def _set_state(http: aiohttp.ClientSession, sim: RunningSimulator, body: Any) -> dict[str, Any]:
    async with http.post(sim.url + "/sim/state", json=body) as response:
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


async def test_a_request_waits_while_the_kv_cache_is_full(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(kv_cache_tokens=100, decode_ms_per_token=50.0)
    finished: list[str] = []

    async def complete(name: str, prompt: int, out: int) -> None:
        await _complete(http, sim, list(range(prompt)), out)
        finished.append(name)

    first = asyncio.create_task(complete("first", 50, 30))  # holds 80 of 100 for 1.5 s
    await _until(http, sim, "vllm:kv_cache_usage_perc", 0.8)
    second = asyncio.create_task(complete("second", 30, 1))  # needs 31: waits
    samples = await _until(http, sim, "vllm:num_requests_waiting", 1)
    assert samples["vllm:num_requests_running"] == 1
    assert samples["vllm:kv_cache_usage_perc"] == 0.8
    await asyncio.gather(first, second)
    assert finished == ["first", "second"]  # it ran only once the first freed the cache
    samples = await _vllm(http, sim)
    assert (samples["vllm:num_requests_waiting"], samples["vllm:kv_cache_usage_perc"]) == (0, 0)


async def test_requests_that_fit_together_run_together(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(kv_cache_tokens=100, decode_ms_per_token=50.0)
    tasks = [asyncio.create_task(_complete(http, sim, list(range(20)), 20)) for _ in range(2)]
    samples = await _until(http, sim, "vllm:num_requests_running", 2)
    assert (samples["vllm:kv_cache_usage_perc"], samples["vllm:num_requests_waiting"]) == (0.8, 0)
    await asyncio.gather(*tasks)


async def test_a_request_bigger_than_the_cache_runs_alone(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(kv_cache_tokens=100, max_model_len=1000, decode_ms_per_token=50.0)
    big = asyncio.create_task(_complete(http, sim, list(range(150)), 20))
    await _until(http, sim, "vllm:kv_cache_usage_perc", 1.0)
    small = asyncio.create_task(_complete(http, sim, [1, 2, 3], 1))
    await _until(http, sim, "vllm:num_requests_waiting", 1)
    await asyncio.gather(big, small)


async def test_a_repeated_prefix_hits_the_cache_and_skips_its_prefill(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(prefill_ms_per_token=5.0)
    prompt = list(range(1000, 1400))  # 400 tokens: 2 s of prefill uncached
    cold = await _complete(http, sim, prompt, 1)
    samples = await _vllm(http, sim)
    assert samples["vllm:prefix_cache_queries_total"] == 400
    assert samples["vllm:prefix_cache_hits_total"] == 0
    warm = await _complete(http, sim, prompt, 1)
    samples = await _vllm(http, sim)
    assert samples["vllm:prefix_cache_queries_total"] == 800
    assert samples["vllm:prefix_cache_hits_total"] == 384  # 24 whole blocks; the last token is computed
    assert cold >= 2.0
    # 16 uncached tokens: 80 ms of prefill against 2 s. Relative to the cold run, so a loaded
    # machine slows both rather than failing a fixed bound; half leaves room for a stall.
    assert warm < cold / 2


async def test_a_different_prefix_misses_and_a_shared_head_hits_partly(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    system = list(range(320))
    await _complete(http, sim, [*system, *range(5000, 5080)], 1)
    await _complete(http, sim, list(range(9000, 9400)), 1)  # nothing in common
    assert (await _vllm(http, sim))["vllm:prefix_cache_hits_total"] == 0
    await _complete(http, sim, [*system, *range(7000, 7080)], 1)  # same 320-token head
    assert (await _vllm(http, sim))["vllm:prefix_cache_hits_total"] == 320


async def test_chat_requests_sharing_a_system_prompt_hit(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    system = {"role": "system", "content": "You review contracts for a legal team. " * 30}
    for question in ("What is clause 4?", "Summarise the indemnity terms."):
        body = {"model": "m", "messages": [system, {"role": "user", "content": question}], "max_tokens": 1}
        async with http.post(sim.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
    samples = await _vllm(http, sim)
    assert samples["vllm:prefix_cache_hits_total"] >= 288  # the 300-token system prompt, whole blocks


async def test_cache_salt_keeps_prefixes_apart(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    """vLLM's ``cache_salt``: a prompt hits only blocks computed under the same salt (or, unsalted,
    only unsalted blocks), on both generation endpoints. 400 tokens: 24 whole blocks a hit."""
    sim = await start_sim()
    prompt = list(range(1000, 1400))
    chat_text = "You review contracts for a legal team. " * 40  # 397 tokens with the template

    async def hits_after(path: str, salt: str | None) -> float:
        body: dict[str, Any] = {"model": "m", "max_tokens": 1}
        if path == "/v1/completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": chat_text}]
        if salt is not None:
            body["cache_salt"] = salt
        async with http.post(sim.url + path, json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
        return (await _vllm(http, sim))["vllm:prefix_cache_hits_total"]

    for path in ("/v1/completions", "/v1/chat/completions"):
        before = (await _vllm(http, sim))["vllm:prefix_cache_hits_total"]
        assert await hits_after(path, "a") == before  # cold
        assert await hits_after(path, "a") == before + 384  # same salt: hits
        assert await hits_after(path, "b") == before + 384  # another salt: misses
        assert await hits_after(path, None) == before + 384  # no salt misses salted blocks
        assert await hits_after(path, None) == before + 2 * 384  # and hits its own
        assert await hits_after(path, "b") == before + 3 * 384  # every salt kept its blocks
        assert await hits_after(path, "a") == before + 4 * 384


async def test_speed_two_halves_generation_time(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    slow = await start_sim(decode_ms_per_token=40.0)
    fast = await start_sim(decode_ms_per_token=40.0, speed=2.0)
    slow_s, fast_s = await asyncio.gather(
        _complete(http, slow, [1, 2, 3], 25), _complete(http, fast, [1, 2, 3], 25)
    )
    assert slow_s >= 1.0 and fast_s >= 0.5
    assert fast_s < slow_s * 0.8  # run side by side: the same load slows both


async def test_speed_divides_prefill_too(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    slow = await start_sim(prefill_ms_per_token=5.0)
    fast = await start_sim(prefill_ms_per_token=5.0, speed=4.0)
    slow_s, fast_s = await asyncio.gather(
        _complete(http, slow, list(range(400)), 1), _complete(http, fast, list(range(400)), 1))
    assert slow_s >= 2.0 and fast_s >= 0.5  # 400 x 5 ms, and a quarter of it
    assert fast_s < slow_s / 2


async def test_state_overrides_show_in_metrics_and_clear(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    view = await _set_state(http, sim, {"waiting": 40, "kv_usage": 0.99})
    assert view["overrides"] == {"waiting": 40, "kv_usage": 0.99}
    assert view["real"]["waiting"] == 0 and view["real"]["kv_usage"] == 0
    samples = await _vllm(http, sim)
    assert samples["vllm:num_requests_waiting"] == 40
    assert samples["vllm:kv_cache_usage_perc"] == 0.99
    assert samples["vllm:num_requests_running"] == 0  # not overridden: the real value
    # The pod still serves, and real counters keep counting under the overrides.
    await _complete(http, sim, [1, 2, 3], 2)
    assert (await _vllm(http, sim))["vllm:generation_tokens_total"] == 2
    for clearing in ({}, {"clear": True}):
        await _set_state(http, sim, {"waiting": 5, "running": 7})
        assert (await _vllm(http, sim))["vllm:num_requests_running"] == 7
        assert (await _set_state(http, sim, clearing))["overrides"] == {}
        samples = await _vllm(http, sim)
        assert (samples["vllm:num_requests_waiting"], samples["vllm:num_requests_running"]) == (0, 0)


async def test_a_new_state_replaces_the_previous_one(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    await _set_state(http, sim, {"waiting": 40})
    await _set_state(http, sim, {"kv_usage": 0.5})
    samples = await _vllm(http, sim)
    assert (samples["vllm:num_requests_waiting"], samples["vllm:kv_cache_usage_perc"]) == (0, 0.5)
    async with http.get(sim.url + "/sim/state") as response:
        view = await response.json()
    assert view["overrides"] == {"kv_usage": 0.5}
    assert view["settings"] == {
        "speed": 1.0, "kv_capacity_tokens": 8 * 2048, "prefix_block_size": 16, "max_num_seqs": 256,
    }


async def test_the_real_load_returns_when_overrides_clear(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(kv_cache_tokens=100, decode_ms_per_token=50.0)
    await _set_state(http, sim, {"kv_usage": 0.0, "running": 0})
    busy = asyncio.create_task(_complete(http, sim, list(range(40)), 40))
    async with http.get(sim.url + "/sim/state") as response:
        view = await response.json()
    deadline = time.monotonic() + 10
    while view["real"]["running"] != 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
        async with http.get(sim.url + "/sim/state") as response:
            view = await response.json()
    assert (await _vllm(http, sim))["vllm:kv_cache_usage_perc"] == 0.0  # overridden
    await _set_state(http, sim, {})
    samples = await _vllm(http, sim)
    assert (samples["vllm:kv_cache_usage_perc"], samples["vllm:num_requests_running"]) == (0.8, 1)
    await busy


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "JSON decode error"),
        (b"", "body is empty"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"waiting": "many"}', "waiting must be a non-negative integer"),
        (b'{"kv_usage": 2}', "kv_usage must be between 0 and 1"),
        (b'{"queue": 4}', "unknown keys: queue"),
    ],
)
async def test_a_bad_state_is_a_400_and_changes_nothing(
    start_sim: StartSim, http: aiohttp.ClientSession, raw: bytes, message: str
) -> None:
    sim = await start_sim()
    await _set_state(http, sim, {"waiting": 3})
    async with http.post(sim.url + "/sim/state", data=raw) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert message in error["message"]
    assert error["code"] == 400
    assert (await _vllm(http, sim))["vllm:num_requests_waiting"] == 3


async def test_fail_metrics_answers_500_while_the_pod_serves(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    await _set_state(http, sim, {"fail_metrics": True})
    async with http.get(sim.url + "/metrics") as response:
        assert response.status == 500
        assert (await response.json())["error"]["code"] == 500
    async with http.get(sim.url + "/dcgm/metrics") as response:
        assert response.status == 200  # only what was asked fails
    await _complete(http, sim, [1, 2, 3], 1)
    async with http.get(sim.url + "/health") as response:
        assert response.status == 200
    await _set_state(http, sim, {})
    assert (await _vllm(http, sim))["vllm:generation_tokens_total"] == 1


def _dcgm_families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


async def test_dcgm_gauges_parse_and_follow_the_gpu(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(kv_cache_tokens=100, decode_ms_per_token=50.0)
    async with http.get(sim.url + "/dcgm/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        families = _dcgm_families(await response.text())
    names = ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
             "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")  # fmt: skip
    for name in names:
        assert families[name].type == "gauge"
        (sample,) = families[name].samples
        assert sample.labels["gpu"] == "0"
        assert sample.labels["UUID"].startswith("GPU-")
        assert {"device", "modelName", "Hostname", "pci_bus_id"} <= set(sample.labels)
    idle = {name: families[name].samples[0].value for name in names}
    assert idle["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"] == GPU_IDLE
    assert idle["DCGM_FI_DEV_FB_USED"] + idle["DCGM_FI_DEV_FB_FREE"] == 81920
    busy = asyncio.create_task(_complete(http, sim, list(range(60)), 40))
    await _until(http, sim, "vllm:num_requests_running", 1)
    loaded = await _scrape(http, sim.url + "/dcgm/metrics")
    assert loaded["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"] == 0  # busy, not throttled
    assert loaded["DCGM_FI_DEV_GPU_TEMP"] > idle["DCGM_FI_DEV_GPU_TEMP"]
    await busy


async def test_dcgm_overrides_make_a_gpu_hot_and_throttled(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    await _set_state(http, sim, {"throttled": True, "gpu_temp_c": 92, "fb_free_mib": 100})
    gauges = await _scrape(http, sim.url + "/dcgm/metrics")
    assert gauges["DCGM_FI_DEV_GPU_TEMP"] == 92
    assert gauges["DCGM_FI_DEV_FB_FREE"] == 100
    assert int(gauges["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"]) & (SW_THERMAL | HW_THERMAL) == 0x60
    await _set_state(http, sim, {"throttle_reasons": 0x80})  # HW power brake only
    assert (await _scrape(http, sim.url + "/dcgm/metrics"))["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"] == 0x80
    await _set_state(http, sim, {"fail_dcgm": True})
    async with http.get(sim.url + "/dcgm/metrics") as response:
        assert response.status == 500
    await _set_state(http, sim, {"clear": True})
    assert (await _scrape(http, sim.url + "/dcgm/metrics"))["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"] == GPU_IDLE


async def test_without_dcgm_the_path_is_404(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(dcgm=False)
    async with http.get(sim.url + "/dcgm/metrics") as response:
        assert response.status == 404


async def test_fail_requests_answers_vllms_500_while_the_metrics_look_idle(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """A dead engine fails each request at once; its pod still reports, and looks idle."""
    sim = await start_sim()
    await _set_state(http, sim, {"fail_requests": True})
    for path, body in (("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})):
        async with http.post(sim.url + path, json=body) as response:
            assert response.status == 500
            error = (await response.json())["error"]
        assert error["type"] == "InternalServerError" and "EngineCore" in error["message"]
    vllm = await _vllm(http, sim)
    assert vllm["vllm:num_requests_running"] == vllm["vllm:num_requests_waiting"] == 0
    await _set_state(http, sim, {})
    await _complete(http, sim, [1, 2, 3], 1)
