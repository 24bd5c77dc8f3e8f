"""Run the deploy of ``fleet.operations.host`` on an inventory through pyinfra's API.

Order: validate every selected host's data and plan (errors for all hosts at once, before any
host is touched); connect (strict host keys, as the inventory says); probe each host's GPUs
(the ``NvmlProbe`` fact, once per host) and plan it from what it has (``fleet.plan.gpu_source``:
an inventory ``gpu`` entry the probe contradicts refuses the host before anything is written; a
host whose NVML does not answer yet and has no entry waits: its units are rendered once the
driver answers, later in the same run when this run's release or reboot brings it, else by the
next deploy); prepare the operations
(pyinfra runs each generator up to its first command: that is ``--dry``'s answer, per host and
operation); execute in pyinfra's lock-step mode; preflight every host that is ready
(``fleet.deploy.preflight``: the host's vLLM parses the new argv, the model resolves, the GPUs are
free or ours); start units that are not running (first deploy) and wait, from this machine, until
each instance serves (``fleet.deploy.health``); restart hosts that were already serving and whose
units, env files or release changed one at a time (``fleet.deploy.restart``). A host that needs a
reboot is reported and not started.

Failures (unreachable, a failing operation, a preflight refusal) name the host, the cause and the
failed command (redacted). ``fail_percent`` (like Ansible's ``max_fail_percentage``; default 0):
once more than that share of the selected hosts failed, nothing more is scheduled: no further
operations, no start, no restart. Files are replaced atomically by the operations and a serving
unit keeps its old process until its host's turn to restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paramiko
from pyinfra.api.config import Config
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.host import Host
from pyinfra.api.operations import run_ops
from pyinfra.api.state import State
from pyinfra.context import ctx_host, ctx_state

from fleet.deploy.health import HEALTH_TIMEOUT_S, Endpoint, wait_healthy
from fleet.deploy.preflight import run_preflight
from fleet.deploy.reboot import reboot as reboot_host
from fleet.deploy.restart import RestartStep, restart_serving_hosts
from fleet.errors import FleetError
from fleet.facts.packages import RebootRequired
from fleet.facts.runner import SshTarget, run_command, run_fact_on_hosts
from fleet.facts.unit_states import UnitState, UnitStates
from fleet.inventory.spec import LoadedInventory, load_inventory
from fleet.operations import host as host_deploy
from fleet.operations import vllm as vllm_ops
from fleet.plan.gpu_source import GpusNotKnownYet
from fleet.plan.planner import HostPlan
from fleet.render.escape import ssh_command
from fleet.render.units import HostPaths
from fleet.secrets import redact

Progress = Callable[[str], None]
Step = Callable[[str, str], None]  #: (host, the step it is on)
#: operations whose change means a serving host must restart to take it
RESTART_OPS = ("vLLM units and env files", "current release")
FAILED = ("failed", "unreachable", "refused")


@dataclass
class HostResult:
    host: str
    #: "changed", "unchanged", "would change", "no change", "failed", "unreachable", "refused"
    #: (preflight, or GPUs that differ from the inventory's), "stopped" (not finished: the deploy
    #: stopped at the fail-percent), "waiting" (installed, but NVML does not answer yet: its units
    #: are rendered by a deploy after the driver loads)
    status: str
    operations: list[str] = field(default_factory=list)  #: changed (or, dry, would change)
    error: str | None = None
    reboot_required: list[str] | None = None
    endpoints: list[Endpoint] = field(default_factory=list)
    restarted: bool = False
    note: str | None = None  #: why the host's units wait for its driver

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
        }


@dataclass
class DeployResult:
    dry: bool
    hosts: list[HostResult]
    seconds: float = 0.0
    error: str | None = None  #: why the deploy stopped early, with the way to resume

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
        }


def check_hosts(loaded: LoadedInventory) -> dict[str, HostPlan]:
    """Everything a deploy needs from each host's data, checked before any host is touched.

    Returns the plans from the inventory's ``gpu`` entries (hosts without one: their model is
    checked); the deploy plans each host again from its probe (``_probe_plans``).
    """
    from fleet.model.arch import load_model

    problems: list[str] = []
    plans: dict[str, HostPlan] = {}
    for spec in loaded.hosts:
        data = loaded.pyinfra.get_host(spec.name).data.dict()  # type: ignore[no-untyped-call]
        try:
            host_deploy.driver_settings(spec.name, data)
            host_deploy.releases_kept(spec.name, data)
            host_deploy.release_spec(spec.name, data, "3")
            host_deploy.api_key(spec.name, data)
            if spec.gpu is not None:
                plans[spec.name] = host_deploy.host_plan(spec.name, data)
            else:
                load_model(spec.model, spec.model_config)
        except FleetError as exc:
            problems.append(str(exc))
    if problems:
        raise FleetError("\n".join(problems))
    return plans


def _endpoints(plan: HostPlan, bind: str) -> list[Endpoint]:
    served = plan.model
    return [Endpoint(f"fleet-{i.unit_name}.service", f"http://{bind}:{i.port}", served) for i in plan.instances]


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


def _add_deploy(state: State, func: Callable[..., Any], hosts: list[Host]) -> None:
    """pyinfra's ``add_deploy`` for each host in its own greenlet, so the facts the operations read
    are gathered from all hosts at once (``add_deploy`` alone walks the hosts one after another).
    pyinfra's host context (``pyinfra.context.ctx_host``) is greenlet-local, and an operation's
    order comes from its place in the code, not from when it was prepared. An error in one host's
    data re-raises here."""
    import gevent

    with ctx_state.use(state):  # a process-wide context (not greenlet-local): set once, around all
        greenlets = [gevent.spawn(add_deploy, state, func, host=h) for h in hosts if h in state.activated_hosts]
        gevent.joinall(greenlets)
    for g in greenlets:
        g.get()


@dataclass
class ProbePlans:
    """Each probed host's plan, or why it waits for its driver, or why it is refused."""

    plans: dict[str, HostPlan] = field(default_factory=dict)
    waiting: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def unprobed(self) -> list[str]:
        """Hosts whose NVML did not answer: waiting, or planned from their inventory gpu entry."""
        return [*self.waiting, *(n for n, p in self.plans.items() if p.gpus_source != "probe")]


