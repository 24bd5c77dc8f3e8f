"""The rollout engine as a re-entrant step function: ``decide(state, observations, now)``.

``decide`` is pure. It reads the journaled state and what every instance *is* now (unit state,
release link, GPU processes, in-flight requests, gate probes) and returns the next state and the
actions to take. The runner journals each action before taking it, takes it through an
``Executor``, and records the outcome with ``after``. Because every phase is judged again from
observations (level-triggered, like Kubernetes' deployment controller recomputing every sync),
a crash at any point resumes by reading the journal and every instance's true state: a stop
that was journaled but never sent is sent again; a start that happened but was never recorded
is seen as an active unit.

The restart protocol for one instance (forward to the target release, or back to the previous
one when its batch is rolled back)::

    PENDING → LB_OUT (its load balancer's server set ``drain``: no new request reaches it)
      → DRAIN (drain hook) → DRAINING (the balancer reports no session or queued request for it,
              then vLLM's running + waiting requests reach 0; each wait bounded by drain_timeout_s)
      → STOP (systemctl stop: SIGTERM, vLLM's --shutdown-timeout drains the rest)
      → GPUS (NVML shows the instance's GPUs free; an orphaned engine of this unit is named and
              stopped, or the instance fails)
      → SWITCH (flip the release link) → START → GATES (gates.step until soaked)
      → UNDRAIN (undrain hook) → LB_IN (the server set ``ready``) → DONE | ROLLED_BACK

A ``stop_only`` target (``fleet drain``) ends after GPUS: LB_IN sets its server ``maint``.

An instance spanning hosts (``Target.nodes``: one ``InstanceState`` per node, ``host/vllm-N`` on
each, leader first) goes through the protocol as one unit, in one batch. Only its leader has a
balancer seat, hooks and HTTP, so the leader is taken out of traffic and drained; each headless
node waits in DRAINING until the leader is stopping, then every node is stopped and switched on
its own host; no node is started before every node is ready to start (START is a barrier: vLLM
0.33 needs no start order, but a node started alone holds its GPUs waiting for its peers); the
leader is gated as any instance (it answers only once every node joined) while each headless
node's unit must stay up (``gates.check_unit``) until the leader passes. A node that fails (or
whose host stops answering) fails its batch, so every node is rolled back; a node waiting for a
peer that failed or was skipped fails with it, naming it. The instance is named in every failure
(``node_words``).
The balancer's view of each instance comes with the facts (``InstanceFacts.lb``); an instance
already on its target and serving but out of its balancer's traffic (a halted rollout left it
there) is gated again and put back, never skipped.

On a failure the failed batch is rolled back (every instance of it that was touched, including
ones already done: the batch is atomic, as Argo Rollouts' abort) and the rollout halts; or it
only halts (``on_failure: halt``). A rollback that fails leaves that instance drained and the
rollout halted with what to do next. Instances of later batches are never touched.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from fleet.errors import FleetError
from fleet.rollout.batches import (
    Batch,
    Groups,
    InstanceRef,
    admit,
    budget_of,
    count_instances,
    plan_batches,
)
from fleet.rollout.gates import Check, Expect, GateTrack, Probe, Status, check_unit, evaluate, start_track
from fleet.rollout.gates import step as gate_step
from fleet.rollout.observe import InstanceFacts, Observations
from fleet.rollout.policy import HookPlace, OnFailure, OrphanPolicy, RolloutPolicy, parse_policy, policy_to_raw


class Phase(StrEnum):
    PENDING = "pending"
    LB_OUT = "lb_out"
    DRAIN = "drain"
    DRAINING = "draining"
    STOP = "stop"
    GPUS = "gpus"
    SWITCH = "switch"
    START = "start"
    GATES = "gates"
    UNDRAIN = "undrain"
    LB_IN = "lb_in"
    DONE = "done"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    ROLLBACK_FAILED = "rollback_failed"
    SKIPPED = "skipped"  #: never touched: its host stayed unreachable when its turn came


TERMINAL = (Phase.DONE, Phase.FAILED, Phase.ROLLED_BACK, Phase.ROLLBACK_FAILED, Phase.SKIPPED)


class RolloutStatus(StrEnum):
    RUNNING = "running"
    DONE = "done"
    HALTED = "halted"


class Act(StrEnum):
    HOOK = "hook"
    STOP = "stop"
    KILL = "kill"
    FLIP = "flip"
    START = "start"
    WAIT = "wait"
    LB = "lb"  #: set the instance's server state on its load balancer


@dataclass(frozen=True)
class Target:
    """What one instance should become: its release and the model name that release serves."""

    ref: InstanceRef
    release: str
    model: str
    port: int = 8000
    restart: bool = False  #: restart even when already on ``release`` (``fleet restart``)
    #: the configuration revision (unit and env file, ``fleet.operations.revisions``) to switch to;
    #: None: the instance's files are left as they are (``--release``, ``fleet restart``)
    revision: str | None = None
    stop_only: bool = False  #: ``fleet drain``: out of traffic and stopped, then done (no start)
    #: the LoRA adapters its new configuration serves, checked by the models gate (None: not checked)
    adapters: tuple[str, ...] | None = None
    #: an instance spanning hosts: every node's ref, leader (node rank 0) first; () for one host
    nodes: tuple[InstanceRef, ...] = ()


@dataclass(frozen=True)
class InstanceState:
    ref: InstanceRef
    target: Target
    phase: Phase = Phase.PENDING
    rolling_back: bool = False
    phase_since: float = 0.0
    first_step_at: float | None = None
    previous_release: str | None = None  #: recorded before anything is changed
    previous_model: str | None = None
    previous_revision: str | None = None
    #: the LoRA adapters its previous revision serves (its ``revision.json``); None: not recorded
    previous_adapters: tuple[str, ...] | None = None
    previous_unit: str | None = None  #: "active/running" etc. before anything is changed
    hooks_done: tuple[str, ...] = ()
    killed: tuple[int, ...] = ()
    started: bool = False  #: the start was sent and systemctl returned
    changed: bool = False  #: fleet has stopped it at least once (so a rollback must restart it)
    baseline_restarts: int = 0
    track: GateTrack | None = None
    failure: str = ""  #: why the forward restart failed (kept through the rollback)
    rollback_failure: str = ""
    note: str = ""  #: the last thing awaited, for people
    lb_drained: bool = False  #: the balancer's sessions for it reached 0 (or their wait ran out)
    lb_out: bool = False  #: fleet took it out of its balancer's traffic and has not put it back

    @property
    def release(self) -> str:
        """The release this instance is heading for now."""
        if self.rolling_back and self.previous_release is not None:
            return self.previous_release
        return self.target.release

    @property
    def revision(self) -> str | None:
        """The configuration revision this instance is heading for now (None: leave the files)."""
        if self.rolling_back:
            return self.previous_revision if self.target.revision is not None else None
        return self.target.revision

    @property
    def model(self) -> str:
        if self.rolling_back and self.previous_model is not None:
            return self.previous_model
        return self.target.model

    @property
    def adapters(self) -> tuple[str, ...] | None:
        """The LoRA adapters the models gate expects now: on the way back, those the previous
        revision records (None where it records none: gated on the model alone)."""
        return self.previous_adapters if self.rolling_back else self.target.adapters

    @property
    def touched(self) -> bool:
        return self.first_step_at is not None

    @property
    def headless(self) -> bool:
        """A node of an instance spanning hosts other than its leader: no HTTP, no balancer seat."""
        return bool(self.target.nodes) and self.ref != self.target.nodes[0]


@dataclass(frozen=True)
class Action:
    kind: Act
    ref: InstanceRef | None = None
    why: str = ""
    hook: str = ""  #: "drain" or "undrain"
    argv: tuple[str, ...] = ()
    release: str = ""
    revision: str | None = None  #: with FLIP: the configuration revision to put in place too
    pids: tuple[int, ...] = ()
    lb_state: str = ""  #: with LB: "drain", "ready" or "maint"

    def __str__(self) -> str:
        where = f" {self.ref}" if self.ref else ""
        to = f" → {self.release}" + (f" (config {self.revision})" if self.revision else "")
        extra = {Act.HOOK: f" {self.hook}", Act.FLIP: to, Act.KILL: f" pids {list(self.pids)}",
                 Act.LB: f" {self.lb_state}"}  # fmt: skip
        return f"{self.kind.value}{where}{extra.get(self.kind, '')}: {self.why}"


@dataclass(frozen=True)
class RolloutState:
    id: str
    fleet: str
    kind: str  #: "rollout", "restart", "rollback"
    policy: RolloutPolicy
    batches: tuple[Batch, ...]
    instances: Mapping[InstanceRef, InstanceState]
    started_at: float
    batch_index: int = 0
    current: tuple[InstanceRef, ...] = ()  #: admitted instances of the batch in progress
    status: RolloutStatus = RolloutStatus.RUNNING
    reason: str = ""
    failing: str = ""  #: set when the current batch failed: why
    last_progress_at: float = 0.0
    waiting: str = ""  #: why the next batch waits (budget)
    baking_since: float | None = None  #: the canary batch is back in traffic and watched since

    @property
    def baking(self) -> bool:
        return self.baking_since is not None

    def inst(self, ref: InstanceRef) -> InstanceState:
        return self.instances[ref]

    def host_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for ref in self.instances:
            sizes[ref.host] = sizes.get(ref.host, 0) + 1
        return sizes

    def groups(self) -> Groups:
        """The instances spanning hosts: each node's ref → every node's ref, leader first."""
        return groups_of(i.target for i in self.instances.values())


def groups_of(targets: Iterable[Target]) -> Groups:
    """Each node's ref → its instance's nodes, for the targets of instances spanning hosts."""
    return {t.ref: t.nodes for t in targets if t.nodes}


def node_words(inst: InstanceState) -> str:
    """``vllm-0 spanning a (leader), b: node b`` for a node of an instance spanning hosts (the
    instance, its nodes, which node); ``host/instance`` for any other instance."""
    nodes = inst.target.nodes
    if not nodes:
        return str(inst.ref)
    hosts = ", ".join(n.host + (" (leader)" if i == 0 else "") for i, n in enumerate(nodes))
    return f"instance {inst.ref.instance} spanning {hosts}: node {inst.ref.host}"


def check_nodes(targets: Sequence[Target]) -> None:
    """Every node of an instance spanning hosts is a target, naming the same nodes: a rollout
    moves such an instance whole or not at all (``FleetError`` naming it, before anything)."""
    refs = {t.ref for t in targets}
    for t in targets:
        if not t.nodes:
            continue
        if t.ref not in t.nodes:
            raise FleetError(f"rollout: {t.ref} is not one of the nodes it names ({', '.join(map(str, t.nodes))})")
        missing = [n for n in t.nodes if n not in refs]
        if missing:
            hosts = ", ".join(n.host for n in t.nodes)
            raise FleetError(
                f"rollout: instance {t.ref.instance} spans hosts {hosts} (leader {t.nodes[0].host}) and is rolled "
                f"as one unit, but node(s) {', '.join(str(m) for m in missing)} are not in this rollout (left out by "
                "--limit, drained, or not changed by the rollout being undone): include every node's host"
            )


@dataclass(frozen=True)
class Decision:
    state: RolloutState
    actions: tuple[Action, ...] = ()
    waits: tuple[str, ...] = field(default=())  #: what is awaited, for the live view


def new_rollout(
    rollout_id: str, fleet: str, kind: str, targets: Sequence[Target], policy: RolloutPolicy, now: float
) -> RolloutState:
    """A rollout over ``targets`` in their order, batched by the policy (batch 0 is the canary)."""
    check_nodes(targets)
    refs = [t.ref for t in targets]
    batches = plan_batches(
        refs, policy.batches, policy.max_unavailable, policy.unit, policy.whole_host, groups=groups_of(targets)
    )
    instances = {t.ref: InstanceState(t.ref, t) for t in targets}
    return RolloutState(
        rollout_id, fleet, kind, policy, tuple(batches), instances, started_at=now, last_progress_at=now
    )


def interrupted(state: RolloutState, why: str) -> RolloutState:
    """The rollout stops before its end for a reason outside the engine (the journal cannot be
    written, a hard abort): it stays ``running`` (resumable; shown as *interrupted*) with why."""
    return replace(state, reason=why)


#: What an instance left in each phase of the protocol is doing, for people.
_MIDWAY = {
    Phase.LB_OUT: "being taken out of its balancer's traffic; still running",
    Phase.DRAIN: "drain hook not yet run; still serving",
    Phase.DRAINING: "being drained; still running",
    Phase.STOP: "being stopped",
    Phase.GPUS: "stopped by this rollout (waiting for its GPUs)",
    Phase.SWITCH: "stopped by this rollout (not yet switched)",
    Phase.START: "stopped by this rollout (not yet started)",
    Phase.GATES: "started, not yet through its gates",
    Phase.UNDRAIN: "healthy, not yet put back into traffic (undrain hook)",
    Phase.LB_IN: "healthy, not yet back in its balancer's traffic",
}


def left_midway(state: RolloutState) -> list[InstanceState]:
    """Instances a rollout that stops now leaves between its first step and its end."""
    return [i for i in state.instances.values() if i.touched and i.phase not in (*TERMINAL, Phase.PENDING)]


def midway_words(inst: InstanceState) -> str:
    back = " (rolling back)" if inst.rolling_back else ""
    return f"{_MIDWAY.get(inst.phase, inst.phase.value)}{back}, release {inst.release}"


def resume(state: RolloutState, now: float) -> RolloutState:
    """After a crash or Ctrl-C: clocks restart from now (deadlines do not count the downtime)."""
    state = replace(state, reason="") if state.status is RolloutStatus.RUNNING else state
    instances = {
        ref: replace(
            i,
            phase_since=now,
            first_step_at=now if i.first_step_at is not None else None,
            track=start_track(now) if i.track is not None else None,
        )
        for ref, i in state.instances.items()
    }
    return replace(state, instances=instances, last_progress_at=now)


# ---- deciding -------------------------------------------------------------------------------------


def decide(state: RolloutState, obs: Observations, now: float) -> Decision:
    """The next state and the actions to take now (at most one per instance)."""
    if state.status is not RolloutStatus.RUNNING:
        return Decision(state)
    p = state.policy
    if not state.current:
        return _next_batch(state, obs, now)
    if not state.failing and now - state.last_progress_at > p.progress_deadline_s:
        state = _fail_batch(
            state, f"no instance finished for {now - state.last_progress_at:.0f}s (progress_deadline_s)", now
        )
    instances = dict(state.instances)
    done_before = sum(1 for r in state.current if instances[r].phase is Phase.DONE)
    acted: dict[InstanceRef, Action] = {}
    # The nodes of an instance spanning hosts wait for each other (``_peer_step``): a node stepped
    # before its peer moved on is stepped once more, so the instance moves in one tick.
    for pass_ in range(2):
        for ref in state.current:
            if ref in acted or (pass_ and not instances[ref].target.nodes):
                continue
            peers = Peers(instances, obs) if instances[ref].target.nodes else None
            inst, action = _instance_step(instances[ref], obs.of(ref), p, now, state.failing != "", peers)
            instances[ref] = inst
            if action is not None:
                acted[ref] = action
    actions = [acted[r] for r in state.current if r in acted]
    waits = [
        f"{r}: {instances[r].note}"
        for r in state.current
        if r not in acted and instances[r].phase not in TERMINAL and instances[r].note
    ]
    state = replace(state, instances=instances)
    failed = [
        instances[r] for r in state.current if instances[r].phase is Phase.FAILED and not instances[r].rolling_back
    ]
    if failed and not state.failing:
        first = failed[0]
        # every node of its instance that failed with it is named (a node's death ends the others)
        more = [f for f in failed[1:] if f.target.nodes and f.target.nodes == first.target.nodes]
        why = f"{node_words(first)}: {first.failure}" + "".join(f"; node {f.ref.host}: {f.failure}" for f in more)
        state = _fail_batch(state, why, now)
        return decide(state, obs, now)  # start the rollback (or the halt) at once
    if sum(1 for r in state.current if instances[r].phase is Phase.DONE) > done_before:
        state = replace(state, last_progress_at=now)  # Nomad: each healthy instance moves the deadline out
    untouched_ok = state.failing != ""  # a failed batch's untouched instances stay as they are
    if all(instances[r].phase in TERMINAL or (untouched_ok and not instances[r].touched) for r in state.current):
        if not state.failing and state.batch_index == 0 and p.canary_bake_s > 0:
            return _bake(state, obs, now)
        return _batch_finished(state, now)
    return Decision(state, tuple(actions), tuple(waits))


def _next_batch(state: RolloutState, obs: Observations, now: float) -> Decision:
    p = state.policy
    if state.batch_index >= len(state.batches):
        return _finished(state)
    batch = state.batches[state.batch_index]
    # Members of the batch on a host that does not answer: wait up to unreachable_timeout_s for
    # it, then skip them (never touched) and go on with the rest, if the budget allows.
    silent = {ref: obs.of(ref) for u in batch for ref in u if obs.of(ref).unreachable}
    young = [(ref, f) for ref, f in silent.items() if unreachable_for(f, now) < p.unreachable_timeout_s]
    if young:
        ref, f = young[0]
        line = f"batch {state.batch_index + 1}: {_unreachable_note(ref, f, p, now)}"
        return Decision(replace(state, waiting=line), waits=(line,))
    if silent:
        # a unit with one silent member is skipped whole (every node of an instance spanning hosts)
        state = _skip(state, {ref: obs.of(ref) for u in batch if any(r in silent for r in u) for ref in u}, now)
        kept = tuple(u for u in batch if not any(ref in silent for ref in u))
        batches = list(state.batches)
        if kept:
            batches[state.batch_index] = kept
            state = replace(state, batches=tuple(batches))
        else:
            del batches[state.batch_index]
            return _next_batch(replace(state, batches=tuple(batches)), obs, now)
        batch = kept
    groups = state.groups()
    unavailable = unavailable_of(state.instances, obs, groups)
    budget = budget_of(p.max_unavailable, count_instances(state.instances, groups))
    a = admit(batch, unavailable, budget, state.host_sizes(), p.whole_host, groups)
    if a.blocked:
        gone = _silent_hosts(state, obs, now)
        if gone:
            # Waiting would not help: the budget is spent on instances fleet cannot reach.
            hosts = "; ".join(f"host {h} unreachable{for_how_long(s)} ({why})" for h, (s, why) in gone.items())
            reason = f"batch {state.batch_index + 1} cannot start: {hosts}; {a.reason}"
            return Decision(replace(state, status=RolloutStatus.HALTED, reason=reason, waiting=""))
        waited = now - state.last_progress_at
        if waited > p.progress_deadline_s:
            reason = f"batch {state.batch_index + 1} could not start for {waited:.0f}s: {a.reason}"
            return Decision(replace(state, status=RolloutStatus.HALTED, reason=reason, waiting=""))
        return Decision(replace(state, waiting=a.reason), waits=(f"batch {state.batch_index + 1}: {a.reason}",))
    batches = list(state.batches)
    batches[state.batch_index] = a.admitted
    if a.deferred:
        batches.insert(state.batch_index + 1, a.deferred)
    current = tuple(ref for u in a.admitted for ref in u)
    state = replace(state, batches=tuple(batches), current=current, waiting="", last_progress_at=now)
    return decide(state, obs, now)


def unavailable_of(refs: Iterable[InstanceRef], obs: Observations, groups: Groups) -> list[InstanceRef]:
    """The refs not serving clients now (for the budget). Every node of an instance spanning hosts
    is unavailable when the instance is: its leader is not available or a node's unit is not up."""
    out = []
    for ref in refs:
        nodes = groups.get(ref)
        if nodes is None:
            ok = obs.of(ref).available
        else:
            ok = obs.of(nodes[0]).available and all(_unit_up(obs.of(n)) for n in nodes[1:])
        if not ok:
            out.append(ref)
    return out


