"""Journal and lock: durable steps, history, crash-surviving lock; a real process SIGKILLed mid-step."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import Phase, RolloutStatus, new_rollout
from fleet.rollout.errors import JournalError, LockHeld
from fleet.rollout.journal import Journal, new_rollout_id
from fleet.rollout.runner import Runner, reopen_rollout
from tests.lab.polling import wait_for
from tests.unit.test_rollout_engine import POLICY, Clock, SimFleet, targets

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from fleet.rollout.engine import new_rollout
    from fleet.rollout.journal import Journal
    from fleet.rollout.runner import Runner, open_rollout, reopen_rollout
    from tests.unit.test_rollout_engine import POLICY, Clock, SimFleet, targets

    db, marker, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    journal = Journal(db)
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    state = new_rollout("crash-1", "lab", "rollout", targets(sim), POLICY, clock.now)
    open_rollout(journal, state)
    if mode == "hold":
        marker.write_text("locked")
        time.sleep(600)

    def stop_forever(ref):
        marker.write_text(str(ref))  # the step is journaled; now the process dies in the middle of it
        time.sleep(600)

    sim.stop_unit = stop_forever
    Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
    """
)


def child(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], Path]:
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "journal.sqlite"), str(marker), mode],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return proc, marker


def test_sigkill_mid_step_then_resume(tmp_path: Path) -> None:
    proc, marker = child(tmp_path, "crash")
    try:
        assert wait_for(marker.exists, timeout=60), "the child never reached its stop"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    journal = Journal(tmp_path / "journal.sqlite")
    # The lock survived the crash, names its owner, and is not taken silently.
    owner = journal.lock_owner("lab")
    assert owner is not None and owner.pid == proc.pid and owner.rollout_id == "crash-1"
    assert owner.alive() is False
    # `fleet history` does not call it running: its process is gone (issue 25, item 6)
    record = journal.history("lab")[0]
    assert (record.id, record.status) == ("crash-1", "interrupted")
    assert record.reason == "its process is gone; resume with: fleet rollout --resume crash-1 --take-over"
    shown = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "history", "--journal", str(tmp_path / "journal.sqlite"), "--json"],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    assert [(r["id"], r["status"]) for r in json.loads(shown.stdout)["rollouts"]] == [("crash-1", "interrupted")]
    with pytest.raises(
        LockHeld, match=r"fleet lab has a stale lock: rollout crash-1 by .* \(pid \d+\), started .* ago"
    ):
        journal.acquire("lab", "crash-1")
    clock = Clock()
    state = reopen_rollout(journal, "crash-1", clock.now, takeover=True)
    assert state.last_progress_at == clock.now  # clocks restart: the downtime does not count
    # The step in flight was journaled before it was taken, with what was there before; no outcome.
    steps = journal.steps("crash-1")
    assert [s.action for s in steps] == ["hook:drain", "stop"]
    assert steps[0].outcome == "ok" and steps[1].outcome is None
    assert steps[1].before == {
        "release": "v1",
        "revision": "c1",
        "model": "llama-8b",
        "unit": "active/running",
        "unreachable": "",
    }
    assert state.status is RolloutStatus.RUNNING and state.inst(InstanceRef("h0", "i0")).phase is Phase.STOP
    assert journal.last_unfinished("lab") == "crash-1"
    # Resume against the hosts' true state (the stop never happened): the stop is taken again, the
    # drain hook (done) is not, and the rollout finishes.
    sim = SimFleet(clock, [1, 1])
    final = Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
    assert final.status is RolloutStatus.DONE, final.reason
    assert sim.log[:3] == ["stop h0/i0", "flip v2 h0/i0", "start h0/i0"]
    assert set(sim.releases().values()) == {"v2"}
    journal.release("lab", "crash-1")
    assert journal.lock_owner("lab") is None
    assert journal.history("lab")[0].status == "done"
    with pytest.raises(JournalError, match=r"rollout crash-1 is done .*nothing to resume"):
        reopen_rollout(journal, "crash-1", 0.0)


