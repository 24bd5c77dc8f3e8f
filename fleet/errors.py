"""Errors that ``fleet`` shows to operators.

Every error names where the problem is (file, host, field), the value that is wrong, and the
way out. They are raised before any host is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.secrets import Redacted, looks_like_secret, redact, shown


class FleetError(Exception):
    """Base class: an error with a message fit for a person at 3 a.m."""


@dataclass
class FieldProblem:
    """One invalid value in an inventory.

    ``inventory`` is the file where the value is written (a ``group_data`` file when it came
    from there), ``line`` its line when known. A value that is, or looks like, a secret is
    replaced by a ``Redacted`` marker on construction, so no copy of it is kept in the error.
    """

    inventory: str
    host: str
    field: str
    value: object
    allowed: str
    secret: bool = False
    line: int | None = None

    def __post_init__(self) -> None:
        if self.secret or looks_like_secret(self.value):
            self.value = Redacted()
            self.secret = True

    @property
    def where(self) -> str:
        return f"{self.inventory}:{self.line}" if self.line else self.inventory

    def __str__(self) -> str:
        parts = [self.where]
        if self.host != "-":
            parts.append(f"host {self.host}")
        if self.field:
            fld = self.field if self.field.isprintable() else repr(self.field)
            parts.append(f"{fld}={shown(self.value)}")
        parts.append(self.allowed)
        return redact(": ".join(parts))

    def data(self) -> dict[str, object]:
        """For ``--json``: every part as text, redacted."""
        return {
            "file": self.inventory,
            "line": self.line,
            "host": redact(self.host),
            "field": redact(self.field if self.field.isprintable() else repr(self.field)),
            "value": shown(self.value),
            "allowed": redact(self.allowed),
        }


class InventoryError(FleetError):
    """One or more invalid values in an inventory; all of them are listed at once."""

    def __init__(self, problems: list[FieldProblem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass
class PlanProblem:
    """Why a host has no valid serving plan: the numbers and the ways out."""

    host: str
    summary: str
    details: list[str] = field(default_factory=list)
    ways_out: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"host {self.host}: {self.summary}"]
        lines += [f"  {d}" for d in self.details]
        if self.ways_out:
            lines.append("  ways out:")
            lines += [f"    - {w}" for w in self.ways_out]
        return "\n".join(lines)


class PlanError(FleetError):
    def __init__(self, problem: PlanProblem):
        self.problem = problem
        super().__init__(str(problem))


class ModelConfigError(FleetError):
    """A model's config.json is missing or unreadable."""


class RenderError(FleetError):
    """A value cannot be written safely where it lands (a unit file, an env file, a path).

    Validation at the input boundary makes this unreachable from an inventory; reaching it
    means a bug, so the CLI reports it as an internal error.
    """
