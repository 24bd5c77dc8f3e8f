"""A serving fleet as the rollout engine sees it, read from an inventory: its instances (one per
systemd unit ``fleet deploy`` installed), how to reach each host, the API keys and the policy.

The instances come from the fleet plan (``fleet.plan.outcomes.build_fleet_plan``, planned as
``fleet deploy`` plans them): a host without a ``gpu`` entry in the inventory is probed first
(the NVML probe over SSH, one round trip per host, all hosts at once; read-only), and in the same
round every host's GPU watcher record is read (``fleet.gpuwatch.state.GpuWatchState``): a
quarantined GPU is planned around as ``fleet deploy`` does; a host whose record cannot be read
is planned as before and named in ``RolloutFleet.unread_quarantine``.

Everything else is checked here, before any host is touched: a bad inventory, a bad ``rollout``
setting, an unreadable API key reference or an unknown ``--limit`` is a ``FleetError`` naming
the file, host and field.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.audit.findings import Finding
from fleet.audit.gate import ROLLOUT, GateVerdict, gate
from fleet.audit.run import judge
from fleet.errors import FleetError
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.facts.runner import HostUnreachable, SshTarget, run_fact_on_hosts
from fleet.gpuwatch.state import GpuWatchState, WatchState, quarantine_and_unread
from fleet.inventory.spec import HostSpec, LoadedInventory
from fleet.lb.traffic import Traffic, traffic_of
from fleet.operations.vllm import DEFAULT_ROOT
from fleet.plan.outcomes import build_fleet_plan, load_for_planning
from fleet.render.part import api_key
from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import Target
from fleet.rollout.executor import ExecutorError
from fleet.rollout.policy import RolloutPolicy, policy_from_hosts
from fleet.rollout.ssh_executor import Connections, InstanceSpec, SshExecutor, connections, read_fact


@dataclass(frozen=True)
class RolloutFleet:
    name: str  #: the lock's key: the inventory's absolute path (one rollout per fleet)
    inventory: str
    hosts: tuple[str, ...]  #: selected hosts, inventory order
    ssh: Mapping[str, SshTarget]
    instances: Mapping[InstanceRef, InstanceSpec]  #: inventory order, hosts then instances
    host_data: Mapping[str, Mapping[str, Any]]
    api_keys: Mapping[str, str | None]
    loaded: LoadedInventory | None = None  #: for the load balancers in front of the instances
    #: host -> GPU index -> why: the GPUs the watcher quarantined, planned around
    quarantined: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    #: host -> why its watcher record could not be read (planned without a quarantine)
    unread_quarantine: Mapping[str, str] = field(default_factory=dict)
    #: the audit's host findings from the same round of facts (``fleet.audit.run.judge``): the gate
    findings: tuple[Finding, ...] = ()
    #: the connections the read round opened (``keep_connections``), handed to the first executor
    conns: Connections = field(default_factory=dict, repr=False, compare=False)

    def gate(self, ignored: Collection[str] = ()) -> GateVerdict:
        """The audit's verdict on rolling this fleet (``fleet.audit.gate``): critical findings and
        quarantined GPUs an instance is planned on refuse their hosts unless ``ignored``."""
        planned: dict[str, set[int]] = {h: set() for h in self.hosts}
        for ref, spec in self.instances.items():
            planned.setdefault(ref.host, set()).update(spec.gpus)
        return gate(self.findings, ROLLOUT, ignored, planned)

    def traffic(self) -> Traffic:
        """The balancer seat of every instance whose host has a ``balancer`` entry."""
        if self.loaded is None:
            return Traffic({})
        served = {(r.host, r.instance): s.model for r, s in self.instances.items()}
        return traffic_of(self.loaded, list(served), served=served)

    def policy(self, overrides: Mapping[str, Any] | None = None) -> RolloutPolicy:
        return policy_from_hosts(self.inventory, self.host_data, overrides)

    def executor(
        self, gates_over_ssh: Sequence[str] = (), http_timeout_s: float = 10.0, *, lb: bool = True
    ) -> SshExecutor:
        """The SSH executor; with ``lb`` (default) it steers the instances' load balancers too."""
        unknown = sorted(set(gates_over_ssh) - set(self.hosts))
        if unknown:
            raise FleetError(f"--gates-over-ssh {', '.join(unknown)}: not a selected host of {self.inventory}")
        kept = dict(self.conns)  # the read round's connections: this executor's now (it closes them)
        self.conns.clear()
        return SshExecutor(
            self.ssh, self.instances, api_keys=self.api_keys, gates_over_ssh=gates_over_ssh,
            http_timeout_s=http_timeout_s, traffic=self.traffic() if lb else None, conns=kept,
        )  # fmt: skip

    def close(self) -> None:
        """Close the read round's connections no executor took (a command that stops before it rolls)."""
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    def targets(self, releases: Mapping[str, str | None], *, restart: bool, skip: Collection[str] = ()) -> list[Target]:
        """Every instance heading for its host's entry in ``releases`` (a host without one is
        refused), except those of the hosts in ``skip`` (drained: ``SshExecutor.skipped``)."""
        missing = [h for h in self.hosts if not releases.get(h) and h not in skip]
        if missing:
            raise FleetError(
                f"no vLLM release is active on {', '.join(missing)} (no {DEFAULT_ROOT}/current "
                "link): run `fleet deploy` on it first"
            )
        return [
            Target(ref, str(releases[ref.host]), s.model, s.port, restart=restart)
            for ref, s in self.instances.items()
            if ref.host not in skip
        ]

    def instance_targets(
        self, releases: Mapping[InstanceRef, str | None], *, restart: bool, skip: Collection[str] = ()
    ) -> list[Target]:
        """Every instance heading for its own entry in ``releases`` (an instance without one is
        refused), except those of the hosts in ``skip`` (drained: ``SshExecutor.skipped``)."""
        missing = [str(ref) for ref in self.instances if not releases.get(ref) and ref.host not in skip]
        if missing:
            raise FleetError(
                f"no vLLM release runs or is active for {', '.join(missing)} (no {DEFAULT_ROOT}/current "
                "link): run `fleet deploy` on its host first"
            )
        return [
            Target(ref, str(releases[ref]), s.model, s.port, restart=restart)
            for ref, s in self.instances.items()
            if ref.host not in skip
        ]


