"""The rendered systemd units and environment files of a host (``fleet.render.units``).

Each file is written atomically with its owner and mode (``files.write_many_command``; env files
hold the API key: root-only 0600). A unit that changed is enabled (again), and each unit is
enabled unless it already is; ``systemctl enable`` reloads systemd's configuration itself
(systemctl(1): ``--no-reload`` "do not implicitly reload daemon configuration"), so
``systemctl daemon-reload`` runs only when a unit changed and nothing is enabled
(``installed(enable=False)`` leaves enabling to ``enabled``, which ``fleet deploy`` runs when it
starts them). Starting and restarting the vLLM units is the deploy's job (first deploy) or the
rolling engine's (a fleet already serving), not this operation's; ``restart`` is for units such
as the GPU watcher, restarted whenever their files change.

Every fact is read before the operation's one command (the files, then enable or reload, then
any restart, each only once the one before succeeded): ``fleet deploy`` reads them in one round
trip (``fleet.deploy.factcache``), where a read after a command would be one of its own. Whether
a unit is enabled is so read before its file is written: a changed unit is therefore enabled
whatever that read said (its new ``[Install]`` section may differ from the one read).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from fleet.facts.batch import FactRequest
from fleet.operations.files import Commands, Wanted, file_requests, files_plan, joined, read_together
from fleet.render.units import RenderedFile

UNIT_SUFFIXES = (".service", ".socket", ".timer", ".target", ".path", ".mount")


def unit_names(files: Sequence[RenderedFile]) -> list[str]:
    """The systemd units among ``files`` (their file names)."""
    return [f.path.rsplit("/", 1)[1] for f in files if f.path.endswith(UNIT_SUFFIXES)]


@operation()
def installed(files: Sequence[RenderedFile], enable: bool = True, restart: Sequence[str] = ()) -> Commands:
    """
    Write ``files`` (root-owned, their own modes), reload systemd if a unit changed, enable units.

    + files: the host's rendered files
    + enable: enable the units (``WantedBy=``) so they start at boot
    + restart: units to restart when any of ``files`` changed, else to start unless running
    """
    wanted = [Wanted(f.path, f.content, f.mode) for f in files]
    names = unit_names(files)
    asked = file_requests(wanted)
    if enable and names:
        asked.append(FactRequest(SystemdEnabled, {"services": names}))
    if restart:
        asked.append(FactRequest(SystemdStatus, {"services": list(restart)}))
    values = read_together(asked)  # every fact before the first command: each read after one is a round trip
    n_files = 2 * len(wanted)
    plan = files_plan(wanted, values[:n_files])
    changed_units = [n for f, n in zip(_units(files), names, strict=True) if f.path in plan.changed]
    parts, stdin = plan.commands()
    todo: list[str] = []
    if enable:
        is_enabled: dict[str, bool] = values[n_files] if names else {}
        # a changed unit is enabled (again): ``systemctl enable`` reloads systemd itself
        todo = [n for n in names if n in changed_units or not is_enabled.get(n)]
    if todo:
        parts.append(shlex.join(["systemctl", "enable", *todo]))
    elif changed_units:
        parts.append("systemctl daemon-reload")
    if restart:
        running = values[-1]
        if plan.changed:
            parts.append(shlex.join(["systemctl", "restart", *restart]))
        elif any(not running.get(u) for u in restart):
            parts.append(shlex.join(["systemctl", "start", *[u for u in restart if not running.get(u)]]))
    if not parts:
        host.noop("units up to date" + (" and enabled" if enable else "") + (" and running" if restart else ""))
        return
    yield joined(parts, stdin)


def _units(files: Sequence[RenderedFile]) -> list[RenderedFile]:
    return [f for f in files if f.path.endswith(UNIT_SUFFIXES)]


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
