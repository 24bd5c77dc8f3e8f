"""The loop around the engine: observe → decide → journal → act → record, until done or halted.

Each action is journaled (with what was there before) before the executor takes it. Ctrl-C (or
``should_stop``) is honoured between steps: the state stays ``running`` in the journal, an
``interrupted`` step records the stop, and ``fleet rollout --resume ID`` picks it up. Every
executor call has its own deadline (the SSH layer's, ``fleet.facts.sshlink``), so the step in
progress ends in bounded time even when a host stops answering. ``Runner.state`` is the latest
state at every point, for a caller that aborts in the middle of a step (a second Ctrl-C). A
journal that cannot be written (a full disk, a shared database gone) ends the loop the same way,
at once: no step is taken that was not journaled first, and the returned state (still
``running``: interrupted) names every instance the rollout left mid-way (``engine.left_midway``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fleet.errors import FleetError
from fleet.rollout.engine import (
    Act,
    Action,
    Phase,
    RolloutState,
    RolloutStatus,
    after,
    decide,
    interrupted,
    left_midway,
    midway_words,
    resume,
)
from fleet.rollout.errors import JournalError
from fleet.rollout.executor import Executor
from fleet.rollout.gates import Probe
from fleet.rollout.journal import RolloutJournal
from fleet.rollout.observe import InstanceFacts, Observations

T = TypeVar("T")
R = TypeVar("R")


def parallel(fn: Callable[[T], R], items: Iterable[T], max_workers: int) -> list[R]:
    """``fn`` over ``items`` on up to ``max_workers`` threads, results in order. An exception in
    the calling thread (a second Ctrl-C) does not wait for calls still running: it leaves them to
    end on their own deadlines (the caller closes the executor's connections to hurry them)."""
    items = list(items)
    if len(items) <= 1 or max_workers <= 1:
        return [fn(i) for i in items]
    pool = ThreadPoolExecutor(max_workers=min(len(items), max_workers))
    try:
        results = list(pool.map(fn, items))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def before_of(facts: InstanceFacts | None) -> dict[str, Any]:
    """What was there before a step, for the journal."""
    if facts is None:
        return {}
    unit = f"{facts.unit.active_state}/{facts.unit.sub_state}" if facts.unit else None
    return {
        "release": facts.release,
        "revision": facts.revision,
        "model": facts.model,
        "unit": unit,
        "unreachable": facts.unreachable,
    }


def _shape(state: RolloutState) -> tuple[Any, ...]:
    """What of a state is worth a journal write when no action is taken (not clocks or notes)."""
    phases = tuple(
        (str(r), i.phase.value, i.rolling_back, i.track.soak_resets if i.track else 0)
        for r, i in state.instances.items()
    )  # a soak reset is journaled when it happens
    return (state.status, state.batch_index, state.current, state.failing, phases, len(state.batches), state.baking)


@dataclass
class Runner:
    executor: Executor
    journal: RolloutJournal
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    should_stop: Callable[[], bool] = lambda: False
    on_event: Callable[[str], None] = lambda _line: None
    max_parallel: int = 64  #: actions of one tick taken at once (one per instance of the batch)
    ticks: int = field(default=0)
    #: the latest state: as decided (before its actions are taken) and after each outcome
    state: RolloutState | None = None

    def observe(self, state: RolloutState) -> Observations:
        # Between batches every instance is observed (the budget counts them all); during a batch
        # only its members. Instances are observed side by side (one SSH round trip each).
        refs = list(state.current) if state.current else list(state.instances)

        def one(ref: Any) -> InstanceFacts:
            f = self.executor.facts(ref)
            gating = state.inst(ref).phase is Phase.GATES or (state.baking and state.inst(ref).phase is Phase.DONE)
            gating = gating and not state.inst(ref).headless  # a headless node serves no HTTP: its unit is its gate
            if state.current and gating and not f.unreachable:
                f = _with_probe(f, self.executor.probe(ref, state.policy, state.inst(ref).model))
            return f

        found = parallel(one, refs, self.max_parallel)
        return Observations(self.clock(), dict(zip(refs, found, strict=True)))

    def execute(self, action: Action, state: RolloutState) -> str:
        ex, ref = self.executor, action.ref
        assert ref is not None
        if action.kind is Act.STOP:
            return ex.stop_unit(ref) or "ok"
        elif action.kind is Act.START:
            ex.start_unit(ref)
        elif action.kind is Act.KILL:
            ex.kill(ref, action.pids)
        elif action.kind is Act.FLIP:
            ex.flip_release(ref, action.release, action.revision)
        elif action.kind is Act.LB:
            ex.set_lb_state(ref, action.lb_state)
        elif action.kind is Act.HOOK:
            hooks = state.policy.hooks
            return ex.run_hook(ref, action.argv, hooks.timeout_s, hooks.on)
        return "ok"

    def _execute_all(self, actions: Sequence[Action], state: RolloutState) -> list[tuple[bool, str]]:
        def one(action: Action) -> tuple[bool, str]:
            try:
                return True, self.execute(action, state)
            except FleetError as exc:
                return False, str(exc)

        return parallel(one, actions, self.max_parallel)

    def run(self, state: RolloutState) -> RolloutState:
        shape = _shape(state)
        self.state = state
        while state.status is RolloutStatus.RUNNING:
            if self.should_stop():
                try:
                    self.journal.interrupted(state, "stopped between steps on request", self.clock())
                except JournalError as exc:
                    return self._unjournaled(state, exc)
                self.on_event(f"stopped between steps; resume with: fleet rollout --resume {state.id}")
                return state
            self.ticks += 1
            obs = self.observe(state)
            decision = decide(state, obs, self.clock())
            state = self.state = decision.state
            # Every action of this tick is journaled first, then they run side by side (one per
            # instance of the batch: a batch restarts together), then their outcomes are recorded.
            seqs = []
            try:
                for action in decision.actions:
                    before = before_of(obs.instances.get(action.ref) if action.ref else None)
                    seqs.append(self.journal.intent(state, action, before, self.clock()))
                    self.on_event(str(action))
            except JournalError as exc:
                return self._unjournaled(state, exc)  # not one action of this tick is taken
            results = self._execute_all(decision.actions, state)
            outcomes = []
            for action, (ok, detail) in zip(decision.actions, results, strict=True):
                state = self.state = after(state, action, ok, detail, self.clock())
                outcomes.append((ok, detail, state))
            try:
                for seq, (ok, detail, then) in zip(seqs, outcomes, strict=True):
                    self.journal.outcome(seq, then, ok, detail, self.clock())
                if not decision.actions and _shape(state) != shape:
                    self.journal.save(state, self.clock())
            except JournalError as exc:
                return self._unjournaled(state, exc)
            if not decision.actions:
                for line in decision.waits:
                    self.on_event(f"waiting: {line}")
                if state.status is RolloutStatus.RUNNING:
                    self.sleep(state.policy.probe_interval_s)
            shape = _shape(state)
        try:
            self.journal.save(state, self.clock())
        except JournalError as exc:
            return self._unjournaled(state, exc)
        self.on_event(f"{state.status.value}: {state.reason}")
        return state

    def _unjournaled(self, state: RolloutState, exc: JournalError) -> RolloutState:
        """The journal cannot be written: stop here (a step is never taken unjournaled), naming
        what the rollout left mid-way; the journal keeps its last write, so ``--resume`` works once
        it is back."""
        state = interrupted(state, f"the journal could not be written ({exc}); no further step was taken")
        self.on_event(f"interrupted: {state.reason}")
        for inst in left_midway(state):
            self.on_event(f"left mid-way: {inst.ref}: {midway_words(inst)}")
        return state


def _with_probe(f: InstanceFacts, probe: Probe) -> InstanceFacts:
    return replace(f, probe=probe)


def open_rollout(journal: RolloutJournal, state: RolloutState, *, takeover: bool = False) -> RolloutState:
    """Take the fleet's lock and journal a new rollout, before anything is touched."""
    journal.acquire(state.fleet, state.id, takeover=takeover)
    journal.begin(state)
    return state


def reopen_rollout(journal: RolloutJournal, rollout_id: str, now: float, *, takeover: bool = False) -> RolloutState:
    """``--resume``: the journaled state of a rollout that did not finish, under the fleet's lock,
    with its clocks restarted; the runner then re-observes every instance."""
    state = journal.latest_state(rollout_id)
    if state.status is not RolloutStatus.RUNNING:
        raise JournalError(
            f"rollout {rollout_id} is {state.status.value} ({state.reason}); nothing to resume. "
            "Start a new rollout, or `fleet rollback` to the last good release"
        )
    journal.acquire(state.fleet, rollout_id, takeover=takeover)
    return resume(state, now)
