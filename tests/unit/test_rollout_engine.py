"""The step engine over a simulated fleet: table tests of ``decide`` and whole scenarios.

``SimFleet`` is an in-memory ``Executor``: units with systemd's states, a release link, GPU
processes as NVML lists them, and vLLM's behaviour at the gates (refused while loading, 200
after; faults: fails to load, alive but hung, flapping completion, orphaned engine after stop,
host down). A fake clock drives every deadline. The lab tests run the real stand-in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import (
    Act,
    InstanceState,
    Phase,
    RolloutState,
    RolloutStatus,
    Target,
    decide,
    new_rollout,
    state_from_dict,
    state_to_dict,
)
from fleet.rollout.executor import ExecutorError
from fleet.rollout.gates import CompletionAnswer, GpuEvents, GpuEventSeen, HttpAnswer, ModelsAnswer, Probe, UnitState
from fleet.rollout.journal import Journal
from fleet.rollout.observe import GpuProcess, InstanceFacts, Observations
from fleet.rollout.policy import GateTimeouts, HookPlace, Hooks, OnFailure, OrphanPolicy, RolloutPolicy
from fleet.rollout.runner import Runner

GiB = 2**30
MODELS = {"v1": "llama-8b", "v2": "llama-8b-instruct-v2"}
#: configuration revisions (unit + env file) and the model each serves; "c1" is what runs at first
REVISION_MODELS = {"c1": None, "c2": "qwen-7b", "c3": "mistral-7b"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class SimInstance:
    ref: InstanceRef
    release: str = "v1"
    revision: str = "c1"
    active: str = "active"
    sub: str = "running"
    n_restarts: int = 0
    main_pid: int = 100
    started_at: float = 0.0
    gpu: list[GpuProcess] = field(default_factory=list)
    sick: bool = False  #: not serving before the rollout starts


class SimFleet:
    """An in-memory fleet that behaves like vLLM under systemd at the boundaries the engine sees."""

    def __init__(self, clock: Clock, counts: Sequence[int], load_s: float = 5.0) -> None:
        self.clock = clock
        self.load_s = load_s
        self.instances = {
            r.ref: r
            for r in (SimInstance(InstanceRef(f"h{h}", f"i{i}")) for h, n in enumerate(counts) for i in range(n))
        }
        self.pid = 1000
        self.fail_load: set[str] = set()  # releases whose model fails to load
        self.hang: set[str] = set()  # releases that come up but never produce a token
        self.flap_at: set[float] = set()  # completion answers "abort" once at these times (±1 s)
        self.orphan_on_stop: set[InstanceRef] = set()
        self.foreign: dict[InstanceRef, GpuProcess] = {}
        self.down_from: dict[str, float] = {}
        #: the GPU watcher's events: an XID on an instance's GPU at a time (host, time, what, action)
        self.gpu_faults: list[tuple[str, float, str, str]] = []
        self.log: list[str] = []
        self.max_down = 0
        #: report when a down host was last heard from (``InstanceFacts.unreachable_since``), as the
        #: SSH executor does; off: the engine decides at once, as for an executor that cannot say
        self.report_since = False

    # -- helpers -------------------------------------------------------------------------------
    def _down(self, host: str) -> bool:
        return host in self.down_from and self.clock.now >= self.down_from[host]

    def _loaded(self, s: SimInstance) -> bool:
        return s.active == "active" and self.clock.now - s.started_at >= self.load_s

    def _tick(self, s: SimInstance) -> None:
        if s.active == "active" and {s.release, s.revision} & self.fail_load and self._loaded(s):
            s.active, s.sub, s.main_pid = "failed", "failed", 0
            s.gpu = [g for g in s.gpu if not g.ours]

    @staticmethod
    def model(s: SimInstance) -> str:
        return REVISION_MODELS[s.revision] or MODELS[s.release]

    def serving(self, s: SimInstance) -> bool:
        self._tick(s)
        return self._loaded(s) and not s.sick and not self._down(s.ref.host)

    def _track(self) -> None:
        self.max_down = max(self.max_down, sum(1 for s in self.instances.values() if not self.serving(s)))

    # -- Executor --------------------------------------------------------------------------------
    def facts(self, ref: InstanceRef) -> InstanceFacts:
        s = self.instances[ref]
        if self._down(ref.host):
            since = self.down_from[ref.host] if self.report_since else None
            return InstanceFacts(ref, unreachable="ssh: connect to host timed out", unreachable_since=since)
        self._tick(s)
        gpus = tuple(s.gpu) + ((self.foreign[ref],) if ref in self.foreign else ())
        return InstanceFacts(
            ref,
            unit=UnitState(s.active, s.sub, s.n_restarts, s.main_pid),
            release=s.release,
            model=self.model(s),
            revision=s.revision,
            gpu_processes=gpus if s.active != "active" else (),
            in_flight=0.0 if self._loaded(s) else None,
            serving=self.serving(s),
        )

    def probe(self, ref: InstanceRef, policy: RolloutPolicy, model: str) -> Probe:
        s = self.instances[ref]
        now = self.clock.now
        unit = UnitState(s.active, s.sub, s.n_restarts, s.main_pid)
        if not self._loaded(s):
            return Probe(now, unit=unit, health=HttpAnswer(None, "connection refused"))
        completion = CompletionAnswer(200, text=" OK", finish_reason="length", completion_tokens=4)
        if s.release in self.hang:
            completion = CompletionAnswer(None, f"timed out after {policy.probe_timeout_s:g}s")
        elif any(abs(now - t) < 1 for t in self.flap_at):
            completion = CompletionAnswer(200, text="", finish_reason="abort")
        served = self.model(s)
        # as the SSH executor reads them: the watcher's events since the unit's process started
        seen = GpuEvents(tuple(GpuEventSeen(0, t, what, action) for h, t, what, action in self.gpu_faults
                               if h == ref.host and s.started_at <= t <= now))  # fmt: skip
        return Probe(
            now,
            gpu_events=seen,
            unit=unit,
            health=HttpAnswer(200),
            models=ModelsAnswer(200, ids=(served,)),
            # as vLLM's /v1/completions: a model it does not serve is a 404 (the prober asks for ``model``)
            completion=completion if model == served else CompletionAnswer(404, f"model {model} does not exist"),
        )

    def _reach(self, ref: InstanceRef, what: str) -> SimInstance:
        if self._down(ref.host):
            raise ExecutorError(f"{ref.host}: ssh: connect to host timed out ({what})")
        self.log.append(f"{what} {ref}")
        return self.instances[ref]

    def stop_unit(self, ref: InstanceRef) -> None:
        s = self._reach(ref, "stop")
        old = s.main_pid
        s.active, s.sub, s.main_pid = "inactive", "dead", 0
        s.gpu = [GpuProcess(old + 1, "VLLM::EngineCore", 0, 70 * GiB, True)] if ref in self.orphan_on_stop else []
        self._track()

    def start_unit(self, ref: InstanceRef) -> None:
        s = self._reach(ref, "start")
        self.pid += 10
        s.active, s.sub, s.main_pid, s.started_at, s.sick = "active", "running", self.pid, self.clock.now, False
        s.gpu = [GpuProcess(self.pid + 1, "VLLM::Worker", 0, 70 * GiB, True)]
        self._track()

    def kill(self, ref: InstanceRef, pids: Sequence[int]) -> None:
        s = self._reach(ref, f"kill {list(pids)}")
        s.gpu = [g for g in s.gpu if g.pid not in pids]

    def flip_release(self, ref: InstanceRef, release: str, revision: str | None = None) -> None:
        s = self._reach(ref, f"flip {release}" + (f" {revision}" if revision else ""))
        s.release = release
        if revision is not None:
            if revision not in REVISION_MODELS:
                raise ExecutorError(f"configuration revision {revision} is not stored on the host")
            s.revision = revision

    def run_hook(self, ref: InstanceRef, argv: Sequence[str], timeout_s: float, on: HookPlace) -> str:
        if on is HookPlace.HOST and self._down(ref.host):  # over the host's SSH connection
            raise ExecutorError(f"host {ref.host}: SSH failed: connect timed out (hook {argv[0]})")
        self.log.append("hook " + " ".join(argv) + ("" if on is HookPlace.CONTROL else f" @{ref.host}"))
        return ""

    # -- for assertions ------------------------------------------------------------------------
    def releases(self) -> dict[str, str]:
        return {str(r): s.release for r, s in self.instances.items()}

    def touched(self) -> set[str]:
        return {line.split()[-1] for line in self.log if not line.startswith("hook")}


POLICY = RolloutPolicy(
    batches=(1, 2, "25%"),
    max_unavailable=2,
    soak_s=10,
    host_deadline_s=300,
    progress_deadline_s=600,
    drain_timeout_s=30,
    gpu_free_timeout_s=10,
    probe_interval_s=1,
    timeouts=GateTimeouts(unit=20, health=60, models=20, completion=20, metrics=20),
    hooks=Hooks(drain=("lb", "disable", "{host}/{instance}"), undrain=("lb", "enable", "{host}/{instance}")),
)


def targets(sim: SimFleet, release: str = "v2", restart: bool = False) -> list[Target]:
    return [Target(ref, release, MODELS[release], restart=restart) for ref in sim.instances]


def run(
    tmp_path: Path, sim: SimFleet, policy: RolloutPolicy = POLICY, release: str = "v2", kind: str = "rollout"
) -> tuple[RolloutState, Journal]:
    journal = Journal(tmp_path / "journal.sqlite")
    state = new_rollout("r1", "lab", kind, targets(sim, release, kind == "restart"), policy, sim.clock.now)
    journal.begin(state)
    runner = Runner(sim, journal, clock=sim.clock, sleep=sim.clock.sleep)
    final = runner.run(state)
    assert runner.ticks < 5000
    return final, journal


# ---- scenarios ----------------------------------------------------------------------------------


def test_clean_rollout_over_four_hosts(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1, 1, 1])
    state, journal = run(tmp_path, sim)
    assert state.status is RolloutStatus.DONE, state.reason
    assert set(sim.releases().values()) == {"v2"}
    assert all(sim.serving(s) for s in sim.instances.values())
    assert sim.max_down <= 2
    assert [len(b) for b in state.batches] == [1, 2, 1]
    # canary first: h0 is stopped, started and undrained before anything happens to h1
    first_h1 = next(i for i, line in enumerate(sim.log) if "h1/i0" in line)
    assert sim.log.index("hook lb enable h0/i0") < first_h1
    assert sim.log[:4] == ["hook lb disable h0/i0", "stop h0/i0", "flip v2 h0/i0", "start h0/i0"]
    steps = journal.steps("r1")
    flip = next(s for s in steps if s.action == "flip" and s.instance == "h0/i0")
    assert flip.before == {
        "release": "v1",
        "revision": "c1",
        "model": "llama-8b",
        "unit": "inactive/dead",
        "unreachable": "",
    }
    assert all(s.outcome == "ok" for s in steps)
    assert journal.history("lab")[0].status == "done"


def test_canary_fails_to_load_is_rolled_back_and_halts(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1, 1, 1])
    sim.fail_load.add("v2")
    state, journal = run(tmp_path, sim)
    assert state.status is RolloutStatus.HALTED
    assert state.reason == "batch 1 failed (h0/i0: unit gate: unit failed (failed/failed)); batch rolled back"
    flips = [
        (s.action, s.detail.split(": ")[0], s.before["release"]) for s in journal.steps("r1") if s.action == "flip"
    ]
    assert flips == [("flip", "flip h0/i0 → v2", "v1"), ("flip", "flip h0/i0 → v1", "v2")]
    assert sim.releases() == {"h0/i0": "v1", "h1/i0": "v1", "h2/i0": "v1", "h3/i0": "v1"}
    assert sim.touched() == {"h0/i0"}  # the other hosts were never touched
    assert all(sim.serving(s) for s in sim.instances.values())  # the old model serves everywhere
    canary = state.inst(InstanceRef("h0", "i0"))
    assert canary.phase is Phase.ROLLED_BACK and canary.failure.startswith("unit gate: unit failed")
    assert sim.log[-1] == "hook lb enable h0/i0"


def test_hung_after_start_is_caught_by_the_completion_gate(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1])
    sim.hang.add("v2")
    state, _ = run(tmp_path, sim, replace(POLICY, batches=(1,)))
    assert state.status is RolloutStatus.HALTED
    canary = state.inst(InstanceRef("h0", "i0"))
    assert canary.failure.startswith("completion gate: completion: timed out after 10s (alive but not generating?)")
    assert "(timeouts.completion=20s)" in canary.failure
    assert sim.releases() == {"h0/i0": "v1", "h1/i0": "v1"}


def test_host_down_mid_rollout(tmp_path: Path) -> None:
    clock = Clock()
    sim = SimFleet(clock, [1, 1, 1, 1])
    sim.down_from["h2"] = clock.now + 24  # while batch 2 (h1, h2) soaks
    state, _ = run(tmp_path, sim)
    assert state.status is RolloutStatus.HALTED
    h1, h2 = state.inst(InstanceRef("h1", "i0")), state.inst(InstanceRef("h2", "i0"))
    assert "host unreachable" in h2.failure
    assert h2.phase is Phase.ROLLBACK_FAILED and "ssh: connect to host timed out" in h2.rollback_failure
    assert h1.phase is Phase.ROLLED_BACK and sim.releases()["h1/i0"] == "v1"
    assert sim.releases()["h0/i0"] == "v2"  # the canary's batch succeeded and is kept
    assert "rollback failed on h2/i0" in state.reason
    assert "h3/i0" not in sim.touched()


def test_flapping_gate_resets_the_soak(tmp_path: Path) -> None:
    clock = Clock()
    sim = SimFleet(clock, [1])
    journal = Journal(tmp_path / "j.sqlite")
    state = new_rollout("r1", "lab", "rollout", targets(sim), replace(POLICY, batches=(1,)), clock.now)
    journal.begin(state)
    sim.flap_at.add(clock.now + 12)  # loaded at ~+5: soaking when the answer comes back "abort"
    runner = Runner(sim, journal, clock=clock, sleep=clock.sleep)
    final = runner.run(state)
    inst = final.inst(InstanceRef("h0", "i0"))
    assert final.status is RolloutStatus.DONE
    assert inst.track is not None and inst.track.soak_resets == 1
    assert inst.track.soak_since is not None and inst.track.soak_since >= clock.now - 11
    assert inst.track.soak_since > sorted(sim.flap_at)[0]  # the soak restarted after the flap


def test_orphaned_engine_is_named_and_stopped(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1])
    sim.orphan_on_stop.add(InstanceRef("h0", "i0"))
    state, journal = run(tmp_path, sim)
    assert state.status is RolloutStatus.DONE
    kill = next(s for s in journal.steps("r1") if s.action == "kill")
    assert kill.instance == "h0/i0"
    assert "pid 101 (VLLM::EngineCore) holding 70.0 GiB on GPU 0" in kill.detail
    assert "kill [101] h0/i0" in sim.log


def test_orphaned_engine_fails_the_instance_when_told_not_to_stop_it(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1])
    sim.orphan_on_stop.add(InstanceRef("h0", "i0"))
    state, _ = run(tmp_path, sim, replace(POLICY, orphans=OrphanPolicy.FAIL, on_failure=OnFailure.HALT))
    assert state.status is RolloutStatus.HALTED
    failure = state.inst(InstanceRef("h0", "i0")).failure
    assert failure.startswith("orphaned engine after stop: pid 101 (VLLM::EngineCore) holding 70.0 GiB on GPU 0")
    assert not any(line.startswith("kill") for line in sim.log)


def test_foreign_process_on_the_gpus_fails_after_the_grace(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1])
    sim.foreign[InstanceRef("h0", "i0")] = GpuProcess(4242, "python3", 0, 2 * GiB, False)
    state, _ = run(tmp_path, sim)
    assert state.status is RolloutStatus.HALTED
    failure = state.inst(InstanceRef("h0", "i0")).failure
    assert "GPUs not free: pid 4242 (python3) holding 2.0 GiB on GPU 0 (not started by this unit" in failure
    assert not any("4242" in line for line in sim.log if line.startswith("kill"))


def test_budget_spent_by_sick_instances_waits_then_halts_untouched(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1, 1, 1])
    for name in ("h2", "h3"):
        sim.instances[InstanceRef(name, "i0")].sick = True
    state, _ = run(tmp_path, sim)
    assert state.status is RolloutStatus.HALTED
    assert state.reason.startswith("batch 1 could not start for 60")
    assert "max_unavailable is 2 and 2 instance(s) are already not serving (h2/i0, h3/i0)" in state.reason
    assert sim.log == []


def test_budget_shrinks_a_batch_around_a_sick_instance(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1, 1, 1])
    sim.instances[InstanceRef("h3", "i0")].sick = True
    state, _ = run(tmp_path, sim)
    assert state.status is RolloutStatus.DONE, state.reason
    assert [len(b) for b in state.batches] == [1, 1, 1, 1]  # batch 2 split: h3 is down already
    assert sim.max_down <= 2


def test_hosts_with_two_instances_never_lose_both(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [2, 2])
    down_per_host: list[int] = []
    original = sim.stop_unit

    def stop(ref: InstanceRef) -> None:
        original(ref)
        down_per_host.append(sum(1 for s in sim.instances.values() if s.ref.host == ref.host and not sim.serving(s)))

    sim.stop_unit = stop  # type: ignore[method-assign]
    state, _ = run(tmp_path, sim, replace(POLICY, batches=(1, -1), max_unavailable=4))
    assert state.status is RolloutStatus.DONE
    assert max(down_per_host) == 1
    assert [[str(r) for u in b for r in u] for b in state.batches] == [["h0/i0"], ["h1/i0", "h0/i1"], ["h1/i1"]]


def test_restart_without_a_release_change_does_not_flip(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1])
    state, _ = run(tmp_path, sim, release="v1", kind="restart")
    assert state.status is RolloutStatus.DONE
    assert not any(line.startswith("flip") for line in sim.log)
    assert sum(line.startswith("start") for line in sim.log) == 2


# ---- decide(): table tests over states and observations -------------------------------------------

REF = InstanceRef("h0", "i0")


def one(phase: Phase, **changes: object) -> RolloutState:
    state = new_rollout("r", "lab", "rollout", [Target(REF, "v2", "m2")], POLICY, 0.0)
    changes = {"first_step_at": 0.0, **changes}
    inst = replace(InstanceState(REF, Target(REF, "v2", "m2")), phase=phase, **changes)  # type: ignore[arg-type]
    return replace(state, current=(REF,), instances={REF: inst})


def facts(active: str = "active", sub: str = "running", **changes: object) -> Observations:
    f = InstanceFacts(REF, unit=UnitState(active, sub, 0, 100 if active == "active" else 0), release="v1", model="m1")
    return Observations(5.0, {REF: replace(f, **changes)})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("phase", "obs", "changes", "action", "next_phase"),
    [
        (Phase.PENDING, facts(), {}, "hook", Phase.DRAIN),  # records the previous release, runs the drain hook
        (Phase.DRAIN, facts(), {"hooks_done": ("drain",)}, None, Phase.DRAINING),  # hook done: wait for in-flight
        (Phase.DRAINING, facts(in_flight=3.0), {}, None, Phase.DRAINING),
        (Phase.DRAINING, facts(in_flight=0.0), {}, "stop", Phase.STOP),
        (Phase.STOP, facts(), {}, "stop", Phase.STOP),  # journaled but not taken before a crash: taken again
        (Phase.STOP, facts("inactive", "dead"), {}, "flip", Phase.SWITCH),  # stopped, GPUs free: switch
        (Phase.SWITCH, facts("inactive", "dead", release="v2"), {}, "start", Phase.START),  # link already flipped
        (Phase.START, facts("activating", "start", release="v2"), {}, None, Phase.GATES),  # started before a crash
        (Phase.START, facts("failed", "failed", release="v2"), {"started": True}, None, Phase.FAILED),
        (Phase.START, facts("failed", "failed", release="v2"), {}, "start", Phase.START),  # failed before we started
    ],
)
def test_decide_table(
    phase: Phase, obs: Observations, changes: dict[str, object], action: str | None, next_phase: Phase
) -> None:
    state = one(phase, **changes)
    if phase is Phase.FAILED or next_phase is Phase.FAILED:
        state = replace(state, policy=replace(POLICY, on_failure=OnFailure.HALT))
    d = decide(state, obs, 5.0)
    assert [a.kind.value for a in d.actions] == ([action] if action else [])
    assert d.state.inst(REF).phase is next_phase


def test_decide_records_what_was_there_before() -> None:
    d = decide(one(Phase.PENDING), facts(), 5.0)
    inst = d.state.inst(REF)
    assert (inst.previous_release, inst.previous_model, inst.previous_unit) == ("v1", "m1", "active/running")
    assert inst.previous_adapters is None
    with_adapters = decide(one(Phase.PENDING), facts(adapters=("sql",)), 5.0).state.inst(REF)
    assert with_adapters.previous_adapters == ("sql",)  # what the live revision's revision.json records
    assert d.actions[0].argv == ("lb", "disable", "h0/i0")


def test_decide_drain_timeout_goes_on_to_stop() -> None:
    state = one(Phase.DRAINING, phase_since=0.0)
    d = decide(state, replace(facts(in_flight=2.0), at=40.0), 40.0)
    assert d.actions[0].kind is Act.STOP


def test_decide_unreachable_before_any_change_skips_it_untouched() -> None:
    state = replace(one(Phase.PENDING, first_step_at=None), policy=replace(POLICY, on_failure=OnFailure.HALT))
    d = decide(state, Observations(5.0, {REF: InstanceFacts(REF, unreachable="no route to host")}), 5.0)
    inst = d.state.inst(REF)
    assert inst.phase is Phase.SKIPPED and not inst.touched and d.actions == ()
    assert inst.failure == "skipped: host h0 unreachable before any change (no route to host)"
    d = decide(d.state, Observations(6.0, {}), 6.0)  # the next tick: no batch left
    assert d.state.status is RolloutStatus.HALTED  # the rollout did not do everything: not "done"
    assert d.state.reason.startswith("1 instance(s) skipped, never touched: host(s) h0 unreachable (h0/i0)")


def test_decide_progress_deadline_fails_the_batch() -> None:
    state = replace(one(Phase.DRAINING), policy=replace(POLICY, on_failure=OnFailure.HALT), last_progress_at=0.0)
    d = decide(state, facts(in_flight=1.0), 601.0)
    assert d.state.failing.startswith("no instance finished for 601s (progress_deadline_s)")


def test_state_round_trips_through_the_journal_form(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1, 1])
    state, _ = run(tmp_path, sim)
    assert state_from_dict(state_to_dict(state)) == state


def test_a_failing_drain_hook_fails_the_instance_before_it_is_stopped(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1])

    def hook(ref: InstanceRef, argv: Sequence[str], timeout_s: float, on: HookPlace) -> str:
        sim.log.append("hook " + " ".join(argv))
        if argv[1] == "disable":
            raise ExecutorError("drain hook lb disable h0/i0 exited 1: backend not found")
        return ""

    sim.run_hook = hook  # type: ignore[method-assign]
    state, _ = run(tmp_path, sim)
    assert state.status is RolloutStatus.HALTED
    canary = state.inst(REF)
    assert canary.failure == "hook failed: drain hook lb disable h0/i0 exited 1: backend not found"
    # never stopped, so the rollback only puts it back into traffic
    assert canary.phase is Phase.ROLLED_BACK
    assert sim.log == ["hook lb disable h0/i0", "hook lb enable h0/i0"]


def test_stop_between_steps_then_resume(tmp_path: Path) -> None:
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    journal = Journal(tmp_path / "j.sqlite")
    state = new_rollout("r1", "lab", "rollout", targets(sim), POLICY, clock.now)
    journal.begin(state)
    asked = {"n": 0}

    def ctrl_c() -> bool:
        asked["n"] += 1
        return asked["n"] > 3

    events: list[str] = []
    stopped = Runner(sim, journal, clock=clock, sleep=clock.sleep, should_stop=ctrl_c, on_event=events.append).run(
        state
    )
    assert stopped.status is RolloutStatus.RUNNING
    assert events[-1] == "stopped between steps; resume with: fleet rollout --resume r1"
    again = journal.latest_state("r1")
    assert again == stopped
    final = Runner(sim, journal, clock=clock, sleep=clock.sleep).run(again)
    assert final.status is RolloutStatus.DONE
    assert sum(line.startswith("stop") for line in sim.log) == 2  # each instance stopped once


def test_instances_already_on_the_target_are_left_alone(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1, 1])
    sim.instances[InstanceRef("h1", "i0")].release = "v2"
    state, _ = run(tmp_path, sim)
    assert state.status is RolloutStatus.DONE
    assert "h1/i0" not in sim.touched()
    assert state.inst(InstanceRef("h1", "i0")).note == "already serving release v2"
    again, _ = run(tmp_path / "again", sim)  # the same rollout again: a no-op
    assert again.status is RolloutStatus.DONE
    assert sum(line.startswith("stop") for line in sim.log) == 2


# ---- properties over random fleets and faults (like Nomad's rapid tests of its reconciler) ---------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    counts=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    batches=st.lists(st.one_of(st.integers(1, 3), st.sampled_from(["25%", "50%", -1])), min_size=1, max_size=3),
    budget=st.integers(1, 4),
    fault=st.sampled_from(["none", "fail_load", "hang"]),
    orphans=st.sets(st.integers(0, 14), max_size=3),
    sick=st.sets(st.integers(0, 14), max_size=2),
    on_failure=st.sampled_from([OnFailure.ROLLBACK, OnFailure.HALT]),
)
def test_engine_properties(
    tmp_path_factory: pytest.TempPathFactory,
    counts: list[int],
    batches: list[int | str],
    budget: int,
    fault: str,
    orphans: set[int],
    sick: set[int],
    on_failure: OnFailure,
) -> None:
    sim = SimFleet(Clock(), counts)
    refs = list(sim.instances)
    for i in sick:
        if i < len(refs):
            sim.instances[refs[i]].sick = True
    sim.orphan_on_stop = {refs[i] for i in orphans if i < len(refs)}
    if fault == "fail_load":
        sim.fail_load.add("v2")
    elif fault == "hang":
        sim.hang.add("v2")
    policy = replace(POLICY, batches=tuple(batches), max_unavailable=budget, on_failure=on_failure)
    sick_before = sum(s.sick for s in sim.instances.values())
    state, journal = run(tmp_path_factory.mktemp("p"), sim, policy)
    # It ends, one way or the other.
    assert state.status in (RolloutStatus.DONE, RolloutStatus.HALTED)
    # The budget is never exceeded by what the rollout stopped (sick instances count, and block).
    assert sim.max_down <= max(budget, sick_before)
    # Every instance is visited at most once forward; a healthy release finishes everywhere.
    forward_stops = [line for line in sim.log if line.startswith("stop")]
    if fault == "none" and state.status is RolloutStatus.DONE:
        assert set(sim.releases().values()) == {"v2"}
    if fault != "none":
        assert state.status is RolloutStatus.HALTED
        # Only the failed batch was touched: nothing past it.
        failed_batch = {r for r in state.current}
        later = {str(r) for b in state.batches[state.batch_index + 1 :] for u in b for r in u}
        assert not (later & sim.touched())
        for ref in failed_batch:
            inst = state.inst(ref)
            if on_failure is OnFailure.ROLLBACK and inst.changed:
                assert inst.phase in (Phase.ROLLED_BACK, Phase.ROLLBACK_FAILED)
                if inst.phase is Phase.ROLLED_BACK:
                    assert sim.releases()[str(ref)] == "v1" and sim.serving(sim.instances[ref])
    # No instance is left stopped unless the engine says why (failed and halted, or rollback failed).
    for ref, s in sim.instances.items():
        if s.active != "active":
            assert state.inst(ref).phase in (Phase.FAILED, Phase.ROLLBACK_FAILED), (ref, state.inst(ref))
    # The journal holds every step with its outcome.
    steps = journal.steps("r1")
    assert all(st_.outcome in ("ok", "failed") for st_ in steps)
    assert len([st_ for st_ in steps if st_.action == "stop"]) == len(forward_stops)


def test_canary_bake_passes_then_the_rollout_goes_on(tmp_path: Path) -> None:
    clock = Clock()
    sim = SimFleet(clock, [1, 1, 1])
    start = clock.now
    state, journal = run(tmp_path, sim, replace(POLICY, canary_bake_s=30))
    assert state.status is RolloutStatus.DONE
    h1_drain = next(s for s in journal.steps("r1") if s.instance == "h1/i0")
    canary_done = next(s for s in journal.steps("r1") if s.action == "hook:undrain" and s.instance == "h0/i0")
    assert h1_drain.at - canary_done.at >= 30  # the next batch waited for the bake
    assert clock.now - start >= 30


def test_canary_that_fails_during_its_bake_is_rolled_back(tmp_path: Path) -> None:
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    sim.flap_at.add(clock.now + 40)  # healthy, soaked and undrained by ~+17; then one aborted answer
    state, _ = run(tmp_path, sim, replace(POLICY, canary_bake_s=60))
    assert state.status is RolloutStatus.HALTED
    assert state.reason.startswith("batch 1 failed (h0/i0: canary bake: completion gate: completion finished with")
    assert sim.releases() == {"h0/i0": "v1", "h1/i0": "v1"}
    assert "h1/i0" not in sim.touched()


def test_a_batch_restarts_together(tmp_path: Path) -> None:
    """The two instances of batch 2 are stopped at the same time (each waits for the other)."""
    import threading

    sim = SimFleet(Clock(), [1, 1, 1])
    both = threading.Barrier(2, timeout=10)
    original = sim.stop_unit

    def stop(ref: InstanceRef) -> None:
        if ref.host != "h0":
            both.wait()  # raises BrokenBarrierError if the stops were taken one after the other
        original(ref)

    sim.stop_unit = stop  # type: ignore[method-assign]
    state, journal = run(tmp_path, sim, replace(POLICY, batches=(1, 2)))
    assert state.status is RolloutStatus.DONE, state.reason
    assert all(s.outcome == "ok" for s in journal.steps("r1"))


# ---- configuration revisions (a model or flag change, ``fleet rollout INVENTORY``) ----------------


def config_targets(sim: SimFleet, revision: str, release: str = "v1") -> list[Target]:
    model = REVISION_MODELS[revision] or MODELS[release]
    return [Target(ref, release, model, revision=revision) for ref in sim.instances]


def run_targets(tmp_path: Path, sim: SimFleet, targets: list[Target]) -> RolloutState:
    journal = Journal(tmp_path / "journal.sqlite")
    state = new_rollout("r-config", "fleet", "rollout", targets, POLICY, sim.clock.now)
    journal.begin(state)
    runner = Runner(sim, journal, clock=sim.clock, sleep=sim.clock.sleep, max_parallel=1)
    return runner.run(state)


def test_a_model_change_rolls_out_as_a_configuration_revision(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1, 1, 1])
    final = run_targets(tmp_path, sim, config_targets(sim, "c2"))
    assert final.status is RolloutStatus.DONE, final.reason
    assert {s.revision for s in sim.instances.values()} == {"c2"}
    assert {s.release for s in sim.instances.values()} == {"v1"}  # the release did not move
    assert all(i.previous_revision == "c1" and i.previous_model == "llama-8b" for i in final.instances.values())
    assert sim.max_down <= 2


def test_a_model_that_fails_to_load_on_the_canary_goes_back_to_the_old_files(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1, 1, 1])
    sim.fail_load.add("c2")
    final = run_targets(tmp_path, sim, config_targets(sim, "c2"))
    assert final.status is RolloutStatus.HALTED
    canary = final.batches[0][0][0]
    assert final.inst(canary).phase is Phase.ROLLED_BACK
    assert {s.revision for s in sim.instances.values()} == {"c1"}  # canary restored, others untouched
    assert all(sim.serving(s) for s in sim.instances.values())
    assert sim.touched() == {str(canary)}


def test_an_instance_already_on_its_revision_is_left_alone(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1])
    first = next(iter(sim.instances.values()))
    first.revision = "c2"
    final = run_targets(tmp_path, sim, config_targets(sim, "c2"))
    assert final.status is RolloutStatus.DONE
    assert str(first.ref) not in sim.touched()
    assert {s.revision for s in sim.instances.values()} == {"c2"}


def test_decide_switches_files_when_only_the_revision_differs() -> None:
    ref = InstanceRef("h0", "i0")
    inst = InstanceState(ref, Target(ref, "v1", "qwen-7b", revision="c2"), phase=Phase.SWITCH)
    state = new_rollout("r", "fleet", "rollout", [inst.target], POLICY, 0.0)
    state = replace(state, current=(ref,), instances={ref: replace(inst, first_step_at=0.0, changed=True)})
    unit = UnitState("inactive", "dead", 0, 0)
    obs = Observations(1.0, {ref: InstanceFacts(ref, unit=unit, release="v1", revision="c1")})
    decision = decide(state, obs, 1.0)
    assert [(a.kind, a.release, a.revision) for a in decision.actions] == [(Act.FLIP, "v1", "c2")]
    obs = Observations(2.0, {ref: InstanceFacts(ref, unit=unit, release="v1", revision="c2")})
    assert [a.kind for a in decide(decision.state, obs, 2.0).actions] == [Act.START]


def test_rollback_without_a_recorded_revision_is_reported_not_guessed() -> None:
    ref = InstanceRef("h0", "i0")
    target = Target(ref, "v1", "qwen-7b", revision="c2")
    inst = InstanceState(
        ref, target, phase=Phase.GATES, first_step_at=0.0, changed=True, previous_release="v1",
        previous_revision=None,
    )  # fmt: skip
    state = new_rollout("r", "fleet", "rollout", [target], POLICY, 0.0)
    state = replace(state, current=(ref,), instances={ref: inst})
    failed = replace(state, instances={ref: replace(inst, phase=Phase.FAILED, failure="health gate: 503")})
    obs = Observations(1.0, {ref: InstanceFacts(ref, unit=UnitState("active", "running", 0, 5), release="v1")})
    decision = decide(failed, obs, 1.0)
    assert decision.state.inst(ref).phase is Phase.ROLLBACK_FAILED
    assert "no previous configuration" in decision.state.inst(ref).rollback_failure


def test_hooks_on_the_host_get_the_instance_and_say_so_in_the_journal(tmp_path: Path) -> None:
    sim = SimFleet(Clock(), [1, 1])
    on_host = replace(POLICY, batches=(1, -1), hooks=replace(POLICY.hooks, on=HookPlace.HOST))
    state, journal = run(tmp_path, sim, on_host)
    assert state.status is RolloutStatus.DONE, state.reason
    hooks = [line for line in sim.log if line.startswith("hook")]
    assert hooks == ["hook lb disable h0/i0 @h0", "hook lb enable h0/i0 @h0",
                     "hook lb disable h1/i0 @h1", "hook lb enable h1/i0 @h1"]  # fmt: skip
    # drain before the stop, undrain after the start (and the gates), per instance
    for host in ("h0", "h1"):
        lines = [line for line in sim.log if f"{host}/i0" in line]
        assert lines[0].startswith("hook lb disable") and lines[-1].startswith("hook lb enable"), lines
        assert lines[1] == f"stop {host}/i0"
    details = [s.detail for s in journal.steps("r1") if s.action.startswith("hook")]
    assert details[0] == "hook h0/i0 drain: take the instance out of traffic (hook runs on the host)"
    assert details[1] == "hook h0/i0 undrain: put the instance back into traffic (hook runs on the host)"


def test_a_drain_hook_on_a_host_that_went_down_fails_the_instance_before_any_stop(tmp_path: Path) -> None:
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    on_host = replace(POLICY, batches=(1, -1), hooks=replace(POLICY.hooks, on=HookPlace.HOST))
    original = sim.run_hook

    def host_dies_first(ref: InstanceRef, argv: Sequence[str], timeout_s: float, on: HookPlace) -> str:
        if ref.host == "h1" and argv[1] == "disable":
            sim.down_from["h1"] = clock.now  # gone between the observation and the hook
        return original(ref, argv, timeout_s, on)

    sim.run_hook = host_dies_first  # type: ignore[method-assign]
    state, _ = run(tmp_path, sim, on_host)
    assert state.status is RolloutStatus.HALTED
    h1 = state.inst(InstanceRef("h1", "i0"))
    assert h1.failure == "hook failed: host h1: SSH failed: connect timed out (hook lb)"
    assert not h1.changed and "stop h1/i0" not in sim.log  # never stopped
    assert h1.phase is Phase.ROLLBACK_FAILED and "host unreachable" in h1.rollback_failure
    assert "rollback failed on h1/i0 (host unreachable" in state.reason
    assert sim.releases() == {"h0/i0": "v2", "h1/i0": "v1"}  # the canary's batch stays


# ---- a host that goes silent: the engine decides within unreachable_timeout_s of its last answer ------


def silent(since: float | None, **changes: object) -> Observations:
    """``REF``'s host did not answer; last heard from at ``since`` (None: the executor cannot say)."""
    f = InstanceFacts(REF, unreachable="host h0: SSH failed: unreachable: no answer", unreachable_since=since)
    return Observations(5.0, {REF: replace(f, **changes)})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("phase", "changes", "heard_ago", "next_phase", "failure"),
    [
        # within unreachable_timeout_s (10 s) of its last answer: not decided yet, whatever the phase
        (Phase.GATES, {"changed": True}, 9.9, Phase.GATES, ""),
        (Phase.DRAINING, {}, 3.0, Phase.DRAINING, ""),
        (Phase.PENDING, {"first_step_at": None}, 9.0, Phase.PENDING, ""),
        # past it: an instance in the middle of its restart fails; one not touched yet is skipped
        (Phase.GATES, {"changed": True}, 10.0, Phase.FAILED, "host unreachable for 10s during gates: "),
        (Phase.START, {"changed": True}, 25.0, Phase.FAILED, "host unreachable for 25s during start: "),
        (Phase.DRAINING, {}, 12.0, Phase.FAILED, "host unreachable for 12s before any change: "),
        (Phase.PENDING, {"first_step_at": None}, 10.0, Phase.SKIPPED, "skipped: host h0 unreachable for 10s "),
    ],
)
def test_decide_on_a_silent_host_waits_unreachable_timeout_s_then_decides(
    phase: Phase, changes: dict[str, object], heard_ago: float, next_phase: Phase, failure: str
) -> None:
    now = 100.0
    state = replace(one(phase, **changes), policy=replace(POLICY, on_failure=OnFailure.HALT))
    d = decide(state, silent(now - heard_ago), now)
    inst = d.state.inst(REF)
    assert inst.phase is next_phase and d.actions == ()
    assert inst.failure.startswith(failure)
    if not failure:
        assert inst.note.startswith("h0/i0: host h0 unreachable for ") and "(deciding at 10s" in inst.note
        assert d.state.status is RolloutStatus.RUNNING
    else:
        if d.state.status is RolloutStatus.RUNNING:  # skipped: the batch is over; the next tick ends it
            d = decide(d.state, Observations(now, {}), now)
        assert d.state.status is RolloutStatus.HALTED and "h0" in d.state.reason


