"""The vLLM releases on a host: one immutable virtual environment per release under
``<root>/releases/<id>``, and the ``current``/``previous`` links that select one.

A release counts as complete only once its marker file (written last by
``fleet.operations.vllm.release``) exists; a directory without it is a half-built release that
the next deploy removes and builds again.

What release an *instance* runs is one definition here, read the same way by the rolling engine
(``fleet.rollout.ssh_executor``), ``fleet status`` (``fleet.facts.units``) and ``fleet deploy``
(``fleet.facts.revisions``): a running instance runs the release its process was started from,
the interpreter in ``/proc/<MainPID>/cmdline`` (the ``vllm`` console script's shebang names the
release's own venv, ``<root>/releases/<id>/bin/python``, as pip writes it: ``main_exe_sh`` for one
unit, ``PID_EXE_SH`` for a ``MainPID`` already read, ``release_from_exe``); a stopped one will run
what ``current`` names (``running_release``). The ``current`` link alone cannot say it: it is one
per host, so after a canary (or a halted rollout) it names a release some of the host's
instances do not run.
"""

from __future__ import annotations

import shlex
from typing import TypedDict

from pyinfra.api.facts import FactBase
from typing_extensions import override

MARKER = ".fleet-release.json"


class ReleaseInfo(TypedDict):
    name: str
    mtime: int
    complete: bool


class ReleasesDict(TypedDict):
    releases: list[ReleaseInfo]  #: oldest first
    current: str | None
    previous: str | None


def release_of(link_target: str) -> str | None:
    """``releases/<id>`` (what our links point at) -> ``<id>``; None for no link."""
    target = link_target.strip().rstrip("/")
    return target.rsplit("/", 1)[-1] or None if target else None


def release_from_exe(exe: str, root: str) -> str | None:
    """``<root>/releases/<id>/bin/python3`` -> ``<id>``; None for a path outside ``<root>/releases``."""
    prefix = root.rstrip("/") + "/releases/"
    if not exe.startswith(prefix):
        return None
    release = exe[len(prefix) :].split("/", 1)[0]
    return release or None


def running_release(exe: str | None, current: str | None, root: str) -> str | None:
    """The release an instance runs (see the module docstring): the release of its main process's
    interpreter ``exe`` (``main_exe_sh``'s answer: None or empty when the unit has no main
    process); otherwise (stopped, or an interpreter outside ``<root>/releases``) ``current``, the
    release its unit starts next."""
    return release_from_exe(exe or "", root) or current


#: Shell that prints the first word of the command line of process ``$pid`` (its interpreter),
#: nothing when there is no such process.
PID_EXE_SH = 'tr "\\000" "\\n" < /proc/$pid/cmdline 2>/dev/null | head -n 1'


def main_exe_sh(unit: str) -> str:
    """Shell that prints the first word of the command line of ``unit``'s main process (its
    interpreter), nothing when it has none. ``unit`` is a shell word (quoted, or ``"$1"``)."""
    return (
        f"pid=$(systemctl show -p MainPID --value -- {unit} 2>/dev/null); "
        f'if [ "${{pid:-0}}" -gt 0 ] 2>/dev/null; then {PID_EXE_SH}; fi'
    )


class VllmReleases(FactBase[ReleasesDict]):
    """
    Releases under ``root`` (oldest first) and the releases the ``current`` and ``previous``
    links name:

    .. code:: python

        {
            "releases": [{"name": "vllm-0.33.0-py3.11.2-0123abcd4567", "mtime": 1790000000,
                          "complete": True}],
            "current": "vllm-0.33.0-py3.11.2-0123abcd4567",
            "previous": None,
        }
    """

    @override
    def command(self, root: str) -> str:
        r = shlex.quote(root)
        marker = shlex.quote(MARKER)
        return (
            f'if [ -d {r}/releases ]; then for d in {r}/releases/*/; do [ -d "$d" ] || continue; '
            f'd=${{d%/}}; if [ -f "$d"/{marker} ]; then c=1; else c=0; fi; '
            f'echo "release $(stat -c %Y "$d") $c ${{d##*/}}"; done; fi; '
            f'echo "current $(readlink {r}/current 2>/dev/null)"; '
            f'echo "previous $(readlink {r}/previous 2>/dev/null)"'
        )

    @staticmethod
    @override
    def default() -> ReleasesDict:
        return {"releases": [], "current": None, "previous": None}

    @override
    def process(self, output: list[str]) -> ReleasesDict:
        result: ReleasesDict = {"releases": [], "current": None, "previous": None}
        for line in output:
            kind, _, rest = line.partition(" ")
            if kind == "release":
                parts = rest.split(" ", 2)
                if len(parts) == 3 and parts[0].isdigit():
                    result["releases"].append({"name": parts[2], "mtime": int(parts[0]), "complete": parts[1] == "1"})
            elif kind == "current":
                result["current"] = release_of(rest)
            elif kind == "previous":
                result["previous"] = release_of(rest)
        result["releases"].sort(key=lambda r: (r["mtime"], r["name"]))
        return result
