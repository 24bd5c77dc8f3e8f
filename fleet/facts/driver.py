"""Facts about the NVIDIA kernel module that is loaded now (not the one installed on disk).

``/proc/driver/nvidia/version`` is written by the loaded ``nvidia`` kernel module; its first line
names the module's version, e.g. ``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ...``
or, for the open module, ``NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05
Release Build ...`` (NVIDIA driver README, "Verifying the installation"). Installed packages of
another version with this one still loaded mean the host needs a reboot.
"""

from __future__ import annotations

import re

from pyinfra.api.facts import FactBase
from typing_extensions import override

_MODULE_VERSION = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")


def parse_module_version(text: str) -> str | None:
    """The module version in the text of ``/proc/driver/nvidia/version``, or None."""
    match = _MODULE_VERSION.search(text)
    return match.group(1) if match else None


class NvidiaKernelModule(FactBase[str | None]):
    """
    The version of the loaded NVIDIA kernel module, or ``None`` when none is loaded.
    """

    @override
    def command(self) -> str:
        return "cat /proc/driver/nvidia/version 2>/dev/null || true"

    @override
    def process(self, output: list[str]) -> str | None:
        return parse_module_version("\n".join(output))


class PythonVersion(FactBase[str | None]):
    """
    ``major.minor.micro`` of a Python interpreter on the host (default ``python3``), or ``None``.
    """

    @override
    def command(self, python: str = "python3") -> str:
        from shlex import quote

        # -E -s -S: no PYTHON* variables, user site or site module (the version is the interpreter's
        # own): a quarter less of a no-change deploy's Python start-up on the host
        program = "'import sys; print(\"%d.%d.%d\" % sys.version_info[:3])'"
        return f"{quote(python)} -E -s -S -c {program} 2>/dev/null || true"

    @override
    def process(self, output: list[str]) -> str | None:
        value = output[0].strip() if output else ""
        return value if re.fullmatch(r"\d+\.\d+\.\d+", value) else None
