"""Run the deploy of ``fleet.operations.host`` on an inventory through pyinfra's API.

Order: validate every selected host's data and plan (errors for all hosts at once, before any
host is touched); connect (strict host keys, as the inventory says); skip the hosts drained for
maintenance (``fleet drain``'s marker on the host, ``fleet.facts.drain``: reported ``skipped``,
which is no failure); probe the GPUs of each host not drained (the ``NvmlProbe`` fact, once per
host, in the same command as the marker: ``fleet.facts.drain.UnlessDrained``) and plan it from
what it has (``fleet.plan.gpu_source``: an inventory ``gpu`` entry the probe contradicts refuses
the host before anything is written; a host whose NVML does not answer yet and has no entry
waits: its units are rendered once the driver answers, later in the same run when this run's
release or reboot brings it, else by the next deploy); prepare the operations
(pyinfra runs each generator up to its first command: that is ``--dry``'s answer, per host and
operation); execute in pyinfra's lock-step mode; stage each host's model where the inventory names
a ``model_source`` (``fleet.deploy.staging``: copied, verified against the source's manifest,
before anything restarts; the manifest is read before any host is touched); preflight every host that is ready
(``fleet.deploy.preflight``: the host's vLLM parses the new argv, the model resolves, the GPUs are
free or ours); start units that are not running (first deploy) and wait, from this machine, until
each instance serves (``fleet.deploy.health``). A host that needs a reboot is reported and not
started.

On hosts that are already serving, the operations never touch what a running unit uses: the new
release is built beside the current one, each instance's new unit and env file are stored as a
configuration revision (``fleet.operations.revisions``). Those instances are then handed to the
rolling engine (``fleet.rollout``): batches with a canary, drain, stop, GPUs free, switch, start,
health gates, soak, and a rollback of the failed batch, journaled like any ``fleet rollout``.

Which running instances the engine takes is decided per instance, by the release its own process
runs (``fleet.facts.releases``), never by the host's ``current`` link. After starting and
rolling, every host where something changed is read again: an instance not on the inventory's
release and configuration fails its host, named (``fleet.deploy.converge``). On a first run, units
are written only once the host is probed again after this run's release, driver or reboot, and
enabled only when planned from the probe: the reboot starts nothing, and instances that never
served are started, not rolled.

Failures (unreachable, a failing operation, a preflight refusal) name the host, the cause and the
failed command (redacted). ``fail_percent`` (like Ansible's ``max_fail_percentage``; default 0):
once more than that share of the selected hosts failed, nothing more is scheduled: no further
operations, no start, no rollout.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import paramiko
from pyinfra.api.command import StringCommand
from pyinfra.api.config import Config
from pyinfra.api.connect import disconnect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.facts import FactBase
from pyinfra.api.host import Host
from pyinfra.api.operations import run_ops
from pyinfra.api.state import State
from pyinfra.context import ctx_host, ctx_state

from fleet.audit.findings import Finding
from fleet.audit.gate import DEPLOY, GateVerdict, gate
from fleet.audit.quarantine import rule_quarantine
from fleet.audit.rules import audit_host
from fleet.audit.run import expectation
from fleet.deploy import factcache, multinode, prefetch, sshwatch, staging
from fleet.deploy.converge import drift
from fleet.deploy.health import HEALTH_TIMEOUT_S, Endpoint, wait_healthy
from fleet.deploy.preflight import run_preflight
from fleet.deploy.reboot import reboot as reboot_host
from fleet.errors import FleetError, ModelConfigError
from fleet.escape import ssh_command
from fleet.facts.batch import NO_ANSWER, BatchAnswer, FactRequest, answer_of
from fleet.facts.drain import DrainMarker, MarkerOrBatch, UnlessDrained
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.facts.packages import RebootRequired
from fleet.facts.revisions import InstanceRevisionsAsRoot
from fleet.facts.runner import DEFAULT_TIMEOUT, HostUnreachable, SshTarget, run_command, run_fact_on_hosts
from fleet.facts.unit_states import UnitState, UnitStates
from fleet.gpuwatch.state import GpuWatchState, WatchState, quarantine_of
from fleet.inventory.spec import LoadedInventory
from fleet.lb.traffic import BalancerError, Traffic, put_back, take_out, traffic_of
from fleet.operations import host as host_deploy
from fleet.operations import vllm as vllm_ops
from fleet.plan.gpu_source import GpusNotKnownYet
from fleet.plan.models import served_names
from fleet.plan.outcomes import build_fleet_plan, load_for_planning
from fleet.plan.planner import HostPlan
from fleet.render.part import HostPart, api_key, host_part
from fleet.render.units import HostPaths
from fleet.secrets import redact
from fleet.weights.stage import describe as describe_staging

if TYPE_CHECKING:  # the rolling engine is imported where a deploy rolls (_roll): a no-change run never does
    from fleet.rollout.engine import RolloutState, Target
    from fleet.rollout.fleet_inventory import RolloutFleet
    from fleet.rollout.ssh_executor import SshExecutor

Progress = Callable[[str], None]
#: runs the rollout of the serving hosts: the fleet, and its targets (the CLI adds its live view)
Roll = Callable[["RolloutFleet", Callable[["SshExecutor"], "list[Target]"]], "RolloutState"]
Step = Callable[[str, str], None]  #: (host, the step it is on)
FAILED = ("failed", "unreachable", "refused")


@dataclass
class HostResult:
    host: str
    #: "changed", "unchanged", "would change", "no change", "failed", "unreachable", "refused"
    #: (preflight, or GPUs that differ from the inventory's), "stopped" (not finished: the deploy
    #: stopped at the fail-percent), "waiting" (installed, but NVML does not answer yet: its units
    #: are rendered by a deploy after the driver loads), "skipped" (drained for maintenance,
    #: ``fleet drain``: nothing is done to it, and it is no failure)
    status: str
    operations: list[str] = field(default_factory=list)  #: changed (or, dry, would change)
    error: str | None = None
    reboot_required: list[str] | None = None
    endpoints: list[Endpoint] = field(default_factory=list)
    restarted: bool = False
    note: str | None = None  #: why the host's units wait for its driver
    #: each instance not on the inventory's release and configuration after the deploy, and why
    drift: list[str] = field(default_factory=list)

    def data(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "status": self.status,
            "operations": self.operations,
            "error": self.error,
            "note": self.note,
            "reboot_required": self.reboot_required,
            "endpoints": [e.__dict__ for e in self.endpoints],
            "restarted": self.restarted,
            "drift": self.drift,
        }


@dataclass
class DeployResult:
    dry: bool
    hosts: list[HostResult]
    seconds: float = 0.0
    error: str | None = None  #: why the deploy stopped early, with the way to resume
    #: the staging phase's fan-out (hosts with ``staging.fanout``): rounds, bounds, broken senders
    staging: dict[str, Any] | None = None
    #: the snapshots staged (``model_source``): model, source, revision, a mirror's commit
    weights: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and all(h.status not in (*FAILED, "stopped") for h in self.hosts)
            and all(e.healthy for h in self.hosts for e in h.endpoints)
        )

    def data(self) -> dict[str, Any]:
        return {
            "dry": self.dry,
            "ok": self.ok,
            "seconds": round(self.seconds, 2),
            "error": self.error,
            "hosts": [h.data() for h in self.hosts],
            **({"staging": self.staging} if self.staging is not None else {}),
            **({"weights": self.weights} if self.weights else {}),
        }


def check_hosts(loaded: LoadedInventory) -> dict[str, HostPlan]:
    """Everything a deploy needs from each host's data, checked before any host is touched.

    Returns the plans from the inventory's ``gpu`` entries (the fleet plan before any probe; hosts
    without one: their model is checked); the deploy plans each host again from its probe
    (``_probe_plans``).
    """
    declared = build_fleet_plan(loaded, deploy=True)
    problems: list[str] = []
    plans: dict[str, HostPlan] = {}
    for spec in loaded.hosts:
        try:
            host_part(spec, None, _paths())  # its deploy keys and API key, before the GPUs are known
            outcome = declared.host(spec.name)
            if outcome.plan is not None:
                plans[spec.name] = outcome.plan
            elif outcome.refusal is not None and (
                spec.gpu is not None or isinstance(outcome.refusal, ModelConfigError)
            ):
                raise outcome.refusal
        except FleetError as exc:
            problems.append(str(exc))
    problems += multinode.release_problems(multinode.spans(plans), plans)
    if problems:
        raise FleetError("\n".join(problems))
    return plans


def _endpoints(plan: HostPlan, bind: str) -> list[Endpoint]:
    """The instances this host serves: a headless node of an instance serves no HTTP; its leader's
    endpoint, on the leader's host, stands for the whole instance (``fleet.deploy.multinode``)."""
    served = served_names(plan, plan.model)  # a host with models: each instance its entry's served name
    return [
        Endpoint(f"fleet-{i.unit_name}.service", f"http://{bind}:{i.port}", served[i.index])
        for i in plan.instances
        if i.serves
    ]


