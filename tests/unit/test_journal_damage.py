"""A damaged journal is bad state, not a bug: the real CLI on a file that is not SQLite and on an
SQLite file with pages overwritten (issue 19, item 9). Every command names the file, says what is
wrong and what to do, never changes the file, and ``fleet history`` shows what is still readable.

Before the fix, each of these exited 3 with "internal error (DatabaseError)".
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.rollout.engine import new_rollout
from fleet.rollout.journal import Journal
from fleet.rollout.runner import Runner
from tests.unit.test_rollout_engine import POLICY, Clock, SimFleet, targets

REPO = Path(__file__).resolve().parents[2]


def fleet(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, cwd=REPO, env=full, timeout=120
    )


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def journal_of(path: Path, rollouts: int = 4) -> None:
    journal = Journal(path)
    clock = Clock()
    for i in range(rollouts):
        sim = SimFleet(clock, [2, 2])
        state = new_rollout(f"r{i}", "lab", "rollout", targets(sim), POLICY, clock.now)
        journal.begin(state)
        Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
        clock.now += 100
    journal.close()


def overwrite_leaf(path: Path, table: str, nth: int) -> None:
    """Overwrite the ``nth`` leaf page of ``table`` with 0xff bytes (what a failing disk leaves)."""
    db = sqlite3.connect(path)
    size = db.execute("PRAGMA page_size").fetchone()[0]
    pages = [r[0] for r in db.execute("SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf'", (table,))]
    db.close()
    with path.open("r+b") as f:
        f.seek((pages[nth] - 1) * size)
        f.write(b"\xff" * size)


NOT_SQLITE = (
    "not an SQLite database (file is not a database); fleet did not change it: keep it for inspection, "
    "and point --journal or FLEET_JOURNAL at another file"
)


@pytest.mark.parametrize(
    "command",
    [
        ["history"],
        ["history", "r1"],
        ["rollout", "--resume"],
        ["rollout", "--resume", "r1", "--take-over"],
        ["rollback"],
        ["rollback", "r1"],
    ],
)
def test_a_file_that_is_not_sqlite_is_named_and_left_as_it_is(tmp_path: Path, command: list[str]) -> None:
    path = tmp_path / "journal.sqlite"
    path.write_text("notes of the on-call, saved over the journal by mistake\n" * 200)
    before = digest(path)
    for how in ({"args": ["--journal", str(path)], "env": {}}, {"args": [], "env": {"FLEET_JOURNAL": str(path)}}):
        out = fleet(*command, *how["args"], env=how["env"])
        assert out.returncode == 2, out
        assert f"journal {path} is {NOT_SQLITE}" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "internal error" not in out.stderr
        assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.sqlite"]  # no -wal, -shm, nothing new


def test_a_damaged_sqlite_journal_shows_what_it_still_holds_and_is_never_written(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal_of(path)
    with Journal(path, write=False) as j:
        steps_before = {s.seq: s.action for s in j.steps("r1")}
        records_before = [(r.id, r.status) for r in j.history()]
    assert len(records_before) == 4 and len(steps_before) > 4
    overwrite_leaf(path, "steps", 2)  # one page of r0's steps
    overwrite_leaf(path, "rollouts", 2)  # r2's row
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    before = digest(path)

    listed = fleet("history", "--journal", str(path), "--json")
    assert listed.returncode == 1, listed
    data = json.loads(listed.stdout)
    assert [(r["id"], r["status"]) for r in data["rollouts"]] == [(i, s) for i, s in records_before if i != "r2"]
    assert data["damaged"][0].startswith(f"journal {path} is damaged (database disk image is malformed)")
    assert "rollout row 3" in data["damaged"]  # r2, the third row, cannot be read: said so

    table = fleet("history", "--journal", str(path))
    assert table.returncode == 1 and "r3" in table.stdout and "r1" in table.stdout
    assert f"warning: journal {path} is damaged" in table.stderr and "keep it for inspection" in table.stderr

    r1 = fleet("history", "r1", "--journal", str(path), "--json")
    assert r1.returncode == 0, r1  # r1's own rows are intact: nothing is missing
    assert {s["seq"]: s["action"] for s in json.loads(r1.stdout)["steps"]} == steps_before

    r0 = fleet("history", "r0", "--journal", str(path), "--json")
    assert r0.returncode == 1, r0
    got = json.loads(r0.stdout)
    assert got["status"] == "done" and len(got["steps"]) >= 1
    lost = [d for d in got["damaged"] if d.startswith("step ")]
    assert len(lost) == 1, got["damaged"]

    # Writing commands refuse it before any host is touched (SQLite's quick_check finds the damage).
    for command in (["rollout", "--resume", "r1"], ["rollback", "r1"]):
        out = fleet(*command, "--journal", str(path))
        assert out.returncode == 2, out
        assert f"journal {path} is damaged" in out.stderr and "Traceback" not in out.stderr
    assert digest(path) == before  # never written, never "repaired"


def test_history_of_a_journal_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    out = fleet("history", "--journal", str(tmp_path / "none.sqlite"))
    assert out.returncode == 1 and "no journal at" in out.stderr
    assert list(tmp_path.iterdir()) == []
