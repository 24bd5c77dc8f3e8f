"""The restart protocol with a load balancer in the loop, over the simulated fleet of
``test_rollout_engine`` plus a simulated HAProxy: each server's administrative state and its
sessions, and clients that the balancer sends to every server in traffic. A request the balancer
sends to an instance that is not serving (stopped, loading, draining) is a failed request."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fleet.lb.runtime import AdminState, ServerView
from fleet.rollout.advice import next_steps
from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import Act, Phase, RolloutState, RolloutStatus, Target, decide, new_rollout
from fleet.rollout.executor import ExecutorError
from fleet.rollout.gates import UnitState
from fleet.rollout.journal import Journal
from fleet.rollout.observe import InstanceFacts, Observations
from fleet.rollout.policy import Hooks, OnFailure
from fleet.rollout.runner import Runner

from .test_rollout_engine import MODELS, POLICY, Clock, SimFleet, targets

LB_POLICY = replace(POLICY, hooks=Hooks())


class SimBalancer(SimFleet):
    """``SimFleet`` behind one HAProxy: ``admin`` per server, ``sessions`` that end one per second
    once no new request comes, and a client that sends every tick to each server in traffic."""

    def __init__(self, clock: Clock, counts: list[int], sessions: int = 3) -> None:
        super().__init__(clock, counts)
        self.admin = dict.fromkeys(self.instances, AdminState.READY)
        self.sessions = dict.fromkeys(self.instances, sessions)
        self.busy_forever: set[InstanceRef] = set()
        self.dead_from: float | None = None
        self.sent = 0
        self.failed: list[str] = []
        self.last = clock.now

    def _traffic(self) -> None:
        """Clients: every elapsed second a request to each server in traffic; sessions of a
        server out of traffic end one per second."""
        while self.clock.now - self.last >= 1:
            self.last += 1
            for ref, s in self.instances.items():
                if self.admin[ref] is AdminState.READY and not (self.dead_from and self.last >= self.dead_from):
                    self.sent += 1
                    if not (s.active == "active" and self._loaded(s)):
                        self.failed.append(f"{ref} at {self.last:.0f}: {s.active}")
                elif ref not in self.busy_forever:
                    self.sessions[ref] = max(0, self.sessions[ref] - 1)

    def _dead(self) -> bool:
        return self.dead_from is not None and self.clock.now >= self.dead_from

    def facts(self, ref: InstanceRef) -> InstanceFacts:
        self._traffic()
        f = super().facts(ref)
        if self._dead():
            return replace(f, lb_error="haproxy on this machine (/run/lb.sock): connection refused")
        status = {"ready": "UP", "drain": "DRAIN", "maint": "MAINT"}[self.admin[ref].value]
        view = ServerView("chat", f"{ref.host}:{ref.instance}", self.admin[ref], status, self.sessions[ref], 0)
        return replace(f, lb=view)

    def stop_unit(self, ref: InstanceRef) -> None:
        self._traffic()
        if self.admin[ref] is AdminState.READY:
            self.failed.append(f"{ref}: stopped while in traffic")
        super().stop_unit(ref)

    def set_lb_state(self, ref: InstanceRef, state: str) -> None:
        self._traffic()
        if self._dead():
            raise ExecutorError("haproxy on this machine (/run/lb.sock): connection refused")
        self.log.append(f"lb {state} {ref}")
        self.admin[ref] = AdminState(state)


def run(
    tmp_path: Path, sim: SimBalancer, ts: list[Target] | None = None, kind: str = "restart", policy=LB_POLICY
) -> tuple[RolloutState, Journal]:  # type: ignore[no-untyped-def]
    journal = Journal(tmp_path / "journal.sqlite")
    state = new_rollout("r1", "/inv/lab.py", kind, ts or targets(sim, "v1", restart=True), policy, sim.clock.now)
    journal.begin(state)
    runner = Runner(sim, journal, clock=sim.clock, sleep=sim.clock.sleep)
    final = runner.run(state)
    assert runner.ticks < 5000
    return final, journal


def test_each_instance_leaves_traffic_drains_on_the_balancer_then_restarts_and_comes_back(tmp_path: Path) -> None:
    sim = SimBalancer(Clock(), [2, 2])
    state, journal = run(tmp_path, sim)
    assert state.status is RolloutStatus.DONE, state.reason
    assert sim.failed == [], sim.failed  # the balancer never sent a request to an instance not serving
    assert sim.sent > 50
    assert set(sim.admin.values()) == {AdminState.READY}
    steps = [(s.instance, s.action) for s in journal.steps("r1")]
    for ref in sim.instances:
        mine = [a for i, a in steps if i == str(ref)]
        assert mine == ["lb:drain", "stop", "start", "lb:ready"], (ref, mine)
    # the stop came only once the balancer reported no session: 3 sessions end one per second
    log = sim.log
    assert (
        log.index("lb drain h0/i0") < log.index("stop h0/i0") < log.index("start h0/i0") < log.index("lb ready h0/i0")
    )
    assert next_steps(state)[0].startswith("every instance is healthy")


def test_the_balancer_wait_is_bounded(tmp_path: Path) -> None:
    sim = SimBalancer(Clock(), [1, 1])
    sim.busy_forever.add(InstanceRef("h0", "i0"))  # a client that never lets go
    t0 = sim.clock.now
    state, _journal = run(tmp_path, sim)
    assert state.status is RolloutStatus.DONE, state.reason
    stop_at = next(i for i, line in enumerate(sim.log) if line == "stop h0/i0")
    assert stop_at > 0
    assert sim.clock.now - t0 >= POLICY.drain_timeout_s  # it waited the whole drain_timeout_s, then went on


def test_an_instance_already_on_target_but_out_of_traffic_is_gated_and_put_back_not_restarted(tmp_path: Path) -> None:
    sim = SimBalancer(Clock(), [1, 1])
    out = InstanceRef("h1", "i0")
    sim.admin[out] = AdminState.DRAIN  # a halted rollout left it there
    state, journal = run(tmp_path, sim, targets(sim, "v1", restart=False), kind="rollout")
    assert state.status is RolloutStatus.DONE, state.reason
    assert [(s.instance, s.action) for s in journal.steps("r1")] == [(str(out), "lb:ready")]
    assert not any(line.startswith(("stop", "start")) for line in sim.log)
    assert sim.admin[out] is AdminState.READY


def test_a_canary_that_fails_goes_back_and_into_traffic(tmp_path: Path) -> None:
    sim = SimBalancer(Clock(), [1, 1, 1])
    sim.fail_load.add("v2")
    policy = replace(LB_POLICY, on_failure=OnFailure.ROLLBACK)
    state, journal = run(tmp_path, sim, targets(sim, "v2"), kind="rollout", policy=policy)
    assert state.status is RolloutStatus.HALTED
    canary = InstanceRef("h0", "i0")
    assert state.inst(canary).phase is Phase.ROLLED_BACK
    assert sim.admin[canary] is AdminState.READY and sim.releases()[str(canary)] == "v1"
    assert [a for i, a in ((s.instance, s.action) for s in journal.steps("r1")) if i == str(canary)] == [
        "lb:drain",
        "stop",
        "flip",
        "start",
        "flip",
        "start",
        "lb:ready",
    ]  # fmt: skip  (still out of traffic when it failed: no second drain; its unit had failed: no stop)
    assert not any("out of traffic" in line for line in next_steps(state))
    assert sim.failed == []


def test_a_balancer_that_dies_mid_rollout_halts_with_every_instance_known(tmp_path: Path) -> None:
    sim = SimBalancer(Clock(), [1, 1, 1, 1])
    sim.dead_from = sim.clock.now + 30  # while the second batch is at its gates, out of traffic
    state, _journal = run(tmp_path, sim)
    assert state.status is RolloutStatus.HALTED, state.reason
    assert "load balancer not reachable" in state.reason
    phases = {str(r): (i.phase.value, i.lb_out) for r, i in state.instances.items()}
    # the canary is back in traffic; batch 2 was at its gates, out of traffic, when the balancer died:
    # it could be neither put back nor drained again for its rollback; batch 3 was never touched
    assert phases == {"h0/i0": ("done", False), "h1/i0": ("rollback_failed", True),
                      "h2/i0": ("rollback_failed", True), "h3/i0": ("pending", False)}  # fmt: skip
    assert sim.releases() == {"h0/i0": "v1", "h1/i0": "v1", "h2/i0": "v1", "h3/i0": "v1"}
    advice = next_steps(state)
    want = "out of traffic on its load balancer: h1/i0, h2/i0; once each serves (fleet status), put it back: "
    assert want + "fleet lb ready /inv/lab.py h1/i0 h2/i0" in advice
    assert not any("is not serving" in line for line in advice)  # they serve: only the balancer is gone
    assert sim.failed == []


def test_drain_stops_and_leaves_in_maintenance(tmp_path: Path) -> None:
    sim = SimBalancer(Clock(), [2])
    ts = [Target(r, "v1", MODELS["v1"], restart=True, stop_only=True) for r in sim.instances]
    policy = replace(LB_POLICY, batches=(-1,), whole_host=True, max_unavailable="100%")
    state, journal = run(tmp_path, sim, ts, kind="drain", policy=policy)
    assert state.status is RolloutStatus.DONE, state.reason
    assert {s.active for s in sim.instances.values()} == {"inactive"}
    assert set(sim.admin.values()) == {AdminState.MAINT}
    assert [s.action for s in journal.steps("r1") if s.instance == "h0/i0"] == ["lb:drain", "stop", "lb:maint"]
    assert sim.failed == []


def test_decide_waits_for_the_balancer_then_for_vllm() -> None:
    ref = InstanceRef("h", "i0")
    state = new_rollout("r", "f", "restart", [Target(ref, "v1", "m", restart=True)], LB_POLICY, 0.0)
    unit = UnitState("active", "running", 0, 10)

    def facts(admin: AdminState, sessions: int, in_flight: float) -> Observations:
        view = ServerView("b", "h:i0", admin, admin.value.upper(), sessions, 0)
        return Observations(0, {ref: InstanceFacts(ref, unit, "v1", "m", serving=True, in_flight=in_flight, lb=view)})

    d = decide(state, facts(AdminState.READY, 2, 2), 1.0)
    assert [(a.kind, a.lb_state) for a in d.actions] == [(Act.LB, "drain")]
    d = decide(d.state, facts(AdminState.DRAIN, 2, 2), 2.0)
    assert d.actions == () and "draining on the balancer: 2 session(s)" in d.waits[0]
    d = decide(d.state, facts(AdminState.DRAIN, 0, 1), 3.0)
    assert d.actions == () and d.state.inst(ref).lb_drained
    d = decide(d.state, facts(AdminState.DRAIN, 0, 1), 4.0)
    assert d.actions == () and "1 request(s) in flight" in d.waits[0]  # then vLLM's own count
    d = decide(d.state, facts(AdminState.DRAIN, 0, 0), 5.0)
    assert [a.kind for a in d.actions] == [Act.STOP]


def test_no_session_on_the_balancer_and_none_in_vllm_is_a_stop_in_the_same_tick() -> None:
    """Both counts come from one observation: a drained instance is stopped at once, not a probe
    interval (2 s by default) after the balancer's count reached 0."""
    ref = InstanceRef("h", "i0")
    state = new_rollout("r", "f", "restart", [Target(ref, "v1", "m", restart=True)], LB_POLICY, 0.0)
    unit = UnitState("active", "running", 0, 10)

    def facts(admin: AdminState, sessions: int) -> Observations:
        view = ServerView("b", "h:i0", admin, admin.value.upper(), sessions, 0)
        return Observations(0, {ref: InstanceFacts(ref, unit, "v1", "m", serving=True, in_flight=0.0, lb=view)})

    d = decide(state, facts(AdminState.READY, 0), 1.0)
    assert [(a.kind, a.lb_state) for a in d.actions] == [(Act.LB, "drain")]
    d = decide(d.state, facts(AdminState.DRAIN, 0), 2.0)
    assert [a.kind for a in d.actions] == [Act.STOP]