def _unit_up(f: InstanceFacts) -> bool:
    return not f.unreachable and f.unit is not None and f.unit.active_state == "active"


def unreachable_for(f: InstanceFacts, now: float) -> float:
    """Seconds the instance's host has not been heard from: 0 when it answered; infinite when the
    executor does not say since when (the engine then decides at once)."""
    if not f.unreachable:
        return 0.0
    if f.unreachable_since is None:
        return math.inf
    return max(0.0, now - f.unreachable_since)


def for_how_long(seconds: float) -> str:
    """`` for 12s`` (nothing when not known)."""
    return "" if math.isinf(seconds) else f" for {seconds:.0f}s"


def _unreachable_note(ref: InstanceRef, f: InstanceFacts, p: RolloutPolicy, now: float) -> str:
    gone = unreachable_for(f, now)
    return (
        f"{ref}: host {ref.host} unreachable{for_how_long(gone)} (deciding at {p.unreachable_timeout_s:g}s, "
        f"unreachable_timeout_s): {f.unreachable}"
    )


def _silent_hosts(state: RolloutState, obs: Observations, now: float) -> dict[str, tuple[float, str]]:
    """Hosts observed unreachable for at least ``unreachable_timeout_s``: seconds and why."""
    out: dict[str, tuple[float, str]] = {}
    for ref in state.instances:
        f = obs.instances.get(ref)
        if f is None or not f.unreachable or ref.host in out:
            continue
        gone = unreachable_for(f, now)
        if gone >= state.policy.unreachable_timeout_s:
            out[ref.host] = (gone, f.unreachable)
    return out


