"""``fleet audit`` as a library: probe the hosts of an inventory (I/O), then judge (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleet.audit.acs import rule_pcie_acs
from fleet.audit.fleet_rules import fleet_findings
from fleet.audit.quarantine import rule_quarantine
from fleet.audit.report import AuditReport, HostAudit
from fleet.audit.rules import Expectation, audit_host, unreachable
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.facts.pcie_acs import AcsFacts, PcieAcs
from fleet.facts.runner import HostUnreachable, Progress, run_fact_on_hosts, targets_from_inventory
from fleet.gpuwatch.state import GpuWatchState, WatchState
from fleet.inventory.spec import HostSpec, LoadedInventory


def expectation(spec: HostSpec) -> Expectation:
    """What the inventory says the host should have."""
    gpu = spec.gpu
    return Expectation(
        gpu_count=gpu.count if gpu is not None else None,
        sku=gpu.sku if gpu is not None else None,
        vllm_version=spec.vllm_version,
    )


def judge(
    loaded: LoadedInventory,
    results: Mapping[str, HostFacts | HostUnreachable],
    seconds: float = 0.0,
    acs: Mapping[str, AcsFacts | HostUnreachable] | None = None,
    watch: Mapping[str, WatchState | HostUnreachable] | None = None,
) -> AuditReport:
    """The report for probed hosts: host rules (and the PCIe ACS rule where ``acs`` was read),
    then fleet rules over each group. Pure."""
    hosts = []
    facts: dict[str, HostFacts] = {}
    groups: dict[str, list[str]] = {}
    for spec in loaded.hosts:
        result = results.get(spec.name)
        for group in spec.groups:
            groups.setdefault(group, []).append(spec.name)
        if isinstance(result, HostFacts):
            facts[spec.name] = result
            found = audit_host(spec.name, result, expectation(spec))
            host_acs = (acs or {}).get(spec.name)
            if isinstance(host_acs, AcsFacts):
                found += rule_pcie_acs(spec.name, result, host_acs)
            host_watch = (watch or {}).get(spec.name)
            found += rule_quarantine(spec.name, host_watch if isinstance(host_watch, WatchState) else None)
            hosts.append(HostAudit(spec.name, result, None, found))
        else:
            reason = result.reason if result is not None else "not probed"
            hosts.append(HostAudit(spec.name, None, reason, [unreachable(spec.name, reason)]))
    return AuditReport(loaded.path, hosts, fleet_findings(facts, groups), seconds)


def probe(
    loaded: LoadedInventory, progress: Progress | None = None, python: str | None = None, timeout: float = 60.0
) -> dict[str, HostFacts | HostUnreachable]:
    """Run the NVML probe on every host of the inventory at once."""
    targets = targets_from_inventory(loaded.pyinfra, [h.name for h in loaded.hosts])
    args: dict[str, Any] = {"python": python} if python else {}
    return run_fact_on_hosts(targets, NvmlProbe, timeout=timeout, progress=progress, **args)


def probe_acs(
    loaded: LoadedInventory, timeout: float = 60.0, progress: Progress | None = None
) -> dict[str, AcsFacts | HostUnreachable]:
    """Read the ACS control of the PCIe bridges above every host's GPUs (as root; read-only)."""
    targets = targets_from_inventory(loaded.pyinfra, [h.name for h in loaded.hosts])
    return run_fact_on_hosts(targets, PcieAcs, timeout=timeout, progress=progress)


def probe_watch(
    loaded: LoadedInventory, timeout: float = 60.0, progress: Progress | None = None
) -> dict[str, WatchState | HostUnreachable]:
    """Read every host's GPU watcher record (as root; read-only): quarantined GPUs."""
    targets = targets_from_inventory(loaded.pyinfra, [h.name for h in loaded.hosts])
    return run_fact_on_hosts(targets, GpuWatchState, timeout=timeout, progress=progress)
