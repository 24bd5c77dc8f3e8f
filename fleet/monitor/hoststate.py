"""The SSH side of ``fleet status``: systemd units, the installed release and NVML, per instance.

:func:`read_hosts` runs :class:`fleet.facts.hoststatus.HostStatusProbe` on every host at once
(one SSH round trip each, strict host keys); :func:`unit_facts` turns the answers into one
:class:`fleet.monitor.status.UnitFacts` per planned instance (pure, table-tested). A host that
cannot be reached gives every instance on it a ``state="unreachable"`` with the reason.

GPU memory in use by an instance is the sum of NVML's per-process ``usedGpuMemory``
(``nvmlDeviceGetComputeRunningProcesses``) over the instance's GPUs, counting only processes in
that instance's systemd unit when the probe could read the process's cgroup (so another
process on the same GPU is not charged to it).

The same command lists the units' Hugging Face cache (``fleet.facts.hub``, the listing ``fleet
prune`` reads): :func:`host_models` gives each host's models (id, bytes, snapshot, being staged)
or why the listing could not be read.

Beside them, each host's drain marker (``fleet.facts.drain``) and its GPU watcher record
(``fleet.gpuwatch.state``: quarantined GPUs), one more round trip per host each, at the same
time, and each instance's server on its load balancer (``fleet.lb.traffic``: one read per
balancer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from fleet.facts.drain import read_markers
from fleet.facts.hostfacts import HostFacts
from fleet.facts.hoststatus import HostStatus, HostStatusProbe
from fleet.facts.hub import hub_dir
from fleet.facts.runner import HostUnreachable, SshTarget, run_fact_on_hosts
from fleet.facts.units import UnitsDict
from fleet.gpuwatch.state import GpuWatchState, WatchState
from fleet.lb.runtime import ServerView
from fleet.lb.traffic import BalancerError, Traffic
from fleet.monitor.scrape import Scrape
from fleet.monitor.status import (
    HeldModel,
    HostModels,
    InstanceStatus,
    UnitFacts,
    attach_host_state,
    attach_units,
    collect,
)
from fleet.monitor.targets import Target
from fleet.monitor.thresholds import Thresholds

HostAnswer = HostStatus | HostUnreachable


def gpu_memory_of(target: Target, gpus: HostFacts | None) -> int | None:
    """Bytes the instance's processes hold on its GPUs (pure); ``None`` when NVML could not say."""
    if gpus is None:
        return None
    wanted = set(target.gpus)
    total = 0
    seen = False
    for gpu in gpus.gpus:
        if wanted and gpu.index not in wanted:
            continue
        if gpu.processes is None:
            continue
        seen = True
        for proc in gpu.processes:
            if proc.unit is not None and proc.unit != target.unit:
                continue
            if not wanted and proc.unit is None:
                continue
            total += proc.used_memory or 0
    return total if seen else None


def _state(info: Mapping[str, Any] | None) -> str:
    if info is None:
        return "not installed"
    if info.get("load_state") == "not-found":
        return "not installed"
    return f"{info.get('active_state') or '?'}/{info.get('sub_state') or '?'}"


def _venv(units: UnitsDict, release: str | None, root: str) -> str | None:
    """The release directory the instance runs (``current``'s target, spelled as the link is, when
    that is the release it runs)."""
    if release is None:
        return None
    link = units["current"]
    if link and units["release"] == release:
        return link if link.startswith("/") else f"{root.rstrip('/')}/{link}"
    return f"{root.rstrip('/')}/releases/{release}"


def unit_facts(
    targets: Iterable[Target], answers: Mapping[str, HostAnswer], root: str = "/opt/fleet/vllm"
) -> dict[str, UnitFacts]:
    """One ``UnitFacts`` per instance (by ``Target.instance``) from each host's answer (pure); for
    an instance spanning hosts also one per node (by ``Target.node_instance(host)``)."""
    out: dict[str, UnitFacts] = {}
    for target in targets:
        for host in target.node_hosts:
            _node_facts(replace(target, host=host, nodes=()), answers, root, out)
    return out


