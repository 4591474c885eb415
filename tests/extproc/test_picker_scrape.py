"""The Scraper against real simulators and small hostile HTTP servers: metrics arrive and follow
the load, failing pods go stale but stay, DNS names resolve, reloads and stop are clean."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from extproc.picker.parse import MAX_BODY_BYTES, MetricsError
from extproc.picker.scrape import (
    BACKOFF_CAP_S,
    PoolPlan,
    Scraper,
    backoff_s,
    connect_failed,
    resolve_system,
    scrape_timeout_s,
)
from extproc.picker.state import PodMetrics, PoolState
from routing.schema import RoutingConfig
from simulator import RunningSimulator, SimConfig, running_simulator

VLLM_BODY = ("vllm:num_requests_running 2\nvllm:num_requests_waiting 9\n"
             "vllm:kv_cache_usage_perc 0.5\n")
DCGM_BODY = ('DCGM_FI_DEV_GPU_TEMP{gpu="0"} 83\nDCGM_FI_DEV_FB_USED{gpu="0"} 3\n'
             'DCGM_FI_DEV_FB_FREE{gpu="0"} 1\nDCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="0"} 64\n')


def routing(clusters: dict[str, dict[str, Any]]) -> RoutingConfig:
    return RoutingConfig.model_validate({
        "version": 1, "clusters": clusters,
        "models": {"m": {"clusters": [next(iter(clusters))]}}})


def picker_pool(endpoints: list[str], **picker: str) -> dict[str, Any]:
    return {"endpoints": endpoints, "max_context": 4096,
            "endpoint_picker": {"metrics_interval": "50ms", **picker}}


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Wait for ``condition`` (a generous deadline: this is a shared 2-core machine)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class FakePod:
    """A tiny HTTP server whose ``/metrics`` answers what ``mode`` says; hits are timestamped."""

    def __init__(self) -> None:
        self.mode = "vllm"
        self.hits: list[float] = []
        self.port = 0
        self.written = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def moved(self, _: web.Request) -> web.Response:
        return web.Response(text=VLLM_BODY)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(asyncio.get_running_loop().time())
        if self.mode == "vllm":
            return web.Response(text=VLLM_BODY)
        if self.mode == "dcgm":
            return web.Response(text=DCGM_BODY)
        if self.mode == "500":
            return web.Response(status=500, text="engine dead")
        if self.mode == "html":
            return web.Response(text="<html>login</html>", content_type="text/html")
        if self.mode == "redirect":
            raise web.HTTPFound("/metrics-moved")  # a valid body there: following is the bug
        if self.mode == "slow":
            await asyncio.sleep(30)
        if self.mode == "endless":
            response = web.StreamResponse()
            await response.prepare(request)
            chunk = b"# padding padding padding\n" * 40_000
            with contextlib.suppress(ConnectionError):
                while self.mode == "endless":
                    await response.write(chunk)
                    self.written += len(chunk)
            return response
        if self.mode == "huge":  # chunked: no Content-Length to refuse it by
            response = web.StreamResponse()
            await response.prepare(request)
            chunk = b"# padding padding padding\n" * 40_000
            with contextlib.suppress(ConnectionError):
                for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
                    await response.write(chunk)
            return response
        return web.Response(text=VLLM_BODY + "x" * MAX_BODY_BYTES)  # "huge-length"


@pytest.fixture
async def fake_pod() -> AsyncIterator[Callable[[], Any]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start() -> FakePod:
            pod = FakePod()
            app = web.Application()
            app.router.add_get("/metrics", pod.metrics)
            app.router.add_get("/metrics-moved", pod.moved)
            runner = web.AppRunner(app, shutdown_timeout=0.1)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            pod.port = int(runner.addresses[0][1])
            return pod

        yield start


@pytest.fixture
async def sims() -> AsyncIterator[Callable[..., Any]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(**settings: Any) -> RunningSimulator:
            config = SimConfig(**{"name": "pool", "decode_ms_per_token": 0.0, **settings})
            return await stack.enter_async_context(running_simulator(config))

        yield start


@pytest.fixture
async def scraping() -> AsyncIterator[Callable[..., Any]]:
    """Start a Scraper over fresh PoolStates; it is stopped (and checked clean) at the end."""
    started: list[Scraper] = []

    async def start(config: RoutingConfig, **kwargs: Any) -> tuple[Scraper, dict[str, PoolState]]:
        pools: dict[str, PoolState] = {}
        scraper = Scraper(pools, config, **kwargs)
        await scraper.start()
        started.append(scraper)
        return scraper, pools

    yield start
    for scraper in started:
        await scraper.stop()
        assert scraper.tasks == ()


def refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def blackholed_port() -> Any:
    """A port whose SYNs are dropped, as a pod behind a dead node's or a firewall's: a listener
    with a full accept queue (backlog 0, filled by connections nobody accepts)."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = int(listener.getsockname()[1])
        for _ in range(3):
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
        yield port


