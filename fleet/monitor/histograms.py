"""Quantiles from cumulative histogram buckets, the way Prometheus' ``histogram_quantile`` does it.

Buckets are ``(upper bound, cumulative count)`` pairs ending with ``+Inf``. The quantile is
interpolated linearly inside the bucket that holds its rank; the lowest bucket starts at 0; a rank
in the ``+Inf`` bucket answers the highest finite bound (Prometheus: ``promql/quantile.go``,
``bucketQuantile``). The answer is only known to lie inside its bucket, so each result carries the
bucket's bounds: that is the resolution to state next to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Buckets = Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Quantile:
    q: float
    value: float | None  #: None when there are no observations
    lower: float  #: the bucket holding the rank: (lower, upper]
    upper: float
    count: float  #: observations the estimate rests on

    @property
    def resolution(self) -> float:
        return self.upper - self.lower


def quantile(q: float, buckets: Buckets) -> Quantile:
    """The ``q`` quantile (0..1) of cumulative ``buckets`` (any order, ``+Inf`` required).

    Mirrors ``bucketQuantile``: the first bucket whose count reaches ``rank = q × total`` holds the
    answer, interpolated linearly from the previous bound (0 for the first bucket); the ``+Inf``
    bucket answers the highest finite bound.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} outside 0..1")
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        raise ValueError("need at least one finite bucket and +Inf")
    total = ordered[-1][1]
    if total <= 0:
        return Quantile(q, None, 0.0, 0.0, 0.0)
    rank = q * total
    b = next((i for i, (_, count) in enumerate(ordered[:-1]) if count >= rank), len(ordered) - 1)
    if b == len(ordered) - 1:
        finite = ordered[-2][0]
        return Quantile(q, finite, finite, math.inf, total)
    end, count = ordered[b]
    start = 0.0
    if b == 0 and end <= 0:
        return Quantile(q, end, end, end, total)
    if b > 0:
        start = ordered[b - 1][0]
        count -= ordered[b - 1][1]
        rank -= ordered[b - 1][1]
    value = start + (end - start) * (rank / count) if count > 0 else start
    return Quantile(q, value, start, end, total)


def delta(after: Buckets, before: Buckets | None) -> list[tuple[float, float]]:
    """Observations between two scrapes; a counter reset (a restart) makes ``after`` the delta."""
    if not before:
        return sorted(after)
    old = dict(before)
    diff = [(bound, count - old.get(bound, 0.0)) for bound, count in sorted(after)]
    if any(c < 0 for _, c in diff) or set(old) != {b for b, _ in after}:
        return sorted(after)
    return diff