def _node_facts(t: Target, answers: Mapping[str, HostAnswer], root: str, out: dict[str, UnitFacts]) -> None:
    """One node's ``UnitFacts`` into ``out`` (by its ``Target.instance``)."""
    answer = answers.get(t.host)
    if answer is None:
        return
    if isinstance(answer, HostUnreachable):
        out[t.instance] = UnitFacts("unreachable", None, None, None, None, detail=answer.reason)
        return
    units = answer.units
    info = units["units"].get(t.unit)
    state = _state(info)
    release = info["release"] if info else units["release"]  # what it runs; not installed: current
    out[t.instance] = UnitFacts(
        state=state,
        uptime_seconds=info["uptime_seconds"] if info else None,
        restarts=info["restarts"] if info else None,
        venv=_venv(units, release, root),
        gpu_memory_used=gpu_memory_of(t, answer.gpus),
        release=release,
        vllm_version=info["vllm_version"] if info else units["vllm_version"],
        main_pid=info["main_pid"] if info else None,
        detail=answer.gpu_error or "",
    )


def ssh_targets(inventory: Any, targets: Iterable[Target]) -> list[SshTarget]:
    """The SSH targets of the hosts that have planned instances (every node of one spanning hosts),
    from the pyinfra inventory."""
    from fleet.facts.runner import targets_from_inventory

    return targets_from_inventory(inventory, {h for t in targets for h in t.node_hosts})


def read_hosts(
    hosts: list[SshTarget], timeout: float = 20.0, root: str = "/opt/fleet/vllm", hub: str | None = None
) -> dict[str, HostAnswer]:
    """Run the status probe on every host in parallel: host name -> answer (never raises).
    ``hub``: also list that cache (the units' by default: ``fleet.facts.hub.hub_dir``)."""
    return run_fact_on_hosts(hosts, HostStatusProbe, timeout=timeout, root=root, hub=hub or hub_dir())


def host_models(answers: Mapping[str, HostAnswer]) -> dict[str, HostModels]:
    """Each host's models from its answer, by host, in the answers' host order (pure)."""
    out = {}
    for host, answer in answers.items():
        if isinstance(answer, HostUnreachable):
            out[host] = HostModels(host, error=f"host unreachable over SSH: {answer.reason}")
        elif answer.models is None:
            out[host] = HostModels(host, error=answer.models_error or "the model cache was not listed")
        else:
            held = (HeldModel(r.model, r.bytes, r.snapshot, r.staging) for r in answer.models.repos)
            out[host] = HostModels(host, tuple(sorted(held, key=lambda m: m.model)))
    return out


def balancer_views(traffic: Traffic, targets: Iterable[Target]) -> dict[str, ServerView | str]:
    """What each instance's load balancer says about it (by ``host/vllm-N``), or why it could not
    be asked; one read per balancer (``Balancer.snapshot``). Never raises."""
    out: dict[str, ServerView | str] = {}
    for t in targets:
        try:
            view = traffic.view(t.host, f"vllm-{t.index}")
        except BalancerError as exc:
            out[t.instance] = str(exc)
            continue
        if view is not None:
            out[t.instance] = view
    return out


def observe(
    targets: list[Target],
    hosts: list[SshTarget],
    thresholds: Mapping[str, Thresholds] | None = None,
    interval: float = 2.0,
    timeout: float = 3.0,
    previous: Mapping[str, Scrape] | None = None,
    ssh_timeout: float = 20.0,
    traffic: Traffic | None = None,
) -> tuple[list[InstanceStatus], dict[str, Scrape], dict[str, HostModels]]:
    """``collect`` over HTTP, :func:`read_hosts` and the hosts' drain markers over SSH and the
    balancers' views (``traffic``), all at the same time, merged into rows; with them each
    latest scrape (by instance) and each host's models (:func:`host_models`; empty without SSH)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        ssh = pool.submit(read_hosts, hosts, ssh_timeout) if hosts else None
        marks = pool.submit(read_markers, hosts) if hosts else None
        records = pool.submit(run_fact_on_hosts, hosts, GpuWatchState, timeout=ssh_timeout) if hosts else None
        views = pool.submit(balancer_views, traffic, targets) if traffic else None
        rows, latest = collect(targets, thresholds, interval, timeout, previous=previous)
        answers = ssh.result() if ssh is not None else {}
        drained = marks.result() if marks is not None else {}
        watch = {
            h: w for h, w in (records.result() if records is not None else {}).items() if isinstance(w, WatchState)
        }
        lb = views.result() if views is not None else {}
    if ssh is not None:
        rows = attach_units(rows, unit_facts(targets, answers), thresholds)
    if drained or lb or watch:
        rows = attach_host_state(rows, drained, lb, thresholds, watch)
    return rows, latest, host_models({h.name: answers[h.name] for h in hosts if h.name in answers})
