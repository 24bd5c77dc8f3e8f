"""The rollout journal and the fleet lock, in SQLite on the control machine.

Every step is written, with what was there before (release, unit state) and the whole engine
state, and committed with ``synchronous=FULL`` in WAL mode **before** the step is taken; its
outcome is written after. After a crash, ``latest_state`` gives back what the engine meant to do
and the engine re-observes every instance to see what *is* (the journal is not trusted alone).

One rollout per fleet at a time: a row in ``locks`` with the owner's pid (and that pid's start
time, so a reused pid is not mistaken for the owner), host, user and start time. A lock whose
owner is gone is *stale*: it is shown with its owner and age, and taken over only when asked
(``takeover=True``), never silently. A lock held from another machine cannot be checked from
here and is treated as live.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.rollout.engine import Action, RolloutState, state_from_dict, state_to_dict
from fleet.rollout.errors import JournalError, LockHeld

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    fleet TEXT NOT NULL,
    kind TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    user TEXT NOT NULL,
    host TEXT NOT NULL,
    state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL REFERENCES rollouts(id),
    at REAL NOT NULL,
    instance TEXT,
    action TEXT NOT NULL,
    detail TEXT NOT NULL,
    before TEXT NOT NULL,
    state TEXT NOT NULL,
    outcome TEXT,
    outcome_detail TEXT,
    outcome_at REAL
);
CREATE INDEX IF NOT EXISTS steps_by_rollout ON steps(rollout_id, seq);
CREATE TABLE IF NOT EXISTS locks (
    fleet TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pid_start TEXT NOT NULL,
    host TEXT NOT NULL,
    user TEXT NOT NULL,
    started_at REAL NOT NULL
);
"""


def default_path() -> Path:
    """``$FLEET_JOURNAL``, else ``$XDG_STATE_HOME/fleet/journal.sqlite`` (``~/.local/state``)."""
    if os.environ.get("FLEET_JOURNAL"):
        return Path(os.environ["FLEET_JOURNAL"])
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "fleet" / "journal.sqlite"


def new_rollout_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{uuid.uuid4().hex[:6]}"


def _pid_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); "" if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


@dataclass(frozen=True)
class LockOwner:
    fleet: str
    rollout_id: str
    pid: int
    pid_start: str
    host: str
    user: str
    started_at: float

    def alive(self) -> bool | None:
        """True/False when it can be told from here; None when the owner is on another machine."""
        if self.host != socket.gethostname():
            return None
        return _pid_start(self.pid) == self.pid_start and self.pid_start != ""

    def describe(self, now: float | None = None) -> str:
        age = (now if now is not None else time.time()) - self.started_at
        return (
            f"rollout {self.rollout_id} by {self.user}@{self.host} (pid {self.pid}), "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(self.started_at))} ({age:.0f}s ago)"
        )


@dataclass(frozen=True)
class Step:
    seq: int
    rollout_id: str
    at: float
    instance: str | None
    action: str
    detail: str
    before: dict[str, Any]
    outcome: str | None
    outcome_detail: str | None