def _skip(state: RolloutState, silent: Mapping[InstanceRef, InstanceFacts], now: float) -> RolloutState:
    """Instances whose host stayed unreachable when their batch came: skipped, never touched."""
    instances = dict(state.instances)
    for ref, f in silent.items():
        if not f.unreachable:  # a node of an instance spanning hosts whose other node is silent
            down = [n for n in instances[ref].target.nodes if n in silent and silent[n].unreachable]
            why = f"skipped: {node_words(instances[down[0]])} unreachable when its batch came" if down else "skipped"
        else:
            gone = unreachable_for(f, now)
            why = f"skipped: host {ref.host} unreachable{for_how_long(gone)} when its batch came ({f.unreachable})"
        instances[ref] = replace(instances[ref], phase=Phase.SKIPPED, phase_since=now, failure=why, note=why)
    return replace(state, instances=instances)


def _finished(state: RolloutState) -> Decision:
    """Every batch went: done, unless instances were skipped (their host was unreachable)."""
    skipped = [i for i in state.instances.values() if i.phase is Phase.SKIPPED]
    if not skipped:
        return Decision(replace(state, status=RolloutStatus.DONE, reason="every batch is healthy", waiting=""))
    hosts = sorted({i.ref.host for i in skipped})
    reason = (
        f"{len(skipped)} instance(s) skipped, never touched: host(s) {', '.join(hosts)} unreachable "
        f"({', '.join(str(i.ref) for i in skipped)}); every other instance is done"
    )
    return Decision(replace(state, status=RolloutStatus.HALTED, reason=reason, waiting=""))


