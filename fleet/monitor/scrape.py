"""One read of an instance's ``/metrics``, parsed with prometheus_client's own text parser.

Samples are kept under their exposed names (counters with ``_total``, histograms as
``_bucket``/``_sum``/``_count``), the names ``fleet.monitor.metric_names`` lists.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from fleet.errors import FleetError

Labels = tuple[tuple[str, str], ...]


class ScrapeError(FleetError):
    pass


@dataclass(frozen=True)
class Scrape:
    """All samples of one scrape, by sample name; ``at``: seconds (monotonic or wall, consistently)."""

    at: float
    samples: Mapping[str, tuple[tuple[Labels, float], ...]] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.samples

    def value(self, name: str, **match: str) -> float | None:
        """Sum of the samples of ``name`` whose labels include ``match``; None if there are none."""
        found = [v for labels, v in self.samples.get(name, ()) if _matches(labels, match)]
        return math.fsum(found) if found else None

    def buckets(self, histogram: str, **match: str) -> list[tuple[float, float]] | None:
        """``(le, cumulative count)`` of ``histogram``, summed over label sets (engines)."""
        out: dict[float, float] = {}
        for labels, v in self.samples.get(histogram + "_bucket", ()):
            if _matches(labels, match):
                le = float(dict(labels)["le"])
                out[le] = out.get(le, 0.0) + v
        return sorted(out.items()) or None


def _matches(labels: Labels, match: Mapping[str, str]) -> bool:
    d = dict(labels)
    return all(d.get(k) == v for k, v in match.items())


def only_families(text: str, families: Collection[str]) -> str:
    """The lines of ``text`` that belong to ``families`` (by name prefix), comments included.

    Parsing is the cost of a scrape (prometheus_client's parser is pure Python); vLLM exposes
    about twenty histograms, and status needs a handful.
    """
    prefixes = tuple(families)
    comments = tuple(f"# {kind} {f}" for f in families for kind in ("HELP", "TYPE"))
    return "\n".join(line for line in text.splitlines() if line.startswith(prefixes) or line.startswith(comments))


def parse_metrics(text: str, at: float, families: Collection[str] | None = None) -> Scrape:
    """Parse Prometheus text format (only ``families`` when given); ``ScrapeError`` when it is not."""
    samples: dict[str, list[tuple[Labels, float]]] = {}
    if families is not None:
        text = only_families(text, families)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((tuple(sorted(s.labels.items())), float(s.value)))
    except ValueError as exc:
        raise ScrapeError(f"not Prometheus text format: {exc}") from exc
    return Scrape(at, {k: tuple(v) for k, v in samples.items()})


def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    """Status and body; ``OSError`` (refused, reset, timeout) is left to the caller."""
    request = urllib.request.Request(url, headers={"accept": "text/plain"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


def scrape(base_url: str, at: float, timeout: float = 5.0, families: Collection[str] | None = None) -> Scrape:
    """GET ``base_url/metrics`` and parse it; ``ScrapeError`` naming the URL otherwise."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        status, body = http_get(url, timeout)
    except OSError as exc:
        raise ScrapeError(f"{url}: {exc}") from exc
    if status != 200:
        raise ScrapeError(f"{url}: HTTP {status}")
    return parse_metrics(body.decode("utf-8", "replace"), at, families)


def get_json(url: str, timeout: float = 5.0) -> object:
    status, body = http_get(url, timeout)
    if status != 200:
        raise ScrapeError(f"{url}: HTTP {status}")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise ScrapeError(f"{url}: not JSON") from exc
