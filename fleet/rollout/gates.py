"""Gate verdicts (pure): is a restarted instance serving the right model, for real, and for long enough?

Gates, in order; the first that does not pass decides:

1. **unit**: systemd says ``ActiveState=active``, ``SubState=running`` and ``NRestarts`` has not
   grown since fleet started it. ``failed``, a restart, or the unit going away are fatal at once
   (Nomad ``client/allochealth/tracker.go``: a failed task makes the allocation unhealthy without
   waiting for the deadline).
2. **health**: ``GET /health`` answers 200. vLLM does not listen until the model is loaded
   (``vllm/entrypoints/launchers/launcher.py: setup_server`` binds without listening), so a refused
   connection is the normal "still loading"; 503 is ``EngineDeadError`` (fatal).
3. **models**: ``GET /v1/models`` lists the expected served model name. Another model is fatal:
   waiting will not change it (the proposal's "deterministic mismatch"). Where the rollout
   switches the instance's configuration, the LoRA adapters it lists (the cards with a
   ``parent``, as ``OpenAIServingModels.show_available_models`` in
   ``vllm/entrypoints/openai/models/serving.py`` adds them after the base model) must be the
   planned ones, no more and no fewer: vLLM loads every ``--lora-modules`` adapter before it
   listens (``init_static_loras``), so another set is fatal too (an old unit, or a wrong file).
4. **completion**: a real ``POST /v1/completions`` returns tokens. An empty answer, an error or
   ``finish_reason: "abort"`` does not pass: vLLM keeps ``/health`` at 200 while it drains
   (``vllm/v1/engine/core.py: _handle_shutdown``), answers new requests with HTTP 500 ``cannot
   schedule new futures after shutdown`` (``vllm/v1/engine/async_llm.py: AsyncLLM.shutdown``)
   and aborts what is still running at its deadline, and an engine
   that is alive but hung answers ``/health`` while no token comes (vLLM issue #39863).
5. **metrics** (optional): bounds on ``/metrics`` values; no data is not a pass (Flagger halts on
   "no values found"; Argo Rollouts errors on an empty result).

Before all of them, **gpu**: the GPU watcher's events on the instance's GPUs since fleet started
it (``fleet.gpuwatch``; the executor reads the host's record). An XID that needs a reset, a
reboot or service, a double-bit ECC error, an application XID (the engine's own fault) or an XID
fleet's catalogue does not know is fatal at once, whatever ``/health`` says: an instance that
loads while its GPU throws XID 79 is not healthy. Corrected (single-bit) ECC errors and
informational XIDs pass. Not observed (no watcher on the host) gates nothing.

Each gate has its own timeout, counted from the moment every gate before it first passed (or,
for a gate that passed before and fails again, from when it started failing). When all gates pass
the soak starts; any failure resets it (Nomad ``min_healthy_time``; Kubernetes
``minReadySeconds``). Verdicts are data, computed from observations and an injected ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from fleet.rollout.policy import GATE_NAMES, MetricThreshold, RolloutPolicy


class Gate(StrEnum):
    GPU = "gpu"
    UNIT = "unit"
    HEALTH = "health"
    MODELS = "models"
    COMPLETION = "completion"
    METRICS = "metrics"
    SOAK = "soak"


class Status(StrEnum):
    PASS = "pass"
    WAIT = "wait"  #: not yet; the gate's timeout has not run out
    FAIL = "fail"


@dataclass(frozen=True)
class Verdict:
    status: Status
    gate: Gate
    detail: str  #: what is awaited (WAIT) or why it failed (FAIL)

    def __str__(self) -> str:
        return f"{self.status.value} {self.gate.value}: {self.detail}"


# ---- observations (what the observer saw; no I/O here) ------------------------------------------


@dataclass(frozen=True)
class UnitState:
    """``systemctl show -p ActiveState,SubState,NRestarts,MainPID``."""

    active_state: str
    sub_state: str
    n_restarts: int = 0
    main_pid: int = 0


@dataclass(frozen=True)
class HttpAnswer:
    """One HTTP exchange: the status, or no answer and why (refused, timed out)."""

    status: int | None
    error: str = ""
    elapsed_s: float = 0.0

    @property
    def answered(self) -> bool:
        return self.status is not None

    def why(self) -> str:
        return f"HTTP {self.status}" if self.status is not None else (self.error or "no answer")


@dataclass(frozen=True)
class ModelsAnswer(HttpAnswer):
    ids: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()  #: ids of the cards with a ``parent``: LoRA adapters


@dataclass(frozen=True)
class CompletionAnswer(HttpAnswer):
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0


Sample = tuple[str, tuple[tuple[str, str], ...], float]


@dataclass(frozen=True)
class MetricsAnswer(HttpAnswer):
    samples: tuple[Sample, ...] = ()

    def value(self, name: str, labels: Mapping[str, str] | tuple[tuple[str, str], ...] = ()) -> float | None:
        """The sum over the series of ``name`` whose labels include ``labels``; None when there is none."""
        want = dict(labels)
        found = [v for n, ls, v in self.samples if n == name and want.items() <= dict(ls).items()]
        return sum(found) if found else None


@dataclass(frozen=True)
class GpuEventSeen:
    """One event the GPU watcher recorded on one of the instance's GPUs."""

    gpu: int
    at: float
    what: str  #: ``XID 79 (reboot): ...``
    action: str  #: fleet.gpuwatch.catalog.ACTIONS