def _config() -> Config:
    return Config(SUDO=True, CONNECT_TIMEOUT=15)  # type: ignore[no-untyped-call]


def _failure(state: State, host: Host) -> str:
    """The failed operation of a failed host: its name, the command and its last error lines."""
    with ctx_state.use(state), ctx_host.use(host):
        for op_hash in state.get_op_order():  # type: ignore[no-untyped-call]
            meta = state.ops.get(host, {}).get(op_hash)
            if meta is None or not meta.operation_meta.is_complete() or meta.operation_meta.did_succeed():
                continue
            op_meta = meta.operation_meta
            name = ", ".join(sorted(n.rsplit(" | ", 1)[-1] for n in state.op_meta[op_hash].names))
            commands = op_meta._commands or []
            command = str(commands[-1]) if commands else "(no command)"
            output = op_meta._combined_output
            stderr = " | ".join(output.stderr_lines[-3:]) if output is not None else ""
            return redact(f"operation {name!r} failed: `{command[:300]}`: {stderr[-400:] or 'no output'}")
    return "an operation failed (see the log above)"


def _add_deploy(
    state: State, func: Callable[..., Any], hosts: list[Host], parts: Mapping[str, HostPart] | None = None
) -> None:
    """pyinfra's ``add_deploy`` for each host in its own greenlet, so the facts the operations read
    are gathered from all hosts at once (``add_deploy`` alone walks the hosts one after another).
    pyinfra's host context (``pyinfra.context.ctx_host``) is greenlet-local, and an operation's
    order comes from its place in the code, not from when it was prepared. ``parts``: each host's
    part of the plan, given to ``func`` (``part=``). An error in one host's data re-raises here."""
    import gevent

    def args(h: Host) -> dict[str, Any]:
        return {"part": parts[h.name]} if parts is not None else {}

    with ctx_state.use(state):  # a process-wide context (not greenlet-local): set once, around all
        greenlets = [
            gevent.spawn(add_deploy, state, func, host=h, **args(h)) for h in hosts if h in state.activated_hosts
        ]
        gevent.joinall(greenlets)
    for g in greenlets:
        g.get()


@dataclass
class ProbePlans:
    """Each probed host's plan, or why it waits for its driver, or why it is refused."""

    plans: dict[str, HostPlan] = field(default_factory=dict)
    waiting: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    overridden: dict[str, list[Finding]] = field(default_factory=dict)  #: host -> findings let through

    @property
    def unprobed(self) -> list[str]:
        """Hosts whose NVML did not answer: waiting, or planned from their inventory gpu entry."""
        return [*self.waiting, *(n for n, p in self.plans.items() if p.gpus_source != "probe")]


def _probe_plans(
    state: State, hosts: list[Host], loaded: LoadedInventory, ignored: Collection[str] = (),
    first: Mapping[str, MarkerOrBatch | None] | None = None,
) -> ProbePlans:  # fmt: skip
    """Probe the hosts' GPUs, all at once (the ``NvmlProbe`` fact, which the deploy's operations
    then read without a second round trip; ``first``: what the first round already read, see
    :func:`_first_round`), and plan each from what it has (the fleet plan); then the audit's gate
    (``fleet.audit.gate``, as a deploy: findings it fixes itself never refuse) over the same
    probes and watcher records refuses a host with a critical finding, unless ``ignored`` names
    its rule."""
    import gevent

    read = first or {}
    with ctx_state.use(state):
        greenlets = [gevent.spawn(_probe_of, h, read.get(h.name)) for h in hosts]
        watched = [gevent.spawn(_watch_of, h, read.get(h.name)) for h in hosts]  # quarantined GPUs
        gevent.joinall(greenlets + watched)
    probes = {h.name: g.get() for h, g in zip(hosts, greenlets, strict=True)}
    held = {h.name: quarantine_of(g.value) for h, g in zip(hosts, watched, strict=True) if g.successful()}
    these = dataclasses.replace(loaded, hosts=tuple(s for s in loaded.hosts if s.name in probes))
    fleet_plan = build_fleet_plan(these, probes, deploy=True, quarantine=held)
    out = ProbePlans()
    for h in hosts:
        outcome = fleet_plan.host(h.name)
        if outcome.plan is not None:
            out.plans[h.name] = outcome.plan
        elif isinstance(outcome.refusal, GpusNotKnownYet):
            out.waiting[h.name] = str(outcome.refusal)
        else:  # GPUs unlike the inventory's entry, or nothing fits them
            out.refused[h.name] = redact(str(outcome.refusal))
    specs = {s.name: s for s in these.hosts}
    found: list[Finding] = []
    for h in hosts:
        probe = probes.get(h.name)
        if isinstance(probe, HostFacts) and h.name in specs:
            found += audit_host(h.name, probe, expectation(specs[h.name]))
            watch = next((g.value for g, x in zip(watched, hosts, strict=True) if x is h and g.successful()), None)
            found += rule_quarantine(h.name, watch if isinstance(watch, WatchState) else None)
    planned = {n: {g for i in p.instances for g in i.gpus} for n, p in out.plans.items()}
    compat = {n for n, p in out.plans.items() if p.cuda.compat}  # the deploy installs cuda-compat there
    verdict = gate(found, DEPLOY, ignored, planned, compat)
    for name in verdict.refused_hosts:
        if name not in out.refused:
            mine = GateVerdict(tuple(f for f in verdict.refusing if f.host == name))
            out.refused[name] = redact(mine.message("fleet deploy"))
            out.plans.pop(name, None)
            out.waiting.pop(name, None)
    for f in verdict.overridden:
        out.overridden.setdefault(f.host, []).append(f)
    return out


def _over(failed: int, total: int, fail_percent: int) -> bool:
    """More than ``fail_percent`` % of ``total`` hosts failed (Ansible's ``max_fail_percentage``)."""
    return total > 0 and failed * 100 > fail_percent * total


