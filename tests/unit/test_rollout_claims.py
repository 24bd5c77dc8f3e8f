"""Host claims (issue 27, item 2): the host-side script run by a real ``sh`` with coreutils and
``flock`` against a directory here (what ``SshExecutor.claim_host`` sends over SSH, under sudo),
its verdicts, the keeper's take/renew/release, and what the engine decides from a lost claim."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from fleet.rollout.batches import InstanceRef
from fleet.rollout.claims import (
    CLAIM_FILE,
    ClaimAnswer,
    ClaimRequest,
    HostClaimed,
    HostClaims,
    claim_script,
    parse_answer,
    safe_word,
)
from fleet.rollout.engine import Phase, RolloutStatus, Target, decide, new_rollout
from fleet.rollout.errors import LockHeld
from fleet.rollout.executor import ExecutorError
from fleet.rollout.gates import UnitState
from fleet.rollout.observe import InstanceFacts, Observations
from fleet.rollout.policy import RolloutPolicy

A = ClaimRequest("20260101T000000Z-aaaaaa", "laptop-a", "alice", 111, 120)
B = ClaimRequest("20260101T000001Z-bbbbbb", "jump-b", "bob", 222, 120)


def on_host(d: Path, request: ClaimRequest, mode: str, lease: int | None = None, stale: str = "-") -> ClaimAnswer:
    argv = ["sh", "-c", claim_script(), "fleet-claim", str(d), mode, request.rollout_id, request.machine,
            request.user, str(request.pid), str(request.lease_s if lease is None else lease), request.pid_start or "-",
            stale]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30)
    return parse_answer(out.stdout)


def test_claim_hold_expire_renew_lose_and_release(tmp_path: Path) -> None:
    d = tmp_path / "state"
    first = on_host(d, A, "claim")
    assert first.verdict == "claimed" and first.holder is not None and first.holder.rollout_id == A.rollout_id
    assert (d / CLAIM_FILE).stat().st_mode & 0o777 == 0o600 and d.stat().st_mode & 0o777 == 0o700
    held = on_host(d, B, "claim")
    assert held.verdict == "held" and held.holder is not None
    assert held.holder.describe().startswith(f"rollout {A.rollout_id} by alice@laptop-a (pid 111), its lease runs ")
    assert on_host(d, B, "release").verdict == "released" and (d / CLAIM_FILE).exists()  # not B's to clear
    assert on_host(d, A, "renew").verdict == "claimed"
    assert on_host(d, A, "claim").verdict == "claimed"  # its own claim (a resume of the same rollout)
    # A's lease runs out (written with a lease in the past): B may take the host...
    on_host(d, A, "claim", lease=-5)
    taken = on_host(d, B, "claim")
    assert taken.verdict == "claimed" and taken.holder is not None and taken.holder.rollout_id == B.rollout_id
    # ... and A, renewing late, finds it lost, naming B.
    lost = on_host(d, A, "renew")
    assert lost.verdict == "lost" and lost.holder is not None and lost.holder.user == "bob"
    assert on_host(d, B, "release").verdict == "released"
    assert not (d / CLAIM_FILE).exists()
    assert on_host(d, A, "renew").verdict == "claimed"  # nobody's: taken again
    assert sorted(p.name for p in d.iterdir()) == [".claim.lock", CLAIM_FILE]  # no temporary file left


def test_two_rollouts_claiming_at_once_never_both_win(tmp_path: Path) -> None:
    for round_ in range(15):
        d = tmp_path / f"r{round_}"
        answers: dict[str, str] = {}

        def claim(request: ClaimRequest, d: Path = d, answers: dict[str, str] = answers) -> None:
            answers[request.user] = on_host(d, request, "claim").verdict

        threads = [threading.Thread(target=claim, args=(r,)) for r in (A, B)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(answers.values()) == ["claimed", "held"], answers


def test_values_written_to_the_claim_file_are_one_safe_word() -> None:
    assert safe_word("evil\nrollout=x; rm -rf /") == "evil_rollout_x__rm_-rf__"
    assert safe_word("") == "-"
    with pytest.raises(ValueError, match="unexpected answer"):
        parse_answer("sudo: a password is required")


class Hosts:
    """``claim_host`` of two hosts, backed by the real script on two directories; one may be down."""

    def __init__(self, root: Path, request: ClaimRequest) -> None:
        self.root, self.request, self.down = root, request, set[str]()

    def op(self, host: str, mode: str, stale: str = "") -> ClaimAnswer:
        if host in self.down:
            raise ExecutorError(f"host {host}: SSH failed: no answer")
        return on_host(self.root / host, self.request, mode, stale=stale or "-")


def test_the_keeper_refuses_a_held_host_and_gives_back_what_it_took(tmp_path: Path) -> None:
    on_host(tmp_path / "h1", B, "claim")
    hosts = Hosts(tmp_path, A)
    keeper = HostClaims(hosts.op, ("h0", "h1"))
    with pytest.raises(HostClaimed) as refused:
        keeper.take()
    assert isinstance(refused.value, LockHeld)  # exit 2 like a held lock, before anything changes
    message = str(refused.value)
    assert message.startswith(f"host h1 is being rolled by rollout {B.rollout_id} by bob@jump-b (pid 222)")
    assert f"fleet rollout --resume {B.rollout_id} --take-over" in message
    assert not (tmp_path / "h0" / CLAIM_FILE).exists()  # h0's claim, taken first, was given back


def test_the_keeper_claims_a_host_that_was_down_once_it_answers_and_notes_a_lost_one(tmp_path: Path) -> None:
    hosts = Hosts(tmp_path, A)
    hosts.down.add("h1")
    keeper = HostClaims(hosts.op, ("h0", "h1"), renew_s=3600)
    with keeper:
        assert keeper.claimed == {"h0"}
        hosts.down.clear()
        keeper.renew()
        assert keeper.claimed == {"h0", "h1"}
        on_host(tmp_path / "h0", A, "claim", lease=-1)  # A stalled past its lease ...
        on_host(tmp_path / "h0", B, "claim")  # ... and B took h0
        keeper.renew()
        assert keeper.lost_on("h0").startswith(f"rollout {B.rollout_id} by bob@jump-b") and keeper.lost_on("h1") == ""
    assert not (tmp_path / "h1" / CLAIM_FILE).exists()  # released at the end
    assert (tmp_path / "h0" / CLAIM_FILE).exists()  # B's, left alone


def test_the_engine_never_touches_a_host_another_rollout_took() -> None:
    refs = [InstanceRef("h0", "vllm-0"), InstanceRef("h1", "vllm-0")]
    policy = RolloutPolicy(batches=(-1,), max_unavailable=2)
    state = new_rollout("R", "/inv.py", "rollout", [Target(r, "v2", "m") for r in refs], policy, 0.0)
    unit = UnitState("active", "running", 0, 5)
    obs = Observations(
        1.0,
        {
            refs[0]: InstanceFacts(refs[0], unit=unit, release="v1", serving=True, in_flight=0),
            refs[1]: InstanceFacts(refs[1], claimed_by="rollout X by bob@jump-b (pid 2), its lease runs 100s more"),
        },
    )
    decision = decide(state, obs, 1.0)
    assert all(a.ref != refs[1] for a in decision.actions)
    failed = decision.state.inst(refs[1])
    assert failed.phase in (Phase.FAILED, Phase.PENDING)
    assert decision.state.failing.startswith("h1/vllm-0: host h1 is claimed before any change by rollout X by bob")
    # the batch halts (restart-like policy: halt) or rolls back what it touched; h1 is never acted on
    for _ in range(50):
        if decision.state.status is not RolloutStatus.RUNNING:
            break
        decision = decide(decision.state, obs, 2.0)
        assert all(a.ref != refs[1] for a in decision.actions)


def test_a_live_claim_of_a_process_that_died_on_this_machine_is_stale(tmp_path: Path) -> None:
    """The journal's rule for its lock: an owner on this machine whose pid (and its start time) is
    gone no longer holds the host, lease or not; one on another machine holds it until its lease ends."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = ClaimRequest.mine("20260101T000002Z-dead00")
    gone = ClaimRequest(here.rollout_id, here.machine, here.user, dead.pid, 120, "1")  # that pid, another start
    on_host(tmp_path / "h0", gone, "claim")
    elsewhere = ClaimRequest("20260101T000003Z-far000", "other-machine", "bob", dead.pid, 120, "1")
    on_host(tmp_path / "h1", elsewhere, "claim")
    keeper = HostClaims(Hosts(tmp_path, A).op, ("h0",), renew_s=3600)
    with keeper:
        assert keeper.claimed == {"h0"}
    with pytest.raises(HostClaimed, match="host h1 is being rolled by rollout 20260101T000003Z-far000 by bob@other"):
        HostClaims(Hosts(tmp_path, A).op, ("h1",)).take()