def test_decide_on_a_silent_host_with_no_since_decides_at_once() -> None:
    """An executor that cannot say when the host was last heard from: decided on the first report."""
    state = replace(one(Phase.GATES, changed=True), policy=replace(POLICY, on_failure=OnFailure.HALT))
    d = decide(state, silent(None), 5.0)
    assert d.state.inst(REF).phase is Phase.FAILED
    assert d.state.inst(REF).failure.startswith("host unreachable during gates: host h0: SSH failed: unreachable")


def _between(counts: Sequence[int], max_unavailable: int, down: dict[str, float], now: float) -> RolloutState:
    """A rollout between batches over ``counts`` instances per host, after the canary (h0/i0) is done;
    hosts in ``down`` last answered at the given times."""
    refs = [InstanceRef(f"h{h}", f"i{i}") for h, n in enumerate(counts) for i in range(n)]
    policy = replace(POLICY, batches=(1, -1), max_unavailable=max_unavailable, whole_host=False)
    state = new_rollout("r", "lab", "restart", [Target(r, "v1", "m1", restart=True) for r in refs], policy, 0.0)
    canary = state.batches[0][0][0]
    inst = replace(state.inst(canary), phase=Phase.DONE, first_step_at=1.0, changed=True)
    return replace(state, batch_index=1, instances={**state.instances, canary: inst}, last_progress_at=now - 1)