@dataclass
class Budget:
    """The deploy's failure budget (Ansible's ``max_fail_percentage``): the one check after every
    phase. Over it, nothing more is scheduled."""

    results: dict[str, HostResult]
    total: int  #: the selected hosts
    fail_percent: int

    @property
    def failed(self) -> int:
        return sum(r.status in FAILED for r in self.results.values())

    def over(self) -> bool:
        return _over(self.failed, self.total, self.fail_percent)

    def stop_others(self, why: str) -> None:
        """Every host that has not failed is ``stopped``, saying why."""
        for r in self.results.values():
            if r.status not in FAILED:
                r.status, r.error = "stopped", why

    def message(self) -> str:
        return _stop_message(self.results, self.fail_percent)


@dataclass
class DeployPhase:
    """One named step of a deploy after its operations, followed by the budget check; ``stopped``:
    what the hosts that did not fail are told when the budget is spent after it (None: nothing)."""

    name: str
    run: Callable[[], None]
    stopped: str | None = None


#: ``fleet.facts.runner.run_fact_on_hosts``'s signature: (targets, fact class, *, args_for, **args)
RunFact = Callable[..., Mapping[str, Any]]


class FactsVia:
    """Reads facts through the deploy's own pyinfra connections (``run_fact_on_hosts``'s
    signature and answers), all hosts at once: the fact's command as it is (not under pyinfra's
    sudo, as ``run_fact_on_hosts`` runs it), its output processed by the fact. A host not given,
    or whose read does not come back as a value (no connection, a failed command, output the fact
    cannot process), is read again on a connection of its own by ``run_fact_on_hosts``, whose
    answer (a value or ``HostUnreachable`` with its reason) is then the answer."""

    def __init__(self, hosts: list[Host]) -> None:
        self.hosts = {h.name: h for h in hosts}

    def __call__(
        self,
        targets: Iterable[SshTarget],
        fact_cls: type[FactBase[Any]],
        *,
        args_for: Callable[[str], Mapping[str, Any]] | None = None,
        **args: Any,
    ) -> dict[str, Any]:
        import gevent

        fact = fact_cls()
        chosen = list(targets)
        mine = [t for t in chosen if t.name in self.hosts]

        def read(t: SshTarget) -> tuple[Any] | None:
            kwargs = {**args, **(dict(args_for(t.name)) if args_for is not None else {})}
            try:
                ok, output = self.hosts[t.name].run_shell_command(
                    StringCommand(str(fact.command(**kwargs))), _timeout=DEFAULT_TIMEOUT
                )
                return (fact.process(output.stdout_lines),) if ok else None
            except (FleetError, PyinfraError, paramiko.SSHException, OSError, EOFError, TimeoutError):
                return None

        greenlets = [gevent.spawn(read, t) for t in mine]
        gevent.joinall(greenlets)
        out = {t.name: a[0] for t, g in zip(mine, greenlets, strict=True) if (a := g.get()) is not None}
        rest = [t for t in chosen if t.name not in out]
        if rest:
            out.update(run_fact_on_hosts(rest, fact_cls, args_for=args_for, **args))
        return {t.name: out[t.name] for t in chosen if t.name in out}


def _close(state: State) -> None:
    disconnect_all(state)
    for h in state.inventory:
        client = getattr(h.connector, "client", None)
        if client is not None:
            client.close()  # pyinfra's disconnect leaves paramiko's client open


def _op_names(state: State, host: Host, will: bool) -> list[str]:
    names = []
    with ctx_state.use(state), ctx_host.use(host):
        for op_hash in state.get_op_order():  # type: ignore[no-untyped-call]
            meta = state.ops.get(host, {}).get(op_hash)
            if meta is None:
                continue
            op_meta = meta.operation_meta
            hit = op_meta.will_change if will else (op_meta.is_complete() and op_meta.did_change())
            if hit:
                names.append(", ".join(sorted(n.rsplit(" | ", 1)[-1] for n in state.op_meta[op_hash].names)))
    return names


