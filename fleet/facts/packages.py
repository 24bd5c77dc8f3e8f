"""Facts about installed Debian packages and what the host needs after installing them.

``DebPackageStates`` reads dpkg's own database (``dpkg-query``), including whether a package is
held (``apt-mark hold`` sets dpkg's selection to ``hold``, dpkg-query(1) ``${Status}``).
``RebootRequired`` reads the Debian/Ubuntu convention ``/var/run/reboot-required`` (and the
``.pkgs`` list naming the packages that asked for it), which package maintainer scripts write.
"""

from __future__ import annotations

from typing import TypedDict

from pyinfra.api.facts import FactBase
from typing_extensions import override


class DebPackageState(TypedDict):
    version: str
    held: bool


class DebPackageStates(FactBase[dict[str, DebPackageState]]):
    """
    Installed packages with their versions and hold state:

    .. code:: python

        {"nvidia-driver": {"version": "580.95.05-1", "held": True}}
    """

    @override
    def requires_command(self) -> str:
        return "dpkg-query"

    @override
    def command(self) -> str:
        return "dpkg-query --show --showformat='${Package}\\t${Version}\\t${Status}\\n'"

    @staticmethod
    @override
    def default() -> dict[str, DebPackageState]:
        return {}

    @override
    def process(self, output: list[str]) -> dict[str, DebPackageState]:
        packages: dict[str, DebPackageState] = {}
        for line in output:
            parts = line.split("\t")
            if len(parts) != 3:
                continue
            name, version, status = parts
            words = status.split()
            # "<want> <error> <status>": installed only when the status word is "installed".
            if len(words) == 3 and words[2] == "installed":
                packages[name] = {"version": version, "held": words[0] == "hold"}
        return packages


class RebootRequired(FactBase[list[str] | None]):
    """
    ``None`` when the host does not need a reboot; otherwise the packages that asked for one
    (possibly an empty list when the file names none).
    """

    @override
    def command(self) -> str:
        return (
            "if [ -e /var/run/reboot-required ]; then echo reboot-required; "
            "cat /var/run/reboot-required.pkgs 2>/dev/null || true; fi"
        )

    @override
    def process(self, output: list[str]) -> list[str] | None:
        if not output or output[0].strip() != "reboot-required":
            return None
        return sorted({line.strip() for line in output[1:] if line.strip()})
