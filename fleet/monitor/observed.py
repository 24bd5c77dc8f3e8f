"""Workloads from observed traffic: what the instances actually serve, next to what the inventory
declares, and the plan that the observed workload would give (``fleet plan --observed``).

From each host's serving instances:

* p95 input and output tokens per request, from ``vllm:request_prompt_tokens`` and
  ``vllm:request_generation_tokens`` (histograms whose buckets are vLLM's 1-2-5 series up to
  ``max_model_len``: ``build_1_2_5_buckets`` in ``vllm/v1/metrics/buckets.py``). The value is
  interpolated inside the bucket that holds the 95th percentile, as ``histogram_quantile`` does, so
  it is only known to within that bucket: the bounds are reported with it, and so is the number of
  requests it rests on.
* prefix reuse: ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` (both in tokens).
* concurrency: the peak of ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` summed over
  the host's instances: over the scrape rounds taken while observing (HTTP), or each instance's
  ``max_over_time`` summed per host (Prometheus: an upper bound, the instances need not peak together).

Read directly from the instances (cumulative since each process started; the peak from the scrapes
taken during the observation window), or from a Prometheus server that scrapes them
(``increase`` over a window). Derivation, suggestion and the plan diff are pure functions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.errors import FleetError
from fleet.inventory.spec import LoadedInventory, Workload
from fleet.monitor.histograms import Buckets, Quantile, quantile
from fleet.monitor.metric_names import MetricNames, names_for
from fleet.monitor.scrape import Scrape, ScrapeError, get_json, scrape
from fleet.monitor.targets import Target
from fleet.plan.outcomes import HostOutcome, plan_inventory

P = 0.95


class ObservedError(FleetError):
    pass


@dataclass(frozen=True)
class HostTraffic:
    """What was read for one host (all its instances summed), before any derivation."""

    host: str
    instances: int
    prompt_buckets: tuple[tuple[float, float], ...] | None
    generation_buckets: tuple[tuple[float, float], ...] | None
    prefix_hits: float | None
    prefix_queries: float | None
    peak_concurrency: float | None
    source: str
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class ObservedWorkload:
    host: str
    requests: float  #: sample size: requests the p95s rest on
    p95_input: Quantile | None
    p95_output: Quantile | None
    prefix_reuse: float | None
    peak_concurrency: float | None
    source: str
    notes: tuple[str, ...] = field(default=())


def derive(traffic: HostTraffic) -> ObservedWorkload:
    """The observed workload of one host (pure)."""
    notes = [f"{name} not exported: that part of the workload stays as declared" for name in traffic.missing]
    p_in = quantile(P, traffic.prompt_buckets) if traffic.prompt_buckets else None
    p_out = quantile(P, traffic.generation_buckets) if traffic.generation_buckets else None
    requests = p_in.count if p_in else (p_out.count if p_out else 0.0)
    for label, q in (("input", p_in), ("output", p_out)):
        if q is not None and q.value is not None and math.isinf(q.upper):
            notes.append(f"p95 {label} lies above the largest bucket ({q.lower:g}): at least that, not exact")
    reuse = None
    if traffic.prefix_queries and traffic.prefix_hits is not None:
        reuse = min(1.0, traffic.prefix_hits / traffic.prefix_queries)
    if requests < 100:
        notes.append(f"only {requests:g} requests observed: a p95 from fewer than 100 is a rough guide")
    return ObservedWorkload(
        traffic.host, requests, p_in, p_out, reuse, traffic.peak_concurrency, traffic.source, tuple(notes)
    )


def suggest(declared: Workload, observed: ObservedWorkload) -> Workload:
    """The workload to declare, from what was observed; unobserved parts keep the declared value (pure)."""

    def tokens(q: Quantile | None, current: int) -> int:
        if q is None or q.value is None or q.count == 0:
            return current
        return max(1, math.ceil(q.value))

    reuse = declared.prefix_reuse if observed.prefix_reuse is None else round(observed.prefix_reuse, 2)
    peak = observed.peak_concurrency
    concurrency = declared.target_concurrency if not peak else max(1, math.ceil(peak))
    return Workload(
        p95_input_tokens=tokens(observed.p95_input, declared.p95_input_tokens),
        p95_output_tokens=tokens(observed.p95_output, declared.p95_output_tokens),
        prefix_reuse=reuse,
        target_concurrency=concurrency,
    )


def workload_change(declared: Workload, suggested: Workload) -> dict[str, tuple[object, object]]:
    """``key → (declared, suggested)`` for the keys that differ (pure)."""
    out: dict[str, tuple[object, object]] = {}
    for f in dataclasses.fields(Workload):
        a, b = getattr(declared, f.name), getattr(suggested, f.name)
        if a != b:
            out[f.name] = (a, b)
    return out


def plan_diff(before: HostOutcome, after: HostOutcome) -> list[str]:
    """What re-planning changes on one host, one line per difference (pure)."""
    if before.plan is None or after.plan is None:
        if (before.plan is None) != (after.plan is None):
            return [
                "plan: no valid plan → valid plan"
                if before.plan is None
                else f"plan: valid → no valid plan: {after.problem.summary if after.problem else '?'}"
            ]
        return []
    lines = []
    b_inst, a_inst = before.plan.instances, after.plan.instances
    if len(b_inst) != len(a_inst):
        lines.append(f"instances: {len(b_inst)} → {len(a_inst)}")
    for b, a in zip(b_inst, a_inst, strict=False):
        b_flags = {f.option: f.value or "(on)" for f in b.flags}
        a_flags = {f.option: f.value or "(on)" for f in a.flags}
        for option in sorted(set(b_flags) | set(a_flags)):
            old, new = b_flags.get(option, "(absent)"), a_flags.get(option, "(absent)")
            if old != new:
                lines.append(f"vllm-{a.index}: {option} {old} → {new}")
        if b.tensor_parallel_size != a.tensor_parallel_size:
            lines.append(f"vllm-{a.index}: tensor parallel {b.tensor_parallel_size} → {a.tensor_parallel_size}")
        if round(b.memory.max_concurrency, 1) != round(a.memory.max_concurrency, 1):
            lines.append(
                f"vllm-{a.index}: max concurrency {b.memory.max_concurrency:.1f} → {a.memory.max_concurrency:.1f}"
            )
    return lines


@dataclass(frozen=True)
class HostReport:
    host: str
    declared: Workload
    observed: ObservedWorkload | None
    suggested: Workload
    change: dict[str, tuple[object, object]]
    plan_diff: list[str]
    problem: str | None = None


def replan(
    inventory: LoadedInventory,
    observed: Mapping[str, ObservedWorkload],
    plan: Callable[[LoadedInventory], list[HostOutcome]] = plan_inventory,
) -> list[HostReport]:
    """Plan with the declared and with the suggested workloads; one report per host."""
    before = {o.spec.name: o for o in plan(inventory)}
    suggested = {
        spec.name: suggest(spec.workload, observed[spec.name]) if spec.name in observed else spec.workload
        for spec in inventory.hosts
    }
    changed = dataclasses.replace(
        inventory, hosts=tuple(dataclasses.replace(s, workload=suggested[s.name]) for s in inventory.hosts)
    )
    after = {o.spec.name: o for o in plan(changed)}
    reports = []
    for spec in inventory.hosts:
        obs = observed.get(spec.name)
        reports.append(
            HostReport(
                host=spec.name,
                declared=spec.workload,
                observed=obs,
                suggested=suggested[spec.name],
                change=workload_change(spec.workload, suggested[spec.name]),
                plan_diff=plan_diff(before[spec.name], after[spec.name]),
                problem=None if obs else "not observed (no instance answered)",
            )
        )
    return reports


# -- reading: instances over HTTP ---------------------------------------------------------------------


def _sum_buckets(parts: Sequence[Buckets]) -> tuple[tuple[float, float], ...] | None:
    total: dict[float, float] = {}
    for buckets in parts:
        for le, count in buckets:
            total[le] = total.get(le, 0.0) + count
    return tuple(sorted(total.items())) or None


def traffic_from_scrapes(host: str, scrapes: Mapping[str, Sequence[Scrape]], names: MetricNames) -> HostTraffic:
    """One host's traffic from repeated scrapes of its instances (instance → scrapes in time order); pure."""
    latest = [s[-1] for s in scrapes.values() if s]
    missing = tuple(
        n
        for n in (names.request_prompt_tokens, names.request_generation_tokens, names.prefix_cache_queries)
        if latest and not any(s.has(n + "_bucket") or s.has(n) for s in latest)
    )
    prompt = _sum_buckets([b for s in latest if (b := s.buckets(names.request_prompt_tokens))])
    generation = _sum_buckets([b for s in latest if (b := s.buckets(names.request_generation_tokens))])
    hits = [v for s in latest if (v := s.value(names.prefix_cache_hits)) is not None]
    queries = [v for s in latest if (v := s.value(names.prefix_cache_queries)) is not None]
    # peak of the host's total in flight, over the scrape rounds (round k: the k-th scrape of each instance)
    rounds = max((len(s) for s in scrapes.values()), default=0)
    peak = None
    for k in range(rounds):
        total = 0.0
        for series in scrapes.values():
            if k < len(series):
                total += (series[k].value(names.running) or 0.0) + (series[k].value(names.waiting) or 0.0)
        peak = total if peak is None else max(peak, total)
    span = 0.0
    if rounds > 1:
        span = max(s[-1].at - s[0].at for s in scrapes.values() if s)
    return HostTraffic(
        host=host,
        instances=len(scrapes),
        prompt_buckets=prompt,
        generation_buckets=generation,
        prefix_hits=sum(hits) if hits else None,
        prefix_queries=sum(queries) if queries else None,
        peak_concurrency=peak,
        source=f"{len(scrapes)} instance(s) over HTTP: histograms since start, peak over {rounds} scrapes "
        f"in {span:.0f}s",
        missing=missing,
    )


