"""``fleet status`` as a library: one row per planned instance, built from observations.

The HTTP side reads each instance directly: ``/health`` (200 ready, 503 engine dead, connection
refused while loading or stopped: vLLM does not listen until loaded), ``/version``, and two scrapes of
``/metrics`` ``interval`` seconds apart (gauges from the second, rates and percentiles from the
difference: ``fleet.monitor.intervals``). All instances are read in parallel; an instance or host
that cannot be reached is a row that says so, never an exception.

The SSH side (unit state and uptime from systemd, the release each instance runs, GPU memory in use from
NVML) comes from ``fleet.monitor.hoststate`` as :class:`UnitFacts` per instance; without it (a
library caller passing no ``units``) those fields are ``None`` and shown as such. So do a host's
drain marker (``fleet drain``: a drained instance is stopped on purpose, which is no problem) and
what its load balancer says about the instance (``fleet.lb``: UP/DRAIN/MAINT/DOWN and sessions;
an instance that serves but is left out of traffic, not drained, is a problem).

An instance spanning hosts (``fleet.plan.multinode``) is one row: HTTP asks its leader only (the
other nodes run headless: no API server), SSH reads the unit on every node (:class:`NodeState`,
leader first). A node whose unit is not active or whose host cannot be reached makes the whole
instance down, naming the node: vLLM's leader does not listen until every node has joined, and
the death of one node's workers ends the engine on all of them (``MultiprocExecutor``'s worker
monitor, ``vllm/v1/executor/multiproc_executor.py``).
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from fleet.facts.drain import DrainMarker
from fleet.gpuwatch.state import WatchState
from fleet.lb.runtime import ServerView
from fleet.monitor.intervals import IntervalStats, interval_stats
from fleet.monitor.metric_names import MetricNames, names_for
from fleet.monitor.scrape import Scrape, ScrapeError, get_json, http_get, parse_metrics
from fleet.monitor.targets import Target
from fleet.monitor.thresholds import Thresholds


class Health(StrEnum):
    READY = "ready"  #: /health 200
    ENGINE_DEAD = "engine dead"  #: /health 503
    NOT_LISTENING = "not listening"  #: connection refused: loading, stopped or crashed
    UNREACHABLE = "unreachable"  #: timeout, no route, unknown name
    ERROR = "error"  #: answered, but not like vLLM


class State(StrEnum):
    """What an instance is doing, in a word: the status table's state column and ``--json``'s ``state``.

    Decided in one place, :func:`state_of`, from everything observed about the instance (its
    ``/health`` answer and, with SSH facts, its systemd unit). ``Health`` is what HTTP alone says;
    a state may say more (a stopped unit, an engine still loading, a host that answers neither HTTP
    nor SSH), and later observers (a balancer's view, a drain marker) add their words here.
    """

    READY = "ready"  #: /health 200
    LOADING = "loading"  #: the unit runs but vLLM does not listen yet: it listens only once loaded
    RESTARTING = "restarting"  #: the unit waits to be started again after its process exited
    STOPPING = "stopping"  #: the unit is stopping: vLLM drains (its /health stays 200 meanwhile)
    STOPPED = "stopped"  #: the unit is inactive (stopped, or never started)
    FAILED = "failed"  #: the unit failed (systemd gave up on it)
    NO_UNIT = "no unit"  #: the host has no such unit (not deployed there)
    ENGINE_DEAD = "engine dead"  #: /health 503
    NOT_LISTENING = "not listening"  #: connection refused, and no unit facts to say why
    UNREACHABLE = "unreachable"  #: neither HTTP nor (when asked) SSH reaches the host
    ERROR = "error"  #: answered, but not like vLLM
    DRAINED = "drained"  #: its host is out of service for maintenance (``fleet drain``'s marker)
    #: a node of an instance spanning hosts is down (its unit not active, or its host unreachable)
    #: while the leader is up or on its way: the instance cannot serve
    NODE_DOWN = "node down"


@dataclass(frozen=True)
class UnitFacts:
    """What the host's systemd and NVML say about one instance (from the SSH fact runner)."""

    state: str  #: systemd ActiveState/SubState ("active/running"), "not installed" or "unreachable"
    uptime_seconds: float | None
    restarts: int | None  #: systemd NRestarts
    venv: str | None  #: the release directory the instance runs
    gpu_memory_used: int | None  #: bytes, summed over the instance's processes on its GPUs
    #: the release the instance runs: its main process's (a stopped one: what ``current`` selects,
    #: the release it starts next); ``fleet.facts.releases.running_release``
    release: str | None = None
    vllm_version: str | None = None  #: that release's vLLM version
    main_pid: int | None = None
    detail: str = ""  #: why a value is missing (SSH or NVML error)

    @property
    def active(self) -> bool:
        return self.state.startswith("active/")


@dataclass(frozen=True)
class QuarantinedGpu:
    """One of the instance's GPUs the GPU watcher quarantined (``fleet.gpuwatch.state``): the first
    critical event since the GPU's last ``fleet gpu clear``."""

    gpu: int  #: NVML index
    uuid: str
    kind: str  #: xid, dbe (``fleet.gpuwatch.catalog.KINDS``)
    xid: int | None
    action: str  #: what NVIDIA's XID catalogue says to do (``fleet.gpuwatch.catalog.ACTIONS``)
    since: float  #: the event's time, seconds since the epoch (the host's clock)
    meaning: str

    def describe(self, host: str) -> str:
        what = f"XID {self.xid}" if self.kind == "xid" else self.kind.upper()
        when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(self.since))
        return (
            f"GPU {self.gpu} quarantined since {when}: {what} ({self.action}); after repair: "
            f"fleet gpu clear INVENTORY {host} {self.gpu} --why TEXT"
        )

    def data(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "uuid": self.uuid, "kind": self.kind, "xid": self.xid, "action": self.action,
                "since": self.since, "meaning": self.meaning}  # fmt: skip