def metrics_of(pools: dict[str, PoolState], cluster: str, address: str) -> PodMetrics | None:
    pool = pools[cluster]
    pod = pool.pods.get(address)
    return None if pod is None else pool.fresh(pod, asyncio.get_running_loop().time())


def queue(pools: dict[str, PoolState], address: str) -> tuple[float, float] | None:
    metrics = metrics_of(pools, "pool", address)
    return None if metrics is None else (metrics.waiting, metrics.running)


async def test_metrics_arrive_and_follow_the_pods_load(sims: Any, scraping: Any) -> None:
    busy = await sims(max_num_seqs=1, decode_ms_per_token=20.0)
    idle = await sims()
    addresses = [f"127.0.0.1:{busy.port}", f"127.0.0.1:{idle.port}"]
    _, pools = await scraping(routing({"pool": picker_pool(addresses)}))
    assert list(pools["pool"].pods) == addresses
    await until(lambda: all(metrics_of(pools, "pool", a) is not None for a in addresses),
                "both pods scraped")
    assert metrics_of(pools, "pool", addresses[1]) == PodMetrics()

    async with aiohttp.ClientSession() as http:
        body = {"model": "pool", "prompt": "hi", "max_tokens": 60}
        requests = [asyncio.create_task(http.post(busy.url + "/v1/completions", json=body))
                    for _ in range(2)]
        await until(lambda: queue(pools, addresses[0]) == (1, 1),
                    "one running and one waiting on the busy pod")
        assert metrics_of(pools, "pool", addresses[1]) == PodMetrics()
        for response in await asyncio.gather(*requests):
            assert response.status == 200
            response.release()
    # Idle again; its prefix-cache counters keep what the two requests looked up.
    await until(lambda: queue(pools, addresses[0]) == (0, 0), "the busy pod idle again")
    served = metrics_of(pools, "pool", addresses[0])
    assert served is not None and served.kv_usage == 0 and served.prefix_queries > 0


@pytest.mark.parametrize("mode", ["500", "html", "redirect", "huge", "huge-length", "refused"])
async def test_a_failing_pod_goes_stale_and_stays_in_the_pool(
        mode: str, sims: Any, fake_pod: Any, scraping: Any) -> None:
    good = await sims()
    bad = await fake_pod()
    bad_address = f"127.0.0.1:{refused_port()}" if mode == "refused" else bad.address
    good_address = f"127.0.0.1:{good.port}"
    _, pools = await scraping(routing({"pool": picker_pool(
        [good_address, bad_address], stale_after="300ms")}))
    if mode != "refused":
        await until(lambda: metrics_of(pools, "pool", bad_address) is not None, "a first scrape")
        bad.mode = mode
    pool = pools["pool"]
    await until(lambda: pool.pods[bad_address].failures >= 3, "three failures in a row")
    await until(lambda: metrics_of(pools, "pool", bad_address) is None, "the bad pod stale")
    assert list(pool.pods) == [good_address, bad_address]  # unknown, never dropped
    assert pool.pods[good_address].failures == 0
    assert metrics_of(pools, "pool", good_address) == PodMetrics()
    if mode != "refused":
        bad.mode = "vllm"
        await until(lambda: metrics_of(pools, "pool", bad_address) is not None, "recovery")
        assert pool.pods[bad_address].failures == 0