def _seen(state: RolloutState, down: dict[str, float]) -> Observations:
    out = {}
    for ref in state.instances:
        if ref.host in down:
            out[ref] = InstanceFacts(ref, unreachable=f"host {ref.host}: SSH failed: unreachable: no answer",
                                     unreachable_since=down[ref.host])  # fmt: skip
        else:
            out[ref] = InstanceFacts(ref, unit=UnitState("active", "running", 0, 5), release="v1", serving=True)
    return Observations(0.0, out)


def test_between_batches_a_silent_host_in_the_next_batch_is_waited_for_then_skipped_within_the_budget() -> None:
    now = 100.0
    # h0, h1, h2 with 2 instances each; budget 3: h1's two instances down leave room for one more
    state = _between([2, 2, 2], 3, {"h1": now - 4}, now)
    d = decide(state, _seen(state, {"h1": now - 4}), now)
    assert d.state.status is RolloutStatus.RUNNING and d.actions == () and not d.state.current
    assert d.waits == (
        "batch 2: h1/i0: host h1 unreachable for 4s (deciding at 10s, unreachable_timeout_s): "
        "host h1: SSH failed: unreachable: no answer",
    )
    later = now + 6  # 10 s since h1 last answered
    d = decide(state, _seen(state, {"h1": now - 4}), later)
    skipped = [r for r, i in d.state.instances.items() if i.phase is Phase.SKIPPED]
    assert [str(r) for r in skipped] == ["h1/i0"]  # the one of this batch; h1/i1's batch has not come
    assert d.state.inst(InstanceRef("h1", "i0")).failure.startswith("skipped: host h1 unreachable for 10s")
    assert d.state.status is RolloutStatus.RUNNING
    assert [str(r) for r in d.state.current] == ["h2/i0"]  # what the budget allows: 2 down + 1
    assert [a.ref for a in d.actions] == [InstanceRef("h2", "i0")]


