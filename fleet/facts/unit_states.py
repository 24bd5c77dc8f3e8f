"""The state of a host's vLLM units: active or not, and whether a restart is pending.

A deploy writes a unit's files (unit, env file, the release's ``current`` link) atomically and
restarts serving units only after preflight; if it stops in between (a refusal, a failure), the
next run finds the files unchanged yet the processes still old. This fact makes that visible
without any state kept by fleet: an active unit whose ``ActiveEnterTimestamp`` (systemd,
``systemctl show --timestamp=unix``) is older than the newest modification time (``stat -c %Y``,
of the link itself for ``current``) of its files is stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.render.escape import ssh_command


@dataclass(frozen=True)
class UnitState:
    unit: str
    active: bool
    stale: bool  #: active, and its files changed after it started


def unit_states_command(units: Sequence[tuple[str, Sequence[str]]]) -> str:
    parts = []
    for unit, files in units:
        show = ssh_command(["systemctl", "show", "--timestamp=unix", "-p", "ActiveEnterTimestamp", "--value", unit])
        active = ssh_command(["systemctl", "is-active", "--quiet", unit])
        stat = ssh_command(["stat", "-c", "%Y", *files])
        name = ssh_command([unit])
        parts.append(
            f"if {active}; then t=$({show} | tr -d @); m=$({stat} 2>/dev/null | sort -n | tail -1); "
            f'if [ -n "$t" ] && [ -n "$m" ] && [ "$m" -gt "$t" ]; then echo {name} active stale; '
            f"else echo {name} active fresh; fi; else echo {name} inactive fresh; fi"
        )
    return "; ".join(parts) + "; true"


class UnitStates(FactBase[list[UnitState]]):
    """
    Whether each unit is active, and whether its files changed after it started.

    + units: ``(unit, files)`` pairs
    """

    def command(self, units: Sequence[tuple[str, Sequence[str]]]) -> str:
        return unit_states_command(units)

    def process(self, output: list[str]) -> list[UnitState]:
        out = []
        for line in output:
            words = line.split()
            if not words:
                continue
            if len(words) != 3 or words[1] not in ("active", "inactive") or words[2] not in ("stale", "fresh"):
                raise FleetError(f"unit states: unreadable line {line[:200]!r}")
            out.append(UnitState(words[0], words[1] == "active", words[2] == "stale"))
        return out