def deploy(
    inventory: str,
    limit: list[str] | None = None,
    dry: bool = False,
    start: bool = True,
    health_timeout: float = HEALTH_TIMEOUT_S,
    progress: Progress = lambda _m: None,
    fail_percent: int = 0,
    step: Step = lambda _h, _s: None,
    reboot: bool = False,
    roll: Roll | None = None,
    overrides: Mapping[str, Any] | None = None,
    ignore_findings: Collection[str] = (),
) -> DeployResult:
    """Deploy ``inventory`` (see the module docstring); errors in the inventory raise first.
    ``ignore_findings``: audit rules whose findings do not refuse a host (``fleet.audit.gate``)."""
    t0 = time.monotonic()
    loaded = load_for_planning(inventory, limit, overrides)
    plans = check_hosts(loaded)
    # a source that cannot be read: before any host (dry runs too; a dry run leaves a mirror's weights there)
    manifests = staging.manifests(loaded, fetch=not dry, note=progress)
    weights = staging.weights_by_host(loaded, manifests)
    selected = [loaded.pyinfra.get_host(s.name) for s in loaded.hosts]
    state = State(loaded.pyinfra, _config(), initial_limit=selected)
    results: dict[str, HostResult] = {}
    staged = host_deploy.staged_of(state)  #: filled in while the operations are prepared

    balancer_results: list[HostResult] = []
    budget = Budget(results, len(selected), fail_percent)

    fanned: dict[str, Any] = {}  #: the staging fan-out's rounds (staging.fanout), for --json

    def finish(error: str | None = None) -> DeployResult:
        hosts = [results[h.name] for h in selected] + balancer_results
        return DeployResult(dry, hosts, time.monotonic() - t0, error, fanned or None, staging.weights_data(manifests))

    early_states: dict[str, list[UnitState]] = {}
    conn = sshwatch.Connected()
    try:
        progress(f"connecting to {len(selected)} host(s)")
        for h in selected:
            step(h.name, "connecting")
        try:
            conn = sshwatch.connect(state)
        except PyinfraError as exc:
            raise FleetError(f"no host could be reached ({exc}); check ssh settings and known_hosts") from exc
        for h in selected:
            if h not in state.activated_hosts:
                why = conn.failed.get(h.name, "could not connect over SSH")
                results[h.name] = HostResult(h.name, "unreachable", error=why)
                step(h.name, "unreachable")
        active = [h for h in selected if h.name not in results]
        if not dry and budget.over():
            for h in active:
                results[h.name] = HostResult(h.name, "stopped", error="not deployed: the deploy stopped")
            return finish(budget.message())
        progress(f"reading the drain markers of {len(active)} host(s), probing the GPUs of those not drained")
        for h in active:
            step(h.name, "drain marker, probing GPUs")
        first = _first_round(state, active)
        for name, marker in _drained(first).items():
            results[name] = HostResult(name, "skipped", note=f"{marker.describe()}; `fleet undrain` puts it back")
            step(name, "skipped: drained")
        active = [h for h in active if h.name not in results]
        if not active:
            return finish()
        probed = _probe_plans(state, active, loaded, ignore_findings, first)
        plans.update(probed.plans)
        waiting, unprobed = probed.waiting, probed.unprobed
        for name, why in probed.refused.items():
            results[name] = HostResult(name, "refused", error=f"{why} (nothing was written to the host)")
            step(name, "refused: " + ("audit" if "refused by the audit" in why else "GPUs"))
        for name, let in probed.overridden.items():
            progress(f"{name}: " + "; ".join(f"{f.rule} overridden by --ignore-finding" for f in let))
        active = [h for h in active if h.name not in results]
        if not dry and budget.over():
            for h in active:
                results[h.name] = HostResult(h.name, "stopped", error="not deployed: the deploy stopped")
            return finish(budget.message())
        progress("preparing operations")
        for h in active:
            step(h.name, "checking what to change")
        parts = _parts(loaded, plans, [h.name for h in active], waiting, weights)
        caches = factcache.install(state, active, lambda h: prefetch.vllm_host_facts(parts[h.name]))  # one batch
        if not dry:  # their units come from the second probe (_units_once_probed), not the gpu entry now
            host_deploy.units_later([h for h in active if h.name in unprobed and h.name not in waiting])
        _add_deploy(state, host_deploy.vllm_host, active, parts)
        if dry:
            for h in active:
                ops = _op_names(state, h, will=True)
                results[h.name] = HostResult(
                    h.name, "would change" if ops else "no change", ops, note=waiting.get(h.name)
                )
            return finish()
        progress("running operations")
        for h in active:
            step(h.name, "installing (driver, release, units)")
        state.config.FAIL_PERCENT = fail_percent
        try:
            run_ops(state)
        except PyinfraError as exc:  # over the fail percent, or every host failed: reported below
            progress(f"pyinfra: {exc}")
        for h in active:
            if h in state.failed_hosts:
                silent = conn.silent(h.name)
                if silent:
                    results[h.name] = HostResult(h.name, "unreachable", error=f"{silent}; {_failure(state, h)}")
                else:
                    results[h.name] = HostResult(h.name, "failed", error=_failure(state, h))
                step(h.name, "failed")
                continue
            ops = _op_names(state, h, will=False)
            results[h.name] = HostResult(h.name, "changed" if ops else "unchanged", ops)
            results[h.name].reboot_required = h.get_fact(RebootRequired)
            if h.name in waiting:
                results[h.name].status, results[h.name].note = "waiting", waiting[h.name]
            elif h.name in unprobed and results[h.name].reboot_required is not None:
                results[h.name].note = "its units are installed once NVML answers, after the reboot (--reboot)"
        # read now, through this connection (and from the batch where no command ran): later phases
        # read again only the hosts they change (a reboot, units written once NVML answers)
        early_states = _unit_states_now(state, [
            h for h in active
            if h.name in plans and h.name not in unprobed and results[h.name].status in ("changed", "unchanged")
            and results[h.name].reboot_required is None
        ], plans)  # fmt: skip
        progress(factcache.summary(caches))
        # later phases read their facts through these connections where the host kept them (not rebooted)
        via = FactsVia([
            h for h in active
            if results[h.name].status in ("changed", "unchanged") and results[h.name].reboot_required is None
        ])  # fmt: skip
        if budget.over():  # lock-step: hosts behind a failure did not finish their operations
            budget.stop_others("not finished: the deploy stopped at the first failures")
        if not start or budget.over():
            if not start and not budget.over():  # units are installed, not started
                _units_once_probed(
                    loaded, plans, results, _answer_now(unprobed, results), progress, step, staged, weights
                )
            return finish(budget.message() if budget.failed else None)
        ready = _Ready()

        def preflight() -> None:
            ready.states = _unit_states(loaded, plans, _ready(results), early_states)
            ready.quiet = [n for n in _ready(results) if _quiet(ready.states.get(n), results[n], staged.get(n))]
            ready.busy = [n for n in _ready(results) if n not in ready.quiet]
            _preflight(loaded, plans, results, ready.busy, progress, step, staged, via)
            _rendezvous(loaded, plans, results, ready.busy, ready.states, progress, step)

        def stage_models() -> None:  # model_source: copied and verified before anything restarts
            up = [r.host for r in results.values() if r.status in ("changed", "unchanged")]  # reboot pending too
            staged_models = staging.stage_hosts(loaded, up, manifests, progress, step)
            fanned.update(staged_models.fanout or {})
            for name, got in staged_models.results.items():
                if got.ok:
                    results[name].operations.append(describe_staging(got))
                else:
                    results[name].status, results[name].error = got.status, got.error

        def rebooting() -> None:
            if reboot:
                _reboot(loaded, plans, results, health_timeout, progress, step)

        def units_once_probed() -> None:
            _units_once_probed(loaded, plans, results, _answer_now(unprobed, results), progress, step, staged, weights)

        phases = [
            DeployPhase("stage model", stage_models, stopped="nothing restarted: the deploy stopped after staging"),
            DeployPhase("reboot (--reboot)", rebooting),
            DeployPhase("units once probed", units_once_probed),
            DeployPhase(
                "preflight", preflight, stopped="nothing restarted: the deploy stopped after preflight refusals"
            ),
        ]
        for phase in phases:
            phase.run()
            if budget.over():
                if phase.stopped is not None:
                    budget.stop_others(phase.stopped)
                return finish(budget.message())
        states, quiet = ready.states, ready.quiet
        _hold_back(plans, results, ready.busy, step)
        busy = [n for n in ready.busy if results[n].status not in FAILED]
        serving = _start(loaded, plans, results, busy, health_timeout, progress, step)
        for name in [*quiet, *serving]:
            if not _to_roll(name, states, staged):
                _check_serving(loaded, plans, results, name, health_timeout, step)
        balancer_results.extend(_balancers(loaded, plans, progress, step))
        _join_balancers(loaded, plans, results, [n for n in results if not _to_roll(n, states, staged)], progress)
        rolling = _whole_instances([n for n in serving if _to_roll(n, states, staged)], serving, plans, results, step)
        error = _roll(loaded, results, rolling, states, staged, roll, progress, step) if rolling else None
        _converged(
            loaded,
            plans,
            results,
            [n for n in busy if results[n].status not in (*FAILED, "stopped")],
            staged,
            via,
        )
        return finish(error)
    finally:
        conn.release()
        _close(state)


@dataclass
class _Ready:
    """What the preflight phase found for the phases after it."""

    states: dict[str, list[UnitState] | None] = field(default_factory=dict)
    quiet: list[str] = field(default_factory=list)  #: nothing to start, switch or restart
    busy: list[str] = field(default_factory=list)  #: preflighted: to start or roll


def _served(loaded: LoadedInventory, plans: Mapping[str, HostPlan]) -> dict[tuple[str, str], str]:
    """(host, instance) -> the model name each planned instance serves (its entry's on a host with
    ``models``): what picks its balancer (``fleet.lb.traffic.traffic_of``)."""
    from fleet.render.part import instance_served

    return {
        (name, instance): served
        for name, plan in plans.items()
        if plan is not None
        for instance, served in instance_served(loaded.host(name), plan).items()
    }


def _balancers(loaded: LoadedInventory, plans: dict[str, HostPlan], progress: Progress, step: Step) -> list[HostResult]:
    """fleet's HAProxy configuration on every balancer in front of the planned hosts
    (``fleet.deploy.balancers``); one result per balancer, beside the hosts'."""
    from fleet.deploy import balancers

    for spec in {m.balancer.on for s in loaded.hosts for m in s.model_specs if m.balancer is not None}:
        step(spec, "configuring the balancer")
    done = balancers.configure(loaded, plans, lambda *a: _balancer_host(loaded, *a), _drain_timeout(loaded), progress)
    for b in done:
        step(b.name, b.status)
    return [HostResult(b.name, b.status, b.operations, error=b.error, note=b.note) for b in done]


