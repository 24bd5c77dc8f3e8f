"""``/metrics``: vLLM 0.33's V1 metrics, written by ``prometheus_client`` as vLLM writes them.

Names, help texts, label names and buckets are those of ``PrometheusStatLogger.__init__`` in
``vllm/v1/metrics/loggers.py`` and ``vllm/v1/metrics/buckets.py``. Every metric carries
``model_name`` (the first served name) and ``engine`` (``"0"``). prometheus_client does the
exposition, so counters come out as ``<name>_total`` with ``<name>_created`` samples and
``# TYPE <name> counter`` (the name without ``_total``), histograms as ``_bucket``/``_count``/
``_sum``/``_created``, exactly what a Prometheus server and prometheus_client's own parser
expect. ``vllm:request_success`` has one series per ``FinishReason`` (``stop``, ``length``,
``abort``, ``error``, ``repetition``; ``vllm/v1/engine/__init__.py``). ``vllm:cache_config_info``
is a gauge of 1 whose labels carry the cache configuration (``log_metrics_info``).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
LABELS = ["model_name", "engine"]

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """``build_1_2_5_buckets`` (``vllm/v1/metrics/buckets.py``): 1, 2, 5, 10, ... ≤ max_value."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class Metrics:
    """The registry behind ``/metrics`` and the hooks the engine calls."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_info: dict[str, str],
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry()
        values = (model_name, "0")
        reg = self.registry

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, LABELS, registry=reg).labels(*values).set_function(fn)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=reg).labels(*values)

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=reg)  # fmt: skip
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*values)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)  # fmt: skip
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)  # fmt: skip
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)  # fmt: skip
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     [*cache_info, "engine"], registry=reg)  # fmt: skip
        info.labels(**cache_info, engine="0").set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