def _probe(
    specs: Sequence[HostSpec],
    ssh: Mapping[str, SshTarget],
    answers: Mapping[str, HostFacts | HostUnreachable] | None = None,
) -> dict[str, HostFacts | HostUnreachable]:
    """The NVML probe of every host (``answers``: read already): what the audit's gate judges,
    and what plans the hosts the inventory gives no ``gpu`` entry.

    Such a host that cannot be reached at all is an ``ExecutorError`` naming it (a host that
    failed, not bad input): its instances cannot be planned, so nothing is touched."""
    answers = dict(answers) if answers is not None else run_fact_on_hosts([ssh[s.name] for s in specs], NvmlProbe)
    unplanned = {s.name for s in specs if s.gpu is None}
    down = [a for n, a in answers.items() if n in unplanned and isinstance(a, HostUnreachable) and a.ssh_failed]
    if down:
        raise ExecutorError(
            "; ".join(f"host {a.host}: SSH failed: {a.reason}" for a in down)
            + ": its GPUs cannot be probed to plan its instances (bring it back, give it a gpu entry, or leave it "
            "out with --limit)"
        )
    return answers


#: What one round of reads gives: each host's NVML probe and its GPU watcher record.
Facts = tuple[Mapping[str, HostFacts | HostUnreachable], Mapping[str, WatchState | HostUnreachable]]


def read_facts(specs: Sequence[HostSpec], ssh: Mapping[str, SshTarget], conns: Connections | None = None) -> Facts:
    """One round, both facts at once: every host's NVML probe and GPU watcher record (read-only).
    ``conns``: over these connections (one per host, kept for the rollout's executor), the two
    reads one after the other on each; else each fact on a connection of its own per host."""
    if conns is not None:
        names = [s.name for s in specs]
        with ThreadPoolExecutor(2) as pool:
            probing = pool.submit(read_fact, conns, names, NvmlProbe)
            watching = pool.submit(read_fact, conns, names, GpuWatchState)
            return _probe(specs, ssh, probing.result()), watching.result()
    with ThreadPoolExecutor(2) as pool:
        watching = pool.submit(run_fact_on_hosts, [ssh[s.name] for s in specs], GpuWatchState)
        probing = pool.submit(_probe, specs, ssh)
        return probing.result(), watching.result()