def test_second_rollout_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    proc, marker = child(tmp_path, "hold")
    try:
        assert wait_for(marker.exists, timeout=60)
        journal = Journal(tmp_path / "journal.sqlite")
        assert [(r.id, r.status) for r in journal.history()] == [("crash-1", "running")]  # its owner lives
        with pytest.raises(LockHeld, match=rf"fleet lab is locked by rollout crash-1 by .*\(pid {proc.pid}\)"):
            journal.acquire("lab", "second")
        with pytest.raises(LockHeld):  # a live owner is never taken over, even when asked
            journal.acquire("lab", "second", takeover=True)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def test_lock_of_another_machine_is_treated_as_live(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite")
    journal.db.execute(
        "INSERT INTO locks VALUES ('lab', 'r9', 1, '1', 'laptop-of-alice', 'alice', ?)", (time.time() - 3600,)
    )
    with pytest.raises(LockHeld, match=r"by alice@laptop-of-alice .* ago.*another machine") as exc:
        journal.acquire("lab", "r10", takeover=True)
    assert "3600s ago" in str(exc.value) or "3601s ago" in str(exc.value)


def test_lock_is_reentrant_for_its_owner_and_released(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite")
    journal.acquire("lab", "r1")
    journal.acquire("lab", "r1")
    journal.release("lab", "r1")
    journal.acquire("other", "r2")
    assert journal.lock_owner("lab") is None and journal.lock_owner("other") is not None


def test_journal_is_wal_synchronous_full_and_private(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "sub" / "j.sqlite")
    assert journal.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert journal.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert (tmp_path / "sub" / "j.sqlite").stat().st_mode & 0o077 == 0


def test_history_newest_first_and_unknown_rollout(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite")
    for i, fleet in enumerate(["lab", "lab", "prod"]):
        clock = Clock()
        sim = SimFleet(clock, [1])
        state = new_rollout(f"r{i}", fleet, "restart", targets(sim, "v1", restart=True), POLICY, 1000.0 + i)
        journal.begin(state)
        Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
    assert [r.id for r in journal.history("lab")] == ["r1", "r0"]
    assert [r.id for r in journal.history()] == ["r2", "r1", "r0"]
    record = journal.history("prod")[0]
    assert (record.kind, record.status, record.steps) == ("restart", "done", 4)
    with pytest.raises(JournalError, match="no rollout 'nope'"):
        journal.latest_state("nope")
    with pytest.raises(sqlite3.IntegrityError):
        journal.begin(journal.latest_state("r0"))  # ids are unique
    assert new_rollout_id(0).startswith("19700101T000000Z-")


def test_a_running_rollout_without_its_lock_is_interrupted_and_the_next_holder_does_not_change_that(
    tmp_path: Path,
) -> None:
    """A hard abort (a second Ctrl-C) releases the lock on the way out and leaves the journal saying
    running; a later rollout of the same fleet holds the lock for itself, not for the first."""
    journal = Journal(tmp_path / "j.sqlite")
    clock = Clock()
    sim = SimFleet(clock, [1])
    first = new_rollout("r-aborted", "lab", "restart", targets(sim, "v1", restart=True), POLICY, clock.now)
    journal.acquire("lab", first.id)
    journal.begin(first)
    journal.release("lab", first.id)
    assert [(r.id, r.status) for r in journal.history()] == [("r-aborted", "interrupted")]
    second = new_rollout("r-next", "lab", "restart", targets(sim, "v1", restart=True), POLICY, clock.now + 1)
    journal.acquire("lab", second.id)
    journal.begin(second)
    assert [(r.id, r.status) for r in journal.history()] == [("r-next", "running"), ("r-aborted", "interrupted")]
    assert journal.latest_state("r-aborted").status is RolloutStatus.RUNNING  # stored: still resumable


def test_where_the_journal_is_and_what_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.rollout.journal import locate

    monkeypatch.delenv("FLEET_JOURNAL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.delenv("FLEET_JOURNAL_CONFIG", raising=False)
    assert locate().path == tmp_path / ".local" / "state" / "fleet" / "journal.sqlite"
    config = tmp_path / ".config" / "fleet" / "journal.toml"
    config.parent.mkdir(parents=True)
    config.write_text('url = "postgresql://fleet@db.internal/fleet"\npassword_ref = "env:FLEET_DB_PW"\n')
    found = locate()
    assert (found.kind, found.url, str(found.password_ref), found.source) == (
        "postgresql", "postgresql://fleet@db.internal/fleet", "env:FLEET_DB_PW", str(config)
    )  # fmt: skip
    monkeypatch.setenv("FLEET_JOURNAL", "postgres://ops@10.0.0.9:6432/journal?sslmode=verify-full")
    assert locate().source == "FLEET_JOURNAL" and locate().kind == "postgresql"
    assert locate(str(tmp_path / "mine.sqlite")).path == tmp_path / "mine.sqlite"  # --journal wins
    for bad, expected in [
        ("postgresql://fleet:hunter2-secret@db/fleet", "a password in the journal URL is refused"),
        ("postgresql://fleet@db/fleet?password=hunter2-secret", "a password in the journal URL is refused"),
        ("mysql://db/fleet", "a PostgreSQL URL without a password"),
    ]:
        with pytest.raises(JournalError, match=expected) as refused:
            locate(bad)
        assert "hunter2" not in str(refused.value)
    monkeypatch.delenv("FLEET_JOURNAL")
    config.write_text('url = "postgresql://fleet@db/fleet"\npasword_ref = "env:X"\n')
    with pytest.raises(JournalError, match=rf"{config}: pasword_ref: not a journal setting; did you mean password_ref"):
        locate()
    config.write_text('url = "postgresql://fleet@db/fleet"\npassword_ref = "hunter2-secret"\n')
    with pytest.raises(JournalError, match="password_ref: a reference to the key, not the key") as refused:
        locate()
    assert "hunter2" not in str(refused.value)
