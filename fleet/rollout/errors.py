"""Errors of the rollout engine that operators see (all ``FleetError``)."""

from __future__ import annotations

from fleet.errors import FleetError
from fleet.inventory.policy import PolicyError as PolicyError
from fleet.inventory.policy import PolicyProblem as PolicyProblem


class LockHeld(FleetError):
    """Another rollout of this fleet is running (or died holding the lock)."""

    def __init__(self, message: str, owner: object) -> None:
        self.owner = owner
        super().__init__(message)


class JournalError(FleetError):
    """The journal cannot be read or written, or names a rollout that does not exist."""


class JournalDamaged(JournalError):
    """The journal file is not SQLite, or is damaged: named, never changed; read what can be read."""

    def __init__(self, message: str, *, salvageable: bool) -> None:
        self.salvageable = salvageable  #: an SQLite file whose readable rows can still be read
        super().__init__(message)


class JournalUnavailable(JournalError):
    """The shared journal's database cannot be reached, refuses the credentials, or went away."""


class NoJournal(JournalError):
    """There is no journal where one was looked for (nothing has run against it yet)."""