def _fail_batch(state: RolloutState, why: str, now: float) -> RolloutState:
    """The batch failed: roll back every touched instance of it (or only halt)."""
    if state.policy.on_failure is OnFailure.HALT:
        return replace(state, failing=why)
    instances = dict(state.instances)
    #: a node of an instance spanning hosts restarts on the way back when any node was stopped
    stopped = {ref for ref in state.current if any(instances[n].changed for n in instances[ref].target.nodes)}
    for ref in state.current:
        inst = instances[ref]
        if not inst.touched or inst.rolling_back:
            continue  # never touched: stays as it is
        if ref in stopped:
            inst = replace(inst, changed=True)
        failure = inst.failure or (
            "rolled back with its batch" if inst.phase is Phase.DONE else "stopped: batch failed"
        )
        lost = _nothing_to_go_back_to(inst)
        if inst.changed and lost:
            instances[ref] = replace(
                inst, rolling_back=True, failure=failure, phase=Phase.ROLLBACK_FAILED, rollback_failure=lost
            )
            continue
        drain_again = inst.phase is Phase.DONE or "undrain" in inst.hooks_done
        instances[ref] = replace(
            inst,
            rolling_back=True,
            failure=failure,
            # never stopped: only put it back into traffic; else the restart protocol to the old release
            phase=Phase.LB_OUT if inst.changed else Phase.UNDRAIN,
            lb_drained=False,
            hooks_done=() if drain_again else tuple(h for h in inst.hooks_done if h != "undrain"),
            phase_since=now,
            started=False,
            track=None,
            killed=(),
            note="",
        )
    return replace(state, instances=instances, failing=why)


def _nothing_to_go_back_to(inst: InstanceState) -> str:
    """Why a rollback of ``inst`` cannot restore what it ran before; empty when it can."""
    if inst.previous_release is None:
        return "no previous release recorded to go back to"
    if inst.target.revision is not None and inst.previous_revision is None:
        return "no previous configuration recorded to go back to (its unit or env file was missing)"
    return ""