def test_between_batches_a_silent_host_that_spends_the_budget_halts_at_once_naming_it() -> None:
    now = 100.0
    # the lab's shape: 2 hosts with 2 instances each, budget 1; h1 silent for 12 s
    state = _between([2, 2], 1, {"h1": now - 12}, now)
    d = decide(state, _seen(state, {"h1": now - 12}), now)
    assert d.state.status is RolloutStatus.HALTED, d.state.reason
    assert d.state.reason.startswith("batch 2 cannot start: host h1 unreachable for 12s (host h1: SSH failed: ")
    assert "max_unavailable is 1 and 2 instance(s) are already not serving (h1/i0, h1/i1)" in d.state.reason
    assert d.actions == ()


def test_skipped_instances_end_the_rollout_halted_with_what_to_do(tmp_path: Path) -> None:
    from fleet.rollout.advice import next_steps

    clock = Clock()
    sim = SimFleet(clock, [1, 1, 1])
    sim.report_since = True
    sim.down_from["h2"] = clock.now  # silent from the start: never touched
    state, journal = run(
        tmp_path, sim, replace(POLICY, batches=(1, -1), max_unavailable=2), kind="restart", release="v1"
    )
    assert state.status is RolloutStatus.HALTED
    assert state.reason == (
        "1 instance(s) skipped, never touched: host(s) h2 unreachable (h2/i0); every other instance is done"
    )
    assert state.inst(InstanceRef("h2", "i0")).phase is Phase.SKIPPED
    assert "h2/i0" not in sim.touched()
    assert {str(r) for r, i in state.instances.items() if i.phase is Phase.DONE} == {"h0/i0", "h1/i0"}
    lines = next_steps(state)
    assert (
        "not touched, host h2 did not answer: h2/i0; once it does, run the restart again for it (`--limit h2`)" in lines
    )
    assert journal.history("lab")[0].status == "halted"


