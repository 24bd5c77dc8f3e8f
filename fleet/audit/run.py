"""``fleet audit`` as a library: probe the hosts of an inventory (I/O), then judge (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleet.audit.acs import rule_pcie_acs
from fleet.audit.findings import Finding
from fleet.audit.fleet_rules import fleet_findings
from fleet.audit.multinode import NodeFacts, SpanningInstance, multi_node_findings, unplanned_finding
from fleet.audit.quarantine import rule_quarantine
from fleet.audit.report import AuditReport, HostAudit
from fleet.audit.rules import Expectation, audit_host, unreachable
from fleet.errors import FleetError
from fleet.facts.hostfacts import HostFacts
from fleet.facts.node_network import DEFAULT_CONNECT_TIMEOUT, NodeNet, NodeNetwork
from fleet.facts.nvml import NvmlProbe
from fleet.facts.pcie_acs import AcsFacts, PcieAcs
from fleet.facts.releases import ReleasesDict, VllmReleases
from fleet.facts.runner import HostUnreachable, Progress, run_fact_on_hosts, targets_from_inventory
from fleet.facts.units import DEFAULT_ROOT
from fleet.gpuwatch.state import GpuWatchState, WatchState
from fleet.inventory.multinode import pool_name, pools
from fleet.inventory.spec import HostSpec, LoadedInventory
from fleet.plan.outcomes import FleetPlan, build_fleet_plan


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
    spanning: MultiNode | None = None,
) -> AuditReport:
    """The report for probed hosts: host rules (and the PCIe ACS rule where ``acs`` was read),
    then fleet rules over each group, then the multi-node rules over ``spanning``'s instances
    (``fleet.audit.multinode``). Pure."""
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
    found_fleet = fleet_findings(facts, groups)
    if spanning is not None:
        nodes = {
            h: NodeFacts(results.get(h), spanning.releases.get(h), spanning.net.get(h))
            for inst in spanning.instances
            for h in inst.nodes
        }
        found_fleet += spanning.unplanned + multi_node_findings(spanning.instances, nodes)
    return AuditReport(loaded.path, hosts, found_fleet, seconds)


class MultiNode:
    """The fleet plan's instances spanning hosts and what was read on their nodes for the audit."""

    def __init__(
        self,
        instances: Sequence[SpanningInstance],
        unplanned: Sequence[Finding] = (),
        releases: Mapping[str, ReleasesDict | HostUnreachable] | None = None,
        net: Mapping[str, NodeNet | HostUnreachable] | None = None,
    ) -> None:
        self.instances = list(instances)
        self.unplanned = list(unplanned)
        self.releases = dict(releases or {})
        self.net = dict(net or {})


def spanning_instances(plan: FleetPlan) -> list[SpanningInstance]:
    """The plan's instances spanning hosts, as the multi-node rules check them (pure)."""
    out = []
    for i in plan.instances():
        node = i.spec.node
        if len(i.placements) < 2 or node is None:
            continue
        address, _, port = node.master.rpartition(":")
        hosts = tuple(p.host for p in sorted(i.placements, key=lambda p: p.node_rank))
        out.append(SpanningInstance(f"{i.host}/{i.name}", hosts, address.strip("[]"), int(port)))
    return out


def plan_multi_node(
    loaded: LoadedInventory, results: Mapping[str, HostFacts | HostUnreachable]
) -> tuple[list[SpanningInstance], list[Finding]]:
    """The fleet plan's instances spanning hosts, and a finding per ``multi_node`` group that forms
    none although its model fits none of its hosts alone (pure given the model configs).

    The plan is ``build_fleet_plan``'s from the probed GPUs; a group it cannot plan that way (its
    hosts' GPUs differ: what the audit is here to say) is taken from the inventory's own ``gpu``
    data, the instances the inventory means. Without a ``multi_node`` group: nothing is planned.
    """
    groups = pools(loaded.hosts)
    if not groups:
        return [], []
    plans = []
    for probes in (results, None):
        try:
            plans.append(build_fleet_plan(loaded, probes))
        except FleetError:
            continue
    instances: list[SpanningInstance] = []
    covered: set[str] = set()
    for plan in plans:
        for inst in spanning_instances(plan):
            if not covered.intersection(inst.nodes):
                instances.append(inst)
                covered.update(inst.nodes)
    unplanned = []
    for names, members in groups.items():
        if covered.intersection(m.name for m in members) or not plans:
            continue
        first = plans[0].host(members[0].name)
        if first.plan is None and first.problem is not None and len(members) > 1:
            unplanned.append(unplanned_finding(first.spec.name, pool_name(names), first.problem.summary))
    return instances, unplanned


def probe_multi_node(
    loaded: LoadedInventory,
    instances: Sequence[SpanningInstance],
    timeout: float = 60.0,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    root: str = DEFAULT_ROOT,
) -> tuple[dict[str, ReleasesDict | HostUnreachable], dict[str, NodeNet | HostUnreachable]]:
    """On every node of ``instances`` at once (read-only, no root): the installed releases, and the
    network towards its leader (workers also connect to the leader's rendezvous port)."""
    towards: dict[str, tuple[str, int]] = {}
    for inst in instances:
        for rank, host in enumerate(inst.nodes):
            towards[host] = (inst.master_address, inst.master_port if rank > 0 else 0)
    if not towards:
        return {}, {}
    targets = targets_from_inventory(loaded.pyinfra, list(towards))
    with ThreadPoolExecutor(max_workers=2) as pool:
        releases = pool.submit(run_fact_on_hosts, targets, VllmReleases, timeout=timeout, root=root)
        net = pool.submit(
            run_fact_on_hosts, targets, NodeNetwork, timeout=timeout,
            args_for=lambda h: {"address": towards[h][0], "port": towards[h][1], "timeout": connect_timeout},
        )  # fmt: skip
        return releases.result(), net.result()


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
