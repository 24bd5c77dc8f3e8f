"""The vLLM releases on a host: one immutable virtual environment per release under
``<root>/releases/<id>``, and the ``current``/``previous`` links that select one.

A release counts as complete only once its marker file (written last by
``fleet.operations.vllm.release``) exists; a directory without it is a half-built release that
the next deploy removes and builds again.
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


def _link_name(target: str) -> str | None:
    """``releases/<id>`` (what our links point at) -> ``<id>``."""
    target = target.strip().rstrip("/")
    return target.rsplit("/", 1)[-1] or None if target else None


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
                result["current"] = _link_name(rest)
            elif kind == "previous":
                result["previous"] = _link_name(rest)
        result["releases"].sort(key=lambda r: (r["mtime"], r["name"]))
        return result
