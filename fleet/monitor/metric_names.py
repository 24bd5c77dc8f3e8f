"""The Prometheus metric names each vLLM release exports, one table per version.

Alert rules are written for the names of the version a host is pinned to (``vllm_version`` in the
inventory), so a rule never watches a name that release does not export (the classic mistake:
``vllm_gpu_cache_usage_perc`` — V0 spelling, removed from 0.12 on — never fires on a V1 engine).

Source for 0.33.0: vLLM's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger.__init__``, the
``name="vllm:..."`` arguments) in the ``vllm==0.33.0`` wheel; counters gain ``_total`` when
prometheus_client exposes them. Histogram buckets: ``vllm/v1/metrics/buckets.py``
(``histogram_buckets``; token counts use ``build_1_2_5_buckets(max_model_len)``).
Labels: ``model_name`` (the first served model name) and ``engine`` (the engine index).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.errors import FleetError


@dataclass(frozen=True)
class MetricNames:
    """The exposed names (as scraped) of the metrics fleet reads, for one vLLM version."""

    version: str
    running: str  #: gauge, requests in the running batch
    waiting: str  #: gauge, requests queued
    kv_cache_usage: str  #: gauge 0..1
    preemptions: str  #: counter
    request_success: str  #: counter, label finished_reason
    prompt_tokens: str  #: counter
    generation_tokens: str  #: counter
    prefix_cache_queries: str  #: counter, tokens queried
    prefix_cache_hits: str  #: counter, tokens hit
    ttft: str  #: histogram base name (seconds)
    e2e_latency: str  #: histogram base name (seconds)
    request_prompt_tokens: str  #: histogram base name (tokens per request)
    request_generation_tokens: str  #: histogram base name (tokens per request)
    model_label: str = "model_name"

    def bucket(self, histogram: str) -> str:
        return histogram + "_bucket"

    def families(self, *names: str) -> tuple[str, ...]:
        """Family names (counters without ``_total``) for ``parse_metrics(families=...)``."""
        return tuple(n.removesuffix("_total") for n in names)

    @property
    def status_families(self) -> tuple[str, ...]:
        return self.families(self.running, self.waiting, self.kv_cache_usage, self.preemptions,
                             self.request_success, self.generation_tokens, self.ttft, self.e2e_latency)  # fmt: skip

    @property
    def observed_families(self) -> tuple[str, ...]:
        return self.families(self.running, self.waiting, self.prefix_cache_queries, self.prefix_cache_hits,
                             self.request_prompt_tokens, self.request_generation_tokens)  # fmt: skip


V0_33_0 = MetricNames(
    version="0.33.0",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_cache_usage="vllm:kv_cache_usage_perc",
    preemptions="vllm:num_preemptions_total",
    request_success="vllm:request_success_total",
    prompt_tokens="vllm:prompt_tokens_total",
    generation_tokens="vllm:generation_tokens_total",
    prefix_cache_queries="vllm:prefix_cache_queries_total",
    prefix_cache_hits="vllm:prefix_cache_hits_total",
    ttft="vllm:time_to_first_token_seconds",
    e2e_latency="vllm:e2e_request_latency_seconds",
    request_prompt_tokens="vllm:request_prompt_tokens",
    request_generation_tokens="vllm:request_generation_tokens",
)

#: Versions whose names were read from the release's own source. Add a row per release checked.
TABLE: dict[str, MetricNames] = {V0_33_0.version: V0_33_0}


class UnknownVllmVersion(FleetError):
    pass


def names_for(version: str, host: str = "-", inventory: str = "-") -> MetricNames:
    """The names for ``version``; an error naming the host and the versions known otherwise."""
    try:
        return TABLE[version]
    except KeyError:
        raise UnknownVllmVersion(
            f"{inventory}: host {host}: vllm_version={version!r}: no metric-name table for this release; "
            f"known: {', '.join(sorted(TABLE))} (add one to fleet/monitor/metric_names.py from that "
            "release's vllm/v1/metrics/loggers.py)"
        ) from None


def token_buckets(max_model_len: int) -> list[float]:
    """Bucket bounds of the per-request token histograms: vLLM's ``build_1_2_5_buckets(max_model_len)``
    (``vllm/v1/metrics/buckets.py``): 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return out
            out.append(float(value))
        exponent += 1
