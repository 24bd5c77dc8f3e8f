"""What ``fleet status`` reads from a host over SSH, in one command: the vLLM units and release
(:class:`fleet.facts.units.VllmUnits`) and the NVML probe (:class:`fleet.facts.nvml.NvmlProbe`).

The two commands run one after the other in the same shell, separated by a marker line, so a
host costs one SSH connection and one round trip. A probe that fails (no NVML, unreadable answer)
leaves the units readable: its error is kept next to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyinfra.api.facts import FactBase
from typing_extensions import override

from fleet.errors import FleetError
from fleet.facts.hostfacts import HostFacts, parse_probe_output
from fleet.facts.nvml import probe_command
from fleet.facts.units import DEFAULT_ROOT, UnitsDict, process_units, units_command

SEPARATOR = "----FLEET-STATUS-NVML----"


@dataclass(frozen=True)
class HostStatus:
    units: UnitsDict
    gpus: HostFacts | None
    gpu_error: str | None  #: why ``gpus`` is missing


def split_output(output: list[str]) -> tuple[list[str], list[str]]:
    """(units part, probe part) of the combined output (pure)."""
    if SEPARATOR in output:
        i = output.index(SEPARATOR)
        return output[:i], output[i + 1 :]
    return output, []


class HostStatusProbe(FactBase[HostStatus]):
    """
    ``VllmUnits`` and ``NvmlProbe`` of a host through one command.

    + root: where fleet's vLLM releases live
    + python: the interpreter that runs the probe, Python 3.6+ (default: the current release's, else ``python3``)
    """

    @override
    def command(self, root: str = DEFAULT_ROOT, python: str | None = None) -> str:
        return f"{{ {units_command(root)}; }}; echo {SEPARATOR}; {probe_command(python)}"

    @override
    def process(self, output: list[str]) -> HostStatus:
        units_part, probe_part = split_output(output)
        units = process_units(units_part)
        if not probe_part:
            return HostStatus(units, None, "the NVML probe printed nothing")
        try:
            facts = parse_probe_output(probe_part)
        except FleetError as exc:
            return HostStatus(units, None, str(exc))
        if not facts.ok:
            return HostStatus(units, facts, f"NVML: {facts.status}: {facts.error_message or facts.error_class}")
        return HostStatus(units, facts, None)
