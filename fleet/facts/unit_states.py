"""The state of a host's vLLM units: active or not, and whether a restart is pending.

A deploy writes a unit's files (unit, env file) atomically and restarts serving units only after
preflight; if it stops in between (a refusal, a failure), the next run finds the files unchanged
yet the processes still old. This fact makes that visible without any state kept by fleet: an
active unit whose ``ActiveEnterTimestamp`` (systemd, ``systemctl show --timestamp=unix``) is older
than the newest modification time (``stat -c %Y``, of a link itself) of the files given is stale.
(``fleet deploy`` gives each unit its unit and env file; the host's ``current`` link is not one
instance's file, and the release each instance runs is read from its process instead:
``fleet.facts.releases``.) One ``systemctl show`` answers for every unit (its blocks come in the
order the units were named, systemctl(1) "show"), one ``stat`` per unit for its files.
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
    """One ``systemctl show`` for every unit (``show``, its blocks in the units' order, ``end``),
    the host's clocks first (``now``) only where systemd has no ``--timestamp=unix``; then per
    unit ``begin <unit>``, the mtime of each of its files that exists, ``end``."""
    if not units:
        return "echo show; echo end"
    show = ["systemctl", "show", "-p", _PROPS, "--", *(unit for unit, _files in units)]
    unix = ssh_command([*show[:2], "--timestamp=unix", *show[2:]])
    parts = [
        f"s=$({unix} 2>/dev/null) || "
        f'{{ read -r up _ </proc/uptime; echo "now $(date +%s.%N) $up"; s=$({ssh_command(show)}); }}',
        "printf '%s\\n' show \"$s\" end",
    ]
    for unit, files in units:
        stat = ssh_command(["stat", "-c", "mtime %Y", "--", *files])
        parts.append(f"echo begin {ssh_command([unit])}; {stat} 2>/dev/null; echo end")
    return "; ".join(parts) + "; true"


def unit_states(output: Sequence[str]) -> list[UnitState]:
    """The command's output -> one ``UnitState`` per unit (pure); garbage is an error. Each unit's
    ``systemctl show`` lines come from the one ``show`` section for all units (in their order) or,
    as before it, from the unit's own ``begin``/``end`` section."""
    out: list[UnitState] = []
    now_unix = now_mono = None
    shown: list[dict[str, str]] = []  # the one show section's blocks, one per unit in order
    showing: list[str] | None = None
    unit: str | None = None
    lines: list[str] = []
    mtime: int | None = None
    for line in output:
        word, _, rest = line.partition(" ")
        if showing is not None:
            if line == "end":
                shown, showing = show_blocks(showing), None
            else:
                showing.append(line)
        elif unit is None:
            if word == "now":
                clocks = rest.split()
                try:
                    now_unix, now_mono = float(clocks[0]), float(clocks[1])
                except (IndexError, ValueError):
                    now_unix = now_mono = None
            elif line == "show":
                showing = []
            elif word == "begin" and rest:
                unit, lines, mtime = rest, [], None
            elif line.strip():
                raise FleetError(f"unit states: unreadable line {line[:200]!r}")
        elif line == "end":
            props = show_blocks(lines) if lines else shown[len(out) : len(out) + 1]
            found = shown_unit(props[0]) if props else None
            if found is None:
                raise FleetError(f"unit states: systemctl show said nothing about {unit[:200]!r}")
            started = started_unix(found.props, "ActiveEnter", now_unix, now_mono)
            stale = found.active and started is not None and mtime is not None and mtime > started
            out.append(UnitState(unit, found.active, stale))
            unit = None
        elif word == "mtime":
            got = show_int(rest)
            if got is not None:
                mtime = got if mtime is None else max(mtime, got)
        else:
            lines.append(line)
    if unit is not None or showing is not None:
        raise FleetError(f"unit states: the answer for {(unit or 'the units')[:200]!r} is cut short")
    if shown and len(shown) != len(out):
        raise FleetError(f"unit states: systemctl show answered for {len(shown)} of {len(out)} units")
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