def quarantined_gpus(gpus: tuple[int, ...], watch: WatchState | None) -> tuple[QuarantinedGpu, ...]:
    """The quarantined GPUs among ``gpus`` (an instance's) in a host's watcher record (pure)."""
    if watch is None or not watch.ok:
        return ()
    out = []
    for g in watch.gpus:
        e = g.quarantine
        if e is not None and g.index is not None and g.index in gpus:
            out.append(QuarantinedGpu(g.index, g.uuid, e.kind, e.xid, e.action, e.at, e.meaning))
    return tuple(sorted(out, key=lambda q: q.gpu))


@dataclass(frozen=True)
class NodeState:
    """One node of an instance spanning hosts, as its host's systemd says (None: not read)."""

    host: str
    rank: int  #: vLLM's ``--node-rank``; 0 leads
    unit: UnitFacts | None = None
    #: its GPUs the GPU watcher of its host quarantined (the leader's are the row's ``quarantine``)
    quarantine: tuple[QuarantinedGpu, ...] = ()

    @property
    def down(self) -> bool:
        """Its unit is not active, or its host cannot be reached (unknown without SSH facts: not down)."""
        return self.unit is not None and not self.unit.active

    def why_down(self, unit_name: str) -> str:
        assert self.unit is not None
        where = f"node {self.rank} ({self.host})"
        if self.unit.state == "unreachable":
            return f"{where} down: host unreachable over SSH: {self.unit.detail}"
        return f"{where} down: unit {unit_name} is {self.unit.state}"


@dataclass(frozen=True)
class HeldModel:
    """One model repository in a host's Hugging Face cache (``fleet.facts.hub``'s listing)."""

    model: str  #: ``ORG/NAME``, from the cache folder's name
    bytes: int  #: every file under its folder, each once (a copy being staged included)
    snapshot: str | None  #: the revision its ``refs/main`` names (None: none)
    staging: bool  #: a copy is being staged into it (``fleet stage``)

    def data(self) -> dict[str, Any]:
        return {"model": self.model, "bytes": self.bytes, "snapshot": self.snapshot, "staging": self.staging}


@dataclass(frozen=True)
class HostModels:
    """What one host's units' cache holds, or why that could not be read (``error``)."""

    host: str
    models: tuple[HeldModel, ...] = ()
    error: str = ""  #: why the listing could not be read (unreachable host, no sudo, ...)

    def data(self) -> dict[str, Any]:
        return {"host": self.host, "models": [m.data() for m in self.models], "models_error": self.error or None}


