"""The vLLM units on a host as systemd sees them, and the release the ``current`` link selects.

One shell command per host (pyinfra fact style: ``command()`` and a pure ``process()``):

* every ``fleet-vllm-*.service`` unit file installed or unit loaded (``systemctl list-unit-files``
  and ``systemctl list-units --all``), then ``systemctl show`` of each: ``ActiveState``,
  ``SubState``, ``NRestarts``, ``MainPID``, ``ExecMainStartTimestamp`` and
  ``ActiveEnterTimestamp`` (``--timestamp=unix``: ``@<seconds>``, systemd >= 248) with their
  ``...Monotonic`` twins (microseconds of CLOCK_MONOTONIC) as a fallback for older systemd
  (systemd.exec(5), org.freedesktop.systemd1(5) "Properties");
* the host's clocks now (``date +%s.%N`` and ``/proc/uptime``), so uptime needs no clock sync
  between the control machine and the host;
* ``readlink <root>/current`` and the release's marker file (``.fleet-release.json``, written last
  by ``fleet.operations.vllm.release``: it names the vLLM version), or, for a release without a
  marker, ``<root>/current/bin/vllm --version``;
* per unit, the interpreter of its main process (``/proc/<MainPID>/cmdline``) and the marker of
  the release that interpreter belongs to: the release each instance *runs*
  (``fleet.facts.releases.running_release``, the one definition the rolling engine reads too),
  which after a canary or a halted rollout is not what ``current`` names.

Reading unit properties needs no privileges, so the fact runs as the SSH login user.

**Example:**

.. code:: python

    units = host.get_fact(VllmUnits)
    units["units"]["fleet-vllm-0.service"]["active_state"], units["vllm_version"]
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from typing import TypedDict

from pyinfra.api.facts import FactBase
from typing_extensions import override

from fleet.facts.releases import MARKER, main_exe_sh, release_from_exe, running_release
from fleet.facts.systemctl_show import ShownUnit, show_blocks, show_int, show_unix, shown_unit

DEFAULT_ROOT = "/opt/fleet/vllm"
#: systemd units that are ours (``fleet-vllm-<n>.service``): a GPU they hold is released when we
#: restart them (the planner counts their memory as free, preflight lets them hold GPUs).
OUR_UNIT_PREFIX = "fleet-vllm-"
UNIT_GLOB = f"{OUR_UNIT_PREFIX}*.service"
_UNIT = re.compile(r"^fleet-vllm-\d{1,4}\.service$")
_PROPS = (
    "Id",
    "LoadState",
    "ActiveState",
    "SubState",
    "NRestarts",
    "MainPID",
    "ExecMainStartTimestamp",
    "ExecMainStartTimestampMonotonic",
    "ActiveEnterTimestamp",
    "ActiveEnterTimestampMonotonic",
)


class UnitInfo(TypedDict):
    load_state: str | None
    active_state: str | None
    sub_state: str | None
    restarts: int | None
    main_pid: int | None
    uptime_seconds: float | None  #: since the main process started (active units only)
    exe: str | None  #: the main process's interpreter (None: no main process, or not read)
    release: str | None  #: the release the instance runs (``running_release``)
    vllm_version: str | None  #: that release's vLLM version, from its marker (None: not read)


class UnitsDict(TypedDict):
    units: dict[str, UnitInfo]  #: by unit name
    current: str | None  #: what ``<root>/current`` points at, as the link says
    release: str | None  #: the release id (last path element of ``current``)
    vllm_version: str | None  #: from the release marker, else ``vllm --version``


_EXE = main_exe_sh('"$u"')  #: the interpreter of the main process of unit ``$u`` (the loop below)


def units_command(root: str = DEFAULT_ROOT) -> str:
    r = shlex.quote(root)
    glob = shlex.quote(UNIT_GLOB)
    props = ",".join(_PROPS)
    return (
        'echo "now $(date +%s.%N) $(cut -d" " -f1 /proc/uptime)"; '
        f'echo "current $(readlink {r}/current 2>/dev/null)"; '
        f"if [ -f {r}/current/{MARKER} ]; then "
        f'echo "marker $(tr -d "\\n" < {r}/current/{MARKER})"; '
        f'elif [ -x {r}/current/bin/vllm ]; then echo "version $(timeout 20 {r}/current/bin/vllm --version 2>/dev/null '
        f'| tail -n1)"; fi; '
        f"printf 'root %s\\n' {r}; "
        f"for u in $( {{ systemctl list-unit-files --no-legend --plain {glob} 2>/dev/null; "
        f"systemctl list-units --all --no-legend --plain {glob} 2>/dev/null; }} | cut -d' ' -f1 | sort -u); do "
        f'{{ systemctl show --timestamp=unix -p {props} "$u" 2>/dev/null '
        f'|| systemctl show -p {props} "$u"; }} | sed "s/^/unit /"; '
        f'exe=$({_EXE}); printf "exe %s %s\\n" "$u" "$exe"; '
        f"case $exe in {r}/releases/*/*) rel=${{exe#{r}/releases/}}; rel=${{rel%%/*}}; "
        f'[ -f {r}/releases/"$rel"/{MARKER} ] && printf "exe-marker %s %s\\n" "$u" '
        f'"$(head -c 4096 {r}/releases/"$rel"/{MARKER} | tr -d "\\n")";; esac; echo "unit end"; done'
    )


def unit_uptime(props: Mapping[str, str], now_unix: float | None, now_monotonic: float | None) -> float | None:
    """Seconds since the unit's main process started (else since it became active); pure.

    ``None`` when the unit is not active or no timestamp can be read.
    """
    if props.get("ActiveState") not in ("active", "reloading", "deactivating"):
        return None
    for name in ("ExecMainStartTimestamp", "ActiveEnterTimestamp"):
        started = show_unix(props.get(name))
        if started is not None and now_unix is not None:
            return max(0.0, now_unix - started)
        mono = show_int(props.get(name + "Monotonic"))
        if mono and now_monotonic is not None:
            return max(0.0, now_monotonic - mono / 1e6)
    return None


def _unit(shown: ShownUnit, now_unix: float | None, now_mono: float | None) -> UnitInfo:
    return {
        "load_state": shown.load_state,
        "active_state": shown.active_state,
        "sub_state": shown.sub_state,
        "restarts": shown.n_restarts,
        "main_pid": shown.main_pid,
        "uptime_seconds": unit_uptime(shown.props, now_unix, now_mono),
        "exe": None,
        "release": None,
        "vllm_version": None,
    }


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _marker_version(text: str) -> str | None:
    """The ``vllm_version`` of a release marker's JSON; None when it is not one."""
    try:
        marker = json.loads(text)
    except ValueError:
        return None
    if isinstance(marker, dict) and isinstance(marker.get("vllm_version"), str):
        return str(marker["vllm_version"])[:64]
    return None


