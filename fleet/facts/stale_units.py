"""Which running units started before their files last changed (a restart is pending).

A deploy writes a unit's files (unit, env file, the release's ``current`` link) atomically and
restarts serving units only after preflight; if it stops in between (a refusal, a failure), the
next run finds the files unchanged yet the processes still old. This fact makes that visible
without any state kept by fleet: a unit whose ``ActiveEnterTimestamp`` (systemd, ``systemctl
show --timestamp=unix``) is older than the newest modification time (``stat -c %Y``, of the
link itself for ``current``) of its files is stale. Units that are not active are not listed.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyinfra.api.facts import FactBase

from fleet.render.escape import ssh_command


def stale_units_command(units: Sequence[tuple[str, Sequence[str]]]) -> str:
    parts = []
    for unit, files in units:
        show = ssh_command(["systemctl", "show", "--timestamp=unix", "-p", "ActiveEnterTimestamp", "--value", unit])
        active = ssh_command(["systemctl", "is-active", "--quiet", unit])
        stat = ssh_command(["stat", "-c", "%Y", *files])
        parts.append(
            f"if {active}; then t=$({show} | tr -d @); m=$({stat} 2>/dev/null | sort -n | tail -1); "
            f'[ -n "$t" ] && [ -n "$m" ] && [ "$m" -gt "$t" ] && echo {ssh_command([unit])}; fi'
        )
    return "; ".join(parts) + "; true"


class StaleUnits(FactBase[list[str]]):
    """
    Active units whose files changed after they started.

    + units: ``(unit, files)`` pairs
    """

    def command(self, units: Sequence[tuple[str, Sequence[str]]]) -> str:
        return stale_units_command(units)

    def process(self, output: list[str]) -> list[str]:
        return [line.strip() for line in output if line.strip()]
