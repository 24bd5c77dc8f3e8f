"""The rollout journal and the fleet lock: one interface, two backends (SQLite and PostgreSQL).

Every step is written, with what was there before (release, unit state) and the whole engine
state, and committed durably **before** the step is taken; its outcome is written after. After
a crash, ``latest_state`` gives back what the engine meant to do and the engine re-observes
every instance to see what *is* (the journal is not trusted alone).

``RolloutJournal`` defines the operations once, over SQL both dialects share (``?`` parameters,
``DOUBLE PRECISION`` timestamps, ``INSERT ... RETURNING``); a backend gives the connection, its
transactions and the lock's liveness:

* ``Journal`` (``SqliteJournal``), the embedded default: a file on the control machine, WAL mode
  with ``synchronous=FULL`` (SQLite docs, "PRAGMA synchronous": FULL syncs the WAL at every
  commit), ``BEGIN IMMEDIATE`` for every write;
* ``PostgresJournal`` (``fleet.rollout.journal_pg``): one database a team shares, so any machine
  that reaches it sees, resumes and rolls back every rollout.

One rollout per fleet at a time: a row in ``locks`` with the owner's pid (and that pid's start
time, so a reused pid is not mistaken for the owner), host, user and start time. A lock whose
owner is gone is *stale*: it is shown with its owner and age, and taken over only when asked
(``takeover=True``), never silently. SQLite can tell only for owners on this machine (a lock held
from another machine is treated as live); PostgreSQL binds the lock to the owner's database
session (an advisory lock), so it knows from anywhere, and a dead owner's session releases it.

A rollout whose journaled status is ``running`` but whose owner is gone (killed, a hard abort,
its machine lost, its journal unreachable) is shown as **interrupted**: derived from the lock,
never stored, so the stored status stays ``running`` and ``--resume`` picks it up.

The schema is versioned (``schema_version``): fleet creates it, migrates an older one, and
refuses one a newer fleet wrote. A damaged SQLite file is never changed or "repaired": it is
named with what is wrong and the way out, and ``fleet history`` reads what it still can.
"""

from __future__ import annotations

import difflib
import getpass
import json
import os
import socket
import sqlite3
import time
import tomllib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError

from fleet.facts.drain import MARKER_PRESENT, DrainMarker, parse_marker
from fleet.inventory.schema import JournalSettings, journal_url_problem
from fleet.rollout.engine import Action, RolloutState, state_from_dict, state_to_dict
from fleet.rollout.errors import JournalDamaged, JournalError, LockHeld, NoJournal
from fleet.secrets import REDACTED, SecretRef, parse_secret_ref, redact

#: The step (and its outcome) that records a rollout stopped by a signal before its end.
INTERRUPTED = "interrupted"

#: The schema this fleet writes. 1: the first journal (no ``schema_version`` table); 2: the
#: version table and an index for ``fleet history --fleet``.
SCHEMA_VERSION = 2

#: The tables, in SQL both SQLite and PostgreSQL take. ``{seq}`` is the dialect's
#: auto-increment key; ``"user"`` is quoted (a reserved word in PostgreSQL).
SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    fleet TEXT NOT NULL,
    kind TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    ended_at DOUBLE PRECISION,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    "user" TEXT NOT NULL,
    host TEXT NOT NULL,
    state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    seq {seq},
    rollout_id TEXT NOT NULL REFERENCES rollouts(id),
    at DOUBLE PRECISION NOT NULL,
    instance TEXT,
    action TEXT NOT NULL,
    detail TEXT NOT NULL,
    before TEXT NOT NULL,
    state TEXT NOT NULL,
    outcome TEXT,
    outcome_detail TEXT,
    outcome_at DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS steps_by_rollout ON steps(rollout_id, seq);