@dataclass(frozen=True)
class GpuEvents:
    """The watcher's events on the instance's GPUs since fleet started it."""

    events: tuple[GpuEventSeen, ...] = ()


@dataclass(frozen=True)
class Probe:
    """Everything observed about one instance at ``at``; a probe not made is None."""

    at: float
    unit: UnitState | None = None
    health: HttpAnswer | None = None
    models: ModelsAnswer | None = None
    completion: CompletionAnswer | None = None
    metrics: MetricsAnswer | None = None
    unreachable: str = ""  #: the host could not be asked (SSH failed): why
    gpu_events: GpuEvents | None = None


# ---- one observation, gate by gate ----------------------------------------------------------------


class Check(StrEnum):
    PASS = "pass"
    PENDING = "pending"  #: not there yet (loading, no answer)
    BAD = "bad"  #: answered wrongly now (may recover: soak resets, timeout runs)
    FATAL = "fatal"  #: will not recover by waiting


@dataclass(frozen=True)
class Expect:
    """What a healthy instance looks like."""

    model: str
    baseline_restarts: int = 0
    thresholds: tuple[MetricThreshold, ...] = ()
    #: the LoRA adapters ``/v1/models`` must list (None: not checked: the rollout leaves the files)
    adapters: tuple[str, ...] | None = None


#: Watcher actions (fleet.gpuwatch.catalog) that pass the gpu gate: corrected, informational.
GPU_EVENTS_PASSING = ("info",)


def check_gpu_events(seen: GpuEvents | None) -> tuple[Check, str]:
    if seen is None:
        return Check.PASS, "GPU events not observed (no GPU watcher on the host)"
    bad = [e for e in seen.events if e.action not in GPU_EVENTS_PASSING]
    if bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return Check.FATAL, f"GPU {first.gpu} reported {first.what} after fleet started the instance{more}"
    return Check.PASS, f"no GPU event that fails the instance ({len(seen.events)} corrected or informational)"


def check_unit(unit: UnitState | None, baseline_restarts: int) -> tuple[Check, str]:
    if unit is None:
        return Check.PENDING, "unit state not observed"
    state = f"{unit.active_state}/{unit.sub_state}"
    if unit.active_state == "failed":
        return Check.FATAL, f"unit failed ({state})"
    if unit.n_restarts > baseline_restarts:
        return Check.FATAL, f"unit restarted {unit.n_restarts - baseline_restarts} time(s) since fleet started it"
    if unit.sub_state == "auto-restart":
        return Check.FATAL, f"unit is restarting ({state})"
    if unit.active_state in ("inactive", "deactivating"):
        return Check.FATAL, f"unit stopped though fleet started it ({state})"
    if unit.active_state == "active" and unit.sub_state == "running":
        return Check.PASS, state
    return Check.PENDING, f"unit {state}"


def check_health(answer: HttpAnswer | None) -> tuple[Check, str]:
    if answer is None or not answer.answered:
        why = answer.why() if answer else "not probed"
        return Check.PENDING, f"/health: {why} (vLLM listens only once the model is loaded)"
    if answer.status == 200:
        return Check.PASS, "/health 200"
    if answer.status == 503:
        return Check.FATAL, "/health 503: the engine is dead (EngineDeadError)"
    return Check.BAD, f"/health {answer.why()}"