def _probe_plans(state: State, hosts: list[Host]) -> ProbePlans:
    """Probe the hosts' GPUs, all at once (the ``NvmlProbe`` fact, which the deploy's operations
    then read without a second round trip), and plan each from what it has."""
    import gevent

    with ctx_state.use(state):
        greenlets = [gevent.spawn(host_deploy.probe, h) for h in hosts]
        gevent.joinall(greenlets)
    out = ProbePlans()
    for h, g in zip(hosts, greenlets, strict=True):
        try:
            out.plans[h.name] = host_deploy.host_plan(h.name, h.data.dict(), g.get())  # type: ignore[no-untyped-call]
        except GpusNotKnownYet as exc:
            out.waiting[h.name] = str(exc)
        except FleetError as exc:  # GPUs unlike the inventory's entry, or nothing fits them
            out.refused[h.name] = redact(str(exc))
    return out


def _over(failed: int, total: int, fail_percent: int) -> bool:
    """More than ``fail_percent`` % of ``total`` hosts failed (Ansible's ``max_fail_percentage``)."""
    return total > 0 and failed * 100 > fail_percent * total


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
) -> DeployResult:
    """Deploy ``inventory`` (see the module docstring); errors in the inventory raise first."""
    t0 = time.monotonic()
    loaded = load_inventory(inventory, limit)
    plans = check_hosts(loaded)
    selected = [loaded.pyinfra.get_host(s.name) for s in loaded.hosts]
    state = State(loaded.pyinfra, _config(), initial_limit=selected)
    results: dict[str, HostResult] = {}

    def finish(error: str | None = None) -> DeployResult:
        return DeployResult(dry, [results[h.name] for h in selected], time.monotonic() - t0, error)

    try:
        progress(f"connecting to {len(selected)} host(s)")
        for h in selected:
            step(h.name, "connecting")
        try:
            connect_all(state)
        except PyinfraError as exc:
            raise FleetError(f"no host could be reached ({exc}); check ssh settings and known_hosts") from exc
        for h in selected:
            if h not in state.activated_hosts:
                results[h.name] = HostResult(h.name, "unreachable", error="could not connect over SSH (see the log)")
                step(h.name, "unreachable")
        active = [h for h in selected if h.name not in results]
        if not dry and _over(len(results), len(selected), fail_percent):
            for h in active:
                results[h.name] = HostResult(h.name, "stopped", error="not deployed: the deploy stopped")
            return finish(_stop_message(results, fail_percent))
        progress(f"probing the GPUs of {len(active)} host(s)")
        for h in active:
            step(h.name, "probing GPUs")
        probed = _probe_plans(state, active)
        plans.update(probed.plans)
        waiting, unprobed = probed.waiting, probed.unprobed
        for name, why in probed.refused.items():
            results[name] = HostResult(name, "refused", error=f"{why} (nothing was written to the host)")
            step(name, "refused: GPUs")
        active = [h for h in active if h.name not in results]
        if not dry and _over(len(results), len(selected), fail_percent):
            for h in active:
                results[h.name] = HostResult(h.name, "stopped", error="not deployed: the deploy stopped")
            return finish(_stop_message(results, fail_percent))
        progress("preparing operations")
        for h in active:
            step(h.name, "checking what to change")
        _add_deploy(state, host_deploy.vllm_host, active)
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
                results[h.name] = HostResult(h.name, "failed", error=_failure(state, h))
                step(h.name, "failed")
                continue
            ops = _op_names(state, h, will=False)
            results[h.name] = HostResult(h.name, "changed" if ops else "unchanged", ops)
            results[h.name].reboot_required = h.get_fact(RebootRequired)
            if h.name in waiting:
                results[h.name].status, results[h.name].note = "waiting", waiting[h.name]
    finally:
        _close(state)
    failed = sum(r.status in FAILED for r in results.values())
    if failed:
        for r in results.values():  # lock-step: hosts behind a failure did not finish their operations
            if r.status not in FAILED and _over(failed, len(selected), fail_percent):
                r.status, r.error = "stopped", "not finished: the deploy stopped at the first failures"
    if not start and not _over(failed, len(selected), fail_percent):  # units are installed, not started
        _units_once_probed(loaded, plans, results, _answer_now(unprobed, results), progress, step)
        failed = sum(r.status in FAILED for r in results.values())
    if not start or _over(failed, len(selected), fail_percent):
        return finish(_stop_message(results, fail_percent) if failed else None)
    if reboot:
        _reboot(loaded, results, progress, step)
        failed = sum(r.status in FAILED for r in results.values())
        if _over(failed, len(selected), fail_percent):
            return finish(_stop_message(results, fail_percent))
    _units_once_probed(loaded, plans, results, _answer_now(unprobed, results), progress, step)
    failed = sum(r.status in FAILED for r in results.values())
    if _over(failed, len(selected), fail_percent):
        return finish(_stop_message(results, fail_percent))
    states = _unit_states(loaded, plans, _ready(results))
    quiet = [n for n in _ready(results) if _quiet(states.get(n), results[n])]
    busy = [n for n in _ready(results) if n not in quiet]
    _preflight(loaded, plans, results, busy, progress, step)
    failed = sum(r.status in FAILED for r in results.values())
    if _over(failed, len(selected), fail_percent):
        for r in results.values():
            if r.status not in FAILED:
                r.status, r.error = "stopped", "nothing restarted: the deploy stopped after preflight refusals"
        return finish(_stop_message(results, fail_percent))
    busy = [n for n in busy if results[n].status not in FAILED]
    serving = _start(loaded, plans, results, busy, health_timeout, progress, step)
    # A serving unit restarts when its files are newer than its process (this run's changes, or an
    # earlier run's left pending); a unit started after them (at boot, after --reboot) is current.
    # Without an answer from the host, what this run changed decides.
    stale = {
        n: any(u.stale for u in states[n] or ())
        if states.get(n) is not None
        else any(op in RESTART_OPS for op in results[n].operations)
        for n in serving
    }
    error = _restart(loaded, plans, results, serving, quiet, stale, health_timeout, progress, step, inventory)
    return finish(error)


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
) -> None:
    """Hosts whose NVML did not answer when the run began (their units wait, or were planned
    from the inventory's gpu entry): this run installed the release (nvidia-ml-py for the probe),
    the driver, or rebooted them. Probe again and install their units from what NVML answers now
    (a second pyinfra run: State is single-use); still no answer: they stay as they are."""
    if not names:
        return
    progress(f"probing {len(names)} host(s) again for their units")
    fresh = load_inventory(loaded.path, names)
    hosts = [fresh.pyinfra.get_host(n) for n in names]
    state = State(fresh.pyinfra, _config(), initial_limit=hosts)
    try:
        for name in names:
            step(name, "probing GPUs")
        connect_all(state)
        probed = _probe_plans(state, [h for h in hosts if h in state.activated_hosts])
        for name, why in probed.refused.items():  # its driver answers only now
            written = "units written from the gpu entry before NVML answered, none started"
            results[name].status = "refused"
            results[name].error = f"{why} ({written if name in plans else 'no unit was written'})"
        for name, why in probed.waiting.items():
            results[name].status, results[name].note = "waiting", why
        ready = [h for h in hosts if h.name in probed.plans]
        if not ready:
            return
        for h in ready:
            step(h.name, "installing units")
        _add_deploy(state, host_deploy.vllm_units, ready)
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
            ops = _op_names(state, h, will=False)
            r.operations += ops
            r.note = None
            if ops or r.status == "waiting":
                r.status = "changed"
    finally:
        _close(state)


