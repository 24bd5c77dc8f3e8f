"""The configuration revisions of a host's vLLM instances (``fleet.render.revision``): which one is
live (the id of the unit and env file in place now), which are stored, whether the unit runs, and
the interpreter its main process runs (``fleet.facts.releases``: the release the instance runs).

Systemd is asked once for all of the host's units (``systemctl show -p Id,ActiveState,MainPID
UNIT...``, read by ``fleet.facts.systemctl_show``; a unit's ``ActiveState`` is what ``systemctl
is-active`` prints for it): a no-change deploy reads this fact on every host, and each
``systemctl`` costs the host ~5 ms of CPU.

Needs root: env files and the revision store are root-only (pyinfra runs facts under ``sudo``
with ``fleet deploy``'s config, ``--sudo`` on the plain CLI).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Protocol, TypedDict

from pyinfra.api.facts import FactBase
from typing_extensions import override

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.releases import PID_EXE_SH
from fleet.facts.systemctl_show import show_blocks, shown_unit

#: Where configuration revisions live on a host (``fleet.render.revision`` names and writes them):
#: ``<ROOT>/<instance>/<id>/{unit,env,revision.json}``.
ROOT = "/etc/fleet/revisions"
META = "revision.json"
UNIT = "unit"
ENV = "env"
ID_LENGTH = 16
#: Prints the id of the live pair ``$U`` ``$E`` (shell variables set by the caller): the first
#: ``ID_LENGTH`` characters of their sha256, cut by the shell itself (POSIX ``${h%"$t"}``, ``$t``
#: what follows them) rather than by one more process (``cut``).
LIVE_ID_SH = (
    f'cat -- "$U" "$E" | sha256sum | {{ read -r h _; t=${{h#{"?" * ID_LENGTH}}}; printf \'%s\\n\' "${{h%"$t"}}"; }}'
)


class _File(Protocol):
    @property
    def path(self) -> str: ...


class _Revision(Protocol):
    """What the fact needs of a ``fleet.render.revision.Revision``."""

    @property
    def instance(self) -> str: ...
    @property
    def unit(self) -> _File: ...
    @property
    def env(self) -> _File: ...


class StoredRevision(TypedDict):
    id: str
    mtime: int


class InstanceRevision(TypedDict):
    state: str  #: the unit's ``ActiveState`` (what ``systemctl is-active`` prints): active, inactive...
    live: str | None  #: id of the files in place; None when either is missing
    stored: list[StoredRevision]
    exe: str | None  #: the interpreter of the unit's main process (``releases.running_release``)


#: ``(instance, unit name, unit file path, env file path)``
Instance = tuple[str, str, str, str]


#: The properties the fact reads of each unit (one ``systemctl show`` for all of a host's units).
_PROPS = "Id,ActiveState,MainPID"


def revisions_command(instances: Sequence[Instance], root: str = ROOT) -> str:
    """One ``systemctl show`` for every unit (``show <instances>``, its blocks in the units' order,
    ``end``), the interpreter of each main process (``exe <pid> <path>``), then per instance its
    live id and stored revisions (``live``/``stored`` lines)."""
    if not instances:
        return "true"
    units = " ".join(shlex.quote(unit) for _name, unit, _u, _e in instances)
    parts = [
        f"s=$(systemctl show -p {_PROPS} -- {units} 2>/dev/null)",
        f"printf '%s\\n' {shlex.quote('show ' + ' '.join(n for n, *_ in instances))} \"$s\" end",
        "set -f",  # the words of $s are not patterns
        f'for w in $s; do case $w in MainPID=[1-9]*) pid=${{w#MainPID=}}; echo "exe $pid $({PID_EXE_SH})";; esac; done',
        "set +f",
    ]
    for name, _unit, unit_path, env_path in instances:
        n, q = shlex.quote(name), shlex.quote(f"{root}/{name}")
        parts.append(
            f"U={shlex.quote(unit_path)}; E={shlex.quote(env_path)}; "
            f'if [ -f "$U" ] && [ -f "$E" ]; then echo "live {name} $({LIVE_ID_SH})"; fi; '
            f'for d in {q}/*/; do [ -f "${{d}}{META}" ] || continue; d=${{d%/}}; '
            f'echo "stored {n} $(stat -c %Y "$d") ${{d##*/}}"; done'
        )
    return "; ".join(parts) + "; true"


class InstanceRevisions(FactBase[dict[str, InstanceRevision]]):
    """
    Per instance: its unit's state, the live revision and the stored ones (oldest first).

    + instances: ``(instance, unit, unit file, env file)`` tuples
    + root: the revision store
    """

    @override
    def command(self, instances: Sequence[Instance], root: str = ROOT) -> str:
        return revisions_command(instances, root)

    @staticmethod
    @override
    def default() -> dict[str, InstanceRevision]:
        return {}

    @override
    def process(self, output: list[str]) -> dict[str, InstanceRevision]:
        return parse_revisions(output)


class InstanceRevisionsAsRoot(InstanceRevisions):
    """``InstanceRevisions`` for a caller that runs commands as the SSH user, not under pyinfra's
    sudo (``fleet.facts.runner.run_fact_on_hosts``): the same command under ``sudo -n``."""

    @override
    def command(self, instances: Sequence[Instance], root: str = ROOT) -> str:
        return ssh_command(["sudo", "-n", "sh", "-c", revisions_command(instances, root)])


def parse_revisions(output: Sequence[str]) -> dict[str, InstanceRevision]:
    """The fact's output (:func:`revisions_command`) -> per instance its revisions; the format
    before one ``systemctl show`` for all units (``state``/``runs`` lines per instance) too."""
    out: dict[str, InstanceRevision] = {}
    shown: list[str] | None = None  # the instances of the ``show`` section being read
    blocks: list[str] = []
    main_pids: dict[str, int | None] = {}
    exes: dict[int, str | None] = {}

    def entry(name: str) -> InstanceRevision:
        return out.setdefault(name, {"state": "unknown", "live": None, "stored": [], "exe": None})

    for line in output:
        if shown is not None:
            if line != "end":
                blocks.append(line)
                continue
            units = show_blocks(blocks)
            for i, name in enumerate(shown):
                unit = shown_unit(units[i]) if len(units) == len(shown) else None
                found = entry(name)
                if unit is not None:
                    found["state"] = unit.active_state or "unknown"
                    main_pids[name] = unit.main_pid
            shown = None
            continue
        words = line.split()
        if not words:
            continue
        kind, name = words[0], words[1] if len(words) > 1 else ""
        if kind == "show":
            shown, blocks = words[1:], []
        elif kind == "exe" and name.isdigit():
            exes[int(name)] = line.split(" ", 2)[2].strip() or None if len(words) > 2 else None
        elif kind == "state":
            entry(name)["state"] = words[2] if len(words) > 2 else "unknown"
        elif kind == "runs":
            entry(name)["exe"] = line.split(" ", 2)[2].strip() or None if len(words) > 2 else None
        elif kind == "live" and len(words) == 3:
            entry(name)["live"] = words[2]
        elif kind == "stored" and len(words) == 4 and words[2].isdigit():
            entry(name)["stored"].append({"id": words[3], "mtime": int(words[2])})
        else:
            raise FleetError(f"configuration revisions: unreadable line {line[:200]!r}")
    if shown is not None:
        raise FleetError("configuration revisions: the units' states are cut short")
    for name, pid in main_pids.items():
        out[name]["exe"] = exes.get(pid) if pid else None
    for found in out.values():
        found["stored"].sort(key=lambda s: (s["mtime"], s["id"]))
    return out


def fact_instances(revisions: Sequence[_Revision]) -> tuple[Instance, ...]:
    """The fact's argument for these revisions (one definition, so every caller hits pyinfra's cache)."""
    return tuple((r.instance, f"fleet-{r.instance}.service", r.unit.path, r.env.path) for r in revisions)