@dataclass(frozen=True)
class RolloutRecord:
    id: str
    fleet: str
    kind: str
    started_at: float
    ended_at: float | None
    status: str
    reason: str
    user: str
    host: str
    steps: int


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fresh = not self.path.exists()
        self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        if fresh:
            os.chmod(self.path, 0o600)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # -- the lock ------------------------------------------------------------------------------------

    def lock_owner(self, fleet: str) -> LockOwner | None:
        row = self.db.execute(
            "SELECT fleet, rollout_id, pid, pid_start, host, user, started_at FROM locks WHERE fleet = ?", (fleet,)
        ).fetchone()
        return LockOwner(*row) if row else None

    def acquire(self, fleet: str, rollout_id: str, *, takeover: bool = False, now: float | None = None) -> LockOwner:
        """Take the fleet's lock for ``rollout_id``, or raise ``LockHeld`` naming the owner and its age.

        A stale lock (its owner is gone) is taken over only with ``takeover=True``; a lock held by
        this very process for the same rollout is kept (re-entrant, for ``--resume`` in-process).
        """
        now = time.time() if now is None else now
        me = LockOwner(fleet, rollout_id, os.getpid(), _pid_start(os.getpid()), socket.gethostname(), _user(), now)
        with self._tx() as db:
            owner = self.lock_owner(fleet)
            if owner is not None:
                mine = owner.pid == me.pid and owner.pid_start == me.pid_start and owner.host == me.host
                if not mine:
                    alive = owner.alive()
                    if alive is not False:
                        where = "" if alive else " (on another machine: fleet cannot tell whether it still runs)"
                        raise LockHeld(
                            f"fleet {fleet} is locked by {owner.describe(now)}{where}. Wait for it, or if it is "
                            f"gone: fleet rollout --resume {owner.rollout_id} --take-over",
                            owner,
                        )
                    if not takeover:
                        raise LockHeld(
                            f"fleet {fleet} has a stale lock: {owner.describe(now)}, and that process is gone. "
                            f"Resume it with: fleet rollout --resume {owner.rollout_id} --take-over",
                            owner,
                        )
                db.execute("DELETE FROM locks WHERE fleet = ?", (fleet,))
            db.execute(
                "INSERT INTO locks VALUES (?, ?, ?, ?, ?, ?, ?)",
                (me.fleet, me.rollout_id, me.pid, me.pid_start, me.host, me.user, me.started_at),
            )
        return me

    def release(self, fleet: str, rollout_id: str) -> None:
        with self._tx() as db:
            db.execute(
                "DELETE FROM locks WHERE fleet = ? AND rollout_id = ? AND pid = ?", (fleet, rollout_id, os.getpid())
            )

    # -- rollouts and steps ----------------------------------------------------------------------------

    def begin(self, state: RolloutState) -> None:
        """Write a new rollout (its plan and policy) before anything is touched."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO rollouts (id, fleet, kind, started_at, status, user, host, state) "
                "VALUES (?,?,?,?,?,?,?,?)",
                (
                    state.id,
                    state.fleet,
                    state.kind,
                    state.started_at,
                    state.status.value,
                    _user(),
                    socket.gethostname(),
                    json.dumps(state_to_dict(state)),
                ),
            )

    def intent(self, state: RolloutState, action: Action, before: Mapping[str, Any], now: float) -> int:
        """Durably record a step before it is taken; returns its sequence number."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO steps (rollout_id, at, instance, action, detail, before, state) VALUES (?,?,?,?,?,?,?)",
                (
                    state.id,
                    now,
                    str(action.ref) if action.ref else None,
                    action.kind.value
                    + (f":{action.hook or action.lb_state}" if action.hook or action.lb_state else ""),
                    str(action),
                    json.dumps(dict(before)),
                    json.dumps(state_to_dict(state)),
                ),
            )
            db.execute("UPDATE rollouts SET state = ? WHERE id = ?", (json.dumps(state_to_dict(state)), state.id))
            seq = cur.lastrowid
        assert seq is not None
        return seq

    def record(
        self, state: RolloutState, what: str, detail: str, ok: bool, outcome: str, now: float, host: str | None = None
    ) -> None:
        """A step taken around the engine (``fleet drain`` writing a host's marker, enabling units),
        written with its outcome at once: ``what`` is its name in ``fleet history ID``."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO steps (rollout_id, at, instance, action, detail, before, state, outcome, outcome_detail, "
                "outcome_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (state.id, now, host, what, detail, "{}", json.dumps(state_to_dict(state)),
                 "ok" if ok else "failed", outcome, now),
            )  # fmt: skip

    def outcome(self, seq: int, state: RolloutState, ok: bool, detail: str, now: float) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE steps SET outcome = ?, outcome_detail = ?, outcome_at = ? WHERE seq = ?",
                ("ok" if ok else "failed", detail, now, seq),
            )
            self._save(db, state, now)

    def save(self, state: RolloutState, now: float) -> None:
        """Write the engine's state (a batch admitted, a verdict reached, the end)."""
        with self._tx() as db:
            self._save(db, state, now)

    def _save(self, db: sqlite3.Connection, state: RolloutState, now: float) -> None:
        ended = now if state.status.value != "running" else None
        db.execute(
            "UPDATE rollouts SET state = ?, status = ?, reason = ?, ended_at = ? WHERE id = ?",
            (json.dumps(state_to_dict(state)), state.status.value, state.reason, ended, state.id),
        )

    def latest_state(self, rollout_id: str) -> RolloutState:
        row = self.db.execute("SELECT state FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
        if row is None:
            raise JournalError(f"journal {self.path}: no rollout {rollout_id!r}; `fleet history` lists them")
        return state_from_dict(json.loads(row[0]))

    def last_unfinished(self, fleet: str) -> str | None:
        row = self.db.execute(
            "SELECT id FROM rollouts WHERE fleet = ? AND status = 'running' ORDER BY started_at DESC LIMIT 1", (fleet,)
        ).fetchone()
        return row[0] if row else None

    def steps(self, rollout_id: str) -> list[Step]:
        rows = self.db.execute(
            "SELECT seq, rollout_id, at, instance, action, detail, before, outcome, outcome_detail "
            "FROM steps WHERE rollout_id = ? ORDER BY seq",
            (rollout_id,),
        ).fetchall()
        return [Step(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]), r[7], r[8]) for r in rows]

    def history(self, fleet: str | None = None, limit: int = 20) -> list[RolloutRecord]:
        """Rollouts, newest first (``fleet history``)."""
        where, args = ("WHERE fleet = ?", (fleet,)) if fleet else ("", ())
        rows = self.db.execute(
            "SELECT r.id, r.fleet, r.kind, r.started_at, r.ended_at, r.status, r.reason, r.user, r.host, "
            f"(SELECT count(*) FROM steps s WHERE s.rollout_id = r.id) FROM rollouts r {where} "
            "ORDER BY r.started_at DESC, r.rowid DESC LIMIT ?",
            (*args, limit),
        ).fetchall()
        return [RolloutRecord(*r) for r in rows]


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