def _quiet(states: list[UnitState] | None, result: HostResult) -> bool:
    """Nothing to start or restart on the host: every unit active and current, nothing changed."""
    return (
        bool(states)
        and all(u.active and not u.stale for u in states or ())
        and not any(op in RESTART_OPS for op in result.operations)
    )


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
    return HostPaths(venv=f"{vllm_ops.DEFAULT_ROOT}/current")


def _ready(results: dict[str, HostResult]) -> list[str]:
    return [r.host for r in results.values() if r.status in ("changed", "unchanged") and r.reboot_required is None]


def _reboot(loaded: LoadedInventory, results: dict[str, HostResult], progress: Progress, step: Step) -> None:
    """Reboot, one at a time, the hosts whose driver change needs it; then they go on with the deploy."""
    for r in results.values():
        if r.status in FAILED or r.reboot_required is None:
            continue
        target = _target(loaded, r.host)
        progress(f"{r.host}: rebooting ({', '.join(r.reboot_required)})")
        step(r.host, "rebooting")
        try:
            seconds = reboot_host(target, loaded.pyinfra.get_host(r.host).data.dict())  # type: ignore[no-untyped-call]
            rc, _out, _err = run_command(target, ssh_command(["test", "-e", "/var/run/reboot-required"]))
        except (FleetError, paramiko.SSHException, OSError, EOFError) as exc:
            r.status, r.error = "failed", redact(f"reboot: {exc}")
            step(r.host, "reboot failed")
            continue
        if rc == 0:
            r.status, r.error = "failed", "rebooted, but /var/run/reboot-required is still there; check the driver"
            continue
        r.reboot_required, r.status = None, "changed"
        r.operations.append(f"reboot ({seconds:.0f} s)")