def _drain_timeout(loaded: LoadedInventory) -> float:
    """The rollout policy's ``drain_timeout_s`` (the same wait as a restart's)."""
    from fleet.rollout.policy import RolloutPolicy, policy_from_hosts

    datas = {s.name: loaded.pyinfra.get_host(s.name).data.dict() for s in loaded.hosts}  # type: ignore[no-untyped-call]
    try:
        return policy_from_hosts(loaded.path, datas).drain_timeout_s
    except FleetError:
        return RolloutPolicy().drain_timeout_s  # a bad rollout policy is reported where it is used


def _balancer_host(loaded: LoadedInventory, name: str, path: str, text: str, dropin: str) -> tuple[bool, list[str]]:
    """``fleet.operations.balancer`` on one balancer host (its own pyinfra run); raises
    ``FleetError`` naming the failed operation."""
    from fleet.inventory.load import read_inventory
    from fleet.operations import balancer as balancer_ops

    inventory = read_inventory(loaded.path, loaded.overrides).pyinfra
    h = inventory.get_host(name)
    state = State(inventory, _config(), initial_limit=[h])
    conn = sshwatch.Connected()
    try:
        try:
            conn = sshwatch.connect(state)
        except PyinfraError as exc:
            raise FleetError(f"balancer host {name}: could not connect over SSH ({exc})") from exc
        if h not in state.activated_hosts:
            why = conn.failed.get(name, "could not connect over SSH")
            raise FleetError(f"balancer host {name}: {why}")
        _add_deploy(state, lambda: balancer_ops.balancer_host(path=path, text=text, dropin=dropin), [h])
        try:
            run_ops(state)
        except PyinfraError as exc:
            raise FleetError(f"balancer host {name}: {_failure(state, h)} ({exc})") from exc
        if h in state.failed_hosts:
            raise FleetError(f"balancer host {name}: {_failure(state, h)}")
        ops = _op_names(state, h, will=False)
        return bool(ops), ops
    finally:
        conn.release()
        _close(state)


def _converged(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    names: list[str],
    staged: Mapping[str, host_deploy.Staged],
    run_fact: RunFact = run_fact_on_hosts,
) -> None:
    """Read again, on each host this run started or rolled instances on, what every instance runs
    and has in place; a host with an instance not on the inventory's release and configuration
    fails, naming each such instance (``fleet.deploy.converge``). Hosts where nothing changed were
    read at the start of this run and found converged (``_quiet``)."""
    names = [n for n in names if n in plans and staged.get(n) is not None and staged[n].revisions]
    if not names:
        return
    paths = _paths()

    def instances(name: str) -> dict[str, object]:
        return {
            "instances": tuple(
                (i.unit_name, f"fleet-{i.unit_name}.service", f"{paths.unit_dir}/fleet-{i.unit_name}.service",
                 f"{paths.env_dir}/{i.unit_name}.env")
                for i in plans[name].instances
            )
        }  # fmt: skip

    answers = run_fact([_target(loaded, n) for n in names], InstanceRevisionsAsRoot, args_for=instances)
    for name, answer in answers.items():
        r = results[name]
        if isinstance(answer, HostUnreachable):
            lines = [f"{name}: could not read its instances after the deploy: {answer.reason}"]
        else:
            lines = drift(name, staged[name].release, staged[name].revisions, answer, vllm_ops.DEFAULT_ROOT)
        if lines:
            r.status, r.drift = "failed", lines
            r.error = "; ".join(x for x in (r.error, "not on the inventory's release and configuration: "
                                           + "; ".join(lines)) if x)  # fmt: skip


def _join_balancers(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    names: list[str],
    progress: Progress,
) -> None:
    """Every instance that serves now (its health, models and completion checks passed) and whose
    server its load balancer holds out of traffic (written ``disabled``: a new host) goes ``ready``;
    one that does not serve stays out. A balancer that cannot be asked is said on the host's line."""
    from fleet.lb.runtime import AdminState

    members = [
        (name, e.unit.removeprefix("fleet-").removesuffix(".service"))
        for name in names
        if name in plans and any(m.balancer is not None for m in loaded.host(name).model_specs)
        for e in results[name].endpoints
        if e.healthy
    ]
    if not members:
        return
    traffic = traffic_of(loaded, members, served=_served(loaded, plans))
    try:
        for host, instance in members:
            try:
                seat = traffic.seat(host, instance)
                view = traffic.view(host, instance)
                if seat is not None and view is not None and view.admin is not AdminState.READY:
                    traffic.set_state(host, instance, AdminState.READY)
                    results[host].operations.append(f"{instance}: into traffic on {seat.describe()}")
            except BalancerError as exc:
                note = f"{instance}: not put into traffic: {exc}"
                results[host].note = f"{results[host].note}; {note}" if results[host].note else note
                progress(f"{host}: {note}")
    finally:
        traffic.close()


def _answer_now(unprobed: list[str], results: dict[str, HostResult]) -> list[str]:
    """Hosts whose NVML did not answer at first and may now: no reboot pending, not failed."""
    return [n for n in unprobed if results[n].reboot_required is None and results[n].status not in FAILED]


def _units_once_probed(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    names: list[str],
    progress: Progress,
    step: Step,
    staged: dict[str, host_deploy.Staged],
    weights: Mapping[str, tuple[tuple[str, str], ...]],
) -> None:
    """Hosts whose NVML did not answer when the run began (their units wait, or were planned
    from the inventory's gpu entry): this run installed the release (nvidia-ml-py for the probe),
    the driver, or rebooted them. Probe again and install their units from what NVML answers now
    (a second pyinfra run: State is single-use); still no answer: they stay as they are."""
    if not names:
        return
    progress(f"probing {len(names)} host(s) again for their units")
    fresh = loaded.reload(names)
    hosts = [fresh.pyinfra.get_host(n) for n in names]
    state = State(fresh.pyinfra, _config(), initial_limit=hosts)
    conn = sshwatch.Connected()
    try:
        for name in names:
            step(name, "probing GPUs")
        conn = sshwatch.connect(state)
        probed = _probe_plans(state, [h for h in hosts if h in state.activated_hosts], fresh)
        for name, why in probed.refused.items():  # its driver answers only now
            results[name].status = "refused"
            results[name].error = f"{why} (no unit was written)"
        for name, why in probed.waiting.items():
            results[name].status, results[name].note = "waiting", why
        ready = [h for h in hosts if h.name in probed.plans]
        if not ready:
            return
        for h in ready:
            step(h.name, "installing units")
        _add_deploy(
            state, host_deploy.vllm_units, ready, _parts(fresh, probed.plans, [h.name for h in ready], None, weights)
        )
        try:
            run_ops(state)
        except PyinfraError as exc:
            progress(f"pyinfra: {exc}")
        for h in ready:
            r = results[h.name]
            if h in state.failed_hosts:
                r.status, r.error = "failed", _failure(state, h)
                continue
            plans[h.name] = probed.plans[h.name]
            second = host_deploy.staged_of(state).get(h.name)
            if second is not None:  # what this pass found and stored is what the engine rolls
                first = staged.setdefault(h.name, host_deploy.Staged())
                first.revisions, first.running, first.live = second.revisions, second.running, second.live
                first.runs = second.runs
            ops = _op_names(state, h, will=False)
            r.operations += ops
            r.note = None
            if ops or r.status == "waiting":
                r.status = "changed"
    finally:
        conn.release()
        _close(state)