def load_fleet(
    inventory: str,
    limit: Sequence[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    refuse_unreachable: bool = False,
    keep_connections: bool = False,
) -> RolloutFleet:
    """The fleet of ``inventory`` (only ``limit`` hosts or groups, when given; ``overrides``: host
    data given on the command line). ``refuse_unreachable``, ``keep_connections``: see :func:`fleet_of`."""
    loaded = load_for_planning(inventory, list(limit) if limit else None, overrides)
    if not loaded.hosts:
        raise FleetError(f"{inventory}: no host selected" + (f" by --limit {' '.join(limit)}" if limit else ""))
    return fleet_of(loaded, refuse_unreachable=refuse_unreachable, keep_connections=keep_connections)


def unreachable_refusal(answers: Mapping[str, HostFacts | HostUnreachable]) -> str | None:
    """Why a restart, rollout or rollback cannot start: the hosts SSH could not reach in the read
    round (each named with SSH's reason), or None when every host answered."""
    down = [a for a in answers.values() if isinstance(a, HostUnreachable) and a.ssh_failed]
    return "; ".join(f"host {a.host}: SSH failed: {a.reason}" for a in down) or None


def fleet_of(
    loaded: LoadedInventory,
    read: Callable[[Sequence[HostSpec], Mapping[str, SshTarget]], Facts] | None = None,
    *,
    refuse_unreachable: bool = False,
    keep_connections: bool = False,
) -> RolloutFleet:
    """The rollout's view of a loaded inventory (its selected hosts); ``read``: the facts' round
    (default :func:`read_facts`). ``refuse_unreachable``: a host SSH cannot reach in that round is an
    ``ExecutorError`` naming it, decided then (one connect timeout), not by every later connection
    (a restart, rollout or rollback would refuse it anyway before changing anything; ``fleet drain``
    and ``fleet lb`` go on without it). ``keep_connections``: the round reads over one connection
    per host that stays open for the fleet's first executor (``RolloutFleet.executor``), so a
    restart logs into each host once (``benchmarks/ssh_rounds.py``); closed here if this raises."""
    problems: list[str] = []
    ssh: dict[str, SshTarget] = {}
    datas: dict[str, Mapping[str, Any]] = {}
    keys: dict[str, str | None] = {}
    for spec in loaded.hosts:
        data = loaded.pyinfra.get_host(spec.name).data.dict()  # type: ignore[no-untyped-call]
        datas[spec.name] = data
        try:
            ssh[spec.name] = SshTarget.from_data(spec.name, data)
            keys[spec.name] = api_key(spec)  # as ``fleet deploy`` renders it
        except FleetError as exc:
            problems.append(str(exc))
    if problems:
        raise FleetError("\n".join(problems))
    conns = connections(ssh) if keep_connections else {}
    try:
        return _fleet_of(loaded, read, refuse_unreachable, ssh, datas, keys, conns)
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise


def _fleet_of(
    loaded: LoadedInventory,
    read: Callable[[Sequence[HostSpec], Mapping[str, SshTarget]], Facts] | None,
    refuse_unreachable: bool,
    ssh: Mapping[str, SshTarget],
    datas: Mapping[str, Mapping[str, Any]],
    keys: Mapping[str, str | None],
    conns: Connections,
) -> RolloutFleet:
    inventory = loaded.path
    problems: list[str] = []
    instances: dict[InstanceRef, InstanceSpec] = {}
    if read is None and conns:
        answers, watch = read_facts(loaded.hosts, ssh, conns=conns)
    else:
        answers, watch = (read or read_facts)(loaded.hosts, ssh)
    if refuse_unreachable and (why := unreachable_refusal(answers)) is not None:
        raise ExecutorError(why)
    held, unread = quarantine_and_unread(watch, [s.name for s in loaded.hosts])
    probes = {
        s.name: a if isinstance(a, HostFacts) else a.reason
        for s in loaded.hosts
        if s.gpu is None and (a := answers.get(s.name)) is not None
    }
    fleet_plan = build_fleet_plan(loaded, probes, deploy=True, quarantine=held)  # planned as `fleet deploy` plans
    problems += fleet_plan.refusals()
    if (why := fleet_plan.multi_node_refusal("fleet rollout/restart/rollback")) is not None:
        raise FleetError(why)
    lora = {s.name: tuple(a.name for a in s.lora.adapters) if s.lora else () for s in loaded.hosts}
    for planned in fleet_plan.instances():
        ref = InstanceRef(planned.host, planned.name)
        gpus = planned.placements[0].gpus  # one node per instance today
        instances[ref] = InstanceSpec(
            ref, planned.unit, planned.url, planned.port, gpus, planned.served_name, adapters=lora.get(planned.host, ())
        )
    if problems:
        raise FleetError("\n".join(problems))
    return RolloutFleet(
        str(Path(inventory).resolve()), inventory, tuple(s.name for s in loaded.hosts), ssh, instances, datas, keys,
        loaded, held, unread, tuple(f for h in judge(loaded, answers, watch=watch).hosts for f in h.findings),
        conns,
    )  # fmt: skip