def _preflight(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    ready: list[str],
    progress: Progress,
    step: Step,
) -> None:
    """Refuse, per host, what would not start; a refused host is neither started nor restarted."""
    if not ready:
        return
    progress(f"preflight on {len(ready)} host(s)")
    for name in ready:
        step(name, "preflight")
    answers = run_preflight({n: _target(loaded, n) for n in ready}, plans, _paths())
    for name, refusals in answers.items():
        if refusals:
            results[name].status = "refused"
            results[name].error = redact("\n".join(str(r) for r in refusals))
            step(name, "refused by preflight")


def _endpoints_of(loaded: LoadedInventory, plans: dict[str, HostPlan], name: str) -> list[Endpoint]:
    spec = loaded.host(name)
    data = loaded.pyinfra.get_host(name).data.dict()  # type: ignore[no-untyped-call]
    return _endpoints(plans[name], spec.bind_address or str(data.get("ssh_hostname") or name))


def _api_key(loaded: LoadedInventory, name: str) -> str | None:
    return host_deploy.api_key(name, loaded.pyinfra.get_host(name).data.dict())  # type: ignore[no-untyped-call]


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
    fresh = load_inventory(loaded.path, ready)  # pyinfra's Inventory and State are single-use
    hosts = [fresh.pyinfra.get_host(n) for n in ready]
    state = State(fresh.pyinfra, _config(), initial_limit=hosts)
    serving: list[str] = []
    started: list[str] = []
    try:
        for name in ready:
            step(name, "starting units")
        connect_all(state)
        _add_deploy(state, host_deploy.vllm_start, hosts)
        run_ops(state)
        for h in hosts:
            names = _op_names(state, h, will=False)
            if h in state.failed_hosts:
                results[h.name].status = "failed"
                results[h.name].error = _failure(state, h)
            elif names:
                results[h.name].operations += names
                results[h.name].status = "changed"
                started.append(h.name)
            else:
                serving.append(h.name)
    finally:
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
    loaded: LoadedInventory, plans: dict[str, HostPlan], names: list[str]
) -> dict[str, list[UnitState] | None]:
    """Each host's units: active? restart pending (files newer than the process)? None: no answer."""
    if not names:
        return {}
    paths = _paths()

    def units(name: str) -> dict[str, object]:
        return {
            "units": [
                (
                    f"fleet-{i.unit_name}.service",
                    [f"{paths.unit_dir}/fleet-{i.unit_name}.service", f"{paths.env_dir}/{i.unit_name}.env", paths.venv],
                )
                for i in plans[name].instances
            ]
        }

    answers = run_fact_on_hosts([_target(loaded, n) for n in names], UnitStates, args_for=units)
    return {n: a if isinstance(a, list) else None for n, a in answers.items()}