def _bake(state: RolloutState, obs: Observations, now: float) -> Decision:
    """The canary batch serves traffic for ``canary_bake_s``; any gate that does not pass fails it.

    Argo Rollouts' analysis with its default ``failureLimit: 0``; no data is not a pass (Flagger).
    """
    p = state.policy
    if state.baking_since is None:
        return Decision(replace(state, baking_since=now), waits=("canary bake started",))
    for ref in state.current:
        inst = state.inst(ref)
        if inst.phase is not Phase.DONE:
            continue
        f = obs.of(ref)
        if f.unreachable and unreachable_for(f, now) < p.unreachable_timeout_s:
            continue  # not observed yet; decided once unreachable_timeout_s has passed
        if inst.headless and not f.unreachable:
            check, detail = check_unit(f.unit, inst.baseline_restarts)  # no HTTP: its unit must stay up
            if check is Check.FATAL:
                failed = replace(state, baking_since=None, last_progress_at=now)
                why = f"{node_words(inst)}: canary bake: its unit: {detail}"
                return decide(_fail_batch(failed, why, now), obs, now)
            continue
        probe = f.probe if not f.unreachable else Probe(now, unreachable=f.unreachable)
        if probe is None:
            continue
        checks = evaluate(probe, Expect(inst.model, inst.baseline_restarts, p.metrics, inst.adapters))
        gate, check, detail = checks[-1]
        if check is not Check.PASS:
            why = f"{node_words(inst)}: canary bake: {gate.value} gate: {detail}"
            failed = replace(state, baking_since=None, last_progress_at=now)
            failed = _fail_batch(failed, why, now)
            return decide(failed, obs, now)
    baked = now - state.baking_since
    if baked >= p.canary_bake_s:
        return _batch_finished(replace(state, baking_since=None), now)
    return Decision(state, waits=(f"canary bake: {baked:.0f}s of {p.canary_bake_s:g}s, all gates green",))


def _batch_finished(state: RolloutState, now: float) -> Decision:
    if state.failing:
        phases = [state.inst(r) for r in state.current]
        rb_failed = [i for i in phases if i.phase is Phase.ROLLBACK_FAILED]
        what = "rolled back" if state.policy.on_failure is OnFailure.ROLLBACK else "halted"
        reason = f"batch {state.batch_index + 1} failed ({state.failing}); batch {what}"
        if rb_failed:
            reason += "; rollback failed on " + ", ".join(f"{i.ref} ({i.rollback_failure})" for i in rb_failed)
        return Decision(replace(state, status=RolloutStatus.HALTED, reason=reason))
    state = replace(state, batch_index=state.batch_index + 1, current=(), last_progress_at=now)
    return Decision(state)


def _unit_running(f: InstanceFacts) -> bool:
    return f.unit is not None and f.unit.active_state in ("active", "activating", "reloading", "deactivating")


@dataclass(frozen=True)
class Peers:
    """For a node of an instance spanning hosts: every node's state as this tick has it so far,
    and what was observed of each."""

    states: Mapping[InstanceRef, InstanceState]
    obs: Observations

    def others(self, inst: InstanceState) -> list[InstanceState]:
        return [self.states[n] for n in inst.target.nodes if n != inst.ref and n in self.states]

    def leader(self, inst: InstanceState) -> InstanceState:
        return self.states[inst.target.nodes[0]]

    def lost(self, inst: InstanceState) -> InstanceState | None:
        """A node of the instance that will not get where this one waits for it: failed (in a
        halted batch), whose rollback failed, or skipped."""
        return next((o for o in self.others(inst) if o.phase in _LOST), None)

    def current(self, inst: InstanceState) -> bool:
        """Every node on its target; the leader serving, every other node's unit up."""
        nodes = [self.states[n] for n in inst.target.nodes]
        return (
            all(_on_target(n, self.obs.of(n.ref)) for n in nodes)
            and self.obs.of(nodes[0].ref).serving
            and all(_unit_up(self.obs.of(n.ref)) for n in nodes[1:])
        )


#: the phases of a node that its peers waiting for it give up on
_LOST = (Phase.FAILED, Phase.ROLLBACK_FAILED, Phase.SKIPPED)
#: the protocol's order, for "has that node got at least this far" (both ends count as the end)
_ORDER = {
    ph: i
    for i, ph in enumerate((Phase.PENDING, Phase.LB_OUT, Phase.DRAIN, Phase.DRAINING, Phase.STOP, Phase.GPUS,
                            Phase.SWITCH, Phase.START, Phase.GATES, Phase.UNDRAIN, Phase.LB_IN, Phase.DONE))
} | {Phase.ROLLED_BACK: 11}  # fmt: skip


def _reached(inst: InstanceState, phase: Phase) -> bool:
    return _ORDER.get(inst.phase, -1) >= _ORDER[phase]


def _instance_step(
    inst: InstanceState,
    f: InstanceFacts,
    p: RolloutPolicy,
    now: float,
    batch_failing: bool,
    peers: Peers | None = None,
) -> tuple[InstanceState, Action | None]:
    """Advance one instance as far as the facts allow; return the action it needs, if any.
    ``peers``: for a node of an instance spanning hosts, its instance's other nodes."""
    for _ in range(len(Phase)):  # phases that need no action fall through to the next at once
        if inst.phase in TERMINAL:
            return inst, None
        if inst.phase is Phase.PENDING and batch_failing:
            return inst, None  # never touched; stays as it is
        if inst.first_step_at is not None and now - inst.first_step_at > p.host_deadline_s and not inst.rolling_back:
            return _fail(
                inst, f"not healthy {now - inst.first_step_at:.0f}s after its first step (host_deadline_s)", now
            ), None
        if f.claimed_by:
            # Another rollout holds the host (its claim replaced this one's): never touch it again.
            changed = "before any change" if not inst.changed else f"during {inst.phase.value}"
            return _fail(inst, f"host {inst.ref.host} is claimed {changed} by {f.claimed_by}", now), None
        if f.unreachable:
            # The executor reports a host unreachable once it stopped answering (its SSH layer
            # waits for a silent connection, and retries a broken one, first); the engine gives
            # it unreachable_timeout_s since it was last heard from, then decides: an instance
            # not touched yet is skipped, one in the middle of its restart fails its batch.
            gone = unreachable_for(f, now)
            if gone < p.unreachable_timeout_s:
                return replace(inst, note=_unreachable_note(inst.ref, f, p, now)), None
            if inst.phase is Phase.PENDING and not inst.rolling_back:
                why = f"skipped: host {inst.ref.host} unreachable{for_how_long(gone)} before any change"
                why += f" ({f.unreachable})"
                return _to(inst, Phase.SKIPPED, now, failure=why, note=why), None
            changed = "before any change" if not inst.changed else f"during {inst.phase.value}"
            return _fail(inst, f"host unreachable{for_how_long(gone)} {changed}: {f.unreachable}", now), None
        waiting = _peer_step(inst, f, p, now, peers) if peers is not None else None
        new, action = waiting if waiting is not None else _phase_step(inst, f, p, now)
        if action is not None or new.phase is inst.phase:
            return new, action
        inst = new
    return inst, None


