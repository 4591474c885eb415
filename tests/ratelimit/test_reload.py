"""Config reload: an edit, a Kubernetes-style symlink swap, and a broken file."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from ratelimit.descriptors import RateLimitConfig
from ratelimit.loader import load_path
from ratelimit.service import rate_limit_process
from sidecar_runtime.process.reload import Reloader
from sidecar_runtime.process.settings import Settings
from tests.harness.waits import until

TEMPLATE = """
domain: llm
descriptors:
  - key: api_key
    rate_limit: {{unit: second, requests_per_unit: {n}}}
"""


def capacity(config: RateLimitConfig) -> int | None:
    limit = config.domains["llm"].match([("api_key", "k")])
    return None if limit is None else limit.requests_per_unit


async def applied(condition: Callable[[], bool], what: str) -> None:
    """A file edit shows (in ~0.2 s: two polls of 0.1 s; the margin is a loaded machine's)."""
    await until(condition, timeout_s=10.0, what=what)


async def test_an_edit_applies_and_a_broken_file_keeps_the_old_config(tmp_path: Path) -> None:
    path = tmp_path / "ratelimit.yaml"
    path.write_text(TEMPLATE.format(n=5))
    server = rate_limit_process(str(path), "127.0.0.1", 0, 0, Settings(reload_interval_s=0.1))
    await server.start()
    try:
        reloader, metrics = server.service.reloader, server.service.metrics
        assert capacity(reloader.current()) == 5
        path.write_text(TEMPLATE.format(n=7))
        await applied(lambda: capacity(reloader.current()) == 7, "capacity 7 in reloader")

        path.write_text("domain: llm\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: x}\n")
        await applied(lambda: metrics.reloads.labels("error")._value.get() == 1, "error reloads == 1")
        assert capacity(reloader.current()) == 7
        await asyncio.sleep(0.3)  # the broken file is not reloaded (or re-logged) every poll
        assert metrics.reloads.labels("error")._value.get() == 1

        path.write_text(TEMPLATE.format(n=9))
        await applied(lambda: capacity(reloader.current()) == 9, "capacity 9 in reloader")
        # The reload thread swaps the snapshot, then counts it: wait for the count too.
        await applied(lambda: metrics.reloads.labels("ok")._value.get() >= 2, "ok reloads >= 2")
        assert metrics.reloads.labels("ok")._value.get() == 2
    finally:
        await server.stop(grace_s=0.1)


def _configmap(root: Path, version: str, n: int) -> None:
    """Lay out a ConfigMap volume: ``..<version>/`` holds the data, ``..data`` points at it,
    and ``ratelimit.yaml`` is a symlink through ``..data``."""
    folder = root / f"..{version}"
    folder.mkdir()
    (folder / "ratelimit.yaml").write_text(TEMPLATE.format(n=n))
    tmp_link = root / "..data_tmp"
    tmp_link.symlink_to(folder.name)
    os.replace(tmp_link, root / "..data")  # atomic, as the kubelet does it


async def test_configmap_symlink_swap_file_and_directory(tmp_path: Path) -> None:
    _configmap(tmp_path, "v1", 3)
    (tmp_path / "ratelimit.yaml").symlink_to("..data/ratelimit.yaml")
    as_file = Reloader(tmp_path / "ratelimit.yaml", load_path, 0.05)
    as_dir = Reloader(tmp_path, load_path, 0.05)
    tasks = [asyncio.create_task(r.run()) for r in (as_file, as_dir)]
    try:
        assert capacity(as_file.current()) == 3 and capacity(as_dir.current()) == 3
        _configmap(tmp_path, "v2", 4)
        await applied(lambda: capacity(as_file.current()) == 4, "capacity 4 in as_file")
        await applied(lambda: capacity(as_dir.current()) == 4, "capacity 4 in as_dir")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_a_broken_routing_yaml_is_a_ratelimit_config_error(tmp_path: Path) -> None:
    from ratelimit.errors import ConfigError

    path = tmp_path / "routing.yaml"
    path.write_text("version: 1\nclusters: {a: {endpoints: ['1.2.3.4:80'], max_context: 10}}\n"
                    "models: {m: {clusters: [b]}}\n")
    try:
        load_path(path)
    except ConfigError as exc:
        assert str(exc) == f"{path}:3: model 'm' names unknown cluster 'b' (known clusters: a)"
    else:
        raise AssertionError("no ConfigError")


async def test_the_watcher_survives_an_unexpected_error(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("1")
    calls: list[bool] = []

    def load(_: str) -> int:
        if calls:
            raise RuntimeError("loader bug")
        calls.append(True)
        return 1

    results: list[tuple[bool, str]] = []
    reloader = Reloader(str(path), load, 0.01, on_result=lambda ok, msg: results.append((ok, msg)),
                        errors=(ValueError,))
    task = asyncio.create_task(reloader.run())
    path.write_text("22")
    await until(lambda: results, timeout_s=10, what="the failed reload to be reported")
    # The watcher survived the bug: it still sees the next edit (and fails on it again).
    path.write_text("333")
    await until(lambda: len(results) >= 2 or task.done(), timeout_s=10, what="a second reload")
    assert not task.done(), "the watcher died"
    task.cancel()
    assert not any(ok for ok, _ in results) and "loader bug" in results[0][1]
    assert reloader.current() == 1
