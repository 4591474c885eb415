"""``python -m bench.picker_load`` cannot rot: its workload, its report, and a tiny run of both modes.

Nothing here is about speed or about which mode wins: the tiny run (2 pods, 2 clients, 2 requests
each) checks that both gateways start, every request is answered, the pods' counters are read
and the table is printed.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.picker_workload import (
    BYTES_PER_TOKEN,
    Corpus,
    ModeReport,
    PodDelta,
    Result,
    Workload,
    parse_counter,
    percentile,
    pod_table,
    rows,
    script,
    table,
)
from sidecar_runtime.process.procs import envoy_binary
from tests.harness.ci import unavailable

ROOT = Path(__file__).resolve().parents[2]


def test_a_client_gets_the_same_script_every_time_and_clients_differ() -> None:
    workload = Workload(seed=3)
    first = list(itertools.islice(script(workload, Corpus.of(workload), 0), 30))
    again = list(itertools.islice(script(workload, Corpus.of(workload), 0), 30))
    other = list(itertools.islice(script(workload, Corpus.of(workload), 1), 30))
    assert first == again
    assert first != other


def test_a_conversation_grows_from_its_group_system_prompt_and_long_asks_are_alone() -> None:
    workload = Workload(seed=4, long_share=0.3)
    corpus = Corpus.of(workload)
    requests = list(itertools.islice(script(workload, corpus, 0), 200))
    kinds = {r.kind for r in requests}
    assert kinds == {"chat", "long"}
    for previous, current in itertools.pairwise(requests):
        if current.kind == "chat":
            assert current.messages[0] == ("system", corpus.systems[current.group])
            assert current.messages[-1][0] == "user"
            if previous.kind == "chat" and len(current.messages) > len(previous.messages):
                # The next turn of the same conversation: the previous prompt is its prefix.
                assert current.messages[:len(previous.messages)] == previous.messages
        else:
            assert len(current.messages) == 1 and current.group == -1
            assert current.max_tokens == workload.long_max_tokens
    longs = [r for r in requests if r.kind == "long"]
    assert min(r.prompt_tokens for r in longs) >= workload.long_tokens[0]
    assert 0.15 < len(longs) / len(requests) < 0.45  # about long_share of the requests
    body = requests[0].body("m")
    assert body["stream"] is True and body["model"] == "m"
    assert len(body["messages"][0]["content"]) >= workload.system_tokens * BYTES_PER_TOKEN


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_parse_counter_sums_label_sets_and_skips() -> None:
    text = ('# HELP vllm:request_success_total x\n'
            'vllm:request_success_total{finished_reason="stop",model_name="a"} 3.0\n'
            'vllm:request_success_total{finished_reason="abort",model_name="a"} 5.0\n'
            'vllm:request_success_created{finished_reason="stop",model_name="a"} 1.7e9\n'
            'vllm:prefix_cache_hits_total{model_name="a"} 128.0\n')
    assert parse_counter(text, "vllm:request_success_total") == 8.0
    assert parse_counter(text, "vllm:request_success_total", skip='"abort"') == 3.0
    assert parse_counter(text, "vllm:prefix_cache_hits_total") == 128.0
    assert parse_counter(text, "vllm:missing_total") == 0.0


def _report(mode: str, ttft: float) -> ModeReport:
    results = [Result("chat", 200, 0.0, 1.0, ttft, 10, "pod0"),
               Result("long", 200, 0.5, 3.0, ttft * 2, 50, "pod1", shed=1),
               Result("chat", 599, 1.0, 1.5, None, 0, None)]
    pods = [PodDelta("pod0", 2.0, 3, 1000, 500, ((1, 0, 0.5), (3, 2, 1.0))),
            PodDelta("pod1", 0.5, 1, 1000, 0)]
    return ModeReport(mode, 2.0, results, pods, extproc_cpu_s=0.03, attempts=4, load=[1.0, 2.0])


def test_the_report_counts_what_the_clients_and_pods_saw() -> None:
    values = {name: value for name, value, _ in rows(_report("least request", 0.2))}
    assert values["completed requests (in window)"] == 1  # the long one ended after the window
    assert values["failed requests"] == 1
    assert values["503 sheds (client waited, retried)"] == 1
    assert values["throughput, req/s"] == 0.5
    assert values["TTFT P50 ms (chat)"] == pytest.approx(200)
    assert values["end-to-end P50 ms (long)"] == pytest.approx(2500)
    assert values["prefix-cache hit rate (tokens)"] == 0.25
    assert values["share of requests, pod0 (speed 2)"] == 0.75
    assert values["extproc CPU ms / request"] == pytest.approx(7.5)
    assert values["load average (1 min), mean in run"] == 1.5

    text = table(_report("least request", 0.2), _report("picker", 0.1))
    assert "| TTFT P50 ms (chat) | 200 | 100 | 0.50x |" in text
    assert "| load average (1 min), mean in run | 1.50 | 1.50 |  |" in text
    pods = pod_table(_report("picker", 0.1))
    assert "| pod0 | 2 | 75.0% | 2.0 | 1.0 | 75% | 50.0% | 0 | 100 | 100 |" in pods
    assert "| pod1 | 0.5 | 25.0% | n/a | n/a | n/a | 0.0% | 1 | n/a | n/a |" in pods


@pytest.mark.e2e
def test_a_tiny_run_of_both_modes_answers_every_request() -> None:
    try:
        envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    done = subprocess.run(
        [sys.executable, "-m", "bench.picker_load", "--speeds", "2.0,0.5", "--clients", "2",
         "--requests", "2", "--duration", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "| completed requests (in window) | 4 | 4 | 1.00x |" in out, out
    assert "| failed requests | 0 | 0 |" in out, out
    assert "share of requests, pod1 (speed 0.5)" in out
    assert "| least request: pod |" in out and "| picker: pod |" in out
    assert "picks by reason:" in out  # extproc picked (the picker mode really had a picker)