def test_a_host_silent_during_its_restart_is_decided_within_30_s_of_its_last_answer(tmp_path: Path) -> None:
    """The scenario of the partition: the host stops answering while its instance is at its gates;
    the executor reports it unreachable (with when it was last heard from) from then on. The batch
    fails and the restart halts once unreachable_timeout_s has passed, naming the host."""
    clock = Clock()
    sim = SimFleet(clock, [1, 1, 1, 1])
    sim.report_since = True
    silent_at = clock.now + 24  # while batch 2 (h1, h2) soaks
    sim.down_from["h2"] = silent_at
    halted_at: list[float] = []

    class Watch(Journal):
        def save(self, state: RolloutState, now: float) -> None:
            if state.status is RolloutStatus.HALTED and not halted_at:
                halted_at.append(now)
            super().save(state, now)

    journal = Watch(tmp_path / "journal.sqlite")
    policy = replace(POLICY, on_failure=OnFailure.HALT)
    state = new_rollout("r1", "lab", "restart", targets(sim, "v1", True), policy, clock.now)
    journal.begin(state)
    final = Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
    assert final.status is RolloutStatus.HALTED
    h2 = final.inst(InstanceRef("h2", "i0"))
    assert h2.phase is Phase.FAILED and h2.failure.startswith("host unreachable for 1")
    assert "during gates: ssh: connect to host timed out" in h2.failure
    assert final.reason.startswith("batch 2 failed (h2/i0: host unreachable for ")
    assert halted_at and policy.unreachable_timeout_s <= halted_at[0] - silent_at <= 30, halted_at[0] - silent_at
    assert "h3/i0" not in sim.touched()