def process_units(output: list[str]) -> UnitsDict:
    """Parse the command's output (pure; unknown lines are ignored)."""
    result: UnitsDict = {"units": {}, "current": None, "release": None, "vllm_version": None}
    now_unix = now_mono = None
    root = DEFAULT_ROOT
    shown: list[str] = []  # the ``systemctl show`` lines, "end" as the empty line between units
    exes: dict[str, str] = {}  # unit -> its main process's interpreter
    versions: dict[str, str] = {}  # unit -> the vLLM version of the release that interpreter is in
    for line in output:
        kind, _, rest = line.partition(" ")
        if kind == "now":
            parts = rest.split()
            now_unix = _float(parts[0]) if parts else None
            now_mono = _float(parts[1]) if len(parts) > 1 else None
        elif kind == "current":
            link = rest.strip().rstrip("/")
            result["current"] = link or None
            result["release"] = link.rsplit("/", 1)[-1] if link else None
        elif kind == "marker":
            result["vllm_version"] = _marker_version(rest) or result["vllm_version"]
        elif kind == "version" and rest.strip():
            result["vllm_version"] = rest.strip().split()[-1][:64]
        elif kind == "root" and rest.strip():
            root = rest.strip()
        elif kind == "exe":
            name, _, path = rest.partition(" ")
            if path.strip():
                exes[name] = path.strip()
        elif kind == "exe-marker":
            name, _, text = rest.partition(" ")
            version = _marker_version(text)
            if version is not None:
                versions[name] = version
        elif kind == "unit":
            shown.append("" if rest == "end" else rest)
    for block in show_blocks(shown):
        unit = shown_unit(block)
        if unit is not None and unit.id is not None and _UNIT.match(unit.id):
            info = _unit(unit, now_unix, now_mono)
            exe: str | None = exes.get(unit.id) if unit.main_pid else None
            info["exe"] = exe
            info["release"] = running_release(exe, result["release"], root)
            runs_its_own = exe is not None and release_from_exe(exe, root) is not None
            info["vllm_version"] = versions.get(unit.id) if runs_its_own else result["vllm_version"]
            result["units"][unit.id] = info
    return result


class VllmUnits(FactBase[UnitsDict]):
    """
    The ``fleet-vllm-*.service`` units of a host (state, restarts, uptime, main PID) and the
    vLLM release ``<root>/current`` selects:

    .. code:: python

        {
            "units": {"fleet-vllm-0.service": {"load_state": "loaded", "active_state": "active",
                      "sub_state": "running", "restarts": 0, "main_pid": 4242,
                      "uptime_seconds": 3600.5}},
            "current": "releases/vllm-0.33.0-py3.11.2-0123abcd4567",
            "release": "vllm-0.33.0-py3.11.2-0123abcd4567",
            "vllm_version": "0.33.0",
        }

    + root: where fleet's vLLM releases live (default ``/opt/fleet/vllm``)
    """

    @override
    def command(self, root: str = DEFAULT_ROOT) -> str:
        return units_command(root)

    @staticmethod
    @override
    def default() -> UnitsDict:
        return {"units": {}, "current": None, "release": None, "vllm_version": None}

    @override
    def process(self, output: list[str]) -> UnitsDict:
        return process_units(output)
