"""Reading a host-side script's answer: the last non-empty line of its output.

fleet's probes and listings (the NVML probe, the PCIe ACS probe, the node network probe, the
model copy and cache listings) print one JSON object as their last line; anything before it (a
login banner, a warning from sudo or Python) is not the answer.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any


def answer_line(lines: Sequence[str]) -> str:
    """The last non-empty line of ``lines`` ("" when there is none)."""
    return next((line for line in reversed(lines) if line.strip()), "")


def answer_object(lines: Sequence[str], statuses: Collection[str]) -> dict[str, Any] | str:
    """The answer line as a JSON object whose ``status`` is one of ``statuses``; else why not (a
    short text naming what was printed), for the fact's "bad output" value."""
    text = answer_line(lines)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        return f"not JSON: {text[:120]!r}"
    if not isinstance(raw, dict) or raw.get("status") not in statuses:
        return f"unexpected answer: {text[:120]!r}"
    return raw
