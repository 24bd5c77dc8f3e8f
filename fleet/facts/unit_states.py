"""The state of a host's vLLM units: active or not, and whether a restart is pending.

A deploy writes a unit's files (unit, env file) atomically and restarts serving units only after
preflight; if it stops in between (a refusal, a failure), the next run finds the files unchanged
yet the processes still old. This fact makes that visible without any state kept by fleet: an
active unit whose ``ActiveEnterTimestamp`` (systemd, ``systemctl show --timestamp=unix``) is older
than the newest modification time (``stat -c %Y``, of a link itself) of the files given is stale.
(``fleet deploy`` gives each unit its unit and env file; the host's ``current`` link is not one
instance's file, and the release each instance runs is read from its process instead:
``fleet.facts.releases``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.systemctl_show import show_blocks, show_int, shown_unit, started_unix

_PROPS = "Id,ActiveState,ActiveEnterTimestamp,ActiveEnterTimestampMonotonic"


@dataclass(frozen=True)
class UnitState:
    unit: str
    active: bool
    stale: bool  #: active, and its files changed after it started


def unit_states_command(units: Sequence[tuple[str, Sequence[str]]]) -> str:
    """Per unit: ``begin <unit>``, its ``systemctl show`` lines, the newest file mtime, ``end``;
    the host's clocks first (for systemd without ``--timestamp=unix``)."""
    parts = ['echo "now $(date +%s.%N) $(cut -d" " -f1 /proc/uptime)"']
    for unit, files in units:
        show = ["systemctl", "show", "-p", _PROPS, "--", unit]
        unix = ssh_command([*show[:2], "--timestamp=unix", *show[2:]])
        stat = ssh_command(["stat", "-c", "%Y", *files])
        parts.append(
            f"echo begin {ssh_command([unit])}; {{ {unix} 2>/dev/null || {ssh_command(show)}; }}; "
            f'echo "mtime $({stat} 2>/dev/null | sort -n | tail -1)"; echo end'
        )
    return "; ".join(parts) + "; true"


def unit_states(output: Sequence[str]) -> list[UnitState]:
    """The command's output -> one ``UnitState`` per unit (pure); garbage is an error."""
    out: list[UnitState] = []
    now_unix = now_mono = None
    unit: str | None = None
    lines: list[str] = []
    mtime: int | None = None
    for line in output:
        word, _, rest = line.partition(" ")
        if unit is None:
            if word == "now":
                clocks = rest.split()
                try:
                    now_unix, now_mono = float(clocks[0]), float(clocks[1])
                except (IndexError, ValueError):
                    now_unix = now_mono = None
            elif word == "begin" and rest:
                unit, lines, mtime = rest, [], None
            elif line.strip():
                raise FleetError(f"unit states: unreadable line {line[:200]!r}")
        elif line == "end":
            props = show_blocks(lines)
            shown = shown_unit(props[0]) if props else None
            if shown is None:
                raise FleetError(f"unit states: systemctl show said nothing about {unit[:200]!r}")
            started = started_unix(shown.props, "ActiveEnter", now_unix, now_mono)
            stale = shown.active and started is not None and mtime is not None and mtime > started
            out.append(UnitState(unit, shown.active, stale))
            unit = None
        elif word == "mtime":
            mtime = show_int(rest)
        else:
            lines.append(line)
    if unit is not None:
        raise FleetError(f"unit states: the answer for {unit[:200]!r} is cut short")
    return out


class UnitStates(FactBase[list[UnitState]]):
    """
    Whether each unit is active, and whether its files changed after it started.

    + units: ``(unit, files)`` pairs
    """

    def command(self, units: Sequence[tuple[str, Sequence[str]]]) -> str:
        return unit_states_command(units)

    def process(self, output: list[str]) -> list[UnitState]:
        return unit_states(output)
