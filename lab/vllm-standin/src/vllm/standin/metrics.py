"""``/metrics`` in Prometheus text format with vLLM 0.33's V1 metric names (vllm.md §4.3).

Labels are ``model_name`` (first served name) and ``engine`` (``"0"``). Counters are exposed
with ``_total`` and ``_created`` samples as prometheus_client does; histograms as
``_bucket``/``_sum``/``_count``; ``vllm:cache_config_info`` is a gauge of 1 whose labels carry
the cache configuration.
"""

from __future__ import annotations

from vllm.standin.engine import FINISH_REASONS, Engine, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(pairs: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in pairs.items())
    return "{" + inner + "}"


def _num(value: float) -> str:
    return repr(float(value))


def _histogram(lines: list[str], name: str, help_text: str, hist: Histogram, labels: dict[str, str]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for bound, count in zip(hist.buckets, hist.counts, strict=True):
        lines.append(f"{name}_bucket{_labels({**labels, 'le': repr(float(bound))})} {_num(count)}")
    lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {_num(hist.count)}")
    lines.append(f"{name}_count{_labels(labels)} {_num(hist.count)}")
    lines.append(f"{name}_sum{_labels(labels)} {_num(hist.total)}")


def render(engine: Engine, model_name: str, cache_info: dict[str, str]) -> str:
    """The whole exposition text."""
    base = {"engine": "0", "model_name": model_name}
    lines: list[str] = []

    def gauge(name: str, help_text: str, value: float) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{_labels(base)} {_num(value)}"])

    def counter(name: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} counter"])
        for extra, value in samples:
            lines.append(f"{name}_total{_labels({**base, **extra})} {_num(value)}")
        for extra, _ in samples:
            lines.append(f"{name}_created{_labels({**base, **extra})} {_num(engine.started)}")

    with engine.cond:
        running, waiting = len(engine.running), len(engine.waiting)
        usage = engine.used_blocks / engine.num_blocks
        prompt, generation, preemptions = engine.prompt_tokens, engine.generation_tokens, engine.preemptions
        success = dict(engine.success)
    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", [({}, preemptions)])
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [({}, prompt)])
    counter("vllm:generation_tokens", "Number of generation tokens processed.", [({}, generation)])
    counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [({"finished_reason": reason}, success[reason]) for reason in FINISH_REASONS],
    )
    _histogram(lines, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
               engine.ttft, base)  # fmt: skip
    _histogram(lines, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
               engine.e2e, base)  # fmt: skip
    lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f"vllm:cache_config_info{_labels({'engine': '0', **cache_info})} 1.0",
    ]
    return "\n".join(lines) + "\n"