CREATE TABLE IF NOT EXISTS locks (
    fleet TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pid_start TEXT NOT NULL,
    host TEXT NOT NULL,
    "user" TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
"""

#: What takes a journal of version ``n`` to ``n + 1`` (run in one transaction, then the version).
MIGRATIONS: Mapping[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
        "CREATE INDEX IF NOT EXISTS rollouts_by_fleet ON rollouts(fleet, started_at)",
    ),
}

#: The journal config file: where a team's shared journal is (``url``, ``password_ref``).
CONFIG_NAME = "journal.toml"


def new_rollout_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{uuid.uuid4().hex[:6]}"


def pid_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); "" if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


# ---- where the journal is --------------------------------------------------------------------------


def default_path() -> Path:
    """The embedded journal: ``$XDG_STATE_HOME/fleet/journal.sqlite`` (``~/.local/state``)."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "fleet" / "journal.sqlite"


def config_path() -> Path:
    """``$FLEET_JOURNAL_CONFIG``, else ``$XDG_CONFIG_HOME/fleet/journal.toml`` (``~/.config``)."""
    if os.environ.get("FLEET_JOURNAL_CONFIG"):
        return Path(os.environ["FLEET_JOURNAL_CONFIG"])
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "fleet" / CONFIG_NAME


@dataclass(frozen=True)
class JournalLocation:
    """Where the journal is and who said so: an SQLite file or a PostgreSQL URL (never a password)."""

    kind: Literal["sqlite", "postgresql"]
    source: str  #: "--journal", "FLEET_JOURNAL", the config file's path, or "default"
    path: Path | None = None
    url: str = ""
    password_ref: SecretRef | None = None

    def __str__(self) -> str:
        return str(self.path) if self.kind == "sqlite" else without_password(self.url)


def is_url(text: str) -> bool:
    return "://" in text


def without_password(url: str) -> str:
    """``url`` as it may be shown: a password in its user part or a ``password=`` parameter is
    replaced by ``<redacted>`` (whatever it looks like), then the usual redaction."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a URL that cannot be parsed>"
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:{REDACTED}@{hostport}"
    query = "&".join(
        f"{kv.split('=', 1)[0]}={REDACTED}" if kv.split("=", 1)[0].lower() == "password" else kv
        for kv in parts.query.split("&")
        if kv
    )
    return redact(urlunsplit(parts._replace(netloc=netloc, query=query)))


def locate(given: str | Path | None = None) -> JournalLocation:
    """The journal to use: ``--journal``, else ``$FLEET_JOURNAL``, else the config file, else the
    embedded default. A value with ``://`` must be a PostgreSQL URL without a password; anything
    else is an SQLite file path. Checked here, before any host is touched."""
    if given is not None and str(given):
        return _location(str(given), "--journal")
    env = os.environ.get("FLEET_JOURNAL")
    if env:
        return _location(env, "FLEET_JOURNAL")
    config = config_path()
    if config.exists():
        return _from_config(config)
    return JournalLocation("sqlite", "default", path=default_path())


def _location(text: str, source: str) -> JournalLocation:
    if not is_url(text):
        return JournalLocation("sqlite", source, path=Path(text))
    problem = journal_url_problem(text)
    if problem:
        raise JournalError(f"{source}={without_password(text)!r}: {problem}")
    return JournalLocation("postgresql", source, url=text)


def _from_config(path: Path) -> JournalLocation:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise JournalError(f"{path}: the journal config cannot be read: {exc}; fix it, or set FLEET_JOURNAL") from None
    try:
        settings = JournalSettings.model_validate(data)
    except ValidationError as exc:

        def why(e: Any) -> str:
            where = ".".join(str(p) for p in e["loc"]) or "-"
            if e["type"] == "extra_forbidden":
                near = difflib.get_close_matches(where, list(JournalSettings.model_fields), n=1)
                return f"{where}: not a journal setting" + (
                    f"; did you mean {near[0]}?" if near else " (url, password_ref)"
                )
            return f"{where}: {e['msg'].removeprefix('Value error, ')}"

        problems = "; ".join(why(e) for e in exc.errors())
        raise JournalError(f"{path}: {redact(problems)}") from None
    ref = parse_secret_ref(settings.password_ref) if settings.password_ref else None
    return JournalLocation("postgresql", str(path), url=settings.url, password_ref=ref)


# ---- records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LockOwner:
    fleet: str
    rollout_id: str
    pid: int
    pid_start: str
    host: str
    user: str
    started_at: float
    #: whether the owner's database session still holds the lock (PostgreSQL); None: not known
    session: bool | None = None

    def alive(self) -> bool | None:
        """True/False when it can be told from here; None when it cannot (another machine's
        process, and a journal that cannot tell either)."""
        if self.session is not None:
            return self.session
        if self.host != socket.gethostname():
            return None
        return pid_start(self.pid) == self.pid_start and self.pid_start != ""

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
    status: str  #: running, interrupted (derived: running with its owner gone), done, halted
    reason: str
    user: str
    host: str
    steps: int  #: -1 when they could not be counted (a damaged journal)


def shown_status(stored: str, rollout_id: str, owner: LockOwner | None) -> str:
    """``interrupted`` for a rollout journaled as running whose owner is gone: no lock names it, or
    the lock's owner is known dead. A lock held from elsewhere that cannot be checked: running."""
    if stored != "running":
        return stored
    if owner is None or owner.rollout_id != rollout_id or owner.alive() is False:
        return "interrupted"
    return stored


T = TypeVar("T")

#: Writes inside one transaction: ``x(sql, args)`` runs a statement and returns its rows.
Exec = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]