@dataclass(frozen=True)
class InstanceStatus:
    target: Target
    health: Health
    detail: str = ""  #: why, when not ready
    version: str | None = None  #: what /version answers
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    interval: IntervalStats | None = None
    unit: UnitFacts | None = None
    problems: tuple[str, ...] = field(default=())
    drained: DrainMarker | None = None  #: its host is drained for maintenance (``fleet drain``)
    lb: ServerView | None = None  #: what its load balancer says (None: none in front of it, or not asked)
    lb_error: str = ""  #: why its load balancer could not be asked
    quarantine: tuple[QuarantinedGpu, ...] = ()  #: its GPUs the GPU watcher quarantined
    #: an instance spanning hosts: every node, leader first (the leader's unit is ``unit``); else empty
    nodes: tuple[NodeState, ...] = ()

    @property
    def ok(self) -> bool:
        """Serving as it should; a drained instance is out of service on purpose."""
        return (self.health is Health.READY or self.drained is not None) and not self.problems

    @property
    def down_nodes(self) -> tuple[NodeState, ...]:
        """The nodes other than the leader that are down (the leader's own state is ``state``'s)."""
        return tuple(n for n in self.nodes if n.rank > 0 and n.down)

    @property
    def state(self) -> State:
        return state_of(self.health, self.unit, drained=self.drained is not None, node_down=bool(self.down_nodes))


# -- pure pieces ------------------------------------------------------------------------------------


def classify_error(exc: BaseException) -> tuple[Health, str]:
    """Connection refused → not listening; anything else network-level → unreachable."""
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ConnectionRefusedError):
        return Health.NOT_LISTENING, "connection refused (loading, stopped or crashed)"
    if isinstance(reason, socket.timeout | TimeoutError):
        return Health.UNREACHABLE, "timed out"
    if isinstance(reason, socket.gaierror):
        return Health.UNREACHABLE, f"name does not resolve: {reason}"
    return Health.UNREACHABLE, str(reason)


#: The leader's own states that say more than "a node is down" (it is stopped, gone or unreachable
#: itself, or stopping on purpose): shown as they are, the down node named among the problems.
LEADER_SAYS_MORE = frozenset({State.STOPPED, State.FAILED, State.NO_UNIT, State.UNREACHABLE, State.STOPPING})


def state_of(health: Health, unit: UnitFacts | None, drained: bool = False, node_down: bool = False) -> State:
    """The state column's word (pure, table-tested): ``/health`` first, systemd to say why not.

    vLLM binds its port before it loads the model but calls ``listen()`` only once the engine is
    up (vLLM 0.33 ``vllm/entrypoints/launchers/api_server/entry.py`` ``run_server`` →
    ``launcher.py`` ``setup_server``, then ``serve_http``), so a refused connection from an instance
    whose unit is running means it is still loading; from a stopped, failed or restarting unit it
    means just that (systemd's ActiveState/SubState, org.freedesktop.systemd1(5)). A unit that is
    stopping is "stopping" even while ``/health`` still answers 200: vLLM keeps it 200 during its
    ``--shutdown-timeout`` drain (``AsyncLLM.shutdown`` in ``vllm/v1/engine/async_llm.py``) while new
    requests fail. An instance of a host drained for maintenance (``fleet drain``) is "drained",
    whatever it does: it is out of service on purpose.

    ``node_down``: a node of an instance spanning hosts other than its leader is down. Unless the
    leader's own state says more (:data:`LEADER_SAYS_MORE`), the instance is "node down": its
    leader may still answer 200 for a moment or wait for the node to join, but cannot serve.
    """
    if drained:
        return State.DRAINED
    if node_down:
        own = state_of(health, unit)
        return own if own in LEADER_SAYS_MORE else State.NODE_DOWN
    if unit is not None and unit.state.startswith("deactivating/"):
        return State.STOPPING
    if health is Health.READY:
        return State.READY
    if health is Health.ENGINE_DEAD:
        return State.ENGINE_DEAD
    if health is Health.ERROR:
        return State.ERROR
    unreachable = State.UNREACHABLE if health is Health.UNREACHABLE else State.NOT_LISTENING
    if unit is None or unit.state == "unreachable":
        return unreachable  # nothing from systemd to say why
    if unit.state == "not installed":
        return State.NO_UNIT
    active, _, sub = unit.state.partition("/")
    if sub == "auto-restart":
        return State.RESTARTING
    if active == "failed":
        return State.FAILED
    if active == "inactive":
        return State.STOPPED
    if active in ("active", "activating", "reloading"):
        return State.LOADING if health is Health.NOT_LISTENING else State.UNREACHABLE
    return unreachable


