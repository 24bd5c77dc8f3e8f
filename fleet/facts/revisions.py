"""The configuration revisions of a host's vLLM instances (``fleet.render.revision``): which one is
live (the id of the unit and env file in place now), which are stored, whether the unit runs, and
the interpreter its main process runs (``fleet.facts.releases``: the release the instance runs).

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
from fleet.facts.releases import main_exe_sh

#: Where configuration revisions live on a host (``fleet.render.revision`` names and writes them):
#: ``<ROOT>/<instance>/<id>/{unit,env,revision.json}``.
ROOT = "/etc/fleet/revisions"
META = "revision.json"
UNIT = "unit"
ENV = "env"
ID_LENGTH = 16
#: Prints the id of the live pair ``$U`` ``$E`` (shell variables set by the caller).
LIVE_ID_SH = f'cat -- "$U" "$E" | sha256sum | cut -c1-{ID_LENGTH}'


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
    state: str  #: ``systemctl is-active``: active, activating, inactive, failed...
    live: str | None  #: id of the files in place; None when either is missing
    stored: list[StoredRevision]
    exe: str | None  #: the interpreter of the unit's main process (``releases.running_release``)


#: ``(instance, unit name, unit file path, env file path)``
Instance = tuple[str, str, str, str]


def revisions_command(instances: Sequence[Instance], root: str = ROOT) -> str:
    parts = []
    for name, unit, unit_path, env_path in instances:
        n, q = shlex.quote(name), shlex.quote(f"{root}/{name}")
        parts.append(
            f"U={shlex.quote(unit_path)}; E={shlex.quote(env_path)}; "
            f'echo "state {name} $(systemctl is-active -- {shlex.quote(unit)} 2>/dev/null)"; '
            f'echo "runs {name} $({main_exe_sh(shlex.quote(unit))})"; '
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
    out: dict[str, InstanceRevision] = {}
    for line in output:
        words = line.split()
        if not words:
            continue
        kind, name = words[0], words[1] if len(words) > 1 else ""
        entry = out.setdefault(name, {"state": "unknown", "live": None, "stored": [], "exe": None})
        if kind == "state":
            entry["state"] = words[2] if len(words) > 2 else "unknown"
        elif kind == "runs":
            entry["exe"] = line.split(" ", 2)[2].strip() or None if len(words) > 2 else None
        elif kind == "live" and len(words) == 3:
            entry["live"] = words[2]
        elif kind == "stored" and len(words) == 4 and words[2].isdigit():
            entry["stored"].append({"id": words[3], "mtime": int(words[2])})
        else:
            raise FleetError(f"configuration revisions: unreadable line {line[:200]!r}")
    for entry in out.values():
        entry["stored"].sort(key=lambda s: (s["mtime"], s["id"]))
    return out


def fact_instances(revisions: Sequence[_Revision]) -> tuple[Instance, ...]:
    """The fact's argument for these revisions (one definition, so every caller hits pyinfra's cache)."""
    return tuple((r.instance, f"fleet-{r.instance}.service", r.unit.path, r.env.path) for r in revisions)