def observe_http(
    targets: list[Target],
    seconds: float = 10.0,
    every: float = 1.0,
    timeout: float = 3.0,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, ObservedWorkload]:
    """Scrape every instance every ``every`` seconds for ``seconds``; the derived workload per host."""
    from concurrent.futures import ThreadPoolExecutor

    series: dict[str, list[Scrape]] = {t.instance: [] for t in targets}
    families = {t.instance: names_for(t.vllm_version, t.host).observed_families for t in targets}
    end = clock() + seconds
    with ThreadPoolExecutor(max_workers=max(1, min(64, len(targets)))) as pool:
        while True:
            started = clock()

            def one(t: Target) -> tuple[str, Scrape | None]:
                try:
                    return t.instance, scrape(t.url, clock(), timeout, families[t.instance])
                except ScrapeError:
                    return t.instance, None

            for instance, result in pool.map(one, targets):
                if result is not None:
                    series[instance].append(result)
            if clock() + every > end:
                break
            time.sleep(max(0.0, every - (clock() - started)))
    out: dict[str, ObservedWorkload] = {}
    for host in dict.fromkeys(t.host for t in targets):
        mine = {t.instance: series[t.instance] for t in targets if t.host == host and series[t.instance]}
        if mine:
            version = next(t.vllm_version for t in targets if t.host == host)
            out[host] = derive(traffic_from_scrapes(host, mine, names_for(version, host)))
    return out