def _peer_step(
    inst: InstanceState, f: InstanceFacts, p: RolloutPolicy, now: float, peers: Peers
) -> tuple[InstanceState, Action | None] | None:
    """Where a node of an instance spanning hosts differs from a single-host instance (see the
    module's docstring); None where it steps as one."""
    lost = peers.lost(inst)
    mine = node_words(inst)
    if inst.phase is Phase.PENDING:
        if lost is not None and lost.phase is Phase.SKIPPED:
            why = f"skipped with its instance: {node_words(lost)} was skipped ({lost.failure})"
            return _to(inst, Phase.SKIPPED, now, failure=why, note=why), None
        silent = [o for o in peers.others(inst) if peers.obs.of(o.ref).unreachable]
        if silent and not inst.rolling_back:
            # no node is touched while another's host does not answer (it may yet be skipped)
            return replace(inst, note=f"waiting for {node_words(silent[0])}: its host does not answer"), None
        if not inst.target.restart and not inst.target.stop_only and peers.current(inst):
            if inst.headless or f.lb is None or f.lb.in_traffic:
                unit = f"{f.unit.active_state}/{f.unit.sub_state}" if f.unit else None
                return _to(inst, Phase.DONE, now, previous_release=f.release, previous_model=f.model,
                           previous_revision=f.revision, previous_unit=unit, previous_adapters=f.adapters,
                           note=f"already serving release {f.release} (every node)"), None  # fmt: skip
            return None  # the leader, out of its balancer's traffic: gated and put back (``_phase_step``)
        if inst.headless:
            unit = f"{f.unit.active_state}/{f.unit.sub_state}" if f.unit else None
            return _to(inst, Phase.LB_OUT, now, first_step_at=now, previous_release=f.release,
                       previous_model=f.model, previous_revision=f.revision, previous_adapters=f.adapters,
                       previous_unit=unit), None  # fmt: skip
        if f.serving and _on_target(inst, f):
            # the leader is on its target but a node is not: the whole instance restarts
            unit = f"{f.unit.active_state}/{f.unit.sub_state}" if f.unit else None
            return _to(inst, Phase.LB_OUT, now, first_step_at=now, previous_release=f.release,
                       previous_model=f.model, previous_revision=f.revision, previous_adapters=f.adapters,
                       previous_unit=unit), None  # fmt: skip
        return None
    if inst.headless and inst.phase in (Phase.LB_OUT, Phase.DRAIN, Phase.UNDRAIN, Phase.LB_IN):
        # no balancer seat, no hooks: its leader stands for the instance
        nxt = {Phase.LB_OUT: Phase.DRAIN, Phase.DRAIN: Phase.DRAINING, Phase.UNDRAIN: Phase.LB_IN}
        if inst.phase in nxt:
            return _to(inst, nxt[inst.phase], now), None
        return _to(inst, Phase.ROLLED_BACK if inst.rolling_back else Phase.DONE, now), None
    if inst.headless and inst.phase is Phase.DRAINING:
        leader = peers.leader(inst)
        if lost is not None:
            return _fail(inst, f"{node_words(lost)} failed while this node waited for the leader to drain", now), None
        if _reached(leader, Phase.STOP) or leader.phase in TERMINAL or f.process_gone or not _unit_running(f):
            return _to(inst, Phase.STOP, now), None
        return replace(inst, note=f"waiting for the leader ({leader.ref.host}) to drain ({leader.phase.value})"), None
    if inst.phase is Phase.START and not inst.started and not _unit_running(f):
        # no node starts before every node can (each would hold its GPUs waiting for the rest)
        if lost is not None:
            return _fail(inst, f"not started: {node_words(lost)} failed ({lost.rollback_failure or lost.failure})",
                         now), None  # fmt: skip
        behind = [o for o in peers.others(inst) if not _reached(o, Phase.START)]
        if behind:
            shown = ", ".join(f"{o.ref.host} ({o.phase.value})" for o in behind)
            return replace(inst, note=f"{mine}: waiting for node(s) {shown}: every node starts together"), None
        return None
    if inst.headless and inst.phase is Phase.GATES:
        check, detail = check_unit(f.unit, inst.baseline_restarts)
        if check is Check.FATAL:
            return _fail(inst, f"its unit: {detail}", now), None
        if lost is not None:
            return _fail(inst, f"{node_words(lost)} failed", now), None
        leader = peers.leader(inst)
        if _reached(leader, Phase.UNDRAIN):
            return _to(inst, Phase.UNDRAIN, now), None
        return replace(inst, note=f"unit {detail}; waiting for the leader's gates ({leader.ref.host})"), None
    return None


def _fail(inst: InstanceState, why: str, now: float) -> InstanceState:
    if inst.rolling_back:
        return replace(inst, phase=Phase.ROLLBACK_FAILED, rollback_failure=why, phase_since=now, note=why)
    return replace(inst, phase=Phase.FAILED, failure=why, phase_since=now, note=why)


def _to(inst: InstanceState, phase: Phase, now: float, **changes: Any) -> InstanceState:
    return replace(inst, **{"phase": phase, "phase_since": now, "note": "", **changes})