def problems_of(status: InstanceStatus, th: Thresholds) -> tuple[str, ...]:
    """The alert thresholds this row breaks right now (same numbers as the alert rules)."""
    out = []
    expected = status.target.expected_version
    if status.version is not None and not status.version.startswith(expected):
        out.append(f"runs vLLM {status.version}, inventory pins {expected}")
    if status.kv_usage is not None and status.kv_usage > th.kv_cache_usage:
        out.append(f"KV cache {status.kv_usage:.0%} > {th.kv_cache_usage:.0%}")
    if status.waiting is not None and status.waiting > th.waiting_requests:
        out.append(f"{status.waiting:g} waiting > {th.waiting_requests}")
    iv = status.interval
    if iv is not None:
        ratio = iv.preemptions_per_request
        if ratio is not None and ratio > th.preemption_ratio:
            out.append(f"preemptions {ratio:.1%} of requests > {th.preemption_ratio:.0%}")
        for label, q, limit in (
            ("e2e p99", iv.e2e_p99, th.e2e_p99_seconds),
            ("TTFT p99", iv.ttft_p99, th.ttft_p99_seconds),
        ):
            if q is not None and q.value is not None and q.value > limit:
                out.append(f"{label} {q.value:.2f}s > {limit:g}s")
    unit = status.unit
    if unit is not None:
        if unit.state == "unreachable":
            out.append(f"host unreachable over SSH: {unit.detail}")
        elif not unit.active and status.drained is None:
            out.append(f"unit {status.target.unit} is {unit.state}")
        if unit.restarts is not None and unit.restarts > th.restarts:
            out.append(f"unit restarted {unit.restarts} times")
    for node in status.nodes[1:]:
        if node.down and status.drained is None:
            out.append(node.why_down(status.target.unit))
        if node.unit is not None and node.unit.restarts is not None and node.unit.restarts > th.restarts:
            out.append(f"node {node.rank} ({node.host}): unit restarted {node.unit.restarts} times")
        out += [f"node {node.rank} ({node.host}): {q.describe(node.host)}" for q in node.quarantine]
    out += [q.describe(status.target.host) for q in status.quarantine]
    if status.lb_error:
        out.append(f"load balancer: {status.lb_error}")
    elif (
        status.lb is not None and status.drained is None and status.health is Health.READY and not status.lb.in_traffic
    ):
        out.append(
            f"serving but out of its balancer's traffic ({status.lb.view}, {status.lb.admin.value}): "
            f"fleet lb ready INVENTORY {status.target.instance}"
        )
    return tuple(out)


def from_scrapes(
    target: Target,
    health: Health,
    detail: str,
    version: str | None,
    first: Scrape | None,
    second: Scrape | None,
    names: MetricNames,
    th: Thresholds,
    unit: UnitFacts | None = None,
) -> InstanceStatus:
    """One row from what was observed (pure)."""
    latest = second or first
    status = InstanceStatus(
        target=target,
        health=health,
        detail=detail,
        version=version,
        kv_usage=latest.value(names.kv_cache_usage) if latest else None,
        running=latest.value(names.running) if latest else None,
        waiting=latest.value(names.waiting) if latest else None,
        interval=interval_stats(first, second, names) if first and second else None,
        unit=unit,
        nodes=_nodes(target, {target.instance: unit} if unit is not None else {}),
    )
    return _with_problems(status, th)


def _nodes(target: Target, units: Mapping[str, UnitFacts]) -> tuple[NodeState, ...]:
    """Every node of an instance spanning hosts with its unit facts (by ``host/vllm-N``); () otherwise."""
    return tuple(NodeState(h, r, units.get(target.node_instance(h))) for r, h in enumerate(target.nodes))


def _with_problems(status: InstanceStatus, th: Thresholds) -> InstanceStatus:
    return replace(status, problems=problems_of(status, th))