# -- reading: a Prometheus server ---------------------------------------------------------------------


def _query(base: str, promql: str, timeout: float) -> list[dict[str, Any]]:
    url = base.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        data = get_json(url, timeout)
    except (OSError, ScrapeError) as exc:
        raise ObservedError(f"Prometheus at {base}: {exc}") from exc
    if not isinstance(data, dict) or data.get("status") != "success":
        raise ObservedError(f"Prometheus at {base}: query failed: {json.dumps(data)[:300]}")
    result = data["data"]["result"]
    return result if isinstance(result, list) else []


def observe_prometheus(
    base: str, hosts: Sequence[str], window: str = "7d", version: str = "0.33.0", timeout: float = 10.0
) -> dict[str, ObservedWorkload]:
    """The derived workload per host from a Prometheus that scrapes the fleet (job ``fleet-vllm``)."""
    n = names_for(version)
    sel = '{job="fleet-vllm"}'

    def by_host_le(hist: str) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for r in _query(base, f"sum by (host, le) (increase({hist}_bucket{sel}[{window}]))", timeout):
            out.setdefault(r["metric"].get("host", "?"), []).append((float(r["metric"]["le"]), float(r["value"][1])))
        return out

    def by_host(promql: str) -> dict[str, float]:
        return {r["metric"].get("host", "?"): float(r["value"][1]) for r in _query(base, promql, timeout)}

    prompt = by_host_le(n.request_prompt_tokens)
    generation = by_host_le(n.request_generation_tokens)
    hits = by_host(f"sum by (host) (increase({n.prefix_cache_hits}{sel}[{window}]))")
    queries = by_host(f"sum by (host) (increase({n.prefix_cache_queries}{sel}[{window}]))")
    # Each instance's own peak, summed per host: an upper bound of the host's simultaneous peak (the
    # instances need not peak together), read from raw samples without a subquery.
    peak = by_host(
        f"sum by (host) (max_over_time({n.running}{sel}[{window}]) + max_over_time({n.waiting}{sel}[{window}]))"
    )
    instances = by_host(f"count by (host) (up{sel})")
    out = {}
    for host in hosts:
        if host not in instances:
            continue
        traffic = HostTraffic(
            host=host,
            instances=int(instances[host]),
            prompt_buckets=tuple(sorted(prompt[host])) if host in prompt else None,
            generation_buckets=tuple(sorted(generation[host])) if host in generation else None,
            prefix_hits=hits.get(host),
            prefix_queries=queries.get(host),
            peak_concurrency=peak.get(host),
            source=f"Prometheus {base}, last {window}",
            missing=tuple(
                name
                for name, found in ((n.request_prompt_tokens, prompt), (n.request_generation_tokens, generation))
                if host not in found
            ),
        )
        out[host] = derive(traffic)
    return out


# -- --json ---------------------------------------------------------------------------------------------


def _q(q: Quantile | None) -> dict[str, Any] | None:
    if q is None or q.value is None:
        return None
    return {"tokens": round(q.value, 1), "bucket": [q.lower, None if math.isinf(q.upper) else q.upper],
            "requests": q.count}  # fmt: skip


def report_data(r: HostReport) -> dict[str, Any]:
    o = r.observed
    return {
        "host": r.host,
        "declared": dataclasses.asdict(r.declared),
        "observed": None
        if o is None
        else {
            "requests": o.requests,
            "p95_input_tokens": _q(o.p95_input),
            "p95_output_tokens": _q(o.p95_output),
            "prefix_reuse": o.prefix_reuse,
            "peak_concurrency": o.peak_concurrency,
            "source": o.source,
            "notes": list(o.notes),
        },
        "suggested": dataclasses.asdict(r.suggested),
        "change": {k: {"declared": a, "suggested": b} for k, (a, b) in r.change.items()},
        "plan_diff": r.plan_diff,
        "problem": r.problem,
    }
