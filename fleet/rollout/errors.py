"""Errors of the rollout engine that operators see (all ``FleetError``)."""

from __future__ import annotations

from dataclasses import dataclass

from fleet.errors import FleetError


@dataclass(frozen=True)
class PolicyProblem:
    """One invalid rollout setting: where it came from, the field, the value and what is allowed."""

    source: str  #: the inventory file, or "command line"
    where: str  #: "group all", "host gpu01", or "--batches"
    field: str
    value: object
    allowed: str

    def __str__(self) -> str:
        return f"{self.source}: {self.where}: {self.field}={self.value!r}: {self.allowed}"


class PolicyError(FleetError):
    """Invalid rollout settings; every problem is listed at once, before any host is touched."""

    def __init__(self, problems: list[PolicyProblem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


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