async def test_a_pod_that_cannot_be_connected_to_is_unreachable(
        sims: Any, scraping: Any) -> None:
    good = await sims()
    good_address = f"127.0.0.1:{good.port}"
    with blackholed_port() as dropped:
        refused, dropping = f"127.0.0.1:{refused_port()}", f"127.0.0.1:{dropped}"
        _, pools = await scraping(routing({"pool": picker_pool([good_address, refused, dropping])}))
        pool = pools["pool"]
        await until(lambda: pool.pods[refused].connect_failures >= 3, "refused three times")
        await until(lambda: pool.pods[dropping].connect_failures >= 3, "three connect timeouts")
        assert pool.pods[refused].unreachable and pool.pods[dropping].unreachable
        assert list(pool.pods) == [good_address, refused, dropping]  # never dropped
        assert not pool.pods[good_address].unreachable


@pytest.mark.parametrize("mode", ["500", "html", "huge", "slow"])
async def test_a_pod_that_answers_badly_is_not_unreachable(
        mode: str, fake_pod: Any, scraping: Any) -> None:
    """An HTTP error, a body that is not metrics, or an answer slower than the scrape timeout:
    the pod took the connection, so Envoy's would succeed too; only its metrics are unknown."""
    bad = await fake_pod()
    bad.mode = mode
    _, pools = await scraping(routing({"pool": picker_pool([bad.address])}))
    pod = pools["pool"].pods[bad.address]
    await until(lambda: pod.failures >= 3, "three failures in a row")
    assert pod.connect_failures == 0 and not pod.unreachable


@pytest.mark.parametrize(("exc", "expected"), [
    (aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None),
        ConnectionRefusedError(111, "refused")), True),
    (aiohttp.ConnectionTimeoutError("Connection timeout to host"), True),
    (TimeoutError(), False),                     # the total timeout: connected, answered late
    (aiohttp.ServerDisconnectedError(), False),  # connected, then closed
    (aiohttp.ClientPayloadError("bad chunk"), False),
    (ValueError("bad body"), False),
])
def test_connect_failed_table(exc: BaseException, expected: bool) -> None:
    assert connect_failed(exc) is expected


async def test_an_endless_body_is_cut_off_at_the_cap(fake_pod: Any, scraping: Any) -> None:
    endless = await fake_pod()
    endless.mode = "endless"
    _, pools = await scraping(routing({"pool": picker_pool([endless.address])}))
    await until(lambda: pools["pool"].pods[endless.address].failures >= 2, "two failures")
    # Read up to the cap, then the connection is dropped: the pod wrote little more than the
    # cap (plus socket buffers) per attempt, not what 250 ms of loopback would carry.
    assert endless.written <= len(endless.hits) * (MAX_BODY_BYTES + 8 * 2**20)
    endless.mode = "vllm"


async def test_a_slow_pod_delays_no_other_pod(fake_pod: Any, scraping: Any) -> None:
    slow, quick = await fake_pod(), await fake_pod()
    slow.mode = "slow"
    _, pools = await scraping(routing({"pool": picker_pool([slow.address, quick.address])}))
    await until(lambda: len(slow.hits) >= 1, "the slow pod asked")
    first = len(quick.hits)
    await until(lambda: len(quick.hits) >= first + 5, "five scrapes of the quick pod")
    # The slow one is still on its first scrape (its timeout is 250 ms, so at most a few).
    assert len(slow.hits) < len(quick.hits)
    assert metrics_of(pools, "pool", quick.address) is not None


