"""``fleet history`` as an operator runs it: the table, ``--json``, one rollout's steps, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fleet.rollout.engine import new_rollout
from fleet.rollout.journal import Journal
from fleet.rollout.runner import Runner
from tests.unit.test_rollout_engine import POLICY, Clock, SimFleet, targets

REPO = Path(__file__).resolve().parents[2]


def fleet(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, cwd=REPO, env=env)


def journal_with_two_rollouts(path: Path) -> None:
    journal = Journal(path)
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    done = new_rollout("r-done", "lab", "rollout", targets(sim), POLICY, clock.now)
    journal.begin(done)
    Runner(sim, journal, clock=clock, sleep=clock.sleep).run(done)
    sim.fail_load.add("v1")
    clock.now += 100
    failed = new_rollout("r-failed", "lab", "rollout", targets(sim, "v1"), POLICY, clock.now)
    journal.begin(failed)
    Runner(sim, journal, clock=clock, sleep=clock.sleep).run(failed)
    journal.close()


def test_history_table_and_json(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal_with_two_rollouts(path)
    out = fleet("history", "--journal", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("r-failed" in line and "halted" in line for line in lines)
    assert any("r-done" in line and "done" in line for line in lines)
    assert out.stdout.index("r-failed") < out.stdout.index("r-done")  # newest first
    data = json.loads(fleet("history", "--journal", str(path), "--json").stdout)
    assert [(r["id"], r["status"]) for r in data["rollouts"]] == [("r-failed", "halted"), ("r-done", "done")]
    assert data["rollouts"][0]["reason"].startswith("batch 1 failed (h0/i0: unit gate: unit failed")


def test_history_of_one_rollout_lists_its_steps(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal_with_two_rollouts(path)
    data = json.loads(fleet("history", "r-failed", "--journal", str(path), "--json").stdout)
    assert data["status"] == "halted"
    flips = [s for s in data["steps"] if s["action"] == "flip"]
    assert [f["before"]["release"] for f in flips] == ["v2", "v1"]  # forward to v1, then back to v2
    table = fleet("history", "r-failed", "--journal", str(path))
    assert table.returncode == 0 and "rollout r-failed (lab): halted" in table.stdout


def test_history_errors(tmp_path: Path) -> None:
    missing = fleet("history", "--journal", str(tmp_path / "none.sqlite"))
    assert missing.returncode == 1 and "no journal at" in missing.stderr
    path = tmp_path / "journal.sqlite"
    journal_with_two_rollouts(path)
    unknown = fleet("history", "nope", "--journal", str(path))
    assert unknown.returncode == 2 and "no rollout 'nope'" in unknown.stderr and "Traceback" not in unknown.stderr


def test_history_json_says_how_often_a_flapping_gate_reset_the_soak(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    state = new_rollout("r-flap", "lab", "rollout", targets(sim), POLICY, clock.now)
    journal.begin(state)
    sim.flap_at.add(clock.now + 12)  # h0/i0 loaded at ~+5, soaking (10 s) when one answer is "abort"
    Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
    journal.close()
    data = json.loads(fleet("history", "r-flap", "--journal", str(path), "--json").stdout)
    assert data["status"] == "done"
    resets = {i["instance"]: i["soak_resets"] for i in data["instances"]}
    assert resets == {"h0/i0": 1, "h1/i0": 0}
    table = fleet("history", "r-flap", "--journal", str(path))
    assert "h0/i0: soak reset 1 time(s): a gate went red while it soaked" in table.stdout
