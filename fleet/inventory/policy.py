"""The rollout policy: typed, validated, with defaults; read from inventory data plus CLI overrides.

Its grammar lives with the inventory's validation (``fleet.inventory.spec`` checks the ``rollout``
key of every host with the rest of its data); the engine reads the parsed value
(``fleet.rollout.policy`` re-exports it).

The vocabulary is borrowed where it exists:

* ``batches`` is Ansible's ``serial`` (an int, ``"N%"`` of all units, or ``-1`` for "the rest";
  the last entry repeats; the first batch is the canary). Ansible docs, "Controlling playbook
  execution: strategies and more", *Setting the batch size with serial*.
* ``max_unavailable`` is Kubernetes' ``rollingUpdate.maxUnavailable`` (count or percent, floored),
  except that it counts every instance not serving, including ones that were sick before we came.
* ``soak_s`` is Nomad's ``min_healthy_time`` / Kubernetes' ``minReadySeconds``: all gates green
  continuously for this long; any failure resets it. ``host_deadline_s`` and
  ``progress_deadline_s`` are Nomad's ``healthy_deadline`` and ``progress_deadline``, ordered as
  Nomad's ``UpdateStrategy.Validate`` orders them.
* ``on_failure``: ``rollback`` (the failed batch goes back to its previous release, then the rollout
  halts) or ``halt`` (stop where we are).

Inventory data, under the key ``rollout`` (group or host data)::

    rollout = {
        "batches": [1, 2, "25%"],
        "unit": "instance",              # or "host"
        "max_unavailable": "25%",
        "soak_s": 30,
        "canary_bake_s": 0,
        "host_deadline_s": 1800,
        "progress_deadline_s": 3600,
        "drain_timeout_s": 120,
        "gpu_free_timeout_s": 30,
        "probe_interval_s": 2,
        "probe_timeout_s": 10,
        "unreachable_timeout_s": 10,
        "orphans": "stop",               # or "fail"
        "on_failure": "rollback",        # or "halt"
        "timeouts": {"unit": 60, "health": 1200, "models": 60, "completion": 120, "metrics": 120},
        "completion": {"prompt": "Reply with OK.", "max_tokens": 4},
        "metrics": [{"name": "vllm:num_requests_waiting", "max": 64}],
        "hooks": {"drain": "lbctl disable {host}:{port}", "undrain": "lbctl enable {host}:{port}",
                  "timeout_s": 60, "on": "control"},   # or "host": run on the instance's host
        "whole_host": False,
    }
"""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from fleet.errors import FleetError

#: A batch size: an int ≥ 1, -1 ("all the rest", Ansible's ``serial`` ≤ 0), or "N%" with 1 ≤ N ≤ 100.
Size = int | str


@dataclass(frozen=True)
class PolicyProblem:
    """One invalid rollout setting: where it came from, the field, the value and what is allowed."""

    source: str  #: the inventory file, or "command line"
    where: str  #: "group all", "host gpu01", or "--batches"
    field: str
    value: object
    allowed: str

    def __str__(self) -> str:
        return f"{self.source}: {self.where}: {self.field}={self.value!r}: {self.allowed}"