class RolloutJournal(ABC):
    """The journal's operations, over SQL both backends share (see the module docstring)."""

    #: where it is, for messages (a path, or a URL without a password)
    location: str
    #: the database itself knows whether a lock's owner lives (PostgreSQL's session-bound lock)
    knows_liveness = False

    # -- the backend's part ------------------------------------------------------------------------------

    @abstractmethod
    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of a read (outside a transaction)."""

    @abstractmethod
    def _tx(self) -> AbstractContextManager[Exec]:
        """A write transaction: committed durably when the block ends, rolled back on an exception."""

    @abstractmethod
    def close(self) -> None: ...

    def _write(self, fn: Callable[[Exec], T]) -> T:
        """``fn``'s statements in one write transaction (a backend may retry it on a new connection)."""
        with self._tx() as x:
            return fn(x)

    def _lock_db(self, fleet: str) -> bool:
        """Take the database's own hold on ``fleet``'s lock; False when a live owner has it."""
        return True

    def _unlock_db(self, fleet: str) -> None:  # noqa: B027  (a backend without its own hold has nothing to do)
        """Give up the database's own hold on ``fleet``'s lock."""

    def _held_elsewhere(self, fleet: str) -> bool | None:
        """Whether a live session other than this one holds ``fleet``'s lock; None: cannot tell."""
        return None

    def _holds(self, fleet: str) -> bool:
        """Whether this journal's own session holds ``fleet``'s lock."""
        return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the schema ------------------------------------------------------------------------------------

    @abstractmethod
    def _schema_version(self) -> int | None:
        """The version the database holds: None for an empty one, 1 for a journal from before the
        version table."""

    def _setup(self, write: bool, seq_column: str) -> None:
        """Check the schema's version; to write, create or migrate it (in one transaction)."""
        version = self._schema_version()
        if version is not None and version > SCHEMA_VERSION:
            raise JournalError(
                f"journal {self.location}: its schema is version {version}, written by a newer fleet (this one "
                f"knows up to version {SCHEMA_VERSION}); fleet does not change it. Upgrade fleet on this machine, "
                "or point --journal / FLEET_JOURNAL at another journal"
            )
        if not write and version is None:
            raise NoJournal(f"no journal in {self.location} yet: no rollout has written to it")
        if not write or version == SCHEMA_VERSION:
            return
        with self._tx() as x:
            version = self._schema_version()  # again, inside the transaction: another fleet may have won
            if version == SCHEMA_VERSION:
                return
            if version is None:
                for statement in _statements(SCHEMA.format(seq=seq_column)):
                    x(statement, ())
            else:
                for v in range(version, SCHEMA_VERSION):
                    for statement in MIGRATIONS[v]:
                        x(statement, ())
            x("DELETE FROM schema_version", ())
            x("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))

    # -- the lock ------------------------------------------------------------------------------------

    def lock_owner(self, fleet: str) -> LockOwner | None:
        rows = self._query(
            'SELECT fleet, rollout_id, pid, pid_start, host, "user", started_at FROM locks WHERE fleet = ?', (fleet,)
        )
        if not rows:
            return None
        owner = LockOwner(*rows[0])
        if self.knows_liveness:
            owner = replace(owner, session=bool(self._held_elsewhere(fleet)) or self._holds(fleet))
        return owner

    def _mine(self, owner: LockOwner) -> bool:
        me = os.getpid()
        return owner.pid == me and owner.pid_start == pid_start(me) and owner.host == socket.gethostname()

    def acquire(self, fleet: str, rollout_id: str, *, takeover: bool = False, now: float | None = None) -> LockOwner:
        """Take the fleet's lock for ``rollout_id``, or raise ``LockHeld`` naming the owner and its age.

        A stale lock (its owner is gone) is taken over only with ``takeover=True``; a lock held by
        this very process for the same rollout is kept (re-entrant, for ``--resume`` in-process).
        """
        now = time.time() if now is None else now
        me = LockOwner(fleet, rollout_id, os.getpid(), pid_start(os.getpid()), socket.gethostname(), _user(), now)
        if not self._lock_db(fleet):
            owner = self.lock_owner(fleet)
            who = owner.describe(now) if owner is not None else "another fleet process (no owner recorded yet)"
            resume = f"fleet rollout --resume {owner.rollout_id} --take-over" if owner else "try again"
            raise LockHeld(
                f"fleet {fleet} is locked by {who}; its database session is open, so it is running. Wait for it, "
                f"or if its machine is gone, the database ends that session within a minute; then: {resume}",
                owner,
            )
        try:
            with self._tx() as x:
                rows = x(
                    'SELECT fleet, rollout_id, pid, pid_start, host, "user", started_at FROM locks WHERE fleet = ?',
                    (fleet,),
                )
                owner = LockOwner(*rows[0]) if rows else None
                if owner is not None and not self._mine(owner):
                    # With the database's own hold taken, a recorded owner is one whose session ended.
                    alive = False if self.knows_liveness else owner.alive()
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
                x("DELETE FROM locks WHERE fleet = ?", (fleet,))
                x(
                    'INSERT INTO locks (fleet, rollout_id, pid, pid_start, host, "user", started_at) '
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (me.fleet, me.rollout_id, me.pid, me.pid_start, me.host, me.user, me.started_at),
                )
        except BaseException:
            self._unlock_db(fleet)
            raise
        return me

    def release(self, fleet: str, rollout_id: str) -> None:
        try:
            self._write(
                lambda x: x(
                    "DELETE FROM locks WHERE fleet = ? AND rollout_id = ? AND pid = ?", (fleet, rollout_id, os.getpid())
                )
            )
        finally:
            self._unlock_db(fleet)

    # -- rollouts and steps ----------------------------------------------------------------------------

    def begin(self, state: RolloutState) -> None:
        """Write a new rollout (its plan and policy) before anything is touched."""
        row = (
            state.id,
            state.fleet,
            state.kind,
            state.started_at,
            state.status.value,
            _user(),
            socket.gethostname(),
            json.dumps(state_to_dict(state)),
        )
        self._write(
            lambda x: x('INSERT INTO rollouts (id, fleet, kind, started_at, status, "user", host, state) '
                        "VALUES (?,?,?,?,?,?,?,?)", row)
        )  # fmt: skip

    def intent(self, state: RolloutState, action: Action, before: Mapping[str, Any], now: float) -> int:
        """Durably record a step before it is taken; returns its sequence number."""
        saved = json.dumps(state_to_dict(state))
        step = (
            state.id,
            now,
            str(action.ref) if action.ref else None,
            action.kind.value + (f":{action.hook or action.lb_state}" if action.hook or action.lb_state else ""),
            str(action),
            json.dumps(dict(before)),
            saved,
        )

        def write(x: Exec) -> int:
            rows = x(
                "INSERT INTO steps (rollout_id, at, instance, action, detail, before, state) "
                "VALUES (?,?,?,?,?,?,?) RETURNING seq",
                step,
            )
            x("UPDATE rollouts SET state = ? WHERE id = ?", (saved, state.id))
            return int(rows[0][0])

        return self._write(write)

    def record(
        self, state: RolloutState, what: str, detail: str, ok: bool, outcome: str, now: float, host: str | None = None
    ) -> None:
        """A step taken around the engine (``fleet drain`` writing a host's marker, enabling units),
        written with its outcome at once: ``what`` is its name in ``fleet history ID``."""
        row = (state.id, now, host, what, detail, "{}", json.dumps(state_to_dict(state)), "ok" if ok else "failed",
               outcome, now)  # fmt: skip
        self._write(
            lambda x: x("INSERT INTO steps (rollout_id, at, instance, action, detail, before, state, outcome, "
                        "outcome_detail, outcome_at) VALUES (?,?,?,?,?,?,?,?,?,?)", row)
        )  # fmt: skip

    def note(self, state: RolloutState, what: str, detail: str, now: float, host: str | None = None) -> int:
        """A step taken around the engine (``fleet gpu clear``), written durably **before** it is
        taken, its outcome left open (``outcome`` records it), with ``state`` (its status and
        reason) in the same transaction; returns its sequence number."""
        row = (state.id, now, host, what, detail, "{}", json.dumps(state_to_dict(state)))

        def write(x: Exec) -> int:
            rows = x(
                "INSERT INTO steps (rollout_id, at, instance, action, detail, before, state) "
                "VALUES (?,?,?,?,?,?,?) RETURNING seq",
                row,
            )
            self._save(x, state, now)
            return int(rows[0][0])

        return self._write(write)

    def drained_hosts(self, fleet: str) -> dict[str, DrainMarker]:
        """The hosts of ``fleet`` whose last marker step in this journal wrote a drain marker (a
        ``fleet drain``), not removed since (``fleet undrain``): what was written, by host."""
        rows = self._query(
            "SELECT s.instance, s.action, s.outcome_detail FROM steps s JOIN rollouts r ON r.id = s.rollout_id "
            "WHERE r.fleet = ? AND s.action IN ('marker:drained', 'marker:removed') AND s.outcome = 'ok' "
            "ORDER BY s.at, s.seq",
            (fleet,),
        )
        last: dict[str, tuple[str, str]] = {}
        for host, action, detail in rows:
            last[str(host)] = (str(action), str(detail or ""))
        out = {}
        for host, (action, detail) in last.items():
            marker = parse_marker([MARKER_PRESENT, detail]) if action == "marker:drained" else None
            if marker is not None and not marker.unreadable:
                out[host] = marker
        return out

    def outcome(self, seq: int, state: RolloutState, ok: bool, detail: str, now: float) -> None:
        def write(x: Exec) -> None:
            x(
                "UPDATE steps SET outcome = ?, outcome_detail = ?, outcome_at = ? WHERE seq = ?",
                ("ok" if ok else "failed", detail, now, seq),
            )
            self._save(x, state, now)

        self._write(write)

    def interrupted(self, state: RolloutState, detail: str, now: float) -> None:
        """Record that this process stopped the rollout before its end (Ctrl-C, SIGTERM): a step
        ``interrupted`` (no instance) saying how and what it left, and the state as it was. The
        status stays ``running``: ``fleet rollout --resume ID`` picks it up from here."""
        row = (state.id, now, None, INTERRUPTED, detail, "{}", json.dumps(state_to_dict(state)), INTERRUPTED, detail,
               now)  # fmt: skip

        def write(x: Exec) -> None:
            x(
                "INSERT INTO steps (rollout_id, at, instance, action, detail, before, state, outcome, outcome_detail, "
                "outcome_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                row,
            )
            self._save(x, state, now)

        self._write(write)

    def save(self, state: RolloutState, now: float) -> None:
        """Write the engine's state (a batch admitted, a verdict reached, the end)."""
        self._write(lambda x: self._save(x, state, now))

    def _save(self, x: Exec, state: RolloutState, now: float) -> None:
        ended = now if state.status.value != "running" else None
        x(
            "UPDATE rollouts SET state = ?, status = ?, reason = ?, ended_at = ? WHERE id = ?",
            (json.dumps(state_to_dict(state)), state.status.value, state.reason, ended, state.id),
        )

    def latest_state(self, rollout_id: str) -> RolloutState:
        rows = self._query("SELECT state FROM rollouts WHERE id = ?", (rollout_id,))
        if not rows:
            raise JournalError(f"journal {self.location}: no rollout {rollout_id!r}; `fleet history` lists them")
        return state_from_dict(json.loads(rows[0][0]))

    def last_unfinished(self, fleet: str) -> str | None:
        rows = self._query(
            "SELECT id FROM rollouts WHERE fleet = ? AND status = 'running' ORDER BY started_at DESC LIMIT 1", (fleet,)
        )
        return str(rows[0][0]) if rows else None

    def steps(self, rollout_id: str) -> list[Step]:
        rows = self._query(
            "SELECT seq, rollout_id, at, instance, action, detail, before, outcome, outcome_detail "
            "FROM steps WHERE rollout_id = ? ORDER BY seq",
            (rollout_id,),
        )
        return [_step(r) for r in rows]

    def history(self, fleet: str | None = None, limit: int = 20) -> list[RolloutRecord]:
        """Rollouts, newest first (``fleet history``); a running one whose owner is gone is
        ``interrupted`` (``shown_status``)."""
        where, args = ("WHERE fleet = ?", (fleet,)) if fleet else ("", ())
        rows = self._query(
            'SELECT r.id, r.fleet, r.kind, r.started_at, r.ended_at, r.status, r.reason, r."user", r.host, '
            f"(SELECT count(*) FROM steps s WHERE s.rollout_id = r.id) FROM rollouts r {where} "
            "ORDER BY r.started_at DESC, r.id DESC LIMIT ?",
            (*args, limit),
        )
        return self._derive([RolloutRecord(*r) for r in rows])

    def _derive(self, records: list[RolloutRecord]) -> list[RolloutRecord]:
        owners: dict[str, LockOwner | None] = {}
        out = []
        for r in records:
            if r.status == "running":
                if r.fleet not in owners:
                    owners[r.fleet] = self.lock_owner(r.fleet)
                status = shown_status(r.status, r.id, owners[r.fleet])
                if status == "interrupted" and not r.reason:
                    r = replace(
                        r, reason=f"its process is gone; resume with: fleet rollout --resume {r.id} --take-over"
                    )
                r = replace(r, status=status)
            out.append(r)
        return out


def _step(r: Sequence[Any]) -> Step:
    return Step(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]), r[7], r[8])


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


