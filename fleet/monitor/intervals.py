"""What happened on an instance between two scrapes (pure): rates and latency percentiles.

Counters and histogram buckets are differenced between the scrapes (a counter that went down
means the process restarted, and the later value is the whole interval's count, as Prometheus'
``increase`` assumes). Percentiles come from the differenced buckets (``fleet.monitor.histograms``),
so they describe only requests that finished inside the interval.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.monitor.histograms import Quantile, delta, quantile
from fleet.monitor.metric_names import MetricNames
from fleet.monitor.scrape import Scrape


@dataclass(frozen=True)
class IntervalStats:
    seconds: float
    finished: float  #: requests finished (any reason)
    preemptions: float
    generation_tokens: float
    ttft_p50: Quantile | None
    ttft_p99: Quantile | None
    e2e_p50: Quantile | None
    e2e_p99: Quantile | None

    @property
    def preemptions_per_request(self) -> float | None:
        """Preemptions per finished request (the 2 % alert's ratio); None when nothing happened."""
        if self.finished > 0:
            return self.preemptions / self.finished
        return float("inf") if self.preemptions > 0 else None

    @property
    def requests_per_second(self) -> float:
        return self.finished / self.seconds if self.seconds > 0 else 0.0

    @property
    def generation_tokens_per_second(self) -> float:
        return self.generation_tokens / self.seconds if self.seconds > 0 else 0.0


def counter_delta(after: float | None, before: float | None) -> float:
    if after is None:
        return 0.0
    if before is None or after < before:
        return after
    return after - before


def _quantiles(name: str, before: Scrape, after: Scrape) -> tuple[Quantile | None, Quantile | None]:
    b1 = after.buckets(name)
    if b1 is None:
        return None, None
    diff = delta(b1, before.buckets(name))
    return quantile(0.5, diff), quantile(0.99, diff)


def interval_stats(before: Scrape, after: Scrape, names: MetricNames) -> IntervalStats:
    """Stats of the interval between two scrapes of the same instance (``before.at < after.at``)."""
    if after.at <= before.at:
        raise ValueError("the second scrape must be later than the first")
    ttft = _quantiles(names.ttft, before, after)
    e2e = _quantiles(names.e2e_latency, before, after)
    return IntervalStats(
        seconds=after.at - before.at,
        finished=counter_delta(after.value(names.request_success), before.value(names.request_success)),
        preemptions=counter_delta(after.value(names.preemptions), before.value(names.preemptions)),
        generation_tokens=counter_delta(after.value(names.generation_tokens), before.value(names.generation_tokens)),
        ttft_p50=ttft[0],
        ttft_p99=ttft[1],
        e2e_p50=e2e[0],
        e2e_p99=e2e[1],
    )