def _phase_step(
    inst: InstanceState, f: InstanceFacts, p: RolloutPolicy, now: float
) -> tuple[InstanceState, Action | None]:
    ref = inst.ref
    waited = now - inst.phase_since
    if inst.phase is Phase.PENDING:
        unit = f"{f.unit.active_state}/{f.unit.sub_state}" if f.unit else None
        if kind_skips_current(inst) and _on_target(inst, f) and f.serving and not inst.target.stop_only:
            if f.lb is not None and not f.lb.in_traffic:
                # serving its target, but out of its balancer's traffic (a halted rollout left it
                # there): gate it, then put it back; nothing is stopped
                return _to(inst, Phase.GATES, now, first_step_at=now, previous_release=f.release,
                           previous_model=f.model, previous_revision=f.revision, previous_unit=unit,
                           previous_adapters=f.adapters, baseline_restarts=f.unit.n_restarts if f.unit else 0,
                           track=start_track(now),
                           note=f"serving release {f.release} but out of traffic ({f.lb.view})"), None  # fmt: skip
            # Already there and serving: nothing to do (Kubernetes compares the template hash;
            # Nomad reports a rollback to the same job as a no-op).
            return _to(inst, Phase.DONE, now, previous_release=f.release, previous_model=f.model,
                       previous_revision=f.revision, previous_unit=unit, previous_adapters=f.adapters,
                       note=f"already serving release {f.release}"), None  # fmt: skip
        return _to(
            inst,
            Phase.LB_OUT,
            now,
            first_step_at=now,
            previous_release=f.release,
            previous_model=f.model,
            previous_revision=f.revision,
            previous_adapters=f.adapters,
            previous_unit=unit,
        ), None
    if inst.phase is Phase.LB_OUT:
        if f.lb_error:
            return _fail(inst, f"load balancer not reachable: {f.lb_error}", now), None
        if f.lb is not None and f.lb.admin.value == "ready":
            return inst, Action(Act.LB, ref, "take the instance out of traffic on its load balancer", lb_state="drain")
        return _to(inst, Phase.DRAIN, now), None
    if inst.phase is Phase.DRAIN:
        argv = p.hooks.argv("drain", host=ref.host, instance=ref.instance, port=inst.target.port)
        if argv is not None and "drain" not in inst.hooks_done:
            why = "take the instance out of traffic" + _hook_place(p)
            return inst, Action(Act.HOOK, ref, why, hook="drain", argv=tuple(argv))
        return _to(inst, Phase.DRAINING, now), None
    if inst.phase is Phase.DRAINING:
        if f.process_gone or not _unit_running(f):
            return _to(inst, Phase.STOP, now), None
        if f.lb_error:
            return _fail(inst, f"load balancer not reachable while draining: {f.lb_error}", now), None
        if f.lb is not None and not inst.lb_drained:
            # first the balancer: no session or queued request for the server any more; then, in
            # the same observation, vLLM's own count (not a probe interval later)
            if f.lb.busy == 0:
                inst, waited = replace(inst, lb_drained=True, phase_since=now, note=""), 0.0
            elif waited > p.drain_timeout_s:
                note = f"balancer still has {f.lb.describe()} after {waited:.0f}s; going on"
                return replace(inst, lb_drained=True, phase_since=now, note=note), None
            else:
                return replace(
                    inst,
                    note=f"draining on the balancer: {f.lb.sessions} session(s), {f.lb.queued} queued, "
                    f"{waited:.0f}s of {p.drain_timeout_s:g}s",
                ), None
        if f.in_flight == 0:
            return _to(inst, Phase.STOP, now), None
        if waited > p.drain_timeout_s:
            note = f"{f.in_flight} request(s) in flight after {waited:.0f}s; SIGTERM: --shutdown-timeout ends them"
            return _to(inst, Phase.STOP, now, note=note), None
        shown = "unknown (no /metrics)" if f.in_flight is None else f"{f.in_flight:g}"
        return replace(
            inst, note=f"draining: {shown} request(s) in flight, {waited:.0f}s of {p.drain_timeout_s:g}s"
        ), None
    if inst.phase is Phase.STOP:
        if _unit_running(f) or (f.unit is not None and f.unit.main_pid):
            return replace(inst, changed=True), Action(Act.STOP, ref, "SIGTERM; vLLM drains for --shutdown-timeout")
        return _to(inst, Phase.GPUS, now), None
    if inst.phase is Phase.GPUS:
        new, action = _gpus(inst, f, p, now, waited)
        if new.phase is Phase.SWITCH and inst.target.stop_only:
            return _to(new, Phase.LB_IN, now), None  # drained: stopped, GPUs free; maintenance on the balancer
        return new, action
    if inst.phase is Phase.SWITCH:
        if not _on_target(inst, f):
            was = f"was {f.release}" + (f" (config {f.revision})" if inst.revision else "")
            return inst, Action(Act.FLIP, ref, was, release=inst.release, revision=inst.revision)
        return _to(inst, Phase.START, now), None
    if inst.phase is Phase.START:
        if f.unit is not None and f.unit.active_state in ("active", "activating", "reloading"):
            return _to(inst, Phase.GATES, now, baseline_restarts=f.unit.n_restarts, track=start_track(now)), None
        if inst.started and f.unit is not None and f.unit.active_state == "failed":
            return _fail(inst, "unit failed right after start", now), None
        return inst, Action(Act.START, ref, f"release {inst.release}")
    if inst.phase is Phase.GATES:
        probe = f.probe if not f.unreachable else Probe(now, unreachable=f.unreachable)
        if probe is None:
            return replace(inst, note="awaiting gate probes"), None
        track = inst.track or start_track(now)
        expect = Expect(inst.model, inst.baseline_restarts, p.metrics, inst.adapters)
        track, verdict = gate_step(track, probe, expect, p, now)
        if verdict.status is Status.PASS:
            return _to(inst, Phase.UNDRAIN, now, track=track), None
        if verdict.status is Status.FAIL:
            return _fail(replace(inst, track=track), f"{verdict.gate.value} gate: {verdict.detail}", now), None
        return replace(inst, track=track, note=f"{verdict.gate.value}: {verdict.detail}"), None
    if inst.phase is Phase.UNDRAIN:
        argv = p.hooks.argv("undrain", host=ref.host, instance=ref.instance, port=inst.target.port)
        if argv is not None and "undrain" not in inst.hooks_done:
            why = "put the instance back into traffic" + _hook_place(p)
            return inst, Action(Act.HOOK, ref, why, hook="undrain", argv=tuple(argv))
        return _to(inst, Phase.LB_IN, now), None
    if inst.phase is Phase.LB_IN:
        want = "maint" if inst.target.stop_only and not inst.rolling_back else "ready"
        if f.lb_error:
            return _fail(inst, f"load balancer not reachable to set it {want}: {f.lb_error}", now), None
        if f.lb is not None and f.lb.admin.value != want:
            why = ("keep it out of traffic (maintenance) while drained" if want == "maint"
                   else "put the instance back into traffic on its load balancer: every gate passed")  # fmt: skip
            return inst, Action(Act.LB, ref, why, lb_state=want)
        return _to(inst, Phase.ROLLED_BACK if inst.rolling_back else Phase.DONE, now), None
    raise AssertionError(inst.phase)


def _on_target(inst: InstanceState, f: InstanceFacts) -> bool:
    """The instance's release link and (when the target names one) its configuration are the ones
    it is heading for."""
    return f.release == inst.release and (inst.revision is None or f.revision == inst.revision)


def _hook_place(p: RolloutPolicy) -> str:
    """Where the hook runs, for the journal and the live view (nothing for the default)."""
    return " (hook runs on the host)" if p.hooks.on is HookPlace.HOST else ""


def kind_skips_current(inst: InstanceState) -> bool:
    """Whether an instance already on its target is left alone: yes, except in an on-call restart."""
    return not inst.target.restart


