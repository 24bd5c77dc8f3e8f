"""Per-instance truth for deploy, rollback and the first run (issues 25.3 and 19.1), as pure pieces:
what a host's instances wait for (``Staged.waiting``), whether a deploy converged
(``fleet.deploy.converge.drift``), where a rollback sends each instance
(``fleet.rollout.previous``), and units enabled only once planned from the probe."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pyinfra.facts.systemd import SystemdEnabled

from fleet.deploy.converge import drift
from fleet.facts.releases import running_release
from fleet.facts.revisions import InstanceRevision
from fleet.operations import units
from fleet.operations.host import Staged, instance_release
from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import InstanceState, Phase, RolloutState, RolloutStatus, Target
from fleet.rollout.policy import RolloutPolicy
from fleet.rollout.previous import back_to, last_changes, rollback_targets

from .opharness import Value, key, run_op
from .test_operations_vllm import ENV, UNIT, _unit_facts

ROOT = "/opt/fleet/vllm"


def exe(release: str) -> str:
    return f"{ROOT}/releases/{release}/bin/python3"


def found(state: str = "active", live: str | None = "c1", runs: str | None = "A") -> InstanceRevision:
    return {"state": state, "live": live, "stored": [], "exe": exe(runs) if runs else None}


# ---- what an instance runs --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("interpreter", "current", "runs"),
    [
        (exe("B"), "A", "B"),  # the canary: its process runs B, the host's link says A
        (None, "A", "A"),  # stopped: it starts next on what current names
        ("", "A", "A"),
        ("/usr/bin/python3", "A", "A"),  # not one of ours: cannot tell, current it is
        (None, None, None),
    ],
)
def test_running_release(interpreter: str | None, current: str | None, runs: str | None) -> None:
    assert running_release(interpreter, current, ROOT) == runs
    entry = {"state": "active", "live": None, "stored": [], "exe": interpreter}
    assert instance_release(entry, current) == runs  # type: ignore[arg-type]


# ---- which running instances a deploy must roll -----------------------------------------------


@pytest.mark.parametrize(
    ("runs", "live", "current", "waiting"),
    [
        ({"vllm-0": "B", "vllm-1": "B"}, {"vllm-0": "c1", "vllm-1": "c1"}, "B", []),  # converged
        # the bug (25.3): a canary flipped the host's link to B; vllm-1 still runs A. By the link
        # nothing waited and the deploy said "healthy"; by each process, vllm-1 waits.
        ({"vllm-0": "B", "vllm-1": "A"}, {"vllm-0": "c1", "vllm-1": "c1"}, "B", ["vllm-1"]),
        # the link names the old release, both run the new one: nothing to roll
        ({"vllm-0": "B", "vllm-1": "B"}, {"vllm-0": "c1", "vllm-1": "c1"}, "A", []),
        ({"vllm-0": "B", "vllm-1": "B"}, {"vllm-0": "c0", "vllm-1": "c1"}, "B", ["vllm-0"]),  # old configuration
        ({"vllm-0": "A", "vllm-1": "A"}, {"vllm-0": "c1", "vllm-1": "c1"}, "A", ["vllm-0", "vllm-1"]),  # new release
    ],
)
def test_waiting_is_per_instance_not_per_host_link(
    runs: dict[str, str], live: dict[str, str], current: str, waiting: list[str]
) -> None:
    staged = Staged(
        release="B", revisions={"vllm-0": "c1", "vllm-1": "c1"}, running={"vllm-0", "vllm-1"}, live=dict(live),
        runs=dict(runs), current=current,
    )  # fmt: skip
    assert staged.waiting == waiting


def test_a_stopped_instance_does_not_wait_for_the_engine() -> None:
    staged = Staged(release="B", revisions={"vllm-0": "c1"}, running=set(), live={"vllm-0": "c0"}, runs={"vllm-0": "A"})
    assert staged.waiting == []  # its files are written in place and it is started by the deploy


# ---- did the deploy converge ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "lines"),
    [
        ({"vllm-0": found(), "vllm-1": found()}, []),
        ({"vllm-0": found(), "vllm-1": found(runs="B")}, ["h1/vllm-1: runs release B, the inventory's is A"]),
        ({"vllm-0": found(), "vllm-1": found(live="c0")},
         ["h1/vllm-1: configuration c0 in place, the inventory's is c1"]),
        ({"vllm-0": found(state="failed", runs=None), "vllm-1": found()}, ["h1/vllm-0: its unit is failed"]),
        ({"vllm-0": found(state="inactive", runs=None, live=None), "vllm-1": found()},
         ["h1/vllm-0: its unit is inactive; configuration (files missing) in place, the inventory's is c1"]),
        ({"vllm-0": found()}, ["h1/vllm-1: not read from the host"]),
        # active, but its interpreter is no release's: what it runs cannot be told, not converged
        ({"vllm-0": {**found(), "exe": "/usr/bin/python3"}, "vllm-1": found()},
         ["h1/vllm-0: runs an interpreter outside the releases (/usr/bin/python3), the inventory's is A"]),
    ],
)  # fmt: skip
def test_drift(entries: dict[str, Any], lines: list[str]) -> None:
    assert drift("h1", "A", {"vllm-0": "c1", "vllm-1": "c1"}, entries, ROOT) == lines


# ---- rollback: each instance's own previous release -------------------------------------------

H1_0, H1_1, H2_0 = InstanceRef("h1", "vllm-0"), InstanceRef("h1", "vllm-1"), InstanceRef("h2", "vllm-0")


def inst(ref: InstanceRef, phase: Phase, target: str, previous: str | None, changed: bool = True) -> InstanceState:
    return InstanceState(
        ref, Target(ref, target, "m"), phase=phase, first_step_at=1.0 if changed else None,
        previous_release=previous, previous_model="m", changed=changed,
    )  # fmt: skip


def rollout(
    rid: str, kind: str, *instances: InstanceState, status: RolloutStatus = RolloutStatus.HALTED
) -> RolloutState:
    return RolloutState(rid, "fleet", kind, RolloutPolicy(), (), {i.ref: i for i in instances}, 0.0, status=status)


#: A release rollout to B halted: the canary (h1/vllm-0) stayed on B; h2/vllm-0 crashed on B and
#: went back to A with its batch; h1/vllm-1 was never reached. The host links now say h1:
#: current A, previous B; h2: current A, previous B.
HALTED = rollout(
    "r1", "rollout",
    inst(H1_0, Phase.DONE, "B", "A"),
    inst(H2_0, Phase.ROLLED_BACK, "B", "A"),
    inst(H1_1, Phase.PENDING, "B", None, changed=False),
)  # fmt: skip


def test_after_a_halted_rollout_only_the_canary_goes_back_and_to_its_own_release() -> None:
    changes = last_changes([HALTED])
    targets, untouched = rollback_targets(changes, [H1_0, H1_1, H2_0])
    # The host links would send h1/vllm-1 and h2/vllm-0 to B, the release that crashed.
    assert [(t.ref, t.release) for t in targets] == [(H1_0, "A")]
    assert untouched == [H1_1, H2_0]


def test_the_newest_change_of_each_instance_wins_and_rollbacks_and_restarts_are_not_changes() -> None:
    older = rollout("r0", "rollout", inst(H1_0, Phase.DONE, "A", "Z"), inst(H2_0, Phase.DONE, "A", "Z"),
                    status=RolloutStatus.DONE)  # fmt: skip
    back = rollout("r2", "rollback", inst(H1_0, Phase.DONE, "A", "B"), status=RolloutStatus.DONE)
    restart = rollout("r3", "restart", inst(H2_0, Phase.DONE, "A", "A"), status=RolloutStatus.DONE)
    changes = last_changes([restart, back, HALTED, older])  # newest first
    targets, untouched = rollback_targets(changes, [H1_0, H1_1, H2_0])
    # h1/vllm-0: undo r1 (A -> B) once more is a no-op on A; h2/vllm-0: r1 returned it, r0 is its change
    assert [(t.ref, t.release) for t in targets] == [(H1_0, "A"), (H2_0, "Z")]
    assert untouched == [H1_1]


def test_an_unfinished_rollout_is_named_not_guessed_past() -> None:
    running = replace(HALTED, id="r9", status=RolloutStatus.RUNNING)
    with pytest.raises(ValueError, match="r9"):
        last_changes([running, HALTED])


def test_back_to_restores_release_model_and_configuration() -> None:
    i = replace(
        inst(H1_0, Phase.FAILED, "B", "A"), target=Target(H1_0, "B", "new-model", 8001, revision="c2"),
        previous_model="old-model", previous_revision="c1",
    )  # fmt: skip
    assert back_to(i) == Target(H1_0, "A", "old-model", 8001, revision="c1")
    plain = replace(i, target=Target(H1_0, "B", "new-model", 8001))
    assert back_to(plain).revision is None  # --release rollouts leave the files: so does their rollback


# ---- first run: units enabled only once planned from the probe --------------------------------


def test_units_written_without_enabling_them() -> None:
    facts = {k: v for k, v in _unit_facts(False, False, False).items() if k[0] is not SystemdEnabled}
    run = run_op(units.installed, facts, files=[UNIT, ENV], enable=False)  # no SystemdEnabled read either
    assert len(run.texts) == 1 and run.texts[0].split(" && ")[-1] == "systemctl daemon-reload"
    assert "enable" not in run.texts[0]


def test_enabled_enables_only_what_is_not() -> None:
    names = ["fleet-vllm-0.service", "fleet-vllm-1.service"]
    state = {"fleet-vllm-0.service": True, "fleet-vllm-1.service": False}
    run = run_op(units.enabled, {key(SystemdEnabled, services=names): Value(state)}, units=names)
    assert run.texts == ["systemctl enable fleet-vllm-1.service"]
    both = {key(SystemdEnabled, services=names): Value(dict.fromkeys(names, True))}
    assert run_op(units.enabled, both, units=names).texts == []
