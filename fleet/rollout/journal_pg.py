"""The shared journal: the same tables and operations as the SQLite journal, in PostgreSQL.

Chosen with ``FLEET_JOURNAL=postgresql://...``, ``--journal postgresql://...`` or the journal
config file (``~/.config/fleet/journal.toml``: ``url``, ``password_ref``). The URL carries no
password: libpq reads it from ``~/.pgpass`` / ``PGPASSFILE`` or a service file
(``PGSERVICEFILE``; "The Password File" and "The Connection Service File", PostgreSQL 15 docs
34.16 and 34.17), or fleet reads ``password_ref`` (``env:NAME`` / ``file:/path``) and hands it to
libpq as a connection parameter (never in argv, never shown).

Driver: psycopg 3 (``psycopg``, the pure-Python package) over the system's libpq (Debian's
``libpq5``), loaded only when a PostgreSQL journal is configured, so the embedded default needs
neither.

Guarantees, as with SQLite: every write is one transaction committed before the step is taken,
with ``synchronous_commit = on`` set for the session (PostgreSQL 15 docs 20.5.1: the commit
returns once its WAL is flushed to durable storage, and, where the server has synchronous
standbys, once they confirmed it).

The lock: the ``locks`` row says who holds it (rollout, pid, machine, user, since when), and a
session-level advisory lock (``pg_try_advisory_lock``, docs 9.27.10) on a key derived from the
fleet's name says whether that owner still lives: the server releases it when the owner's
session ends, so a killed fleet process frees it at once and a machine that vanished frees it
once the server's TCP keepalives (set for the session: 10 s idle, 3 probes 5 s apart) give up.
A lock row without its advisory lock is stale, and ``--take-over`` takes it from any machine.

A connection that breaks while writing is opened again once (a failover to a standby that took
the address); the advisory lock is taken again and the lock row must still name this process,
else the rollout stops there (nothing more is done without a journal) and says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, TypeVar, cast

from fleet.rollout.errors import JournalError, JournalUnavailable
from fleet.rollout.journal import Exec, JournalLocation, RolloutJournal
from fleet.secret_store import read_secret

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")

#: libpq connection parameters fleet sets (libpq docs 34.1.2): a bounded connect, TCP keepalives
#: and a bound on unacknowledged data, so a server that vanished is noticed within ~30 s.
CONNECT = {
    "connect_timeout": 10,
    "application_name": "fleet",
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
#: Session settings: durable commits; the server's keepalives, so a dead client's session (and
#: its advisory lock) ends within ~25 s.
SESSION = (
    "SET synchronous_commit = on",
    "SET tcp_keepalives_idle = 10",
    "SET tcp_keepalives_interval = 5",
    "SET tcp_keepalives_count = 3",
)
SEQ_COLUMN = "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY"


def advisory_key(name: str) -> int:
    """A signed 64-bit advisory-lock key for ``name`` (its SHA-256, first 8 bytes)."""
    return int.from_bytes(hashlib.sha256(b"fleet lock\0" + name.encode()).digest()[:8], "big", signed=True)


MIGRATE_KEY = advisory_key("fleet journal schema")


def _driver() -> Any:
    try:
        import psycopg
    except ImportError as exc:  # psycopg installed, libpq missing: "no pq wrapper available"
        raise JournalUnavailable(
            f"a PostgreSQL journal needs libpq on this machine ({exc}): install it (Debian/Ubuntu: apt install libpq5)"
        ) from None
    return psycopg


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:400] or type(exc).__name__


class PostgresJournal(RolloutJournal):
    knows_liveness = True

    def __init__(self, loc: JournalLocation, *, write: bool = True) -> None:
        self.loc = loc
        self.location = str(loc)
        self._psycopg = _driver()
        self._held: set[str] = set()
        self._sql: dict[str, str] = {}
        self.conn = self._connect()
        try:
            self._setup(write, SEQ_COLUMN)
        except BaseException:
            self.conn.close()
            raise

    # -- connecting ------------------------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        params: dict[str, Any] = dict(CONNECT)
        if self.loc.password_ref is not None:
            params["password"] = read_secret(self.loc.password_ref, field=f"{self.loc.source}: password_ref")
        try:
            conn = self._psycopg.connect(self.loc.url, autocommit=True, **params)
        except self._psycopg.Error as exc:
            raise self._connect_error(exc) from None
        try:
            for statement in SESSION:
                conn.execute(statement)
        except self._psycopg.Error as exc:
            conn.close()
            raise JournalUnavailable(f"journal {self.location}: {_first_line(exc)}") from None
        return cast("psycopg.Connection[Any]", conn)

    def _connect_error(self, exc: BaseException) -> JournalError:
        why = _first_line(exc)
        where = f"journal {self.location} (from {self.loc.source})"
        low = why.lower()
        if "password" in low or "authentication" in low:
            ref = f"password_ref {self.loc.password_ref}" if self.loc.password_ref else "~/.pgpass (or PGPASSFILE)"
            return JournalUnavailable(
                f"{where}: the database refused the credentials ({why}). Check the user in the URL and the password "
                f"in {ref} or the libpq service file; nothing was touched"
            )
        if "does not exist" in low:
            return JournalUnavailable(
                f"{where}: {why}. Create the database and grant this user access (docs/rollout.md, 'A shared "
                "journal'); nothing was touched"
            )
        return JournalUnavailable(
            f"{where}: cannot reach the database ({why}). Check the host and port in the URL and that the server "
            "runs and accepts connections from this machine; nothing was touched"
        )

    def close(self) -> None:
        self._held.clear()
        self.conn.close()  # the session ends: the server releases its advisory locks

    # -- statements ------------------------------------------------------------------------------------

    def _pg(self, sql: str) -> str:
        """The shared SQL's ``?`` parameters in psycopg's ``%s`` form (the shared SQL has no ``%``)."""
        if sql not in self._sql:
            self._sql[sql] = sql.replace("?", "%s")
        return self._sql[sql]

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except (self._psycopg.OperationalError, self._psycopg.InterfaceError) as exc:
            raise JournalUnavailable(
                f"journal {self.location}: the database went away while fleet tried to {doing} ({_first_line(exc)})"
            ) from None
        except self._psycopg.errors.InsufficientPrivilege as exc:
            raise JournalError(
                f"journal {self.location}: this database user may not {doing} the journal ({_first_line(exc)}); "
                "grant it the rights docs/rollout.md lists ('A shared journal')"
            ) from None

    def _run(self, sql: str, args: Sequence[Any]) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(self._pg(sql), tuple(args))
        return list(cur.fetchall()) if cur.description else []

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._errors("read"):
            return self._run(sql, args)

    @contextmanager
    def _tx(self) -> Iterator[Exec]:
        with self._errors("write"), self.conn.transaction():
            yield self._run

    def _write(self, fn: Callable[[Exec], T]) -> T:
        """``fn`` in one transaction; a connection lost on the way is opened again once (a failover),
        the lock taken again and checked to be still this process's, and ``fn`` run again."""
        try:
            return super()._write(fn)
        except JournalUnavailable as lost:
            if not self.conn.closed and not self.conn.broken:
                raise
            try:
                self._reconnect()
            except JournalError as again:
                raise JournalUnavailable(f"{lost}; connecting again failed: {again}") from None
            return super()._write(fn)

    def _reconnect(self) -> None:
        held = sorted(self._held)
        self._held.clear()
        self.conn.close()
        self.conn = self._connect()
        for fleet in held:
            if not self._lock_db(fleet):
                raise JournalUnavailable(f"journal {self.location}: fleet {fleet}'s lock was taken by another session")
            owner = super().lock_owner(fleet)
            if owner is None or not self._mine(owner):
                raise JournalUnavailable(
                    f"journal {self.location}: fleet {fleet}'s lock no longer names this process "
                    f"({owner.describe() if owner else 'no owner'})"
                )

    # -- the schema ------------------------------------------------------------------------------------

    def _schema_version(self) -> int | None:
        rows = self._query("SELECT to_regclass('schema_version') IS NOT NULL, to_regclass('rollouts') IS NOT NULL")
        has_version, has_rollouts = rows[0]
        if has_version:
            top = self._query("SELECT max(version) FROM schema_version")
            if top and top[0][0] is not None:
                return int(top[0][0])
        return 1 if has_rollouts else None

    def _setup(self, write: bool, seq_column: str) -> None:
        if not write:
            super()._setup(write, seq_column)
            return
        self._query("SELECT pg_advisory_lock(?)", (MIGRATE_KEY,))  # one fleet creates or migrates at a time
        try:
            super()._setup(write, seq_column)
        finally:
            self._query("SELECT pg_advisory_unlock(?)", (MIGRATE_KEY,))

    # -- the lock's liveness: a session-level advisory lock --------------------------------------------

    def _lock_db(self, fleet: str) -> bool:
        if fleet in self._held:
            return True
        got = bool(self._query("SELECT pg_try_advisory_lock(?)", (advisory_key(fleet),))[0][0])
        if got:
            self._held.add(fleet)
        return got

    def _unlock_db(self, fleet: str) -> None:
        if fleet not in self._held:
            return
        self._held.discard(fleet)
        with suppress(JournalError):  # the session is gone, and its lock with it
            self._query("SELECT pg_advisory_unlock(?)", (advisory_key(fleet),))

    def _holds(self, fleet: str) -> bool:
        return fleet in self._held

    def _held_elsewhere(self, fleet: str) -> bool | None:
        if fleet in self._held:
            return False
        key = advisory_key(fleet)
        if self._query("SELECT pg_try_advisory_lock(?)", (key,))[0][0]:
            self._query("SELECT pg_advisory_unlock(?)", (key,))
            return False
        return True