# ---- stopping: between steps, and at once (a second Ctrl-C) ---------------------------------------------


def test_a_stop_between_steps_journals_an_interrupted_step_and_stays_resumable(tmp_path: Path) -> None:
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    journal = Journal(tmp_path / "journal.sqlite")
    state = new_rollout("r1", "lab", "restart", targets(sim, "v1", True), POLICY, clock.now)
    journal.begin(state)
    asked = iter([False, False, True])
    runner = Runner(sim, journal, clock=clock, sleep=clock.sleep, should_stop=lambda: next(asked, True))
    final = runner.run(state)
    assert final.status is RolloutStatus.RUNNING
    (mark,) = [s for s in journal.steps("r1") if s.action == "interrupted"]
    assert (mark.instance, mark.detail, mark.outcome) == (None, "stopped between steps on request", "interrupted")
    assert journal.latest_state("r1").status is RolloutStatus.RUNNING


#: Run in a fresh interpreter: another test of the session may have monkey-patched threading with
#: gevent (``fleet deploy``'s CLI does), and this one is about real threads and a real SIGINT.
_HARD_ABORT = """
import json, os, signal, sys, threading, time
from dataclasses import replace
from pathlib import Path
from tests.unit.test_rollout_engine import POLICY, Clock, SimFleet, targets
from fleet.rollout.advice import left_down
from fleet.rollout.engine import new_rollout
from fleet.rollout.journal import Journal
from fleet.rollout.policy import Hooks
from fleet.rollout.runner import Runner

clock = Clock()
sim = SimFleet(clock, [1, 1, 1, 1])
release = threading.Event()
sim.stop_unit = lambda ref: release.wait(30)
journal = Journal(Path(sys.argv[1]))
state = new_rollout("r1", "lab", "restart", targets(sim, "v1", True), replace(POLICY, batches=(2, -1), hooks=Hooks()),
                    clock.now)
journal.begin(state)
runner = Runner(sim, journal, clock=clock, sleep=clock.sleep)
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # a real Ctrl-C: EINTR in the wait
t0 = time.monotonic()
try:
    runner.run(state)
    raised = False
except KeyboardInterrupt:
    raised = True
took = time.monotonic() - t0
stops = [s.outcome for s in journal.steps("r1") if s.action == "stop"]
print(json.dumps({"raised": raised, "took": took, "down": sorted(str(i.ref) for i in left_down(runner.state)),
                  "stops": stops}))
release.set()
"""


