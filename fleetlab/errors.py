"""The lab's error type: what is wrong and how to fix it, fit to print as-is."""

from __future__ import annotations

from fleet.errors import FleetError


class LabError(FleetError):
    """A lab operation failed; the message names the problem and the way out."""