def _gpus(
    inst: InstanceState, f: InstanceFacts, p: RolloutPolicy, now: float, waited: float
) -> tuple[InstanceState, Action | None]:
    procs = f.gpu_processes
    if not procs:
        return _to(inst, Phase.SWITCH, now), None
    ours = [g for g in procs if g.ours]
    foreign = [g for g in procs if not g.ours]
    shown = "; ".join(str(g) for g in procs)
    if foreign and waited > p.gpu_free_timeout_s:
        return _fail(
            inst,
            f"GPUs not free: {'; '.join(str(g) for g in foreign)} (not started by this unit: stop it, "
            "or move the instance to free GPUs)",
            now,
        ), None
    if ours and p.orphans is OrphanPolicy.FAIL:
        return _fail(inst, f"orphaned engine after stop: {shown}; stop it (orphans: stop does this)", now), None
    to_kill = tuple(sorted({g.pid for g in ours} - set(inst.killed)))
    if to_kill:
        why = "orphaned engine left by the stopped unit: " + "; ".join(str(g) for g in ours if g.pid in to_kill)
        return replace(inst, killed=inst.killed + to_kill, note=why), Action(Act.KILL, inst.ref, why, pids=to_kill)
    if waited > p.gpu_free_timeout_s:
        return _fail(inst, f"GPUs still not free {waited:.0f}s after stop: {shown}", now), None
    return replace(inst, note=f"waiting for the GPUs to be free: {shown}"), None


# ---- outcomes -------------------------------------------------------------------------------------


def after(state: RolloutState, action: Action, ok: bool, detail: str, now: float) -> RolloutState:
    """Record what came of an action (the runner calls this after the executor returns)."""
    if action.ref is None:
        return state
    inst = state.inst(action.ref)
    if ok:
        if action.kind is Act.HOOK:
            inst = replace(inst, hooks_done=(*inst.hooks_done, action.hook))
        elif action.kind is Act.START:
            inst = replace(inst, started=True)
        elif action.kind is Act.LB:
            inst = replace(inst, lb_out=action.lb_state != "ready")
    else:
        inst = _fail(inst, f"{action.kind.value} failed: {detail}", now)
    return replace(state, instances={**state.instances, action.ref: inst})


# ---- journal form ----------------------------------------------------------------------------------


def state_to_dict(state: RolloutState) -> dict[str, Any]:
    return {
        "id": state.id,
        "fleet": state.fleet,
        "kind": state.kind,
        "policy": policy_to_raw(state.policy),
        "batches": [[[str(r) for r in u] for u in b] for b in state.batches],
        "instances": [_inst_to_dict(i) for i in state.instances.values()],
        "started_at": state.started_at,
        "batch_index": state.batch_index,
        "current": [str(r) for r in state.current],
        "status": state.status.value,
        "reason": state.reason,
        "failing": state.failing,
        "last_progress_at": state.last_progress_at,
        "waiting": state.waiting,
        "baking_since": state.baking_since,
    }


def state_from_dict(d: Mapping[str, Any]) -> RolloutState:
    instances = [_inst_from_dict(x) for x in d["instances"]]
    return RolloutState(
        id=d["id"],
        fleet=d["fleet"],
        kind=d["kind"],
        policy=parse_policy(d["policy"], source="journal", where=f"rollout {d['id']}"),
        batches=tuple(tuple(tuple(InstanceRef.parse(r) for r in u) for u in b) for b in d["batches"]),
        instances={i.ref: i for i in instances},
        started_at=d["started_at"],
        batch_index=d["batch_index"],
        current=tuple(InstanceRef.parse(r) for r in d["current"]),
        status=RolloutStatus(d["status"]),
        reason=d["reason"],
        failing=d["failing"],
        last_progress_at=d["last_progress_at"],
        waiting=d["waiting"],
        baking_since=d.get("baking_since"),
    )


def _inst_to_dict(i: InstanceState) -> dict[str, Any]:
    return {
        "ref": str(i.ref),
        "target": {
            "release": i.target.release,
            "model": i.target.model,
            "port": i.target.port,
            "restart": i.target.restart,
            "revision": i.target.revision,
            "stop_only": i.target.stop_only,
            "adapters": list(i.target.adapters) if i.target.adapters is not None else None,
            "nodes": [str(n) for n in i.target.nodes],
        },
        "phase": i.phase.value,
        "rolling_back": i.rolling_back,
        "phase_since": i.phase_since,
        "first_step_at": i.first_step_at,
        "previous_release": i.previous_release,
        "previous_model": i.previous_model,
        "previous_revision": i.previous_revision,
        "previous_adapters": list(i.previous_adapters) if i.previous_adapters is not None else None,
        "previous_unit": i.previous_unit,
        "hooks_done": list(i.hooks_done),
        "killed": list(i.killed),
        "started": i.started,
        "changed": i.changed,
        "baseline_restarts": i.baseline_restarts,
        "track": i.track.to_dict() if i.track else None,
        "failure": i.failure,
        "rollback_failure": i.rollback_failure,
        "note": i.note,
        "lb_drained": i.lb_drained,
        "lb_out": i.lb_out,
    }


def _inst_from_dict(d: Mapping[str, Any]) -> InstanceState:
    ref = InstanceRef.parse(d["ref"])
    t = d["target"]
    return InstanceState(
        ref=ref,
        target=Target(
            ref,
            t["release"],
            t["model"],
            t["port"],
            t["restart"],
            t.get("revision"),
            t.get("stop_only", False),
            tuple(t["adapters"]) if t.get("adapters") is not None else None,
            tuple(InstanceRef.parse(n) for n in t.get("nodes") or ()),
        ),
        phase=Phase(d["phase"]),
        rolling_back=d["rolling_back"],
        phase_since=d["phase_since"],
        first_step_at=d["first_step_at"],
        previous_release=d["previous_release"],
        previous_model=d["previous_model"],
        previous_revision=d.get("previous_revision"),
        previous_adapters=tuple(d["previous_adapters"]) if d.get("previous_adapters") is not None else None,
        previous_unit=d["previous_unit"],
        hooks_done=tuple(d["hooks_done"]),
        killed=tuple(d["killed"]),
        started=d["started"],
        changed=d["changed"],
        baseline_restarts=d["baseline_restarts"],
        track=GateTrack.from_dict(d["track"]) if d["track"] else None,
        failure=d["failure"],
        rollback_failure=d["rollback_failure"],
        note=d["note"],
        lb_drained=d.get("lb_drained", False),
        lb_out=d.get("lb_out", False),
    )
