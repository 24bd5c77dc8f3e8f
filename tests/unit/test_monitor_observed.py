"""Workloads from observed traffic (pure parts): p95s from vLLM's 1-2-5 token buckets within the
bucket resolution, prefix reuse, peak concurrency, the suggested workload and the plan diff."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from fleet.inventory.spec import Workload, load_inventory
from fleet.monitor.histograms import Quantile
from fleet.monitor.metric_names import V0_33_0 as N
from fleet.monitor.metric_names import token_buckets
from fleet.monitor.observed import (
    HostTraffic,
    ObservedWorkload,
    derive,
    replan,
    suggest,
    traffic_from_scrapes,
    workload_change,
)
from fleet.monitor.scrape import parse_metrics


def cumulative(values: list[int], bounds: list[float]) -> list[tuple[float, float]]:
    return [(b, float(sum(1 for v in values if v <= b))) for b in bounds] + [(math.inf, float(len(values)))]


def true_p95(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[math.ceil(0.95 * len(ordered)) - 1])


def test_token_buckets_are_vllms_1_2_5_series() -> None:
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(4096)[-2:] == [1000, 2000]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(("low", "high"), [(100, 3000), (20, 400), (1500, 1900)])
def test_p95_within_bucket_resolution(seed: int, low: int, high: int) -> None:
    rng = random.Random(seed)
    prompts = [rng.randint(low, high) for _ in range(2000)]
    outputs = [rng.randint(1, 300) for _ in range(2000)]
    bounds = token_buckets(8192)
    traffic = HostTraffic("h", 1, tuple(cumulative(prompts, bounds)), tuple(cumulative(outputs, bounds)),
                          None, None, None, "test")  # fmt: skip
    observed = derive(traffic)
    assert observed.requests == 2000
    for q, values in ((observed.p95_input, prompts), (observed.p95_output, outputs)):
        assert q is not None and q.value is not None
        truth = true_p95(values)
        assert q.lower <= truth <= q.upper, (q, truth)  # the stated bucket holds the true p95
        assert abs(q.value - truth) <= q.resolution


def test_p95_above_largest_bucket_is_flagged() -> None:
    traffic = HostTraffic("h", 1, ((1000.0, 10.0), (2000.0, 10.0), (math.inf, 200.0)), None, None, None, None, "t")
    observed = derive(traffic)
    assert observed.p95_input is not None and observed.p95_input.value == 2000
    assert any("above the largest bucket" in n for n in observed.notes)


def _text(prompt: list[float], running: float, waiting: float, hits: float, queries: float) -> str:
    lab = 'engine="0",model_name="m"'
    lines = ["# TYPE vllm:request_prompt_tokens histogram"]
    for le, c in zip(("100.0", "200.0", "+Inf"), prompt, strict=True):
        lines.append(f'vllm:request_prompt_tokens_bucket{{{lab},le="{le}"}} {c}')
    lines += [
        f"vllm:request_prompt_tokens_count{{{lab}}} {prompt[-1]}", f"vllm:request_prompt_tokens_sum{{{lab}}} 1",
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} {running}",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lab}}} {waiting}",
        "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total{{{lab}}} {hits}",
        "# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total{{{lab}}} {queries}",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def test_traffic_from_scrapes_sums_instances_and_takes_the_peak() -> None:
    a = [parse_metrics(_text([0, 0, 0], 1, 0, 0, 0), 0), parse_metrics(_text([10, 60, 100], 4, 2, 30, 100), 5)]
    b = [parse_metrics(_text([0, 0, 0], 3, 0, 0, 0), 0), parse_metrics(_text([50, 90, 100], 1, 0, 10, 100), 5)]
    traffic = traffic_from_scrapes("h", {"h/vllm-0": a, "h/vllm-1": b}, N)
    assert traffic.prompt_buckets == ((100.0, 60.0), (200.0, 150.0), (math.inf, 200.0))
    assert traffic.peak_concurrency == 7  # round 2: 4 + 2 waiting + 1
    assert (traffic.prefix_hits, traffic.prefix_queries) == (40, 200)
    assert traffic.missing == (N.request_generation_tokens,)
    observed = derive(traffic)
    assert observed.prefix_reuse == pytest.approx(0.2)
    assert observed.p95_input is not None and observed.p95_input.upper == math.inf
    assert observed.p95_output is None and any("not exported" in n for n in observed.notes)


def test_suggest_keeps_what_was_not_observed() -> None:
    declared = Workload(2048, 512, 0.5, 128)
    q = Quantile(0.95, 1371.2, 1000, 2000, 500)
    observed = ObservedWorkload("h", 500, q, None, 0.123, 40.0, "t")
    suggested = suggest(declared, observed)
    assert suggested == Workload(1372, 512, 0.12, 40)
    assert workload_change(declared, suggested) == {
        "p95_input_tokens": (2048, 1372), "prefix_reuse": (0.5, 0.12), "target_concurrency": (128, 40),
    }  # fmt: skip


def test_replan_shows_the_plan_diff(tmp_path: Path) -> None:
    inv = tmp_path / "inv.py"
    wl = {"p95_input_tokens": 8000, "p95_output_tokens": 1000, "prefix_reuse": 0.0, "target_concurrency": 8}
    inv.write_text(
        "edge = [('e1', {'model': 'mistralai/Mistral-7B-Instruct-v0.3', 'gpu': {'sku': 'a10-24gb'}, "
        f"'workload': {wl!r}}}), ('e2', {{'model': 'mistralai/Mistral-7B-Instruct-v0.3', "
        f"'gpu': {{'sku': 'a10-24gb'}}, 'workload': {wl!r}}})]\n"
    )
    loaded = load_inventory(inv)
    q_in = Quantile(0.95, 1800.0, 1000, 2000, 1000)
    q_out = Quantile(0.95, 180.0, 100, 200, 1000)
    reports = replan(loaded, {"e1": ObservedWorkload("e1", 1000, q_in, q_out, 0.0, 8.0, "t")})
    e1, e2 = reports
    assert e1.change == {"p95_input_tokens": (8000, 1800), "p95_output_tokens": (1000, 180)}
    assert "vllm-0: --max-model-len 9008 → 1984" in e1.plan_diff
    assert e2.observed is None and e2.problem and not e2.change and not e2.plan_diff
