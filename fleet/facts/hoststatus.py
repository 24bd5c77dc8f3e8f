"""What ``fleet status`` reads from a host over SSH, in one command: the vLLM units and release
(:class:`fleet.facts.units.VllmUnits`), the NVML probe (:class:`fleet.facts.nvml.NvmlProbe`) and,
given the units' cache, what it holds (:mod:`fleet.facts.hub`'s listing, the one ``fleet prune``
reads, without the unit and revision words prune keeps by).

The commands run one after the other in the same shell, separated by marker lines, so a host
costs one SSH connection and one round trip. A probe that fails (no NVML, unreadable answer) or a
listing that fails (no passwordless ``sudo``, no ``python3``) leaves the units readable: its error
is kept next to them. The listing's exit status is printed after it (the command as a whole exits
0 whatever the listing did), with its error output folded into its part of the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyinfra.api.facts import FactBase
from typing_extensions import override

from fleet.errors import FleetError
from fleet.facts.hostfacts import HostFacts, parse_probe_output
from fleet.facts.hub import HubListing, listing_command, parse_listing
from fleet.facts.nvml import CODE_CACHE, probe_command
from fleet.facts.output import answer_line
from fleet.facts.units import DEFAULT_ROOT, UnitsDict, process_units, units_command

SEPARATOR = "----FLEET-STATUS-NVML----"
HUB_SEPARATOR = "----FLEET-STATUS-HUB----"
HUB_EXIT = "----FLEET-STATUS-HUB-EXIT "  #: followed by the listing's exit status


@dataclass(frozen=True)
class HostStatus:
    units: UnitsDict
    gpus: HostFacts | None
    gpu_error: str | None  #: why ``gpus`` is missing
    models: HubListing | None = None  #: what the units' cache holds (None: not asked, or unreadable)
    models_error: str | None = None  #: why ``models`` is missing when it was asked for


def split_output(output: list[str]) -> tuple[list[str], list[str]]:
    """(units part, probe part) of the combined output (pure); the listing's part, when there is
    one, is not in the probe part (:func:`split_hub`)."""
    if SEPARATOR in output:
        i = output.index(SEPARATOR)
        return output[:i], split_hub(output[i + 1 :])[0]
    return output, []


def split_hub(output: list[str]) -> tuple[list[str], list[str] | None]:
    """(probe part, listing part) of what follows the NVML separator; ``None``: no listing asked."""
    if HUB_SEPARATOR in output:
        i = output.index(HUB_SEPARATOR)
        return output[:i], output[i + 1 :]
    return output, None


def read_listing(part: list[str]) -> tuple[HubListing | None, str | None]:
    """The listing's part of the answer: (listing, None) or (None, why not) (pure)."""
    lines = [line for line in part if line.strip()]
    code = next((line[len(HUB_EXIT) :].strip() for line in reversed(lines) if line.startswith(HUB_EXIT)), None)
    said = [line for line in lines if not line.startswith(HUB_EXIT)]
    if code is None:
        return None, "the model cache listing was cut off: " + (" ".join(said)[-300:] or "no answer")
    if code != "0":
        return None, f"listing the model cache exited {code}: " + (" ".join(said)[-300:] or "no output")
    try:
        return parse_listing(answer_line(said)), None
    except FleetError as exc:
        return None, str(exc)


class HostStatusProbe(FactBase[HostStatus]):
    """
    ``VllmUnits`` and ``NvmlProbe`` of a host through one command.

    + root: where fleet's vLLM releases live
    + python: the interpreter that runs the probe, Python 3.6+ (default: the current release's, else ``python3``)
    + hub: the units' ``<HF_HOME>/hub`` to list as root (default: not listed)
    """

    @override
    def command(self, root: str = DEFAULT_ROOT, python: str | None = None, hub: str | None = None) -> str:
        command = f"{{ {units_command(root)}; }}; echo {SEPARATOR}; {probe_command(python, CODE_CACHE)}"
        if hub is None:
            return command
        listing = listing_command(hub, revisions="", units="", errors_to_stdout=True)
        return f"{command}echo {HUB_SEPARATOR}; {listing}echo {HUB_EXIT}$?\n"

    @override
    def process(self, output: list[str]) -> HostStatus:
        i = output.index(SEPARATOR) if SEPARATOR in output else len(output)
        units_part = output[:i]
        probe_part, hub_part = split_hub(output[i + 1 :])
        units = process_units(units_part)
        models, models_error = read_listing(hub_part) if hub_part is not None else (None, None)
        if not probe_part:
            return HostStatus(units, None, "the NVML probe printed nothing", models, models_error)
        try:
            facts = parse_probe_output(probe_part)
        except FleetError as exc:
            return HostStatus(units, None, str(exc), models, models_error)
        if not facts.ok:
            why = f"NVML: {facts.status}: {facts.error_message or facts.error_class}"
            return HostStatus(units, facts, why, models, models_error)
        return HostStatus(units, facts, None, models, models_error)