async def test_a_dead_pod_is_retried_with_backoff(fake_pod: Any, scraping: Any) -> None:
    dead = await fake_pod()
    dead.mode = "500"
    await scraping(routing({"pool": picker_pool([dead.address])}))
    await until(lambda: len(dead.hits) >= 6, "six attempts")
    gaps = [b - a for a, b in zip(dead.hits, dead.hits[1:], strict=False)]
    # After the 4th and 5th failures the waits are 400 ms and 800 ms, less 20% jitter at most
    # (lower bounds only: a slow machine can only make them longer).
    assert gaps[3] >= 0.4 * 0.8 - 0.01
    assert gaps[4] >= 0.8 * 0.8 - 0.01


async def test_stop_ends_a_loop_whose_fetch_turned_the_cancel_into_an_error(
        fake_pod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch cancelled mid-way that raises an error of its own (as an HTTP stack may) still
    ends its loop: stop() returns, and no task is left."""
    pod = await fake_pod()
    fetching = asyncio.Event()

    async def swallowing_get(self: Scraper, url: str, timeout_s: float) -> str:
        fetching.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise MetricsError("connection closed") from None
        raise AssertionError("unreachable")

    monkeypatch.setattr(Scraper, "_get", swallowing_get)
    scraper = Scraper({}, routing({"pool": picker_pool([pod.address])}))
    await scraper.start()
    await asyncio.wait_for(fetching.wait(), 10)
    # Not wait_for: cancelling a stop() stuck on such a loop would hang on it too.
    stopping = asyncio.ensure_future(scraper.stop())
    done, _ = await asyncio.wait({stopping}, timeout=10)
    assert done == {stopping}, "stop() is still waiting for the scrape loop"
    assert scraper.tasks == ()


@pytest.mark.parametrize(("interval_s", "failures", "expected"), [
    (0.05, 1, 0.05), (0.05, 2, 0.1), (0.05, 4, 0.4), (0.05, 6, 1.6), (0.05, 7, BACKOFF_CAP_S),
    (0.05, 10_000, BACKOFF_CAP_S), (5.0, 1, 5.0), (5.0, 3, 5.0), (1.0, 2, 2.0),
])
def test_backoff_table(interval_s: float, failures: int, expected: float) -> None:
    assert backoff_s(interval_s, failures) == pytest.approx(expected)


@pytest.mark.parametrize(("interval_s", "expected"), [(0.01, 0.25), (0.1, 0.25), (0.5, 0.5),
                                                       (1.0, 1.0), (10.0, 1.0)])
def test_scrape_timeout_table(interval_s: float, expected: float) -> None:
    assert scrape_timeout_s(interval_s) == expected


async def test_dcgm_reading_joins_the_pods_metrics(sims: Any, fake_pod: Any, scraping: Any) -> None:
    sim = await sims()
    dcgm = await fake_pod()
    dcgm.mode = "dcgm"
    address = f"127.0.0.1:{sim.port}"
    _, pools = await scraping(routing({"pool": picker_pool(
        [address], dcgm_url=f"http://{{host}}:{dcgm.port}/metrics")}))
    hot = PodMetrics(gpu_temp_c=83.0, gpu_mem_used_frac=0.75, throttled=True)
    await until(lambda: metrics_of(pools, "pool", address) == hot, "the GPU reading")
    dcgm.mode = "500"  # DCGM down: GPU unknown, the pod itself still fine
    await until(lambda: metrics_of(pools, "pool", address) == PodMetrics(), "GPU unknown")
    assert pools["pool"].pods[address].failures == 0


async def test_a_dns_name_resolves_to_its_addresses(sims: Any, scraping: Any) -> None:
    sim = await sims()
    _, pools = await scraping(routing({"pool": picker_pool([f"localhost:{sim.port}"])}))
    address = f"127.0.0.1:{sim.port}"
    await until(lambda: metrics_of(pools, "pool", address) is not None, "localhost scraped")
    assert list(pools["pool"].pods) == [address]
    assert await resolve_system("localhost", 80) == ["127.0.0.1:80"]


async def test_a_failed_resolution_keeps_the_last_addresses(fake_pod: Any, scraping: Any) -> None:
    one, two = await fake_pod(), await fake_pod()
    answers: list[list[str] | None] = [[one.address], None, None, [one.address, two.address],
                                       [two.address]]
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        answer = answers[min(len(asked), len(answers)) - 1]
        if answer is None:
            raise OSError("Temporary failure in name resolution")
        return answer

    scraper, pools = await scraping(routing({"pool": picker_pool(
        ["vllm.llm.svc:8000"], resolve_interval="100ms")}), resolve=resolve)
    pool = pools["pool"]
    await until(lambda: len(asked) >= 3, "two failed resolutions")
    assert list(pool.pods) == [one.address]
    assert asked[0] == ("vllm.llm.svc", 8000)
    await until(lambda: list(pool.pods) == [one.address, two.address], "a second pod")
    await until(lambda: list(pool.pods) == [two.address], "the first pod gone")
    await until(lambda: len(scraper.tasks) == 2, "its scrape task ended")  # resolver + pod two
    hits = len(one.hits)
    await until(lambda: len(two.hits) >= 5, "the remaining pod scraped")
    assert len(one.hits) <= hits + 1  # at most one scrape already in flight


async def test_update_follows_the_config(fake_pod: Any, scraping: Any) -> None:
    a, b = await fake_pod(), await fake_pod()
    plain = {"endpoints": [a.address], "max_context": 4096}
    scraper, pools = await scraping(routing({"one": picker_pool([a.address]), "off": plain}))
    assert set(pools) == {"one"}
    await until(lambda: len(a.hits) >= 2, "pool one scraped")
    same_tasks = scraper.tasks
    scraper.update(routing({"one": picker_pool([a.address]), "off": plain}))
    assert scraper.tasks == same_tasks  # unchanged: nothing restarted
    one = pools["one"]

    scraper.update(routing({"one": picker_pool([a.address, b.address], stale_after="5s"),
                            "two": picker_pool([b.address])}))
    assert pools["one"] is one and one.stale_s == 5.0  # the picker's state carries on
    assert set(pools) == {"one", "two"}
    await until(lambda: all(metrics_of(pools, c, b.address) is not None for c in ("one", "two")),
                "b scraped for both pools")

    scraper.update(routing({"two": picker_pool([b.address]), "off": plain}))
    assert set(pools) == {"two"}
    await until(lambda: len(scraper.tasks) == 1, "pool one's tasks ended")
    hits_a, hits_b = len(a.hits), len(b.hits)
    await until(lambda: len(b.hits) >= hits_b + 5, "pool two still scraped")
    assert len(a.hits) <= hits_a + 1  # nothing scrapes a any more (one may have been in flight)


async def test_stop_leaves_no_task_and_closes_the_session(sims: Any) -> None:
    sim = await sims()
    pools: dict[str, PoolState] = {}
    scraper = Scraper(pools, routing({"pool": picker_pool(
        [f"localhost:{sim.port}"], dcgm_url="http://{host}:1/metrics")}))
    await scraper.start()
    await until(lambda: any(p.scraped_at for p in pools["pool"].pods.values()), "a scrape")
    running = scraper.tasks
    assert len(running) == 3  # resolver, scraper, DCGM
    await scraper.stop()
    assert scraper.tasks == () and not scraper.running
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("picker-")] == []
    assert list(pools["pool"].pods) == [f"127.0.0.1:{sim.port}"]  # the state stays for the picker


@pytest.mark.parametrize(("pattern", "pod", "url"), [
    ("http://{host}:9400/metrics", "10.0.0.5:8000", "http://10.0.0.5:9400/metrics"),
    ("http://{host}:{port}/dcgm/metrics", "127.0.0.1:8101", "http://127.0.0.1:8101/dcgm/metrics"),
    ("http://{host}:9400/metrics", "[fd00::5]:8000", "http://[fd00::5]:9400/metrics"),
])
def test_the_dcgm_url_names_each_pod(pattern: str, pod: str, url: str) -> None:
    plan = PoolPlan("pool", (pod,), "/metrics", 0.1, 5.0, 2.0, pattern)
    assert plan.dcgm_for(pod) == url