def check_models(answer: ModelsAnswer | None, model: str, adapters: tuple[str, ...] | None = None) -> tuple[Check, str]:
    if answer is None or not answer.answered:
        return Check.PENDING, f"/v1/models: {answer.why() if answer else 'not probed'}"
    if answer.status in (401, 403):
        return Check.FATAL, f"/v1/models {answer.status}: the API key was refused (check api_key_ref)"
    if answer.status != 200:
        return Check.BAD, f"/v1/models {answer.why()}"
    if model not in answer.ids:
        return Check.FATAL, f"/v1/models lists {list(answer.ids)}, not {model!r}: another model is loaded"
    if adapters is None:
        return Check.PASS, f"/v1/models lists {model!r}"
    listed, planned = sorted(answer.adapters), sorted(adapters)
    if listed != planned:
        missing = sorted(set(planned) - set(listed))
        extra = sorted(set(listed) - set(planned))
        said = "; ".join(
            part for part in (f"missing {missing}" if missing else "", f"not planned {extra}" if extra else "") if part
        )
        return Check.FATAL, (
            f"/v1/models lists LoRA adapters {listed}, planned {planned} ({said}): vLLM loads every --lora-modules "
            "adapter before it listens, so this set will not change by waiting"
        )
    if not planned:
        return Check.PASS, f"/v1/models lists {model!r} and no LoRA adapter, as planned"
    return Check.PASS, f"/v1/models lists {model!r} and the planned LoRA adapter(s) {planned}"


#: What a client gets from a request that meets a dead engine (``EngineDeadError`` in
#: ``vllm/v1/engine/exceptions.py``): ``CLIENT_MESSAGE`` in 0.33.0, ``ENGINE_DEAD_MESSAGE`` in 0.32.0
#: (measured on the real engine); ``engine_error_handler`` answers HTTP 500 and stops the server.
ENGINE_DEAD_MESSAGES = (
    "The server had an error while processing your request.",
    "EngineCore encountered an issue. See stack trace (above) for the root cause.",
)


def check_completion(answer: CompletionAnswer | None) -> tuple[Check, str]:
    if answer is None:
        return Check.PENDING, "completion not probed"
    if not answer.answered:
        return Check.BAD, f"completion: {answer.why()} (alive but not generating?)"
    if answer.status in (401, 403):
        return Check.FATAL, f"completion {answer.status}: the API key was refused (check api_key_ref)"
    if answer.status == 500 and "cannot schedule new futures after shutdown" in answer.error:
        return Check.BAD, f"completion {answer.why()}: {answer.error} (the server is draining or stopping)"
    if answer.status == 500 and any(m in answer.error for m in ENGINE_DEAD_MESSAGES):
        return Check.BAD, (
            f"completion {answer.why()}: {answer.error} (the engine core died: EngineDeadError; vLLM's API "
            "server exits at once and the unit restarts it)"
        )
    if answer.status != 200:
        return Check.BAD, f"completion {answer.why()}" + (f": {answer.error}" if answer.error else "")
    if answer.finish_reason == "abort":
        return Check.BAD, 'completion finished with finish_reason "abort" (the server is draining or stopping)'
    if answer.completion_tokens <= 0 or not answer.text:
        return Check.BAD, "completion returned no tokens"
    return Check.PASS, f"completion returned {answer.completion_tokens} token(s) in {answer.elapsed_s:.2f}s"


def check_metrics(answer: MetricsAnswer | None, thresholds: tuple[MetricThreshold, ...]) -> tuple[Check, str]:
    if not thresholds:
        return Check.PASS, "no metric thresholds"
    if answer is None or not answer.answered or answer.status != 200:
        return Check.BAD, f"/metrics: {answer.why() if answer else 'not probed'}"
    for t in thresholds:
        value = answer.value(t.name, t.labels)
        if value is None or math.isnan(value):
            return Check.BAD, f"/metrics has no {t.describe().split(' ')[0]} (no data is not a pass)"
        if (t.min is not None and value < t.min) or (t.max is not None and value > t.max):
            return Check.BAD, f"{t.describe()} is violated: {value:g}"
    return Check.PASS, f"{len(thresholds)} metric threshold(s) hold"


ORDER = (Gate.UNIT, Gate.HEALTH, Gate.MODELS, Gate.COMPLETION, Gate.METRICS)