# ---- SQLite ----------------------------------------------------------------------------------------


class Journal(RolloutJournal):
    """The embedded journal: an SQLite file on the control machine (private: 0600 in a 0700 dir).

    ``write=False`` (``fleet history``) neither creates nor migrates anything. A file that is
    not SQLite, or an SQLite file that is damaged, raises ``JournalDamaged`` naming it; it is
    never changed. ``Journal.salvage(path)`` opens a damaged one read-only for what it still holds.
    """

    def __init__(self, path: str | Path, *, write: bool = True, _readonly: bool = False) -> None:
        self.path = Path(path)
        self.location = str(self.path)
        self.lost: list[str] = []  #: what a salvage could not read
        self._readonly = _readonly
        self.salvaging = _readonly  #: reading a damaged file: row by row, noting what is lost
        if self.path.is_dir():
            raise JournalError(
                f"journal {self.path} is a directory, not a journal file: point --journal or FLEET_JOURNAL at a file"
            )
        with self._errors("open"):
            if _readonly:
                self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30, isolation_level=None)
            else:
                if write:
                    self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                elif not self.path.exists():
                    raise NoJournal(f"no journal at {self.path}: no rollout has run with it (or pass --journal)")
                fresh = not self.path.exists()
                self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
                if fresh:
                    os.chmod(self.path, 0o600)
                if write and not fresh:
                    self._check_whole()
                if write:  # a reader changes nothing in the file, not even its journal mode
                    self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=FULL")
                self.db.execute("PRAGMA foreign_keys=ON")
        if not _readonly:
            try:
                self._setup(write, "INTEGER PRIMARY KEY AUTOINCREMENT")
            except BaseException:
                self.db.close()
                raise

    def _check_whole(self) -> None:
        """Before writing: SQLite's ``PRAGMA quick_check`` (every page and b-tree of the file, no
        index contents): a damaged journal is refused before any host is touched, never written to."""
        rows = self.db.execute("PRAGMA quick_check(5)").fetchall()
        if rows != [("ok",)]:
            self.db.close()
            found = "; ".join(str(r[0]) for r in rows)
            raise sqlite_error(self.path, "check", sqlite3.DatabaseError(f"database disk image is malformed: {found}"))

    @classmethod
    def salvage(cls, path: str | Path) -> Journal:
        """A damaged journal, read-only: ``history``/``steps``/``latest_state`` return what can be
        read and note the rest in ``lost``; nothing is ever written to it."""
        return cls(path, write=False, _readonly=True)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError):
            raise  # fleet's own mistake (a duplicate id, a bad statement): a bug, not the file's
        except sqlite3.DatabaseError as exc:
            raise sqlite_error(self.path, doing, exc) from None

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._errors("read"):
            return self.db.execute(sql, tuple(args)).fetchall()

    @contextmanager
    def _tx(self) -> Iterator[Exec]:
        def x(sql: str, args: Sequence[Any]) -> list[tuple[Any, ...]]:
            return self.db.execute(sql, tuple(args)).fetchall()

        with self._errors("write"):
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield x
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def _schema_version(self) -> int | None:
        names = {r[0] for r in self._query("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "schema_version" in names:
            rows = self._query("SELECT max(version) FROM schema_version")
            if rows and rows[0][0] is not None:
                return int(rows[0][0])
        return 1 if "rollouts" in names else None

    # -- reading a damaged file: what can be read, row by row ------------------------------------------

    def history(self, fleet: str | None = None, limit: int = 20) -> list[RolloutRecord]:
        if not self._readonly:
            return super().history(fleet, limit)
        try:
            return super().history(fleet, limit)
        except JournalDamaged:
            pass
        records = []
        for rowid in self._rowids("rollouts", "SELECT max(rowid) FROM rollouts"):
            try:
                rows = self.db.execute(
                    'SELECT id, fleet, kind, started_at, ended_at, status, reason, "user", host FROM rollouts '
                    "WHERE rowid = ?",
                    (rowid,),
                ).fetchall()
            except sqlite3.DatabaseError:
                self.lost.append(f"rollout row {rowid}")
                continue
            if not rows or (fleet and rows[0][1] != fleet):
                continue
            try:
                count = int(
                    self.db.execute("SELECT count(*) FROM steps WHERE rollout_id = ?", (rows[0][0],)).fetchone()[0]
                )
            except sqlite3.DatabaseError:
                count = -1
            r = rows[0]
            records.append(RolloutRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], count))
        records.sort(key=lambda r: (r.started_at, r.id), reverse=True)
        try:
            return self._derive(records[:limit])
        except JournalDamaged:
            self.lost.append("the lock table (running rollouts are shown as journaled)")
            return records[:limit]

    def latest_state(self, rollout_id: str) -> RolloutState:
        if not self._readonly:
            return super().latest_state(rollout_id)
        try:
            return super().latest_state(rollout_id)
        except JournalDamaged:
            pass
        for rowid in self._rowids("rollouts", "SELECT max(rowid) FROM rollouts"):
            try:
                rows = self.db.execute("SELECT id, state FROM rollouts WHERE rowid = ?", (rowid,)).fetchall()
            except sqlite3.DatabaseError:
                continue
            if rows and rows[0][0] == rollout_id:
                return state_from_dict(json.loads(rows[0][1]))
        raise JournalDamaged(f"journal {self.path}: rollout {rollout_id!r} cannot be read", salvageable=True)

    def steps(self, rollout_id: str) -> list[Step]:
        if not self._readonly:
            return super().steps(rollout_id)
        try:
            return super().steps(rollout_id)
        except JournalDamaged:
            pass
        found = []
        for seq in self._rowids("steps", "SELECT seq FROM sqlite_sequence WHERE name = 'steps'"):
            try:
                rows = self.db.execute(
                    "SELECT seq, rollout_id, at, instance, action, detail, before, outcome, outcome_detail "
                    "FROM steps WHERE seq = ?",
                    (seq,),
                ).fetchall()
            except sqlite3.DatabaseError:
                self.lost.append(f"step {seq}")
                continue
            if rows and rows[0][1] == rollout_id:
                found.append(_step(rows[0]))
        return found

    def _rowids(self, table: str, max_sql: str) -> range:
        try:
            top = self.db.execute(max_sql).fetchone()
            last = int(top[0]) if top and top[0] is not None else 0
        except sqlite3.DatabaseError:
            last = 100_000  # cannot tell: look that far
            self.lost.append(f"the number of rows of {table} (looked at the first {last})")
        return range(1, last + 1)


