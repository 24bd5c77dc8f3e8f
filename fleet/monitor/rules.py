"""Alert rules for Prometheus, written for the metric names of each host's pinned vLLM release.

Hosts that share a vLLM version and thresholds share one rule group, selected by a ``host``
matcher, so a 1000-host fleet with three threshold profiles has three groups, not 1000. Every
alert carries its meaning (``description``) and what the on-call does (``runbook``) in its
annotations; ``severity`` is ``page`` (act now) or ``ticket`` (act today).

Sources: metric names from ``fleet.monitor.metric_names`` (vLLM's ``vllm/v1/metrics/loggers.py``);
``histogram_quantile`` over ``rate(..._bucket)`` as in Prometheus' documentation ("Histograms and
summaries"); unit restarts from node_exporter's systemd collector (``collector/systemd_linux.go``:
``node_systemd_service_restart_total{name}``, systemd's ``NRestarts``; on with
``--collector.systemd --collector.systemd.enable-restarts-metrics``); audit findings from the
textfile ``fleet.monitor.findings`` writes (node_exporter's textfile collector serves it); GPU
quarantine and the watcher's NVML session from the textfile the GPU watcher writes on each host
(``fleet.gpuwatch.watcher.textfile``: ``fleet_gpu_quarantined``, ``fleet_gpu_watch_up``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleet.monitor.findings import FINDING_METRIC
from fleet.monitor.metric_names import MetricNames, names_for
from fleet.monitor.targets import Target
from fleet.monitor.thresholds import Thresholds

VLLM_JOB = "fleet-vllm"
NODE_JOB = "fleet-node"
AUDIT_JOB = "fleet-audit"
BY = "host, group, model, instance"
UNIT_RE = r"fleet-vllm-[0-9]+\\.service"


@dataclass(frozen=True)
class RuleGroup:
    """Hosts that share a vLLM version and thresholds."""

    version: str
    thresholds: Thresholds
    hosts: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"fleet-vllm-{self.version}-{'-'.join(self.hosts[:1])}" + (
            f"-and-{len(self.hosts) - 1}-more" if len(self.hosts) > 1 else ""
        )


def group_hosts(targets: list[Target], thresholds: Mapping[str, Thresholds]) -> list[RuleGroup]:
    """Pure: one group per (version, thresholds), hosts in inventory order."""
    groups: dict[tuple[str, Thresholds], list[str]] = {}
    for t in targets:
        key = (t.vllm_version, thresholds.get(t.host, Thresholds()))
        hosts = groups.setdefault(key, [])
        if t.host not in hosts:
            hosts.append(t.host)
    return [RuleGroup(v, th, tuple(h)) for (v, th), h in groups.items()]


_RE_META = re.compile(r"([.^$*+?()\[\]{}|\\])")


def _host_matcher(hosts: tuple[str, ...]) -> str:
    """``host=~"a|b\\.c"``: RE2 metacharacters escaped, then escaped again for the PromQL string."""
    alternatives = "|".join(_RE_META.sub(r"\\\1", h) for h in hosts)
    return 'host=~"' + alternatives.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _num(value: float) -> str:
    return f"{value:g}"


def _alert(
    name: str, expr: str, for_: str, severity: str, summary: str, description: str, runbook: str
) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description, "runbook": runbook},
    }


def alert_rules(names: MetricNames, th: Thresholds, hosts: tuple[str, ...]) -> list[dict[str, Any]]:
    """The alerts of one rule group (pure)."""
    sel = _host_matcher(hosts)
    vsel = f'job="{VLLM_JOB}", {sel}'
    by = f"sum by ({BY})"
    where = "{{ $labels.instance }} ({{ $labels.model }})"
    return [
        _alert(
            "VllmInstanceDown",
            f"up{{{vsel}}} == 0",
            th.instance_down_for,
            "page",
            f"vLLM instance {where} is down",
            f"Prometheus has not been able to scrape {{{{ $labels.instance }}}}'s /metrics for {th.instance_down_for}: "
            "the unit is stopped or crash-looping, the engine is still loading, or the host is unreachable.",
            "Run `fleet status INVENTORY --limit {{ $labels.host }}`; on the host `systemctl status "
            "{{ $labels.unit }}` and `journalctl -u {{ $labels.unit }} -n 200`. A restart loop or an "
            "engine error: `fleet restart INVENTORY --limit {{ $labels.host }}`; a dead host: take it out of "
            "the load balancer and open a hardware ticket.",
        ),
        _alert(
            "VllmKvCacheHigh",
            f"{names.kv_cache_usage}{{{vsel}}} > {_num(th.kv_cache_usage)}",
            th.kv_cache_for,
            "ticket",
            f"KV cache of {where} above {th.kv_cache_usage:.0%}",
            f"{names.kv_cache_usage} has stayed above {_num(th.kv_cache_usage)} for {th.kv_cache_for}: "
            "the instance is at its concurrency limit, new requests queue and running ones get preempted.",
            "Compare with `fleet plan INVENTORY --observed`: if observed prompts/outputs are longer or "
            "concurrency higher than the inventory declares, update the workload and redeploy (shorter "
            "max-model-len, fp8 KV cache, more GPUs); otherwise shift traffic to less loaded instances.",
        ),
        _alert(
            "VllmRequestsWaiting",
            f"{names.waiting}{{{vsel}}} > {th.waiting_requests}",
            th.waiting_for,
            "ticket",
            f"{{{{ $value }}}} requests waiting on {where}",
            f"More than {th.waiting_requests} requests have been queued for {th.waiting_for}: "
            "clients see time-to-first-token grow by the queue time.",
            "Check KV-cache use and preemptions on the same instance; if both are high the instance is "
            "undersized for its traffic (re-plan with --observed); if KV is low, the limit is max-num-seqs "
            "or the engine is stuck (look at generation throughput and `fleet status`).",
        ),
        _alert(
            "VllmPreemptionsHigh",
            f"({by} (increase({names.preemptions}{{{vsel}}}[{th.preemption_window}])))"
            f" / ({by} (increase({names.request_success}{{{vsel}}}[{th.preemption_window}])))"
            f" > {_num(th.preemption_ratio)}",
            th.preemption_for,
            "ticket",
            f"Preemptions on {where} above {th.preemption_ratio:.0%} of requests",
            f"Over {th.preemption_window}, preemptions per finished request exceeded {_num(th.preemption_ratio)}: "
            "the KV cache cannot hold the running batch and vLLM recomputes evicted requests, wasting GPU time "
            "and adding latency. (+Inf: preempting while no request finishes.)",
            "The KV budget is too small for the real traffic: run `fleet plan INVENTORY --observed`, apply the "
            "suggested workload (max-model-len from the observed p95, lower target concurrency) or add GPUs.",
        ),
        _alert(
            "VllmE2eLatencyP99High",
            f"histogram_quantile(0.99, sum by (le, {BY}) (rate({names.bucket(names.e2e_latency)}{{{vsel}}}"
            f"[{th.latency_window}]))) > {_num(th.e2e_p99_seconds)}",
            th.latency_for,
            "ticket",
            f"p99 end-to-end latency of {where} above {_num(th.e2e_p99_seconds)}s",
            f"The 99th percentile of request latency over {th.latency_window} (from histogram buckets, so "
            f"resolved to the bucket bounds) is above {_num(th.e2e_p99_seconds)} s.",
            "Look at waiting requests and preemptions first (overload); then at output lengths (long "
            "generations are slow by nature: compare `fleet plan --observed`); then at GPU health "
            "(`fleet audit INVENTORY --limit {{ $labels.host }}`).",
        ),
        _alert(
            "VllmTtftP99High",
            f"histogram_quantile(0.99, sum by (le, {BY}) (rate({names.bucket(names.ttft)}{{{vsel}}}"
            f"[{th.latency_window}]))) > {_num(th.ttft_p99_seconds)}",
            th.latency_for,
            "ticket",
            f"p99 time to first token of {where} above {_num(th.ttft_p99_seconds)}s",
            f"The 99th percentile of time to first token over {th.latency_window} is above "
            f"{_num(th.ttft_p99_seconds)} s: requests queue or prefill is slow (long prompts).",
            "Check waiting requests (queueing) and observed prompt lengths; raise capacity or move traffic.",
        ),
        _alert(
            "FleetUnitRestartLoop",
            f'increase(node_systemd_service_restart_total{{job="{NODE_JOB}", {sel}, name=~"{UNIT_RE}"}}'
            f"[{th.restart_window}]) > {th.restarts}",
            "0s",
            "page",
            "{{ $labels.name }} on {{ $labels.host }} restarted {{ $value | humanize }} times",
            f"systemd restarted the vLLM unit more than {th.restarts} times within {th.restart_window} "
            "(node_exporter systemd collector, NRestarts): it starts, dies and is restarted.",
            "`journalctl -u {{ $labels.name }} -n 300` on the host: out of GPU memory (another process holds "
            "it: `nvidia-smi`), a flag the installed vLLM rejects, a model that does not fit, a failing GPU "
            "(`fleet audit`). Stop the loop with `systemctl stop {{ $labels.name }}` while you fix it.",
        ),
        _alert(
            "FleetGpuAuditFinding",
            f'{FINDING_METRIC}{{{sel}, severity="error"}} > 0',
            "0s",
            "ticket",
            "GPU audit finding on {{ $labels.host }}: {{ $labels.check }}",
            "The last `fleet audit` found a problem on this host's GPUs ({{ $labels.check }}, GPU "
            "{{ $labels.gpu }}): {{ $labels.message }}.",
            "Run `fleet audit INVENTORY --limit {{ $labels.host }}` for the details; a degraded link or a GPU "
            "with errors: drain the host (`fleet restart` with the host excluded from traffic) and open a "
            "hardware ticket; a driver mismatch: redeploy the pinned driver.",
        ),
        _alert(
            "FleetGpuQuarantined",
            f'fleet_gpu_quarantined{{job="{NODE_JOB}", {sel}}} == 1',
            "0s",
            "ticket",
            "GPU {{ $labels.gpu }} of {{ $labels.host }} is quarantined ({{ $labels.kind }} {{ $labels.xid }})",
            "fleet's GPU watcher recorded a critical event on this GPU ({{ $labels.kind }} {{ $labels.xid }}, "
            "NVIDIA's action: {{ $labels.action }}): deploys and rollouts plan the host around it.",
            "`fleet audit INVENTORY --limit {{ $labels.host }}` shows the event; follow NVIDIA's action for the XID "
            "(reset the GPU, reboot, or a hardware ticket), then lift the quarantine: "
            "`fleet gpu clear INVENTORY {{ $labels.host }} {{ $labels.gpu }} --why TEXT`.",
        ),
        _alert(
            "FleetGpuWatcherDown",
            f'fleet_gpu_watch_up{{job="{NODE_JOB}", {sel}}} == 0',
            "15m",
            "ticket",
            "the GPU watcher on {{ $labels.host }} has no NVML session",
            "fleet's GPU watcher has been re-initialising NVML for 15 minutes: the driver is not loaded or was "
            "replaced, so XID and ECC events of this host go unrecorded.",
            "`journalctl -u fleet-gpu-watch -n 100` and `nvidia-smi` on the host; a pending driver reboot: "
            "reboot through `fleet drain` / `fleet undrain`.",
        ),
    ]


def rules_file(groups: list[RuleGroup], inventory: str = "-") -> dict[str, Any]:
    """The whole rules file: ``{"groups": [...]}`` (pure)."""
    out = []
    for g in groups:
        names = names_for(g.version, g.hosts[0], inventory)
        rules = alert_rules(names, g.thresholds, g.hosts)
        for rule in rules:  # which thresholds raised it; also keeps the groups' alerts distinct for promtool
            rule["labels"]["fleet_rules"] = g.name
        out.append({"name": g.name, "rules": rules})
    return {"groups": out}
