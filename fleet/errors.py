"""Errors that ``fleet`` shows to operators.

Every error names where the problem is (file, host, field), the value that is wrong, and the
way out. They are raised before any host is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class FleetError(Exception):
    """Base class: an error with a message fit for a person at 3 a.m."""


@dataclass
class FieldProblem:
    """One invalid value in an inventory."""

    inventory: str
    host: str
    field: str
    value: object
    allowed: str

    def __str__(self) -> str:
        return f"{self.inventory}: host {self.host}: {self.field}={self.value!r}: {self.allowed}"


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
