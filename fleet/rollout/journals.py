"""Opening the journal a location names: the embedded SQLite file (``fleet.rollout.journal``) or a
shared PostgreSQL database (``fleet.rollout.journal_pg``); both backends are below this module."""

from __future__ import annotations

from pathlib import Path

from fleet.rollout.journal import Journal, JournalLocation, RolloutJournal, locate
from fleet.rollout.journal_pg import PostgresJournal


def open_journal(where: str | Path | JournalLocation | None = None, *, write: bool = True) -> RolloutJournal:
    """The journal ``where`` names (``locate`` rules), opened, its schema checked (and, to write,
    created or migrated). ``JournalError`` (a ``FleetError``) for every way it cannot be."""
    loc = where if isinstance(where, JournalLocation) else locate(where)
    if loc.kind == "postgresql":
        return PostgresJournal(loc, write=write)
    assert loc.path is not None
    return Journal(loc.path, write=write)
