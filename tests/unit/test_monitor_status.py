"""The status model's pure parts: quantiles from buckets, two scrapes → interval stats, the
thresholds a row breaks; and rows for instances that cannot be reached."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest

from fleet.monitor.histograms import delta, quantile
from fleet.monitor.intervals import counter_delta, interval_stats
from fleet.monitor.metric_names import V0_33_0 as N
from fleet.monitor.scrape import ScrapeError, parse_metrics
from fleet.monitor.status import Health, InstanceStatus, classify_error, collect, from_scrapes, problems_of
from fleet.monitor.targets import Target
from fleet.monitor.thresholds import Thresholds

INF = math.inf
TARGET = Target("h1", "g", "m", 0, "127.0.0.1", 8000, "0.33.0")


@pytest.mark.parametrize(
    ("q", "buckets", "value", "bounds"),
    [
        (0.5, [(1, 0), (2, 10), (INF, 10)], 1.5, (1, 2)),  # interpolated inside (1, 2]
        (0.99, [(1, 0), (2, 10), (INF, 10)], 1.99, (1, 2)),
        (0.5, [(1, 4), (2, 4), (INF, 4)], 0.5, (0, 1)),  # the first bucket starts at 0
        (0.99, [(1, 0), (2, 5), (INF, 10)], 2, (2, INF)),  # in +Inf: the highest finite bound
        (0.5, [(0.5, 2), (1.0, 4), (INF, 4)], 0.5, (0, 0.5)),
        (0.95, [(100, 0), (200, 50), (500, 100), (INF, 100)], 470, (200, 500)),
    ],
)
def test_quantile_like_histogram_quantile(q: float, buckets: list[tuple[float, float]], value: float,
                                          bounds: tuple[float, float]) -> None:  # fmt: skip
    result = quantile(q, buckets)
    assert result.value == pytest.approx(value)
    assert (result.lower, result.upper) == bounds
    assert result.count == buckets[-1][1]


def test_quantile_edges() -> None:
    assert quantile(0.5, [(1, 0), (INF, 0)]).value is None
    with pytest.raises(ValueError, match="\\+Inf"):
        quantile(0.5, [(1, 1), (2, 2)])
    with pytest.raises(ValueError):
        quantile(1.5, [(1, 1), (INF, 1)])


def test_delta_and_counter_reset() -> None:
    before = [(1.0, 5.0), (INF, 8.0)]
    assert delta([(1.0, 7.0), (INF, 12.0)], before) == [(1.0, 2.0), (INF, 4.0)]
    assert delta([(1.0, 1.0), (INF, 2.0)], before) == [(1.0, 1.0), (INF, 2.0)]  # restarted: all new
    assert counter_delta(10, 4) == 6 and counter_delta(3, 4) == 3 and counter_delta(None, 4) == 0


def exposition(preempt: float, success: float, ttft: list[float], e2e: list[float], kv: float, waiting: float) -> str:
    """vLLM 0.33-shaped text: names and labels as vllm/v1/metrics/loggers.py writes them."""
    lab = 'engine="0",model_name="m"'
    lines = [
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} 3.0",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lab}}} {waiting}",
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{lab}}} {kv}",
        "# TYPE vllm:num_preemptions counter", f"vllm:num_preemptions_total{{{lab}}} {preempt}",
        "# TYPE vllm:generation_tokens counter", f"vllm:generation_tokens_total{{{lab}}} {success * 10}",
        "# TYPE vllm:request_success counter",
        f'vllm:request_success_total{{{lab},finished_reason="stop"}} {success / 2}',
        f'vllm:request_success_total{{{lab},finished_reason="length"}} {success / 2}',
    ]  # fmt: skip
    for name, counts, bounds in (
        ("vllm:time_to_first_token_seconds", ttft, (0.1, 0.5, 1.0)),
        ("vllm:e2e_request_latency_seconds", e2e, (1.0, 5.0, 10.0)),
    ):
        lines.append(f"# TYPE {name} histogram")
        for le, c in zip((*bounds, "+Inf"), counts, strict=True):
            lines.append(f'{name}_bucket{{{lab},le="{le}"}} {c}')
        lines += [f"{name}_count{{{lab}}} {counts[-1]}", f"{name}_sum{{{lab}}} 1.0"]
    return "\n".join(lines) + "\n"


def test_two_scrapes_give_interval_stats() -> None:
    first = parse_metrics(exposition(2, 100, [50, 90, 100, 100], [10, 80, 100, 100], 0.2, 0), at=10.0)
    second = parse_metrics(exposition(5, 200, [50, 90, 190, 200], [10, 80, 100, 200], 0.95, 30), at=20.0)
    stats = interval_stats(first, second, N)
    assert stats.seconds == 10 and stats.finished == 100 and stats.preemptions == 3
    assert stats.preemptions_per_request == pytest.approx(0.03)
    assert stats.requests_per_second == 10 and stats.generation_tokens_per_second == 100
    # the 100 new TTFTs: 90 in (0.5, 1], 10 above 1 s → p50 inside (0.5, 1], p99 in +Inf → "> 1"
    assert (stats.ttft_p50.lower, stats.ttft_p50.upper) == (0.5, 1.0)  # type: ignore[union-attr]
    assert stats.ttft_p50.value == pytest.approx(0.5 + 0.5 * 50 / 90)  # type: ignore[union-attr]
    assert stats.ttft_p99.value == 1.0 and stats.ttft_p99.upper == INF  # type: ignore[union-attr]
    assert stats.e2e_p99.value == 10.0  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        interval_stats(second, first, N)

    row = from_scrapes(TARGET, Health.READY, "", "0.33.0", first, second, N, Thresholds())
    assert row.kv_usage == 0.95 and row.running == 3 and row.waiting == 30
    assert row.problems == ("KV cache 95% > 90%", "30 waiting > 20", "preemptions 3.0% of requests > 2%")
    assert not row.ok
    quiet = from_scrapes(TARGET, Health.READY, "", "0.33.0", first, first.__class__(11.0, first.samples), N,
                         Thresholds())  # fmt: skip
    assert quiet.ok and quiet.interval is not None and quiet.interval.preemptions_per_request is None


@pytest.mark.parametrize(
    ("row", "problems"),
    [
        (InstanceStatus(TARGET, Health.READY, version="0.32.0"), ["runs vLLM 0.32.0, inventory pins 0.33.0"]),
        (InstanceStatus(TARGET, Health.READY, version="0.33.0+fleetlab.1", kv_usage=0.5), []),
        (InstanceStatus(TARGET, Health.READY, waiting=21), ["21 waiting > 20"]),
        (InstanceStatus(TARGET, Health.NOT_LISTENING), []),
    ],
)
def test_problems_table(row: InstanceStatus, problems: list[str]) -> None:
    assert list(problems_of(row, Thresholds())) == problems


def test_classify_errors() -> None:
    assert classify_error(urllib.error.URLError(ConnectionRefusedError()))[0] is Health.NOT_LISTENING
    assert classify_error(urllib.error.URLError(socket.gaierror(-2, "Name or service not known")))[0] is (
        Health.UNREACHABLE
    )
    assert classify_error(TimeoutError())[0] is Health.UNREACHABLE


def test_unreachable_instances_are_rows() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: refused
        targets = [
            Target("h1", "g", "m", 0, "127.0.0.1", port, "0.33.0"),
            Target("h2", "g", "m", 0, "no-such-host.invalid", 8000, "0.33.0"),
        ]
        rows, latest = collect(targets, interval=0.1, timeout=1.0)
    assert [r.health for r in rows] == [Health.NOT_LISTENING, Health.UNREACHABLE]
    assert all(not r.ok and r.interval is None for r in rows) and latest == {}


def test_not_prometheus_text() -> None:
    with pytest.raises(ScrapeError):
        parse_metrics("vllm:x{ 1 2 3\n", 0.0)


def test_status_cli_rows_for_instances_that_do_not_answer(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        inv = tmp_path / "inv.py"
        wl = {"p95_input_tokens": 1000, "p95_output_tokens": 100, "prefix_reuse": 0.0, "target_concurrency": 4}
        data = {"ssh_hostname": "127.0.0.1", "port": port, "model": "mistralai/Mistral-7B-Instruct-v0.3",
                "gpu": {"sku": "a10-24gb"}, "workload": wl}  # fmt: skip
        inv.write_text(f"edge = [('e1', {data!r})]\n")
        env = {**os.environ, "COLUMNS": "200"}
        cmd = [sys.executable, "-m", "fleet.cli", "status", str(inv), "--interval", "0.2"]
        result = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, timeout=60)
        human = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        no_ssh = subprocess.run([*cmd, "--json", "--no-ssh"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1, result.stderr
    (row,) = json.loads(result.stdout)["instances"]
    assert (row["host"], row["health"], row["ok"]) == ("e1", "not listening", False)
    assert row["interval"] is None
    # no SSH server that knows us there: the SSH side says so in the row
    assert row["unit"]["state"] == "unreachable" and row["unit"]["detail"], row["unit"]
    assert any("unreachable over SSH" in p for p in row["problems"])
    (row,) = json.loads(no_ssh.stdout)["instances"]
    assert no_ssh.returncode == 1 and row["unit"] is None and row["problems"] == []
    assert human.returncode == 1 and "not listening" in human.stdout and "Traceback" not in human.stderr


def test_parsing_only_the_families_status_needs_reads_the_same_values() -> None:
    text = exposition(2, 100, [50, 90, 100, 100], [10, 80, 100, 100], 0.2, 4)
    text += "# TYPE vllm:inter_token_latency_seconds histogram\n"
    text += 'vllm:inter_token_latency_seconds_bucket{engine="0",model_name="m",le="+Inf"} 7.0\n'
    full = parse_metrics(text, 1.0)
    some = parse_metrics(text, 1.0, N.status_families)
    itl = "vllm:inter_token_latency_seconds_bucket"
    assert not some.has(itl) and full.has(itl)
    for name in (N.kv_cache_usage, N.waiting, N.preemptions, N.request_success):
        assert some.value(name) == full.value(name) is not None
    assert some.buckets(N.ttft) == full.buckets(N.ttft) and some.buckets(N.e2e_latency) == full.buckets(N.e2e_latency)