SqliteJournal = Journal


def sqlite_error(path: Path, doing: str, exc: sqlite3.DatabaseError) -> JournalError:
    """An SQLite error as an operator reads it: the file, what is wrong, what to do."""
    text = str(exc)
    keep = (
        "fleet did not change it: keep it for inspection, and point --journal or FLEET_JOURNAL at another "
        "file to run rollouts (a new journal is made there)"
    )
    if "not a database" in text:
        return JournalDamaged(f"journal {path} is not an SQLite database ({text}); {keep}", salvageable=False)
    if "malformed" in text or type(exc) is sqlite3.DatabaseError:
        return JournalDamaged(
            f"journal {path} is damaged ({text}); {keep}. `fleet history --journal {path}` shows what it still holds",
            salvageable=True,
        )
    if "locked" in text or "busy" in text:
        return JournalError(
            f"journal {path}: another fleet process kept it busy for 30s ({text}) while this one tried to {doing}; "
            "try again"
        )
    if "readonly" in text or "unable to open" in text:
        return JournalError(
            f"journal {path}: cannot {doing} it ({text}): check that this user may write it and its directory, "
            "or point --journal or FLEET_JOURNAL elsewhere"
        )
    return JournalError(f"journal {path}: cannot {doing} it: {text} (disk full or failing?); fleet did not change it")