def _quiet(states: list[UnitState] | None, result: HostResult, staged: host_deploy.Staged | None) -> bool:
    """Nothing to start, switch or restart on the host: every unit active and current, every
    instance's release and configuration live."""
    return (
        bool(states)
        and all(u.active and not u.stale for u in states or ())
        and (staged is None or not staged.waiting)
        and "reboot" not in " ".join(result.operations)
    )


def _to_roll(name: str, states: dict[str, list[UnitState] | None], staged: dict[str, host_deploy.Staged]) -> bool:
    """A serving host the rolling engine must take through: a release or configuration waits for
    its instances, or a unit's files are newer than its process (an earlier run stopped between)."""
    waiting = staged.get(name)
    return bool(waiting and waiting.waiting) or any(u.stale for u in states.get(name) or ())


def _stop_message(results: dict[str, HostResult], fail_percent: int) -> str:
    failed = [r for r in results.values() if r.status in FAILED]
    lines = [f"{r.host}: {r.status}: {r.error}" for r in failed]
    return (
        f"{len(failed)} host(s) failed, over --fail-percent {fail_percent}: nothing more was scheduled.\n"
        + "\n".join(lines)
        + "\nFix them (or --limit to the others, or raise --fail-percent) and run the deploy again."
    )


def _target(loaded: LoadedInventory, name: str) -> SshTarget:
    return SshTarget.from_data(name, loaded.pyinfra.get_host(name).data.dict())  # type: ignore[no-untyped-call]


def _paths() -> HostPaths:
    return host_deploy.PATHS


def _parts(
    loaded: LoadedInventory,
    plans: Mapping[str, HostPlan],
    names: list[str],
    waiting: Mapping[str, str] | None = None,
    weights: Mapping[str, tuple[tuple[str, str], ...]] | None = None,
) -> dict[str, HostPart]:
    """Each host's part of the plan, for its operations (``fleet.render.part``): from the plan this
    run made for it, or without one while its GPUs are not known (``waiting`` says why); ``weights``:
    the snapshots staged for each host (``staging.weights_by_host``)."""
    return {
        n: host_part(loaded.host(n), plans.get(n), _paths(), (waiting or {}).get(n, ""), (weights or {}).get(n, ()))
        for n in names
    }  # fmt: skip


def _ready(results: dict[str, HostResult]) -> list[str]:
    return [r.host for r in results.values() if r.status in ("changed", "unchanged") and r.reboot_required is None]


def _reboot(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    timeout: float,
    progress: Progress,
    step: Step,
) -> None:
    """Reboot, one at a time, the hosts whose driver change needs it; then they go on with the deploy.

    A host that was serving (one of its units active before the reboot) goes through the same drain
    as a restart: its instances leave their load balancer's traffic first (``drain``, then their
    sessions end, bounded by ``drain_timeout_s``: ``fleet.lb.traffic.take_out``), so the reboot
    aborts no request; after the reboot its units, started at boot, must serve (``/health``,
    ``/v1/models``, a completion) and are put back ``ready`` before the next host goes down: a
    reboot takes a whole host's capacity, and two at once would take two. A balancer that cannot be
    used stops the host's reboot (it stays pending, reported)."""
    drain_timeout = _drain_timeout(loaded)
    for r in results.values():
        if r.status in FAILED or r.reboot_required is None:
            continue
        plan = plans.get(r.host)  # none yet: the host waits for its driver to plan from the probe
        members = [(r.host, i.unit_name) for i in plan.instances] if plan else []
        traffic = traffic_of(loaded, members, served=_served(loaded, plans))
        try:
            if not _reboot_one(loaded, plans, r, members, traffic, timeout, drain_timeout, progress, step):
                return  # the others keep their pending reboot (reported), their capacity intact
        finally:
            traffic.close()


def _reboot_one(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    r: HostResult,
    members: list[tuple[str, str]],
    traffic: Traffic,
    timeout: float,
    drain_timeout: float,
    progress: Progress,
    step: Step,
) -> bool:
    """One host of ``_reboot``; False when the deploy must reboot no further host."""
    target = _target(loaded, r.host)
    units = [f"fleet-{i}.service" for _h, i in members]
    progress(f"{r.host}: rebooting ({', '.join(r.reboot_required or ())})")
    step(r.host, "rebooting")
    try:
        active = ssh_command(["systemctl", "is-active", "--quiet", "--", *units])
        was_serving = bool(units) and run_command(target, active)[0] == 0
        if was_serving and traffic:
            step(r.host, "out of traffic before the reboot")
            busy = take_out(traffic, members, drain_timeout, progress=progress)
            where = ", ".join(sorted({s.balancer.name for s in traffic.seats.values()}))
            r.operations.append(
                f"out of traffic on {where}"
                + (f" (still busy after {drain_timeout:g}s: {'; '.join(busy)})" if busy else "")
            )
        seconds = reboot_host(target, loaded.host(r.host).reboot_command)
        rc, _out, _err = run_command(target, ssh_command(["test", "-e", "/var/run/reboot-required"]))
    except BalancerError as exc:
        r.status, r.error = "failed", redact(f"not rebooted: its instances could not be taken out of traffic: {exc}")
        step(r.host, "not rebooted: balancer")
        return True
    except (FleetError, paramiko.SSHException, OSError, EOFError) as exc:
        r.status, r.error = "failed", redact(f"reboot: {exc}")
        step(r.host, "reboot failed")
        return True
    if rc == 0:
        r.status, r.error = "failed", "rebooted, but /var/run/reboot-required is still there; check the driver"
        return True
    r.reboot_required, r.status = None, "changed"
    r.operations.append(f"reboot ({seconds:.0f} s)")
    if not was_serving:
        return True
    step(r.host, "rebooted: waiting until it serves again")
    endpoints = _endpoints_of(loaded, plans, r.host)
    wait_healthy(endpoints, _api_key(loaded, r.host), timeout)
    r.endpoints = endpoints
    bad = [e for e in endpoints if not e.healthy]
    if bad:
        r.status = "failed"
        r.error = "rebooted, but not serving again: " + "; ".join(f"{e.unit}: {e.detail}" for e in bad)
        if traffic:
            out = " ".join(f"{h}/{i}" for h, i in members)
            r.error += f"; its instances stay out of traffic: once they serve, fleet lb ready {loaded.path} {out}"
        r.error += "; no further host was rebooted"
        step(r.host, "not serving after the reboot")
        return False
    if traffic:
        try:
            put_back(traffic, members)
        except BalancerError as exc:
            r.status = "failed"
            r.error = redact(
                f"rebooted and serving, but not put back into traffic: {exc}; no further host was rebooted"
            )
            return False
        r.operations.append("back into traffic")
    return True