class PolicyError(FleetError):
    """Invalid rollout settings; every problem is listed at once, before any host is touched."""

    def __init__(self, problems: list[PolicyProblem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


POLICY_KEY = "rollout"
GATE_NAMES = ("unit", "health", "models", "completion", "metrics")
HOOK_FIELDS = ("host", "instance", "port")
_PCT = re.compile(r"^([0-9]{1,3})%$")


class OnFailure(StrEnum):
    ROLLBACK = "rollback"
    HALT = "halt"


class BatchUnit(StrEnum):
    INSTANCE = "instance"
    HOST = "host"


class OrphanPolicy(StrEnum):
    STOP = "stop"
    FAIL = "fail"


class HookPlace(StrEnum):
    """Where drain/undrain hooks run."""

    CONTROL = "control"  #: on the machine running fleet (e.g. a load balancer's API or CLI)
    HOST = "host"  #: on the instance's host, over the rollout's SSH connection, as the SSH user


@dataclass(frozen=True)
class MetricThreshold:
    """A bound on a ``/metrics`` value (summed over the series that match ``labels``)."""

    name: str
    min: float | None = None
    max: float | None = None
    labels: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        sel = ",".join(f'{k}="{v}"' for k, v in self.labels)
        shown = f"{self.name}{{{sel}}}" if sel else self.name
        bounds = []
        if self.min is not None:
            bounds.append(f">= {self.min:g}")
        if self.max is not None:
            bounds.append(f"<= {self.max:g}")
        return f"{shown} {' and '.join(bounds)}"


@dataclass(frozen=True)
class Hooks:
    """Commands run around each instance's restart (argv, never a shell): on the control machine,
    or (``on: host``) on the instance's host, e.g. to reach a load balancer's local admin socket
    (HAProxy's ``disable server`` on its stats socket)."""

    drain: tuple[str, ...] | None = None
    undrain: tuple[str, ...] | None = None
    timeout_s: float = 60.0
    on: HookPlace = HookPlace.CONTROL

    def argv(self, which: str, *, host: str, instance: str, port: int) -> list[str] | None:
        """The hook's argv with ``{host}``, ``{instance}``, ``{port}`` filled in, each within its argument."""
        template = self.drain if which == "drain" else self.undrain
        if template is None:
            return None
        return [arg.format(host=host, instance=instance, port=port) for arg in template]


@dataclass(frozen=True)
class GateTimeouts:
    """How long each gate may take, counted from the moment every gate before it first passed."""

    unit: float = 60.0
    health: float = 1200.0  #: model load: vLLM does not listen until loaded (SkyServe allows 1200 s)
    models: float = 60.0
    completion: float = 120.0
    metrics: float = 120.0

    def of(self, gate: str) -> float:
        value: float = getattr(self, gate)
        return value


@dataclass(frozen=True)
class CompletionProbe:
    prompt: str = "Reply with OK."
    max_tokens: int = 4


@dataclass(frozen=True)
class RolloutPolicy:
    batches: tuple[Size, ...] = (1, "25%")
    unit: BatchUnit = BatchUnit.INSTANCE
    max_unavailable: Size = "25%"
    whole_host: bool = False  #: allow a batch to take every instance of a host at once
    soak_s: float = 30.0
    canary_bake_s: float = 0.0  #: after the canary batch is back in traffic, watch its gates this long
    host_deadline_s: float = 1800.0
    progress_deadline_s: float = 3600.0
    drain_timeout_s: float = 120.0
    gpu_free_timeout_s: float = 30.0
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 10.0
    #: seconds a host may stay unreachable (since it was last heard from) before the engine decides
    #: for its instances: fail one it is restarting, skip one it has not touched, or halt when the
    #: budget cannot spare them
    unreachable_timeout_s: float = 10.0
    orphans: OrphanPolicy = OrphanPolicy.STOP
    on_failure: OnFailure = OnFailure.ROLLBACK
    timeouts: GateTimeouts = field(default_factory=GateTimeouts)
    completion: CompletionProbe = field(default_factory=CompletionProbe)
    metrics: tuple[MetricThreshold, ...] = ()
    hooks: Hooks = field(default_factory=Hooks)


#: Every key the policy reads (for the inventory schema), with a one-line meaning.
POLICY_KEYS: dict[str, str] = {
    "batches": 'list of int >= 1, "N%" (1-100) or -1 (the rest); the last repeats; the first is the canary',
    "unit": '"instance" (default) or "host": what a batch counts',
    "max_unavailable": 'int >= 1 or "N%": instances not serving at any time, counting ones already sick',
    "whole_host": "true lets a batch take every instance of a host at once (default false)",
    "soak_s": "seconds all gates must stay green; any failure resets it",
    "canary_bake_s": "seconds the canary batch is watched after its undrain hook; any failed gate fails it",
    "host_deadline_s": "seconds from an instance's first step to healthy-and-soaked",
    "progress_deadline_s": "seconds without any instance finishing before the rollout halts",
    "drain_timeout_s": "seconds to wait for in-flight requests to reach 0 before SIGTERM",
    "gpu_free_timeout_s": "seconds after stop for the instance's GPUs to be free",
    "probe_interval_s": "seconds between gate probes",
    "probe_timeout_s": "seconds one HTTP probe may take",
    "unreachable_timeout_s": "seconds a host may stay unreachable (since last heard from) before the engine "
    "decides: fail the instance it restarts there, skip ones it has not touched, or halt",
    "orphans": '"stop" (stop engines left holding the GPUs by the stopped unit) or "fail"',
    "on_failure": '"rollback" (the failed batch, then halt) or "halt"',
    "timeouts": "{unit, health, models, completion, metrics}: seconds per gate",
    "completion": "{prompt, max_tokens}: the real completion the gate asks for",
    "metrics": "list of {name, min?, max?, labels?}: bounds on /metrics values",
    "hooks": '{drain, undrain, timeout_s, on}: commands with {host}, {instance}, {port}; on: "control" '
    '(default: run here) or "host" (on the instance\'s host over SSH, as the SSH user)',
}


class _Checker:
    def __init__(self, source: str, where: str) -> None:
        self.source, self.where = source, where
        self.problems: list[PolicyProblem] = []

    def problem(self, fld: str, value: object, allowed: str) -> None:
        self.problems.append(PolicyProblem(self.source, self.where, fld, value, allowed))

    def seconds(self, fld: str, value: Any, low: float = 0.0, high: float = 7 * 86400) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            self.problem(fld, value, f"a number of seconds from {low:g} to {high:g}")
            return low
        return float(value)

    def integer(self, fld: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.problem(fld, value, f"an integer from {low} to {high}")
            return low
        return value

    def choice(self, fld: str, value: Any, enum: type[Enum]) -> Any:
        names = [str(m.value) for m in enum]
        if value not in names:
            self.problem(fld, value, "one of " + ", ".join(names))
            return next(iter(enum))
        return enum(value)

    def size(self, fld: str, value: Any, *, rest_ok: bool) -> Size:
        if isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or (rest_ok and value == -1)):
            return value
        if isinstance(value, str):
            match = _PCT.match(value.strip())
            if match and 1 <= int(match[1]) <= 100:
                return f"{int(match[1])}%"
        rest = ", or -1 for all the rest" if rest_ok else ""
        self.problem(fld, value, f'an integer >= 1 or a percentage "N%" with N from 1 to 100{rest}')
        return 1

    def unknown(self, prefix: str, raw: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        for key in raw:
            if key not in allowed:
                self.problem(f"{prefix}{key}", raw[key], "unknown key; allowed: " + ", ".join(allowed))


def _hook(c: _Checker, fld: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        argv = tuple(value)
    elif isinstance(value, str) and value.strip():
        try:
            argv = tuple(shlex.split(value))
        except ValueError as exc:
            c.problem(fld, value, f"a command line shlex can split ({exc})")
            return None
    else:
        c.problem(fld, value, "a command (string or list of arguments) run without a shell")
        return None
    for arg in argv:
        if "\0" in arg:
            c.problem(fld, value, "a command without NUL characters")
            return None
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(arg) if name is not None}
        except ValueError as exc:
            c.problem(fld, value, f"placeholders {{host}}, {{instance}}, {{port}} only ({exc}; write {{{{ for a brace)")
            return None
        bad = names - set(HOOK_FIELDS)
        if bad:
            c.problem(fld, value, f"unknown placeholder(s) {sorted(bad)}; allowed: {{host}}, {{instance}}, {{port}}")
            return None
    return argv


def _metrics(c: _Checker, raw: Any) -> tuple[MetricThreshold, ...]:
    if not isinstance(raw, list):
        c.problem("metrics", raw, "a list of {name, min?, max?, labels?}")
        return ()
    out = []
    for i, item in enumerate(raw):
        fld = f"metrics[{i}]"
        if not isinstance(item, dict):
            c.problem(fld, item, "a dict {name, min?, max?, labels?}")
            continue
        c.unknown(fld + ".", item, ("name", "min", "max", "labels"))
        name = item.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name):
            c.problem(fld + ".name", name, "a Prometheus metric name, e.g. vllm:num_requests_waiting")
            continue
        bounds: dict[str, float | None] = {}
        for key in ("min", "max"):
            v = item.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                c.problem(f"{fld}.{key}", v, "a number")
                v = None
            bounds[key] = float(v) if v is not None else None
        if bounds["min"] is None and bounds["max"] is None:
            c.problem(fld, item, "needs min or max")
            continue
        if bounds["min"] is not None and bounds["max"] is not None and bounds["min"] > bounds["max"]:
            c.problem(fld, item, "min must not exceed max")
        labels = item.get("labels", {})
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            c.problem(fld + ".labels", labels, "a dict of label name to string value")
            labels = {}
        out.append(MetricThreshold(name, bounds["min"], bounds["max"], tuple(sorted(labels.items()))))
    return tuple(out)


def _sub(c: _Checker, raw: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        c.problem(key, value, "a dict with keys " + ", ".join(allowed))
        return {}
    c.unknown(key + ".", value, allowed)
    return value


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides win; dotted keys (``timeouts.health``) reach into sub-dicts."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if rest:
            sub = out.get(head)
            out[head] = {**(sub if isinstance(sub, dict) else {}), rest: value}
        else:
            out[key] = value
    return out


def parse_policy(
    raw: Mapping[str, Any] | None,
    *,
    source: str,
    where: str,
    overrides: Mapping[str, Any] | None = None,
) -> RolloutPolicy:
    """Validate the ``rollout`` data of an inventory (``where``: "group all", "host gpu01").

    ``overrides`` come from the command line (``{"batches": [1, 3], "timeouts.health": 600}``);
    a bad override is reported against "command line". Every problem is reported at once.
    """
    raw = raw if raw is not None else {}
    c = _Checker(source, where)
    if not isinstance(raw, Mapping):
        c.problem(POLICY_KEY, raw, "a dict with keys " + ", ".join(POLICY_KEYS))
        raise PolicyError(c.problems)
    c.unknown("", raw, tuple(POLICY_KEYS))
    if overrides:
        oc = _Checker("command line", "override")
        oc.unknown("", {k.partition(".")[0]: v for k, v in overrides.items()}, tuple(POLICY_KEYS))
        if oc.problems:
            raise PolicyError(c.problems + oc.problems)
        # Validate overrides on their own first so a bad one names the command line, not the file.
        _validate(_merge({}, overrides), oc, ordering=False)
        if oc.problems:
            raise PolicyError(c.problems + oc.problems)
        raw = _merge(raw, overrides)
    policy = _validate(raw, c)
    if c.problems:
        raise PolicyError(c.problems)
    return policy


def _validate(raw: Mapping[str, Any], c: _Checker, ordering: bool = True) -> RolloutPolicy:
    d = RolloutPolicy()
    batches_raw = raw.get("batches", list(d.batches))
    batches: tuple[Size, ...] = d.batches
    if isinstance(batches_raw, int | str) and not isinstance(batches_raw, bool):
        batches_raw = [batches_raw]
    if not isinstance(batches_raw, list | tuple) or not batches_raw:
        c.problem("batches", batches_raw, 'a non-empty list like [1, 2, "25%"]')
    else:
        batches = tuple(c.size(f"batches[{i}]", v, rest_ok=True) for i, v in enumerate(batches_raw))
    t = _sub(c, raw, "timeouts", GATE_NAMES)
    comp = _sub(c, raw, "completion", ("prompt", "max_tokens"))
    hooks = _sub(c, raw, "hooks", ("drain", "undrain", "timeout_s", "on"))
    prompt = comp.get("prompt", d.completion.prompt)
    if not isinstance(prompt, str) or not prompt.strip():
        c.problem("completion.prompt", prompt, "a non-empty string")
        prompt = d.completion.prompt
    policy = RolloutPolicy(
        batches=batches,
        unit=c.choice("unit", raw.get("unit", d.unit.value), BatchUnit),
        max_unavailable=c.size("max_unavailable", raw.get("max_unavailable", d.max_unavailable), rest_ok=False),
        whole_host=_bool(c, "whole_host", raw.get("whole_host", d.whole_host)),
        soak_s=c.seconds("soak_s", raw.get("soak_s", d.soak_s)),
        canary_bake_s=c.seconds("canary_bake_s", raw.get("canary_bake_s", d.canary_bake_s)),
        host_deadline_s=c.seconds("host_deadline_s", raw.get("host_deadline_s", d.host_deadline_s), 1),
        progress_deadline_s=c.seconds("progress_deadline_s", raw.get("progress_deadline_s", d.progress_deadline_s), 1),
        drain_timeout_s=c.seconds("drain_timeout_s", raw.get("drain_timeout_s", d.drain_timeout_s)),
        gpu_free_timeout_s=c.seconds("gpu_free_timeout_s", raw.get("gpu_free_timeout_s", d.gpu_free_timeout_s)),
        probe_interval_s=c.seconds("probe_interval_s", raw.get("probe_interval_s", d.probe_interval_s), 0.05, 600),
        probe_timeout_s=c.seconds("probe_timeout_s", raw.get("probe_timeout_s", d.probe_timeout_s), 0.1, 600),
        unreachable_timeout_s=c.seconds(
            "unreachable_timeout_s", raw.get("unreachable_timeout_s", d.unreachable_timeout_s), 0, 3600
        ),
        orphans=c.choice("orphans", raw.get("orphans", d.orphans.value), OrphanPolicy),
        on_failure=c.choice("on_failure", raw.get("on_failure", d.on_failure.value), OnFailure),
        timeouts=GateTimeouts(**{g: c.seconds(f"timeouts.{g}", t.get(g, d.timeouts.of(g)), 0.1) for g in GATE_NAMES}),
        completion=CompletionProbe(prompt, c.integer("completion.max_tokens", comp.get("max_tokens", 4), 1, 256)),
        metrics=_metrics(c, raw.get("metrics", [])),
        hooks=Hooks(
            drain=_hook(c, "hooks.drain", hooks.get("drain")),
            undrain=_hook(c, "hooks.undrain", hooks.get("undrain")),
            timeout_s=c.seconds("hooks.timeout_s", hooks.get("timeout_s", d.hooks.timeout_s), 1),
            on=c.choice("hooks.on", hooks.get("on", d.hooks.on.value), HookPlace),
        ),
    )
    if ordering:
        _ordering(c, policy)
    return policy


def _ordering(c: _Checker, p: RolloutPolicy) -> None:
    """Nomad's ordering rule (``UpdateStrategy.Validate``): probe interval < soak < host deadline <= progress."""
    if p.soak_s and p.probe_interval_s >= p.soak_s:
        c.problem("probe_interval_s", p.probe_interval_s, f"must be less than soak_s ({p.soak_s:g})")
    if p.soak_s >= p.host_deadline_s:
        c.problem("soak_s", p.soak_s, f"must be less than host_deadline_s ({p.host_deadline_s:g})")
    if p.canary_bake_s >= p.progress_deadline_s:
        c.problem(
            "canary_bake_s", p.canary_bake_s, f"must be less than progress_deadline_s ({p.progress_deadline_s:g})"
        )
    if p.host_deadline_s > p.progress_deadline_s:
        c.problem(
            "host_deadline_s", p.host_deadline_s, f"must not exceed progress_deadline_s ({p.progress_deadline_s:g})"
        )
    for gate in GATE_NAMES:
        if p.timeouts.of(gate) > p.host_deadline_s:
            c.problem(
                f"timeouts.{gate}",
                p.timeouts.of(gate),
                f"must not exceed host_deadline_s ({p.host_deadline_s:g}); raise host_deadline_s or lower it",
            )


def _bool(c: _Checker, fld: str, value: Any) -> bool:
    if not isinstance(value, bool):
        c.problem(fld, value, "true or false")
        return False
    return value


def policy_to_raw(p: RolloutPolicy) -> dict[str, Any]:
    """The inventory form of a policy (``parse_policy`` of it gives it back): for the journal."""
    return {
        "batches": list(p.batches),
        "unit": p.unit.value,
        "max_unavailable": p.max_unavailable,
        "whole_host": p.whole_host,
        "soak_s": p.soak_s,
        "canary_bake_s": p.canary_bake_s,
        "host_deadline_s": p.host_deadline_s,
        "progress_deadline_s": p.progress_deadline_s,
        "drain_timeout_s": p.drain_timeout_s,
        "gpu_free_timeout_s": p.gpu_free_timeout_s,
        "probe_interval_s": p.probe_interval_s,
        "probe_timeout_s": p.probe_timeout_s,
        "unreachable_timeout_s": p.unreachable_timeout_s,
        "orphans": p.orphans.value,
        "on_failure": p.on_failure.value,
        "timeouts": {g: p.timeouts.of(g) for g in GATE_NAMES},
        "completion": {"prompt": p.completion.prompt, "max_tokens": p.completion.max_tokens},
        "metrics": [
            {
                "name": m.name,
                **({"min": m.min} if m.min is not None else {}),
                **({"max": m.max} if m.max is not None else {}),
                "labels": dict(m.labels),
            }
            for m in p.metrics
        ],
        "hooks": {
            "drain": list(p.hooks.drain) if p.hooks.drain else None,
            "undrain": list(p.hooks.undrain) if p.hooks.undrain else None,
            "timeout_s": p.hooks.timeout_s,
            "on": p.hooks.on.value,
        },
    }


def policy_from_hosts(
    source: str, host_data: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Any] | None = None
) -> RolloutPolicy:
    """The one policy of a rollout from the hosts' inventory data (group data merged in, as pyinfra does).

    Every host of a rollout must carry the same ``rollout`` settings (set them on a group they all
    share, e.g. ``all``); hosts that differ are named.
    """
    if not host_data:
        return parse_policy(None, source=source, where="no hosts", overrides=overrides)
    by_value: dict[str, list[str]] = {}
    raws: dict[str, Any] = {}
    for host, data in host_data.items():
        raw = data.get(POLICY_KEY)
        key = repr(raw)
        by_value.setdefault(key, []).append(host)
        raws[key] = raw
    if len(by_value) > 1:
        groups = sorted(by_value.values(), key=len, reverse=True)
        problems = [
            PolicyProblem(
                source,
                f"host {hosts[0]}" + (f" (and {len(hosts) - 1} more)" if len(hosts) > 1 else ""),
                POLICY_KEY,
                raws[next(k for k, v in by_value.items() if v is hosts)],
                f"differs from host {groups[0][0]}'s; one rollout has one policy: set it on a group every host shares",
            )
            for hosts in groups[1:]
        ]
        raise PolicyError(problems)
    (key,) = by_value
    hosts = by_value[key]
    where = f"host {hosts[0]}" if len(hosts) == 1 else f"hosts {hosts[0]}..{hosts[-1]} ({len(hosts)})"
    return parse_policy(raws[key], source=source, where=where, overrides=overrides)
