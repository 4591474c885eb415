"""Config reload: atomic swaps, bad files kept out, ConfigMap symlink swaps, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from routing.compiled import Snapshot, compile_config
from routing.errors import ConfigError
from routing.loader import load_config
from sidecar_runtime.process.reload import Reloader
from sidecar_runtime.process.reload_metrics import ReloadMetrics
from tests.harness.waits import until
from tests.routing.test_check import GOOD


@contextlib.asynccontextmanager
async def polling(holder: Reloader[Any]) -> AsyncIterator[None]:
    """``holder.run()`` as the process skeleton runs it: a task, cancelled at the end."""
    task = asyncio.create_task(holder.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def load(path: str) -> Snapshot:
    return compile_config(load_config(path))


def replace(path: pathlib.Path, text: str) -> None:
    """Write the way editors and config tools do: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def with_model(name: str) -> str:
    return GOOD + f"  {name}:\n    clusters: [vllm-long]\n"


def test_a_changed_file_is_swapped_in_whole(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(GOOD)
    holder = Reloader(str(path), load)
    before = holder.current()
    assert holder.check_now() is False
    replace(path, with_model("mistral-7b"))
    assert holder.check_now() is False  # seen once: it may still be changing
    assert holder.check_now() is True
    assert list(holder.current().models) == ["llama-2-13b", "mistral-7b"]
    assert list(before.models) == ["llama-2-13b"]  # a request holding the old one keeps it whole


def test_a_bad_file_keeps_the_old_config_and_is_reported_once(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(GOOD)
    registry = CollectorRegistry()
    seen: list[tuple[bool, str]] = []
    metrics = ReloadMetrics(registry, "test")

    def on_reload(ok: bool, message: str) -> None:
        seen.append((ok, message))
        metrics(ok, message)

    holder = Reloader(str(path), load, on_result=on_reload)
    old = holder.current()
    replace(path, GOOD.replace("[vllm-short, vllm-long]", "[vllm-short, vllm-lng]"))
    assert holder.check_now() is False
    assert holder.check_now() is False
    assert holder.current() is old
    assert seen == [(False, f"{path}:7: model 'llama-2-13b' names unknown cluster 'vllm-lng' "
                            "(did you mean 'vllm-long'?)")]
    assert registry.get_sample_value("test_config_reloads_total", {"result": "error"}) == 1
    assert registry.get_sample_value("test_config_last_reload_ok") == 0
    replace(path, with_model("mistral-7b"))
    assert holder.check_now() is False
    assert holder.check_now() is True
    assert registry.get_sample_value("test_config_reloads_total", {"result": "ok"}) == 1
    assert registry.get_sample_value("test_config_last_reload_ok") == 1


def configmap(directory: pathlib.Path, version: int, text: str) -> None:
    """Lay out a ConfigMap volume update as the kubelet does: a new dir, ``..data`` swapped."""
    stamp = directory / f"..2026_01_01_00_00_0{version}"
    stamp.mkdir()
    (stamp / "routing.yaml").write_text(text)
    tmp_link = directory / "..data_tmp"
    tmp_link.symlink_to(stamp.name)
    os.replace(tmp_link, directory / "..data")
    if not (directory / "routing.yaml").is_symlink():
        (directory / "routing.yaml").symlink_to("..data/routing.yaml")


def test_a_configmap_symlink_swap_is_seen(tmp_path: pathlib.Path) -> None:
    configmap(tmp_path, 1, GOOD)
    holder = Reloader(str(tmp_path / "routing.yaml"), load)
    configmap(tmp_path, 2, with_model("mistral-7b"))
    assert holder.check_now() is False
    assert holder.check_now() is True
    assert "mistral-7b" in holder.current().models


def test_a_file_still_being_written_is_not_judged(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(GOOD)
    failures: list[str] = []

    def on_result(ok: bool, message: str) -> None:
        if not ok:
            failures.append(message)

    holder = Reloader(str(path), load, on_result=on_result)
    path.write_text(GOOD[:40])  # half written

    def load_while_the_writer_finishes(p: str) -> Snapshot:
        try:
            return load(p)
        finally:
            path.write_text(with_model("mistral-7b"))

    assert holder.check_now() is False  # seen once
    holder._load = load_while_the_writer_finishes
    assert holder.check_now() is False  # loaded, but it changed meanwhile: not judged
    assert failures == []
    holder._load = load
    assert holder.check_now() is False
    assert holder.check_now() is True
    assert "mistral-7b" in holder.current().models


def test_a_valid_half_of_a_file_is_not_applied(tmp_path: pathlib.Path) -> None:
    """A file rewritten in place in two steps whose first step is a valid config on its own
    (the models, not yet the rate limits): applied, its limits would be gone until the second.
    Not applied when the second step comes before the next poll, nor when it comes while the
    first is being loaded."""
    path = tmp_path / "routing.yaml"
    path.write_text(with_model("a"))
    holder = Reloader(str(path), load)
    path.write_text(GOOD)  # the first step: valid, and not what is meant
    assert holder.check_now() is False
    path.write_text(with_model("b"))  # the second, before the next poll
    assert holder.check_now() is False
    assert holder.check_now() is True
    assert "b" in holder.current().models

    path.write_text(GOOD)

    def load_while_the_writer_finishes(p: str) -> Snapshot:
        try:
            return load(p)
        finally:
            path.write_text(with_model("c"))

    assert holder.check_now() is False
    holder._load = load_while_the_writer_finishes
    assert holder.check_now() is False  # GOOD loaded, then changed: not swapped in
    assert "b" in holder.current().models
    holder._load = load
    assert holder.check_now() is False
    assert holder.check_now() is True
    assert "c" in holder.current().models


def test_a_worker_started_on_a_refused_edit_serves_the_last_config_that_loaded(
        tmp_path: pathlib.Path) -> None:
    """``last_good`` (the supervisor's folder under ``--workers``): every config that loads is
    copied there; a process started while the file is refused serves the copy and still
    watches the file."""
    path, kept = tmp_path / "routing.yaml", tmp_path / "last-good.yaml"
    path.write_text(with_model("a"))
    first = Reloader(str(path), load, last_good=str(kept))
    assert kept.read_text() == with_model("a")
    replace(path, with_model("b"))
    assert first.check_now() is False and first.check_now() is True
    assert kept.read_text() == with_model("b")
    bad = GOOD.replace("[vllm-short, vllm-long]", "[vllm-short, vllm-lng]")
    replace(path, bad)
    assert first.check_now() is False and first.check_now() is False
    assert kept.read_text() == with_model("b")  # a refused file is never kept
    restarted = Reloader(str(path), load, last_good=str(kept))
    assert "b" in restarted.current().models
    replace(path, with_model("c"))
    assert restarted.check_now() is False and restarted.check_now() is True
    assert "c" in restarted.current().models
    with pytest.raises(ConfigError):  # nothing kept: a file that does not load stops it
        Reloader(str(path.with_name("other.yaml")), load, last_good=str(tmp_path / "none"))


async def test_polling_applies_a_change(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(GOOD)
    holder = Reloader(str(path), load)
    async with polling(holder):
        replace(path, with_model("mistral-7b"))
        await until(lambda: "mistral-7b" in holder.current().models, timeout_s=10,
                    what="the new model swapped in")


async def test_subscribers_hear_each_swap_on_the_event_loop(tmp_path: pathlib.Path) -> None:
    """What the endpoint picker relies on: the new snapshot, on the loop's own thread (it
    changes state requests read without locks), and nothing for a bad file."""
    path = tmp_path / "routing.yaml"
    path.write_text(GOOD)
    results: list[bool] = []
    holder = Reloader(str(path), load, interval_s=0.02,
                      on_result=lambda ok, _message: results.append(ok))
    heard: list[tuple[list[str], bool]] = []
    loop_thread = threading.get_ident()
    holder.subscribe(lambda snap: heard.append((list(snap.models),
                                                threading.get_ident() == loop_thread)))
    async with polling(holder):
        replace(path, GOOD.replace("[vllm-short, vllm-long]", "[vllm-short, vllm-lng]"))
        await until(lambda: results == [False], timeout_s=10, what="the bad file judged")
        replace(path, with_model("mistral-7b"))
        await until(lambda: len(heard) == 1, timeout_s=10, what="the good file heard")
    assert heard == [(["llama-2-13b", "mistral-7b"], True)]