def test_a_hard_abort_does_not_wait_for_steps_in_flight_and_the_state_knows_what_was_stopped(tmp_path: Path) -> None:
    """A second Ctrl-C (SIGINT: KeyboardInterrupt in the main thread) while two stops hang on their
    hosts: the runner gives up at once (the calls are left to their own deadlines), and its
    ``state`` marks both instances as stopped by this rollout. (Before, the thread pool's exit
    waited for the steps in flight.)"""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _HARD_ABORT, str(tmp_path / "journal.sqlite")], cwd=root,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["raised"] and out["took"] < 2.0, out
    assert out["down"] == ["h0/i0", "h1/i0"], out
    assert out["stops"] == [None, None], out  # journaled, not finished


def test_the_abort_says_what_is_down_and_how_to_resume_and_journals_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import signal

    from fleet.cli.rollout import _abort

    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    journal = Journal(tmp_path / "journal.sqlite")
    state = new_rollout("r1", "lab", "restart", targets(sim, "v1", True), POLICY, clock.now)
    journal.begin(state)
    ref = InstanceRef("h0", "i0")
    stopping = replace(state.inst(ref), phase=Phase.STOP, changed=True, first_step_at=clock.now)
    state = replace(state, current=(ref,), instances={**state.instances, ref: stopping})

    class Closing:
        closed = False

        def close(self) -> None:
            self.closed = True

    executor = Closing()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exited:
            _abort(state, executor, journal, True, "second signal (SIGINT, then SIGINT)")  # type: ignore[arg-type]
    finally:
        for s, h in handlers.items():  # _abort ignores further signals (the process ends right after)
            signal.signal(s, h)
    assert exited.value.code == 1 and executor.closed
    out = json.loads(capsys.readouterr().out)
    assert (out["id"], out["status"], out["down"]) == ("r1", "interrupted", ["h0/i0"])
    assert out["next"][-1] == "resume with: fleet rollout --resume r1"
    assert "h0/i0: not serving: this rollout stopped it and it is not back (last step: stop)" in out["next"]
    (mark,) = [s for s in journal.steps("r1") if s.action == "interrupted"]
    assert mark.detail == (
        "aborted during a step on a second signal (SIGINT, then SIGINT); not serving (stopped by this rollout, "
        "not back): h0/i0"
    )
    assert journal.latest_state("r1").status is RolloutStatus.RUNNING


def test_a_canary_whose_gpu_throws_an_xid_during_its_soak_is_rolled_back(tmp_path: Path) -> None:
    clock = Clock()
    sim = SimFleet(clock, [1, 1, 1, 1])
    xid79 = "XID 79 (reboot): GPU has fallen off the bus"
    sim.gpu_faults = [("h0", clock.now - 60, "XID 13 (app): before the rollout", "app"),  # before: not this start's
                      ("h0", clock.now + 12.5, xid79, "reboot")]  # soaking  # fmt: skip
    state, _ = run(tmp_path, sim)
    assert state.status is RolloutStatus.HALTED
    canary = state.inst(InstanceRef("h0", "i0"))
    assert canary.phase is Phase.ROLLED_BACK
    assert canary.failure == f"gpu gate: GPU 0 reported {xid79} after fleet started the instance"
    assert sim.touched() == {"h0/i0"} and sim.releases()["h0/i0"] == "v1"
