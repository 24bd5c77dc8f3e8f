"""The step engine over an instance spanning hosts: recorded observations and a simulated fleet.

``SpanSim`` extends the engine tests' ``SimFleet`` with vLLM 0.33's multi-node behaviour at the
boundaries the engine sees (``docs/multi-node.md``): the leader answers only once every node of
its instance runs (its engine core waits in the store for every node), a headless node serves no
HTTP, and a node's death ends the others with exit status 0, which ``Restart=always`` brings back
after ``RestartSec`` (10 s) as a restart (``NRestarts`` + 1). No SSH: the lab test runs the real
stand-in on two lab hosts.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fleet.errors import FleetError
from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import (
    Act,
    Phase,
    RolloutState,
    RolloutStatus,
    Target,
    decide,
    new_rollout,
    resume,
    state_from_dict,
    state_to_dict,
)
from fleet.rollout.gates import Probe, UnitState
from fleet.rollout.journal import Journal
from fleet.rollout.observe import InstanceFacts, Observations
from fleet.rollout.policy import OnFailure, RolloutPolicy
from fleet.rollout.previous import back_to
from fleet.rollout.runner import Runner
from tests.unit.test_rollout_engine import MODELS, POLICY, Clock, SimFleet, SimInstance

LEAD, WORK = InstanceRef("h0", "i0"), InstanceRef("h1", "i0")
NODES = (LEAD, WORK)
RESTART_SEC = 10.0


class SpanSim(SimFleet):
    """Hosts h0..hN with one instance each; h0/i0 and h1/i0 are the two nodes of one instance."""

    def __init__(self, clock: Clock, hosts: int = 4, load_s: float = 5.0) -> None:
        super().__init__(clock, [1] * hosts, load_s)
        self.groups = dict.fromkeys(NODES, NODES)
        self.restart_at: dict[InstanceRef, float] = {}
        self.start_fails: dict[InstanceRef, str] = {}  #: a node whose start on this release fails at once
        self.die_at: dict[InstanceRef, float] = {}  #: a node whose process is killed at this time
        self.probed: list[InstanceRef] = []
        self.starts: list[tuple[float, InstanceRef]] = []
        self.max_instances_down = 0

    # -- vLLM 0.33 across nodes ----------------------------------------------------------------------
    def _peers(self, ref: InstanceRef) -> list[SimInstance]:
        return [self.instances[n] for n in self.groups.get(ref, ()) if n != ref]

    def _end_peers(self, ref: InstanceRef) -> None:
        """A node's process ended: every other node's ends too, exit 0, and systemd restarts it."""
        for p in self._peers(ref):
            if p.active == "active":
                p.active, p.sub, p.main_pid, p.gpu = "activating", "auto-restart", 0, []
                p.n_restarts += 1
                self.restart_at[p.ref] = self.clock.now + RESTART_SEC

    def _tick(self, s: SimInstance) -> None:
        now = self.clock.now
        at = self.die_at.get(s.ref)
        if at is not None and now >= at and s.active == "active":
            del self.die_at[s.ref]
            s.active, s.sub, s.main_pid, s.gpu = "activating", "auto-restart", 0, []
            s.n_restarts += 1
            self.restart_at[s.ref] = now + RESTART_SEC
            self._end_peers(s.ref)
        if s.sub == "auto-restart" and now >= self.restart_at.get(s.ref, float("inf")):
            self.pid += 10
            s.active, s.sub, s.main_pid, s.started_at = "active", "running", self.pid, now
        super()._tick(s)

    def _loaded(self, s: SimInstance) -> bool:
        nodes = [s, *self._peers(s.ref)]
        return all(n.active == "active" for n in nodes) and all(
            self.clock.now - n.started_at >= self.load_s for n in nodes
        )

    def facts(self, ref: InstanceRef) -> InstanceFacts:
        for s in self.instances.values():
            self._tick(s)
        f = super().facts(ref)
        if ref == WORK:  # headless: no HTTP, nothing in flight it could report
            return replace(f, serving=False, in_flight=None if f.unit and f.unit.main_pid else 0.0)
        return f

    def probe(self, ref: InstanceRef, policy: RolloutPolicy, model: str) -> Probe:
        self.probed.append(ref)
        assert ref != WORK, "a headless node was asked over HTTP"
        return super().probe(ref, policy, model)

    def stop_unit(self, ref: InstanceRef) -> None:
        was = self.instances[ref].active
        super().stop_unit(ref)
        self.restart_at.pop(ref, None)
        if was == "active":
            self._end_peers(ref)

    def start_unit(self, ref: InstanceRef) -> None:
        super().start_unit(ref)
        self.starts.append((self.clock.now, ref))
        s = self.instances[ref]
        if self.start_fails.get(ref) == s.release:
            s.active, s.sub, s.main_pid, s.gpu = "failed", "failed", 0, []

    def _track(self) -> None:
        super()._track()
        down = {self.groups.get(r, (r,))[0] for r, s in self.instances.items() if not self.serving(s)}
        down |= {LEAD for n in NODES if self.instances[n].active != "active"}
        self.max_instances_down = max(self.max_instances_down, len(down))


def span_targets(sim: SpanSim, release: str = "v2") -> list[Target]:
    return [Target(ref, release, MODELS[release], nodes=sim.groups.get(ref, ())) for ref in sim.instances]


def roll(tmp_path: Path, sim: SpanSim, policy: RolloutPolicy, release: str = "v2") -> tuple[RolloutState, Journal]:
    journal = Journal(tmp_path / "journal.sqlite")
    state = new_rollout("r1", "lab", "rollout", span_targets(sim, release), policy, sim.clock.now)
    journal.begin(state)
    runner = Runner(sim, journal, clock=sim.clock, sleep=sim.clock.sleep)
    final = runner.run(state)
    assert runner.ticks < 5000
    return final, journal


POLICY_1 = replace(POLICY, batches=(1, 1), max_unavailable=1)


def test_a_spanning_instance_is_the_canary_whole_and_rolls_as_one_unit(tmp_path: Path) -> None:
    sim = SpanSim(Clock())
    state, journal = roll(tmp_path, sim, POLICY_1)
    assert state.status is RolloutStatus.DONE, state.reason
    assert set(sim.releases().values()) == {"v2"}
    assert [[str(r) for u in b for r in u] for b in state.batches] == [["h0/i0", "h1/i0"], ["h2/i0"], ["h3/i0"]]
    # both nodes started in the same tick, after both were stopped and switched
    starts = [(t, r) for t, r in sim.starts if r in NODES]
    assert len(starts) == 2 and starts[0][0] == starts[1][0], starts
    first_start = sim.log.index("start h0/i0") if "start h0/i0" in sim.log else sim.log.index("start h1/i0")
    assert {"stop h0/i0", "stop h1/i0", "flip v2 h0/i0", "flip v2 h1/i0"} <= set(sim.log[:first_start])
    # gated on the leader only; never more than one instance (both nodes count once) out at a time
    assert WORK not in sim.probed and LEAD in sim.probed
    assert sim.max_instances_down == 1
    # the hooks ran for the leader only (it stands for the instance)
    assert [line for line in sim.log if line.startswith("hook") and "h1/" in line] == []
    # the journal holds each node, with its nodes, and comes back equal (for --resume and rollback)
    saved = journal.latest_state("r1")
    assert saved.inst(WORK).target.nodes == NODES and saved.inst(WORK).previous_release == "v1"
    assert state_from_dict(state_to_dict(state)) == state


def test_a_node_whose_new_start_fails_rolls_back_every_node_and_names_the_instance(tmp_path: Path) -> None:
    sim = SpanSim(Clock())
    sim.start_fails[WORK] = "v2"
    state, _ = roll(tmp_path, sim, POLICY_1)
    assert state.status is RolloutStatus.HALTED
    assert "instance i0 spanning h0 (leader), h1: node h1: unit failed right after start" in state.reason
    assert {r: sim.instances[r].release for r in NODES} == dict.fromkeys(NODES, "v1")  # every node went back
    assert {state.inst(r).phase for r in NODES} == {Phase.ROLLED_BACK}
    assert all(sim.instances[r].active == "active" for r in NODES)
    assert sim.serving(sim.instances[LEAD])  # serving again, on v1
    assert sim.releases()["h2/i0"] == sim.releases()["h3/i0"] == "v1"  # later batches never touched


def test_a_node_killed_during_the_gates_fails_the_instance_and_both_go_back(tmp_path: Path) -> None:
    sim = SpanSim(Clock(), load_s=20.0)
    sim.die_at[WORK] = sim.clock.now + 12  # while the leader is loading, after both nodes started
    state, _ = roll(tmp_path, sim, POLICY_1)
    assert state.status is RolloutStatus.HALTED
    # the worker's death ends the leader's process too (exit 0, restarted): both are named
    assert "instance i0 spanning h0 (leader), h1: node h0: unit gate: unit restarted 1 time(s)" in state.reason
    assert "; node h1: its unit: unit restarted 1 time(s)" in state.reason, state.reason
    assert {r: sim.instances[r].release for r in NODES} == dict.fromkeys(NODES, "v1")
    assert {state.inst(r).phase for r in NODES} == {Phase.ROLLED_BACK}


def test_a_node_whose_host_goes_down_mid_rollout_halts_naming_the_instance(tmp_path: Path) -> None:
    sim = SpanSim(Clock())
    sim.report_since = True
    sim.down_from["h1"] = sim.clock.now + 3  # after the stop, before the start
    state, _ = roll(tmp_path, sim, POLICY_1)
    assert state.status is RolloutStatus.HALTED
    assert "instance i0 spanning h0 (leader), h1: node h1: host unreachable" in state.reason, state.reason
    # the worker's rollback cannot run (its host is gone); the leader is not started alone to wait
    # in the rendezvous holding its GPUs: both are named, the leader left stopped on its old release
    assert state.inst(WORK).phase is Phase.ROLLBACK_FAILED
    assert state.inst(LEAD).phase is Phase.ROLLBACK_FAILED
    assert "node h1" in state.inst(LEAD).rollback_failure
    assert sim.instances[LEAD].release == "v1" and sim.instances[LEAD].active != "active"
    assert sim.releases()["h2/i0"] == "v1"


@pytest.mark.parametrize("ticks", [2, 4, 6, 9, 14])
def test_a_rollout_stopped_mid_way_resumes_from_the_journal_and_moves_both_nodes(tmp_path: Path, ticks: int) -> None:
    """Ctrl-C after ``ticks`` steps (the nodes anywhere between drained and gated), then --resume:
    the journaled state (with each node's nodes) finishes the instance as one unit."""
    sim = SpanSim(Clock())
    journal = Journal(tmp_path / "j.sqlite")
    state = new_rollout("r1", "lab", "rollout", span_targets(sim), POLICY_1, sim.clock.now)
    journal.begin(state)
    asked = {"n": 0}

    def ctrl_c() -> bool:
        asked["n"] += 1
        return asked["n"] > ticks

    stopped = Runner(sim, journal, clock=sim.clock, sleep=sim.clock.sleep, should_stop=ctrl_c).run(state)
    assert stopped.status is RolloutStatus.RUNNING
    again = resume(journal.latest_state("r1"), sim.clock.now)
    assert again.inst(WORK).target.nodes == NODES
    final = Runner(sim, journal, clock=sim.clock, sleep=sim.clock.sleep).run(again)
    assert final.status is RolloutStatus.DONE, final.reason
    assert set(sim.releases().values()) == {"v2"}
    assert [line for line in sim.log if line.startswith("stop")].count("stop h1/i0") == 1
    starts = [t for t, r in sim.starts if r in NODES]
    assert len(starts) == 2 and starts[0] == starts[1]  # started together, after the resume too


def test_an_on_call_restart_restarts_every_node_together_on_its_release(tmp_path: Path) -> None:
    sim = SpanSim(Clock())
    journal = Journal(tmp_path / "journal.sqlite")
    targets = [replace(t, release="v1", model=MODELS["v1"], restart=True) for t in span_targets(sim)]
    policy = replace(POLICY_1, on_failure=OnFailure.HALT)
    state = new_rollout("r1", "lab", "restart", targets, policy, sim.clock.now)
    journal.begin(state)
    final = Runner(sim, journal, clock=sim.clock, sleep=sim.clock.sleep).run(state)
    assert final.status is RolloutStatus.DONE, final.reason
    assert {"stop h0/i0", "stop h1/i0", "start h0/i0", "start h1/i0"} <= set(sim.log)
    assert not any(line.startswith("flip") for line in sim.log)  # on the release each ran
    starts = [t for t, r in sim.starts if r in NODES]
    assert len(starts) == 2 and starts[0] == starts[1]


def test_an_instance_already_on_its_target_with_every_node_up_is_left_alone(tmp_path: Path) -> None:
    sim = SpanSim(Clock())
    for s in sim.instances.values():
        s.release = "v2"
    state, _ = roll(tmp_path, sim, POLICY_1)
    assert state.status is RolloutStatus.DONE
    assert sim.log == [] and {state.inst(r).phase for r in NODES} == {Phase.DONE}


def test_a_node_off_its_target_restarts_the_whole_instance(tmp_path: Path) -> None:
    sim = SpanSim(Clock())
    sim.instances[LEAD].release = "v2"  # the leader is there already; the worker is not
    state, _ = roll(tmp_path, sim, POLICY_1)
    assert state.status is RolloutStatus.DONE, state.reason
    assert {"stop h0/i0", "stop h1/i0", "start h0/i0", "start h1/i0"} <= set(sim.log)
    assert "flip v2 h0/i0" not in sim.log and "flip v2 h1/i0" in sim.log


def test_a_rollout_that_holds_only_one_node_of_an_instance_is_refused_before_anything() -> None:
    with pytest.raises(FleetError, match=r"instance i0 spans hosts h0, h1 .* node\(s\) h1/i0 are not in this rollout"):
        new_rollout("r", "lab", "rollout", [Target(LEAD, "v2", "m", nodes=NODES)], POLICY, 0.0)


def test_the_way_back_from_the_journal_keeps_each_node_of_the_instance() -> None:
    state = new_rollout("r", "lab", "rollout", [Target(r, "v2", "m", nodes=NODES) for r in NODES], POLICY, 0.0)
    inst = replace(state.inst(WORK), previous_release="v1", changed=True, phase=Phase.DONE)
    assert back_to(inst).release == "v1"  # run_rollout gives it its nodes from the plan (with_nodes)


# ---- decide on recorded observations ----------------------------------------------------------------


def _unit(active: str, sub: str, restarts: int = 0) -> UnitState:
    return UnitState(active, sub, restarts, 100 if active == "active" else 0)


def _obs(
    at: float, lead: UnitState, work: UnitState, release: str = "v1", work_release: str = "", **lead_changes: object
) -> Observations:
    lf = InstanceFacts(
        LEAD, unit=lead, release=release, model="m1", in_flight=0.0, serving=lead.active_state == "active"
    )
    wf = InstanceFacts(WORK, unit=work, release=work_release or release, model="m1")
    return Observations(at, {LEAD: replace(lf, **lead_changes), WORK: wf})  # type: ignore[arg-type]


def _state(lead: Phase, work: Phase, **changes: object) -> RolloutState:
    state = new_rollout("r", "lab", "rollout", [Target(r, "v2", "m2", nodes=NODES) for r in NODES],
                        replace(POLICY, hooks=replace(POLICY.hooks, drain=None, undrain=None)), 0.0)  # fmt: skip
    insts = {
        LEAD: replace(state.inst(LEAD), phase=lead, first_step_at=0.0, **changes),  # type: ignore[arg-type]
        WORK: replace(state.inst(WORK), phase=work, first_step_at=0.0, **changes),  # type: ignore[arg-type]
    }
    return replace(state, current=NODES, instances=insts)


ACTIVE, DEAD, FAILED = _unit("active", "running"), _unit("inactive", "dead"), _unit("failed", "failed")


@pytest.mark.parametrize(
    ("lead", "work", "obs", "changes", "actions", "phases"),
    [
        # both pending, nothing in flight: the leader drains at once, then both are stopped together
        (Phase.PENDING, Phase.PENDING, _obs(5, ACTIVE, ACTIVE), {}, ["stop", "stop"], (Phase.STOP, Phase.STOP)),
        # the leader still has requests in flight: the headless node is not stopped under it
        (
            Phase.DRAINING,
            Phase.DRAINING,
            _obs(5, ACTIVE, ACTIVE, in_flight=2.0),
            {},
            [],
            (Phase.DRAINING, Phase.DRAINING),
        ),
        # the worker is still waiting for its GPUs: the leader, ready to start, is not started alone
        (Phase.START, Phase.SWITCH, _obs(5, DEAD, DEAD, "v2", "v1"), {}, ["flip"], (Phase.START, Phase.SWITCH)),
        # both ready: both started in the same tick
        (Phase.START, Phase.START, _obs(5, DEAD, DEAD, "v2"), {}, ["start", "start"], (Phase.START, Phase.START)),
        # the worker's unit failed right after its start: it fails (its batch then rolls both back)
        (Phase.GATES, Phase.START, _obs(5, ACTIVE, FAILED, "v2"), {"started": True}, [], (Phase.GATES, Phase.FAILED)),
        # the headless node's unit restarted during the gates: its node died
        (
            Phase.GATES,
            Phase.GATES,
            _obs(5, ACTIVE, _unit("active", "running", 1), "v2"),
            {},
            [],
            (Phase.GATES, Phase.FAILED),
        ),
        # the leader passed its gates: the headless node is done with it
        (Phase.LB_IN, Phase.GATES, _obs(5, ACTIVE, ACTIVE, "v2"), {}, [], (Phase.DONE, Phase.DONE)),
    ],
)
def test_decide_moves_the_nodes_of_an_instance_together(
    lead: Phase,
    work: Phase,
    obs: Observations,
    changes: dict[str, object],
    actions: list[str],
    phases: tuple[Phase, Phase],
) -> None:
    state = _state(lead, work, **changes)
    state = replace(state, policy=replace(state.policy, on_failure=OnFailure.HALT))
    d = decide(state, obs, 5.0)
    assert sorted(a.kind.value for a in d.actions) == sorted(actions)
    assert (d.state.inst(LEAD).phase, d.state.inst(WORK).phase) == phases


def test_decide_a_halted_nodes_failure_names_the_instance_its_nodes_and_the_node() -> None:
    state = replace(_state(Phase.GATES, Phase.GATES), policy=replace(POLICY, on_failure=OnFailure.HALT))
    d = decide(state, _obs(5, ACTIVE, _unit("activating", "auto-restart", 1), "v2"), 5.0)
    assert d.state.failing.startswith("instance i0 spanning h0 (leader), h1: node h1: its unit: unit restarted")


def test_decide_a_node_waiting_to_start_fails_with_a_peer_that_cannot_go_back() -> None:
    state = _state(Phase.START, Phase.ROLLBACK_FAILED, rolling_back=True, previous_release="v1")
    state = replace(state, failing="earlier")
    d = decide(state, _obs(5, DEAD, DEAD), 5.0)
    assert d.actions == () and d.state.inst(LEAD).phase is Phase.ROLLBACK_FAILED
    assert d.state.inst(LEAD).rollback_failure.startswith("not started: instance i0 spanning h0 (leader), h1: node h1")
    assert d.state.status is RolloutStatus.HALTED


def test_decide_budget_counts_an_instance_down_once_and_a_down_node_as_the_instance_down() -> None:
    refs = [*NODES, InstanceRef("h2", "i0")]
    targets = [Target(r, "v2", "m2", nodes=NODES if r in NODES else ()) for r in refs]
    state = new_rollout("r", "lab", "rollout", targets, replace(POLICY, batches=(1,), max_unavailable=1), 0.0)
    up = {r: InstanceFacts(r, unit=ACTIVE, release="v1", model="m1", serving=r != WORK, in_flight=0.0) for r in refs}
    d = decide(state, Observations(5, up), 5.0)  # the worker serves no HTTP: the instance is still up
    assert d.state.current == NODES and [a.kind for a in d.actions] == [Act.HOOK]
    # h2 first; a node of the spanning instance is down: the instance is down, counted once, and
    # spends the budget of 1, so h2 waits
    down = {**up, WORK: replace(up[WORK], unit=DEAD)}
    state2 = replace(state, batches=(((InstanceRef("h2", "i0"),),), ((LEAD, WORK),)))
    d2 = decide(state2, Observations(5, down), 5.0)
    assert d2.state.current == () and d2.actions == ()
    assert d2.state.waiting == "max_unavailable is 1 and 1 instance(s) are already not serving (h0/i0, h1/i0)"