def _restart(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    serving: list[str],
    quiet: list[str],
    stale: dict[str, bool],
    timeout: float,
    progress: Progress,
    step: Step,
    inventory: str,
) -> str | None:
    """Hosts that were serving: restart the changed ones one at a time; check the others serve.

    Changed (``stale``, from ``UnitStates``): their units, env files or release are newer than
    the running processes (this run changed them, or an earlier run did and stopped).
    """
    changed = [n for n in serving if stale.get(n)]
    for name in [*quiet, *serving]:
        if name in changed:
            continue
        endpoints = _endpoints_of(loaded, plans, name)
        step(name, "checking it serves")
        wait_healthy(endpoints, _api_key(loaded, name), timeout)
        results[name].endpoints = endpoints
        step(name, "serving")
    if not changed:
        return None
    progress(f"restarting {len(changed)} serving host(s) one at a time")
    steps = [
        RestartStep(
            name,
            _target(loaded, name),
            [f"fleet-{i.unit_name}.service" for i in plans[name].instances],
            _endpoints_of(loaded, plans, name),
            _api_key(loaded, name),
        )
        for name in changed
    ]
    outcome = restart_serving_hosts(steps, timeout, f"fleet deploy {inventory}", step)
    for s in steps:
        r = results[s.host]
        if s.host in outcome.done:
            r.restarted, r.endpoints = True, s.endpoints
            r.operations.append("restart " + ", ".join(s.units))
        elif s.host == outcome.failed:
            r.status, r.error, r.endpoints = "failed", outcome.error, s.endpoints
        else:
            r.status, r.error = "stopped", "not restarted: the one-at-a-time restart stopped at " + str(outcome.failed)
    return outcome.error
