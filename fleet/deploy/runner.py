"""Run the deploy of ``fleet.operations.host`` on an inventory through pyinfra's API.

Order: validate every selected host's data and plan (errors for all hosts at once, before any
host is touched); connect (strict host keys, as the inventory says); prepare the operations
(pyinfra runs each generator up to its first command: that is ``--dry``'s answer, per host and
operation); execute in pyinfra's lock-step mode; then, first deploy only, start units that are
not running and wait, from this machine, until each instance's ``/health`` answers 200 and
``/v1/models`` lists the served model. A host that needs a reboot is reported and not started.

This is the first cut (issue 12): a fleet that is already serving gets its files and releases
updated but no restart; the restart goes through the rolling engine, which does not exist yet.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api.config import Config
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.host import Host
from pyinfra.api.operations import run_ops
from pyinfra.api.state import State
from pyinfra.context import ctx_host, ctx_state

from fleet.errors import FleetError
from fleet.facts.packages import RebootRequired
from fleet.inventory.spec import LoadedInventory, load_inventory
from fleet.operations import host as host_deploy
from fleet.plan.planner import HostPlan

Progress = Callable[[str], None]
HEALTH_TIMEOUT_S = 300.0


@dataclass
class Endpoint:
    unit: str
    url: str
    model: str
    healthy: bool = False
    detail: str = ""


@dataclass
class HostResult:
    host: str
    status: str  #: "changed", "unchanged", "would change", "no change", "failed", "unreachable"
    operations: list[str] = field(default_factory=list)  #: changed (or, dry, would change)
    error: str | None = None
    reboot_required: list[str] | None = None
    endpoints: list[Endpoint] = field(default_factory=list)

    def data(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "status": self.status,
            "operations": self.operations,
            "error": self.error,
            "reboot_required": self.reboot_required,
            "endpoints": [e.__dict__ for e in self.endpoints],
        }


@dataclass
class DeployResult:
    dry: bool
    hosts: list[HostResult]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(h.status not in ("failed", "unreachable") for h in self.hosts) and all(
            e.healthy for h in self.hosts for e in h.endpoints
        )

    def data(self) -> dict[str, Any]:
        return {
            "dry": self.dry,
            "ok": self.ok,
            "seconds": round(self.seconds, 2),
            "hosts": [h.data() for h in self.hosts],
        }


def check_hosts(loaded: LoadedInventory) -> dict[str, HostPlan]:
    """Everything a deploy needs from each host's data, checked before any host is touched."""
    problems: list[str] = []
    plans: dict[str, HostPlan] = {}
    for spec in loaded.hosts:
        data = loaded.pyinfra.get_host(spec.name).data.dict()  # type: ignore[no-untyped-call]
        try:
            host_deploy.driver_settings(spec.name, data)
            host_deploy.releases_kept(spec.name, data)
            host_deploy.release_spec(spec.name, data, "3")
            plans[spec.name] = host_deploy.host_plan(spec.name, data)
        except FleetError as exc:
            problems.append(str(exc))
    if problems:
        raise FleetError("\n".join(problems))
    return plans


def _endpoints(plan: HostPlan, bind: str) -> list[Endpoint]:
    served = plan.model
    return [Endpoint(f"fleet-{i.unit_name}.service", f"http://{bind}:{i.port}", served) for i in plan.instances]


def _get(url: str, key: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_healthy(endpoints: list[Endpoint], key: str | None, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Poll each endpoint until ``/health`` is 200 and ``/v1/models`` lists its model, or time out."""
    deadline = time.monotonic() + timeout
    for e in endpoints:
        while True:
            status, _ = _get(e.url + "/health", key)
            if status == 200:
                status, body = _get(e.url + "/v1/models", key)
                try:
                    ids = [m.get("id") for m in json.loads(body or b"{}").get("data", [])]
                except ValueError:
                    ids = []
                if status == 200 and ids:
                    e.healthy, e.detail = True, "serving " + ", ".join(map(str, ids))
                    break
            if time.monotonic() > deadline:
                e.detail = f"no healthy answer within {timeout:.0f} s (last status {status or 'refused'})"
                break
            time.sleep(1.0)


def _config() -> Config:
    return Config(SUDO=True, CONNECT_TIMEOUT=15)  # type: ignore[no-untyped-call]


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
) -> DeployResult:
    """Deploy ``inventory`` (see the module docstring); errors in the inventory raise first."""
    t0 = time.monotonic()
    loaded = load_inventory(inventory, limit)
    plans = check_hosts(loaded)
    selected = [loaded.pyinfra.get_host(s.name) for s in loaded.hosts]
    state = State(loaded.pyinfra, _config(), initial_limit=selected)
    results: dict[str, HostResult] = {}
    try:
        progress(f"connecting to {len(selected)} host(s)")
        try:
            connect_all(state)
        except PyinfraError as exc:
            raise FleetError(f"no host could be reached ({exc}); check ssh settings and known_hosts") from exc
        for h in selected:
            if h not in state.activated_hosts:
                results[h.name] = HostResult(h.name, "unreachable", error="could not connect (see the log above)")
        progress("preparing operations")
        add_deploy(state, host_deploy.vllm_host)
        active = [h for h in selected if h.name not in results]
        if dry:
            for h in active:
                ops = _op_names(state, h, will=True)
                results[h.name] = HostResult(h.name, "would change" if ops else "no change", ops)
            return DeployResult(True, [results[h.name] for h in selected], time.monotonic() - t0)
        progress("running operations")
        try:
            run_ops(state)
        except PyinfraError as exc:  # every host failed: each is reported below
            progress(f"pyinfra: {exc}")
        for h in active:
            if h in state.failed_hosts:
                results[h.name] = HostResult(h.name, "failed", error="an operation failed (see the log above)")
                continue
            ops = _op_names(state, h, will=False)
            results[h.name] = HostResult(h.name, "changed" if ops else "unchanged", ops)
            results[h.name].reboot_required = h.get_fact(RebootRequired)
    finally:
        _close(state)
    if start:
        _start(loaded, plans, results, health_timeout, progress)
    return DeployResult(False, [results[h.name] for h in selected], time.monotonic() - t0)


def _start(
    loaded: LoadedInventory,
    plans: dict[str, HostPlan],
    results: dict[str, HostResult],
    timeout: float,
    progress: Progress,
) -> None:
    """Start units (first deploy) on hosts that are ready, then wait for their health."""
    ready = [r.host for r in results.values() if r.status in ("changed", "unchanged") and r.reboot_required is None]
    if not ready:
        return
    fresh = load_inventory(loaded.path, ready)  # pyinfra's Inventory and State are single-use
    hosts = [fresh.pyinfra.get_host(n) for n in ready]
    state = State(fresh.pyinfra, _config(), initial_limit=hosts)
    try:
        connect_all(state)
        add_deploy(state, host_deploy.vllm_start)
        run_ops(state)
        for h in hosts:
            started = _op_names(state, h, will=False)
            if started:
                results[h.name].operations += started
                results[h.name].status = "changed"
            elif h in state.failed_hosts:
                results[h.name].status = "failed"
                results[h.name].error = "starting the units failed (see the log above)"
    finally:
        _close(state)
    for name in ready:
        spec = loaded.host(name)
        data = loaded.pyinfra.get_host(name).data.dict()  # type: ignore[no-untyped-call]
        endpoints = _endpoints(plans[name], spec.bind_address or str(data.get("ssh_hostname") or name))
        progress(f"{name}: waiting for {len(endpoints)} instance(s) to be healthy")
        wait_healthy(endpoints, host_deploy.api_key(name, data), timeout)
        results[name].endpoints = endpoints
