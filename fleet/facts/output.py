"""Reading a host-side script's answer: the last non-empty line of its output.

fleet's probes and listings (the NVML probe, the PCIe ACS probe, the node network probe, the
model copy and cache listings) print one JSON object as their last line; anything before it (a
login banner, a warning from sudo or Python) is not the answer.
"""

from __future__ import annotations

from collections.abc import Sequence


def answer_line(lines: Sequence[str]) -> str:
    """The last non-empty line of ``lines`` ("" when there is none)."""
    return next((line for line in reversed(lines) if line.strip()), "")
