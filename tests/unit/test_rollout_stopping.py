"""How a ``systemctl stop`` ended (issue 20): SIGKILL after TimeoutStopSec is a known, journaled outcome.

The properties are those a real systemd (in a lab host) showed: a service whose main process
ignores SIGTERM, stopped with ``TimeoutStopSec=2`` and ``KillMode=mixed``: ``systemctl stop``
returned 0 after 2 s, then ``Result=timeout``, ``ActiveState=failed``, ``ExecMainCode=2``,
``ExecMainStatus=9``; one that exits on SIGTERM: ``Result=success``, ``ActiveState=inactive``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import Phase, RolloutStatus
from fleet.rollout.gates import Check, CompletionAnswer, check_completion
from fleet.rollout.stopping import stop_outcome
from tests.unit.test_rollout_engine import POLICY, Clock, SimFleet, run


@pytest.mark.parametrize(
    ("props", "expect"),
    [
        ({"Result": "success", "ActiveState": "inactive", "ExecMainCode": "0", "ExecMainStatus": "0"}, "stopped"),
        ({"Result": "success", "ActiveState": "inactive", "ExecMainCode": "2", "ExecMainStatus": "15"}, "stopped"),
        ({}, "stopped"),
        (
            {"Result": "timeout", "ActiveState": "failed", "ExecMainCode": "2", "ExecMainStatus": "9"},
            "stopped by SIGKILL after TimeoutStopSec (Result=timeout; main process killed with status 9)",
        ),
        (
            {"Result": "exit-code", "ActiveState": "failed", "ExecMainCode": "1", "ExecMainStatus": "1"},
            "stopped (Result=exit-code; main process exited with status 1)",
        ),
    ],
)
def test_stop_outcome(props: dict[str, str], expect: str) -> None:
    assert stop_outcome(props).startswith(expect)


def test_a_stop_that_ended_in_sigkill_is_journaled_and_the_gpu_check_follows(tmp_path: Path) -> None:
    """The stop step's outcome in the journal says how it ended; the rollout goes on through the
    GPU check (an engine core left holding a GPU would fail it) and finishes."""
    sim = SimFleet(Clock(), [1, 1])
    original = sim.stop_unit
    killed = {"Result": "timeout", "ActiveState": "failed", "ExecMainCode": "2", "ExecMainStatus": "9"}

    def stop(ref: InstanceRef) -> str:
        original(ref)
        return stop_outcome(killed if ref.host == "h0" else {"Result": "success"})

    sim.stop_unit = stop  # type: ignore[method-assign]
    state, journal = run(tmp_path, sim, replace(POLICY, batches=(1, 1)))
    assert state.status is RolloutStatus.DONE, state.reason
    stops = [s for s in journal.steps("r1") if s.action == "stop"]
    by_host = {s.instance.split("/")[0]: s for s in stops}
    assert by_host["h0"].outcome == "ok"
    assert by_host["h0"].outcome_detail is not None
    assert by_host["h0"].outcome_detail.startswith("stopped by SIGKILL after TimeoutStopSec (Result=timeout")
    assert by_host["h1"].outcome_detail == "stopped"
    assert all(state.inst(ref).phase is Phase.DONE for ref in sim.instances)
    # after that stop the GPUs were checked before the start: the log has stop, then start
    h0 = [line for line in sim.log if "h0" in line]
    first = {verb: next(i for i, x in enumerate(h0) if x.startswith(verb)) for verb in ("stop", "start")}
    assert first["stop"] < first["start"]


@pytest.mark.parametrize(
    "message",
    [
        "The server had an error while processing your request.",  # 0.33.0 CLIENT_MESSAGE
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",  # 0.32.0
    ],
)
def test_completion_gate_names_a_dead_engine(message: str) -> None:
    verdict, why = check_completion(CompletionAnswer(status=500, error=message))
    assert verdict is Check.BAD
    assert "the engine core died: EngineDeadError" in why and message in why


def test_completion_gate_names_a_drain() -> None:
    verdict, why = check_completion(CompletionAnswer(status=500, error="cannot schedule new futures after shutdown"))
    assert verdict is Check.BAD and "the server is draining or stopping" in why


def test_after_a_sigkill_stop_the_gpu_check_holds_the_start_until_the_gpus_are_free(tmp_path: Path) -> None:
    """The GPU check after a SIGKILLed stop is real: an engine core still holding the GPU (as one
    whose API server deadlocked while loading would, were it outside the unit's cgroup) is named
    and killed before the new release starts, and the stop's journaled outcome stays the SIGKILL."""
    sim = SimFleet(Clock(), [1])
    ref = InstanceRef("h0", "i0")
    sim.orphan_on_stop.add(ref)
    original = sim.stop_unit

    def stop(r: InstanceRef) -> str:
        original(r)
        return stop_outcome({"Result": "timeout", "ActiveState": "failed", "ExecMainCode": "2", "ExecMainStatus": "9"})

    sim.stop_unit = stop  # type: ignore[method-assign]
    state, journal = run(tmp_path, sim, replace(POLICY, batches=(1,)))
    assert state.status is RolloutStatus.DONE, state.reason
    acts = [line.split()[0] for line in sim.log if not line.startswith("hook")]
    assert acts == ["stop", "kill", "flip", "start"], sim.log
    steps = {s.action: s for s in journal.steps("r1")}
    assert steps["stop"].outcome_detail is not None
    assert steps["stop"].outcome_detail.startswith("stopped by SIGKILL after TimeoutStopSec")
    assert "orphaned engine left by the stopped unit" in steps["kill"].detail