def evaluate(probe: Probe, expect: Expect) -> list[tuple[Gate, Check, str]]:
    """The gates in order up to the first that does not pass (later ones are not reached)."""
    if probe.unreachable:
        return [(Gate.UNIT, Check.PENDING, f"host unreachable: {probe.unreachable}")]
    gpu, gpu_detail = check_gpu_events(probe.gpu_events)
    if gpu is Check.FATAL:  # before the others: a GPU fault decides whatever /health says
        return [(Gate.GPU, gpu, gpu_detail)]
    checks: tuple[Callable[[], tuple[Check, str]], ...] = (
        lambda: check_unit(probe.unit, expect.baseline_restarts),
        lambda: check_health(probe.health),
        lambda: check_models(probe.models, expect.model, expect.adapters),
        lambda: check_completion(probe.completion),
        lambda: check_metrics(probe.metrics, expect.thresholds),
    )
    out: list[tuple[Gate, Check, str]] = []
    for gate, check in zip(ORDER, checks, strict=True):
        status, detail = check()
        out.append((gate, status, detail))
        if status is not Check.PASS:
            break
    return out


# ---- over time: timeouts and soak ----------------------------------------------------------------


@dataclass(frozen=True)
class GateTrack:
    """The gates' memory for one instance since it was started (journaled; plain data)."""

    started_at: float
    reached: tuple[float | None, ...] = field(default=(None,) * len(ORDER))  #: first time each gate was reached
    passed: tuple[bool, ...] = field(default=(False,) * len(ORDER))  #: has each gate passed at least once
    failing_since: float | None = None  #: start of the current non-passing streak
    soak_since: float | None = None
    soak_resets: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "reached": list(self.reached),
            "passed": list(self.passed),
            "failing_since": self.failing_since,
            "soak_since": self.soak_since,
            "soak_resets": self.soak_resets,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GateTrack:
        return cls(
            started_at=d["started_at"],
            reached=tuple(d["reached"]),
            passed=tuple(d["passed"]),
            failing_since=d["failing_since"],
            soak_since=d["soak_since"],
            soak_resets=d["soak_resets"],
        )


def start_track(now: float) -> GateTrack:
    return GateTrack(started_at=now, reached=(now,) + (None,) * (len(ORDER) - 1))


def step(
    track: GateTrack, probe: Probe, expect: Expect, policy: RolloutPolicy, now: float
) -> tuple[GateTrack, Verdict]:
    """Fold one observation into the track and say pass (healthy and soaked), wait, or fail."""
    checks = evaluate(probe, expect)
    reached = list(track.reached)
    passed = list(track.passed)
    for i, (_gate, status, _d) in enumerate(checks):
        if reached[i] is None:
            reached[i] = now
        if status is Check.PASS:
            passed[i] = True
    gate, status, detail = checks[-1]
    if status is Check.PASS:
        soak_since = track.soak_since if track.soak_since is not None else now
        new = replace(track, reached=tuple(reached), passed=tuple(passed), failing_since=None, soak_since=soak_since)
        soaked = now - soak_since
        if soaked >= policy.soak_s:
            return new, Verdict(Status.PASS, Gate.SOAK, f"all gates green for {soaked:.1f}s")
        return new, Verdict(Status.WAIT, Gate.SOAK, f"soaking: all gates green for {soaked:.1f}s of {policy.soak_s:g}s")
    resets = track.soak_resets + (1 if track.soak_since is not None else 0)
    failing_since = track.failing_since if track.failing_since is not None else now
    new = replace(
        track,
        reached=tuple(reached),
        passed=tuple(passed),
        failing_since=failing_since,
        soak_since=None,
        soak_resets=resets,
    )
    if status is Check.FATAL:
        return new, Verdict(Status.FAIL, gate, detail)
    index = len(checks) - 1
    since = reached[index]
    assert since is not None
    if passed[index]:
        since = max(since, failing_since)
    timeout = policy.timeouts.of(gate.value) if gate.value in GATE_NAMES else policy.host_deadline_s
    waited = now - since
    if waited > timeout:
        why = f"{detail}; still so after {waited:.1f}s (timeouts.{gate.value}={timeout:g}s)"
        return new, Verdict(Status.FAIL, gate, why)
    reset = " (soak reset)" if track.soak_since is not None else ""
    return new, Verdict(Status.WAIT, gate, f"{detail}{reset}; {waited:.1f}s of {timeout:g}s")