def attach_host_state(
    rows: list[InstanceStatus],
    drained: Mapping[str, DrainMarker],
    lb: Mapping[str, ServerView | str],
    thresholds: Mapping[str, Thresholds] | None = None,
    watch: Mapping[str, WatchState] | None = None,
) -> list[InstanceStatus]:
    """The rows with their host's drain marker (by host; an instance spanning hosts: its leader's,
    else the first of its nodes' that has one), their balancer's view (by instance, ``host/vllm-N``;
    a string: why the balancer could not be asked) and their quarantined GPUs (by host: its GPU
    watcher record) filled in, problems recomputed (pure)."""
    thresholds = thresholds or {}
    out = []
    for r in rows:
        seen = lb.get(r.target.instance)
        marker = next((m for h in r.target.node_hosts if (m := drained.get(h)) is not None), None)
        row = replace(
            r,
            drained=marker,
            lb=seen if isinstance(seen, ServerView) else None,
            lb_error=seen if isinstance(seen, str) else "",
            quarantine=quarantined_gpus(r.target.gpus, (watch or {}).get(r.target.host)),
            nodes=tuple(
                replace(n, quarantine=quarantined_gpus(r.target.gpus, (watch or {}).get(n.host))) if n.rank else n
                for n in r.nodes
            ),
        )
        out.append(_with_problems(row, thresholds.get(r.target.host, Thresholds())))
    return out


def attach_units(
    rows: list[InstanceStatus], units: Mapping[str, UnitFacts], thresholds: Mapping[str, Thresholds] | None = None
) -> list[InstanceStatus]:
    """The rows with each instance's SSH facts (an instance spanning hosts: each node's, by
    ``host/vllm-N``) filled in and its problems recomputed (pure)."""
    thresholds = thresholds or {}
    th = Thresholds()
    out = []
    for r in rows:
        unit = units.get(r.target.instance, r.unit)
        known = {r.target.node_instance(n.host): n.unit for n in r.nodes if n.unit is not None}
        known.update(units)
        if unit is not None:
            known[r.target.instance] = unit
        row = replace(r, unit=unit, nodes=_nodes(r.target, known))
        out.append(_with_problems(row, thresholds.get(r.target.host, th)))
    return out


# -- I/O ----------------------------------------------------------------------------------------------


@dataclass
class _Probe:
    target: Target
    health: Health = Health.READY
    detail: str = ""
    version: str | None = None
    first: Scrape | None = None
    second: Scrape | None = None


def _first(probe: _Probe, timeout: float, clock: Callable[[], float]) -> None:
    url = probe.target.url
    try:
        code, _ = http_get(url + "/health", timeout)
    except OSError as exc:
        probe.health, probe.detail = classify_error(exc)
        return
    if code == 503:
        probe.health, probe.detail = Health.ENGINE_DEAD, "/health 503: the engine died"
    elif code != 200:
        probe.health, probe.detail = Health.ERROR, f"/health answered HTTP {code}"
    try:
        data = get_json(url + "/version", timeout)
        probe.version = str(data.get("version")) if isinstance(data, dict) else None
    except (OSError, ScrapeError):
        probe.version = None
    probe.first = _scrape(probe, timeout, clock)


def _scrape(probe: _Probe, timeout: float, clock: Callable[[], float]) -> Scrape | None:
    try:
        code, body = http_get(probe.target.url + "/metrics", timeout)
        if code != 200:
            raise ScrapeError(f"/metrics answered HTTP {code}")
        families = names_for(probe.target.vllm_version, probe.target.host).status_families
        return parse_metrics(body.decode("utf-8", "replace"), clock(), families)
    except (OSError, ScrapeError) as exc:
        if probe.health is Health.READY:
            probe.health, probe.detail = Health.ERROR, f"/metrics: {exc}"
        return None