def _rendezvous(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    ready: list[str],
    states: Mapping[str, list[UnitState] | None],
    progress: Progress,
    step: Step,
) -> None:
    """Each instance spanning hosts that this run starts: its rendezvous port free on the leader and
    reachable from every other node (``fleet.deploy.multinode.check_rendezvous``); a refused node is
    neither started nor restarted. An instance whose leader runs already holds the port: not checked."""
    chosen = set(ready)

    def running(s: multinode.Span) -> bool:
        return any(u.unit == s.unit and u.active for u in states.get(s.leader) or ())

    found = [
        s for s in multinode.spans(plans)
        if all(h in chosen and results[h].status not in FAILED for h in s.hosts) and not running(s)
    ]  # fmt: skip
    if not found:
        return
    progress(f"checking the rendezvous port of {len(found)} multi-node instance(s)")
    for s in found:
        for h in s.hosts:
            step(h, "preflight: rendezvous port")

    def run(host: str, command: str) -> tuple[int, str, str]:
        return run_command(_target(loaded, host), command, timeout=multinode.PROBE_SECONDS + 30)

    for host, why in multinode.check_rendezvous(found, run).items():
        results[host].status, results[host].error = "refused", redact(why)
        step(host, "refused by preflight: rendezvous port")


def _hold_back(plans: dict[str, HostPlan], results: dict[str, HostResult], busy: list[str], step: Step) -> None:
    """A node whose instance cannot start on every node is not started (it would wait in the
    rendezvous holding its GPUs): refused, naming the node that cannot."""

    def able(host: str) -> str | None:
        r = results.get(host)
        if r is None:
            return "not selected or not reached"
        if r.status in (*FAILED, "stopped", "waiting") or r.reboot_required is not None:
            return r.status if r.reboot_required is None else "waiting for its reboot"
        return None

    for host, why in multinode.held_back(multinode.spans(plans), able, busy).items():
        if results[host].status not in FAILED:
            results[host].status, results[host].error = "refused", why
            step(host, "not started: another node of its instance cannot start")


def _whole_instances(
    names: list[str], serving: list[str], plans: dict[str, HostPlan], results: dict[str, HostResult], step: Step
) -> list[str]:
    """The serving hosts the rolling engine takes: ``names`` (a release or configuration waits) and,
    for an instance spanning hosts among them, every other node's host too: the instance is rolled
    as one unit (``fleet.rollout.engine``), a node whose own files did not change restarts with it.
    A node whose host is not serving in this run (it failed or was refused) holds its instance
    back: the instance's hosts fail, naming it, their new release or configuration stays staged."""
    chosen = set(names)
    spans = [i.node for n in names if (plan := plans.get(n)) for i in plan.instances if i.node is not None]
    held: dict[str, str] = {}
    for node in spans:
        missing = [h for h in node.hosts if h not in serving]
        if missing:
            why = (
                f"instance spanning {', '.join(node.hosts)} (leader {node.leader}) is rolled as one unit, but "
                f"node host(s) {', '.join(missing)} did not get through this deploy "
                f"({'; '.join(f'{h}: {results[h].status}' for h in missing if h in results)}); its new release or "
                "configuration is staged: run the deploy again once every node is back"
            )
            held.update(dict.fromkeys((h for h in node.hosts if h not in missing), why))
        else:
            chosen.update(node.hosts)
    for name, why in held.items():
        chosen.discard(name)
        if results[name].status not in FAILED:
            results[name].status, results[name].error = "failed", why
            step(name, "not rolled: a node of its instance is missing")
    return [n for n in serving if n in chosen]


def _preflight(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    ready: list[str],
    progress: Progress,
    step: Step,
    staged: Mapping[str, host_deploy.Staged],
    run_fact: RunFact = run_fact_on_hosts,
) -> None:
    """Refuse, per host, what would not start; a refused host is neither started nor restarted.

    The new command line is parsed by the release it will run on: ``current`` on a host that is
    not serving (the deploy made it current), the new release itself where it waits for the engine.
    """
    if not ready:
        return
    progress(f"preflight on {len(ready)} host(s)")
    for name in ready:
        step(name, "preflight")
    venvs = {n: _venv(staged.get(n)) for n in ready}
    answers = run_preflight({n: _target(loaded, n) for n in ready}, plans, _paths(), venvs, run_fact)
    for name, refusals in answers.items():
        if refusals:
            results[name].status = "refused"
            results[name].error = redact("\n".join(str(r) for r in refusals))
            step(name, "refused by preflight")


def _venv(staged: host_deploy.Staged | None) -> str:
    if staged is not None and staged.release and staged.running and staged.current != staged.release:
        return vllm_ops.release_dir(vllm_ops.DEFAULT_ROOT, staged.release)
    return _paths().venv


def _endpoints_of(loaded: LoadedInventory, plans: dict[str, HostPlan], name: str) -> list[Endpoint]:
    spec = loaded.host(name)
    data = loaded.pyinfra.get_host(name).data.dict()  # type: ignore[no-untyped-call]
    return _endpoints(plans[name], spec.bind_address or str(data.get("ssh_hostname") or name))


def _api_key(loaded: LoadedInventory, name: str) -> str | None:
    return api_key(loaded.host(name))


def _start(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    ready: list[str],
    timeout: float,
    progress: Progress,
    step: Step,
) -> list[str]:
    """Start units that are not running (first deploy) and wait for their health.

    Returns the hosts whose units were all already running (serving before this deploy).
    """
    if not ready:
        return []
    fresh = loaded.reload(ready)  # pyinfra's Inventory and State are single-use
    hosts = [fresh.pyinfra.get_host(n) for n in ready]
    state = State(fresh.pyinfra, _config(), initial_limit=hosts)
    serving: list[str] = []
    started: list[str] = []
    conn = sshwatch.Connected()
    try:
        for name in ready:
            step(name, "starting units")
        conn = sshwatch.connect(state)
        _add_deploy(state, host_deploy.vllm_start, hosts, _parts(fresh, plans, ready))
        run_ops(state)
        for h in hosts:
            names = _op_names(state, h, will=False)
            if h in state.failed_hosts:
                results[h.name].status = "failed"
                results[h.name].error = _failure(state, h)
            elif any(n.startswith("start ") for n in names):
                results[h.name].operations += names
                results[h.name].status = "changed"
                started.append(h.name)
            else:  # its units ran already (at most they were enabled now)
                if names:
                    results[h.name].operations += names
                    results[h.name].status = "changed"
                serving.append(h.name)
    finally:
        conn.release()
        _close(state)
    for name in started:
        endpoints = _endpoints_of(loaded, plans, name)
        progress(f"{name}: waiting for {len(endpoints)} instance(s) to be healthy")
        step(name, "waiting until it serves")
        wait_healthy(endpoints, _api_key(loaded, name), timeout)
        results[name].endpoints = endpoints
        step(name, "serving" if all(e.healthy for e in endpoints) else "not healthy")
    return serving


def _unit_states(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    names: list[str],
    known: Mapping[str, list[UnitState]] | None = None,
) -> dict[str, list[UnitState] | None]:
    """Each host's units: active? restart pending (its unit or env file newer than the process)?
    None: no answer. Not the ``current`` link: it is one per host, and any instance's switch (a
    canary, a rollback) touches it; whether an instance runs the release it should is read from
    its own process (``Staged.runs``). ``known``: hosts whose states were read after the
    operations and that nothing changed since (``_unit_states_now``): not asked again."""
    known = known or {}
    out: dict[str, list[UnitState] | None] = {n: known[n] for n in names if n in known}
    ask = [n for n in names if n not in known]
    if not ask:
        return out
    paths = _paths()

    def units(name: str) -> dict[str, object]:
        return {"units": prefetch.unit_state_units(plans[name], paths)}

    answers = run_fact_on_hosts([_target(loaded, n) for n in ask], UnitStates, args_for=units)
    out.update({n: a if isinstance(a, list) else None for n, a in answers.items()})
    return out


