"""``fleet deploy``'s load balancers: fleet's HAProxy configuration installed and reloaded on each.

For every balancer in front of a deployed host (``fleet.lb.config.fleet_configs`` over this
deploy's plans), after the hosts' instances are started and before they are put into traffic:

1. what HAProxy runs now (``show servers state``) is read and merged with the plans
   (``fleet.lb.config.reconfigure``): a server this deploy planned is written as planned (a new
   one ``disabled``: it joins only once its instance passes its checks, ``_join_balancers``); one
   of an inventory host this deploy did not plan (``--limit``, drained, no driver yet) is kept as
   HAProxy has it; any other is *retired*;
2. retired servers leave traffic first (``fleet.lb.traffic.retire``: ``drain``, their sessions end,
   bounded by ``drain_timeout_s``, then ``maint``), so a host removed from the inventory is no
   longer sent requests when the configuration that drops it is loaded;
3. the configuration is installed and HAProxy reloaded keeping runtime state: on a balancer host
   through pyinfra (``fleet.operations.balancer``: packages, drop-in, ``haproxy -c``, ``systemctl
   reload``), on this machine directly (``fleet.lb.local``);
4. the reload is awaited until HAProxy has every server of the new configuration.

A balancer that does not answer is configured from the plans alone only when this deploy plans
every host of the inventory (a first install); otherwise it is left alone and reported failed,
since a configuration written without knowing what it runs could drop hosts this deploy did not
see.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fleet.errors import FleetError
from fleet.facts.runner import SshTarget
from fleet.inventory.spec import LoadedInventory
from fleet.lb import local
from fleet.lb.config import (
    BalancerConfig,
    Reconfiguration,
    fleet_configs,
    reconfigure,
    render_config,
    systemd_dropin,
)
from fleet.lb.runtime import ServerState
from fleet.lb.traffic import Balancer, BalancerError, default_transport, retire
from fleet.plan.planner import HostPlan

#: How long the new configuration may take to be live after a reload.
LIVE_TIMEOUT_S = 30.0
#: (balancer host, configuration path, configuration, drop-in) -> (changed, operations done)
InstallRemote = Callable[[str, str, str, str], tuple[bool, list[str]]]


@dataclass
class BalancerResult:
    name: str  #: the balancer host, or "local" for this machine's
    status: str  #: "changed", "unchanged", "failed"
    operations: list[str] = field(default_factory=list)
    error: str | None = None
    note: str | None = None


def _every_host_planned(loaded: LoadedInventory, plans: Mapping[str, HostPlan]) -> bool:
    serving = {h.name for h in loaded.pyinfra if h.data.get("role") != "balancer"}
    return serving <= set(plans)


def _names(servers: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{b}/{s}" for b, s in servers)


def configure(
    loaded: LoadedInventory,
    plans: Mapping[str, HostPlan],
    install_remote: InstallRemote,
    drain_timeout_s: float,
    progress: Callable[[str], None] = lambda _m: None,
) -> list[BalancerResult]:
    """Every balancer in front of the planned hosts, configured (see the module docstring)."""
    inventory_hosts = {h.name for h in loaded.pyinfra}
    targets = {b.name: b for b in loaded.balancer_hosts}
    out = []
    for config in fleet_configs(loaded, plans):
        spec = config.spec
        name = "local" if spec.local else spec.on
        target = None
        if not spec.local:
            data = loaded.pyinfra.get_host(spec.on).data.dict()  # type: ignore[no-untyped-call]
            target = SshTarget.from_data(targets[spec.on].name, data)
        balancer = Balancer(spec, default_transport(spec, target))
        try:
            out.append(
                _one(loaded, plans, config, balancer, inventory_hosts, install_remote, drain_timeout_s, progress)
            )
        except (BalancerError, FleetError) as exc:
            out.append(BalancerResult(name, "failed", error=f"{spec.describe()}: {exc}"))
        finally:
            balancer.close()
    return out


def _one(
    loaded: LoadedInventory,
    plans: Mapping[str, HostPlan],
    config: BalancerConfig,
    balancer: Balancer,
    inventory_hosts: set[str],
    install_remote: InstallRemote,
    drain_timeout_s: float,
    progress: Callable[[str], None],
) -> BalancerResult:
    spec = config.spec
    name = "local" if spec.local else spec.on
    answering = True
    try:
        running: list[ServerState] = balancer.servers_state()
    except BalancerError as exc:
        if not _every_host_planned(loaded, plans):
            return BalancerResult(
                name, "failed",
                error=f"{spec.describe()} does not answer ({exc}), and this deploy does not plan every host behind it: "
                "not reconfigured (a configuration written blind could drop hosts); bring it back, or deploy the whole "
                "inventory",
            )  # fmt: skip
        answering, running = False, []
    plan: Reconfiguration = reconfigure(config, running, inventory_hosts)
    text = render_config(plan.config, loaded.path, written_by="fleet deploy")
    ops: list[str] = []
    note = None
    if plan.retired:
        progress(f"{name}: taking {_names(plan.retired)} out of traffic before the configuration drops them")
        busy = retire(balancer, plan.retired, drain_timeout_s, progress=progress)
        ops.append(f"out of traffic, then dropped: {_names(plan.retired)}")
        if busy:
            note = f"still busy after {drain_timeout_s:g}s when dropped: {'; '.join(busy)}"
    if spec.local:
        changed = local.write_config(plan.config, text)
        if changed and answering:
            local.reload(plan.config)
        elif changed:
            note = f"HAProxy does not run on this machine: start it with {spec.config} (haproxy -W -f {spec.config})"
        if changed:
            ops.append(f"configuration {spec.config} written" + (", HAProxy reloaded" if answering else ""))
    else:
        dropin = systemd_dropin(spec.admin_socket, plan.config.state_file, spec.config)
        changed, done = install_remote(spec.on, spec.config, text, dropin)
        ops += done
    if plan.added:
        ops.append(f"new servers, out of traffic until their instance serves: {_names(plan.added)}")
    if changed and (answering or not spec.local):
        missing = _await_servers(balancer, plan.config)
        if missing:
            raise BalancerError(f"the reloaded configuration is not live after {LIVE_TIMEOUT_S:g}s: no {missing}")
    return BalancerResult(name, "changed" if changed or plan.retired else "unchanged", ops, note=note)


def _await_servers(balancer: Balancer, config: BalancerConfig) -> str:
    """Until HAProxy has every server of ``config`` (after a reload); what it still lacks, if any."""
    want = set(config.servers)
    deadline = time.monotonic() + LIVE_TIMEOUT_S
    missing = want
    while time.monotonic() < deadline:
        try:
            have = {(st.backend, st.server) for st in balancer.servers_state()}
            missing = want - have
            if not missing:
                return ""
        except BalancerError:
            pass
        time.sleep(0.3)
    return _names(tuple(sorted(missing)))