def collect(
    targets: list[Target],
    thresholds: Mapping[str, Thresholds] | None = None,
    interval: float = 2.0,
    timeout: float = 3.0,
    units: Mapping[str, UnitFacts] | None = None,
    previous: Mapping[str, Scrape] | None = None,
    clock: Callable[[], float] = time.monotonic,
    workers: int = 64,
) -> tuple[list[InstanceStatus], dict[str, Scrape]]:
    """Observe every target in parallel: rows in target order, and each instance's latest scrape.

    ``previous`` (instance → its last scrape, e.g. from a ``--watch`` loop) replaces the first
    scrape, so a watch loop reads each instance once per refresh.
    """
    thresholds = thresholds or {}
    probes = [_Probe(t) for t in targets]
    started = clock()
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(probes)))) as pool:
        list(pool.map(lambda p: _first(p, timeout, clock), probes))
        if previous is None:
            time.sleep(max(0.0, interval - (clock() - started)))
            list(pool.map(lambda p: _second(p, timeout, clock), [p for p in probes if p.first is not None]))
    rows = []
    latest: dict[str, Scrape] = {}
    for p in probes:
        first, second = p.first, p.second
        if previous is not None:
            first, second = previous.get(p.target.instance), p.first
            if first is not None and second is not None and second.at <= first.at:
                first = None
        names = names_for(p.target.vllm_version, p.target.host)
        th = thresholds.get(p.target.host, Thresholds())
        unit = (units or {}).get(p.target.instance)
        rows.append(from_scrapes(p.target, p.health, p.detail, p.version, first, second, names, th, unit))
        if second or first:
            latest[p.target.instance] = second or first  # type: ignore[assignment]
    return rows, latest


def _second(probe: _Probe, timeout: float, clock: Callable[[], float]) -> None:
    probe.second = _scrape(probe, timeout, clock)


# -- --json -------------------------------------------------------------------------------------------


def _q(q: Any) -> dict[str, Any] | None:
    if q is None or q.value is None:
        return None
    return {
        "seconds": round(q.value, 4),
        "bucket": [q.lower, None if math.isinf(q.upper) else q.upper],
        "requests": q.count,
    }


def status_data(row: InstanceStatus) -> dict[str, Any]:
    t = row.target
    iv = row.interval
    data: dict[str, Any] = {
        "host": t.host,
        "group": t.group,
        "instance": t.instance,
        "url": t.url,
        "model": t.model,
        "pinned_vllm_version": t.vllm_version,
        "expected_vllm_version": t.expected_version,
        "vllm_version": row.version,
        "state": row.state.value,
        "health": row.health.value,
        "detail": row.detail,
        "kv_cache_usage": row.kv_usage,
        "requests_running": row.running,
        "requests_waiting": row.waiting,
        "interval": None
        if iv is None
        else {
            "seconds": round(iv.seconds, 3),
            "requests_finished": iv.finished,
            "preemptions": iv.preemptions,
            "preemptions_per_request": iv.preemptions_per_request
            if iv.preemptions_per_request is None or not math.isinf(iv.preemptions_per_request)
            else "inf",
            "generation_tokens_per_second": round(iv.generation_tokens_per_second, 2),
            "ttft_p50": _q(iv.ttft_p50),
            "ttft_p99": _q(iv.ttft_p99),
            "e2e_p50": _q(iv.e2e_p50),
            "e2e_p99": _q(iv.e2e_p99),
        },
        "unit": _unit_data(row.unit),
        "drained": None if row.drained is None else row.drained.data(),
        "balancer": None
        if row.lb is None and not row.lb_error
        else {
            "view": row.lb.view if row.lb else None,
            "admin": row.lb.admin.value if row.lb else None,
            "status": row.lb.status if row.lb else None,
            "sessions": row.lb.sessions if row.lb else None,
            "queued": row.lb.queued if row.lb else None,
            "backend": row.lb.backend if row.lb else None,
            "server": row.lb.server if row.lb else None,
            "error": row.lb_error or None,
        },
        "quarantine": [q.data() for q in row.quarantine],
        "problems": list(row.problems),
        "ok": row.ok,
    }
    if row.nodes:  # an instance spanning hosts (absent otherwise)
        data["nodes"] = [
            {"host": n.host, "rank": n.rank, "leader": n.rank == 0, "headless": n.rank > 0,
             "unit": _unit_data(n.unit), "down": n.down, "quarantine": [q.data() for q in n.quarantine]}
            for n in row.nodes
        ]  # fmt: skip
    return data


def _unit_data(unit: UnitFacts | None) -> dict[str, Any] | None:
    if unit is None:
        return None
    return {
        "state": unit.state,
        "uptime_seconds": unit.uptime_seconds,
        "restarts": unit.restarts,
        "venv": unit.venv,
        "release": unit.release,
        "installed_vllm_version": unit.vllm_version,
        "main_pid": unit.main_pid,
        "gpu_memory_used_bytes": unit.gpu_memory_used,
        "detail": unit.detail,
    }