def _unit_states_now(state: State, hosts: list[Host], plans: dict[str, HostPlan]) -> dict[str, list[UnitState]]:
    """The hosts' unit states through the deploy's own connections (the ``UnitStates`` fact, which
    the prefetch batch holds where the operations ran no command), all at once; a host whose read
    fails is left out (read again later on its own)."""
    import gevent

    paths = _paths()

    def read(h: Host) -> list[UnitState] | None:
        try:
            answer = h.get_fact(UnitStates, units=prefetch.unit_state_units(plans[h.name], paths))
        except (FleetError, PyinfraError, paramiko.SSHException, OSError, EOFError):
            return None
        return answer if isinstance(answer, list) else None

    with ctx_state.use(state):
        greenlets = [gevent.spawn(read, h) for h in hosts]
        gevent.joinall(greenlets)
    return {h.name: a for h, g in zip(hosts, greenlets, strict=True) if (a := g.get()) is not None}


#: what the first round reads on a host that is not drained (``_first_round``): the NVML probe
#: and the GPU watcher's record, the index of each its place here
FIRST_ROUND = (FactRequest(NvmlProbe), FactRequest(GpuWatchState))


def _first_round(state: State, hosts: list[Host]) -> dict[str, MarkerOrBatch | None]:
    """Each host's drain marker (``fleet drain``) and, only on a host that has none, its NVML probe
    and GPU watcher record (:data:`FIRST_ROUND`): one command per host
    (``fleet.facts.drain.UnlessDrained``), through the deploy's own connections, all at once. A
    drained host is not probed: it is often drained because a GPU is broken, and a broken GPU can
    hang NVML. None: the host could not be asked; it is not taken for drained here (the step that
    needs it reports it), and what it did not answer is read on its own (:func:`_probe_of`,
    :func:`_watch_of`)."""
    import gevent

    commands = [r.shell() for r in FIRST_ROUND]

    def read(h: Host) -> MarkerOrBatch | None:
        try:
            answer = h.get_fact(UnlessDrained, commands=commands)
        except (FleetError, PyinfraError, paramiko.SSHException, OSError, EOFError):
            return None
        return answer if isinstance(answer, MarkerOrBatch) else None

    with ctx_state.use(state):
        greenlets = [gevent.spawn(read, h) for h in hosts]
        gevent.joinall(greenlets)
    return {h.name: g.get() for h, g in zip(hosts, greenlets, strict=True)}


def _drained(first: Mapping[str, MarkerOrBatch | None]) -> dict[str, DrainMarker]:
    """The drain marker of every host that has one, from the first round (pure)."""
    return {name: a.marker for name, a in first.items() if a is not None and a.marker is not None}


def _batched(first: MarkerOrBatch | None, index: int) -> Any:
    """The first round's value of ``FIRST_ROUND[index]``, or ``NO_ANSWER``: read it on its own."""
    answer: BatchAnswer | None = first.answers.get(index) if first is not None else None
    return answer_of(FIRST_ROUND[index], answer) if answer is not None else NO_ANSWER


def _probe_of(h: Host, first: MarkerOrBatch | None) -> HostFacts | str:
    """The host's NVML probe: the first round's answer, else read on its own (``host_deploy.probe``)."""
    if first is None or 0 not in first.answers:
        return host_deploy.probe(h)

    def read() -> HostFacts | None:
        value = _batched(first, 0)
        return h.get_fact(NvmlProbe) if value is NO_ANSWER else value

    return host_deploy.remember_probe(h, read)


def _watch_of(h: Host, first: MarkerOrBatch | None) -> WatchState:
    """The host's GPU watcher record: the first round's answer, else read on its own."""
    value = _batched(first, 1)
    return h.get_fact(GpuWatchState) if value is NO_ANSWER else value


def _check_serving(
    loaded: LoadedInventory, plans: dict[str, HostPlan], results: dict[str, HostResult], name: str,
    timeout: float, step: Step,
) -> None:  # fmt: skip
    endpoints = _endpoints_of(loaded, plans, name)
    step(name, "checking it serves")
    wait_healthy(endpoints, _api_key(loaded, name), timeout)
    results[name].endpoints = endpoints
    step(name, "serving")


def _roll(
    loaded: LoadedInventory,
    results: dict[str, HostResult],
    hosts: list[str],
    states: dict[str, list[UnitState] | None],
    staged: dict[str, host_deploy.Staged],
    roll: Roll | None,
    progress: Progress,
    step: Step,
) -> str | None:
    """Serving hosts whose release or configuration changed go through the rolling engine: batches,
    drain, stop, GPUs free, switch (release link and configuration revision), start, gates."""
    from fleet.rollout.advice import next_steps
    from fleet.rollout.engine import RolloutStatus, Target
    from fleet.rollout.fleet_inventory import fleet_of

    fleet = fleet_of(loaded.reload(hosts))
    stale = {(n, u.unit) for n in hosts for u in states.get(n) or () if u.stale}
    targets = [
        Target(ref, staged[ref.host].release, s.model, s.port, restart=(ref.host, s.unit) in stale,
               revision=staged[ref.host].revisions[ref.instance], adapters=s.adapters)
        for ref, s in fleet.instances.items()
    ]  # fmt: skip
    progress(f"rolling {len(hosts)} serving host(s) onto the new release/configuration behind the health gates")
    for name in hosts:
        step(name, "rolling (see the rollout below)")
    final = (roll or _headless)(fleet, lambda _executor: targets)
    results_of_rollout(final, fleet, results)
    for name in hosts:
        step(name, results[name].status)
    if final.status is RolloutStatus.DONE:
        return None
    return f"rollout {final.id} {final.status.value}: {final.reason}\n" + "\n".join(next_steps(final))


def _headless(fleet: RolloutFleet, targets_of: Callable[[SshExecutor], list[Target]]) -> RolloutState:
    from fleet.rollout.session import run_rollout

    return run_rollout(fleet, "rollout", targets_of)


def results_of_rollout(final: RolloutState, fleet: RolloutFleet, results: dict[str, HostResult]) -> None:
    """Each rolled host's result from the instances' end states."""
    from fleet.rollout.engine import Phase

    for name in {r.host for r in final.instances}:
        r = results[name]
        mine = {ref: i for ref, i in final.instances.items() if ref.host == name}
        r.endpoints = [
            Endpoint(fleet.instances[ref].unit, fleet.instances[ref].url, i.model, i.phase is Phase.DONE,
                     i.rollback_failure or i.failure or (f"serving {i.model}" if i.phase is Phase.DONE else i.note))
            for ref, i in mine.items()
            if not i.headless  # a headless node serves no HTTP: its leader's endpoint stands for the instance
        ]  # fmt: skip
        moved = [ref.instance for ref, i in mine.items() if i.touched and i.phase is Phase.DONE]
        if moved:
            r.restarted = True
            r.status = "changed" if r.status == "unchanged" else r.status
            r.operations.append(f"rolled out {', '.join(moved)} (rollout {final.id})")
        failed = [i for i in mine.values() if i.phase in (Phase.FAILED, Phase.ROLLED_BACK, Phase.ROLLBACK_FAILED)]
        if failed:
            r.status = "failed"
            r.error = "; ".join(f"{i.ref}: {i.rollback_failure or i.failure}" for i in failed)
        elif any(i.phase is Phase.PENDING for i in mine.values()):
            r.status, r.error = "stopped", f"not rolled out: rollout {final.id} halted ({final.reason})"
