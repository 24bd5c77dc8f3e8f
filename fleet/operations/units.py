"""The rendered systemd units and environment files of a host (``fleet.render.units``).

Each file is written atomically with its owner and mode (``files.atomic_file``; env files hold
the API key: root-only 0600). ``systemctl daemon-reload`` runs only when a unit file changed,
and each unit is enabled unless it already is (``installed(enable=False)`` leaves that to
``enabled``, which ``fleet deploy`` runs when it starts them). Starting and restarting is the
deploy's job (first deploy) or the rolling engine's (a fleet already serving), not this
operation's.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.facts.systemd import SystemdEnabled

from fleet.operations.files import Commands, atomic_file
from fleet.render.units import RenderedFile

UNIT_SUFFIXES = (".service", ".socket", ".timer", ".target", ".path", ".mount")


def unit_names(files: Sequence[RenderedFile]) -> list[str]:
    """The systemd units among ``files`` (their file names)."""
    return [f.path.rsplit("/", 1)[1] for f in files if f.path.endswith(UNIT_SUFFIXES)]


@operation()
def installed(files: Sequence[RenderedFile], enable: bool = True) -> Commands:
    """
    Write ``files`` (root-owned, their own modes), reload systemd if a unit changed, enable units.

    + files: the host's rendered files
    + enable: enable the units (``WantedBy=``) so they start at boot
    """
    unit_changed = file_changed = False
    for f in files:
        commands = list(atomic_file._inner(path=f.path, content=f.content, mode=f.mode))
        file_changed = file_changed or bool(commands)
        unit_changed = unit_changed or (bool(commands) and f.path.endswith(UNIT_SUFFIXES))
        yield from commands
    if unit_changed:
        yield "systemctl daemon-reload"
    todo = _not_enabled(unit_names(files)) if enable else []
    if todo:
        yield shlex.join(["systemctl", "enable", *todo])
    elif not file_changed:
        host.noop("units up to date" + (" and enabled" if enable else ""))


def _not_enabled(units: Sequence[str]) -> list[str]:
    """Those of ``units`` that are not enabled (asked of these units only, not every unit on the host)."""
    enabled = host.get_fact(SystemdEnabled, services=list(units)) if units else {}
    return [u for u in units if not enabled.get(u)]


@operation()
def enabled(units: Sequence[str]) -> Commands:
    """
    Enable ``units`` (``WantedBy=``: they start at boot) unless they are.

    + units: unit names
    """
    todo = _not_enabled(units)
    if todo:
        yield shlex.join(["systemctl", "enable", *todo])
    else:
        host.noop("units enabled")
